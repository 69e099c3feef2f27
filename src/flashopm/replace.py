"""flashopm swapped into a model that already exists.

`replace_outer_product_means(model)` finds the model's Outer-Product Mean modules by their layout:
the submodule names and shapes of OpenFold's / AlphaFold2's module (`layer_norm`, `linear_1`,
`linear_2`, `linear_out`, and `eps`), of Boltz's (`norm`, `proj_a`, `proj_b` without bias,
`proj_o`) or of the specification's `Model` (`layer_norm`, `proj_a`, `proj_b`, `out_proj`).  It
checks that each computes what the flashopm module of that convention computes, on a small random
problem in float64 with fully masked residues and fractional mask values, then puts the flashopm
module in its place.

The flashopm module holds the old module's own submodules, so its parameters are the same tensors:
the state dict, a checkpoint, and an optimizer or DistributedDataParallel wrapper built before the
swap all stay valid.  Swap before `torch.compile` and before FSDP, which flatten the modules they
are given.  Hooks on the old module itself are not carried over, and those on its submodules do
not fire: the fused op reads their parameters without calling them.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
import torch.nn as nn

from .modules import BoltzOuterProductMean, ModelNew, OpenFoldOuterProductMean

# What the check on a random problem may differ by, normwise relative to the original's output:
# float64 on both sides agrees to ~1e-15; Boltz's original sums its outer product in float32 (its
# releases before 2.2), ~1e-7.  A different convention differs by tens of percent.
VERIFY_TOLERANCE = 1e-5

_FLASHOPM_MODULES = (OpenFoldOuterProductMean, BoltzOuterProductMean, ModelNew)


@dataclasses.dataclass(frozen=True)
class _Layout:
    convention: str
    # The LayerNorm, the first and second projections and the output projection, in that order.
    children: tuple[str, str, str, str]
    # Whether the projections carry biases: True or False, or None where the models differ
    # (OpenFold3 and Protenix drop them).
    projection_bias: bool | None


_LAYOUTS = (
    _Layout("openfold", ("layer_norm", "linear_1", "linear_2", "linear_out"), None),
    _Layout("boltz", ("norm", "proj_a", "proj_b", "proj_o"), False),
    _Layout("row", ("layer_norm", "proj_a", "proj_b", "out_proj"), True),
)


@dataclasses.dataclass(frozen=True)
class _Match:
    layout: _Layout
    modules: tuple[nn.Module, nn.Module, nn.Module, nn.Module]
    msa_dim: int
    hidden_dim: int
    pair_dim: int
    projection_bias: bool


def _vector(t, n: int | None = None) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and (n is None or t.shape[0] == n)


def _matrix(t, rows: int | None, cols: int | None) -> bool:
    return (isinstance(t, torch.Tensor) and t.dim() == 2 and (rows is None or t.shape[0] == rows)
            and (cols is None or t.shape[1] == cols))


def _match_layout(module: nn.Module, layout: _Layout) -> _Match | str:
    """The layout's dimensions in `module`, or why it does not have that layout."""
    found = [module._modules.get(name) for name in layout.children]
    if any(m is None for m in found):
        return "no submodules " + ", ".join(f"`{n}`" for n, m in zip(layout.children, found) if m is None)
    norm, first, second, out = found
    ln_w, ln_b = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if not (_vector(ln_w) and _vector(ln_b, ln_w.shape[0]) and isinstance(getattr(norm, "eps", None), float)):
        return f"`{layout.children[0]}` is not a LayerNorm with a weight, a bias and eps over the last dim"
    C = ln_w.shape[0]
    w1, w2 = getattr(first, "weight", None), getattr(second, "weight", None)
    if not (_matrix(w1, None, C) and _matrix(w2, w1.shape[0], C)):
        return (f"`{layout.children[1]}` and `{layout.children[2]}` are not linear layers "
                f"from {C} features to the same width")
    H = w1.shape[0]
    b1, b2 = getattr(first, "bias", None), getattr(second, "bias", None)
    bias = _vector(b1, H) and _vector(b2, H)
    if not bias and not (b1 is None and b2 is None):
        return f"`{layout.children[1]}` and `{layout.children[2]}` do not both have a bias of {H}, nor both none"
    if layout.projection_bias is not None and bias != layout.projection_bias:
        return f"the projections {'lack' if layout.projection_bias else 'have'} biases"
    w_out, b_out = getattr(out, "weight", None), getattr(out, "bias", None)
    if not (_matrix(w_out, None, H * H) and (b_out is None or _vector(b_out, w_out.shape[0]))):
        return f"`{layout.children[3]}` is not a linear layer from {H * H} (hidden_dim squared) features"
    if layout.convention == "openfold" and not isinstance(getattr(module, "eps", None), float):
        return "no float attribute `eps` (the normaliser's epsilon)"
    return _Match(layout, (norm, first, second, out), C, H, w_out.shape[0], bias)


def _find_layout(module: nn.Module) -> _Match | str:
    reasons = []
    for layout in _LAYOUTS:
        found = _match_layout(module, layout)
        if isinstance(found, _Match):
            return found
        reasons.append(f"{layout.convention} layout: {found}")
    return "; ".join(reasons)


def _flashopm_module(module: nn.Module, match: _Match) -> nn.Module:
    """The flashopm module of `match`'s convention holding `module`'s submodules."""
    cls = {"openfold": OpenFoldOuterProductMean, "boltz": BoltzOuterProductMean, "row": ModelNew}[
        match.layout.convention]
    new = cls.__new__(cls)
    nn.Module.__init__(new)  # no parameters of its own: the old module's are adopted below
    if cls is OpenFoldOuterProductMean:
        new.eps, new.c_z, new.c_hidden = float(module.eps), match.pair_dim, match.hidden_dim
    elif cls is BoltzOuterProductMean:
        new.c_hidden = match.hidden_dim
    ours = {"openfold": ("layer_norm", "linear_1", "linear_2", "linear_out"),
            "boltz": ("norm", "proj_a", "proj_b", "proj_o"),
            "row": ("layer_norm", "proj_a", "proj_b", "out_proj")}[match.layout.convention]
    for name, sub in zip(ours, match.modules):
        setattr(new, name, sub)
    new.training = module.training
    return new


def _check_problem(C: int, batch: int = 2, depth: int = 5, residues: int = 6, seed: int = 0):
    """msa (batch, depth, residues, C) and a mask with zeros, fractions, a residue masked in every
    sequence (fully masked pairs: where the conventions' eps, clamp and bias differ) and a masked
    sequence, in float64."""
    g = torch.Generator().manual_seed(seed)
    msa = torch.randn(batch, depth, residues, C, generator=g, dtype=torch.float64)
    mask = torch.randint(0, 3, (batch, depth, residues), generator=g).to(torch.float64) / 2
    mask[:, :, 0] = 0.0
    mask[:, 1] = 0.0
    mask[:, 0, 1:] = 1.0  # every other residue seen at least once
    return msa, mask


def _verify(module: nn.Module, match: _Match) -> str | None:
    """None where `module` computes what its flashopm module computes on a random float64 problem
    with random parameters; else why not."""
    try:
        probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float64).eval()
    except Exception as e:  # noqa: BLE001 (any failure to copy means the module cannot be checked)
        return f"it could not be copied for the check ({type(e).__name__}: {e})"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / max(1, p.shape[-1]) ** 0.5)
    probe_match = _match_layout(probe, match.layout)
    if not isinstance(probe_match, _Match):
        return f"its copy lost the layout ({probe_match})"
    ours = _flashopm_module(probe, probe_match)
    msa, mask = _check_problem(match.msa_dim)
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            want = probe(msa, mask)
            got = ours(msa, mask)
    except Exception as e:  # noqa: BLE001 (a forward that fails on the check's inputs is not this op)
        return f"its forward failed on the check's inputs ({type(e).__name__}: {e})"
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return f"its output is not a tensor of shape {tuple(got.shape)}"
    err = ((got - want.to(got.dtype)).norm() / want.norm().clamp_min(1e-300)).item()
    if not err <= VERIFY_TOLERANCE:
        return (f"its output differs from the {match.layout.convention} convention's by {err:.2e} "
                f"(normwise, relative; at most {VERIFY_TOLERANCE:.0e} allowed)")
    return None


def convert_outer_product_mean(module: nn.Module, *, verify: bool = True) -> nn.Module:
    """The flashopm module computing what `module` computes, holding `module`'s submodules (and so
    its parameters, on their device and in their dtype).

    `module` is laid out as OpenFold's, Boltz's or the specification's Outer-Product Mean (see the
    module docstring).  With `verify`, its forward is compared with the flashopm module's on a
    small float64 problem with random parameters first (a copy of it: `module` is untouched).
    Raises ValueError, saying why, where the layout or the check does not match.
    """
    if isinstance(module, _FLASHOPM_MODULES):
        return module
    match = _find_layout(module)
    if not isinstance(match, _Match):
        raise ValueError(f"{type(module).__name__} is not laid out as an Outer-Product Mean flashopm knows ({match})")
    if verify:
        why = _verify(module, match)
        if why is not None:
            raise ValueError(f"{type(module).__name__} has the {match.layout.convention} layout but {why}")
    return _flashopm_module(module, match)


def replace_outer_product_means(model: nn.Module, *, verify: bool = True) -> list[str]:
    """Replaces, in place, every submodule of `model` laid out as an Outer-Product Mean (OpenFold's,
    Boltz's or the specification's) by the flashopm module of its convention, which holds the old
    module's submodules and parameters.  Returns the qualified names replaced.

    With `verify` (the default) each candidate is checked first (see `convert_outer_product_mean`);
    one whose forward does not match is left in place with a warning.  Modules already flashopm's
    are left as they are, so a second call replaces nothing.  `model` itself is not replaced: use
    `convert_outer_product_mean` for a lone module.
    """
    replaced: list[str] = []
    converted: dict[int, nn.Module | None] = {}  # a module shared by several parents is checked once
    walked: set[int] = set()

    def walk(parent: nn.Module, prefix: str) -> None:
        if id(parent) in walked:
            return
        walked.add(id(parent))
        for name, child in list(parent._modules.items()):
            if child is None or isinstance(child, _FLASHOPM_MODULES):
                continue
            qualified = f"{prefix}{name}"
            if id(child) not in converted:
                match = _find_layout(child)
                if isinstance(match, _Match):
                    why = _verify(child, match) if verify else None
                    if why is not None:
                        warnings.warn(f"flashopm: {qualified} ({type(child).__name__}) left in place: it has the "
                                      f"{match.layout.convention} layout but {why}", stacklevel=3)
                    converted[id(child)] = None if why is not None else _flashopm_module(child, match)
                else:
                    converted[id(child)] = None
            new = converted[id(child)]
            if new is None:
                walk(child, qualified + ".")
            else:
                parent._modules[name] = new
                replaced.append(qualified)

    walk(model, "")
    return replaced
