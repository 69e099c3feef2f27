"""A PNG chart of benchmark results, drawn without plotting libraries (none is assumed on GPU
machines): speedup over eager PyTorch and peak extra memory per shape, one bar per
implementation.  Pure Python: a pixel buffer, a 5×7 bitmap font, zlib for the PNG stream.
"""
from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

# 5×7 glyphs, one string of 7 rows per character ('#' = ink).  Text is drawn upper-case.
_FONT_ROWS = {
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "######....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "###..#..#.#...##...##...##..#.###..",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "J": "..###...#....#....#....#.#..#..##..",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#", "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##...##...##...##...#", "N": "#...##...###..##.#.##..###...##...#",
    "O": ".###.#...##...##...##...##...#.###.", "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".#####....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    ".": "..........................##...##..", ",": ".....................##....#...#...",
    ":": "......##...##........##...##.......", "(": "...#...#...#....#....#.....#.....#.",
    ")": ".#.....#.....#....#....#...#...#...", "-": "...............###.................",
    "_": "..............................#####", "%": "##...##..#...#...#...#...#..##...##",
    "/": ".........#...#...#...#...#.........", "=": "..........#####.....#####..........",
    "+": ".......#....#..#####..#....#.......", " ": "...................................",
    "[": ".###..#....#....#....#....#....###.", "]": ".###....#....#....#....#....#..###.",
}
_FONT = {ch: [rows[5 * r:5 * r + 5] for r in range(7)] for ch, rows in _FONT_ROWS.items()}

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


class Canvas:
    def __init__(self, width: int, height: int, background=(255, 255, 255)):
        self.w, self.h = width, height
        self.px = bytearray(bytes(background) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.w, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.h, max(y0, y1))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            i = 3 * (y * self.w + x0)
            self.px[i:i + len(row)] = row

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> int:
        """Draws s with its top-left at (x, y); returns the width drawn."""
        for k, ch in enumerate(s.upper()):
            glyph = _FONT.get(ch, _FONT[" "])
            for r, line in enumerate(glyph):
                for c, bit in enumerate(line):
                    if bit == "#":
                        gx, gy = x + k * 6 * scale + c * scale, y + r * scale
                        self.rect(gx, gy, gx + scale, gy + scale, color)
        return len(s) * 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _short(shape: dict) -> str:
    return f"N{shape['N']} S{shape['S']} B{shape['B']}"


def _panel(cv: Canvas, x0: int, y0: int, w: int, h: int, title: str, groups: list[str], impls: list[str],
           values: dict[tuple[str, str], float | None], log: bool, fmt: str, ref_line: float | None) -> None:
    cv.text(x0, y0, title, scale=2)
    top, bottom = y0 + 30, y0 + h - 40
    vals = [v for v in values.values() if v is not None and v > 0]
    if not vals:
        return
    vmax = max(vals) * (1.6 if log else 1.2)
    vmin = min(min(vals) / 1.5, 0.5) if log else 0.0

    def ypos(v: float) -> int:
        if log:
            f = (math.log10(v) - math.log10(vmin)) / (math.log10(vmax) - math.log10(vmin))
        else:
            f = v / vmax
        return int(bottom - f * (bottom - top))

    cv.rect(x0, bottom, x0 + w, bottom + 2, (0, 0, 0))
    if ref_line is not None and vmin < ref_line < vmax:
        y = ypos(ref_line)
        for x in range(x0, x0 + w, 8):
            cv.rect(x, y, x + 4, y + 1, (120, 120, 120))
    gw = w // max(1, len(groups))
    bw = max(4, (gw - 20) // max(1, len(impls)))
    for gi, g in enumerate(groups):
        gx = x0 + gi * gw + 10
        for ii, impl in enumerate(impls):
            v = values.get((g, impl))
            bx = gx + ii * bw
            if v is None or v <= 0:
                cv.text(bx + 2, bottom - 16, "-", scale=1)
                continue
            y = ypos(v)
            cv.rect(bx + 1, y, bx + bw - 1, bottom, PALETTE[ii % len(PALETTE)])
            label = fmt.format(v)
            cv.text(bx + max(0, (bw - len(label) * 6) // 2), y - 10, label, scale=1)
        cv.text(gx, bottom + 8, g, scale=1)


def render(results: dict, path: str | Path) -> Path:
    """Writes the chart of `results` (the benchmark's JSON: environment + results) to path."""
    rows = [r for r in results["results"] if r.get("status") == "ok"]
    env = results.get("environment", {})
    groups, impls = [], []
    for r in results["results"]:
        g = _short(r)
        if g not in groups:
            groups.append(g)
        if r["impl"] not in impls:
            impls.append(r["impl"])
    eager = {_short(r): r["wall_us"] for r in rows if r["impl"] == "eager"}
    speed = {(_short(r), r["impl"]): eager[_short(r)] / r["wall_us"] for r in rows if _short(r) in eager}
    mem = {(_short(r), r["impl"]): r["extra_over_output"] for r in rows}
    width = max(900, 60 + len(groups) * (40 + 44 * len(impls)))
    cv = Canvas(width, 760)
    cv.text(20, 12, f"flashopm: {env.get('gpu', '?')}, torch {env.get('torch', '?')}, {env.get('date', '')}, "
            f"{env.get('dtype', 'float32')}", scale=2)
    lx = 20
    for ii, impl in enumerate(impls):
        cv.rect(lx, 44, lx + 14, 58, PALETTE[ii % len(PALETTE)])
        lx += 40 + cv.text(lx + 20, 45, impl, scale=2)
    _panel(cv, 20, 80, width - 40, 330, "speedup over eager (wall time per call, x)", groups, impls, speed,
           log=True, fmt="{:.1f}", ref_line=1.0)
    _panel(cv, 20, 420, width - 40, 330, "peak extra memory / output size", groups, impls, mem,
           log=True, fmt="{:.2f}", ref_line=1.0)
    path = Path(path)
    path.write_bytes(cv.png())
    return path
