"""Summarise `ncu --page source --print-source sass --csv` of one kernel: stall samples and
executed instructions per stretch of SASS between block barriers (BAR.SYNC) and the wait for the
prerequisite grid (ACQBULK), i.e. per phase of the kernel, then the instructions with the most
samples.

    python scripts/ncu_source_summary.py SOURCE.csv
"""
import collections
import csv
import io
import sys


def column(header, *words):
    """Index of the first column whose name contains every word (case-insensitive), or None."""
    for i, name in enumerate(header):
        if all(w.lower() in name.lower() for w in words):
            return i
    return None


def number(text):
    try:
        return float(text.replace(",", "")) if text.strip() else 0.0
    except ValueError:
        return 0.0


def main() -> int:
    lines = open(sys.argv[1], encoding="utf-8", errors="replace").read().splitlines()
    start = next((k for k, line in enumerate(lines) if '"Source"' in line), None)
    if start is None:
        print("no CSV header with a Source column; first lines:", *lines[:10], sep="\n")
        return 1
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, rows = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    src = column(header, "source")
    addr = column(header, "address")
    samples = column(header, "sampling", "all") or column(header, "sampling")
    executed = column(header, "instructions executed") or column(header, "executed")
    if src is None or samples is None:
        print("columns not found; header:", header)
        return 1
    total = sum(number(r[samples]) for r in rows) or 1.0
    segments, current = [], None
    for r in rows:
        text = r[src].strip()
        if current is None or "BAR.SYNC" in text or "ACQBULK" in text:
            current = {"first": r[addr] if addr is not None else "", "boundary": ("wait" if "ACQBULK" in text else "barrier") if current else "start",
                       "n": 0, "samples": 0.0, "executed": 0.0, "ops": collections.Counter()}
            segments.append(current)
        s = number(r[samples])
        current["n"] += 1
        current["samples"] += s
        current["executed"] += number(r[executed]) if executed is not None else 0.0
        op = text.split(" ")[0]
        if op.startswith("@"):
            op = text.split(" ")[1] if len(text.split(" ")) > 1 else op
        current["ops"][op] += s
    print(f"{len(rows)} instructions, {total:.0f} stall samples; columns: samples = {header[samples]!r}"
          + (f", executed = {header[executed]!r}" if executed is not None else ""))
    print("segment  starts at           after  instrs  samples      %  warp instrs executed  top opcodes by samples")
    for k, seg in enumerate(segments):
        top = ", ".join(f"{op} {v / total:.1%}" for op, v in seg["ops"].most_common(4) if v > 0)
        print(f"{k:7d}  {seg['first']:>16}  {seg['boundary']:>7}  {seg['n']:6d}  {seg['samples']:7.0f}  "
              f"{seg['samples'] / total:5.1%}  {seg['executed']:20.0f}  {top}")
    print("\ninstructions with the most samples:")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[:25]:
        extra = "  ".join(f"{h}={v}" for h, v in zip(header, r) if h not in (header[src],) and v.strip())[:200]
        print(f"{number(r[samples]) / total:6.2%}  {r[src].strip()[:60]:60s}  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
