"""Where a lone forward call's wall time goes at a large shape, for flashopm's module and the eager
module of the same convention, in one process: the wall as the bench CLI times it (L2 flush, a
synchronize, CUDA events around the call); a one-call CUDA graph replayed the same way (host time
removed, the cold start kept); that graph replayed back to back (neither); the host time of a
lone call; and, from the profiler over a few lone calls, the host's operators and runtime calls by
self time and each kernel's duration and the gaps before and between them.

    python scripts/lone_call_parts.py [--module openfold] [--dtype bfloat16] [B,S,N,C,H,D]
"""
import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from flashopm.__main__ import DTYPES, _models
from flashopm.bench import L2Flusher, time_wall, warm_gpu
from flashopm.testing import Shape, capture_graph, make_problem
from step_host import call_host_us


def replay_times(g, flusher, n):
    """Replays of the graph, each timed by events; after a flush and a synchronize if `flusher`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(n):
        if flusher is not None:
            flusher()
            torch.cuda.synchronize()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return statistics.median(out)


def profiled(fn, flusher, n=3):
    """The profiler over `n` lone calls: the host's operators and runtime calls by self time, and
    each call's kernels in order with the gap before each (the flush's kernel starting a call)."""
    try:
        prof_ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True)
    except TypeError:
        prof_ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    with prof_ctx as prof:
        for _ in range(n):
            flusher()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    calls, cur = [], None
    for e in ev:
        if "fill" in e.name or "FillFunctor" in e.name:
            cur = [e]
            calls.append(cur)
        elif cur is not None:
            cur.append(e)
    return table, calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="1,512,1536,256,32,128")
    ap.add_argument("--module", default="openfold")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    shape = Shape(*map(int, a.shape.split(",")))
    dtype = DTYPES[a.dtype]
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    ref, new = _models(shape, p, dtype, a.module)
    x, m = x.to("cuda", dtype), m.to("cuda", dtype)
    flusher = L2Flusher()
    warm_gpu()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.module} {a.dtype} {shape}")
    with torch.no_grad():
        for name, mod in (("flashopm", new), ("eager", ref)):
            fn = lambda: mod(x, m)  # noqa: E731
            wall = time_wall(fn, n=a.calls, warmup=2).median_us
            g, _ = capture_graph(fn)
            cold = replay_times(g, flusher, a.calls)
            warm = replay_times(g, None, a.calls)
            del g
            print(f"{name:9s} wall {wall:9.1f} us | one-call graph after a flush {cold:9.1f} | back to back "
                  f"{warm:9.1f} | host and launch {wall - cold:7.1f}, cold start {cold - warm:7.1f}")
            print(f"  host time of a lone call (to its return): {call_host_us(fn, a.calls, before=flusher):.1f} us")
            table, calls = profiled(fn, flusher)
            print(table)
            for k, call in enumerate(calls):
                flush, kernels = call[0], call[1:]
                prev_end, parts = flush.time_range.end, []
                for e in kernels:
                    parts.append(f"gap {e.time_range.start - prev_end:.0f} | {e.name[:60]} {e.device_time:.0f}")
                    prev_end = e.time_range.end
                span = (kernels[-1].time_range.end - kernels[0].time_range.start) if kernels else 0
                print(f"  call {k}: first kernel {kernels[0].time_range.start - flush.time_range.end if kernels else 0:.0f}"
                      f" us after the flush's end, first start to last end {span:.0f} us, in kernels "
                      f"{sum(e.device_time for e in kernels):.0f}")
                for line in parts:
                    print("    " + line)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
