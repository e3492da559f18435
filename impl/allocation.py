"""The KV pool's operations on requests (vLLM's KVCacheManager and BlockPool):
free, allocate, key the full blocks, grow a running request's table, find a
prefix hit, allocate an admission. A hybrid layout's calls go on to the
coordinator of impl/kv_groups.py.

The pool itself is three structures, no scans: the free queue as a linked
list over arrays (impl/free_queue.py), the interned chained prefix keys
(impl/prefix_index.py) and a reference count per block.
"""

from __future__ import annotations

from typing import Any

from schedspec.spec.interface import SchedulerConfig

from schedspec.impl.free_queue import FreeBlockQueue
from schedspec.impl.kv_events import stored_keyed, stored_run
from schedspec.impl.prefix_index import KeyNode, Parent, PrefixIndex
from schedspec.impl.request import Request


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """The most full blocks a prefix-cache lookup may return: the last token
    is always computed (it yields the logits), so the hit covers at most
    ``num_tokens - 1`` tokens. (spec/rules.py has the same rule; the test
    suite compares the two with ``crosshair diffbehavior``.)"""
    return (num_tokens - 1) // block_size


class AllocationMixin:
    """ImplScheduler's block-table operations."""

    # provided by ImplScheduler (and impl/kv_groups.py's GroupsMixin)
    _config: SchedulerConfig
    _bs: int
    _max_model_len: int
    _lookahead: int
    _hash_la: int
    _caching: bool
    _hybrid: bool
    _ref: list[int]
    _fq: FreeBlockQueue
    _px: PrefixIndex
    _g_cache: Any
    _g_remove_skipped: Any
    _g_need: Any
    _g_grow: Any
    _g_slots: Any
    _g_take_hit: Any

    def _free(self, table: list[int]) -> None:
        """Release a block table, tail first: unkeyed blocks to the head of the
        free queue, keyed ones to the tail."""
        if not table:
            return
        ref_cnt = self._ref
        node_of = self._px.block_node
        front: list[int] = []
        back: list[int] = []
        for block in reversed(table):
            count = ref_cnt[block] - 1
            ref_cnt[block] = count
            if count == 0:
                if node_of[block] is None:
                    front.append(block)
                else:
                    back.append(block)
        self._fq.prepend(front)
        self._fq.append(back)

    def _allocate(self, count: int) -> list[int]:
        taken = self._fq.popleft_n(count)
        ref_cnt = self._ref
        prefix_index = self._px
        node_of = prefix_index.block_node
        for block in taken:
            if node_of[block] is not None:
                prefix_index.evict(block)
            ref_cnt[block] = 1
        return taken

    def _allocate_one(self) -> int:
        """One block from the head of the free queue (a decode step crossing
        into a new block), without the list of ``_allocate``."""
        free_queue = self._fq
        following = free_queue.nxt
        head = free_queue.head
        block = following[head]
        after = following[block]
        following[head] = after
        free_queue.prv[after] = head
        free_queue.size -= 1
        if self._px.block_node[block] is not None:
            self._px.evict(block)
        self._ref[block] = 1
        return block

    def _free_own_table(self, req: Request) -> None:
        """The plain layout without a connector: free the request's blocks
        now (tail first, kv_cache_manager.free) and leave it an empty table."""
        self._free(req.block_ids)
        req.block_ids = []
        req.cached_block_tuple = ()
        req.num_slots = 0

    def _register(self, req: Request, upto: int) -> None:
        """Give keys to the blocks of ``req`` that are full once ``upto`` tokens
        are computed (requires prefix caching), and move ``next_full_at``."""
        if self._hybrid:
            self._g_cache(req, upto)
            return
        block_size = self._bs
        # EAGLE's hash lookahead L: a block has a key once the L tokens after
        # it are known, and its key's own tokens run L past its end
        lookahead = self._hash_la
        num_full = (min(upto, req.num_tokens - lookahead) if lookahead else upto) // block_size
        first = req.num_cached_blocks
        if num_full <= first:
            return
        prefix_index = self._px
        blocks = req.block_ids
        parent: Parent
        if first == 0:
            parent = req.key_root
        else:
            node = prefix_index.block_node[blocks[first - 1]]
            assert node is not None
            parent = node
        # each full block's own tokens: prompt slices, then output slices
        num_prompt = req.num_prompt_tokens
        start = first * block_size
        end = num_full * block_size
        if lookahead:
            token_range = req.token_range
            chunks = [token_range(x, x + block_size + lookahead) for x in range(start, end, block_size)]
        elif num_full == first + 1:  # one block (a decode step)
            chunks = [req.token_range(start, end)]
        elif end <= num_prompt:
            prompt = req.prompt_token_ids
            chunks = [prompt[x : x + block_size] for x in range(start, end, block_size)]
        elif start >= num_prompt:
            output = req.output
            chunks = [tuple(output[x : x + block_size]) for x in range(start - num_prompt, end - num_prompt, block_size)]
        else:
            token_range = req.token_range
            chunks = [token_range(x, x + block_size) for x in range(start, end, block_size)]
        if req.identity_marks:
            prefix_index.register_marked(blocks, first, parent, chunks, req.identity_marks)
        else:
            prefix_index.register_chain(blocks, first, parent, chunks)
        if prefix_index.events is not None:
            prefix_index.events.append(
                stored_keyed(req, blocks, prefix_index.block_node, first, num_full, list(range(first, num_full)),
                             block_size, 0, "full_attention", lookahead) if lookahead
                else stored_run(req, blocks, prefix_index.block_node, first, chunks, block_size))
        req.num_cached_blocks = num_full
        req.next_full_at = (num_full + 1) * block_size

    def _grow_running(self, req: Request, end: int) -> bool:
        """allocate_slots for a running request: slots to reach ``end``
        computed tokens (drafts and placeholders included), and keys for the
        blocks its known tokens fill. False (and nothing changed) when the
        pool is short."""
        if self._hybrid:
            return self._grow_running_groups(req, end)
        block_size = self._bs
        blocks = req.block_ids
        slots = end
        if self._lookahead:  # the drafter's slots, up to max_model_len
            slots = min(end + self._lookahead, self._max_model_len)
        need = -(-slots // block_size) - len(blocks)
        if need > 0:
            if need > self._fq.size:
                return False
            if need == 1:
                blocks.append(self._allocate_one())
            else:
                blocks.extend(self._allocate(need))
            req.num_slots = len(blocks) * block_size
            req.cached_block_tuple = None
        known_end = end if end < req.num_tokens else req.num_tokens
        if known_end >= req.next_full_at:  # never when prefix caching is off
            self._register(req, known_end)
        return True

    def _grow_running_groups(self, req: Request, end: int) -> bool:
        """allocate_slots for a running request of a hybrid layout: the
        blocks out of a sliding window freed first (processed tokens), even
        when the allocation then fails; the count summed over the groups."""
        computed = req.num_computed_tokens
        max_model_len = self._max_model_len
        target = min(end + self._lookahead, max_model_len)
        # each part only where it may change something (below group_skip_from,
        # num_slots and next_full_at it is a no-op)
        processed = max(0, min(computed, max_model_len) - req.num_in_flight_tokens)
        if processed >= req.group_skip_from:
            self._g_remove_skipped(req, processed)
        if target > req.num_slots:
            if self._g_need(req, target, None, computed) > self._fq.size:
                return False
            self._g_grow(req, target)
            req.num_slots = self._g_slots(req)
        known_end = min(end, req.num_tokens)
        if known_end >= req.next_full_at:
            self._g_cache(req, known_end)
        return True

    def _find_hit(self, req: Request) -> list[int]:
        if not self._caching:
            return []
        block_size = self._bs
        lookup = self._px.lookup
        hit: list[int] = []
        parent: Parent = req.key_root
        marks = req.identity_marks
        lookahead = self._hash_la  # the tokens after a block its key covers (EAGLE)
        for i in range(max_hit_blocks(req.num_tokens, block_size)):
            if lookahead > 1 and (i + 1) * block_size + lookahead > req.num_tokens:
                break  # only hashed blocks hit: num_tokens - L tokens
            if marks and i in marks:
                assert isinstance(parent, KeyNode)
                parent = (parent, marks[i])
            node = lookup(parent, req.token_range(i * block_size, (i + 1) * block_size + lookahead))
            if node is None:
                break
            hit.append(node.holders[0])
            parent = node
        return hit

    def _admit_alloc(
        self, req: Request, hit: list[int], n: int, watermark: int,
        computed: int, load_async: bool = False, reserved: int = 0,
    ) -> bool:
        """Blocks for an admission past its prefix hit; ``watermark`` blocks
        must stay free besides. ``computed``: tokens counted computed before
        the step (the hit, plus with a KV connector the external tokens, whose
        blocks come right after the hit's; or a promoted load's, whose blocks
        the request holds); ``load_async``: an asynchronous load (nothing
        cached yet); ``reserved``: the blocks left free for the in-flight
        prefills."""
        block_size = self._bs
        ref_cnt = self._ref
        free = self._fq.size - watermark
        num_hit = len(hit)
        held = len(req.block_ids)  # a promoted load's table (then no hit)
        evictable = 0
        for block in hit:
            if ref_cnt[block] == 0:
                evictable += 1
        if self._config.scheduler_reserve_full_isl:
            full = min(req.num_tokens, self._max_model_len)
            if max(-(-full // block_size) - num_hit - held, 0) + evictable > free:
                return False
        target = min(computed + n + (0 if load_async else self._lookahead), self._max_model_len)
        need = max(-(-target // block_size) - num_hit - held, 0)
        if need + evictable + reserved > free:
            return False
        free_queue = self._fq
        for block in hit:
            if ref_cnt[block] == 0:
                free_queue.remove(block)
            ref_cnt[block] += 1
        blocks = req.block_ids if held else list(hit)
        if need:
            blocks.extend(self._allocate(need))
        req.block_ids = blocks
        req.cached_block_tuple = None
        req.num_slots = len(blocks) * block_size
        if not held:
            req.num_cached_blocks = num_hit
            if self._caching:
                req.next_full_at = (num_hit + 1) * block_size
        if self._caching and not load_async:
            self._register(req, min(computed + n, req.num_tokens))
        return True

    def _admit_alloc_groups(
        self, req: Request, hit: list[list[int]], n: int, watermark: int, computed: int,
        load_async: bool = False, reserved: int = 0,
    ) -> bool:
        """allocate_slots for an admission of a hybrid layout (the spec's
        _allocate_admission): the full-sequence gate with the sliding-window
        admission caps, the skipped blocks of a promoted load freed, the
        count summed over the groups, the hit then the external tokens'
        blocks, then this step's."""
        block_size = self._bs
        num_hit_tokens = len(hit[0]) * block_size if hit else 0
        num_external = 0 if req.block_ids else computed - num_hit_tokens
        if self._config.scheduler_reserve_full_isl:
            full = min(req.num_tokens, self._max_model_len)
            if self._g_need(req, full, hit, computed, True) + watermark > self._fq.size:
                return False
        self._g_remove_skipped(req, max(0, computed - req.num_in_flight_tokens))
        target = min(computed + n + (0 if load_async else self._lookahead), self._max_model_len)
        if self._g_need(req, target, hit, computed) + watermark + reserved > self._fq.size:
            return False
        if any(hit) or num_external > 0:
            self._g_take_hit(req, hit, num_hit_tokens, num_external)
        self._g_grow(req, target)
        if not load_async:
            self._g_cache(req, min(computed + n, req.num_tokens))
        req.num_slots = self._g_slots(req)
        req.cached_block_tuple = None
        return True
