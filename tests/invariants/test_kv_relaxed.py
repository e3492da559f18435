"""Invariants relaxed to what vLLM 0.33 really does with a KV connector (the
default check draws connector workloads): for each, the old statement fired
on a real behaviour of vLLM (and of the spec, which agrees with it in
lockstep), and the new statement still fires on a crafted bad transition.

- waiting-queue-order / priority-admission-order: vLLM keeps two waiting
  queues, kv_holding_waiting (requests holding KV blocks: a load in flight or
  promoted) drained before waiting (scheduler.py, _enqueue_waiting_request,
  skip_request); the view lists them in that order.
- paused-admits-nothing: under PAUSED_NEW the WAITING loop still serves
  kv_holding_waiting.
- cached-block-content: a promoted load that covered every token keeps its
  last block cached at num_tokens - 1 computed (_update_waiting_for_remote_kv).
- block-table-covers-computed: a promoted one-token load keeps its block at 0
  computed.
- encoder-cache-within-size: a failed load can cut the computed tokens inside
  an encoder input the connector loaded (never encoded here).
- progress-admits-head: stands aside for exactly the vLLM liveness defect of
  a whole failed asynchronous load under "recompute" (docs/divergences.md),
  reproduced here on the spec and on vLLM; and while async scheduling with a
  connector fences frees behind the step in flight (deferred_frees).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from schedspec.invariants import Monitor, Transition
from schedspec.invariants.core import History
from schedspec.spec.interface import (
    KVLoad,
    MMInput,
    PauseState,
    Policy,
    RequestSpec,
    RequestStatus,
    ScheduleKind,
    SchedulerConfig,
    StepResult,
)

from tests.invariants.test_catalogue import key, req
from tests.invariants.test_connector import cfg, entry, fires, kview, plan

W, R, P = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED
REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
PRIO = cfg(policy=Policy.PRIORITY)


def old_fcfs_order(t: Transition) -> list[str]:
    """waiting-queue-order's old statement: one FCFS queue."""
    now = set(t.after.waiting)
    returned = [rid for rid in t.before.running if rid in now]
    stayed = [rid for rid in t.before.waiting if rid in now]
    new = [rid for rid in t.after.waiting if rid not in t.before.requests]
    return returned + stayed + new


# ------------------------------------------------------------ the two queues


def start_r10_load(after_waiting: tuple[str, ...]) -> Transition:
    """r7 and r10 wait; r7 is passed over (its grammar), r10 starts an
    asynchronous load: skip_request puts r7 back in waiting and r10 in
    kv_holding_waiting, drained first (the shrunk counterexample)."""
    g = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    r7 = req("r7", range(1, 9), status=g, arrival=7, structured_output=True)
    r10 = req("r10", range(1, 9), arrival=10, kv_external_tokens=4, kv_load_async=True)
    r10_after = dataclasses.replace(r10, status=REMOTE, num_computed_tokens=4, block_ids=(1, 2))
    load = KVLoad("r10", 0, 4, (1, 2), True)
    before = kview([r7, r10], waiting=("r7", "r10"))
    after = kview([r7, r10_after], step=1, waiting=after_waiting)
    p = plan(1, loads=[load])
    return Transition("schedule", before, after, plan=p, in_flight=(p,))


def test_waiting_queue_order_two_queues() -> None:
    good = start_r10_load(("r10", "r7"))
    assert old_fcfs_order(good) == ["r7", "r10"] != list(good.after.waiting)  # the old statement fired
    assert fires("waiting-queue-order", good) == []
    assert fires("fcfs-admission-order", good) == []
    # a holder listed after a plain waiting request
    bad = start_r10_load(("r7", "r10"))
    assert any("after r7" in m for m in fires("waiting-queue-order", bad))


def test_waiting_queue_order_still_fires_within_each_queue() -> None:
    a = req("a", range(1, 9), status=REMOTE, computed=4, blocks=(1,), kv_external_tokens=4, kv_load_async=True)
    b = req("b", range(1, 9), status=REMOTE, computed=4, blocks=(2,), kv_external_tokens=4, kv_load_async=True)
    c, d = req("c", range(1, 5)), req("d", range(1, 5))
    before = kview([a, b, c, d], waiting=("a", "b", "c", "d"))
    ok = Transition("update", before, kview([a, b, c, d], waiting=("a", "b", "c", "d")),
                    plan=plan(1), result=StepResult())
    assert fires("waiting-queue-order", ok) == []
    swapped_holders = dataclasses.replace(ok, after=kview([a, b, c, d], waiting=("b", "a", "c", "d")))
    assert any("kv_holding_waiting is ['b', 'a']" in m for m in fires("waiting-queue-order", swapped_holders))
    swapped_plain = dataclasses.replace(ok, after=kview([a, b, c, d], waiting=("a", "b", "d", "c")))
    assert any("waiting queue is ['d', 'c']" in m for m in fires("waiting-queue-order", swapped_plain))


def test_priority_admission_order_two_heaps() -> None:
    # r10 (priority 5) holds blocks for its load: served before r7 (priority 0)
    r10 = req("r10", range(1, 9), status=REMOTE, computed=4, blocks=(1,), priority=5, arrival=10,
              kv_external_tokens=4, kv_load_async=True)
    r7 = req("r7", range(1, 9), priority=0, arrival=7)
    r8 = req("r8", range(1, 9), priority=3, arrival=8)
    v = kview([r10, r7], config=PRIO, waiting=("r10", "r7"))
    t = Transition("update", v, v, plan=plan(1), result=StepResult())
    keys = [(r.spec.priority, r.spec.arrival, r.request_id) for r in (r10, r7)]
    assert keys != sorted(keys)  # the old statement (one heap) fired
    assert fires("priority-admission-order", t) == []
    bad = kview([r10, r8, r7], config=PRIO, waiting=("r10", "r8", "r7"))
    assert fires("priority-admission-order", dataclasses.replace(t, before=bad, after=bad)) == [
        "waiting queue ['r8', 'r7'] is not in (priority, arrival, request_id) order"
    ]


# ------------------------------------------------------------ PAUSED_NEW


def paused_admission(loaded: bool) -> Transition:
    """Under PAUSED_NEW step 2 admits ``a``: promoted from its load (it holds
    blocks: allowed) or a plain waiting request (not allowed)."""
    kw: dict[str, Any] = dict(kv_external_tokens=8, kv_load_async=True) if loaded else {}
    if loaded:
        a = req("a", range(1, 11), status=REMOTE, computed=8, blocks=(1, 2), **kw)
    else:
        a = req("a", range(1, 11))
    before = dataclasses.replace(kview([a], step=1, done=("a",) if loaded else ()), pause_state=PauseState.PAUSED_NEW)
    ar = req("a", range(1, 11), status=R, computed=10, blocks=(1, 2, 3), **kw)
    p = plan(2, [entry(ar, 8 if loaded else 0, 2 if loaded else 10, kind=ScheduleKind.NEW)])
    after = dataclasses.replace(kview([ar], step=2), pause_state=PauseState.PAUSED_NEW)
    return Transition("schedule", before, after, plan=p, in_flight=(p,))


def test_paused_new_admits_requests_holding_kv_blocks() -> None:
    assert fires("paused-admits-nothing", paused_admission(True)) == []
    assert fires("paused-admits-nothing", paused_admission(False)) == [
        "PAUSED_NEW, yet admitted as NEW in step 2"
    ]


# ------------------------------------------------------------ promoted loads


def test_promoted_full_load_keeps_its_last_block_cached() -> None:
    def promoted(computed: int) -> Transition:
        a = req("a", range(1, 9), status=W, computed=computed, blocks=(1, 2), kv_external_tokens=8,
                kv_load_async=True)
        v = kview([a], keys={1: key(a, 0), 2: key(a, 1)})
        return Transition("update", v, v, plan=plan(1), result=StepResult())

    # _update_waiting_for_remote_kv: cache_blocks(request, 8), then num_computed_tokens = 8 - 1
    assert fires("cached-block-content", promoted(7)) == []
    assert fires("cached-block-content", promoted(6)) == [
        "block 2 (index 1) carries a key but only 6 tokens are computed (8 fill it)"
    ]


def test_promoted_one_token_load_keeps_its_block() -> None:
    def promoted(prompt: range) -> Transition:
        a = req("a", prompt, status=W, computed=0, blocks=(1,), kv_external_tokens=1, kv_load_async=True)
        v = kview([a], keys={})
        return Transition("update", v, v, plan=plan(1), result=StepResult())

    assert fires("block-table-covers-computed", promoted(range(1, 2))) == []
    assert fires("block-table-covers-computed", promoted(range(1, 3))) == [
        "WAITING with 0 computed tokens holds blocks [1]"
    ]


# ------------------------------------------------------------ encoder inputs


def test_failed_load_may_cut_inside_a_loaded_encoder_input() -> None:
    c = cfg(encoder_cache_size=16, max_num_encoder_input_tokens=8)

    def cut(external: int) -> Transition:
        # the load covered the input at 2..6; an invalid block cut it to 5 computed
        a = req("a", range(1, 9), status=R, computed=5, blocks=(1, 2), kv_external_tokens=external,
                mm_inputs=(MMInput(2, 5, "mm1"),))
        v = dataclasses.replace(kview([a], config=c), encoder_cache_free=16)
        return Transition("update", v, v, plan=plan(1), result=StepResult())

    assert fires("encoder-cache-within-size", cut(7)) == []
    assert fires("encoder-cache-within-size", cut(0)) == [
        "is inside encoder input 0 ('mm1' at 2..6, 5 computed), which is not in the encoder cache"
    ]


# ------------------------------------------------------------ the liveness defect

STALL = dict(block_size=1, num_blocks=18, max_model_len=16, max_num_batched_tokens=16,
             kv_connector=True, kv_load_failure_policy="recompute")


def stall_transition(loaded_before: bool, free_blocks: int = 17) -> tuple[Transition, History]:
    """A 9-token request whose asynchronous load failed whole (recompute),
    promoted with nothing computed and no block, is not admitted with nothing
    running: 9 needed + its own 9 still reserved > 17 free."""
    c = SchedulerConfig(**{**STALL, "num_blocks": free_blocks + 1})
    a = req("a", range(1, 10), max_tokens=1, kv_external_tokens=9, kv_load_async=True)
    v = kview([a], config=c, step=2)
    h = History()
    if loaded_before:
        h.loads["a"] = KVLoad("a", 0, 9, tuple(range(1, 10)), True)
    return Transition("schedule", v, dataclasses.replace(v, step=3), plan=plan(3)), h


def test_progress_admits_head_stands_aside_for_the_failed_load_defect() -> None:
    t, h = stall_transition(True)
    assert fires("progress-admits-head", t, h) == []
    # a head that never loaded, or with room for twice its need, must be admitted
    t, h = stall_transition(False)
    assert fires("progress-admits-head", t, h) == ["nothing was running, yet the head of the waiting queue was not admitted"]
    t, h = stall_transition(True, free_blocks=18)
    assert fires("progress-admits-head", t, h) == ["nothing was running, yet the head of the waiting queue was not admitted"]


def test_spec_stalls_on_a_failed_load_and_the_monitor_stays_silent() -> None:
    """The defect on the spec (the spec keeps vLLM's behaviour): never
    admitted again, every invariant silent (progress-admits-head stands aside
    for exactly this)."""
    from schedspec.spec.scheduler import SpecScheduler

    s = SpecScheduler(SchedulerConfig(**STALL))
    _drive_stall(s, monitor=True)


REQUIRE = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_vllm_stalls_on_a_failed_load() -> None:
    """The same on vLLM 0.33.0's Scheduler (adapter): when a vLLM release
    fixes _update_waiting_for_remote_kv / _inflight_prefills, this fails:
    then remove progress-admits-head's exception and the spec's behaviour."""
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.adapters.vllm_load import load_vllm

    load_vllm()
    _drive_stall(VllmScheduler(SchedulerConfig(**STALL)), monitor=False)


def _drive_stall(s: Any, *, monitor: bool) -> None:
    m = Monitor()

    def seen(t: Transition) -> None:
        if monitor:
            found = m.observe(t)
            assert found == [], [str(v) for v in found]

    spec = RequestSpec("a", tuple(range(1, 10)), 1, kv_external_tokens=9, kv_load_async=True)
    before = s.view()
    s.add(spec)
    seen(Transition("add", before, s.view(), request=spec))
    for i in range(5):
        before = s.view()
        p = s.schedule()
        seen(Transition("schedule", before, s.view(), plan=p, in_flight=(p,)))
        if i == 0:
            assert p.kv_loads and p.kv_loads[0].asynchronous and p.scheduled == ()
            res = StepResult(finished_recving=("a",), failed_recving=("a",))
        else:
            assert p.scheduled == () and p.kv_loads == ()  # never admitted again
            res = StepResult()
        before = s.view()
        s.update(p, res)
        seen(Transition("update", before, s.view(), plan=p, result=res))
    v = s.view()
    assert v.requests["a"].status == RequestStatus.WAITING and v.requests["a"].block_ids == ()
    assert v.kv.num_free_blocks == 17 and not v.running


# ------------------------------------------------------------ shrunk counterexamples
# Shrunk by `schedspec check --against spec --kv all --steps 3000` (FIX15), each a
# behaviour spec and vLLM share that an invariant reported before it was relaxed:
# a pending async save holding the pool while the running head preempts itself
# (no-starvation), a promoted full load's sliding window cut at the load's end
# (group-tables-cover), an async load that never fits beside the spec-decode
# reservation (progress-admits-head), or beside the stale reservation another
# request's failed load left (progress-admits-head), a failed load's request promoted at the head
# of kv_holding_waiting ahead of a better-priority waiting request
# (priority-admission-order).

DATA = __import__("pathlib").Path(__file__).resolve().parent / "data"
TRACES = sorted(p.name for p in DATA.glob("*.jsonl"))


def _replay(name: str, factories: dict[str, Any]) -> Any:
    from schedspec.check import trace as tracefile
    from schedspec.check.run import run_workload

    t = tracefile.read(DATA / name)
    return run_workload(t.workload, factories, vocab=t.vocab, oracle_seed=t.oracle_seed)[1]


@pytest.mark.parametrize("name", TRACES)
def test_shrunk_counterexamples_hold_every_invariant_on_the_spec(name: str) -> None:
    from schedspec.spec.scheduler import SpecScheduler

    assert _replay(name, {"spec": SpecScheduler}) is None


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
@pytest.mark.parametrize("name", TRACES)
def test_vllm_agrees_on_the_shrunk_counterexamples(name: str) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.adapters.vllm_load import load_vllm
    from schedspec.spec.scheduler import SpecScheduler

    load_vllm()
    assert _replay(name, {"spec": SpecScheduler, "vllm": VllmScheduler}) is None


VLLM_DEFECTS = sorted((Path(__file__).resolve().parents[2] / "vectors" / "vllm-defects").glob("*.jsonl"))


@pytest.mark.parametrize("path", VLLM_DEFECTS, ids=[p.stem for p in VLLM_DEFECTS])
@pytest.mark.parametrize("against", ["spec", "impl"])
def test_vllm_defect_traces_replay_with_every_invariant(path: Path, against: str) -> None:
    """The traces of vLLM 0.33 defects the check found (docs/divergences.md)
    replay with every invariant on: the invariants name the defect's
    situation rather than fail the gate on it. The reservation trace is the
    main job's seed 25: a whole failed asynchronous load under "recompute"
    lingers in _inflight_prefills and its reservation holds back the
    admission of another request (work-conserving-admission fired on it)."""
    from schedspec.cli.main import main

    assert main(["replay", str(path), "--against", against, "--invariants", "all"]) == 0



# ------------------------------------------------------------ a shared invalid block


def _shared_invalid_update() -> Transition:
    """The shrunk counterexample of `check --against vllm --kv all --modes sync
    --steps 20000` (seed 20): r70 and r74 share block 1 (r74's prefix hit on
    the block r70's synchronous load filled in the same step); the worker
    reports blocks 1 and 3 invalid. vLLM's walk over self.running marks block
    1 for r70 (cut to 0), so r74 skips it and is cut at its own invalid block
    3 (index 2): 4 computed tokens, not 0 and not the 5 it had."""
    from schedspec.check import trace as tracefile
    from schedspec.spec.scheduler import SpecScheduler

    t = tracefile.read(DATA / "invalid-block-shared-recomputed-by-first.jsonl")
    s = SpecScheduler(t.workload.config)
    for e in t.workload.events[:2]:
        s.add(e.request)
    p = s.schedule()
    assert {e.request_id: e.num_computed_tokens for e in p.scheduled} == {"r70": 1, "r74": 5}
    res = StepResult(
        sampled={"r70": (9,), "r74": (9,)}, invalid_block_ids=(1, 3),
    )
    before = s.view()
    assert before.requests["r74"].block_ids[:3] == (1, 2, 3)
    s.update(p, res)
    return Transition("update", before, s.view(), plan=p, result=res, in_flight=(p,))


def test_shared_invalid_block_is_recomputed_by_the_first_holder_only() -> None:
    t = _shared_invalid_update()
    assert t.after.requests["r70"].num_computed_tokens == 0
    assert t.after.requests["r74"].num_computed_tokens == 4
    assert fires("kv-load-failure-policy", t) == []
    assert fires("invalid-block-not-computed", t, History()) == []
    for wrong in (0, 5):  # the first invalid block's start; what it had before the step
        bad_r74 = dataclasses.replace(t.after.requests["r74"], num_computed_tokens=wrong)
        after = dataclasses.replace(t.after, requests={**t.after.requests, "r74": bad_r74})
        found = fires("kv-load-failure-policy", dataclasses.replace(t, after=after))
        assert found and "want 4" in found[0], found


def test_progress_stands_aside_for_a_victim_in_flight_only_when_frees_are_deferred() -> None:
    """Async scheduling with a connector (`check --against spec --kv all --seed 4000`, seed
    4023): step 3 finds the pool full, and the only victim has step 2 in flight, so vLLM's
    RUNNING loop stops (_request_blocks_can_be_freed) and the step is empty; step 2's update
    frees the way. Without deferred frees (no connector) the same empty step is a violation."""
    from schedspec.check import trace as tracefile
    from schedspec.spec.scheduler import SpecScheduler

    t = tracefile.read(DATA / "async-connector-victim-in-flight-empty-step.jsonl")
    s = SpecScheduler(t.workload.config)
    for e in t.workload.events:
        s.add(e.request)
    p1 = s.schedule()
    p2 = s.schedule()
    s.update(p1, StepResult())
    before = s.view()
    p3 = s.schedule()
    assert p3.scheduled == () and s.rules["connector.victim_in_flight"]
    step3 = Transition("schedule", before, s.view(), plan=p3, in_flight=(p2, p3))
    assert fires("progress", step3) == []
    plain = dataclasses.replace(before.config, kv_connector=False)
    no_defer = dataclasses.replace(
        step3, before=dataclasses.replace(before, config=plain), after=dataclasses.replace(step3.after, config=plain)
    )
    assert fires("progress", no_defer) == ["step 3 scheduled nothing with 2 running and 0 waiting"]
