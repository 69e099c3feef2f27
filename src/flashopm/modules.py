"""Thin nn.Modules over the op: the specification's ModelNew and the OpenFold and Boltz modules."""
from __future__ import annotations

import torch
import torch.nn as nn

from . import _build
from .ops import NORMALIZATIONS, call_outer_product_mean
from .reference import BoltzOuterProductMeanReference, OpenFoldOuterProductMeanReference


# ModelNew's LayerNorm and its three linear layers, in the op's order.
_SUBMODULES = ("layer_norm", "proj_a", "proj_b", "out_proj")


class ModelNew(nn.Module):
    """Drop-in replacement of the specification's `Model` on the fused kernel.

    Same submodules (`layer_norm`, `proj_a`, `proj_b`, `out_proj`), created in the same order, so
    seeding gives identical weights and state dicts load both ways.

    forward: msa_repr (B, S, N, msa_dim), msa_mask (B, S, N) -> (B, N, N, pair_dim).
    """

    def __init__(self, msa_dim, pair_dim, hidden_dim=32):
        super().__init__()
        self.layer_norm = nn.LayerNorm(msa_dim)
        self.proj_a = nn.Linear(msa_dim, hidden_dim)
        self.proj_b = nn.Linear(msa_dim, hidden_dim)
        self.out_proj = nn.Linear(hidden_dim * hidden_dim, pair_dim)

    def _parameters_in_op_order(self):
        # nn.Module.__getattr__ costs about half a microsecond per lookup and a call makes twelve
        # of them: read the registries directly, and fall back to attributes for modules whose
        # parameters are not plain entries (parametrizations, replaced submodules).
        try:
            mods = self._modules
            ln, pa, pb, po = (mods["layer_norm"], mods["proj_a"], mods["proj_b"], mods["out_proj"])
            lp, ap, bp, op = ln._parameters, pa._parameters, pb._parameters, po._parameters
            return (lp["weight"], lp["bias"], ln.eps, ap["weight"], ap["bias"], bp["weight"], bp["bias"],
                    op["weight"], op["bias"])
        except KeyError:
            ln, pa, pb, po = self.layer_norm, self.proj_a, self.proj_b, self.out_proj
            return (ln.weight, ln.bias, ln.eps, pa.weight, pa.bias, pb.weight, pb.bias, po.weight, po.bias)

    def forward(self, msa_repr: torch.Tensor, msa_mask: torch.Tensor) -> torch.Tensor:
        if msa_repr.is_cuda and not torch.compiler.is_compiling():
            # The extension reads the parameters from the submodules itself (fewer Python frames
            # and lookups per call); NotImplemented where it cannot, as the op's entry answers.
            out = (_build.modules_entry or _build.load_modules_entry())(self._modules, _SUBMODULES, msa_repr, msa_mask)
            if out is not NotImplemented:
                return out
        return call_outer_product_mean(msa_repr, msa_mask, *self._parameters_in_op_order())


def _lecun_normal_(weight: torch.Tensor) -> None:
    """Truncated-normal fan-in initialisation (OpenFold's "default" init for its Linear layers)."""
    fan_in = weight.shape[1]
    std = (1.0 / max(1, fan_in)) ** 0.5 / 0.87962566103423978  # std of N(0,1) truncated at ±2
    with torch.no_grad():
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2 * std, b=2 * std)


class OpenFoldOuterProductMean(OpenFoldOuterProductMeanReference):
    """OpenFold / AlphaFold2 Outer-Product Mean (Algorithm 10) on the fused kernel.

    Same parameters as OpenFold's `OuterProductMean` (`layer_norm`, `linear_1`, `linear_2`,
    `linear_out`), so a checkpoint's sub-dict loads unchanged; `projection_bias=False` gives the
    bias-free projections of OpenFold3 and Protenix.  `linear_out` starts at zero ("final" init).

    forward: m (*, S, N, c_m), mask (*, S, N) or None -> (*, N, N, c_z), with
        out = (linear_out(vec(sum_s a_si (x) b_sj))) / (eps + sum_s mask_si mask_sj)
    (the bias is divided too: a fully masked pair gives linear_out.bias / eps).  `chunk_size` and
    `inplace_safe` are accepted for compatibility; the kernel never forms the chunks they bound.
    In a float16 autocast region it runs in float32 with autocast off, as OpenFold's module does.
    """

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3, *, projection_bias: bool = True):
        super().__init__(c_m, c_z, c_hidden, eps, projection_bias)  # the parameters, as the reference lays them out
        self.c_z, self.c_hidden = c_z, c_hidden
        for lin in (self.linear_1, self.linear_2):
            _lecun_normal_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        nn.init.zeros_(self.linear_out.weight)
        nn.init.zeros_(self.linear_out.bias)

    def forward(self, m: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None,
                inplace_safe: bool = False) -> torch.Tensor:
        return super().forward(m, mask, chunk_size)

    def _forward(self, m: torch.Tensor, mask: torch.Tensor | None, chunk_size: int | None) -> torch.Tensor:
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        *batch, S, N, C = m.shape
        flat = len(batch) != 1  # the op wants exactly one batch dim; views cost host time, so only when needed
        ln, l1, l2, lo = self.layer_norm, self.linear_1, self.linear_2, self.linear_out
        out = call_outer_product_mean(
            m.reshape(-1, S, N, C) if flat else m, mask.reshape(-1, S, N) if flat else mask, ln.weight, ln.bias,
            ln.eps, l1.weight, l1.bias, l2.weight, l2.bias, lo.weight, lo.bias, 0, NORMALIZATIONS["openfold"], self.eps,
        )
        return out.reshape(*batch, N, N, self.c_z) if flat else out


class BoltzOuterProductMean(BoltzOuterProductMeanReference):
    """Boltz-1/2 Outer-Product Mean on the fused kernel.

    Same parameters as Boltz's `OuterProductMean` (`norm`, `proj_a`, `proj_b` without bias,
    `proj_o`), so a checkpoint's sub-dict loads unchanged; `proj_o` starts at zero.

    forward: m (B, S, N, c_in), mask (B, S, N) -> (B, N, N, c_out), with
        out = proj_o(vec(sum_s a_si (x) b_sj) / max(sum_s mask_si mask_sj, 1))
    (the bias is added after the division).  `chunk_size` is accepted for compatibility.
    """

    def __init__(self, c_in: int, c_hidden: int, c_out: int):
        super().__init__(c_in, c_hidden, c_out)  # the parameters, as the reference lays them out
        nn.init.zeros_(self.proj_o.weight)
        nn.init.zeros_(self.proj_o.bias)

    def forward(self, m: torch.Tensor, mask: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        n, pa, pb, po = self.norm, self.proj_a, self.proj_b, self.proj_o
        return call_outer_product_mean(
            m, mask, n.weight, n.bias, n.eps, pa.weight, None, pb.weight, None, po.weight, po.bias, 0,
            NORMALIZATIONS["boltz"], 1e-3,
        )


class NamedOuterProductMean(nn.Module):
    """The fused op over submodules named as a model names them.

    `modules` maps the model's four attribute names, in order, to its LayerNorm, first and second
    projections and output projection; `normalization` ("row", "openfold" or "boltz") and
    `norm_eps` are as in `flashopm.outer_product_mean`.  The submodules keep their names, so the
    state dict keeps the model's keys.  `replace_outer_product_means` builds these for the layouts
    it is given.

    forward: m (*, S, N, C), mask (*, S, N) or None -> (*, N, N, D).  Further arguments (chunk
    sizes and the like) are accepted and change nothing.
    """

    def __init__(self, modules: dict[str, nn.Module], normalization: str = "openfold", norm_eps: float = 1e-3):
        super().__init__()
        if len(modules) != 4:
            raise ValueError(f"flashopm: NamedOuterProductMean takes 4 submodules (LayerNorm, two projections, output "
                             f"projection), got {len(modules)}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"flashopm: normalization must be one of {sorted(NORMALIZATIONS)}, got {normalization!r}")
        for name, module in modules.items():
            setattr(self, name, module)
        self.names = tuple(modules)
        self.normalization, self.norm_eps = normalization, float(norm_eps)

    def extra_repr(self) -> str:
        return f"normalization={self.normalization!r}, norm_eps={self.norm_eps}"

    def forward(self, m: torch.Tensor, mask: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        *batch, S, N, C = m.shape
        ln, first, second, out = (self._modules[name] for name in self.names)
        result = call_outer_product_mean(
            m.reshape(-1, S, N, C), mask.reshape(-1, S, N), ln.weight, ln.bias, ln.eps, first.weight, first.bias,
            second.weight, second.bias, out.weight, out.bias, 0, NORMALIZATIONS[self.normalization], self.norm_eps,
        )
        return result.reshape(*batch, N, N, result.shape[-1])
