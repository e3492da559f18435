"""Lockstep in every mode: sync and async scheduling, each with and without
speculative decoding. ImplScheduler must make the spec's plans, views and
errors when a plan is in flight (async: schedule() for step N+1 before
update() for step N), with drafts handed in through
StepResult.draft_token_ids, placeholders, stale output across preemption and
rejected drafts.

Three drivers:

- ``ModesLockstep``: a Hypothesis state machine (the sync machine's
  requests, aborts and resets, plus a drawn mode) that schedules while the
  protocol allows, updates the oldest plan with drawn acceptance and drafts,
  and tries the in-flight protocol's bad inputs (an update out of order or
  twice, drafts for a request the plan did not schedule or past k, more
  tokens than drafts + 1, drafts after a partial prefill chunk); after every
  operation equal outcomes and views, and a raising operation changed
  nothing.
- seeded workloads of the check engine (``random_workload`` in each mode,
  its fake model, the driver's lockstep) that must reach the spec's async and
  speculative rules;
- ``drive``: the hand-driven loop that tests/impl/test_clone.py forks.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections import Counter
from typing import Any, Callable

import pytest
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from schedspec.check.driver import Runner
from schedspec.check.config_space import LOCKSTEP_SPACE
from schedspec.check.random_workloads import random_workload
from schedspec.impl import ImplScheduler
from schedspec.spec.errors import ConfigError
from schedspec.spec.interface import ProtocolError, SchedulerConfig, StepPlan, StepResult
from schedspec.spec.scheduler import SpecScheduler
from schedspec.testing.strategies import configs

from tests.impl.test_lockstep import PROFILE, STEP_COUNT, Lockstep

VOCAB = 12

#: (async_scheduling, num_speculative_tokens > 0) of the four modes, by name
MODE_FLAGS = {"sync": (False, False), "async": (True, False), "spec": (False, True), "async-spec": (True, True)}


def token(rid: str, pos: int) -> int:
    """The fake model's token for request ``rid`` at position ``pos``: fixed
    by both, so in-flight tokens, accepted drafts and every scheduler agree
    (crc32, not hash(): the same in every process)."""
    return zlib.crc32(f"{rid}:{pos}".encode()) % VOCAB


def accepted(rid: str, pos: int, drafts: int, how: str) -> int:
    if how == "all":
        return drafts
    if how == "none":
        return 0
    return zlib.crc32(f"a{rid}:{pos}".encode()) % (drafts + 1)


def model_result(plan: StepPlan, live: Callable[[str], bool], k: int, propose: bool,
                 how: str = "mixed", short_drafts: bool = True) -> StepResult:
    """The model's output for ``plan``: for each entry that samples, the
    accepted drafts (the model's own tokens) and the bonus token, from the
    first position past the known, in-flight and draft positions; with
    ``propose`` (sync speculative decoding) up to k drafts for the next step.
    Requests no longer live get nothing."""
    sampled: dict[str, tuple[int, ...]] = {}
    drafts: dict[str, tuple[int, ...]] = {}
    for s in plan.scheduled:
        rid = s.request_id
        if not s.samples or not live(rid):
            continue
        nd = len(s.spec_token_ids)
        first = s.num_computed_tokens + s.num_scheduled_tokens - nd
        a = accepted(rid, first, nd, how)
        toks = tuple(token(rid, first + j) for j in range(a + 1))
        sampled[rid] = toks
        if propose:
            n = k if not short_drafts else zlib.crc32(f"d{rid}:{first}".encode()) % (k + 2)
            nxt = first + len(toks)
            drafts[rid] = tuple(token(rid, nxt + j) for j in range(min(n, k)))
    return StepResult(sampled, drafts)


def with_mode(cfg: SchedulerConfig, asyn: bool, k: int) -> SchedulerConfig:
    """``cfg`` in a mode, kept valid: the budget holds one decode with its
    drafts, the long-prefill threshold is off or above k."""
    thr = cfg.long_prefill_token_threshold
    if k and 0 < thr <= k:
        thr = 0
    return dataclasses.replace(
        cfg, async_scheduling=asyn, num_speculative_tokens=k,
        max_num_batched_tokens=max(cfg.max_num_batched_tokens, 1 + k), long_prefill_token_threshold=thr,
    )


# ---------------------------------------------------------------- the state machine


class ModesLockstep(Lockstep):
    def __init__(self) -> None:
        super().__init__()
        self.flight: list[tuple[StepPlan, StepPlan]] = []  # (spec's plan, impl's plan), oldest first
        self.done: list[tuple[StepPlan, StepPlan, StepResult]] = []  # updated plans, for "twice"

    @initialize(
        cfg=configs(LOCKSTEP_SPACE),
        prefixes=st.lists(
            st.lists(st.integers(0, 3), min_size=2, max_size=16), min_size=1, max_size=3
        ),
        mode=st.sampled_from(sorted(MODE_FLAGS)),
        k=st.integers(1, 4),
    )
    def setup_mode(self, cfg: SchedulerConfig, prefixes: list[list[int]], mode: str, k: int) -> None:
        asyn, spec = MODE_FLAGS[mode]
        try:
            cfg = with_mode(cfg, asyn, k if spec else 0)
        except ConfigError:
            assume(False)
        self.setup(cfg, prefixes)

    def setup(self, cfg: SchedulerConfig, prefixes: list[list[int]]) -> None:  # type: ignore[override]
        """Not a rule here (setup_mode draws the mode first)."""
        Lockstep.setup(self, cfg, prefixes)

    @property
    def depth(self) -> int:
        assert self.cfg is not None
        return 2 if self.cfg.async_scheduling else 1

    def live_fn(self) -> Callable[[str], bool]:
        assert self.spec is not None
        return lambda rid: rid in self.spec.requests  # type: ignore[union-attr]

    def result_for(self, plan: StepPlan, how: str = "mixed") -> StepResult:
        assert self.cfg is not None
        k = self.cfg.num_speculative_tokens
        return model_result(plan, self.live_fn(), k, k > 0 and not self.cfg.async_scheduling, how)

    def _schedule(self) -> None:
        assert self.spec is not None and self.impl is not None
        if len(self.flight) >= self.depth:
            self.both(lambda s: s.schedule())  # both raise ProtocolError
            return
        pa = self.spec.schedule()
        pb = self.impl.schedule()
        assert pa == pb, f"plans differ:\nspec {pa}\nimpl {pb}"
        self.flight.append((pa, pb))
        self.compare()

    def _update_oldest(self, how: str = "mixed") -> None:
        assert self.spec is not None and self.impl is not None
        if not self.flight:
            self.both(lambda s: s.update(StepPlan(0, (), (), ()), StepResult({})))
            return
        pa, pb = self.flight[0]
        result = self.result_for(pa, how)
        self.spec.update(pa, result)
        self.impl.update(pb, result)
        self.flight.pop(0)
        self.done = [(pa, pb, result)]
        STEP_COUNT[0] += 1
        self.compare()

    # the sync machine's step rules, with a plan in flight where allowed

    @rule(n=st.integers(1, 8) if PROFILE == "ci" else st.integers(1, 48),
          how=st.sampled_from(["mixed", "mixed", "all", "none"]))
    def step(self, n: int, how: str = "mixed") -> None:  # type: ignore[override]
        for _ in range(n):
            self._schedule()
            if len(self.flight) >= self.depth:
                self._update_oldest(how)

    @rule()
    def schedule_only(self) -> None:
        self._schedule()

    @rule(how=st.sampled_from(["mixed", "all", "none"]))
    def update_only(self, how: str = "mixed") -> None:  # type: ignore[override]
        self._update_oldest(how)

    def bad_update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Not a rule here: bad_update_in_flight replaces it."""
        raise AssertionError("not a rule of this machine")

    @precondition(lambda self: bool(self.flight) or bool(self.done))
    @rule(data=st.data(), how=st.sampled_from(
        ["out_of_order", "twice", "drafts_unplanned", "drafts_too_many", "drafts_prefill",
         "too_many_tokens", "no_tokens", "drafts_not_tuple", "drafts_negative"]
    ))
    def bad_update_in_flight(self, data: st.DataObject, how: str) -> None:
        assert self.cfg is not None and self.spec is not None
        k = self.cfg.num_speculative_tokens
        if how == "twice" or not self.flight:
            if not self.done:
                return
            pa, pb, result = self.done[0]
            self.both(lambda s: s.update(pa if s is self.spec else pb, result))
            return
        if how == "out_of_order":
            if len(self.flight) < 2:
                return
            pa, pb = self.flight[1]
            self.both(lambda s: s.update(pa if s is self.spec else pb, self.result_for(pa)))
            return
        pa, pb = self.flight[0]
        good = self.result_for(pa)
        sampled = dict(good.sampled)
        drafts = dict(good.draft_token_ids)
        planned = [s for s in pa.scheduled if s.request_id in self.spec.requests]
        if how == "drafts_unplanned":
            drafts["zz-unplanned"] = (1,)
        elif how == "drafts_too_many" and planned:
            s = data.draw(st.sampled_from(planned))
            drafts[s.request_id] = (1,) * (k + 1)
        elif how == "drafts_prefill":
            chunks = [s for s in planned if not s.samples]
            if not chunks:
                return
            drafts[data.draw(st.sampled_from(chunks)).request_id] = (1,)
        elif how == "too_many_tokens" and sampled:
            rid = data.draw(st.sampled_from(sorted(sampled)))
            entry = pa.get(rid)
            assert entry is not None
            sampled[rid] = (1,) * (len(entry.spec_token_ids) + 2)
        elif how == "no_tokens" and sampled:
            sampled[data.draw(st.sampled_from(sorted(sampled)))] = ()
        elif how == "drafts_not_tuple" and planned:
            drafts[data.draw(st.sampled_from(planned)).request_id] = [1]  # type: ignore[assignment]
        elif how == "drafts_negative" and planned:
            drafts[data.draw(st.sampled_from(planned)).request_id] = (-1,)
        result = StepResult(sampled, drafts)
        kind, _ = self.both(lambda s: s.update(pa if s is self.spec else pb, result))
        if kind == "ok":  # the change happened to leave a valid result
            self.flight.pop(0)
            self.done = [(pa, pb, result)]
            STEP_COUNT[0] += 1


ModesLockstepTest = ModesLockstep.TestCase
ModesLockstepTest.settings = settings.get_profile(f"impl-{PROFILE}")
if os.environ.get("IMPL_LOCKSTEP_EXAMPLES"):
    ModesLockstepTest.settings = settings(
        ModesLockstepTest.settings, max_examples=int(os.environ["IMPL_LOCKSTEP_EXAMPLES"])
    )


# ---------------------------------------------------------------- the check engine's workloads

#: rules of the spec each mode's seeded workloads must reach (so a generator
#: that stopped exercising them fails here rather than passing vacuously)
MUST_REACH = {
    "sync": ("preempt.fcfs_tail", "kv.hit_full"),
    "async": ("async.placeholders_added", "async.stale_output", "running.skip_max_tokens_in_flight",
              "async.stale_dropped", "async.stale_output_stopped"),
    "spec": ("spec.drafts_scheduled", "spec.some_rejected", "spec.all_accepted", "spec.drafts_set",
             "admit.padded_decode", "spec.stop_inside_run"),
    "async-spec": ("async.placeholders_added", "async.stale_output", "spec.drafts_scheduled",
                   "spec.some_rejected", "admit.padded_decode", "spec.stop_inside_run"),
}


@pytest.mark.parametrize("mode", sorted(MODE_FLAGS))
def test_check_engine_workloads_in_lockstep(mode: str) -> None:
    rules: Counter[str] = Counter()
    runs = 0
    for seed in range(60):
        try:
            w = random_workload(seed, 60, modes=(mode,))
        except ConfigError:
            continue  # a drawn config the mode cannot take
        runner = Runner(w.config, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed,
                        check_invariants=False)
        failure = runner.run(w.events) or runner.drain()
        assert failure is None, f"{mode} seed {seed}: " + failure.describe()
        spec = runner.scheds["spec"]
        assert isinstance(spec, SpecScheduler)
        rules.update(spec.rules)
        runs += 1
    assert runs >= 50
    missing = [r for r in MUST_REACH[mode] if not rules[r]]
    assert not missing, f"{mode}: never reached {missing}"


# ---------------------------------------------------------------- the hand-driven loop


def drive(scheds: list[Any], cfg: SchedulerConfig, flights: list[list[StepPlan]],
          how: str = "mixed") -> None:
    """One engine step by hand on each of ``scheds`` (the first one's request
    table says which requests are live): schedule while the protocol allows,
    then, once the flight is full, update the oldest plan with one
    ``model_result``, the same for all."""
    k = cfg.num_speculative_tokens
    depth = 2 if cfg.async_scheduling else 1
    for sched, flight in zip(scheds, flights):
        flight.append(sched.schedule())
    if len(flights[0]) >= depth:
        plan = flights[0][0]
        live = set(scheds[0].view().requests)
        result = model_result(plan, live.__contains__, k, k > 0 and not cfg.async_scheduling, how)
        for sched, flight in zip(scheds, flights):
            sched.update(flight.pop(0), result)


def test_a_plan_in_flight_by_hand() -> None:
    """Async + drafts by hand: the second plan counts the first one's output
    as placeholders (-1 positions, then -1 drafts), a rejected draft rolls
    back, and both schedulers agree at every point; the protocol's errors
    (a third plan, an update out of order, the same update twice) are equal
    and change nothing."""
    from schedspec.spec.interface import RequestSpec

    cfg = SchedulerConfig(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=4,
                          max_model_len=40, async_scheduling=True, num_speculative_tokens=2)
    spec, impl = SpecScheduler(cfg), ImplScheduler(cfg)
    for s in (spec, impl):
        s.add(RequestSpec("a", (1, 2, 3, 4, 5), 20))
        s.add(RequestSpec("b", (1, 2, 3, 4, 6, 7), 20))
    p1 = spec.schedule()
    assert impl.schedule() == p1 and spec.view() == impl.view()
    p2 = spec.schedule()
    assert impl.schedule() == p2 and spec.view() == impl.view()
    a2 = p2.get("a")
    assert a2 is not None and a2.num_output_placeholders == 1 and a2.spec_token_ids == (-1, -1)
    assert a2.token_ids == (-1, -1, -1)  # the in-flight output, then the placeholder drafts
    for bad in (lambda s: s.schedule(), lambda s: s.update(p2, StepResult({}))):
        errors = []
        for s in (spec, impl):
            before = s.view()
            with pytest.raises(ProtocolError) as exc:
                bad(s)
            errors.append(str(exc.value))
            assert s.view() == before
        assert errors[0] == errors[1]
    r1 = StepResult({"a": (9,), "b": (8,)})
    spec.update(p1, r1)
    impl.update(p1, r1)
    assert spec.view() == impl.view()
    with pytest.raises(ProtocolError) as twice_spec:
        spec.update(p1, r1)
    with pytest.raises(ProtocolError) as twice_impl:
        impl.update(p1, r1)
    assert str(twice_spec.value) == str(twice_impl.value)
    r2 = StepResult({"a": (9, 10), "b": (8,)})  # a: one draft accepted, one rejected
    spec.update(p2, r2)
    impl.update(p2, r2)
    assert spec.view() == impl.view()
    va = impl.view().requests["a"]
    assert va.output_token_ids == (9, 9, 10) and va.num_output_placeholders == 0
    assert va.num_computed_tokens == 7  # the rejected draft rolled back


@pytest.mark.parametrize("mode", sorted(MODE_FLAGS))
def test_reset_and_abort_with_a_plan_in_flight(mode: str) -> None:
    """reset_prefix_cache(reset_running_requests=True) and aborts while a plan
    is in flight (async) or between steps: the stale output is dropped or
    delivered as the spec says, and spec and impl agree throughout."""
    from schedspec.spec.interface import RequestSpec

    asyn, spec_on = MODE_FLAGS[mode]
    cfg = with_mode(SchedulerConfig(block_size=2, num_blocks=13, max_num_batched_tokens=16, max_num_seqs=3,
                                    max_model_len=24), asyn, 2 if spec_on else 0)
    spec, impl = SpecScheduler(cfg), ImplScheduler(cfg)
    fs: list[StepPlan] = []
    fi: list[StepPlan] = []
    n = 0
    for i in range(40):
        if i % 3 == 0:
            n += 1
            for s in (spec, impl):
                s.add(RequestSpec(f"r{n}", (1, 2, 3, n % 3), 6 + n % 5, stop_token_ids=(7,)))
        drive([spec, impl], cfg, [fs, fi])
        assert fs == fi and spec.view() == impl.view()
        if i % 7 == 3 and spec.requests:
            victim = sorted(spec.requests)[0]
            spec.abort(victim)
            impl.abort(victim)
        if i % 5 == 2:
            assert spec.reset_prefix_cache(True) == impl.reset_prefix_cache(True)
        assert spec.view() == impl.view()


@pytest.mark.skipif(not os.environ.get("IMPL_DEEP_STEPS"), reason="the deep run: set IMPL_DEEP_STEPS=N")
def test_deep_run_with_async_scheduling_and_drafts() -> None:
    """The deep run (opt-in): seeded check-engine workloads of 200 steps in
    the async, spec and async-spec modes (async-spec twice as often) until
    IMPL_DEEP_STEPS steps; plans compared at every step, views at the end of
    each workload and after every operation in every IMPL_DEEP_VIEWS_EVERY-th
    workload (default 10). Seeds from IMPL_DEEP_SEED (default 100000). A
    violation the spec itself shows (the fake model's context checks) ends
    that workload and is reported, not counted as a divergence."""
    import time

    target = int(os.environ["IMPL_DEEP_STEPS"])
    views_every = int(os.environ.get("IMPL_DEEP_VIEWS_EVERY", "10"))
    seed = int(os.environ.get("IMPL_DEEP_SEED", "100000"))
    modes = ("async-spec", "async", "spec", "async-spec")
    steps = workloads = 0
    spec_findings: list[str] = []
    started = time.time()
    while steps < target:
        mode = modes[seed % len(modes)]
        try:
            w = random_workload(seed, 200, modes=(mode,))
        except ConfigError:
            seed += 1
            continue
        runner = Runner(w.config, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed,
                        check_invariants=False, compare_views=workloads % views_every == 0)
        failure = runner.run(w.events) or runner.drain() or runner.compare_final_views()
        if failure is not None:
            assert failure.kind == "violation" and failure.scheduler == "spec", (
                f"{mode} seed {seed}: " + failure.describe())
            spec_findings.append(f"{mode} seed {seed}: {failure.describe()}")
        steps += sum(1 for e in w.events if type(e).__name__ in ("Step", "Schedule"))
        workloads += 1
        seed += 1
    print(f"\ndeep run: {steps} steps in {workloads} workloads, {time.time() - started:.0f} s; "
          f"{len(spec_findings)} spec finding(s)")
    for f in spec_findings:
        print(f)
