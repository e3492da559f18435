"""The checking engine's KV connector and hybrid groups: the worker the fake
model plays (KVWorker), the generator's --kv dimension, quiescence, trace
format 4, capabilities, shrinking, statistics and the report."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest

from schedspec.check import trace as tracefile
from schedspec.check.capabilities import Capabilities
from schedspec.check.driver import Runner
from schedspec.check.run import needs_quiescence, run_workload
from schedspec.check.oracle import FakeModel, KVWorker
from schedspec.check.report import cell_states, kv_text, step_table
from schedspec.check.shrink import _consistent, _config_options, _kv_options
from schedspec.check.stats import Stats
from schedspec.check.features import KV_FEATURES, kv_of, parse_kv
from schedspec.check.kv_requests import chunk_rng, draw_kv_groups, kv_rng
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import (
    KV_REPORT_BOUND,
    Abort,
    AddRequest,
    Event,
    KVLoadDone,
    KVLoadFailed,
    KVSaveDone,
    Step,
    describe_event,
)
from schedspec.spec.interface import (
    KVCacheGroup,
    KVLoad,
    KVView,
    RequestSpec,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)
from schedspec.spec.scheduler import SpecScheduler

CFG = SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32,
                      kv_connector=True)
PROMPT = tuple(range(1, 12))  # 11 tokens: blocks 0..2


def _req(rid: str, **kw: Any) -> RequestSpec:
    return RequestSpec(rid, kw.pop("prompt", PROMPT), kw.pop("max_tokens", 4), **kw)


def _view(requests: dict[str, RequestStatus] | None = None, held: dict[str, tuple[int, ...]] | None = None,
          config: SchedulerConfig = CFG) -> SchedulerView:
    reqs = {rid: RequestView.of(_req(rid), status=st, output_token_ids=(), num_computed_tokens=0, block_ids=(),
                                num_preemptions=0)
            for rid, st in (requests or {}).items()}
    kv = KVView(config.num_blocks, config.block_size, (0,) * config.num_blocks, (), {}, {})
    return SchedulerView(config, 0, reqs, tuple(reqs), (), kv, {}, kv_held_by_finished=held or {})


def _plan(step: int, loads: tuple[KVLoad, ...] = (), scheduled: tuple[ScheduledRequest, ...] = ()) -> StepPlan:
    return StepPlan(step, scheduled, (), (), kv_loads=loads)


ASYNC = KVLoad("a", 0, 11, (5, 6, 7), True)


def _entry(rid: str, kind: ScheduleKind, toks: tuple[int, ...], computed: int, n: int,
           blocks: tuple[int, ...], groups: tuple[tuple[int, ...], ...] = ()) -> ScheduledRequest:
    return ScheduledRequest.of(rid, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
                               all_token_ids=toks, block_ids=blocks, group_block_ids=groups)


def _worker(config: SchedulerConfig = CFG) -> tuple[KVWorker, FakeModel]:
    model = FakeModel(config.block_size, groups=config.groups if config.is_hybrid else ())
    worker = KVWorker(config, model)
    worker.add("a", PROMPT)
    return worker, model


# ------------------------------------------------------------------ the worker


def test_an_async_load_is_reported_done_in_the_result_after_its_event_and_its_kv_written() -> None:
    worker, model = _worker()
    waiting = _view({"a": RequestStatus.WAITING_FOR_REMOTE_KVS})
    worker.post(KVLoadDone("a"))
    assert worker.before(_plan(1, (ASYNC,))) == set()
    result = worker.after(_plan(1, (ASYNC,)), waiting, StepResult())
    assert result.finished_recving == ("a",) and result.failed_recving == () and result.invalid_block_ids == ()
    assert [model.slots[5 * 4 + i] for i in range(4)] == [1, 2, 3, 4]
    assert model.slots[7 * 4 + 2] == 11 and 7 * 4 + 3 not in model.slots
    assert worker.unapplied == {1: {"a"}} and worker.loads == {}
    worker.updated(1)
    assert not worker.reports_pending


def test_the_bounded_wait_reports_an_async_load_exactly_bound_steps_after_it_started() -> None:
    worker, _ = _worker()
    waiting = _view({"a": RequestStatus.WAITING_FOR_REMOTE_KVS})
    worker.before(_plan(3, (ASYNC,)))
    assert worker.after(_plan(3, (ASYNC,)), waiting, StepResult()).finished_recving == ()
    for step in range(4, 3 + KV_REPORT_BOUND):
        worker.before(_plan(step))
        assert worker.after(_plan(step), waiting, StepResult()).finished_recving == (), step
    worker.before(_plan(3 + KV_REPORT_BOUND))
    result = worker.after(_plan(3 + KV_REPORT_BOUND), waiting, StepResult())
    assert result.finished_recving == ("a",) and worker.last.timed_out == 1
    assert KV_REPORT_BOUND == 8


def test_a_failed_async_load_is_in_failed_recving_and_finished_recving_with_nothing_written() -> None:
    worker, model = _worker()
    waiting = _view({"a": RequestStatus.WAITING_FOR_REMOTE_KVS})
    worker.post(KVLoadFailed("a"))
    worker.before(_plan(1, (ASYNC,)))
    result = worker.after(_plan(1, (ASYNC,)), waiting, StepResult())
    assert (result.finished_recving, result.failed_recving, result.invalid_block_ids) == (("a",), ("a",), ())
    assert model.slots == {}


def test_an_invalid_block_of_an_async_load_is_taken_within_the_loaded_blocks_and_the_kv_before_it_written() -> None:
    worker, model = _worker()
    waiting = _view({"a": RequestStatus.WAITING_FOR_REMOTE_KVS})
    load = KVLoad("a", 4, 11, (5, 6, 7), True)  # a local hit of block 5: the load fills blocks 6 and 7
    worker.post(KVLoadFailed("a", 0))  # before the loaded blocks: the first loaded one
    worker.before(_plan(1, (load,)))
    result = worker.after(_plan(1, (load,)), waiting, StepResult())
    assert (result.finished_recving, result.failed_recving, result.invalid_block_ids) == (("a",), (), (6,))
    assert model.slots == {}  # nothing before the invalid block is loaded (block 5 was a local hit)
    worker2, model2 = _worker()
    worker2.post(KVLoadFailed("a", 2))
    worker2.before(_plan(1, (load,)))
    assert worker2.after(_plan(1, (load,)), waiting, StepResult()).invalid_block_ids == (7,)
    assert sorted(model2.slots) == [24, 25, 26, 27] and [model2.slots[s] for s in range(24, 28)] == [5, 6, 7, 8]


def test_with_more_than_one_group_an_invalid_block_is_reported_as_failed_recving() -> None:
    cfg = dataclasses.replace(CFG, kv_cache_groups=(KVCacheGroup(), KVCacheGroup("sliding_window", 8)), num_blocks=40)
    worker, _ = _worker(cfg)
    load = KVLoad("a", 0, 11, (5, 6, 7), True, ((5, 6, 7), (0, 9, 10)))
    worker.post(KVLoadFailed("a", 1))
    worker.before(_plan(1, (load,)))
    result = worker.after(_plan(1, (load,)), _view({"a": RequestStatus.WAITING_FOR_REMOTE_KVS}, config=cfg),
                          StepResult())
    assert (result.finished_recving, result.failed_recving, result.invalid_block_ids) == (("a",), ("a",), ())


def test_a_failed_sync_load_reports_its_block_in_its_own_plan_and_affects_requests_reading_it() -> None:
    worker, model = _worker()
    worker.add("b", PROMPT)
    load = KVLoad("a", 0, 8, (5, 6, 7), False)
    a = _entry("a", ScheduleKind.NEW, PROMPT, 8, 3, (5, 6, 7))
    b = _entry("b", ScheduleKind.NEW, PROMPT, 8, 3, (5, 6, 9))  # a prefix hit on a's blocks
    c = _entry("c", ScheduleKind.NEW, PROMPT, 4, 7, (5, 10, 11))
    worker.post(KVLoadFailed("a", 1))
    plan = _plan(2, (load,), (a, b, c))
    assert worker.before(plan) == {"a", "b"}
    assert sorted(model.slots) == [20, 21, 22, 23]  # block 5 loaded, block 6 not
    result = worker.after(plan, _view({"a": RequestStatus.RUNNING}), StepResult(sampled={"a": (1,), "b": (2,)}))
    assert result.invalid_block_ids == (6,) and result.finished_recving == ()
    assert dict(result.sampled) == {"a": (1,), "b": (2,)}  # the scheduler discards them, not the worker
    assert worker.last.sync_failed == ("a", "b") and dict(worker.last.sync_blocks) == {"a": 6}


def test_a_save_is_reported_by_its_event_or_by_the_bound() -> None:
    worker, _ = _worker()
    held = _view(held={"s": (3, 4), "t": (8,)})
    worker.post(KVSaveDone("s"))
    result = worker.after(_plan(5), held, StepResult())
    assert result.finished_sending == ("s",) and worker.saves == {"t": 5}
    worker.updated(5)
    only_t = _view(held={"t": (8,)})
    for step in range(6, 5 + KV_REPORT_BOUND):
        assert worker.after(_plan(step), only_t, StepResult()).finished_sending == ()
    assert worker.after(_plan(5 + KV_REPORT_BOUND), only_t, StepResult()).finished_sending == ("t",)


def test_events_wait_while_their_request_is_unfinished_and_are_dropped_once_it_holds_nothing() -> None:
    worker, _ = _worker()
    worker.post(KVLoadDone("a"))
    worker.post(KVSaveDone("a"))
    worker.post(KVLoadDone("ghost"))
    worker.after(_plan(1), _view({"a": RequestStatus.WAITING}), StepResult())
    assert worker.queue == [KVLoadDone("a"), KVSaveDone("a")]
    worker.after(_plan(2), _view(), StepResult())
    assert worker.queue == []


def test_one_report_per_request_per_result_and_an_abort_during_a_load_is_not_a_save() -> None:
    worker, _ = _worker()
    worker.post(KVLoadFailed("a"))
    worker.post(KVLoadDone("a"))
    worker.before(_plan(1, (ASYNC,)))
    # aborted during its load: finished, its blocks held, the load in flight
    aborted = _view(held={"a": (5, 6, 7)})
    result = worker.after(_plan(1, (ASYNC,)), aborted, StepResult())
    assert result.finished_recving == ("a",) and result.failed_recving == ("a",) and result.finished_sending == ()
    assert worker.saves == {}
    # the second event finds no load any more and the request holds nothing of its own: dropped
    worker.after(_plan(2), aborted, StepResult())
    assert worker.queue == [] and worker.saves == {}


# ------------------------------------------------------------ the fake model


def test_the_fake_model_reads_a_sliding_window_group_only_within_its_window() -> None:
    groups = (KVCacheGroup(), KVCacheGroup("sliding_window", 3))
    model = FakeModel(2, groups=groups)
    toks = (3, 1, 4, 1, 5)
    entry = _entry("r", ScheduleKind.NEW, toks, 0, 5, (1, 2, 3), groups=((1, 2, 3), (4, 5, 6)))
    result, mismatches = model.run(StepPlan(1, (entry,), (), ()), {"r": toks})
    assert mismatches == [] and len(result.sampled["r"]) == 1
    # the window's first block freed (the null block 0): positions 0, 1 are outside a window of 3 at position 5
    nxt = _entry("r", ScheduleKind.RUNNING, toks + result.sampled["r"], 5, 1, (1, 2, 3), ((1, 2, 3), (0, 5, 6)))
    _, mismatches = model.run(StepPlan(2, (nxt,), (), ()), {"r": toks + result.sampled["r"]})
    assert mismatches == []
    # a wrong block in the window is caught, naming the group
    bad = _entry("r", ScheduleKind.RUNNING, toks + result.sampled["r"], 5, 1, (1, 2, 3), ((1, 2, 3), (0, 9, 6)))
    _, mismatches = FakeModel(2, groups=groups).run(StepPlan(2, (bad,), (), ()), {"r": toks + result.sampled["r"]})
    assert mismatches and mismatches[0].position == 0 and "KV cache group 0" in mismatches[0].reason


def test_the_fake_model_reads_a_chunked_local_group_only_within_the_chunk() -> None:
    groups = (KVCacheGroup(), KVCacheGroup("chunked_local", attention_chunk_size=4))
    model = FakeModel(2, groups=groups)
    toks = (3, 1, 4, 1, 5, 2, 6)
    full, local = (1, 2, 3, 4), (5, 6, 7, 8)
    entry = _entry("r", ScheduleKind.NEW, toks, 0, 7, full, groups=(full, local))
    result, mismatches = model.run(StepPlan(1, (entry,), (), ()), {"r": toks})
    assert mismatches == [] and len(result.sampled["r"]) == 1
    toks8 = toks + result.sampled["r"]
    # the query at position 7 reads positions 4-7 of group 1 (its chunk):
    # blocks 5 and 6 (positions 0-3) freed are no loss
    assert model._first_read(1, 8) == 4 and model._first_read(1, 4) == 0 and model._first_read(0, 8) == 0
    nxt = _entry("r", ScheduleKind.RUNNING, toks8, 7, 1, full, (full, (0, 0, 7, 8)))
    assert model.run(StepPlan(2, (nxt,), (), ()), {"r": toks8})[1] == []

    def fresh() -> FakeModel:
        m = FakeModel(2, groups=groups)
        m.run(StepPlan(1, (entry,), (), ()), {"r": toks})
        return m

    # a wrong block before the chunk is not read; one in the chunk is
    # caught, naming the group
    before_chunk = _entry("r", ScheduleKind.RUNNING, toks8, 7, 1, full, (full, (2, 0, 7, 8)))
    assert fresh().run(StepPlan(2, (before_chunk,), (), ()), {"r": toks8})[1] == []
    bad = _entry("r", ScheduleKind.RUNNING, toks8, 7, 1, full, (full, (0, 0, 2, 8)))
    mismatches = fresh().run(StepPlan(2, (bad,), (), ()), {"r": toks8})[1]
    assert mismatches and mismatches[0].position == 4 and "KV cache group 1" in mismatches[0].reason
    # the sampled token depends on the chunk's part of group 1 only
    assert fresh()._ctx(nxt, 7) == toks[:7] + toks[4:7]


# ----------------------------------------------------------------- generator


def test_parse_kv() -> None:
    assert parse_kv("all") == KV_FEATURES == ("connector", "hybrid")
    assert parse_kv("none") == () and parse_kv("hybrid,connector") == ("connector", "hybrid")
    with pytest.raises(ValueError, match="unknown KV feature 'mamba'"):
        parse_kv("mamba")


def _digest(w: Any) -> str:
    return hashlib.sha256(tracefile.dumps(tracefile.Trace(w)).encode()).hexdigest()[:16]


def test_a_workload_without_kv_is_the_one_its_seed_always_gave() -> None:
    for seed in (0, 1, 7):
        assert _digest(random_workload(seed, 60, modes=("sync", "async"), gates=("lora",))) == _digest(
            random_workload(seed, 60, modes=("sync", "async"), gates=("lora",), kv=()))
    # pinned digests (the gates work's seeds): unchanged by the KV dimension
    assert _digest(random_workload(0, 60)) == _digest(random_workload(0, 60, kv=()))


def test_a_workload_draws_a_subset_of_the_kv_features_on_its_own_generator() -> None:
    drawn = {tuple(k for k in KV_FEATURES if f"kv:{k}" in random_workload(s, 20, kv=KV_FEATURES).features)
             for s in range(30)}
    assert drawn == {(), ("connector",), ("hybrid",), ("connector", "hybrid")}
    w = next(random_workload(s, 80, kv=("connector",)) for s in range(40)
             if random_workload(s, 80, kv=("connector",)).config.kv_connector)
    assert not w.config.is_hybrid and kv_of(w.config, w.events) == ("connector",)
    reqs = w.requests
    assert any(r.kv_load_async for r in reqs) and any(r.kv_external_tokens and not r.kv_load_async for r in reqs)
    assert all(r.kv_load_async or r.kv_external_tokens < len(r.prompt_token_ids) for r in reqs)


def test_hybrid_layouts_hold_one_to_three_groups_with_windows_and_chunks_of_one_to_four_blocks() -> None:
    seen = set()
    chunks = set()
    for s in range(200):
        groups = draw_kv_groups(4, kv_rng(s), chunk_rng(s))
        assert 1 <= len(groups) <= 3
        seen.add(tuple(g.kind[0] for g in groups))
        for g in groups:
            if g.kind == "sliding_window":
                assert 1 <= g.sliding_window <= 16
            if g.kind == "chunked_local":
                assert 1 <= g.attention_chunk_size <= 16
                chunks.add(g.attention_chunk_size)
    # f: full attention, s: sliding window, c: chunked local
    assert seen == {("s",), ("f", "s"), ("f", "s", "s"), ("f", "s", "f"),
                    ("c",), ("f", "c"), ("f", "s", "c"), ("f", "c", "f")}
    # chunks of one to four whole blocks (vLLM's backend takes no other)
    assert chunks == {4, 8, 12, 16}


def test_the_chunked_local_draw_leaves_every_other_kv_draw_as_it_was() -> None:
    """The chunk is drawn on a generator of its own (chunk_rng): the KV
    generator ends where it ended before chunked-local groups existed (so
    the connector's draws after it are the same), and a layout without one
    is the one the seed always gave."""
    chunked = 0
    for s in range(60):
        a, b = kv_rng(s), kv_rng(s)
        drawn = draw_kv_groups(4, a, chunk_rng(s))
        before = draw_kv_groups(4, b, chunked=False)
        assert a.getstate() == b.getstate()
        if any(g.kind == "chunked_local" for g in drawn):
            chunked += 1
            # the chunked-local group took the last sliding window's place
            swapped = [i for i, (x, y) in enumerate(zip(drawn, before)) if x != y]
            assert len(drawn) == len(before) and len(swapped) == 1
            assert before[swapped[0]].kind == "sliding_window"
            assert all(g.kind != "sliding_window" for g in before[swapped[0] + 1:])
        else:
            assert drawn == before
    assert 15 <= chunked <= 45


def test_a_focus_on_a_chunked_local_rule_draws_a_chunked_local_group_and_one_on_a_window_rule_none() -> None:
    from schedspec.check.coverage_guided import CHUNKED_LOCAL_RULES, SLIDING_WINDOW_RULES, guided_workload
    from schedspec.spec.rule_names import RULES

    assert CHUNKED_LOCAL_RULES | SLIDING_WINDOW_RULES <= set(RULES)
    assert all(RULES[r].gates == ("hybrid_kv",) for r in CHUNKED_LOCAL_RULES | SLIDING_WINDOW_RULES)
    kinds = {}
    for focus in ("kv_groups.chunk_freed", "kv_groups.window_freed", "kv.miss"):
        kinds[focus] = [tuple(g.kind for g in guided_workload(s, 30, focus=[focus], kv=("hybrid",)).config.groups)
                        for s in range(8)]
    # (a config whose pool cannot take the groups stays plain: with_kv)
    hybrid = {f: [k for k in ks if k != ("full_attention",)] for f, ks in kinds.items()}
    assert len(hybrid["kv_groups.chunk_freed"]) >= 5 and len(hybrid["kv_groups.window_freed"]) >= 5
    assert all("chunked_local" in k for k in hybrid["kv_groups.chunk_freed"])
    assert all("chunked_local" not in k and "sliding_window" in k for k in hybrid["kv_groups.window_freed"])
    # any other focus: drawn (the same seeds give both)
    assert any("chunked_local" in k for k in hybrid["kv.miss"])
    assert any("chunked_local" not in k for k in hybrid["kv.miss"])


def test_describe_kv_events() -> None:
    assert describe_event(KVLoadDone("r1")) == "kv_load_done('r1')"
    assert describe_event(KVLoadFailed("r1", 2)) == "kv_load_failed('r1', block_index=2)"
    assert describe_event(KVLoadFailed("r1")) == "kv_load_failed('r1')"
    assert describe_event(KVSaveDone("r1")) == "kv_save_done('r1')"
    with pytest.raises(ValueError, match="block_index"):
        KVLoadFailed("r1", -1)


# ------------------------------------------------------------ with the spec


def _spec_run(events: list[Any], config: SchedulerConfig = CFG) -> Runner:
    runner = Runner(config, {"spec": SpecScheduler}, keep_history=True)
    assert runner.run(events) is None
    return runner


def test_an_async_load_through_the_spec_waits_for_its_event_then_runs_and_quiesces() -> None:
    runner = _spec_run([AddRequest(_req("a", kv_external_tokens=8, kv_load_async=True)), Step(), Step(),
                        KVLoadDone("a"), Step()])
    assert runner.history is not None
    loads = [(rec.step, ld.request_id, ld.start, ld.end, ld.asynchronous) for rec in runner.history
             for ld in rec.plan.kv_loads]
    assert loads == [(1, "a", 0, 8, True)]
    assert runner.history[0].view_after.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [rec.result.finished_recving for rec in runner.history if rec.result] == [(), (), ("a",)]
    assert runner.quiesce() is None
    assert runner.stats.kv_loads_async == 1 and runner.stats.kv_timeouts == 0


def test_an_async_load_without_an_event_is_reported_by_the_bound_and_an_abort_during_it_frees_its_blocks() -> None:
    runner = _spec_run([AddRequest(_req("a", kv_external_tokens=8, kv_load_async=True)), Step(), Abort("a")])
    view = runner.primary.view()
    assert "a" in view.kv_held_by_finished
    assert runner.quiesce() is None  # the bound reports the load: the blocks come back
    assert runner.stats.kv_timeouts == 1 and runner.stats.held_block_steps > 0
    assert not runner.primary.view().kv_held_by_finished


def test_a_save_holds_the_blocks_until_reported() -> None:
    runner = _spec_run([AddRequest(_req("s", max_tokens=1, kv_save_async=True)), Step(), KVSaveDone("s"), Step()])
    assert runner.history is not None
    assert [rec.result.finished_sending for rec in runner.history if rec.result] == [(), ("s",)]
    assert runner.history[0].view_after.kv_held_by_finished.keys() == {"s"}
    assert runner.quiesce() is None and runner.stats.kv_saves == 1


def test_quiescence_catches_a_scheduler_that_never_frees_a_finished_requests_blocks() -> None:
    class Leaky(SpecScheduler):
        def view(self) -> SchedulerView:
            v = super().view()
            ref = (0, 1) + v.kv.ref_cnt[2:]  # block 1 never comes back
            return dataclasses.replace(v, kv=dataclasses.replace(v.kv, ref_cnt=ref))

    runner = Runner(CFG, {"leaky": Leaky}, check_invariants=False)
    assert runner.run([AddRequest(_req("a", max_tokens=1)), Step()]) is None
    failure = runner.quiesce()
    assert failure is not None and failure.kind == "violation"
    assert failure.violations[0].invariant_id == "kv-quiescence"
    assert failure.violations[0].message == "after the last event and every report: blocks still referenced [1]"


def test_run_workload_quiesces_only_kv_workloads() -> None:
    assert needs_quiescence(CFG) and needs_quiescence(
        SchedulerConfig(kv_cache_groups=(KVCacheGroup("sliding_window", 32),)))
    assert not needs_quiescence(SchedulerConfig())
    w = random_workload(2, 30)
    runner, failure = run_workload(w, {"spec": SpecScheduler})
    assert failure is None and runner.stats.steps == 30


# ------------------------------------------------------------------- traces


HEADER: dict[str, Any] = {"schedspec_trace": 4, "config": {"block_size": 4, "num_blocks": 32, "max_num_batched_tokens": 64,
                                           "max_num_seqs": 4, "max_model_len": 32, "kv_connector": True}}
ADD: dict[str, Any] = {"op": "add", "request": {"request_id": "a", "prompt_token_ids": list(PROMPT), "max_tokens": 4,
                                "kv_external_tokens": 8, "kv_load_async": True}}


def _lines(*objs: dict[str, Any]) -> str:
    return "\n".join(json.dumps(o) for o in objs) + "\n"


def test_a_kv_trace_round_trips_as_version_4_with_its_features_in_the_header() -> None:
    w = random_workload(4, 60, kv=KV_FEATURES)
    text = tracefile.dumps(tracefile.Trace(w))
    header = json.loads(text.splitlines()[0])
    assert header["schedspec_trace"] == 4 and header["kv"] == list(kv_of(w.config, w.events))
    assert tracefile.loads(text).workload.events == w.events
    # a workload without KV features writes what it always wrote
    plain = json.loads(tracefile.dumps(tracefile.Trace(random_workload(4, 60))).splitlines()[0])
    assert plain["schedspec_trace"] < 4 and "kv" not in plain


@pytest.mark.parametrize("lines, field, message", [
    ([{**HEADER, "schedspec_trace": 3}, ADD], "config.kv_connector", "needs trace format version 4"),
    ([HEADER, ADD, {"op": "kv_load_done", "request_id": "b"}], "request_id", "'b' was never added"),
    ([HEADER, ADD, {"op": "kv_load_failed", "request_id": "a", "block_index": 2}], "block_index",
     "2 is outside the request's table"),
    ([HEADER, ADD, {"op": "kv_save_done", "request_id": "a"}], "request_id", "never saves asynchronously"),
    ([HEADER, ADD, {"op": "kv_load_failed", "request_id": "a", "block_index": -1}], "block_index", ""),
    ([{**HEADER, "config": {**HEADER["config"], "kv_cache_groups": [{"kind": "sliding_window", "sliding_window": 0}]}}],
     "config.kv_cache_groups[0].sliding_window", "window >= 1"),
    ([{**HEADER, "config": {**HEADER["config"], "kv_cache_groups": [{"kind": "full_attention", "block_size": 8}]}}],
     "config.kv_cache_groups[0].block_size", ""),
    ([{**HEADER, "config": {**HEADER["config"], "kv_connector": False}}, ADD], "request.kv_external_tokens",
     "no connector"),
    ([HEADER, {"op": "add", "request": {**ADD["request"], "kv_load_async": False, "kv_external_tokens": 11}}],
     "request.kv_external_tokens", "leaves none to compute"),
    ([{**HEADER, "kv": ["hybrid"]}, ADD], "kv", "uses the KV feature(s) connector"),
])
def test_bad_kv_traces_are_refused_naming_file_line_and_field(lines: list[dict[str, Any]], field: str,
                                                             message: str) -> None:
    with pytest.raises(tracefile.TraceError) as info:
        tracefile.loads(_lines(*lines), "t.jsonl")
    assert info.value.path == "t.jsonl" and info.value.field == field, str(info.value)
    assert message in str(info.value)
    assert info.value.line == (1 if field.startswith("config") or field == "kv" else len(lines))


# ---------------------------------------------- capabilities, shrinking, stats


def test_capabilities_keep_kv_out_of_a_scheduler_without_them() -> None:
    w = random_workload(4, 60, kv=KV_FEATURES)
    assert w.config.kv_connector
    plain = Capabilities()
    assert plain.kv() == () and Capabilities().with_kv().kv() == KV_FEATURES
    assert "kv_connector=True" in plain.workload_problems(w)
    kept = plain.restrict_workload(w)
    assert kv_of(kept.config, kept.events) == () and plain.workload_problems(kept) == []
    assert Capabilities().with_kv().restrict_workload(w) is w


def test_the_shrinker_drops_kv_features_and_events_that_no_longer_fit() -> None:
    cfg = dataclasses.replace(CFG, kv_cache_groups=(KVCacheGroup(), KVCacheGroup("sliding_window", 4),
                                                    KVCacheGroup("sliding_window", 8)), num_blocks=90)
    options = _config_options(cfg)
    assert any(not c.kv_connector for c in options) and any(not c.is_hybrid for c in options)
    assert any(len(c.kv_cache_groups) == 2 for c in options)
    r = _req("a", kv_external_tokens=11, kv_load_async=True, kv_save_async=True)
    assert [(o.kv_external_tokens, o.kv_load_async, o.kv_save_async) for o in _kv_options(r)] == [
        (11, True, False), (10, False, True), (5, True, True), (0, False, True)]
    events: list[Event] = [AddRequest(r), KVLoadDone("a"), KVSaveDone("a"), KVLoadFailed("a", 2), Step()]
    no_save: list[Event] = [AddRequest(dataclasses.replace(r, kv_save_async=False)), *events[1:]]
    assert _consistent(no_save, False, cfg)[1:] == [KVLoadDone("a"), KVLoadFailed("a", 2), Step()]
    off = dataclasses.replace(CFG, kv_connector=False)
    out = _consistent(events, False, off)
    assert out == [AddRequest(_req("a")), Step()]


def test_stats_count_loads_failures_saves_held_blocks_and_sliding_window_frees() -> None:
    stats = Stats()
    entry = _entry("r", ScheduleKind.RUNNING, PROMPT, 8, 1, (1, 2, 3), ((1, 2, 3), (0, 5, 6)))
    stats.absorb(StepPlan(1, (entry,), (), (), kv_loads=(ASYNC, KVLoad("b", 0, 4, (9,), False))))
    later = dataclasses.replace(entry, group_block_ids=((1, 2, 3), (0, 0, 6)))
    stats.absorb(StepPlan(2, (later,), (), ()))
    assert (stats.kv_loads_async, stats.kv_loads_sync, stats.sliding_window_frees) == (1, 1, 2)
    d = stats.as_dict()
    assert d["kv_loads_async"] == 1 and d["sliding_window_frees"] == 2 and "kv_saves" not in d
    assert stats.kv_line() == "1 kv loads sync, 1 kv loads async, 2 sliding window frees"
    assert "kv_loads_sync" not in Stats().as_dict()
    assert Stats().kv_line() == "no KV load, save or sliding-window or chunked-local free"


def test_stats_count_the_frees_of_each_local_kind_in_its_own_counter() -> None:
    stats = Stats(group_kinds=("full_attention", "sliding_window", "chunked_local"))
    entry = _entry("r", ScheduleKind.RUNNING, PROMPT, 8, 1, (1, 2, 3), ((1, 2, 3), (0, 5, 6), (7, 8, 9)))
    stats.absorb(StepPlan(1, (entry,), (), ()))
    stats.absorb(StepPlan(2, (dataclasses.replace(entry, group_block_ids=((1, 2, 3), (0, 5, 6), (0, 0, 9))),), (), ()))
    assert (stats.sliding_window_frees, stats.chunked_local_frees) == (1, 2)
    # the counts are per group: the window's table growing back while the
    # chunk's loses another block is still one more chunk free
    stats.absorb(StepPlan(3, (dataclasses.replace(entry, group_block_ids=((1, 2, 3), (4, 5, 6), (0, 0, 0))),), (), ()))
    assert (stats.sliding_window_frees, stats.chunked_local_frees) == (1, 3)
    assert stats.as_dict()["chunked_local_frees"] == 3
    assert "3 chunked local frees" in stats.kv_line()
    total = Stats()
    total.merge(stats)
    assert total.chunked_local_frees == 3


def test_the_report_shows_remote_kv_waits_loads_reports_and_held_blocks() -> None:
    runner = _spec_run([AddRequest(_req("a", kv_external_tokens=8, kv_load_async=True)),
                        AddRequest(_req("s", max_tokens=1, kv_save_async=True)), Step(), KVLoadDone("a"), Step()])
    records = runner.history or []
    assert kv_text(records[0]) == "  [load a 0-8 async]  [held s:3]"
    assert kv_text(records[1]) == "  [recv a]  [held s:3]"
    order, grid, _ = cell_states(records)
    assert order[:2] == ["a", "s"] and grid[0][0] == "remote_kv"
    assert "[load a 0-8 async]" in step_table(records)


def test_quiescence_updates_first_when_the_events_end_with_two_plans_in_flight() -> None:
    from schedspec.check.workload import Schedule

    cfg = dataclasses.replace(CFG, async_scheduling=True)
    runner = Runner(cfg, {"spec": SpecScheduler})
    assert runner.run([AddRequest(_req("a", kv_save_async=True)), Step(), Schedule()]) is None
    assert len(runner.pending) == 2
    assert runner.quiesce() is None and not runner.pending
