"""Each gradient's error against float64, as a ratio to eager float32's, over several seeds of one
problem: whether a ratio past 2 is the seed's or the kernels'.

    python scripts/grad_seeds.py 2,260,13,8,32,6 --normalization boltz --no-bias --seeds 12
"""
import argparse

import torch

import flashopm
from flashopm.reference import GRAD_INPUTS
from flashopm.testing import Shape, leaf_gradients, make_problem, rel_error


def grads(x, m, p, g, names, normalization, ours):
    if ours:
        def fn(*args):
            return flashopm.outer_product_mean(*args, normalization=normalization)
    else:
        code = ("row", "openfold", "boltz").index(normalization)

        def fn(*args):
            return flashopm.outer_product_mean_reference(*args, normalization=code)
    return leaf_gradients(fn, x, m, p, g, names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="B,S,N,C,H,D")
    ap.add_argument("--normalization", default="boltz", choices=["row", "openfold", "boltz"])
    ap.add_argument("--no-bias", action="store_true")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--mask", default="masked_positions")
    a = ap.parse_args()
    shape = Shape(*map(int, a.shape.split(",")))
    worst = {}
    for seed in range(a.seeds):
        x, m, p = make_problem(shape, a.mask, seed=seed)
        if a.no_bias:
            p = {**p, "b_a": None, "b_b": None, "b_out": None}
        names = [k for k in GRAD_INPUTS if k == "msa_repr" or p[k] is not None]
        g = torch.randn(shape.B, shape.N, shape.N, shape.D, generator=torch.Generator().manual_seed(seed + 100))
        m64 = m if m.dtype == torch.bool else m.double()
        ref = grads(x.double(), m64, {k: (v.double() if v is not None else None) for k, v in p.items()}, g.double(),
                    names, a.normalization, False)
        pc = {k: (v.cuda() if v is not None else None) for k, v in p.items()}
        ours = grads(x.cuda(), m.cuda(), pc, g.cuda(), names, a.normalization, True)
        eager = grads(x.cuda(), m.cuda(), pc, g.cuda(), names, a.normalization, False)
        row = []
        for name, o, e, r in zip(names, ours, eager, ref):
            ratio = rel_error(o.cpu(), r) / max(rel_error(e.cpu(), r), 1e-30)
            worst[name] = max(worst.get(name, 0.0), ratio)
            row.append(f"{name} {ratio:5.2f}")
        print(f"seed {seed:2d}: " + "  ".join(row), flush=True)
    print("worst ratio: " + "  ".join(f"{k} {v:.2f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
