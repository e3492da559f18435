"""Scenario tests: each pins one vLLM 0.33 rule of the spec with exact numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from schedspec.spec import (
    ConfigError,
    Policy,
    ProtocolError,
    RequestError,
    RequestSpec,
    RequestStatus,
    ScheduleKind,
    Scheduler,
    SchedulerConfig,
    SpecScheduler,
    StepPlan,
    StepResult,
)

from tests.helpers import cfg, entries, req, step  # the shared scenario helpers


# ---------------------------------------------------------------- KV pool


def test_block_zero_is_reserved_and_free_queue_starts_in_id_order() -> None:
    s = SpecScheduler(cfg())
    v = s.view()
    assert v.kv.free_queue == tuple(range(1, 9))
    s.add(req("a", 5))
    plan = s.schedule()
    assert plan.scheduled[0].block_ids == (1, 2)  # allocation pops the head


def test_freed_blocks_tail_first_unkeyed_to_front_keyed_to_back() -> None:
    # block_pool.py BlockPool.free_blocks: LIFO for blocks without a hash,
    # LRU tail for cached ones; kv_cache_manager.free walks the table reversed.
    s = SpecScheduler(cfg())
    s.add(req("a", 10, max_tokens=1))  # blocks 1,2 full (keyed), block 3 partial
    plan = step(s)
    assert plan.scheduled[0].block_ids == (1, 2, 3)
    s.schedule()  # reports 'a' finished; the table was freed at update
    assert s.view().kv.free_queue == (3, 4, 5, 6, 7, 8, 2, 1)


def test_freed_blocks_all_go_to_the_front_without_prefix_caching() -> None:
    s = SpecScheduler(cfg(enable_prefix_caching=False))
    s.add(req("a", 10, max_tokens=1))
    step(s)
    assert s.view().kv.free_queue == (3, 2, 1, 4, 5, 6, 7, 8)
    assert s.view().kv.block_keys == {}


def test_prefix_hit_reuses_blocks_and_is_capped_below_num_tokens() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 8, max_tokens=1))
    step(s)
    # Same 8-token prompt: both blocks are cached, but a hit may cover at most
    # 7 tokens, so only block 1 is reused and the last block is recomputed.
    s.add(req("b", 8, max_tokens=1))
    plan = s.schedule()
    (e,) = plan.scheduled
    assert (e.kind, e.num_computed_tokens, e.num_scheduled_tokens) == (ScheduleKind.NEW, 4, 4)
    assert e.block_ids[0] == 1
    assert e.token_ids == (4, 5, 6, 7)


def test_hit_takes_blocks_out_of_the_free_queue_and_counts_them_for_admission() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 9, max_tokens=1))
    step(s)
    free_before = s.view().kv.free_queue
    assert 1 in free_before and 2 in free_before
    s.add(req("b", list(range(8)) + [99]))
    plan = s.schedule()
    assert plan.scheduled[0].block_ids[:2] == (1, 2)
    kv = s.view().kv
    assert 1 not in kv.free_queue and 2 not in kv.free_queue
    assert kv.ref_cnt[1] == kv.ref_cnt[2] == 1


def test_salt_separates_cache_entries() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 9, max_tokens=1, cache_salt="x"))
    step(s)
    s.add(req("b", 9, max_tokens=1))
    assert s.schedule().scheduled[0].num_computed_tokens == 0


def test_blocks_are_cached_at_allocation_so_a_same_step_admission_hits_them() -> None:
    # allocate_slots caches min(computed + new, num_tokens) tokens' full blocks
    # when it allocates, before the step runs.
    s = SpecScheduler(cfg())
    s.add(req("a", 9, max_tokens=2))
    s.add(req("b", 9, max_tokens=2))
    plan = s.schedule()
    assert entries(plan) == [("a", "new", 0, 9), ("b", "new", 8, 1)]
    assert plan.scheduled[1].block_ids[:2] == plan.scheduled[0].block_ids[:2]


def test_allocation_evicts_cached_blocks_from_the_head() -> None:
    s = SpecScheduler(cfg(num_blocks=9))
    s.add(req("a", 9, max_tokens=1))
    step(s)
    s.add(req("big", [50] * 31, max_tokens=1))  # needs all 8 usable blocks
    plan = s.schedule()
    assert len(plan.scheduled[0].block_ids) == 8
    assert s.view().kv.block_keys.keys() == {s.view().requests["big"].block_ids[i] for i in range(7)}


# ---------------------------------------------------------------- schedule()


def test_running_first_then_waiting_and_token_budget() -> None:
    s = SpecScheduler(cfg(max_num_batched_tokens=8, long_prefill_token_threshold=0))
    s.add(req("a", 10))
    s.add(req("b", 3))
    p1 = s.schedule()
    assert entries(p1) == [("a", "new", 0, 8)]
    s.update(p1, StepResult({}))
    p2 = s.schedule()
    assert entries(p2) == [("a", "running", 8, 2), ("b", "new", 0, 3)]


def test_long_prefill_threshold_and_lone_request_exemption() -> None:
    s = SpecScheduler(cfg(long_prefill_token_threshold=3))
    s.add(req("a", 10))
    p = s.schedule()  # only one request: the threshold is not applied
    assert entries(p) == [("a", "new", 0, 10)]
    s2 = SpecScheduler(cfg(long_prefill_token_threshold=3))
    s2.add(req("a", 10))
    s2.add(req("b", 10))
    p = s2.schedule()
    assert entries(p) == [("a", "new", 0, 3), ("b", "new", 0, 3)]


def test_chunked_prefill_off_prompt_that_does_not_fit_the_budget_waits() -> None:
    s = SpecScheduler(cfg(enable_chunked_prefill=False, max_num_batched_tokens=32))
    s.add(req("a", 20))
    s.add(req("b", [5] * 20))
    s.add(req("c", [6] * 2))
    p = s.schedule()
    # b does not fit the 12 tokens left; the loop stops, c is not tried.
    assert entries(p) == [("a", "new", 0, 20)]


def test_max_num_seqs_limits_admission() -> None:
    s = SpecScheduler(cfg(max_num_seqs=2))
    for r in "abc":
        s.add(req(r, 2))
    assert [e.request_id for e in s.schedule().scheduled] == ["a", "b"]


def test_admission_needs_the_whole_prompt_to_fit_with_reserve_full_isl() -> None:
    for reserve, expected in ((True, []), (False, [("b", "new", 0, 3)])):
        s = SpecScheduler(cfg(max_num_batched_tokens=8, long_prefill_token_threshold=4, num_blocks=9,
                              scheduler_reserve_full_isl=reserve))
        s.add(req("a", 16, max_tokens=10))
        s.add(req("x", [9] * 4, max_tokens=10))
        step(s)
        # a holds 1 block, x holds 1; a's next chunk takes one more: 5 free,
        # and b's 28-token prompt needs 7.
        s.add(req("b", [5] * 28))
        p = s.schedule()
        assert [t for t in entries(p) if t[0] == "b"] == expected


def test_fcfs_preempts_the_last_running_and_puts_it_in_front() -> None:
    s = SpecScheduler(cfg(num_blocks=5, max_model_len=16))  # 4 usable blocks
    s.add(req("a", 4, max_tokens=10))
    s.add(req("b", [9] * 4, max_tokens=10))
    s.add(req("c", [8] * 3, max_tokens=10))
    step(s)  # a, b, c hold one block each; 1 free
    p = s.schedule()  # a takes the last free block; b needs one: c (last) is preempted
    assert p.preempted_ids == ("c",)
    assert [e.request_id for e in p.scheduled] == ["a", "b"]
    v = s.view()
    assert v.waiting[0] == "c" and v.requests["c"].status == RequestStatus.PREEMPTED
    assert v.requests["c"].num_computed_tokens == 0 and v.requests["c"].block_ids == ()
    assert v.requests["c"].output_token_ids == (7,)  # kept across preemption


def test_no_admission_in_a_step_that_preempted() -> None:
    s = SpecScheduler(cfg(num_blocks=5, max_model_len=16))
    s.add(req("a", 4, max_tokens=10))
    s.add(req("b", [9] * 4, max_tokens=10))
    s.add(req("c", [8] * 3, max_tokens=10))
    step(s)
    s.add(req("d", 1))
    p = s.schedule()
    assert p.preempted_ids == ("c",)
    assert "d" not in p.scheduled_ids


def test_resumed_request_comes_back_as_resumed_with_its_outputs() -> None:
    s = SpecScheduler(cfg(num_blocks=5, max_model_len=16))
    s.add(req("a", 4, max_tokens=3))
    s.add(req("b", [9] * 4, max_tokens=10))
    s.add(req("c", [8] * 3, max_tokens=10))
    step(s)
    kinds = {}
    for _ in range(10):
        p = step(s)
        for e in p.scheduled:
            kinds.setdefault(e.request_id, set()).add(e.kind)
            if e.request_id == "c" and e.kind == ScheduleKind.RESUMED:
                # the whole prompt and every output so far is recomputed
                assert e.num_computed_tokens == 0 and e.num_scheduled_tokens == e.num_tokens
                assert e.token_ids == (8, 8, 8) + (7,) * (e.num_tokens - 3)
    assert ScheduleKind.RESUMED in kinds["c"]


def test_priority_victim_is_max_priority_then_arrival_and_gives_budget_back() -> None:
    c = cfg(num_blocks=5, max_model_len=16, policy=Policy.PRIORITY)
    s = SpecScheduler(c)
    s.add(req("low", [1] * 4, max_tokens=10, priority=5, arrival=0))
    step(s)  # low alone: 1 block, 5 tokens
    s.add(req("hi", [2] * 8, max_tokens=10, priority=0, arrival=1))
    p = step(s)  # low takes a 2nd block, hi is admitted with 2: the pool is full
    assert entries(p) == [("low", "running", 4, 1), ("hi", "new", 0, 8)]
    p = s.schedule()
    # running order is [low, hi]: low is scheduled first (no new block), then
    # hi needs a 3rd block; the victim is low, already scheduled in this step,
    # so it leaves the plan and its tokens go back to the budget.
    assert p.preempted_ids == ("low",)
    assert entries(p) == [("hi", "running", 8, 1)]
    assert s.view().running == ("hi",)


def test_priority_waiting_order_is_priority_then_arrival_then_id() -> None:
    s = SpecScheduler(cfg(policy=Policy.PRIORITY, max_num_seqs=1))
    s.add(req("b", 2, priority=1, arrival=5))
    s.add(req("z", 2, priority=0, arrival=7))
    s.add(req("a", 2, priority=1, arrival=5))
    assert s.view().waiting == ("z", "a", "b")
    assert s.schedule().scheduled_ids == ("z",)


# ---------------------------------------------------------------- update()


@pytest.mark.parametrize(
    ("kw", "token", "status", "n_out"),
    [
        (dict(eos_token_id=7), 7, RequestStatus.FINISHED_STOPPED, 1),
        (dict(eos_token_id=7, ignore_eos=True, max_tokens=3), 7, RequestStatus.FINISHED_LENGTH_CAPPED, 3),
        (dict(stop_token_ids=(7,)), 7, RequestStatus.FINISHED_STOPPED, 1),
        (dict(max_tokens=2), 7, RequestStatus.FINISHED_LENGTH_CAPPED, 2),
    ],
)
def test_stop_conditions(kw: dict[str, object], token: int, status: RequestStatus, n_out: int) -> None:
    s = SpecScheduler(cfg())
    params: dict[str, object] = dict(max_tokens=10)
    params.update(kw)
    s.add(req("a", 3, **params))
    finished = None
    for _ in range(12):
        step(s, token)
        if s.view().finished:
            finished = s.view().finished["a"]
            break
    assert finished is not None
    assert finished.status == status and len(finished.output_token_ids) == n_out


def test_max_model_len_caps_length() -> None:
    s = SpecScheduler(cfg(max_model_len=8))
    s.add(req("a", 6, max_tokens=100))
    step(s)
    step(s)
    fin = s.view().finished["a"]
    assert fin.status == RequestStatus.FINISHED_LENGTH_CAPPED and fin.num_tokens == 8


def test_partial_prefill_chunk_gets_no_token_and_finished_reported_once() -> None:
    s = SpecScheduler(cfg(max_num_batched_tokens=8, max_num_seqs=4))
    s.add(req("a", 12, max_tokens=1))
    p = s.schedule()
    assert p.scheduled[0].is_prefill_chunk
    with pytest.raises(ProtocolError):
        s.update(p, StepResult({"a": (1,)}))
    s.update(p, StepResult({}))
    step(s)
    p3 = s.schedule()
    assert p3.finished_ids == ("a",)
    s.update(p3, StepResult({}))
    assert s.schedule().finished_ids == ()


def test_abort_in_every_state_frees_blocks() -> None:
    s = SpecScheduler(cfg(num_blocks=5, max_model_len=16))
    s.add(req("a", 4, max_tokens=10))
    s.add(req("b", [9] * 4, max_tokens=10))
    s.add(req("c", [8] * 3, max_tokens=10))
    s.add(req("w", [6] * 15, max_tokens=10))
    step(s)
    step(s)  # c preempted
    v = s.view()
    assert v.requests["c"].status == RequestStatus.PREEMPTED
    for rid in ("c", "w", "a"):
        s.abort(rid)
    s.abort("b")
    v = s.view()
    assert not v.requests and v.kv.num_free_blocks == 4
    assert {r.status for r in v.finished.values()} == {RequestStatus.FINISHED_ABORTED}
    with pytest.raises(RequestError):
        s.abort("a")


def test_abort_between_schedule_and_update_drops_the_output() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 3))
    p = s.schedule()
    s.abort("a")
    s.update(p, StepResult({"a": (1,)}))
    assert s.view().finished["a"].output_token_ids == ()


# ---------------------------------------------------------------- reset, errors


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 9, max_tokens=5))
    step(s)
    assert s.reset_prefix_cache() is False
    assert s.view().kv.block_keys
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    v = s.view()
    assert v.requests["a"].status == RequestStatus.PREEMPTED and not v.kv.block_keys
    assert s.schedule().preempted_ids == ("a",)


def test_bad_requests_are_rejected_and_change_nothing() -> None:
    s = SpecScheduler(cfg(max_model_len=8))
    s.add(req("a", 3))
    before = s.view()
    with pytest.raises(RequestError) as e1:
        s.add(req("a", 3))
    assert e1.value.field == "request_id"
    with pytest.raises(RequestError) as e2:
        s.add(req("b", 8))
    assert e2.value.field == "prompt_token_ids"
    assert s.view() == before
    with pytest.raises(RequestError):
        RequestSpec("x", (), 1)
    with pytest.raises(RequestError):
        RequestSpec("x", (1, -2), 1)
    with pytest.raises(RequestError):
        RequestSpec("x", (1,), 0)


def test_protocol_errors_change_nothing() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 3))
    p = s.schedule()
    with pytest.raises(ProtocolError):
        s.schedule()
    before = s.view()
    for bad in (StepResult({}), StepResult({"a": (1, 2)}), StepResult({"zz": (1,)}), StepResult({"a": (-1,)})):
        with pytest.raises(ProtocolError):
            s.update(p, bad)
        assert s.view() == before
    with pytest.raises(ProtocolError):
        s.reset_prefix_cache()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(block_size=0), "block_size"),
        (dict(num_blocks=1), "num_blocks"),
        (dict(num_blocks=4, max_model_len=32), "num_blocks"),
        (dict(max_num_batched_tokens=4, max_num_seqs=8), "max_num_batched_tokens"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=16), "max_num_batched_tokens"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
        (dict(long_prefill_token_threshold=40), "long_prefill_token_threshold"),
        (dict(max_num_seqs=True), "max_num_seqs"),
        (dict(policy="fcfs"), "policy"),
    ],
)
def test_bad_configs_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        cfg(**kw)
    assert e.value.field == field


def test_status_transitions_are_enforced() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 3))
    r = s.requests["a"]
    with pytest.raises(AssertionError):
        r.set_status(RequestStatus.PREEMPTED)  # WAITING -> PREEMPTED is not legal


# ---------------------------------------------------------------- clone()


def _clone_workload(s: SpecScheduler, seed: int) -> list[object]:
    """Drive ``s`` through a small random workload with shared prefixes, a
    tight pool (so preemption and eviction happen) and aborts; return every
    event applied, so the same events can be replayed on another scheduler."""
    import random

    rng = random.Random(seed)
    events: list[object] = []
    n = 0
    for _ in range(40):
        r = rng.random()
        if r < 0.3:
            prompt = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randint(1, 8)] + [rng.randint(0, 9) for _ in range(rng.randint(0, 6))]
            spec = req(f"r{n}", prompt, rng.randint(1, 6), priority=rng.randint(0, 2), arrival=n)
            n += 1
            s.add(spec)
            events.append(spec)
        elif r < 0.38 and s.requests:
            rid = rng.choice(sorted(s.requests))
            s.abort(rid)
            events.append(rid)
        else:
            events.append(step(s, token=rng.randint(0, 9)))
    return events


def _continue(s: SpecScheduler, seed: int) -> list[object]:
    """A deterministic continuation: views and plans of a fixed event script."""
    out: list[object] = [s.view()]
    if s.outstanding is not None:
        plan = s.outstanding
        s.update(plan, StepResult({e.request_id: (3,) for e in plan.scheduled if e.samples and e.request_id in s.requests}))
    for i in range(6):
        s.add(req(f"c{seed}-{i}", [1, 2, 3, 4, 5, 6, 9, i], 3))
        out.append(step(s, token=i))
        out.append(s.view())
    out.append(s.reset_prefix_cache(reset_running_requests=True))
    for _ in range(8):
        out.append(step(s))
    out.append(s.view())
    return out


@pytest.mark.parametrize("policy", [Policy.FCFS, Policy.PRIORITY])
@pytest.mark.parametrize("seed", range(4))
def test_clone_is_equal_and_independent(policy: Policy, seed: int) -> None:
    config = cfg(num_blocks=7, max_model_len=20, max_num_batched_tokens=16, long_prefill_token_threshold=6, policy=policy)
    s = SpecScheduler(config)
    _clone_workload(s, seed)
    for mid_step in (False, True):
        if mid_step:
            s.add(req("m", [1, 2, 3, 4, 5], 2))
            s.schedule()  # clone between schedule() and update()
        c = s.clone()
        assert type(c) is SpecScheduler
        before = s.view()
        assert c.view() == before
        assert c.outstanding == s.outstanding
        # Running the clone on leaves the original untouched ...
        got = _continue(c, seed)
        assert s.view() == before
        # ... and the original, run through the same script, does what the clone did.
        assert _continue(s, seed) == got
        s = SpecScheduler(config)
        _clone_workload(s, seed)


def test_clone_shares_no_mutable_structure() -> None:
    s = SpecScheduler(cfg(num_blocks=7, max_model_len=20))
    s.add(req("a", 9))
    s.add(req("b", [0, 1, 2, 3, 4]))
    step(s)
    c = s.clone()
    before = s.view()
    # Mutate every structure of the clone by hand.
    c.requests["a"].output_token_ids.append(99)
    c.requests["a"].blocks.append(6)
    c.requests["a"].num_computed_tokens = 0
    c.waiting.append("x")
    c.running.pop()
    c.finished["x"] = before.requests["a"]
    c.preempted.add("x")
    c.kv.ref_cnt[1] += 5
    c.kv.free_queue.pop()
    c.kv.block_key.clear()
    next(iter(c.kv.index.values())).append(42)
    assert s.view() == before
    assert c.view() != before


def test_clone_negative_control_a_shallow_copy_is_caught() -> None:
    """The independence check above fails for a copy that shares lists: the
    test can fail."""
    import copy

    s = SpecScheduler(cfg(num_blocks=7, max_model_len=20))
    s.add(req("a", 9))
    step(s)
    shallow = copy.copy(s)
    before = s.view()
    step(shallow)
    assert s.view() != before


# ---------------------------------------------------------------- docs/spec.md worked example


def test_worked_example_in_docs_is_fresh(tmp_path: Path) -> None:
    """docs/spec.md holds, between its markers, exactly what running the spec
    prints; refresh it with ``python -m schedspec.spec.worked_example --write
    docs/spec.md``."""
    from schedspec.spec import worked_example as we

    doc = Path(__file__).resolve().parents[2] / "docs" / "spec.md"
    text = doc.read_text()
    generated = we.render()
    assert we.splice(text, generated) == text, "docs/spec.md is stale: regenerate the worked example"
    # The example shows what the prose says it shows.
    assert "8 from the cache" in generated and "preempted C" in generated
    assert "C resumed  tokens 4..12, 4 from the cache" in generated
    # Negative control: a stale copy is detected, and --write repairs it.
    stale = tmp_path / "spec.md"
    stale.write_text(text.replace("free      7 5 3 ", "free      3 5 7 "))
    assert we.splice(stale.read_text(), generated) != stale.read_text()
    assert we.main(["--write", str(stale)]) == 0
    assert stale.read_text() == text
    no_markers = tmp_path / "bare.md"
    no_markers.write_text("# nothing here\n")
    with pytest.raises(ValueError, match="markers"):
        we.main(["--write", str(no_markers)])


def test_worked_example_prints_without_arguments_and_rejects_any_other_than_write_file(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from schedspec.spec import worked_example as we

    usage = "usage: python -m schedspec.spec.worked_example [--write FILE]\n"
    monkeypatch.setattr(sys, "argv", ["worked_example"])
    assert we.main() == 0  # the arguments come from sys.argv when none are given
    assert capsys.readouterr() == (we.render() + "\n", "")
    for bad in (["--write"], ["--out", "x.md"], ["x.md", "--write"], ["--write", "a.md", "b.md"]):
        assert we.main(bad) == 2, bad
        assert capsys.readouterr() == ("", usage), bad
    monkeypatch.setattr(sys, "argv", ["worked_example", "--write"])
    assert we.main() == 2
    assert capsys.readouterr() == ("", usage)


def test_worked_example_splice_replaces_only_the_first_marked_region() -> None:
    from schedspec.spec import worked_example as we

    b, e = we.BEGIN, we.END
    doc = f"intro\n{b}\nold\n{e}\nprose quoting {e}\n{b}\nsecond\n{e}\nend\n"
    assert we.splice(doc, "new") == f"intro\n{b}\nnew\n{e}\nprose quoting {e}\n{b}\nsecond\n{e}\nend\n"
    lacks = f"the document lacks the markers {b!r} .. {e!r}"
    for bad in (f"{b}\nold\n", f"old\n{e}\n", "no markers\n"):
        with pytest.raises(ValueError) as info:
            we.splice(bad, "new")
        assert str(info.value) == lacks


def test_worked_example_shows_empty_steps_joint_arrivals_two_preemptions_and_joint_finishes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's formatting, on arrivals other than the document's: a step
    with nothing to do, three arrivals at once, two preemptions in one step
    (X takes Z's only block, then Y finds none and preempts itself) and two
    requests finishing together."""
    from schedspec.spec import worked_example as we

    monkeypatch.setattr(we, "ARRIVALS", {2: (RequestSpec("X", tuple(range(1, 13)), max_tokens=2),
                                             RequestSpec("Y", tuple(range(20, 32)), max_tokens=2),
                                             RequestSpec("Z", (40, 41, 42, 43), max_tokens=2))})
    monkeypatch.setattr(we, "NUM_STEPS", 4)
    steps = we.render().split("\n\n")
    assert len(steps) == 4
    assert steps[0].splitlines() == [
        "```text",
        "Time 1: schedule, update",
        "  tables    -   (waiting: -)",
        "  block      1  2  3  4  5  6  7",
        "  ref_cnt    0  0  0  0  0  0  0",
        "  free      1 2 3 4 5 6 7   (head .. tail)",
        "  cached    -",
    ]
    assert steps[1].splitlines()[0] == (
        "Time 2: add X (prompt 1 2 3 4 5 6 7 8 9 10 11 12); add Y (prompt 20 21 22 23 24 25 26 27 28 29 30 31); "
        "add Z (prompt 40 41 42 43); schedule, update")
    assert steps[2].splitlines()[:5] == [
        "Time 3: schedule, update",
        "  plan      X running  tokens 12..12",
        "  preempted Y Z",
        "  finished  X",
        "  tables    Y=[]  Z=[]   (waiting: Y Z)",
    ]
    assert steps[3].splitlines()[3:5] == ["  finished  Y Z", "  tables    -   (waiting: -)"]
    assert steps[3].endswith("\n```")
