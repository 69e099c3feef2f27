"""Runs the fused backward of the contraction a few times at one shape, for a profiler to attach to.

    ncu --kernel-name regex:opm_bwd python scripts/profile_backward.py [B,S,N,H,D] [0|1 (precision)]
"""
import sys

import torch

import flashopm
from flashopm.ops import outer_contract_backward_op

B, S, N, H, D = map(int, (sys.argv[1] if len(sys.argv) > 1 else "1,128,256,32,128").split(","))
precision = int(sys.argv[2]) if len(sys.argv) > 2 else 0
flashopm.load()
gen = torch.Generator().manual_seed(0)
a, b = (torch.randn(B, S, N, H, generator=gen).cuda() for _ in range(2))
w = (torch.randn(D, H * H, generator=gen) / H).cuda()
g = torch.randn(B, N, N, D, generator=gen).cuda()
for _ in range(3):
    outer_contract_backward_op(g, a, b, w, True, True, precision)
torch.cuda.synchronize()
