"""Small helpers the checkers share. They read views only; none of them
imports the spec's logic (spec.interface holds plain types)."""

from __future__ import annotations

from schedspec.spec.interface import (
    BlockKey,
    Policy,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerView,
    StepPlan,
)

from schedspec.invariants.core import Transition


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_key(r: RequestView, index: int, block_size: int) -> BlockKey:
    """The content key block ``index`` of ``r`` must carry once it is full:
    its identity (cache salt, LoRA adapter, encoder inputs started before the
    block's end; RequestView.block_identity) and its token prefix."""
    end = (index + 1) * block_size
    return (r.block_identity(end), r.all_token_ids[:end])


def queue_key(r: RequestView) -> tuple[int, int, str]:
    """PRIORITY waiting-queue order (vllm/v1/request.py, Request.__lt__)."""
    return (r.priority, r.arrival, r.request_id)


def victim_key(r: RequestView) -> tuple[int, int]:
    """PRIORITY preemption order: the running request with the greatest key
    is preempted first (scheduler.py, schedule())."""
    return (r.priority, r.arrival)


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
    """block id -> [(request id, index in its table)] over live requests."""
    out: dict[int, list[tuple[str, int]]] = {}
    for rid, r in view.requests.items():
        for i, b in enumerate(r.block_ids):
            out.setdefault(b, []).append((rid, i))
    return out


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
        live.sort(key=lambda rid: queue_key(view.requests[rid]))
    return live


def admission_candidate(view: SchedulerView) -> str | None:
    """The first request in waiting-queue service order that the WAITING
    loop would not pass over for an admission gate it can see: one still
    waiting for its grammar (_handle_blocked_waiting_request) or whose
    adapter would exceed max_loras distinct adapters among the running
    requests (the max_loras check) is passed over (skip_request)."""
    live = waiting_order(view)
    loras = {view.requests[rid].lora_id for rid in view.running if rid in view.requests} - {0}
    for rid in live:
        r = view.requests[rid]
        if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            continue
        m = view.config.max_loras
        if m and r.lora_id and len(loras) >= m and r.lora_id not in loras:
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
    bs = view.config.block_size
    hit: list[int] = []
    for i in range((r.num_tokens - 1) // bs):
        blocks = view.kv.cache_index.get(block_key(r, i, bs), ())
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
    need = needed(min(hit_tokens + n, cfg.max_model_len))
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
    if p > 0 and r.num_computed_tokens + 2 - p >= len(r.prompt_token_ids) + r.max_tokens:
        return 0
    n = r.num_tokens + len(r.spec_token_ids) + p - r.num_computed_tokens
    if 0 < threshold < n:
        n = threshold
    n = min(n, budget, max_model_len - r.num_computed_tokens - 1)
    return max(n, 0)


def is_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> bool:
    return len(a) <= len(b) and tuple(b[: len(a)]) == tuple(a)
