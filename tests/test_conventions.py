"""The OpenFold and Boltz normalisations and their modules: checkpoints' parameter names, the
models' forward signatures, parity with the pure-PyTorch references of each model's math (and
their chunked forms), autograd; and the CUDA kernels against float64 for every contraction order."""
import pytest
import torch

import flashopm
from conftest import poison_output_block, requires_cuda
from flashopm.testing import PARAM_ORDER, Shape, make_problem, reference, rel_error


def openfold_forward(module, m, mask, eps):
    ref = flashopm.OpenFoldOuterProductMeanReference(1, 1, 1, eps=eps, projection_bias=module.linear_1.bias is not None)
    ref.layer_norm, ref.linear_1, ref.linear_2, ref.linear_out = (
        module.layer_norm, module.linear_1, module.linear_2, module.linear_out)
    return ref(m, mask)


def boltz_forward(module, m, mask):
    ref = flashopm.BoltzOuterProductMeanReference(1, module.c_hidden, 1)
    ref.norm, ref.proj_a, ref.proj_b, ref.proj_o = module.norm, module.proj_a, module.proj_b, module.proj_o
    return ref(m, mask)


def _mask(shape, seed):
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(shape, generator=g) < 0.7).float()
    m[..., 0] = 0.0                 # a residue masked in every sequence: fully masked row and column
    m[..., 1, :] = 0.0              # a fully masked sequence
    return m


def test_openfold_state_dict_matches_the_checkpoint_layout():
    mod = flashopm.OpenFoldOuterProductMean(c_m=16, c_z=8, c_hidden=4)
    shapes = {k: tuple(v.shape) for k, v in mod.state_dict().items()}
    assert shapes == {
        "layer_norm.weight": (16,), "layer_norm.bias": (16,),
        "linear_1.weight": (4, 16), "linear_1.bias": (4,),
        "linear_2.weight": (4, 16), "linear_2.bias": (4,),
        "linear_out.weight": (8, 16), "linear_out.bias": (8,),
    }
    assert not mod.linear_out.weight.any() and not mod.linear_out.bias.any()  # "final" init
    bare = flashopm.OpenFoldOuterProductMean(16, 8, 4, projection_bias=False)
    assert set(bare.state_dict()) == set(shapes) - {"linear_1.bias", "linear_2.bias"}


def test_boltz_state_dict_matches_the_checkpoint_layout():
    mod = flashopm.BoltzOuterProductMean(c_in=16, c_hidden=4, c_out=8)
    shapes = {k: tuple(v.shape) for k, v in mod.state_dict().items()}
    assert shapes == {
        "norm.weight": (16,), "norm.bias": (16,), "proj_a.weight": (4, 16), "proj_b.weight": (4, 16),
        "proj_o.weight": (8, 16), "proj_o.bias": (8,),
    }
    assert not mod.proj_o.weight.any() and not mod.proj_o.bias.any()


@pytest.mark.parametrize("batch", [(), (2,), (2, 3)], ids=str)
@pytest.mark.parametrize("projection_bias", [True, False])
def test_openfold_module_matches_its_math(batch, projection_bias):
    torch.manual_seed(0)
    mod = flashopm.OpenFoldOuterProductMean(12, 5, 3, eps=1e-3, projection_bias=projection_bias)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.4)
    m = torch.randn(*batch, 4, 7, 12)
    mask = _mask((*batch, 4, 7), seed=1)
    out = mod(m, mask, chunk_size=4, inplace_safe=True)
    assert out.shape == (*batch, 7, 7, 5)
    torch.testing.assert_close(out, openfold_forward(mod, m, mask, 1e-3), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mod(m), openfold_forward(mod, m, torch.ones(*batch, 4, 7), 1e-3), rtol=1e-4,
                               atol=1e-4)


def test_boltz_module_matches_its_math():
    torch.manual_seed(0)
    mod = flashopm.BoltzOuterProductMean(12, 3, 5)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.4)
    m = torch.randn(2, 4, 7, 12)
    for mask in (_mask((2, 4, 7), seed=2), _mask((2, 4, 7), seed=3).bool()):
        out = mod(m, mask, chunk_size=2)
        torch.testing.assert_close(out, boltz_forward(mod, m, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("normalization", ["openfold", "boltz"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gradcheck_float64_cpu(normalization, with_bias):
    x, m, p = make_problem(Shape(2, 3, 5, 6, 3, 4), "masked_positions", seed=11)
    x = x.double().requires_grad_()
    p = {k: v.double().requires_grad_() for k, v in p.items()}
    names = [k for k in PARAM_ORDER if with_bias or not k.startswith("b_")]

    def f(x, *params):
        q = dict.fromkeys(PARAM_ORDER)
        q.update(zip(names, params))
        return flashopm.outer_product_mean(x, m.double(), *(q[k] for k in PARAM_ORDER), normalization=normalization)

    assert torch.autograd.gradcheck(f, (x, *(p[k] for k in names)))


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_chunked_references_match_unchunked(chunk):
    torch.manual_seed(0)
    of = flashopm.OpenFoldOuterProductMeanReference(12, 5, 6)
    bz = flashopm.BoltzOuterProductMeanReference(12, 6, 5)
    m = torch.randn(2, 4, 7, 12)
    mask = _mask((2, 4, 7), seed=5)
    torch.testing.assert_close(of(m, mask, chunk_size=chunk), of(m, mask))
    torch.testing.assert_close(bz(m, mask, chunk_size=chunk), bz(m, mask))


def test_reference_state_dicts_equal_the_modules():
    assert set(flashopm.OpenFoldOuterProductMeanReference(8, 4, 3).state_dict()) == set(
        flashopm.OpenFoldOuterProductMean(8, 4, 3).state_dict())
    assert set(flashopm.BoltzOuterProductMeanReference(8, 3, 4).state_dict()) == set(
        flashopm.BoltzOuterProductMean(8, 3, 4).state_dict())


def test_bad_normalization():
    x, m, p = make_problem(Shape(1, 2, 3, 4, 2, 3), "ones")
    with pytest.raises(ValueError, match="normalization must be one of"):
        flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), normalization="mean")
    with pytest.raises((ValueError, RuntimeError), match="normalization must be 0 .* got 5"):
        torch.ops.flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], 1e-5, p["w_a"], p["b_a"], p["w_b"],
                                              p["b_b"], p["w_out"], p["b_out"], 0, 5, 1e-3)


# ---- CUDA ----

CUDA_SHAPES = [
    Shape(2, 8, 32, 64, 32, 64),     # spec: single launch
    Shape(1, 3, 7, 17, 8, 13),       # ragged, single launch
    Shape(1, 16, 70, 32, 32, 64),    # every algorithm applies
    Shape(1, 128, 33, 64, 32, 128),  # outer-first by default
    Shape(1, 2, 97, 24, 8, 10),      # project-first territory (small S)
]


@requires_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("normalization", ["openfold", "boltz"])
@pytest.mark.parametrize("algorithm", ["auto", "outer", "project", "single"])
def test_cuda_conventions_against_fp64(shape, normalization, algorithm):
    x, m, p = make_problem(shape, "masked_positions", seed=13)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    code = flashopm.ops.NORMALIZATIONS[normalization]
    ref64 = reference(xc, mc, pc, dtype=torch.float64, normalization=code).cpu()
    ref32 = reference(xc, mc, pc, normalization=code).cpu()
    def call():
        return flashopm.outer_product_mean(xc, mc, *(pc[k] for k in PARAM_ORDER), algorithm=algorithm,
                                           normalization=normalization)

    try:
        poison_ptr = poison_output_block(call)
        out = call()
    except RuntimeError as exc:
        if algorithm == "single" and "does not fit" in str(exc):
            pytest.skip("the single-launch kernel does not fit this problem")
        raise
    assert out.data_ptr() == poison_ptr, "the NaN-poisoned block was not reused; the check proves nothing"
    out = out.cpu()
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, 4 * torch.finfo(torch.float32).eps), f"{err:.3g} vs eager {err_eager:.3g}"


@requires_cuda
def test_cuda_modules_match_the_cpu():
    torch.manual_seed(0)
    of = flashopm.OpenFoldOuterProductMean(24, 16, 8)
    bz = flashopm.BoltzOuterProductMean(24, 8, 16)
    for mod in (of, bz):
        with torch.no_grad():
            for p in mod.parameters():
                p.normal_(0.0, 0.3)
    m = torch.randn(2, 6, 19, 24)
    mask = _mask((2, 6, 19), seed=4)
    for mod in (of, bz):
        expect = mod(m, mask)
        got = mod.cuda()(m.cuda(), mask.cuda()).cpu()
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
        mod.cpu()
