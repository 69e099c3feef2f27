"""The waves form (FLASHOPM_WAVES=1), on a GPU.

One cooperative launch of one block per SM takes the float16 split form's tiles a wave at a time;
per wave the sum over s runs in parts kept in the tiles' registers, each part's a and b projected
by every block into a buffer in the output's unwritten rows or the workspace, with a grid barrier
between projection and contraction.  Against the float32 reference: allclose(1e-4); against float64:
at most twice eager float32's normwise error; every plan (blocks per launch, workspace, the output's
rows used or not) gives the same bits, since each tile adds the same chunks in the same order; the
peak extra memory within 1.1x the output at (1,1024,256,64,32,128), where a and b for all s would
be twice it.
"""
import pytest
import torch

import flashopm
from conftest import flashopm_kernels, poison_output_block, requires_cuda
from flashopm.testing import PARAM_ORDER, Shape, make_problem, reference, rel_error

pytestmark = requires_cuda

FP64_FLOOR = 4 * torch.finfo(torch.float32).eps
WAVES_KERNEL = "256, false, true>"  # opm_outer_tc_kernel<3, true, true, true, 32, 32, 256, false, true>


@pytest.fixture(autouse=True)
def _waves(monkeypatch):
    flashopm.load()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the float16 split form runs on sm_90 GPUs")
    monkeypatch.setenv("FLASHOPM_WAVES", "1")
    for name in ("FLASHOPM_WAVES_BLOCKS", "FLASHOPM_WAVES_WS", "FLASHOPM_WAVES_OUT", "FLASHOPM_PEAK_BOUND"):
        monkeypatch.delenv(name, raising=False)


def _call(x, m, p, normalization):
    return flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer",
                                       normalization=normalization, precision="highest")


def _peak_extra(fn):
    """Bytes fn() asks for at its peak beyond what was allocated before (its output included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["requested_bytes.all.peak"] - base, out


# (shape, normalization, mask kind, plan): a chunk of s and one past it, S = 1, msa_dim below a
# float4 step (4, 20), N one column tile (8), residues that end mid-tile (9, 13, 37, 45, 97), B = 3,
# every convention, fully masked residues and fractional masks; plans with a few blocks (several
# waves, edge waves of fewer tiles and residues), workspaces of one or two chunks per part, and
# the output's rows left out.
CASES = [
    (Shape(1, 1024, 256, 64, 32, 128), "openfold", "masked_positions", {}),
    (Shape(2, 33, 45, 64, 32, 16), "row", "masked_positions", {"FLASHOPM_WAVES_BLOCKS": "5"}),
    (Shape(1, 70, 37, 20, 32, 64), "boltz", "fractional",
     {"FLASHOPM_WAVES_BLOCKS": "3", "FLASHOPM_WAVES_WS": "1", "FLASHOPM_WAVES_OUT": "0"}),
    (Shape(1, 1, 9, 4, 32, 8), "row", "binary", {}),
    (Shape(3, 31, 13, 64, 32, 128), "openfold", "masked_positions", {"FLASHOPM_WAVES_BLOCKS": "2"}),
    (Shape(1, 64, 8, 48, 32, 32), "boltz", "bool", {}),
    (Shape(1, 160, 97, 64, 32, 128), "row", "ones", {"FLASHOPM_WAVES_BLOCKS": "7", "FLASHOPM_WAVES_WS": "1"}),
    (Shape(2, 300, 64, 32, 32, 128), "openfold", "fractional", {"FLASHOPM_WAVES_BLOCKS": "4"}),
]


@pytest.mark.parametrize("shape,normalization,mask_kind,plan", CASES, ids=str)
def test_waves_against_the_references(shape, normalization, mask_kind, plan, monkeypatch):
    for name, value in plan.items():
        monkeypatch.setenv(name, value)
    x, m, p = make_problem(shape, mask_kind, seed=41)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    code = flashopm.ops.NORMALIZATIONS[normalization]
    ref32 = reference(xc, mc, pc, normalization=code)
    ref64 = reference(xc, mc, pc, dtype=torch.float64, normalization=code)
    kernels = flashopm_kernels(lambda: _call(xc, mc, pc, normalization))
    assert any(WAVES_KERNEL in k for k in kernels), f"the waves form did not run: {kernels}"
    assert not any("project_rows" in k or "opm_prep" in k for k in kernels), kernels
    poison_ptr = poison_output_block(lambda: _call(xc, mc, pc, normalization))
    out = _call(xc, mc, pc, normalization)
    assert out.data_ptr() == poison_ptr, "the poisoned block was not reused; the check proves nothing"
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"error {err:.3g} against eager float32's {err_eager:.3g}"
    assert torch.equal(out, _call(xc, mc, pc, normalization)), "two identical calls differ: a race"


def test_waves_every_plan_gives_the_same_bits(monkeypatch):
    """One wave of every tile against several waves of few blocks, parts of one chunk from the
    workspace, and the output's rows used or not: each tile adds the same chunks in the same
    order, so the bits agree."""
    shape = Shape(2, 200, 77, 64, 32, 64)
    x, m, p = make_problem(shape, "masked_positions", seed=42)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    first = _call(xc, mc, pc, "openfold")
    plans = [
        {"FLASHOPM_WAVES_BLOCKS": "3"},
        {"FLASHOPM_WAVES_BLOCKS": "6", "FLASHOPM_WAVES_WS": "1", "FLASHOPM_WAVES_OUT": "0"},
        {"FLASHOPM_WAVES_BLOCKS": "11", "FLASHOPM_WAVES_WS": "1"},
        {"FLASHOPM_WAVES_OUT": "0"},
    ]
    for plan in plans:
        for name, value in plan.items():
            monkeypatch.setenv(name, value)
        assert torch.equal(_call(xc, mc, pc, "openfold"), first), plan
        for name in plan:
            monkeypatch.delenv(name)


def test_waves_within_the_memory_bound():
    """(1,1024,256,64,32,128): a and b would be twice the output; the waves form's peak extra
    memory (the output included) stays within 1.1x it, and its result agrees with the default's."""
    shape = Shape(1, 1024, 256, 64, 32, 128)
    x, m, p = make_problem(shape, "masked_positions", seed=43)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    _call(xc, mc, pc, "openfold")
    extra, out = _peak_extra(lambda: _call(xc, mc, pc, "openfold"))
    assert extra <= 1.1 * shape.out_bytes, f"peak extra {extra} B vs output {shape.out_bytes} B"


def test_waves_large_weights_strided_x_and_no_bias(monkeypatch):
    """Weights x10, x a slice of a wider tensor, proj_b without a bias: the error against float64
    within twice eager float32's and the default path's, and the strided x gives the contiguous
    copy's bits."""
    monkeypatch.setenv("FLASHOPM_WAVES_BLOCKS", "4")
    shape = Shape(2, 40, 29, 60, 32, 64)
    x, m, p = make_problem(shape, "masked_positions", seed=44, scale=10.0)
    p["b_b"] = None
    pc = {k: None if v is None else v.cuda() for k, v in p.items()}
    wide = torch.randn(shape.B, shape.S, shape.N, shape.C + 4, device="cuda")
    wide[..., : shape.C] = x.cuda()
    xs, mc = wide[..., : shape.C], m.cuda()
    assert not xs.is_contiguous()
    ref32 = reference(xs, mc, pc)
    ref64 = reference(xs, mc, pc, dtype=torch.float64)
    out = _call(xs, mc, pc, "row")
    monkeypatch.setenv("FLASHOPM_WAVES", "0")
    out_default = _call(xs, mc, pc, "row")
    monkeypatch.setenv("FLASHOPM_WAVES", "1")
    err = rel_error(out, ref64)
    assert err <= max(2 * rel_error(ref32, ref64), FP64_FLOOR), err
    assert err <= max(2 * rel_error(out_default, ref64), FP64_FLOOR), err
    assert torch.equal(out, _call(xs.contiguous(), mc, pc, "row"))


def test_waves_rows_far_from_zero_and_constant_rows():
    """Rows 600 standard deviations from zero and constant rows: LayerNorm in the block keeps the
    error within twice eager float32's."""
    shape = Shape(1, 45, 21, 64, 32, 32)
    x, m, p = make_problem(shape, "masked_positions", seed=45)
    x = 30.0 + 0.05 * x
    x[:, ::7, 3] = 7.0
    x[:, 5, ::4] = -2.5
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    ref32 = reference(xc, mc, pc)
    ref64 = reference(xc, mc, pc, dtype=torch.float64)
    out = _call(xc, mc, pc, "row")
    assert out.isfinite().all()
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"error {err:.3g} against eager float32's {err_eager:.3g}"


def test_waves_left_out_where_it_cannot_run():
    """msa_dim 17 or hidden 16: the setting is ignored and the result still agrees."""
    for shape in (Shape(1, 40, 33, 17, 32, 64), Shape(1, 40, 33, 64, 16, 64)):
        x, m, p = make_problem(shape, "binary", seed=46)
        xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
        kernels = flashopm_kernels(lambda: _call(xc, mc, pc, "row"))
        assert not any(WAVES_KERNEL in k for k in kernels), kernels
        torch.testing.assert_close(_call(xc, mc, pc, "row"), reference(xc, mc, pc), atol=1e-4, rtol=1e-4)


def test_waves_taken_under_a_peak_bound(monkeypatch):
    """Under peak_memory_bound(1.1), where b for every residue passes what the bound leaves, the
    waves form runs by itself (FLASHOPM_WAVES unset) and keeps the bound; FLASHOPM_WAVES=0 leaves
    it out; without a bound it does not run."""
    monkeypatch.delenv("FLASHOPM_WAVES")
    shape = Shape(1, 100, 256, 24, 32, 128)
    x, m, p = make_problem(shape, "masked_positions", seed=47)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    ref32 = reference(xc, mc, pc)
    assert not any(WAVES_KERNEL in k for k in flashopm_kernels(lambda: _call(xc, mc, pc, "row")))
    with flashopm.peak_memory_bound(1.1):
        assert any(WAVES_KERNEL in k for k in flashopm_kernels(lambda: _call(xc, mc, pc, "row")))
        extra, out = _peak_extra(lambda: _call(xc, mc, pc, "row"))
        monkeypatch.setenv("FLASHOPM_WAVES", "0")
        assert not any(WAVES_KERNEL in k for k in flashopm_kernels(lambda: _call(xc, mc, pc, "row")))
    assert extra <= 1.1 * shape.out_bytes, f"peak extra {extra} B vs output {shape.out_bytes} B"
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
