"""Host time per call (no synchronisation) of the op's stages at the specification's shape, to
locate the op's overhead over an empty extension call:

    empty call          torch.ops.flashopm._noop (one tensor argument, no work)
    B = 0               argument parsing, dispatch, checks and the output's allocation
    S = 0               the same plus one fill kernel
    single launch       the same plus the plan lookup and the cluster launch
    outer-first         two launches (prep, contraction) and a workspace instead
and, for scale, an allocation and a one-kernel ATen op.

    python scripts/host_breakdown.py
"""
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
    cases = {
        "empty call": lambda: noop(dummy),
        "B = 0": lambda: outer_product_mean_op(x[:0], m[:0], *params, 0),
        "S = 0": lambda: outer_product_mean_op(x[:, :0], m[:, :0], *params, 0),
        "single launch": lambda: outer_product_mean_op(x, m, *params, ALGORITHMS["single"]),
        "auto": lambda: outer_product_mean_op(x, m, *params, 0),
        "outer-first": lambda: outer_product_mean_op(x, m, *params, ALGORITHMS["outer"]),
        "torch.empty (B,N,N,D)": lambda: torch.empty(sh.B, sh.N, sh.N, sh.D, device="cuda"),
        "x + x (one ATen kernel)": lambda: x + x,
    }
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  shape {sh}")
    with torch.no_grad():
        for name, fn in cases.items():
            fn()
            print(f"{name:>24}: host {host_us(fn):6.2f} us")


if __name__ == "__main__":
    main()
