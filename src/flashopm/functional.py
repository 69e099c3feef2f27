"""Functional API of flashopm."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from . import _build
from .ops import (ALGORITHMS, FOLLOW_PYTORCH, NORMALIZATIONS, PRECISIONS, call_outer_product_mean,
                  outer_product_mean_rows_op)


def _mode_codes(normalization: str, precision: str | None) -> tuple[int, int]:
    """The ops' integer codes for a normalization name and a precision name (None: PyTorch's setting)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"flashopm: normalization must be one of {sorted(NORMALIZATIONS)}, got {normalization!r}")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"flashopm: precision must be one of {sorted(PRECISIONS)} or None, got {precision!r}")
    return NORMALIZATIONS[normalization], FOLLOW_PYTORCH if precision is None else PRECISIONS[precision]


def outer_product_mean(
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
    *,
    ln_eps: float = 1e-5,
    algorithm: str = "auto",
    normalization: str = "row",
    norm_eps: float = 1e-3,
    precision: str | None = None,
) -> torch.Tensor:
    """Fused outer-product mean.

    Args:
        msa_repr: (B, S, N, C) MSA features.
        msa_mask: (B, S, N) float or bool mask.
        ln_weight, ln_bias: (C,) LayerNorm affine parameters, eps `ln_eps`.
        w_a, w_b: (H, C) projection weights; b_a, b_b: (H,) biases or None.
        w_out: (D, H*H) output projection; b_out: (D,) or None.
        algorithm: "auto" ("small-tc" or "single" for small problems, else fewest FLOPs within a
            bounded workspace), "outer" (outer product over S first, per tile on chip), "project"
            (b projected through w_out first; best for small S), "single" (one kernel, everything
            in shared memory, for small problems only: an error where it does not fit) or
            "small-tc" (small problems on tensor cores: the projections, then one block per row i
            and chunk of d; hidden_dim a multiple of 8, sm_90); "outer-fma" is "outer" on CUDA
            cores only ("outer" uses tensor cores when hidden_dim is a multiple of 8).

        normalization: how the sum over S is normalised, with O_ij = W_out vec(sum_s a_si (x) b_sj):
            "row" (the specification): O_ij / max(sum_s m_si, 1) + b_out;
            "openfold" (OpenFold, AlphaFold2): (O_ij + b_out) / (norm_eps + sum_s m_si m_sj);
            "boltz" (Boltz-1/2): O_ij / max(sum_s m_si m_sj, 1) + b_out.
        precision: float32 matmul precision of the contractions, as PyTorch names it ("highest":
            float32 accuracy, 3xTF32 on tensor cores; "high": TF32 allowed; "medium": bfloat16
            operands with float32 sums on this op's outer-first path, "high" on its small paths
            and in `outer_product_mean_rows`); None follows
            torch.get_float32_matmul_precision() for float32 inputs, and for bfloat16/float16
            inputs means products in that type (TF32 on the small paths).

    Returns:
        (B, N, N, D), with a = (LayerNorm(x) W_a^T + b_a) * m and b likewise.

    On CUDA tensors this is one call of the fused CUDA kernels (compiled on first use); on the CPU
    it is the PyTorch reference.  On CUDA, bfloat16 and float16 inputs (with parameters of the same
    type) are normalised and projected in float32, contracted on tensor cores in their own type
    with float32 sums unless `precision` says otherwise, and the output comes back in that type.
    16-bit parameters also take float32 msa_repr (normalised in float32, then as above): how the op
    runs in a torch.autocast region, which casts the parameters to the region's type.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"flashopm: algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    norm_code, precision_code = _mode_codes(normalization, precision)
    return call_outer_product_mean(
        msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out, ALGORITHMS[algorithm],
        norm_code, norm_eps, precision_code,
    )


def outer_product_mean_rows(
    a: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor,
    row_offset: int,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    *,
    normalization: str = "row",
    norm_eps: float = 1e-3,
    precision: str | None = None,
) -> torch.Tensor:
    """Rows row_offset .. row_offset + N_rows of the outer-product mean, from the projections.

    Args:
        a: (B, S, N_rows, H) masked left projections of residues row_offset .. row_offset + N_rows.
        b: (B, S, N, H) masked right projections of all residues.
        mask: (B, S, N) mask of all residues (for the normalisers).
        w_out, b_out, normalization, norm_eps, precision: as in `outer_product_mean`.

    Returns:
        (B, N_rows, N, D): out[:, r, j] = normalise(W_out vec(sum_s a[:, s, r] (x) b[:, s, j]))
        for row i = row_offset + r.  The residue-sharded OPM runs this on each rank's rows; on
        CUDA it is the fused outer-first kernel without its LayerNorm/projection stage.
    """
    norm_code, precision_code = _mode_codes(normalization, precision)
    if a.is_cuda and not _build.is_loaded():
        _build.load()
    return outer_product_mean_rows_op(a, b, mask, row_offset, w_out, b_out, norm_code, norm_eps, precision_code)


PEAK_BOUND_VAR = "FLASHOPM_PEAK_BOUND"
MIN_PEAK_BOUND = 1.02  # the output itself is 1; the rest leaves room for a part of s at the least


@contextlib.contextmanager
def peak_memory_bound(factor: float | None) -> Iterator[None]:
    """Bounds the CUDA forward's peak extra memory to `factor` times its output's size (the output
    included) inside the block; None lifts the bound.  Process-wide, like the FLASHOPM_PEAK_BOUND
    variable it sets for the block (and restores after it).

    Without a bound the forward holds its output plus the projections a (B, S, rows, H) and
    b (B, S, N, H): 1.1-1.25x the output where S·H is small next to N·D, several times it for deep
    MSAs. A bound takes the output in bands of rows; with one batch element a band's a and b lie
    in the output's rows after it, which are not written yet. The last bands, and every block
    with B > 1, take blocks of columns (b for a block of residues) and, for float32 outputs, the
    sum over s in parts where even that passes the bound, each part normalised and added to the
    output. At deep MSAs (hidden 32, msa_dim <= 64, float32, "highest", sm_90) the waves form
    keeps the parts' sums on chip instead: a tight bound there costs about 1.6 times the
    unbounded time (README, "Latest"). 16-bit outputs are bounded by the blocks alone.

        with flashopm.peak_memory_bound(1.1):
            pair_update = model.outer_product_mean(m, mask)
    """
    if factor is not None and not factor >= MIN_PEAK_BOUND:
        raise ValueError(f"flashopm: peak_memory_bound's factor must be >= {MIN_PEAK_BOUND} (a factor of the "
                         f"output's size, the output included) or None, got {factor!r}")
    before = os.environ.get(PEAK_BOUND_VAR)
    if factor is None:
        os.environ.pop(PEAK_BOUND_VAR, None)
    else:
        os.environ[PEAK_BOUND_VAR] = repr(float(factor))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PEAK_BOUND_VAR, None)
        else:
            os.environ[PEAK_BOUND_VAR] = before
