"""When each part of a lone forward call happens, on the host and on the GPU, for flashopm's module
at a large shape: the call timed as the bench CLI times it (L2 flush, a synchronize, then the
call), under the profiler. For each of a few calls, every host event inside the call (the op, the
allocator's and ATen's calls, each driver or runtime call) and every kernel, with its start and end
in us from the moment the module is called. The GPU idles until the first kernel that matters
starts: this shows which host work stands before it.

    python scripts/lone_call_timeline.py [--module openfold] [--dtype bfloat16] [--calls 3] [B,S,N,C,H,D]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from flashopm.__main__ import DTYPES, _models
from flashopm.bench import L2Flusher, warm_gpu
from flashopm.testing import Shape, make_problem

MARK = "lone_call"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="1,512,1536,256,32,128")
    ap.add_argument("--module", default="openfold")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    shape = Shape(*map(int, a.shape.split(",")))
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    _, new = _models(shape, p, DTYPES[a.dtype], a.module)
    x, m = x.to("cuda", DTYPES[a.dtype]), m.to("cuda", DTYPES[a.dtype])
    flusher = L2Flusher()
    warm_gpu()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.module} {a.dtype} {shape}")
    with torch.no_grad():
        for _ in range(3):
            new(x, m)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.calls):
                flusher()
                torch.cuda.synchronize()
                with record_function(MARK):
                    new(x, m)
                torch.cuda.synchronize()
    events = list(prof.events())
    marks = sorted((e for e in events if e.name == MARK and e.device_type == torch.autograd.DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    for k, mk in enumerate(marks):
        t0, t_end = mk.time_range.start, mk.time_range.end
        nxt = marks[k + 1].time_range.start if k + 1 < len(marks) else float("inf")
        rows = []
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CPU or e is mk:
                continue
            if t0 <= e.time_range.start <= t_end:
                rows.append((e.time_range.start - t0, e.time_range.end - t0, "host", e.name))
        for e in kernels:
            if t0 <= e.time_range.start < nxt and "fill" not in e.name.lower():
                rows.append((e.time_range.start - t0, e.time_range.end - t0, "GPU ", e.name))
        rows.sort()
        print(f"\ncall {k}: the module returns after {t_end - t0:.1f} us")
        for s, e, where, name in rows:
            print(f"  {s:8.1f} {e:8.1f} {e - s:8.1f}  {where}  {name[:90]}")


if __name__ == "__main__":
    main()
