"""Hypothesis state machines that hold schedulers to the spec.

``make_machine(factories)`` returns a RuleBasedStateMachine class that builds
every scheduler in ``factories`` from one drawn configuration and feeds them the
same events: request arrivals rich in shared prefixes (and salts), long
prompts, priorities, stop and eos tokens; aborts; steps with the fake model;
prefix-cache resets. After every operation every invariant is checked on every
scheduler and, with more than one scheduler, plans and views must be equal.

On a failure the machine writes the workload as a replayable trace (the last
write is Hypothesis's shrunk example) when ``trace_sink`` is set.

Profiles: ``ci`` (quick, derandomized) and ``deep`` (long); pick with
HYPOTHESIS_PROFILE or ``load_profile``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from schedspec.spec.interface import Policy, RequestSpec, SchedulerConfig
from schedspec.check import trace as tracefile
from schedspec.check.driver import Failure, Runner, Stats
from schedspec.spec.interface import SchedulerFactory
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Step, Workload

settings.register_profile(
    "ci",
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "deep",
    max_examples=1_000_000,
    stateful_step_count=400,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

VOCAB = 24
ALPHABET = 4  # tokens of prompts: a tiny alphabet makes accidental sharing common too


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    """Small, tight configurations: every mechanism gets exercised."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.sampled_from([8, 12, 16, 24]))
    min_blocks = -(-max_model_len // block_size) + 1
    num_blocks = min_blocks + draw(st.sampled_from([0, 0, 1, 1, 2, 3, 6]))
    chunked = draw(st.booleans() | st.just(True))
    max_num_seqs = draw(st.sampled_from([1, 2, 3, 4, 6]))
    if chunked:
        budget = max(draw(st.sampled_from([2, 3, 4, 6, 8, 16, 32])), max_num_seqs)
    else:
        budget = max_model_len + draw(st.sampled_from([0, 4, 16]))
    threshold = draw(st.sampled_from([0, 0, 1, 2, 3, 5]))
    return SchedulerConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=min(threshold, max_model_len),
        enable_prefix_caching=draw(st.sampled_from([True, True, True, True, False])),
        policy=draw(st.sampled_from([Policy.FCFS, Policy.PRIORITY])),
        scheduler_reserve_full_isl=draw(st.booleans() | st.just(True)),
    )


class RunTally:
    """Counts over many state-machine runs: how often each mechanism fired.

    Rates are over the runs of at least ``min_steps`` steps: Hypothesis also
    tries trivially small examples (no step at all), which prove nothing
    about any mechanism either way and would only dilute the rates.
    """

    def __init__(self, min_steps: int = 20) -> None:
        self.min_steps = min_steps
        self.all_runs = 0
        self.runs = 0
        self.runs_with: Counter[str] = Counter()
        self.total = Stats()

    def add(self, stats: Stats) -> None:
        self.all_runs += 1
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

    def __init__(self) -> None:
        super().__init__()
        self.runner: Runner | None = None
        self.config: SchedulerConfig | None = None
        self.events: list[Event] = []
        self.prefixes: list[tuple[int, ...]] = []
        self.live: list[str] = []
        self.counter = 0

    @initialize(
        config=configs(),
        prefixes=st.lists(st.lists(st.integers(0, ALPHABET - 1), min_size=4, max_size=12), min_size=1, max_size=3),
        data=st.data(),
    )
    def setup(self, config: SchedulerConfig, prefixes: list[list[int]], data: st.DataObject) -> None:
        self.config = config
        self.prefixes = [tuple(p) for p in prefixes]
        self.runner = Runner(
            config,
            dict(self.factories),
            vocab=VOCAB,
            check_invariants=self.run_invariants,
            compare_views=self.compare_views,
        )
        # Every run starts with work to do: a first burst of arrivals.
        for _ in range(data.draw(st.integers(2, 6), label="initial requests")):
            self._add(data)

    def _do(self, event: Event) -> None:
        assert self.runner is not None and self.config is not None
        self.events.append(event)
        failure = self.runner.apply(event)
        if failure is not None:
            self._report(failure)

    def _report(self, failure: Failure) -> None:
        assert self.config is not None
        if self.trace_sink is not None:
            tracefile.write(
                self.trace_sink,
                tracefile.Trace(Workload(self.config, tuple(self.events)), vocab=VOCAB),
            )
        raise AssertionError(failure.describe())

    def _add(self, data: st.DataObject) -> None:
        """One arrival: often a shared prefix plus a tail, sometimes long."""
        assert self.config is not None
        use_prefix = data.draw(st.sampled_from([True, True, True, False]), label="shared prefix")
        prefix = data.draw(st.sampled_from(self.prefixes)) if use_prefix else ()
        tail = data.draw(st.lists(st.integers(0, ALPHABET - 1), min_size=0, max_size=14))
        prompt = (prefix + tuple(tail))[: self.config.max_model_len - 1] or (0,)
        self.counter += 1
        rid = f"r{self.counter}"
        req = RequestSpec(
            request_id=rid,
            prompt_token_ids=prompt,
            max_tokens=data.draw(st.sampled_from([1, 3, 5, 8, 30, 30])),
            priority=data.draw(st.integers(0, 2)),
            arrival=self.counter,
            stop_token_ids=tuple(data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=1))),
            eos_token_id=data.draw(st.none() | st.integers(0, VOCAB - 1)),
            ignore_eos=data.draw(st.booleans()),
            cache_salt=data.draw(st.sampled_from([None, None, None, "a"])),
        )
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
        if reset is not None:
            self._do(ResetPrefixCache(reset))
        for _ in range(n):
            self._do(Step())

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live))
        self.live.remove(rid)
        self._do(Abort(rid))

    @invariant()
    def forget_finished(self) -> None:
        # Keep `live` roughly live so aborts mostly name unfinished requests.
        if self.runner is not None and self.runner.views:
            view = next(iter(self.runner.views.values()))
            self.live = [r for r in self.live if r in view.requests]

    def teardown(self) -> None:
        if self.tally is not None and self.runner is not None:
            self.tally.add(self.runner.stats)


def make_machine(
    factories: dict[str, SchedulerFactory],
    *,
    check_invariants: bool = True,
    compare_views: bool = True,
    trace_sink: Path | None = None,
    tally: RunTally | None = None,
    name: str = "SchedulerMachine",
) -> type[SchedulerMachineBase]:
    attrs: dict[str, Any] = {
        "factories": dict(factories),
        "run_invariants": check_invariants,
        "compare_views": compare_views,
        "trace_sink": trace_sink,
        "tally": tally,
    }
    return type(name, (SchedulerMachineBase,), attrs)
