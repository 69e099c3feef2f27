"""Four float32 training steps of ModelNew (forward, then torch.autograd.grad for the MSA and every
parameter) at one shape: the program scripts/ncu_backward.sh profiles the fused backward's kernels in.

    python scripts/ncu_backward_step.py B,S,N,C,H,D
"""
import sys

import torch

import flashopm

B, S, N, C, H, D = (int(v) for v in sys.argv[1].split(","))
torch.manual_seed(0)
model = flashopm.ModelNew(C, D, H).cuda()
x = torch.randn(B, S, N, C, device="cuda", requires_grad=True)
mask = (torch.rand(B, S, N, device="cuda") > 0.2).float()
g = torch.randn(B, N, N, D, device="cuda")
leaves = [x, *model.parameters()]
for _ in range(4):
    torch.autograd.grad(model(x, mask), leaves, g)
torch.cuda.synchronize()
