"""Where the 16-bit contraction's time goes: one traced call (FLASHOPM_TC16_TRACE) per form of the
kernel, from each consumer warpgroup's Tc16Mark records.

    python scripts/tc16_trace.py [--shape B,S,N,C,H,D] [--forms 0,1,2] [--dtype bfloat16] [--out DIR]

Forms are FLASHOPM_TC16_CLUSTER values (0: the form whose warps copy their own stages; 1, 2, 4: the
tensor-copy forms), each optionally with other variables for its call: 2+FLASHOPM_TC16_DEFER=0.  Per tile, in clock cycles of its SM (clock64) and in microseconds: phase 1 of
each column tile, each O store, the wait on O before phase 2, the first W chunk's wait, phase 2, the
sums, the stores, and the gap to the next tile on the same SM (the same block for the persistent
forms, the next block on that SM otherwise).  Next to them, the cycles the tensor cores need for
each phase at 4096 dense 16-bit FLOP a clock per SM.  Writes summary.json, and with --tiles every
tile's record to tiles.csv (~40 MB at N = 1536).
"""
import argparse
import csv
import json
import os
import statistics

import torch

import flashopm
from flashopm.testing import PARAM_ORDER, Shape, make_problem

MARK_NAMES = ["tile", "p1_done0", "o0", "p1_done1", "o1", "round", "w0", "p2_done", "sums", "stored"]
# intervals between consecutive marks of a tile, named by what happens in them
STEPS = ["phase1_tile0", "o_store0", "phase1_tile1", "o_store1", "o_barrier", "w0_wait", "phase2", "sums",
         "stores"]
# phase 2's W chunks (FLASHOPM_TC16_TRACE in the tensor-copy forms): the chunk and the cycles its
# warpgroup waited for it
W_CHUNK_MARK = 10
# the last column tile's products retired in every warpgroup, before its O store: splits o_store1
# into the wait for the other warpgroups (o1_wait) and the store itself (o1_store)
O1_SYNC_MARK = 11
TENSOR_FLOP_PER_CLK = 4096  # dense 16-bit, per SM (four tensor cores)


def tiles_of(trace):
    """Per record row (block x consumer warpgroup): its tiles as lists of (mark, payload, ns, clk)."""
    t = trace.cpu()
    rows = []
    for r in range(t.shape[0]):
        n = int(t[r, 0, 0])
        cur, tiles = None, []
        for e0, ns, clk in t[r, 1:n + 1].tolist():
            m, pay = e0 & 0xFF, e0 >> 8
            if m == 0:
                cur = {"row": r, "it": pay & 0xFFFFFF, "sm": pay >> 24}
                tiles.append(cur)
            if cur is not None and m < len(MARK_NAMES):
                cur[MARK_NAMES[m]] = (ns, clk)
            elif cur is not None and m == W_CHUNK_MARK:
                cur.setdefault("w_waits", {})[pay & 0xFF] = pay >> 8
            elif cur is not None and m == O1_SYNC_MARK:
                cur["o1_sync"] = (ns, clk)
        rows.append(tiles)
    return rows


def cluster_pair_waits(rows, wgs):
    """Clusters of two (blocks 2k and 2k + 1 take the same tiles, W multicast to both): per W
    chunk, the mean over tiles and the phase-2 warpgroups of the two blocks' waits for it, as the
    smaller (the wait that the block behind sees as well) and the larger (the block ahead's), and
    the mean skew of the two blocks' tile starts in ns. A W copy goes out once both blocks have
    released the chunk before it in its slot, so where the larger wait is much the greater, the
    block behind paces the one ahead."""
    by_row = {tiles[0]["row"]: {t["it"]: t for t in tiles} for tiles in rows if tiles}
    acc, starts = {}, []
    for r, tiles in by_row.items():
        blk, wg = divmod(r, wgs)
        if blk % 2:
            continue
        other = by_row.get((blk + 1) * wgs + wg)
        if other is None:
            continue
        for it, t in tiles.items():
            u = other.get(it)
            if u is None:
                continue
            if wg == 0 and "tile" in t and "tile" in u:
                starts.append(abs(t["tile"][0] - u["tile"][0]))
            wa, wb = t.get("w_waits", {}), u.get("w_waits", {})
            for kc in wa.keys() & wb.keys():
                a = acc.setdefault(kc, ([], []))
                a[0].append(min(wa[kc], wb[kc]))
                a[1].append(max(wa[kc], wb[kc]))
    out = {kc: {"min": statistics.mean(a[0]), "max": statistics.mean(a[1]), "n": len(a[0])}
           for kc, a in sorted(acc.items())}
    return out, (statistics.mean(starts) if starts else float("nan"))


def summarise(rows, shape, wgs=2):
    """wgs: the form's consumer warpgroups (3 with FLASHOPM_TC16_WIDE=1: tiles of 192 rows, 96 pairs)."""
    B, S, N, C, H, D = shape
    pairs = 32 * wgs
    p1 = 2 * 64 * wgs * 256 * S / TENSOR_FLOP_PER_CLK
    p2 = 2 * pairs * H * H * D / TENSOR_FLOP_PER_CLK
    ideal = {"phase1_tile0": p1, "phase1_tile1": p1, "phase2": p2}
    steps = {k: [] for k in STEPS + ["o1_wait", "o1_store", "w_wait_total", "gap", "tile_total"]}
    chunk_waits = {}  # W chunk -> the cycles each warpgroup waited for it in phase 2
    ghz = []
    recs = []
    by_sm = {}
    for tiles in rows:
        for t in tiles:
            if not all(m in t for m in MARK_NAMES):
                continue
            row = {"row": t["row"], "sm": t["sm"], "it": t["it"]}
            for k, step in enumerate(STEPS):
                row[step] = t[MARK_NAMES[k + 1]][1] - t[MARK_NAMES[k]][1]
                steps[step].append(row[step])
            row["start_clk"] = t["tile"][1]
            row["end_clk"] = t["stored"][1]
            dns = t["stored"][0] - t["tile"][0]
            if dns > 0:
                ghz.append((t["stored"][1] - t["tile"][1]) / dns)
            if "o1_sync" in t:
                for step, a, b in (("o1_wait", "p1_done1", "o1_sync"), ("o1_store", "o1_sync", "o1")):
                    row[step] = t[b][1] - t[a][1]
                    steps[step].append(row[step])
            waits = t.get("w_waits", {})
            for kc, w in waits.items():
                chunk_waits.setdefault(kc, []).append(w)
            if waits:
                row["w_wait_total"] = sum(waits.values())
                steps["w_wait_total"].append(row["w_wait_total"])
            recs.append(row)
            # the warpgroup's stream on this SM (warpgroup = row modulo wgs)
            by_sm.setdefault((t["sm"], t["row"] % wgs), []).append(row)
    for key, rs in by_sm.items():
        rs.sort(key=lambda r: r["start_clk"])
        for a, b in zip(rs, rs[1:]):
            if b["start_clk"] >= a["end_clk"]:
                steps["gap"].append(b["start_clk"] - a["end_clk"])
                steps["tile_total"].append(b["start_clk"] - a["start_clk"])
    clock = statistics.median(ghz) if ghz else float("nan")
    out = {"clock_ghz": clock, "tiles": len(recs), "steps": {}}
    total = statistics.mean(steps["tile_total"]) if steps["tile_total"] else float("nan")
    for k, v in steps.items():
        if not v:
            continue
        mean = statistics.mean(v)
        out["steps"][k] = {
            "mean_clk": mean,
            "median_clk": statistics.median(v),
            "p90_clk": sorted(v)[int(0.9 * (len(v) - 1))],
            "mean_us": mean / clock / 1e3,
            "share": mean / total if k != "tile_total" else 1.0,
            "tensor_clk": ideal.get(k),
        }
    out["w_chunk_wait_mean_clk"] = {kc: statistics.mean(v) for kc, v in sorted(chunk_waits.items())}
    out["tensor_share"] = (2 * p1 + p2) / total
    out["pairs_per_tile"] = pairs
    out["tile_clk_per_64_pairs"] = total * 64 / pairs
    return out, recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1,512,1536,256,32,128")
    ap.add_argument("--forms", default="0,1,2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiles", action="store_true", help="also write every tile's record (tiles.csv)")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    x, m, p = make_problem(Shape(*shape), "masked_positions", seed=1)
    x, m = x.cuda().to(dtype), m.cuda().to(dtype)
    p = {k: None if v is None else v.cuda().to(dtype) for k, v in p.items()}
    B, S, N, C, H, D = shape
    groups = B * -(-N // 16) * -(-N // 4)
    summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": shape,
               "dtype": args.dtype, "forms": {}}
    all_rows = []
    for item in args.forms.split(","):
        form, *extra = item.split("+")
        env = dict(e.split("=", 1) for e in extra)
        os.environ.update(env)
        os.environ["FLASHOPM_TC16_CLUSTER"] = form
        os.environ.pop("FLASHOPM_TC16_TRACE", None)
        for _ in range(2):
            flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer")
        torch.cuda.synchronize()
        # a persistent block takes about groups / SMs tiles of ten marks
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        one_tile = form == "0" and env.get("FLASHOPM_TC16_RESIDENT") == "0"
        cap = 16 if one_tile else 30 * (groups // sms + 4) + 16  # eleven marks and 16 W chunks a tile
        os.environ["FLASHOPM_TC16_TRACE"] = str(cap)
        flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer")
        torch.cuda.synchronize()
        os.environ.pop("FLASHOPM_TC16_TRACE", None)
        for k in env:
            os.environ.pop(k, None)
        rows = tiles_of(torch.ops.flashopm._waves_trace(x))
        # three consumer warpgroups: the tensor-copy forms in clusters of one or two at hidden 32
        # with D <= 128, unless FLASHOPM_TC16_WIDE=0
        wide = env.get("FLASHOPM_TC16_WIDE", "1") != "0" and form in ("1", "2") and H == 32 and D <= 128
        s, recs = summarise(rows, shape, 3 if wide else 2)
        pair_waits, start_skew = cluster_pair_waits(rows, 3 if wide else 2) if form == "2" else ({}, float("nan"))
        s["w_chunk_wait_pairs_clk"], s["tile_start_skew_ns"] = pair_waits, start_skew
        summary["forms"][item] = s
        for r in recs:
            r["form"] = item
        all_rows += recs
        print(f"form FLASHOPM_TC16_CLUSTER={item}: {s['tiles']} tile records, clock {s['clock_ghz']:.3f} GHz, "
              f"tensor cores' share of a tile's cycles {s['tensor_share']:.3f}, {s['pairs_per_tile']} pairs a tile, "
              f"{s['tile_clk_per_64_pairs']:.0f} cycles per 64 pairs")
        print(f"  {'step':14s} {'mean clk':>9s} {'median':>8s} {'p90':>8s} {'mean us':>8s} {'share':>6s} {'tensor':>7s}")
        for k, v in s["steps"].items():
            tc = "" if v["tensor_clk"] is None else f"{v['tensor_clk']:.0f}"
            print(f"  {k:14s} {v['mean_clk']:9.0f} {v['median_clk']:8.0f} {v['p90_clk']:8.0f} {v['mean_us']:8.3f} "
                  f"{v['share']:6.3f} {tc:>7s}")
        if s["w_chunk_wait_mean_clk"]:
            print("  phase 2's wait for each W chunk (mean clk, within phase2; chunk 0's is w0_wait): " +
                  " ".join(f"{kc}:{w:.0f}" for kc, w in s["w_chunk_wait_mean_clk"].items()))
        if pair_waits:
            print(f"  the cluster's two blocks (tile starts {start_skew:.0f} ns apart on average), each W chunk's "
                  "wait in the block behind / the block ahead (mean clk): " +
                  " ".join(f"{kc}:{v['min']:.0f}/{v['max']:.0f}" for kc, v in pair_waits.items()))
            print(f"  W's waits a tile in the block behind {sum(v['min'] for v in pair_waits.values()):.0f}, "
                  f"in the block ahead {sum(v['max'] for v in pair_waits.values()):.0f}")
    os.environ.pop("FLASHOPM_TC16_CLUSTER", None)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        if all_rows and args.tiles:
            with open(os.path.join(args.out, "tiles.csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(all_rows[0].keys()))
                w.writeheader()
                w.writerows(all_rows)


if __name__ == "__main__":
    main()
