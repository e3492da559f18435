"""The KV cache groups of a hybrid model, as vLLM 0.33's KV cache coordinator
keeps them: the per-group rules, pure functions over block tables.

vLLM sources (paths under vllm/v1/core/):

- kv_cache_coordinator.py: KVCacheCoordinator (get_num_blocks_to_allocate,
  allocate_new_computed_blocks, allocate_new_blocks, cache_blocks, free,
  remove_skipped_blocks), UnitaryKVCacheCoordinator (one group),
  HybridKVCacheCoordinator (several: verify_and_split_kv_cache_groups,
  find_longest_cache_hit), KVCacheCoordinatorNoPrefixCache (caching off),
  get_kv_cache_coordinator (which of the three);
- single_type_kv_cache_manager.py: SingleTypeKVCacheManager
  (get_num_blocks_to_allocate, add_local_computed_blocks,
  allocate_external_computed_blocks, allocate_new_blocks, cache_blocks,
  _remove_blocks_in_range, remove_skipped_blocks, pop_blocks_for_free),
  FullAttentionManager and SlidingWindowManager (find_longest_cache_hit,
  get_num_skipped_tokens, reachable_block_mask), ChunkedLocalAttentionManager
  (find_longest_cache_hit, get_num_skipped_tokens; everything else is the
  base class's: it caches every full block and frees like a sliding window),
  get_manager_for_kv_cache_spec (the admission caps);
- vllm/v1/kv_cache_interface.py: SlidingWindowSpec and
  ChunkedLocalAttentionSpec, max_admission_blocks_per_request.

What differs by kind (FullAttentionManager, SlidingWindowManager,
ChunkedLocalAttentionManager: the hit search, the skipped tokens, the
admission cap, the cache mask) is the kind's class in spec/kv_kinds.py,
found through ``kind_of``; this module is the coordinator's part, which
never asks a kind's name.

The pool they all draw from is spec/kv_cache.py's KVPool (vLLM's one
BlockPool); KVPool's coordinator methods call these functions, and the
request's tables live on the request (group 0's is its ``blocks``). The
null block 0 stands in a sliding-window or chunked-local table for every
block it freed (or a hit skipped).

The modelled layouts: every group has the config's block size (the
scheduler block size; the hash block size divides it, and hits are block
aligned: a hash block size below it comes without a Mamba group, so
partial_hash_hits_enabled is off and a partial entry is never hit), no
EAGLE, no DCP/PCP, Mamba only in "align" mode (spec/mamba.py); the prefix-cache retention interval is vLLM's CacheConfig
default 0 (``kv_kinds.RETENTION_INTERVAL``: sliding-window groups cache only the blocks
a later hit can use, at the replay boundary and at a shared-prefix junction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from schedspec.spec.interface import KVCacheGroup, SchedulerConfig
from schedspec.spec.kv_kinds import NULL_BLOCK, GroupKind, Lookup, kind_of
from schedspec.spec.rules import cdiv


@dataclass(frozen=True)
class SpecGroup:
    """Groups with one spec, looked up together (kv_cache_coordinator.py,
    SpecGroup): their kind, window, group ids in group order, and attention
    chunk (0 unless chunked local)."""

    kind: str
    window: int
    group_ids: tuple[int, ...]
    chunk: int = 0
    #: the merged groups' shared spec, every kind-specific field of it
    #: (None: the one ``kind``, ``window`` and ``chunk`` give)
    spec: KVCacheGroup | None = field(default=None, compare=False, repr=False)

    @property
    def group(self) -> KVCacheGroup:
        """The spec's group (the fields the merged groups share)."""
        if self.spec is not None:
            return self.spec
        return KVCacheGroup(self.kind, sliding_window=self.window, attention_chunk_size=self.chunk)

    @property
    def rules(self) -> GroupKind:
        """The spec's kind (spec/kv_kinds.py)."""
        return kind_of(self.group)

    @property
    def is_full(self) -> bool:
        """Whether its hit is downward closed (FullAttentionSpec): looked up
        once, sorted first, cut to the final hit."""
        return self.rules.downward_closed


@dataclass(frozen=True)
class GroupLayout:
    """The KV cache groups of a config and what the coordinator derives from
    them once (KVCacheCoordinator.__init__, get_manager_for_kv_cache_spec)."""

    groups: tuple[KVCacheGroup, ...]
    block_size: int
    enable_caching: bool
    #: per group, SlidingWindowSpec's or ChunkedLocalAttentionSpec's
    #: max_admission_blocks_per_request (None for full attention: no cap)
    admission_caps: tuple[int | None, ...]
    #: the hash block size when prefix caching is on and it is below the
    #: block size (kv_cache_utils.py, resolve_kv_cache_block_sizes: then a
    #: full-attention group keys its prompt's last hash boundary inside a
    #: block as a partial entry), else 0
    partial_unit: int = 0

    @classmethod
    def plain(cls, block_size: int, enable_caching: bool) -> GroupLayout:
        return cls((KVCacheGroup(),), block_size, enable_caching, (None,))

    @classmethod
    def of(cls, config: SchedulerConfig) -> GroupLayout:
        """vllm/config/vllm.py, VllmConfig.max_in_flight_tokens: one batch per
        concurrent step (max_concurrent_batches: two with async scheduling,
        the pipeline size without); get_manager_for_kv_cache_spec gives a
        sliding-window and a chunked-local manager their spec's cap."""
        in_flight = config.max_concurrent_batches * config.max_num_batched_tokens
        caps = tuple(group_admission_cap(g, config.block_size, in_flight, config.max_model_len) for g in config.groups)
        hb = config.hash_block_size
        unit = hb if config.enable_prefix_caching and 0 < hb < config.block_size else 0
        return cls(config.groups, config.block_size, config.enable_prefix_caching, caps, unit)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def aligns_chunks(self) -> bool:
        """Scheduler.need_mamba_block_aligned_split: a Mamba group in "align"
        mode (prefix caching on: MambaModelConfig.verify_and_update_config)."""
        return self.enable_caching and any(kind_of(g).keeps_state for g in self.groups)

    @property
    def coordinator(self) -> str:
        """get_kv_cache_coordinator: "no_prefix_cache" when caching is off,
        "unitary" for one group, "hybrid" otherwise."""
        if not self.enable_caching:
            return "no_prefix_cache"
        return "unitary" if self.num_groups == 1 else "hybrid"

    @property
    def spec_groups(self) -> tuple[SpecGroup, ...]:
        """HybridKVCacheCoordinator.verify_and_split_kv_cache_groups: groups
        of equal spec (the kind and its fields; every group has the
        config's block size) merged in order of first appearance, then the
        downward-closed kinds (full attention) first (a stable sort)."""
        merged: dict[KVCacheGroup, list[int]] = {}
        for i, g in enumerate(self.groups):
            merged.setdefault(replace(g, block_size=0), []).append(i)
        out = [SpecGroup(g.kind, g.sliding_window, tuple(ids), g.attention_chunk_size, g) for g, ids in merged.items()]
        out.sort(key=lambda s: not s.is_full)
        return tuple(out)


def group_admission_cap(group: KVCacheGroup, block_size: int, max_in_flight_tokens: int, max_model_len: int) -> int | None:
    """get_manager_for_kv_cache_spec: the admission cap of a group's manager
    (its kind's max_admission_blocks_per_request, spec/kv_kinds.py); None for
    full attention, which holds every block to the end."""
    return kind_of(group).admission_cap(group, block_size, max_in_flight_tokens, max_model_len)


def num_skipped_tokens(group: KVCacheGroup, num_computed_tokens: int) -> int:
    """get_num_skipped_tokens of the group's manager: the leading tokens no
    later token attends. Full attention skips none; a window of W skips all
    but the last W - 1 computed tokens; chunked local with chunk C skips
    every token before the chunk of the next token (spec/kv_kinds.py)."""
    return kind_of(group).num_skipped_tokens(group, num_computed_tokens)


def find_group_hit(spec: SpecGroup, lookup: Lookup, max_length: int, block_size: int) -> tuple[list[list[int]], int]:
    """One spec group's lookup (the manager class's find_longest_cache_hit)."""
    return spec.rules.find_hit(spec.group, lookup, len(spec.group_ids), max_length, block_size)


def hybrid_cache_hit(
    layout: GroupLayout, lookup_of: Callable[[SpecGroup], Lookup], max_length: int
) -> tuple[list[list[int]], int, int]:
    """HybridKVCacheCoordinator.find_longest_cache_hit: the fixed point over
    the spec groups. Each group in turn accepts the candidate length or
    shortens it; a full-attention group is looked up once and afterwards only
    caps the candidate (it is downward closed); any shortening restarts the
    pass, except for one full-attention group beside one other ("simple
    hybrid": one pass). At the end the full-attention tables are cut to the
    hit. Returns every group's hit blocks, the hit length, and the
    uncached common prefix (the longest length some group accepted minus
    the hit)."""
    bs = layout.block_size
    specs = layout.spec_groups
    simple = len(specs) == 2 and specs[0].is_full
    blocks: list[list[int] | None] = [None] * layout.num_groups
    lengths = [0] * layout.num_groups
    hit_length, longest = max_length, 0
    while True:
        curr = hit_length
        for spec in specs:
            first = spec.group_ids[0]
            if spec.is_full and blocks[first] is not None:
                curr = min(curr, lengths[first])
                continue
            found, curr = find_group_hit(spec, lookup_of(spec), curr, bs)
            for gid, got in zip(spec.group_ids, found):
                blocks[gid], lengths[gid] = got, curr
            longest = max(longest, curr)
        if curr >= hit_length:
            break
        hit_length = curr
        if simple:
            break
    for spec in specs:
        if spec.is_full:
            for gid in spec.group_ids:
                kept = blocks[gid]
                if kept is not None:
                    del kept[cdiv(hit_length, bs):]
    return [b if b is not None else [] for b in blocks], hit_length, longest - hit_length


def blocks_to_allocate(
    group: KVCacheGroup,
    block_size: int,
    cap: int | None,
    table_len: int,
    num_tokens: int,
    new_computed: Sequence[int],
    num_evictable: Callable[[Sequence[int]], int],
    total_computed_tokens: int,
    apply_admission_cap: bool,
) -> int:
    """SingleTypeKVCacheManager.get_num_blocks_to_allocate for one group: the
    blocks to reach ``num_tokens`` slots past the blocks the table has or
    the hit brings, or past the blocks the window or chunk skips when those are more
    (their places hold the null block, which costs nothing); plus each hit
    block, past the skipped ones, that is free now (touching it takes it
    from the free queue). ``apply_admission_cap`` (the full-sequence gate)
    caps a sliding-window or chunked-local group at its admission cap. A running request has
    no hit, and the table already covers its skipped blocks, so this is
    vLLM's fast path for it too (``max(required - table_len, 0)``)."""
    required = cdiv(num_tokens, block_size)
    if apply_admission_cap and cap is not None:
        required = min(required, cap)
    skipped_blocks = num_skipped_tokens(group, total_computed_tokens) // block_size
    num_new = max(required - max(skipped_blocks, len(new_computed) + table_len), 0)
    skip_new = max(0, skipped_blocks - table_len)
    return num_new + num_evictable(new_computed[skip_new:])


def skipped_blocks_to_free(table: list[int], num_skipped: int, block_size: int) -> list[int]:
    """remove_skipped_blocks -> _remove_blocks_in_range(0, n) with n the
    whole blocks before the window or chunk of the next token
    (``num_skipped_tokens``; at most the table's length): walk back
    from block n - 1, stop at the first null block (everything before it was
    freed by an earlier call), put the null block in each place. Returns the
    blocks taken out, in the order BlockPool.free_blocks gets them."""
    n = min(num_skipped // block_size, len(table))
    freed: list[int] = []
    for i in range(n - 1, -1, -1):
        if table[i] == NULL_BLOCK:
            break
        freed.append(table[i])
        table[i] = NULL_BLOCK
    return freed


def blocks_for_free(tables: Sequence[Sequence[int]]) -> list[int]:
    """KVCacheCoordinator.pop_blocks_for_free: every group's table without
    its leading null blocks (trim_null_head), group after group, in table
    order; the caller frees them in reverse (a deferred free)."""
    out: list[int] = []
    for table in tables:
        i = 0
        while i < len(table) and table[i] == NULL_BLOCK:
            i += 1
        out.extend(table[i:])
    return out
