"""Accuracy of 3xTF32 and 1xTF32 for the outer-first contraction, emulated on the CPU.

TF32 rounding (10-bit mantissa, round to nearest, ties away) is applied to float32 bit patterns;
each emulated MMA multiplies exactly and accumulates in float32.  Prints the normwise error
against a float64 reference next to eager float32's, on a few shapes.

    PYTHONPATH=src python scripts/tf32_emulation.py
"""
import torch
import torch.nn.functional as F

from flashopm.testing import Shape, make_problem, reference, rel_error

def tf32(x):
    """x rounded to TF32 (as cvt.rna.tf32.f32 does), kept in float32."""
    i = x.float().view(torch.int32)
    i = (i + 0x1000) & ~0x1FFF
    return i.view(torch.float32)

def split(x):
    hi = tf32(x)
    return hi, tf32(x - hi)

def mm3(A, B, terms=3):
    """A (M, K) @ B (K, N) as 3xTF32 (small terms first) or 1xTF32, float32 accumulation."""
    ah, al = split(A)
    bh, bl = split(B)
    if terms == 1:
        return ah @ bh
    return (al @ bh + ah @ bl) + ah @ bh

for shape in [Shape(1, 128, 48, 64, 32, 128), Shape(1, 8, 64, 64, 32, 64), Shape(2, 1, 16, 256, 8, 16)]:
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    ref64 = reference(x, m, p, dtype=torch.float64)
    ref32 = reference(x, m, p)
    B, S, N, C, H, D = shape.B, shape.S, shape.N, shape.C, shape.H, shape.D
    xn = F.layer_norm(x, (C,), p["ln_weight"], p["ln_bias"])
    a = F.linear(xn, p["w_a"], p["b_a"]) * m[..., None]
    b = F.linear(xn, p["w_b"], p["b_b"]) * m[..., None]
    den = m.sum(1).clamp(min=1)
    for terms in (3, 1):
        outs = []
        for bb in range(B):
            A = a[bb].permute(1, 2, 0).reshape(N * H, S)      # (i,h1) x s
            Bm = b[bb].permute(0, 1, 2).reshape(S, N * H)     # s x (j,h2)
            O = mm3(A, Bm, terms).view(N, H, N, H).permute(0, 2, 1, 3).reshape(N * N, H * H)
            out = mm3(O, p["w_out"].t().contiguous(), terms).view(N, N, D) / den[bb][:, None, None] + p["b_out"]
            outs.append(out)
        out = torch.stack(outs)
        print(shape, f"{terms}xTF32 err {rel_error(out, ref64):.2e}  eager fp32 err {rel_error(ref32, ref64):.2e}")
