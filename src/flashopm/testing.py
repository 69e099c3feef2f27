"""Problem generators and error metrics shared by the tests, the checker and the benchmark."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import outer_product_mean_reference

MASK_KINDS = ("ones", "binary", "fractional", "masked_positions", "bool")


@dataclass(frozen=True)
class Shape:
    """(B, S, N, C, H, D): batch, MSA depth, residues, msa_dim, hidden_dim, pair_dim."""

    B: int
    S: int
    N: int
    C: int
    H: int
    D: int

    def __str__(self) -> str:
        return f"B{self.B}_S{self.S}_N{self.N}_C{self.C}_H{self.H}_D{self.D}"

    @property
    def flops(self) -> float:
        """FLOPs of the outer-first contraction: 2·B·N²·H²·(S + D)."""
        return 2.0 * self.B * self.N**2 * self.H**2 * (self.S + self.D)

    @property
    def out_bytes(self) -> int:
        return 4 * self.B * self.N * self.N * self.D


def make_mask(kind: str, B: int, S: int, N: int, generator: torch.Generator) -> torch.Tensor:
    """A (B, S, N) mask on the CPU.

    kinds: "ones"; "binary" (random 0/1); "fractional" (uniform in [0, 1)); "masked_positions"
    (random 0/1 and fractional values, with some positions masked over all of S, so that the
    denominator takes its clamp(min=1) path); "bool" (random bool).
    """
    if kind == "ones":
        return torch.ones(B, S, N)
    if kind == "binary":
        return (torch.rand(B, S, N, generator=generator) < 0.7).float()
    if kind == "fractional":
        return torch.rand(B, S, N, generator=generator)
    if kind == "masked_positions":
        m = torch.rand(B, S, N, generator=generator)
        m = torch.where(m < 0.3, torch.zeros_like(m), torch.where(m > 0.6, torch.ones_like(m), m))
        dead = torch.rand(B, N, generator=generator) < 0.25
        dead[:, 0] = True
        return m.masked_fill(dead[:, None, :], 0.0)
    if kind == "bool":
        return torch.rand(B, S, N, generator=generator) < 0.6
    raise ValueError(f"unknown mask kind {kind!r}; expected one of {MASK_KINDS}")


def make_params(shape: Shape, generator: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random parameters (never zeros) in the reference's layout, on the CPU, float32."""
    C, H, D = shape.C, shape.H, shape.D

    def rnd(*size, s=1.0):
        return torch.randn(*size, generator=generator) * s

    return {
        "ln_weight": 1.0 + 0.2 * rnd(C),
        "ln_bias": 0.2 * rnd(C),
        "w_a": rnd(H, C, s=scale / C**0.5),
        "b_a": rnd(H, s=0.1 * scale),
        "w_b": rnd(H, C, s=scale / C**0.5),
        "b_b": rnd(H, s=0.1 * scale),
        "w_out": rnd(D, H * H, s=scale / H),
        "b_out": rnd(D, s=0.1 * scale),
    }


def make_problem(shape: Shape, mask_kind: str = "ones", seed: int = 0, scale: float = 1.0):
    """(msa_repr, msa_mask, params) on the CPU, float32, drawn from a private generator."""
    g = torch.Generator().manual_seed(seed)
    msa = torch.randn(shape.B, shape.S, shape.N, shape.C, generator=g)
    mask = make_mask(mask_kind, shape.B, shape.S, shape.N, g)
    return msa, mask, make_params(shape, g, scale)


# The parameters in the functional API's order (after msa_repr and msa_mask).
PARAM_ORDER = ("ln_weight", "ln_bias", "w_a", "b_a", "w_b", "b_b", "w_out", "b_out")


def op_args(msa, mask, params, ln_eps: float = 1e-5) -> list:
    """The first eleven arguments of flashopm::outer_product_mean, in its schema's order: msa_repr,
    msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out."""
    p = params
    return [msa, mask, p["ln_weight"], p["ln_bias"], ln_eps, p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"],
            p["b_out"]]


def reference(msa, mask, params, dtype=None, ln_eps: float = 1e-5, normalization: int = 0,
              norm_eps: float = 1e-3) -> torch.Tensor:
    """The reference evaluated in `dtype` (float64 for ground truth); mask kept bool if bool."""
    if dtype is not None:
        msa = msa.to(dtype)
        if mask.dtype != torch.bool:
            mask = mask.to(dtype)
        params = {k: None if v is None else v.to(dtype) for k, v in params.items()}
    p = params
    return outer_product_mean_reference(
        msa, mask, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"], p["b_out"], ln_eps,
        normalization, norm_eps,
    )


def leaf_gradients(fn, msa, mask, params, grad_out, names):
    """Gradients of fn(msa, mask, *params in PARAM_ORDER) against grad_out with respect to the
    inputs in names ("msa_repr" and parameter names), each a fresh copy of the given tensor; a
    parameter that is None stays None."""
    leaves = {"msa_repr": msa.clone().requires_grad_(),
              **{k: (v.clone().requires_grad_() if v is not None else None) for k, v in params.items()}}
    out = fn(leaves["msa_repr"], mask, *(leaves[k] for k in PARAM_ORDER))
    return torch.autograd.grad(out, [leaves[k] for k in names], grad_out)


def capture_graph(fn):
    """A CUDA graph of `fn()` and what the captured call returned.  One call runs first on a side
    stream, so that lazy setup (the extension's first launch, the allocator's pools) stays out of
    the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ||out - ref|| / ||ref|| in float64 (0 when both are empty)."""
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return (out.double() - ref.double()).abs().max().item()


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
