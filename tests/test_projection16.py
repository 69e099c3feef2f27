"""The register-resident LayerNorm/projection kernel for 16-bit x (opm_project_regs_kernel), on a GPU.

a and b come from torch.ops.flashopm._projections, which runs the projection stage as the 16-bit
contraction does.  Error bars: normwise error against float64 (LayerNorm, projections and mask on
the same 16-bit inputs) at most twice that of eager PyTorch in the same type; for the whole op, the
half-precision tests' bar (against float32 PyTorch, floored at two ulps of the type).  FLASHOPM_PROJECT_REGS=0 takes the row-tiled kernel, whose products (TF32, LayerNorm's
output unrounded) give other bits: comparing the two proves which ran.
"""
import copy

import pytest
import torch

import flashopm
from conftest import flashopm_kernels, poison_output_block, requires_cuda
from flashopm.reference import OpenFoldOuterProductMeanReference, masked_projections
from flashopm.testing import PARAM_ORDER, Shape, make_mask, make_problem, reference, rel_error

pytestmark = requires_cuda

REGS_KERNEL = "opm_project_regs_kernel"
ROWS_KERNEL = "opm_project_rows_kernel"
DTYPES = [torch.bfloat16, torch.float16]
FP32_FLOOR = 4 * torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _default_forms(monkeypatch):
    for name in ("FLASHOPM_PROJECT_REGS", "FLASHOPM_PROJECT_STREAM", "FLASHOPM_PEAK_BOUND"):
        monkeypatch.delenv(name, raising=False)
    flashopm.load()


def _inputs(B, S, N, C, H, mask_kind, dtype, mask_dtype=None, seed=0):
    """x, mask and the projection parameters (LayerNorm's, W_a, b_a, W_b, b_b) on the GPU in dtype
    (the mask in mask_dtype, default dtype; bool masks stay bool)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, N, C, generator=g) * 1.5 + 0.3
    m = make_mask(mask_kind, B, S, N, g)
    params = [1.0 + 0.2 * torch.randn(C, generator=g), 0.2 * torch.randn(C, generator=g),
              torch.randn(H, C, generator=g) / C**0.5, 0.1 * torch.randn(H, generator=g),
              torch.randn(H, C, generator=g) / C**0.5, 0.1 * torch.randn(H, generator=g)]
    if m.dtype != torch.bool:
        m = m.to(mask_dtype or dtype)
    return x.to(dtype).cuda(), m.cuda(), [p.to(dtype).cuda() for p in params]


def _project(x, m, params, ln_eps=1e-5, out=None):
    ln_w, ln_b, w_a, b_a, w_b, b_b = params
    return torch.ops.flashopm._projections(x, m, ln_w, ln_b, ln_eps, w_a, b_a, w_b, b_b, out)


def _references(x, m, params):
    """(float64 reference, eager reference in x's type), each (a, b)."""
    ln_w, ln_b, w_a, b_a, w_b, b_b = params
    d = [p.double() for p in params]
    ref64 = masked_projections(x.double(), m.double(), d[0], d[1], d[2], d[3], d[4], d[5])
    eager = masked_projections(x, m if m.dtype == torch.bool else m.to(x.dtype), ln_w, ln_b, w_a, b_a, w_b, b_b)
    return ref64, eager


def _check_errors(out, ref64, eager, dtype, what):
    """Normwise error of a and b against float64 at most twice eager's (which rounds a and b to
    the type, so is never near zero: no floor but float32's)."""
    for name, o, r, e in zip("ab", out, ref64, eager):
        err, err_eager = rel_error(o, r), rel_error(e, r)
        assert err <= max(2 * err_eager, FP32_FLOOR), (
            f"{what}: {name}'s error {err:.3g} against float64, eager {dtype}'s {err_eager:.3g}")


# (B, S, N, C, H, mask kind, mask dtype or None for x's): rows 1, 15, 16, 17, 97 and tens of
# thousands (many tiles per warp, the last tile partial); msa_dim of one 16-byte piece a row (8),
# a partial group (24), whole groups (64, 256) and a partial last group of seven (200); hidden 4
# (8-byte row stores), 16 and 32; every mask kind, float32 and bool masks too.
CASES = [
    (1, 1, 1, 64, 16, "ones", None),
    (1, 3, 5, 24, 4, "binary", None),
    (2, 2, 4, 8, 32, "fractional", torch.float32),
    (1, 1, 17, 200, 16, "masked_positions", None),
    (1, 1, 97, 256, 32, "bool", None),
    (1, 7, 13, 8, 4, "masked_positions", torch.float32),
    (2, 100, 211, 256, 32, "masked_positions", None),
    (1, 333, 61, 64, 4, "fractional", None),
    (1, 150, 97, 200, 16, "binary", torch.float32),
    (3, 41, 50, 24, 32, "bool", None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_S{}_N{}_C{}_H{}_{}".format(*c[:6]))
def test_regs_projection_against_float64(case, dtype):
    """The register-resident kernel runs (profiler); every element of a and b is written (into a
    buffer filled with NaN); error within the bars; two calls give the same bits."""
    B, S, N, C, H, mask_kind, mask_dtype = case
    x, m, params = _inputs(B, S, N, C, H, mask_kind, dtype, mask_dtype, seed=C + H + N)
    kernels = flashopm_kernels(lambda: _project(x, m, params))
    assert any(REGS_KERNEL in k for k in kernels), kernels
    assert not any(ROWS_KERNEL in k for k in kernels), kernels
    out = torch.full((2, B, S, N, H), float("nan"), dtype=dtype, device="cuda")
    a, b = _project(x, m, params, out=out)
    assert a.data_ptr() == out.data_ptr() and b.data_ptr() == out[1].data_ptr()
    assert a.dtype == b.dtype == dtype and a.shape == b.shape == (B, S, N, H)
    assert not a.isnan().any() and not b.isnan().any(), "NaN in a or b: an element was not written"
    ref64, eager = _references(x, m, params)
    _check_errors((a, b), ref64, eager, dtype, "register-resident form")
    a2, b2 = _project(x, m, params)
    assert torch.equal(a, a2) and torch.equal(b, b2), "two identical calls differ: a race"


def test_regs_projection_nan_inf_like_reference():
    """A NaN and an Inf in x (the Inf's row masked: 0 · inf is NaN) reach exactly the rows of a and
    b they reach in the float64 reference, the others staying within the bars."""
    dtype = torch.bfloat16
    x, m, params = _inputs(1, 9, 37, 64, 32, "binary", dtype, seed=3)
    x[0, 1, 2, 3] = float("nan")
    x[0, 2, 5, 0] = float("inf")
    m[0, 2, 5] = 0
    out = _project(x, m, params)
    ref64, eager = _references(x, m, params)
    for o, r in zip(out, ref64):
        assert torch.equal(o.isnan(), r.isnan()), "NaN where the reference has none, or none where it has"
    fin = ~ref64[0].isnan().any(-1)
    _check_errors([o[fin] for o in out], [r[fin] for r in ref64], [e[fin] for e in eager], dtype, "finite rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_regs_switch_takes_the_row_tiled_kernel(dtype, monkeypatch):
    """FLASHOPM_PROJECT_REGS=0: the row-tiled kernel runs instead, within the same bars, and its
    bits differ from the register-resident form's (LayerNorm's output unrounded, TF32 products):
    the switch, and so the form, is live."""
    x, m, params = _inputs(1, 64, 97, 256, 32, "masked_positions", dtype, seed=5)
    ref64, eager = _references(x, m, params)
    regs = _project(x, m, params)
    monkeypatch.setenv("FLASHOPM_PROJECT_REGS", "0")
    kernels = flashopm_kernels(lambda: _project(x, m, params))
    assert any(ROWS_KERNEL in k for k in kernels) and not any(REGS_KERNEL in k for k in kernels), kernels
    rows = _project(x, m, params)
    _check_errors(rows, ref64, eager, dtype, "row-tiled kernel")
    assert not (torch.equal(regs[0], rows[0]) and torch.equal(regs[1], rows[1])), (
        "FLASHOPM_PROJECT_REGS=0 changed nothing: the form switch is dead")


# msa_dim not a multiple of 8 (20), past what a row holds in registers (264), hidden not a
# multiple of 4 (6): the row-tiled kernel, with the same bars.
@pytest.mark.parametrize("C,H", [(20, 32), (264, 32), (64, 6)])
def test_regs_projection_not_taken_where_it_does_not_apply(C, H):
    dtype = torch.bfloat16
    x, m, params = _inputs(1, 40, 37, C, H, "masked_positions", dtype, seed=C)
    kernels = flashopm_kernels(lambda: _project(x, m, params))
    assert any(ROWS_KERNEL in k for k in kernels) and not any(REGS_KERNEL in k for k in kernels), kernels
    ref64, eager = _references(x, m, params)
    _check_errors(_project(x, m, params), ref64, eager, dtype, "row-tiled kernel")


def _rows_above_tiled_projection_threshold(B, N, extra):
    """S such that B*S*N passes the rows at which the op's projection takes the row-tiled kernels
    (a block of 128 rows on every other SM) by `extra` rows or more."""
    threshold = 64 * torch.cuda.get_device_properties(0).multi_processor_count
    return (threshold + extra) // (B * N) + 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normalization", ["row", "openfold"])
def test_whole_op_in_both_forms(dtype, normalization, monkeypatch):
    """The op in a 16-bit model with FLASHOPM_PROJECT_REGS=1 (the default) and =0: the kernel asked
    for runs, every element written, normwise error against float32 PyTorch on the same inputs at
    most 2x eager's in the type (the half-precision tests' bar), and the two forms' bits differ."""
    N = 97
    shape = Shape(1, _rows_above_tiled_projection_threshold(1, N, 100), N, 64, 32, 48)
    x, m, p = make_problem(shape, "masked_positions", seed=11)
    x16, m16 = x.to(dtype).cuda(), m.to(dtype).cuda()
    p16 = {k: v.to(dtype).cuda() for k, v in p.items()}
    code = flashopm.ops.NORMALIZATIONS[normalization]
    ref32 = reference(x16, m16, p16, dtype=torch.float32, normalization=code).cpu()
    eager = reference(x16, m16, p16, normalization=code).float().cpu()

    def call():
        return flashopm.outer_product_mean(x16, m16, *(p16[k] for k in PARAM_ORDER), algorithm="outer",
                                           normalization=normalization)

    outs = {}
    for regs, kernel in (("1", REGS_KERNEL), ("0", ROWS_KERNEL)):
        monkeypatch.setenv("FLASHOPM_PROJECT_REGS", regs)
        kernels = flashopm_kernels(call)
        assert any(kernel in k for k in kernels), (regs, kernels)
        poison_ptr = poison_output_block(call)
        out = call()
        assert out.data_ptr() == poison_ptr, "the poisoned block was not reused; the check proves nothing"
        assert out.dtype == dtype and not out.isnan().any(), f"REGS={regs}: NaN in the output"
        err, err_eager = rel_error(out.float().cpu(), ref32), rel_error(eager, ref32)
        assert err <= max(2 * err_eager, 2 * torch.finfo(dtype).eps), (
            f"REGS={regs}: error {err:.3g} vs eager {dtype} {err_eager:.3g}")
        assert torch.equal(out, call()), f"REGS={regs}: two identical calls differ"
        outs[regs] = out
    assert not torch.equal(outs["1"], outs["0"]), "the two projection forms gave the same bits"


def _randomized(module, seed):
    """The module with every parameter drawn at random (OpenFold's linear_out starts at zero):
    LayerNorm's weight near 1, biases near 0, weights of unit gain."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, q in module.named_parameters():
            r = torch.randn(q.shape, generator=g)
            if name == "layer_norm.weight":
                q.copy_(1.0 + 0.2 * r)
            elif q.dim() == 1:
                q.copy_(0.1 * r)
            else:
                q.copy_(r / q.shape[1] ** 0.5)
    return module


@pytest.mark.parametrize("regs", ["1", "0"])
def test_openfold_module_in_bfloat16(regs, monkeypatch):
    """OpenFold's module cast to bfloat16 against its reference module: error against the float32
    reference on the same (rounded) inputs and parameters at most 2x that of the reference module
    run in bfloat16 by eager PyTorch, with either projection form."""
    monkeypatch.setenv("FLASHOPM_PROJECT_REGS", regs)
    N, C, H, D = 96, 64, 32, 64
    S = _rows_above_tiled_projection_threshold(1, N, 100)
    ours = _randomized(flashopm.OpenFoldOuterProductMean(C, D, H), seed=9).cuda().to(torch.bfloat16)
    ref = OpenFoldOuterProductMeanReference(C, D, H).cuda().to(torch.bfloat16)
    ref.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(2)
    m = torch.randn(1, S, N, C, generator=g).cuda().to(torch.bfloat16)
    mask = make_mask("masked_positions", 1, S, N, g).cuda().to(torch.bfloat16)
    kernels = flashopm_kernels(lambda: ours(m, mask))
    assert any((REGS_KERNEL if regs == "1" else ROWS_KERNEL) in k for k in kernels), kernels
    with torch.no_grad():
        out = ours(m, mask)
        eager = ref(m, mask).float()
        ref32 = copy.deepcopy(ref).float()(m.float(), mask.float())
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    err, err_eager = rel_error(out.float(), ref32), rel_error(eager, ref32)
    assert err <= max(2 * err_eager, 2 * torch.finfo(torch.bfloat16).eps), f"{err:.3g} vs eager {err_eager:.3g}"


def test_bands_under_a_peak_bound_take_the_same_form(monkeypatch):
    """Under a peak bound the projection runs once per band of rows; every launch takes the
    register-resident form (the choice depends on the problem, not the launch), so the bits equal
    the unbounded call's."""
    monkeypatch.setenv("FLASHOPM_WAVES", "0")
    dtype = torch.bfloat16
    shape = Shape(1, 200, 768, 32, 32, 64)
    x, m, p = make_problem(shape, "masked_positions", seed=22)
    xc, mc = x.cuda().to(dtype), m.cuda().to(dtype)
    pc = {k: v.cuda().to(dtype) for k, v in p.items()}

    def call():
        return flashopm.outer_product_mean(xc, mc, *(pc[k] for k in PARAM_ORDER), algorithm="outer",
                                           normalization="openfold")

    loose = call()
    monkeypatch.setenv("FLASHOPM_PEAK_BOUND", "1.1")
    kernels = flashopm_kernels(call)
    assert any(REGS_KERNEL in k for k in kernels) and not any(ROWS_KERNEL in k for k in kernels), kernels
    bounded = call()
    assert not bounded.isnan().any()
    assert torch.equal(bounded, loose), "the bound's bands changed the bits"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_does_not_depend_on_the_form(dtype, monkeypatch):
    """A training step of a 16-bit model: the backward recomputes a and b itself (in float32), so
    its gradients are the same bits with either projection form in the forward, whose outputs
    differ."""
    torch.manual_seed(4)
    base = flashopm.ModelNew(64, 32, 32)
    N = 64
    S = _rows_above_tiled_projection_threshold(1, N, 100)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, S, N, 64, generator=g).cuda().to(dtype)
    mask = make_mask("masked_positions", 1, S, N, g).cuda().to(dtype)
    results = {}
    for regs in ("1", "0"):
        monkeypatch.setenv("FLASHOPM_PROJECT_REGS", regs)
        model = copy.deepcopy(base).cuda().to(dtype)
        xi = x.detach().clone().requires_grad_(True)
        out = model(xi, mask)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        results[regs] = (out.detach(), [xi.grad] + [q.grad for q in model.parameters()])
    assert not torch.equal(results["1"][0], results["0"][0]), "the two forms' outputs are the same bits"
    for g1, g0 in zip(results["1"][1], results["0"][1]):
        assert g1 is not None and torch.equal(g1, g0), "the forward's projection form changed a gradient"
