"""``schedspec check``: random workloads in lockstep with the spec, every
invariant on every step; or, with ``--mode invariants``, the scheduler alone
under the chosen invariants (the loop is schedspec.check.gate.run_check)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from schedspec.check.deadline import interruptible
from schedspec.check.gate import (
    replay_command,
    CheckSettings,
    check_summary,
    counterexample_line,
    interrupted_message,
    known_defect_line,
    junit_xml,
    missing_rules_message,
    reference_line,
    run_check,
)
from schedspec.check.rule_reach import rules_line as capability_rules_line
from schedspec.invariants import Selection
from schedspec.check.kv_requests import mamba_rate
from schedspec.check.capabilities import CapabilityError
from schedspec.check.outputs import outputs_line
from schedspec.check.features import parse_engine, parse_gates, parse_kv, parse_modes
from schedspec.spec.coverage import format_table, parse_required
from schedspec.spec.effects import effects_line, effects_table
from schedspec.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    Progress,
    UsageError,
    add_call_timeout_argument,
    add_mode_arguments,
    call_timeout_of,
    check_factories,
    check_output_dir,
    check_output_file,
    mode_of,
    parse_shard,
    positive_int,
)


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--against", default="spec", help="spec | impl | vllm | MODULE:CLASS (default spec)")
    c.add_argument("--steps", default=None, help="total steps to check (default 2000)")
    c.add_argument("--time", default=None, type=float, help="check for this many seconds instead")
    c.add_argument("--seed", default=0, type=int, help="first workload seed (default 0)")
    c.add_argument("--shard", default=None, help="K/N: this job takes seeds seed+K-1, seed+K-1+N, ...")
    c.add_argument("--out", default="schedspec-out", help="where counterexamples go (default schedspec-out/)")
    c.add_argument("--json", default=None, help="write a JSON summary here")
    c.add_argument("--junit", default=None, help="write JUnit XML here")
    c.add_argument("--workload-steps", default=100, type=int, help="steps per generated workload (default 100)")
    c.add_argument("--vocab", default=64, type=int, help="fake model vocabulary (default 64)")
    c.add_argument("--shrink-time", default=60.0, type=float, help="seconds to spend shrinking (default 60)")
    c.add_argument("--quiet", action="store_true", help="no progress line")
    c.add_argument("--plans-only", action="store_true",
                   help="fast lockstep: plans every step, views once per workload, no invariants")
    add_mode_arguments(c)
    c.add_argument("--require-rules", default=None, metavar="all|NAME,...",
                   help="fail (exit 1) when one of these spec rules (spec/rule_names.py; a group such as "
                        "'kv' names all its rules) was never reached")
    c.add_argument("--rules", action="store_true", help="print the rule-coverage table (every rule, its count)")
    c.add_argument("--stats", action="store_true",
                   help="build every scheduler with log_stats and compare the scheduler statistics "
                        "(make_stats) after every update, under the invariants of invariants/stats.py, in every "
                        "workload (default: in a share of them, where the scheduler declares Capabilities.stats)")
    c.add_argument("--no-stats", action="store_true", help="no scheduler statistics in any workload")
    c.add_argument("--generator", default="guided", choices=("guided", "random"),
                   help="guided (default): swarm workloads aimed at the rules reached least so far; "
                        "random: the plain seeded workloads")
    c.add_argument("--modes", default="all", metavar="sync,async,spec,async-spec|all",
                   help="the modes the workloads run in, each drawn per workload (default all: those "
                        "of the four the scheduler under test supports)")
    c.add_argument("--gates", default="all", metavar="lora,grammar,pause,watermark,cadence,encoder|all|none",
                   help="the admission gates the workloads may turn on, a subset drawn per workload (default "
                        "all: every gate the scheduler under test supports; none: no gate)")
    c.add_argument("--kv", default="all", metavar="connector,hybrid|all|none",
                   help="the KV features the workloads may turn on (the KV connector: external prefix loads, "
                        "async loads and saves, the worker's reports; hybrid KV cache groups), a subset drawn per "
                        "workload (default all: every one the scheduler under test supports; none: neither)")
    c.add_argument("--kv-events", action="store_true",
                   help="turn the KV cache events on in every workload (vLLM's KVEventsConfig."
                        "enable_kv_cache_events) and compare every scheduler's stream once per step (default: "
                        "on in a share of the workloads, where the scheduler declares Capabilities.kv_events)")
    c.add_argument("--no-kv-events", action="store_true", help="no KV cache events in any workload")
    c.add_argument("--events", default=None, metavar="FILE",
                   help="write the reference's KV cache event stream to FILE as JSON lines (implies --kv-events)")
    c.add_argument("--engine", default="all", metavar="sessions,pipeline,runner,drafter|all|none",
                   help="the engine features the guided workloads may turn on, in a share of them: streaming-input "
                        "sessions, a pipeline of k plans in flight, Model Runner V2, a drafter with its own forward "
                        "pass (draft model, EAGLE) (default all: every one the scheduler under test supports)")
    c.add_argument("--sessions", action="store_true",
                   help="every workload random, with streaming-input sessions: resumable requests sent chunks and "
                        "ends between steps (docs/spec.md, Sessions); the scheduler needs session_update()")
    c.add_argument("--pipeline", action="store_true",
                   help="every workload random, with pipeline_parallel_size drawn 1..4: up to k plans in flight "
                        "(docs/spec.md, In flight)")
    c.add_argument("--runner", action="store_true",
                   help="every workload random, with Model Runner V1 or V2, pipeline_parallel_size 1..4 and the "
                        "drafter drawn (docs/spec.md, Model Runner V2)")
    add_call_timeout_argument(c)
    c.add_argument("--strict-defects", action="store_true",
                   help="a workload on which the reference meets a documented vLLM 0.33 defect "
                        "(docs/divergences.md) fails the run (default: named, counted apart, and the run goes on)")
    c.add_argument("--coverage", nargs="?", const="", default=None, metavar="PATH",
                   help="fidelity report: the lines and functions of vLLM's scheduler the run reached, "
                        "printed and written as JSON to PATH (default OUT/fidelity.json)")


def settings_from(args: argparse.Namespace) -> CheckSettings:
    """The flags as CheckSettings; UsageError naming the flag on bad values."""
    if args.steps is not None and args.time is not None:
        raise UsageError("--steps and --time: give one of them")
    total_steps = positive_int("--steps", args.steps) if args.steps is not None else None
    time_budget = float(args.time) if args.time is not None else None
    if time_budget is not None and time_budget <= 0:
        raise UsageError(f"--time: must be positive, got {args.time}")
    mode = mode_of(args)
    if args.plans_only and mode == "invariants":
        raise UsageError("--plans-only compares plans with the spec: it is a lockstep option, not one of "
                         "--mode invariants")
    if args.plans_only and args.invariants is not None:
        raise UsageError("--plans-only checks no invariants: drop --invariants or --plans-only")
    modes = _modes(args.modes)
    gates = parse_gates_flag(args.gates)
    kv = parse_kv_flag(getattr(args, "kv", "all"))
    engine = parse_engine_flag(getattr(args, "engine", "all"))
    return CheckSettings(
        mode=mode,
        invariants=args.invariants,
        against=args.against,
        total_steps=total_steps,
        time_budget=time_budget,
        seed=args.seed,
        shard=parse_shard(args.shard) if args.shard else (1, 1),
        workload_steps=positive_int("--workload-steps", str(args.workload_steps)),
        vocab=args.vocab,
        shrink_time=args.shrink_time,
        plans_only=args.plans_only,
        out_dir=Path(args.out),
        require_rules=_required_rules(args.require_rules),
        require_all=args.require_rules is not None and "all" in [p.strip() for p in args.require_rules.split(",")],
        generator=args.generator,
        modes=modes,
        gates=gates,
        kv=kv,
        engine=engine,
        call_timeout=call_timeout_of(args),
        strict_defects=getattr(args, "strict_defects", False),
        kv_events=_output_flag(args, "kv_events", "--kv-events", extra=getattr(args, "events", None) is not None),
        stats=_output_flag(args, "stats", "--stats"),
        events_file=Path(args.events) if getattr(args, "events", None) is not None else None,
        sessions=getattr(args, "sessions", False),
        pipeline=getattr(args, "pipeline", False),
        runner=getattr(args, "runner", False),
    )


def _output_flag(args: argparse.Namespace, name: str, flag: str, extra: bool = False) -> bool | None:
    """--kv-events / --stats (True: every workload), --no-... (False), neither
    (None: a share, check/outputs.py); UsageError when both are given."""
    on, off = getattr(args, name, False) or extra, getattr(args, "no_" + name, False)
    if on and off:
        raise UsageError(f"--no-{flag[2:]}: contradicts {flag if getattr(args, name, False) else '--events'}")
    return True if on else False if off else None


def parse_gates_flag(text: str, flag: str = "--gates") -> tuple[str, ...]:
    """The gates a ``--gates`` value names (``all``: GATES; ``none``: ());
    UsageError naming the flag and the unknown gate."""
    try:
        return parse_gates(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def parse_kv_flag(text: str, flag: str = "--kv") -> tuple[str, ...]:
    """The KV features a ``--kv`` value names (``all``: KV_FEATURES;
    ``none``: ()); UsageError naming the flag and the unknown feature."""
    try:
        return parse_kv(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def parse_engine_flag(text: str, flag: str = "--engine") -> tuple[str, ...]:
    """The engine features an ``--engine`` value names (``all``:
    ENGINE_FEATURES; ``none``: ()); UsageError naming the flag and the
    unknown feature."""
    try:
        return parse_engine(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _modes(text: str) -> tuple[str, ...]:
    try:
        return parse_modes("sync,async,spec,async-spec" if text.strip() == "all" else text)
    except ValueError as exc:
        raise UsageError(f"--modes: {exc}") from None


def _required_rules(text: str | None) -> tuple[str, ...]:
    """The rules named (``all`` is CheckSettings.require_all: every rule the
    modes the scheduler under test supports can reach)."""
    if text is None:
        return ()
    parts = [p for p in text.split(",") if p.strip() and p.strip() != "all"]
    if not parts and "all" in [p.strip() for p in text.split(",")]:
        return ()
    try:
        return parse_required(",".join(parts))
    except ValueError as exc:
        raise UsageError(f"--require-rules: {exc}") from None


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    try:  # the opt-in Mamba draws (check/kv_requests.py)
        mamba_rate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    target, factories = check_factories(args.against, settings.mode)
    name = target.name
    if settings.stats and not target.capabilities.stats:
        raise UsageError(f"--stats: {args.against} does not report scheduler statistics (its declared "
                         f"capabilities: {target.capabilities.describe()})")
    settings = dataclasses.replace(settings, capabilities=target.capabilities)
    try:
        drawn_gates = settings.drawn_gates
    except CapabilityError as exc:  # --gates leaves out a gate the scheduler declares ALWAYS
        raise UsageError(f"--gates: {args.against}: {exc}") from None
    unsupported = [g for g in settings.gates if g not in drawn_gates]
    if args.gates.strip() not in ("all", "none") and unsupported:
        raise UsageError(f"--gates: {args.against} does not support the gate(s) {', '.join(unsupported)} "
                         f"(its declared capabilities: {target.capabilities.describe()})")
    kv_text = getattr(args, "kv", "all").strip()
    unsupported_kv = [k for k in settings.kv if k not in settings.drawn_kv]
    if kv_text not in ("all", "none") and unsupported_kv:
        raise UsageError(f"--kv: {args.against} does not support the KV feature(s) {', '.join(unsupported_kv)} "
                         f"(its declared capabilities: {target.capabilities.describe()})")
    engine_text = getattr(args, "engine", "all").strip()
    unsupported_engine = [k for k in settings.engine if k not in settings.drawn_engine]
    if engine_text not in ("all", "none") and unsupported_engine:
        raise UsageError(f"--engine: {args.against} does not support the engine feature(s) "
                         f"{', '.join(unsupported_engine)} (its declared capabilities: {target.capabilities.describe()})")
    # --sessions, --pipeline, --runner ask for the feature in every workload: the scheduler is
    # held to it whatever it declares (one that cannot take it is a finding, not a usage error)
    asked = (("sessions",) if settings.sessions else ()) + (("pipeline",) if settings.pipeline else ()) \
        + (("pipeline", "runner", "drafter") if settings.runner else ())
    if asked:
        settings = dataclasses.replace(settings, capabilities=settings.capabilities.with_engine(asked))
    if settings.kv_events and not target.capabilities.kv_events:
        flag = "--events" if settings.events_file is not None else "--kv-events"
        raise UsageError(f"{flag}: {args.against} does not take KV cache events (its declared "
                         f"capabilities: {target.capabilities.describe()})")
    check_outputs(args)
    progress = Progress(enabled=not args.quiet)
    coverage = _coverage_start(args, name)
    try:
        with interruptible():
            outcome = run_check(factories, settings, progress=progress,
                                notice=lambda line: print(line, file=sys.stderr))
    finally:
        progress.close()
        if coverage is not None:
            coverage.stop()
    if outcome.failure is not None:
        assert outcome.out_dir is not None and outcome.trace_path is not None
        print((outcome.out_dir / "steps.txt").read_text(), end="")
        print(counterexample_line(outcome))
        print(f"replay it: {replay_command(outcome.trace_path, args.against, settings.call_timeout)}"
              + (" --stats" if outcome.stats_on else ""))
        if outcome.reference_failed:
            print(reference_line(outcome, args.against))
    elif outcome.interrupted is not None:
        print(interrupted_message(outcome) + f"; against {args.against}: {held_line(outcome.selection, name, args.plans_only)}")
    else:
        stats = outcome.stats
        held = held_line(outcome.selection, name, plans_only=args.plans_only)
        print(f"OK: {outcome.steps} steps in {outcome.workloads} workloads against {args.against}: {held}"
              + f" ({outcome.steps_per_s:,.0f} steps/s; {stats.preemptions} preemptions, {stats.hit_admissions}"
              f" prefix hits, {stats.chunks} prefill chunks)")
    if outcome.known_defects:
        print(known_defect_line(outcome.known_defects))
    gates = settings.drawn_gates
    always = settings.capabilities.always_gates()
    every = f", {', '.join(always)} in every one" if always else ""
    print("gates: " + (", ".join(gates) if gates else "none")
          + (f" (each workload a subset{every}; {outcome.stats.gate_line()})" if gates else ""))
    kv = settings.drawn_kv
    print("kv: " + (", ".join(kv) if kv else "none")
          + (f" (each workload a subset; {outcome.stats.kv_line()})" if kv else ""))
    engine = settings.drawn_engine
    print("engine: " + (", ".join(engine) if engine else "none")
          + (f" (in a share of the guided workloads and the narrow ones; {outcome.stats.engine_line()})" if engine else ""))
    if settings.events_file is not None:
        print(f"KV cache events: {outcome.stats.kv_cache_events} written to {settings.events_file}")
    print(outputs_line(settings.kv_events, settings.stats, settings.capabilities))
    if outcome.events.workloads:
        print(outcome.events.line())
    if outcome.stats.stats_reports:
        print(f"stats: {outcome.stats.stats_reports} make_stats() reports compared, one per update")
    if outcome.stats.rules or outcome.interrupted is not None:  # the coverage so far, even of nothing
        # the rules out of reach are those of the modes and gates this run
        # could not draw, not those of every gate
        modes, on = settings.drawn_modes, settings.drawn_capabilities
        print(format_table(outcome.stats.rules, modes=modes, gates=on) if args.rules
              else capability_rules_line(settings, outcome.stats.rules))
        print(effects_table(outcome.stats.rules, modes, on) if args.rules else effects_line(outcome.stats.rules, modes, on))
    if outcome.missing_rules:
        print(f"FAILED: {missing_rules_message(outcome.missing_rules)}")
    if coverage is not None:
        _coverage_write(args, coverage, outcome.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(check_summary(settings, outcome), indent=2) + "\n")
    if args.junit:
        Path(args.junit).write_text(junit_xml(settings, outcome))
    if outcome.result == "interrupted":
        return outcome.interrupt_status
    return EXIT_OK if outcome.ok else EXIT_FAIL


def check_outputs(args: argparse.Namespace) -> None:
    """Every path the run will write, checked (folders created) before it
    starts: UsageError naming the flag and the path when one cannot be written."""
    check_output_dir("--out", Path(args.out))
    for flag, value in (("--json", args.json), ("--junit", args.junit), ("--events", getattr(args, "events", None))):
        if value:
            check_output_file(flag, Path(value))
    if args.coverage:
        check_output_file("--coverage", Path(args.coverage))



def held_line(selection: Selection | None, name: str, plans_only: bool = False) -> str:
    """What held, saying exactly what ran: never a comparison that did not run."""
    if plans_only:
        return "plans equal to the spec at every step, views at the end of each workload (no invariants)"
    assert selection is not None
    n = len(selection.invariants)
    what = f"{n} invariant{'s' if n != 1 else ''} held ({selection.effective_selector})"
    if selection.compares and name != "spec":
        what += ", plans and views equal to the spec"
    elif selection.compares:
        what += " (the spec against itself: no comparison)"
    else:
        what += "; invariants mode: no comparison with the spec"
    if selection.skipped:
        what += "; skipped, unsupported: " + ", ".join(f"{i} ({why})" for i, why in selection.skipped)
    return what


def _coverage_start(args: argparse.Namespace, name: str) -> Any:
    """A started LineCollector over vLLM's scheduling files when --coverage
    is given (vLLM imported first, outside it); None otherwise."""
    if args.coverage is None:
        return None
    if name in ("spec", "impl"):
        raise UsageError(f"--coverage: measures vLLM's scheduler; use it with --against vllm or a "
                         f"vLLM scheduler class, not {name}")
    from schedspec.adapters.fidelity import LineCollector

    collector = LineCollector()
    collector.start()
    return collector


def _coverage_write(args: argparse.Namespace, collector: Any, steps: int) -> None:
    from schedspec.adapters.fidelity import fidelity_report, report_json, report_table

    report = fidelity_report(collector.hits, steps=steps)
    print(report_table(report), end="")
    path = Path(args.coverage) if args.coverage else Path(args.out) / "fidelity.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_json(report), indent=2) + "\n")
    print(f"fidelity report written to {path}")
