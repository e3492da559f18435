"""The spec's async-scheduling and speculative-decoding rules, one test per
rule: acceptance of all, none or a prefix of the drafts; a stop inside an
accepted run; max_model_len with drafts; padded new decodes; preemption,
abort, finishing and reset_prefix_cache with a step in flight; the in-flight
protocol's errors, which change nothing; the config's new fields."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

from schedspec.spec import (
    ConfigError,
    ProtocolError,
    RequestSpec,
    SchedulerConfig,
    SpecScheduler,
    StepPlan,
    StepResult,
)
from schedspec.spec.interface import RequestStatus, ScheduledRequest, ScheduleKind


def config(async_scheduling: bool = False, k: int = 2, **kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(
        block_size=4, num_blocks=17, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32,
        async_scheduling=async_scheduling, num_speculative_tokens=k,
    )
    base.update(kw)
    return SchedulerConfig(**base)


def req(rid: str, prompt: int, max_tokens: int = 10, **kw: Any) -> RequestSpec:
    return RequestSpec(rid, tuple(range(1, prompt + 1)), max_tokens, **kw)


def decoding(k: int = 2, drafts: tuple[int, ...] = (30, 31), **kw: Any) -> tuple[SpecScheduler, StepPlan]:
    """A sync scheduler whose request a (5-token prompt) has sampled 20 and
    holds ``drafts``; returns it with the plan of a's next step."""
    s = SpecScheduler(config(k=k, **kw))
    s.add(req("a", 5))
    p = s.schedule()
    s.update(p, StepResult({"a": (20,)}, {"a": drafts}))
    return s, s.schedule()


def entry(plan: StepPlan, rid: str) -> ScheduledRequest:
    e = plan.get(rid)
    assert e is not None
    return e


# ---------------------------------------------------------------- speculative decoding


def test_a_decode_verifies_its_drafts_as_scheduled_tokens() -> None:
    s, p = decoding()
    e = entry(p, "a")
    # the last known token, then both drafts: 3 scheduled tokens from the budget
    assert (e.num_computed_tokens, e.num_scheduled_tokens, e.num_tokens) == (5, 3, 6)
    assert e.spec_token_ids == (30, 31) and e.token_ids == (20, 30, 31) and e.samples
    assert s.view().requests["a"].spec_token_ids == ()  # consumed by scheduling
    assert s.view().requests["a"].num_computed_tokens == 8


@pytest.mark.parametrize(
    "tokens,computed",
    [((30, 31, 40), 8), ((41,), 6), ((30, 42), 7)],
    ids=["all-accepted", "none-accepted", "prefix-accepted"],
)
def test_rejected_drafts_roll_computed_tokens_back(tokens: tuple[int, ...], computed: int) -> None:
    s, p = decoding()
    s.update(p, StepResult({"a": tokens}, {"a": (50, 51)}))
    a = s.view().requests["a"]
    assert a.output_token_ids == (20,) + tokens
    # every token but the last (the bonus token) is computed
    assert a.num_computed_tokens == computed == a.num_tokens - 1
    assert a.spec_token_ids == (50, 51)  # update_draft_token_ids
    assert s.rules["spec.some_rejected"] == (len(tokens) < 3)


def test_a_stop_inside_an_accepted_run_drops_the_rest() -> None:
    s2 = SpecScheduler(config())
    s2.add(req("a", 5, stop_token_ids=(31,)))
    p2 = s2.schedule()
    s2.update(p2, StepResult({"a": (20,)}, {"a": (30, 31)}))
    p2 = s2.schedule()
    s2.update(p2, StepResult({"a": (30, 31, 40)}))
    fin = s2.view().finished["a"]
    assert fin.status == RequestStatus.FINISHED_STOPPED
    assert fin.output_token_ids == (20, 30, 31)  # 40 came after the stop
    assert s2.rules["spec.stop_inside_run"] == 1


def test_max_tokens_inside_an_accepted_run_caps_the_output() -> None:
    s = SpecScheduler(config())
    s.add(req("a", 5, max_tokens=3))
    p = s.schedule()
    s.update(p, StepResult({"a": (20,)}, {"a": (30, 31)}))
    p = s.schedule()
    s.update(p, StepResult({"a": (30, 31, 40)}))
    fin = s.view().finished["a"]
    assert fin.status == RequestStatus.FINISHED_LENGTH_CAPPED and fin.output_token_ids == (20, 30, 31)


def test_max_model_len_cuts_the_drafts() -> None:
    s = SpecScheduler(config(max_model_len=10))
    s.add(req("a", 5, max_tokens=20))
    p = s.schedule()
    s.update(p, StepResult({"a": (20,)}, {"a": (30, 31)}))
    p = s.schedule()
    e = entry(p, "a")
    # 6 known, 5 computed: the step may reach position max_model_len - 2 = 8, so both drafts fit
    assert e.num_scheduled_tokens == 3 and e.spec_token_ids == (30, 31)
    s.update(p, StepResult({"a": (30, 31, 32)}, {"a": (33, 34)}))
    p = s.schedule()
    e = entry(p, "a")
    # 9 tokens known: only the last one fits below max_model_len - 1, the drafts are dropped
    assert (e.num_computed_tokens, e.num_scheduled_tokens, e.spec_token_ids) == (8, 1, ())
    assert s.rules["spec.drafts_unscheduled"] == 1
    s.update(p, StepResult({"a": (40,)}))
    assert s.view().finished["a"].status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_drafts_cut_by_the_budget_are_dropped() -> None:
    s = SpecScheduler(config(k=3, max_num_batched_tokens=6, max_num_seqs=2))
    s.add(req("b", 2))
    s.add(req("a", 3))
    p = s.schedule()
    assert [e.num_scheduled_tokens for e in p.scheduled] == [2, 3]
    s.update(p, StepResult({"b": (20,), "a": (21,)}, {"b": (40, 41, 42), "a": (30, 31, 32)}))
    p = s.schedule()
    # b goes first (1 + 3 drafts), leaving a 2 of its 4 tokens: one draft
    assert entry(p, "b").num_scheduled_tokens == 4
    assert entry(p, "a").spec_token_ids == (30,)
    assert s.rules["spec.drafts_cut"] == 1
    assert s.view().requests["a"].spec_token_ids == ()


def test_a_new_decode_behind_a_running_one_is_padded() -> None:
    s = SpecScheduler(config())
    s.add(req("a", 5))
    p = s.schedule()
    s.update(p, StepResult({"a": (20,)}, {"a": (30, 31)}))
    s.add(req("b", 1))  # a one-token prompt: one token to compute
    p = s.schedule()
    b = entry(p, "b")
    assert b.kind == ScheduleKind.NEW
    assert (b.num_scheduled_tokens, b.spec_token_ids, b.token_ids) == (3, (-1, -1), (1, -1, -1))
    s.update(p, StepResult({"a": (30, 31, 40), "b": (50,)}))
    assert s.view().requests["b"].num_computed_tokens == 1  # both padding drafts rejected
    assert s.rules["admit.padded_decode"] == 1


def test_no_padding_without_a_running_request_or_a_hit() -> None:
    s = SpecScheduler(config())
    s.add(req("b", 1))
    assert entry(s.schedule(), "b").num_scheduled_tokens == 1


def test_preemption_drops_the_drafts() -> None:
    s, p = decoding()
    s.update(p, StepResult({"a": (30, 31, 40)}, {"a": (50, 51)}))
    s.reset_prefix_cache(reset_running_requests=True)
    a = s.view().requests["a"]
    assert a.status == RequestStatus.PREEMPTED and a.spec_token_ids == ()
    e = entry(s.schedule(), "a")
    assert e.kind == ScheduleKind.RESUMED and e.spec_token_ids == ()


def test_drafts_after_a_prefill_chunk_are_dropped() -> None:
    """spec.drafts_after_chunk_dropped: a drafter with its own forward pass
    proposes for a request whose step was a partial prefill chunk; vLLM's
    update_draft_token_ids drops them, and the next step verifies none."""
    s = SpecScheduler(config(max_num_batched_tokens=4, max_num_seqs=2))
    s.add(req("a", 8))
    p = s.schedule()
    assert not entry(p, "a").samples
    s.update(p, StepResult({}, {"a": (1, 2)}))
    assert s.view().requests["a"].spec_token_ids == ()
    assert s.rules["spec.drafts_after_chunk_dropped"] == 1
    assert entry(s.schedule(), "a").spec_token_ids == ()


# ---------------------------------------------------------------- async scheduling


def two_in_flight(k: int = 0, **kw: Any) -> tuple[SpecScheduler, StepPlan, StepPlan]:
    s = SpecScheduler(config(async_scheduling=True, k=k, **kw))
    s.add(req("a", 5))
    return s, s.schedule(), s.schedule()


def test_placeholders_count_the_output_in_flight() -> None:
    s, p1, p2 = two_in_flight(k=2)
    e2 = entry(p2, "a")
    assert e2.num_output_placeholders == 1 and e2.spec_token_ids == (-1, -1)
    assert e2.token_ids == (-1, -1, -1) and e2.num_computed_tokens == 5
    a = s.view().requests["a"]
    assert (a.num_output_placeholders, a.num_computed_tokens, a.spec_token_ids) == (4, 8, (-1, -1))
    s.update(p1, StepResult({"a": (20,)}))
    assert s.view().requests["a"].num_output_placeholders == 3
    s.update(p2, StepResult({"a": (21,)}))  # both drafts rejected
    a = s.view().requests["a"]
    assert (a.num_output_placeholders, a.num_computed_tokens, a.output_token_ids) == (0, 6, (20, 21))


def test_the_ids_of_drafts_are_ignored_under_async_scheduling() -> None:
    s, p1, p2 = two_in_flight(k=2)
    s.update(p1, StepResult({"a": (20,)}, {"a": (7, 8)}))
    assert s.view().requests["a"].spec_token_ids == (-1, -1)


def test_a_request_sure_to_reach_max_tokens_is_not_scheduled_again() -> None:
    s = SpecScheduler(config(async_scheduling=True, k=0))
    s.add(req("a", 5, max_tokens=2))
    p1 = s.schedule()
    p2 = s.schedule()  # output 2 of 2 in flight behind output 1
    assert entry(p2, "a").num_scheduled_tokens == 1
    s.update(p1, StepResult({"a": (20,)}))
    p3 = s.schedule()
    assert p3.get("a") is None and s.rules["running.skip_max_tokens_in_flight"] == 1
    s.update(p2, StepResult({"a": (21,)}))
    assert s.view().finished["a"].output_token_ids == (20, 21)


def test_a_request_finished_meanwhile_drops_its_next_output() -> None:
    s = SpecScheduler(config(async_scheduling=True, k=0))
    s.add(req("a", 5, max_tokens=5, stop_token_ids=(2,)))
    p1 = s.schedule()
    p2 = s.schedule()
    s.update(p1, StepResult({"a": (2,)}))  # stops on its first token
    assert s.view().finished["a"].status == RequestStatus.FINISHED_STOPPED
    s.update(p2, StepResult({"a": (9,)}))  # the step scheduled behind it: dropped
    assert s.view().finished["a"].output_token_ids == (2,)
    assert s.rules["update.request_gone"] == 1


def test_abort_with_a_step_in_flight() -> None:
    s, p1, p2 = two_in_flight()
    s.abort("a")
    assert s.view().requests == {} and s.kv.num_free == 16
    s.update(p1, StepResult({"a": (5,)}))
    s.update(p2, StepResult({"a": (6,)}))
    assert s.view().finished["a"].output_token_ids == ()
    assert s.view().finished["a"].status == RequestStatus.FINISHED_ABORTED


def test_preemption_with_a_step_in_flight_delivers_stale_output() -> None:
    s = SpecScheduler(config(async_scheduling=True, k=2, num_blocks=5, max_model_len=16, max_num_batched_tokens=16))
    s.add(req("a", 7, max_tokens=8))
    s.add(req("b", 7, max_tokens=8))
    p1 = s.schedule()
    p2 = s.schedule()  # a needs a block: b is preempted with its prefill in flight
    assert p2.preempted_ids == ("b",)
    b = s.view().requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_output_placeholders) == (RequestStatus.PREEMPTED, 0, 0)
    s.update(p1, StepResult({"a": (20,), "b": (21,)}))
    b = s.view().requests["b"]
    # delivered, but the reset counters stay reset
    assert (b.output_token_ids, b.num_computed_tokens, b.num_output_placeholders) == ((21,), 0, 0)
    assert s.rules["async.stale_output"] == 1
    s.update(p2, StepResult({"a": (22,)}))
    p3 = s.schedule()
    assert "b" not in p3.scheduled_ids or entry(p3, "b").kind == ScheduleKind.RESUMED


def test_stale_output_can_stop_a_preempted_request() -> None:
    s = SpecScheduler(config(async_scheduling=True, k=2, num_blocks=5, max_model_len=16, max_num_batched_tokens=16))
    s.add(req("a", 7, max_tokens=8))
    s.add(req("b", 7, max_tokens=8, eos_token_id=3))
    p1 = s.schedule()
    s.schedule()
    s.update(p1, StepResult({"a": (20,), "b": (3,)}))
    fin = s.view().finished["b"]
    assert fin.status == RequestStatus.FINISHED_STOPPED and "b" not in s.view().waiting
    assert s.rules["async.stale_output_stopped"] == 1


def test_reset_prefix_cache_in_flight_drops_the_output_and_readmits() -> None:
    s = SpecScheduler(config(async_scheduling=True, k=2))
    s.add(req("a", 5))
    p1 = s.schedule()
    s.update(p1, StepResult({"a": (20,)}))
    p2 = s.schedule()
    assert s.reset_prefix_cache(reset_running_requests=True)
    a = s.view().requests["a"]
    assert (a.status, a.num_output_placeholders, a.spec_token_ids) == (RequestStatus.PREEMPTED, 0, ())
    p3 = s.schedule()  # re-admitted at once: its stale output will be dropped
    e = entry(p3, "a")
    # the reset emptied the prefix cache: it recomputes everything it knows
    assert e.kind == ScheduleKind.RESUMED and (e.num_computed_tokens, e.num_scheduled_tokens) == (0, 6)
    s.update(p2, StepResult({"a": (30, 31, 32)}))
    a = s.view().requests["a"]
    assert a.output_token_ids == (20,) and s.rules["async.stale_dropped"] == 1
    s.update(p3, StepResult({"a": (33,)}))
    assert s.view().requests["a"].output_token_ids == (20, 33)


def test_reset_without_preempting_fails_while_a_request_holds_blocks() -> None:
    s, p1, p2 = two_in_flight()
    s.update(p1, StepResult({"a": (20,)}))
    assert not s.reset_prefix_cache()  # one step in flight is allowed; a holds blocks
    assert s.kv.view().block_keys


# ---------------------------------------------------------------- the protocol


def unchanged(s: SpecScheduler, fn: Callable[[], object]) -> ProtocolError:
    before = s.view()
    in_flight = s.in_flight
    with pytest.raises(ProtocolError) as info:
        fn()
    assert s.view() == before and s.in_flight == in_flight
    return info.value


def test_async_allows_one_plan_in_flight_not_two() -> None:
    s, p1, p2 = two_in_flight()
    err = unchanged(s, s.schedule)
    assert err.step == 1 and "step 1 must be updated first" in str(err)
    err = unchanged(s, s.reset_prefix_cache)
    assert err.field == "plan"


def test_updates_come_in_plan_order_each_once() -> None:
    s, p1, p2 = two_in_flight()
    err = unchanged(s, lambda: s.update(p2, StepResult({"a": (1,)})))
    assert (err.step, err.field) == (2, "plan") and "out of order" in str(err)
    s.update(p1, StepResult({"a": (1,)}))
    err = unchanged(s, lambda: s.update(p1, StepResult({"a": (1,)})))
    assert err.step == 1 and "not the outstanding one" in str(err)
    forged = dataclasses.replace(p2, scheduled=())
    err = unchanged(s, lambda: s.update(forged, StepResult()))
    assert err.step == 2 and "differs" in str(err)


def test_sync_keeps_its_one_step_rule() -> None:
    s = SpecScheduler(config(k=0))
    s.add(req("a", 5))
    s.schedule()
    assert "before update()" in str(unchanged(s, s.schedule))
    assert "between schedule() and update()" in str(unchanged(s, s.reset_prefix_cache))


@pytest.mark.parametrize(
    "sampled,drafts,field,text",
    [
        ({"a": (30, 31, 40, 41)}, {}, "sampled", "takes 1 to 3"),
        ({"a": ()}, {}, "sampled", "takes 1 to 3"),
        ({"a": (30,)}, {"zz": (1,)}, "draft_token_ids", "did not schedule"),
        ({"a": (30,)}, {"a": (1, 2, 3)}, "draft_token_ids", "num_speculative_tokens is 2"),
        ({"a": (30,)}, {"a": (-1,)}, "draft_token_ids", "tuple of token ids"),
    ],
    ids=["accepted-beyond-drafts", "nothing", "unknown-request", "too-many-drafts", "bad-id"],
)
def test_bad_results_change_nothing(sampled: dict[str, tuple[int, ...]], drafts: dict[str, tuple[int, ...]],
                                    field: str, text: str) -> None:
    s, p = decoding()
    err = unchanged(s, lambda: s.update(p, StepResult(sampled, drafts)))
    assert (err.field, err.step) == (field, p.step) and text in str(err)
    s.update(p, StepResult({"a": (30, 40)}))  # and the scheduler goes on


def test_drafts_need_speculative_decoding() -> None:
    s = SpecScheduler(config(k=0))
    s.add(req("a", 5))
    p = s.schedule()
    err = unchanged(s, lambda: s.update(p, StepResult({"a": (1,)}, {"a": (2,)})))
    assert "num_speculative_tokens is 0" in str(err)


# ---------------------------------------------------------------- config, clone


def test_config_defaults_are_sync_without_drafts_and_old_dicts_load() -> None:
    c = SchedulerConfig()
    assert (c.async_scheduling, c.num_speculative_tokens, c.num_lookahead_tokens) == (False, 0, 0)
    assert "async_scheduling" not in c.to_dict() and "num_speculative_tokens" not in c.to_dict()
    assert SchedulerConfig.from_dict(c.to_dict()) == c
    on = config(async_scheduling=True, k=3)
    assert on.to_dict()["async_scheduling"] is True and on.to_dict()["num_speculative_tokens"] == 3
    assert SchedulerConfig.from_dict(on.to_dict()) == on


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_speculative_tokens=9), "num_speculative_tokens"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(num_speculative_tokens=True), "num_speculative_tokens"),
        (dict(async_scheduling=1), "async_scheduling"),
        (dict(num_speculative_tokens=3, long_prefill_token_threshold=3), "long_prefill_token_threshold"),
        (dict(num_speculative_tokens=4, max_num_batched_tokens=4, max_num_seqs=4), "max_num_batched_tokens"),
    ],
)
def test_bad_configs_name_the_field(kw: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = dict(block_size=4, num_blocks=17, max_num_batched_tokens=32, max_model_len=32)
    base.update(kw)
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(**base)
    assert info.value.field == field


def test_clone_copies_the_new_mutable_state() -> None:
    s, p = decoding()
    s.update(p, StepResult({"a": (30, 40)}, {"a": (50, 51)}))
    c = s.clone()
    assert c.view() == s.view() and c.in_flight == s.in_flight
    p2 = c.schedule()
    assert s.view().requests["a"].spec_token_ids == (50, 51)  # the clone consumed its own copy
    assert c.view().requests["a"].spec_token_ids == ()
    assert s.in_flight == () and c.in_flight == (p2,)
    a1, a2 = s.requests["a"], c.requests["a"]
    assert a1.spec_token_ids is not a2.spec_token_ids


@pytest.mark.parametrize("async_scheduling,k", [(False, 0), (False, 3), (True, 0), (True, 3)])
def test_random_bad_calls_change_nothing_in_any_mode(async_scheduling: bool, k: int) -> None:
    import functools
    import random

    rng = random.Random(7)
    s = SpecScheduler(config(async_scheduling=async_scheduling, k=k, num_blocks=9, max_num_batched_tokens=16))
    queue: list[StepPlan] = []
    rejected = 0
    for i in range(300):
        if rng.random() < 0.2:
            s.add(req(f"r{i}", rng.randint(1, 12), rng.randint(1, 12)))
            continue
        queue.append(s.schedule())
        if async_scheduling and len(queue) < 2:
            continue
        p = queue.pop(0)
        good = {e.request_id: tuple(range(40, 41 + rng.randint(0, len(e.spec_token_ids))))
                for e in p.scheduled if e.samples}
        drafts = {e.request_id: (9,) * k for e in p.scheduled if e.samples}
        bad: list[Callable[[], object]] = [s.schedule] if (queue or not async_scheduling) else []
        if queue:
            bad.append(lambda: s.update(queue[0], StepResult()))  # out of order
        bad.append(lambda: s.update(p, StepResult(good, {"nobody": ()})))
        for e in p.scheduled:
            if not e.samples:
                continue
            rid = e.request_id
            too_many = {**good, rid: tuple(range(2 + len(e.spec_token_ids)))}
            too_many_drafts = {**drafts, rid: (1,) * (k + 1)}
            if rid in s.requests:  # tokens for a request finished meanwhile are anything well-formed
                bad.append(functools.partial(s.update, p, StepResult(too_many)))
            bad.append(functools.partial(s.update, p, StepResult(good, too_many_drafts)))
        for call in bad:
            unchanged(s, call)
            rejected += 1
        s.update(p, StepResult(good, drafts))
        err = unchanged(s, lambda: s.update(p, StepResult(good)))  # the same plan twice
        assert err.step == p.step
    assert rejected > 300


def test_a_padded_decode_that_does_not_fit_the_budget_stops_the_waiting_loop() -> None:
    s = SpecScheduler(config(k=3, max_num_batched_tokens=6, max_num_seqs=4))
    s.add(req("a", 5))
    p = s.schedule()
    s.update(p, StepResult({"a": (20,)}, {"a": (30, 31, 32)}))
    s.add(req("b", 1))  # one token to compute: padded to 4, but 2 are left after a's 4
    s.add(req("c", 2))  # would fit unpadded, yet the loop has stopped
    p = s.schedule()
    assert p.scheduled_ids == ("a",) and entry(p, "a").num_scheduled_tokens == 4
    assert s.rules["admit.blocked_padding"] == 1
    assert s.view().waiting == ("b", "c")
