"""Invariants of hybrid KV cache groups: every group's block table per
request (full attention beside sliding window and chunked local attention),
block conservation per group, tables that keep exactly what their group
keeps, prefix hits valid in every group, and vLLM's freeing of blocks that
slid out of the window or lie before the current chunk. Each
requires the ``hybrid_kv`` capability (schedspec.check.capabilities); on the
plain layout (one full-attention group) each is silent but for the check that
no view or plan carries group tables.

The vLLM behaviour is that of vllm/v1/core/kv_cache_coordinator.py
(UnitaryKVCacheCoordinator, HybridKVCacheCoordinator) and
vllm/v1/core/single_type_kv_cache_manager.py (FullAttentionManager,
SlidingWindowManager, ChunkedLocalAttentionManager) over the one BlockPool.
A sliding-window and a chunked-local group differ only in which leading
tokens the next token skips (invariants/_util.py, skipped_tokens)."""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import (
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerView,
    block_key_group,
    group_block_key,
)

from schedspec.invariants._util import (
    NULL_BLOCK,
    admitted,
    attended_span,
    block_key,
    describe_group,
    inflight_tokens,
    skipped_blocks,
    skipping_groups,
    state_groups,
    tables,
)
from schedspec.invariants.core import Finding, History, Transition, transition_invariant
from schedspec.invariants.step import own_live_entries, promoted_blocks

_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
_NEEDS = ("hybrid_kv",)


def _nulls(table: tuple[int, ...]) -> int:
    """How many places a table's null prefix has."""
    n = 0
    while n < len(table) and table[n] == NULL_BLOCK:
        n += 1
    return n


def _shape_findings(v: SchedulerView, rid: str, r: RequestView | ScheduledRequest, what: str) -> Iterator[Finding]:
    n = len(v.config.groups)
    if not v.config.is_hybrid:
        if r.group_block_ids:
            yield rid, f"{what} carries group tables in a plain layout"
        return
    if not r.group_block_ids:
        if r.block_ids:
            yield rid, f"{what} holds blocks {list(r.block_ids)} but no group tables in a hybrid layout"
        return
    if len(r.group_block_ids) != n:
        yield rid, f"{what} has {len(r.group_block_ids)} group tables for {n} KV cache groups"
    elif r.group_block_ids[0] != r.block_ids:
        yield rid, f"{what} block_ids {list(r.block_ids)} is not group 0's table {list(r.group_block_ids[0])}"


@transition_invariant(
    "group-block-conservation",
    "Per KV cache group: a hybrid layout's requests and plan entries carry one table per group "
    "(group 0's is block_ids), a plain layout's none; every held block is in exactly one group's "
    "tables, the null block 0 only in a sliding-window or chunked-local group's, and a held "
    "block's prefix-cache key is its group's (block_key_group).",
    "vllm/v1/core/kv_cache_coordinator.py: each SingleTypeKVCacheManager keeps req_to_blocks per "
    "group and draws from the one BlockPool (get_new_blocks hands a block to one group); "
    "single_type_kv_cache_manager.py, remove_skipped_blocks puts the null block in a sliding "
    "window's or a chunked-local group's table; kv_cache_utils.py, make_block_hash_with_group_id "
    "/ BlockHashWithGroupId.",
    tags=("safety",),
    requires=_NEEDS,
)
def group_block_conservation(t: Transition, h: History) -> Iterator[Finding]:
    v = t.after
    for rid, r in v.requests.items():
        yield from _shape_findings(v, rid, r, "request")
    if t.kind == "schedule" and t.plan is not None:
        for s in t.plan.scheduled:
            yield from _shape_findings(v, s.request_id, s, "plan entry")
    if not v.config.is_hybrid:
        return
    sw = skipping_groups(v.config)
    group_of: dict[int, int] = {}
    for rid, r in sorted(v.requests.items()):
        for g, table in enumerate(tables(r)):
            for i, b in enumerate(table):
                if b == NULL_BLOCK:
                    if g not in sw:
                        yield rid, f"full-attention group {g} holds the null block at index {i}"
                    continue
                other = group_of.setdefault(b, g)
                if other != g:
                    yield rid, f"block {b} is in group {g}'s table and in group {other}'s"
                key = v.kv.block_keys.get(b)
                if key is not None and block_key_group(key) != g:
                    yield rid, f"block {b} of group {g} carries a key of group {block_key_group(key)}"


@transition_invariant(
    "group-tables-cover",
    "Each group's table keeps exactly what its group keeps: every group's table of a request has "
    "group 0's length (slots for the same tokens); a full-attention table holds a real block in "
    "every place; a sliding-window or chunked-local table's null places are a prefix and only "
    "blocks wholly before what the next token attends (the whole blocks among max(0, computed - "
    "window + 1) tokens for a window, among (computed // chunk) * chunk for a chunk), so every "
    "token the next one attends keeps its block.",
    "vllm/v1/core/single_type_kv_cache_manager.py: allocate_new_blocks grows every group's table "
    "to cdiv(num_tokens, block_size); SlidingWindowManager.get_num_skipped_tokens (computed - "
    "sliding_window + 1), ChunkedLocalAttentionManager.get_num_skipped_tokens ((computed // "
    "attention_chunk_size) * attention_chunk_size) and remove_skipped_blocks / "
    "_remove_blocks_in_range (backward from the last skipped block, stopping at a null one) null "
    "only the skipped prefix; add_local_computed_blocks pads a hit's skipped blocks with nulls.",
    tags=("safety",),
    requires=_NEEDS,
)
def group_tables_cover(t: Transition, h: History) -> Iterator[Finding]:
    v = t.after
    if not v.config.is_hybrid:
        return
    bs = v.config.block_size
    groups = v.config.groups
    skipping = skipping_groups(v.config) - state_groups(v.config)  # Mamba: invariants/mamba.py
    for rid, r in sorted(v.requests.items()):
        tabs = tables(r)
        if len(tabs) != len(groups):
            continue  # group-block-conservation says so
        for g, (grp, table) in enumerate(zip(groups, tabs)):
            if len(table) != len(tabs[0]):
                yield rid, f"group {g}'s table has {len(table)} places, group 0's {len(tabs[0])}"
            if g not in skipping:
                continue
            k = _nulls(table)
            if NULL_BLOCK in table[k:]:
                yield rid, f"{describe_group(grp, g).split(' (')[0]}'s null places {list(table)} are not a prefix"
            if r.status == _REMOTE:
                continue  # its tokens are not computed until its load is reported
            computed = r.num_computed_tokens
            if (
                v.config.kv_connector
                and r.status == RequestStatus.WAITING
                and r.spec.kv_external_tokens
                and computed == r.num_tokens - 1
            ):
                # a promoted load of every token: its window (or chunk) was cut at the
                # load's end (allocate_slots' remove_skipped_blocks at
                # num_tokens), before _update_waiting_for_remote_kv set
                # num_computed_tokens = num_tokens - 1
                computed += 1
            most = skipped_blocks(grp, computed, bs)
            if k > most:
                yield rid, (
                    f"{describe_group(grp, g)} freed {k} blocks, but with "
                    f"{r.num_computed_tokens} computed tokens only {most} lie wholly before {attended_span(grp)}"
                )


def _hit_length(t: Transition, s: ScheduledRequest) -> int | None:
    """The prefix-cache hit of an admission on a fresh lookup (before the step
    it had 0 computed tokens): its computed tokens, or where its load starts."""
    b = t.before.requests.get(s.request_id)
    if b is None or b.num_computed_tokens or b.status == _REMOTE:
        return None
    assert t.plan is not None
    for load in t.plan.kv_loads:
        if load.request_id == s.request_id:
            return load.start
    return s.num_computed_tokens


@transition_invariant(
    "groups-prefix-hit-valid",
    "A prefix hit is valid in every group: each block an admission (or an asynchronous load) takes "
    "from the cache is, in every group's table, either a block cached under that group's key for "
    "the request's content (group_block_key of its salt and token prefix), before the step or "
    "filled by another request scheduled in it, or a sliding-window or chunked-local group's null "
    "place wholly before what the token after the admission's computed tokens attends (its "
    "window, its chunk).",
    "vllm/v1/core/kv_cache_coordinator.py, HybridKVCacheCoordinator.find_longest_cache_hit: the "
    "hit length is the fixed point over the groups' find_longest_cache_hit (full attention left "
    "to right, sliding window right to left needing cdiv(window - 1, block_size) contiguous "
    "blocks, chunked local null blocks before the chunk start of the candidate length then left "
    "to right), each looking up BlockHashWithGroupId of its own group; kv_cache_manager.py, "
    "get_computed_blocks; single_type_kv_cache_manager.py, add_local_computed_blocks.",
    ("schedule",),
    tags=("safety",),
    requires=_NEEDS,
)
def groups_prefix_hit_valid(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.after.config
    if not cfg.is_hybrid:
        return
    bs = cfg.block_size
    sw = skipping_groups(cfg)
    # (request, its tables, the hit, the computed tokens the hit's skipped
    # places follow: local and external, add_local_computed_blocks)
    taking: list[tuple[str, tuple[tuple[int, ...], ...], int, int]] = []
    for s in admitted(t.plan):
        hit = _hit_length(t, s)
        if hit:
            taking.append((s.request_id, tables(s), hit, s.num_computed_tokens))
    for load in t.plan.kv_loads:
        a = t.after.requests.get(load.request_id)
        if load.asynchronous and a is not None and load.start:
            taking.append((load.request_id, tables(a), load.start, load.end))
    if not taking:
        return
    others = {
        e.request_id: {
            x
            for tab in tables(e)
            for f in own_live_entries(e, t)
            for j, x in enumerate(tab)
            if f.num_computed_tokens < (j + 1) * bs <= f.num_computed_tokens + f.num_scheduled_tokens
        }
        for e in t.plan.scheduled
    }
    promoted = promoted_blocks(t)
    for rid, tabs, hit, total in taking:
        b = t.before.requests[rid]
        filled = {x for oid, xs in others.items() if oid != rid for x in xs} | promoted
        for g, table in enumerate(tabs):
            grp = cfg.groups[g] if g < len(cfg.groups) else None
            for i in range(min(hit // bs, len(table))):
                x = table[i]
                if x == NULL_BLOCK:
                    if g not in sw or grp is None:
                        yield rid, f"hit place {i} of full-attention group {g} is the null block"
                    elif i >= skipped_blocks(grp, total, bs):
                        yield rid, (
                            f"hit place {i} of {describe_group(grp, g)} is the null block, but with {total} "
                            f"computed tokens only {skipped_blocks(grp, total, bs)} blocks lie wholly before "
                            f"{attended_span(grp)}"
                        )
                    continue
                want = group_block_key(block_key(b, i, bs, t.after.config.num_hash_lookahead_tokens), g)
                if t.after.kv.block_keys.get(x) != want:
                    yield rid, f"hit block {x} (index {i}, group {g}) does not carry the group's key for the request"
                elif t.before.kv.block_keys.get(x) != want and x not in filled:
                    yield rid, (
                        f"hit block {x} (index {i}, group {g}) was not cached under the group's key before "
                        f"the step, nor filled by another request in it"
                    )


@transition_invariant(
    "sliding-window-frees",
    "A sliding-window or chunked-local group holds no block wholly before what the next token "
    "attends beyond what vLLM keeps: after a step, each scheduled request's table in such a group "
    "has nulls exactly for the blocks wholly before the window (or the chunk) of its processed "
    "tokens (its computed tokens before the step less those of steps in flight; for a fresh "
    "admission its hit with any loaded tokens, as for a request starting an asynchronous load), "
    "or for more only where an earlier step had freed them.",
    "vllm/v1/core/kv_cache_manager.py, allocate_slots: coordinator.remove_skipped_blocks(request, "
    "max(0, total_computed_tokens - num_in_flight_tokens)) before allocating (freeing on the "
    "processed-token basis, the lag vLLM keeps); single_type_kv_cache_manager.py, "
    "get_num_skipped_tokens of SlidingWindowManager and ChunkedLocalAttentionManager, "
    "add_local_computed_blocks pads a hit's skipped blocks (local + external) with nulls.",
    ("schedule",),
    tags=("policy:vllm-sliding-window",),
    requires=_NEEDS,
)
def sliding_window_frees(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.after.config
    sw = skipping_groups(cfg) - state_groups(cfg)  # Mamba: invariants/mamba.py
    if not sw:
        return
    bs = cfg.block_size
    checks: list[tuple[str, tuple[tuple[int, ...], ...], int, tuple[tuple[int, ...], ...]]] = []
    for s in t.plan.scheduled:
        b = t.before.requests.get(s.request_id)
        if b is None:
            continue
        fresh = s.kind != ScheduleKind.RUNNING and not b.num_computed_tokens
        processed = s.num_computed_tokens if fresh else max(0, s.num_computed_tokens - inflight_tokens(t, s.request_id))
        checks.append((s.request_id, tables(s), processed, tables(b)))
    for load in t.plan.kv_loads:
        a = t.after.requests.get(load.request_id)
        if load.asynchronous and a is not None:
            checks.append((load.request_id, tables(a), load.end, ()))
    for rid, tabs, processed, old in checks:
        for g in sorted(sw):
            if g >= len(tabs):
                continue
            grp = cfg.groups[g]
            table = tabs[g]
            before = _nulls(old[g]) if g < len(old) else 0
            want = max(before, min(len(table), skipped_blocks(grp, processed, bs)))
            k = _nulls(table)
            if k != want:
                yield rid, (
                    f"{describe_group(grp, g)} has {k} null places after the "
                    f"step; with {processed} processed tokens vLLM has freed {want}"
                )


@transition_invariant(
    "partial-entries-with-their-block",
    "A partial entry (whole hash units ending inside a block) sits on a block whose full key, of its "
    "group, covers it: it goes with that key.",
    "vllm/v1/core/single_type_kv_cache_manager.py, FullAttentionManager._cache_partial_tail_block; "
    "block_pool.py, cache_partial_block, _remove_cached_block_hashes.",
    tags=("safety",),
    requires=_NEEDS,
)
def partial_entries_with_their_block(t: Transition, h: History) -> Iterator[Finding]:
    v = t.after
    kv, bs, hb = v.kv, v.config.block_size, v.config.hash_block_size
    if kv.partial_index and not 0 < hb < bs:
        yield None, f"{len(kv.partial_index)} partial entries with a hash block size of {hb or bs}, not below {bs}"
        return
    for key, blocks in kv.partial_index.items():
        n = len(key[1])
        if n % bs == 0 or n % hb:
            yield None, f"a partial entry of {n} tokens: not inside a block of {bs}, or not whole units of {hb}"
            continue
        for b in blocks:
            full = kv.block_keys.get(b)
            if full is None:
                yield None, f"block {b} keeps the partial entry of {n} tokens without a full key: not removed with it"
            elif (block_key_group(full) != block_key_group(key) or len(full[1]) != (n // bs + 1) * bs
                  or full[1][:n] != key[1]):
                yield None, f"block {b} keeps the partial entry of {n} tokens beside the key of other content"
