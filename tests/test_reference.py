"""The reference module is the specification's, and the functional reference computes it exactly."""
import importlib.util
from pathlib import Path

import pytest
import torch

import flashopm
from flashopm.testing import Shape, make_problem, reference

REPO = Path(__file__).resolve().parents[1]
SPEC_CANDIDATES = [REPO.parent / "shared" / "spec" / "seed_model.py", REPO / "shared" / "spec" / "seed_model.py"]


def _load_spec():
    for path in SPEC_CANDIDATES:
        if path.exists():
            spec = importlib.util.spec_from_file_location("seed_model", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    pytest.skip("the specification file is not beside this checkout")


def test_reference_model_matches_specification_bitwise():
    spec = _load_spec()
    assert spec.get_init_inputs() == flashopm.get_init_inputs()
    for seed in range(3):
        torch.manual_seed(seed)
        ref = spec.Model(*spec.get_init_inputs())
        torch.manual_seed(seed)
        ours = flashopm.Model(*flashopm.get_init_inputs())
        torch.manual_seed(100 + seed)
        x, m = spec.get_inputs()
        torch.manual_seed(100 + seed)
        x2, m2 = flashopm.get_inputs()
        assert torch.equal(x, x2) and torch.equal(m, m2)
        m = (torch.rand_like(m) < 0.5).float() * torch.rand_like(m)
        assert torch.equal(ref(x, m), ours(x, m))


@pytest.mark.parametrize("mask_kind", ["ones", "fractional", "masked_positions", "bool"])
def test_functional_reference_matches_module(mask_kind):
    torch.manual_seed(0)
    model = flashopm.Model(17, 5, 6)
    shape = Shape(2, 3, 7, 17, 6, 5)
    x, m, _ = make_problem(shape, mask_kind, seed=1)
    p = {
        "ln_weight": model.layer_norm.weight, "ln_bias": model.layer_norm.bias,
        "w_a": model.proj_a.weight, "b_a": model.proj_a.bias,
        "w_b": model.proj_b.weight, "b_b": model.proj_b.bias,
        "w_out": model.out_proj.weight, "b_out": model.out_proj.bias,
    }
    assert torch.equal(reference(x, m, p), model(x, m))


def test_denominator_counts_position_i_only_and_bias_after_division():
    """A hand-computed case pins down the spec's normalisation quirks."""
    shape = Shape(1, 2, 2, 3, 1, 1)
    x, _, p = make_problem(shape, seed=3)
    m = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # i=0 seen once, i=1 never
    out = reference(x, m, p, dtype=torch.float64)
    xd = torch.nn.functional.layer_norm(x.double(), (3,), p["ln_weight"].double(), p["ln_bias"].double())
    a = (xd @ p["w_a"].double().T + p["b_a"].double()) * m.double()[..., None]
    b = (xd @ p["w_b"].double().T + p["b_b"].double()) * m.double()[..., None]
    outer = torch.einsum("bsih,bsjk->bij", a, b)  # H = 1
    denom = torch.tensor([1.0, 1.0]).double()  # max(1, 1) and max(0, 1)
    expect = (outer / denom[None, :, None])[..., None] * p["w_out"].double()[0, 0] + p["b_out"].double()
    torch.testing.assert_close(out, expect)
    assert torch.allclose(out[0, 1], p["b_out"].double().expand(2, 1))  # fully masked i: bias only
