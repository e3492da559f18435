"""``schedspec bench``: scheduler speed side by side (the benchmark is
schedspec.bench.scheduler.run_bench); the table goes through rich on a
terminal and is the plain fixed-width table everywhere else."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from schedspec.adapters.registry import resolve
from schedspec.bench.scheduler import (
    PLAIN,
    TABLE_COLUMNS,
    format_table,
    not_run_notes,
    parse_kv_layouts,
    parse_modes,
    ratio_columns,
    ratio_names,
    run_bench,
    table_cells,
)
from schedspec.cli.common import EXIT_OK, StatusLine, UsageError, print_table
from schedspec.spec.interface import SchedulerFactory

PROG = "schedspec bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--against", default="impl,spec,vllm", help="comma-separated: impl, spec, vllm, MODULE:CLASS")
    p.add_argument("--running", default="256,1024,4096", help="decode batch sizes (comma-separated)")
    p.add_argument(
        "--modes",
        default="sync,async,sync+spec3,async+spec3",
        help="comma-separated: sync, async, sync+specK, async+specK (K speculative tokens, 1-8), sync+ppK "
             "(K = 2-4 plans in flight); "
        "every workload runs in each",
    )
    p.add_argument(
        "--kv",
        default="plain",
        help="comma-separated KV layouts: plain, connector (a KV connector), hybrid (full attention + "
        "sliding window), chunked (full attention + chunked local attention), hybrid-mamba (full attention + "
        "a Mamba group), all; every workload runs "
        "in each (default plain); with another layout the table adds the first scheduler's CPU-median "
        "ratio against each other one",
    )
    p.add_argument("--repeat", type=int, default=1,
                   help="run every cell this many times, the schedulers of a cell back to back in each "
                   "round; rows report the median of the runs' medians (default 1)")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per cell (default 200)")
    p.add_argument("--mixed-steps", type=int, default=400, help="steps of the mixed trace (0: skip)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="time cap per decode cell (at least 5 steps)")
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc memory pass")
    p.add_argument("--memory-waiting", type=int, default=10_000)
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--quick", action="store_true", help="tiny sizes, a few steps (for tests)")
    p.add_argument("--kv-events", action="store_true",
                   help="KV cache events on in every cell, taken after every update (schedspec/bench/outputs.py)")
    p.add_argument("--stats", action="store_true",
                   help="every scheduler built with log_stats, make_stats() after every update")


def resolve_factories(names: Sequence[str], *, skip_missing: bool = True) -> tuple[dict[str, SchedulerFactory], list[str]]:
    """Factories for scheduler names (through the adapter registry); vLLM is
    skipped, with a note, when it cannot be imported and ``skip_missing`` is set."""
    out: dict[str, SchedulerFactory] = {}
    notes: list[str] = []
    for name in names:
        target = resolve(name)
        if name == "vllm":
            try:
                import vllm  # noqa: F401
                import schedspec.adapters.vllm_adapter  # noqa: F401
            except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
                if not skip_missing:
                    raise
                notes.append(f"vllm skipped: {type(exc).__name__}: {exc}")
                continue
        out[name] = target.factory
    return out, notes


def run(args: argparse.Namespace) -> int:
    try:
        running = tuple(int(x) for x in args.running.split(",") if x.strip())
        if not running or min(running) <= 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--running: expected positive integers, got {args.running!r}", PROG) from None
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        raise UsageError(f"--modes: {exc}", PROG) from None
    try:
        layouts = parse_kv_layouts(args.kv)
    except ValueError as exc:
        raise UsageError(f"--kv: {exc}", PROG) from None
    if args.repeat < 1:
        raise UsageError(f"--repeat: expected a positive integer, got {args.repeat}", PROG)
    names = [x.strip() for x in args.against.split(",") if x.strip()]
    try:
        factories, notes = resolve_factories(names)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"--against: {exc}", PROG) from None
    if not factories:
        raise UsageError("--against: no scheduler available", PROG)
    for note in notes:
        print(note, file=sys.stderr)
    if getattr(args, "kv_events", False) or getattr(args, "stats", False):
        from schedspec.bench.outputs import with_outputs

        factories = with_outputs(factories, getattr(args, "kv_events", False), getattr(args, "stats", False))
        print("outputs: " + " and ".join(w for f, w in (("kv_events", "KV cache events taken"),
                                                       ("stats", "statistics made")) if getattr(args, f, False))
              + " after every update, in the timed step (vLLM's inside update_from_output)")
    if args.quick:
        rows = run_bench(
            factories,
            running=tuple(dict.fromkeys(min(r, 32) for r in running[:2])),  # each size once
            steps=5,
            json_path=args.json,
            mixed_steps=20,
            max_seconds=2.0,
            memory=False,
            modes=modes,
            layouts=layouts,
            repeat=args.repeat,
        )
    else:
        status = StatusLine()
        try:
            rows = run_bench(
                factories,
                running=running,
                steps=args.steps,
                json_path=args.json,
                mixed_steps=args.mixed_steps,
                max_seconds=args.max_seconds,
                memory=not args.no_memory,
                memory_waiting=args.memory_waiting,
                progress=status,
                modes=modes,
                layouts=layouts,
                repeat=args.repeat,
            )
        finally:
            status.close()
    ratios = layouts != (PLAIN,)
    first, others = ratio_names(rows) if ratios else ("", [])
    columns = TABLE_COLUMNS + ratio_columns(others, first)
    print_table([(name, align) for name, _, align in columns], table_cells(rows, others),
                format_table(rows, ratios=ratios))
    for note in not_run_notes(rows):
        print(f"not run: {note}")
    return EXIT_OK
