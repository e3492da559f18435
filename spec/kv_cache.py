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
