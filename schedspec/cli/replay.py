"""``schedspec replay``: replay traces against a scheduler, in lockstep with
the spec, every invariant on every step.

One trace prints its step table when it fails (or with ``--table``) and a
result line. Several traces, or a directory (searched recursively for
``*.jsonl``, e.g. the vectors/ corpus), print one result line per trace and a
total; the exit status is 1 when any trace fails. Every trace is read and
validated before any is replayed: a malformed one is a usage error (2) naming
its file, line and field.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from schedspec.check import report
from schedspec.check import trace as tracefile
from schedspec.check.driver import Failure, StepRecord
from schedspec.check.gate import run_workload
from schedspec.cli.common import EXIT_FAIL, EXIT_OK, UsageError, lockstep_factories, print_table, rich_console
from schedspec.spec.interface import ScheduleKind, SchedulerFactory


def add_arguments(r: argparse.ArgumentParser) -> None:
    r.add_argument("trace", nargs="+", help="trace files (.jsonl), or directories holding them")
    r.add_argument("--against", default="spec", help="spec | impl | vllm | MODULE:CLASS (default spec)")
    r.add_argument("--table", action="store_true", help="print the step table even when everything held")


def trace_paths(items: Sequence[str]) -> list[Path]:
    """The trace files named: a file as given, a directory as every ``*.jsonl``
    below it, sorted; UsageError for a directory that holds none."""
    out: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
            if not found:
                raise UsageError(f"replay: {item}: the directory holds no .jsonl traces")
            out.extend(found)
        else:
            out.append(path)  # a missing file is reported by the trace reader, naming it
    return out


_KINDS = {ScheduleKind.NEW: "new", ScheduleKind.RESUMED: "res", ScheduleKind.RUNNING: "run"}
_COLUMNS = (("step", ">"), ("free", ">"), ("scheduled (request:kind computed+n)", "<"),
            ("preempted", "<"), ("finished", "<"))


def _table_rows(records: list[StepRecord]) -> list[list[str]]:
    rows = []
    for rec in records:
        sched = ", ".join(
            f"{s.request_id}:{_KINDS[s.kind]} {s.num_computed_tokens}+{s.num_scheduled_tokens}"
            + ("" if s.samples else " chunk")
            for s in rec.plan.scheduled
        ) or "-"
        rows.append([str(rec.step), str(rec.view_after.kv.num_free_blocks), sched,
                     ",".join(rec.plan.preempted_ids) or "-", ",".join(rec.plan.finished_ids) or "-"])
    return rows


def _show_table(records: list[StepRecord], failure: Failure | None, title: str | None = None) -> None:
    """The step table (report.step_table's text when stdout is not a
    terminal), the failure described below it."""
    console = rich_console(sys.stdout)
    if console is None:
        print(report.step_table(records, failure), end="")
        return
    print_table(_COLUMNS, _table_rows(records), "", title=title)
    if failure is not None:
        print(failure.describe())


def _held(name: str) -> str:
    return "all invariants held" + ("" if name == "spec" else ", plans and views equal to the spec")


def run(args: argparse.Namespace) -> int:
    paths = trace_paths(args.trace)
    traces = [(path, tracefile.read(path)) for path in paths]  # every one valid before any runs
    name, factories = lockstep_factories(args.against)
    if len(args.trace) == 1 and len(traces) == 1 and not Path(args.trace[0]).is_dir():
        return _replay_one(traces[0][1], factories, name, args)
    failed = 0
    for path, trace in traces:
        runner, failure = run_workload(trace.workload, factories, trace.vocab, trace.oracle_seed,
                                       keep_history=args.table)
        if args.table:
            _show_table(runner.history or [], failure, title=str(path))
        if failure is None:
            print(f"OK      {path}: {len(trace.events)} events ({runner.stats.steps} steps)")
        else:
            failed += 1
            first = failure.message.splitlines()[0] if failure.message else ""
            print(f"FAILED  {path}: {failure.kind} at event {failure.event_index} (step {failure.step}) "
                  f"in {failure.scheduler}: {first}")
    if failed:
        print(f"FAILED: {failed} of {len(traces)} traces against {args.against}")
        return EXIT_FAIL
    print(f"OK: replayed {len(traces)} traces against {args.against}: {_held(name)}")
    return EXIT_OK


def _replay_one(trace: tracefile.Trace, factories: dict[str, SchedulerFactory], name: str,
                args: argparse.Namespace) -> int:
    runner, failure = run_workload(trace.workload, factories, trace.vocab, trace.oracle_seed, keep_history=True)
    if args.table or failure is not None:
        _show_table(runner.history or [], failure)
    if failure is None:
        print(f"OK: replayed {len(trace.events)} events ({runner.stats.steps} steps) against {args.against}: "
              + _held(name))
        return EXIT_OK
    print(f"FAILED: {failure.kind} at event {failure.event_index} (step {failure.step})")
    return EXIT_FAIL
