"""The GPU's launches of one forward call of flashopm's module, in order: each kernel's name, grid
and time, and the call's total, for each shape of the command line (FLASHOPM_ settings from the
environment, FLASHOPM_PEAK_BOUND included).
    usage: python scripts/launch_timeline.py B,S,N,C,H,D [...]"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.testing import Shape, make_problem


def timeline(shape):
    x, m, _ = make_problem(shape, "masked_positions", seed=0)
    x, m = x.cuda(), m.cuda()
    torch.manual_seed(0)
    model = flashopm.ModelNew(shape.C, shape.D, shape.H).cuda()
    with torch.no_grad():
        for _ in range(3):
            model(x, m)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(x, m)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start if events else 0
    print(f"{shape}: {len(events)} launches, {sum(e.device_time for e in events):.0f} us in kernels, "
          f"{(events[-1].time_range.end - t0) if events else 0:.0f} us first start to last end")
    for e in events:
        print(f"  {e.time_range.start - t0:9.1f} {e.device_time:8.1f} us  {e.name[:90]}")


def main():
    flashopm.load()
    for arg in sys.argv[1:]:
        timeline(Shape(*(int(v) for v in arg.split(","))))


if __name__ == "__main__":
    main()
