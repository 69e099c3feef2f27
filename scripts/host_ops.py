"""Where the host time of a call goes: torch.profiler's CPU table (self CPU time per operator, per
call) of a forward or a training step (forward + backward through torch.autograd.grad), for eager
PyTorch and flashopm, next to the call's wall time with a synchronize after each call.
    usage: python scripts/host_ops.py {training,forward} {float32,bfloat16} [B,S,N,C,H,D ...]"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.reference import Model
from flashopm.testing import Shape, make_problem

from kernel_times import _step

STEPS = 50


def _report(name, step):
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / STEPS * 1e6
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
            torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    cpu = sum(e.self_cpu_time_total for e in rows) / STEPS
    print(f"  {name}: wall {wall_us:.1f} us per call (synchronized), profiled self CPU {cpu:.1f} us per call")
    for e in rows[:28]:
        print(f"    {e.self_cpu_time_total / STEPS:8.2f} us self  {e.cpu_time_total / STEPS:8.2f} total"
              f"  x{e.count / STEPS:4.1f}  {e.key[:90]}")


def main():
    flashopm.load()
    mode, dtype = sys.argv[1], getattr(torch, sys.argv[2])
    shapes = [Shape(*(int(v) for v in s.split(","))) for s in sys.argv[3:]] or [Shape(2, 8, 32, 64, 32, 64)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {mode}, {dtype}")
    for shape in shapes:
        print(shape)
        x, m, _ = make_problem(shape, "masked_positions", seed=0)
        x, m = x.to("cuda", dtype).requires_grad_(mode != "forward"), m.to("cuda", dtype)
        g = torch.randn(shape.B, shape.N, shape.N, shape.D, device="cuda", dtype=dtype)
        torch.manual_seed(0)
        ref = Model(shape.C, shape.D, shape.H).to("cuda", dtype)
        torch.manual_seed(0)
        new = flashopm.ModelNew(shape.C, shape.D, shape.H).to("cuda", dtype)
        with torch.set_grad_enabled(mode != "forward"):
            _report("eager", _step(ref, x, m, g, mode))
            _report("flashopm", _step(new, x, m, g, mode))


if __name__ == "__main__":
    main()
