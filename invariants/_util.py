"""Small helpers the checkers share. They read views only; of the spec they
import the plain types (spec.interface) and the KV group kinds' rules
(spec/kv_kinds.py), never the scheduler's logic."""

from __future__ import annotations

from typing import Any, Mapping

from schedspec.spec.interface import (
    BlockKey,
    KVCacheGroup,
    KVLoad,
    Policy,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
)

from schedspec.spec.kv_kinds import kind_of

from schedspec.invariants.transition import Transition


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_key(r: RequestView, index: int, block_size: int, lookahead: int = 0) -> BlockKey:
    """The content key block ``index`` of ``r`` must carry once it is full:
    its identity (cache salt, LoRA adapter, encoder inputs started before the
    block's end; RequestView.block_identity) and its token prefix, both
    reaching ``lookahead`` tokens past the block with EAGLE's hash lookahead
    (SchedulerConfig.num_hash_lookahead_tokens; kv_cache_utils.py,
    get_request_block_hasher)."""
    end = (index + 1) * block_size + lookahead
    return (r.block_identity(end), r.all_token_ids[:end])


def queue_key(r: RequestView) -> tuple[int, int, str]:
    """PRIORITY waiting-queue order (vllm/v1/request.py, Request.__lt__)."""
    return (r.spec.priority, r.spec.arrival, r.request_id)


def victim_key(r: RequestView) -> tuple[int, int]:
    """PRIORITY preemption order: the running request with the greatest key
    is preempted first (scheduler.py, schedule())."""
    return (r.spec.priority, r.spec.arrival)


def lookup(view: SchedulerView, rid: str) -> RequestView | None:
    """The request, live or finished since the last plan."""
    r = view.requests.get(rid)
    return r if r is not None else view.finished.get(rid)


def status_of(view: SchedulerView, rid: str) -> RequestStatus | None:
    r = lookup(view, rid)
    return None if r is None else r.status


def admitted(plan: StepPlan) -> list[ScheduledRequest]:
    """Entries taken from the waiting queue this step, in admission order."""
    return [s for s in plan.scheduled if s.kind in (ScheduleKind.NEW, ScheduleKind.RESUMED)]


def step_victims(t: Transition) -> list[str]:
    """Requests preempted by this schedule() call. A plan's preempted_ids
    also carries the requests that reset_prefix_cache(reset_running_requests
    =True) preempted since the previous plan (``before.preempted_since_plan``);
    those are not this step's victims."""
    if t.plan is None:
        return []
    earlier = set(t.before.preempted_since_plan)
    return [rid for rid in t.plan.preempted_ids if rid not in earlier]


def holders(view: SchedulerView) -> dict[int, list[tuple[str, int]]]:
    """block id -> [(request id, index in its table)] over live requests, in
    every KV cache group's table (the null block 0 of a sliding-window or
    chunked-local group's skipped places left out)."""
    out: dict[int, list[tuple[str, int]]] = {}
    for rid, r in view.requests.items():
        for table in tables(r):
            for i, b in enumerate(table):
                if b != NULL_BLOCK:
                    out.setdefault(b, []).append((rid, i))
    return out


#: vLLM's null block (block_pool.py, BlockPool.__init__: block 0 is taken out
#: of the free queue); a sliding-window or chunked-local group's table holds it
#: in the places of the blocks it freed or a hit skipped
#: (single_type_kv_cache_manager.py, remove_skipped_blocks,
#: add_local_computed_blocks).
NULL_BLOCK = 0


def tables(r: RequestView | ScheduledRequest) -> tuple[tuple[int, ...], ...]:
    """Every KV cache group's block table of ``r`` in group order: its
    ``group_block_ids`` for a hybrid layout, else its one table."""
    return r.group_block_ids if r.group_block_ids else (r.block_ids,)


def skipping_groups(config: SchedulerConfig) -> frozenset[int]:
    """The indexes of the groups among ``config.groups`` whose tables free
    the blocks no later token attends into the null block (their kind
    skips: SlidingWindowManager, ChunkedLocalAttentionManager, whose
    get_num_skipped_tokens is not 0; spec/kv_kinds.py)."""
    return frozenset(g for g, grp in enumerate(config.groups) if kind_of(grp).skips)


def state_groups(config: SchedulerConfig) -> frozenset[int]:
    """The indexes of the groups that keep one recurrent state per request
    (MambaManager in "align" mode, spec/kv_kinds.py ``keeps_state``): their
    null places are not a prefix (the state block of each step stands after
    null padding), so the window invariants leave them to invariants/mamba.py."""
    return frozenset(g for g, grp in enumerate(config.groups) if kind_of(grp).keeps_state)


#: The older name, kept for the invariants written when sliding window was
#: the only kind that frees: every use means "a group that may hold the null
#: block and frees before it allocates", which chunked local is too.
sliding_groups = skipping_groups


def skipped_tokens(group: KVCacheGroup, tokens: int) -> int:
    """The leading tokens that the token after ``tokens`` computed ones does
    not attend, by the group's kind (spec/kv_kinds.py, num_skipped_tokens): a
    window of W reads the W - 1 before it
    (SlidingWindowManager.get_num_skipped_tokens: max(0, tokens - W + 1)); a
    chunk of C reads only its own chunk's earlier positions
    (ChunkedLocalAttentionManager.get_num_skipped_tokens: (tokens // C) * C);
    full attention reads every one."""
    return kind_of(group).num_skipped_tokens(group, tokens)


def skipped_blocks(group: KVCacheGroup, tokens: int, block_size: int) -> int:
    """The whole blocks among ``skipped_tokens``: the places a table may (and
    vLLM does) hold the null block after ``tokens`` processed tokens."""
    return skipped_tokens(group, tokens) // block_size


def describe_group(group: KVCacheGroup, g: int) -> str:
    """How a finding names group ``g``: "sliding-window group 1 (window 4)",
    "chunked-local group 1 (chunk 8)", "full-attention group 0"."""
    kind = kind_of(group)
    params = kind.describe(group)
    return f"{kind.label} group {g}" + (f" ({params})" if params else "")


def attended_span(group: KVCacheGroup) -> str:
    """What a skipping group's next token reads: "the window" or "its chunk"."""
    return kind_of(group).attended


def defers_frees(config: SchedulerConfig) -> bool:
    """Whether vLLM defers block frees behind the steps in flight: several
    batches in flight (async scheduling or a pipeline: max_concurrent_batches
    > 1) with a KV connector (kv_both is a consumer: scheduler.py,
    __init__, defer_block_free)."""
    return config.kv_connector and config.max_concurrent_batches > 1


def held_blocks(r: RequestView | ScheduledRequest) -> list[int]:
    """The blocks ``r`` holds in every group (null places left out), in
    group order, each table in table order."""
    return [b for table in tables(r) for b in table if b != NULL_BLOCK]


def table_extends(old: tuple[int, ...], new: tuple[int, ...], sliding: bool) -> bool:
    """Whether ``new`` keeps ``old`` and appends: each old place holds the
    same block, or, in a sliding-window or chunked-local group (``sliding``),
    the null block that replaced a block freed outside the window or chunk."""
    if len(new) < len(old):
        return False
    return all(n == o or (sliding and n == NULL_BLOCK) for o, n in zip(old, new))


def tables_extend(
    config: SchedulerConfig, old: RequestView | ScheduledRequest, new: RequestView | ScheduledRequest
) -> bool:
    """table_extends for every group's table of a request."""
    sw = skipping_groups(config)
    a, b = tables(old), tables(new)
    if len(a) != len(b):
        return not old.block_ids and is_prefix(old.block_ids, new.block_ids)
    return all(table_extends(x, y, g in sw) for g, (x, y) in enumerate(zip(a, b)))


def effective_threshold(before: SchedulerView) -> int:
    """The long-prefill threshold in force for the step that starts from
    ``before``: none while at most one request is running or waiting
    (scheduler.py, schedule(), ``num_eligible_reqs > 1``)."""
    threshold = before.config.long_prefill_token_threshold
    eligible = len(before.running) + len(before.waiting)
    return threshold if eligible > 1 else 0


def queue_head(view: SchedulerView) -> str | None:
    """The request the waiting loop looks at next: FCFS the front of the
    queue, PRIORITY the least (priority, arrival, request_id)."""
    live = [rid for rid in view.waiting if rid in view.requests]
    if not live:
        return None
    if view.config.policy == Policy.FCFS:
        return live[0]
    return min(live, key=lambda rid: queue_key(view.requests[rid]))


def waiting_order(view: SchedulerView) -> list[str]:
    """The waiting queue in the order the WAITING loop visits it."""
    live = [rid for rid in view.waiting if rid in view.requests]
    if view.config.policy != Policy.FCFS:
        # with a KV connector, kv_holding_waiting then waiting: two heaps
        held = set(kv_holding_prefix(view)) if view.config.kv_connector else set()
        live.sort(key=lambda rid: (rid not in held, queue_key(view.requests[rid])))
    return live


def admission_candidate(view: SchedulerView) -> str | None:
    """The first request in waiting-queue service order that the WAITING
    loop would not pass over for an admission gate it can see: one still
    waiting for its grammar (_handle_blocked_waiting_request) or whose
    adapter would exceed max_loras distinct adapters among the running
    requests (the max_loras check) is passed over (skip_request)."""
    live = waiting_order(view)
    loras = {view.requests[rid].spec.lora_id for rid in view.running if rid in view.requests} - {0}
    for rid in live:
        r = view.requests[rid]
        if r.status in (RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, RequestStatus.WAITING_FOR_STREAMING_REQ):
            continue  # (a session waiting for input: _handle_blocked_waiting_request)
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in view.kv_loads_done:
            continue  # its load is in flight (_handle_blocked_waiting_request)
        m = view.config.max_loras
        if m and r.spec.lora_id and len(loras) >= m and r.spec.lora_id not in loras:
            continue
        return rid
    return None


def prefix_hit(view: SchedulerView, r: RequestView) -> list[int]:
    """The blocks a prefix-cache lookup for ``r`` returns in ``view``: the
    longest run of full blocks from the start whose key is cached (first
    block registered under each key), at most ``num_tokens - 1`` tokens
    (kv_cache_manager.py, get_computed_blocks; FullAttentionManager.
    find_longest_cache_hit)."""
    if not view.config.enable_prefix_caching:
        return []
    # with hash lookahead L only the hashed blocks hit: num_tokens - L tokens
    bs, lookahead = view.config.block_size, view.config.num_hash_lookahead_tokens
    hit: list[int] = []
    for i in range((r.num_tokens - max(1, lookahead)) // bs):
        blocks = view.kv.cache_index.get(block_key(r, i, bs, lookahead), ())
        if not blocks:
            break
        hit.append(blocks[0])
    return hit


def admission_fits(view: SchedulerView, r: RequestView, budget: int, threshold: int) -> str | None:
    """If the waiting loop, at ``view`` with ``budget`` tokens left, would
    admit ``r``: None if not, else a sentence saying why it fits
    (scheduler.py, schedule(), the WAITING loop; kv_cache_manager.py,
    allocate_slots with full_sequence_must_fit; single_type_kv_cache_manager.py,
    get_num_blocks_to_allocate). ``budget`` must be positive."""
    cfg = view.config
    bs = cfg.block_size
    hit = prefix_hit(view, r)
    hit_tokens = len(hit) * bs
    n = r.num_tokens - hit_tokens
    k = cfg.num_speculative_tokens
    if k > 0 and n == 1 and hit_tokens + 1 + k + 1 <= cfg.max_model_len:
        # the admission may be padded to 1 + k tokens (scheduler.py, the WAITING
        # loop, pad_spec_decode), and then must fit as such or stop the loop
        if 1 + k > budget:
            return None
        n = 1 + k
    if 0 < threshold < n:
        n = threshold
    if not cfg.enable_chunked_prefill and n > budget:
        return None
    n = min(n, budget)
    evictable = sum(1 for b in hit if 0 <= b < len(view.kv.ref_cnt) and view.kv.ref_cnt[b] == 0)
    # the watermark stays free when some request runs (allocate_slots, has_scheduled_reqs)
    free = len(view.kv.free_queue) - (cfg.watermark_blocks if view.running else 0)

    def needed(target_tokens: int) -> int:
        return max(cdiv(target_tokens, bs) - len(hit), 0) + evictable

    if cfg.scheduler_reserve_full_isl and needed(min(r.num_tokens, cfg.max_model_len)) > free:
        return None
    # with the drafter's lookahead slots (allocate_slots' num_lookahead_tokens)
    need = needed(min(hit_tokens + n + cfg.num_lookahead_tokens, cfg.max_model_len))
    if need > free:
        return None
    whole = needed(min(r.num_tokens, cfg.max_model_len))
    return (
        f"{r.num_tokens} tokens, {hit_tokens} of them cached; {n} tokens fit the "
        f"{budget} left in the budget; the whole sequence needs {whole} free blocks and "
        f"{free} are free"
    )


def running_chunk(r: RequestView, budget: int, threshold: int, max_model_len: int) -> int:
    """Tokens a running request is given when the RUNNING loop reaches it with
    ``budget`` tokens left (scheduler.py, schedule()): its known tokens, drafts
    and in-flight placeholders past the computed ones (``num_tokens_with_spec
    + num_output_placeholders - num_computed_tokens``); 0 when async
    scheduling's steps in flight surely bring it to max_tokens."""
    p = r.num_output_placeholders
    if p > 0 and r.num_computed_tokens + 2 - p >= len(r.spec.prompt_token_ids) + r.spec.max_tokens:
        return 0
    n = r.num_tokens + len(r.spec_token_ids) + p - r.num_computed_tokens
    if 0 < threshold < n:
        n = threshold
    n = min(n, budget, max_model_len - r.num_computed_tokens - 1)
    return max(n, 0)


def is_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> bool:
    return len(a) <= len(b) and tuple(b[: len(a)]) == tuple(a)


def inflight_tokens(t: Transition, rid: str) -> int:
    """The tokens of ``rid`` scheduled by plans still awaiting update() when
    the schedule() call ``t`` started (vLLM's Request.num_in_flight_tokens:
    stale shares from before a preemption included)."""
    plans = [p for p in t.in_flight if p is not t.plan]
    return sum(e.num_scheduled_tokens for p in plans for e in p.scheduled if e.request_id == rid)


def kv_load_failed(t: Transition) -> dict[str, int | None]:
    """For an update whose result reports failed loads: the requests vLLM
    treats as affected (and skips in its output loop), each with the index of
    its first invalid block within the tokens it had computed before this
    step, or None for a whole load named in failed_recving of a request
    waiting for it (scheduler.py, update_from_output: _handle_failed_recving,
    _handle_invalid_blocks over kv_holding_waiting's loading requests and the
    running ones, _update_requests_with_invalid_blocks)."""
    res = t.result
    if t.kind != "update" or res is None or not t.before.config.kv_connector:
        return {}
    if not (res.failed_recving or res.invalid_block_ids):
        return {}
    out: dict[str, int | None] = {}
    for rid, b in t.before.requests.items():
        if b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid in res.failed_recving:
            out[rid] = None
    for rid, (first, _) in invalid_block_walk(t).items():
        out.setdefault(rid, first)
    return out


def invalid_block_walk(t: Transition) -> dict[str, tuple[int, bool]]:
    """For an update whose result names invalid blocks: vLLM's walk
    (scheduler.py, _handle_invalid_blocks calls
    _update_requests_with_invalid_blocks on the loading requests of
    kv_holding_waiting, then on self.running, each call with its own
    marked_invalid_block_ids): request id -> (the index of the first invalid
    block within the tokens it had computed before the step that no request
    before it in the walk marked, or of its first invalid block when every
    one was marked; whether every one was marked). A request truncates its
    computed tokens at that first unmarked block; when every invalid block it
    holds is marked, another request recomputes them and it keeps what it had
    computed before the step."""
    res = t.result
    if t.kind != "update" or res is None or not res.invalid_block_ids:
        return {}
    bs = t.before.config.block_size
    bad = set(res.invalid_block_ids)
    scheduled = {e.request_id: e.num_scheduled_tokens for e in t.plan.scheduled} if t.plan is not None else {}
    view = t.before
    loading = [r for r in view.waiting if r in view.requests and view.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS]
    running = [r for r in view.running if r in view.requests and view.requests[r].status == RequestStatus.RUNNING]
    out: dict[str, tuple[int, bool]] = {}
    for walk in (loading, running):
        marked: set[int] = set()
        for rid in walk:
            b = view.requests[rid]
            c = b.num_computed_tokens - scheduled.get(rid, 0)
            found = [(i, x) for i, x in enumerate(b.block_ids[: cdiv(c, bs)]) if x in bad]
            if not found:
                continue
            fresh = [i for i, x in found if x not in marked]
            marked.update(x for _, x in found)
            out[rid] = (fresh[0], False) if fresh else (found[0][0], True)
    return out


def reported_invalid(t: Transition, loads: Mapping[str, KVLoad]) -> dict[int, int]:
    """For an update: invalid block -> its index in the tables of the requests
    that held it before the update. The blocks a result names in
    invalid_block_ids with every block after them in an affected request's
    table (their KV was computed from the invalid one: vLLM evicts
    ``req_block_ids[idx:]`` under "fail"), and the loaded blocks of each
    request waiting for a load that the result names in failed_recving
    (``loads``: the last load a plan started per request)."""
    failed = kv_load_failed(t)
    if not failed:
        return {}
    bs = t.before.config.block_size
    # a request whose invalid blocks another one recomputes keeps its blocks
    # computed (the recomputing request's table names them)
    shared = {rid for rid, (_, all_marked) in invalid_block_walk(t).items() if all_marked}
    out: dict[int, int] = {}
    for rid, first in failed.items():
        if rid in shared:
            continue
        r = t.before.requests[rid]
        if first is None:
            load = loads.get(rid)
            first = load.start // bs if load is not None and load.request_id == rid else 0
        for i in range(first, len(r.block_ids)):
            if r.block_ids[i] != NULL_BLOCK:
                out.setdefault(r.block_ids[i], i)
    return out


def next_invalid_blocks(t: Transition, h: Any) -> dict[int, tuple[int, frozenset[str]]]:
    """The invalid blocks awaiting recomputation after ``t``, from those
    before it (``h.invalid_blocks``): the blocks ``t`` reports invalid are
    added (with the requests vLLM lets keep counting one computed: under
    "recompute", while another holder truncated its computed tokens to the
    block's start, scheduler.py, _update_requests_with_invalid_blocks,
    marked_invalid_block_ids); a block leaves once a plan rewrites it (an
    entry computes from at or before its start through it: the recompute has
    begun; or a load fills it), or once nobody holds it and it carries no key
    (it can only be handed out fresh)."""
    cfg = t.after.config
    bs = cfg.block_size
    pending: dict[int, tuple[int, frozenset[str]]] = dict(h.invalid_blocks)
    for b, i in reported_invalid(t, h.loads).items():
        counting = set()
        recomputing = False
        for rid, r in t.after.requests.items():
            if i < len(r.block_ids) and r.block_ids[i] == b:
                if r.num_computed_tokens > i * bs:
                    counting.add(rid)
                else:
                    recomputing = True
        excused = frozenset(counting) if recomputing and cfg.kv_load_failure_policy == "recompute" else frozenset()
        pending[b] = (i, excused | pending.get(b, (i, frozenset()))[1])
    if not pending:
        return pending
    where = holders(t.after)
    held_by_finished = {b for blocks in t.after.kv_held_by_finished.values() for b in blocks}
    rewritten: set[int] = set()
    if t.kind == "schedule" and t.plan is not None:
        for e in t.plan.scheduled:
            c, n = e.num_computed_tokens, e.num_scheduled_tokens
            rewritten.update(x for j, x in enumerate(e.block_ids) if c <= j * bs < c + n)
        for load in t.plan.kv_loads:
            rewritten.update(x for j, x in enumerate(load.block_ids) if load.start <= j * bs < load.end)
    for b in list(pending):
        if b in rewritten:
            del pending[b]
        elif b not in where and b not in held_by_finished and b not in t.after.kv.block_keys:
            del pending[b]
        elif pending[b][1] and not _owes_recompute(t.after, b, pending[b][0], pending[b][1]):
            # the holder that was to recompute it is gone (aborted, preempted)
            # or counts it computed itself: the excuse lapses (a vLLM 0.33
            # defect, docs/divergences.md)
            pending[b] = (pending[b][0], frozenset())
    return pending


def _owes_recompute(v: SchedulerView, b: int, i: int, excused: frozenset[str]) -> bool:
    """Whether some unexcused request still holds block ``b`` at index ``i``
    without counting it computed, so its next step recomputes it: the
    premise on which vLLM lets the other holders count it computed
    (scheduler.py, _update_requests_with_invalid_blocks,
    marked_invalid_block_ids)."""
    bs = v.config.block_size
    return any(
        rid not in excused and i < len(r.block_ids) and r.block_ids[i] == b and r.num_computed_tokens <= i * bs
        for rid, r in v.requests.items()
    )


def holds_kv_blocks(view: SchedulerView, rid: str) -> bool:
    """vLLM's Scheduler._holds_kv_blocks for a waiting request: it is loading
    (WAITING_FOR_REMOTE_KVS) or has computed tokens (a promoted load). Such a
    request is queued in kv_holding_waiting, which the waiting loop drains
    before self.waiting (scheduler.py, _enqueue_waiting_request, skip_request)."""
    r = view.requests.get(rid)
    return r is not None and (
        r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or r.num_computed_tokens > 0
    )


def kv_holding_prefix(view: SchedulerView, h: Any = None) -> list[str]:
    """The part of ``view.waiting`` that is kv_holding_waiting (listed
    first): up to its last request holding KV blocks or, given the history,
    promoted from an asynchronous load (WAITING after a load a plan started:
    one whose load failed keeps no block, but stays in kv_holding_waiting
    until the WAITING loop admits or skips it). A request so promoted and
    then skipped into waiting is counted here too."""
    w = list(view.waiting)

    def held(rid: str) -> bool:
        if holds_kv_blocks(view, rid):
            return True
        r = view.requests.get(rid)
        load = h.loads.get(rid) if h is not None else None
        return r is not None and r.status == RequestStatus.WAITING and load is not None and load.asynchronous

    last = max((i for i, rid in enumerate(w) if held(rid)), default=-1)
    return w[: last + 1]


#: The statuses of a session that stopped and goes on (spec/sessions.py).
SESSION_WAITS = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_STREAMING_REQ)


def session_went_on(b: RequestView | None, a: RequestView | None) -> bool:
    """Whether ``a`` is a session (a resumable request) that stopped since
    ``b`` and went on instead of finishing (scheduler.py,
    _handle_stopped_request): it ran or was preempted, and now waits for
    input or, its next chunk applied, to be admitted again."""
    return (
        a is not None and b is not None and a.spec.resumable and a.status in SESSION_WAITS
        and b.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
        and (a.status == RequestStatus.WAITING_FOR_STREAMING_REQ or a.spec.prompt_token_ids != b.spec.prompt_token_ids)
    )


def sessions_hold(view: SchedulerView) -> bool:
    """Whether a session holds what admission needs while it waits: a
    model-runner slot (WAITING_FOR_STREAMING_REQ counts against
    max_num_seqs) or blocks (one that went on keeps its blocks)."""
    return any(
        r.spec.resumable and r.status != RequestStatus.RUNNING
        and (r.status == RequestStatus.WAITING_FOR_STREAMING_REQ or bool(r.block_ids))
        for r in view.requests.values()
    )
