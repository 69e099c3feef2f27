"""flashopm swapped into a model that already exists.

`replace_outer_product_means(model)` finds the model's Outer-Product Mean modules by their layout:
the submodule names and shapes of OpenFold's / AlphaFold2's module (`layer_norm`, `linear_1`,
`linear_2`, `linear_out`, and `eps`), of Boltz's (`norm`, `proj_a`, `proj_b` without bias,
`proj_o`) or of the specification's `Model` (`layer_norm`, `proj_a`, `proj_b`, `out_proj`), and any
other layouts it is given (`OuterProductMeanLayout`: a port's own names).  It checks that each
computes what the flashopm module of that normalisation computes, on a small random problem in
float64 with fully masked residues and fractional mask values, then puts the flashopm module in
its place (for a layout it was given, a `NamedOuterProductMean` that keeps the port's names).

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

from .modules import BoltzOuterProductMean, ModelNew, NamedOuterProductMean, OpenFoldOuterProductMean
from .ops import NORMALIZATIONS

# What the check on a random problem may differ by, normwise relative to the original's output:
# float64 on both sides agrees to ~1e-15; Boltz's older releases sum the outer product in float32,
# ~1e-7.  A different convention differs by tens of percent.
VERIFY_TOLERANCE = 1e-5

_FLASHOPM_MODULES = (OpenFoldOuterProductMean, BoltzOuterProductMean, ModelNew, NamedOuterProductMean)


@dataclasses.dataclass(frozen=True)
class OuterProductMeanLayout:
    """How a model lays out its Outer-Product Mean, for `replace_outer_product_means` and
    `convert_outer_product_mean`: the attribute names of its LayerNorm, first and second
    projections and output projection, in that order, and the normalisation its forward applies
    ("row", "openfold" or "boltz", as in `flashopm.outer_product_mean`).  `eps` is the "openfold"
    normaliser's epsilon, for modules that keep none in a float attribute `eps`.

    For example, a port with `layer_norm`, `linear_a`, `linear_b`, `linear_out` and a fixed 1e-3:
    `OuterProductMeanLayout(("layer_norm", "linear_a", "linear_b", "linear_out"), "openfold", eps=1e-3)`.
    """

    names: tuple[str, str, str, str]
    normalization: str = "openfold"
    eps: float | None = None

    def __post_init__(self):
        if not (isinstance(self.names, tuple) and len(self.names) == 4 and all(isinstance(n, str) for n in self.names)):
            raise ValueError(f"flashopm: a layout's names are 4 attribute names (LayerNorm, first projection, second "
                             f"projection, output projection), got {self.names!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"flashopm: a layout's normalization must be one of {sorted(NORMALIZATIONS)}, "
                             f"got {self.normalization!r}")


# The models' own layouts, each with the flashopm module that carries its names, and whether its
# projections carry biases (None: either; OpenFold3 and Protenix drop them).
_BUILT_IN = (
    (OuterProductMeanLayout(("layer_norm", "linear_1", "linear_2", "linear_out"), "openfold"),
     OpenFoldOuterProductMean, None),
    (OuterProductMeanLayout(("norm", "proj_a", "proj_b", "proj_o"), "boltz"), BoltzOuterProductMean, False),
    (OuterProductMeanLayout(("layer_norm", "proj_a", "proj_b", "out_proj"), "row"), ModelNew, True),
)


@dataclasses.dataclass(frozen=True)
class _Match:
    layout: OuterProductMeanLayout
    cls: type | None  # the built-in layout's module; None: NamedOuterProductMean
    modules: tuple[nn.Module, nn.Module, nn.Module, nn.Module]
    hidden_dim: int
    pair_dim: int
    msa_dim: int
    eps: float


def _vector(t, n: int | None = None) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and (n is None or t.shape[0] == n)


def _matrix(t, rows: int | None, cols: int | None) -> bool:
    return (isinstance(t, torch.Tensor) and t.dim() == 2 and (rows is None or t.shape[0] == rows)
            and (cols is None or t.shape[1] == cols))


def _match_layout(module: nn.Module, layout: OuterProductMeanLayout, cls: type | None = None,
                  projection_bias: bool | None = None) -> _Match | str:
    """The layout's dimensions in `module`, or why it does not have that layout."""
    names = layout.names
    found = [module._modules.get(name) for name in names]
    if any(m is None for m in found):
        return "no submodules " + ", ".join(f"`{n}`" for n, m in zip(names, found) if m is None)
    norm, first, second, out = found
    ln_w, ln_b = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if not (_vector(ln_w) and _vector(ln_b, ln_w.shape[0]) and isinstance(getattr(norm, "eps", None), float)):
        return f"`{names[0]}` is not a LayerNorm with a weight, a bias and eps over the last dim"
    C = ln_w.shape[0]
    w1, w2 = getattr(first, "weight", None), getattr(second, "weight", None)
    if not (_matrix(w1, None, C) and _matrix(w2, w1.shape[0], C)):
        return f"`{names[1]}` and `{names[2]}` are not linear layers from {C} features to the same width"
    H = w1.shape[0]
    b1, b2 = getattr(first, "bias", None), getattr(second, "bias", None)
    bias = _vector(b1, H) and _vector(b2, H)
    if not bias and not (b1 is None and b2 is None):
        return f"`{names[1]}` and `{names[2]}` do not both have a bias of {H}, nor both none"
    if projection_bias is not None and bias != projection_bias:
        return f"the projections {'lack' if projection_bias else 'have'} biases"
    w_out, b_out = getattr(out, "weight", None), getattr(out, "bias", None)
    if not (_matrix(w_out, None, H * H) and (b_out is None or _vector(b_out, w_out.shape[0]))):
        return f"`{names[3]}` is not a linear layer from {H * H} (hidden_dim squared) features"
    eps = getattr(module, "eps", None)
    eps = eps if isinstance(eps, float) else layout.eps
    if layout.normalization == "openfold" and eps is None:
        return "no float attribute `eps` (the normaliser's epsilon), and the layout gives none"
    return _Match(layout, cls, (norm, first, second, out), H, w_out.shape[0], C, 1e-3 if eps is None else float(eps))


def _matches(module: nn.Module, layouts) -> tuple[list[_Match], list[str]]:
    """The layouts `module` has (those given first, then the models' own), and why it has not the
    others."""
    found, reasons = [], []
    for layout, cls, projection_bias in [*((layout, None, None) for layout in layouts), *_BUILT_IN]:
        match = _match_layout(module, layout, cls, projection_bias)
        if isinstance(match, _Match):
            found.append(match)
        else:
            reasons.append(f"{layout.normalization} layout {layout.names}: {match}")
    return found, reasons


def _choose(module: nn.Module, layouts, verify: bool) -> tuple[_Match | None, str | None]:
    """The first layout of `module` whose check passes (the first it has, without `verify`), or
    None and why none does; (None, None) where it has none of them."""
    found, reasons = _matches(module, layouts)
    if not found:
        return None, None
    if not verify:
        return found[0], None
    failed = []
    for match in found:
        why = _verify(module, match)
        if why is None:
            return match, None
        failed.append(f"as {match.layout.normalization} layout {match.layout.names}, {why}")
    return None, "; ".join(failed)


def _flashopm_module(module: nn.Module, match: _Match) -> nn.Module:
    """The flashopm module of `match`'s layout holding `module`'s submodules."""
    if match.cls is None:
        new = NamedOuterProductMean(dict(zip(match.layout.names, match.modules)), match.layout.normalization,
                                    match.eps)
    else:
        new = match.cls.__new__(match.cls)
        nn.Module.__init__(new)  # no parameters of its own: the old module's are adopted below
        if match.cls is OpenFoldOuterProductMean:
            new.eps, new.c_z, new.c_hidden = match.eps, match.pair_dim, match.hidden_dim
        elif match.cls is BoltzOuterProductMean:
            new.c_hidden = match.hidden_dim
        for name, sub in zip(match.layout.names, match.modules):
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
    probe_match = _match_layout(probe, match.layout, match.cls)
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
        return (f"its output differs from the {match.layout.normalization} normalisation's by {err:.2e} "
                f"(normwise, relative; at most {VERIFY_TOLERANCE:.0e} allowed)")
    return None


def _as_layouts(layouts) -> tuple[OuterProductMeanLayout, ...]:
    layouts = (layouts,) if isinstance(layouts, OuterProductMeanLayout) else tuple(layouts or ())
    for layout in layouts:
        if not isinstance(layout, OuterProductMeanLayout):
            raise TypeError(f"flashopm: layouts must be OuterProductMeanLayout objects, got {type(layout).__name__}")
    return layouts


def convert_outer_product_mean(module: nn.Module, *, layouts=(), verify: bool = True) -> nn.Module:
    """The flashopm module computing what `module` computes, holding `module`'s submodules (and so
    its parameters, on their device and in their dtype).

    `module` is laid out as one of `layouts` (OuterProductMeanLayout objects, tried first) or as
    OpenFold's, Boltz's or the specification's Outer-Product Mean (see the module docstring).
    With `verify`, its forward is compared with the flashopm module's on a small float64 problem
    with random parameters first (on a copy: `module` is untouched), and the first layout that
    agrees is taken.  Raises ValueError, saying why, where no layout matches or none agrees.
    """
    if isinstance(module, _FLASHOPM_MODULES):
        return module
    layouts = _as_layouts(layouts)
    match, why = _choose(module, layouts, verify)
    if match is None:
        if why is None:
            raise ValueError(f"{type(module).__name__} is not laid out as an Outer-Product Mean flashopm knows "
                             f"({'; '.join(_matches(module, layouts)[1])})")
        raise ValueError(f"{type(module).__name__} has an Outer-Product Mean's layout but its output does not agree: "
                         f"{why}")
    return _flashopm_module(module, match)


def replace_outer_product_means(model: nn.Module, *, layouts=(), verify: bool = True) -> list[str]:
    """Replaces, in place, every submodule of `model` laid out as an Outer-Product Mean (as one of
    `layouts`, or as OpenFold's, Boltz's or the specification's) by the flashopm module of its
    normalisation, which holds the old module's submodules and parameters.  Returns the qualified
    names replaced.

    With `verify` (the default) each candidate is checked first (see `convert_outer_product_mean`);
    one whose forward agrees with none of its layouts is left in place with a warning.  Modules
    already flashopm's are left as they are, so a second call replaces nothing.  `model` itself is
    not replaced: use `convert_outer_product_mean` for a lone module.
    """
    layouts = _as_layouts(layouts)
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
                match, why = _choose(child, layouts, verify)
                if why is not None:
                    warnings.warn(f"flashopm: {qualified} ({type(child).__name__}) left in place: it has an "
                                  f"Outer-Product Mean's layout but its output does not agree: {why}", stacklevel=3)
                converted[id(child)] = None if match is None else _flashopm_module(child, match)
            new = converted[id(child)]
            if new is None:
                walk(child, qualified + ".")
            else:
                parent._modules[name] = new
                replaced.append(qualified)

    walk(model, "")
    return replaced
