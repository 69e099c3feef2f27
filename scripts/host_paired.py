"""Host time of ModelNew's forward (through the extension's modules entry, its op entry and
torch.ops; with the kernels launched through the driver, the default, or through the runtime) and
of the op through the op entry against torch.ops, timed in alternation (batches of calls back to
back, A then B, many times), so that both sides meet the same host; the median of the per-pair
ratios is the figure, as host time on the GPU machine drifts by tens of percent between blocks of
calls.

    python scripts/host_paired.py [B,S,N,C,H,D]      (default: the specification's shape)
"""
import os
import statistics
import sys
import time

import torch

import flashopm
import flashopm._build
from flashopm.bench import warm_gpu
from flashopm.ops import outer_product_mean_op
from flashopm.reference import Model
from flashopm.testing import Shape, make_problem


def batch_us(fn, calls):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def paired(fa, fb, calls=20, pairs=300):
    fa(), fb()
    ta, tb = [], []
    for _ in range(pairs):
        ta.append(batch_us(fa, calls))
        tb.append(batch_us(fb, calls))
    ratio = statistics.median(b / a for a, b in zip(ta, tb))
    return statistics.median(ta), statistics.median(tb), ratio


def main(shape):
    flashopm._build.load()
    warm_gpu()
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    torch.manual_seed(0)
    new = flashopm.ModelNew(shape.C, shape.D, shape.H).cuda()
    ref = Model(shape.C, shape.D, shape.H).cuda()
    entry = flashopm._build.op_entry
    declining = lambda *a: NotImplemented  # noqa: E731
    args = (x, m, p["ln_weight"], p["ln_bias"], 1e-5, p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"], p["b_out"], 0)
    dummy = torch.empty(1, device="cuda")
    noop = torch.ops.flashopm._noop.default

    modules_entry = flashopm._build.modules_entry

    def new_via_op_entry():
        # ModelNew with its parameters collected in Python (its path before the modules entry)
        flashopm._build.modules_entry = declining
        try:
            return new(x, m)
        finally:
            flashopm._build.modules_entry = modules_entry

    def new_via_torch_ops():
        flashopm._build.op_entry = flashopm._build.modules_entry = declining
        try:
            return new(x, m)
        finally:
            flashopm._build.op_entry, flashopm._build.modules_entry = entry, modules_entry

    driver_launch = flashopm._build.extension().driver_launch

    def new_by_runtime_launches():
        # the same call with the kernels launched through the runtime's cudaLaunchKernelEx
        driver_launch(False)
        try:
            return new(x, m)
        finally:
            driver_launch(True)

    def new_with_env(var, value):
        # ModelNew with an environment switch set; both sides of a pair pay for setting it
        def call():
            os.environ[var] = value
            return new(x, m)
        return call

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {shape}")
    print(f"{'A':>22} {'B':>24}   host us A   host us B   B / A (median of pairs)")
    with torch.no_grad():
        for (na, fa), (nb, fb) in (
            (("op, direct entry", lambda: entry(*args)), ("op, torch.ops", lambda: outer_product_mean_op(*args))),
            (("ModelNew", lambda: new(x, m)), ("ModelNew via the op entry", new_via_op_entry)),
            (("ModelNew", lambda: new(x, m)), ("ModelNew via torch.ops", new_via_torch_ops)),
            (("ModelNew", lambda: new(x, m)), ("ModelNew, runtime launches", new_by_runtime_launches)),
            (("empty call", lambda: noop(dummy)), ("ModelNew", lambda: new(x, m))),
            (("ModelNew", lambda: new(x, m)), ("eager Model", lambda: ref(x, m))),
            # the projections launched as the previous kernel's programmatic dependent (the default)
            # or in plain stream order
            (("ModelNew, PREP_PDL=1", new_with_env("FLASHOPM_PREP_PDL", "1")),
             ("ModelNew, PREP_PDL=0", new_with_env("FLASHOPM_PREP_PDL", "0"))),
            # the chained form in one cooperative launch or in two
            (("ModelNew, F16_FUSED=1", new_with_env("FLASHOPM_SMALL_F16_FUSED", "1")),
             ("ModelNew, F16_FUSED=0", new_with_env("FLASHOPM_SMALL_F16_FUSED", "0"))),
            # the launches as one graph launch (the default) or as kernel launches
            (("ModelNew, GRAPH_LAUNCH=1", new_with_env("FLASHOPM_GRAPH_LAUNCH", "1")),
             ("ModelNew, GRAPH_LAUNCH=0", new_with_env("FLASHOPM_GRAPH_LAUNCH", "0"))),
        ):
            a, b, r = paired(fa, fb)
            print(f"{na:>22} {nb:>24}   {a:9.2f}   {b:9.2f}   {r:6.3f}")
    os.environ.pop("FLASHOPM_PREP_PDL", None)
    os.environ.pop("FLASHOPM_SMALL_F16_FUSED", None)
    os.environ.pop("FLASHOPM_GRAPH_LAUNCH", None)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Shape(*map(int, args[0].split(","))) if args else Shape(2, 8, 32, 64, 32, 64))
