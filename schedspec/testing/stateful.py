"""Hypothesis state machines that hold schedulers to the spec.

``make_machine(factories)`` returns a RuleBasedStateMachine class that builds
every scheduler in ``factories`` from one drawn configuration and feeds them the
same events: request arrivals rich in shared prefixes (and salts), long
prompts, priorities, stop and eos tokens; aborts; steps with the fake model;
prefix-cache resets. After every operation every invariant is checked on every
scheduler and, with more than one scheduler, plans and views must be equal.
With admission gates among the capabilities, a run turns a subset on: its
requests carry adapters, structured outputs and encoder inputs as the gates
say, and rules pause and resume the scheduler and report grammars compiled
(or failed) for requests waiting for one. With the KV features among them, a
run may have a connector (its requests load and save, and a rule reports
loads done or failed and saves done, the worker delivering each where it is
meaningful) and hybrid KV cache groups; a run with either ends in
quiescence (every request finished, every report delivered, every block free).

Every event is passed to Hypothesis's ``note()`` as a line of a script
(``add(RequestSpec(...))``, ``step()``, ``abort('r2')``), so a shrunk failure
reads as the events that cause it. On a failure the machine also writes the
workload as a replayable trace (the last write is Hypothesis's shrunk example)
when ``trace_sink`` is set.

Importing this module registers no Hypothesis profile: the run takes the
settings in force (a profile the caller loaded, or ``settings=`` of the test).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from schedspec.spec.interface import RequestStatus, SchedulerConfig
from schedspec.check import trace as tracefile
from schedspec.check.capabilities import FULL, Capabilities
from schedspec.invariants import Invariant
from schedspec.check.driver import Runner
from schedspec.check.records import Failure
from schedspec.check.stats import Stats
from schedspec.spec.interface import SchedulerFactory
from schedspec.check.gate_requests import GateRequests
from schedspec.check.kv_requests import KVRequests
from schedspec.check.workload import (
    Abort,
    AddRequest,
    Event,
    GrammarReady,
    KVLoadDone,
    KVLoadFailed,
    KVSaveDone,
    PAUSE_MODES,
    Pause,
    ResetPrefixCache,
    Resume,
    Step,
    Workload,
    describe_event,
)
from schedspec.spec import coverage
from schedspec.testing.strategies import VOCAB, configs, gate_plans, kv_plans, prefixes, requests

class RunTally:
    """Counts over many state-machine runs: how often each mechanism fired.

    Rates are over the runs of at least ``min_steps`` steps: Hypothesis also
    tries trivially small examples (no step at all), which prove nothing
    about any mechanism either way and would only dilute the rates.
    ``rules`` sums the spec's rule counts (spec/coverage.py) over every run,
    short ones included: ``unreached_rules()`` names the branches no run took.
    """

    def __init__(self, min_steps: int = 20) -> None:
        self.min_steps = min_steps
        self.all_runs = 0
        self.runs = 0
        self.runs_with: Counter[str] = Counter()
        self.total = Stats()
        self.rules: Counter[str] = Counter()

    def add(self, stats: Stats) -> None:
        self.all_runs += 1
        coverage.merge(self.rules, stats.rules)
        if stats.steps < self.min_steps:
            return
        self.runs += 1
        self.total.merge(stats)
        for name, value in (
            ("preemption", stats.preemptions),
            ("prefix_hit", stats.hit_admissions),
            ("chunked_prefill", stats.chunks),
            ("abort", stats.aborts),
        ):
            if value:
                self.runs_with[name] += 1

    def unreached_rules(self) -> list[str]:
        """Catalogued spec rules no run reached (spec/rule_names.py)."""
        return coverage.unreached(self.rules)

    def rates(self) -> dict[str, float]:
        if not self.runs:
            return {}
        return {k: self.runs_with[k] / self.runs for k in ("preemption", "prefix_hit", "chunked_prefill", "abort")}


class SchedulerMachineBase(RuleBasedStateMachine):
    factories: ClassVar[dict[str, SchedulerFactory]] = {}
    run_invariants: ClassVar[bool] = True
    compare_views: ClassVar[bool] = True
    trace_sink: ClassVar[Path | None] = None
    tally: ClassVar[RunTally | None] = None
    #: what the schedulers support: configs and events are drawn within it
    capabilities: ClassVar[Capabilities] = FULL
    #: the invariants to check (None: the whole catalogue); not ``invariants``,
    #: which is RuleBasedStateMachine's own
    checked_invariants: ClassVar[tuple[Invariant, ...] | None] = None
    #: the check, as a trace header records it (None: lockstep, every invariant)
    check_record: ClassVar[dict[str, str] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.runner: Runner | None = None
        self.config: SchedulerConfig | None = None
        self.events: list[Event] = []
        self.prefixes: list[tuple[int, ...]] = []
        self.live: list[str] = []
        self.counter = 0
        #: the gates this run turned on (None: none)
        self.gated: GateRequests | None = None
        self.paused = False
        #: the connector's request fields of this run (None: no connector)
        self.kv_requests: KVRequests | None = None
        #: requests with connector fields, in order of arrival
        self.kv_ids: list[str] = []
        self.failed = False

    @initialize(
        shared=prefixes(),
        data=st.data(),
    )
    def setup(self, shared: list[tuple[int, ...]], data: st.DataObject) -> None:
        # drawn restricted, so a failure prints the config that ran, not the one before the restriction
        config = data.draw(configs().map(self.capabilities.restrict_config), label="config")
        if self.capabilities.gates():
            config, self.gated = data.draw(gate_plans(config, self.capabilities), label="gates")
            note(f"gate events: pause={self.gated.pause}, grammar={self.gated.grammar}")
        if self.capabilities.kv():
            config, self.kv_requests = data.draw(kv_plans(config, self.capabilities), label="kv")
        self.config = config
        self.prefixes = list(shared)
        note(f"config = {config!r}")
        self.runner = Runner(
            config,
            dict(self.factories),
            vocab=VOCAB,
            check_invariants=self.run_invariants,
            compare_views=self.compare_views,
            invariants=self.checked_invariants,
        )
        # Every run starts with work to do: a first burst of arrivals.
        for _ in range(data.draw(st.integers(2, 6), label="initial requests")):
            self._add(data)

    def _do(self, event: Event) -> None:
        assert self.runner is not None and self.config is not None
        self.events.append(event)
        note(f"{len(self.events) - 1}: {describe_event(event)}")
        failure = self.runner.apply(event)
        if failure is not None:
            self._report_failure(failure)

    def _report_failure(self, failure: Failure) -> None:
        self.failed = True
        self._report(failure)

    def _report(self, failure: Failure) -> None:
        assert self.config is not None
        if self.trace_sink is not None:
            tracefile.write(
                self.trace_sink,
                tracefile.Trace(Workload(self.config, tuple(self.events)), vocab=VOCAB, check=self.check_record),
            )
        if failure.kind == "timeout":
            # not an Exception: Hypothesis does not shrink it (each try would
            # hang for the whole deadline again); the contract fails the test
            raise CallHung(failure.describe())
        raise AssertionError(failure.describe())

    def _add(self, data: st.DataObject) -> None:
        """One arrival (schedspec.testing.strategies.requests)."""
        assert self.config is not None
        self.counter += 1
        rid = f"r{self.counter}"
        req = self.capabilities.restrict_request(
            data.draw(requests(rid, self.counter, self.config.max_model_len, self.prefixes))
        )
        if self.gated is not None:
            req = self.gated.decorate(req)
        if self.kv_requests is not None:
            req = self.kv_requests.decorate(req)
            self.kv_requests.due.clear()  # the kv_report rule draws the worker's events
            if req.kv_external_tokens or req.kv_save_async:
                self.kv_ids.append(rid)
        self._do(AddRequest(req))
        self.live.append(rid)

    @rule(data=st.data(), n=st.integers(1, 3))
    def add_requests(self, data: st.DataObject, n: int) -> None:
        for _ in range(n):
            self._add(data)

    @rule(n=st.integers(1, 8), reset=st.sampled_from([None] * 14 + [False, True]))
    def step(self, n: int, reset: bool | None) -> None:
        """Steps, now and then preceded by a prefix-cache reset (kept rare: a
        reset empties the cache, and hits are what most runs must reach)."""
        if reset is not None and self.capabilities.reset_prefix_cache:
            self._do(ResetPrefixCache(reset))
        for _ in range(n):
            self._do(Step())

    @precondition(lambda self: bool(self.live) and self.capabilities.abort)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live))
        self.live.remove(rid)
        self._do(Abort(rid))

    @precondition(lambda self: self.gated is not None and self.gated.pause and not self.paused)
    @rule(mode=st.sampled_from(PAUSE_MODES), clear_cache=st.booleans())
    def pause(self, mode: str, clear_cache: bool) -> None:
        self.paused = True
        self._do(Pause(mode, clear_cache))

    @precondition(lambda self: self.paused)
    @rule()
    def resume(self) -> None:
        self.paused = False
        self._do(Resume())

    @precondition(lambda self: bool(self._waiting_for_grammar()))
    @rule(data=st.data(), ok=st.sampled_from([True] * 9 + [False]))
    def grammar_ready(self, data: st.DataObject, ok: bool) -> None:
        """The grammar of a request waiting for one compiled (or failed)."""
        rid = data.draw(st.sampled_from(self._waiting_for_grammar()))
        self._do(GrammarReady(rid, ok))

    @precondition(lambda self: bool(self.kv_ids))
    @rule(data=st.data())
    def kv_report(self, data: st.DataObject) -> None:
        """A worker report for a request with connector fields: its load
        done, its load failed (as a whole or at one block), its save done.
        The worker delivers it where it is meaningful (or drops it)."""
        assert self.config is not None and self.runner is not None
        rid = data.draw(st.sampled_from(self.kv_ids), label="kv request")
        req = next(e.request for e in self.events if isinstance(e, AddRequest) and e.request.request_id == rid)
        options: list[Event] = []
        if req.kv_load_async:
            options.append(KVLoadDone(rid))
        if req.kv_external_tokens:
            blocks = -(-req.kv_external_tokens // self.config.block_size)
            options.append(KVLoadFailed(rid, None))
            options.append(KVLoadFailed(rid, data.draw(st.integers(0, blocks - 1), label="block index")))
        if req.kv_save_async:
            options.append(KVSaveDone(rid))
        self._do(data.draw(st.sampled_from(options), label="kv event"))

    def _waiting_for_grammar(self) -> list[str]:
        if self.gated is None or not self.gated.grammar or self.runner is None:
            return []
        view = self.runner.views.get(self.runner.names[0]) or self.runner.primary.view()
        return sorted(rid for rid, r in view.requests.items()
                      if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)

    @invariant()
    def forget_finished(self) -> None:
        # Keep `live` roughly live so aborts mostly name unfinished requests.
        if self.runner is not None and self.runner.views:
            view = next(iter(self.runner.views.values()))
            self.live = [r for r in self.live if r in view.requests]

    def teardown(self) -> None:
        if (self.runner is not None and self.config is not None and not self.failed
                and (self.config.kv_connector or self.config.is_hybrid)):
            # quiescence (schedspec.check.driver.Runner.quiesce): every request
            # finished, every worker report delivered, every block free
            failure = self.runner.quiesce()
            if failure is not None:
                self._report_failure(failure)
        if self.tally is not None and self.runner is not None:
            self.runner.stats.absorb_rules(self.runner.scheds[self.runner.names[0]])  # the reference's
            self.tally.add(self.runner.stats)


class CallHung(BaseException):
    """A call into a scheduler ran past its deadline (check/deadline.py)
    inside the state machine: raised past Hypothesis, unshrunk."""


def make_machine(
    factories: dict[str, SchedulerFactory],
    *,
    check_invariants: bool = True,
    compare_views: bool = True,
    trace_sink: Path | None = None,
    tally: RunTally | None = None,
    name: str = "SchedulerMachine",
    capabilities: Capabilities = FULL,
    invariants: tuple[Invariant, ...] | None = None,
    check_record: dict[str, str] | None = None,
) -> type[SchedulerMachineBase]:
    """A state machine class over ``factories``: configs and events drawn
    within ``capabilities``, ``invariants`` checked (None: all) and, with
    ``compare_views`` and more than one factory, plans and views compared."""
    attrs: dict[str, Any] = {
        "factories": dict(factories),
        "run_invariants": check_invariants,
        "compare_views": compare_views,
        "trace_sink": trace_sink,
        "tally": tally,
        "capabilities": capabilities,
        "checked_invariants": invariants,
        "check_record": check_record,
    }
    return type(name, (SchedulerMachineBase,), attrs)
