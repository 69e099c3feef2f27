"""Time of the tensor-core outer-first path per normalisation convention at (1, 512, N, 256, 32,
128) (CUDA events, mean of 5 calls after 2 warm-up calls), for comparing the epilogues' cost; also
the target of `ncu --kernel-name regex:opm_outer_tc` runs.

    python scripts/convention_times.py [N ...] row openfold boltz      (N defaults to 384)
"""
import sys

import torch

import flashopm
from flashopm.testing import Shape, make_problem


def time_ms(x, m, p, norm, calls=5):
    def call():
        return flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"],
                                           p["b_b"], p["w_out"], p["b_out"], algorithm="outer", normalization=norm)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(calls):
        call()
    ev[1].record()
    ev[1].synchronize()
    return ev[0].elapsed_time(ev[1]) / calls


def main(sizes, norms):
    flashopm.load()
    for n in sizes:
        sh = Shape(1, 512, n, 256, 32, 128)
        x, m, p = make_problem(sh, "masked_positions", seed=0)
        x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
        times = {norm: time_ms(x, m, p, norm) for norm in norms}
        base = times.get("row")
        for norm, t in times.items():
            rel = f"  {t / base - 1:+6.1%} vs row" if base else ""
            print(f"N={n:5d} {norm:>9}: {t:8.3f} ms{rel}", flush=True)
        del x, m, p


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()] or [384]
    main(sizes, [a for a in sys.argv[1:] if not a.isdigit()])
