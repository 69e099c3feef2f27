"""scripts/tc16_trace.py's reading of a trace (FLASHOPM_TC16_TRACE records), on made-up records:
the steps of a tile and the W chunks' waits split between the two blocks of a cluster."""
import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tc16_trace.py"


@pytest.fixture(scope="module")
def trace_script():
    spec = importlib.util.spec_from_file_location("tc16_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_trace(n_blocks, wgs, tiles, wait_of, start_of):
    """Records as the wide kernel writes them: per block and consumer warpgroup, record 0 the count,
    then (mark | payload << 8, ns, clk). The first two warpgroups record phase 2's chunks."""
    tr = torch.zeros(n_blocks * wgs, 1 + 26 * tiles, 3, dtype=torch.long)  # 10 marks, 16 chunks a tile
    for blk in range(n_blocks):
        for wg in range(2):
            row = blk * wgs + wg
            recs = []
            for it in range(tiles):
                t0 = start_of(blk, it)
                recs.append((0, it | (7 << 24), t0, t0))
                for m in range(1, 10):  # the tile's marks, 100 cycles apart
                    recs.append((m, 0, t0 + 100 * m, t0 + 100 * m))
                for kc in range(16):
                    recs.append((10, kc | (wait_of(blk, it, kc) << 8), t0 + 600, t0 + 600))
            for i, (m, pay, ns, clk) in enumerate(recs):
                tr[row, i + 1] = torch.tensor([m | (pay << 8), ns, clk])
            tr[row, 0, 0] = len(recs)
    return tr


def test_cluster_pair_waits_split_each_chunk_between_the_two_blocks(trace_script):
    # blocks 0-1 and 2-3 are clusters; the odd block starts 40 ns later and waits 50 cycles a chunk,
    # the even one 100 + kc; block 4 has no partner and is left out
    def wait_of(blk, it, kc):
        return 50 if blk % 2 else 100 + kc + it

    rows = trace_script.tiles_of(make_trace(5, 3, 3, wait_of, lambda blk, it: 10_000 * it + 40 * (blk % 2)))
    pairs, skew = trace_script.cluster_pair_waits(rows, 3)
    assert sorted(pairs) == list(range(16))
    for kc, v in pairs.items():
        assert v["n"] == 2 * 2 * 3  # two clusters x two warpgroups x three tiles
        assert v["min"] == 50
        assert v["max"] == pytest.approx(100 + kc + 1)  # tiles 0-2: the mean of it is 1
    assert skew == pytest.approx(40)


def test_summarise_steps_of_a_tile(trace_script):
    rows = trace_script.tiles_of(make_trace(2, 3, 4, lambda blk, it, kc: 60, lambda blk, it: 10_000 * it))
    s, recs = trace_script.summarise(rows, (1, 512, 1536, 256, 32, 128), 3)
    assert s["tiles"] == len(recs) == 2 * 2 * 4
    for step in trace_script.STEPS:
        assert s["steps"][step]["mean_clk"] == 100
    assert s["steps"]["tile_total"]["mean_clk"] == 10_000
    assert s["steps"]["gap"]["mean_clk"] == 10_000 - 900
    assert s["w_chunk_wait_mean_clk"] == {kc: 60 for kc in range(16)}
