"""The paged KV pool with automatic prefix caching, as vLLM 0.33 keeps it.

Plain lists and dicts. vLLM sources: vllm/v1/core/block_pool.py (BlockPool,
BlockHashToBlockMap), vllm/v1/core/kv_cache_utils.py (FreeKVCacheBlockQueue),
vllm/v1/core/single_type_kv_cache_manager.py (FullAttentionManager), and
for the KV cache groups of a hybrid model vllm/v1/core/kv_cache_coordinator.py
(KVCacheCoordinator): the pool's coordinator methods below apply the
per-group rules of spec/kv_groups.py to a request's tables (group 0's is the
request's ``blocks``, the others its ``group_blocks``), all groups drawing
from this one pool. The plain layout (one full-attention group) allocates,
caches and frees exactly as a single FullAttentionManager does.

One deliberate difference in representation, none in behaviour: vLLM keys a
cached block by a chained hash of its tokens; the spec keys it by the tokens
themselves (BlockKey), so no collision can ever produce a wrong hit. The
methods carry the names of the BlockPool methods they capture.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from schedspec.spec.coverage import CountsRules
from schedspec.spec.interface import BlockKey, KVView, block_key_group, group_block_key
from schedspec.spec.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    plain_key,
)
from schedspec.spec.kv_groups import (
    GroupLayout,
    SpecGroup,
    blocks_for_free,
    blocks_to_allocate,
    find_group_hit,
    hybrid_cache_hit,
    num_skipped_tokens,
    skipped_blocks_to_free,
)
from schedspec.spec.kv_kinds import KINDS, NULL_BLOCK, kind_of
from schedspec.spec.mamba import StateTrack, allocate_state_block, retire_state_blocks, state_blocks_to_allocate
from schedspec.spec.rules import cdiv, split_freed_blocks


class GroupTables(Protocol):
    """What the coordinator methods read and write of a request: its block
    table per KV cache group (group 0's is ``blocks``, groups 1.. in
    ``group_blocks``), how many leading blocks of each already have a key
    (vLLM's num_cached_block per manager), and the shared-prefix junction of
    its last prefix lookup (Request.shared_prefix_boundary)."""

    blocks: list[int]
    num_cached_blocks: int
    group_blocks: list[list[int]]
    group_num_cached: list[int]
    shared_prefix_boundary: int
    state_tracks: dict[int, StateTrack]


class CacheHit(NamedTuple):
    """A prefix lookup's hit, valid in every KV cache group."""

    blocks: list[list[int]]  # each group's hit blocks (a sliding-window group's
    # with the null block before its run, a chunked-local group's with it
    # before the chunk start)
    num_tokens: int  # the hit length in tokens
    num_uncached_tokens: int = 0  # the uncached common prefix past it (0 with one group)


class KVPool(CountsRules):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 rules: Counter[str] | None = None, layout: GroupLayout | None = None,
                 hash_lookahead: int = 0) -> None:
        self.num_blocks = num_blocks
        # Tokens after a block its key covers (BlockPool.num_hash_lookahead_tokens):
        # the stored events then carry them (lookahead_token_ids).
        self.hash_lookahead = hash_lookahead
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The KV cache groups (immutable, shared by clones); one full-attention
        # group unless the config says otherwise.
        self.layout = layout if layout is not None else GroupLayout.plain(block_size, enable_caching)
        # Reference count per block id; block 0 is the null block, never counted.
        self.ref_cnt = [0] * num_blocks
        # Free blocks in eviction order, head first. At start the queue is in
        # block-id order and block 0 is popped off as the null block
        # (BlockPool.__init__).
        self.free_queue: list[int] = list(range(1, num_blocks))
        # block id -> its prefix-cache key (vLLM: KVCacheBlock.block_hash).
        self.block_key: dict[int, BlockKey] = {}
        # key -> blocks registered under it, in insertion order; a lookup
        # returns the first (BlockHashToBlockMap.get_one_block). Identical
        # blocks are not de-duplicated so block tables stay append-only.
        self.index: dict[BlockKey, list[int]] = {}
        # The partial prefix-cache entries (BlockPool.cache_partial_block):
        # block id -> the partial keys it carries, in registration order, and
        # key -> the blocks under it. vLLM keeps them in the same map as full
        # keys (a block's first key its block_hash, the others in
        # cached_block_hashes_by_block); a partial key names a prefix ending
        # inside a block, so it never equals a full block's key.
        self.partial: dict[int, list[BlockKey]] = {}
        self.partial_index: dict[BlockKey, list[int]] = {}
        # rule coverage (spec/coverage.py): shared with the scheduler and its clones
        self.rules: Counter[str] = Counter() if rules is None else rules
        # The KV cache events since the last take (spec/kv_events.py), None
        # when events are off (BlockPool.kv_event_queue, enable_kv_cache_events).
        self.events: list[KVCacheEvent] | None = None
        # The keys a Mamba group cached this step (MambaManager.cached_blocks_this_step),
        # emptied when a step starts (new_step_starts).
        self.cached_this_step: set[BlockKey] = set()

    def clone(self) -> KVPool:
        """An independent pool in the same state; keys (tuples) are shared."""
        new: KVPool = object.__new__(type(self))
        d = new.__dict__
        d.update(self.__dict__)
        d["ref_cnt"] = self.ref_cnt[:]
        d["free_queue"] = self.free_queue[:]
        d["block_key"] = self.block_key.copy()
        d["index"] = {k: v[:] for k, v in self.index.items()}
        d["partial"] = {k: v[:] for k, v in self.partial.items()}
        d["partial_index"] = {k: v[:] for k, v in self.partial_index.items()}
        d["events"] = None if self.events is None else self.events[:]
        d["cached_this_step"] = set(self.cached_this_step)
        return new

    def new_step_starts(self) -> None:
        """KVCacheCoordinator.new_step_starts: each Mamba manager forgets the
        states it cached in the step before (MambaManager.new_step_starts)."""
        self.cached_this_step.clear()

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last take, the queue emptied (BlockPool.take_events)."""
        if self.events is None:
            return []
        out, self.events = self.events, []
        return out

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, key: BlockKey) -> int | None:
        """The block a prefix hit on ``key`` reuses: the first registered
        under it (BlockPool.get_cached_block)."""
        blocks = self.index.get(key)
        return blocks[0] if blocks else None

    def touch(self, blocks: list[int]) -> None:
        """A prefix hit takes a reference; a block at ref_cnt 0 leaves the free
        queue (BlockPool.touch). The null block is skipped."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            self._rule("kv.touch_shared", self.ref_cnt[b] > 0)  # pragma: no mutate
            if self.ref_cnt[b] == 0:
                self._rule("kv.touch_free")  # pragma: no mutate
                self.free_queue.remove(b)
            self.ref_cnt[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue; a popped block that
        still carries a key is evicted from the cache first
        (BlockPool.get_new_blocks, _maybe_evict_cached_block)."""
        assert n <= self.num_free, "caller must check the free count first"
        taken = self.free_queue[:n]
        del self.free_queue[:n]
        for b in taken:
            if self.enable_caching:
                self._maybe_evict_cached_block(b)
            assert self.ref_cnt[b] == 0
            self.ref_cnt[b] = 1
        return taken

    def free(self, table: list[int]) -> None:
        """Release one block table. The table is walked tail first
        (SingleTypeKVCacheManager.free: ``reversed``), see free_blocks."""
        self.free_blocks(list(reversed(table)))

    def free_blocks(self, ordered: list[int]) -> None:
        """BlockPool.free_blocks: drop one reference per block, in eviction
        order (the null block is skipped); each block whose count reaches 0
        goes to the front of the free queue if it has no key, to the back if
        it has one, each part in the given order."""
        ordered = [b for b in ordered if b != NULL_BLOCK]
        newly_free: list[bool] = []
        for b in ordered:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0
            newly_free.append(self.ref_cnt[b] == 0)
            self._rule("kv.free_shared", self.ref_cnt[b] > 0)  # pragma: no mutate
        has_key = [b in self.block_key for b in ordered]  # a partial entry's block has a full key too
        front, back = split_freed_blocks(
            blocks_tail_first=ordered, newly_free=newly_free, has_key=has_key, caching=self.enable_caching
        )
        self._rule("kv.free_front", len(front))  # pragma: no mutate
        self._rule("kv.free_back", len(back))  # pragma: no mutate
        self.free_queue = front + self.free_queue + back

    def cache_full_blocks(self, blocks: list[int], keys: list[BlockKey]) -> None:
        """Give each block that just became full its key, in table order
        (BlockPool.cache_full_blocks, one ``_insert_block_hash`` per block)."""
        for block, key in zip(blocks, keys, strict=True):
            assert block not in self.block_key, "a newly full block has no key yet"
            # vLLM's partial -> full promotion (a block with a partial entry
            # becoming full) never runs here: see cache_partial_tail
            assert block not in self.partial, "a partial entry lands on a full block"
            self._rule("kv.cache_duplicate_key", key in self.index)  # pragma: no mutate
            self.block_key[block] = key
            self.index.setdefault(key, []).append(block)

    def _maybe_evict_cached_block(self, block: int) -> None:
        """A block leaving the free queue for a new owner loses its key
        (BlockPool._maybe_evict_cached_block)."""
        key = self.block_key.pop(block, None)
        if key is None:
            return
        self._rule("kv.evict_cached")  # pragma: no mutate
        holders = self.index[key]
        holders.remove(block)
        self._rule("kv.evict_keeps_duplicate", len(holders) > 0)  # pragma: no mutate
        if not holders:
            del self.index[key]
        if self.events is not None:
            # BlockPool._emit_block_removed_events: one event per key removed,
            # whether or not another block still holds it
            self.events.append(BlockRemoved((plain_key(key),), MEDIUM_GPU, block_key_group(key)))
        self._drop_partial_keys(block)

    def _drop_partial_keys(self, block: int) -> None:
        """Remove the partial entries of ``block`` with its full key, in
        registration order, one BlockRemoved each after the full key's
        (BlockPool._remove_cached_block_hashes: the block's block_hash, then
        its cached_block_hashes_by_block; _emit_block_removed_events). vLLM walks the extra keys as a set: two
        of them on one block (two resumed requests whose hits share a full
        block that holds both their prompt boundaries) leave vLLM's order to
        the process's hash seed; one never does."""
        keys = self.partial.pop(block, None)
        if keys is None:
            return
        self._rule("kv_groups.partial_removed")  # pragma: no mutate
        for key in keys:
            holders = self.partial_index[key]
            holders.remove(block)
            if not holders:
                del self.partial_index[key]
            if self.events is not None:
                self.events.append(BlockRemoved((plain_key(key),), MEDIUM_GPU, block_key_group(key)))

    def cache_partial_block(self, block: int, key: BlockKey, stored: BlockStored) -> None:
        """BlockPool.cache_partial_block for a full, keyed block: register
        ``block`` under the partial ``key`` (its group's) beside its full key
        (_insert_block_hash: cached_block_hashes_by_block); ``stored`` is the
        BlockStored it emits, only when the block did not already carry the
        key (``already_cached``). The branch that first drops a block's keys
        covering fewer tokens never runs: its full key covers more."""
        assert block in self.block_key, "a partial entry lands on a full block"
        if key in self.partial.get(block, ()):
            self._rule("kv_groups.partial_again")  # pragma: no mutate
            return
        self._rule("kv_groups.partial_stored")  # pragma: no mutate
        self.partial.setdefault(block, []).append(key)
        self.partial_index.setdefault(key, []).append(block)
        if self.events is not None:
            self.events.append(stored)

    def evict_blocks(self, blocks: list[int]) -> None:
        """Drop the prefix-cache key of each block, held or free; the blocks
        themselves stay where they are (BlockPool.evict_blocks, for a KV
        connector's failed load under kv_load_failure_policy "fail"). vLLM
        passes the blocks as a set built by adding them in the order given
        (Scheduler._update_requests_with_invalid_blocks: ``blocks_to_evict``)
        and evicts in that set's iteration order, which orders the
        BlockRemoved events: the same insertions into a set of ints iterate
        alike here."""
        for b in set(blocks):
            if self.enable_caching:
                self._maybe_evict_cached_block(b)

    def reset_prefix_cache(self) -> bool:
        """Drop every key, only when no block is held (BlockPool.reset_prefix_cache)."""
        if self.num_free != self.num_blocks - 1:
            self._rule("kv.reset_refused")  # pragma: no mutate
            return False
        self._rule("kv.reset_ok")  # pragma: no mutate
        self.block_key.clear()
        self.index.clear()
        self.partial.clear()
        self.partial_index.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())  # BlockPool.reset_prefix_cache
        return True

    # ------------------------------------------------------------ the groups
    # KVCacheCoordinator (vllm/v1/core/kv_cache_coordinator.py) over this
    # pool: each method applies a group's rule (spec/kv_groups.py) to every
    # group's table of one request, in group order.

    def tables(self, req: GroupTables) -> list[list[int]]:
        """The request's table per group (the lists themselves)."""
        return [req.blocks, *req.group_blocks]

    def _set_num_cached(self, req: GroupTables, group: int, n: int) -> None:
        if group == 0:
            req.num_cached_blocks = n
        else:
            req.group_num_cached[group - 1] = n

    def _num_cached(self, req: GroupTables, group: int) -> int:
        return req.num_cached_blocks if group == 0 else req.group_num_cached[group - 1]

    def _lookup(self, key_of: Callable[[int], BlockKey], spec: SpecGroup) -> Callable[[int], list[int] | None]:
        """BlockPool.get_cached_block for the groups of ``spec``: block i's
        cached block in each group (keyed with the group's id), or None when
        one misses."""
        def lookup(i: int) -> list[int] | None:
            key = key_of(i)
            found = []
            for g in spec.group_ids:
                block = self.get_cached_block(group_block_key(key, g))
                if block is None:
                    return None
                found.append(block)
            return found
        return lookup

    def find_longest_cache_hit(
        self, key_of: Callable[[int], BlockKey], max_length: int
    ) -> CacheHit:
        """The coordinator's find_longest_cache_hit (HybridKVCacheCoordinator
        for several groups, UnitaryKVCacheCoordinator for one). With caching
        off (KVCacheCoordinatorNoPrefixCache) nothing hits."""
        lay = self.layout
        if lay.coordinator == "no_prefix_cache":
            return CacheHit([[] for _ in lay.groups], 0)
        if lay.coordinator == "unitary":
            spec = lay.spec_groups[0]
            found, length = find_group_hit(spec, self._lookup(key_of, spec), max_length, lay.block_size)
            return CacheHit(found, length)
        blocks, length, uncached = hybrid_cache_hit(lay, lambda spec: self._lookup(key_of, spec), max_length)
        self._rule("kv_groups.hit_cut_by_group", uncached > 0)  # pragma: no mutate
        return CacheHit(blocks, length, uncached)

    def _num_evictable(self, blocks: Sequence[int]) -> int:
        """_get_num_evictable_blocks: hit blocks now free (ref_cnt 0), not null."""
        return sum(1 for b in blocks if b != NULL_BLOCK and self.ref_cnt[b] == 0)

    def get_num_blocks_to_allocate(
        self, req: GroupTables, num_tokens: int, new_computed: Sequence[Sequence[int]] | None,
        total_computed_tokens: int, apply_admission_cap: bool = False,
    ) -> int:
        """KVCacheCoordinator.get_num_blocks_to_allocate: the sum over the
        groups (kv_groups.blocks_to_allocate); ``new_computed`` is the hit's
        blocks per group (None: no hit, a running request)."""
        lay = self.layout
        total = 0
        for g, (group, table) in enumerate(zip(lay.groups, self.tables(req))):
            cap = lay.admission_caps[g]
            capped = apply_admission_cap and cap is not None and cdiv(num_tokens, lay.block_size) > cap
            kind = kind_of(group)
            if kind.keeps_state:
                total += self._state_blocks_to_allocate(req, g, num_tokens, new_computed)
                continue
            self.rules["kv_groups.admission_capped"] += capped and kind.capped_rule == "kv_groups.admission_capped"  # pragma: no mutate
            self.rules["kv_groups.chunk_admission_capped"] += capped and kind.capped_rule == "kv_groups.chunk_admission_capped"  # pragma: no mutate
            total += blocks_to_allocate(
                group, lay.block_size, lay.admission_caps[g], len(table), num_tokens,
                new_computed[g] if new_computed else (), self._num_evictable,
                total_computed_tokens, apply_admission_cap,
            )
        return total

    def _state_blocks_to_allocate(
        self, req: GroupTables, g: int, num_tokens: int, new_computed: Sequence[Sequence[int]] | None
    ) -> int:
        """MambaManager.get_num_blocks_to_allocate ("align", spec/mamba.py):
        a hit whose state block another request cached this step is put off
        to a later step (more blocks than the pool has: "Mamba can't rely on
        blocks generated by other requests in the current step"); else at
        most one new state block, plus the hit's block when it is free."""
        hit = new_computed[g] if new_computed else ()
        deferred = bool(hit) and self.block_key.get(hit[-1]) in self.cached_this_step
        self._rule("kv_groups.state_hit_deferred", deferred)  # pragma: no mutate
        if deferred:
            return self.num_blocks + 1
        table = self.tables(req)[g]
        return state_blocks_to_allocate(len(table), num_tokens, self.layout.block_size, len(hit)) + self._num_evictable(hit)

    def _track(self, req: GroupTables, g: int) -> StateTrack:
        return req.state_tracks.setdefault(g, StateTrack())

    def allocate_new_computed_blocks(
        self, req: GroupTables, new_computed: Sequence[Sequence[int]], num_local: int, num_external: int = 0
    ) -> None:
        """KVCacheCoordinator.allocate_new_computed_blocks, two phases (vLLM
        issue #33775): every group takes its hit first
        (add_local_computed_blocks: the hit blocks the window skips become
        the null block, the rest are touched; all count as cached), then
        every group gets blocks for the external tokens it keeps
        (allocate_external_computed_blocks)."""
        lay, bs = self.layout, self.layout.block_size
        tables = self.tables(req)
        total = num_local + num_external
        for g, group in enumerate(lay.groups):
            assert not tables[g], "a request takes its hit before it has blocks"
            skipped = num_skipped_tokens(group, total) // bs
            kept = list(new_computed[g][skipped:]) if new_computed else []
            kind = kind_of(group)
            self.rules["kv_groups.hit_skipped_in_window"] += skipped > 0 and kind.hit_skipped_rule == "kv_groups.hit_skipped_in_window"  # pragma: no mutate
            self.rules["kv_groups.hit_skipped_in_chunk"] += skipped > 0 and kind.hit_skipped_rule == "kv_groups.hit_skipped_in_chunk"  # pragma: no mutate
            self.rules["kv_groups.hit_before_state"] += skipped > 0 and kind.hit_skipped_rule == "kv_groups.hit_before_state"  # pragma: no mutate
            if self.enable_caching:
                self.touch(kept)
            tables[g].extend([NULL_BLOCK] * skipped + kept)
            self._set_num_cached(req, g, len(tables[g]))
        if num_external <= 0:
            return
        for g, group in enumerate(lay.groups):
            skipped_tokens = num_skipped_tokens(group, total)
            if min(total - skipped_tokens, num_external) <= 0:
                continue
            tables[g].extend(self.get_new_blocks(max(0, cdiv(total, bs) - len(tables[g]))))

    def allocate_new_blocks(self, req: GroupTables, num_tokens: int) -> None:
        """KVCacheCoordinator.allocate_new_blocks: each group's table grows to
        ``cdiv(num_tokens, block_size)`` blocks, group by group."""
        for g, (group, table) in enumerate(zip(self.layout.groups, self.tables(req))):
            if kind_of(group).keeps_state:
                # one state block, the null block before it (spec/mamba.py)
                allocate_state_block(table, self._track(req, g), num_tokens, self.layout.block_size, self.get_new_blocks)
                continue
            need = cdiv(num_tokens, self.layout.block_size) - len(table)
            if need > 0:
                table.extend(self.get_new_blocks(need))

    def remove_skipped_blocks(self, req: GroupTables, processed_computed_tokens: int) -> None:
        """KVCacheCoordinator.remove_skipped_blocks: each sliding-window group
        frees the blocks wholly before the window of its next token, each
        chunked-local group those wholly before the chunk of its next token
        (kv_groups.skipped_blocks_to_free), null block in their places;
        BlockPool.free_blocks gets them last skipped first."""
        lay = self.layout
        for g, (group, table) in enumerate(zip(lay.groups, self.tables(req))):
            if kind_of(group).keeps_state:
                self._retire_states(req, g, table, processed_computed_tokens)
                continue
            skipped = num_skipped_tokens(group, processed_computed_tokens)
            if skipped <= 0:
                continue
            freed = skipped_blocks_to_free(table, skipped, lay.block_size)
            kind = kind_of(group)
            self.rules["kv_groups.window_freed"] += len(freed) > 0 and kind.freed_rule == "kv_groups.window_freed"  # pragma: no mutate
            self.rules["kv_groups.chunk_freed"] += len(freed) > 0 and kind.freed_rule == "kv_groups.chunk_freed"  # pragma: no mutate
            if freed:
                self.free_blocks(freed)

    def _retire_states(self, req: GroupTables, g: int, table: list[int], processed: int) -> None:
        """MambaManager.remove_skipped_blocks ("align", spec/mamba.py): the
        unretired blocks before the last processed token's state, then the
        previous step's state block, two BlockPool.free_blocks calls."""
        freed, previous = retire_state_blocks(table, self._track(req, g), processed, self.layout.block_size)
        self._rule("kv_groups.state_freed", len(freed) + len(previous) > 0)  # pragma: no mutate
        for blocks in (freed, previous):
            if blocks:
                self.free_blocks(blocks)

    def cache_blocks(
        self, req: GroupTables, num_tokens: int, num_prompt_tokens: int, key_of: Callable[[int], BlockKey],
        lora_id: int = 0, key_at: Callable[[int], BlockKey] | None = None,
    ) -> None:
        """KVCacheCoordinator.cache_blocks -> each manager's cache_blocks: the
        blocks full once ``num_tokens`` tokens are computed get their group's
        key (block i: ``group_block_key(key_of(i), g)``), in table order; the
        null block never; only the blocks the group kind's cache_mask keeps
        (spec/kv_kinds.py: a sliding-window group's reachable_block_mask, with
        the replay boundary num_prompt_tokens - 1 and the request's
        shared-prefix junction; every one for the other kinds, the base
        reachable_block_mask: None). Then, with a hash block size below the
        block size, each group whose kind caches_partial_tail registers its
        prompt's partial tail (cache_partial_tail; ``key_at(n)``: the key of
        the request's first n tokens), even when no block became full."""
        if not self.enable_caching:
            return
        lay, bs = self.layout, self.layout.block_size
        boundaries = [num_prompt_tokens - 1] + ([req.shared_prefix_boundary] if req.shared_prefix_boundary else [])
        for g, (group, table) in enumerate(zip(lay.groups, self.tables(req))):
            start, end = self._num_cached(req, g), num_tokens // bs
            if start < end:
                self._cache_group(req, g, table, start, end, boundaries, key_of, lora_id)
            if lay.partial_unit and kind_of(group).caches_partial_tail:
                assert key_at is not None, "a partial tail needs the request's prefix keys"
                self.cache_partial_tail(table, g, num_tokens, num_prompt_tokens, key_at, lora_id)

    def cache_partial_tail(self, table: list[int], g: int, num_tokens: int, num_prompt_tokens: int,
                           key_at: Callable[[int], BlockKey], lora_id: int) -> None:
        """FullAttentionManager._cache_partial_tail_block (no EAGLE): the
        prompt's last hash boundary short of its final token, ``t = (P - 1)
        // hb * hb``, is registered as a partial entry of the block holding
        it, once the cacheable tokens reach it, unless t is 0 or block
        aligned or the table does not reach it. The cacheable tokens are
        ``num_tokens`` rounded down to the block size
        (HybridKVCacheCoordinator.get_num_cacheable_tokens, _align_cacheable:
        no fine-grained hits), so the block is full and keyed by then (the
        manager's cache_blocks keyed it first) and the entry is a second key
        of it: vLLM's partial -> full promotion in cache_full_blocks never
        runs. Then BlockPool.cache_partial_block:
        the group's key of the first t tokens, and a BlockStored naming that
        key alone, the parent the key of the first t - hb tokens (None when
        t is hb: _get_partial_block_parent_hash_and_start), the last hb
        tokens, ``block_size`` hb, group g and its kind."""
        hb, bs = self.layout.partial_unit, self.layout.block_size
        t = (num_prompt_tokens - 1) // hb * hb
        if t == 0 or t > num_tokens // bs * bs or t % bs == 0 or t // bs >= len(table):
            return
        block = table[t // bs]
        if block == NULL_BLOCK:
            return
        key = key_at(t)
        stored = BlockStored(
            block_keys=(key,),
            parent_key=key_at(t - hb) if t > hb else None,
            token_ids=key[1][t - hb:t],
            block_size=hb,
            lora_id=lora_id or None,
            medium=MEDIUM_GPU,
            group=g,
            kind=KINDS[self.layout.groups[g].kind].vllm_kind,
        )
        self.cache_partial_block(block, group_block_key(key, g), stored)

    def _cache_group(self, req: GroupTables, g: int, table: list[int], start: int, end: int,
                     boundaries: list[int], key_of: Callable[[int], BlockKey], lora_id: int) -> None:
        """One manager's SingleTypeKVCacheManager.cache_blocks: blocks
        ``start`` to ``end`` of group g's ``table`` keyed, as cache_blocks says."""
        bs = self.layout.block_size
        group = self.layout.groups[g]
        mask = kind_of(group).cache_mask(group, start, end, bs, boundaries)
        keep = [i for i in range(start, end) if table[i] != NULL_BLOCK and (mask is None or mask[i - start])]
        self.rules["kv_groups.cache_masked"] += len(keep) < end - start  # pragma: no mutate
        self.cache_full_blocks([table[i] for i in keep], [group_block_key(key_of(i), g) for i in keep])
        if kind_of(group).keeps_state:  # MambaManager.cache_blocks: cached_blocks_this_step
            self.cached_this_step.update(group_block_key(key_of(i), g) for i in keep)
        if self.events is not None:
            self.events.append(self._stored_event(group.kind, g, start, end, keep, key_of, lora_id))
        self._set_num_cached(req, g, end)

    def _stored_event(self, kind: str, group: int, start: int, end: int, keep: list[int],
                      key_of: Callable[[int], BlockKey], lora_id: int) -> BlockStored:
        """The BlockStored of one cache_full_blocks call (spec/kv_events.py,
        "stored"; BlockPool._build_block_stored_event): the keys of the blocks
        registered, the parent key of block ``start - 1`` (None from block
        0), the tokens of blocks ``start`` to ``end``, skipped ones included."""
        bs = self.layout.block_size
        return BlockStored(
            block_keys=tuple(key_of(i) for i in keep),
            parent_key=key_of(start - 1) if start > 0 else None,
            token_ids=key_of(end - 1)[1][start * bs:end * bs],
            block_size=bs,
            lora_id=lora_id or None,
            medium=MEDIUM_GPU,
            group=group,
            kind=KINDS[kind].vllm_kind,
            lookahead_token_ids=self._lookahead_tokens(keep, key_of),
        )

    def _lookahead_tokens(self, blocks: Sequence[int], key_of: Callable[[int], BlockKey]
                          ) -> tuple[tuple[int, ...], ...] | None:
        """BlockPool._lookahead_token_ids for each of ``blocks`` (indices):
        the tokens its key covers past its end; None without hash lookahead."""
        if not self.hash_lookahead:
            return None
        bs = self.layout.block_size
        return tuple(key_of(i)[1][(i + 1) * bs:] for i in blocks)

    def emit_cached_block_events(self, hit: Sequence[Sequence[int]], key_of: Callable[[int], BlockKey],
                                 lora_id: int) -> None:
        """KVCacheCoordinator.emit_cached_block_events -> BlockPool.
        emit_cached_block_events (spec/kv_events.py, "reused"): for each group
        whose hit is not empty, in group order, one BlockStored of the hit's
        n blocks as the request names them (block i: ``key_of(i)``, whatever
        the group's table holds there, the null block too), parent None, the
        tokens of blocks 0 to n; no block changes. Only with events on."""
        if self.events is None:
            return
        bs = self.layout.block_size
        for g, (group, blocks) in enumerate(zip(self.layout.groups, hit)):
            if not blocks:
                continue
            n = len(blocks)
            self.events.append(BlockStored(
                block_keys=tuple(key_of(i) for i in range(n)),
                parent_key=None,
                token_ids=key_of(n - 1)[1][:n * bs],
                block_size=bs,
                lora_id=lora_id or None,
                medium=MEDIUM_GPU,
                group=g,
                kind=KINDS[group.kind].vllm_kind,
                reused=True,
                lookahead_token_ids=self._lookahead_tokens(range(n), key_of),
            ))

    def pop_blocks_for_free(self, req: GroupTables) -> list[int]:
        """KVCacheCoordinator.pop_blocks_for_free: the request's blocks, group
        after group without leading null blocks, taken from it unfreed (a
        deferred free later hands them to ``free``, which walks them tail
        first: ``free_blocks(reversed(blocks))``)."""
        blocks = blocks_for_free(self.tables(req))
        self._clear_tables(req)
        return blocks

    def _clear_tables(self, req: GroupTables) -> None:
        req.blocks = []
        req.num_cached_blocks = 0
        req.group_blocks = [[] for _ in req.group_blocks]
        req.group_num_cached = [0] * len(req.group_num_cached)
        req.state_tracks.clear()  # MambaManager.pop_blocks_for_free

    def free_request(self, req: GroupTables) -> None:
        """KVCacheCoordinator.free: each group's table, tail first (leading
        null blocks dropped: trim_null_head), group after group; the request
        keeps empty tables."""
        for table in self.tables(req):
            self.free(table)
        self._clear_tables(req)

    def view(self) -> KVView:
        return KVView(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_cnt=tuple(self.ref_cnt),
            free_queue=tuple(self.free_queue),
            block_keys=dict(self.block_key),
            cache_index={k: tuple(v) for k, v in self.index.items()},
            partial_index={k: tuple(v) for k, v in self.partial_index.items()},
        )


class EncoderCache:
    """The multimodal encoder cache, as vLLM 0.33 keeps it
    (vllm/v1/core/encoder_cache_manager.py, EncoderCacheManager), sized in
    embeddings. Entries are keyed by mm identifier; each records the requests
    that reference it. An entry no request references is *freeable*: it stays
    cached (a later request may reuse it) until its space is needed, when the
    oldest freeable entries are evicted first and their identifiers reported
    as freed. The methods carry the names of the manager's methods.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # identifier -> ids of the requests referencing it (empty: freeable)
        self.cached: dict[str, set[str]] = {}
        self.num_embeds: dict[str, int] = {}
        # request id -> the indices of its inputs it holds a reference for
        self.request_inputs: dict[str, set[int]] = {}
        # request id -> identifier -> how many of its inputs reference it
        self.request_refs: dict[str, dict[str, int]] = {}
        # freeable entries, oldest first (an OrderedDict in vLLM)
        self.freeable: dict[str, int] = {}
        self.freed: list[str] = []

    def clone(self) -> EncoderCache:
        new: EncoderCache = object.__new__(EncoderCache)
        new.__dict__.update(self.__dict__)
        new.cached = {k: set(v) for k, v in self.cached.items()}
        new.num_embeds = dict(self.num_embeds)
        new.request_inputs = {k: set(v) for k, v in self.request_inputs.items()}
        new.request_refs = {k: dict(v) for k, v in self.request_refs.items()}
        new.freeable = dict(self.freeable)
        new.freed = list(self.freed)
        return new

    def check_and_update_cache(self, request_id: str, input_id: int, identifier: str) -> bool:
        """Whether the input's output is cached; if so the request takes a
        reference (a freeable entry stops being freeable)."""
        if identifier not in self.cached:
            return False
        if not self.cached[identifier]:
            self.num_freeable_slots -= self.freeable.pop(identifier)
        self.cached[identifier].add(request_id)
        self._add_cached_input_id(request_id, input_id, identifier)
        return True

    def can_allocate(self, num_embeds: int, compute_budget: int, num_embeds_to_schedule: int) -> bool:
        """Whether an input of ``num_embeds`` fits the encoder budget and,
        with the ``num_embeds_to_schedule`` this request already takes this
        step, the cache; evicts the oldest freeable entries to make room (this
        happens even if the request is then not scheduled)."""
        if num_embeds > compute_budget:
            return False
        need = num_embeds + num_embeds_to_schedule
        if need <= self.num_free_slots:
            return True
        if need > self.num_freeable_slots:
            return False
        while need > self.num_free_slots:
            identifier = next(iter(self.freeable))
            size = self.freeable.pop(identifier)
            del self.cached[identifier]
            del self.num_embeds[identifier]
            self.freed.append(identifier)
            self.num_free_slots += size
        return True

    def allocate(self, request_id: str, input_id: int, identifier: str, num_embeds: int) -> None:
        """Reserve the space of an input the encoder runs this step."""
        self.cached.setdefault(identifier, set())
        assert self.num_embeds.setdefault(identifier, num_embeds) == num_embeds
        assert self.num_free_slots >= num_embeds and self.num_freeable_slots >= num_embeds
        self.cached[identifier].add(request_id)
        self._add_cached_input_id(request_id, input_id, identifier)
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds

    def _add_cached_input_id(self, request_id: str, input_id: int, identifier: str) -> None:
        ids = self.request_inputs.setdefault(request_id, set())
        if input_id in ids:
            return
        ids.add(input_id)
        refs = self.request_refs.setdefault(request_id, {})
        refs[identifier] = refs.get(identifier, 0) + 1

    def cached_input_ids(self, request_id: str) -> list[int]:
        """The inputs the request holds a reference for, in index order (vLLM
        iterates a set of small ints, which is that order)."""
        return sorted(self.request_inputs.get(request_id, ()))

    def free_encoder_input(self, request_id: str, input_id: int, identifier: str) -> None:
        """Drop the request's reference for one input; an entry no request
        references any more becomes freeable (it stays cached)."""
        ids = self.request_inputs.get(request_id)
        if ids is not None and input_id in ids:
            ids.remove(input_id)
            refs = self.request_refs[request_id]
            refs[identifier] -= 1
            if not refs[identifier]:
                del refs[identifier]
            if not ids:
                del self.request_inputs[request_id]
                del self.request_refs[request_id]
        if not self.cached.get(identifier):
            return
        if identifier in self.request_refs.get(request_id, ()):
            return
        self.cached[identifier].discard(request_id)
        if not self.cached[identifier]:
            self.freeable[identifier] = self.num_embeds[identifier]
            self.num_freeable_slots += self.num_embeds[identifier]

    def free(self, request_id: str, identifiers: list[str]) -> None:
        """Drop every reference the request holds (finish, abort, preemption,
        or a failed admission); ``identifiers[i]`` is its input i's."""
        for input_id in self.cached_input_ids(request_id):
            self.free_encoder_input(request_id, input_id, identifiers[input_id])

    def get_freed_mm_hashes(self) -> list[str]:
        """The identifiers evicted since the last call that are not cached
        again, for the plan (the model runner drops them)."""
        freed = [h for h in self.freed if h not in self.cached]
        self.freed = []
        return freed
