"""Host time per call (no synchronisation) of the op's stages at the specification's shape, to
locate the op's overhead over an empty extension call, each through torch.ops and through the
extension's direct entry (no schema parsing):

    empty call          torch.ops.flashopm._noop (one tensor argument, no work)
    B = 0               argument parsing, dispatch, checks and the output's allocation
    S = 0               the same plus one fill kernel
    single launch       the same plus the plan lookup and the cluster launch
    auto                the default: two launches (projections, contraction) and a workspace
    auto, one launch    FLASHOPM_SMALL_TC_FUSED=1: one cooperative launch, a workspace
    outer-first         two launches (prep, contraction) and a workspace instead
and, for scale, an allocation, a one-kernel ATen op and a bare kernel launch (torch.cuda._sleep).

    python scripts/host_breakdown.py
"""
import os

import torch

import flashopm
import flashopm._build
from flashopm.bench import warm_gpu
from flashopm.ops import ALGORITHMS, outer_product_mean_op
from flashopm.testing import Shape, make_problem

from spec_paths import host_us


def main():
    flashopm._build.load()
    warm_gpu()
    sh = Shape(2, 8, 32, 64, 32, 64)
    x, m, p = make_problem(sh, "masked_positions", seed=0)
    x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    params = (p["ln_weight"], p["ln_bias"], 1e-5, p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"], p["b_out"])
    dummy = torch.empty(1, device="cuda")
    noop = torch.ops.flashopm._noop.default
    entry = flashopm._build.op_entry
    cases = {
        "B = 0": ((x[:0], m[:0], *params, 0), {}),
        "S = 0": ((x[:, :0], m[:, :0], *params, 0), {}),
        "single launch": ((x, m, *params, ALGORITHMS["single"]), {}),
        "auto": ((x, m, *params, 0), {}),
        "auto, one launch": ((x, m, *params, 0), {"FLASHOPM_SMALL_TC_FUSED": "1"}),
        "outer-first": ((x, m, *params, ALGORITHMS["outer"]), {}),
    }
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  shape {sh}")
    print(f"{'':>24}  {'torch.ops':>9}  {'entry':>9}  (host us per call)")
    with torch.no_grad():
        for name, fn in (("empty call", lambda: noop(dummy)),
                         ("torch.empty (B,N,N,D)", lambda: torch.empty(sh.B, sh.N, sh.N, sh.D, device="cuda")),
                         ("x + x (one ATen kernel)", lambda: x + x),
                         ("torch.cuda._sleep(0)", lambda: torch.cuda._sleep(0))):
            fn()
            print(f"{name:>24}: {host_us(fn):9.2f}")
        for name, (args, env) in cases.items():
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                times = []
                for fn in (lambda: outer_product_mean_op(*args), lambda: entry(*args)):
                    fn()
                    times.append(host_us(fn))
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k)
                    else:
                        os.environ[k] = v
            print(f"{name:>24}: {times[0]:9.2f}  {times[1]:9.2f}")


if __name__ == "__main__":
    main()
