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
from conftest import call_outer_highest as _call
from conftest import (check_deep_msa_within_the_memory_bound, check_finite_within_twice_eager,
                      check_form_against_the_references, check_large_weights_strided_x_and_no_bias,
                      check_left_out_where_it_cannot_run, check_rows_far_from_zero_and_constant_rows,
                      flashopm_kernels, peak_extra, requires_cuda,
                      split_form_gpu_or_skip, with_setting)
from flashopm.testing import Shape, make_problem, reference

pytestmark = requires_cuda

WAVES_KERNEL = "256, false, true>"  # opm_outer_tc_kernel<3, true, true, true, 32, 32, 256, false, true>
KEPT_A_MARK = 12  # WaveMark kMarkKeptA (csrc/opm_params.h): a wave kept the a of the wave before it


@pytest.fixture(autouse=True)
def _waves(monkeypatch):
    split_form_gpu_or_skip()
    monkeypatch.setenv("FLASHOPM_WAVES", "1")
    for name in ("FLASHOPM_WAVES_BLOCKS", "FLASHOPM_WAVES_WS", "FLASHOPM_WAVES_OUT", "FLASHOPM_WAVES_BUFS",
                 "FLASHOPM_WAVES_KEEP", "FLASHOPM_WAVES_OWN", "FLASHOPM_WAVES_TRACE",
                 "FLASHOPM_PEAK_BOUND"):
        monkeypatch.delenv(name, raising=False)


# (shape, normalization, mask kind, plan): a chunk of s and one past it, S = 1, msa_dim below a
# float4 step (4, 20), N one column tile (8), residues that end mid-tile (9, 13, 37, 45, 97), B = 3,
# every convention, fully masked residues and fractional masks; plans with a few blocks (several
# waves, edge waves of fewer tiles and residues), workspaces of one or two chunks per part, one or
# two part buffers, and the output's rows left out.
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
    (Shape(1, 229, 41, 64, 32, 64), "row", "masked_positions",
     {"FLASHOPM_WAVES_BLOCKS": "3", "FLASHOPM_WAVES_WS": "1", "FLASHOPM_WAVES_OUT": "0", "FLASHOPM_WAVES_BUFS": "1"}),
    (Shape(1, 129, 33, 48, 32, 32), "boltz", "fractional", {"FLASHOPM_WAVES_BLOCKS": "9", "FLASHOPM_WAVES_BUFS": "2"}),
]


@pytest.mark.parametrize("shape,normalization,mask_kind,plan", CASES, ids=str)
def test_waves_against_the_references(shape, normalization, mask_kind, plan, monkeypatch):
    for name, value in plan.items():
        monkeypatch.setenv(name, value)
    check_form_against_the_references(_call, shape, normalization, mask_kind, 41, WAVES_KERNEL)


def test_waves_every_plan_gives_the_same_bits(monkeypatch):
    """One wave of every tile against several waves of few blocks, parts of one chunk from the
    workspace, the output's rows used or not, one part buffer or two: each tile adds the same
    chunks in the same order, so the bits agree."""
    shape = Shape(2, 200, 77, 64, 32, 64)
    x, m, p = make_problem(shape, "masked_positions", seed=42)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    first = _call(xc, mc, pc, "openfold")
    plans = [
        {"FLASHOPM_WAVES_BLOCKS": "3"},
        {"FLASHOPM_WAVES_BLOCKS": "6", "FLASHOPM_WAVES_WS": "1", "FLASHOPM_WAVES_OUT": "0"},
        {"FLASHOPM_WAVES_BLOCKS": "11", "FLASHOPM_WAVES_WS": "1"},
        {"FLASHOPM_WAVES_OUT": "0"},
        {"FLASHOPM_WAVES_BUFS": "1", "FLASHOPM_WAVES_BLOCKS": "5", "FLASHOPM_WAVES_WS": "1"},
        {"FLASHOPM_WAVES_BUFS": "2", "FLASHOPM_WAVES_BLOCKS": "7", "FLASHOPM_WAVES_WS": "1", "FLASHOPM_WAVES_OUT": "0"},
        {"FLASHOPM_WAVES_BUFS": "1", "FLASHOPM_WAVES_OUT": "0"},
        {"FLASHOPM_WAVES_KEEP": "0", "FLASHOPM_WAVES_BLOCKS": "5"},
        {"FLASHOPM_WAVES_OWN": "0", "FLASHOPM_WAVES_BLOCKS": "3"},
    ]
    for plan in plans:
        for name, value in plan.items():
            monkeypatch.setenv(name, value)
        assert torch.equal(_call(xc, mc, pc, "openfold"), first), plan
        for name in plan:
            monkeypatch.delenv(name)


def test_waves_one_buffer_parts_repeat_bit_for_bit(monkeypatch):
    """Parts of two chunks in one buffer (the workspace alone): each part's stores wait at a grid
    barrier that every block arrives at once its reads of the part before are done (before its
    phase 2 where that part ended a wave).  A block storing too early would overwrite rows another
    still reads; ten calls give the same bits, which match the two-buffer plan's and the
    references."""
    shape = Shape(1, 257, 70, 64, 32, 64)
    x, m, p = make_problem(shape, "masked_positions", seed=49)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    monkeypatch.setenv("FLASHOPM_WAVES_BLOCKS", "13")
    monkeypatch.setenv("FLASHOPM_WAVES_WS", "1")
    monkeypatch.setenv("FLASHOPM_WAVES_OUT", "0")
    monkeypatch.setenv("FLASHOPM_WAVES_BUFS", "2")
    two = _call(xc, mc, pc, "row")
    monkeypatch.setenv("FLASHOPM_WAVES_BUFS", "1")
    outs = [_call(xc, mc, pc, "row") for _ in range(10)]
    for out in outs:
        assert torch.equal(out, two)
    torch.testing.assert_close(two, reference(xc, mc, pc), atol=1e-4, rtol=1e-4)


KEPT_A_MARK, OWN_ROWS_MARK = 12, 14  # WaveMark: kMarkKeptA, kMarkOwnRows


def _marked_waves(call, mark=KEPT_A_MARK):
    """The result of call() and how many of its waves passed trace point `mark` (the launch's
    trace, FLASHOPM_WAVES_TRACE): kept the a of the wave before them, or laid their part buffers
    over their own rows."""
    out = call()
    trace = torch.ops.flashopm._waves_trace(out).cpu()
    marked = 0
    for blk in range(trace.shape[0]):
        n = int(trace[blk, 0, 0])
        marked += int(((trace[blk, 1:n + 1, 0] & 0xFF) == mark).sum())
    return out, marked // trace.shape[0]


def test_waves_keep_a_across_a_band(monkeypatch):
    """Eight blocks at N = 64: bands of 16 rows in four waves each, all of s in one part in the
    band's rows after it, so that the band's later waves keep the first wave's a (three per band
    but the last, whose workspace takes s in parts): against the references, and the bits of every
    wave projecting its own a."""
    shape = Shape(1, 100, 64, 32, 32, 128)
    x, m, p = make_problem(shape, "masked_positions", seed=48)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    monkeypatch.setenv("FLASHOPM_WAVES_BLOCKS", "8")
    monkeypatch.setenv("FLASHOPM_WAVES_TRACE", "4096")
    kept_out, kept = _marked_waves(lambda: _call(xc, mc, pc, "row"))
    assert kept == 9, f"waves that kept a: {kept}, expected 3 in each of the first three bands"
    monkeypatch.setenv("FLASHOPM_WAVES_KEEP", "0")
    fresh_out, fresh = _marked_waves(lambda: _call(xc, mc, pc, "row"))
    assert fresh == 0
    assert torch.equal(kept_out, fresh_out)
    torch.testing.assert_close(kept_out, reference(xc, mc, pc), atol=1e-4, rtol=1e-4)


def test_waves_last_band_in_its_own_rows(monkeypatch):
    """(1,1024,256,64) on 132 blocks: 16 waves of 64 x 64 residues.  The last band has no rows
    after it; its first three waves hold more slots in their own rows (from their first column
    on: 512, 384 and 256) than in a workspace of 183, so their parts lie there and their output
    stores wait for every block's reads; the last (128 slots) takes the workspace.  The same bits as with the workspace alone (FLASHOPM_WAVES_OWN=0), and the
    references'."""
    if torch.cuda.get_device_properties(0).multi_processor_count < 132:
        pytest.skip("needs 132 SMs for this plan")
    shape = Shape(1, 1024, 256, 64, 32, 128)
    x, m, p = make_problem(shape, "masked_positions", seed=50)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    monkeypatch.setenv("FLASHOPM_WAVES_BLOCKS", "132")
    monkeypatch.setenv("FLASHOPM_WAVES_WS", str(183 * 16384))  # 183 slots: more than the last wave's own 128
    monkeypatch.setenv("FLASHOPM_WAVES_TRACE", "8192")
    own_out, own = _marked_waves(lambda: _call(xc, mc, pc, "openfold"), OWN_ROWS_MARK)
    assert own == 3, f"waves with their parts in their own rows: {own}, expected 3 (the last band's first three)"
    monkeypatch.setenv("FLASHOPM_WAVES_OWN", "0")
    ws_out, none = _marked_waves(lambda: _call(xc, mc, pc, "openfold"), OWN_ROWS_MARK)
    assert none == 0
    assert torch.equal(own_out, ws_out)
    code = flashopm.ops.NORMALIZATIONS["openfold"]
    torch.testing.assert_close(own_out, reference(xc, mc, pc, normalization=code), atol=1e-4, rtol=1e-4)


def test_waves_within_the_memory_bound():
    """(1,1024,256,64,32,128) in the waves form within 1.1x the output."""
    check_deep_msa_within_the_memory_bound(_call, seed=43)


def test_waves_large_weights_strided_x_and_no_bias(monkeypatch):
    """Weights x10, strided x, proj_b without a bias, in several waves, against the default path
    too."""
    monkeypatch.setenv("FLASHOPM_WAVES_BLOCKS", "4")

    default = with_setting(monkeypatch, "FLASHOPM_WAVES", "0", _call)
    check_large_weights_strided_x_and_no_bias(_call, default, seed=44)


def test_waves_scales_from_a_bound_far_above_the_values():
    """The residues' scales come from a bound on a and b (the mask's largest magnitude times the
    largest |bias'| + sqrt(C)·||W'_h||), here far above most values: one row of W x1000, biases
    and LayerNorm's bias large, mask values up to 2.5 and fully masked residues; the error against
    float64 within twice eager float32's."""
    shape = Shape(1, 77, 30, 64, 32, 64)
    x, m, p = make_problem(shape, "fractional", seed=47)
    m = 2.5 * m
    m[:, :, 4] = 0.0
    p["w_a"][0] *= 1000.0
    p["b_a"] += 40.0
    p["ln_bias"] += 3.0
    check_finite_within_twice_eager(_call, x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()})


def test_waves_rows_far_from_zero_and_constant_rows():
    """LayerNorm in the block, from the row's first value as the first kernel forms it."""
    check_rows_far_from_zero_and_constant_rows(_call, seed=45)


def test_waves_left_out_where_it_cannot_run():
    """msa_dim 17 or hidden 16: the setting is ignored and the result still agrees."""
    check_left_out_where_it_cannot_run(_call, WAVES_KERNEL, seed=46)


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
        extra, out = peak_extra(lambda: _call(xc, mc, pc, "row"))
        monkeypatch.setenv("FLASHOPM_WAVES", "0")
        assert not any(WAVES_KERNEL in k for k in flashopm_kernels(lambda: _call(xc, mc, pc, "row")))
    assert extra <= 1.1 * shape.out_bytes, f"peak extra {extra} B vs output {shape.out_bytes} B"
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
