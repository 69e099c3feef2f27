"""Accuracy of a float16 split form for the fused backward's GEMMs with scales per chunk of K,
emulated on the CPU: the design NOTES.md's "Sketch: the backward in the float16 split form"
proposes for "highest" on wgmma.

A GEMM C = A·B over K is cut into chunks of `chunk` k.  In each chunk, A is scaled per row (its
largest magnitude in the chunk into [2^14, 2^15)) and B once for the chunk, per column over the
whole of K (whose factor is applied at the end) or per (column, chunk), each split into float16
high and low parts; the products lo·hi + hi·lo + hi·hi are exact (float64) and summed in float64 within the
chunk (the zeroed accumulator), rounded to float32, multiplied by the chunk's inverse scales and
added to the float32 sums (one FFMA per element at each retirement).  The tensor core's own
truncation inside a chunk is not modelled, unless --cuda runs each chunk's products as one float16
GEMM on the GPU.  For the side kernel's two GEMMs (dO = g·W over d, then
grad_a = dO·b over (j, h2)) and the W kernel's (O = a·b over s, then grad_W = gᵀ·O over pairs),
prints the normwise error against float64 next to eager float32's (CPU matmul), overall and for
the worst output column, with g and the weights at unit scale and at scales far apart, a third of
W's columns scaled down by up to 1e-6 and a fifth of b's columns zero; then with residues masked
by fractions far apart, B per column as given and with the K index's scale moved into B.

    PYTHONPATH=src python scripts/f16_split_backward_emulation.py [--cuda]
"""
import sys

import torch
from f16_split_emulation import scale_exp, split16  # the forward's emulation: the same scaling and split

CUDA = "--cuda" in sys.argv


def chunk_exponents(amax: torch.Tensor) -> torch.Tensor:
    """e with amax·2^e in [2^14, 2^15) (float64); 0 where amax is 0."""
    return scale_exp(amax, 126).double()


def chunk_products(al, ah, bh, bl) -> torch.Tensor:
    """lo·hi + hi·lo + hi·hi of one chunk in float32: exact products summed in float64 on the CPU;
    with --cuda, one float16 GEMM over the three products' K on the GPU's tensor cores with float32
    accumulation (cuBLAS), which adds their own rounding inside the chunk."""
    if CUDA:
        x = torch.cat([al, ah, ah], 1).half().cuda()
        y = torch.cat([bh, bl, bh], 0).half().cuda()
        return torch.mm(x, y, out_dtype=torch.float32).cpu()
    return (al @ bh + ah @ bl + ah @ bh).float()


def split_gemm(a: torch.Tensor, b: torch.Tensor, chunk: int, b_scales: str) -> torch.Tensor:
    """a (M, K) float32, b (K, N) float32 -> (M, N) float32 in the chunked split form: A scaled per
    (row, chunk); B (b_scales) once per chunk ("chunk"), per column over the whole of K ("column",
    a factor applied once at the end), or per (column, chunk) ("column-chunk": each retirement's
    factor then differs per element)."""
    M, K = a.shape
    acc = torch.zeros(M, b.shape[1], dtype=torch.float32)
    eb_col = chunk_exponents(b.abs().amax(dim=0))[None, :] if b_scales == "column" else None
    for k0 in range(0, K, chunk):
        ac, bc = a[:, k0:k0 + chunk], b[k0:k0 + chunk]
        ea = chunk_exponents(ac.abs().amax(dim=1))[:, None]  # per row of A
        eb = {"column": eb_col, "chunk": chunk_exponents(bc.abs().amax()),
              "column-chunk": chunk_exponents(bc.abs().amax(dim=0))[None, :]}[b_scales]
        ah, al = split16(ac, ea)
        bh, bl = split16(bc, eb)
        part = chunk_products(al, ah, bh, bl)                 # the chunk's zeroed accumulator
        acc = acc + part * torch.exp2(-(ea if b_scales == "column" else ea + eb)).float()
    return (acc.double() * torch.exp2(-eb_col)).float() if b_scales == "column" else acc


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def worst_column(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest normwise error of one output column (columns of small magnitude show what one
    scale for B's whole chunk costs them)."""
    return float(((x.double() - ref).norm(dim=0) / ref.norm(dim=0).clamp(min=1e-300)).max())


def report(name: str, a: torch.Tensor, b: torch.Tensor, chunk: int) -> None:
    ref = a.double() @ b.double()
    eager = a @ b
    line = f"  {name:28s} K={a.shape[1]:5d}  eager {rel(eager, ref):.2e} (worst column {worst_column(eager, ref):.2e})"
    for scales in ("chunk", "column", "column-chunk"):
        ours = split_gemm(a, b, chunk, scales)
        line += f";  B per {scales}: {rel(ours, ref):.2e} ({worst_column(ours, ref):.2e})"
    print(line)


def report_balanced(name: str, a: torch.Tensor, b: torch.Tensor, chunk: int, k_exp: torch.Tensor) -> None:
    """As report, then B per column with each K index's power of two 2^k_exp moved from A into B
    (A·2^-k_exp, B·2^k_exp: the same product, B flat along K)."""
    ref = a.double() @ b.double()
    eager = a @ b
    a2 = (a.double() * torch.exp2(-k_exp)[None, :]).float()
    b2 = (b.double() * torch.exp2(k_exp)[:, None]).float()
    line = f"  {name:28s} K={a.shape[1]:5d}  eager {rel(eager, ref):.2e} (worst column {worst_column(eager, ref):.2e})"
    for scales in ("chunk", "column", "column-chunk"):
        ours = split_gemm(a, b, chunk, scales)
        line += f";  B per {scales}: {rel(ours, ref):.2e} ({worst_column(ours, ref):.2e})"
    moved = split_gemm(a2, b2, chunk, "column")
    print(line + f";  K's scales in B: {rel(moved, ref):.2e} ({worst_column(moved, ref):.2e})")


def masked_residues(randn, gen) -> None:
    """OpenFold's convention with residues masked by fractions 1e-6..10 (a tenth fully): a and b
    shrink with the mask, g = grad_out / (1e-3 + sum_s m_si m_sj) grows, so the K index of the two
    second GEMMs (residue j; pair (i, j)) carries magnitudes 1e12 apart in B."""
    N, S, H, D = 40, 96, 16, 64
    r = 10.0 ** (torch.rand(N, generator=gen) * 7 - 6)
    r[::10] = 0.0
    m = r[None, :] * (torch.rand(S, N, generator=gen) > 0.2).float()             # (s, residue)
    a = randn(S, N, H) * m[..., None]
    b = randn(S, N, H) * m[..., None]
    den = 1e-3 + m.t().double() @ m.double()                                     # (i, j)
    g = (randn(N, N, D).double() / den[..., None]).float()                       # (i, j, d)
    w = randn(D, H * H)
    print("masked residues (OpenFold's convention):")
    report("side 1: dO = g.W", g.reshape(N * N, D), w, 16)
    report("W 1: O = a.b over s", a.reshape(S, N * H).t().contiguous(), b.reshape(S, N * H), 16)
    dO = (g.reshape(N * N, D).double() @ w.double()).float()
    dO_rows = dO.reshape(N, N, H, H).permute(0, 2, 1, 3).reshape(N * H, N * H)   # (i, h1) x (j, h2)
    b_rows = b.reshape(S, N * H).t().contiguous()                                # (j, h2) x s
    e_j = chunk_exponents(b.abs().amax(dim=(0, 2)))                              # per residue j
    report_balanced("side 2: grad_a = dO.b", dO_rows, b_rows, 32, e_j.repeat_interleave(H))
    o = (a.reshape(S, N * H).t().double() @ b.reshape(S, N * H).double()).float()
    o_pairs = o.reshape(N, H, N, H).permute(0, 2, 1, 3).reshape(N * N, H * H)    # (i, j) x (h1, h2)
    e_pair = chunk_exponents(a.abs().amax(dim=(0, 2))[:, None] * b.abs().amax(dim=(0, 2))[None, :]).reshape(-1)
    report_balanced("W 2: grad_W = g^T.O", g.reshape(N * N, D).t().contiguous(), o_pairs, 32, e_pair)


def main() -> None:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    N, S, H, D = 48, 128, 16, 128
    for g_scale, w_scale, ab_scale in ((1.0, 1.0, 1.0), (1e-6, 30.0, 1e-3), (1e4, 1e-4, 50.0)):
        print(f"g x{g_scale:g}, W x{w_scale:g}, a and b x{ab_scale:g}:")
        g = randn(N * N, D, scale=g_scale)                    # pairs (i, j) x d
        g[::7] *= 1e-3                                        # rows of other magnitudes (masked pairs)
        w = randn(D, H * H, scale=w_scale)                    # d x (h1, h2)
        w[:, ::3] *= 10.0 ** -torch.randint(0, 7, (w[:, ::3].shape[1],), generator=gen).float()  # columns 1e-6..1
        a, b = randn(S, N * H, scale=ab_scale), randn(S, N * H, scale=ab_scale)
        b[:, ::5] = 0.0                                       # fully masked columns
        report("side 1: dO = g.W", g, w, 16)
        dO = (g.double() @ w.double()).float()                # (i, j) x (h1, h2)
        dO_rows = dO.reshape(N, N, H, H).permute(0, 2, 1, 3).reshape(N * H, N * H)  # (i, h1) x (j, h2)
        report("side 2: grad_a = dO.b", dO_rows, b.t().contiguous(), 32)
        o = (a.t().double() @ b.double()).float()             # (i, h1) x (j, h2), exact-ish
        report("W 1: O = a.b over s", a.t().contiguous(), b, 16)
        o_pairs = o.reshape(N, H, N, H).permute(0, 2, 1, 3).reshape(N * N, H * H)
        report("W 2: grad_W = g^T.O", g.t().contiguous(), o_pairs, 32)
    masked_residues(randn, gen)


if __name__ == "__main__":
    main()
