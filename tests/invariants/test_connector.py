"""The KV connector's invariants (invariants/connector.py): each fires, under
its id, on a hand-built transition that breaks it in one place, and holds on
the good transition it was made from; the catalogue's other invariants stay
silent on the good ones (the views the connector adds: WAITING_FOR_REMOTE_KVS,
blocks a finished request holds, a promoted load's blocks).

Views are built as tests/invariants/test_catalogue.py builds them: a pool of
4-token blocks, ref counts derived from the tables and the blocks finished
requests hold."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from schedspec.invariants import BY_ID, CATALOGUE, Monitor, Transition
from schedspec.invariants.core import History
from schedspec.spec.interface import (
    BlockKey,
    KVCacheGroup,
    KVLoad,
    KVView,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)

from tests.invariants.test_catalogue import key, req

W, R, P = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED
REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
STOPPED, ABORTED, ERROR = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
)

CONNECTOR_IDS = (
    "remote-kv-not-scheduled",
    "remote-kv-leaves-after-report",
    "kv-loads-consistent",
    "kv-load-follows-request",
    "kv-load-failure-policy",
    "invalid-block-not-computed",
    "finished-holds-only-pending",
    "kv-save-delays-free",
    "kv-quiescence",
)


def cfg(**kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(
        block_size=4, num_blocks=9, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
        kv_connector=True,
    )
    base.update(kw)
    return SchedulerConfig(**base)


CFG = cfg()
PROMPT = tuple(range(1, 11))  # 10 tokens


def kview(
    reqs: Iterable[RequestView],
    *,
    config: SchedulerConfig = CFG,
    step: int = 0,
    finished: Iterable[RequestView] = (),
    held: dict[str, tuple[int, ...]] | None = None,
    keys: dict[int, BlockKey] | None = None,
    done: Iterable[str] = (),
    failed: Iterable[str] = (),
    waiting: Iterable[str] | None = None,
) -> SchedulerView:
    """A view whose pool follows from the tables (every group's) and the blocks
    finished requests hold: ref counts count holders, the other usable blocks
    are free in id order; ``keys`` defaults to the keys of every full computed
    block of a running or promoted request."""
    live = list(reqs)
    held = held or {}
    bs = config.block_size
    ref = [0] * config.num_blocks
    for r in live:
        for table in (r.group_block_ids or (r.block_ids,)):
            for b in table:
                if b:
                    ref[b] += 1
    for blocks in held.values():
        for b in blocks:
            ref[b] += 1
    if keys is None:
        keys = {}
        for r in live:
            if r.status != REMOTE:
                for i in range(min(r.num_computed_tokens // bs, len(r.block_ids))):
                    keys.setdefault(r.block_ids[i], key(r, i, bs))
    index: dict[BlockKey, tuple[int, ...]] = {}
    for b in sorted(keys):
        index[keys[b]] = index.get(keys[b], ()) + (b,)
    queued = (W, P, REMOTE)
    return SchedulerView(
        config=config,
        step=step,
        requests={r.request_id: r for r in live},
        waiting=tuple(waiting) if waiting is not None else tuple(r.request_id for r in live if r.status in queued),
        running=tuple(r.request_id for r in live if r.status == R),
        kv=KVView(
            num_blocks=config.num_blocks,
            block_size=bs,
            ref_cnt=tuple(ref),
            free_queue=tuple(b for b in range(1, config.num_blocks) if ref[b] == 0),
            block_keys=keys,
            cache_index=index,
        ),
        finished={r.request_id: r for r in finished},
        kv_held_by_finished=held,
        kv_loads_done=tuple(done),
        kv_loads_failed=tuple(failed),
    )


def fires(inv_id: str, t: Transition, h: History | None = None) -> list[str]:
    return [v.message for v in BY_ID[inv_id].check(t, h)]


def silent(t: Transition, h: History | None = None) -> None:
    """No invariant of the catalogue fires on ``t``."""
    found = [v for inv in CATALOGUE for v in inv.check(t, h)]
    assert found == [], [str(v) for v in found]


def a_req(status: RequestStatus = W, computed: int = 0, blocks: Iterable[int] = (), **kw: Any) -> RequestView:
    base: dict[str, Any] = dict(kv_external_tokens=8, kv_load_async=True)
    base.update(kw)
    return req("a", PROMPT, status=status, computed=computed, blocks=blocks, **base)


def entry(r: RequestView, computed: int, n: int, *, kind: ScheduleKind) -> ScheduledRequest:
    """The plan entry that computes ``n`` of ``r``'s tokens from ``computed``,
    with ``r``'s table (every group's) as it is after the step."""
    return ScheduledRequest.of(
        r.request_id, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
        all_token_ids=r.all_token_ids, block_ids=r.block_ids, group_block_ids=r.group_block_ids,
    )


def plan(step: int, scheduled: Iterable[ScheduledRequest] = (), loads: Iterable[KVLoad] = (),
         finished: Iterable[str] = ()) -> StepPlan:
    return StepPlan(step, tuple(scheduled), (), tuple(finished), kv_loads=tuple(loads))


# --------------------------------------------------------------------------
# An asynchronous load: start, report, promotion and admission
# --------------------------------------------------------------------------

LOAD = KVLoad("a", 0, 8, (1, 2), True)


def start_load() -> Transition:
    """Step 1 starts a's asynchronous load of 8 tokens into blocks 1, 2."""
    before = kview([a_req()])
    after = kview([a_req(REMOTE, 8, (1, 2))], step=1)
    return Transition("schedule", before, after, plan=plan(1, loads=[LOAD]), in_flight=(plan(1, loads=[LOAD]),))


def report_load() -> Transition:
    """Step 1's update reports the load finished."""
    p = plan(1, loads=[LOAD])
    v = kview([a_req(REMOTE, 8, (1, 2))], step=1)
    return Transition("update", v, dataclasses.replace(v, kv_loads_done=("a",)), plan=p,
                      result=StepResult(finished_recving=("a",)))


def admit_loaded() -> Transition:
    """Step 2 promotes a (8 of 10 tokens loaded) and admits it for the last 2."""
    before = kview([a_req(REMOTE, 8, (1, 2))], step=1, done=("a",))
    a = a_req(R, 10, (1, 2, 3))
    e = entry(a, 8, 2, kind=ScheduleKind.NEW)
    p = plan(2, [e])
    return Transition("schedule", before, kview([a], step=2), plan=p, in_flight=(p,))


def test_every_connector_invariant_is_catalogued_and_requires_the_connector() -> None:
    ids = [inv.id for inv in CATALOGUE if "kv_connector" in inv.requires]
    assert tuple(ids) == CONNECTOR_IDS
    for i in CONNECTOR_IDS:
        assert BY_ID[i].tags and "scheduler.py" in BY_ID[i].vllm_behaviour


def test_the_good_async_load_is_silent() -> None:
    h = History()
    for t in (start_load(), report_load(), admit_loaded()):
        silent(t, h)
        h.record(t)


def test_remote_kv_not_scheduled() -> None:
    t = start_load()
    assert fires("remote-kv-not-scheduled", t) == []
    # scheduled while its load is in flight (not reported done)
    bad = admit_loaded()
    bad = dataclasses.replace(bad, before=dataclasses.replace(bad.before, kv_loads_done=()))
    assert any("while its KV load is in flight" in m for m in fires("remote-kv-not-scheduled", bad))
    # waits for its load holding one block for 8 computed tokens
    short = dataclasses.replace(t, after=kview([a_req(REMOTE, 8, (1,))], step=1))
    assert any("needs at least 2" in m for m in fires("remote-kv-not-scheduled", short))
    # in kv_loads_done without waiting for a load
    stray = dataclasses.replace(t, after=dataclasses.replace(kview([a_req(R, 10, (1, 2, 3))], step=1),
                                                             kv_loads_done=("a",)))
    assert any("is in kv_loads_done but is RUNNING" in m for m in fires("remote-kv-not-scheduled", stray))


def test_remote_kv_leaves_after_report() -> None:
    assert fires("remote-kv-leaves-after-report", admit_loaded()) == []
    assert fires("remote-kv-leaves-after-report", report_load()) == []
    # an update without a report promotes it
    t = report_load()
    early = dataclasses.replace(t, result=StepResult(), after=kview([a_req(W, 8, (1, 2))], step=1))
    assert fires("remote-kv-leaves-after-report", early) == [
        "left WAITING_FOR_REMOTE_KVS in update (WAITING) before its load was reported"
    ]
    # the report does not reach kv_loads_done
    lost = dataclasses.replace(t, after=t.before)
    assert fires("remote-kv-leaves-after-report", lost) == [
        "its load was reported finished (finished_recving) but it is not in kv_loads_done"
    ]
    # promoted as PREEMPTED though it was never preempted
    t2 = admit_loaded()
    wrong = dataclasses.replace(t2, plan=plan(2), after=kview([a_req(P, 8, (1, 2))], step=2))
    assert fires("remote-kv-leaves-after-report", wrong) == ["promoted to PREEMPTED, vLLM promotes it to WAITING"]


def test_kv_loads_consistent() -> None:
    t = start_load()
    assert fires("kv-loads-consistent", t) == []
    # the load's blocks are not the request's table
    other = dataclasses.replace(t, plan=plan(1, loads=[dataclasses.replace(LOAD, block_ids=(1, 3))]))
    assert any("are not its table" in m for m in fires("kv-loads-consistent", other))
    # the range starts inside a block
    odd = dataclasses.replace(t, plan=plan(1, loads=[dataclasses.replace(LOAD, start=2)]))
    assert any("inside a block" in m for m in fires("kv-loads-consistent", odd))
    # asynchronous, yet the request did not enter WAITING_FOR_REMOTE_KVS
    ran = dataclasses.replace(t, after=kview([a_req(R, 8, (1, 2))], step=1))
    assert any("has an asynchronous load but is RUNNING" in m for m in fires("kv-loads-consistent", ran))
    # entering WAITING_FOR_REMOTE_KVS without a load
    none = dataclasses.replace(t, plan=plan(1))
    assert fires("kv-loads-consistent", none) == ["entered WAITING_FOR_REMOTE_KVS without an asynchronous load in the plan"]
    # a synchronous load whose admission does not start at the load's end
    a = a_req(R, 10, (1, 2, 3), kv_load_async=False)
    sync = KVLoad("a", 0, 8, (1, 2, 3), False)
    good = Transition("schedule", kview([a_req(kv_load_async=False)]), kview([a], step=1),
                      plan=plan(1, [entry(a, 8, 2, kind=ScheduleKind.NEW)], [sync]))
    assert fires("kv-loads-consistent", good) == []
    silent(good)
    bad = dataclasses.replace(good, plan=plan(1, [entry(a, 4, 6, kind=ScheduleKind.NEW)], [sync]))
    assert fires("kv-loads-consistent", bad) == ["admitted from 4 computed tokens, its load ends at 8"]
    # no connector, yet a load
    plain = dataclasses.replace(t, after=dataclasses.replace(t.after, config=cfg(kv_connector=False)))
    assert fires("kv-loads-consistent", plain) == ["plan 1 carries 1 KV loads without a KV connector"]


def test_kv_load_follows_request() -> None:
    t = start_load()
    assert fires("kv-load-follows-request", t) == []
    short = dataclasses.replace(t, plan=plan(1, loads=[dataclasses.replace(LOAD, end=4, block_ids=(1,))]))
    assert fires("kv-load-follows-request", short) == ["load ends at 4, the store holds 8 tokens"]
    sync = dataclasses.replace(t, plan=plan(1, loads=[dataclasses.replace(LOAD, asynchronous=False)]))
    assert fires("kv-load-follows-request", sync) == [
        "load is synchronous, the request asks for an asynchronous one"
    ]


def failed_load(policy: str, after_a: RequestView | None, finished: Iterable[RequestView] = ()) -> Transition:
    c = cfg(kv_load_failure_policy=policy)
    before = kview([a_req(REMOTE, 8, (1, 2))], config=c, step=1)
    after = kview([after_a] if after_a is not None else [], config=c, step=1, finished=finished,
                  done=("a",) if after_a is not None and after_a.status == REMOTE else ())
    return Transition("update", before, after, plan=plan(1),
                      result=StepResult(finished_recving=("a",), failed_recving=("a",)))


def test_kv_load_failure_policy() -> None:
    ok_fail = failed_load("fail", None, [a_req(ERROR, 8, ())])
    assert fires("kv-load-failure-policy", ok_fail) == []
    silent(ok_fail)
    kept = failed_load("fail", a_req(REMOTE, 0, (1, 2)))
    assert fires("kv-load-failure-policy", kept) == [
        'its load failed under policy "fail" but it is WAITING_FOR_REMOTE_KVS'
    ]
    ok_recompute = failed_load("recompute", a_req(REMOTE, 0, (1, 2)))
    assert fires("kv-load-failure-policy", ok_recompute) == []
    silent(ok_recompute)
    counted = failed_load("recompute", a_req(REMOTE, 8, (1, 2)))
    assert fires("kv-load-failure-policy", counted) == ["its load failed as a whole but it keeps 8 computed tokens"]
    errored = failed_load("recompute", None, [a_req(ERROR, 8, ())])
    assert fires("kv-load-failure-policy", errored) == [
        'its load failed under policy "recompute" but it is FINISHED_ERROR'
    ]


# --------------------------------------------------------------------------
# Invalid blocks of a synchronous load
# --------------------------------------------------------------------------

SYNC = cfg(kv_load_failure_policy="recompute")


def sync_b(computed: int, blocks: Iterable[int] = (1, 2, 3), status: RequestStatus = R) -> RequestView:
    return req("b", PROMPT, status=status, computed=computed, blocks=blocks, kv_external_tokens=8)


def invalid_report(after_computed: int) -> Transition:
    """Step 1 loaded b's 8 tokens into blocks 1, 2 and computed 2 more; its
    update reports block 2 invalid."""
    b = sync_b(10)
    p = plan(1, [entry(b, 8, 2, kind=ScheduleKind.NEW)], [KVLoad("b", 0, 8, (1, 2, 3), False)])
    before = kview([b], config=SYNC, step=1)
    after = kview([sync_b(after_computed)], config=SYNC, step=1, keys=dict(before.kv.block_keys))
    return Transition("update", before, after, plan=p, result=StepResult(invalid_block_ids=(2,)))


def test_invalid_block_not_computed() -> None:
    good = invalid_report(4)
    assert fires("invalid-block-not-computed", good) == []
    assert fires("kv-load-failure-policy", good) == []
    # the report is ignored: b still counts block 2's tokens computed
    bad = invalid_report(10)
    # block 3 after it was computed from block 2's KV: invalid too
    assert fires("invalid-block-not-computed", bad) == [
        "counts 10 tokens computed, through invalid block 2 (index 1) that is not recomputed yet",
        "counts 10 tokens computed, through invalid block 3 (index 2) that is not recomputed yet",
    ]
    assert fires("kv-load-failure-policy", bad) == [
        "holds invalid block 2 at index 1 and has 10 computed tokens after the report, want 4"
    ]
    # later, before b recomputes it, c hits the still-cached invalid block 2
    h = History()
    h.record(good)
    assert h.invalid_blocks == {2: (1, frozenset()), 3: (2, frozenset())}
    c = req("c", PROMPT, status=R, computed=10, blocks=(1, 2, 4))
    before = good.after
    after = kview([dataclasses.replace(sync_b(4)), c], config=SYNC, step=2, keys=dict(before.kv.block_keys))
    p = plan(2, [entry(c, 8, 2, kind=ScheduleKind.NEW)])
    hit = Transition("schedule", before, after, plan=p, in_flight=(p,))
    assert fires("invalid-block-not-computed", hit, h) == [
        "counts 10 tokens computed, through invalid block 2 (index 1) that is not recomputed yet"
    ]
    # once b's step recomputes from index 1's start, a hit is a hit again
    b2 = sync_b(10)
    p2 = plan(2, [entry(b2, 4, 6, kind=ScheduleKind.RUNNING), entry(c, 8, 2, kind=ScheduleKind.NEW)])
    fixed = dataclasses.replace(hit, plan=p2, after=kview([b2, c], config=SYNC, step=2, keys=dict(before.kv.block_keys)))
    assert fires("invalid-block-not-computed", fixed, h) == []
    h.record(fixed)
    assert h.invalid_blocks == {}


# --------------------------------------------------------------------------
# Blocks of finished requests and quiescence
# --------------------------------------------------------------------------


def saved(held: bool = True, status: RequestStatus = STOPPED, save: bool = True) -> Transition:
    """d (10 prompt tokens, 1 output) stops in step 3's update; it asked for
    an asynchronous save, so its blocks 1..3 stay held."""
    d = req("d", PROMPT, (7,), status=R, computed=10, blocks=(1, 2, 3), kv_save_async=save, max_tokens=1)
    e = entry(d, 9, 1, kind=ScheduleKind.RUNNING)
    done = dataclasses.replace(d, status=status)
    after = kview([], step=3, finished=[done], held={"d": (1, 2, 3)} if held else None)
    return Transition("update", kview([d], step=3), after, plan=plan(3, [e]), result=StepResult({"d": (8,)}))


def test_finished_holds_only_pending() -> None:
    t = saved()
    assert fires("finished-holds-only-pending", t) == []
    assert fires("kv-save-delays-free", t) == []
    aborted = saved(status=ABORTED)
    assert fires("finished-holds-only-pending", aborted) == [
        "holds blocks after finishing FINISHED_ABORTED from RUNNING with no save or load pending"
    ]
    nosave = saved(save=False)
    assert any("no save or load pending" in m for m in fires("finished-holds-only-pending", nosave))
    # the save is reported: the blocks go in that update, not before or after
    v = t.after
    freed = kview([], step=3)
    report = Transition("update", v, freed, plan=plan(4), result=StepResult(finished_sending=("d",)))
    assert fires("finished-holds-only-pending", report) == []
    early = Transition("update", v, freed, plan=plan(4), result=StepResult())
    assert fires("finished-holds-only-pending", early) == ["stopped holding its blocks in update without a report naming it"]
    late = Transition("update", v, v, plan=plan(4), result=StepResult(finished_sending=("d",)))
    assert fires("finished-holds-only-pending", late) == ["its report came in this update but it still holds its blocks"]
    # only null places: wrong in a full-attention layout, what a chunked-local
    # or sliding-window table may be left with (every block before it freed)
    nulls = dataclasses.replace(t, after=dataclasses.replace(t.after, kv_held_by_finished={"d": (0, 0)}))
    assert "is listed in kv_held_by_finished with no block" in fires("finished-holds-only-pending", nulls)
    cl = cfg(num_blocks=17, kv_cache_groups=(KVCacheGroup(), KVCacheGroup(kind="chunked_local", attention_chunk_size=4)))
    nulls_cl = dataclasses.replace(nulls, after=dataclasses.replace(nulls.after, config=cl))
    assert "is listed in kv_held_by_finished with no block" not in fires("finished-holds-only-pending", nulls_cl)


def test_abort_during_a_load_holds_its_blocks_until_the_report() -> None:
    before = kview([a_req(REMOTE, 8, (1, 2))], step=1)
    after = kview([], step=1, finished=[a_req(ABORTED, 8, (1, 2))], held={"a": (1, 2)})
    t = Transition("abort", before, after, request_id="a")
    assert fires("finished-holds-only-pending", t) == []
    silent(t)
    # had the load been reported, nothing is pending: vLLM frees at once
    reported = dataclasses.replace(t, before=dataclasses.replace(before, kv_loads_done=("a",)))
    assert fires("finished-holds-only-pending", reported) == [
        "holds blocks after finishing FINISHED_ABORTED from WAITING_FOR_REMOTE_KVS with no save or load pending"
    ]


def test_kv_save_delays_free() -> None:
    t = saved(held=False)
    assert fires("kv-save-delays-free", t) == [
        "finished FINISHED_STOPPED asking for an asynchronous save, yet holds no block"
    ]
    assert fires("kv-save-delays-free", saved(held=False, status=ABORTED)) == []


def test_kv_quiescence() -> None:
    v = kview([], step=5)
    t = Transition("update", v, v, plan=plan(5), result=StepResult())
    assert fires("kv-quiescence", t) == []
    # a block kept back (a deferred free never drained)
    leak = dataclasses.replace(v, kv=dataclasses.replace(v.kv, ref_cnt=(0, 1) + (0,) * 7,
                                                         free_queue=tuple(range(2, 9))))
    bad = dataclasses.replace(t, after=leak)
    assert fires("kv-quiescence", bad) == [
        "nothing unfinished, held or in flight, yet blocks [1] have non-zero ref_cnt",
        "nothing unfinished, held or in flight, yet blocks [1] are not in the free queue",
    ]
    # with a plan in flight, the deferred free may still be pending
    assert fires("kv-quiescence", dataclasses.replace(bad, in_flight=(plan(6),))) == []
    # a finished request holding blocks for its save: not yet quiescent
    assert fires("kv-quiescence", saved()) == []
