"""ModelNew: construction, weights, state dicts and the CPU path."""
import pytest
import torch

import flashopm
from flashopm.testing import MASK_KINDS, Shape, make_problem, reference


def _params_of(model):
    return {
        "ln_weight": model.layer_norm.weight, "ln_bias": model.layer_norm.bias,
        "w_a": model.proj_a.weight, "b_a": model.proj_a.bias,
        "w_b": model.proj_b.weight, "b_b": model.proj_b.bias,
        "w_out": model.out_proj.weight, "b_out": model.out_proj.bias,
    }


@pytest.mark.parametrize("seed", [0, 1, 42])
@pytest.mark.parametrize("init", [[64, 64, 32], [17, 3, 5], [1, 1, 1]])
def test_seeded_construction_gives_identical_state_dicts(seed, init):
    torch.manual_seed(seed)
    ref = flashopm.Model(*init)
    after_ref = torch.rand(1)
    torch.manual_seed(seed)
    new = flashopm.ModelNew(*init)
    after_new = torch.rand(1)
    sd_ref, sd_new = ref.state_dict(), new.state_dict()
    assert list(sd_ref) == list(sd_new)
    for k in sd_ref:
        assert torch.equal(sd_ref[k], sd_new[k]), k
    assert torch.equal(after_ref, after_new), "ModelNew must draw from the RNG exactly like Model"


def test_state_dict_loads_both_ways():
    torch.manual_seed(0)
    ref = flashopm.Model(8, 4, 3)
    torch.manual_seed(1)
    new = flashopm.ModelNew(8, 4, 3)
    new.load_state_dict(ref.state_dict())
    x, m, _ = make_problem(Shape(1, 2, 3, 8, 3, 4), "fractional")
    assert torch.equal(new(x, m), ref(x, m))
    torch.manual_seed(2)
    ref2 = flashopm.Model(8, 4, 3)
    ref2.load_state_dict(new.state_dict())
    assert torch.equal(ref2(x, m), ref(x, m))


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_cpu_path_equals_reference(mask_kind):
    torch.manual_seed(0)
    model = flashopm.ModelNew(17, 6, 5)
    x, m, _ = make_problem(Shape(2, 3, 7, 17, 5, 6), mask_kind, seed=4)
    expect = reference(x, m, _params_of(model))
    assert torch.equal(model(x, m), expect)


@pytest.mark.parametrize("algorithm", sorted(flashopm.ops.ALGORITHMS))
def test_cpu_path_accepts_every_algorithm(algorithm):
    """The algorithm only picks a CUDA kernel; on the CPU every name gives the reference."""
    torch.manual_seed(0)
    model = flashopm.ModelNew(8, 4, 8)
    x, m, _ = make_problem(Shape(1, 3, 5, 8, 8, 4), "fractional", seed=2)
    p = _params_of(model)
    out = flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"],
                                      p["w_out"], p["b_out"], algorithm=algorithm)
    assert torch.equal(out, reference(x, m, p))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_path_half_precision_returns_that_type(dtype):
    torch.manual_seed(0)
    model = flashopm.ModelNew(8, 4, 8).to(dtype)
    x, m, _ = make_problem(Shape(1, 3, 5, 8, 8, 4), "binary", seed=3)
    out = model(x.to(dtype), m.to(dtype))
    assert out.dtype == dtype
    assert torch.equal(out, reference(x.to(dtype), m.to(dtype), _params_of(model)))


def test_cpu_path_float64_and_noncontiguous():
    torch.manual_seed(0)
    model = flashopm.ModelNew(6, 4, 3).double()
    x = torch.randn(2, 5, 3, 6, dtype=torch.float64).transpose(1, 2)  # (B, S=3, N=5, C) view
    m = torch.rand(2, 5, 3, 2, dtype=torch.float64)[..., 0].transpose(1, 2)
    out = model(x, m)
    assert out.dtype == torch.float64 and out.is_contiguous()
    assert torch.equal(out, reference(x.contiguous(), m.contiguous(), _params_of(model)))


@pytest.mark.parametrize("B,S,N", [(0, 3, 4), (2, 0, 4), (2, 3, 0)])
def test_empty_sizes_behave_like_reference(B, S, N):
    torch.manual_seed(0)
    model = flashopm.ModelNew(5, 4, 3)
    x, m = torch.randn(B, S, N, 5), torch.ones(B, S, N)
    out = model(x, m)
    expect = reference(x, m, _params_of(model))
    assert out.shape == expect.shape == (B, N, N, 4)
    assert torch.equal(out, expect)


def test_nan_and_inf_propagate_like_reference():
    torch.manual_seed(0)
    model = flashopm.ModelNew(8, 4, 3)
    x, m, _ = make_problem(Shape(1, 3, 5, 8, 3, 4), "binary", seed=2)
    x[0, 1, 2, 3] = float("nan")
    x[0, 2, 4, 0] = float("inf")
    out, expect = model(x, m), reference(x, m, _params_of(model))
    assert torch.equal(out.isnan(), expect.isnan())
    assert out.isnan().any()


def test_parametrized_submodule_uses_its_effective_weight():
    """Parameters that are not plain registry entries (a parametrization) are still honoured."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    model = flashopm.ModelNew(6, 5, 3)
    ref = flashopm.Model(6, 5, 3)
    ref.load_state_dict(model.state_dict())
    parametrize.register_parametrization(model.out_proj, "weight", Double())
    with torch.no_grad():
        ref.out_proj.weight.mul_(2)
    x, m = torch.randn(2, 4, 7, 6), (torch.rand(2, 4, 7) > 0.3).float()
    torch.testing.assert_close(model(x, m), ref(x, m))
