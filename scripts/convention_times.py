"""Time of the tensor-core outer-first path per normalisation convention at one shape (CUDA
events, mean of 5 calls after 2 warm-up calls), for comparing the epilogues' cost; also the
target of `ncu --kernel-name regex:opm_outer_tc` runs.

    python scripts/convention_times.py row openfold boltz
"""
import sys

import torch

import flashopm
from flashopm.testing import Shape, make_problem

flashopm.load()
sh = Shape(1, 512, 384, 256, 32, 128)
x, m, p = make_problem(sh, "masked_positions", seed=0)
x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
for norm in sys.argv[1:]:
    for _ in range(2):
        flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"], p["b_out"], algorithm="outer", normalization=norm)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(5):
        flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"], p["b_out"], algorithm="outer", normalization=norm)
    ev[1].record(); ev[1].synchronize()
    print(norm, f"{ev[0].elapsed_time(ev[1]) / 5:.3f} ms", flush=True)
