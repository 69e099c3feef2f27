"""Runs the outer-first contraction a few times at one shape, for a profiler to attach to.

    ncu --kernel-name regex:opm_outer python scripts/profile_outer.py [B,S,N,C,H,D] [outer|outer-fma] [highest|high]
"""
import sys

import torch

import flashopm
from flashopm.testing import Shape, make_problem

shape = Shape(*map(int, (sys.argv[1] if len(sys.argv) > 1 else "1,256,384,64,32,128").split(",")))
algorithm = sys.argv[2] if len(sys.argv) > 2 else "outer"
precision = sys.argv[3] if len(sys.argv) > 3 else "highest"
x, m, p = make_problem(shape, "masked_positions", seed=0)
x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
for _ in range(3):
    flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"],
                                p["w_out"], p["b_out"], algorithm=algorithm, precision=precision)
torch.cuda.synchronize()
