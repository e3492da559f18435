"""spec/interface.py: the helpers of the interface types (status predicates, legal
transitions, plan and view properties) with exact values."""

from __future__ import annotations

from schedspec.spec import RequestSpec, RequestStatus, ScheduleKind, StepPlan
from schedspec.spec.interface import KVView, RequestView, ScheduledRequest, is_legal_transition


def test_statuses_transitions_and_plan_helpers_answer_as_documented() -> None:
    S = RequestStatus
    assert [s.is_finished for s in S] == [False, False, False, True, True, True, True, False, True, False, False]
    assert is_legal_transition(S.WAITING, S.RUNNING) and is_legal_transition(S.PREEMPTED, S.RUNNING)
    assert not is_legal_transition(S.WAITING, S.PREEMPTED)
    assert is_legal_transition(S.WAITING_FOR_STREAMING_REQ, S.WAITING)
    assert is_legal_transition(S.RUNNING, S.WAITING_FOR_STREAMING_REQ, resumable=True)
    assert not is_legal_transition(S.RUNNING, S.WAITING) and is_legal_transition(S.RUNNING, S.WAITING, True)
    assert not is_legal_transition(S.WAITING_FOR_STREAMING_REQ, S.RUNNING)
    assert not is_legal_transition(S.FINISHED_ABORTED, S.RUNNING)
    a = ScheduledRequest("a", ScheduleKind.NEW, 0, 4, 6, (1, 2), (0, 1, 2, 3))
    b = ScheduledRequest("b", ScheduleKind.RUNNING, 5, 1, 6, (3, 4), (9,))
    assert a.is_prefill_chunk and not a.samples
    assert b.samples and not b.is_prefill_chunk
    assert ScheduledRequest("c", ScheduleKind.NEW, 2, 4, 6, (), ()).samples
    plan = StepPlan(1, (a, b), (), ())
    assert plan.total_num_scheduled_tokens == 5
    assert plan.get("b") is b and plan.get("zz") is None
    assert plan.scheduled_ids == ("a", "b")
    rv = RequestView(RequestSpec("a", (1, 2), 4, cache_salt="q"), S.RUNNING, (3,), 0, (), 0)
    assert rv.num_tokens == 3 and rv.all_token_ids == (1, 2, 3) and rv.salt == "q"
    assert rv.request_id == "a" and rv.block_identity(2) == "q"
    assert RequestView(RequestSpec("a", (1,), 4), S.RUNNING, (), 0, (), 0).salt == ""
    assert KVView(3, 4, (0, 0, 0), (1, 2), {}, {}).num_free_blocks == 2


def test_a_scheduled_entry_built_from_the_known_tokens_derives_its_count_and_slice() -> None:
    """ScheduledRequest.of, the one constructor the spec and the vLLM adapter
    share: num_tokens is all the known tokens, token_ids the scheduled slice."""
    tokens = [10, 11, 12, 13, 14, 15, 16]  # any sequence: vLLM hands over a list
    e = ScheduledRequest.of("r", ScheduleKind.RESUMED, num_computed_tokens=2, num_scheduled_tokens=3,
                            all_token_ids=tokens, block_ids=(4, 5))
    assert e == ScheduledRequest("r", ScheduleKind.RESUMED, 2, 3, 7, (4, 5), (12, 13, 14))
    assert isinstance(e.token_ids, tuple)
    last = ScheduledRequest.of("r", ScheduleKind.RUNNING, num_computed_tokens=6, num_scheduled_tokens=1,
                               all_token_ids=tuple(tokens), block_ids=(4, 5))
    assert last.token_ids == (16,) and last.samples


def test_a_request_view_declares_no_field_of_the_request_it_holds() -> None:
    """A field of the request is declared once, in RequestSpec: the view holds
    the request itself (``view.spec``) and its own fields are the request's
    state in the scheduler."""
    from dataclasses import fields

    assert not {f.name for f in fields(RequestView)} & {f.name for f in fields(RequestSpec)}
    spec = RequestSpec("r", (1, 2, 3), 5, priority=2, lora_id=1)
    view = RequestView.of(spec, status=RequestStatus.WAITING, output_token_ids=(), num_computed_tokens=0,
                          block_ids=(), num_preemptions=0)
    assert view.spec is spec and view.request_id == "r"
