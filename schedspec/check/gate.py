"""The checking gate: random workloads in lockstep with the spec (or, in
invariants mode, the scheduler alone under a chosen set of invariants), a
failure shrunk and written as a replayable counterexample.

This is the library behind ``schedspec check`` and ``schedspec replay``; it
takes scheduler factories (the caller resolves names) and reports through
callbacks, so it imports neither the adapters nor the command line.

    outcome = run_check({"spec": SpecScheduler, "mine": Mine}, CheckSettings(against="mine"))
    outcome.failure        # None when everything held
    check_summary(settings, outcome)   # the JSON summary, as data
    junit_xml(settings, outcome)       # the JUnit report, as text
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
from xml.sax.saxutils import escape, quoteattr

from schedspec.check import report
from schedspec.check import trace as tracefile
from schedspec.check.capabilities import FULL, Capabilities, CapabilityError, rules_within
from schedspec.check.conformance import check_conformance
from schedspec.check.deadline import CLOCK, DEFAULT_CALL_TIMEOUT, CallTimeout, Interrupted, guarded
from schedspec.check.defects import Defect, failure_reports, known_defect
from schedspec.check.defects import describe as describe_defect
from schedspec.check.records import Failure, StepRecord
from schedspec.check.run import count_rules, failure_of, run_workload
from schedspec.check.stats import Stats
from schedspec.check.shrink import count_steps, shrink
from schedspec.check.coverage_guided import SWEEP, choose_focus, effect_focus, guided_workload, sweep_lead
from schedspec.check.dense_phase import (DENSE_STEPS, after_phase, core_first_after, dense_first, in_phase,
                                         phase_settings)
from schedspec.check.features import (
    ENGINE_FEATURES,
    GATES,
    KV_FEATURES,
    engine_capabilities,
    engine_of,
    gate_capabilities,
    kv_capabilities,
)
from schedspec.check.kv_events_file import EventsWriter
from schedspec.check.event_counts import EventsTally
from schedspec.check.outputs import outputs_on, with_outputs
from schedspec.check.narrow import families, is_narrow, narrow_seed, narrow_workload
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import Workload
from schedspec.spec import coverage
from schedspec.spec.effects import effects_report
from schedspec.spec.rule_names import reachable_in
from schedspec.check.rule_reach import reachable_rules, required_rules, rules_line
from schedspec.invariants import DEFAULT_SELECTOR, Mode, Selection, SelectionError, select
from schedspec.invariants.selection import named_ids
from schedspec.spec.interface import SchedSpecError, SchedulerConfig, SchedulerFactory

#: Steps checked when neither a step count nor a time budget is given.
DEFAULT_STEPS = 2000


class BuildError(SchedSpecError, RuntimeError):
    """A scheduler could not even be built from the default configuration."""


@dataclass(frozen=True)
class CheckSettings:
    """What one ``check`` run does. ``against`` names the scheduler under
    test (a key of the factories, and the name the replay line repeats)."""

    against: str = "spec"
    total_steps: int | None = None  # with time_budget also None: DEFAULT_STEPS
    time_budget: float | None = None  # seconds
    seed: int = 0
    shard: tuple[int, int] = (1, 1)  # K/N: this job takes seeds seed+K-1, seed+K-1+N, ...
    workload_steps: int = 100
    vocab: int = 64
    shrink_time: float = 60.0
    plans_only: bool = False
    out_dir: Path = Path("schedspec-out")
    #: "lockstep": plans and views compared with the reference, every step;
    #: "invariants": the scheduler alone, the chosen invariants only
    mode: Mode = "lockstep"
    invariants: str | None = None  # the --invariants selector; None: the mode's default
    capabilities: Capabilities = FULL  # what the scheduler under test supports
    #: rule names (spec/rule_names.py) the run must reach: one never reached fails it
    require_rules: tuple[str, ...] = ()
    #: also require every rule the supported modes can reach (``--require-rules all``)
    require_all: bool = False
    #: "guided": swarm workloads aimed at the rules the run has reached least
    #: (schedspec.check.coverage_guided); "random": random_workloads.random_workload
    generator: str = "guided"
    #: the modes the workloads run in (features.MODES)
    modes: tuple[str, ...] = ("sync",)
    #: the admission gates the workloads may turn on (features.GATES), each
    #: workload a subset; only those the scheduler under test supports (its
    #: capabilities) are drawn, so the default draws every gate it supports
    gates: tuple[str, ...] = GATES
    #: the KV features (features.KV_FEATURES: the connector, hybrid groups)
    #: the workloads may turn on, each workload a subset; only those the
    #: scheduler under test supports are drawn
    kv: tuple[str, ...] = KV_FEATURES
    #: the engine features (features.ENGINE_FEATURES: sessions, a pipeline,
    #: Model Runner V2, drafters) the guided workloads may turn on, in a share
    #: of them (check/engine_draw.py); only those the scheduler under test
    #: supports are drawn
    engine: tuple[str, ...] = ENGINE_FEATURES
    #: the deadline of one call into a scheduler, in seconds (None: none;
    #: check/deadline.py): a call past it is a finding of kind "timeout"
    call_timeout: float | None = DEFAULT_CALL_TIMEOUT
    #: a workload on which the reference meets a documented vLLM defect
    #: (check/defects.py) fails the run, instead of being counted apart
    strict_defects: bool = False
    #: config.enable_kv_cache_events: the schedulers' KV cache events
    #: (spec/kv_events.py) compared once per update; True in every workload,
    #: False in none, None in a share (check/outputs.py), each only where
    #: the capabilities declare them; ``stats`` likewise for log_stats
    kv_events: bool | None = None
    stats: bool | None = None
    #: with kv_events: write the reference's stream here as JSON lines
    #: (kv_events_file.py), one per event
    events_file: Path | None = None
    #: every workload random, with streaming-input sessions (check/session_events.py)
    sessions: bool = False
    #: every workload random, with a pipeline size (k plans in flight) drawn (check/pipeline.py)
    pipeline: bool = False
    #: every workload random, with the model runner, pipeline size and drafter drawn (check/runner_draw.py)
    runner: bool = False

    @property
    def steps_goal(self) -> int | None:
        if self.total_steps is None and self.time_budget is None:
            return DEFAULT_STEPS
        return self.total_steps

    @property
    def random_throughout(self) -> bool:
        """Every workload random: ``--generator random``, ``--sessions``, ``--pipeline`` or ``--runner``."""
        return self.generator == "random" or self.sessions or self.pipeline or self.runner

    @property
    def shard_text(self) -> str:
        return f"{self.shard[0]}/{self.shard[1]}"

    @property
    def drawn_modes(self) -> tuple[str, ...]:
        """``modes`` less those the scheduler under test does not support
        (its declared capabilities); sync when none is left."""
        return self.capabilities.drawable_modes(self.modes)

    @property
    def drawn_gates(self) -> tuple[str, ...]:
        """``gates`` less those the scheduler under test does not support, in GATES order."""
        return self.capabilities.drawable_gates(self.gates)

    @property
    def drawn_kv(self) -> tuple[str, ...]:
        """``kv`` less the KV features the scheduler under test does not
        support, in KV_FEATURES order."""
        return self.capabilities.drawable_kv(self.kv)

    @property
    def drawn_engine(self) -> tuple[str, ...]:
        """``engine`` less the engine features the scheduler under test does
        not support, in ENGINE_FEATURES order."""
        return self.capabilities.drawable_engine(self.engine)

    @property
    def drawn_capabilities(self) -> tuple[str, ...]:
        """The capability names of the gates, KV and engine features drawn
        (what spec/rule_names.py's Rule.gates lists)."""
        return (gate_capabilities(self.drawn_gates) + kv_capabilities(self.drawn_kv)
                + engine_capabilities(self.drawn_engine))


def resolve_selection(mode: Mode, selector: str | None, capabilities: Capabilities = FULL) -> Selection:
    """The invariants a check runs: ``selector`` in ``mode``, less those whose
    premise ``capabilities`` lacks (listed as skipped). SelectionError for an
    unknown item or an empty choice; CapabilityError for an invariant named by
    id that the scheduler cannot take, or when nothing is left after skipping."""
    chosen = select(selector, mode)
    kept, skipped = capabilities.split(chosen)
    why = dict(skipped)
    for iid in named_ids(selector):
        if iid in why:
            raise CapabilityError(
                f"--invariants {iid}: cannot be checked on this scheduler: it {why[iid]} "
                f"(its declared capabilities: {capabilities.describe()})"
            )
    if not kept:
        raise CapabilityError(
            f"--invariants {selector or DEFAULT_SELECTOR[mode]}: nothing left to check once the invariants "
            f"this scheduler cannot take are skipped ({', '.join(i for i, _ in skipped)})"
        )
    return Selection(mode, selector, kept, skipped)


def check_record(selection: Selection) -> dict[str, str] | None:
    """What a trace's header records of the check (None for the default
    lockstep check of every invariant, which old traces mean)."""
    if selection.mode == "lockstep" and selection.selector is None:
        return None
    return {"mode": selection.mode, "invariants": selection.effective_selector}


def selection_of_trace(trace: tracefile.Trace, mode: Mode | None = None, selector: str | None = None,
                       capabilities: Capabilities = FULL) -> Selection:
    """The check a replay repeats: the one the trace records, unless ``mode``
    (and then ``selector``) says otherwise."""
    rec = trace.check or {}
    if mode is None:
        raw = rec.get("mode", "lockstep")
        if raw not in ("lockstep", "invariants"):
            raise SelectionError(f"the trace records an unknown mode {raw!r}")
        mode = "invariants" if raw == "invariants" else "lockstep"
        if selector is None:
            selector = rec.get("invariants")
    return resolve_selection(mode, selector, capabilities)


def selection_summary(selection: Selection, plans_only: bool = False) -> dict[str, Any]:
    """The check as data: mode, selector, whether a comparison ran, what was
    checked and what was skipped (and why). ``plans_only``: plans compared,
    views once per workload, no invariant checked."""
    return {
        "mode": selection.mode,
        "invariants": "none (--plans-only)" if plans_only else selection.effective_selector,
        "compared_with_reference": selection.compares,
        "checked": [] if plans_only else list(selection.ids),
        "skipped": [{"id": i, "why": why} for i, why in selection.skipped],
    }


@dataclass(frozen=True)
class CheckProgress:
    """A snapshot for a progress display; ``final`` marks the last one (the
    run ended or just failed), which a display shows whatever its rate limit.
    ``elapsed`` is the check's own clock, started after the warm-up, so the
    display's steps/s is the summary's."""

    steps: int
    total: int | None
    workloads: int
    stats: Stats
    final: bool = False
    elapsed: float = 0.0


@dataclass(frozen=True)
class KnownDefectHit:
    """A workload on which the reference met a documented vLLM defect."""

    seed: int
    defect: Defect
    failure: Failure

    def line(self) -> str:
        ids = ", ".join(v.invariant_id for v in self.failure.violations) or self.failure.kind
        return f"workload seed {self.seed}: {describe_defect(self.defect)} [{ids}]"


def known_defect_line(hits: list[KnownDefectHit]) -> str:
    """One line counting the documented vLLM defects a run met, by name."""
    counts: dict[str, int] = {}
    for h in hits:
        counts[h.defect.name] = counts.get(h.defect.name, 0) + 1
    return (f"known vLLM 0.33 defects met (counted apart, docs/divergences.md): {len(hits)} workload(s): "
            + ", ".join(f"{n} x{c}" for n, c in counts.items()))


def reference_line(outcome: "CheckOutcome", against: str) -> str:
    """What a failure first seen in the reference is: the spec's, never the
    scheduler under test's."""
    if outcome.defect is not None:
        return (f"the reference (the spec) failed first, on a {describe_defect(outcome.defect)}: "
                f"not a failure of {against} (fatal under --strict-defects)")
    return (f"the reference (the spec) failed first: a bug of schedspec or a vLLM defect not yet written up, "
            f"not a failure of {against}; please report it with the trace")


@dataclass
class CheckOutcome:
    steps: int
    workloads: int
    elapsed: float
    stats: Stats
    failure: Failure | None = None
    seed: int | None = None  # the failing workload's seed
    out_dir: Path | None = None  # the counterexample's folder
    trace_path: Path | None = None
    seeds: list[int] = field(default_factory=list)  # every workload seed run
    counterexample: Workload | None = None  # the shrunk failing workload
    selection: Selection | None = None  # what was checked
    found_after: float | None = None  # seconds from the start to the failure, before shrinking
    #: required rules (CheckSettings.require_rules) the run never reached
    missing_rules: tuple[str, ...] = ()
    #: the steps the counterexample's table shows (the events' own, and those
    #: of the run to quiescence after them)
    table_steps: int = 0
    #: the signal that ended the run early (SIGINT, SIGTERM), None when none did
    interrupted: str | None = None
    #: the exit status the interruption calls for (130 SIGINT, 143 SIGTERM)
    interrupt_status: int = 0
    #: the workload seed in progress when the run was interrupted (not counted)
    interrupted_seed: int | None = None
    #: the workloads on which the reference met a documented vLLM defect,
    #: counted apart (the run went on)
    known_defects: list[KnownDefectHit] = field(default_factory=list)
    #: the failure was first seen in the reference (the spec), not in the
    #: scheduler under test: a bug of ours, or ``defect`` (--strict-defects)
    reference_failed: bool = False
    defect: Defect | None = None
    #: the failing workload's schedulers were built with log_stats (its replay takes --stats)
    stats_on: bool = False
    #: what the workloads with KV cache events on exercised
    events: EventsTally = field(default_factory=EventsTally)

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.missing_rules and self.interrupted is None

    @property
    def result(self) -> str:
        """pass, fail or interrupted (a failure found before the signal is a fail)."""
        if self.failure is not None or self.missing_rules:
            return "fail"
        return "interrupted" if self.interrupted is not None else "pass"

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.elapsed if self.elapsed > 0 else 0.0


def replay_command(trace_path: Path | str, against: str, call_timeout: float | None = DEFAULT_CALL_TIMEOUT) -> str:
    """The command that replays a counterexample (with the deadline it ran
    under, when that is not the default)."""
    flag = "" if call_timeout == DEFAULT_CALL_TIMEOUT else f" --call-timeout {call_timeout or 0:g}"
    return f"schedspec replay {trace_path} --against {against}{flag}"


def write_counterexample(out_dir: Path, workload: Workload, failure: Failure,
                         factories: dict[str, SchedulerFactory], against: str, vocab: int, oracle_seed: int,
                         notice: Callable[[str], None] | None = None,
                         selection: Selection | None = None,
                         call_timeout: float | None = DEFAULT_CALL_TIMEOUT) -> Path:
    """Write trace.jsonl, steps.txt, timeline.png and summary.json into
    ``out_dir``; return the trace's path. Without matplotlib the picture is
    skipped and ``notice`` hears why in one line."""
    return _write_counterexample(out_dir, workload, failure, factories, against, vocab, oracle_seed, notice,
                                 selection, call_timeout)[0]


def _write_counterexample(out_dir: Path, workload: Workload, failure: Failure,
                          factories: dict[str, SchedulerFactory], against: str, vocab: int, oracle_seed: int,
                          notice: Callable[[str], None] | None, selection: Selection | None,
                          call_timeout: float | None) -> tuple[Path, int]:
    """write_counterexample, and the number of steps its table shows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / "trace.jsonl"
    record = check_record(selection) if selection is not None else None
    tracefile.write(trace_path, tracefile.Trace(workload, vocab=vocab, oracle_seed=oracle_seed, check=record))
    invariants = selection.invariants if selection is not None else None
    if failure.kind == "timeout":
        # not run again (it would hang once more): the trace ends with the
        # event whose call hung, and the table says so
        records: list[StepRecord] = []
        again: Failure | None = None
        (out_dir / "steps.txt").write_text(f"(no step table: the trace ends with the call that hung, event "
                                           f"{failure.event_index})\n{failure.describe()}\n")
    else:
        runner, again = run_workload(workload, factories, vocab, oracle_seed, keep_history=True,
                                     invariants=invariants)
        records = runner.history or []
        (out_dir / "steps.txt").write_text(report.step_table(records, again or failure))
    if records:
        try:
            report.timeline_png(records, out_dir / "timeline.png", failure=again or failure)
        except report.PlotUnavailable as exc:
            if notice is not None:
                notice(f"timeline.png skipped: {exc}")
    summary = {
        "against": against,
        "kind": failure.kind,
        "scheduler": failure.scheduler,
        "message": failure.message,
        "violations": [{"id": v.invariant_id, "message": v.message} for v in failure.violations],
        "events": len(workload.events),
        "steps": count_steps(workload.events),
        "table_steps": len(records),
        "replay": replay_command(trace_path, against, call_timeout),
    }
    if selection is not None:
        summary["check"] = selection_summary(selection)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return trace_path, len(records)


def warm_up(factories: dict[str, SchedulerFactory], config: SchedulerConfig | None = None,
            capabilities: Capabilities | None = None) -> None:
    """Build each scheduler once and check that it conforms (the types of its
    first views and plan, and the optional methods of the gates
    ``capabilities`` declares): a class that cannot even be built raises
    BuildError, one that does not conform ConformanceError; and one-time
    costs (vLLM's import) stay out of the checking."""
    cfg = config or SchedulerConfig()
    for name, factory in factories.items():
        CLOCK.start(name, "construction")
        try:
            factory(cfg)
        except SchedSpecError:
            raise
        except Exception as exc:
            raise BuildError(f"--against {name}: cannot build the scheduler: {type(exc).__name__}: {exc}") from None
        finally:
            CLOCK.stop()
        check_conformance(name, factory, cfg, capabilities)


def run_check(factories: dict[str, SchedulerFactory], settings: CheckSettings,
              progress: Callable[[CheckProgress], None] | None = None,
              notice: Callable[[str], None] | None = None) -> CheckOutcome:
    """Seeded random workloads against ``factories`` (the spec and the
    scheduler under test) until the step goal or the time budget is reached
    or something fails; a failure is shrunk (``notice`` hears of it first)
    and written under ``settings.out_dir / f"seed-{seed}"``.

    Every call into a scheduler has ``settings.call_timeout`` seconds
    (check/deadline.py): one past it is a failure of kind "timeout", not
    shrunk, its trace the workload's events up to the call that hung. The time
    budget is honoured within a workload too (checked between events). An
    ``Interrupted`` (SIGINT/SIGTERM through deadline.interruptible) or a
    KeyboardInterrupt ends the run with what it did so far
    (``outcome.interrupted``)."""
    with guarded(settings.call_timeout) as why:
        if why is not None and notice is not None:
            notice(f"no deadline on the scheduler's calls: {why}")
        return _run_check(factories, settings, progress, notice)


def _run_check(factories: dict[str, SchedulerFactory], settings: CheckSettings,
               progress: Callable[[CheckProgress], None] | None,
               notice: Callable[[str], None] | None) -> CheckOutcome:
    total_steps, time_budget = settings.steps_goal, settings.time_budget
    shard_k, shard_n = settings.shard
    caps = settings.capabilities
    selection = resolve_selection(settings.mode, settings.invariants, caps)
    if settings.mode == "invariants" and settings.plans_only:
        raise SelectionError("--plans-only compares plans with the reference: it is a lockstep option, "
                             "not one of invariants mode")
    if settings.mode == "invariants" and len(factories) != 1:
        raise SelectionError(f"invariants mode checks one scheduler alone, got {len(factories)}: "
                             f"{', '.join(factories)}")
    invariants = selection.invariants
    show = progress or (lambda _p: None)
    say = notice or (lambda _m: None)
    stats = Stats()
    steps = workloads = 0
    seeds: list[int] = []
    known: list[KnownDefectHit] = []
    # the reference (the first scheduler) beside the one under test: a
    # failure first seen in it is never the candidate's
    reference = next(iter(factories)) if len(factories) > 1 else None
    start = time.monotonic()
    # imports and first construction stay out of the steps/s figure
    try:
        warm_up(factories, caps.restrict_config(SchedulerConfig()), caps if settings.drawn_gates else None)
    except CallTimeout as exc:
        return _warm_up_timeout(exc, factories, settings, selection, say)
    except (Interrupted, KeyboardInterrupt) as exc:
        return _interrupted(exc, CheckOutcome(0, 0, 0.0, stats, selection=selection), None)
    start = time.monotonic()
    stop_at = start + time_budget if time_budget is not None else None
    index = 0
    # the core workloads' own rule counts: their focus follows the core's
    # coverage alone, as in a run with no gate or KV feature to draw
    core_rules: Counter[str] = Counter()
    first = core_first(total_steps, settings.workload_steps)
    dense = dense_first(total_steps, settings.workload_steps)  # short core workloads first (dense_phase.py)
    first = core_first_after(first, dense)
    seed, swarm = settings.seed, 0  # swarm: the swarm workloads so far (coverage_guided.sweep_lead)
    turns, narrow_rules = 0, Counter[str]()  # the narrow workloads so far and their rule counts (narrow.py)
    rotation = () if settings.random_throughout else families(settings.drawn_kv, settings.drawn_engine)
    events_out = EventsWriter(settings.events_file) if settings.events_file is not None else None
    tally = EventsTally()
    try:
        while True:
            if total_steps is not None and steps >= total_steps:
                break
            if time_budget is not None and time.monotonic() - start >= time_budget:
                break
            # narrow ones (narrow.py) go between those of a run without them: ``base`` counts these
            base = index - turns
            narrow = bool(rotation) and is_narrow(base, dense + first, turns)  # never in the dense phase
            index += 1
            n = settings.workload_steps if total_steps is None else min(settings.workload_steps, total_steps - steps)
            core = not narrow and (in_phase(base, dense) or is_core(after_phase(base, dense), first))
            seed = narrow_seed(settings.seed, turns, shard_k, shard_n) if narrow else (
                settings.seed + base * shard_n + (shard_k - 1))
            n = min(n, DENSE_STEPS) if in_phase(base, dense) else n
            ws = phase_settings(settings, in_phase(base, dense))  # the dense phase's vocabulary (dense_phase.py)
            workload = caps.restrict_workload(narrow_workload(
                seed, n, rotation[turns % len(rotation)], ws.vocab, ws.drawn_modes, ws.drawn_gates, caps.always_gates())
                if narrow else make_workload(ws, seed, n, core_rules if core else stats.rules - narrow_rules, core, swarm))
            turns, swarm = turns + narrow, swarm + (not core and not narrow)
            sweep = settings.generator == "guided" and not core and not narrow and swarm <= len(SWEEP)  # outputs on
            on = outputs_on(settings.kv_events, settings.stats, caps, seed, sweep)
            workload, used = with_outputs(workload, factories, *on)
            sink = events_out.sink(seed) if events_out is not None else None
            runner, failure = run_workload(workload, used, ws.vocab, oracle_seed=seed,
                                           plans_only=settings.plans_only, invariants=invariants, stop_at=stop_at,
                                           kv_event_sink=tally.sink(sink) if on[0] else sink)
            if failure is not None and settings.plans_only and failure.kind != "timeout":
                # the same workload, everything checked
                failure = run_workload(workload, used, ws.vocab, oracle_seed=seed,
                                       invariants=invariants)[1] or failure
            seeds.append(seed)
            if not runner.stopped:
                count_rules(runner, workload, seed, ws.vocab)
                if on[0]:
                    tally.add(runner.stats, workload)
            stats.merge(runner.stats)
            stats.count_engine(engine_of(workload.config, workload.events))
            if core or narrow:  # the focus follows the core's and the guided workloads' own counts
                (core_rules if core else narrow_rules).update(runner.stats.rules)
            steps += runner.stats.steps
            workloads += 1
            show(CheckProgress(steps, total_steps, workloads, stats, elapsed=time.monotonic() - start))
            in_reference = failure is not None and reference is not None and failure.scheduler == reference
            defect = None
            if failure is not None and in_reference:
                defect = known_defect(workload.config, workload.events,
                                      failure_reports(failure.kind, (v.invariant_id for v in failure.violations)))
                if defect is not None and not settings.strict_defects:
                    known.append(KnownDefectHit(seed, defect, failure))
                    say(known[-1].line() + "; counted apart, going on (--strict-defects makes it fatal)")
                    continue
            if failure is not None:
                show(CheckProgress(steps, total_steps, workloads, stats, final=True,
                                   elapsed=time.monotonic() - start))
                found_after = time.monotonic() - start
                say(f"FAILED on workload seed {seed}{workload_label(workload)} after {found_after:.1f} s: "
                    f"{failure.describe()}")
                outcome = _counterexample(used, ws, selection, workload, failure, seed,
                                          CheckOutcome(steps, workloads, 0.0, stats, seeds=seeds, selection=selection,
                                                       known_defects=known, found_after=found_after),
                                          start, say)
                outcome.reference_failed = outcome.failure is not None and outcome.failure.scheduler == reference
                outcome.defect, outcome.stats_on = defect, on[1]
                return outcome
    except (Interrupted, KeyboardInterrupt) as exc:
        outcome = CheckOutcome(steps, workloads, time.monotonic() - start, stats, seeds=list(seeds),
                               selection=selection, known_defects=known)
        show(CheckProgress(steps, total_steps, workloads, stats, final=True, elapsed=outcome.elapsed))
        return _interrupted(exc, outcome, seed)
    outcome = CheckOutcome(steps, workloads, time.monotonic() - start, stats, seeds=seeds, selection=selection,
                           missing_rules=tuple(coverage.unreached(stats.rules, required_rules(settings))),
                           known_defects=known, events=tally)
    show(CheckProgress(steps, total_steps, workloads, stats, final=True, elapsed=time.monotonic() - start))
    return outcome


def _interrupted(exc: BaseException, outcome: CheckOutcome, seed: int | None) -> CheckOutcome:
    """``outcome`` marked interrupted by ``exc`` (an Interrupted or a
    KeyboardInterrupt, which is SIGINT's)."""
    sig = exc if isinstance(exc, Interrupted) else Interrupted(2)
    outcome.interrupted, outcome.interrupt_status, outcome.interrupted_seed = sig.name, sig.exit_status, seed
    return outcome


def _counterexample(factories: dict[str, SchedulerFactory], settings: CheckSettings, selection: Selection,
                    workload: Workload, failure: Failure, seed: int, outcome: CheckOutcome, start: float,
                    say: Callable[[str], None]) -> CheckOutcome:
    """Shrink the failing ``workload`` (a timeout is not shrunk: its trace
    is the events up to the call that hung) and write the counterexample;
    ``outcome`` completed. A signal while shrinking keeps the smallest
    workload found so far (the outcome is marked interrupted too)."""
    if failure.kind == "timeout":
        small = dataclasses.replace(workload, events=workload.events[:max(failure.event_index, -1) + 1])
        small_failure = failure
    else:
        say("shrinking...")
        check = functools.partial(failure_of, factories=factories, vocab=settings.vocab, oracle_seed=seed,
                                  invariants=selection.invariants)
        try:
            small, small_failure = shrink(workload, failure, check, budget_s=settings.shrink_time)
        except (Interrupted, KeyboardInterrupt) as exc:
            _interrupted(exc, outcome, seed)
            say(f"shrinking interrupted ({outcome.interrupted}): the counterexample is the workload as it failed")
            small, small_failure = workload, failure
    out_dir = settings.out_dir / f"seed-{seed}"
    trace_path, outcome.table_steps = _write_counterexample(out_dir, small, small_failure, factories,
                                                            settings.against, settings.vocab, seed, say,
                                                            selection, settings.call_timeout)
    outcome.elapsed = time.monotonic() - start
    outcome.failure, outcome.seed, outcome.out_dir, outcome.trace_path = small_failure, seed, out_dir, trace_path
    outcome.counterexample = small
    return outcome


def _warm_up_timeout(exc: CallTimeout, factories: dict[str, SchedulerFactory], settings: CheckSettings,
                     selection: Selection, say: Callable[[str], None]) -> CheckOutcome:
    """A call past its deadline while building and probing the schedulers:
    a failure before the first event; its trace holds no event (its replay
    builds the schedulers and takes their first views)."""
    failure = Failure("timeout", -1, 0, exc.scheduler,
                      exc.describe(f"{exc.scheduler}: {exc.method} (while building and probing it)"), exception=exc)
    say(f"FAILED before the first workload: {failure.describe()}")
    config = settings.capabilities.restrict_config(SchedulerConfig())
    workload = Workload(config, ())
    out_dir = settings.out_dir / "warm-up"
    trace_path = write_counterexample(out_dir, workload, failure, factories, settings.against, settings.vocab, 0,
                                      notice=say, selection=selection, call_timeout=settings.call_timeout)
    return CheckOutcome(0, 0, 0.0, Stats(), failure, None, out_dir, trace_path, [], workload, selection=selection)


def counterexample_line(o: CheckOutcome) -> str:
    """What the counterexample holds, in the words of the table printed
    above it: its events, and the steps the table shows (those the events
    schedule, and those of the run to quiescence after them)."""
    events = o.counterexample.events if o.counterexample is not None else ()
    ev = f"{len(events)} event{'s' if len(events) != 1 else ''}"
    if o.failure is not None and o.failure.kind == "timeout":
        if not events:
            return f"counterexample: no events (it hung before the first), written to {o.out_dir}/"
        return f"counterexample: {ev}, the last one's call hung, written to {o.out_dir}/"
    own, shown = count_steps(events), o.table_steps
    if shown <= own:
        return f"counterexample: {own} steps, {ev}, written to {o.out_dir}/"
    return (f"counterexample: {shown} steps in the table ({own} scheduled by its {ev}, {shown - own} run after "
            f"them to quiescence), written to {o.out_dir}/")


def check_summary(settings: CheckSettings, o: CheckOutcome) -> dict[str, Any]:
    """The JSON summary of a check run (what ``--json`` writes)."""
    return {
        "result": o.result,
        "interrupted": None if o.interrupted is None else {
            "signal": o.interrupted,
            "exit_status": o.interrupt_status,
            # the workload in progress when the signal came: not counted above
            "workload_seed_in_progress": o.interrupted_seed,
        },
        "call_timeout_s": settings.call_timeout,
        "against": settings.against,
        "seed": settings.seed,
        "shard": settings.shard_text,
        "steps": o.steps,
        "workloads": o.workloads,
        "workload_seeds": o.seeds,
        "elapsed_s": round(o.elapsed, 3),
        "steps_per_s": round(o.steps / o.elapsed, 1) if o.elapsed > 0 else None,
        "stats": o.stats.as_dict(),
        **({"kv_events": o.events.as_dict()} if o.events.workloads else {}),
        "check": None if o.selection is None else selection_summary(o.selection, plans_only=settings.plans_only),
        "gates": list(settings.drawn_gates),
        "kv": list(settings.drawn_kv),
        "rule_coverage": o.stats.rule_coverage(required_rules(settings), settings.drawn_modes,
                                               settings.drawn_capabilities, reachable_rules(settings)),
        "effect_coverage": effects_report(o.stats.rules, settings.drawn_modes, settings.drawn_capabilities),
        "known_defects": [{"workload_seed": h.seed, "defect": h.defect.name, "section": h.defect.section,
                           "violations": [v.invariant_id for v in h.failure.violations] or [h.failure.kind]}
                          for h in o.known_defects],
        "failure": None if o.failure is None else {
            "kind": o.failure.kind,
            # "reference": first seen in the spec (a bug of ours, or a
            # documented vLLM defect under --strict-defects); "candidate": the
            # scheduler under test
            "culprit": "reference" if o.reference_failed else "candidate",
            "known_defect": None if o.defect is None else o.defect.name,
            "workload_seed": o.seed,
            # the check's clock at the failure, before shrinking: the time to catch
            "found_after_s": None if o.found_after is None else round(o.found_after, 3),
            # what the failing workload was built to contain (the guided generator's switches and focus)
            "workload_features": list(o.counterexample.features) if o.counterexample is not None else [],
            "message": o.failure.message,
            "violations": [{"id": v.invariant_id, "message": v.message} for v in o.failure.violations],
            "trace": str(o.trace_path),
            "replay": replay_command(str(o.trace_path), settings.against, settings.call_timeout),
        },
    }


def junit_xml(settings: CheckSettings, o: CheckOutcome) -> str:
    """The check run as a JUnit test suite of one case (what ``--junit`` writes)."""
    name = f"schedspec check --against {settings.against} --mode {settings.mode} (shard {settings.shard_text})"
    case = f'<testcase classname="schedspec.check" name={quoteattr(name)} time="{o.elapsed:.3f}">'
    if o.failure is not None:
        replay = replay_command(str(o.trace_path), settings.against, settings.call_timeout)
        body = escape(o.failure.describe() + (f"\n{reference_line(o, settings.against)}" if o.reference_failed else "")
                      + f"\nreplay: {replay}")
        case += f'<failure message={quoteattr(o.failure.message)} type="{o.failure.kind}">{body}</failure>'
    elif o.missing_rules:
        message = missing_rules_message(o.missing_rules)
        case += f'<failure message={quoteattr(message)} type="rules">{escape(message)}</failure>'
    elif o.interrupted is not None:
        message = interrupted_message(o)
        case += f'<error message={quoteattr(message)} type="interrupted">{escape(message)}</error>'
    case += f"<system-out>{escape(json.dumps(check_summary(settings, o)))}</system-out></testcase>"
    rules = coverage.as_dict(o.stats.rules)
    props = "".join(f'<property name={quoteattr("rule." + n)} value="{c}"/>' for n, c in rules.items())
    props = (f'<properties><property name="rules.reached" value="{len(coverage.reached(rules))}"/>'
             f'<property name="rules.total" value="{len(rules)}"/>{props}</properties>')
    failures = 1 if o.result == "fail" else 0
    errors = 1 if o.result == "interrupted" else 0
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="schedspec" tests="1" '
            f'failures="{failures}" errors="{errors}" time="{o.elapsed:.3f}">{props}{case}</testsuite>\n')


def interrupted_message(o: CheckOutcome) -> str:
    """The line an interrupted run ends with: how far it got, and that
    nothing failed so far (a failure found before the signal is reported
    as a failure instead)."""
    wl = "workload" if o.workloads == 1 else "workloads"
    text = f"interrupted ({o.interrupted}) after {o.steps} steps in {o.workloads} {wl}: no violation so far"
    if o.interrupted_seed is not None:
        text += f" (workload seed {o.interrupted_seed}, in progress, not counted)"
    return text


def missing_rules_message(names: tuple[str, ...] | list[str]) -> str:
    """The one line a run that missed required rules fails with."""
    return f"{len(names)} required rule(s) never reached: {', '.join(names)}"


#: the generators a check can draw its workloads from
GENERATORS = ("guided", "random")


#: The core phase: the first CORE_FIRST workloads of a run (core_first: fewer in
#: a short run), and then one in CORE_EVERY, run synchronously (when the scheduler can), turn on no admission
#: gate and no KV feature (but the gates a scheduler declares always on), and aim
#: at the core's rules with the core workloads' own counts. A bug of the core
#: (queues, budgets, the pool, preemption, the prefix cache) is met there as
#: densely as in a run with nothing else to draw, while the modes, gates and
#: layouts spread the other workloads thin; those draw from everything the
#: scheduler declares. Narrow workloads (check/narrow.py) come between them.
CORE_FIRST = 16
CORE_EVERY = 3


def core_first(total_steps: int | None, workload_steps: int) -> int:
    """How many workloads the first phase takes: CORE_FIRST, or a quarter of
    a run with a step goal that plans fewer than 4 * CORE_FIRST (one at least)."""
    if total_steps is None:
        return CORE_FIRST
    planned = -(-total_steps // max(1, workload_steps))
    return min(CORE_FIRST, max(1, planned // 4))


def is_core(index: int, first: int = CORE_FIRST) -> bool:
    """Whether the run's workload number ``index`` (0, 1, ...) is a core one."""
    return index < first or index % CORE_EVERY == 0


def make_workload(settings: CheckSettings, seed: int, num_steps: int, counts: Mapping[str, int],
                  core: bool = False, swarm: int = -1) -> Workload:
    """The workload of ``seed``: guided (aimed at the rules ``counts``, the
    run's so far, has reached least; the focus is named in the workload's
    features) or random, as ``settings.generator`` says; a ``core`` one
    (is_core) with no gate and no KV feature drawn, named so; ``swarm``: the
    swarm workloads before it, the first ones led by a sweep (sweep_lead)."""
    always = settings.capabilities.always_gates()  # a gate declared ALWAYS is in every workload
    gates = tuple(g for g in settings.drawn_gates if g in always) if core else settings.drawn_gates
    kv = () if core else settings.drawn_kv
    modes = settings.drawn_modes
    if core and "sync" in modes:
        modes = ("sync",)
    if settings.random_throughout:
        workload = random_workload(seed, num_steps, vocab=settings.vocab, modes=modes if core else settings.modes,
                                   gates=gates, kv=kv, always_gates=always, sessions=settings.sessions,
                                   pipeline=settings.pipeline, runner=settings.runner)
    elif settings.generator == "guided":
        names = reachable_rules(settings)
        if core:
            names = rules_within(settings.capabilities, reachable_in(modes, gate_capabilities(gates)))
        lead = () if core else sweep_lead(swarm, names)
        focus = choose_focus(counts, seed, names=names, lead=lead) + effect_focus(counts, seed, modes)  # effects
        workload = guided_workload(seed, num_steps, vocab=settings.vocab, focus=focus, modes=modes,
                                   gates=gates, kv=kv, always_gates=always,
                                   engine=() if core else settings.drawn_engine)
    else:
        raise ValueError(f"generator must be one of {', '.join(GENERATORS)}, got {settings.generator!r}")
    if core and (settings.drawn_gates or settings.drawn_kv or modes != settings.drawn_modes):
        return dataclasses.replace(workload, name=f"{workload.name or 'workload'}, core")
    return workload


def workload_label(workload: Workload) -> str:
    """`` (guided: FEATURE, ..., focus:RULE)`` for a generated workload that
    names its features, "" otherwise: with the seed, what rebuilds it
    (coverage_guided.guided_workload(seed, steps, focus=...))."""
    if not workload.features:
        return ""
    return f" ({workload.name or 'workload'}: {', '.join(workload.features)})"
