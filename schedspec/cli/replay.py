"""``schedspec replay``: replay traces against a scheduler, repeating the
check each trace records (lockstep with the spec and every invariant, for a
trace that records none); ``--mode`` and ``--invariants`` choose another.

One trace prints its step table when it fails (or with ``--table``) and a
result line. Several traces, or a directory (searched recursively for
``*.jsonl``, e.g. the vectors/ corpus), print one result line per trace and a
total; the exit status is 1 when any trace fails. Every trace is read and
validated before any is replayed: a malformed one is a usage error (2) naming
its file, line and field.

``--gates`` names the admission gates to replay (default all: every gate the
scheduler declares; naming one it lacks is a usage error): a trace that uses
a gate outside them is skipped, with a line saying so, when several are
replayed (a corpus with gated traces replays against a scheduler without the
gates), and refused (2) when it is the one trace named. ``--kv`` does the
same for the KV features (the header's ``kv``: the connector, hybrid groups).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from schedspec.check import report
from schedspec.check import trace as tracefile
from schedspec.check.records import Failure, StepRecord
from schedspec.check.recorded import compare_plans, recorded_plans
from schedspec.check.capabilities import Capabilities, CapabilityError
from schedspec.check.deadline import guarded
from schedspec.check.defects import describe, failure_reports, known_defect
from schedspec.check.gate import selection_of_trace
from schedspec.check.run import run_workload
from schedspec.check.features import parse_gates, parse_kv
from schedspec.engine import replay as engine_replay
from schedspec.engine.env import EngineEnvError
from schedspec.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    UsageError,
    add_call_timeout_argument,
    add_mode_arguments,
    call_timeout_of,
    check_factories,
    with_stats_factories,
    print_table,
    rich_console,
)
from schedspec.invariants import Mode, Selection
from schedspec.spec.interface import ScheduleKind, SchedulerFactory, StepPlan


def add_arguments(r: argparse.ArgumentParser) -> None:
    r.add_argument("trace", nargs="+", help="trace files (.jsonl), or directories holding them")
    r.add_argument("--against", default="spec",
                   help="spec | impl | vllm | vllm-0.32 | MODULE:CLASS (default spec); vllm-0.32: the scheduler "
                        "of the engine's environment, the vLLM a captured trace was recorded on (docs/engine.md)")
    r.add_argument("--table", action="store_true", help="print the step table even when everything held")
    r.add_argument("--gates", default="all", metavar="lora,grammar,pause,watermark,cadence,encoder|all|none",
                   help="replay only the traces whose admission gates (the header's gates) are among these "
                        "(default all: those the scheduler supports); the others are skipped")
    r.add_argument("--kv", default="all", metavar="connector,hybrid|all|none",
                   help="replay only the traces whose KV features (the header's kv) are among these "
                        "(default all: those the scheduler supports); the others are skipped")
    add_mode_arguments(r, " (default: the check the trace records)")
    add_call_timeout_argument(r)
    r.add_argument("--stats", action="store_true",
                   help="build the schedulers with log_stats and compare their statistics (as check --stats)")


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


def _held(name: str, selection: Selection) -> str:
    n = len(selection.invariants)
    what = f"{n} invariant{'s' if n != 1 else ''} held ({selection.effective_selector})"
    if selection.compares and name != "spec":
        what += ", plans and views equal to the spec"
    elif selection.compares:
        what += " (the spec against itself: no comparison)"
    else:
        what += "; invariants mode: no comparison with the spec"
    if selection.skipped:
        what += "; skipped, unsupported: " + ", ".join(i for i, _ in selection.skipped)
    return what


def _in_its_mode(path: Path, trace: tracefile.Trace, against: str, caps: Capabilities) -> tracefile.Trace:
    """``trace`` in the one scheduling mode a scheduler supports when that is
    all it lacks (a vLLM AsyncScheduler subclass schedules only
    asynchronously, a Scheduler subclass only synchronously): its workload
    restricted as ``check`` draws one (the events kept within the mode's
    protocol, steered around the documented vLLM defects), with a line
    saying so; ``trace`` itself otherwise."""
    problems = caps.workload_problems(trace.workload)
    if problems not in (["async_scheduling=False"], ["async_scheduling=True"]):
        return trace
    workload = caps.restrict_workload(trace.workload)
    mode = "asynchronously" if workload.config.async_scheduling else "synchronously"
    print(f"NOTE {path}: {against} schedules only {mode}: replayed in that mode "
          f"(the trace's {problems[0]} turned, as check draws it)")
    return dataclasses.replace(trace, workload=workload)


def _selection(path: Path, trace: tracefile.Trace, args: argparse.Namespace, caps: Capabilities) -> Selection:
    """The check to repeat on ``trace``; exit 2 (CapabilityError) naming the
    trace when it uses what the scheduler does not support."""
    problems = caps.workload_problems(trace.workload)
    if problems:
        raise CapabilityError(f"replay {path}: --against {args.against} does not support what the trace uses: "
                              + ", ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    mode: Mode | None = args.mode
    return selection_of_trace(trace, mode, args.invariants, caps)


def _outside_gates(trace: tracefile.Trace, gates: tuple[str, ...]) -> list[str]:
    """The gates ``trace`` uses that are not among ``gates``."""
    return [g for g in trace.gates if g not in gates]


def run(args: argparse.Namespace) -> int:
    if args.against == engine_replay.AGAINST:
        try:
            return engine_replay.replay_in_engine(args.command_line)
        except EngineEnvError as exc:
            raise UsageError(f"--against {engine_replay.AGAINST}: {exc}") from None
    deadline = call_timeout_of(args)
    with guarded(deadline) as why:
        if why is not None:
            print(f"no deadline on the scheduler's calls: {why}", file=sys.stderr)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    text = getattr(args, "gates", "all")
    try:
        gates = parse_gates(text)
    except ValueError as exc:
        raise UsageError(f"--gates: {exc}") from None
    paths = trace_paths(args.trace)
    traces = [(path, tracefile.read(path)) for path in paths]  # every one valid before any runs
    target, _ = check_factories(args.against, "lockstep")
    have = target.capabilities.gates()
    if text.strip() == "all":
        gates = have
    elif [g for g in gates if g not in have]:
        raise UsageError(f"--gates: {args.against} does not support the gate(s) "
                         f"{', '.join(g for g in gates if g not in have)}")
    shown = text if text.strip() != "all" else ("all of " + args.against + "'s: " + (", ".join(have) or "none"))
    single = len(args.trace) == 1 and len(traces) == 1 and not Path(args.trace[0]).is_dir()
    kv_text = getattr(args, "kv", "all")
    try:
        kv = parse_kv(kv_text)
    except ValueError as exc:
        raise UsageError(f"--kv: {exc}") from None
    have_kv = target.capabilities.kv()
    if kv_text.strip() == "all":
        kv = have_kv
    elif [k for k in kv if k not in have_kv]:
        raise UsageError(f"--kv: {args.against} does not support the KV feature(s) "
                         f"{', '.join(k for k in kv if k not in have_kv)}")
    shown_kv = kv_text if kv_text.strip() != "all" else ("all of " + args.against + "'s: " + (", ".join(have_kv) or "none"))
    kept_kv = []
    for path, trace in traces:
        outside_kv = [k for k in trace.kv if k not in kv]
        if not outside_kv or (single and kv_text.strip() == "all"):
            kept_kv.append((path, trace))  # a lone trace outside the scheduler's is refused below, naming it
        elif single:
            raise UsageError(f"replay {path}: the trace uses the KV feature(s) {', '.join(outside_kv)}, "
                             f"outside --kv {shown_kv}")
        else:
            print(f"SKIPPED {path}: uses the KV feature(s) {', '.join(outside_kv)}, outside --kv {shown_kv}")
    if not kept_kv:
        print(f"replayed nothing: every trace uses a KV feature outside --kv {shown_kv}")
        return EXIT_OK
    traces = kept_kv
    kept = []
    for path, trace in traces:
        outside = _outside_gates(trace, gates)
        if not outside:
            kept.append((path, trace))
        elif single:
            if text.strip() == "all":
                kept.append((path, trace))  # refused below, naming what the scheduler lacks
                continue
            raise UsageError(f"replay {path}: the trace uses the gate(s) {', '.join(outside)}, outside --gates "
                             f"{shown}")
        else:
            print(f"SKIPPED {path}: uses the gate(s) {', '.join(outside)}, outside --gates {shown}")
    if not kept:
        print(f"replayed nothing: every trace uses a gate outside --gates {shown}")
        return EXIT_OK
    traces = kept
    plans: list[tuple[Path, tracefile.Trace, Selection, dict[str, SchedulerFactory]]] = []
    for path, trace in traces:
        trace = _in_its_mode(path, trace, args.against, target.capabilities)
        selection = _selection(path, trace, args, target.capabilities)
        _, factories = check_factories(args.against, selection.mode)
        if getattr(args, "stats", False):
            factories = with_stats_factories(factories, target)
        plans.append((path, trace, selection, factories))
    name = target.name
    if single:
        _, trace, selection, factories = plans[0]
        return _replay_one(trace, factories, name, args, selection)
    failed = 0
    for path, trace, selection, factories in plans:
        runner, failure = run_workload(trace.workload, factories, trace.vocab, trace.oracle_seed,
                                       keep_history=args.table or bool(recorded_plans(trace.events)),
                                       invariants=selection.invariants)
        if args.table:
            _show_table(runner.history or [], failure, title=str(path))
        verdict = _recorded_verdict(trace, runner.history or [], failure, runner.last_plan)
        if verdict is not None:
            ok, what = verdict
            print(f"{'OK     ' if ok else 'FAILED '} {path}: {what}")
            failed += not ok
            continue
        if failure is None:
            print(f"OK      {path}: {len(trace.events)} events ({runner.stats.steps} steps; {selection.mode}, "
                  f"{len(selection.invariants)} invariants)")
        else:
            failed += 1
            first = failure.message.splitlines()[0] if failure.message else ""
            print(f"FAILED  {path}: {failure.kind} at event {failure.event_index} (step {failure.step}) "
                  f"in {failure.scheduler}: {first}")
    if failed:
        print(f"FAILED: {failed} of {len(traces)} traces against {args.against}")
        return EXIT_FAIL
    held = sorted({_held(name, sel) for _, _, sel, _ in plans})
    print(f"OK: replayed {len(traces)} traces against {args.against}: {'; '.join(held)}")
    return EXIT_OK


def _replay_one(trace: tracefile.Trace, factories: dict[str, SchedulerFactory], name: str,
                args: argparse.Namespace, selection: Selection) -> int:
    runner, failure = run_workload(trace.workload, factories, trace.vocab, trace.oracle_seed, keep_history=True,
                                   invariants=selection.invariants)
    verdict = _recorded_verdict(trace, runner.history or [], failure, runner.last_plan)
    if verdict is not None:
        ok, what = verdict
        if args.table or not ok:
            _show_table(runner.history or [], failure)
        print(f"{'OK' if ok else 'FAILED'}: replayed {len(trace.events)} events against {args.against}: {what}")
        return EXIT_OK if ok else EXIT_FAIL
    if args.table or failure is not None:
        _show_table(runner.history or [], failure)
    if failure is None:
        print(f"OK: replayed {len(trace.events)} events ({runner.stats.steps} steps) against {args.against}: "
              + _held(name, selection))
        return EXIT_OK
    print(f"FAILED: {failure.kind} at event {failure.event_index} (step {failure.step})")
    if len(factories) > 1 and failure.scheduler == next(iter(factories)):
        # first seen in the reference: never the scheduler under test's
        defect = known_defect(trace.workload.config, trace.workload.events,
                              failure_reports(failure.kind, (v.invariant_id for v in failure.violations)))
        what = f"on a {describe(defect)}" if defect else "a bug of schedspec or a vLLM defect not yet written up"
        print(f"the reference (the spec) failed first, {what}: not a failure of {args.against}")
    return EXIT_FAIL


def _recorded_verdict(trace: tracefile.Trace, history: list[StepRecord], failure: Failure | None,
                      last_plan: StepPlan | None = None) -> tuple[bool, str] | None:
    """A captured trace (with the plans a recorded engine made, format 5)
    held to those plans (schedspec/check/recorded.py): (ok, what to print),
    or None for a trace without them or a failure before any difference
    (reported as for any trace). A documented vLLM 0.32 -> 0.33 difference
    is ok, and a failure at or after its step is its consequence."""
    if not recorded_plans(trace.events):
        return None
    compared, mismatch = compare_plans(trace.config, trace.events, history, last_plan)
    if mismatch is None:
        if failure is not None:
            return None
        return True, f"{compared} plans equal to the recorded engine's (vLLM 0.32), every invariant held"
    if failure is not None and failure.step < mismatch.step:
        return None
    then = f"; then, its consequence: {failure.kind} at step {failure.step}" if failure is not None else ""
    if mismatch.difference is not None:
        return True, f"{compared} plans equal to the recorded engine's, then {mismatch.describe()}{then}"
    return False, (f"{compared} plans equal to the recorded engine's (vLLM 0.32), then {mismatch.describe()} "
                   f"(not a documented 0.32 -> 0.33 difference: a bug of the scheduler, of vLLM 0.32, "
                   f"or a difference to document){then}")
