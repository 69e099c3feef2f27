"""Pure-PyTorch references: the specification's module and the functional form of its math.

These serve the CPU path of the op and every test. `Model` is the specification's module, unchanged;
`outer_product_mean_reference` is the same computation written with functional calls, so that
any parameters (and any floating dtype, float64 included) can be fed to it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def masked_projections(msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, ln_eps=1e-5):
    """a = (LayerNorm(x) W_a^T + b_a) * m and b likewise, (B, S, N, H) each.  float32 x with 16-bit
    parameters (a mixed-precision region) is normalised in float32, then projected in their type."""
    if msa_repr.dtype != ln_weight.dtype:
        x = F.layer_norm(msa_repr, (msa_repr.shape[-1],), ln_weight.to(msa_repr.dtype), ln_bias.to(msa_repr.dtype),
                         ln_eps).to(ln_weight.dtype)
    else:
        x = F.layer_norm(msa_repr, (msa_repr.shape[-1],), ln_weight, ln_bias, ln_eps)
    mask = msa_mask.unsqueeze(-1)
    return F.linear(x, w_a, b_a) * mask, F.linear(x, w_b, b_b) * mask


def output_divisor(mask_rows: torch.Tensor, mask_cols: torch.Tensor, normalization: int, norm_eps: float):
    """What output (i, j) is divided by, for rows i of mask_rows (B, S, Ni) and columns j of
    mask_cols (B, S, Nj) (float masks): (B, Ni, 1, 1) for the row normalisation,
    (B, Ni, Nj, 1) for the pair normalisations (see outer_product_mean_reference)."""
    if normalization == 0:
        return mask_rows.sum(1).clamp(min=1)[:, :, None, None]
    pair = torch.einsum("bsi,bsj->bij", mask_rows, mask_cols)[..., None]
    return norm_eps + pair if normalization == 1 else pair.clamp(min=1)


def rows_per_block(B: int, N: int, H: int, elems: int = 1 << 26) -> int:
    """Output rows i whose (B, rows, N, H, H) intermediate holds about `elems` elements."""
    return max(1, elems // max(1, B * N * H * H))


def backward_block_elems(grad_out: torch.Tensor) -> int:
    """Size of the backward's (B, n, N, H, H) blocks: a quarter of the output gradient, at least
    16M elements and at most 64M.  Each block lives twice at once (einsum lays it out again for its
    second contraction); below 16M elements the backward's time goes to launching its per-block
    einsums (measured on the H200: 4M-element blocks made it 1.8x slower at N = 256)."""
    return min(1 << 26, max(1 << 24, grad_out.numel() // 4))


def contract_outer_blocks(a: torch.Tensor, b: torch.Tensor, w_out: torch.Tensor,
                          chunk_elems: int = 1 << 26) -> torch.Tensor:
    """W_out vec(sum_s a[:, s, i] (x) b[:, s, j]) for a (B, S, Ni, H) and b (B, S, Nj, H), as
    (B, Ni, Nj, D), forming the (B, n, Nj, H, H) intermediate for blocks of n rows i only."""
    B, S, Ni, H = a.shape
    Nj, D = b.shape[2], w_out.shape[0]
    W = w_out.view(D, H, H)
    step = rows_per_block(B, Nj, H, chunk_elems)
    blocks = [torch.einsum("bijpq,dpq->bijd", torch.einsum("bsip,bsjq->bijpq", a[:, :, i0:i0 + step], b), W)
              for i0 in range(0, Ni, step)]
    return torch.cat(blocks, dim=1) if blocks else a.new_zeros(B, 0, Nj, D)


def contract_outer_blocks_backward(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w_out: torch.Tensor,
                                   need_ab: bool, need_w: bool, chunk_elems: int = 1 << 26):
    """Gradients of contract_outer_blocks for the output gradient g (B, Ni, Nj, D): (grad_a,
    grad_b, grad_w_out), None where not needed, with the (B, n, Nj, H, H) intermediates formed
    for blocks of n rows only:
        dO[i,j] = sum_d g[i,j,d] W[d];  grad_a[s,i] = sum_j dO[i,j] b[s,j];  grad_b[s,j] = sum_i dO[i,j]^T a[s,i]
        grad_W[d] = sum_{i,j} g[i,j,d] sum_s a[s,i] (x) b[s,j]"""
    B, S, Ni, H = a.shape
    Nj, D = b.shape[2], w_out.shape[0]
    W = w_out.view(D, H, H)
    grad_a = torch.zeros_like(a) if need_ab else None
    grad_b = torch.zeros_like(b) if need_ab else None
    grad_w = torch.zeros(D, H, H, dtype=a.dtype, device=a.device) if need_w else None
    step = rows_per_block(B, Nj, H, chunk_elems)
    for i0 in range(0, Ni if (need_ab or need_w) else 0, step):
        i1 = min(Ni, i0 + step)
        gi = g[:, i0:i1]
        if need_ab:
            d_outer = torch.einsum("bijd,dpq->bijpq", gi, W)
            grad_a[:, :, i0:i1] = torch.einsum("bijpq,bsjq->bsip", d_outer, b)
            grad_b += torch.einsum("bijpq,bsip->bsjq", d_outer, a[:, :, i0:i1])
            del d_outer
        if need_w:
            outer = torch.einsum("bsip,bsjq->bijpq", a[:, :, i0:i1], b)
            grad_w += torch.einsum("bijd,bijpq->dpq", gi, outer)
            del outer
    return grad_a, grad_b, None if grad_w is None else grad_w.reshape(D, H * H)


def outer_product_mean_rows_reference(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, row_offset: int,
                                      w_out: torch.Tensor, b_out: torch.Tensor | None, normalization: int = 0,
                                      norm_eps: float = 1e-3, chunk_elems: int = 1 << 26) -> torch.Tensor:
    """Rows i = row_offset .. row_offset + Nr of the outer-product mean, from the projections:
    a (B, S, Nr, H) of those residues, b (B, S, N, H) and mask (B, S, N) of all residues.
    Returns (B, Nr, N, D), normalised as in outer_product_mean_reference (the sharded OPM's local
    contraction)."""
    Nr = a.shape[2]
    m = mask.to(a.dtype)
    den = output_divisor(m[:, :, row_offset:row_offset + Nr], m, normalization, norm_eps)
    acc = contract_outer_blocks(a, b, w_out, chunk_elems)
    bias = 0.0 if b_out is None else b_out
    return (acc + bias) / den if normalization == 1 else acc / den + bias


ROWS_GRAD_INPUTS = ("a", "b", "w_out", "b_out")


def outer_product_mean_rows_backward_reference(grad_out, a, b, mask, row_offset, w_out, b_out, normalization=0,
                                               norm_eps=1e-3, needs=(True,) * 4, chunk_elems=1 << 26,
                                               contract_backward=None):
    """Gradients of outer_product_mean_rows_reference for ROWS_GRAD_INPUTS (None where not needed
    or where the bias is None); `contract_backward` as in outer_product_mean_backward_reference."""
    Nr = a.shape[2]
    m = mask.to(a.dtype)
    g = grad_out / output_divisor(m[:, :, row_offset:row_offset + Nr], m, normalization, norm_eps)
    need_a, need_b, need_w, need_bo = needs
    if contract_backward is not None:
        grad_a, grad_b, grad_w = contract_backward(g, a, b, w_out, need_a or need_b, need_w)
    else:
        grad_a, grad_b, grad_w = contract_outer_blocks_backward(g, a, b, w_out, need_a or need_b, need_w, chunk_elems)
    grad_bo = None
    if need_bo and b_out is not None:
        grad_bo = (g if normalization == 1 else grad_out).sum((0, 1, 2))
    return [grad_a if need_a else None, grad_b if need_b else None, grad_w, grad_bo]


def outer_product_mean_reference(
    msa_repr: torch.Tensor,
    msa_mask: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    w_a: torch.Tensor,
    b_a: torch.Tensor | None,
    w_b: torch.Tensor,
    b_b: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    ln_eps: float = 1e-5,
    normalization: int = 0,
    norm_eps: float = 1e-3,
) -> torch.Tensor:
    """Outer-product mean, materialising the (B, N, N, H*H) intermediate.

    Shapes: msa_repr (B, S, N, C), msa_mask (B, S, N), w_a/w_b (H, C), w_out (D, H*H).
    Returns (B, N, N, D), with a = (LayerNorm(x) W_a^T + b_a) * m, b likewise, and
    O[b, i, j] = vec(sum_s a[b, s, i] (x) b[b, s, j]):

        normalization 0 (the specification): out = W_out O / max(sum_s m[s, i], 1) + b_out
        normalization 1 (OpenFold, AF2):      out = (W_out O + b_out) / (norm_eps + sum_s m[s, i] m[s, j])
        normalization 2 (Boltz-1/2):          out = W_out O / max(sum_s m[s, i] m[s, j], 1) + b_out

    Each is written in its model's own order of operations.
    """
    a, b = masked_projections(msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, ln_eps)
    outer = torch.einsum("bsih,bsjk->bijhk", a, b)
    batch, n1, n2, h1, h2 = outer.shape
    if normalization == 0:
        denom = msa_mask.sum(dim=1).unsqueeze(-1).unsqueeze(-1).unsqueeze(-1).clamp(min=1)
        outer = outer / denom
        return F.linear(outer.reshape(batch, n1, n2, h1 * h2), w_out, b_out)
    m = msa_mask.to(a.dtype)
    pair = torch.einsum("bsi,bsj->bij", m, m)[..., None]  # (B, N, N, 1)
    if normalization == 1:
        return F.linear(outer.reshape(batch, n1, n2, h1 * h2), w_out, b_out) / (norm_eps + pair)
    if normalization == 2:
        return F.linear(outer.reshape(batch, n1, n2, h1 * h2) / pair.clamp(min=1), w_out, b_out)
    raise ValueError(f"flashopm: normalization must be 0, 1 or 2, got {normalization}")


GRAD_INPUTS = ("msa_repr", "ln_weight", "ln_bias", "w_a", "b_a", "w_b", "b_b", "w_out", "b_out")


def outer_product_mean_backward_reference(
    grad_out: torch.Tensor,
    msa_repr: torch.Tensor,
    msa_mask: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    w_a: torch.Tensor,
    b_a: torch.Tensor | None,
    w_b: torch.Tensor,
    b_b: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    ln_eps: float = 1e-5,
    normalization: int = 0,
    norm_eps: float = 1e-3,
    needs: tuple[bool, ...] = (True,) * 9,
    chunk_elems: int | None = None,
    contract_backward=None,
) -> list[torch.Tensor | None]:
    """Gradients of `outer_product_mean_reference` for the inputs named in GRAD_INPUTS, written out
    by hand, with the (B, n, N, H, H) intermediates formed for blocks of n output rows i only
    (about `chunk_elems` elements each, by default `backward_block_elems`), so memory stays near
    that of the output; the LayerNorm part works in place on its own temporaries.

    With g = grad_out / den (B, N, N, D), den the normalisation's divisor of output (i, j) (see
    outer_product_mean_reference), and W = w_out viewed (D, H, H):
        dO[i,j]      = sum_d g[i,j,d] W[d]                       (per block of rows i)
        grad_a[s,i]  = sum_j dO[i,j] b[s,j],   grad_b[s,j] = sum_i dO[i,j]^T a[s,i]
        grad_W[d]    = sum_{i,j} g[i,j,d] sum_s a[s,i] (x) b[s,j]
        grad_b_out   = sum_{i,j} grad_out (sum_{i,j} g where the bias is divided too: OpenFold)
    then through the mask, both projections and LayerNorm.  Entries whose `needs` flag is False
    (or whose bias is None) are None.  Sums run in float32 for half-precision inputs.
    `contract_backward(g, a, b, w_out, need_ab, need_w)` replaces contract_outer_blocks_backward for
    the three contractions (the fused CUDA kernels); it returns (grad_a, grad_b, grad_w_out).
    """
    B, S, N, C = msa_repr.shape
    H = w_a.shape[0]
    work = torch.float32 if msa_repr.dtype in (torch.float16, torch.bfloat16) else msa_repr.dtype
    x, m = msa_repr.to(work), msa_mask.to(work)
    lw, lb, wa, wb, wo = (t.to(work) for t in (ln_weight, ln_bias, w_a, w_b, w_out))
    mu = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + ln_eps)
    xhat = (x - mu) * rstd
    xn = xhat * lw + lb
    a = F.linear(xn, wa, None if b_a is None else b_a.to(work)) * m[..., None]
    b = F.linear(xn, wb, None if b_b is None else b_b.to(work)) * m[..., None]
    g = grad_out.to(work) / output_divisor(m, m, normalization, norm_eps)
    need_x, need_lw, need_lb, need_wa, need_ba, need_wb, need_bb, need_wo, need_bo = needs
    need_proj = need_x or need_lw or need_lb or need_wa or need_ba or need_wb or need_bb
    grads: dict[str, torch.Tensor | None] = dict.fromkeys(GRAD_INPUTS)
    if need_bo and b_out is not None:
        grads["b_out"] = (g if normalization == 1 else grad_out.to(work)).sum((0, 1, 2))
    if contract_backward is not None:
        grad_a, grad_b, grad_w = contract_backward(g, a, b, wo, need_proj, need_wo)
    else:
        if chunk_elems is None:
            chunk_elems = backward_block_elems(grad_out)
        grad_a, grad_b, grad_w = contract_outer_blocks_backward(g, a, b, wo, need_proj, need_wo, chunk_elems)
    del g, a, b  # (B, N, N, D) and (B, S, N, H): not needed below
    if need_wo:
        grads["w_out"] = grad_w
    if need_proj:
        ga = (grad_a * m[..., None]).reshape(-1, H)
        gb = (grad_b * m[..., None]).reshape(-1, H)
        xn2 = xn.reshape(-1, C)
        if need_wa:
            grads["w_a"] = ga.t() @ xn2
        if need_ba and b_a is not None:
            grads["b_a"] = ga.sum(0)
        if need_wb:
            grads["w_b"] = gb.t() @ xn2
        if need_bb and b_b is not None:
            grads["b_b"] = gb.sum(0)
        del xn, xn2
        if need_x or need_lw or need_lb:
            grad_xn = torch.addmm(ga @ wa, gb, wb).reshape(B, S, N, C)
            if need_lw:
                grads["ln_weight"] = (grad_xn * xhat).sum((0, 1, 2))
            if need_lb:
                grads["ln_bias"] = grad_xn.sum((0, 1, 2))
            if need_x:
                # rstd (gxhat - mean(gxhat) - xhat mean(gxhat xhat)), built in grad_xn's storage
                gxhat = grad_xn.mul_(lw)
                proj = torch.einsum("bsnc,bsnc->bsn", gxhat, xhat).unsqueeze(-1).div_(C)
                mean = gxhat.mean(-1, keepdim=True)
                grads["msa_repr"] = gxhat.sub_(mean).addcmul_(xhat, proj, value=-1.0).mul_(rstd)
    like = {"msa_repr": msa_repr, "ln_weight": ln_weight, "ln_bias": ln_bias, "w_a": w_a, "b_a": b_a, "w_b": w_b,
            "b_b": b_b, "w_out": w_out, "b_out": b_out}
    return [None if grads[k] is None else grads[k].to(like[k].dtype) for k in GRAD_INPUTS]


def openfold_float16_region() -> bool:
    """Whether a CUDA autocast region in float16 is active, as OpenFold's `is_fp16_enabled` asks."""
    return torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16


class OpenFoldOuterProductMeanReference(nn.Module):
    """OpenFold / AlphaFold2's Outer-Product Mean in plain PyTorch, from its math:

        out = linear_out(vec(sum_s a_si (x) b_sj)) / (eps + sum_s mask_si mask_sj)

    m (*, S, N, c_m), mask (*, S, N) -> (*, N, N, c_z).  With `chunk_size`, the outer product is
    formed for blocks of `chunk_size` residues i at a time (how OpenFold bounds its memory).
    Parameter names are OpenFold's.
    """

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3, projection_bias: bool = True):
        super().__init__()
        self.eps = eps
        self.layer_norm = nn.LayerNorm(c_m)
        self.linear_1 = nn.Linear(c_m, c_hidden, bias=projection_bias)
        self.linear_2 = nn.Linear(c_m, c_hidden, bias=projection_bias)
        self.linear_out = nn.Linear(c_hidden * c_hidden, c_z)

    def forward(self, m: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None):
        # OpenFold's own rule: in a float16 autocast region the module runs in float32 with autocast
        # off (float16's range); in a bfloat16 region it runs under autocast like any layer.
        if openfold_float16_region():
            with torch.autocast("cuda", enabled=False):
                return self._forward(m.float(), mask, chunk_size)
        return self._forward(m, mask, chunk_size)

    def _forward(self, m: torch.Tensor, mask: torch.Tensor | None, chunk_size: int | None) -> torch.Tensor:
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        mask = mask.to(m.dtype)
        x = self.layer_norm(m)
        a = self.linear_1(x) * mask[..., None]
        b = self.linear_2(x) * mask[..., None]
        norm = torch.einsum("...si,...sj->...ij", mask, mask)[..., None]
        n = a.shape[-2]
        step = n if chunk_size is None else chunk_size
        rows = [
            self.linear_out(torch.einsum("...sic,...sjd->...ijcd", a[..., i0:i0 + step, :], b).flatten(-2))
            for i0 in range(0, n, step)
        ]
        return torch.cat(rows, dim=-3) / (self.eps + norm)


class BoltzOuterProductMeanReference(nn.Module):
    """Boltz-1/2's Outer-Product Mean in plain PyTorch, from its math:

        out = proj_o(vec(sum_s a_si (x) b_sj) / max(sum_s mask_si mask_sj, 1))

    m (B, S, N, c_in), mask (B, S, N) -> (B, N, N, c_out).  With `chunk_size`, a's hidden channels
    are taken `chunk_size` at a time against the matching columns of proj_o (how Boltz bounds its
    memory at inference).  Parameter names are Boltz's.
    """

    def __init__(self, c_in: int, c_hidden: int, c_out: int):
        super().__init__()
        self.c_hidden = c_hidden
        self.norm = nn.LayerNorm(c_in)
        self.proj_a = nn.Linear(c_in, c_hidden, bias=False)
        self.proj_b = nn.Linear(c_in, c_hidden, bias=False)
        self.proj_o = nn.Linear(c_hidden * c_hidden, c_out)

    def forward(self, m: torch.Tensor, mask: torch.Tensor, chunk_size: int | None = None):
        mask = mask.to(m.dtype)
        x = self.norm(m)
        a = self.proj_a(x) * mask[..., None]
        b = self.proj_b(x) * mask[..., None]
        norm = torch.einsum("bsi,bsj->bij", mask, mask)[..., None].clamp(min=1)
        if chunk_size is None:
            return self.proj_o(torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2) / norm)
        H = self.c_hidden
        out = self.proj_o.bias
        for c0 in range(0, H, chunk_size):
            c1 = min(H, c0 + chunk_size)
            part = torch.einsum("bsic,bsjd->bijcd", a[..., c0:c1], b).flatten(-2) / norm
            out = out + part @ self.proj_o.weight[:, c0 * H:c1 * H].t()
        return out


class Model(nn.Module):
    """The specification's Outer-Product Mean module (AlphaFold-style), in plain PyTorch."""

    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim)
        self.proj_b = nn.Linear(msa_dim, hidden_dim)
        self.out_proj = nn.Linear(hidden_dim * hidden_dim, pair_dim)

    def forward(self, msa_repr: torch.Tensor, msa_mask: torch.Tensor) -> torch.Tensor:
        """msa_repr (B, S, N, msa_dim), msa_mask (B, S, N) -> (B, N, N, pair_dim)."""
        x = self.layer_norm(msa_repr)
        a = self.proj_a(x)  # (B, S, N, H)
        b = self.proj_b(x)
        mask = msa_mask.unsqueeze(-1)  # (B, S, N, 1)
        a = a * mask
        b = b * mask
        outer = torch.einsum("bsih,bsjk->bijhk", a, b)  # (B, N, N, H, H)
        denom = msa_mask.sum(dim=1).unsqueeze(-1).unsqueeze(-1).unsqueeze(-1).clamp(min=1)
        outer = outer / denom  # mean over S
        B, N1, N2, H1, H2 = outer.shape
        outer = outer.reshape(B, N1, N2, H1 * H2)
        return self.out_proj(outer)


msa_dim = 64
pair_dim = 64
hidden_dim = 32
seq_len = 32
msa_depth = 8
batch_size = 2


def get_inputs():
    msa_repr = torch.randn(batch_size, msa_depth, seq_len, msa_dim)
    msa_mask = torch.ones(batch_size, msa_depth, seq_len)
    return [msa_repr, msa_mask]


def get_init_inputs():
    return [msa_dim, pair_dim, hidden_dim]
