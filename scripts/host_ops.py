"""Where the host time of a call goes: torch.profiler's CPU table (self CPU time per operator, per
call) of a forward or a training step (forward + backward through torch.autograd.grad), for eager
PyTorch and flashopm, next to the call's wall time with a synchronize after each call.
    usage: python scripts/host_ops.py {training,forward} {float32,bfloat16} [B,S,N,C,H,D ...]"""
import torch
from torch.profiler import ProfilerActivity, profile

from flashopm.testing import Shape

import kernel_times

STEPS = 50


def _report(name, step):
    wall = kernel_times.wall_us(step, STEPS, warmup=20, sync_each=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
            torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    cpu = sum(e.self_cpu_time_total for e in rows) / STEPS
    print(f"  {name}: wall {wall:.1f} us per call (synchronized), profiled self CPU {cpu:.1f} us per call")
    for e in rows[:28]:
        print(f"    {e.self_cpu_time_total / STEPS:8.2f} us self  {e.cpu_time_total / STEPS:8.2f} total"
              f"  x{e.count / STEPS:4.1f}  {e.key[:90]}")


if __name__ == "__main__":
    kernel_times.main(_report, default_shapes=(Shape(2, 8, 32, 64, 32, 64),))
