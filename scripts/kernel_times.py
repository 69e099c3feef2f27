"""Where the GPU time goes: a training step (forward + backward through torch.autograd.grad) or a
forward call of flashopm and of eager PyTorch under torch.profiler, one table of kernels per
implementation and shape (time per call, launches per call), and the call's wall time next to the
sum of its kernels.  PRECISION=high (or medium) sets PyTorch's float32 matmul precision for both.
    usage: python scripts/kernel_times.py {training,forward} {float32,bfloat16} [B,S,N,C,H,D ...]"""
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.reference import Model
from flashopm.testing import Shape, make_problem

STEPS = 5


def _step(model, x, m, g, mode):
    if mode == "forward":
        return lambda: model(x, m)
    leaves = [x, *model.parameters()]
    return lambda: torch.autograd.grad(model(x, m), leaves, g)


def wall_us(step, steps=STEPS, warmup=3, sync_each=False):
    """Wall time per call of `step` (after `warmup` calls), with a synchronize after every call or
    only after the last."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e6


def _report(name, step):
    wall = wall_us(step)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / STEPS
    launches = sum(e.count for e in rows) / STEPS
    print(f"  {name}: wall {wall:.0f} us per call, kernels {total:.0f} us, {launches:.0f} launches")
    for e in rows[:14]:
        print(f"    {e.device_time_total / STEPS:9.1f} us  x{e.count / STEPS:4.1f}  {e.key[:100]}")


def main(report=_report, default_shapes=(Shape(2, 8, 32, 64, 32, 64), Shape(1, 128, 256, 256, 32, 128))):
    """report(name, step) for eager and flashopm at each shape of the command line."""
    flashopm.load()
    mode, dtype = sys.argv[1], getattr(torch, sys.argv[2])
    torch.set_float32_matmul_precision(os.environ.get("PRECISION", "highest"))
    shapes = [Shape(*(int(v) for v in s.split(","))) for s in sys.argv[3:]] or list(default_shapes)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {mode}, {dtype}, "
          f"{torch.get_float32_matmul_precision()}")
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
            report("eager", _step(ref, x, m, g, mode))
            report("flashopm", _step(new, x, m, g, mode))


if __name__ == "__main__":
    main()
