"""Counterexample reports: a readable step table and a timeline picture.

The picture is a PNG written with the standard library only (zlib): a row per
request, steps along x, each cell colored by what the request was doing in that
step; a KV-usage strip runs below.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from schedspec.spec.interface import RequestStatus, ScheduleKind
from schedspec.check.driver import Failure, StepRecord

# state -> RGB
COLORS: dict[str, tuple[int, int, int]] = {
    "absent": (255, 255, 255),
    "waiting": (210, 210, 210),
    "prefill": (66, 133, 244),
    "decode": (52, 168, 83),
    "preempted": (234, 67, 53),
    "finished": (60, 60, 60),
    "usage": (251, 188, 5),
    "grid": (240, 240, 240),
}


def step_table(records: list[StepRecord], failure: Failure | None = None) -> str:
    lines = [
        f"{'step':>4}  {'free':>4}  scheduled (request:kind computed+n)          preempted  finished",
        "-" * 88,
    ]
    for rec in records:
        parts = []
        for s in rec.plan.scheduled:
            kind = {ScheduleKind.NEW: "new", ScheduleKind.RESUMED: "res", ScheduleKind.RUNNING: "run"}[s.kind]
            tag = "" if s.samples else " chunk"
            parts.append(f"{s.request_id}:{kind} {s.num_computed_tokens}+{s.num_scheduled_tokens}{tag}")
        sched = ", ".join(parts) or "-"
        lines.append(
            f"{rec.step:>4}  {rec.view_after.kv.num_free_blocks:>4}  {sched:<42} "
            f"{','.join(rec.plan.preempted_ids) or '-':<10} {','.join(rec.plan.finished_ids) or '-'}"
        )
    if failure is not None:
        lines.append("-" * 88)
        lines.append(failure.describe())
    return "\n".join(lines) + "\n"


def _cell_states(records: list[StepRecord]) -> tuple[list[str], list[list[str]], list[float]]:
    order: list[str] = []
    for rec in records:
        for rid in list(rec.view_after.requests) + list(rec.view_after.finished) + list(rec.plan.scheduled_ids):
            if rid not in order:
                order.append(rid)
    grid: list[list[str]] = []
    usage: list[float] = []
    done: set[str] = set()
    for rec in records:
        col: list[str] = []
        planned = {s.request_id: s for s in rec.plan.scheduled}
        for rid in order:
            if rid in planned:
                entry = planned[rid]
                col.append("prefill" if entry.num_scheduled_tokens > 1 or entry.is_prefill_chunk else "decode")
            elif rid in rec.plan.preempted_ids:
                col.append("preempted")
            elif rid in rec.view_after.requests:
                st = rec.view_after.requests[rid].status
                col.append("preempted" if st == RequestStatus.PREEMPTED else "waiting" if st == RequestStatus.WAITING else "decode")
            elif rid in rec.view_after.finished or rid in done:
                done.add(rid)
                col.append("finished")
            else:
                col.append("absent")
        grid.append(col)
        kv = rec.view_after.kv
        usable = max(kv.num_blocks - 1, 1)
        usage.append(1.0 - kv.num_free_blocks / usable)
    return order, grid, usage


def _png(width: int, height: int, pixels: list[list[tuple[int, int, int]]]) -> bytes:
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


# A 3x5 bitmap font for row labels (request ids) and step numbers.
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "a": "010101111101101", "b": "110101110101110",
    "c": "011100100100011", "d": "110101101101110", "e": "111100110100111", "f": "111100110100100",
    "g": "011100101101011", "h": "101101111101101", "i": "111010010010111", "j": "001001001101010",
    "k": "101101110101101", "l": "100100100100111", "m": "101111111101101", "n": "110101101101101",
    "o": "010101101101010", "p": "110101110100100", "q": "010101101110011", "r": "110101110101101",
    "s": "011100010001110", "t": "111010010010010", "u": "101101101101111", "v": "101101101101010",
    "w": "101101111111101", "x": "101101010101101", "y": "101101010010010", "z": "111001010100111",
    "-": "000000111000000", "_": "000000000000111", ":": "000010000010000", ".": "000000000000010",
}


def _text(pixels: list[list[tuple[int, int, int]]], x: int, y: int, text: str, scale: int = 2) -> None:
    color = (40, 40, 40)
    for ch in text.lower():
        glyph = _GLYPHS.get(ch)
        if glyph is not None:
            for i, bit in enumerate(glyph):
                if bit == "1":
                    gx, gy = x + (i % 3) * scale, y + (i // 3) * scale
                    for dy in range(scale):
                        for dx in range(scale):
                            if 0 <= gy + dy < len(pixels) and 0 <= gx + dx < len(pixels[0]):
                                pixels[gy + dy][gx + dx] = color
        x += 4 * scale


def timeline_png(records: list[StepRecord], path: str | Path, cell: int = 16, failed_step: int | None = None) -> None:
    """Write the timeline picture; ``failed_step`` gets a red marker above its column."""
    order, grid, usage = _cell_states(records)
    steps = max(len(records), 1)
    rows = max(len(order), 1)
    label_w = 8 * max((len(r) for r in order), default=1) + 8
    top_band = cell  # step numbers and the failure marker
    strip = 4 * cell
    width = label_w + steps * cell
    height = top_band + rows * cell + cell + strip
    white = COLORS["absent"]
    pixels = [[white] * width for _ in range(height)]
    for y, rid in enumerate(order):
        _text(pixels, 2, top_band + y * cell + (cell - 10) // 2, rid)
    for x, rec in enumerate(records):
        x0 = label_w + x * cell
        if rec.step == failed_step:
            for dy in range(2, top_band - 2):
                for dx in range(1, cell):
                    pixels[dy][x0 + dx] = COLORS["preempted"]
        elif x % 5 == 0 or x == len(records) - 1:
            _text(pixels, x0 + 2, 2, str(rec.step)[-2:], scale=1)
    for x, col in enumerate(grid):
        x0 = label_w + x * cell
        for y, state in enumerate(col):
            color = COLORS[state]
            for dy in range(1, cell):
                row = pixels[top_band + y * cell + dy]
                for dx in range(1, cell):
                    row[x0 + dx] = color
        base = top_band + rows * cell + cell
        filled = int(round(usage[x] * strip))
        for dy in range(strip):
            color = COLORS["usage"] if dy >= strip - filled else COLORS["grid"]
            row = pixels[base + dy]
            for dx in range(1, cell):
                row[x0 + dx] = color
    _text(pixels, 2, top_band + rows * cell + cell + strip // 2 - 5, "kv")
    Path(path).write_bytes(_png(width, height, pixels))


def legend() -> str:
    return ("timeline.png: a row per request (in order of appearance), a column per step; "
            "grey waiting, blue prefill chunk, green decode, red preempted, black finished; "
            "the yellow strip below is KV-pool usage; a red mark above a column is the failing step.")
