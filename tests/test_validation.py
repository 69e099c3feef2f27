"""Bad input gets a clear error naming the argument, expected vs got, on every device."""
import os

import pytest
import torch

import flashopm
from conftest import requires_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _model(device):
    torch.manual_seed(0)
    return flashopm.ModelNew(8, 4, 3).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "x_shape,m_shape,pattern",
    [
        ((2, 3, 5), (2, 3, 5), r"msa_repr must have shape \(B, S, N, msa_dim\), got 3 dims"),
        ((2, 3, 5, 8), (2, 3), r"msa_mask must have shape \(B, S, N\), got 2 dims"),
        ((2, 3, 5, 8), (2, 3, 6), r"msa_mask must have shape \(B, S, N\) = \(2, 3, 5\).*got .*6"),
        ((2, 3, 5, 8), (1, 3, 5), r"msa_mask must have shape \(B, S, N\) = \(2, 3, 5\)"),
        ((2, 3, 5, 7), (2, 3, 5), r"layer_norm weight must have shape \[7\], got \[8\]"),
    ],
)
def test_shape_errors(device, x_shape, m_shape, pattern):
    model = _model(device)
    with pytest.raises((ValueError, RuntimeError), match=pattern):
        model(torch.randn(*x_shape, device=device), torch.ones(*m_shape, device=device))


@requires_cuda
def test_device_mismatch():
    model = _model("cuda")
    with pytest.raises((ValueError, RuntimeError), match="msa_mask is on cpu but msa_repr is on cuda"):
        model(torch.randn(1, 2, 3, 8, device="cuda"), torch.ones(1, 2, 3))
    with pytest.raises((ValueError, RuntimeError), match="is on cpu but msa_repr is on cuda"):
        _model("cpu")(torch.randn(1, 2, 3, 8, device="cuda"), torch.ones(1, 2, 3, device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_dtype_errors(device):
    model = _model(device)
    x = torch.randn(1, 2, 3, 8, device=device)
    with pytest.raises((ValueError, RuntimeError), match="msa_mask must be .*got torch.int64|msa_mask must be .*got Long"):
        model(x, torch.ones(1, 2, 3, dtype=torch.int64, device=device))
    with pytest.raises((ValueError, RuntimeError), match="must have dtype .*like msa_repr|msa_repr must be"):
        model(x.double(), torch.ones(1, 2, 3, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_float32_x_goes_with_16_bit_parameters_only(device):
    """msa_repr has the parameters' type, or is float32 beside 16-bit parameters (the op then
    computes in theirs, as in a mixed-precision region); other pairs are named."""
    x = torch.randn(1, 2, 3, 8, device=device)
    m = torch.ones(1, 2, 3, device=device)
    assert _model(device).to(torch.bfloat16)(x, m).dtype == torch.bfloat16
    with pytest.raises((ValueError, RuntimeError), match="must have dtype torch.bfloat16 like proj_a weight, got "
                                                         "torch.float32|must have dtype BFloat16 like proj_a weight, got Float"):
        model = _model(device).to(torch.bfloat16)
        model.out_proj.float()
        model(x, m)
    with pytest.raises((ValueError, RuntimeError), match="must have dtype .*like msa_repr"):
        _model(device).to(torch.bfloat16)(x.half(), m)
    with pytest.raises((ValueError, RuntimeError), match="must have dtype .*like msa_repr"):
        _model(device).double()(x, m)


@requires_cuda
def test_cuda_rejects_unsupported_msa_dtype():
    model = _model("cuda").double()
    with pytest.raises(RuntimeError, match="msa_repr must be float32, bfloat16 or float16 on CUDA, got Double"):
        model(torch.randn(1, 2, 3, 8, device="cuda", dtype=torch.double), torch.ones(1, 2, 3, device="cuda"))


def test_hidden_dim_limit_is_explicit():
    if not torch.cuda.is_available():
        pytest.skip("the hidden-size limit is a CUDA-kernel limit")
    model = flashopm.ModelNew(8, 4, 65).cuda()
    with pytest.raises(RuntimeError, match=r"hidden_dim must be in \[1, 64\], got 65"):
        model(torch.randn(1, 2, 3, 8, device="cuda"), torch.ones(1, 2, 3, device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_algorithm(device):
    model = _model(device)
    x = torch.randn(1, 2, 3, 8, device=device)
    m = torch.ones(1, 2, 3, device=device)
    with pytest.raises(ValueError, match="algorithm must be one of .*got 'fastest'"):
        flashopm.outer_product_mean(x, m, *[None] * 8, algorithm="fastest")
    p = [model.layer_norm.weight, model.layer_norm.bias, model.proj_a.weight, model.proj_a.bias,
         model.proj_b.weight, model.proj_b.bias, model.out_proj.weight, model.out_proj.bias]
    with pytest.raises((ValueError, RuntimeError), match="algorithm must be 0 .* got 7"):
        torch.ops.flashopm.outer_product_mean(x, m, p[0], p[1], 1e-5, *p[2:], 7)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_precision(device):
    model = _model(device)
    x = torch.randn(1, 2, 3, 8, device=device)
    m = torch.ones(1, 2, 3, device=device)
    p = [model.layer_norm.weight, model.layer_norm.bias, model.proj_a.weight, model.proj_a.bias,
         model.proj_b.weight, model.proj_b.bias, model.out_proj.weight, model.out_proj.bias]
    with pytest.raises(ValueError, match="precision must be one of .*got 'exact'"):
        flashopm.outer_product_mean(x, m, *p, precision="exact")
    with pytest.raises((ValueError, RuntimeError), match=r"precision must be -1 \(PyTorch's setting\).* got 3"):
        torch.ops.flashopm.outer_product_mean(x, m, p[0], p[1], 1e-5, *p[2:], 0, 0, 1e-3, 3)
    for precision in ("highest", "high", "medium", None):  # every valid value is accepted
        out = flashopm.outer_product_mean(x, m, *p, precision=precision)
        assert out.shape == (1, 3, 3, 4)


@pytest.mark.parametrize("factor", [1.0, 0.5, float("nan"), -1.1])
def test_peak_memory_bound_refuses_a_factor_below_its_floor(factor, monkeypatch):
    monkeypatch.delenv("FLASHOPM_PEAK_BOUND", raising=False)
    with pytest.raises(ValueError, match=r"peak_memory_bound's factor must be >= 1.02"):
        with flashopm.peak_memory_bound(factor):
            pass
    assert "FLASHOPM_PEAK_BOUND" not in os.environ


def test_peak_memory_bound_sets_and_restores_the_setting(monkeypatch):
    """The bound holds inside its block (nested blocks too, None lifting it) and what was set before
    comes back after, also when the block raises."""
    monkeypatch.setenv("FLASHOPM_PEAK_BOUND", "1.5")
    with flashopm.peak_memory_bound(1.1):
        assert float(os.environ["FLASHOPM_PEAK_BOUND"]) == 1.1
        with flashopm.peak_memory_bound(None):
            assert "FLASHOPM_PEAK_BOUND" not in os.environ
        assert float(os.environ["FLASHOPM_PEAK_BOUND"]) == 1.1
    assert os.environ["FLASHOPM_PEAK_BOUND"] == "1.5"
    with pytest.raises(KeyError):
        with flashopm.peak_memory_bound(2):
            raise KeyError("inside")
    assert os.environ["FLASHOPM_PEAK_BOUND"] == "1.5"
