"""impl's KV connector (impl/connector.py): each connector path with exact
values, spec and impl side by side (equal outcomes and views after every
operation, tests.helpers.Twin)."""

from __future__ import annotations

import dataclasses

from schedspec.impl import ImplScheduler
from schedspec.spec import SchedulerConfig
from schedspec.spec.interface import KVLoad, RequestStatus, StepResult

from tests.helpers import Twin, req, truncated_sync_load_in_flight


def config(**kw: object) -> SchedulerConfig:
    base = dict(block_size=4, num_blocks=17, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                kv_connector=True)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def test_impl_declares_the_connector_and_hybrid_groups() -> None:
    assert ImplScheduler.KV == ("kv_connector", "hybrid_kv")


def test_a_synchronous_load_is_computed_in_the_admitting_step() -> None:
    t = Twin(config())
    t.add(req("a", 10, kv_external_tokens=8))
    plan = t.schedule()
    (e,) = plan.scheduled
    assert (e.num_computed_tokens, e.num_scheduled_tokens, e.block_ids) == (8, 2, (1, 2, 3))
    assert plan.kv_loads == (KVLoad("a", 0, 8, (1, 2, 3), False, ()),)
    # loaded blocks are cached at allocation
    assert sorted(t.impl.view().kv.block_keys) == [1, 2]
    t.update(plan, StepResult({"a": (5,)}))
    assert t.impl.view().requests["a"].num_computed_tokens == 10


def test_an_asynchronous_load_waits_for_its_report_then_is_promoted() -> None:
    t = Twin(config())
    t.add(req("a", 10, kv_external_tokens=8, kv_load_async=True))
    plan = t.schedule()
    assert plan.scheduled == ()
    assert plan.kv_loads == (KVLoad("a", 0, 8, (1, 2), True, ()),)
    v = t.impl.view()
    assert v.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert (v.requests["a"].num_computed_tokens, v.waiting, v.kv.block_keys) == (8, ("a",), {})
    t.update(plan, StepResult({}))
    plan = t.schedule()  # still loading: passed over
    assert plan.scheduled == ()
    t.update(plan, StepResult({}, finished_recving=("a",)))
    assert t.impl.view().kv_loads_done == ("a",)
    plan = t.schedule()
    (e,) = plan.scheduled
    assert (e.kind.value, e.num_computed_tokens, e.num_scheduled_tokens, e.block_ids) == ("new", 8, 2, (1, 2, 3))
    assert sorted(t.impl.view().kv.block_keys) == [1, 2]
    assert t.impl.view().kv_loads_done == ()


def test_a_whole_prompt_load_leaves_the_last_token_to_compute() -> None:
    t = Twin(config())
    t.add(req("a", 8, kv_external_tokens=8, kv_load_async=True))
    t.update(t.schedule(), StepResult({}, finished_recving=("a",)))
    (e,) = t.schedule().scheduled
    assert (e.num_computed_tokens, e.num_scheduled_tokens) == (7, 1)


def test_an_abort_during_a_load_keeps_the_blocks_until_the_report() -> None:
    t = Twin(config())
    t.add(req("a", 10, kv_external_tokens=8, kv_load_async=True))
    plan = t.schedule()
    t.abort("a")
    v = t.impl.view()
    assert v.kv_held_by_finished == {"a": (1, 2)}
    assert v.finished["a"].block_ids == ()
    assert v.kv.num_free_blocks == 14
    t.update(plan, StepResult({}, finished_recving=("a",)))
    v = t.impl.view()
    assert v.kv_held_by_finished == {}
    assert v.kv.num_free_blocks == 16


def test_an_asynchronous_save_delays_the_free() -> None:
    t = Twin(config())
    t.add(req("a", 6, max_tokens=1, kv_save_async=True))
    plan = t.schedule()
    t.update(plan, StepResult({"a": (5,)}))
    v = t.impl.view()
    assert v.kv_held_by_finished == {"a": (1, 2)}
    assert v.finished["a"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    plan = t.schedule()
    t.update(plan, StepResult({}, finished_sending=("a",)))
    v = t.impl.view()
    assert v.kv_held_by_finished == {}
    assert v.kv.free_queue[-1:] == (1,)  # the keyed block goes to the tail


def test_a_failed_load_is_recomputed_under_recompute() -> None:
    t = Twin(config(kv_load_failure_policy="recompute"))
    t.add(req("a", 10, kv_external_tokens=8, kv_load_async=True))
    plan = t.schedule()
    t.update(plan, StepResult({}, finished_recving=("a",), failed_recving=("a",)))
    assert t.impl.view().kv_loads_failed == ("a",)
    plan = t.schedule()
    # nothing of it counts: its blocks are freed (tail first, to the head of
    # the free queue); the connector is asked again (stateless) and offers
    # the load again, into the same blocks
    assert plan.scheduled == ()
    assert plan.kv_loads == (KVLoad("a", 0, 8, (2, 1), True, ()),)


def test_a_failed_load_errs_under_fail() -> None:
    t = Twin(config(kv_load_failure_policy="fail"))
    t.add(req("a", 10, kv_external_tokens=8, kv_load_async=True))
    plan = t.schedule()
    t.update(plan, StepResult({}, finished_recving=("a",), failed_recving=("a",)))
    v = t.impl.view()
    assert v.finished["a"].status == RequestStatus.FINISHED_ERROR
    assert v.kv.num_free_blocks == 16


def test_invalid_blocks_of_a_synchronous_load_truncate_the_computed_tokens() -> None:
    t = Twin(config(kv_load_failure_policy="recompute"))
    t.add(req("a", 14, kv_external_tokens=12))
    plan = t.schedule()
    assert plan.kv_loads[0].block_ids == (1, 2, 3, 4)
    t.update(plan, StepResult({"a": (5,)}, invalid_block_ids=(2,)))
    v = t.impl.view()
    assert (v.requests["a"].num_computed_tokens, v.requests["a"].output_token_ids) == (4, ())
    (e,) = t.schedule().scheduled
    assert (e.num_computed_tokens, e.num_scheduled_tokens) == (4, 10)


def test_invalid_blocks_under_fail_evict_and_err() -> None:
    t = Twin(config(kv_load_failure_policy="fail"))
    t.add(req("a", 14, kv_external_tokens=12))
    plan = t.schedule()
    t.update(plan, StepResult({"a": (5,)}, invalid_block_ids=(2,)))
    v = t.impl.view()
    assert v.finished["a"].status == RequestStatus.FINISHED_ERROR
    assert sorted(v.kv.block_keys) == [1]


def test_deferred_frees_with_async_scheduling() -> None:
    t = Twin(config(async_scheduling=True))
    t.add(req("a", 6, max_tokens=4))
    p1 = t.schedule()
    p2 = t.schedule()
    t.abort("a")  # a step in flight still writes its blocks: the free waits
    assert t.impl.view().kv.num_free_blocks == 14
    t.update(p1, StepResult({"a": (5,)}))
    assert t.impl.view().kv.num_free_blocks == 14
    t.update(p2, StepResult({}))
    assert t.impl.view().kv.num_free_blocks == 16


def test_reset_refused_while_blocks_are_kept() -> None:
    t = Twin(config())
    t.add(req("a", 10, kv_external_tokens=8, kv_load_async=True))
    t.update(t.schedule(), StepResult({}))
    msg = t.expect_error(lambda s: s.reset_prefix_cache(True))
    assert "waiting request 'a' holds blocks for a KV load" in msg


def test_kv_holding_waiting_is_served_first_and_under_paused_new() -> None:
    from schedspec.spec.interface import PauseState

    t = Twin(config(max_num_batched_tokens=8))
    t.add(req("a", 10, kv_external_tokens=8, kv_load_async=True))
    t.update(t.schedule(), StepResult({}, finished_recving=("a",)))
    t.add(req("b", 6))
    assert t.impl.view().waiting == ("a", "b")
    t.both(lambda s: s.set_pause_state(PauseState.PAUSED_NEW))
    plan = t.schedule()
    assert [e.request_id for e in plan.scheduled] == ["a"]


def test_clones_are_independent() -> None:
    t = Twin(config())
    t.add(req("a", 10, kv_external_tokens=8, kv_load_async=True))
    t.schedule()
    c = t.impl.clone()
    t.abort("a")
    assert c.view().requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert c.view().kv_held_by_finished == {}
    assert dataclasses.replace(t.impl.view(), finished={}).kv_held_by_finished == {"a": (1, 2)}


def test_a_failed_grammar_and_a_failed_load_finish_in_the_same_update() -> None:
    """Under kv_load_failure_policy "fail" the update that reports a failed
    load finishes its request with an error, and with it every request whose
    grammar failed since the last update (in id order)."""
    t = Twin(config(kv_load_failure_policy="fail"))
    t.add(req("r", 14, kv_external_tokens=12))
    t.add(req("g", 6, structured_output=True))
    t.both(lambda s: s.grammar_ready("g", False))
    plan = t.schedule()
    assert [e.request_id for e in plan.scheduled] == ["r"]
    t.update(plan, StepResult({"r": (5,)}, invalid_block_ids=plan.kv_loads[0].block_ids[:1]))
    v = t.impl.view()
    assert v.finished["r"].status == RequestStatus.FINISHED_ERROR
    assert v.finished["g"].status == RequestStatus.FINISHED_ERROR


def test_drafts_for_a_request_whose_load_failed_are_taken_after_the_errors() -> None:
    """Synchronous speculative decoding: the drafts proposed for a request
    whose output the failed load skipped are applied once the update's
    errors are done (update_draft_token_ids after update_from_output)."""
    t = Twin(config(kv_load_failure_policy="recompute", num_speculative_tokens=2))
    t.add(req("r", 14, kv_external_tokens=12))
    plan = t.schedule()
    t.update(plan, StepResult({"r": (5,)}, invalid_block_ids=plan.kv_loads[0].block_ids[1:2],
                              draft_token_ids={"r": (8, 9)}))
    r = t.impl.view().requests["r"]
    assert r.num_computed_tokens == 4 and r.output_token_ids == ()  # truncated, its token skipped
    assert r.spec_token_ids == (8, 9)
    # the next step recomputes from token 4: the known tokens, then the drafts
    (e,) = t.schedule().scheduled
    assert (e.num_computed_tokens, e.num_scheduled_tokens) == (4, 12)
    assert (e.token_ids, e.spec_token_ids) == ((4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 8, 9), (8, 9))


def test_a_truncated_load_with_a_step_in_flight_recomputes_with_its_placeholders() -> None:
    """Async scheduling: the update of a synchronous load's step reports an
    invalid block while the next step is in flight. The request's computed
    tokens go back to 4, its output is skipped, and the next step computes
    tokens 4 .. 13 and then the two output placeholders still counted (-1;
    vLLM 0.33 plans the one its skipped output never fills: docs/divergences.md,
    "A stale output placeholder after a failed synchronous load")."""
    t = Twin(config(async_scheduling=True, kv_load_failure_policy="recompute"))
    t.add(req("a", 14, kv_external_tokens=8))
    first = t.schedule()
    second = t.schedule()
    (e,) = second.scheduled
    assert (e.num_computed_tokens, e.num_scheduled_tokens, e.token_ids) == (14, 1, (-1,))
    t.update(first, StepResult({"a": (5,)}, invalid_block_ids=first.kv_loads[0].block_ids[1:2]))
    a = t.impl.view().requests["a"]
    assert (a.num_computed_tokens, a.num_output_placeholders, a.output_token_ids) == (4, 2, ())
    third = t.schedule()
    (e,) = third.scheduled
    assert (e.num_computed_tokens, e.num_scheduled_tokens, e.num_output_placeholders) == (4, 12, 2)
    assert e.token_ids == (4, 5, 6, 7, 8, 9, 10, 11, 12, 13, -1, -1)
    t.update(second, StepResult({"a": (6,)}))
    t.update(third, StepResult({"a": (7,)}))
    # The placeholder nobody fills then stalls the request one token short of
    # max_tokens: the async skip (computed + 2 - placeholders reaches prompt +
    # max_tokens) passes it over in every step, and it never finishes. vLLM
    # 0.33 does the same (docs/divergences.md).
    assert t.step().scheduled_ids == ("a",)
    for _ in range(3):
        assert t.step().scheduled == ()
    a = t.impl.view().requests["a"]
    assert (a.num_computed_tokens, a.output_token_ids, a.num_output_placeholders) == (17, (6, 7, 7), 1)


def test_a_truncated_load_with_a_step_in_flight_runs_on_to_its_end() -> None:
    """As above with room left under max_tokens: after the recompute the
    request decodes block after block, its blocks keyed as its tokens are
    verified, up to one token short of max_tokens, where it stalls."""
    t = Twin(config(async_scheduling=True, kv_load_failure_policy="recompute"))
    truncated_sync_load_in_flight(t, max_tokens=12)
    assert [len(t.step().scheduled) for _ in range(11)] == [1] * 9 + [0] * 2
    v = t.impl.view()
    a = v.requests["a"]
    assert (a.num_computed_tokens, len(a.output_token_ids), a.num_output_placeholders) == (25, 11, 1)
    assert sorted(v.kv.block_keys) == [1, 2, 3, 4, 5, 6]
