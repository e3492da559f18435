"""Counterexample reports: a readable step table and a timeline picture.

The picture is a PNG written with the standard library only (zlib): a row per
request, steps along x, each cell colored by what the request was doing in that
step; a KV-usage strip runs below.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from spec.interface import RequestStatus, ScheduleKind
from harness.driver import Failure, StepRecord

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


def timeline_png(records: list[StepRecord], path: str | Path, cell: int = 12) -> None:
    order, grid, usage = _cell_states(records)
    steps = max(len(records), 1)
    rows = max(len(order), 1)
    strip = 4 * cell
    width = steps * cell
    height = rows * cell + cell + strip
    white = COLORS["absent"]
    pixels = [[white] * width for _ in range(height)]
    for x, col in enumerate(grid):
        for y, state in enumerate(col):
            color = COLORS[state]
            for dy in range(1, cell):
                row = pixels[y * cell + dy]
                for dx in range(1, cell):
                    row[x * cell + dx] = color
        top = rows * cell + cell
        filled = int(round(usage[x] * strip))
        for dy in range(strip):
            color = COLORS["usage"] if dy >= strip - filled else COLORS["grid"]
            row = pixels[top + dy]
            for dx in range(1, cell):
                row[x * cell + dx] = color
    Path(path).write_bytes(_png(width, height, pixels))


def legend() -> str:
    return ("timeline.png: a row per request (in order of appearance), a column per step; "
            "grey waiting, blue prefill chunk, green decode, red preempted, black finished; "
            "the yellow strip below is KV-pool usage.")
