"""Host time of the backward op and of a training step at one shape: the direct backward (temporaries
in two allocations, the contractions launched from C++) against the tensor-per-temporary form
(FLASHOPM_BACKWARD_DIRECT=0), in alternation within one process (the op reads the switch on
every call), each call timed from an idle GPU.
    usage: python scripts/direct_vs_old.py [B,S,N,C,H,D]      (default: the specification's shape)"""
import os
import statistics
import sys
import time

import torch

import flashopm
from flashopm.bench import warm_gpu
from flashopm.testing import Shape

from step_host import StepParts

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
    sp = StepParts(shape)
    parts = {"backward op": sp.backward_op, "step": sp.step}
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
