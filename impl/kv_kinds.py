"""impl's KV cache group kinds: one class per kind, found through ``KINDS``
by the group's ``kind`` name (the names of spec/kv_kinds.py's registry).

Written from docs/spec.md ("Hybrid KV cache groups") apart from the spec's
code (impl uses only spec.interface): each class is one of vLLM 0.33's
single-type managers (vllm/v1/core/single_type_kv_cache_manager.py) in impl's
fast form, an object per group holding its parameters. ``Layout`` and
``GroupsMixin`` (impl/kv_groups.py) call these and never ask a kind's name.
A new kind is one class here and its entry in ``KINDS``.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Sequence

from schedspec.spec.interface import KVCacheGroup

NULL = 0
#: a token count no request reaches ("never")
NEVER = 1 << 62

#: ``look(i)``: the cached block of each group of one spec at block index
#: i, or None when any of them misses.
Look = Callable[[int], "list[int] | None"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _forward(look: Look, num_ids: int, start: int, max_blocks: int, bs: int) -> tuple[list[list[int]], int]:
    """Null in places [0, start), then the cached blocks forward to the
    first miss (at most block max_blocks - 1)."""
    computed: list[list[int]] = [[NULL] * start for _ in range(num_ids)]
    for i in range(start, max_blocks):
        got = look(i)
        if got is None:
            break
        for blocks, b in zip(computed, got):
            blocks.append(b)
    return computed, len(computed[0]) * bs


class GroupRules:
    """One group's kind with its parameters: FullAttentionManager's rules
    (no skipped token, no cap, every full block keyed, the hit forward from
    block 0); the other kinds override what differs."""

    #: the hybrid coordinator looks such a spec up once, first, and cuts its
    #: tables to the final hit (FullAttentionSpec: every prefix of a hit hits)
    downward_closed: ClassVar[bool] = False
    #: vLLM's KVCacheSpecKind value, as KV cache events carry it
    vllm_kind: ClassVar[str]
    #: one recurrent state per request (MambaManager, "align" mode):
    #: impl/kv_groups.py allocates and retires its state blocks
    keeps_state: ClassVar[bool] = False
    #: registers its prompt's last hash boundary inside a block as a partial
    #: entry (FullAttentionManager._cache_partial_tail_block)
    caches_partial_tail: ClassVar[bool] = False
    #: keys only some of its full blocks (``cache_mask`` returns a mask)
    masks: ClassVar[bool] = False
    #: frees blocks it skips (``skipped_tokens`` is not always 0)
    skips: ClassVar[bool] = False

    def __init__(self, group: KVCacheGroup) -> None:
        self.group = group

    def cap(self, bs: int, in_flight: int, mml: int) -> int | None:
        """max_admission_blocks_per_request (None: no cap)."""
        return None

    def skipped_tokens(self, computed: int) -> int:
        """get_num_skipped_tokens."""
        return 0

    def next_skip(self, nulled: int, bs: int) -> int:
        """The fewest processed tokens at which ``remove_skipped_blocks``
        frees a block of a table whose first ``nulled`` blocks are null: the
        least p with skipped_tokens(p) // bs > nulled (NEVER when the group
        skips none). Below it the call changes nothing."""
        return NEVER

    def hit(self, look: Look, num_ids: int, max_length: int, bs: int) -> tuple[list[list[int]], int]:
        """find_longest_cache_hit: forward from block 0 to the first miss."""
        return _forward(look, num_ids, 0, max_length // bs, bs)

    def cache_mask(self, start: int, end: int, bs: int, boundaries: Sequence[int]) -> list[bool] | None:
        """reachable_block_mask (None: every full block)."""
        return None


class FullAttention(GroupRules):
    """FullAttentionManager."""

    vllm_kind = "full_attention"
    caches_partial_tail = True

    downward_closed = True


class SlidingWindow(GroupRules):
    """SlidingWindowManager (SlidingWindowSpec): skips all but the last W - 1
    tokens, caps at the window and the tokens in flight (one block more),
    searches its hit right to left, keys only the blocks before a boundary."""

    vllm_kind = "sliding_window"
    masks = True
    skips = True

    def __init__(self, group: KVCacheGroup) -> None:
        super().__init__(group)
        self.window = group.sliding_window

    def cap(self, bs: int, in_flight: int, mml: int) -> int | None:
        return _cdiv(min(self.window - 1 + in_flight, mml), bs) + 1

    def skipped_tokens(self, computed: int) -> int:
        return max(0, computed - self.window + 1)

    def next_skip(self, nulled: int, bs: int) -> int:
        return (nulled + 1) * bs + self.window - 1

    def hit(self, look: Look, num_ids: int, max_length: int, bs: int) -> tuple[list[list[int]], int]:
        """Right to left for _contiguous_blocks_for_hit cached blocks in a
        row; without such a run, the run from block 0."""
        need = _cdiv(self.window - 1, bs)
        max_blocks = max_length // bs
        computed = [[NULL] * max_blocks for _ in range(num_ids)]
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            got = look(i)
            if got is None:
                run = 0
                continue
            for blocks, b in zip(computed, got):
                blocks[i] = b
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[i + run:]
                return computed, len(computed[0]) * bs
        for blocks in computed:
            del blocks[run:]
        return computed, len(computed[0]) * bs

    def cache_mask(self, start: int, end: int, bs: int, boundaries: Sequence[int]) -> list[bool] | None:
        """reachable_block_mask with retention 0: the contiguous_blocks_for_hit
        blocks right before each boundary (block aligned down)."""
        need = _cdiv(self.window - 1, bs)
        mask = [False] * (end - start)
        for boundary in boundaries:
            stop = boundary // bs
            for j in range(max(start, stop - need), min(end, stop)):
                mask[j - start] = True
        return mask


class ChunkedLocal(GroupRules):
    """ChunkedLocalAttentionManager (ChunkedLocalAttentionSpec): skips every
    token before the chunk of the next one, caps at one chunk and the tokens
    in flight, its hit is null up to the chunk start of the next token then
    forward to the first miss; keys every full block."""

    vllm_kind = "chunked_local_attention"
    skips = True

    def __init__(self, group: KVCacheGroup) -> None:
        super().__init__(group)
        self.chunk = group.attention_chunk_size

    def cap(self, bs: int, in_flight: int, mml: int) -> int | None:
        return _cdiv(min(self.chunk + in_flight, mml), bs)

    def skipped_tokens(self, computed: int) -> int:
        c = self.chunk
        return max(0, computed // c * c)

    def next_skip(self, nulled: int, bs: int) -> int:
        c = self.chunk
        return _cdiv((nulled + 1) * bs, c) * c

    def hit(self, look: Look, num_ids: int, max_length: int, bs: int) -> tuple[list[list[int]], int]:
        c = self.chunk
        start = (max_length // c * c if max_length > 0 else 0) // bs
        return _forward(look, num_ids, start, max_length // bs, bs)


class Mamba(GroupRules):
    """MambaManager in "align" mode: keeps the state of the last computed
    token only (skips n - 1), its hit the rightmost cached state block with
    nulls before it, keys only the state block ending on a boundary; its
    tables grow one state block a step (impl/kv_groups.py)."""

    vllm_kind = "mamba"
    masks = True
    skips = True
    keeps_state = True

    def skipped_tokens(self, computed: int) -> int:
        return computed - 1 if computed > 1 else 0

    def hit(self, look: Look, num_ids: int, max_length: int, bs: int) -> tuple[list[list[int]], int]:
        for i in range(max_length // bs - 1, -1, -1):
            got = look(i)
            if got is not None:
                return [[NULL] * i + [b] for b in got], (i + 1) * bs
        return [[] for _ in range(num_ids)], 0

    def cache_mask(self, start: int, end: int, bs: int, boundaries: Sequence[int]) -> list[bool] | None:
        mask = [False] * (end - start)
        for boundary in boundaries:
            i = boundary // bs - 1
            if start <= i < end:
                mask[i - start] = True
        return mask


#: Every kind impl knows, by its ``KVCacheGroup.kind`` name.
KINDS: dict[str, type[GroupRules]] = {
    "full_attention": FullAttention,
    "sliding_window": SlidingWindow,
    "chunked_local": ChunkedLocal,
    "mamba": Mamba,
}


def rules_of(group: KVCacheGroup) -> GroupRules:
    """The rules of a (validated) group."""
    return KINDS[group.kind](group)
