"""The fused backward of the outer-first contraction (flashopm::outer_contract_backward):

    out[b,i,j,d] = sum_(h1,h2) W[d, h1*H + h2] sum_s a[b,s,i,h1] b[b,s,j,h2]

its three gradients against a float64 reference over awkward sizes (1, primes, the tile edges of
16 rows and 4-8 columns, S across the 128-wide s blocks and within them at 1-4 tiles of 8 per warp,
D across the 128-wide d blocks and not a multiple of 4), every element written, bitwise-repeatable
results, and the argument checks."""
import pytest
import torch

import flashopm
from conftest import f16_backward_form_or_skip, requires_cuda
from flashopm.ops import FUSED_BACKWARD_HIDDEN, contract_backward, outer_contract_backward_op
from flashopm.reference import contract_outer_blocks_backward
from flashopm.testing import rel_error

@pytest.fixture(autouse=True)
def _extension_loaded():
    """The op is called directly here, not through the functional API: load its CUDA kernels."""
    if torch.cuda.is_available():
        flashopm.load()


# (B, S, Nr, Nc, H, D)
SHAPES = [
    (1, 1, 1, 1, 16, 1),
    (2, 3, 17, 5, 32, 7),
    (1, 8, 16, 16, 32, 64),
    (1, 7, 15, 17, 32, 64),
    (3, 5, 9, 33, 16, 13),
    (1, 129, 33, 31, 32, 128),
    (1, 40, 65, 3, 64, 130),
    (2, 31, 32, 65, 64, 129),
    (1, 64, 97, 97, 32, 256),
    (1, 100, 20, 18, 32, 40),  # 13 of the s block's 16 tiles of 8: the last warp's GEMM 2 on one of four
]


def _problem(B, S, Nr, Nc, H, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(B, S, Nr, H, generator=gen)
    b = torch.randn(B, S, Nc, H, generator=gen)
    w = torch.randn(D, H * H, generator=gen) / H
    g = torch.randn(B, Nr, Nc, D, generator=gen)
    return g, a, b, w


def test_cpu_op_matches_the_blocked_reference():
    g, a, b, w = _problem(2, 5, 7, 6, 16, 9)
    ours = outer_contract_backward_op(g, a, b, w, True, True)
    ref = contract_outer_blocks_backward(g, a, b, w, True, True)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r)
    ga, gb, gw = outer_contract_backward_op(g, a, b, w, False, True)
    assert ga.numel() == 0 and gb.numel() == 0 and gw.shape == (9, 256)


def test_opcheck_cpu():
    g, a, b, w = _problem(1, 3, 4, 5, 16, 6)
    torch.library.opcheck(outer_contract_backward_op, (g, a, b, w, True, True))


@requires_cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_Nr{}_Nc{}_H{}_D{}".format(*s))
def test_gradients_against_fp64(shape):
    """Each gradient's normwise error against float64 is at most twice that of float32 PyTorch."""
    g, a, b, w = _problem(*shape, seed=sum(shape))
    ref = contract_outer_blocks_backward(g.double(), a.double(), b.double(), w.double(), True, True)
    eager = contract_outer_blocks_backward(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True)
    ours = outer_contract_backward_op(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True)
    for name, o, e, r in zip(("grad_a", "grad_b", "grad_w"), ours, eager, ref):
        assert o.shape == r.shape, name
        assert torch.isfinite(o).all(), name
        err, err_eager = rel_error(o.cpu(), r), rel_error(e.cpu(), r)
        assert err <= max(2 * err_eager, 4 * torch.finfo(torch.float32).eps), f"{name}: {err:.3g} vs eager {err_eager:.3g}"


# Operand magnitudes the float16 split forms' scales must absorb: each case scales g, a, b or W's
# columns far apart (the side kernels' powers of two are per (pair, chunk of d), per W column, per
# (row, chunk) of dO and per s of the other side's projection; the W kernel's per residue of a and
# b, one for O, and per (d, chunk of pairs) of g).
def _scaled(case, g, a, b, w):
    g, a, b, w = g.clone(), a.clone(), b.clone(), w.clone()
    if case == "g_tiny":
        g *= 1e-6
    elif case == "g_huge":
        g *= 1e4
    elif case == "g_pairs_apart":  # OpenFold's normaliser: pairs divided by counts far apart
        g[:, ::3] *= 1e-4
        g[:, :, 1::4] *= 1e3
    elif case == "w_columns_apart":
        w[:, ::3] *= 1e-6
        w[:, 1::5] *= 1e3
    elif case == "residues_apart":  # fractional masks: residues (and sequences) of a and b far apart
        a[:, :, ::4] *= 1e-5
        b[:, :, 1::3] *= 1e-3
        b[:, ::2] *= 1e2
    elif case == "masked_residues":  # residues masked at every s, OpenFold's large g at their pairs
        a[:, :, 2::5] = 0
        b[:, :, ::4] = 0
        g[:, 2::5] *= 1e3
        g[:, :, ::4] *= 1e3
    elif case == "hidden_apart":  # projection columns far apart: O's columns (h1, h2) too
        a[..., ::5] *= 1e-4
        b[..., 1::3] *= 1e3
    return g, a, b, w


@requires_cuda
@pytest.mark.parametrize("case", ["unit", "g_tiny", "g_huge", "g_pairs_apart", "w_columns_apart", "residues_apart",
                                  "masked_residues", "hidden_apart"])
@pytest.mark.parametrize("shape", [(1, 129, 33, 31, 32, 128), (2, 7, 20, 37, 32, 45), (1, 300, 9, 64, 32, 64),
                                   (1, 33, 70, 5, 32, 200)],
                         ids=lambda s: "B{}_S{}_Nr{}_Nc{}_H{}_D{}".format(*s))
def test_f16_forms_against_fp64(monkeypatch, case, shape):
    """The contractions' float16 split forms: each gradient within twice eager float32's error
    against float64, with operands scaled far apart; and not the mma.sync forms' bits (they ran)."""
    g, a, b, w = _scaled(case, *_problem(*shape, seed=sum(shape)))
    ref = contract_outer_blocks_backward(g.double(), a.double(), b.double(), w.double(), True, True)
    eager = contract_outer_blocks_backward(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True)
    f16_backward_form_or_skip(monkeypatch)
    ours = outer_contract_backward_op(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True)
    monkeypatch.setenv("FLASHOPM_BWD_FORM", "mma_sync")
    other = outer_contract_backward_op(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True)
    for name, o, e, r, x in zip(("grad_a", "grad_b", "grad_w"), ours, eager, ref, other):
        assert torch.isfinite(o).all(), name
        err, err_eager = rel_error(o.cpu(), r), rel_error(e.cpu(), r)
        assert err <= max(2 * err_eager, 4 * torch.finfo(torch.float32).eps), f"{name}: {err:.3g} vs eager {err_eager:.3g}"
        assert not torch.equal(o, x), f"{name}: the float16 split form gave the mma.sync form's bits"


@requires_cuda
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[4] == 32], ids=lambda s: "B{}_S{}_Nr{}_Nc{}_H{}_D{}".format(*s))
def test_f16_forms_every_shape(monkeypatch, shape):
    """test_gradients_against_fp64's hidden-32 shapes in the float16 split forms: under "highest"
    within twice eager float32's error against float64; under "high" (the high parts' products
    alone) within twice eager TF32's, and off float64 by more than float32's rounding (so that form
    ran)."""
    g, a, b, w = _problem(*shape, seed=sum(shape))
    ref = contract_outer_blocks_backward(g.double(), a.double(), b.double(), w.double(), True, True)
    eager = contract_outer_blocks_backward(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True)
    torch.set_float32_matmul_precision("high")
    try:
        eager_tf32 = contract_outer_blocks_backward(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True)
    finally:
        torch.set_float32_matmul_precision("highest")
    f16_backward_form_or_skip(monkeypatch)
    for precision, eager_p in ((0, eager), (1, eager_tf32)):
        ours = outer_contract_backward_op(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True, precision)
        for name, o, e, r in zip(("grad_a", "grad_b", "grad_w"), ours, eager_p, ref):
            assert torch.isfinite(o).all(), name
            err, err_eager = rel_error(o.cpu(), r), rel_error(e.cpu(), r)
            assert err <= max(2 * err_eager, 4 * torch.finfo(torch.float32).eps), f"{name}: {err:.3g} vs {err_eager:.3g}"
            if precision == 1:
                assert err > 1e-5, f"{name}: float32's error under \"high\""


@requires_cuda
def test_f16_forms_every_element_written_and_repeatable(monkeypatch):
    """As test_every_element_written_and_repeatable, in the float16 split forms, with the grid's
    splits (partial sums) and several tiles per block."""
    f16_backward_form_or_skip(monkeypatch)
    _check_written_and_repeatable(*(t.cuda() for t in _problem(2, 70, 45, 61, 32, 36, seed=6)))


@requires_cuda
def test_form_switch_is_checked(monkeypatch):
    g, a, b, w = (t.cuda() for t in _problem(1, 2, 3, 4, 32, 5))
    monkeypatch.setenv("FLASHOPM_BWD_FORM", "fast")
    with pytest.raises(RuntimeError, match="FLASHOPM_BWD_FORM must be mma_sync or f16_split"):
        outer_contract_backward_op(g, a, b, w, True, False)
    monkeypatch.setenv("FLASHOPM_BWD_FORM", "f16_split")
    g, a, b, w = (t.cuda() for t in _problem(1, 2, 3, 4, 16, 5))
    with pytest.raises(RuntimeError, match="needs hidden_dim 32"):
        outer_contract_backward_op(g, a, b, w, True, False)


@requires_cuda
def test_tf32_precision_is_close():
    g, a, b, w = _problem(1, 33, 40, 37, 32, 64, seed=3)
    ref = contract_outer_blocks_backward(g.double(), a.double(), b.double(), w.double(), True, True)
    ours = outer_contract_backward_op(g.cuda(), a.cuda(), b.cuda(), w.cuda(), True, True, 1)
    for o, r in zip(ours, ref):
        assert rel_error(o.cpu(), r) < 5e-3


def _check_written_and_repeatable(g, a, b, w):
    """Every gradient element written (the outputs land on NaN-poisoned memory) and two identical
    calls giving the same bits."""
    first = outer_contract_backward_op(g, a, b, w, True, True)
    # NaN in the memory the outputs are about to take: a gradient element never written stays NaN
    poison = [torch.full_like(t, float("nan")) for t in first]
    ptrs = [p.data_ptr() for p in poison]
    del poison
    second = outer_contract_backward_op(g, a, b, w, True, True)
    assert [t.data_ptr() for t in second] == ptrs, "the NaN-poisoned blocks were not reused; the check proves nothing"
    for x, y in zip(first, second):
        assert torch.isfinite(y).all()
        assert torch.equal(x, y), "two identical calls differ"


@requires_cuda
def test_every_element_written_and_repeatable():
    _check_written_and_repeatable(*(t.cuda() for t in _problem(2, 9, 19, 23, 32, 12, seed=5)))


@requires_cuda
def test_only_requested_gradients():
    g, a, b, w = (t.cuda() for t in _problem(1, 4, 5, 6, 16, 8))
    ga, gb, gw = outer_contract_backward_op(g, a, b, w, True, False)
    assert ga.shape == a.shape and gb.shape == b.shape and gw.numel() == 0
    ga, gb, gw = outer_contract_backward_op(g, a, b, w, False, True)
    assert ga.numel() == 0 and gb.numel() == 0 and gw.shape == w.shape


@requires_cuda
@pytest.mark.parametrize("empty", ["B", "S", "Nr", "Nc"])
def test_empty_dims_give_zero_gradients(empty):
    dims = dict(B=2, S=3, Nr=4, Nc=5)
    dims[empty] = 0
    g, a, b, w = (t.cuda() for t in _problem(dims["B"], dims["S"], dims["Nr"], dims["Nc"], 16, 8))
    ga, gb, gw = outer_contract_backward_op(g, a, b, w, True, True)
    assert ga.shape == a.shape and gb.shape == b.shape and gw.shape == w.shape
    assert not ga.any() and not gb.any() and not gw.any()


@requires_cuda
def test_non_contiguous_inputs():
    g, a, b, w = _problem(1, 6, 10, 11, 32, 20, seed=7)
    ref = contract_outer_blocks_backward(g.double(), a.double(), b.double(), w.double(), True, True)
    gc = g.cuda().transpose(1, 2).contiguous().transpose(1, 2)
    ac = a.cuda().transpose(0, 1).contiguous().transpose(0, 1)
    ours = outer_contract_backward_op(gc, ac, b.cuda(), w.cuda().t().contiguous().t(), True, True)
    for o, r in zip(ours, ref):
        assert rel_error(o.cpu(), r) < 1e-6


@requires_cuda
def test_bad_arguments_are_named():
    g, a, b, w = (t.cuda() for t in _problem(1, 2, 3, 4, 32, 5))
    with pytest.raises(RuntimeError, match="hidden_dim 16, 32 or 64"):
        outer_contract_backward_op(g, a[..., :8].contiguous(), b[..., :8].contiguous(), w[:, :64].contiguous(),
                                   True, True)
    with pytest.raises(RuntimeError, match="grad must have shape"):
        outer_contract_backward_op(g[:, :2], a, b, w, True, True)
    with pytest.raises(RuntimeError, match="b must have shape"):
        outer_contract_backward_op(g, a, b[:, :1], w, True, True)
    with pytest.raises(RuntimeError, match="must have dtype"):
        outer_contract_backward_op(g.double(), a, b, w, True, True)


@requires_cuda
def test_dispatch_falls_back_for_other_hidden_sizes():
    g, a, b, w = (t.cuda() for t in _problem(1, 3, 4, 5, 8, 6))
    assert 8 not in FUSED_BACKWARD_HIDDEN
    ours = contract_backward(g, a, b, w, True, True)
    ref = contract_outer_blocks_backward(g, a, b, w, True, True)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r)


@requires_cuda
def test_opcheck_cuda():
    g, a, b, w = (t.cuda() for t in _problem(1, 3, 4, 5, 16, 6))
    torch.library.opcheck(outer_contract_backward_op, (g, a, b, w, True, True))
