"""Invariants of a single view: they hold of every state a scheduler can show,
whatever operation led to it."""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from schedspec.spec.interface import RequestStatus, RequestView, SchedulerView

from schedspec.spec.interface import group_block_key
from schedspec.spec.kv_kinds import kind_of

from schedspec.invariants._util import NULL_BLOCK, block_key, cdiv, defers_frees, holders, sliding_groups, tables
from schedspec.invariants.core import Finding, state_invariant

_QUEUED = (
    RequestStatus.WAITING,
    RequestStatus.PREEMPTED,
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RequestStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.WAITING_FOR_STREAMING_REQ,  # a session waiting for input (spec/sessions.py)
)
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS


@state_invariant(
    "queues-match-status",
    "Waiting holds exactly the WAITING/PREEMPTED requests (and those waiting for a grammar or for "
    "a KV connector load), "
    "running exactly the RUNNING ones; "
    "the queues are disjoint, without duplicates, and together hold every unfinished request.",
    "vllm/v1/core/sched/scheduler.py, Scheduler: add_request puts a request in self.waiting; "
    "schedule() moves it to self.running with status RUNNING; _preempt_request sets PREEMPTED and "
    "prepends it to waiting; finish_requests/_free_request remove it from both and from self.requests "
    "(a request in WAITING_FOR_REMOTE_KVS waits in kv_holding_waiting, which the view shows in the "
    "waiting queue).",
    tags=("safety",),
)
def queues_match_status(v: SchedulerView) -> Iterator[Finding]:
    for rid, r in v.requests.items():
        if r.request_id != rid:
            yield rid, f"requests[{rid!r}] is a view of {r.request_id!r}"
        if r.status.is_finished:
            yield rid, f"unfinished request has finished status {r.status.name}"
    for name, queue in (("waiting", v.waiting), ("running", v.running)):
        for rid, n in Counter(queue).items():
            if n > 1:
                yield rid, f"appears {n} times in the {name} queue"
    for rid in set(v.waiting) & set(v.running):
        yield rid, "is in both the waiting and the running queue"
    for rid in v.waiting:
        w = v.requests.get(rid)
        if w is None:
            yield rid, "is in the waiting queue but not an unfinished request"
        elif w.status not in _QUEUED:
            yield rid, f"is in the waiting queue with status {w.status.name}"
    for rid in v.running:
        u = v.requests.get(rid)
        if u is None:
            yield rid, "is in the running queue but not an unfinished request"
        elif u.status != RequestStatus.RUNNING:
            yield rid, f"is in the running queue with status {u.status.name}"
    for rid in sorted(set(v.requests) - set(v.waiting) - set(v.running)):
        yield rid, f"unfinished request (status {v.requests[rid].status.name}) is in no queue"
    for rid, r in v.finished.items():
        if not r.status.is_finished:
            yield rid, f"listed as finished with status {r.status.name}"
        if rid in v.requests:
            yield rid, "is both finished and unfinished"


@state_invariant(
    "max-num-seqs",
    "At most max_num_seqs requests are running (vLLM's reading; max-num-seqs-per-step is the safety part).",
    "vllm/v1/core/sched/scheduler.py, schedule(): the WAITING loop stops admitting once "
    "len(self.running) >= self.max_num_active_reqs (max_num_seqs).",
    tags=("policy:vllm-running-set",),
)
def max_num_seqs(v: SchedulerView) -> Iterator[Finding]:
    if len(v.running) > v.config.max_num_seqs:
        yield None, (
            f"{len(v.running)} requests running, max_num_seqs is {v.config.max_num_seqs}: "
            f"{', '.join(v.running)}"
        )


@state_invariant(
    "block-conservation",
    "Free blocks + held blocks + the null block = num_blocks: ref_cnt[b] is the number of "
    "unfinished requests holding b (in any KV cache group's table) plus the finished requests "
    "still holding it for the KV connector (kv_held_by_finished), the free queue is exactly the "
    "usable blocks with ref_cnt 0, each once, and no table holds a block twice or an id out of "
    "range, nor block 0 except in a sliding-window group's skipped places (with async scheduling "
    "and a KV connector, a block whose free is deferred may keep a greater ref_cnt, outside the "
    "free queue).",
    "vllm/v1/core/block_pool.py, BlockPool: get_new_blocks pops the free queue and sets "
    "ref_cnt 1, touch increments (and removes a free block from the queue), free_blocks decrements "
    "and requeues at 0; block 0 is the null block taken out in __init__ "
    "(single_type_kv_cache_manager.py, remove_skipped_blocks puts it in a sliding-window table); "
    "scheduler.py, _free_request keeps a request's blocks while the connector delays their free; "
    "with async scheduling and a connector, _free_request_blocks defers a free (deferred_frees): "
    "such blocks keep their ref_cnt outside the free queue, held by nobody.",
    tags=("safety",),
)
def block_conservation(v: SchedulerView) -> Iterator[Finding]:
    kv = v.kv
    n = kv.num_blocks
    if n != v.config.num_blocks or kv.block_size != v.config.block_size:
        yield None, (
            f"KV view has {n} blocks of {kv.block_size} tokens, config says "
            f"{v.config.num_blocks} of {v.config.block_size}"
        )
    if len(kv.ref_cnt) != n:
        yield None, f"ref_cnt has {len(kv.ref_cnt)} entries for {n} blocks"
        return
    if kv.ref_cnt[0] != 0:
        yield None, f"null block 0 has ref_cnt {kv.ref_cnt[0]}"
    sw = sliding_groups(v.config)
    count: Counter[int] = Counter()
    who: dict[int, list[str]] = {}
    for rid, r in v.requests.items():
        held: list[int] = []
        for g, table in enumerate(tables(r)):
            for b in table:
                if b == NULL_BLOCK and g in sw:
                    continue
                held.append(b)
        yield from _count_holder(rid, held, n, count, who)
    for rid, blocks in v.kv_held_by_finished.items():
        yield from _count_holder(rid, [b for b in blocks if b != NULL_BLOCK], n, count, who)
    # async scheduling with a KV connector defers the free of a request's
    # blocks while a step that scheduled it is in flight: they keep their
    # ref_cnt, held by nobody, outside the free queue, until a processed step
    # passes the fence (scheduler.py, _free_request_blocks, deferred_frees;
    # kv-quiescence requires them back once nothing is in flight)
    deferred = defers_frees(v.config)
    for b in range(1, n):
        if kv.ref_cnt[b] != count[b] and not (deferred and kv.ref_cnt[b] > count[b] and b not in kv.free_queue):
            yield None, (
                f"block {b} has ref_cnt {kv.ref_cnt[b]} but {count[b]} requests hold it"
                f" ({', '.join(sorted(who.get(b, []))) or 'none'})"
            )
    for b, k in Counter(kv.free_queue).items():
        if k > 1:
            yield None, f"block {b} is {k} times in the free queue"
        if not 1 <= b < n:
            yield None, f"free queue holds block {b}, outside the usable blocks 1..{n - 1}"
    free = set(kv.free_queue)
    for b in range(1, n):
        if count[b] == 0 and b not in free and not (deferred and kv.ref_cnt[b] > 0):
            yield None, f"block {b} is held by nobody and not in the free queue (leaked)"
        if count[b] > 0 and b in free:
            yield None, f"block {b} is in the free queue while held by {', '.join(sorted(who[b]))}"


def _count_holder(
    rid: str, held: list[int], n: int, count: Counter[int], who: dict[int, list[str]]
) -> Iterator[Finding]:
    for b, k in Counter(held).items():
        if k > 1:
            yield rid, f"holds block {b} {k} times"
        if not 1 <= b < n:
            yield rid, f"holds block {b}, outside the usable blocks 1..{n - 1}"
        else:
            count[b] += 1
            who.setdefault(b, []).append(rid)


@state_invariant(
    "block-table-covers-computed",
    "A running request holds at least cdiv(num_computed_tokens, block_size) blocks, so every "
    "computed token has a slot (after schedule() its computed count includes the tokens just "
    "scheduled); a preempted request holds none, and a waiting or preempted one has 0 computed "
    "tokens, except with "
    "a KV connector: a request whose load is in flight (WAITING_FOR_REMOTE_KVS) holds blocks "
    "covering its computed tokens, and one promoted from it keeps them while it waits (computed "
    "tokens > 0 exactly when it holds blocks, but a promoted one-token load keeps its block at 0 "
    "computed).",
    "vllm/v1/core/kv_cache_manager.py, allocate_slots: a request is given cdiv(computed + new, "
    "block_size) slots' worth of blocks before its tokens are scheduled; scheduler.py, "
    "_update_after_schedule advances num_computed_tokens by the scheduled tokens; "
    "_preempt_request frees all and resets to 0; schedule() allocates local + external tokens' "
    "blocks before WAITING_FOR_REMOTE_KVS, _update_waiting_for_remote_kv keeps them (or frees "
    "them when no valid token is left), _holds_kv_blocks.",
    tags=("safety",),
)
def block_table_covers_computed(v: SchedulerView) -> Iterator[Finding]:
    bs = v.config.block_size
    for rid, r in v.requests.items():
        want = cdiv(r.num_computed_tokens, bs)
        if r.status == RequestStatus.RUNNING or r.status == _REMOTE:
            if len(r.block_ids) < want:
                yield rid, (
                    f"{r.status.name} with {r.num_computed_tokens} computed tokens holds "
                    f"{len(r.block_ids)} blocks, needs at least cdiv({r.num_computed_tokens}, {bs}) = {want}"
                )
            if r.status == _REMOTE and not v.config.kv_connector:
                yield rid, "waits for a KV load, but the config has no KV connector"
        elif r.status in _QUEUED:
            if r.spec.resumable and r.status != RequestStatus.PREEMPTED:
                # a session that stopped keeps its blocks and computed tokens while it waits
                # (scheduler.py, _handle_stopped_request; spec/sessions.py)
                if len(r.block_ids) < want or (r.block_ids and not r.num_computed_tokens):
                    yield rid, (f"session {r.status.name} with {r.num_computed_tokens} computed tokens holds "
                                f"{len(r.block_ids)} blocks, needs {want} (none at 0 computed)")
                continue
            if v.config.kv_connector and r.status != RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
                if r.num_computed_tokens and len(r.block_ids) < want:
                    yield rid, (
                        f"{r.status.name} with {r.num_computed_tokens} computed tokens (a finished "
                        f"load) holds {len(r.block_ids)} blocks, needs at least {want}"
                    )
                if not r.num_computed_tokens and r.block_ids and not _promoted_one_token(v, r):
                    yield rid, f"{r.status.name} with 0 computed tokens holds blocks {list(r.block_ids)}"
                continue
            if r.block_ids and r.status != RequestStatus.WAITING:
                yield rid, f"{r.status.name} but holds blocks {list(r.block_ids)}"
            if r.num_computed_tokens != 0:
                yield rid, f"{r.status.name} with {r.num_computed_tokens} computed tokens (should be 0)"


def _promoted_one_token(v: SchedulerView, r: RequestView) -> bool:
    """A promoted load of a one-token prompt: _update_waiting_for_remote_kv
    sets num_computed_tokens = num_tokens - 1 = 0 and keeps the request's one
    block (per group) for the next lookup (the stateless connector offers the
    token again: allocate_slots loads it into the block held)."""
    return (
        r.status == RequestStatus.WAITING
        and r.num_tokens == 1
        and r.spec.kv_external_tokens >= 1
        and all(len(t) <= 1 for t in tables(r))
    )


@state_invariant(
    "waiting-holds-no-blocks",
    "A WAITING request holds no blocks (no KV connector): vLLM takes them at admission.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the WAITING loop's allocate_slots.",
    tags=("policy:vllm-allocation",),
)
def waiting_holds_no_blocks(v: SchedulerView) -> Iterator[Finding]:
    if v.config.kv_connector:
        return  # block-table-covers-computed says what a waiting request may hold for a load
    for rid, r in v.requests.items():
        if r.status == RequestStatus.WAITING and r.block_ids and not r.spec.resumable:
            # (a session that went on keeps its blocks: block-table-covers-computed)
            yield rid, f"WAITING but holds blocks {list(r.block_ids)}"


@state_invariant(
    "block-table-exact",
    "A running request holds exactly cdiv(num_computed_tokens, block_size) blocks: vLLM "
    "allocates a block only for tokens it schedules, never ahead.",
    "vllm/v1/core/single_type_kv_cache_manager.py, get_num_blocks_to_allocate / "
    "allocate_new_blocks: the table grows to cdiv(num_computed_tokens + num_new_tokens, "
    "block_size) blocks (no lookahead without speculative decoding); a request with a KV "
    "connector load keeps the table of its load after a failure truncates its computed tokens, "
    "and under \"recompute\" so does a request that shared an invalid block another holder "
    "recomputes (scheduler.py, _update_requests_with_invalid_blocks): only the lower bound holds.",
    tags=("policy:vllm-allocation",),
)
def block_table_exact(v: SchedulerView) -> Iterator[Finding]:
    bs = v.config.block_size
    # Speculative decoding: rejected drafts roll num_computed_tokens back but
    # keep their blocks, by up to k per step still counted (one per plan in
    # flight, max_concurrent_batches: scheduler.py, update_from_output, num_rejected),
    # past the draft model's lookahead slots (allocate_slots' num_lookahead_tokens).
    k = v.config.num_speculative_tokens
    slack = k * v.config.max_concurrent_batches + v.config.num_lookahead_tokens
    for rid, r in v.requests.items():
        if r.status == RequestStatus.RUNNING:
            want = cdiv(r.num_computed_tokens, bs)
            most = cdiv(min(r.num_computed_tokens + slack, v.config.max_model_len), bs)
            if v.config.kv_connector and (r.spec.kv_external_tokens or v.config.kv_load_failure_policy == "recompute"):
                # a failed load truncates the computed tokens at its first
                # invalid block and keeps the table (scheduler.py,
                # _update_requests_with_invalid_blocks); under "recompute" a
                # request sharing an invalid block that another holder
                # recomputes goes back to what it had before the step, its
                # table kept
                most = len(r.block_ids)
            if not want <= len(r.block_ids) <= max(most, want):
                yield rid, (
                    f"running with {r.num_computed_tokens} computed tokens holds "
                    f"{len(r.block_ids)} blocks, vLLM holds cdiv({r.num_computed_tokens}, {bs}) = {want}"
                )


@state_invariant(
    "shared-blocks-identical-prefix",
    "Two requests share a block only at the same index i, with equal salt and equal tokens "
    "[:(i+1)*block_size], and the block is full and computed for both.",
    "vllm/v1/core/kv_cache_manager.py, get_computed_blocks / allocate_slots: a block is shared "
    "only through a prefix-cache hit on the chained hash of its salt and full-block tokens "
    "(kv_cache_utils.py, hash_block_tokens); only full blocks are cached (block_pool.py, "
    "cache_full_blocks).",
    tags=("safety",),
)
def shared_blocks_identical_prefix(v: SchedulerView) -> Iterator[Finding]:
    bs = v.config.block_size
    for b, hs in sorted(holders(v).items()):
        if len(hs) < 2:
            continue
        rid0, i0 = hs[0]
        r0 = v.requests[rid0]
        for rid, i in hs:
            r = v.requests[rid]
            if i != i0:
                yield rid, f"holds block {b} at index {i}, {rid0} holds it at index {i0}"
                continue
            if r.num_computed_tokens < (i + 1) * bs and not _kept_after_failed_load(v, r):
                yield rid, (
                    f"shares block {b} (index {i}) but has only {r.num_computed_tokens} computed "
                    f"tokens: the block is not full ({(i + 1) * bs} needed)"
                )
            la = v.config.num_hash_lookahead_tokens
            if rid != rid0 and block_key(r, i, bs, la) != block_key(r0, i0, bs, la):
                yield rid, (
                    f"shares block {b} (index {i}) with {rid0} but their salt or tokens "
                    f"[:{(i + 1) * bs}] differ"
                )


@state_invariant(
    "cache-index-consistent",
    "block_keys and cache_index describe the same (key, block) pairs; each key is (salt, tokens) "
    "with a non-empty whole number of blocks of tokens (plus EAGLE's lookahead); blocks are usable ids, "
    "listed once per key.",
    "vllm/v1/core/block_pool.py, BlockHashToBlockMap and KVCacheBlock.block_hash: "
    "_insert_block_hash / _maybe_evict_cached_block keep the block's hash and the hash -> blocks "
    "map in step.",
    tags=("safety",),
)
def cache_index_consistent(v: SchedulerView) -> Iterator[Finding]:
    kv = v.kv
    bs, la = v.config.block_size, v.config.num_hash_lookahead_tokens
    for b, key in kv.block_keys.items():
        if not 1 <= b < kv.num_blocks:
            yield None, f"block_keys names block {b}, outside 1..{kv.num_blocks - 1}"
        salt, toks = key
        if not isinstance(salt, str) or len(toks) <= la or (len(toks) - la) % bs != 0:
            yield None, (
                f"block {b} has a malformed key: salt {salt!r}, {len(toks)} tokens "
                f"(want a positive multiple of {bs}" + (f" plus {la})" if la else ")")
            )
        if b not in kv.cache_index.get(key, ()):
            yield None, f"block {b} has a key that cache_index does not list it under"
    for key, blocks in kv.cache_index.items():
        if not blocks:
            yield None, f"cache_index has an empty entry for a key of {len(key[1])} tokens"
        for b, k in Counter(blocks).items():
            if k > 1:
                yield None, f"cache_index lists block {b} {k} times under one key"
            if kv.block_keys.get(b) != key:
                yield None, (
                    f"cache_index lists block {b} under a key of {len(key[1])} tokens, "
                    f"but block_keys gives it {'no key' if b not in kv.block_keys else 'another key'}"
                )


@state_invariant(
    "cached-block-content",
    "A held block that carries a key carries the key of its content: for every holder r at "
    "index i of group g's table, key = group_block_key((r.salt, r.tokens[:(i+1)*block_size+lookahead]), g), "
    "and the block is full of computed tokens.",
    "vllm/v1/core/block_pool.py, cache_full_blocks: a block gets the hash of the request's "
    "block_hashes[i] only once its tokens are all scheduled (kv_cache_manager.py, allocate_slots, "
    "num_tokens_to_cache); get_new_blocks evicts the old hash before a block is reused; "
    "kv_cache_utils.py, make_block_hash_with_group_id keys each group's blocks apart. A failed KV "
    "load under \"recompute\" leaves keyed blocks past the truncated computed tokens of its request "
    "and of a request that shared an invalid block "
    "(scheduler.py, _handle_invalid_blocks evicts only under \"fail\"); a promoted load that covered "
    "every token keeps its last block cached at num_tokens - 1 computed (_update_waiting_for_remote_kv).",
    tags=("safety",),
)
def cached_block_content(v: SchedulerView) -> Iterator[Finding]:
    bs, la = v.config.block_size, v.config.num_hash_lookahead_tokens
    for rid, r in v.requests.items():
        for g, table in enumerate(tables(r)):
            for i, b in enumerate(table):
                key = v.kv.block_keys.get(b) if b != NULL_BLOCK else None
                if key is None:
                    continue
                where = f"block {b} (index {i}{f', group {g}' if g else ''})"
                if key != group_block_key(block_key(r, i, bs, la), g):
                    yield rid, (
                        f"{where} is keyed by a salt/tokens prefix of {len(key[1])} tokens "
                        f"that differs from the request's own (salt {r.salt!r}, tokens [:{(i + 1) * bs}]"
                        f"{f', group {g}' if g else ''})"
                    )
                elif (
                    r.num_computed_tokens < (i + 1) * bs
                    and not _kept_after_failed_load(v, r)
                    and not _promoted_full_load(v, r, i)
                ):
                    yield rid, (
                        f"{where} carries a key but only {r.num_computed_tokens} tokens "
                        f"are computed ({(i + 1) * bs} fill it)"
                    )


def _kept_after_failed_load(v: SchedulerView, r: RequestView) -> bool:
    """Whether ``r`` may hold keyed blocks beyond its computed tokens because
    a failed KV load truncated them under the "recompute" policy, which
    leaves the blocks cached for the recompute to refill (scheduler.py,
    _handle_invalid_blocks evicts only under "fail"): its own load, or an
    invalid block it shared with the request that recomputes it, after
    which vLLM puts its computed tokens back to what they were before the
    step and keeps the blocks that step keyed
    (_update_requests_with_invalid_blocks, marked_invalid_block_ids)."""
    return v.config.kv_connector and v.config.kv_load_failure_policy == "recompute"


def _promoted_full_load(v: SchedulerView, r: RequestView, i: int) -> bool:
    """Whether block ``i`` of ``r`` is the last block of a promoted load that
    covered every token: _update_waiting_for_remote_kv caches the loaded
    blocks (cache_blocks(request, num_computed_tokens)) and then sets
    num_computed_tokens = num_tokens - 1, so until the request is admitted its
    last cached block holds one token more than it counts computed."""
    return (
        v.config.kv_connector
        and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        and r.spec.kv_external_tokens > 0
        and r.num_computed_tokens == r.num_tokens - 1
        and (i + 1) * v.config.block_size <= r.num_tokens
    )


@state_invariant(
    "full-blocks-cached",
    "With prefix caching on, every full computed block of a running request carries a key in "
    "every full-attention group and every block a chunked-local group still holds; with it off, "
    "no block does.",
    "vllm/v1/core/kv_cache_manager.py, allocate_slots: cache_blocks(request, min(computed + new, "
    "num_tokens)) hashes every block that becomes full (EAGLE: and its next token known; single_type_kv_cache_manager.py, "
    "cache_blocks; a chunked-local group keeps the base reachable_block_mask: every full block); "
    "with enable_caching False nothing is cached. A sliding-window group caches "
    "only the blocks a hit can reach (SlidingWindowManager.reachable_block_mask), which this "
    "invariant leaves to the lockstep comparison.",
    tags=("policy:vllm-caching",),
)
def full_blocks_cached(v: SchedulerView) -> Iterator[Finding]:
    bs = v.config.block_size
    if not v.config.enable_prefix_caching:
        if v.kv.block_keys or v.kv.cache_index or v.kv.partial_index:
            yield None, (
                f"prefix caching is off but {len(v.kv.block_keys)} blocks carry keys and "
                f"cache_index has {len(v.kv.cache_index)} keys"
            )
        return
    sw = {g for g, grp in enumerate(v.config.groups) if not kind_of(grp).caches_every_block}
    for rid in v.running:
        r = v.requests.get(rid)
        if r is None:
            continue
        # only known tokens are cached: not in-flight placeholders or drafts
        # (kv_cache_manager.py, allocate_slots caps at request.num_tokens;
        # update_from_output caches num_computed_tokens - num_in_flight_tokens)
        # and with EAGLE's hash lookahead L a block waits for the L tokens after
        # it (kv_cache_utils.py, get_request_block_hasher)
        known = min(r.num_computed_tokens - r.num_output_placeholders, r.num_tokens - v.config.num_hash_lookahead_tokens)
        for g, table in enumerate(tables(r)):
            if g in sw:
                continue  # a sliding window caches only the blocks a hit can reach
            for i in range(min(known // bs, len(table))):
                # a chunked-local group caches every full block (the base
                # reachable_block_mask) but frees those before the chunk
                if table[i] not in v.kv.block_keys and table[i] != NULL_BLOCK:
                    yield rid, (
                        f"block {table[i]} (index {i}{f', group {g}' if g else ''}) is full "
                        f"({r.num_computed_tokens} computed tokens) but carries no key"
                    )


@state_invariant(
    "quiescence",
    "With no unfinished request, the queues are empty, and every block is free (ref_cnt 0, all "
    "num_blocks - 1 usable blocks in the free queue) except those a finished request still holds "
    "for the KV connector (kv_held_by_finished); with async scheduling and a connector, "
    "kv-quiescence says it once no step is in flight.",
    "vllm/v1/core/sched/scheduler.py, _free_request -> kv_cache_manager.free: a finished or "
    "aborted request returns every block; only unfinished requests hold KV, and finished ones "
    "whose connector delays the free (_free_request delay_free_blocks, until _free_blocks).",
    tags=("safety",),
)
def quiescence(v: SchedulerView) -> Iterator[Finding]:
    if v.requests:
        return
    if v.waiting or v.running:
        yield None, f"no unfinished request, yet waiting={list(v.waiting)} running={list(v.running)}"
    kept = {b for blocks in v.kv_held_by_finished.values() for b in blocks}
    if defers_frees(v.config):
        return  # a deferred free may wait for the step in flight (kv-quiescence)
    held = [b for b, c in enumerate(v.kv.ref_cnt) if c != 0 and b not in kept]
    if held:
        yield None, f"no unfinished request, yet blocks {held} have non-zero ref_cnt"
    usable = v.kv.num_blocks - 1
    free = set(v.kv.free_queue) - {0}
    if len(free) + len(kept - {0}) != usable:
        yield None, (
            f"no unfinished request, yet {len(free)} of {usable} usable blocks are free"
            + (f" and {len(kept - {0})} held by finished requests" if kept else "")
        )
