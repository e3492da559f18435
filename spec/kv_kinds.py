"""The kinds of KV cache group, one class per kind, found through ``KINDS``.

vLLM 0.33 keeps one single-type manager per kind of KV cache spec
(vllm/v1/core/single_type_kv_cache_manager.py: FullAttentionManager,
SlidingWindowManager, ChunkedLocalAttentionManager, each with its
find_longest_cache_hit and get_num_skipped_tokens; spec_manager_map picks
one per KVCacheSpec), and its coordinator never asks a kind's name. The
spec does the same: a ``KVCacheGroup`` keeps its serialized ``kind`` string
and fields, ``kind_of(group)`` gives the kind object, and the coordinator
(spec/kv_groups.py, spec/kv_cache.py), validation (spec/validate.py) and the
invariants read the kind object's rules: the fields it owns and their
ranges, the tokens it skips, its admission cap, its cache-hit search, which
blocks it caches, the rule names its branches count, and how a finding
names it. No code outside a layer's kinds module compares a kind by name.

Each layer that knows a kind keeps its own class per kind, keyed by the same
names: impl/kv_kinds.py (impl's fast version), schedspec/check/kv_kinds.py
(the generator's draw, stats, the oracle), schedspec/adapters/vllm_kinds.py
(vLLM's KVCacheSpec and manager) and gpu_runner/attention_kinds.py (the
runner's attention rule). A new kind is one class in each of those plus its
entry in each registry (tests/test_kv_kinds.py holds them complete).

This module sits at the bottom of spec/ (validate.py reads it), so it reads a
group through the ``GroupFields`` protocol and imports nothing else of spec/
but the errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

from schedspec.spec.errors import ConfigError

#: The null block: never pooled, stands for a freed (skipped) block in a
#: sliding-window or chunked-local table (BlockPool.null_block).
NULL_BLOCK = 0

#: CacheConfig.prefix_cache_retention_interval's default (vllm/config/cache.py),
#: which the engine copies into KVCacheConfig (kv_cache_planning.py): 0 keeps
#: only the semantic checkpoints of a sliding-window group (the replay
#: boundary and a shared-prefix junction); None would cache densely.
RETENTION_INTERVAL: int | None = 0

#: A lookup of one block index: the cached block of each group asked, or
#: None when any of them misses (BlockPool.get_cached_block).
Lookup = Callable[[int], "list[int] | None"]

#: The kind-specific fields of a KVCacheGroup, in the order validation reads
#: them, each with the message for a group whose kind does not own it and
#: gives it a value (``name``: the kind's name, ``label``: its words).
GROUP_FIELDS: dict[str, str] = {
    "attention_chunk_size": "a {name} group has no attention chunk, got {value}",
    "sliding_window": "a {label} group has no window, got {value}",
}


class GroupFields(Protocol):
    """What the kinds read of a group (spec/interface.py, KVCacheGroup)."""

    @property
    def kind(self) -> str: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def attention_chunk_size(self) -> int: ...


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupKind:
    """One kind of KV cache group: the rules of its single-type manager.

    Subclasses set the class attributes and override what differs from full
    attention (a group that attends every earlier position, skips nothing,
    has no cap and caches every full block)."""

    #: the ``KVCacheGroup.kind`` string (the trace format's)
    name: ClassVar[str]
    #: the kind in words, as findings and errors name it ("sliding-window")
    label: ClassVar[str]
    #: vLLM's KVCacheSpecKind value for it, as KV cache events carry it
    #: (vllm/v1/kv_cache_interface.py, get_kv_cache_spec_kind)
    vllm_kind: ClassVar[str]
    #: whether every BlockStored of its groups names a parent that was stored:
    #: only where every full block is cached from the start (a sliding window
    #: caches only the blocks a hit can use, and names parents it skipped)
    parent_stored: ClassVar[bool] = False
    #: the kind-specific fields of GROUP_FIELDS this kind owns (every other
    #: one must be 0 in a group of this kind)
    fields: ClassVar[tuple[str, ...]] = ()
    #: whether its tables free the blocks no later token attends, holding the
    #: null block in their places (get_num_skipped_tokens is not 0)
    skips: ClassVar[bool] = False
    #: whether its cache hit is downward closed (every prefix of a hit is a
    #: hit): the hybrid coordinator sorts such groups first, looks them up
    #: once and cuts their tables to the final hit (FullAttentionSpec)
    downward_closed: ClassVar[bool] = False
    #: whether cache_blocks keys every full block of its tables (False: only
    #: those its cache_mask keeps, so an invariant cannot expect each one)
    caches_every_block: ClassVar[bool] = True
    #: what the next token of a skipping group reads, as findings say it
    attended: ClassVar[str] = "every earlier position"
    #: the rule names its branches count in spec/kv_cache.py (None: none):
    #: the full-sequence gate capped it, a hit's blocks it skipped, blocks
    #: remove_skipped_blocks freed
    capped_rule: ClassVar[str | None] = None
    hit_skipped_rule: ClassVar[str | None] = None
    freed_rule: ClassVar[str | None] = None
    #: whether the group keeps one recurrent state per request instead of
    #: every position's keys and values (MambaSpec in "align" mode): its
    #: tables grow by one state block a step (spec/mamba.py), its chunks end
    #: on the state grid (Scheduler._mamba_block_aligned_split), and a hit
    #: in it is one state block at a checkpointed length
    keeps_state: ClassVar[bool] = False
    #: whether its cache_blocks also registers the prompt's last hash
    #: boundary inside a block as a partial prefix-cache entry when the hash
    #: block size is below the block size (FullAttentionManager.cache_blocks,
    #: _cache_partial_tail_block; spec/kv_cache.py, cache_partial_tail)
    caches_partial_tail: ClassVar[bool] = False

    def validate(self, group: GroupFields, block_size: int, where: str) -> None:
        """Raise ConfigError for the first bad kind-specific field of
        ``group`` (``where`` its field path): each field of GROUP_FIELDS in
        order, its own range if the kind owns it, else it must be 0; then the
        relations of the kind's fields to the config."""
        for field, absent in GROUP_FIELDS.items():
            value: int = getattr(group, field)
            if field in self.fields:
                self.check_field(field, value, f"{where}.{field}")
            elif value != 0:
                raise ConfigError(f"{where}.{field}", absent.format(name=self.name, label=self.label, value=value))
        self.check_relations(group, block_size, where)

    def check_field(self, field: str, value: int, where: str) -> None:
        """The range of one of the kind's own fields."""

    def check_relations(self, group: GroupFields, block_size: int, where: str) -> None:
        """The kind's fields against the config's."""

    def num_skipped_tokens(self, group: GroupFields, num_computed_tokens: int) -> int:
        """get_num_skipped_tokens: the leading tokens no later token attends
        (full attention: none)."""
        return 0

    def admission_cap(self, group: GroupFields, block_size: int, max_in_flight_tokens: int,
                      max_model_len: int) -> int | None:
        """The spec's max_admission_blocks_per_request, which
        get_manager_for_kv_cache_spec gives the manager (None: no cap, the
        group holds every block to the end)."""
        return None

    def find_hit(self, group: GroupFields, lookup: Lookup, num_ids: int, max_length: int,
                 block_size: int) -> tuple[list[list[int]], int]:
        """The manager's find_longest_cache_hit over ``num_ids`` groups of
        this spec: their hit blocks and the hit length in tokens."""
        return find_full_attention_hit(lookup, num_ids, max_length, block_size)

    def cache_mask(self, group: GroupFields, start: int, end: int, block_size: int,
                   boundaries: Sequence[int]) -> list[bool] | None:
        """reachable_block_mask: which of blocks ``start .. end - 1``
        cache_blocks keys (None: every one, the base class's)."""
        return None

    def describe(self, group: GroupFields) -> str:
        """Its parameters in words ("window 4"; "" for none)."""
        return ""


class FullAttention(GroupKind):
    """FullAttentionSpec and FullAttentionManager: every position stays
    attended, nothing is skipped or capped, every full block is cached, and
    the hit is the run of cached blocks from the start."""

    name = "full_attention"
    label = "full-attention"
    vllm_kind = "full_attention"
    parent_stored = True
    downward_closed = True
    caches_partial_tail = True


class SlidingWindow(GroupKind):
    """SlidingWindowSpec and SlidingWindowManager: a token attends the last
    ``sliding_window`` positions; blocks wholly before that window are freed
    and replaced by the null block (remove_skipped_blocks); the hit is
    searched right to left (find_longest_cache_hit) and only the blocks a hit
    can use are cached (reachable_block_mask)."""

    name = "sliding_window"
    label = "sliding-window"
    vllm_kind = "sliding_window"
    fields = ("sliding_window",)
    skips = True
    caches_every_block = False
    attended = "the window"
    capped_rule = "kv_groups.admission_capped"
    hit_skipped_rule = "kv_groups.hit_skipped_in_window"
    freed_rule = "kv_groups.window_freed"

    def check_field(self, field: str, value: int, where: str) -> None:
        # vllm/v1/kv_cache_interface.py, SlidingWindowSpec: a window of at
        # least one token.
        if value < 1:
            raise ConfigError(where, f"a sliding-window group needs a window >= 1, got {value}")

    def num_skipped_tokens(self, group: GroupFields, num_computed_tokens: int) -> int:
        """SlidingWindowManager.get_num_skipped_tokens (no extra retained
        tokens): all but the last W - 1 computed tokens."""
        return sliding_window_skipped(group.sliding_window, num_computed_tokens)

    def admission_cap(self, group: GroupFields, block_size: int, max_in_flight_tokens: int,
                      max_model_len: int) -> int | None:
        return admission_cap(group.sliding_window, block_size, max_in_flight_tokens, max_model_len)

    def find_hit(self, group: GroupFields, lookup: Lookup, num_ids: int, max_length: int,
                 block_size: int) -> tuple[list[list[int]], int]:
        return find_sliding_window_hit(lookup, num_ids, max_length, block_size, group.sliding_window)

    def cache_mask(self, group: GroupFields, start: int, end: int, block_size: int,
                   boundaries: Sequence[int]) -> list[bool] | None:
        return sliding_window_cache_mask(start, end, block_size, group.sliding_window, boundaries)

    def describe(self, group: GroupFields) -> str:
        return f"window {group.sliding_window}"


class ChunkedLocal(GroupKind):
    """ChunkedLocalAttentionSpec and ChunkedLocalAttentionManager: positions
    are cut into chunks of ``attention_chunk_size`` tokens and a token attends
    only the earlier positions of its own chunk; blocks wholly before the
    chunk of the next token are freed and nulled (get_num_skipped_tokens);
    every full block is cached (the base reachable_block_mask)."""

    name = "chunked_local"
    label = "chunked-local"
    vllm_kind = "chunked_local_attention"
    fields = ("attention_chunk_size",)
    skips = True
    attended = "its chunk"
    capped_rule = "kv_groups.chunk_admission_capped"
    hit_skipped_rule = "kv_groups.hit_skipped_in_chunk"
    freed_rule = "kv_groups.chunk_freed"

    def check_field(self, field: str, value: int, where: str) -> None:
        # vllm/v1/kv_cache_interface.py, ChunkedLocalAttentionSpec: a chunk
        # of at least one token.
        if value < 1:
            raise ConfigError(where, f"a chunked-local group needs a chunk >= 1 token, got {value}")

    def check_relations(self, group: GroupFields, block_size: int, where: str) -> None:
        # vllm/v1/attention/backends/utils.py, make_local_attention_virtual_batches:
        # the chunked-local attention backend asserts that the chunk is a
        # whole number of blocks (the scheduler does not check it, and with
        # any other chunk ChunkedLocalAttentionManager.find_longest_cache_hit
        # can null a block the hit's next token still attends).
        chunk = group.attention_chunk_size
        if chunk % block_size:
            raise ConfigError(
                f"{where}.attention_chunk_size",
                f"({chunk}) must be a multiple of block_size ({block_size}): vLLM's chunked local "
                "attention backend refuses any other chunk",
            )

    def num_skipped_tokens(self, group: GroupFields, num_computed_tokens: int) -> int:
        """ChunkedLocalAttentionManager.get_num_skipped_tokens: every token
        before the chunk of the next token, ``(n // C) * C``."""
        return chunked_local_skipped(group.attention_chunk_size, num_computed_tokens)

    def admission_cap(self, group: GroupFields, block_size: int, max_in_flight_tokens: int,
                      max_model_len: int) -> int | None:
        return chunked_local_admission_cap(group.attention_chunk_size, block_size, max_in_flight_tokens,
                                           max_model_len)

    def find_hit(self, group: GroupFields, lookup: Lookup, num_ids: int, max_length: int,
                 block_size: int) -> tuple[list[list[int]], int]:
        return find_chunked_local_hit(lookup, num_ids, max_length, block_size, group.attention_chunk_size)

    def describe(self, group: GroupFields) -> str:
        return f"chunk {group.attention_chunk_size}"


class Mamba(GroupKind):
    """MambaSpec and MambaManager in "align" mode (prefix caching on; the
    modelled Mamba block size is the config's block size, no speculative or
    prefill-checkpoint blocks): a request keeps only the state after its last
    computed token (get_num_skipped_tokens: ``n - 1``), so its table is the
    null block but for the state blocks of the last two steps
    (spec/mamba.py); the state after ``(i + 1) * block_size`` tokens lives in
    block i, cached only at the reachable boundaries (reachable_block_mask
    with the default retention 0); the hit is the rightmost cached state
    block (find_longest_cache_hit), never a run of blocks."""

    name = "mamba"
    label = "mamba"
    vllm_kind = "mamba"
    skips = True
    caches_every_block = False
    keeps_state = True
    attended = "its last state"
    hit_skipped_rule = "kv_groups.hit_before_state"
    freed_rule = "kv_groups.state_freed"

    def num_skipped_tokens(self, group: GroupFields, num_computed_tokens: int) -> int:
        """MambaManager.get_num_skipped_tokens: every token but the last
        computed one (``n - 1``; at most 0 for no token)."""
        return max(0, num_computed_tokens - 1)

    def find_hit(self, group: GroupFields, lookup: Lookup, num_ids: int, max_length: int,
                 block_size: int) -> tuple[list[list[int]], int]:
        return find_mamba_hit(lookup, num_ids, max_length, block_size)

    def cache_mask(self, group: GroupFields, start: int, end: int, block_size: int,
                   boundaries: Sequence[int]) -> list[bool] | None:
        return mamba_cache_mask(start, end, block_size, boundaries)

    def describe(self, group: GroupFields) -> str:
        return "one state per block"


#: Every kind of KV cache group, by its ``KVCacheGroup.kind`` name.
KINDS: dict[str, GroupKind] = {k.name: k for k in (FullAttention(), SlidingWindow(), ChunkedLocal(), Mamba())}


#: The kinds by vLLM's KVCacheSpecKind value (what a KV cache event names).
BY_VLLM_KIND: dict[str, GroupKind] = {k.vllm_kind: k for k in KINDS.values()}


def kind_of(group: GroupFields) -> GroupKind:
    """The kind object of a (validated) group."""
    return KINDS[group.kind]


# --------------------------------------------------------------------------
# The kinds' pure rules (PEP 316 contracts that CrossHair checks)
# --------------------------------------------------------------------------


def sliding_window_skipped(window: int, num_computed_tokens: int) -> int:
    """SlidingWindowManager.get_num_skipped_tokens: a window of W skips all
    but the last W - 1 computed tokens.

    pre: window >= 1
    post: 0 <= __return__ <= max(num_computed_tokens, 0)
    """
    return max(0, num_computed_tokens - window + 1)


def chunked_local_skipped(chunk: int, num_computed_tokens: int) -> int:
    """ChunkedLocalAttentionManager.get_num_skipped_tokens: a chunk of C
    skips every token before the chunk of the next token, ``(n // C) * C``.

    pre: chunk >= 1
    post: 0 <= __return__ <= max(num_computed_tokens, 0)
    """
    return max(0, num_computed_tokens // chunk * chunk)


def admission_cap(window: int, block_size: int, max_in_flight_tokens: int, max_model_len: int) -> int:
    """SlidingWindowSpec.max_admission_blocks_per_request: the blocks a
    sliding-window request holds at most (the window's last W - 1 tokens plus
    every token in flight, one block more for a window that starts inside a
    block).

    pre: window >= 1 and block_size >= 1
    pre: max_in_flight_tokens >= 0 and max_model_len >= 1
    post: __return__ >= 1
    post: (__return__ - 2) * block_size < max_model_len
    """
    return _cdiv(min(window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1


def chunked_local_admission_cap(chunk: int, block_size: int, max_in_flight_tokens: int, max_model_len: int) -> int:
    """ChunkedLocalAttentionSpec.max_admission_blocks_per_request: the blocks
    a chunked-local request holds at most (one chunk plus every token in
    flight, never more than max_model_len; no extra block).

    pre: chunk >= 1 and block_size >= 1
    pre: max_in_flight_tokens >= 0 and max_model_len >= 1
    post: __return__ >= 1
    post: (__return__ - 1) * block_size < max_model_len
    """
    return _cdiv(min(chunk + max_in_flight_tokens, max_model_len), block_size)


def contiguous_blocks_for_hit(window: int, block_size: int) -> int:
    """SlidingWindowManager._contiguous_blocks_for_hit (no EAGLE): the cached
    blocks right before a hit's end that the window of the next token reads.

    pre: window >= 1 and block_size >= 1
    post: __return__ * block_size >= window - 1
    """
    return _cdiv(window - 1, block_size)


def find_full_attention_hit(lookup: Lookup, num_ids: int, max_length: int, block_size: int) -> tuple[list[list[int]], int]:
    """FullAttentionManager.find_longest_cache_hit: the longest run of cached
    blocks from the start, at most ``max_length // block_size`` of them;
    chained keys make every block after a miss a miss too."""
    return _forward_hit(lookup, num_ids, 0, max_length // block_size, block_size)


def _forward_hit(
    lookup: Lookup, num_ids: int, start_block: int, end_block: int, block_size: int
) -> tuple[list[list[int]], int]:
    """The null block in places ``[0, start_block)``, then the cached blocks
    from ``start_block`` forward until the first miss (at most up to
    ``end_block``): the hit and its length in tokens."""
    computed: list[list[int]] = [[NULL_BLOCK] * start_block for _ in range(num_ids)]
    for i in range(start_block, end_block):
        cached = lookup(i)
        if cached is None:
            break
        for blocks, b in zip(computed, cached):
            blocks.append(b)
    return computed, len(computed[0]) * block_size


def find_sliding_window_hit(
    lookup: Lookup, num_ids: int, max_length: int, block_size: int, window: int
) -> tuple[list[list[int]], int]:
    """SlidingWindowManager.find_longest_cache_hit: scan right to left from
    block ``max_length // block_size - 1`` for ``contiguous_blocks_for_hit``
    cached blocks in a row; the hit ends with that run and every block
    before it is the null block. With no such run, the run of cached blocks
    from block 0 is the hit (possibly empty)."""
    need = contiguous_blocks_for_hit(window, block_size)
    max_blocks = max_length // block_size
    computed = [[NULL_BLOCK] * max_blocks for _ in range(num_ids)]
    run = 0
    for i in range(max_blocks - 1, -1, -1):
        cached = lookup(i)
        if cached is None:
            run = 0
            continue
        for blocks, b in zip(computed, cached):
            blocks[i] = b
        run += 1
        if run >= need:
            for blocks in computed:
                del blocks[i + run:]
            return computed, len(computed[0]) * block_size
    for blocks in computed:
        del blocks[run:]
    return computed, len(computed[0]) * block_size


def find_chunked_local_hit(
    lookup: Lookup, num_ids: int, max_length: int, block_size: int, chunk: int
) -> tuple[list[list[int]], int]:
    """ChunkedLocalAttentionManager.find_longest_cache_hit: every block
    before the block of the chunk start of the next token (``(max_length //
    chunk) * chunk``, 0 for max_length 0) is the null block, never looked
    up; then the cached blocks from there forward, up to block
    ``max_length // block_size - 1``, until the first miss. The hit is every
    block returned, nulls included. E.g. chunk 8, block 4: max_length 15
    gives [null, null] and block 2 when it is cached; max_length 16 gives
    four nulls, looking nothing up."""
    start_block = (max_length // chunk * chunk if max_length > 0 else 0) // block_size
    return _forward_hit(lookup, num_ids, start_block, max_length // block_size, block_size)


def sliding_window_cache_mask(
    start: int, end: int, block_size: int, window: int, boundaries: Sequence[int],
    retention: int | None = RETENTION_INTERVAL,
) -> list[bool] | None:
    """SlidingWindowManager.reachable_block_mask (no EAGLE, alignment = the
    block size): which of blocks ``start .. end - 1`` a sliding-window group
    caches. Dense retention (None) caches every block once a hit needs at
    least one; otherwise only the ``contiguous_blocks_for_hit`` blocks right
    before each reachable boundary (the replay boundary num_prompt_tokens - 1
    and a shared-prefix junction, block aligned down), plus, for a positive
    interval, the same tail of every segment of that many tokens. None = all."""
    need = contiguous_blocks_for_hit(window, block_size)
    segment = block_size if retention is None else (retention or None)
    mask = [False] * (end - start)
    if segment is not None:
        per_segment = segment // block_size
        if need >= per_segment:
            return None
        for i in range(start, end):
            if i % per_segment >= per_segment - need:
                mask[i - start] = True
    if retention is not None:
        for boundary in boundaries:
            stop = boundary // block_size
            for j in range(max(start, stop - need), min(end, stop)):
                mask[j - start] = True
    return mask


def find_mamba_hit(lookup: Lookup, num_ids: int, max_length: int, block_size: int) -> tuple[list[list[int]], int]:
    """MambaManager.find_longest_cache_hit (alignment = the block size): scan
    right to left from block ``max_length // block_size - 1`` and stop at the
    first cached state block i; the hit is the null block in places
    ``[0, i)`` and that block, ``(i + 1) * block_size`` tokens: a state is
    valid only for exactly the prefix it was checkpointed at. No cached
    block: an empty hit. E.g. block 4, max_length 13, block 1 cached and
    block 2 not: ``[null, b1]``, 8 tokens."""
    for i in range(max_length // block_size - 1, -1, -1):
        cached = lookup(i)
        if cached is not None:
            return [[NULL_BLOCK] * i + [b] for b in cached], (i + 1) * block_size
    return [[] for _ in range(num_ids)], 0


def mamba_cache_mask(start: int, end: int, block_size: int, boundaries: Sequence[int],
                     retention: int | None = RETENTION_INTERVAL) -> list[bool] | None:
    """MambaManager.reachable_block_mask (alignment = the block size): dense
    retention (None) caches every state block; 0 only the block ending on
    each reachable boundary (the replay boundary num_prompt_tokens - 1 and a
    shared-prefix junction, block aligned down: block ``b // bs - 1``); a
    positive interval of k blocks also the last block of every k-block
    segment (k <= 1: every block).

    pre: 0 <= start <= end and block_size >= 1
    post: __return__ is None or len(__return__) == end - start
    """
    if retention is None:
        return None
    mask = [False] * (end - start)
    if retention:
        per_segment = retention // block_size
        if per_segment <= 1:
            return None
        for i in range(start, end):
            if (i + 1) % per_segment == 0:
                mask[i - start] = True
    for boundary in boundaries:
        block = boundary // block_size - 1
        if start <= block < end:
            mask[block - start] = True
    return mask
