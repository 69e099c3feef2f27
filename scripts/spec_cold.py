"""Spec shape: wall time per call with and without an L2 flush between calls, next to the graph
(GPU) time and an empty extension call, to separate the cold-cache start from the kernel's work.

    python scripts/spec_cold.py [B,S,N,C,H,D]
"""
import sys

import torch

import flashopm
from flashopm.bench import time_graph, time_wall, warm_gpu
from flashopm.testing import Shape, make_problem

shape = Shape(*(int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "2,8,32,64,32,64").split(",")))
flashopm._build.load()
warm_gpu()
x, m, p = make_problem(shape, "masked_positions", seed=0)
x, m = x.cuda(), m.cuda()
model = flashopm.ModelNew(shape.C, shape.D, shape.H).cuda()
dummy = torch.empty(1, device="cuda")
noop = lambda: torch.ops.flashopm._noop.default(dummy)  # noqa: E731
call = lambda: model(x, m)  # noqa: E731
with torch.no_grad():
    for name, fn in (("empty call", noop), ("ModelNew", call)):
        cold = time_wall(fn, n=200, flush_l2=True)
        warm = time_wall(fn, n=200, flush_l2=False)
        print(f"{name:>11}: wall {cold.median_us:7.1f} us (L2 flushed), {warm.median_us:7.1f} us (L2 warm)")
    print(f"   ModelNew: GPU {time_graph(call, n=50).median_us:7.1f} us (graph)")
