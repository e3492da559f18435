"""Spec and impl side by side (tests.helpers.Twin): scenarios that pin a rule with
exact numbers, or take impl off its fast path, with equal outcomes and equal
views after every operation."""

from __future__ import annotations

import contextlib

from schedspec.spec import Policy, RequestStatus, StepResult

from tests.helpers import BothRaised, Tok, Twin, cfg, entries, req


def test_int_subclass_tokens_take_the_plain_path_and_decide_alike() -> None:
    t = Twin(cfg(max_num_batched_tokens=12))
    t.add(req("a", 3, max_tokens=3))
    t.add(req("b", 3, max_tokens=1))
    t.add(req("c", 3, max_tokens=5, eos_token_id=9))
    t.add(req("d", 6, max_tokens=5))
    p = t.schedule()  # a, b and c sample; d gets a partial chunk
    assert entries(p)[-1] == ("d", "new", 0, 3)
    t.update(p, StepResult({"a": (Tok(4),), "b": (Tok(5),), "c": (Tok(9),)}))
    v = t.impl.view()
    assert v.requests["a"].output_token_ids == (4,)
    assert v.finished["b"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert v.finished["c"].status == RequestStatus.FINISHED_STOPPED
    p = t.schedule()
    assert [e.token_ids for e in p.scheduled if e.request_id == "a"] == [(4,)]
    t.update(p, StepResult({"a": (Tok(6),), "d": (Tok(2),)}))
    t.step()
    t.step()


def test_reset_prefix_cache_default_keeps_running_requests() -> None:
    t = Twin(cfg())
    t.add(req("a", 9, max_tokens=5))
    t.step()
    assert t.both(lambda s: s.reset_prefix_cache()) is False
    assert t.impl.view().requests["a"].status == RequestStatus.RUNNING


def test_aborting_the_first_waiting_request_under_priority_keeps_the_order() -> None:
    t = Twin(cfg(policy=Policy.PRIORITY, max_num_seqs=1))
    t.add(req("a", 3, priority=0))
    t.add(req("b", 3, priority=1))
    t.add(req("c", 3, priority=1))
    t.abort("a")
    assert t.schedule().scheduled_ids == ("b",)
    t.abort("c")
    t.abort("b")


def test_a_reported_request_id_can_come_back_under_priority() -> None:
    t = Twin(cfg(policy=Policy.PRIORITY, max_num_seqs=1))
    t.add(req("x", 3, max_tokens=1))
    t.add(req("r", 3, priority=2, arrival=4))
    t.abort("r")
    t.add(req("s", 3, priority=2, arrival=4))
    t.step()  # x runs and finishes
    t.step()  # reports x, runs s
    t.add(req("r", 3, priority=2, arrival=4))  # the id of an aborted, reported request comes back
    t.add(req("q", 3, priority=2, arrival=4))
    for _ in range(16):
        t.step()
    assert not t.impl.view().requests


def test_priority_victim_scheduled_earlier_gives_its_budget_back() -> None:
    # lo runs ahead of hi and x; when hi needs a block, lo (the greatest (priority,
    # arrival)) is preempted after it was scheduled: its token returns to the
    # budget and x's prefill chunk takes it.
    t = Twin(cfg(policy=Policy.PRIORITY, block_size=4, max_model_len=16, num_blocks=5, max_num_seqs=3,
                 max_num_batched_tokens=6, enable_prefix_caching=False, scheduler_reserve_full_isl=False))
    t.add(req("lo", [1, 2, 3, 4], max_tokens=10, priority=2, arrival=0))
    t.step()
    t.add(req("hi", [5, 6, 7, 8], max_tokens=10, priority=0, arrival=1))
    t.add(req("x", [9] * 8, max_tokens=10, priority=1, arrival=2))
    assert entries(t.step()) == [("lo", "running", 4, 1), ("hi", "new", 0, 4), ("x", "new", 0, 1)]
    p = t.step()
    assert p.preempted_ids == ("lo",)
    assert entries(p) == [("hi", "running", 4, 1), ("x", "running", 1, 5)]


def test_chunked_prefill_off_admission_stops_at_a_prompt_over_the_budget() -> None:
    t = Twin(cfg(enable_chunked_prefill=False, max_num_batched_tokens=32, scheduler_reserve_full_isl=False))
    t.add(req("a", 20))
    t.add(req("b", [5] * 20))
    t.add(req("c", [6] * 2))
    assert entries(t.step()) == [("a", "new", 0, 20)]
    assert entries(t.step()) == [("a", "running", 20, 1)]  # b waits for blocks, c behind it
    t = Twin(cfg(enable_chunked_prefill=False, max_num_batched_tokens=32))
    t.add(req("a", 16))
    t.add(req("b", [5] * 16))  # fits the 16 tokens left exactly
    assert entries(t.step()) == [("a", "new", 0, 16), ("b", "new", 0, 16)]


def test_the_plain_path_takes_an_aborted_entry_and_token_zero() -> None:
    t = Twin(cfg())
    for rid in "abc":
        t.add(req(rid, 3, max_tokens=4))
    p = t.schedule()
    t.abort("a")
    t.update(p, StepResult({"b": (Tok(4),), "c": (0,)}))
    v = t.impl.view()
    assert v.requests["b"].output_token_ids == (4,) and v.requests["c"].output_token_ids == (0,)


def test_an_id_finished_since_the_last_plan_stays_taken_until_a_plan_reports_it() -> None:
    t = Twin(cfg())
    t.add(req("a", 3, max_tokens=1))
    t.add(req("b", 3, max_tokens=4))
    t.step()  # a samples its only token and finishes
    assert t.expect_error(lambda s: s.add(req("a", 5))) == (
        "RequestError: request 'a': request_id: duplicate request id")
    t.abort("b")
    assert t.expect_error(lambda s: s.add(req("b", 5))) == (
        "RequestError: request 'b': request_id: duplicate request id")
    p = t.schedule()
    assert p.finished_ids == ("a", "b")
    t.update(p, StepResult({}))
    t.add(req("a", 5))  # reported: the ids are free again
    t.add(req("b", 5))
    assert t.step().scheduled_ids == ("a", "b")


def test_a_bad_result_on_the_general_update_gets_the_spec_error() -> None:
    """Async scheduling takes the general update: a result it cannot vouch
    for goes to the protocol's own check, which raises the spec's error on
    both and changes nothing."""
    t = Twin(cfg(async_scheduling=True))
    t.add(req("a", 3))
    plan = t.schedule()
    for bad in ({"zz": (1,)}, {"a": (1, 2)}, {"a": (-1,)}):
        assert t.expect_error(lambda s: s.update(plan, StepResult(bad))).startswith("ProtocolError: ")
    t.update(plan, StepResult({"a": (1,)}))


def test_drafts_for_a_request_the_plan_did_not_schedule_are_refused_beside_good_ones() -> None:
    """The fast path vouches for a result only when every draft belongs to a
    scheduled request; one stray beside a good one gets the spec's error."""
    t = Twin(cfg(num_speculative_tokens=3))
    t.add(req("a", 3))
    plan = t.schedule()
    bad = StepResult({"a": (1,)}, draft_token_ids={"a": (5, 6), "zz": (7,)})
    assert t.expect_error(lambda s: s.update(plan, bad)) == (
        "ProtocolError: draft_token_ids for 'zz', which the plan did not schedule")
    t.update(plan, StepResult({"a": (1,)}, draft_token_ids={"a": (5, 6)}))


def test_a_grammar_cuts_drafts_at_the_first_refused_one_wherever_it_comes() -> None:
    """update_draft_token_ids: the grammar keeps the drafts before the first
    token it refuses, at the first, second or a later place."""
    t = Twin(cfg(num_speculative_tokens=4, max_num_seqs=8))
    for k in range(4):
        t.add(req(f"g{k}", 3, max_tokens=8, structured_output=True, grammar_rejects=(9,)))
        t.both(lambda s, rid=f"g{k}": s.grammar_ready(rid))
    plan = t.schedule()
    drafts = {"g0": (9, 1, 2), "g1": (1, 9, 2), "g2": (1, 2, 9, 3), "g3": (1, 2, 3, 9)}
    t.update(plan, StepResult({f"g{k}": (4,) for k in range(4)}, draft_token_ids=drafts))
    kept = {rid: v.spec_token_ids for rid, v in t.impl.view().requests.items()}
    assert kept == {"g0": (), "g1": (1,), "g2": (1, 2), "g3": (1, 2, 3)}


def test_drafts_proposed_for_a_partial_prefill_chunk_are_dropped_in_every_mode() -> None:
    """update_draft_token_ids: a drafter with its own forward pass proposes
    for every request of the batch; the drafts of a request whose step was a
    partial prefill chunk are dropped, not refused."""
    for extra in (dict(), dict(async_scheduling=True)):
        t = Twin(cfg(num_speculative_tokens=2, max_num_batched_tokens=8, **extra))
        t.add(req("a", 3, max_tokens=6))
        t.add(req("b", 12, max_tokens=4))
        plan = t.schedule()
        assert entries(plan)[-1] == ("b", "new", 0, 5)  # a partial chunk of b's prompt
        t.update(plan, StepResult({"a": (1,)}, draft_token_ids={"a": (2, 3), "b": (4, 5)}))
        assert t.impl.view().requests["b"].spec_token_ids == ()
        for _ in range(6):
            t.step()
