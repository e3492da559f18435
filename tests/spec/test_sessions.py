"""spec/sessions.py: streaming-input sessions (resumable requests), as vLLM
0.33's scheduler.py runs them (add_request, _handle_stopped_request,
_update_request_as_session, the WAITING loop's slot count)."""

from __future__ import annotations

import pytest

from schedspec.spec.interface import (
    Policy,
    RequestError,
    RequestSpec,
    RequestStatus,
    SchedulerConfig,
    SessionUpdate,
    StepPlan,
    StepResult,
    supports_sessions,
)
from schedspec.spec.scheduler import SpecScheduler

S = RequestStatus


def _cfg(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(block_size=4, num_blocks=32, max_num_batched_tokens=16, max_num_seqs=4,
                                   max_model_len=64)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def _result(plan: StepPlan, token: int = 9) -> StepResult:
    return StepResult(sampled={e.request_id: (token,) for e in plan.scheduled if e.samples})


def _step(s: SpecScheduler, token: int = 9) -> StepPlan:
    plan = s.schedule()
    s.update(plan, _result(plan, token))
    return plan


def _session(s: SpecScheduler, rid: str = "s", prompt: tuple[int, ...] = (1, 2, 3, 4, 5), max_tokens: int = 2) -> None:
    s.add(RequestSpec(rid, prompt, max_tokens=max_tokens, resumable=True))


def test_a_stopped_session_waits_for_input_keeping_its_blocks_and_a_slot() -> None:
    s = SpecScheduler(_cfg())
    assert supports_sessions(s)
    _session(s)
    _step(s)
    _step(s)  # max_tokens 2 reached: the session stops and waits
    v = s.view()
    r = v.requests["s"]
    assert r.status == S.WAITING_FOR_STREAMING_REQ and "s" not in v.finished
    assert r.all_token_ids == (1, 2, 3, 4, 5, 9, 9) and r.num_computed_tokens == 6
    assert r.block_ids and v.waiting == ("s",) and s.num_waiting_for_streaming_input == 1
    plan = _step(s)  # the WAITING loop passes it over
    assert not plan.scheduled and s.rules["sessions.skip_waiting_for_input"] >= 1


def test_a_chunk_updates_the_session_in_place_dropping_the_last_sampled_token() -> None:
    s = SpecScheduler(_cfg())
    _session(s)
    _step(s)
    _step(s)
    blocks = s.view().requests["s"].block_ids
    s.session_update(SessionUpdate("s", (11, 12, 13), max_tokens=3))
    r = s.view().requests["s"]
    assert r.status == S.WAITING and s.num_waiting_for_streaming_input == 0
    # the kept output (9) joined the prompt; the last sampled 9 was dropped
    assert r.spec.prompt_token_ids == (1, 2, 3, 4, 5, 9, 11, 12, 13) and r.output_token_ids == ()
    assert r.spec.max_tokens == 3 and r.num_computed_tokens == 6 and r.block_ids == blocks
    plan = _step(s)
    e = plan.get("s")
    assert e is not None and e.kind.value == "new"
    assert (e.num_computed_tokens, e.num_scheduled_tokens) == (6, 3)
    assert e.block_ids[: len(blocks)] == blocks


def test_a_chunk_sent_while_the_session_runs_is_queued_until_it_stops() -> None:
    s = SpecScheduler(_cfg())
    _session(s)
    _step(s)
    s.session_update(SessionUpdate("s", (21, 22), max_tokens=1))
    assert s.view().requests["s"].status == S.RUNNING and s.rules["sessions.update_queued"] == 1
    _step(s)  # stops: the queued chunk is applied at once
    r = s.view().requests["s"]
    assert r.status == S.WAITING and r.spec.prompt_token_ids == (1, 2, 3, 4, 5, 9, 21, 22)
    assert s.rules["sessions.continued_at_stop"] == 1 and s.num_waiting_for_streaming_input == 0


def test_the_end_finishes_a_waiting_session_aborted_and_a_queued_end_at_its_stop() -> None:
    s = SpecScheduler(_cfg())
    _session(s)
    _session(s, "t", (7, 7, 7))
    free = s.view().kv.num_free_blocks
    _step(s)
    _step(s)
    s.session_update(SessionUpdate("s", end=True))
    assert s.view().finished["s"].status == S.FINISHED_ABORTED and s.num_waiting_for_streaming_input == 1
    s2 = SpecScheduler(_cfg())
    _session(s2)
    _step(s2)
    s2.session_update(SessionUpdate("s", end=True))
    _step(s2)
    assert s2.view().finished["s"].status == S.FINISHED_LENGTH_CAPPED
    assert "s" not in s2.streaming_queues and s2.view().kv.num_free_blocks == free
    s.abort("t")  # an abort of a waiting session gives its slot back
    assert s.num_waiting_for_streaming_input == 0


def test_sessions_waiting_for_input_hold_admission_slots() -> None:
    s = SpecScheduler(_cfg(max_num_seqs=1))
    _session(s)
    _step(s)
    _step(s)
    s.add(RequestSpec("r", (5, 6), max_tokens=2))
    plan = _step(s)
    assert not plan.scheduled and s.view().requests["r"].status == S.WAITING
    assert s.rules["sessions.slots_held"] == 1
    s.session_update(SessionUpdate("s", end=True))
    assert _step(s).get("r") is not None


@pytest.mark.parametrize(
    "update, field",
    [
        (SessionUpdate("nobody", (1,)), "request_id"),
        (SessionUpdate("plain", (1,)), "resumable"),
        (SessionUpdate("s", (1,) * 60), "prompt_token_ids"),
    ],
)
def test_a_bad_update_names_its_field_and_changes_nothing(update: SessionUpdate, field: str) -> None:
    s = SpecScheduler(_cfg())
    _session(s)
    s.add(RequestSpec("plain", (1, 2), max_tokens=2))
    _step(s)
    before = s.view()
    with pytest.raises(RequestError) as err:
        s.session_update(update)
    assert err.value.field == field and s.view() == before and s.streaming_queues["s"] == ()


def test_an_update_after_the_end_or_the_finish_is_refused() -> None:
    s = SpecScheduler(_cfg())
    _session(s)
    _step(s)
    s.session_update(SessionUpdate("s", end=True))
    with pytest.raises(RequestError) as err:
        s.session_update(SessionUpdate("s", (3,)))
    assert err.value.field == "end"
    _step(s)
    with pytest.raises(RequestError) as err:
        s.session_update(SessionUpdate("s", (3,)))
    assert err.value.field == "request_id"


def test_an_empty_chunk_and_unmodelled_sessions_are_refused_naming_the_field() -> None:
    with pytest.raises(RequestError) as err:
        SessionUpdate("s", ())
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(RequestError) as err:
        SessionUpdate("s", (1,), end=True)
    assert err.value.field == "prompt_token_ids"
    s = SpecScheduler(_cfg(policy=Policy.PRIORITY))
    with pytest.raises(RequestError) as err:
        _session(s)
    assert err.value.field == "resumable" and not s.requests
    assert SessionUpdate.from_dict(SessionUpdate("s", (1, 2), 3).to_dict()) == SessionUpdate("s", (1, 2), 3)
    with pytest.raises(RequestError) as err:
        SessionUpdate.from_dict({"request_id": "s", "chunk": [1]})
    assert err.value.field == "chunk"


def test_async_a_session_stopping_with_a_step_in_flight_drops_that_steps_output() -> None:
    s = SpecScheduler(_cfg(async_scheduling=True))
    s.add(RequestSpec("s", (1, 2, 3, 4, 5), max_tokens=8, eos_token_id=9, resumable=True))
    p1 = s.schedule()
    p2 = s.schedule()  # the decode of the next position, a placeholder
    assert p2.get("s") is not None
    s.update(p1, _result(p1))  # eos: it stops, and the frontier is the materialized one
    r = s.requests["s"]
    assert r.status == S.WAITING_FOR_STREAMING_REQ and r.num_computed_tokens == 5
    assert r.num_output_placeholders == 0 and r.drop_stale_output and r.num_stale_output_tokens == 1
    s.session_update(SessionUpdate("s", (4, 4), max_tokens=1))
    s.update(p2, _result(p2, token=3))  # stale: dropped
    assert s.requests["s"].all_token_ids == (1, 2, 3, 4, 5, 4, 4)
    assert s.rules["async.stale_dropped"] == 1
    e = s.schedule().get("s")
    assert e is not None and (e.num_computed_tokens, e.num_scheduled_tokens) == (5, 2)


def test_clones_do_not_share_session_books() -> None:
    s = SpecScheduler(_cfg())
    _session(s)
    _step(s)
    c = s.clone()
    c.session_update(SessionUpdate("s", (3,)))
    assert s.streaming_queues["s"] == () and c.streaming_queues["s"] != ()
