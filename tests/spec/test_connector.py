"""The spec's KV connector (spec/connector.py, SpecScheduler): a worked
scenario with exact values for each connector.* rule, as vLLM 0.33 behaves
with the modelled connector (block_size 4, 15 usable blocks)."""

from __future__ import annotations

from typing import Any

import pytest

from schedspec.spec.connector import (
    external_hit,
    get_num_new_matched_tokens,
    loaded_block_range,
    request_finished_delays_free,
    truncate_at_invalid,
)
from schedspec.spec.interface import (
    KVLoad,
    RequestSpec,
    RequestStatus,
    ScheduleKind,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from schedspec.spec.scheduler import SpecScheduler

S = RequestStatus


def make(**kw: Any) -> SpecScheduler:
    base: dict[str, Any] = dict(
        block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=40,
        kv_connector=True, kv_load_failure_policy="recompute",
    )
    base.update(kw)
    return SpecScheduler(SchedulerConfig(**base))


def req(rid: str, n: int = 10, start: int = 0, **kw: Any) -> RequestSpec:
    kw.setdefault("max_tokens", 4)
    return RequestSpec(rid, tuple(range(start, start + n)), **kw)


def entries(plan: StepPlan) -> list[tuple[str, ScheduleKind, int, int]]:
    return [(e.request_id, e.kind, e.num_computed_tokens, e.num_scheduled_tokens) for e in plan.scheduled]


def sample(plan: StepPlan, token: int = 7) -> dict[str, tuple[int, ...]]:
    return {e.request_id: (token,) for e in plan.scheduled if e.samples}


def step(s: SpecScheduler, **result: Any) -> StepPlan:
    plan = s.schedule()
    s.update(plan, StepResult(sampled=sample(plan), **result))
    return plan


def async_loaded(s: SpecScheduler, rid: str = "a", **kw: Any) -> StepPlan:
    """Add ``rid`` with an asynchronous load of its whole 10-token prompt and
    run the step that starts it."""
    s.add(req(rid, kv_external_tokens=10, kv_load_async=True, **kw))
    return step(s)


# ---------------------------------------------------------------- the modelled connector


def test_modelled_connector_functions() -> None:
    assert get_num_new_matched_tokens(10, False, 4) == (6, False)
    assert get_num_new_matched_tokens(10, True, 4) == (6, True)
    assert get_num_new_matched_tokens(4, True, 8) == (0, False)
    assert get_num_new_matched_tokens(5, True, 4) == (1, True)  # a single external token still loads async
    # the partial-tail rules (a local hit ending inside a block)
    assert external_hit(8, 4, 6, True) == (8, 6, True)
    assert external_hit(10, 4, 5, True) == (8, 5, True)  # longer remote hit: the tail goes
    assert external_hit(10, 4, 2, True) == (10, 0, False)  # not longer: nothing loads
    assert request_finished_delays_free(True, S.FINISHED_STOPPED)
    assert request_finished_delays_free(True, S.FINISHED_LENGTH_CAPPED)
    assert not request_finished_delays_free(True, S.FINISHED_ABORTED)
    assert not request_finished_delays_free(False, S.FINISHED_STOPPED)
    assert loaded_block_range(4, 10, 4) == range(1, 3)
    assert truncate_at_invalid([5, 6, 7], 10, 4, {7, 6}) == 1
    assert truncate_at_invalid([5, 6, 7], 4, 4, {7, 6}) is None


# ---------------------------------------------------------------- admission


def test_sync_load_counts_external_tokens_computed() -> None:
    """connector.external_hit, connector.load_sync: 8 external tokens load
    within the admitting step, the last 2 are scheduled, the blocks of all
    known tokens are cached at allocation."""
    s = make()
    s.add(req("a", kv_external_tokens=8))
    plan = s.schedule()
    assert entries(plan) == [("a", ScheduleKind.NEW, 8, 2)]
    assert plan.kv_loads == (KVLoad("a", 0, 8, (1, 2, 3), False),)
    assert s.view().kv.block_keys.keys() == {1, 2}
    assert s.rules["connector.external_hit"] == 1 and s.rules["connector.load_sync"] == 1


def test_external_tokens_within_the_local_hit_load_nothing() -> None:
    """connector.external_within_local: b's local hit (8 tokens) covers its
    8 external tokens; the connector offers none."""
    s = make()
    s.add(req("a"))
    step(s)
    s.add(req("b", kv_external_tokens=8))
    plan = s.schedule()
    assert entries(plan) == [("a", ScheduleKind.RUNNING, 10, 1), ("b", ScheduleKind.NEW, 8, 2)]
    assert plan.kv_loads == ()
    assert s.rules["connector.external_within_local"] == 1


def test_external_tokens_beyond_the_local_hit() -> None:
    """The load starts at the block-aligned local hit: b hits a's first two
    blocks and loads tokens 8 .. 10 of its 12-token prompt."""
    s = make()
    s.add(req("a"))
    step(s)
    s.add(req("b", n=12, kv_external_tokens=11))
    plan = s.schedule()
    assert entries(plan)[1] == ("b", ScheduleKind.NEW, 11, 1)
    assert plan.kv_loads == (KVLoad("b", 8, 11, (1, 2, 4), False),)


def test_async_load_waits_for_remote_kvs() -> None:
    """connector.load_async, connector.skip_loading: blocks for all 10
    tokens, nothing scheduled, WAITING_FOR_REMOTE_KVS in kv_holding_waiting
    until the worker reports the load."""
    s = make()
    plan = async_loaded(s)
    assert plan.scheduled == ()
    assert plan.kv_loads == (KVLoad("a", 0, 10, (1, 2, 3), True),)
    v = s.view()
    assert v.requests["a"].status == S.WAITING_FOR_REMOTE_KVS
    assert v.requests["a"].num_computed_tokens == 10
    assert v.requests["a"].block_ids == (1, 2, 3)
    assert v.waiting == ("a",) and s.kv_holding == ["a"] and s.waiting == []
    assert v.kv.block_keys == {}  # delay_cache_blocks
    assert step(s).scheduled == ()
    assert s.rules["connector.skip_loading"] == 1


def test_async_load_done_promotes_and_leaves_the_last_token() -> None:
    """connector.load_done, connector.load_promoted, connector.load_last_token,
    connector.admit_loaded: the report marks the load done; the next WAITING
    loop caches the loaded blocks, leaves token 9 to compute and admits it."""
    s = make()
    async_loaded(s)
    step(s, finished_recving=("a",))
    assert s.view().kv_loads_done == ("a",)
    plan = s.schedule()
    assert entries(plan) == [("a", ScheduleKind.NEW, 9, 1)]
    assert plan.kv_loads == ()
    assert s.view().kv.block_keys.keys() == {1, 2}
    assert s.view().kv_loads_done == ()
    for rule in ("load_done", "load_promoted", "load_last_token", "admit_loaded"):
        assert s.rules[f"connector.{rule}"] == 1, rule


def test_async_load_admitted_on_its_report_step_under_paused_new() -> None:
    """kv_holding_waiting is drained first and is the only queue admitted
    under PAUSED_NEW."""
    from schedspec.spec.interface import PauseState

    s = make()
    async_loaded(s)
    s.add(req("b", start=50))
    step(s, finished_recving=("a",))
    s.set_pause_state(PauseState.PAUSED_NEW)
    s.add(req("c", start=80))
    plan = s.schedule()
    assert entries(plan) == [("b", ScheduleKind.RUNNING, 10, 1), ("a", ScheduleKind.NEW, 9, 1)]
    assert s.view().waiting == ("c",)


def test_async_load_is_refused_room_held_by_an_inflight_prefill() -> None:
    """connector.load_blocked_reserve: a's first prefill chunk (8 of 40
    tokens, cut by the long-prefill threshold) leaves it needing 8 more
    blocks of the 13 free; b's load of 6 blocks would fit the pool but not
    beside that reservation, so the WAITING loop stops."""
    s = make(max_model_len=48, long_prefill_token_threshold=8)
    s.add(req("a", n=40))
    s.add(req("b", n=24, kv_external_tokens=24, kv_load_async=True, start=100))
    plan = s.schedule()
    assert entries(plan) == [("a", ScheduleKind.NEW, 0, 8)]
    assert plan.kv_loads == ()
    assert s.view().requests["b"].status == S.WAITING
    assert s.rules["connector.load_blocked_reserve"] == 1


# ---------------------------------------------------------------- failures


def test_failed_load_recompute_frees_and_loads_again() -> None:
    """connector.failed_recompute, connector.failed_load_freed: the whole
    load failed; nothing counts computed; the promotion frees the blocks and
    the admission asks the connector again (a new asynchronous load)."""
    s = make()
    async_loaded(s)
    step(s, finished_recving=("a",), failed_recving=("a",))
    v = s.view()
    assert v.kv_loads_done == ("a",) and v.kv_loads_failed == ("a",)
    assert v.requests["a"].num_computed_tokens == 0
    plan = s.schedule()
    assert plan.kv_loads == (KVLoad("a", 0, 10, (3, 2, 1), True),)
    assert s.rules["connector.failed_recompute"] == 1 and s.rules["connector.failed_load_freed"] == 1


def test_invalid_block_recompute_truncates_an_async_load() -> None:
    """connector.invalid_truncated, connector.invalid_recompute,
    connector.failed_load_kept: block 2 (index 1) failed: the computed tokens
    stop at 4, block 1 is cached at promotion, 6 tokens are computed."""
    s = make()
    async_loaded(s)
    step(s, finished_recving=("a",), invalid_block_ids=(2,))
    assert s.view().requests["a"].num_computed_tokens == 4
    plan = s.schedule()
    assert entries(plan) == [("a", ScheduleKind.NEW, 4, 6)]
    assert s.view().kv.block_keys.keys() == {1, 2}  # block 2 recomputed and cached at allocation
    for rule in ("invalid_truncated", "invalid_recompute", "failed_load_kept"):
        assert s.rules[f"connector.{rule}"] == 1, rule


def test_invalid_block_recompute_of_a_sync_load_skips_the_output() -> None:
    """connector.output_skipped: the sync load's block 2 failed; the step's
    sampled token is dropped and tokens 4 .. 9 are computed again."""
    s = make()
    s.add(req("a", kv_external_tokens=8))
    plan = s.schedule()
    s.update(plan, StepResult(sampled={"a": (7,)}, invalid_block_ids=(2,)))
    v = s.view().requests["a"]
    assert v.num_computed_tokens == 4 and v.output_token_ids == () and v.status == S.RUNNING
    assert entries(s.schedule()) == [("a", ScheduleKind.RUNNING, 4, 6)]
    assert s.rules["connector.output_skipped"] == 1


def test_invalid_block_shared_by_a_later_request() -> None:
    """connector.invalid_shared: b hit a's synchronously loaded (and cached)
    blocks in the same step; a marks block 2, b keeps its computed tokens
    and both skip the step's output."""
    s = make()
    s.add(req("a", kv_external_tokens=8))
    s.add(req("b"))
    plan = s.schedule()
    assert entries(plan) == [("a", ScheduleKind.NEW, 8, 2), ("b", ScheduleKind.NEW, 8, 2)]
    s.update(plan, StepResult(sampled=sample(plan), invalid_block_ids=(2,)))
    v = s.view().requests
    assert (v["a"].num_computed_tokens, v["b"].num_computed_tokens) == (4, 8)
    assert v["a"].output_token_ids == v["b"].output_token_ids == ()
    assert s.rules["connector.invalid_shared"] == 1


def test_fail_policy_sync_load_evicts_and_errors() -> None:
    """connector.invalid_fail, connector.failed_load_error: the request fails;
    blocks 2 and 3 (from the invalid one on) lose their keys before it is
    freed, block 1 keeps its key."""
    s = make(kv_load_failure_policy="fail")
    s.add(req("a", kv_external_tokens=8))
    plan = s.schedule()
    s.update(plan, StepResult(sampled={"a": (7,)}, invalid_block_ids=(2,)))
    v = s.view()
    assert v.finished["a"].status == S.FINISHED_ERROR
    assert v.kv.block_keys.keys() == {1}
    assert v.kv.free_queue[:2] == (3, 2) and v.kv.free_queue[-1] == 1
    assert s.rules["connector.invalid_fail"] == 1 and s.rules["connector.failed_load_error"] == 1


def test_fail_policy_async_load_errors_and_frees_at_the_report() -> None:
    """connector.finish_during_load, connector.load_done_after_finish: the
    failed request finishes (its load not yet marked done, so its blocks are
    kept) and the finished_recving of the same result frees them."""
    s = make(kv_load_failure_policy="fail")
    async_loaded(s)
    step(s, finished_recving=("a",), failed_recving=("a",))
    v = s.view()
    assert v.finished["a"].status == S.FINISHED_ERROR
    assert v.kv_held_by_finished == {} and v.kv.num_free_blocks == 15
    assert s.rules["connector.finish_during_load"] == 1
    assert s.rules["connector.load_done_after_finish"] == 1


def test_failed_report_for_an_aborted_load_is_ignored() -> None:
    """connector.failed_ignored."""
    s = make()
    async_loaded(s)
    s.abort("a")
    step(s, finished_recving=("a",), failed_recving=("a",))
    assert s.rules["connector.failed_ignored"] == 1
    assert s.view().kv_held_by_finished == {}


# ---------------------------------------------------------------- held blocks


def test_abort_during_an_async_load_keeps_the_blocks_until_the_report() -> None:
    s = make()
    async_loaded(s)
    s.abort("a")
    v = s.view()
    assert v.finished["a"].status == S.FINISHED_ABORTED and v.finished["a"].block_ids == ()
    assert v.kv_held_by_finished == {"a": (1, 2, 3)}
    assert v.kv.num_free_blocks == 12
    step(s)
    assert s.view().kv_held_by_finished == {"a": (1, 2, 3)}
    step(s, finished_recving=("a",))
    assert s.view().kv_held_by_finished == {} and s.view().kv.free_queue[:3] == (3, 2, 1)


def test_abort_after_the_load_was_reported_frees_at_once() -> None:
    """connector.finish_after_load."""
    s = make()
    async_loaded(s)
    step(s, finished_recving=("a",))
    s.abort("a")
    assert s.view().kv_held_by_finished == {} and s.view().kv.num_free_blocks == 15
    assert s.rules["connector.finish_after_load"] == 1


def test_async_save_keeps_the_blocks_until_finished_sending() -> None:
    """connector.save_delays_free, connector.save_done."""
    s = make()
    s.add(req("a", max_tokens=1, kv_save_async=True))
    step(s)
    v = s.view()
    assert v.finished["a"].status == S.FINISHED_LENGTH_CAPPED
    assert v.kv_held_by_finished == {"a": (1, 2, 3)}
    step(s, finished_sending=("a",))
    assert s.view().kv_held_by_finished == {} and s.view().kv.num_free_blocks == 15
    assert s.rules["connector.save_delays_free"] == 1 and s.rules["connector.save_done"] == 1


def test_aborted_request_is_not_saved() -> None:
    s = make()
    s.add(req("a", kv_save_async=True))
    s.schedule()
    s.abort("a")
    assert s.view().kv_held_by_finished == {}


# ---------------------------------------------------------------- async scheduling: defer_block_free


def test_free_deferred_behind_the_step_in_flight() -> None:
    """connector.free_deferred, connector.deferred_drained: with async
    scheduling a request aborted while its step is in flight keeps its blocks
    out of the pool until that step is updated."""
    s = make(async_scheduling=True)
    s.add(req("a"))
    plan = s.schedule()
    s.abort("a")
    assert s.view().kv.num_free_blocks == 12
    assert s.deferred_frees == [(1, [1, 2, 3])]
    s.update(plan, StepResult(sampled={"a": (7,)}))
    assert s.view().kv.num_free_blocks == 15 and s.deferred_frees == []
    assert s.rules["connector.free_deferred"] == 1 and s.rules["connector.deferred_drained"] == 1


def test_no_preemption_of_a_victim_whose_step_is_in_flight() -> None:
    """connector.victim_in_flight: the pool is short for a's next block and
    the victim (b, the tail) was scheduled in the step in flight: the
    RUNNING loop stops instead of preempting."""
    s = make(async_scheduling=True, num_blocks=6, max_model_len=20, max_num_batched_tokens=20)
    s.add(req("a", n=8, max_tokens=10))
    s.add(req("b", n=8, max_tokens=10, start=50))
    p1 = s.schedule()
    assert entries(p1) == [("a", ScheduleKind.NEW, 0, 8), ("b", ScheduleKind.NEW, 0, 8)]
    p2 = s.schedule()
    assert entries(p2) == [("a", ScheduleKind.RUNNING, 8, 1)]
    assert s.rules["connector.victim_in_flight"] == 1
    assert p2.preempted_ids == ()
    s.update(p1, StepResult(sampled=sample(p1)))


def test_running_preemption_drops_in_flight_output() -> None:
    """requires_kv_delivery (kv_both): a preemption victim's in-flight output
    is dropped (drop_stale_output), so it may be resumed at once."""
    s = make(async_scheduling=True, num_blocks=6, max_model_len=20, max_num_batched_tokens=20)
    s.add(req("a", n=8, max_tokens=10))
    s.add(req("b", n=8, max_tokens=10, start=50))
    p1 = s.schedule()
    s.update(p1, StepResult(sampled=sample(p1)))
    p2 = s.schedule()
    assert entries(p2) == [("a", ScheduleKind.RUNNING, 8, 1)]
    assert p2.preempted_ids == ("b",)
    assert s.requests["b"].drop_stale_output


# ---------------------------------------------------------------- the boundary


def test_kv_fields_need_a_connector() -> None:
    from schedspec.spec.interface import ProtocolError

    s = make(kv_connector=False)
    for kw in ({"kv_external_tokens": 4}, {"kv_external_tokens": 4, "kv_load_async": True}, {"kv_save_async": True}):
        with pytest.raises(ProtocolError) as e:
            s.add(req("a", **kw))
        assert e.value.field == next(iter(kw))
    assert s.view().requests == {}


def test_sync_load_of_the_whole_prompt_is_refused() -> None:
    from schedspec.spec.interface import ProtocolError

    s = make()
    with pytest.raises(ProtocolError) as e:
        s.add(req("a", kv_external_tokens=10))
    assert e.value.field == "kv_external_tokens"
    s.add(req("a", kv_external_tokens=10, kv_load_async=True))


@pytest.mark.parametrize(
    ("result", "field"),
    [
        ({"finished_recving": ("zz",)}, "finished_recving"),
        ({"finished_recving": ("b",)}, "finished_recving"),  # running, no load in flight
        ({"finished_recving": ("a", "a")}, "finished_recving"),
        ({"finished_sending": ("a",)}, "finished_sending"),  # loading, not saving
        ({"finished_sending": ("b",)}, "finished_sending"),
        ({"failed_recving": ("a",)}, "failed_recving"),  # not in finished_recving
        ({"finished_recving": ("a",), "invalid_block_ids": (0,)}, "invalid_block_ids"),
        ({"finished_recving": ("a",), "invalid_block_ids": (16,)}, "invalid_block_ids"),
        ({"finished_recving": ("a",), "invalid_block_ids": (4,)}, "invalid_block_ids"),  # b's block
        ({"invalid_block_ids": (1,)}, "invalid_block_ids"),  # a's load not reported here
        ({"finished_recving": ["a"]}, "finished_recving"),
    ],
)
def test_bad_reports_are_refused_unchanged(result: dict[str, Any], field: str) -> None:
    from schedspec.spec.interface import ProtocolError

    s = make()
    async_loaded(s)
    s.add(req("b", start=50))
    plan = s.schedule()
    before = s.view()
    with pytest.raises(ProtocolError) as e:
        s.update(plan, StepResult(sampled=sample(plan), **result))
    assert e.value.field == field
    assert s.view() == before


def test_reports_without_a_connector_are_refused() -> None:
    from schedspec.spec.interface import ProtocolError

    s = make(kv_connector=False)
    s.add(req("a"))
    plan = s.schedule()
    with pytest.raises(ProtocolError) as e:
        s.update(plan, StepResult(sampled=sample(plan), finished_sending=("a",)))
    assert e.value.field == "finished_sending"


def test_invalid_blocks_with_several_groups_are_refused() -> None:
    from schedspec.spec.interface import KVCacheGroup, ProtocolError

    s = make(kv_cache_groups=(KVCacheGroup(), KVCacheGroup("sliding_window", 8)), num_blocks=32)
    s.add(req("a", kv_external_tokens=8))
    plan = s.schedule()
    with pytest.raises(ProtocolError) as e:
        s.update(plan, StepResult(sampled=sample(plan), invalid_block_ids=(plan.kv_loads[0].block_ids[0],)))
    assert e.value.field == "invalid_block_ids" and e.value.step == plan.step
    assert str(e.value).endswith(
        "invalid_block_ids with more than one KV cache group: vLLM raises (_handle_invalid_blocks); "
        "report failed_recving instead")


def test_an_invalid_block_outside_the_pool_is_refused_with_the_pool_range() -> None:
    from schedspec.spec.interface import ProtocolError

    s = make()
    async_loaded(s)
    plan = s.schedule()
    before = s.view()
    for block in (0, 16, -1, True, "1"):
        with pytest.raises(ProtocolError) as e:
            s.update(plan, StepResult(sampled=sample(plan), finished_recving=("a",),
                                      invalid_block_ids=(block,)))  # type: ignore[arg-type]
        assert e.value.field == "invalid_block_ids" and e.value.step == plan.step
        assert str(e.value).endswith(f"invalid_block_ids holds {block!r}, not a block of the pool (1 .. 15)")
        assert s.view() == before


def test_reset_running_with_held_blocks_is_refused() -> None:
    from schedspec.spec.interface import ProtocolError

    s = make()
    async_loaded(s)
    with pytest.raises(ProtocolError) as e:
        s.reset_prefix_cache(reset_running_requests=True)
    assert e.value.field == "reset_running_requests"
    assert s.reset_prefix_cache() is False


def test_reset_running_is_refused_while_a_step_in_flight_writes_blocks() -> None:
    """defer_block_free: a running request whose step is in flight, then the
    same request aborted (its free deferred behind the fence): both refuse
    reset_prefix_cache(reset_running_requests=True) with the same message,
    and leave the scheduler as it was."""
    from schedspec.spec.interface import ProtocolError

    s = make(async_scheduling=True)
    s.add(req("a"))
    plan = s.schedule()
    for abort in (False, True):
        if abort:
            s.abort("a")
        before = s.view()
        with pytest.raises(ProtocolError) as e:
            s.reset_prefix_cache(reset_running_requests=True)
        assert str(e.value) == (
            "reset_prefix_cache(reset_running_requests=True) would leave blocks held: "
            "a step in flight still writes blocks whose free is deferred (defer_block_free)"
        )
        assert s.view() == before
    s.update(plan, StepResult(sampled={"a": (7,)}))
    assert s.reset_prefix_cache(reset_running_requests=True) is True


def test_clone_is_independent() -> None:
    s = make()
    async_loaded(s)
    c = s.clone()
    step(c, finished_recving=("a",))
    assert s.view().kv_loads_done == () and c.view().kv_loads_done == ("a",)
    assert s.kv_loading == {"a": (1, 2, 3)} and c.kv_loading == {}


def test_default_config_view_has_no_connector_state() -> None:
    s = make(kv_connector=False)
    s.add(req("a", max_tokens=1))
    step(s)
    v = s.view()
    assert v.kv_held_by_finished == {} and v.kv_loads_done == () and v.kv_loads_failed == ()
    assert s.schedule().kv_loads == ()


def test_connector_rules_are_reachable_only_with_a_connector() -> None:
    from schedspec.check.features import kv_capabilities
    from schedspec.spec.rule_names import ALL_MODES, RULES, reachable_in

    conn = {n for n in RULES if n.startswith("connector.")}
    assert conn and not conn & set(reachable_in(ALL_MODES))
    assert conn <= set(reachable_in(ALL_MODES, ("kv_connector",)))
    deferred = {"connector.victim_in_flight", "connector.free_deferred", "connector.deferred_drained"}
    assert not deferred & set(reachable_in(("sync", "spec"), ("kv_connector",)))
    assert kv_capabilities(()) == ()
    assert kv_capabilities(("connector", "hybrid")) == ("kv_connector", "hybrid_kv")


def test_this_file_reaches_every_connector_rule() -> None:
    """Each connector rule is taken by one of the scenarios above."""
    import sys

    from collections import Counter

    made: list[SpecScheduler] = []
    this = sys.modules[__name__]
    real_make = this.make

    def counted(**kw: Any) -> SpecScheduler:
        s = real_make(**kw)
        made.append(s)
        return s

    this.make = counted  # type: ignore[assignment]
    try:
        for name, fn in sorted(vars(this).items()):
            if name.startswith("test_") and callable(fn) and name not in (
                "test_this_file_reaches_every_connector_rule", "test_bad_reports_are_refused_unchanged"
            ):
                fn()
    finally:
        this.make = real_make  # type: ignore[assignment]
    counts: Counter[str] = Counter()
    for s in made:
        counts.update(s.rules)
    missing = [n for n in RULES_CONN if counts[n] == 0]
    assert not missing, missing


RULES_CONN = [n for n in __import__("schedspec.spec.rule_names", fromlist=["RULES"]).RULES if n.startswith("connector.")]


def test_grammar_ready_then_async_load_in_one_step() -> None:
    """_handle_blocked_waiting_request makes the request WAITING, then its
    asynchronous load starts: one schedule() takes it from
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR to WAITING_FOR_REMOTE_KVS, a legal
    change (LEGAL_TRANSITIONS)."""
    from schedspec.spec.interface import is_legal_transition

    s = make()
    s.add(req("a", kv_external_tokens=10, kv_load_async=True, structured_output=True))
    s.grammar_ready("a")
    plan = s.schedule()
    assert plan.kv_loads[0].asynchronous
    assert s.view().requests["a"].status == S.WAITING_FOR_REMOTE_KVS
    assert is_legal_transition(S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, S.WAITING_FOR_REMOTE_KVS)


def test_failed_load_can_block_its_own_reload() -> None:
    """A vLLM 0.33 behaviour the spec keeps: a request whose asynchronous
    load failed as a whole (recompute) frees its blocks at promotion but stays
    in _inflight_prefills, so the reservation its next asynchronous load must
    leave free counts its own whole need: with a pool smaller than twice that
    it is never admitted again, although nothing runs (block_size 1, 17
    usable blocks, a 9-token load: 9 needed + 9 reserved > 17)."""
    s = make(block_size=1, num_blocks=18, max_model_len=16, max_num_batched_tokens=16)
    s.add(req("a", n=9, max_tokens=1, kv_external_tokens=9, kv_load_async=True))
    assert s.schedule().kv_loads[0].asynchronous
    s.update(s.in_flight[0], StepResult(finished_recving=("a",), failed_recving=("a",)))
    for _ in range(3):
        plan = step(s)
        assert plan.scheduled == () and plan.kv_loads == ()
    v = s.view()
    assert v.requests["a"].status == S.WAITING and v.requests["a"].block_ids == ()
    assert v.kv.num_free_blocks == 17 and s.inflight_prefills == {"a"}
    assert s.rules["connector.load_blocked_reserve"] == 3


def test_one_token_prompt_loaded_asynchronously_loads_again() -> None:
    """connector.reload_held: vLLM cuts a promoted load covering the whole
    sequence to num_tokens - 1 = 0 computed tokens; the same WAITING loop
    looks the request up again and the stateless connector offers the token
    again, loaded into the block it holds (docs/divergences.md)."""
    s = make(block_size=8, num_blocks=9)
    s.add(RequestSpec("r", (10,), max_tokens=1, kv_external_tokens=1, kv_load_async=True))
    plan = s.schedule()
    for _ in range(3):
        assert plan.scheduled == () and plan.kv_loads == (KVLoad("r", 0, 1, (1,), True),)
        s.update(plan, StepResult(finished_recving=("r",)))
        plan = s.schedule()
    v = s.view().requests["r"]
    assert (v.status, v.num_computed_tokens, v.block_ids) == (S.WAITING_FOR_REMOTE_KVS, 1, (1,))
    assert s.rules["connector.reload_held"] >= 1


def test_an_invalid_block_no_load_writes_is_refused_by_name() -> None:
    from schedspec.spec.interface import ProtocolError

    s = make()
    s.add(RequestSpec("a", tuple(range(10)), 2))  # no external tokens: no load
    plan = s.schedule()
    before = s.view()
    with pytest.raises(ProtocolError) as exc:
        s.update(plan, StepResult(sampled={"a": (7,)}, invalid_block_ids=(1,)))
    assert str(exc.value).endswith(
        "invalid_block_ids holds block 1, which no load this result ends writes (an asynchronous load in "
        "finished_recving, or a synchronous load of this plan)")
    assert exc.value.field == "invalid_block_ids" and exc.value.step == plan.step
    assert s.view() == before
