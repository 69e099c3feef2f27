"""Host time of a training step's backward at one shape, by stage: torch.profiler with CPU activity
only (no CUPTI, so launches cost what they cost), each call from an idle GPU.  Three callables are
profiled in turn: the backward op called directly, torch.autograd.grad through a retained graph of
ModelNew's forward, and a whole step (forward + torch.autograd.grad); for each, the call's
unprofiled host time and, per call, the CPU time of the flashopm:: scopes (the ops, the backward's
stages `flashopm::backward/*` and `flashopm::outer_contract_backward/*`), of the autograd engine's
events and of the ATen operators under them.
    usage: python scripts/backward_stages.py [B,S,N,C,H,D]      (default: the specification's shape)"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.bench import warm_gpu
from flashopm.testing import Shape

from step_host import StepParts, call_host_us

CALLS = 200


def profile_rows(name, call, top=30):
    call()
    unprofiled = call_host_us(call)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(CALLS):
            torch.cuda.synchronize()
            call()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)
    print(f"\n{name}: {unprofiled:.1f} us host per call unprofiled (from an idle GPU)")
    print(f"{'total us':>9} {'self us':>8} {'calls':>6}  scope, event or operator (per call)")
    for e in rows[:top]:
        print(f"{e.cpu_time_total / CALLS:9.2f} {e.self_cpu_time_total / CALLS:8.2f} {e.count / CALLS:6.1f}  "
              f"{e.key[:100]}")


def main(shape):
    flashopm.load()
    warm_gpu()
    sp = StepParts(shape)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {shape}")
    profile_rows("backward op", sp.backward_op)
    profile_rows("autograd.grad, retained graph", sp.grad_retained)
    profile_rows("training step", sp.step)

if __name__ == "__main__":
    args = sys.argv[1:]
    main(Shape(*map(int, args[0].split(","))) if args else Shape(2, 8, 32, 64, 32, 64))
