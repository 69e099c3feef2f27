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


def call_host_us(fn, calls=200):
    """Median time until a call returns, the GPU idle before each call (calls back to back would
    fill the launch queue and measure the GPU instead)."""
    per = []
    for _ in range(calls):
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


def main(shape):
    flashopm.load()
    warm_gpu()
    x, m, _ = make_problem(shape, "masked_positions", seed=0)
    x, m = x.cuda().requires_grad_(), m.cuda()
    torch.manual_seed(0)
    model = flashopm.ModelNew(shape.C, shape.D, shape.H).cuda()
    leaves = [x, *model.parameters()]
    g = torch.randn(shape.B, shape.N, shape.N, shape.D, device="cuda")
    out = model(x, m)
    ln, pa, pb, po = model.layer_norm, model.proj_a, model.proj_b, model.out_proj
    bwd_args = (g, x.detach(), m, ln.weight.detach(), ln.bias.detach(), ln.eps, pa.weight.detach(),
                pa.bias.detach(), pb.weight.detach(), pb.bias.detach(), po.weight.detach(), po.bias.detach(), 0,
                1e-3, [True] * 9, FOLLOW_PYTORCH)
    y_floor = x * 2.0

    def fwd_nograd():
        with torch.no_grad():
            return model(x, m)

    parts = [
        ("forward, no grad", fwd_nograd),
        ("forward, grad mode", lambda: model(x, m)),
        ("backward op alone", lambda: outer_product_mean_backward_op(*bwd_args)),
        ("autograd.grad of the forward's graph", lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)),
        ("training step", lambda: torch.autograd.grad(model(x, m), leaves, g)),
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
