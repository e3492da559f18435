"""Invariants of Mamba (state-space) KV cache groups in "align" mode
(spec/mamba.py): a prefix hit in a Mamba group is one state block cached
for exactly the hit's length, a prefill chunk ends on the state grid where
a state is to be checkpointed, and a request holds no more state blocks
than vLLM's bound. Each requires the ``hybrid_kv`` capability and is silent
without a Mamba group.

The vLLM behaviour is that of vllm/v1/core/single_type_kv_cache_manager.py
(MambaManager) and vllm/v1/core/sched/scheduler.py
(Scheduler._mamba_block_aligned_split)."""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import RequestStatus, RequestView, ScheduledRequest, SchedulerConfig, group_block_key
from schedspec.spec.mamba import block_aligned_split, checkpoint_position

from schedspec.invariants._util import NULL_BLOCK, admitted, block_key, running_chunk, state_groups, tables
from schedspec.invariants.core import Finding, History, Transition, transition_invariant

_NEEDS = ("hybrid_kv",)


def aligns_chunks(config: SchedulerConfig) -> bool:
    """Scheduler.need_mamba_block_aligned_split: a Mamba group with prefix
    caching on ("align" mode)."""
    return config.enable_prefix_caching and bool(state_groups(config))


def max_prefill_tokens(config: SchedulerConfig) -> int:
    """_mamba_block_aligned_split's max_prefill_tokens: the batch, cut to the
    long-prefill threshold when one is set."""
    t = config.long_prefill_token_threshold
    return min(config.max_num_batched_tokens, t) if t > 0 else config.max_num_batched_tokens


def aligned_want(config: SchedulerConfig, r: RequestView, want: int, got: int) -> bool:
    """Whether ``got`` tokens are what the block-aligned split leaves of
    ``want`` for running request ``r`` (its shared-prefix junction, which
    the view does not carry, may only stop the chunk earlier on a block
    boundary from its start)."""
    start, bs = r.num_computed_tokens, config.block_size
    cut = block_aligned_split(start, want, len(r.spec.prompt_token_ids), r.num_tokens, bs,
                              max_prefill_tokens(config), 0)
    return got == cut or (0 < got < cut and got % bs == 0)


def aligned_away(config: SchedulerConfig, r: RequestView, budget: int, threshold: int) -> bool:
    """Whether the block-aligned split leaves running request ``r`` no token
    when the RUNNING loop reaches it with ``budget`` tokens left: a prefill
    chunk that cannot reach the next block boundary waits for a bigger
    budget (scheduler.py, schedule(): ``num_new_tokens == 0``, continue).
    The shared-prefix junction, which the view does not carry, only stops a
    chunk on a boundary past its start, so it never makes the cut 0."""
    want = running_chunk(r, budget, threshold, config.max_model_len)
    return want > 0 and aligned_want(config, r, want, 0)


@transition_invariant(
    "mamba-hit-at-checkpoint",
    "A prefix hit in a Mamba group is one state block cached for exactly the hit's length: in "
    "each Mamba group's table of an admission with a hit of h tokens, place h / block_size - 1 "
    "holds a block carrying the group's key for the request's first h tokens (a state "
    "checkpointed at that length), and every place before it is the null block.",
    "vllm/v1/core/single_type_kv_cache_manager.py, MambaManager.find_longest_cache_hit (right to "
    "left, the first cached block, null blocks before it); cache_blocks keys a state block at "
    "the length its state was written for.",
    ("schedule",),
    tags=("safety",),
    requires=_NEEDS,
)
def mamba_hit_at_checkpoint(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.after.config
    groups = state_groups(cfg)
    if not groups:
        return
    bs = cfg.block_size
    for s in admitted(t.plan):
        b = t.before.requests.get(s.request_id)
        if b is None or b.num_computed_tokens or not s.num_computed_tokens:
            continue
        hit = s.num_computed_tokens
        tabs = tables(s)
        for g in sorted(groups):
            if g >= len(tabs):
                continue
            table, last = tabs[g], hit // bs - 1
            if hit % bs or last >= len(table):
                yield s.request_id, f"mamba group {g}: a hit of {hit} tokens is not a whole state block of its table"
                continue
            if any(x != NULL_BLOCK for x in table[:last]):
                yield s.request_id, f"mamba group {g}: places before the hit's state block {last} hold blocks {list(table[:last])}"
            want = group_block_key(block_key(b, last, bs), g)
            if t.after.kv.block_keys.get(table[last]) != want:
                yield s.request_id, (
                    f"mamba group {g}: the hit's state block {table[last]} (place {last}) is not cached for "
                    f"exactly the request's first {hit} tokens"
                )


@transition_invariant(
    "mamba-chunk-on-grid",
    "With a Mamba group in align mode a prefill chunk ends on the state grid where a state is to "
    "be checkpointed: a chunk from computed tokens c that stops before the prefill's end (the "
    "prompt, or the known tokens but one) ends on a block boundary (unless a block is wider than "
    "the largest prefill chunk, or an encoder input cut it), and no chunk runs past the last cacheable position "
    "((num_tokens - 1) // block_size * block_size) from before it.",
    "vllm/v1/core/sched/scheduler.py, Scheduler._mamba_block_aligned_split (aligned_end, "
    "last_cache_position, next_block_boundary); vllm/v1/kv_cache_interface.py, "
    "get_mamba_prefill_checkpoint_position.",
    ("schedule",),
    tags=("safety",),
    requires=_NEEDS,
)
def mamba_chunk_on_grid(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.before.config
    if not aligns_chunks(cfg):
        return
    bs = cfg.block_size
    for s in t.plan.scheduled:
        b = t.before.requests.get(s.request_id)
        if b is None:
            continue
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
        prefill_end = max(len(b.spec.prompt_token_ids), b.num_tokens - 1)
        if start >= prefill_end:
            continue
        # vLLM splits before the encoder caps ("Apply Mamba alignment before
        # encoder caps"): an encoder input may cut the chunk off the grid,
        # and the next chunk re-aligns at the next block boundary
        if end < prefill_end and end % bs and bs <= max_prefill_tokens(cfg) and not b.spec.mm_inputs:
            yield s.request_id, f"prefill chunk {start}..{end} stops before {prefill_end} off the state grid (block {bs})"
        last = checkpoint_position(b.num_tokens, bs)
        if start < last < end:
            yield s.request_id, f"prefill chunk {start}..{end} runs past the last cacheable state at {last}"


def _state_blocks(r: RequestView | ScheduledRequest, g: int) -> int:
    tabs = tables(r)
    return sum(1 for x in tabs[g] if x != NULL_BLOCK) if g < len(tabs) else 0


@transition_invariant(
    "mamba-state-blocks-bounded",
    "A request holds at most vLLM's bound of state blocks in each Mamba group: two (the state "
    "the step writes and the one it reads), three with async scheduling, where the previous "
    "state is retired only once its step is processed; and none once it is preempted or "
    "finished.",
    "vllm/v1/kv_cache_interface.py, MambaSpec.max_memory_usage_bytes (align: 2 + speculative + "
    "prefill-checkpoint pages); single_type_kv_cache_manager.py, MambaManager.allocate_new_blocks "
    "(one new block a step, physical_block_cap), remove_skipped_blocks (last_state_block_idx), "
    "pop_blocks_for_free.",
    tags=("safety",),
    requires=_NEEDS,
)
def mamba_state_blocks_bounded(t: Transition, h: History) -> Iterator[Finding]:
    cfg = t.after.config
    groups = state_groups(cfg)
    if not groups:
        return
    bound = 1 + cfg.max_concurrent_batches  # 2, and 3 with async scheduling's two plans in flight
    for rid, r in sorted(t.after.requests.items()):
        for g in sorted(groups):
            n = _state_blocks(r, g)
            if n > bound:
                yield rid, f"mamba group {g} holds {n} state blocks, vLLM's bound is {bound}"
            elif n and (r.status.is_finished or r.status == RequestStatus.PREEMPTED):
                yield rid, f"mamba group {g} still holds {n} state blocks while {r.status.name.lower()}"


@transition_invariant(
    "mamba-progress-bound",
    "With a Mamba group a request's computed tokens never fall back without a preemption counted: "
    "across any operation, a request (not resumable) whose num_computed_tokens is lower after "
    "than before has num_preemptions one higher, so no request is prefilled again and again while "
    "its preemptions stay 0 (with no drafts and no connector beside a Mamba group, nothing else "
    "takes computed tokens back).",
    "vllm/v1/core/sched/scheduler.py, Scheduler._preempt_request (num_computed_tokens = 0, "
    "num_preemptions += 1) is the only place a Mamba layout's computed tokens go back; "
    "_mamba_block_aligned_split must leave a running request progress (vllm#52520: a request "
    "near the pool ceiling re-prefilled for ever with num_preemptions 0).",
    tags=("safety",),
    requires=_NEEDS,
)
def mamba_progress_bound(t: Transition, h: History) -> Iterator[Finding]:
    if not state_groups(t.after.config):
        return
    for rid, a in sorted(t.after.requests.items()):
        b = t.before.requests.get(rid)
        if b is None or b.spec.resumable or a.num_computed_tokens >= b.num_computed_tokens:
            continue
        if a.num_preemptions <= b.num_preemptions:
            yield rid, (
                f"computed tokens fell from {b.num_computed_tokens} to {a.num_computed_tokens} with "
                f"num_preemptions still {a.num_preemptions}: prefilled again without a preemption"
            )
