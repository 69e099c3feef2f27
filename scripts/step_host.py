"""Where the wall time of a small training step goes: host time (until the call returns, from an
idle GPU) and synchronised wall time of its parts at one shape, for flashopm:
the forward without and with autograd, the backward op called directly, the whole step
(forward + torch.autograd.grad), and a step of the same leaves through one trivial operation
(the floor that torch.autograd.grad and its engine set), next to the GPU time of the step's kernels.
    usage: python scripts/step_host.py [B,S,N,C,H,D]      (default: the specification's shape)"""
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.bench import warm_gpu
from flashopm.ops import FOLLOW_PYTORCH, outer_product_mean_backward_op
from flashopm.testing import Shape, make_problem


def call_host_us(fn, calls=200, before=None):
    """Median time until a call returns, the GPU idle before each call (calls back to back would
    fill the launch queue and measure the GPU instead); before(), if given, runs ahead of each
    call's synchronize (an L2 flush, as the wall is timed)."""
    per = []
    for _ in range(calls):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        per.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per)


def wall_us(fn, calls=300):
    per = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(per)


def kernels_us(fn, steps=20):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in rows) / steps, sum(e.count for e in rows) / steps


class StepParts:
    """A training step at `shape` on CUDA and its parts: ModelNew (seed 0), x (requiring grad) and
    the mask from make_problem, a random gradient g of the output; `backward_op` calls the backward
    op directly on the model's parameters, `grad_retained` torch.autograd.grad through one retained
    graph of the forward, `step` the whole step (forward + torch.autograd.grad)."""

    def __init__(self, shape):
        x, m, _ = make_problem(shape, "masked_positions", seed=0)
        self.x, self.m = x.cuda().requires_grad_(), m.cuda()
        torch.manual_seed(0)
        self.model = flashopm.ModelNew(shape.C, shape.D, shape.H).cuda()
        self.leaves = [self.x, *self.model.parameters()]
        self.g = torch.randn(shape.B, shape.N, shape.N, shape.D, device="cuda")
        self.out = self.model(self.x, self.m)
        ln, pa, pb, po = self.model.layer_norm, self.model.proj_a, self.model.proj_b, self.model.out_proj
        self.backward_args = (self.g, self.x.detach(), self.m, ln.weight.detach(), ln.bias.detach(), ln.eps,
                              pa.weight.detach(), pa.bias.detach(), pb.weight.detach(), pb.bias.detach(),
                              po.weight.detach(), po.bias.detach(), 0, 1e-3, [True] * 9, FOLLOW_PYTORCH)

    def backward_op(self):
        return outer_product_mean_backward_op(*self.backward_args)

    def grad_retained(self):
        return torch.autograd.grad(self.out, self.leaves, self.g, retain_graph=True)

    def step(self):
        return torch.autograd.grad(self.model(self.x, self.m), self.leaves, self.g)


def main(shape):
    flashopm.load()
    warm_gpu()
    sp = StepParts(shape)
    model, x, m = sp.model, sp.x, sp.m
    y_floor = x * 2.0

    def fwd_nograd():
        with torch.no_grad():
            return model(x, m)

    parts = [
        ("forward, no grad", fwd_nograd),
        ("forward, grad mode", lambda: model(x, m)),
        ("backward op alone", sp.backward_op),
        ("autograd.grad of the forward's graph", sp.grad_retained),
        ("training step", sp.step),
        ("floor: autograd.grad of x * 2", lambda: torch.autograd.grad(y_floor, [x], y_floor, retain_graph=True)),
    ]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {shape}")
    print(f"{'':>38}  {'host us':>8}  {'wall us':>8}  {'kernels us':>10}  launches")
    for name, fn in parts:
        fn()
        h, w = call_host_us(fn), wall_us(fn)
        k, n = kernels_us(fn)
        print(f"{name:>38}  {h:8.1f}  {w:8.1f}  {k:10.1f}  {n:6.1f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Shape(*map(int, args[0].split(","))) if args else Shape(2, 8, 32, 64, 32, 64))
