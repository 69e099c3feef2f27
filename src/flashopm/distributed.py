"""Outer-Product Mean with residues sharded over the ranks of a torch.distributed process group.

Rank r holds residues [n_r, n_r + N_r) of the MSA (contiguous slices in rank order; sizes may
differ) and produces the matching rows of the pair output, against all columns:

    msa_local (B, S, N_r, C), mask_local (B, S, N_r)  ->  out_local (B, N_r, N, D)

Each rank applies LayerNorm and both projections to its own residues; the right-hand projection b
(B, S, N_r, H) and the mask are gathered over the group (H values per residue instead of the C of
the MSA), and the contraction runs on the local rows.  The gather is differentiable (its backward
sums each rank's share of the gradient back to its owner), so autograd works across ranks.  The
three normalisations of `flashopm.outer_product_mean` are supported; the pair normalisations
use the gathered mask.

The contraction on the local rows is the op `flashopm::outer_product_mean_rows`: on CUDA the fused
outer-first kernel (without its LayerNorm/projection stage, which ran here), on the CPU the
PyTorch reference; its backward is PyTorch (blocks of rows) on every device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import reference
from .functional import outer_product_mean_rows
from .ops import NORMALIZATIONS


def _gather_along_residues(t: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """All-gather t (dim 2 = residues, N_r on this rank) into the full tensor, differentiably."""
    from torch.distributed.nn.functional import all_gather

    pad = max(sizes) - t.shape[2]
    if pad:  # all_gather wants equal shapes: pad, gather, then drop the padding
        t = F.pad(t, (0, 0) * (t.dim() - 3) + (0, pad))
    parts = all_gather(t.contiguous(), group=group)
    return torch.cat([p.narrow(2, 0, n) for p, n in zip(parts, sizes)], dim=2)


def shard_bounds(N: int, world: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal slices [n0, n1) of N residues in rank order (the first N % world
    ranks hold one more)."""
    sizes = [N // world + (1 if r < N % world else 0) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def shard_sizes(msa_local: torch.Tensor, group=None) -> list[int]:
    """Residues held by every rank of the group, in rank order."""
    n = torch.tensor([msa_local.shape[2]], dtype=torch.long, device=msa_local.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    return [int(s.item()) for s in sizes]


def sharded_outer_product_mean(
    msa_local: torch.Tensor,
    mask_local: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    w_a: torch.Tensor,
    b_a: torch.Tensor | None,
    w_b: torch.Tensor,
    b_b: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    *,
    group=None,
    ln_eps: float = 1e-5,
    normalization: str = "row",
    norm_eps: float = 1e-3,
) -> torch.Tensor:
    """This rank's rows of the outer-product mean; see the module docstring.

    Args are those of `flashopm.outer_product_mean`, with msa_local (B, S, N_r, C) and
    mask_local (B, S, N_r) this rank's residues.  Returns (B, N_r, N, D).
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"flashopm: normalization must be one of {sorted(NORMALIZATIONS)}, got {normalization!r}")
    sizes = shard_sizes(msa_local, group)
    mask = mask_local.to(msa_local.dtype)
    a, b = reference.masked_projections(msa_local, mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, ln_eps)
    b_all = _gather_along_residues(b, group, sizes)                    # (B, S, N, H)
    mask_all = _gather_along_residues(mask, group, sizes).detach()   # (B, S, N)
    row_offset = sum(sizes[:dist.get_rank(group)])
    return outer_product_mean_rows(a, b_all, mask_all, row_offset, w_out, b_out, normalization=normalization,
                                   norm_eps=norm_eps)


class ShardedOuterProductMean(nn.Module):
    """Runs one of flashopm's modules (ModelNew, OpenFoldOuterProductMean, BoltzOuterProductMean)
    with residues sharded over `group`: forward(msa_local, mask_local) -> (B, N_r, N, D), this
    rank's rows.  The parameters are the wrapped module's (replicated on every rank, as with
    DistributedDataParallel)."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module = module
        self.group = group

    def _parameters_and_convention(self):
        from .modules import BoltzOuterProductMean, ModelNew, OpenFoldOuterProductMean

        mod = self.module
        if isinstance(mod, ModelNew):
            ln, pa, pb, po = mod.layer_norm, mod.proj_a, mod.proj_b, mod.out_proj
            return (ln, pa, pb, po), "row", 1e-3
        if isinstance(mod, OpenFoldOuterProductMean):
            return (mod.layer_norm, mod.linear_1, mod.linear_2, mod.linear_out), "openfold", mod.eps
        if isinstance(mod, BoltzOuterProductMean):
            return (mod.norm, mod.proj_a, mod.proj_b, mod.proj_o), "boltz", 1e-3
        raise TypeError(f"flashopm: cannot shard a {type(mod).__name__}")

    def forward(self, msa_local: torch.Tensor, mask_local: torch.Tensor) -> torch.Tensor:
        (ln, pa, pb, po), normalization, eps = self._parameters_and_convention()
        return sharded_outer_product_mean(
            msa_local, mask_local, ln.weight, ln.bias, pa.weight, pa.bias, pb.weight, pb.bias, po.weight, po.bias,
            group=self.group, ln_eps=ln.eps, normalization=normalization, norm_eps=eps,
        )
