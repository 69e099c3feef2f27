"""Accuracy of the float16 split form of "highest" for the outer-first contraction, emulated on
the CPU (the spec's row normalisation).

Each operand block is scaled by 2^e (its largest magnitude into [2^14, 2^15), e clamped to
[-113, MAX]) and split into float16 high and low parts; a and b per residue, W per output column,
O by the bound |sum_s a'b'| < S·2^30.  Products lo·hi + hi·lo + hi·hi are exact (float64) and
summed in float64 within a stage (32 s in phase 1, 64 k in phase 2: the zeroed accumulators),
each stage's sum rounded to float32 and added in float32.  The tensor core's own truncation inside
a stage is not modelled.  Prints the normwise error against a float64 reference next to eager
float32's, for the cases of test_float16_split_form, with MAX = 60 and 126.

    PYTHONPATH=src python scripts/f16_split_emulation.py
"""
import math

import torch

from flashopm.reference import masked_projections, output_divisor
from flashopm.testing import Shape, make_problem, reference, rel_error

TOP = 14


def scale_exp(m: torch.Tensor, max_exp: int) -> torch.Tensor:
    """Exponents e with m·2^e in [2^14, 2^15), clamped; 0 where m is 0 or not finite."""
    e = TOP - torch.floor(torch.log2(m.double().clamp(min=1e-300)))
    e = e.clamp(-113, max_exp)
    return torch.where((m > 0) & m.isfinite(), e, torch.zeros_like(e)).to(torch.int64)


def split16(x: torch.Tensor, e: torch.Tensor):
    """Scaled x as float16 (hi, lo), returned in float64."""
    xs = (x.double() * torch.exp2(e.double())).float()
    hi = xs.half()
    lo = (xs - hi.float()).half()
    return hi.double(), lo.double()


def staged_sum(terms: torch.Tensor, stage: int) -> torch.Tensor:
    """Sum over the last dim: float64 within stages of `stage`, float32 between them."""
    acc = torch.zeros(terms.shape[:-1], dtype=torch.float32)
    for k0 in range(0, terms.shape[-1], stage):
        acc = acc + terms[..., k0:k0 + stage].sum(-1).float()
    return acc


def split_form(x, m, p, max_exp: int) -> torch.Tensor:
    a, b = masked_projections(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"])
    B, S, N, H = a.shape
    D = p["w_out"].shape[0]
    ea = scale_exp(a.abs().amax(dim=(1, 3)), max_exp)  # (B, N)
    eb = scale_exp(b.abs().amax(dim=(1, 3)), max_exp)
    ah, al = split16(a, ea[:, None, :, None])
    bh, bl = split16(b, eb[:, None, :, None])
    # phase 1: (B, i, j, h1, h2, s) products, staged over s
    def outer(x, y):
        return torch.einsum("bsip,bsjq->bijpqs", x, y)
    acc = staged_sum(outer(al, bh) + outer(ah, bl) + outer(ah, bh), 32)  # (B, N, N, H, H) float32
    o_exp = -(TOP + 1) - math.ceil(math.log2(max(S, 1)))
    o = acc * 2.0 ** o_exp
    k = torch.zeros_like(o, dtype=torch.int64)
    oh, ol = split16(o.reshape(B, N, N, H * H), k.reshape(B, N, N, H * H))
    w = p["w_out"]
    ew = scale_exp(w.abs().amax(dim=1), max_exp)  # (D)
    wh, wl = split16(w, ew[:, None])
    prods = (torch.einsum("bijk,dk->bijdk", ol, wh) + torch.einsum("bijk,dk->bijdk", oh, wl)
             + torch.einsum("bijk,dk->bijdk", oh, wh))
    acc2 = staged_sum(prods, 64).double()  # (B, N, N, D)
    e_out = -o_exp - ea[:, :, None, None] - eb[:, None, :, None] - ew[None, None, None, :]
    out = (acc2 * torch.exp2(e_out.double())).float()
    den = output_divisor(m, m, 0, 1e-3)
    return out / den + p["b_out"]


def problem(shape, case, seed):
    x, m, p = make_problem(shape, "masked_positions", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if case == "mask_range":
        m = (m * 10.0 ** torch.randint(-6, 2, (shape.B, 1, shape.N), generator=g).float()
             * 10.0 ** torch.randint(-3, 1, (shape.B, shape.S, 1), generator=g).float())
    elif case == "outliers":
        x = x.clone()
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 500),), generator=g)
        x.view(-1)[idx] *= 1e4
    elif case == "large_weights":
        p = {k: (v * 1e3 if k in ("w_a", "w_b", "w_out") else v) for k, v in p.items()}
    elif case == "small_weights":
        p = {k: (v * 1e-4 if k in ("w_a", "b_a", "w_b", "b_b") else v * 1e-8 if k == "b_out" else v)
             for k, v in p.items()}
    elif case == "tiny":
        p = {k: (v * 1e-20 if k in ("w_a", "b_a", "b_out") else v) for k, v in p.items()}
    elif case == "column_range":
        p = dict(p)
        p["w_out"] = p["w_out"] * 10.0 ** torch.randint(-5, 3, (shape.D, 1), generator=g).float()
    return x, m, p


def main() -> None:
    shapes = [Shape(1, 77, 12, 24, 32, 16), Shape(1, 300, 10, 16, 16, 20), Shape(2, 9, 16, 8, 8, 33)]
    cases = ["plain", "mask_range", "outliers", "large_weights", "small_weights", "tiny", "column_range"]
    print(f"{'shape':28s} {'case':14s} {'eager fp32':>10s} {'split(60)':>10s} {'split(126)':>10s}")
    for shape in shapes:
        for case in cases:
            x, m, p = problem(shape, case, seed=7)
            ref64 = reference(x, m, p, dtype=torch.float64)
            eager = rel_error(reference(x, m, p), ref64)
            errs = [rel_error(split_form(x, m, p, mx), ref64) for mx in (60, 126)]
            print(f"{str(shape):28s} {case:14s} {eager:10.2e} {errs[0]:10.2e} {errs[1]:10.2e}", flush=True)


if __name__ == "__main__":
    main()
