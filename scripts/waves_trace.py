"""Where the waves form's time goes: one forward call traced (FLASHOPM_WAVES_TRACE), per part and
per wave, from every block's records (WaveArgs::trace, WaveMark).

    python scripts/waves_trace.py [B,S,N,C,H,D ...] [--calls 3] [--out DIR] [--env VAR=VALUE,...]

Per part: the projection (this block's share of the part, less the one-buffer barrier inside it),
the wait at that barrier, the wait at the part's grid barrier, the chunks added to the tile; per
wave: phase 2 and the stores.  Means over blocks (the chunks over blocks with a tile), in
microseconds, from %globaltimer; the kernel's span from the first record to the last.  Writes
parts.csv and summary.json under --out.
"""
import argparse
import csv
import json
import os
from collections import defaultdict

import torch

import flashopm
from flashopm.testing import Shape, make_problem

MARKS = {1: "wave", 2: "part", 3: "store_wait", 4: "store_go", 5: "projected", 6: "barrier", 7: "chunks",
         8: "wave_end", 9: "batch_in", 10: "batch_stats", 11: "batch_done", 13: "batch_issued"}
# a wave's steps, summed over its parts (block means), then its epilogue and the gap before it
PART_STEPS = ("proj_us", "copy_wait_us", "issue_us", "stats_us", "project_us", "store_wait_us", "barrier_wait_us",
              "chunks_us")
WAVE_TAIL = ("epilogue_us", "gap_us")


def records(trace):
    """(block, mark, wave, part, ns) for every record of every block."""
    out = []
    t = trace.cpu()
    for blk in range(t.shape[0]):
        n = int(t[blk, 0, 0])
        for r in t[blk, 1:n + 1].tolist():
            out.append((blk, r[0] & 0xFF, (r[0] >> 8) & 0xFFFFFF, r[0] >> 32, r[1]))
    return out


def summarise(recs):
    t0 = min(r[4] for r in recs)
    by_part = defaultdict(lambda: defaultdict(list))  # q -> block -> [(mark, ns)] in order
    by_wave = defaultdict(lambda: defaultdict(dict))  # w -> block -> mark -> ns
    part_wave = {}
    for blk, mark, w, q, ns in recs:
        name = MARKS.get(mark, str(mark))
        if name in ("wave", "wave_end"):
            by_wave[w][blk][name] = ns - t0
        else:
            by_part[q][blk].append((name, ns - t0))
            part_wave[q] = w

    def mean(v):
        return sum(v) / len(v) if v else 0.0

    def split_part(seq):
        """One block's part: the times of its steps (ns)."""
        m = {}
        for name, ns in seq:
            m.setdefault(name, ns)
        t = dict.fromkeys(("copy_wait", "issue", "stats", "project", "store_wait"), 0)
        prev = m.get("part")
        batch_in = None
        for name, ns in seq:
            if name == "batch_in":
                t["copy_wait"] += ns - prev
                batch_in = ns
            elif name == "batch_issued":
                t["issue"] += ns - batch_in
                batch_in = ns
            elif name == "batch_stats":
                t["stats"] += ns - batch_in
                prev = ns
            elif name == "batch_done":
                t["project"] += ns - prev
                prev = ns
        if "store_go" in m:
            t["store_wait"] = m["store_go"] - m["store_wait"]
            t["stats"] -= t["store_wait"]
        return m, t

    parts = []
    for q in sorted(by_part):
        cols = defaultdict(list)
        for blk, seq in by_part[q].items():
            m, t = split_part(seq)
            if not {"part", "projected", "barrier", "chunks"} <= m.keys():
                continue
            cols["proj"].append(m["projected"] - m["part"] - t["store_wait"])
            for k, v in t.items():
                cols[k].append(v)
            cols["bwait"].append(m["barrier"] - m["projected"])
            cols["chunks"].append(m["chunks"] - m["barrier"])
            cols["start"].append(m["part"])
            cols["end"].append(m["chunks"])
        with_tile = [c for c in cols["chunks"] if c > 0]
        parts.append({
            "part": q, "wave": part_wave[q], "span_us": (max(cols["end"]) - min(cols["start"])) / 1e3,
            "proj_us": mean(cols["proj"]) / 1e3, "proj_max_us": max(cols["proj"]) / 1e3,
            "copy_wait_us": mean(cols["copy_wait"]) / 1e3, "issue_us": mean(cols["issue"]) / 1e3,
            "stats_us": mean(cols["stats"]) / 1e3,
            "project_us": mean(cols["project"]) / 1e3,
            "store_wait_us": mean(cols["store_wait"]) / 1e3, "barrier_wait_us": mean(cols["bwait"]) / 1e3,
            "barrier_wait_min_us": min(cols["bwait"]) / 1e3, "chunks_us": mean(with_tile) / 1e3,
            "chunks_max_us": max(cols["chunks"]) / 1e3,
        })
    waves = []
    for w in sorted(by_wave):
        ms = by_wave[w]
        start = min(m["wave"] for m in ms.values() if "wave" in m)
        end = max(m["wave_end"] for m in ms.values() if "wave_end" in m)
        last_chunks = {}
        for q, blocks in by_part.items():
            if part_wave[q] == w:
                for blk, seq in blocks.items():
                    for name, ns in seq:
                        if name == "chunks":
                            last_chunks[blk] = max(last_chunks.get(blk, 0), ns)
        epi = [m["wave_end"] - last_chunks[blk] for blk, m in ms.items() if blk in last_chunks and "wave_end" in m]
        prev = by_wave.get(w - 1, {})
        gap = [m["wave"] - prev[blk]["wave_end"] for blk, m in ms.items()
               if "wave" in m and blk in prev and "wave_end" in prev[blk]]
        wp = [p for p in parts if p["wave"] == w]
        row = {"wave": w, "parts": len(wp), "span_us": (end - start) / 1e3}
        for k in PART_STEPS:
            row[k] = sum(p[k] for p in wp)
        row.update({"epilogue_us": mean(epi) / 1e3, "epilogue_max_us": (max(epi) if epi else 0) / 1e3,
                    "gap_us": mean(gap) / 1e3})
        waves.append(row)
    span = (max(r[4] for r in recs) - t0) / 1e3
    times = sorted(r[4] for r in recs)
    diffs = sorted({b - a for a, b in zip(times, times[1:]) if b > a})
    totals = {k: sum(w[k] for w in waves) for k in PART_STEPS + WAVE_TAIL}
    return {"span_us": span, "parts": len(parts), "waves": len(waves), "timer_step_ns": diffs[0] if diffs else 0,
            "totals": totals}, parts, waves


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["1,1024,256,64,32,128"])
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--env", default="", help="VAR=VALUE,... set for the traced calls")
    ap.add_argument("--cap", type=int, default=8192)
    args = ap.parse_args()
    os.environ.update({"FLASHOPM_WAVES": "1", "FLASHOPM_WAVES_TRACE": str(args.cap)})
    if args.env:
        os.environ.update(dict(item.split("=", 1) for item in args.env.split(",")))
    flashopm.load()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; env {args.env or '-'}")
    result = {}
    for text in args.shapes:
        sh = Shape(*map(int, text.split(",")))
        x, m, p = make_problem(sh, "masked_positions", seed=1)
        model = flashopm.ModelNew(sh.C, sh.D, sh.H).cuda()
        x, m = x.cuda(), m.cuda()
        with torch.no_grad():
            for _ in range(args.calls):
                model(x, m)
        torch.cuda.synchronize()
        recs = records(torch.ops.flashopm._waves_trace(x))
        if not recs:
            print(f"{text}: no trace (the waves form did not run)")
            continue
        summary, parts, waves = summarise(recs)
        result[text] = {"summary": summary, "waves": waves}
        tot = summary["totals"]
        print(f"{text}: kernel {summary['span_us']:.1f} us, {summary['waves']} waves, {summary['parts']} parts, "
              f"timer step {summary['timer_step_ns']} ns; sums over waves of block means (us): " +
              ", ".join(f"{k[:-3]} {v:.1f}" for k, v in tot.items()))
        print("  wave parts   span   proj  copyw  issue  stats  projt  swait  bwait chunks   epi  epi_max   gap")
        for w in waves:
            print(f"  {w['wave']:4d} {w['parts']:5d} {w['span_us']:6.1f} " + " ".join(
                f"{w[k]:6.1f}" for k in PART_STEPS + ("epilogue_us", "epilogue_max_us", "gap_us")))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            tag = text.replace(",", "_")
            with open(os.path.join(args.out, f"parts_{tag}.csv"), "w", newline="") as fh:
                wr = csv.DictWriter(fh, fieldnames=list(parts[0]))
                wr.writeheader()
                wr.writerows(parts)
    if args.out:
        with open(os.path.join(args.out, "summary.json"), "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
