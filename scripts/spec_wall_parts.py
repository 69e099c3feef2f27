"""Where the wall time of one forward call at the specification's shape goes, all in one process,
for an empty extension call, ModelNew and eager Model: wall per call with the L2 flushed by a write
(as the benchmark does), by a read, and not at all; a one-call CUDA graph the same ways (host time
removed, the cold start kept); two calls in one timed window (the second starts warm); after the
flush, a call of a second model in a memory pool of its own (code warm, data cold); host time per
call; GPU time per call in graphs of 20, 100 and 400 calls; and ModelNew's cold start in parts
(what is warmed between the flush and the call, in turns over several rounds).

    python scripts/spec_wall_parts.py [B,S,N,C,H,D]
"""
import statistics
import sys

import torch

import flashopm
from flashopm.bench import L2Flusher, time_graph, time_wall, warm_gpu
from flashopm.reference import Model
from flashopm.testing import Shape
from spec_paths import host_us


def timed(fn, before, n=200):
    """Median of CUDA-event time around fn(), after before() and a synchronize, in us."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        fn()
    out = []
    for _ in range(n):
        before()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return statistics.median(out)


def one_call_graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def models_and_inputs(sh, seed):
    """The reference Model and ModelNew with the same weights (from `seed`), and an input and mask."""
    torch.manual_seed(seed)
    ref = Model(sh.C, sh.D, sh.H).cuda()
    torch.manual_seed(seed)
    new = flashopm.ModelNew(sh.C, sh.D, sh.H).cuda()
    x = torch.randn(sh.B, sh.S, sh.N, sh.C, device="cuda")
    return ref, new, x, torch.ones(sh.B, sh.S, sh.N, device="cuda")


def main() -> None:
    sh = Shape(*(int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "2,8,32,64,32,64").split(",")))
    flashopm.load()
    warm_gpu()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {sh}; us per call (medians)")
    ref, new, x, m = models_and_inputs(sh, 0)
    # The second model and its inputs in a pool of their own, so that they share no page with the first's
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        ref2, new2, x2, m2 = models_and_inputs(sh, 1)
    dummy = torch.empty(1, device="cuda")
    write_flush = L2Flusher()
    read_buf = write_flush.buf
    def read_flush():
        read_buf.sum()

    def nothing():
        pass

    calls = {
        "empty call": lambda: torch.ops.flashopm._noop.default(dummy),
        "ModelNew": lambda: new(x, m),
        "eager Model": lambda: ref(x, m),
    }
    def in_pool(fn):
        def call():
            with torch.cuda.use_mem_pool(pool):
                fn()
        return call

    others = {"empty call": calls["empty call"], "ModelNew": in_pool(lambda: new2(x2, m2)),
              "eager Model": in_pool(lambda: ref2(x2, m2))}
    for name, fn in calls.items():
        other = others[name]

        def flush_then_other():
            write_flush()
            other()

        row = {
            "write-flushed": timed(fn, write_flush),
            "read-flushed": timed(fn, read_flush),
            "warm": timed(fn, nothing),
            "two calls, write-flushed": timed(lambda: (fn(), fn()), write_flush),
            "write-flushed, code warm": timed(fn, flush_then_other),
            "host": host_us(fn),
        }
        if name != "empty call":
            g = one_call_graph(fn)
            row["graph of one call, write-flushed"] = timed(g.replay, write_flush)
            row["graph of one call, warm"] = timed(g.replay, nothing)
            del g
        print(f"{name:>12}: " + "; ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    # The first call's cold start in parts, the variants in turn over several rounds: after the
    # write flush, a call without a batch (the host path warm, the kernels not run), its data read
    # back into L2 (pages and lines warm, code cold), a call of the second model (its code and the
    # host path warm, the first's data cold), or both.
    def touch_data():
        for t in (x, m, *new.parameters()):
            t.sum()

    x0, m0 = x[:0], m[:0]  # no batch: the host path of a call without its kernels

    variants = {
        "cold": write_flush,
        "host path warm": lambda: (write_flush(), new(x0, m0)),
        "data warm": lambda: (write_flush(), touch_data()),
        "code warm": lambda: (write_flush(), others["ModelNew"]()),
        "code and data warm": lambda: (write_flush(), others["ModelNew"](), touch_data()),
        "warm": nothing,
    }
    got = {k: [] for k in variants}
    for _ in range(6):
        for k, before in variants.items():
            got[k].append(timed(calls["ModelNew"], before, n=40))
    print("ModelNew wall per call by what is warm (medians of 6 rounds of 40 calls): " +
          "; ".join(f"{k} {statistics.median(v):.1f}" for k, v in got.items()), flush=True)
    # a second pass, so that drift shows
    for name, fn in calls.items():
        print(f"{name:>12} again: write-flushed {timed(fn, write_flush):.1f}; warm {timed(fn, nothing):.1f}", flush=True)
    for name in ("ModelNew", "eager Model"):
        per = {n: time_graph(calls[name], n=n).median_us for n in (20, 100, 400)}
        print(f"{name:>12}: GPU time per call in a graph of n calls: " + "; ".join(f"n={n} {v:.2f}" for n, v in per.items()))
    print(f"wall as the benchmark times it: ModelNew {time_wall(calls['ModelNew']).median_us:.1f}, eager "
          f"{time_wall(calls['eager Model']).median_us:.1f}, empty {time_wall(calls['empty call']).median_us:.1f}")


if __name__ == "__main__":
    with torch.no_grad():  # as the benchmark times a forward call
        main()
