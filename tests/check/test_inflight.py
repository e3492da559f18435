"""The engine with a step in flight: the async drive loop, the finer events,
the fake model's drafts and in-flight fills, trace format version 2 and the
shrinker's respect for the in-flight protocol."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import Counter
from pathlib import Path

import pytest

from schedspec.check import trace as tracefile
from schedspec.check.driver import Runner
from schedspec.check.oracle import ACCEPTANCE_MODES, ContextError, FakeModel
from schedspec.check.shrink import _consistent
from schedspec.check.trace import TraceError
from schedspec.check.config_space import CHECK_SPACE, LOCKSTEP_SPACE, draw_config, with_mode
from schedspec.check.features import MODES, mode_of, parse_modes
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import (
    Abort,
    AddRequest,
    Event,
    EventError,
    ResetPrefixCache,
    Schedule,
    Step,
    Update,
    Workload,
)
from schedspec.spec.interface import (
    RequestSpec,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from schedspec.spec.scheduler import SpecScheduler

SYNC = SchedulerConfig(block_size=2, num_blocks=33, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)
ASYNC = dataclasses.replace(SYNC, async_scheduling=True)
SPEC = dataclasses.replace(SYNC, num_speculative_tokens=3)
ASYNC_SPEC = dataclasses.replace(SYNC, async_scheduling=True, num_speculative_tokens=3)
CONFIGS = {"sync": SYNC, "async": ASYNC, "spec": SPEC, "async-spec": ASYNC_SPEC}


def _req(rid: str, n: int = 3, max_tokens: int = 6) -> RequestSpec:
    return RequestSpec(request_id=rid, prompt_token_ids=tuple(range(1, n + 1)), max_tokens=max_tokens, ignore_eos=True)


class Recorder(SpecScheduler):
    """The spec, logging the order of schedule() and update() calls (the
    workload's: not probed with refused calls, check/rejects.py)."""

    PROTOCOL_ERRORS = False

    log: list[str]

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.log = []

    def schedule(self) -> StepPlan:
        plan = super().schedule()
        self.log.append(f"schedule {plan.step}")
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> None:
        self.log.append(f"update {plan.step}")
        super().update(plan, result)

    def abort(self, request_id: str) -> None:
        self.log.append(f"abort {request_id}")
        super().abort(request_id)


def _recorder(runner: Runner) -> Recorder:
    sched = runner.primary
    assert isinstance(sched, Recorder)
    return sched


# ---------------------------------------------------------------------------
# The drive loop
# ---------------------------------------------------------------------------


def test_async_steps_schedule_the_next_plan_before_updating_the_last() -> None:
    runner = Runner(ASYNC, {"spec": Recorder}, check_invariants=False)
    assert runner.run([AddRequest(_req("a")), Step(), Step(), Step()]) is None
    assert _recorder(runner).log == ["schedule 1", "schedule 2", "update 1", "schedule 3", "update 2"]
    assert runner.in_flight == (3,)


def test_sync_steps_keep_schedule_then_update() -> None:
    runner = Runner(SYNC, {"spec": Recorder}, check_invariants=False)
    assert runner.run([AddRequest(_req("a")), Step(), Step(), Schedule(), Update(step=3)]) is None
    assert _recorder(runner).log == ["schedule 1", "update 1", "schedule 2", "update 2", "schedule 3", "update 3"]
    assert runner.in_flight == ()


def test_an_abort_between_schedule_n_plus_1_and_update_n_is_expressible() -> None:
    runner = Runner(ASYNC, {"spec": Recorder}, check_invariants=False)
    events: list[Event] = [AddRequest(_req("a")), AddRequest(_req("b")), Step(), Schedule(), Abort("a"), Update(step=1)]
    assert runner.run(events) is None
    assert _recorder(runner).log[-4:] == ["schedule 1", "schedule 2", "abort a", "update 1"]
    assert runner.in_flight == (2,)


@pytest.mark.parametrize(
    ("config", "events", "why"),
    [
        (ASYNC, [Update()], "update with no plan in flight"),
        (ASYNC, [Schedule(), Update(step=2)], "update for step 2, which was never planned"),
        (ASYNC, [Schedule(), Update(), Update(step=1)], "update for step 1, which was already updated"),
        (ASYNC, [Schedule(), Schedule(), Update(step=2)], "update for step 2 out of order"),
        (ASYNC, [Schedule(), Schedule(), Schedule()], "schedule with steps 1 and 2 in flight"),
        (ASYNC, [Schedule(), Schedule(), Step()], "schedule with steps 1 and 2 in flight"),
        (ASYNC, [Schedule(), Schedule(), ResetPrefixCache()], "reset_prefix_cache with step(s) [1, 2] in flight"),
        (SYNC, [Schedule(), Schedule()], "without async scheduling every plan is updated"),
        (SYNC, [Schedule(), Step()], "without async scheduling every plan is updated"),
        (SYNC, [Schedule(), ResetPrefixCache()], "reset_prefix_cache with step(s) [1] in flight"),
    ],
)
def test_an_event_that_breaks_the_in_flight_protocol_raises_and_changes_nothing(
    config: SchedulerConfig, events: list[Event], why: str
) -> None:
    runner = Runner(config, {"spec": Recorder}, check_invariants=False)
    assert runner.run([AddRequest(_req("a"))]) is None
    with pytest.raises(EventError, match=re.escape(why)):
        runner.run(events)
    log, in_flight = list(_recorder(runner).log), runner.in_flight
    with pytest.raises(EventError):
        runner.apply(events[-1])
    assert _recorder(runner).log == log and runner.in_flight == in_flight


@pytest.mark.parametrize("mode", MODES)
def test_run_to_completion_drains_the_plan_in_flight(mode: str) -> None:
    runner = Runner(CONFIGS[mode], {"spec": Recorder})
    events: list[Event] = [AddRequest(_req("a", 5)), AddRequest(_req("b", 2)), Step(), AddRequest(_req("c", 7))]
    assert runner.run_to_completion(events) is None
    assert runner.pending == [] and runner.in_flight == ()
    log = _recorder(runner).log
    scheduled = [e for e in log if e.startswith("schedule")]
    updated = [e for e in log if e.startswith("update")]
    assert [e.split()[1] for e in scheduled] == [e.split()[1] for e in updated]
    assert set(runner.finished) == {"a", "b", "c"}
    for rid, rv in runner.finished.items():
        assert list(rv.all_token_ids) == runner.truth[rid][: rv.num_tokens]
        assert len(rv.output_token_ids) == 6


def test_a_failure_with_a_plan_in_flight_says_which_steps_are_in_flight() -> None:
    class Crashes(SpecScheduler):
        def abort(self, request_id: str) -> None:
            raise RuntimeError("no")

    runner = Runner(ASYNC, {"spec": Crashes}, check_invariants=False)
    failure = runner.run([AddRequest(_req("a")), Step(), Schedule(), Abort("a")])
    assert failure is not None and failure.in_flight == (1, 2)
    assert "step(s) 1, 2 in flight" in failure.describe()
    sync_failure = Runner(SYNC, {"spec": Crashes}, check_invariants=False).run([AddRequest(_req("a")), Abort("a")])
    assert sync_failure is not None and "in flight" not in sync_failure.describe()


def test_the_transitions_name_the_plans_in_flight() -> None:
    seen: list[tuple[str, tuple[int, ...]]] = []
    runner = Runner(ASYNC, {"spec": SpecScheduler}, invariants=())
    monitor = runner.monitors["spec"]
    observe = monitor.observe

    def spy(t):  # type: ignore[no-untyped-def]
        seen.append((t.kind, tuple(p.step for p in t.in_flight)))
        return observe(t)

    monitor.observe = spy  # type: ignore[method-assign]
    runner.run([AddRequest(_req("a")), Step(), Step()])
    assert seen == [("add", ()), ("schedule", (1,)), ("schedule", (1, 2)), ("update", (2,))]


# ---------------------------------------------------------------------------
# The fake model
# ---------------------------------------------------------------------------


def _sampled_lengths(config: SchedulerConfig, acceptance: str, seeds: range = range(6)) -> Counter[tuple[int, int]]:
    """(drafts verified, tokens sampled) over spec runs of random workloads,
    for running requests (a new or resumed request's drafts are -1 padding the
    model has no proposal for, so never accepted)."""
    out: Counter[tuple[int, int]] = Counter()
    for seed in seeds:
        w = random_workload(seed, 40)
        cfg = dataclasses.replace(w.config, async_scheduling=config.async_scheduling)
        cfg = with_mode(cfg, async_scheduling=config.async_scheduling, num_speculative_tokens=3)
        runner = Runner(cfg, {"spec": SpecScheduler}, oracle_seed=seed, check_invariants=False,
                        keep_history=True, acceptance=acceptance)
        assert runner.run_to_completion(w.events) is None
        assert runner.history is not None
        for rec in runner.history:
            assert rec.result is not None
            for s in rec.plan.scheduled:
                if s.request_id in rec.result.sampled and s.kind is ScheduleKind.RUNNING:
                    out[(len(s.spec_token_ids), len(rec.result.sampled[s.request_id]))] += 1
    return out


@pytest.mark.parametrize("config", [SPEC, ASYNC_SPEC], ids=["spec", "async-spec"])
def test_acceptance_all_accepts_every_draft_and_none_accepts_none(config: SchedulerConfig) -> None:
    every = _sampled_lengths(config, "all")
    assert all(n == 1 + d for d, n in every) and any(d == 3 for d, _ in every)
    nothing = _sampled_lengths(config, "none")
    assert all(n == 1 for _, n in nothing) and any(d == 3 for d, _ in nothing)


@pytest.mark.parametrize("config", [SPEC, ASYNC_SPEC], ids=["spec", "async-spec"])
def test_acceptance_prefix_reaches_every_accepted_count(config: SchedulerConfig) -> None:
    counts = _sampled_lengths(config, "prefix")
    assert {n for d, n in counts if d == 3} == {1, 2, 3, 4}


def test_the_acceptance_mode_follows_the_oracle_seed_unless_given() -> None:
    assert [FakeModel(2, seed=s).acceptance for s in range(3)] == list(ACCEPTANCE_MODES)
    assert FakeModel(2, seed=0, acceptance="none").acceptance == "none"
    with pytest.raises(ValueError, match="acceptance must be one of"):
        FakeModel(2, acceptance="most")


def _entry(rid: str, computed: int, tokens: tuple[int, ...], num_tokens: int, blocks: tuple[int, ...],
           placeholders: int = 0, drafts: tuple[int, ...] = (), kind: ScheduleKind = ScheduleKind.RUNNING
           ) -> ScheduledRequest:
    return ScheduledRequest(rid, kind, computed, len(tokens), num_tokens, blocks, tokens, drafts, placeholders)


def test_greedy_verification_takes_the_accepted_drafts_then_the_bonus_token() -> None:
    model = FakeModel(4, vocab=64, seed=1, num_speculative_tokens=2, acceptance="all")
    first = model.execute(StepPlan(1, (_entry("a", 0, (5, 6, 7), 3, (1,), kind=ScheduleKind.NEW),), (), ()))
    bonus = first.sampled["a"]
    drafts = first.draft_token_ids["a"]
    assert len(bonus) == 1 and len(drafts) == 2
    # the drafts of mode "all" are exactly what the model then samples
    second = model.execute(StepPlan(2, (_entry("a", 3, bonus + drafts, 4, (1, 2), drafts=drafts),), (), ()))
    assert second.sampled["a"][:2] == drafts and len(second.sampled["a"]) == 3
    # a wrong first draft: only the bonus token
    model2 = FakeModel(4, vocab=64, seed=1, num_speculative_tokens=2, acceptance="all")
    model2.execute(StepPlan(1, (_entry("a", 0, (5, 6, 7), 3, (1,), kind=ScheduleKind.NEW),), (), ()))
    wrong = ((drafts[0] + 1) % 64, drafts[1])
    third = model2.execute(StepPlan(2, (_entry("a", 3, bonus + wrong, 4, (1, 2), drafts=wrong),), (), ()))
    assert third.sampled["a"] == (drafts[0],)


def test_in_flight_placeholders_are_filled_from_the_models_own_output() -> None:
    sync_model = FakeModel(4, seed=3, num_speculative_tokens=2, acceptance="prefix")
    async_model = FakeModel(4, seed=3, num_speculative_tokens=2, acceptance="prefix")
    first = _entry("a", 0, (5, 6, 7), 3, (1, 2), kind=ScheduleKind.NEW)
    out1 = sync_model.execute(StepPlan(1, (first,), (), ()))
    assert async_model.execute(StepPlan(1, (first,), (), ())) == out1
    drafts = out1.draft_token_ids["a"]
    # sync: the scheduler knows the token and the drafts
    known = _entry("a", 3, out1.sampled["a"] + drafts, 4, (1, 2), drafts=drafts)
    # async: the same step planned before the update, with -1 for both
    placeholder = _entry("a", 3, (-1, -1, -1), 3, (1, 2), placeholders=1, drafts=(-1, -1))
    assert async_model.execute(StepPlan(2, (placeholder,), (), ())) == sync_model.execute(StepPlan(2, (known,), (), ()))


def test_a_placeholder_with_nothing_in_flight_is_a_context_error() -> None:
    model = FakeModel(4, seed=3)
    bogus = _entry("a", 3, (-1,), 3, (1,), placeholders=1, kind=ScheduleKind.RUNNING)
    with pytest.raises(ContextError, match="a -1 placeholder where the model has sampled nothing"):
        model.execute(StepPlan(1, (bogus,), (), ()))


class SwapsBlocks(SpecScheduler):
    """Hands the model a block table with its first two blocks swapped once a
    request holds four (the scheduler's own state stays right). Its update()
    takes only the plans it made, so it is not probed with refused calls."""

    PROTOCOL_ERRORS = False

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.real: dict[int, StepPlan] = {}

    def schedule(self) -> StepPlan:
        plan = super().schedule()
        entries = []
        for s in plan.scheduled:
            if len(s.block_ids) >= 4 and s.samples:
                s = dataclasses.replace(s, block_ids=(s.block_ids[1], s.block_ids[0]) + s.block_ids[2:])
            entries.append(s)
        bad = dataclasses.replace(plan, scheduled=tuple(entries))
        self.real[bad.step] = plan
        return bad

    def update(self, plan: StepPlan, result: StepResult) -> None:
        super().update(self.real.pop(plan.step), result)


@pytest.mark.parametrize("mode", MODES)
def test_the_context_check_still_catches_a_wrong_block_table(mode: str) -> None:
    runner = Runner(CONFIGS[mode], {"bad": SwapsBlocks}, check_invariants=False)
    failure = runner.run_to_completion([AddRequest(_req("a", 5, max_tokens=12))])
    assert failure is not None and failure.violations[0].invariant_id == "kv-context"


def test_a_recorded_output_replaces_the_models_tokens_and_drafts() -> None:
    runner = Runner(SPEC, {"spec": SpecScheduler}, check_invariants=False, keep_history=True)
    events: list[Event] = [
        AddRequest(_req("a")),
        Schedule(StepResult(sampled={"a": (9,)}, draft_token_ids={"a": (8, 7)})),
        Update(step=1),
        Step(),
    ]
    assert runner.run(events) is None
    assert runner.truth["a"][3] == 9
    assert runner.history is not None and runner.history[1].plan.scheduled[0].spec_token_ids == (8, 7)
    too_many = Runner(SPEC, {"spec": SpecScheduler}, check_invariants=False).run(
        [AddRequest(_req("a")), Schedule(StepResult(sampled={"a": (9, 9)}))])
    assert too_many is not None and too_many.kind == "error" and "takes 1 to 1" in too_many.message


# ---------------------------------------------------------------------------
# Modes and random workloads
# ---------------------------------------------------------------------------


def test_sync_random_workloads_are_the_ones_each_seed_always_gave() -> None:
    """A digest of the traces of random_workload(seed, 50) for seeds 0-29,
    taken before the admission gates existed (and equal to the one taken
    before the modes existed); with no gate every seed still draws it."""
    h = hashlib.sha256()
    for seed in range(30):
        w = random_workload(seed, 50)
        assert w == random_workload(seed, 50, modes=("sync",)) == random_workload(seed, 50, gates=())
        h.update(tracefile.dumps(tracefile.Trace(w)).encode())
    assert h.hexdigest() == "7be771e54f33170dc02a6c24e6763f09364e0850265553298379e890c09b43fd"


def test_random_workloads_of_every_mode_are_the_ones_each_seed_gave_before_the_gates() -> None:
    h = hashlib.sha256()
    for seed in range(40):
        w = random_workload(seed, 40, modes=MODES)
        h.update(tracefile.dumps(tracefile.Trace(w)).encode())
    assert h.hexdigest() == "ef96075bb2052119858693f194713c2d9de703552916070095f1e6293ee317e6"


def test_the_check_space_mixes_every_mode() -> None:
    found = Counter(mode_of(random_workload(seed, 5, modes=CHECK_SPACE.modes).config) for seed in range(40))
    assert set(found) == set(MODES)
    async_events = [e for seed in range(40) for e in random_workload(seed, 30, modes=("async",)).events]
    assert any(isinstance(e, Schedule) for e in async_events) and any(isinstance(e, Update) for e in async_events)


def test_draw_config_keeps_k_below_the_threshold_and_the_budget() -> None:
    import random
    from typing import Sequence, TypeVar

    T = TypeVar("T")
    for seed in range(300):
        rng = random.Random(seed)

        def pick(options: Sequence[T]) -> T:
            return rng.choice(options)

        config = draw_config(CHECK_SPACE if seed % 2 else LOCKSTEP_SPACE, pick, lambda p: rng.random() < p)
        k, t = config.num_speculative_tokens, config.long_prefill_token_threshold
        assert k == 0 or t == 0 or t > k
        assert k < config.max_num_batched_tokens


def test_parse_modes() -> None:
    assert parse_modes("async-spec, sync") == ("sync", "async-spec")
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        parse_modes("sync,fast")
    with pytest.raises(ValueError, match="no mode given"):
        parse_modes(" , ")


# ---------------------------------------------------------------------------
# Traces and the shrinker
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_trace_of_every_mode_round_trips(mode: str) -> None:
    w = random_workload(11, 40, modes=(mode,))
    if mode == "spec":
        extra = (AddRequest(_req("x")), Schedule(StepResult({"x": (1, 2)}, {"x": (3,)})), Update(step=41))
        w = dataclasses.replace(w, events=w.events + extra)
    text = tracefile.dumps(tracefile.Trace(w))
    back = tracefile.loads(text)
    assert back.workload.events == w.events and back.config == w.config
    assert text.startswith('{"config"') and (f'"schedspec_trace": {1 if mode == "sync" else 2}' in text.splitlines()[0])


HEADER = ('{"schedspec_trace": 2, "config": {"block_size": 4, "num_blocks": 9, "max_model_len": 16, '
          '"max_num_batched_tokens": 16, "async_scheduling": true, "num_speculative_tokens": 2}}')
ADD = '{"op": "add", "request": {"request_id": "r1", "prompt_token_ids": [1, 2], "max_tokens": 4}}'


@pytest.mark.parametrize(
    ("lines", "line", "field", "message"),
    [
        (['{"op": "update"}'], 3, "op", "update with no plan in flight"),
        (['{"op": "schedule"}', '{"op": "update", "step": 2}'], 4, "step", "never planned"),
        (['{"op": "schedule"}', '{"op": "update"}', '{"op": "update", "step": 1}'], 5, "step", "already updated"),
        (['{"op": "schedule"}', '{"op": "schedule"}', '{"op": "update", "step": 2}'], 5, "step", "out of order"),
        (['{"op": "step"}', '{"op": "schedule"}', '{"op": "schedule"}'], 5, "op", "schedule with steps 1 and 2"),
        (['{"op": "schedule", "result": {"sampled": {"r9": [1]}}}'], 3, "result.sampled.r9", "never added"),
        (['{"op": "abort", "request_id": "r1"}', '{"op": "schedule", "result": {"sampled": {}, '
          '"draft_token_ids": {"r1": [1]}}}'], 4, "result.draft_token_ids.r1", "finished: aborted on line 3"),
        (['{"op": "schedule", "result": {"sampled": {"r1": [1, 2, 3, 4]}}}'], 3, "result.sampled.r1",
         "accepted beyond the drafts"),
        (['{"op": "schedule", "result": {"sampled": {"r1": [1]}, "draft_token_ids": {"r1": [1, 1, 1]}}}'], 3,
         "result.draft_token_ids.r1", "more than num_speculative_tokens"),
        (['{"op": "schedule", "result": {"sampled": {"r1": []}}}'], 3, "result.sampled.r1", "should be non-empty"),
        (['{"op": "update", "step": 0}'], 3, "step", "less than the minimum of 1"),
    ],
)
def test_a_trace_that_breaks_the_in_flight_protocol_is_rejected_at_load(
    lines: list[str], line: int, field: str, message: str
) -> None:
    with pytest.raises(TraceError, match=message) as info:
        tracefile.loads("\n".join([HEADER, ADD, *lines]) + "\n", "t.jsonl")
    assert (info.value.path, info.value.line, info.value.field) == ("t.jsonl", line, field)


def test_a_version_1_trace_cannot_carry_version_2_fields_or_events() -> None:
    with pytest.raises(TraceError, match="needs trace format version 2") as info:
        tracefile.loads(HEADER.replace('"schedspec_trace": 2', '"schedspec_trace": 1') + "\n")
    assert info.value.field == "config.async_scheduling"
    v1 = '{"schedspec_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "max_model_len": 16}}'
    with pytest.raises(TraceError, match="needs trace format version 2") as info:
        tracefile.loads("\n".join([v1, ADD, '{"op": "schedule"}']) + "\n")
    assert (info.value.line, info.value.field) == (3, "op")


def test_every_vector_still_loads() -> None:
    root = Path(__file__).resolve().parents[2] / "vectors"
    paths = sorted(root.rglob("*.jsonl"))
    assert paths
    for path in paths:
        tracefile.read(path)


def test_the_shrinkers_candidates_keep_the_in_flight_protocol() -> None:
    events: list[Event] = [
        AddRequest(_req("a")), Schedule(StepResult({"b": (1,)})), AddRequest(_req("b")),
        Schedule(), Abort("a"), Update(step=1), Update(step=2), Update(step=3), ResetPrefixCache(),
    ]
    # drop the first Schedule: its Update goes, the next is renumbered, the
    # surplus ones go, and the recorded output keeps the requests still added
    kept = _consistent(events[:1] + events[2:], async_scheduling=True)
    assert kept == [AddRequest(_req("a")), AddRequest(_req("b")), Schedule(), Abort("a"), Update(), ResetPrefixCache()]
    dropped_b = _consistent([e for e in events if e != AddRequest(_req("b"))], async_scheduling=True)
    assert dropped_b[1] == Schedule(StepResult({}))
    # in sync mode a second Schedule before its Update is dropped
    assert _consistent([Schedule(), Schedule(), Update(), Update()], async_scheduling=False) == [Schedule(), Update()]
    w = Workload(ASYNC, tuple(kept))
    tracefile.loads(tracefile.dumps(tracefile.Trace(w)))


# ---------------------------------------------------------------------------
# Lockstep in every mode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_two_spec_schedulers_run_in_lockstep_in_every_mode(mode: str) -> None:
    for seed in range(4):
        w = random_workload(seed, 40, modes=(mode,))
        runner = Runner(w.config, {"a": SpecScheduler, "b": SpecScheduler}, oracle_seed=seed, check_invariants=False)
        assert runner.run_to_completion(w.events) is None
        assert runner.compare_final_views() is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("acceptance", ACCEPTANCE_MODES)
def test_a_reset_with_a_plan_in_flight_drops_its_output_and_the_tokens_stay_right(mode: str, acceptance: str) -> None:
    """reset_prefix_cache(reset_running_requests=True) preempts the running
    requests and drops what they had in flight; the driver's record of their
    tokens follows, so the requests resume and finish with the tokens the model
    gives them."""
    runner = Runner(CONFIGS[mode], {"a": SpecScheduler, "b": SpecScheduler}, acceptance=acceptance)
    events: list[Event] = [AddRequest(_req("a", 5, 8)), AddRequest(_req("b", 3, 8)), Step(), Step(), Step(),
                           ResetPrefixCache(True), Step(), Step(), ResetPrefixCache(True)]
    assert runner.run_to_completion(events) is None
    assert runner.stats.resets >= 1 and set(runner.finished) == {"a", "b"}
    for rid, rv in runner.finished.items():
        assert len(rv.output_token_ids) == 8
        assert list(rv.all_token_ids) == runner.truth[rid][: rv.num_tokens]


@pytest.mark.parametrize("mode", MODES)
def test_spec_and_impl_run_in_lockstep_in_every_mode(mode: str) -> None:
    """Plans, model outputs and views equal after every operation, with a step
    in flight and drafts verified, and every invariant held by both."""
    from schedspec.impl.scheduler import ImplScheduler

    for seed in range(6):
        w = random_workload(seed, 60, modes=(mode,))
        runner = Runner(w.config, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed)
        failure = runner.run_to_completion(w.events)
        assert failure is None, failure.describe()
        assert runner.compare_final_views() is None


def test_a_scheduler_without_async_scheduling_gets_an_async_workload_within_the_sync_protocol() -> None:
    from schedspec.check.capabilities import FULL

    w = Workload(ASYNC, (AddRequest(_req("a")), Schedule(), Schedule(), Abort("a"), Update(step=1), Update(step=2), Step()))
    sync = FULL.restrict_workload(w)
    assert not sync.config.async_scheduling
    assert sync.events == (AddRequest(_req("a")), Schedule(), Abort("a"), Update(), Step())
    assert Runner(sync.config, {"spec": SpecScheduler}).run_to_completion(sync.events) is None


class AsyncOnly(SpecScheduler):
    """A scheduler that runs only with async scheduling (as a vLLM
    AsyncScheduler subclass does), declared so."""

    from schedspec.check.capabilities import Capabilities as _Caps

    CAPABILITIES = _Caps(async_scheduling=True, speculative_decoding=True, sync_scheduling=False)
    built: list[SchedulerConfig] = []

    def __init__(self, config: SchedulerConfig) -> None:
        assert config.async_scheduling, "AsyncOnly built without async scheduling"
        AsyncOnly.built.append(config)
        super().__init__(config)


def test_an_async_only_scheduler_is_checked_with_a_step_in_flight_in_every_workload(tmp_path: Path) -> None:
    from schedspec.check.capabilities import Capabilities, CapabilityError
    from schedspec.cli.main import main

    with pytest.raises(CapabilityError, match="sync or async"):
        Capabilities(sync_scheduling=False)
    caps = AsyncOnly.CAPABILITIES
    w = Workload(SYNC, (AddRequest(_req("a")), Step(), Step()))
    assert caps.restrict_workload(w).config == ASYNC
    AsyncOnly.built.clear()
    rc = main(["check", "--against", "tests.check.test_inflight:AsyncOnly", "--steps", "300", "--quiet",
               "--generator", "random", "--out", str(tmp_path)])
    assert rc == 0
    assert AsyncOnly.built and all(c.async_scheduling for c in AsyncOnly.built)
    assert {c.num_speculative_tokens > 0 for c in AsyncOnly.built} == {True, False}
