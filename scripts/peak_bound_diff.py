"""Where the forward under a peak bound differs from the unbounded one, bit for bit: the count of
differing outputs, the largest difference, and the batch elements, rows i and columns j they lie
in (ranges), for the outer-first path at (B,S,N,C,H,D) = (2 or 1,256,512,24,32,128), where a bound
of 1.1x takes blocks of rows and columns and no parts of s.

    python scripts/peak_bound_diff.py
"""
import os

import torch

import flashopm
from flashopm.testing import PARAM_ORDER, Shape, make_problem


def ranges(values):
    """Sorted distinct values as [first, last] runs: the first 20, and how many there are."""
    runs = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return runs[:20], len(runs)

def run(shape, normalization, env):
    """The op without and with FLASHOPM_PEAK_BOUND=1.1 (twice), under the settings `env`."""
    x, m, p = make_problem(shape, "masked_positions", seed=22)
    xc, mc = x.cuda(), m.cuda()
    pc = {k: v.cuda() for k, v in p.items()}

    def call():
        return flashopm.outer_product_mean(xc, mc, *(pc[k] for k in PARAM_ORDER), algorithm="outer",
                                           normalization=normalization)

    os.environ.update(env)
    try:
        unbounded = call()
        os.environ["FLASHOPM_PEAK_BOUND"] = "1.1"
        bounded, again = call(), call()
    finally:
        os.environ.pop("FLASHOPM_PEAK_BOUND", None)
        for k in env:
            os.environ.pop(k, None)
    torch.cuda.synchronize()
    differ = unbounded != bounded
    diff = (unbounded - bounded).abs().nan_to_num(1e30)
    print(shape, normalization, env, "NaN", int(bounded.isnan().sum()), "differ", int(differ.sum()), "of",
          differ.numel(), "largest", float(diff.max()),
          "normwise", float((unbounded - bounded).norm() / unbounded.norm()),
          "repeat same bits", bool(torch.equal(bounded, again)), flush=True)
    if differ.any():
        where = differ.any(-1).nonzero()
        print("  batch elements", sorted(set(where[:, 0].tolist())))
        print("  rows i", ranges(where[:, 1].tolist()))
        print("  columns j", ranges(where[:, 2].tolist()))


if __name__ == "__main__":
    flashopm.load()
    shape = Shape(2, 256, 512, 24, 32, 128)
    run(shape, "row", {})
    run(shape, "openfold", {})
    run(shape, "row", {"FLASHOPM_TC_FORM": "mma_sync"})
    run(Shape(1, 256, 512, 24, 32, 128), "row", {})
