"""Pure-PyTorch references: the specification's module and the functional form of its math.

These serve the CPU path of the op and every test. `Model` is the specification's module, unchanged;
`outer_product_mean_reference` is the same computation written with functional calls, so that
any parameters (and any floating dtype, float64 included) can be fed to it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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
) -> torch.Tensor:
    """Outer-product mean, materialising the (B, N, N, H*H) intermediate.

    Shapes: msa_repr (B, S, N, C), msa_mask (B, S, N), w_a/w_b (H, C), w_out (D, H*H).
    Returns (B, N, N, D):

        a = (LayerNorm(x) W_a^T + b_a) * m,   b = (LayerNorm(x) W_b^T + b_b) * m
        out[b, i, j] = W_out vec(sum_s a[b, s, i] (x) b[b, s, j]) / max(sum_s m[b, s, i], 1) + b_out
    """
    x = F.layer_norm(msa_repr, (msa_repr.shape[-1],), ln_weight, ln_bias, ln_eps)
    a = F.linear(x, w_a, b_a)
    b = F.linear(x, w_b, b_b)
    mask = msa_mask.unsqueeze(-1)
    a = a * mask
    b = b * mask
    outer = torch.einsum("bsih,bsjk->bijhk", a, b)
    denom = msa_mask.sum(dim=1).unsqueeze(-1).unsqueeze(-1).unsqueeze(-1).clamp(min=1)
    outer = outer / denom
    batch, n1, n2, h1, h2 = outer.shape
    outer = outer.reshape(batch, n1, n2, h1 * h2)
    return F.linear(outer, w_out, b_out)


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
