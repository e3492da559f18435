"""The protocol boundary every scheduler shares: add, abort, schedule, update and
reset_prefix_cache reject bad calls with the same exact messages, on spec and
impl alike, and a rejected update leaves nothing behind."""

from __future__ import annotations

import contextlib

import pytest
from typing import Any, Callable

from schedspec.spec import ProtocolError, RequestError, SchedulerConfig, StepPlan, StepResult

from tests.helpers import BothRaised, Twin, cfg, entries, message, req, spec_and_impl


@spec_and_impl
def test_every_boundary_error_has_its_exact_message(make: Callable[[SchedulerConfig], Any]) -> None:
    assert message(lambda: make({"block_size": 4}), TypeError) == "config must be a SchedulerConfig, got dict"
    config = cfg(max_model_len=8, num_blocks=5, max_num_batched_tokens=8, max_num_seqs=2)
    s = make(config)
    assert s.config == config
    assert message(lambda: s.add("a"), TypeError) == "request must be a RequestSpec, got str"
    s.add(req("a", 3))
    assert message(lambda: s.add(req("a", 3)), RequestError) == "request 'a': request_id: duplicate request id"
    assert (message(lambda: s.add(req("b", 8)), RequestError)
            == "request 'b': prompt_token_ids: prompt length 8 leaves no room for an output token within "
               "max_model_len 8")
    s.add(req("c", 7))  # max_model_len - 1 is accepted
    assert (message(lambda: s.abort("zz"), RequestError)
            == "request 'zz': request_id: no unfinished request with this id")
    assert (message(lambda: s.update(StepPlan(4, (), (), ()), StepResult()), ProtocolError)
            == "update() with a plan that is not the outstanding one (step 4)")
    p = s.schedule()
    assert (message(lambda: s.schedule(), ProtocolError)
            == "schedule() called again before update() of the previous plan")
    assert (message(lambda: s.reset_prefix_cache(), ProtocolError)
            == "reset_prefix_cache between schedule() and update()")
    assert (message(lambda: s.update(StepPlan(9, (), (), ()), StepResult()), ProtocolError)
            == "update() with a plan that is not the outstanding one (step 9)")
    assert message(lambda: s.update(p, {"a": (1,)}), ProtocolError) == "result must be a StepResult, got dict"
    assert (message(lambda: s.update(p, StepResult({"zz": (1,)})), ProtocolError)
            == "result has tokens for 'zz', which the plan did not schedule")
    for bad in ([1], (-1,), (True,), (1.0,), ("1",)):
        assert (message(lambda: s.update(p, StepResult({"a": bad})), ProtocolError)
                == f"result for 'a' must be a tuple of token ids, got {bad!r}")
    assert (message(lambda: s.update(p, StepResult({})), ProtocolError)
            == "result for 'a' has 0 tokens; a completed step takes 1")
    assert (message(lambda: s.update(p, StepResult({"a": (1, 2)})), ProtocolError)
            == "result for 'a' has 2 tokens; a completed step takes 1")
    # c (7 tokens) got a partial chunk: the 5 tokens left of the budget
    assert entries(p) == [("a", "new", 0, 3), ("c", "new", 0, 5)]
    assert (message(lambda: s.update(p, StepResult({"a": (1,), "c": (2,)})), ProtocolError)
            == "result for 'c' has 1 tokens; a partial prefill chunk takes 0")
    before = s.view()
    assert before.requests["a"].output_token_ids == ()
    s.update(p, StepResult({"a": (5,)}))
    assert s.view().requests["a"].output_token_ids == (5,)


def test_rejected_update_rolls_back_every_appended_token() -> None:
    t = Twin(cfg(max_num_batched_tokens=16))
    for rid in "abc":
        t.add(req(rid, 2, max_tokens=10))
    t.add(req("d", 30, max_tokens=10))
    t.step(3)
    t.step(4)  # a, b, c decode; d prefills in chunks
    p = t.schedule()
    sampling = [e.request_id for e in p.scheduled if e.samples]
    assert sampling[:3] == ["a", "b", "c"]
    good = {rid: (8,) for rid in sampling}
    for bad_rid, bad in (("c", (-1,)), ("c", (1, 2)), ("b", ()), ("c", [5]), ("a", (True,))):
        msg = t.expect_error(lambda s: s.update(p, StepResult({**good, bad_rid: bad})))
        assert "ProtocolError" in msg
    msg = t.expect_error(lambda s: s.update(p, StepResult({**good, "zz": (1,)})))
    assert "did not schedule" in msg
    t.update(p, StepResult(good))
    p = t.schedule()
    assert [e.token_ids for e in p.scheduled if e.request_id in "abc"] == [(8,), (8,), (8,)]


def test_tokens_of_a_request_aborted_while_its_step_ran_are_checked_then_dropped() -> None:
    t = Twin(cfg())
    t.add(req("a", 3, max_tokens=4))
    t.add(req("b", 3, max_tokens=4))
    p = t.schedule()
    t.abort("a")
    assert "must be a tuple" in t.expect_error(lambda s: s.update(p, StepResult({"a": (-1,), "b": (1,)})))
    assert "must be a tuple" in t.expect_error(lambda s: s.update(p, StepResult({"a": [1], "b": (1,)})))
    t.update(p, StepResult({"a": (5,), "b": (1,)}))  # a's token is dropped
    assert t.impl.view().finished["a"].output_token_ids == ()
    p = t.schedule()
    t.abort("b")
    t.update(p, StepResult({}))
    assert t.schedule().finished_ids == ("b",)


def test_result_checks_go_on_past_an_aborted_entry() -> None:
    t = Twin(cfg())
    for rid in "abc":
        t.add(req(rid, 3, max_tokens=4))
    p = t.schedule()
    t.abort("a")
    assert "has 0 tokens" in t.expect_error(lambda s: s.update(p, StepResult({"b": (1,)})))
    assert "has 2 tokens" in t.expect_error(lambda s: s.update(p, StepResult({"b": (1,), "c": (1, 2)})))
    t.update(p, StepResult({"b": (1,), "c": (2,)}))


def test_every_mix_of_result_tokens_is_accepted_or_rejected_alike() -> None:
    """Every mix of tokens for sampling, partial-chunk and aborted entries, with
    0 to 5 tokens for requests the plan did not schedule: spec and impl accept
    or reject alike, with the same message."""
    import itertools

    def setup(aborted: tuple[str, ...] = ("d",)) -> tuple[Twin, StepPlan]:
        t = Twin(cfg(max_num_batched_tokens=12))
        t.add(req("a", 3))
        t.add(req("b", 3))
        t.add(req("d", 2))
        t.add(req("c", 9))
        p = t.schedule()
        assert [(e.request_id, e.samples) for e in p.scheduled] == [
            ("a", True), ("b", True), ("d", True), ("c", False)]
        for rid in aborted:
            t.abort(rid)
        return t, p

    options: list[Any] = [None, (1,), (), [1], [], (-1,)]
    accepted = 0
    for c_tok, d_tok, k in itertools.product(options, options, range(6)):
        t, p = setup()
        sampled: dict[str, Any] = {"a": (1,), "b": (2,)}
        for rid, tok in (("c", c_tok), ("d", d_tok)):
            if tok is not None:
                sampled[rid] = tok
        for j in range(k):
            sampled[f"u{j}"] = (3,)
        try:
            t.update(p, StepResult(sampled))
            accepted += 1
        except BothRaised:
            pass
    assert accepted == 2 * 3  # c: none or (); d: none, (1,) or ()
    for b_tok, d_tok, k in itertools.product(options, options, range(4)):  # two aborted entries
        t, p = setup(aborted=("b", "d"))
        sampled = {"a": (1,), "c": ()}
        for rid, tok in (("b", b_tok), ("d", d_tok)):
            if tok is not None:
                sampled[rid] = tok
        for j in range(k):
            sampled[f"u{j}"] = (3,)
        with contextlib.suppress(BothRaised):
            t.update(p, StepResult(sampled))


@spec_and_impl
def test_the_id_of_a_request_finished_since_the_last_plan_is_taken_until_the_next_plan(
        make: Callable[[SchedulerConfig], Any]) -> None:
    """A finished request stays known until a plan reports it in finished_ids:
    adding its id again before that is a duplicate; after it, the id is free."""
    s = make(cfg())
    s.add(req("a", 3, max_tokens=1))
    p = s.schedule()
    s.update(p, StepResult({"a": (5,)}))  # a stops at max_tokens
    assert "a" in s.view().finished
    assert message(lambda: s.add(req("a", 3)), RequestError) == "request 'a': request_id: duplicate request id"
    s.add(req("b", 3))
    s.abort("b")
    assert message(lambda: s.add(req("b", 3)), RequestError) == "request 'b': request_id: duplicate request id"
    assert s.schedule().finished_ids == ("a", "b")
    s.add(req("a", 3))  # reported: the id is free again
    assert s.view().waiting == ("a",)


def test_a_protocol_error_names_the_plans_step_and_the_field() -> None:
    """ProtocolError.step is the step of the plan the refused call concerns,
    ``field`` the part of the call at fault."""
    from schedspec.spec.scheduler import SpecScheduler

    s = SpecScheduler(cfg())
    s.add(req("a", [1, 2, 3]))
    s.update(s.schedule(), StepResult({"a": (5,)}))
    plan = s.schedule()
    assert plan.step == 2
    try:
        s.update(plan, StepResult({"a": (6,)}, finished_recving=("a",)))
    except ProtocolError as e:
        assert (e.step, e.field) == (2, "finished_recving")
        assert str(e) == "finished_recving reported but the config has no KV connector"
    else:
        raise AssertionError("update accepted a KV report without a connector")


def test_boundary_errors_name_their_step_and_field() -> None:
    """A ProtocolError carries the field it is about and, for a plan's
    result, the plan's step: schedule() twice names the plan; a draft for
    an unknown request names the drafts and the step."""
    import pytest

    from schedspec.spec.scheduler import SpecScheduler

    s = SpecScheduler(cfg(max_model_len=16, num_blocks=9, max_num_batched_tokens=16, num_speculative_tokens=2))
    s.add(req("a", 3))
    p = s.schedule()
    with pytest.raises(ProtocolError) as exc:
        s.schedule()
    assert exc.value.field == "plan"
    with pytest.raises(ProtocolError) as exc:
        s.update(p, StepResult({"a": (1,)}, draft_token_ids=[(1,)]))  # type: ignore[arg-type]
    assert (exc.value.field, exc.value.step) == ("draft_token_ids", p.step)
    # async scheduling: a third schedule() with two plans in flight names the plan too
    s = SpecScheduler(cfg(max_model_len=16, num_blocks=9, max_num_batched_tokens=16, async_scheduling=True))
    s.add(req("a", 3))
    s.schedule()
    s.schedule()
    with pytest.raises(ProtocolError) as exc:
        s.schedule()
    assert exc.value.field == "plan"


@spec_and_impl
def test_boundary_errors_name_their_step_and_field(make: Callable[[SchedulerConfig], Any]) -> None:
    s = make(cfg(max_num_batched_tokens=8))
    s.add(req("a", 3))
    with pytest.raises(ProtocolError) as e:
        s.update(StepPlan(4, (), (), ()), StepResult())
    assert (e.value.step, e.value.field) == (4, "plan")
    a = make(cfg(async_scheduling=True))
    a.add(req("a", 3))
    a.schedule()
    a.schedule()
    with pytest.raises(ProtocolError) as e:
        a.schedule()
    assert str(e.value) == ("schedule() with steps 1, 2 in flight: async scheduling allows one plan in flight, "
                            "so step 1 must be updated first")
    assert (e.value.step, e.value.field) == (1, "plan")
    c = make(cfg(kv_connector=True))
    with pytest.raises(ProtocolError) as e:
        c.add(req("x", 4, kv_external_tokens=4))
    assert str(e.value) == (
        "request 'x': a synchronous load of all 4 prompt tokens leaves none to compute (vLLM asserts "
        "num_new_tokens > 0); load at most the prompt less one token, or load asynchronously")
