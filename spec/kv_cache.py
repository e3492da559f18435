"""The paged KV pool with automatic prefix caching, as vLLM 0.33 keeps it.

Plain lists and dicts. vLLM sources: vllm/v1/core/block_pool.py (BlockPool,
BlockHashToBlockMap), vllm/v1/core/kv_cache_utils.py (FreeKVCacheBlockQueue),
vllm/v1/core/single_type_kv_cache_manager.py (FullAttentionManager).

One deliberate difference in representation, none in behaviour: vLLM keys a
cached block by a chained hash of its tokens; the spec keys it by the tokens
themselves (BlockKey), so no collision can ever produce a wrong hit. The
methods carry the names of the BlockPool methods they capture.
"""

from __future__ import annotations

from collections import Counter

from schedspec.spec.interface import BlockKey, KVView
from schedspec.spec.rules import split_freed_blocks


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 rules: Counter[str] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
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
        # rule coverage (spec/coverage.py): shared with the scheduler and its clones
        self.rules: Counter[str] = Counter() if rules is None else rules

    def clone(self) -> KVPool:
        """An independent pool in the same state; keys (tuples) are shared."""
        new: KVPool = object.__new__(type(self))
        d = new.__dict__
        d.update(self.__dict__)
        d["ref_cnt"] = self.ref_cnt[:]
        d["free_queue"] = self.free_queue[:]
        d["block_key"] = self.block_key.copy()
        d["index"] = {k: v[:] for k, v in self.index.items()}
        return new

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
        queue (BlockPool.touch)."""
        for b in blocks:
            self.rules["kv.touch_shared"] += self.ref_cnt[b] > 0  # pragma: no mutate
            if self.ref_cnt[b] == 0:
                self.rules["kv.touch_free"] += 1  # pragma: no mutate
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
        """Release a request's whole block table. The table is walked tail
        first (KVCacheManager.free); each block whose count reaches 0 goes to
        the front of the free queue if it has no key, to the back if it has one
        (BlockPool.free_blocks)."""
        tail_first = list(reversed(table))
        newly_free: list[bool] = []
        for b in tail_first:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0
            newly_free.append(self.ref_cnt[b] == 0)
            self.rules["kv.free_shared"] += self.ref_cnt[b] > 0  # pragma: no mutate
        has_key = [b in self.block_key for b in tail_first]
        front, back = split_freed_blocks(
            blocks_tail_first=tail_first, newly_free=newly_free, has_key=has_key, caching=self.enable_caching
        )
        self.rules["kv.free_front"] += len(front)  # pragma: no mutate
        self.rules["kv.free_back"] += len(back)  # pragma: no mutate
        self.free_queue = front + self.free_queue + back

    def cache_full_blocks(self, blocks: list[int], keys: list[BlockKey]) -> None:
        """Give each block that just became full its key, in table order
        (BlockPool.cache_full_blocks, one ``_insert_block_hash`` per block)."""
        for block, key in zip(blocks, keys, strict=True):
            assert block not in self.block_key, "a newly full block has no key yet"
            self.rules["kv.cache_duplicate_key"] += key in self.index  # pragma: no mutate
            self.block_key[block] = key
            self.index.setdefault(key, []).append(block)

    def _maybe_evict_cached_block(self, block: int) -> None:
        """A block leaving the free queue for a new owner loses its key
        (BlockPool._maybe_evict_cached_block)."""
        key = self.block_key.pop(block, None)
        if key is None:
            return
        self.rules["kv.evict_cached"] += 1  # pragma: no mutate
        holders = self.index[key]
        holders.remove(block)
        self.rules["kv.evict_keeps_duplicate"] += len(holders) > 0  # pragma: no mutate
        if not holders:
            del self.index[key]

    def reset_prefix_cache(self) -> bool:
        """Drop every key, only when no block is held (BlockPool.reset_prefix_cache)."""
        if self.num_free != self.num_blocks - 1:
            self.rules["kv.reset_refused"] += 1  # pragma: no mutate
            return False
        self.rules["kv.reset_ok"] += 1  # pragma: no mutate
        self.block_key.clear()
        self.index.clear()
        return True

    def view(self) -> KVView:
        return KVView(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_cnt=tuple(self.ref_cnt),
            free_queue=tuple(self.free_queue),
            block_keys=dict(self.block_key),
            cache_index={k: tuple(v) for k, v in self.index.items()},
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
