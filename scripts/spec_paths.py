"""The specification's shape, path by path: GPU time of each algorithm (CUDA-graph replay), wall
time per call of ModelNew next to eager, and host time per call (no synchronisation) of the op
and of ModelNew against an empty extension call, each through the extension's direct entry and
through torch.ops.

    python scripts/spec_paths.py [shape ...]     shapes as B,S,N,C,H,D (default: the spec's)
"""
import statistics
import sys
import time

import torch

import flashopm
import flashopm._build
from flashopm.bench import time_graph, time_wall, warm_gpu
from flashopm.reference import Model
from flashopm.testing import Shape, make_problem


def host_us(fn, calls=200, repeats=15):
    """Median host time per call over batches of `calls` calls, synchronising only between batches."""
    per = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per)


def main(shapes):
    flashopm._build.load()
    warm_gpu()
    dummy = torch.empty(1, device="cuda")
    noop = lambda: torch.ops.flashopm._noop.default(dummy)  # noqa: E731
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"empty extension call: wall {time_wall(noop, n=300).median_us:.1f} us, host {host_us(noop):.2f} us")
    for shape in shapes:
        x, m, p = make_problem(shape, "masked_positions", seed=0)
        x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
        print(f"--- {shape}")
        for algorithm in ("auto", "small-tc", "single", "outer", "project", "outer-fma"):
            def call(a=algorithm):
                return flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"],
                                                   p["b_b"], p["w_out"], p["b_out"], algorithm=a)
            try:
                call()
            except RuntimeError as exc:
                print(f"{algorithm:>10}: {str(exc).splitlines()[0][:80]}")
                continue
            g = time_graph(call, n=50)
            print(f"{algorithm:>10}: GPU {g.median_us:7.2f} us (graph)")
        torch.manual_seed(0)
        ref = Model(shape.C, shape.D, shape.H).cuda()
        new = flashopm.ModelNew(shape.C, shape.D, shape.H).cuda()
        new.load_state_dict(ref.state_dict())
        op = flashopm.ops.outer_product_mean_op
        args = (x, m, p["ln_weight"], p["ln_bias"], 1e-5, p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"],
                p["b_out"], 0)
        entry = flashopm._build.op_entry

        modules_entry = flashopm._build.modules_entry

        def new_via_torch_ops():
            # ModelNew with the extension's direct entries declining every call (its path before them)
            flashopm._build.op_entry = flashopm._build.modules_entry = lambda *a: NotImplemented
            try:
                return new(x, m)
            finally:
                flashopm._build.op_entry, flashopm._build.modules_entry = entry, modules_entry

        rows = []
        for name, fn, grad in (("eager Model", lambda: ref(x, m), False), ("ModelNew", lambda: new(x, m), False),
                               ("ModelNew (grad mode)", lambda: new(x, m), True),
                               ("ModelNew via torch.ops", new_via_torch_ops, False),
                               ("op (torch.ops)", lambda: op(*args), False),
                               ("op (direct entry)", lambda: entry(*args), False)):
            with torch.set_grad_enabled(grad):
                fn()
                rows.append((name, time_wall(fn, n=300).median_us, host_us(fn)))
        for name, wall, host in rows:
            print(f"{name:>22}: wall {wall:7.1f} us   host {host:6.2f} us")
        with torch.no_grad():
            print(f"{'eager / ModelNew wall':>22}: {rows[0][1] / rows[1][1]:.2f}x;  GPU eager "
                  f"{time_graph(lambda: ref(x, m), n=20).median_us:.1f} us")


if __name__ == "__main__":
    args = sys.argv[1:]
    shapes = [Shape(*map(int, a.split(","))) for a in args] or [Shape(2, 8, 32, 64, 32, 64)]
    main(shapes)
