"""Mamba (state-space) KV cache groups in "align" mode, as vLLM 0.33 keeps
them: the per-request bookkeeping of MambaManager and the scheduler's
block-aligned chunk split, pure functions over a request's table.

vLLM sources: vllm/v1/core/single_type_kv_cache_manager.py (MambaManager:
get_num_blocks_to_allocate, allocate_new_blocks, remove_skipped_blocks,
_remove_blocks_in_range, pop_blocks_for_free, cache_blocks,
new_step_starts), vllm/v1/core/sched/scheduler.py
(Scheduler._mamba_block_aligned_split) and vllm/v1/kv_cache_interface.py
(get_mamba_prefill_checkpoint_position).

A Mamba layer carries one recurrent state, not a key and value per
position. In "align" mode the state after ``(i + 1) * block_size`` tokens
is written to block i of the request's table, so a block is a checkpoint
of the state at that length, and a later request whose prefix is exactly
that long can start from it. Each step the request takes at most one new
state block (the state it writes), the places before it hold the null
block, and the state block of the step before is freed once no in-flight
step reads it: a request holds at most two state blocks (plus a hit's).

The modelled subset: the Mamba block size is the config's block size (so
the hash block size too: no partial-block hits, no copy-on-write), no
speculative blocks (no drafts), no prefill-checkpoint blocks, no EAGLE, no
shared-prefix checkpoint; prefix caching on and chunked prefill on
(spec/validate.py refuses the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schedspec.spec.kv_kinds import NULL_BLOCK


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StateTrack:
    """MambaManager's per-request bookkeeping for one Mamba group."""

    #: whether the request has been allocated blocks (_allocated_block_reqs)
    allocated: bool = False
    #: the index of the state block of the allocation before the last one
    #: (last_state_block_idx), freed once the processed tokens pass it
    last_state: int | None = None
    #: the blocks before this index were retired already (_num_retired_blocks)
    retired: int = 0

    def copy(self) -> StateTrack:
        return StateTrack(self.allocated, self.last_state, self.retired)


def state_blocks_to_allocate(table_len: int, num_tokens: int, block_size: int, hit_len: int) -> int:
    """MambaManager.get_num_blocks_to_allocate in "align" mode, before the
    hit's free blocks are added: the blocks to reach ``cdiv(num_tokens,
    block_size)`` places past the table and the hit, at most one (the state
    this step writes: ``physical_block_cap``); the places before it are the
    null block, which costs nothing. Negative when the table is longer
    (vLLM adds it as it is).

    pre: table_len >= 0 and num_tokens >= 0 and block_size >= 1 and hit_len >= 0
    post: __return__ <= 1
    """
    num_new = _cdiv(num_tokens, block_size) - hit_len - table_len
    return min(num_new, 1) if num_new > 0 else num_new


def allocate_state_block(
    table: list[int], track: StateTrack, num_tokens: int, block_size: int, get_new_blocks: Callable[[int], list[int]]
) -> None:
    """MambaManager.allocate_new_blocks in "align" mode: nothing when the
    table already has ``cdiv(num_tokens, block_size)`` places; else the last
    block of the table becomes the previous state (``last_state_block_idx``,
    for a request taking its first blocks only after a hit: the hit's
    block), the places up to the last one are filled with the null block, and
    the last place gets one new block, the state this step writes."""
    required = _cdiv(num_tokens, block_size)
    if required <= len(table):
        track.allocated = True
        return
    prev = len(table)
    if track.allocated or prev > 0:
        track.last_state = prev - 1
    if prev < required - 1:
        table.extend([NULL_BLOCK] * (required - 1 - prev))
    table.extend(get_new_blocks(max(required - len(table), 0)))
    track.allocated = True


def retire_state_blocks(
    table: list[int], track: StateTrack, processed_tokens: int, block_size: int
) -> tuple[list[int], list[int]]:
    """MambaManager.remove_skipped_blocks in "align" mode: the blocks before
    the state of the last processed token (get_num_skipped_tokens ``n - 1``,
    whole blocks, at most the table's length) not retired yet, walked back
    from the last, skipping the null gaps (_remove_blocks_in_range), then
    the previous state block once the processed tokens pass the block after
    it (``last_state_block_idx < cdiv(processed, block_size) - 1``). Each
    becomes the null block; returns the blocks freed, in the order of the
    two BlockPool.free_blocks calls, as two lists."""
    freed: list[int] = []
    previous: list[int] = []
    skipped = processed_tokens - 1
    if skipped > 0:
        last = min(skipped // block_size, len(table))
        first = track.retired
        if first < last:
            for i in range(last - 1, first - 1, -1):
                if table[i] != NULL_BLOCK:
                    freed.append(table[i])
                    table[i] = NULL_BLOCK
            track.retired = last
    last_state = track.last_state
    if last_state is not None and last_state < _cdiv(processed_tokens, block_size) - 1:
        if table[last_state] != NULL_BLOCK:
            previous.append(table[last_state])
            table[last_state] = NULL_BLOCK
    return freed, previous


def checkpoint_position(num_tokens: int, block_size: int) -> int:
    """vllm/v1/kv_cache_interface.py, get_mamba_prefill_checkpoint_position
    (no EAGLE, no hash lookahead): the last block boundary strictly before
    the last token, whose state a later request can reuse (one token is left
    to compute its logits).

    pre: num_tokens >= 0 and block_size >= 1
    post: 0 <= __return__ < max(num_tokens, 1)
    post: __return__ % block_size == 0
    """
    return max((num_tokens - 1) // block_size * block_size, 0)


def block_aligned_split(
    start: int, num_new_tokens: int, num_prompt_tokens: int, num_tokens: int, block_size: int,
    max_prefill_tokens: int, shared_prefix_boundary: int,
) -> int:
    """Scheduler._mamba_block_aligned_split: a prefill chunk from ``start``
    (computed tokens, the hit's included) is cut so that it ends where a
    Mamba state must be checkpointed. Past the prefill (``prefill_end``: the
    prompt, or the known tokens but one for a resumed request) nothing is
    cut. Before it, a chunk that does not reach prefill_end ends on a block
    boundary (unless it cannot reach one and a block is wider than
    ``max_prefill_tokens``); then it stops at the earliest of: the next
    block boundary for a chunk starting inside a block, the last cacheable
    position (``checkpoint_position(num_tokens)``), the block-floored
    shared-prefix junction. 0 when a chunk shorter than a block cannot reach
    a boundary (the request waits for a bigger budget).

    pre: start >= 0 and num_new_tokens >= 0 and block_size >= 1
    pre: max_prefill_tokens >= 1 and shared_prefix_boundary >= 0
    post: 0 <= __return__ <= num_new_tokens
    """
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens
    last_cache_position = checkpoint_position(num_tokens, block_size)
    end = start + num_new_tokens
    if end < prefill_end:
        aligned_end = end // block_size * block_size
        if aligned_end > start or block_size <= max_prefill_tokens:
            end = aligned_end
    next_block_boundary = (start // block_size + 1) * block_size
    junction = shared_prefix_boundary
    junction_stop = start + (junction - start) // block_size * block_size
    stops = (
        next_block_boundary if start % block_size != 0 else 0,
        last_cache_position,
        junction_stop if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)
