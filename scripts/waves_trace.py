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
         8: "wave_end"}


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
    by_part = defaultdict(lambda: defaultdict(dict))  # q -> block -> mark -> ns
    by_wave = defaultdict(lambda: defaultdict(dict))  # w -> block -> mark -> ns
    part_wave = {}
    for blk, mark, w, q, ns in recs:
        name = MARKS.get(mark, str(mark))
        if name in ("wave", "wave_end"):
            by_wave[w][blk][name] = ns - t0
        else:
            by_part[q][blk][name] = ns - t0
            part_wave[q] = w

    def mean(v):
        return sum(v) / len(v) if v else 0.0

    parts = []
    for q in sorted(by_part):
        proj, swait, bwait, chunks = [], [], [], []
        for blk, m in by_part[q].items():
            if not {"part", "projected", "barrier", "chunks"} <= m.keys():
                continue
            sw = m["store_go"] - m["store_wait"] if "store_go" in m else 0
            proj.append(m["projected"] - m["part"] - sw)
            swait.append(sw)
            bwait.append(m["barrier"] - m["projected"])
            chunks.append(m["chunks"] - m["barrier"])
        starts = [m["part"] for m in by_part[q].values() if "part" in m]
        ends = [m["chunks"] for m in by_part[q].values() if "chunks" in m]
        with_tile = [c for c in chunks if c > 0]
        parts.append({
            "part": q, "wave": part_wave[q], "span_us": (max(ends) - min(starts)) / 1e3,
            "proj_us": mean(proj) / 1e3, "proj_max_us": max(proj) / 1e3,
            "store_wait_us": mean(swait) / 1e3, "barrier_wait_us": mean(bwait) / 1e3,
            "barrier_wait_min_us": min(bwait) / 1e3, "chunks_us": mean(with_tile) / 1e3,
            "chunks_max_us": max(chunks) / 1e3,
        })
    waves = []
    for w in sorted(by_wave):
        ms = by_wave[w]
        start = min(m["wave"] for m in ms.values() if "wave" in m)
        end = max(m["wave_end"] for m in ms.values() if "wave_end" in m)
        last_chunks = {}
        for q, blocks in by_part.items():
            if part_wave[q] == w:
                for blk, m in blocks.items():
                    if "chunks" in m:
                        last_chunks[blk] = max(last_chunks.get(blk, 0), m["chunks"])
        epi = [m["wave_end"] - last_chunks[blk] for blk, m in ms.items() if blk in last_chunks and "wave_end" in m]
        prev = by_wave.get(w - 1, {})
        gap = [m["wave"] - prev[blk]["wave_end"] for blk, m in ms.items()
               if "wave" in m and blk in prev and "wave_end" in prev[blk]]
        wp = [p for p in parts if p["wave"] == w]
        waves.append({
            "wave": w, "parts": len(wp), "span_us": (end - start) / 1e3,
            "proj_us": sum(p["proj_us"] for p in wp), "store_wait_us": sum(p["store_wait_us"] for p in wp),
            "barrier_wait_us": sum(p["barrier_wait_us"] for p in wp), "chunks_us": sum(p["chunks_us"] for p in wp),
            "epilogue_us": mean(epi) / 1e3, "epilogue_max_us": (max(epi) if epi else 0) / 1e3,
            "gap_us": mean(gap) / 1e3,
        })
    span = (max(r[4] for r in recs) - t0) / 1e3
    diffs = sorted({b - a for a, b in zip(sorted(r[4] for r in recs), sorted(r[4] for r in recs)[1:]) if b > a})
    totals = {k: sum(w[k] for w in waves) for k in
              ("proj_us", "store_wait_us", "barrier_wait_us", "chunks_us", "epilogue_us", "gap_us")}
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
              f"timer step {summary['timer_step_ns']} ns; sums of block means: projection {tot['proj_us']:.1f}, "
              f"store wait {tot['store_wait_us']:.1f}, barrier wait {tot['barrier_wait_us']:.1f}, chunks "
              f"{tot['chunks_us']:.1f}, phase 2 + stores {tot['epilogue_us']:.1f}, between waves {tot['gap_us']:.1f} us")
        print("  wave parts   span   proj  swait  bwait chunks   epi  epi_max   gap")
        for w in waves:
            print(f"  {w['wave']:4d} {w['parts']:5d} {w['span_us']:6.1f} {w['proj_us']:6.1f} {w['store_wait_us']:6.1f} "
                  f"{w['barrier_wait_us']:6.1f} {w['chunks_us']:6.1f} {w['epilogue_us']:5.1f} {w['epilogue_max_us']:7.1f} "
                  f"{w['gap_us']:5.1f}")
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
