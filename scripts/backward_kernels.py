"""Where a training step's GPU time goes: forward + backward (torch.autograd.grad) of flashopm and of
eager PyTorch under torch.profiler, one table of kernels per implementation and shape (time per
step, launches per step), and the step's wall time next to the sum of its kernels.
    usage: python scripts/backward_kernels.py [B,S,N,C,H,D ...]"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.reference import Model
from flashopm.testing import Shape, make_problem

STEPS = 5


def _step(model, x, m, g):
    leaves = [x, *model.parameters()]
    return lambda: torch.autograd.grad(model(x, m), leaves, g)


def _report(name, step):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / STEPS * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / STEPS
    launches = sum(e.count for e in rows) / STEPS
    print(f"  {name}: wall {wall_us:.0f} us per step, kernels {total:.0f} us, {launches:.0f} launches")
    for e in rows[:14]:
        print(f"    {e.device_time_total / STEPS:9.1f} us  x{e.count / STEPS:4.1f}  {e.key[:100]}")


def main():
    flashopm.load()
    shapes = [Shape(*(int(v) for v in s.split(","))) for s in sys.argv[1:]] or [
        Shape(2, 8, 32, 64, 32, 64), Shape(1, 128, 256, 256, 32, 128)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in shapes:
        print(shape)
        x, m, _ = make_problem(shape, "masked_positions", seed=0)
        x, m = x.cuda().requires_grad_(), m.cuda()
        g = torch.randn(shape.B, shape.N, shape.N, shape.D, device="cuda")
        torch.manual_seed(0)
        ref = Model(shape.C, shape.D, shape.H).cuda()
        torch.manual_seed(0)
        new = flashopm.ModelNew(shape.C, shape.D, shape.H).cuda()
        _report("eager", _step(ref, x, m, g))
        _report("flashopm", _step(new, x, m, g))


if __name__ == "__main__":
    main()
