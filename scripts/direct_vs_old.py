"""Host time of the backward op and of a training step at one shape: the direct backward (temporaries
in two allocations, the contractions launched from C++) against the tensor-per-temporary form
(FLASHOPM_BACKWARD_DIRECT=0), in alternation within one process (the
kernels read the switches on every call), each call timed from an idle GPU.
    usage: python scripts/direct_vs_old.py [B,S,N,C,H,D]      (default: the specification's shape)"""
import os
import statistics
import sys
import time

import torch

import flashopm
from flashopm.bench import warm_gpu
from flashopm.ops import FOLLOW_PYTORCH, outer_product_mean_backward_op
from flashopm.testing import Shape, make_problem

FORMS = {"direct": {"FLASHOPM_BACKWARD_DIRECT": "1"},
         "old": {"FLASHOPM_BACKWARD_DIRECT": "0"}}
ROUNDS, CALLS = 60, 20


def host_and_wall_us(fn):
    host, wall = [], []
    for _ in range(CALLS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        wall.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(host), statistics.median(wall)


def use_form(name):
    os.environ.update(FORMS[name])


def main(shape):
    flashopm.load()
    warm_gpu()
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    g = torch.randn(shape.B, shape.N, shape.N, shape.D, device="cuda")
    args = (g, x, m, p["ln_weight"], p["ln_bias"], 1e-5, p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"],
            p["b_out"], 0, 1e-3, [True] * 9, FOLLOW_PYTORCH)
    torch.manual_seed(0)
    model = flashopm.ModelNew(shape.C, shape.D, shape.H).cuda()
    xg = x.clone().requires_grad_()
    leaves = [xg, *model.parameters()]
    parts = {"backward op": lambda: outer_product_mean_backward_op(*args),
             "step": lambda: torch.autograd.grad(model(xg, m), leaves, g)}
    print(torch.cuda.get_device_name(), torch.__version__, shape)
    for part, fn in parts.items():
        times = {f: [] for f in FORMS}
        for r in range(ROUNDS):
            for form in (list(FORMS) if r % 2 == 0 else list(FORMS)[::-1]):
                use_form(form)
                fn()
                times[form].append(host_and_wall_us(fn))
        for form, t in times.items():
            print(f"{part:>12} {form:>7}: host {statistics.median(h for h, _ in t):7.1f} us  "
                  f"wall {statistics.median(w for _, w in t):7.1f} us")
        ratio = statistics.median(o[0] / d[0] for o, d in zip(times["old"], times["direct"]))
        print(f"{part:>12} host old/direct, paired median: {ratio:.3f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Shape(*map(int, args[0].split(","))) if args else Shape(2, 8, 32, 64, 32, 64))
