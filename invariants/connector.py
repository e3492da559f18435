"""Invariants of the KV connector: requests waiting for a remote load, the
loads a plan starts, failed loads and invalid blocks, the blocks a finished
request keeps for the connector, and quiescence. Each requires the
``kv_connector`` capability (schedspec.check.capabilities), so a scheduler
without a connector skips them; each is silent on a config without one.

They read views, plans, results and the History only. The vLLM behaviour is
that of vllm/v1/core/sched/scheduler.py (schedule()'s waiting loop,
update_from_output, finish_requests, _free_request) with the modelled
connector of spec/interface.py (SchedulerConfig.kv_connector)."""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import (
    KVLoad,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerView,
)

from schedspec.invariants._util import (
    NULL_BLOCK,
    admitted,
    block_key,
    cdiv,
    lookup,
    invalid_block_walk,
    kv_load_failed,
    next_invalid_blocks,
    skipping_groups,
    tables,
)
from schedspec.invariants.core import Finding, History, Transition, transition_invariant

_S = RequestStatus
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
_NEEDS = ("kv_connector",)


def _on(v: SchedulerView) -> bool:
    return v.config.kv_connector


# ---------------------------------------------------------------- waiting for a load


@transition_invariant(
    "remote-kv-not-scheduled",
    "A request in WAITING_FOR_REMOTE_KVS is never scheduled for compute: no plan entry names a "
    "request in it after the step, nor one that was in it before the step unless its load had "
    "been reported (kv_loads_done); in every view it is in the waiting queue, not running, with "
    "no output placeholders or drafts, holding blocks that cover its computed tokens; "
    "kv_loads_done and kv_loads_failed name only such requests, sorted.",
    "vllm/v1/core/sched/scheduler.py, schedule(): an asynchronous load sets the request "
    "WAITING_FOR_REMOTE_KVS after allocate_slots and skips it into kv_holding_waiting "
    "(skip_request) with num_new_tokens 0; _handle_blocked_waiting_request passes it over until "
    "finished_recving_kv_req_ids holds it, then _update_waiting_for_remote_kv promotes it.",
    tags=("safety",),
    requires=_NEEDS,
)
def remote_kv_not_scheduled(t: Transition, h: History) -> Iterator[Finding]:
    v = t.after
    if not (_on(v) or _on(t.before)):
        return
    if t.kind == "schedule" and t.plan is not None:
        for s in t.plan.scheduled:
            b = t.before.requests.get(s.request_id)
            if b is not None and b.status == _REMOTE and s.request_id not in t.before.kv_loads_done:
                yield s.request_id, f"scheduled in step {t.plan.step} while its KV load is in flight"
            a = v.requests.get(s.request_id)
            if a is not None and a.status == _REMOTE:
                yield s.request_id, f"scheduled in step {t.plan.step} and WAITING_FOR_REMOTE_KVS after it"
    bs = v.config.block_size
    running = set(v.running)
    for rid, r in v.requests.items():
        if r.status != _REMOTE:
            continue
        if rid in running:
            yield rid, "is WAITING_FOR_REMOTE_KVS and in the running queue"
        if r.num_output_placeholders or r.spec_token_ids:
            yield rid, (
                f"is WAITING_FOR_REMOTE_KVS with {r.num_output_placeholders} placeholders and "
                f"drafts {list(r.spec_token_ids)}"
            )
        want = max(cdiv(r.num_computed_tokens, bs), 1)
        for g, table in enumerate(tables(r)):
            if len(table) < want:
                yield rid, (
                    f"is WAITING_FOR_REMOTE_KVS with {r.num_computed_tokens} computed tokens but holds "
                    f"{len(table)} blocks{f' in group {g}' if g else ''}, needs at least {want}"
                )
    for name, ids in (("kv_loads_done", v.kv_loads_done), ("kv_loads_failed", v.kv_loads_failed)):
        if list(ids) != sorted(set(ids)):
            yield None, f"{name} {list(ids)} is not sorted without duplicates"
        for rid in ids:
            w = v.requests.get(rid)
            if w is None or w.status != _REMOTE:
                yield rid, f"is in {name} but is {'not unfinished' if w is None else w.status.name}"


def _failure_named(t: Transition, rid: str, b: RequestView) -> bool:
    """Whether ``t``'s result reports a failure of ``rid``'s load."""
    if t.result is None:
        return False
    if rid in t.result.failed_recving:
        return True
    bad = set(t.result.invalid_block_ids)
    return any(x in bad for x in b.block_ids)


@transition_invariant(
    "remote-kv-leaves-after-report",
    "A request leaves WAITING_FOR_REMOTE_KVS only in schedule() after its load was reported "
    "(it was in kv_loads_done: then WAITING, PREEMPTED if it was preempted before, or RUNNING), "
    "by its own abort (FINISHED_ABORTED), or in the update whose result reports its load failed "
    "under the \"fail\" policy (FINISHED_ERROR); it enters kv_loads_done only in the update whose "
    "finished_recving names it, and leaves it only by leaving WAITING_FOR_REMOTE_KVS.",
    "vllm/v1/core/sched/scheduler.py, _update_from_kv_xfer_finished adds finished_recving to "
    "finished_recving_kv_req_ids; _handle_blocked_waiting_request / _update_waiting_for_remote_kv "
    "promote (status WAITING, or PREEMPTED when num_preemptions) and remove it; finish_requests "
    "(abort); update_from_output finishes failed_kv_load_req_ids with FINISHED_ERROR unless "
    "recompute_kv_load_failures.",
    tags=("safety",),
    requires=_NEEDS,
)
def remote_kv_leaves_after_report(t: Transition, h: History) -> Iterator[Finding]:
    if not (_on(t.after) or _on(t.before)):
        return
    cfg = t.after.config
    recv = set(t.result.finished_recving) if t.kind == "update" and t.result is not None else set()
    for rid, b in t.before.requests.items():
        if b.status != _REMOTE:
            continue
        a = lookup(t.after, rid)
        status = a.status if a is not None else None
        if status == _REMOTE:
            restarted = t.kind == "schedule" and t.plan is not None and any(
                ld.request_id == rid and ld.asynchronous for ld in t.plan.kv_loads
            )
            if rid in t.before.kv_loads_done and rid not in t.after.kv_loads_done and not restarted:
                # (promoted with no valid token left, a fresh lookup may start a new load)
                yield rid, f"left kv_loads_done in {t.kind} while still WAITING_FOR_REMOTE_KVS"
            if rid not in t.before.kv_loads_done and rid in t.after.kv_loads_done and rid not in recv:
                yield rid, f"entered kv_loads_done in {t.kind} without a result naming it in finished_recving"
            if rid in recv and rid not in t.after.kv_loads_done:
                yield rid, "its load was reported finished (finished_recving) but it is not in kv_loads_done"
            continue
        if t.kind == "schedule" and rid in t.before.kv_loads_done:
            if status in (_S.WAITING, _S.PREEMPTED, _S.RUNNING):
                promoted = _S.PREEMPTED if b.num_preemptions else _S.WAITING
                if status != _S.RUNNING and status != promoted:
                    yield rid, f"promoted to {status.name}, vLLM promotes it to {promoted.name}"
                continue
        if t.kind == "abort" and t.request_id == rid and status == _S.FINISHED_ABORTED:
            continue
        if (
            t.kind == "update"
            and status == _S.FINISHED_ERROR
            and cfg.kv_load_failure_policy == "fail"
            and _failure_named(t, rid, b)
        ):
            continue
        where = "gone" if status is None else status.name
        done = "after its load was reported" if rid in t.before.kv_loads_done else "before its load was reported"
        yield rid, f"left WAITING_FOR_REMOTE_KVS in {t.kind} ({where}) {done}"


# ---------------------------------------------------------------- the plan's loads


@transition_invariant(
    "kv-loads-consistent",
    "A plan's KV loads are consistent: at most one per request, only with a KV connector; each "
    "covers a non-empty range of the prompt starting at the request's local prefix-cache hit (a "
    "whole number of blocks, each cached under the request's key) on a fresh lookup (0 computed "
    "tokens before, WAITING or PREEMPTED); its blocks are the request's table (every group's for a "
    "hybrid layout) covering the range; an asynchronous load exactly for a request entering "
    "WAITING_FOR_REMOTE_KVS in the step, with the range's end as its computed tokens; a "
    "synchronous one for an admission whose entry starts at the range's end; sync loads in plan order.",
    "vllm/v1/core/sched/scheduler.py, schedule(): get_num_new_matched_tokens is asked only when "
    "num_computed_tokens == 0, after the local hit (_get_local_prefix_cache_hit, block aligned); "
    "allocate_slots then update_state_after_alloc(request, get_blocks(request_id), "
    "num_external_computed_tokens); load_kv_async -> WAITING_FOR_REMOTE_KVS with "
    "num_computed_tokens = local + external; otherwise the request runs from local + external; "
    "build_connector_meta collects them in admission order.",
    ("schedule",),
    tags=("safety",),
    requires=_NEEDS,
)
def kv_loads_consistent(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.after.config
    loads = t.plan.kv_loads
    if not cfg.kv_connector:
        if loads:
            yield None, f"plan {t.plan.step} carries {len(loads)} KV loads without a KV connector"
        return
    bs = cfg.block_size
    seen: set[str] = set()
    entries = {s.request_id: s for s in t.plan.scheduled}
    for load in loads:
        rid = load.request_id
        if rid in seen:
            yield rid, f"has two loads in plan {t.plan.step}"
        seen.add(rid)
        yield from _load_findings(t, load, bs, entries.get(rid))
    sync_order = [ld.request_id for ld in loads if not ld.asynchronous]
    plan_order = [s.request_id for s in t.plan.scheduled if s.request_id in set(sync_order)]
    if sync_order != plan_order:
        yield None, f"synchronous loads {sync_order} are not in the plan's order {plan_order}"
    asynchronous = {ld.request_id for ld in loads if ld.asynchronous}
    for rid, a in t.after.requests.items():
        b = t.before.requests.get(rid)
        if a.status == _REMOTE and (b is None or b.status != _REMOTE) and rid not in asynchronous:
            yield rid, "entered WAITING_FOR_REMOTE_KVS without an asynchronous load in the plan"


def _load_findings(t: Transition, load: KVLoad, bs: int, entry: ScheduledRequest | None) -> Iterator[Finding]:
    rid = load.request_id
    b = t.before.requests.get(rid)
    a = t.after.requests.get(rid)
    if b is None or a is None:
        yield rid, "has a load but is not an unfinished request before and after the step"
        return
    if not 0 <= load.start < load.end <= len(b.spec.prompt_token_ids):
        yield rid, f"load range [{load.start}, {load.end}) is not a non-empty range of its {len(b.spec.prompt_token_ids)}-token prompt"
    # a finished load promoted in this step with no valid token left (a failed
    # one) gets a fresh lookup in the same pass (_update_waiting_for_remote_kv)
    promoted = b.status == _REMOTE and rid in t.before.kv_loads_done
    # a request whose grammar compiled meanwhile is promoted to WAITING and
    # looked up in the same pass (_handle_blocked_waiting_request)
    grammar_ready = b.status == _S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    if b.status not in (_S.WAITING, _S.PREEMPTED) and not promoted and not grammar_ready:
        yield rid, f"load started though the request was {b.status.name}"
    elif b.num_computed_tokens != 0 and not promoted:
        yield rid, f"load started though the request had {b.num_computed_tokens} computed tokens"
    if load.start % bs:
        yield rid, f"load starts at {load.start}, inside a block: the local hit is whole blocks"
    for i in range(min(load.start // bs, len(a.block_ids))):
        blk = a.block_ids[i]
        if blk != NULL_BLOCK and t.after.kv.block_keys.get(blk) != block_key(
                b, i, bs, t.after.config.num_hash_lookahead_tokens):
            yield rid, f"load starts at {load.start} but block {blk} (index {i}) is not a hit on the request's key"
    if tuple(a.block_ids[: len(load.block_ids)]) != load.block_ids or len(load.block_ids) < cdiv(load.end, bs):
        yield rid, f"load blocks {list(load.block_ids)} are not its table {list(a.block_ids)} covering {load.end} tokens"
    if t.after.config.is_hybrid:
        tabs = tables(a)
        if len(load.group_block_ids) != len(tabs) or any(
            tuple(tab[: len(lg)]) != lg for lg, tab in zip(load.group_block_ids, tabs)
        ):
            yield rid, f"load group blocks {[list(x) for x in load.group_block_ids]} are not its tables"
    elif load.group_block_ids:
        yield rid, "load carries group tables in a plain layout"
    if load.asynchronous:
        if a.status != _REMOTE:
            yield rid, f"has an asynchronous load but is {a.status.name} after the step"
        elif a.num_computed_tokens != load.end:
            yield rid, f"waits for a load ending at {load.end} with {a.num_computed_tokens} computed tokens"
        if entry is not None:
            yield rid, "has an asynchronous load and a plan entry"
        return
    if entry is None or entry.kind not in (ScheduleKind.NEW, ScheduleKind.RESUMED):
        yield rid, "has a synchronous load but is not admitted in the step"
    elif entry.num_computed_tokens != load.end:
        yield rid, f"admitted from {entry.num_computed_tokens} computed tokens, its load ends at {load.end}"


@transition_invariant(
    "kv-load-follows-request",
    "The modelled connector: a load ends at the request's kv_external_tokens, is asynchronous "
    "exactly when the request asks for it (kv_load_async), and a fresh admission or asynchronous "
    "load that takes no load had a local hit of at least kv_external_tokens.",
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py, KVConnectorBase_V1."
    "get_num_new_matched_tokens as spec/interface.py models it: (max(0, kv_external_tokens - "
    "num_computed_tokens), kv_load_async and that > 0); vllm/v1/core/sched/scheduler.py, "
    "schedule() loads num_external_computed_tokens from the local hit on.",
    ("schedule",),
    tags=("policy:modelled-connector",),
    requires=_NEEDS,
)
def kv_load_follows_request(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    if not t.after.config.kv_connector:
        return
    loads = {ld.request_id: ld for ld in t.plan.kv_loads}
    for load in t.plan.kv_loads:
        b = t.before.requests.get(load.request_id)
        if b is None:
            continue
        if load.end != b.spec.kv_external_tokens:
            yield load.request_id, f"load ends at {load.end}, the store holds {b.spec.kv_external_tokens} tokens"
        if load.asynchronous != b.spec.kv_load_async:
            yield load.request_id, (
                f"load is {'a' if load.asynchronous else ''}synchronous, the request asks for "
                f"{'an a' if b.spec.kv_load_async else 'a '}synchronous one"
            )
    for s in admitted(t.plan):
        b = t.before.requests.get(s.request_id)
        if b is None or b.num_computed_tokens or b.status == _REMOTE or s.request_id in loads:
            continue
        if s.num_computed_tokens < b.spec.kv_external_tokens:
            yield s.request_id, (
                f"admitted with a hit of {s.num_computed_tokens} tokens and no load, though the store "
                f"holds {b.spec.kv_external_tokens}"
            )


# ---------------------------------------------------------------- failed loads


@transition_invariant(
    "kv-load-failure-policy",
    "A failed load is handled by the configured policy in the update that reports it: every "
    "request it affects (waiting for a load named in failed_recving, or holding a block named in "
    "invalid_block_ids within the tokens it had computed before the step) finishes with "
    "FINISHED_ERROR under \"fail\"; under \"recompute\" it stays unfinished with its computed "
    "tokens cut: to 0 for a failed load, else to the start of its first invalid block that no "
    "request before it in vLLM's walk (the loading requests, then the running ones) marked for "
    "recomputation, or, when every invalid block it holds was marked, to what it had before the step.",
    "vllm/v1/core/sched/scheduler.py, update_from_output: _handle_failed_recving (num_computed_tokens "
    "= 0 under recompute), _handle_invalid_blocks / _update_requests_with_invalid_blocks (truncate at "
    "the first invalid block; marked_invalid_block_ids for a shared one), and "
    "finish_requests(failed_kv_load_req_ids, FINISHED_ERROR) unless recompute_kv_load_failures.",
    ("update",),
    tags=("safety",),
    requires=_NEEDS,
)
def kv_load_failure_policy(t: Transition, h: History) -> Iterator[Finding]:
    cfg = t.after.config
    bs = cfg.block_size
    scheduled = {e.request_id: e.num_scheduled_tokens for e in t.plan.scheduled} if t.plan is not None else {}
    walk = invalid_block_walk(t)
    for rid, first in sorted(kv_load_failed(t).items()):
        b = t.before.requests[rid]
        a = lookup(t.after, rid)
        if cfg.kv_load_failure_policy == "fail":
            if a is None or a.status != _S.FINISHED_ERROR:
                yield rid, f"its load failed under policy \"fail\" but it is {'gone' if a is None else a.status.name}"
            continue
        if a is None or a.status.is_finished:
            yield rid, f"its load failed under policy \"recompute\" but it is {'gone' if a is None else a.status.name}"
        elif first is None:
            if a.num_computed_tokens != 0:
                yield rid, f"its load failed as a whole but it keeps {a.num_computed_tokens} computed tokens"
        else:
            want = first * bs
            if walk.get(rid, (first, False))[1]:
                want = b.num_computed_tokens - scheduled.get(rid, 0)  # every invalid block marked by another
            if a.num_computed_tokens != want:
                yield rid, (
                    f"holds invalid block {b.block_ids[first]} at index {first} and has {a.num_computed_tokens} "
                    f"computed tokens after the report, want {want}"
                )


@transition_invariant(
    "invalid-block-not-computed",
    "An invalid block is never read as computed: from the update whose result reports it (in "
    "invalid_block_ids with the blocks after it in an affected request's table, or the loaded "
    "blocks of a load in failed_recving) until a plan rewrites it (an entry computes from at or "
    "before its start through it, or a load fills it) or it leaves the cache (held by nobody, no "
    "key), no request counts a token of it computed, save those vLLM lets keep it while another "
    "holder recomputes it, and only while that holder still holds it uncomputed (an abort of the "
    "recomputing holder leaves the others reading invalid KV: docs/divergences.md).",
    "vllm/v1/core/sched/scheduler.py, _update_requests_with_invalid_blocks truncates "
    "num_computed_tokens at the first invalid block (marked_invalid_block_ids: a shared block is "
    "recomputed by its first holder), _handle_invalid_blocks evicts sync-loaded blocks under "
    "\"fail\", _update_waiting_for_remote_kv caches only the valid prefix of a failed async load.",
    tags=("safety",),
    requires=_NEEDS,
)
def invalid_block_not_computed(t: Transition, h: History) -> Iterator[Finding]:
    if not (_on(t.after) or h.invalid_blocks):
        return
    bs = t.after.config.block_size
    for blk, (i, excused) in sorted(next_invalid_blocks(t, h).items()):
        for rid, r in sorted(t.after.requests.items()):
            if rid in excused:
                continue
            if i < len(r.block_ids) and r.block_ids[i] == blk and r.num_computed_tokens > i * bs:
                yield rid, (
                    f"counts {r.num_computed_tokens} tokens computed, through invalid block {blk} "
                    f"(index {i}) that is not recomputed yet"
                )


# ---------------------------------------------------------------- blocks of finished requests


_SAVED = (_S.FINISHED_STOPPED, _S.FINISHED_LENGTH_CAPPED)


@transition_invariant(
    "finished-holds-only-pending",
    "A finished request holds blocks (kv_held_by_finished) only while a report is pending: its "
    "asynchronous save (it asked for one and stopped or hit its length) or its asynchronous load "
    "(it finished while WAITING_FOR_REMOTE_KVS with the load not reported); it enters only as it "
    "finishes, holds blocks it held then, and leaves exactly in the update whose result names it "
    "(finished_sending or finished_recving), freeing them. It holds a real block, save with a "
    "sliding-window or chunked-local group, whose table may be all null places by then.",
    "vllm/v1/core/sched/scheduler.py, _free_request (delay_free_blocks from finish_requests for a "
    "load in flight, and _connector_finished -> request_finished for a save), "
    "_update_from_kv_xfer_finished -> _free_blocks for finished_recving of a finished request "
    "and for finished_sending.",
    tags=("safety",),
    requires=_NEEDS,
)
def finished_holds_only_pending(t: Transition, h: History) -> Iterator[Finding]:
    before, after = t.before.kv_held_by_finished, t.after.kv_held_by_finished
    if not (before or after):
        return
    named: set[str] = set()
    if t.kind == "update" and t.result is not None:
        named = set(t.result.finished_sending) | set(t.result.finished_recving)
    skipping = bool(skipping_groups(t.after.config))
    for rid, blocks in after.items():
        if rid in t.after.requests:
            yield rid, "is unfinished but listed in kv_held_by_finished"
        if not skipping and not [x for x in blocks if x != NULL_BLOCK]:
            # a sliding-window or chunked-local table may hold only null
            # places (every block before the window or chunk freed), and vLLM
            # still delays the free for the save (scheduler.py, _free_request)
            yield rid, "is listed in kv_held_by_finished with no block"
        if rid in before:
            if tuple(before[rid]) != tuple(blocks):
                yield rid, f"held blocks changed from {list(before[rid])} to {list(blocks)}"
            if rid in named:
                yield rid, "its report came in this update but it still holds its blocks"
            continue
        b = t.before.requests.get(rid)
        if b is None:
            yield rid, f"started holding blocks for the connector in {t.kind} without finishing in it"
            continue
        held_then = {x for tab in tables(b) for x in tab if x != NULL_BLOCK}
        extra = sorted(set(blocks) - held_then - {NULL_BLOCK})
        if extra:
            yield rid, f"holds blocks {extra} it did not hold when it finished"
        a = lookup(t.after, rid)
        status = a.status if a is not None else None
        save = b.spec.kv_save_async and status in _SAVED
        load = b.status == _REMOTE and rid not in t.before.kv_loads_done
        if not (save or load):
            yield rid, (
                f"holds blocks after finishing {status.name if status else ''} from {b.status.name} with "
                f"no save or load pending"
            )
    for rid in before:
        if rid not in after and rid not in named:
            yield rid, f"stopped holding its blocks in {t.kind} without a report naming it"


@transition_invariant(
    "kv-save-delays-free",
    "The modelled connector: a request that asked for an asynchronous save and finishes stopped "
    "or length-capped keeps its blocks (is in kv_held_by_finished) until the save is reported.",
    "vllm/v1/core/sched/scheduler.py, _free_request: _connector_finished -> "
    "request_finished(request, block_ids) returns delay_free_blocks, modelled as kv_save_async "
    "and status in (FINISHED_STOPPED, FINISHED_LENGTH_CAPPED).",
    tags=("policy:modelled-connector",),
    requires=_NEEDS,
)
def kv_save_delays_free(t: Transition, h: History) -> Iterator[Finding]:
    if not _on(t.after):
        return
    for rid, r in t.after.finished.items():
        b = t.before.requests.get(rid)
        if b is None or not b.spec.kv_save_async or r.status not in _SAVED:
            continue
        if rid not in t.after.kv_held_by_finished:
            yield rid, f"finished {r.status.name} asking for an asynchronous save, yet holds no block"


@transition_invariant(
    "kv-quiescence",
    "Every block returns: once no request is unfinished, no finished request holds blocks for "
    "the connector and no plan is in flight, every ref_cnt is 0 and all num_blocks - 1 usable "
    "blocks are in the free queue (none kept back, as a deferred free would be).",
    "vllm/v1/core/sched/scheduler.py, _free_blocks / _free_request_blocks: blocks are freed at "
    "finish, or deferred (deferred_frees, async scheduling with a consumer connector) until the "
    "in-flight step is processed (_drain_deferred_frees), or kept for the connector until its "
    "report; has_requests / has_finished_requests stay true until then.",
    tags=("safety",),
    requires=_NEEDS,
)
def kv_quiescence(t: Transition, h: History) -> Iterator[Finding]:
    v = t.after
    if v.requests or v.kv_held_by_finished or t.in_flight:
        return
    held = [b for b, c in enumerate(v.kv.ref_cnt) if c != 0]
    if held:
        yield None, f"nothing unfinished, held or in flight, yet blocks {held} have non-zero ref_cnt"
    free = set(v.kv.free_queue) - {NULL_BLOCK}
    if len(free) != v.kv.num_blocks - 1:
        missing = sorted(set(range(1, v.kv.num_blocks)) - free)
        yield None, f"nothing unfinished, held or in flight, yet blocks {missing} are not in the free queue"

