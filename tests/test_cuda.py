"""The fused CUDA kernels against the references, on a GPU.

fp32 reference: allclose(atol=rtol=1e-4).  fp64 reference: our normwise relative error is at most
twice that of eager fp32 PyTorch on the same inputs (floored at a few fp32 ulps, for cases where
eager happens to be exact).
"""
import copy
import os
import re
import warnings
import zlib

import pytest
import torch

import flashopm
from conftest import flashopm_kernels, poison_output_block, requires_cuda
from flashopm.testing import MASK_KINDS, PARAM_ORDER, Shape, make_problem, reference, rel_error

pytestmark = requires_cuda


@pytest.fixture(autouse=True, scope="module")
def _extension_loaded():
    """The plan queries below (torch.ops.flashopm._small_tc_plan) have their CUDA implementation in
    the extension, which an op's first CUDA call loads; a test run alone may query first."""
    flashopm.load()


SPEC = Shape(2, 8, 32, 64, 32, 64)
# Every value of N {1,7,32,33,97,256}, S {1,3,8,128}, C {1,17,64,256}, H {1,8,32,64},
# D {1,64,128}, B {1,2,3} appears at least once; tile edges (33 = 32+1, 97, 256 = 2·128) included.
SWEEP = [
    SPEC,
    Shape(1, 1, 1, 1, 1, 1),
    Shape(3, 3, 7, 17, 8, 64),
    Shape(1, 128, 33, 64, 32, 128),
    Shape(2, 8, 97, 256, 64, 1),
    Shape(1, 3, 256, 17, 32, 128),
    Shape(1, 128, 97, 64, 8, 64),
    Shape(3, 1, 33, 256, 1, 128),
    Shape(2, 128, 7, 1, 64, 64),
    Shape(1, 8, 256, 64, 64, 128),
    Shape(1, 5, 65, 33, 5, 7),     # odd hidden (scalar phase-2 path), ragged everything
    Shape(2, 9, 31, 48, 31, 65),   # D just above 64, H just below 32
]
ALGORITHMS = ["auto", "outer", "project", "single", "outer-fma", "small-tc"]
FP64_FLOOR = 4 * torch.finfo(torch.float32).eps


def _cuda_params(p):
    return {k: v.cuda() for k, v in p.items()}


def _run(x, m, p, algorithm="auto", poison=True, may_not_fit=True, precision=None, normalization="row"):
    """Calls the op with the output's memory poisoned with NaN beforehand (checked to be reused)."""
    B, S, N, C = x.shape
    D = p["w_out"].shape[0]
    numel = B * N * N * D

    def call():
        return flashopm.outer_product_mean(
            x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"], p["w_out"], p["b_out"],
            algorithm=algorithm, precision=precision, normalization=normalization,
        )

    poison_ptr = None
    try:
        if poison and numel > 0:
            poison_ptr = poison_output_block(call)
        out = call()
    except RuntimeError as exc:
        if algorithm in ("single", "small-tc") and "does not fit" in str(exc) and may_not_fit:
            pytest.skip(f"algorithm {algorithm!r} does not fit this problem")
        raise
    if poison_ptr is not None:
        assert out.data_ptr() == poison_ptr, "the poisoned block was not reused; the check proves nothing"
    return out


def _check(shape, mask_kind, algorithm, seed=0, scale=1.0, may_not_fit=True):
    x, m, p = make_problem(shape, mask_kind, seed=seed, scale=scale)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    ref32 = reference(xc, mc, pc).cpu()
    x_before, m_before = xc.clone(), mc.clone()
    out = _run(xc, mc, pc, algorithm, may_not_fit=may_not_fit)
    torch.cuda.synchronize()
    assert out.shape == (shape.B, shape.N, shape.N, shape.D) and out.dtype == torch.float32
    assert out.is_contiguous()
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(xc, x_before) and torch.equal(mc, m_before), "inputs were modified"
    out_cpu = out.cpu()
    torch.testing.assert_close(out_cpu, ref32, atol=1e-4, rtol=1e-4)
    err, err_eager = rel_error(out_cpu, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"normwise error {err:.3g} vs eager fp32 {err_eager:.3g}"
    again = _run(xc, mc, pc, algorithm)
    assert torch.equal(out, again), "two identical calls differ: a race"
    return err, err_eager


@pytest.mark.parametrize("shape", SWEEP, ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sweep_mixed_masks(shape, algorithm):
    _check(shape, "masked_positions", algorithm, seed=zlib.crc32(f"{shape}-{algorithm}".encode()) % 1000)


@pytest.mark.parametrize("shape", SWEEP, ids=str)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_sweep_mask_kinds(shape, mask_kind):
    _check(shape, mask_kind, "auto", seed=7)


@pytest.mark.parametrize("seed", range(4))
def test_spec_protocol_seeded_modules(seed):
    """As a KernelBench-style harness does it: seeded construction on the CPU, then .to(cuda)."""
    torch.manual_seed(seed)
    ref = flashopm.Model(*flashopm.get_init_inputs()).to(device="cuda", dtype=torch.float32)
    torch.manual_seed(seed)
    new = flashopm.ModelNew(*flashopm.get_init_inputs()).to(device="cuda", dtype=torch.float32)
    x, m = [t.cuda() for t in flashopm.get_inputs()]
    expect = ref(x, m)
    out = new(x, m)
    assert out.shape == expect.shape
    assert torch.allclose(out, expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_noncontiguous_inputs(algorithm):
    shape = Shape(2, 5, 37, 24, 16, 40)
    x, m, p = make_problem(shape, "masked_positions", seed=11)
    ref32 = reference(x.cuda(), m.cuda(), _cuda_params(p))
    # msa as a (B, N, S, C) tensor seen through transpose; mask as a strided slice; weight transposed twice
    x_nc = x.transpose(1, 2).contiguous().cuda().transpose(1, 2)
    m_big = torch.zeros(shape.B, shape.S, shape.N, 3)
    m_big[..., 1] = m
    m_nc = m_big.cuda()[..., 1]
    pc = _cuda_params(p)
    pc["w_out"] = pc["w_out"].t().contiguous().t()
    assert not x_nc.is_contiguous() and not m_nc.is_contiguous() and not pc["w_out"].is_contiguous()
    out = _run(x_nc, m_nc, pc, algorithm)
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
    # a msa view whose last dim is strided too
    x_big = torch.zeros(shape.B, shape.S, shape.N, shape.C, 2)
    x_big[..., 0] = x
    out2 = _run(x_big.cuda()[..., 0], m.cuda(), _cuda_params(p), algorithm)
    torch.testing.assert_close(out2, ref32, atol=1e-4, rtol=1e-4)


def test_algorithms_agree_and_auto_picks_one_of_them():
    shape = Shape(1, 16, 70, 32, 32, 64)
    x, m, p = make_problem(shape, "fractional", seed=5)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    outs = {a: _run(xc, mc, pc, a) for a in ALGORITHMS}
    torch.testing.assert_close(outs["outer"], outs["project"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["single"], outs["project"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["small-tc"], outs["project"], atol=1e-4, rtol=1e-4)
    assert any(torch.equal(outs["auto"], outs[a]) for a in ("outer", "project", "single", "small-tc"))


# Awkward small problems for the single-launch kernel: every cluster size, partial tiles along
# i, j and d, N not a multiple of 4 (scalar push of b), odd hidden and pair widths.
SINGLE_SHAPES = [
    Shape(1, 1, 1, 1, 1, 1),
    Shape(2, 8, 32, 64, 32, 64),
    Shape(1, 3, 2, 5, 3, 5),
    Shape(3, 2, 5, 9, 6, 13),
    Shape(1, 7, 17, 31, 16, 33),
    Shape(2, 4, 40, 8, 12, 4),
    Shape(1, 2, 100, 20, 8, 10),
    Shape(1, 6, 48, 40, 64, 16),
    # odd S, N ragged and prime, pair widths below and across a tile of d
    Shape(2, 5, 23, 24, 8, 7),
    Shape(1, 3, 45, 16, 24, 20),
    Shape(3, 1, 9, 8, 40, 3),
    Shape(1, 9, 64, 32, 16, 48),
    Shape(2, 2, 37, 56, 32, 130),
]


# Awkward small problems for the two-launch tensor-core path (hidden a multiple of 8): one row
# tile and many, N one past a tile of 16, S not a multiple of 8 (padded n tile in phase P), pair
# widths below, at and across the chunk of d, K split over warps or not, msa_dim not a multiple
# of 4 and above 128, more rows of projections per block than the one-launch form takes.
SMALL_TC_SHAPES = [
    Shape(1, 1, 1, 1, 8, 1),
    Shape(2, 8, 32, 64, 32, 64),
    Shape(1, 3, 17, 5, 8, 5),
    Shape(3, 2, 5, 9, 16, 13),
    Shape(1, 7, 17, 31, 24, 33),
    Shape(2, 4, 40, 8, 40, 4),
    Shape(1, 2, 100, 20, 8, 10),
    Shape(1, 6, 48, 40, 64, 16),
    Shape(2, 9, 23, 24, 8, 7),
    Shape(1, 11, 33, 16, 32, 71),
    Shape(1, 9, 64, 32, 16, 48),
    Shape(2, 2, 37, 56, 32, 130),
    Shape(1, 1, 129, 12, 8, 9),
    Shape(1, 20, 20, 64, 56, 64),
    Shape(1, 5, 3, 70, 16, 24),
    Shape(2, 3, 11, 131, 8, 16),
    Shape(1, 48, 24, 40, 16, 8),
]


# The small-problem paths on their own awkward sizes; every case must fit (no skip).
SMALL_PATH_CASES = [("single", s, "") for s in SINGLE_SHAPES] + [("small-tc", s, "-tc") for s in SMALL_TC_SHAPES]


@pytest.mark.parametrize("algorithm,shape,seed_tag", SMALL_PATH_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("mask_kind", ["masked_positions", "fractional", "bool"])
def test_small_problem_paths(algorithm, shape, seed_tag, mask_kind):
    _check(shape, mask_kind, algorithm, seed=zlib.crc32(f"{shape}-{mask_kind}{seed_tag}".encode()) % 1000,
           may_not_fit=False)


# The same sizes in one cooperative launch (FLASHOPM_SMALL_TC_FUSED=1: each block projects its
# share of the rows, then a grid barrier), in the FMA form and the mma.sync form.
@pytest.mark.parametrize("form", ["fma", "mma_sync"])
@pytest.mark.parametrize("shape", SMALL_TC_SHAPES, ids=str)
def test_small_tc_in_one_launch(shape, form, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_FUSED", "1")
    if form == "mma_sync":
        monkeypatch.setenv("FLASHOPM_SMALL_TC_FMA", "0")
    _check(shape, "fractional", "small-tc", seed=zlib.crc32(f"{shape}-one-{form}".encode()) % 1000, may_not_fit=False)


# The FMA form in which each block projects its own rows of a and runs phase P before it waits
# (FLASHOPM_SMALL_TC_LOCAL_A=1, where its staged inputs fit; the first kernel then writes b alone).
@pytest.mark.parametrize("shape", SMALL_TC_SHAPES, ids=str)
def test_small_tc_local_a_form(shape, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_LOCAL_A", "1")
    _check(shape, "fractional", "small-tc", seed=zlib.crc32(f"{shape}-local-a".encode()) % 1000,
           may_not_fit=False)


def test_small_tc_local_a_form_with_unaligned_parameters(monkeypatch):
    """LayerNorm's parameters and the projections' weights as views 4 bytes past an aligned address:
    the local-a form copies them in 16-byte pieces only where each is 16-byte aligned."""
    monkeypatch.setenv("FLASHOPM_SMALL_TC_LOCAL_A", "1")
    x, m, p = make_problem(SPEC, "fractional", seed=21)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    for name in ("ln_weight", "ln_bias", "w_a", "w_b"):
        flat = torch.empty(pc[name].numel() + 1, device="cuda")
        flat[1:] = pc[name].flatten()
        pc[name] = flat[1:].view_as(pc[name])
        assert pc[name].data_ptr() % 16 != 0
    out = _run(xc, mc, pc, "small-tc", may_not_fit=False).cpu()
    assert torch.allclose(out, reference(xc, mc, pc).cpu(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("local_a", ["0", "1"])
@pytest.mark.parametrize("shape", [Shape(67, 8, 41, 20, 8, 16), Shape(61, 7, 43, 20, 8, 16)], ids=str)
def test_small_tc_fma_layouts_from_tiled_projection(shape, local_a, monkeypatch):
    """a and b in the FMA form's layouts (rows of positions per h, and per (s, h)) from the
    register-tiled projection kernel, which takes over from a block of 128 rows on every other SM;
    N, and in the second shape S and N·S, not multiples of 4."""
    monkeypatch.setenv("FLASHOPM_SMALL_TC_LOCAL_A", local_a)
    _check(shape, "masked_positions", "small-tc", seed=11, may_not_fit=False)


# The float16 split form wherever it applies (hidden 16, 32 or 64; by default only where a block
# has enough work), and the float32 FMA form (the default elsewhere, where W's chunk fits).
@pytest.mark.parametrize("shape", SMALL_TC_SHAPES, ids=str)
def test_small_tc_f16_form(shape, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "1")
    _check(shape, "masked_positions", "small-tc", seed=zlib.crc32(f"{shape}-f16".encode()) % 1000,
           may_not_fit=False)


@pytest.mark.parametrize("shape", SMALL_TC_SHAPES, ids=str)
def test_small_tc_fma_form(shape, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "0")
    _check(shape, "masked_positions", "small-tc", seed=zlib.crc32(f"{shape}-fma".encode()) % 1000,
           may_not_fit=False)


@pytest.mark.parametrize("scale", [1e-12, 1e12])
@pytest.mark.parametrize("shape", [SPEC, Shape(1, 2, 20, 24, 64, 8), Shape(3, 2, 5, 9, 16, 13)], ids=str)
def test_small_tc_f16_form_far_from_one(shape, scale, monkeypatch):
    """The float16 split form scales its operands by powers of two: projections scaled by 1e-12 or
    1e12 (W by the inverse, no output bias) stay within the float32 bars, where unscaled float16
    parts would underflow or overflow."""
    x, m, p = make_problem(shape, "fractional", seed=17)
    for name in ("w_a", "b_a", "w_b", "b_b"):
        p[name] = p[name] * scale
    p["w_out"] = p["w_out"] / scale
    p["b_out"] = torch.zeros_like(p["b_out"])
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "1")
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    ref32 = reference(xc, mc, pc).cpu()
    kernels = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False, may_not_fit=False))
    assert any("opm_small_f16_" in k for k in kernels), kernels
    out = _run(xc, mc, pc, "small-tc", may_not_fit=False).cpu()
    assert not out.isnan().any() and out.abs().max() > 0
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"normwise error {err:.3g} vs eager fp32 {err_eager:.3g}"


# The float16 split form where it is asked for, checked to be the form that ran: kernel 1 writes
# a's and b's rows split, each with its own scale; rows of i ragged in their last tile; hidden 16,
# 32 and 64; four rows per warp in kernel 1 (B·S blocks of 32 positions past two per SM).
F16_FORM_CASES = [(SPEC, None), (Shape(1, 5, 31, 24, 32, 40), (4, 8)), (Shape(2, 3, 24, 9, 16, 70), (1, 64)),
                  (Shape(1, 2, 20, 24, 64, 8), None), (Shape(33, 8, 16, 12, 16, 8), None)]


@pytest.mark.parametrize("shape,tile", F16_FORM_CASES, ids=lambda v: str(v))
def test_small_tc_f16_form_runs(shape, tile, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "1")
    if tile is not None:
        monkeypatch.setenv("FLASHOPM_SMALL_TC_TILE", f"{tile[0]},{tile[1]}")
    like = torch.empty(1, device="cuda")
    plan = torch.ops.flashopm._small_tc_plan(like, shape.B, shape.S, shape.N, shape.H, shape.D)
    assert len(plan) == 3 and plan[2] == 1, plan
    if tile is not None:
        assert plan[:2] == list(tile)
    x, m, p = make_problem(shape, "masked_positions", seed=zlib.crc32(f"{shape}-f16-runs".encode()) % 1000)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    kernels = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False, may_not_fit=False))
    assert any("opm_small_f16_" in k for k in kernels), kernels
    _check(shape, "masked_positions", "small-tc", seed=zlib.crc32(f"{shape}-f16-runs".encode()) % 1000,
           may_not_fit=False)
    _check_weights_x10(shape, seed=3)


def _check_weights_x10(shape, seed):
    """The small path with every weight x10: the output scales as 10^3, and eager float32's own
    error with it; allclose(1e-4) scaled so, and the normwise error within 2x eager's."""
    x, m, p = make_problem(shape, "fractional", seed=seed, scale=10.0)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    out = _run(xc, mc, pc, "small-tc", may_not_fit=False).cpu()
    ref64, ref32 = reference(xc, mc, pc, dtype=torch.float64).cpu(), reference(xc, mc, pc).cpu()
    torch.testing.assert_close(out, ref32, atol=1e-4 * 10.0**3, rtol=1e-4)
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"normwise error {err:.3g} vs eager fp32 {err_eager:.3g}"


def _f16_form_problem(shape, tile, mask_kind, seed_text, monkeypatch, staged=False):
    """A problem on the GPU for the float16 split form, asked for (with `tile` = (TI, Dc) if given;
    its staged form if `staged`) and checked to be the form that the plan chooses; the seed from
    `seed_text`."""
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "1")
    if staged:
        monkeypatch.setenv("FLASHOPM_SMALL_F16_CHAIN", "0")
    if tile is not None:
        monkeypatch.setenv("FLASHOPM_SMALL_TC_TILE", f"{tile[0]},{tile[1]}")
    x, m, p = make_problem(shape, mask_kind, seed=zlib.crc32(seed_text.encode()) % 1000)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    assert torch.ops.flashopm._small_tc_plan(xc, shape.B, shape.S, shape.N, shape.H, shape.D)[2] == 1
    return xc, mc, pc


# The staged float16 split form's row factors taken by each thread itself (FLASHOPM_SMALL_F16_OPTS:
# 1 b's in phase O, 2 a's in phase P) give the same bits as the passes over the rows' exponents.
@pytest.mark.parametrize("normalization", ["row", "boltz"])
@pytest.mark.parametrize("shape,tile", F16_FORM_CASES + [(Shape(2, 7, 13, 9, 32, 24), None)], ids=lambda v: str(v))
def test_small_tc_f16_own_factors(shape, tile, normalization, monkeypatch):
    xc, mc, pc = _f16_form_problem(shape, tile, "masked_positions", f"{shape}-own", monkeypatch, staged=True)
    outs = {}
    for opts in ("0", "1", "2", "3"):
        monkeypatch.setenv("FLASHOPM_SMALL_F16_OPTS", opts)
        out = flashopm.outer_product_mean(xc, mc, pc["ln_weight"], pc["ln_bias"], pc["w_a"], pc["b_a"], pc["w_b"],
                                          pc["b_b"], pc["w_out"], pc["b_out"], algorithm="small-tc",
                                          normalization=normalization)
        assert not out.isnan().any()
        outs[opts] = out
    for opts in ("1", "2", "3"):
        assert torch.equal(outs[opts], outs["0"]), (opts, (outs[opts] - outs["0"]).abs().max().item())
    norm_code = {"row": 0, "boltz": 2}[normalization]
    ref32 = reference(xc, mc, pc, normalization=norm_code).cpu()
    torch.testing.assert_close(outs["3"].cpu(), ref32, atol=1e-4, rtol=1e-4)


# The float16 split forms' epilogue (items of two columns, the K parts read at once) in the
# specification's normalisation and Boltz's (pair counts); D odd, a ragged last chunk of d.
@pytest.mark.parametrize("staged", [False, True], ids=["chained", "staged"])
@pytest.mark.parametrize("normalization,norm_code", [("row", 0), ("boltz", 2)])
@pytest.mark.parametrize("shape,tile", [(SPEC, None), (Shape(1, 5, 31, 24, 32, 41), (4, 8)),
                                        (Shape(2, 3, 24, 9, 16, 70), (1, 64))], ids=lambda v: str(v))
def test_small_tc_f16_epilogue(shape, tile, normalization, norm_code, staged, monkeypatch):
    xc, mc, pc = _f16_form_problem(shape, tile, "fractional", f"{shape}-pairs-{normalization}", monkeypatch,
                                   staged=staged)

    def op():
        return flashopm.outer_product_mean(xc, mc, pc["ln_weight"], pc["ln_bias"], pc["w_a"], pc["b_a"], pc["w_b"],
                                           pc["b_b"], pc["w_out"], pc["b_out"], algorithm="small-tc",
                                           normalization=normalization)

    def call():
        ptr = poison_output_block(op)
        out = op()
        assert out.data_ptr() == ptr, "the poisoned block was not reused; the check proves nothing"
        return out

    out = call()
    assert not out.isnan().any()
    assert torch.equal(call(), out)
    ref64 = reference(xc, mc, pc, dtype=torch.float64, normalization=norm_code).cpu()
    ref32 = reference(xc, mc, pc, normalization=norm_code).cpu()
    torch.testing.assert_close(out.cpu(), ref32, atol=1e-4, rtol=1e-4)
    err, err_eager = rel_error(out.cpu(), ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"normwise error {err:.3g} vs eager fp32 {err_eager:.3g}"


@pytest.mark.parametrize("hidden", [16, 32])
def test_small_tc_f16_form_nan_inf_propagate(hidden, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "1")
    _check_nan_inf_propagate(Shape(1, 4, 9, 16, hidden, 8), 3, "small-tc")


# The chained float16 split form (hidden 32, N <= 48; the default there) and the staged one
# (FLASHOPM_SMALL_F16_CHAIN=0), each checked to be the kernel that ran: S past one chunk of eight
# and not a multiple of it, N past 32 (three m tiles of j) and ragged, one row i per block (an item's
# second row empty; at N = 16 too, where the tile is otherwise whole), chunks of d ragged (D = 70,
# 130), N = S = 1; whole tiles (N a multiple of 16 and of the tile's even rows, S of 8, D of the
# chunk) with one to three m tiles of j, and three m tiles not whole.
F16_CHAIN_CASES = [(SPEC, None), (Shape(1, 5, 31, 24, 32, 40), (4, 8)), (Shape(1, 8, 47, 16, 32, 24), (4, 8)),
                   (Shape(3, 5, 33, 20, 32, 70), (1, 16)), (Shape(1, 12, 31, 8, 32, 130), (4, 8)),
                   (Shape(2, 1, 1, 3, 32, 8), None), (Shape(1, 3, 2, 5, 32, 9), (2, 8)),
                   (Shape(1, 16, 16, 12, 32, 16), None), (Shape(1, 16, 16, 12, 32, 16), (1, 8)),
                   (Shape(2, 8, 48, 8, 32, 32), (4, 8)),
                   (Shape(1, 5, 48, 8, 32, 16), (4, 8)), (Shape(1, 8, 41, 8, 32, 24), (4, 8))]


@pytest.mark.parametrize("staged", [False, True], ids=["chained", "staged"])
@pytest.mark.parametrize("shape,tile", F16_CHAIN_CASES, ids=lambda v: str(v))
def test_small_tc_f16_chained_form(shape, tile, staged, monkeypatch):
    xc, mc, pc = _f16_form_problem(shape, tile, "masked_positions", f"{shape}-chain", monkeypatch, staged=staged)
    kernels = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False, may_not_fit=False))
    name = "opm_small_f16_kernel" if staged else "opm_small_f16_chain_kernel"
    assert any(name in k for k in kernels), kernels
    _check(shape, "masked_positions", "small-tc", seed=zlib.crc32(f"{shape}-chain".encode()) % 1000,
           may_not_fit=False)
    _check_weights_x10(shape, seed=5)


# Pairs of blocks along d share the copies after the wait (a cluster of two, each block's half of a's
# and b's rows multicast to both; by default where N <= 32, FLASHOPM_SMALL_PAIR_COPIES=1 wherever
# the chunks of d pair up, =0 nowhere): the same bits either way, where the chunks come in pairs
# (the spec shape, D = 9 with a ragged second chunk, 16 and 32, N = 48) and where they do not.
@pytest.mark.parametrize("shape,tile", F16_CHAIN_CASES, ids=lambda v: str(v))
def test_small_tc_f16_chained_form_pair_copies(shape, tile, monkeypatch):
    xc, mc, pc = _f16_form_problem(shape, tile, "fractional", f"{shape}-pairs", monkeypatch)
    Dc = torch.ops.flashopm._small_tc_plan(xc, shape.B, shape.S, shape.N, shape.H, shape.D)[1]
    if shape in (SPEC, Shape(1, 3, 2, 5, 32, 9), Shape(2, 8, 48, 8, 32, 32)):  # cases with pairs
        assert -(-shape.D // Dc) % 2 == 0, Dc
    default = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    monkeypatch.setenv("FLASHOPM_SMALL_PAIR_COPIES", "1")
    paired = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    monkeypatch.setenv("FLASHOPM_SMALL_PAIR_COPIES", "0")
    alone = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    assert torch.equal(paired, alone), (paired - alone).abs().max().item()
    assert torch.equal(default, alone), (default - alone).abs().max().item()


def test_small_tc_pair_copies_switch_is_checked(monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_PAIR_COPIES", "2")
    x, m, p = make_problem(SPEC, "masked_positions", seed=4)
    with pytest.raises(RuntimeError, match="FLASHOPM_SMALL_PAIR_COPIES must be 0 or 1"):
        _run(x.cuda(), m.cuda(), _cuda_params(p), "small-tc", poison=False)


def _chain_fused_applies(shape, plan):
    """Whether FLASHOPM_SMALL_F16_FUSED=1 takes one cooperative launch (small_f16_chain_fused): every
    block resident at once, the first kernel's whole-weights form (msa_dim % 4 == 0, at most 64), and
    the staged weights within the items' sums region (small_f16_chain_layout)."""
    S, N, C, H = shape.S, shape.N, shape.C, shape.H
    TI, Dc = plan[0], plan[1]
    blocks = shape.B * -(-N // TI) * -(-shape.D // Dc)
    groups = -(-TI // 2) * (Dc // 8)
    kparts = max(1, min(16 // groups, H // 2 * (-(-S // 8))))
    ldr = TI * Dc + (8 - (TI * Dc) % 32 + 32) % 32
    red_bytes = kparts * (-(-N // 16) * 16) * ldr * 4
    ldw = -(-C // 4) * 4 + (4 if (-(-C // 4) * 4) % 8 == 0 else 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return blocks <= sms and C % 4 == 0 and C <= 64 and red_bytes >= (64 * ldw + 4 * C) * 4


# The chained form in one cooperative launch (FLASHOPM_SMALL_F16_FUSED=1): each block's first warps
# project its share of the rows as the first kernel would, then a grid barrier in place of the
# second launch's wait. Where it applies it must give the two launches' bits; elsewhere the two
# launches run.
@pytest.mark.parametrize("mask_kind", ["masked_positions", "fractional"])
@pytest.mark.parametrize("shape,tile", F16_CHAIN_CASES, ids=lambda v: str(v))
def test_small_tc_f16_chained_form_in_one_launch(shape, tile, mask_kind, monkeypatch):
    seed_text = f"{shape}-{mask_kind}-fused"
    xc, mc, pc = _f16_form_problem(shape, tile, mask_kind, seed_text, monkeypatch, staged=False)
    plan = torch.ops.flashopm._small_tc_plan(xc, shape.B, shape.S, shape.N, shape.H, shape.D)
    two = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    monkeypatch.setenv("FLASHOPM_SMALL_F16_FUSED", "1")
    kernels = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False, may_not_fit=False))
    if _chain_fused_applies(shape, plan):
        assert len(kernels) == 1 and "opm_small_f16_chain_fused_kernel" in kernels[0], kernels
    else:
        assert len(kernels) == 2, kernels
    one = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    assert torch.equal(one, two), (one - two).abs().max().item()
    _check(shape, mask_kind, "small-tc", seed=zlib.crc32(seed_text.encode()) % 1000, may_not_fit=False)


def test_small_tc_f16_chained_form_in_one_launch_applies_at_the_spec_shape(monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_F16_FUSED", "1")
    x, m, p = make_problem(SPEC, "masked_positions", seed=4)
    kernels = flashopm_kernels(lambda: _run(x.cuda(), m.cuda(), _cuda_params(p), "auto", poison=False))
    assert len(kernels) == 1 and "opm_small_f16_chain_fused_kernel" in kernels[0], kernels


# Past N = 48 (four m tiles of j) the float16 split form is the staged one: the chained form stops
# at three.
@pytest.mark.parametrize("shape", [Shape(1, 8, 49, 16, 32, 24), Shape(1, 8, 64, 64, 32, 64)], ids=str)
def test_small_tc_f16_staged_past_three_m_tiles(shape, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "1")
    x, m, p = make_problem(shape, "masked_positions", seed=7)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    kernels = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False, may_not_fit=False))
    assert any("opm_small_f16_kernel" in k for k in kernels), kernels
    assert not any("opm_small_f16_chain_kernel" in k for k in kernels), kernels
    _check(shape, "masked_positions", "small-tc", seed=7, may_not_fit=False)


# The mma.sync form.
@pytest.mark.parametrize("shape", SMALL_TC_SHAPES, ids=str)
def test_small_tc_mma_sync_form(shape, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_FMA", "0")
    _check(shape, "bool", "small-tc", seed=zlib.crc32(f"{shape}-mma".encode()) % 1000, may_not_fit=False)


def test_small_tc_launches(monkeypatch):
    x, m, p = make_problem(SPEC, "masked_positions", seed=4)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    two = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False))
    assert len(two) == 2 and any("opm_prep_kernel" in k for k in two), two
    assert any("opm_small_f16_chain_kernel" in k for k in two), two  # the chained float16 split form under "highest"
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "0")
    fma = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False))
    assert len(fma) == 2 and any("opm_small_tc_kernel<0, false, false>" in k for k in fma), fma
    monkeypatch.delenv("FLASHOPM_SMALL_TC_F16")
    # little work per block: the FMA form by default
    xs, ms, ps = make_problem(Shape(3, 2, 5, 9, 16, 13), "masked_positions", seed=4)
    small = flashopm_kernels(lambda: _run(xs.cuda(), ms.cuda(), _cuda_params(ps), "small-tc", poison=False))
    assert any("opm_small_tc_kernel<0, false, false>" in k for k in small), small
    monkeypatch.setenv("FLASHOPM_SMALL_TC_LOCAL_A", "1")
    local = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False))
    assert len(local) == 2 and any("opm_small_tc_kernel<0, false, true>" in k for k in local), local
    monkeypatch.delenv("FLASHOPM_SMALL_TC_LOCAL_A")
    monkeypatch.setenv("FLASHOPM_SMALL_TC_FUSED", "1")
    one = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False))
    assert len(one) == 1 and "opm_small_tc_kernel<0, true, false>" in one[0], one


@pytest.mark.parametrize("shape", [SPEC, Shape(1, 48, 24, 40, 16, 8), Shape(3, 2, 5, 9, 16, 13)], ids=str)
def test_prep_weight_copies_order_keeps_the_bits(shape, monkeypatch):
    """The first kernel issues its weight copies after the rows' loads; issued first
    (FLASHOPM_PREP_WEIGHTS_FIRST=1) the same sums give the same bits."""
    x, m, p = make_problem(shape, "masked_positions", seed=8)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    late = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    monkeypatch.setenv("FLASHOPM_PREP_WEIGHTS_FIRST", "1")
    first = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    assert torch.equal(late, first)
    torch.testing.assert_close(late.cpu(), reference(xc, mc, pc).cpu(), atol=1e-4, rtol=1e-4)


# msa_dim a multiple of 4 up to 64 (whole or partial chunks of 32), one or two projection outputs
# per lane (2H up to 32, or up to 64), the float16 split form and the FMA form.
PREP_WHOLE_W_CASES = [(SPEC, "f16"), (SPEC, "fma"), (Shape(1, 48, 24, 40, 16, 8), "f16"),
                      (Shape(3, 2, 5, 12, 8, 13), "fma"), (Shape(2, 5, 17, 60, 32, 24), "f16"),
                      (Shape(1, 3, 7, 4, 24, 8), "fma"), (Shape(2, 4, 9, 36, 32, 10), "fma"),
                      (Shape(2, 8, 48, 64, 32, 64), "f16")]


@pytest.mark.parametrize("shape,form", PREP_WHOLE_W_CASES, ids=str)
@pytest.mark.parametrize("weights_first", [False, True], ids=["weights-late", "weights-first"])
def test_prep_whole_weights_keeps_the_bits(shape, form, weights_first, monkeypatch):
    """The first kernel stages W_a's and W_b's rows whole where msa_dim allows (one group of copies,
    no block barriers between chunks); in chunks (FLASHOPM_PREP_WHOLE_W=0) the same products in the
    same order give the same bits.  So does either form at every block size (FLASHOPM_PREP_WARPS):
    a row is one warp's work whatever the block."""
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "1" if form == "f16" else "0")
    if weights_first:
        monkeypatch.setenv("FLASHOPM_PREP_WEIGHTS_FIRST", "1")
    x, m, p = make_problem(shape, "masked_positions", seed=zlib.crc32(f"{shape}-whole".encode()) % 1000)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    kernels = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False, may_not_fit=False))
    assert any("opm_prep_kernel" in k and "float, true>" in k for k in kernels), kernels
    whole = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    for warps in ("2", "4", "8"):
        monkeypatch.setenv("FLASHOPM_PREP_WARPS", warps)
        assert torch.equal(_run(xc, mc, pc, "small-tc", may_not_fit=False), whole), warps
    monkeypatch.delenv("FLASHOPM_PREP_WARPS")
    monkeypatch.setenv("FLASHOPM_PREP_WHOLE_W", "0")
    kernels = flashopm_kernels(lambda: _run(xc, mc, pc, "small-tc", poison=False, may_not_fit=False))
    assert any("opm_prep_kernel" in k and "float, false>" in k for k in kernels), kernels
    chunked = _run(xc, mc, pc, "small-tc", may_not_fit=False)
    assert torch.equal(whole, chunked)
    for warps in ("2", "8"):
        monkeypatch.setenv("FLASHOPM_PREP_WARPS", warps)
        assert torch.equal(_run(xc, mc, pc, "small-tc", may_not_fit=False), whole), warps
    torch.testing.assert_close(whole.cpu(), reference(xc, mc, pc).cpu(), atol=1e-4, rtol=1e-4)


def test_prep_warps_setting_is_checked(monkeypatch):
    x, m, p = make_problem(SPEC, "masked_positions", seed=3)
    monkeypatch.setenv("FLASHOPM_PREP_WARPS", "3")
    with pytest.raises(RuntimeError, match="FLASHOPM_PREP_WARPS"):
        _run(x.cuda(), m.cuda(), _cuda_params(p), "small-tc", may_not_fit=False)


# Tilings of the two-launch path forced one by one: rows per block 1 to 8 (ragged at N = 13),
# chunks of d from 8 to 64 (ragged at D = 70), phase O's columns (i, d) in one group or several;
# TI·S a multiple of 4 or not (a's copies in 16- or 4-byte pieces in the FMA form).
SMALL_TC_TILINGS = [(Shape(2, 8, 32, 64, 32, 64), tile) for tile in [(1, 8), (1, 32), (1, 64), (2, 16), (4, 8), (8, 8)]] + [
    (Shape(2, 3, 13, 9, H, 70), tile) for H in (8, 16) for tile in [(1, 64), (2, 32), (4, 16), (8, 8), (8, 64)]]


@pytest.mark.parametrize("form", ["f16", "fma", "mma_sync"])
@pytest.mark.parametrize("shape,tile", SMALL_TC_TILINGS, ids=lambda v: str(v))
def test_small_tc_tilings(shape, tile, form, monkeypatch):
    monkeypatch.setenv("FLASHOPM_SMALL_TC_TILE", f"{tile[0]},{tile[1]}")
    monkeypatch.setenv("FLASHOPM_SMALL_TC_F16", "1" if form == "f16" else "0")
    if form == "mma_sync":
        monkeypatch.setenv("FLASHOPM_SMALL_TC_FMA", "0")
    _check(shape, "masked_positions", "small-tc", seed=zlib.crc32(f"{shape}-{tile}".encode()) % 1000,
           may_not_fit=False)


def test_small_tc_tiling_setting_is_checked(monkeypatch):
    x, m, p = make_problem(SPEC, "masked_positions", seed=2)
    monkeypatch.setenv("FLASHOPM_SMALL_TC_TILE", "4x8")
    with pytest.raises(RuntimeError, match="FLASHOPM_SMALL_TC_TILE"):
        _run(x.cuda(), m.cuda(), _cuda_params(p), "small-tc")


def test_auto_uses_small_tc_on_spec():
    x, m, p = make_problem(SPEC, "masked_positions", seed=2)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    assert torch.equal(_run(xc, mc, pc, "auto"), _run(xc, mc, pc, "small-tc", may_not_fit=False))


def _rows_above_tiled_projection_threshold(B, N, extra):
    """S such that B*S*N passes the rows at which the LayerNorm/projection stage switches to its
    register-tiled kernel (a block of 128 rows on every other SM), by `extra` rows or more, and is
    not a multiple of 128."""
    threshold = 64 * torch.cuda.get_device_properties(0).multi_processor_count
    S = (threshold + extra) // (B * N) + 1
    while (B * S * N) % 128 == 0:
        S += 1
    return S


# (B, N, C, H, D, mask kind): outputs per thread 1, 2, 4 and 8 (2H <= 16, 32, 64, 128), msa_dim
# 2, primes and one past a 32-wide chunk, every mask kind.  (msa_dim 1 makes every row's LayerNorm
# output the bias, so the contraction sums hundreds of identical terms, where its accumulation
# order, not this kernel, sets the error; the sweep covers msa_dim 1.)
TILED_PROJECTION = [
    (1, 17, 33, 17, 5, "masked_positions"),
    (2, 31, 257, 64, 7, "fractional"),
    (1, 29, 2, 3, 4, "binary"),
    (1, 13, 64, 8, 9, "bool"),
    (3, 11, 40, 32, 6, "ones"),
]


@pytest.mark.parametrize("case", TILED_PROJECTION, ids=lambda c: "B{}_N{}_C{}_H{}_D{}_{}".format(*c))
def test_tiled_projection_kernel(case):
    B, N, C, H, D, mask_kind = case
    shape = Shape(B, _rows_above_tiled_projection_threshold(B, N, 100), N, C, H, D)
    _check(shape, mask_kind, "auto", seed=C + H)


def test_tiled_projection_in_row_blocks():
    """a projected for blocks of rows (n_offset > 0): b for all 128 residues at S = 1100 and hidden 64
    passes the workspace budget, so rows are blocked (two blocks of 64)."""
    _check(Shape(1, 1100, 128, 24, 64, 8), "masked_positions", "auto", seed=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiled_projection_half_precision(dtype):
    shape = Shape(1, _rows_above_tiled_projection_threshold(1, 29, 50), 29, 64, 32, 16)
    x, m, p = make_problem(shape, "masked_positions", seed=3)
    x16, m16 = x.to(dtype).cuda(), m.to(dtype).cuda()
    p16 = {k: v.to(dtype).cuda() for k, v in p.items()}
    ref32 = reference(x16, m16, p16, dtype=torch.float32).cpu()
    eager = reference(x16, m16, p16).float().cpu()
    out = _run(x16, m16, p16, "auto")
    assert not out.isnan().any()
    err, err_eager = rel_error(out.float().cpu(), ref32), rel_error(eager, ref32)
    assert err <= max(2 * err_eager, 2 * torch.finfo(dtype).eps), f"error {err:.3g} vs eager {dtype} {err_eager:.3g}"


@pytest.mark.parametrize("H", [8, 32, 64])
def test_tiled_projection_tf32_under_high(H):
    """float32 under "high": the tiled projection kernel's tensor-core form (TF32 products, as
    PyTorch's linear layers take them at that precision); error against float64 at most 2x that
    of eager PyTorch under "high", and "highest" unchanged by it (float32 bars)."""
    shape = Shape(1, _rows_above_tiled_projection_threshold(1, 29, 50), 29, 64, H, 16)
    x, m, p = make_problem(shape, "masked_positions", seed=H)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    out_high = _run(xc, mc, pc, "outer", precision="high").cpu()
    assert not out_high.isnan().any()
    err, err_eager_tf32 = rel_error(out_high, ref64), rel_error(_eager_tf32(xc, mc, pc), ref64)
    assert err <= 2 * err_eager_tf32, f"TF32: {err:.3g} vs eager TF32 {err_eager_tf32:.3g}"
    out_highest = _run(xc, mc, pc, "outer", precision="highest").cpu()
    err_highest, err_eager = rel_error(out_highest, ref64), rel_error(reference(xc, mc, pc).cpu(), ref64)
    assert err_highest <= max(2 * err_eager, FP64_FLOOR), f"{err_highest:.3g} vs eager fp32 {err_eager:.3g}"


@pytest.mark.parametrize("H", [8, 32, 64])
@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_tiled_projection_3xtf32_under_highest(H, scale, monkeypatch):
    """float32 under "highest": the tiled projection kernel's tensor-core form in 3xTF32 (split
    operands, float32 sums) within the float32 bars (error against float64 at most 2x eager
    float32's, weights scaled x10 too), and FLASHOPM_PROJECTION_MMA=0 takes the float32 FMA form,
    whose other rounding gives other bits: the switch (and so the form) is live."""
    shape = Shape(1, _rows_above_tiled_projection_threshold(1, 29, 50), 29, 64, H, 16)
    x, m, p = make_problem(shape, "fractional", seed=H + 1, scale=scale)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    ref32 = reference(xc, mc, pc).cpu()
    err_eager = rel_error(ref32, ref64)
    out = _run(xc, mc, pc, "outer", precision="highest").cpu()
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
    err = rel_error(out, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"3xTF32: {err:.3g} vs eager fp32 {err_eager:.3g}"
    monkeypatch.setenv("FLASHOPM_PROJECTION_MMA", "0")
    fma = _run(xc, mc, pc, "outer", precision="highest").cpu()
    err_fma = rel_error(fma, ref64)
    assert err_fma <= max(2 * err_eager, FP64_FLOOR), f"FMA form: {err_fma:.3g} vs eager fp32 {err_eager:.3g}"
    assert not torch.equal(out, fma), "FLASHOPM_PROJECTION_MMA=0 changed nothing: the form switch is dead"


HALF_SHAPES = [
    SPEC,
    Shape(1, 128, 64, 64, 32, 128),  # outer-first on tensor cores
    Shape(1, 5, 65, 33, 5, 7),       # odd hidden: CUDA-core paths
    Shape(2, 9, 31, 48, 31, 65),
    Shape(3, 3, 17, 20, 8, 24),
    # 16-bit tensor-core kernel: S off its stage depth, partial column tiles, two groups of d
    Shape(1, 37, 45, 32, 32, 130),
    Shape(2, 20, 19, 24, 16, 7),     # odd D, hidden 16
    Shape(1, 40, 21, 16, 64, 64),    # hidden 64: fewer pairs per block than phase 2's rows
    Shape(1, 1, 300, 8, 8, 3),       # hidden 8: many rounds of pairs per block
    Shape(1, 3, 16, 8, 8, 5),        # partial column tiles filling whole rounds of phase 2
    Shape(2, 5, 8, 12, 16, 130),     # the same at hidden 16, two groups of d
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES, ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_half_precision_inputs(dtype, shape, algorithm):
    """bfloat16/float16 inputs and parameters: the output in that type, every element written,
    and normwise error against float32 PyTorch on the same (rounded) inputs at most 2x that of
    eager PyTorch in the same type."""
    x, m, p = make_problem(shape, "masked_positions", seed=zlib.crc32(f"{shape}-{dtype}".encode()) % 1000)
    x16, m16 = x.to(dtype).cuda(), m.to(dtype).cuda()
    p16 = {k: None if v is None else v.to(dtype).cuda() for k, v in p.items()}
    ref32 = reference(x16, m16, p16, dtype=torch.float32).cpu()
    eager = reference(x16, m16, p16).float().cpu()
    x_before = x16.clone()
    out = _run(x16, m16, p16, algorithm)
    assert out.dtype == dtype and out.shape == (shape.B, shape.N, shape.N, shape.D) and out.is_contiguous()
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(x16, x_before)
    err, err_eager = rel_error(out.float().cpu(), ref32), rel_error(eager, ref32)
    assert err <= max(2 * err_eager, 2 * torch.finfo(dtype).eps), f"error {err:.3g} vs eager {dtype} {err_eager:.3g}"
    assert torch.equal(out, _run(x16, m16, p16, algorithm)), "two identical calls differ: a race"


def _half_problem(shape, dtype, tag: str):
    """A problem (masked positions) in a 16-bit type on the GPU, seeded by the shape and `tag`."""
    x, m, p = make_problem(shape, "masked_positions", seed=zlib.crc32(f"{shape}-{tag}".encode()) % 1000)
    return x.to(dtype).cuda(), m.to(dtype).cuda(), {k: None if v is None else v.to(dtype).cuda() for k, v in p.items()}


def _is_cluster_kernel(name: str, cluster: int, wide: bool = False) -> bool:
    """Whether a kernel's name is the tensor-copy form's in clusters of `cluster` blocks, with three
    consumer warpgroups (wide) or two."""
    m = re.search(r"opm_outer_tc16_cluster_kernel<[^,>]+, (\d+)(?:, (true|false))?>", name)
    return m is not None and int(m.group(1)) == cluster and (m.group(2) == "true") == wide


# The 16-bit kernel's tensor-copy forms (FLASHOPM_TC16_CLUSTER=1, 2 or 4: a producer warp issues
# the stages and W chunks by tensor copies, in clusters of one, two or four blocks along rows, each
# block's share of b and W multicast to all): whole tiles at hidden 32 with a number of row tiles that is not a multiple of
# the cluster's (the last cluster's blocks past Na), S off the stage depth with partial column
# tiles and two groups of d in a batch of 2 (the second group's rows of d past D in some blocks'
# whole shares), hidden 16, and hidden 8 (1024 pairs a block: 16 rounds of phase 2, W's chunk
# sequence over rounds and groups of d); one stage per column tile, and deep MSAs whose stage
# buffers are refilled many times.
CLUSTER_SHAPES = [
    Shape(1, 64, 164, 64, 32, 128),
    Shape(2, 37, 45, 32, 32, 130),
    Shape(1, 100, 256, 24, 16, 64),
    Shape(1, 33, 99, 16, 8, 200),
    Shape(1, 8, 164, 64, 32, 128),    # one stage a column tile (S <= 32)
    Shape(1, 300, 164, 64, 32, 64),   # 20 stages: each buffer refilled with both parities
    Shape(1, 520, 96, 32, 16, 64),    # 34 stages at hidden 16
]


@pytest.mark.parametrize("cluster", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", CLUSTER_SHAPES, ids=str)
def test_tc16_cluster_form_gives_the_default_bits(shape, dtype, cluster, monkeypatch):
    """The tensor-copy form runs (profiler) and gives the bits of the form without tensor copies
    (the same products in the same order), every element written (poisoned output), two calls
    equal; the same under the memory bound."""
    x16, m16, p16 = _half_problem(shape, dtype, "pairs")
    monkeypatch.setenv("FLASHOPM_TC16_WIDE", "0")  # the two-warpgroup forms (the wide ones: below)
    monkeypatch.setenv("FLASHOPM_TC16_CLUSTER", "0")
    monkeypatch.delenv("FLASHOPM_TC16_MMA_SYNC", raising=False)
    default = _run(x16, m16, p16, "outer")
    kernels = flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False))
    assert not any("opm_outer_tc16_cluster_kernel" in k for k in kernels), kernels
    if not any("opm_outer_tc16_kernel" in k and "true, true" in k for k in kernels):
        pytest.skip("the 16-bit kernel's form with both phases on warpgroup MMAs does not run here (sm_90a only)")
    monkeypatch.setenv("FLASHOPM_TC16_CLUSTER", str(cluster))

    def ran(names):
        return any(_is_cluster_kernel(k, cluster) for k in names)

    kernels = flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False))
    assert ran(kernels), f"the form in clusters of {cluster} did not run (clusters of that size not available?): {kernels}"
    clustered = _run(x16, m16, p16, "outer")
    assert not clustered.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(clustered, default), f"the form in clusters of {cluster} gives other bits than the default form"
    assert torch.equal(clustered, _run(x16, m16, p16, "outer")), "two identical calls differ: a race"
    # one cluster per group of tiles, and three clusters each taking many groups in turn (their
    # stage rings and W chunks carried from tile to tile, each tile's last round stored beside the
    # next tile's first stages, or at once); O stored by stmatrix (FLASHOPM_TC16_STMATRIX=1)
    for env in ({"FLASHOPM_TC16_PERSISTENT": "0"}, {"FLASHOPM_TC16_MAX_CLUSTERS": "3"},
                {"FLASHOPM_TC16_MAX_CLUSTERS": "3", "FLASHOPM_TC16_DEFER": "0"},
                {"FLASHOPM_TC16_MAX_CLUSTERS": "3", "FLASHOPM_TC16_WIDE_STORES": "0"},
                {"FLASHOPM_TC16_MAX_CLUSTERS": "3", "FLASHOPM_TC16_STMATRIX": "1"},
                {"FLASHOPM_TC16_STMATRIX": "1"}):
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            other = _run(x16, m16, p16, "outer")
        assert torch.equal(other, default), f"clusters of {cluster} with {env}: other bits than the default form"
    # under the memory bound: launches over bands of rows and blocks of columns.  A launch whose
    # band or block leaves partial tiles takes the default form on both sides (the comparison is
    # then of two identical calls), so whether the clustered form ran is reported.
    with flashopm.peak_memory_bound(1.1):
        if not ran(flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False))):
            warnings.warn(f"{shape}: under the bound the form in clusters of {cluster} did not run")
        bounded_clustered = _run(x16, m16, p16, "outer")
        monkeypatch.setenv("FLASHOPM_TC16_CLUSTER", "0")
        bounded_default = _run(x16, m16, p16, "outer")
    assert not bounded_clustered.isnan().any(), "NaN in the output under the bound: an element was not written"
    assert torch.equal(bounded_clustered, bounded_default), "under the bound the clustered form's bits differ"


# The tensor-copy forms with three consumer warpgroups (FLASHOPM_TC16_WIDE=1: tiles of 192 rows (i,
# h1), 96 pairs, at hidden 32 with D <= 128): the shapes of the two-warpgroup test that qualify (a
# last row tile past Na, one stage a column tile, stage buffers refilled with both parities), a
# batch of 3 with a prime N in one partial tile, a prime N below a column block, and D = 100 (4-byte
# output stores, bias columns past D).
WIDE_SHAPES = [s for s in CLUSTER_SHAPES if s.H == 32 and s.D <= 128] + [
    Shape(3, 70, 13, 24, 32, 128), Shape(1, 40, 11, 16, 32, 16), Shape(2, 37, 45, 32, 32, 100)]


def _wide_against_default(shape, dtype, normalization, cluster, monkeypatch, **env):
    """The problem of `shape` in `dtype`, the form without tensor copies' output for it, and the
    environment then set for the wide tensor-copy form in clusters of `cluster` (with `env`),
    whose run there the profiler confirms; skips where the wgmma forms do not run (sm_90a only)."""
    x16, m16, p16 = _half_problem(shape, dtype, "wide")
    monkeypatch.setenv("FLASHOPM_TC16_CLUSTER", "0")
    monkeypatch.delenv("FLASHOPM_TC16_MMA_SYNC", raising=False)
    default = _run(x16, m16, p16, "outer", normalization=normalization)
    kernels = flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False, normalization=normalization))
    if not any("opm_outer_tc16_kernel" in k and "true, true" in k for k in kernels):
        pytest.skip("the 16-bit kernel's form with both phases on warpgroup MMAs does not run here (sm_90a only)")
    monkeypatch.setenv("FLASHOPM_TC16_CLUSTER", str(cluster))
    monkeypatch.setenv("FLASHOPM_TC16_WIDE", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    kernels = flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False, normalization=normalization))
    assert any(_is_cluster_kernel(k, cluster, wide=True) for k in kernels), kernels
    return x16, m16, p16, default


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("normalization", ["row", "openfold"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=str)
def test_tc16_wide_form_gives_the_default_bits(shape, dtype, normalization, cluster, monkeypatch):
    """The three-warpgroup tensor-copy form runs (profiler) and gives the bits of the form without
    tensor copies (the same products in the same order: phase 1 as two m64n128k16 rather than one
    m64n256k16, phase 2 as one m64n96k16 over both column tiles rather than m64n64k16 over 64
    pairs, each sum over k in the same order, O and the stages in slices, W's chunks in O's used
    slices),
    every element written (poisoned output), two calls equal; resident clusters taking many tiles
    in turn, and one cluster a group of tiles; each tile's outputs stored by the consumers at once
    (FLASHOPM_TC16_STORE_WARPS=0) rather than by the producer warpgroup's other warps; a block's b
    groups a copy each (FLASHOPM_TC16_B_PAIRS=0) rather than two a copy where N·hidden allows; W's
    chunks 2-3 copied by the producer (FLASHOPM_TC16_W_THIRD=0) rather than stored by the third
    warpgroup."""
    x16, m16, p16, default = _wide_against_default(shape, dtype, normalization, cluster, monkeypatch)
    wide = _run(x16, m16, p16, "outer", normalization=normalization)
    assert not wide.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(wide, default), "the wide form gives other bits than the default form"
    assert torch.equal(wide, _run(x16, m16, p16, "outer", normalization=normalization)), "two calls differ: a race"
    for env in ({"FLASHOPM_TC16_MAX_CLUSTERS": "3"}, {"FLASHOPM_TC16_PERSISTENT": "0"},
                {"FLASHOPM_TC16_MAX_CLUSTERS": "3", "FLASHOPM_TC16_STORE_WARPS": "0"},
                {"FLASHOPM_TC16_B_PAIRS": "0"}, {"FLASHOPM_TC16_MAX_CLUSTERS": "3", "FLASHOPM_TC16_B_PAIRS": "0"},
                {"FLASHOPM_TC16_W_THIRD": "0"}, {"FLASHOPM_TC16_MAX_CLUSTERS": "3", "FLASHOPM_TC16_W_THIRD": "0"}):
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            other = _run(x16, m16, p16, "outer", normalization=normalization)
        assert torch.equal(other, default), f"the wide form with {env}: other bits than the default form"


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("normalization", ["row", "openfold"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=str)
def test_tc16_wide_w_third_two_gives_the_default_bits(shape, dtype, normalization, cluster, monkeypatch):
    """W's chunks 5 and 6 of each tile also stored by the wide form's third consumer warpgroup
    from its registers (FLASHOPM_TC16_W_THIRD=2; each after its chunk two before is stored, into
    the slot of chunk 2 or 3 once this block has retired that chunk): the default form's bits,
    every element written (poisoned output), two calls equal, also with resident clusters taking
    many tiles in turn."""
    x16, m16, p16, default = _wide_against_default(shape, dtype, normalization, cluster, monkeypatch,
                                                   FLASHOPM_TC16_W_THIRD="2")
    out = _run(x16, m16, p16, "outer", normalization=normalization)
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(out, default), "W_THIRD=2 gives other bits than the default form"
    assert torch.equal(out, _run(x16, m16, p16, "outer", normalization=normalization)), "two calls differ: a race"
    monkeypatch.setenv("FLASHOPM_TC16_MAX_CLUSTERS", "3")
    assert torch.equal(_run(x16, m16, p16, "outer", normalization=normalization), default), \
        "W_THIRD=2 with three resident clusters: other bits than the default form"


@pytest.mark.parametrize("normalization", ["row", "openfold"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=str)
def test_tc16_wide_w_local_gives_the_default_bits(shape, dtype, normalization, monkeypatch):
    """Each block of a cluster of two copying both halves of W's chunks into its own shared memory
    once its own phase-2 warpgroups have released the chunk before in that slot
    (FLASHOPM_TC16_W_LOCAL=1), rather than its half to both blocks once both have: the default
    form's bits, every element written (poisoned output), two calls equal, with the third
    warpgroup storing none, two or four of W's chunks, and with resident clusters taking many
    tiles in turn."""
    x16, m16, p16, default = _wide_against_default(shape, dtype, normalization, 2, monkeypatch,
                                                   FLASHOPM_TC16_W_LOCAL="1")
    out = _run(x16, m16, p16, "outer", normalization=normalization)
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(out, default), "W_LOCAL=1 gives other bits than the default form"
    assert torch.equal(out, _run(x16, m16, p16, "outer", normalization=normalization)), "two calls differ: a race"
    for env in ({"FLASHOPM_TC16_MAX_CLUSTERS": "3"}, {"FLASHOPM_TC16_W_THIRD": "0"}, {"FLASHOPM_TC16_W_THIRD": "2"},
                {"FLASHOPM_TC16_MAX_CLUSTERS": "3", "FLASHOPM_TC16_W_THIRD": "2"}):
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            other = _run(x16, m16, p16, "outer", normalization=normalization)
        assert torch.equal(other, default), f"W_LOCAL=1 with {env}: other bits than the default form"


# The form without tensor copies as resident blocks taking tiles in turn (FLASHOPM_TC16_RESIDENT=0:
# a block a tile), and its 16-byte output stores (FLASHOPM_TC16_WIDE_STORES=0: 4-byte).  D = 130
# and 200 take a second group of d and the 4-byte stores.
@pytest.mark.parametrize("normalization", ["row", "openfold"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", CLUSTER_SHAPES, ids=str)
def test_tc16_default_form_variants_give_the_same_bits(shape, dtype, normalization, monkeypatch):
    """The 16-bit kernel's form without tensor copies, resident or not, 16- or 4-byte stores:
    every element written (poisoned output), two calls equal, and the same bits every way (the
    same products in the same order)."""
    x16, m16, p16 = _half_problem(shape, dtype, "early")
    monkeypatch.setenv("FLASHOPM_TC16_CLUSTER", "0")
    monkeypatch.delenv("FLASHOPM_TC16_MMA_SYNC", raising=False)
    early = _run(x16, m16, p16, "outer", normalization=normalization)
    assert not early.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(early, _run(x16, m16, p16, "outer", normalization=normalization)), "two calls differ: a race"
    # a block a tile rather than resident blocks taking tiles in turn; 4-byte output stores rather
    # than 16-byte; three resident blocks, each taking many tiles (each tile's first stages issued
    # beside the epilogue of the one before, its last round's sums over O)
    for env in ({"FLASHOPM_TC16_RESIDENT": "0"}, {"FLASHOPM_TC16_WIDE_STORES": "0"}, {"FLASHOPM_TC16_MAX_CLUSTERS": "3"}):
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            other = _run(x16, m16, p16, "outer", normalization=normalization)
        assert torch.equal(early, other), f"{env}: other bits than the default"


# OpenFold's and Boltz's conventions on the 16-bit kernel (their pair counts, and the divisor's
# reciprocal staged per round of phase 2): the half-precision tests' error rule, and the clustered
# forms' bits equal to the default form's.
@pytest.mark.parametrize("normalization", ["openfold", "boltz"])
@pytest.mark.parametrize("shape", [CLUSTER_SHAPES[0], CLUSTER_SHAPES[1], CLUSTER_SHAPES[3]], ids=str)
def test_tc16_conventions(shape, normalization, monkeypatch):
    """The OpenFold and Boltz conventions in bfloat16 through the 16-bit kernel: every element
    written, normwise error against float32 PyTorch on the same inputs at most 2x eager
    bfloat16's; in each tensor-copy form the bits of the form without tensor copies."""
    dtype = torch.bfloat16
    x, m, p = make_problem(shape, "masked_positions", seed=zlib.crc32(f"{shape}-{normalization}".encode()) % 1000)
    x16, m16 = x.to(dtype).cuda(), m.to(dtype).cuda()
    p16 = {k: None if v is None else v.to(dtype).cuda() for k, v in p.items()}
    code = flashopm.ops.NORMALIZATIONS[normalization]
    ref32 = reference(x16, m16, p16, dtype=torch.float32, normalization=code).cpu()
    eager = reference(x16, m16, p16, normalization=code).float().cpu()
    monkeypatch.setenv("FLASHOPM_TC16_CLUSTER", "0")
    monkeypatch.delenv("FLASHOPM_TC16_MMA_SYNC", raising=False)
    out = _run(x16, m16, p16, "outer", normalization=normalization)
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    err, err_eager = rel_error(out.float().cpu(), ref32), rel_error(eager, ref32)
    assert err <= max(2 * err_eager, 2 * torch.finfo(dtype).eps), f"error {err:.3g} vs eager {dtype} {err_eager:.3g}"
    kernels = flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False, normalization=normalization))
    if not any("opm_outer_tc16_kernel" in k and "true, true" in k for k in kernels):
        pytest.skip("the 16-bit kernel's form with both phases on warpgroup MMAs does not run here (sm_90a only)")
    # two consumer warpgroups in clusters of 1, 2 and 4, three in clusters of 1 and 2 (where the
    # shape qualifies: hidden 32, D <= 128; else the two-warpgroup form runs)
    for cluster, wide in ((1, False), (2, False), (4, False), (1, True), (2, True)):
        monkeypatch.setenv("FLASHOPM_TC16_CLUSTER", str(cluster))
        monkeypatch.setenv("FLASHOPM_TC16_WIDE", "1" if wide else "0")
        wide_runs = wide and shape.H == 32 and shape.D <= 128
        kernels = flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False, normalization=normalization))
        assert any(_is_cluster_kernel(k, cluster, wide_runs) for k in kernels), kernels
        clustered = _run(x16, m16, p16, "outer", normalization=normalization)
        assert torch.equal(clustered, out), (
            f"{normalization}: clusters of {cluster} (wide {wide_runs}) give other bits than the default form")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_module_and_gradients(dtype):
    """A model cast to the type as a whole (the way bfloat16 checkpoints are run): forward like the
    reference module in that type, and gradients within 2x of eager's error in that type."""
    torch.manual_seed(3)
    ref = flashopm.Model(64, 64, 32).cuda()
    new = flashopm.ModelNew(64, 64, 32).cuda()
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, 8, 32, 64, device="cuda")
    m = (torch.rand(2, 8, 32, device="cuda") > 0.3).float()
    m[:, :, 5] = 0  # a position masked over all of S

    def run(model, dtype_):
        model = model.to(dtype_)
        xi = x.detach().clone().to(dtype_).requires_grad_(True)
        out = model(xi, m.to(dtype_))
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        grads = [xi.grad] + [q.grad for q in model.parameters()]
        return out, grads

    out32, g32 = run(copy.deepcopy(ref), torch.float32)
    out_eager, g_eager = run(copy.deepcopy(ref), dtype)
    out_new, g_new = run(new, dtype)
    assert out_new.dtype == dtype
    assert rel_error(out_new.float(), out32) <= 2 * rel_error(out_eager.float(), out32) + 2 * torch.finfo(dtype).eps
    for a, e, r in zip(g_new, g_eager, g32):
        assert a.dtype == dtype
        assert rel_error(a.float(), r) <= 2 * rel_error(e.float(), r) + 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("B,S,N", [(0, 3, 4), (2, 0, 4), (2, 3, 0)])
def test_empty_sizes(B, S, N):
    torch.manual_seed(0)
    model = flashopm.ModelNew(5, 4, 3).cuda()
    ref = flashopm.Model(5, 4, 3).cuda()
    ref.load_state_dict(model.state_dict())
    x, m = torch.randn(B, S, N, 5, device="cuda"), torch.ones(B, S, N, device="cuda")
    out, expect = model(x, m), ref(x, m)
    assert out.shape == expect.shape
    torch.testing.assert_close(out, expect)


def _check_nan_inf_propagate(shape, seed, algorithm, precision=None):
    """A NaN and a masked Inf in x reach exactly the outputs they reach in the reference."""
    x, m, p = make_problem(shape, "binary", seed=seed)
    x[0, 1, 2, 3] = float("nan")
    x[0, 2, 5, 0] = float("inf")
    m[0, 2, 5] = 0.0  # masked Inf still poisons, as 0 * inf = nan in the reference
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    expect = reference(xc, mc, pc)
    out = _run(xc, mc, pc, algorithm, poison=False, precision=precision)
    assert torch.equal(out.isnan(), expect.isnan())
    fin = ~expect.isnan()
    torch.testing.assert_close(out[fin], expect[fin], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nan_inf_propagate_like_reference(algorithm):
    _check_nan_inf_propagate(Shape(1, 4, 9, 16, 8, 8), 3, algorithm)


def test_large_shape_correct_with_bounded_memory():
    """(1,128,256,256,32,128): correct, and peak extra memory <= 1.25x the output."""
    shape = Shape(1, 128, 256, 256, 32, 128)
    x, m, p = make_problem(shape, "masked_positions", seed=9)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref32 = reference(xc, mc, pc)
    ref_cpu = ref32.cpu()
    del ref32
    torch.cuda.synchronize()
    # Bytes the op asks for, not the allocator's blocks: a cached block left by earlier tests can
    # be handed out whole, larger than the request.
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    out = _run(xc, mc, pc, poison=False)
    torch.cuda.synchronize()
    extra = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base
    assert extra <= 1.25 * shape.out_bytes, f"peak extra {extra} B vs output {shape.out_bytes} B"
    torch.testing.assert_close(out.cpu(), ref_cpu, atol=1e-4, rtol=1e-4)


def _peak_and_out(call):
    """Bytes `call()` asks for at its peak beyond what was allocated before (the output included),
    and its output on the CPU, the output's block poisoned first."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    poison_ptr = poison_output_block(call)
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    assert out.data_ptr() == poison_ptr, "the poisoned block was not reused; the check proves nothing"
    return torch.cuda.memory_stats()["requested_bytes.all.peak"] - base, out.cpu()


def test_peak_bound_1_1_row_blocks(monkeypatch):
    """FLASHOPM_PEAK_BOUND=1.1: where b for all residues leaves room, a comes in bands of rows so
    that the peak extra memory stays within 1.1x the output ((1,128,512,64,32,128): a and b together
    would be 0.25x it; b stays in the workspace, the first band's a lies in the output's rows after
    it), with the same bits as the default's one block, which passes 1.1x (so the bound is the
    bands')."""
    shape = Shape(1, 128, 512, 64, 32, 128)
    x, m, p = make_problem(shape, "masked_positions", seed=12)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref32 = reference(xc, mc, pc).cpu()
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    loose, out_loose = _peak_and_out(lambda: _run(xc, mc, pc, poison=False))
    assert loose > 1.1 * shape.out_bytes, f"one block: peak extra {loose} B vs output {shape.out_bytes} B"
    monkeypatch.setenv("FLASHOPM_PEAK_BOUND", "1.1")
    extra, out = _peak_and_out(lambda: _run(xc, mc, pc, poison=False))
    assert extra <= 1.1 * shape.out_bytes, f"peak extra {extra} B vs output {shape.out_bytes} B"
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
    assert rel_error(out, ref64) <= max(2 * rel_error(ref32, ref64), FP64_FLOOR)
    torch.testing.assert_close(out_loose, out, atol=0, rtol=0)


# (shape, precision, FLASHOPM_TC_FORM, normalization, plan): the forms of the outer-first path.
# At N = 200-256 and D = 128, b for all s takes more than a tenth of the output (in the operand
# type), so a bound of 1.1x needs the sum over s in parts, blocks of columns, or (one batch
# element) bands of rows whose a and b lie in the output's rows not written yet.  Plans: None,
# bands where they apply; "workspace" (FLASHOPM_PEAK_TAIL=0): no bands, so the sum over s in
# parts with blocks of rows and columns where a launch of such blocks still fills the GPU, else
# with blocks of rows; "rows" (FLASHOPM_PEAK_PLAN=rows): blocks of rows alone (with two batch
# elements, the normalisers of every row read at each block's offset).  S = 100 leaves K-major
# chunks past the end of a part.  The bands at (1,400,256,24,12,128) and (1,300,256,...) take
# parts for their last band (from the workspace), at (1,1024,256,24,32,128) for every band.
PARTS_CASES = [
    (Shape(1, 100, 256, 24, 32, 128), "highest", None, "row", "workspace"),
    (Shape(1, 100, 256, 24, 32, 128), "high", None, "openfold", "workspace"),
    (Shape(1, 100, 256, 24, 32, 128), "highest", "mma_sync", "boltz", "workspace"),
    (Shape(1, 400, 256, 24, 12, 128), "highest", None, "boltz", "workspace"),
    (Shape(1, 300, 256, 24, 32, 128), "medium", None, "openfold", "workspace"),
    (Shape(1, 1024, 256, 24, 32, 128), "highest", None, "openfold", None),
    (Shape(1, 1024, 256, 24, 32, 128), "high", None, "row", None),
    (Shape(1, 100, 256, 24, 32, 128), "highest", None, "row", None),         # float16 split, wgmma
    (Shape(1, 100, 256, 24, 32, 128), "high", None, "openfold", None),       # TF32, wgmma
    (Shape(1, 100, 256, 24, 32, 128), "highest", "mma_sync", "boltz", None),  # 3xTF32, mma.sync
    (Shape(1, 100, 256, 24, 32, 128), "highest", "mma_sync", "row", "rows"),
    (Shape(2, 70, 200, 24, 24, 128), "highest", None, "row", "rows"),        # 3xTF32 on wgmma (hidden 24)
    (Shape(1, 400, 256, 24, 12, 128), "highest", None, "boltz", None),       # CUDA cores (hidden 12)
    (Shape(1, 300, 256, 24, 32, 128), "medium", None, "openfold", None),     # bfloat16 operands
    (Shape(2, 70, 200, 24, 32, 128), "highest", None, "openfold", "rows"),
    (Shape(2, 150, 200, 24, 32, 128), "medium", None, "row", "rows"),
    (Shape(1, 100, 256, 24, 32, 128), "highest", None, "boltz", None),
]


@pytest.mark.parametrize("shape,precision,tc_form,normalization,plan", PARTS_CASES, ids=str)
def test_peak_bound_1_1_parts_of_s(shape, precision, tc_form, normalization, plan, monkeypatch):
    """FLASHOPM_PEAK_BOUND=1.1 where b for all residues passes a tenth of the output: bands, blocks
    of columns, or the sum over s in parts, each normalised and added to the output (the first with
    the bias). The peak
    stays within 1.1x the output (the default passes it, so the bound is the parts'), the result
    passes allclose(1e-4) against the float32 reference ("highest"), and its error against float64
    stays within twice the default's, with fully masked rows and columns in the mask."""
    monkeypatch.setenv("FLASHOPM_WAVES", "0")  # the plans with parts of s (the waves form: test_waves.py)
    if tc_form is not None:
        monkeypatch.setenv("FLASHOPM_TC_FORM", tc_form)
    if plan == "workspace":
        monkeypatch.setenv("FLASHOPM_PEAK_TAIL", "0")
    elif plan is not None:
        monkeypatch.setenv("FLASHOPM_PEAK_PLAN", plan)
    x, m, p = make_problem(shape, "masked_positions", seed=21)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    code = flashopm.ops.NORMALIZATIONS[normalization]
    ref32 = reference(xc, mc, pc, normalization=code).cpu()
    ref64 = reference(xc, mc, pc, dtype=torch.float64, normalization=code).cpu()

    def call():
        return flashopm.outer_product_mean(xc, mc, *(pc[k] for k in PARAM_ORDER), algorithm="outer",
                                           normalization=normalization, precision=precision)

    loose, out_loose = _peak_and_out(call)
    assert loose > 1.1 * shape.out_bytes, f"default: peak extra {loose} B vs output {shape.out_bytes} B"
    monkeypatch.setenv("FLASHOPM_PEAK_BOUND", "1.1")
    extra, out = _peak_and_out(call)
    assert extra <= 1.1 * shape.out_bytes, f"peak extra {extra} B vs output {shape.out_bytes} B"
    assert not out.isnan().any(), "NaN in the output: an element was not written or a part was lost"
    if precision == "highest":
        torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
    err, err_loose = rel_error(out, ref64), rel_error(out_loose, ref64)
    assert err <= max(2 * err_loose, FP64_FLOOR), f"parts: error {err:.3g} against the default's {err_loose:.3g}"
    _, again = _peak_and_out(call)
    assert torch.equal(out, again), "two identical calls differ: a race"


# (shape, model type, normalization): b for all residues passes the room a bound of 1.1x leaves,
# but blocks of rows and columns (3 x 3 with a short last block, 4 x 4; 4 x 4 for a bfloat16 model,
# whose 16-bit output takes no parts) hold a and b for all of s, so the sum needs no parts: every
# pair's sums run as without the bound, the same bits.  Under OpenFold's convention in bfloat16
# the bands also carry their rows' pair counts after their a.
BLOCK_CASES = [
    (Shape(2, 256, 512, 24, 32, 128), torch.float32, "row"),
    (Shape(2, 256, 512, 24, 32, 128), torch.float32, "openfold"),
    (Shape(1, 200, 768, 32, 32, 64), torch.bfloat16, "row"),
    (Shape(1, 200, 768, 32, 32, 64), torch.bfloat16, "openfold"),
]


@pytest.mark.parametrize("shape,dtype,normalization", BLOCK_CASES, ids=str)
def test_peak_bound_1_1_blocks_of_columns(shape, dtype, normalization, monkeypatch):
    monkeypatch.setenv("FLASHOPM_WAVES", "0")  # the bands' blocks of columns (the waves form: test_waves.py)
    x, m, p = make_problem(shape, "masked_positions", seed=22)
    xc, mc = x.cuda().to(dtype), m.cuda().to(dtype)
    pc = {k: v.cuda().to(dtype) for k, v in p.items()}

    def call():
        return flashopm.outer_product_mean(xc, mc, *(pc[k] for k in PARAM_ORDER), algorithm="outer",
                                           normalization=normalization)

    out_bytes = shape.out_bytes * dtype.itemsize // 4
    loose, out_loose = _peak_and_out(call)
    assert loose > 1.1 * out_bytes, f"default: peak extra {loose} B vs output {out_bytes} B"
    monkeypatch.setenv("FLASHOPM_PEAK_BOUND", "1.1")
    extra, out = _peak_and_out(call)
    assert extra <= 1.1 * out_bytes, f"peak extra {extra} B vs output {out_bytes} B"
    assert torch.equal(out, out_loose), "blocks of columns changed a pair's sums"


def test_peak_memory_bound_around_a_module():
    """flashopm.peak_memory_bound(1.1) around an OpenFold module's forward (deep enough that the
    unbounded peak passes 1.1x): the peak stays within 1.1x the output, the result within
    allclose(1e-4) of the unbounded one, and the setting is gone after the block."""
    shape = Shape(1, 100, 256, 24, 32, 128)
    x, m, _ = make_problem(shape, "masked_positions", seed=5)
    torch.manual_seed(3)
    model = flashopm.OpenFoldOuterProductMean(shape.C, shape.D, shape.H).cuda()
    torch.nn.init.normal_(model.linear_out.weight, std=0.05)  # "final" init starts at zero
    xc, mc = x.cuda(), m.cuda()

    with torch.no_grad():
        loose, expect = _peak_and_out(lambda: model(xc, mc))
        with flashopm.peak_memory_bound(1.1):
            extra, out = _peak_and_out(lambda: model(xc, mc))
    assert "FLASHOPM_PEAK_BOUND" not in os.environ
    assert loose > 1.1 * shape.out_bytes >= extra, f"peak {loose} B unbounded, {extra} B bounded, output {shape.out_bytes} B"
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)


# (shape, precision, dtype): the row-tiled projection's tensor-core forms (3xTF32, TF32, 16-bit x)
# at hidden sizes whose outputs make 2 (H = 8), 4 (12), 8 (32) and 16 (64) n tiles, msa_dim with a
# short last chunk (40), a prime N and two batch elements.  Each launch has rows enough for the
# row-tiled kernel (B·S·N >= 64 x 132).
PROJ_ROWS_CASES = [
    (Shape(1, 64, 160, 64, 32, 128), "highest", torch.float32),
    (Shape(1, 64, 160, 40, 12, 64), "highest", torch.float32),
    (Shape(2, 40, 131, 64, 64, 32), "high", torch.float32),
    (Shape(1, 64, 160, 64, 8, 64), "highest", torch.float32),
    (Shape(1, 64, 160, 64, 32, 128), None, torch.bfloat16),
]


@pytest.mark.parametrize("shape,precision,dtype", PROJ_ROWS_CASES, ids=str)
def test_projection_block_rows_give_the_same_bits(shape, precision, dtype, monkeypatch):
    """FLASHOPM_PROJ_ROWS (blocks of 128, 64 or 32 rows in the row-tiled projection; a size the
    outputs do not allow runs as 128): every output's sums take the same k-steps in the same order,
    so the results are bitwise equal, every element written (poisoned output), and within
    allclose(1e-4) of the float32 reference under "highest"."""
    x, m, p = make_problem(shape, "masked_positions", seed=31)
    xc, mc = x.cuda().to(dtype), m.cuda().to(dtype)
    pc = {k: v.cuda().to(dtype) for k, v in p.items()}
    outs = {}
    monkeypatch.delenv("FLASHOPM_PROJECT_STREAM", raising=False)  # 16-bit x: the row-tiled kernel,
    monkeypatch.setenv("FLASHOPM_PROJECT_REGS", "0")              # not the register-resident one
    for rows in ("128", "64", "32"):
        monkeypatch.setenv("FLASHOPM_PROJ_ROWS", rows)
        outs[rows] = _run(xc, mc, pc, "outer", precision=precision)
        assert not outs[rows].isnan().any(), f"rows {rows}: NaN in the output, an element was not written"
    assert torch.equal(outs["64"], outs["128"]), "blocks of 64 rows changed the projections' bits"
    assert torch.equal(outs["32"], outs["128"]), "blocks of 32 rows changed the projections' bits"
    if precision == "highest":
        ref32 = reference(xc, mc, pc).cpu()
        torch.testing.assert_close(outs["32"].cpu(), ref32, atol=1e-4, rtol=1e-4)


# (B, N, C, H, D, mask kind): the streamed projection (16-bit x) at msa_dim of one 16-byte piece a
# row (8), a few (40), AF2's (256, four stages) and past it (296: three stages, 400: two), hidden 1
# (2H = 2 of its 64 columns), 12, 16, 31 (odd: one-element stores) and 32, a prime N and batches of
# 2 and 3.  Each launch has rows enough for the row-tiled kernels (B·S·N >= 64 x SMs), and tiles
# that do not fill the last round of blocks.
STREAM_PROJECTION = [
    (1, 160, 64, 32, 128, "masked_positions"),
    (2, 131, 40, 12, 24, "fractional"),
    (1, 97, 256, 32, 64, "binary"),
    (3, 61, 8, 1, 5, "bool"),
    (1, 89, 296, 31, 16, "ones"),
    (1, 41, 400, 16, 8, "binary"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", STREAM_PROJECTION, ids=lambda c: "B{}_N{}_C{}_H{}_D{}_{}".format(*c))
def test_streamed_projection_gives_the_row_tiled_bits(case, dtype, monkeypatch):
    """16-bit x: the streamed projection kernel (FLASHOPM_PROJECT_STREAM=1) runs (profiler) and
    gives the row-tiled kernel's bits (FLASHOPM_PROJECT_REGS=0): the same LayerNorm arithmetic and
    TF32 products in the same order; every element written (poisoned output), two calls equal, the
    same bits from 1 and 7 blocks, error against float32 PyTorch on the same inputs at most 2x
    eager's in the type."""
    B, N, C, H, D, mask_kind = case
    shape = Shape(B, _rows_above_tiled_projection_threshold(B, N, 100), N, C, H, D)
    x, m, p = make_problem(shape, mask_kind, seed=C + H)
    x16, m16 = x.to(dtype).cuda(), m.to(dtype).cuda()
    p16 = {k: None if v is None else v.to(dtype).cuda() for k, v in p.items()}
    monkeypatch.setenv("FLASHOPM_PROJECT_STREAM", "1")
    monkeypatch.setenv("FLASHOPM_PROJECT_REGS", "0")
    kernels = flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False))
    assert any("opm_project_stream_kernel" in k for k in kernels), kernels
    out = _run(x16, m16, p16, "outer")
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(out, _run(x16, m16, p16, "outer")), "two identical calls differ: a race"
    # one block (every tile round the ring in turn) and seven (about 20 tiles each): each stage
    # refilled many times, every path of the deferred mask values
    for blocks in ("1", "7"):
        monkeypatch.setenv("FLASHOPM_PROJECT_STREAM_BLOCKS", blocks)
        assert torch.equal(_run(x16, m16, p16, "outer"), out), f"{blocks} blocks changed the bits"
    monkeypatch.delenv("FLASHOPM_PROJECT_STREAM_BLOCKS")
    monkeypatch.delenv("FLASHOPM_PROJECT_STREAM")
    tiled_kernels = flashopm_kernels(lambda: _run(x16, m16, p16, "outer", poison=False))
    assert not any("opm_project_stream_kernel" in k for k in tiled_kernels), tiled_kernels
    tiled = _run(x16, m16, p16, "outer")
    assert torch.equal(out, tiled), "the streamed projection's bits differ from the row-tiled kernel's"
    ref32 = reference(x16, m16, p16, dtype=torch.float32).cpu()
    err, err_eager = rel_error(out.float().cpu(), ref32), rel_error(reference(x16, m16, p16).float().cpu(), ref32)
    assert err <= max(2 * err_eager, 2 * torch.finfo(dtype).eps), f"error {err:.3g} vs eager {dtype} {err_eager:.3g}"


def test_projection_block_rows_bad_value_is_refused(monkeypatch):
    shape = Shape(1, 64, 160, 64, 32, 128)
    x, m, p = make_problem(shape, "masked_positions", seed=32)
    monkeypatch.setenv("FLASHOPM_PROJ_ROWS", "48")
    with pytest.raises(RuntimeError, match="FLASHOPM_PROJ_ROWS must be 128, 64 or 32, got '48'"):
        _run(x.cuda(), m.cuda(), _cuda_params(p), "outer", poison=False)


@pytest.mark.parametrize("value", ["abc", "1.0", "1.1x", "-2"])
def test_peak_bound_bad_value_is_refused(value, monkeypatch):
    shape = Shape(1, 100, 256, 24, 32, 128)
    x, m, p = make_problem(shape, "ones", seed=1)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    monkeypatch.setenv("FLASHOPM_PEAK_BOUND", value)
    with pytest.raises(RuntimeError, match="FLASHOPM_PEAK_BOUND must be a number >= 1.02"):
        _run(xc, mc, pc, "outer", poison=False)


def test_current_stream_is_used():
    shape = SPEC
    x, m, p = make_problem(shape, "fractional", seed=1)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    expect = _run(xc, mc, pc, poison=False)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)  # keep the side stream busy: a launch on another stream would race
        out = _run(xc, mc, pc, poison=False)
    s.synchronize()
    assert torch.equal(out, expect)


def test_cuda_graph_capture_and_replay():
    torch.manual_seed(0)
    model = flashopm.ModelNew(*flashopm.get_init_inputs()).cuda()
    x, m = [t.cuda() for t in flashopm.get_inputs()]
    m = torch.rand_like(m)
    expect = model(x, m)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model(x, m)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model(x, m)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, model(x, m), atol=0, rtol=0)
    assert not torch.equal(out, expect)


def test_spec_gpu_time_is_below_eager_with_the_benchmarks_timer():
    """The benchmark's own timer (CUDA-graph replay) on the spec shape: flashopm must stay well
    ahead of eager PyTorch (measured 27 µs vs 82 µs on an H200)."""
    from flashopm.bench import time_graph

    torch.manual_seed(0)
    new = flashopm.ModelNew(*flashopm.get_init_inputs()).cuda()
    ref = flashopm.Model(*flashopm.get_init_inputs()).cuda()
    ref.load_state_dict(new.state_dict())
    x, m = [t.cuda() for t in flashopm.get_inputs()]
    with torch.no_grad():
        t_new, t_ref = time_graph(lambda: new(x, m), n=20), time_graph(lambda: ref(x, m), n=20)
    assert t_new is not None and t_ref is not None
    assert t_new.median_us < 0.75 * t_ref.median_us, f"flashopm {t_new} vs eager {t_ref}"


# The tensor-core path (hidden_dim a multiple of 8): every hidden width it takes, tiles that do not
# fill 128 rows (H = 24, 40, 48, 56), pair counts per tile from 8 (H = 64) to 512 (H = 8), N at
# tile edges ±1, D past one group of 128 columns and odd D, S past one stage and ragged.
TC_SHAPES = [
    Shape(1, 33, 9, 20, 24, 130),
    Shape(2, 40, 11, 16, 40, 17),
    Shape(1, 65, 257, 32, 32, 128),
    Shape(1, 31, 33, 8, 8, 3),
    Shape(1, 97, 31, 24, 16, 64),
    Shape(2, 7, 23, 12, 48, 33),
    Shape(1, 64, 17, 40, 56, 8),
    Shape(1, 1, 64, 8, 64, 256),
]


@pytest.mark.parametrize("shape", TC_SHAPES, ids=str)
@pytest.mark.parametrize("normalization", ["row", "openfold", "boltz"])
def test_tensor_core_path(shape, normalization):
    """"highest" on tensor cores (3xTF32): the float32 bars, under every normalisation."""
    x, m, p = make_problem(shape, "masked_positions", seed=zlib.crc32(str(shape).encode()) % 1000)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    norm = flashopm.ops.NORMALIZATIONS[normalization]
    ref64 = reference(xc, mc, pc, dtype=torch.float64, normalization=norm).cpu()
    ref32 = reference(xc, mc, pc, normalization=norm).cpu()
    args = (xc, mc, pc["ln_weight"], pc["ln_bias"], pc["w_a"], pc["b_a"], pc["w_b"], pc["b_b"], pc["w_out"],
            pc["b_out"])
    outs = []
    for _ in range(2):
        torch.empty(shape.B * shape.N * shape.N * shape.D, device="cuda").fill_(float("nan"))
        outs.append(flashopm.outer_product_mean(*args, algorithm="outer", normalization=normalization,
                                                precision="highest"))
    out = outs[0].cpu()
    assert not out.isnan().any()
    assert torch.equal(outs[0], outs[1]), "two identical calls differ: a race"
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"normwise error {err:.3g} vs eager fp32 {err_eager:.3g}"


@pytest.mark.parametrize("algorithm,shape", [("outer", Shape(1, 128, 64, 64, 32, 128)),
                                             ("small-tc", Shape(1, 16, 64, 64, 32, 128))], ids=str)
@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_precision_modes_follow_pytorch(scale, algorithm, shape):
    """"highest" keeps float32 accuracy (weights x10 too); "high" is TF32, within 2x the error of
    eager PyTorch with TF32 allowed, and measurably less exact than "highest" (so the TF32 path is
    the one that ran); the global setting is followed when no precision is given."""
    x, m, p = make_problem(shape, "masked_positions", seed=21, scale=scale)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    ref32 = reference(xc, mc, pc).cpu()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        ref_tf32 = reference(xc, mc, pc).cpu()
        out_global_high = _run(xc, mc, pc, algorithm).cpu()
    finally:
        torch.set_float32_matmul_precision(before)
    out_highest = _run(xc, mc, pc, algorithm, precision="highest").cpu()
    out_high = _run(xc, mc, pc, algorithm, precision="high").cpu()
    err_highest, err_eager = rel_error(out_highest, ref64), rel_error(ref32, ref64)
    err_high, err_eager_tf32 = rel_error(out_high, ref64), rel_error(ref_tf32, ref64)
    # the output scales as scale^3; eager float32 itself is off by ~2.5e-4 from float64 at scale 10
    torch.testing.assert_close(out_highest, ref32, atol=1e-4 * scale**3, rtol=1e-4)
    assert err_highest <= max(2 * err_eager, FP64_FLOOR), f"{err_highest:.3g} vs eager {err_eager:.3g}"
    assert err_high <= 2 * err_eager_tf32, f"TF32: {err_high:.3g} vs eager TF32 {err_eager_tf32:.3g}"
    assert err_high > 10 * err_highest, f"'high' ({err_high:.3g}) is not TF32 next to 'highest' ({err_highest:.3g})"
    assert torch.equal(out_global_high, out_high)
    if before == "highest":
        assert torch.equal(_run(xc, mc, pc, algorithm).cpu(), out_highest)


requires_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the warpgroup-MMA form of the float32 kernel needs an sm_90 GPU",
)

# S against the chunks of 16 s (3xTF32) and 32 s (TF32): below one chunk, one past, ragged, whole;
# N at the 256-column tile edges and below one tile; hidden sizes that fill 120-128 rows of a tile
# (24, 40, 48) and 8-64; B = 2; row tiles cut short by N.
TF32_FORM_SHAPES = [
    Shape(2, 33, 41, 40, 16, 72),
    Shape(1, 1, 64, 8, 64, 256),
    Shape(1, 65, 257, 32, 32, 128),
    Shape(1, 17, 9, 20, 24, 130),
    Shape(2, 32, 11, 16, 40, 17),
    Shape(1, 48, 31, 24, 8, 64),
    Shape(1, 97, 23, 12, 48, 33),
    Shape(1, 15, 255, 32, 32, 64),
    Shape(1, 40, 70, 24, 8, 130),   # phase 2 on wgmma ("high"): 16 rounds of pairs, two groups of d
    Shape(2, 21, 33, 16, 16, 7),    # phase 2 on wgmma: 4 rounds, a ragged column tile, odd D
]


def _eager_tf32(xc, mc, pc):
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        return reference(xc, mc, pc).cpu()
    finally:
        torch.set_float32_matmul_precision(before)


@requires_sm90
@pytest.mark.parametrize("shape", TF32_FORM_SHAPES, ids=str)
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_tf32_wgmma_form(shape, precision, monkeypatch):
    """Phase 1 of the float32 tensor-core kernel on warpgroup MMAs (forced, as the auto setting
    takes it on sm_90): the float32 bars for "highest", at most 2x eager TF32's error for "high",
    every element written, repeatable, within twice the mma.sync form's error, and the parameters
    unchanged."""
    x, m, p = make_problem(shape, "masked_positions", seed=zlib.crc32(f"{shape}-{precision}".encode()) % 1000)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    ref32 = reference(xc, mc, pc).cpu()
    params_before = {k: v.clone() for k, v in pc.items() if v is not None}
    monkeypatch.setenv("FLASHOPM_TC_FORM", "wgmma")
    out = _run(xc, mc, pc, "outer", precision=precision)
    again = _run(xc, mc, pc, "outer", precision=precision)
    for k, v in params_before.items():  # W's TF32 copy (hidden 8: W's own order) must be a copy
        assert torch.equal(pc[k], v), f"{k} changed by the call"
    monkeypatch.setenv("FLASHOPM_TC_FORM", "mma_sync")
    err_mma_sync = rel_error(_run(xc, mc, pc, "outer", precision=precision).cpu(), ref64)
    out = out.cpu()
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    assert torch.equal(out, again.cpu()), "two identical calls differ: a race"
    err = rel_error(out, ref64)
    if precision == "highest":
        torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
        err_eager = rel_error(ref32, ref64)
        assert err <= max(2 * err_eager, FP64_FLOOR), f"normwise error {err:.3g} vs eager fp32 {err_eager:.3g}"
    else:
        err_eager_tf32 = rel_error(_eager_tf32(xc, mc, pc), ref64)
        assert err <= 2 * err_eager_tf32, f"TF32: {err:.3g} vs eager TF32 {err_eager_tf32:.3g}"
    assert err <= max(2 * err_mma_sync, FP64_FLOOR), f"wgmma form {err:.3g} vs mma.sync form {err_mma_sync:.3g}"


@requires_sm90
@pytest.mark.parametrize("shape", [Shape(1, 1100, 128, 24, 64, 8), Shape(1, 1100, 256, 24, 32, 8)], ids=str)
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_tf32_wgmma_form_in_row_blocks(shape, precision, monkeypatch):
    """The K-major layouts of a for blocks of rows (b for all residues takes over half of the
    workspace budget, so the rows come in two blocks) and a last chunk of s cleared for 1100 % 16
    and % 32; phase 2 on wgmma for "high" at hidden 32."""
    monkeypatch.setenv("FLASHOPM_TC_FORM", "wgmma")
    x, m, p = make_problem(shape, "masked_positions", seed=5)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    out = _run(xc, mc, pc, "outer", precision=precision).cpu()
    assert not out.isnan().any()
    err = rel_error(out, ref64)
    if precision == "highest":
        torch.testing.assert_close(out, reference(xc, mc, pc).cpu(), atol=1e-4, rtol=1e-4)
        assert err <= max(2 * rel_error(reference(xc, mc, pc).cpu(), ref64), FP64_FLOOR)
    else:
        assert err <= 2 * rel_error(_eager_tf32(xc, mc, pc), ref64)


# The float16 split form of "highest" runs for hidden 8, 16 and 32 with a full column tile (N >=
# 256 / hidden): rounds of pairs at tile edges (N = 33 for hidden 16, N = 32 and 97 for hidden 8),
# S across chunks of 32 (1, 31, 33, 300), B = 2, a row tile cut short (N = 41 for hidden 32).
HALF_SPLIT_SHAPES = [
    Shape(1, 77, 41, 24, 32, 64),
    Shape(2, 300, 33, 16, 16, 20),
    Shape(1, 1, 97, 8, 8, 130),
    Shape(1, 33, 32, 40, 8, 7),
    Shape(2, 31, 8, 17, 32, 128),
]


def _problem_with_range(shape, case, seed):
    """A problem whose operands span many binades: the float16 split form scales per residue,
    per output column of W and by a bound for O, so these are where it could lose accuracy."""
    x, m, p = make_problem(shape, "masked_positions", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if case == "mask_range":  # mask values from 1e-6 to 10, varying by residue and by sequence
        m = (m * 10.0 ** torch.randint(-6, 2, (shape.B, 1, shape.N), generator=g).float()
             * 10.0 ** torch.randint(-3, 1, (shape.B, shape.S, 1), generator=g).float())
    elif case == "outliers":  # a few features of x 1e4 times the rest
        x = x.clone()
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 500),), generator=g)
        x.view(-1)[idx] *= 1e4
    elif case == "large_weights":
        p = {k: (v * 1e3 if k in ("w_a", "w_b", "w_out") else v) for k, v in p.items()}
    elif case == "small_weights":  # a and b near 1e-4, the output bias as small as their product
        p = {k: (v * 1e-4 if k in ("w_a", "b_a", "w_b", "b_b") else v * 1e-8 if k == "b_out" else v)
             for k, v in p.items()}
    elif case == "tiny":  # a near 1e-20 (its scale near 2^80), the output bias as small as the products
        p = {k: (v * 1e-20 if k in ("w_a", "b_a", "b_out") else v) for k, v in p.items()}
    elif case == "column_range":  # W's rows (output columns) from 1e-5 to 1e2
        p = dict(p)
        p["w_out"] = p["w_out"] * 10.0 ** torch.randint(-5, 3, (shape.D, 1), generator=g).float()
    return x, m, p


@requires_sm90
@pytest.mark.parametrize("shape", HALF_SPLIT_SHAPES, ids=str)
@pytest.mark.parametrize("case", ["plain", "mask_range", "outliers", "large_weights", "small_weights",
                                  "tiny", "column_range"])
def test_float16_split_form(shape, case, monkeypatch):
    """"highest" in the float16 split form (the wgmma form's default where it fits): the float32
    bars on operands that span many binades, every element written, repeatable, within twice the
    error of the 3xTF32 wgmma form, and not bitwise that form (so the split form is what ran)."""
    x, m, p = _problem_with_range(shape, case, seed=zlib.crc32(f"{shape}-{case}".encode()) % 1000)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    ref32 = reference(xc, mc, pc).cpu()
    monkeypatch.setenv("FLASHOPM_TC_FORM", "wgmma")
    out = _run(xc, mc, pc, "outer", precision="highest")
    again = _run(xc, mc, pc, "outer", precision="highest")
    monkeypatch.setenv("FLASHOPM_TC_FORM", "wgmma_tf32")
    out_tf32x3 = _run(xc, mc, pc, "outer", precision="highest").cpu()
    out = out.cpu()
    assert out.isfinite().all(), "NaN or Inf in the output"
    assert torch.equal(out, again.cpu()), "two identical calls differ: a race"
    assert not torch.equal(out, out_tf32x3), "the float16 split form did not run"
    scale = max(1.0, ref64.abs().max().item())
    torch.testing.assert_close(out, ref32, atol=1e-4 * scale, rtol=1e-4)
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"normwise error {err:.3g} vs eager fp32 {err_eager:.3g}"
    err_tf32x3 = rel_error(out_tf32x3, ref64)
    assert err <= max(2 * err_tf32x3, FP64_FLOOR), f"float16 split {err:.3g} vs 3xTF32 {err_tf32x3:.3g}"


@requires_sm90
@pytest.mark.parametrize("shape", [Shape(1, 4, 33, 16, 8, 8), Shape(1, 5, 9, 16, 32, 8)], ids=str)
def test_nan_inf_propagate_in_float16_split_form(shape, monkeypatch):
    """The scales of the float16 split form come from each residue's largest magnitude, which
    skips NaN: a NaN or Inf in x still reaches exactly the outputs it reaches in the reference."""
    monkeypatch.setenv("FLASHOPM_TC_FORM", "wgmma")
    _check_nan_inf_propagate(shape, 4, "outer", precision="highest")


def test_tensor_core_form_setting_is_checked(monkeypatch):
    monkeypatch.setenv("FLASHOPM_TC_FORM", "fastest")
    x, m, p = make_problem(Shape(1, 8, 40, 16, 32, 16), "ones", seed=0)
    with pytest.raises(RuntimeError, match="FLASHOPM_TC_FORM must be mma_sync, wgmma or wgmma_tf32"):
        _run(x.cuda(), m.cuda(), _cuda_params(p), "outer", poison=False)


@pytest.mark.parametrize("shape", [Shape(1, 128, 64, 64, 32, 128), Shape(2, 33, 41, 40, 16, 72)], ids=str)
def test_medium_precision_takes_bfloat16_operands(shape):
    """"medium" on float32 inputs: bfloat16 operands on tensor cores, float32 output; error against
    float64 at most 2x that of the same model run in bfloat16 by eager PyTorch, and far from
    float32's (so the bfloat16 kernel is the one that ran); the global setting is followed."""
    x, m, p = make_problem(shape, "masked_positions", seed=zlib.crc32(str(shape).encode()) % 1000)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    ref64 = reference(xc, mc, pc, dtype=torch.float64).cpu()
    eager_bf16 = reference(xc.bfloat16(), mc.bfloat16(),
                           {k: None if v is None else v.bfloat16() for k, v in pc.items()}).float().cpu()
    out_medium = _run(xc, mc, pc, "outer", precision="medium")
    assert out_medium.dtype == torch.float32
    out_highest = _run(xc, mc, pc, "outer", precision="highest").cpu()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        out_global = _run(xc, mc, pc, "outer")
    finally:
        torch.set_float32_matmul_precision(before)
    err, err_eager = rel_error(out_medium.cpu(), ref64), rel_error(eager_bf16, ref64)
    assert err <= 2 * err_eager, f"medium: {err:.3g} vs eager bfloat16 {err_eager:.3g}"
    assert err > 100 * rel_error(out_highest, ref64), "'medium' is as exact as 'highest': not bfloat16"
    assert torch.equal(out_global, out_medium)
    assert torch.equal(out_medium, _run(xc, mc, pc, "outer", precision="medium")), "two identical calls differ"


def test_tensor_cores_and_cuda_cores_agree():
    shape = Shape(2, 48, 40, 32, 32, 64)
    x, m, p = make_problem(shape, "fractional", seed=4)
    xc, mc, pc = x.cuda(), m.cuda(), _cuda_params(p)
    tc, fma = _run(xc, mc, pc, "outer"), _run(xc, mc, pc, "outer-fma")
    torch.testing.assert_close(tc, fma, atol=1e-4, rtol=1e-4)
