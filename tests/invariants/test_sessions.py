"""The streaming-input sessions' invariants (invariants/sessions.py): each
holds on the spec's transitions with sessions and fires, under its id, on a
crafted transition that breaks it in one place; the whole catalogue stays
silent on the spec over random workloads with sessions in all four modes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.invariants import BY_ID, History, Transition
from schedspec.invariants.sessions import SESSION_STALL_BOUND
from schedspec.spec import RequestSpec, SchedulerConfig, SpecScheduler, StepResult
from schedspec.spec.interface import RequestStatus, SchedulerView, SessionUpdate, StepPlan

SESSION_IDS = (
    "request-in-one-queue",
    "stream-input-not-early",
    "dropped-token-not-computed",
    "stream-liveness",
)

WFS = RequestStatus.WAITING_FOR_STREAMING_REQ


def _cfg(**kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(block_size=4, num_blocks=32, max_num_batched_tokens=16, max_num_seqs=4,
                                max_model_len=64)
    base.update(kw)
    return SchedulerConfig(**base)


def fires(inv_id: str, t: Transition, h: History | None = None) -> list[str]:
    return [v.message for v in BY_ID[inv_id].check(t, h or History())]


def with_request(v: SchedulerView, rid: str, **changes: Any) -> SchedulerView:
    reqs = dict(v.requests)
    reqs[rid] = dataclasses.replace(reqs[rid], **changes)
    return dataclasses.replace(v, requests=reqs)


def _stopped_session() -> tuple[SpecScheduler, SchedulerView, StepPlan, StepResult, SchedulerView]:
    """A session whose second step stops it with a chunk queued: the update goes on."""
    s = SpecScheduler(_cfg())
    s.add(RequestSpec("s", (1, 2, 3, 4, 5), max_tokens=2, resumable=True))
    p = s.schedule()
    s.update(p, StepResult(sampled={"s": (9,)}))
    s.session_update(SessionUpdate("s", (11, 12), max_tokens=2))
    p2 = s.schedule()
    before = s.view()
    result = StepResult(sampled={"s": (8,)})
    s.update(p2, result)
    return s, before, p2, result, s.view()


def test_the_session_invariants_hold_on_a_session_that_goes_on() -> None:
    _, before, plan, result, after = _stopped_session()
    assert after.requests["s"].spec.prompt_token_ids == (1, 2, 3, 4, 5, 9, 11, 12)
    t = Transition("update", before, after, plan=plan, result=result)
    for inv in SESSION_IDS:
        assert fires(inv, t) == [], inv


def test_request_in_one_queue_fires_on_a_request_in_two_queues() -> None:
    _, before, plan, result, after = _stopped_session()
    bad = dataclasses.replace(after, running=("s",))
    assert fires("request-in-one-queue", Transition("update", before, bad, plan=plan, result=result))


def test_session_input_not_early_fires_on_a_chunk_scheduled_before_it_arrives() -> None:
    s = SpecScheduler(_cfg())
    s.add(RequestSpec("s", (1, 2, 3, 4, 5), max_tokens=2, resumable=True))
    before = s.view()
    plan = s.schedule()
    t = Transition("schedule", before, s.view(), plan=plan)
    assert fires("stream-input-not-early", t) == []
    e = plan.scheduled[0]
    early = dataclasses.replace(plan, scheduled=(dataclasses.replace(e, num_scheduled_tokens=7),))
    assert "past its 5 known tokens" in fires("stream-input-not-early", dataclasses.replace(t, plan=early))[0]
    waiting = with_request(before, "s", status=WFS)
    assert "waits for input" in fires("stream-input-not-early", dataclasses.replace(t, before=waiting))[0]


def test_dropped_token_not_computed_fires_when_the_dropped_position_counts() -> None:
    _, before, plan, result, after = _stopped_session()
    t = Transition("update", before, after, plan=plan, result=result)
    r = after.requests["s"]
    bad = with_request(after, "s", num_computed_tokens=r.num_computed_tokens + 2)
    assert "the dropped token is at 6" in fires("dropped-token-not-computed", dataclasses.replace(t, after=bad))[0]
    lost = with_request(after, "s", spec=dataclasses.replace(r.spec, prompt_token_ids=(1, 2, 3, 4, 5, 7, 11, 12)))
    assert fires("dropped-token-not-computed", dataclasses.replace(t, after=lost))
    s2 = SpecScheduler(_cfg())
    s2.add(RequestSpec("w", (1, 2, 3), max_tokens=1, resumable=True))
    p = s2.schedule()
    s2.update(p, StepResult(sampled={"w": (4,)}))
    v = s2.view()
    assert v.requests["w"].status == WFS and fires("dropped-token-not-computed", Transition("update", v, v, p)) == []
    counted = with_request(v, "w", num_computed_tokens=4)
    assert fires("dropped-token-not-computed", Transition("update", v, counted, p))


def test_session_liveness_fires_past_its_bound_of_empty_steps_with_room_to_admit() -> None:
    s = SpecScheduler(_cfg())
    s.add(RequestSpec("s", (1, 2, 3), max_tokens=1, resumable=True))
    p = s.schedule()
    s.update(p, StepResult(sampled={"s": (4,)}))  # the session waits for input
    s.add(RequestSpec("r", (5, 6), max_tokens=2))
    before = s.view()
    empty = StepPlan(step=2, scheduled=(), preempted_ids=(), finished_ids=())
    t = Transition("schedule", before, before, plan=empty, in_flight=(empty,))
    h = History()
    found: list[str] = []
    for _ in range(SESSION_STALL_BOUND + 1):
        found = fires("stream-liveness", t, h)
    assert found and "empty steps in a row" in found[0]
    h2 = History()
    admitted = s.schedule()  # the spec admits r at once
    assert admitted.get("r") is not None
    assert fires("stream-liveness", dataclasses.replace(t, plan=admitted), h2) == []


@pytest.mark.parametrize("modes", [("sync",), ("async",), ("spec",), ("async-spec",)])
def test_the_catalogue_is_silent_on_the_spec_with_sessions_but_for_the_liveness_bound(modes: tuple[str, ...]) -> None:
    steps = 0
    for seed in range(6):
        w = random_workload(seed, 80, modes=modes, sessions=True)
        r = Runner(w.config, {"spec": SpecScheduler}, oracle_seed=seed)
        for e in w.events:
            f = r.apply(e)
            if f is not None:
                assert {v.invariant_id for v in f.violations} == {"stream-liveness"}, f.message
                break
        steps += r.stats.steps
    assert steps > 200
