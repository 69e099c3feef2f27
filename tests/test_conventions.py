"""The OpenFold and Boltz normalisations and their modules: checkpoints' parameter names, the
models' forward signatures, parity with the pure-PyTorch references of each model's math (and
their chunked forms), autograd; and the CUDA kernels against float64 for every contraction order."""
import pytest
import torch

import flashopm
from conftest import flashopm_kernels, poison_output_block, requires_cuda
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


# ---- the pair mask counts sum_s m[s, i] m[s, j] (torch.ops.flashopm._pair_counts) ----
# The default form runs on tensor cores (16-bit operands, float32 mask values as three bfloat16
# pieces); FLASHOPM_PAIR_COUNT_MMA=0 takes the float32 FMA kernel.

PAIR_KINDS = ["float", "float_wide", "float01", "bool", "half", "bfloat16"]
PAIR_N = [1, 7, 63, 64, 65, 129, 300]
PAIR_S = [1, 3, 31, 32, 33, 100]


def _pair_mask(kind, B, S, N, seed):
    """A (B, S, N) mask on the GPU: "float" fractions of full float32 precision in (0, 1) with zeros
    and ones, "float_wide" the same scaled by 2^-20 .. 2^20, "float01" 0/1 in float32, "bool", and
    "half" / "bfloat16" fractions of those types with zeros and ones."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(B, S, N, generator=g, dtype=torch.float64)
    v = torch.rand(B, S, N, generator=g)
    if kind == "bool":
        return (u < 0.6).cuda()
    if kind == "float01":
        return (u < 0.6).float().cuda()
    m = torch.where(u < 0.25, 0.0, torch.where(u > 0.75, 1.0, v.double())).float()
    if kind == "float_wide":
        m = m * torch.exp2(torch.randint(-20, 21, (B, S, N), generator=g).float())
    dtype = {"float": torch.float32, "float_wide": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
    return m.to(dtype[kind]).cuda()


def _pair_call(mask, rows, row0):
    return torch.ops.flashopm._pair_counts(mask, rows, row0)


def _check_pair_counts(out, mask, rows, row0):
    """out against float64: equal where the mask holds only 0 and 1 (integer sums, exact in float32),
    else within float32's rounding of a sum of S exact products, |err| <= (S + 8)·2^-23·sum_s |m_i m_j|
    (the float32 split's products below float32's last place left out included)."""
    m = mask.double()
    ref = torch.einsum("bsi,bsj->bij", m[:, :, row0:row0 + rows], m)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert not out.isnan().any(), "NaN in the counts: an element was not written"
    if bool(((m == 0) | (m == 1)).all()):
        assert torch.equal(out.double(), ref), (out.double() - ref).abs().max().item()
        return
    ma = m.abs()
    scale = torch.einsum("bsi,bsj->bij", ma[:, :, row0:row0 + rows], ma)
    err = (out.double() - ref).abs()
    bound = (mask.shape[1] + 8) * 2.0 ** -23 * scale
    assert bool((err <= bound).all()), f"worst error {(err / scale.clamp_min(1e-300)).max().item():.3g} of the scale"


def _checked_pair_counts(mask, rows, row0):
    """The counts into a NaN-poisoned block (checked to be reused), checked against float64, and the
    same bits on a second call."""
    poison_ptr = poison_output_block(lambda: _pair_call(mask, rows, row0))
    out = _pair_call(mask, rows, row0)
    assert out.data_ptr() == poison_ptr, "the NaN-poisoned block was not reused; the check proves nothing"
    _check_pair_counts(out, mask, rows, row0)
    assert torch.equal(out, _pair_call(mask, rows, row0)), "two identical calls differ: a race"
    return out


@requires_cuda
@pytest.mark.parametrize("N", PAIR_N)
@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_pair_counts_against_fp64(kind, N, monkeypatch):
    """Every S of PAIR_S and B in {1, 2}, all rows and a band of them, in both forms; for masks of
    0 and 1 both forms give the same (exact) counts."""
    flashopm.load()
    for S in PAIR_S:
        for B in (1, 2):
            mask = _pair_mask(kind, B, S, N, seed=N * 1000 + S * 10 + B)
            for rows, row0 in ((N, 0), (max(N // 3, 1), N // 2)):
                monkeypatch.delenv("FLASHOPM_PAIR_COUNT_MMA", raising=False)
                out = _checked_pair_counts(mask, rows, row0)
                monkeypatch.setenv("FLASHOPM_PAIR_COUNT_MMA", "0")
                fma = _checked_pair_counts(mask, rows, row0)
                if kind in ("float01", "bool"):
                    assert torch.equal(out, fma), (S, B, rows, row0)


@requires_cuda
@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_pair_counts_of_mask_views(kind):
    """Masks that are views (transposed storage, a misaligned start, every other s or n, a batch
    broadcast by a zero stride): the same bits as the contiguous copy, whose loads take other paths
    (element by element here) but whose sums are the same."""
    flashopm.load()
    B, S, N = 2, 37, 131
    full = _pair_mask(kind, B, 2 * S + 1, 2 * N + 3, seed=5)
    views = {
        "transposed": full[:, :S, :N].transpose(1, 2).contiguous().transpose(1, 2),
        "offset": full[:, :S, 1:N + 1],
        "every_other_s": full[:, 1::2, :N],
        "every_other_n": full[:, :S, ::2][:, :, :N],
        "broadcast_batch": full[:1, :S, :N].expand(B, S, N),
    }
    for name, view in views.items():
        for rows, row0 in ((view.shape[2], 0), (50, 3), (1, view.shape[2] - 1)):
            out = _checked_pair_counts(view, rows, row0)
            assert torch.equal(out, _pair_call(view.contiguous(), rows, row0)), name


def _bounded_bands(N, S, C, H, D):
    """(r0, rows) of the bands the peak bound 1.1 plans for OpenFold's convention in float32 (the
    planner's query as tests/test_peak_plan.py makes it), or one band of every row."""
    out_bytes = N * N * D * 4
    ab_room = int(0.09 * out_bytes) - (D * H * H + D) * 4 - (N + D) * 4 - (64 << 10) - N * 4
    raw = torch.ops.flashopm._peak_band_plan(torch.empty(0), N, S, C, H, D, 32, 4, 4, 4, ab_room, N * 4,
                                             max(128 // H, 1), max(256 // H, 1), 132, 0.064, 7)
    if not raw:
        return [(0, N)]
    return [(raw[3 + 5 * k], raw[4 + 5 * k]) for k in range(raw[2])]


@requires_cuda
@pytest.mark.parametrize("kind", ["float", "bool", "bfloat16"])
def test_pair_counts_of_bands(kind):
    """The bands of rows the bounded path takes (from its planner) and awkward ones: each band's
    counts are the whole's rows bit for bit (a row's sums do not depend on its block)."""
    flashopm.load()
    for N, S in ((509, 256), (257, 333), (300, 100)):
        mask = _pair_mask(kind, 1, S, N, seed=N + S)
        whole = _checked_pair_counts(mask, N, 0)
        bands = _bounded_bands(N, S, 64, 32, 128) + [(0, 1), (N - 1, 1), (13, 37), (200, min(100, N - 200)), (5, N - 5)]
        for r0, rows in bands:
            band = _checked_pair_counts(mask, rows, r0)
            assert torch.equal(band, whole[:, r0:r0 + rows]), (N, r0, rows)


@requires_cuda
@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_pair_count_form_switch(kind, monkeypatch):
    """The default form runs on tensor cores (where the GPU has them: compute capability 8.0 on),
    FLASHOPM_PAIR_COUNT_MMA=0 takes the FMA kernel, and the two agree within rounding at (1, 512,
    1536)'s depth."""
    flashopm.load()
    mask = _pair_mask(kind, 1, 512, 300, seed=3)
    names = flashopm_kernels(lambda: _pair_call(mask, 300, 0))
    if torch.cuda.get_device_capability() >= (8, 0):
        assert any("opm_pair_count_mma_kernel" in k for k in names), names
    out = _checked_pair_counts(mask, 300, 0)
    monkeypatch.setenv("FLASHOPM_PAIR_COUNT_MMA", "0")
    names = flashopm_kernels(lambda: _pair_call(mask, 300, 0))
    assert any("opm_pair_count_kernel" in k for k in names) and not any("mma" in k for k in names), names
    fma = _checked_pair_counts(mask, 300, 0)
    if kind in ("float01", "bool"):
        assert torch.equal(out, fma)


@requires_cuda
@pytest.mark.parametrize("normalization", ["openfold", "boltz"])
@pytest.mark.parametrize("mask_kind", ["bool", "masked_positions"])
def test_conventions_with_either_pair_count_form(normalization, mask_kind, monkeypatch):
    """The op on the outer-first path, under the peak bound (bands that carry their own counts) and
    its gradients, with each form of the pair counts: the same bits for a 0/1 mask, within
    rounding for a fractional one, both against float64."""
    shape = Shape(1, 1024, 256, 64, 32, 128)
    x, m, p = make_problem(shape, mask_kind, seed=21)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    code = flashopm.ops.NORMALIZATIONS[normalization]
    ref64 = reference(xc, mc, pc, dtype=torch.float64, normalization=code).cpu()
    ref32 = reference(xc, mc, pc, normalization=code).cpu()
    g = torch.randn(shape.B, shape.N, shape.N, shape.D, generator=torch.Generator().manual_seed(2)).cuda()
    names = ["msa_repr", *PARAM_ORDER]

    def run():
        out = flashopm.outer_product_mean(xc, mc, *(pc[k] for k in PARAM_ORDER), algorithm="outer",
                                          normalization=normalization).cpu()
        with flashopm.peak_memory_bound(1.1):
            bounded = flashopm.outer_product_mean(xc, mc, *(pc[k] for k in PARAM_ORDER), algorithm="outer",
                                                  normalization=normalization).cpu()
        leaves = {"msa_repr": xc.clone().requires_grad_(), **{k: v.clone().requires_grad_() for k, v in pc.items()}}
        y = flashopm.outer_product_mean(leaves["msa_repr"], mc, *(leaves[k] for k in PARAM_ORDER),
                                        normalization=normalization)
        grads = torch.autograd.grad(y, [leaves[k] for k in names if leaves[k] is not None], g)
        return [out, bounded, *(t.cpu() for t in grads)]

    mma = run()
    monkeypatch.setenv("FLASHOPM_PAIR_COUNT_MMA", "0")
    fma = run()
    for out in (mma[0], mma[1], fma[0], fma[1]):
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
        err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
        assert err <= max(2 * err_eager, 4 * torch.finfo(torch.float32).eps), f"{err:.3g} vs eager {err_eager:.3g}"
    for i, (a, b) in enumerate(zip(mma, fma)):
        if mask_kind == "bool":
            assert torch.equal(a, b)
        elif i < 2:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        else:
            # gradients: sums over every (s, n) of terms divided by the counts, where the forms'
            # last-place differences in the counts add up (each form's counts are held to float64
            # in test_pair_counts_against_fp64)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
