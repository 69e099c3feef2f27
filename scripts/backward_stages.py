"""Host time of the backward op's stages at one shape: torch.profiler with CPU activity only (no
CUPTI, so launches cost what they cost), the backward op called directly from an idle GPU; per
call, the CPU time of each flashopm:: scope (the op, its stages `flashopm::backward/*` and
`flashopm::outer_contract_backward/*`) and of the ATen operators under it, next to the call's
unprofiled host time.
    usage: python scripts/backward_stages.py [B,S,N,C,H,D]      (default: the specification's shape)"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.bench import warm_gpu
from flashopm.ops import FOLLOW_PYTORCH, outer_product_mean_backward_op
from flashopm.testing import Shape, make_problem

from step_host import call_host_us

CALLS = 200


def main(shape):
    flashopm.load()
    warm_gpu()
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    g = torch.randn(shape.B, shape.N, shape.N, shape.D, device="cuda")
    args = (g, x, m, p["ln_weight"], p["ln_bias"], 1e-5, p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"],
            p["b_out"], 0, 1e-3, [True] * 9, FOLLOW_PYTORCH)
    call = lambda: outer_product_mean_backward_op(*args)  # noqa: E731
    call()
    unprofiled = call_host_us(call)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(CALLS):
            torch.cuda.synchronize()
            call()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key.startswith(("flashopm", "aten::"))]
    rows.sort(key=lambda e: -e.cpu_time_total)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {shape}")
    print(f"backward op, unprofiled: {unprofiled:.1f} us host per call (from an idle GPU)")
    print(f"{'total us':>9} {'self us':>8} {'calls':>6}  scope or operator (per backward call)")
    for e in rows[:40]:
        print(f"{e.cpu_time_total / CALLS:9.2f} {e.self_cpu_time_total / CALLS:8.2f} {e.count / CALLS:6.1f}  {e.key[:90]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Shape(*map(int, args[0].split(","))) if args else Shape(2, 8, 32, 64, 32, 64))
