"""The peak bound's bands (opm_api.cpp's search_bands), checked on the host: the planner runs
without a GPU, so these run wherever the extension builds (CI included).

A band's a and b may lie in the output's rows after it, which the band's launches must not write
and which must hold them; the bands must cover every row once, in order; what does not lie in a
tail must fit in the workspace the bound leaves.  These are the conditions under which the
bounded forward is correct and within its bound; the GPU tests check the results themselves."""
import itertools

import pytest
import torch

from conftest import toolchain_or_skip

SMS = 132
PARTS, COL_BLOCKS, WHOLE_LAST_COL_TILE = 1, 2, 4


@pytest.fixture(scope="module", autouse=True)
def extension():
    toolchain_or_skip()
    from flashopm import _build

    _build.load()


def _plan(N, S, C, H, D, *, row_floats, elem, out_elem, bound, flags, ti=None, tj=None, wave_step_us=0.064,
          pair_counts=False, x_elem=4, w_copy=None, counts_beside_b=False):
    """The op's band plan as the forward asks for it; pair_counts: OpenFold's or Boltz's convention,
    whose counts (N floats a row) lie after each band's a (counts_beside_b: the counts of every
    row taken from the room instead, as before the bands carried them).  w_copy: the bytes of W's
    copies (float32's blocked copy by default)."""
    out_bytes = N * N * D * out_elem
    norm_fixed = (1 if pair_counts else 2) * N * 4 + (N * N * 4 if counts_beside_b else 0)
    w_copy = (D * H * H + D) * 4 if w_copy is None else w_copy
    ab_room = int((bound - 1.01) * out_bytes) - w_copy - (N + D) * 4 - (64 << 10) - norm_fixed
    ti = ti or max(128 // H, 1)
    tj = tj or max(256 // H, 1)
    norm_row_bytes = N * 4 if pair_counts and not counts_beside_b else 0
    raw = torch.ops.flashopm._peak_band_plan(torch.empty(0), N, S, C, H, D, row_floats, elem, x_elem, out_elem,
                                             ab_room, norm_row_bytes, ti, tj, SMS, wave_step_us, flags)
    return raw, ab_room, ti, tj


def _bands(raw):
    b_kept, ws_bytes, n = raw[:3]
    rows = [raw[3 + 5 * k: 8 + 5 * k] for k in range(n)]
    assert len(raw) == 3 + 5 * n
    return bool(b_kept), ws_bytes, [dict(zip(("r0", "rows", "cols", "s_part", "tail"), r)) for r in rows]


def _stored(s, row_floats):
    return -(-s // row_floats) * row_floats


# (N, S, C, H, D, row_floats, a/b element bytes, output element bytes, bound, flags): the
# benchmark's shapes and awkward ones (primes, N below a column tile, deep and shallow MSAs), in
# float32 (the float16 split form's 32 s per chunk, 3xTF32's 16, none) and 16-bit outputs (no parts).
CASES = [
    (256, 128, 256, 32, 128, 32, 4, 4, 1.1, PARTS | COL_BLOCKS | WHOLE_LAST_COL_TILE),
    (768, 512, 256, 32, 128, 32, 4, 4, 1.1, PARTS | COL_BLOCKS | WHOLE_LAST_COL_TILE),
    (256, 1024, 64, 32, 128, 32, 4, 4, 1.1, PARTS | COL_BLOCKS | WHOLE_LAST_COL_TILE),
    (1536, 512, 256, 32, 128, 32, 4, 4, 1.1, PARTS | COL_BLOCKS | WHOLE_LAST_COL_TILE),
    (384, 5120, 64, 32, 128, 32, 4, 4, 1.1, PARTS | COL_BLOCKS | WHOLE_LAST_COL_TILE),
    (1536, 512, 256, 32, 128, 1, 2, 2, 1.1, COL_BLOCKS),
    (509, 256, 32, 32, 128, 1, 2, 2, 1.1, COL_BLOCKS),
    (256, 100, 24, 32, 128, 16, 4, 4, 1.1, PARTS | COL_BLOCKS),
    (256, 400, 24, 12, 128, 1, 4, 4, 1.1, PARTS | COL_BLOCKS),
    (257, 333, 24, 24, 97, 16, 4, 4, 1.05, PARTS | COL_BLOCKS),
    (31, 1000, 17, 8, 64, 32, 4, 4, 2.0, PARTS | COL_BLOCKS),
    (509, 2048, 64, 32, 128, 32, 4, 4, 1.02, PARTS | COL_BLOCKS | WHOLE_LAST_COL_TILE),
    (1021, 64, 256, 32, 128, 32, 4, 4, 1.1, PARTS),
]


@pytest.mark.parametrize("pair_counts", [False, True], ids=["row", "pair_counts"])
@pytest.mark.parametrize("N,S,C,H,D,row_floats,elem,out_elem,bound,flags", CASES, ids=str)
def test_bands_cover_every_row_and_keep_a_and_b_apart_from_their_writes(N, S, C, H, D, row_floats, elem, out_elem,
                                                                     bound, flags, pair_counts):
    raw, ab_room, ti, tj = _plan(N, S, C, H, D, row_floats=row_floats, elem=elem, out_elem=out_elem, bound=bound,
                                 flags=flags, pair_counts=pair_counts)
    assert raw, "no bands for a bound that leaves room for them"
    b_kept, ws_bytes, bands = _bands(raw)
    out_row_bytes = N * D * out_elem
    assert 0 <= ws_bytes <= ab_room, f"workspace {ws_bytes} B past the room {ab_room} B"
    b_kept_bytes = _stored(S, row_floats) * N * H * elem if b_kept else 0
    next_row = 0
    for bd in bands:
        assert bd["r0"] == next_row, f"bands out of order or overlapping: {bands}"
        assert bd["rows"] >= 1
        next_row = bd["r0"] + bd["rows"]
        if next_row < N:
            assert bd["rows"] % ti == 0, f"a band ending before the last row must take whole row tiles: {bd}"
        cols = bd["cols"]
        assert 1 <= cols <= N and (cols == N or cols % tj == 0), f"blocks of columns in whole tiles: {bd}"
        if cols < N:
            assert flags & COL_BLOCKS
            if flags & WHOLE_LAST_COL_TILE:
                assert N - (-(-N // cols) - 1) * cols >= tj, f"a last block of columns short of a tile: {bd}"
        sp = bd["s_part"]
        assert 1 <= sp <= S
        if sp < S:
            assert flags & PARTS and not b_kept, f"parts of s where none are allowed: {bd}"
            assert sp % row_floats == 0, f"parts of whole chunks: {bd}"
        if b_kept:
            assert cols == N and sp == S
        # a (rows) and b (cols, unless kept) over a part, then the band's pair counts from a
        # 16-byte boundary, as the forward lays them out
        need = ((0 if b_kept else cols) + bd["rows"]) * _stored(sp, row_floats) * H * elem
        if pair_counts:
            need += bd["rows"] * N * 4 + 16
        if bd["tail"]:
            start = -(-next_row * out_row_bytes // 256) * 256  # 256-byte aligned, after the band's rows
            assert start >= next_row * out_row_bytes
            assert start + need <= N * out_row_bytes, f"a and b run past the output's end: {bd}"
        else:
            assert b_kept_bytes + need <= ws_bytes, f"a and b past the workspace: {bd}"
    assert next_row == N, f"rows {next_row}..{N} left out: {bands}"


def test_outputs_in_16_bits_take_no_parts():
    """A 16-bit output has no float32 sums to add parts into: bands without parts, or none."""
    for N, S in itertools.product((256, 768), (128, 512, 2048)):
        raw, *_ = _plan(N, S, 256, 32, 128, row_floats=1, elem=2, out_elem=2, bound=1.1, flags=COL_BLOCKS)
        if raw:
            _, _, bands = _bands(raw)
            assert all(bd["s_part"] == S for bd in bands), (N, S, bands)


def test_first_band_lies_in_the_output_where_b_passes_the_workspace():
    """The crop under 1.1x: b for every residue (4.2 MB) passes the room the bound leaves (~2.4 MB),
    so the first band's a and b lie in the output's rows after it, and no band needs parts."""
    raw, ab_room, _, _ = _plan(256, 128, 256, 32, 128, row_floats=32, elem=4, out_elem=4, bound=1.1,
                               flags=PARTS | COL_BLOCKS | WHOLE_LAST_COL_TILE)
    b_kept, _, bands = _bands(raw)
    assert 256 * 128 * 32 * 4 > ab_room
    assert not b_kept and bands[0]["tail"] and bands[0]["cols"] == 256
    assert all(bd["s_part"] == 128 for bd in bands)


def test_pair_counts_leave_b_for_every_residue_in_the_workspace():
    """OpenFold's convention in bfloat16 at (1,512,1536,256,32,128) under 1.1x: with the pair counts
    laid band by band after each band's a, b for every residue (50.3 MB) stays in the room the bound
    leaves (~54 MB), as under the specification's convention; counts for every row beside it (9.4
    MB) push it out, and b is projected again for blocks of columns."""
    shape = dict(row_floats=1, elem=2, out_elem=2, bound=1.1, flags=COL_BLOCKS, wave_step_us=0.035, tj=16, x_elem=2,
                 w_copy=128 * 32 * 32 * 2)  # the 16-bit kernel's blocked copy of a bfloat16 module's W
    for pair_counts in (False, True):
        raw, *_ = _plan(1536, 512, 256, 32, 128, pair_counts=pair_counts, **shape)
        b_kept, _, bands = _bands(raw)
        assert b_kept and all(bd["cols"] == 1536 for bd in bands), (pair_counts, bands)
    raw, *_ = _plan(1536, 512, 256, 32, 128, pair_counts=True, counts_beside_b=True, **shape)
    b_kept, _, bands = _bands(raw)
    assert not b_kept and any(bd["cols"] < 1536 for bd in bands), bands


def test_bad_sizes_are_refused():
    with pytest.raises(RuntimeError, match="_peak_band_plan needs positive sizes"):
        torch.ops.flashopm._peak_band_plan(torch.empty(0), 0, 128, 256, 32, 128, 32, 4, 4, 4, 1 << 20, 0, 4, 8, SMS,
                                           0.064, 3)
    with pytest.raises(RuntimeError, match="_peak_band_plan needs positive sizes"):
        torch.ops.flashopm._peak_band_plan(torch.empty(0), 256, 128, 256, 32, 128, 32, 4, 4, 4, 1 << 20, -1, 4, 8, SMS,
                                           0.064, 3)
