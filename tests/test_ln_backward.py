"""The backward through LayerNorm, both projections and the mask inside
flashopm::outer_product_mean_backward on CUDA (the projections recomputed by one launch, the
gradients taken back by opm_ln_backward_kernel and its reduction):

    grad_xn = (grad_a * m) W_a + (grad_b * m) W_b
    grad_x  = rstd (grad_xn ln_w - mean_c(.) - xhat mean_c(. xhat)),  dW_a = (grad_a * m)^T xn, ...

Every gradient against float64 over msa_dim across the kernel's column layouts (1, primes,
32·2^k ± 1, up to 512, and the ATen path past it), hidden sizes the fused contractions take and
those they do not, row counts at the tile edges and past one tile per block, every mask kind,
half-precision inputs, non-contiguous x, subsets of the gradients, and repeatability.  Where msa_dim
is at most 256 and hidden_dim at most 32 the kernel's register form runs
(FLASHOPM_LN_BACKWARD_REGS=0 asks for the other one there: both are checked).  A 16-bit model
whose matmuls follow PyTorch's in its type takes the tensor-core form where msa_dim is 64, 128 or
256 and hidden_dim at most 32; a float32 model takes its TF32 form there under "high" and its 3xTF32
form (float32 sums) under "highest"; FLASHOPM_LN_BACKWARD_MMA=0 asks for the FMA forms."""
import pytest
import torch

import flashopm
from conftest import requires_cuda
from flashopm.ops import outer_product_mean_backward_op
from flashopm.reference import GRAD_INPUTS, outer_product_mean_backward_reference
from flashopm.testing import PARAM_ORDER, Shape, make_problem, rel_error

pytestmark = requires_cuda

LN_EPS = 1e-5


@pytest.fixture(autouse=True)
def _extension_loaded():
    """The op is called directly here, not through the functional API: load its CUDA kernels."""
    flashopm.load()


def _op(g, x, m, p, needs=(True,) * 9, normalization=0, precision=-1):
    lw, lb, wa, ba, wb, bb, wo, bo = (p[k] for k in PARAM_ORDER)
    return outer_product_mean_backward_op(g, x, m, lw, lb, LN_EPS, wa, ba, wb, bb, wo, bo, normalization, 1e-3,
                                          list(needs), precision)


def _reference(g, x, m, p, normalization=0):
    lw, lb, wa, ba, wb, bb, wo, bo = (p[k] for k in PARAM_ORDER)
    return outer_product_mean_backward_reference(g, x, m, lw, lb, wa, ba, wb, bb, wo, bo, LN_EPS, normalization)


def _check_against_fp64(shape, mask_kind="masked_positions", seed=0, normalization=0, dtype=torch.float32,
                        x_transform=None, precision=-1):
    x, m, p = make_problem(shape, mask_kind, seed=seed)
    g = torch.randn(shape.B, shape.N, shape.N, shape.D, generator=torch.Generator().manual_seed(seed + 1))
    # the float64 reference sees the values the half-precision run sees
    x, g = x.to(dtype), g.to(dtype)
    p = {k: v.to(dtype) for k, v in p.items()}
    m64 = m if m.dtype == torch.bool else m.double()
    ref = _reference(g.double(), x.double(), m64, {k: v.double() for k, v in p.items()}, normalization)
    xc, mc, gc = x.cuda(), m.cuda(), g.cuda()
    pc = {k: v.cuda() for k, v in p.items()}
    eager = _reference(gc, xc, mc, pc, normalization)
    ours = _op(gc, x_transform(xc) if x_transform else xc, mc, pc, normalization=normalization, precision=precision)
    for name, o, e, r in zip(GRAD_INPUTS, ours, eager, ref):
        assert o.shape == r.shape and o.dtype == dtype, name
        assert torch.isfinite(o).all(), name
        err, err_eager = rel_error(o.cpu(), r), rel_error(e.cpu(), r)
        assert err <= max(2 * err_eager, 4 * torch.finfo(dtype).eps), f"{name}: {err:.3g} vs eager {err_eager:.3g}"


# (B, S, N, C, H, D): msa_dim across one and two columns per thread and 32-256 threads per row
# (tile rows 64, 32, 16, 8), hidden sizes of the fused contractions (16, 32, 64) and others (1, 3, 8).
SHAPES = [
    Shape(1, 3, 5, 1, 16, 4),
    Shape(2, 3, 7, 5, 3, 6),
    Shape(1, 4, 9, 31, 32, 8),
    Shape(1, 5, 13, 32, 8, 5),
    Shape(2, 2, 17, 33, 16, 7),
    Shape(1, 6, 11, 63, 64, 4),
    Shape(1, 3, 10, 64, 32, 9),
    Shape(1, 2, 19, 65, 1, 3),
    Shape(1, 4, 8, 127, 16, 6),
    Shape(1, 3, 7, 129, 32, 5),
    Shape(1, 2, 9, 255, 64, 4),
    Shape(1, 5, 6, 256, 32, 3),
    Shape(1, 3, 5, 257, 16, 4),
    Shape(1, 2, 7, 511, 32, 4),
    Shape(1, 3, 6, 512, 64, 3),
    Shape(1, 2, 5, 513, 16, 4),   # past the kernel's 512: the ATen path
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gradients_against_fp64(shape):
    _check_against_fp64(shape, seed=shape.N + shape.C + shape.H)


# Row counts B*S*N at a tile's edges (tile rows: 64 for C <= 32, 32 for C <= 64, 8 for C <= 512) and
# more tiles than blocks, so blocks take several tiles in turn.
@pytest.mark.parametrize("shape", [Shape(1, 1, 63, 24, 16, 4), Shape(1, 1, 64, 24, 16, 4), Shape(1, 5, 13, 24, 16, 4),
                                   Shape(1, 1, 31, 64, 32, 4), Shape(1, 3, 11, 64, 32, 4), Shape(1, 1, 7, 256, 32, 4),
                                   Shape(1, 1, 9, 256, 32, 4), Shape(1, 24, 97, 256, 32, 4),
                                   Shape(2, 40, 53, 64, 32, 3)], ids=str)
def test_row_counts_at_tile_edges(shape):
    _check_against_fp64(shape, seed=7)


# Both forms where the register form applies: hidden 4, 8, 16 and 32 (its three register widths),
# msa_dim across 32-256 threads per row, a row count past one tile per block.
@pytest.mark.parametrize("regs", ["1", "0"], ids=["register-form", "shared-form"])
@pytest.mark.parametrize("shape", [Shape(1, 3, 7, 17, 4, 4), Shape(2, 5, 11, 64, 8, 5), Shape(1, 4, 13, 100, 16, 6),
                                   Shape(1, 24, 97, 256, 32, 4), Shape(2, 3, 9, 33, 32, 3)], ids=str)
def test_both_forms(shape, regs, monkeypatch):
    monkeypatch.setenv("FLASHOPM_LN_BACKWARD_REGS", regs)
    _check_against_fp64(shape, seed=shape.S + shape.N)


@pytest.mark.parametrize("mask_kind", ["ones", "binary", "fractional", "masked_positions", "bool", "half"])
def test_every_mask_kind(mask_kind):
    if mask_kind == "half":
        x, m, p = make_problem(Shape(1, 6, 21, 40, 32, 8), "fractional", seed=3)
        g = torch.randn(1, 21, 21, 8, generator=torch.Generator().manual_seed(4))
        ref = _reference(g.double(), x.double(), m.half().double(), {k: v.double() for k, v in p.items()})
        ours = _op(g.cuda(), x.cuda(), m.half().cuda(), {k: v.cuda() for k, v in p.items()})
        eager = _reference(g.cuda(), x.cuda(), m.half().cuda(), {k: v.cuda() for k, v in p.items()})
        for name, o, e, r in zip(GRAD_INPUTS, ours, eager, ref):
            err, err_eager = rel_error(o.cpu(), r), rel_error(e.cpu(), r)
            assert err <= max(2 * err_eager, 4 * torch.finfo(torch.float32).eps), name
        return
    _check_against_fp64(Shape(2, 6, 21, 40, 32, 8), mask_kind, seed=3)


@pytest.mark.parametrize("normalization", [1, 2], ids=["openfold", "boltz"])
def test_other_normalizations(normalization):
    _check_against_fp64(Shape(1, 7, 23, 48, 32, 10), seed=5, normalization=normalization)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_inputs(dtype):
    """Against the reference's float32 sums, so with "highest" asked for explicitly (a 16-bit model's
    default contracts in its type, tested in test_autograd against eager 16-bit)."""
    _check_against_fp64(Shape(1, 5, 19, 64, 32, 8), seed=2, dtype=dtype, precision=0)


# The tensor-core form (16-bit x whose matmuls follow PyTorch's in its type, precision -1): msa_dim
# 64, 128 and 256 (its three warp grids), hidden 3 to 32, row counts at its 64-row tiles' edges and
# past one tile per block, against float64 next to eager PyTorch in the same type.
MMA_SHAPES = [Shape(1, 3, 21, 64, 8, 5), Shape(2, 4, 8, 128, 16, 3), Shape(1, 5, 13, 256, 32, 4),
              Shape(1, 9, 15, 128, 3, 6), Shape(1, 1, 64, 64, 32, 3), Shape(1, 70, 130, 256, 32, 4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", MMA_SHAPES, ids=str)
def test_tensor_core_form(shape, dtype):
    _check_against_fp64(shape, seed=shape.N + shape.C, dtype=dtype)


@pytest.mark.parametrize("mask_kind", ["binary", "fractional", "bool"])
def test_tensor_core_form_masks(mask_kind):
    _check_against_fp64(Shape(2, 6, 21, 128, 32, 8), mask_kind, seed=3, dtype=torch.bfloat16)


def test_tensor_core_form_strided_x_and_switch(monkeypatch):
    """x read through its strides; FLASHOPM_LN_BACKWARD_MMA=0 takes the float32 FMA form, whose
    unrounded gradients differ: the switch (and so the form) is live."""
    transform = lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)
    _check_against_fp64(Shape(1, 5, 13, 256, 32, 6), seed=8, dtype=torch.bfloat16, x_transform=transform)
    x, m, p = make_problem(Shape(1, 5, 13, 256, 32, 6), "masked_positions", seed=8)
    g = torch.randn(1, 13, 13, 6, generator=torch.Generator().manual_seed(9)).bfloat16().cuda()
    x, m, p = x.bfloat16().cuda(), m.bfloat16().cuda(), {k: v.bfloat16().cuda() for k, v in p.items()}
    mma = _op(g, x, m, p)
    assert all(torch.equal(a, b) for a, b in zip(mma, _op(g, x, m, p)))  # repeatable
    monkeypatch.setenv("FLASHOPM_LN_BACKWARD_MMA", "0")
    fma = _op(g, x, m, p)
    assert not torch.equal(mma[GRAD_INPUTS.index("w_a")], fma[GRAD_INPUTS.index("w_a")])


# The TF32 form (float32 x under "high", as PyTorch's matmuls there): msa_dim 64, 128 and 256,
# hidden 3 to 32, row counts at its 32-row tiles' edges and past one tile per block, every mask
# kind, against float64 next to eager PyTorch under the same setting.
TF32_SHAPES = [Shape(1, 3, 21, 64, 8, 5), Shape(2, 4, 8, 128, 16, 3), Shape(1, 5, 13, 256, 32, 4),
               Shape(1, 1, 31, 64, 32, 3), Shape(1, 1, 32, 128, 3, 3), Shape(1, 1, 33, 256, 17, 3),
               Shape(1, 70, 130, 256, 32, 4)]


@pytest.fixture
def pytorch_high():
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("shape", TF32_SHAPES, ids=str)
def test_tf32_form(shape, pytorch_high):
    _check_against_fp64(shape, seed=shape.N + shape.C)


@pytest.mark.parametrize("mask_kind", ["binary", "fractional", "bool"])
def test_tf32_form_masks(mask_kind, pytorch_high):
    _check_against_fp64(Shape(2, 6, 21, 128, 32, 8), mask_kind, seed=3)


def test_tf32_form_strided_x_explicit_precision_and_switch(monkeypatch):
    """x read through its strides under "high"; an explicit precision="high" under PyTorch's
    "highest" takes the same form (the same bits); FLASHOPM_LN_BACKWARD_MMA=0 takes the float32
    FMA form, whose unrounded products give other bits: the switch (and so the form) is live."""
    transform = lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)
    shape = Shape(1, 5, 13, 256, 32, 6)
    torch.set_float32_matmul_precision("high")
    try:
        _check_against_fp64(shape, seed=8, x_transform=transform)
        x, m, p = make_problem(shape, "masked_positions", seed=8)
        g = torch.randn(1, 13, 13, 6, generator=torch.Generator().manual_seed(9)).cuda()
        x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
        tf32 = _op(g, x, m, p)
        assert all(torch.equal(a, b) for a, b in zip(tf32, _op(g, x, m, p)))  # repeatable
    finally:
        torch.set_float32_matmul_precision("highest")
    explicit = _op(g, x, m, p, precision=1)
    assert all(torch.equal(a, b) for a, b in zip(tf32, explicit))
    monkeypatch.setenv("FLASHOPM_LN_BACKWARD_MMA", "0")
    fma = _op(g, x, m, p, precision=1)
    assert not torch.equal(tf32[GRAD_INPUTS.index("w_a")], fma[GRAD_INPUTS.index("w_a")])


# The 3xTF32 form (float32 x under "highest", the default): the TF32 form's shapes and masks
# against float64 with eager float32's bar, weights scaled x10 too.
@pytest.mark.parametrize("shape", TF32_SHAPES, ids=str)
def test_3xtf32_form(shape):
    _check_against_fp64(shape, seed=shape.N + shape.C + 1)


@pytest.mark.parametrize("mask_kind", ["binary", "fractional", "bool"])
def test_3xtf32_form_masks(mask_kind):
    _check_against_fp64(Shape(2, 6, 21, 128, 32, 8), mask_kind, seed=5)


def test_3xtf32_form_is_float32_accurate_and_switches(monkeypatch):
    """Under "highest" the 3xTF32 form meets eager float32's bar, which precision="high" (the TF32
    form, and TF32 contractions) misses at this shape, so the bar can fail; FLASHOPM_LN_BACKWARD_MMA=0
    takes the float32 FMA form (other bits, the same bar), so the switch is live."""
    shape = Shape(1, 7, 23, 256, 32, 6)
    x, m, p = make_problem(shape, "fractional", seed=21, scale=10.0)
    g = torch.randn(1, 23, 23, 6, generator=torch.Generator().manual_seed(22))
    ref = _reference(g.double(), x.double(), m.double(), {k: v.double() for k, v in p.items()})
    xc, mc, gc, pc = x.cuda(), m.cuda(), g.cuda(), {k: v.cuda() for k, v in p.items()}
    eager = _reference(gc, xc, mc, pc)
    three = _op(gc, xc, mc, pc)
    assert all(torch.equal(a, b) for a, b in zip(three, _op(gc, xc, mc, pc)))  # repeatable
    one = _op(gc, xc, mc, pc, precision=1)
    monkeypatch.setenv("FLASHOPM_LN_BACKWARD_MMA", "0")
    fma = _op(gc, xc, mc, pc)
    for name in ("msa_repr", "w_a", "w_b", "ln_weight"):
        k = GRAD_INPUTS.index(name)
        r = ref[k]
        err_eager = rel_error(eager[k].cpu(), r)
        assert rel_error(three[k].cpu(), r) <= max(2 * err_eager, 4 * torch.finfo(torch.float32).eps), name
        assert rel_error(fma[k].cpu(), r) <= max(2 * err_eager, 4 * torch.finfo(torch.float32).eps), name
        assert rel_error(one[k].cpu(), r) > 2 * err_eager, f"{name}: TF32 alone within float32's bar"
    assert not torch.equal(three[GRAD_INPUTS.index("w_a")], fma[GRAD_INPUTS.index("w_a")])


@pytest.mark.parametrize("layout", ["strided_c", "permuted_sn"])
def test_non_contiguous_x(layout):
    if layout == "strided_c":  # unit stride lost along C: copied once
        transform = lambda x: torch.stack([x, x], dim=-1)[..., 0]
    else:  # (B, N, S, C) storage seen as (B, S, N, C): read in place through its strides
        transform = lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)
    _check_against_fp64(Shape(2, 5, 13, 48, 16, 6), seed=8, x_transform=transform)


def test_subsets_of_gradients_match_the_full_call():
    x, m, p = make_problem(Shape(1, 6, 17, 72, 32, 8), "masked_positions", seed=4)
    g = torch.randn(1, 17, 17, 8, generator=torch.Generator().manual_seed(1)).cuda()
    x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    full = _op(g, x, m, p)
    for k in range(9):
        needs = [i == k for i in range(9)]
        part = _op(g, x, m, p, needs)
        for i, (a, b) in enumerate(zip(part, full)):
            if i == k:
                assert torch.equal(a, b), GRAD_INPUTS[i]
            else:
                assert a.numel() == 0, GRAD_INPUTS[i]
    only_params = _op(g, x, m, p, [False] + [True] * 6 + [False, False])
    for a, b in zip(only_params[1:7], full[1:7]):
        assert torch.equal(a, b)


def test_every_element_written_and_repeatable():
    """NaN in freed blocks of grad_x's size beforehand (the allocator may hand the op others), then
    every element of every gradient checked against float64 on its own, not only in norm: an element
    left unwritten holds NaN or another call's values."""
    shape = Shape(1, 9, 19, 96, 16, 12)
    x, m, p = make_problem(shape, "masked_positions", seed=6)
    g = torch.randn(1, 19, 19, 12, generator=torch.Generator().manual_seed(2))
    ref = _reference(g.double(), x.double(), m.double(), {k: v.double() for k, v in p.items()})
    x, m, p, g = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}, g.cuda()
    poison = [torch.full((shape.B, shape.S, shape.N, shape.C), float("nan"), device="cuda") for _ in range(8)]
    del poison
    first = _op(g, x, m, p)
    second = _op(g, x, m, p)
    for name, a, b, r in zip(GRAD_INPUTS, first, second, ref):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double().cpu(), r, atol=1e-4 * float(r.abs().max()), rtol=1e-3, msg=name)
        assert torch.equal(a, b), f"{name}: two identical calls differ"


def test_rows_past_the_tiled_projection_threshold():
    """Enough rows for the register-tiled projection kernel (a block of 128 rows on every other SM)
    and for every block of the backward to take many tiles in turn."""
    threshold = 64 * torch.cuda.get_device_properties(0).multi_processor_count  # a block on every other SM
    N = 17
    S = threshold // N + 3
    _check_against_fp64(Shape(1, S, N, 40, 32, 4), seed=12)


def test_fully_masked_rows_give_zero_projection_gradients():
    x, m, p = make_problem(Shape(1, 4, 11, 40, 16, 6), "ones", seed=9)
    m = torch.zeros_like(m)
    g = torch.randn(1, 11, 11, 6, generator=torch.Generator().manual_seed(3)).cuda()
    grads = _op(g, x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()})
    for name, t in zip(GRAD_INPUTS[:7], grads[:7]):
        assert torch.count_nonzero(t) == 0, name


def test_bad_arguments_are_named():
    """The backward op called directly: a mask on the CPU or of the wrong shape, or a parameter on
    another device, is refused with the argument's name before any kernel reads it."""
    x, m, p = make_problem(Shape(1, 3, 5, 8, 16, 4), "ones", seed=1)
    g = torch.randn(1, 5, 5, 4, device="cuda")
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    with pytest.raises(RuntimeError, match="msa_mask is on"):
        _op(g, xc, m, pc)
    with pytest.raises(RuntimeError, match="msa_mask must have shape"):
        _op(g, xc, mc[:, :2], pc)
    with pytest.raises(RuntimeError, match="proj_b weight is on"):
        _op(g, xc, mc, {**pc, "w_b": p["w_b"]})
    with pytest.raises(RuntimeError, match="layer_norm weight and bias must have"):
        _op(g, xc, mc, {**pc, "ln_weight": pc["ln_weight"][:7]})
