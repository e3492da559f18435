"""Hybrid KV cache groups in impl: the coordinator's per-group rules (vLLM
0.33 vllm/v1/core/kv_cache_coordinator.py, single_type_kv_cache_manager.py),
written from docs/spec.md ("Hybrid KV cache groups") over impl's pool: the
free queue, the reference counts and the interned chain keys
(impl/prefix_index.py).

A hybrid layout takes the gated path for good, and its KV calls go through
``GroupsMixin`` (the plain layout never reaches this module). Keys of group
g >= 1 are the chain of the request's blocks rooted at its identity with
``GROUP_KEY_SEPARATOR + g`` appended (so the view's key is
``group_block_key(key, g)``). A sliding-window group caches only some of its
blocks, so a chain may pass through nodes no block is registered under: they
are interned without holders while a registered descendant keeps them
(``refs``), and dropped with it. A chunked-local group (ChunkedLocalAttentionManager)
frees the blocks before the chunk of the next token and keys every full
block, as full attention does. What differs by kind is the group's class in
impl/kv_kinds.py (``Layout.rules``); this module never asks a kind's name.

A running request calls the coordinator only when a step may change
something (docs/impl.md, "The hybrid steady path"): past ``cap`` (the
shortest table's slots), at ``next_full`` (a group's next full block to key)
or at ``gskip`` (a window or chunk boundary, or a Mamba state to retire, that
frees a block: ``_state_next``). Every change to a table resets the marks it
moves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

from schedspec.spec.interface import (
    GROUP_KEY_SEPARATOR,
    MEDIUM_GPU,
    BlockKey,
    BlockStored,
    KVCacheGroup,
    RequestSpec,
    SchedulerConfig,
    group_block_key,
)

from schedspec.impl.kv_events import stored_keyed
from schedspec.impl.kv_kinds import NEVER, NULL, GroupRules, rules_of
from schedspec.impl.prefix_index import KeyNode, Parent, PrefixIndex


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

class Layout:
    """The groups of a config and what the coordinator derives from them;
    each group's kind rules (impl/kv_kinds.py) in ``rules``."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.groups = config.groups
        self.bs = bs = config.block_size
        self.caching = config.enable_prefix_caching
        hb = config.hash_block_size
        #: the hash block size when caching and below the block size (partial
        #: entries: spec/kv_groups.py, GroupLayout.partial_unit), else 0
        self.partial_unit = hb if self.caching and 0 < hb < bs else 0
        #: each group's kind with its parameters
        self.rules: tuple[GroupRules, ...] = tuple(rules_of(g) for g in self.groups)
        in_flight = config.max_concurrent_batches * config.max_num_batched_tokens
        self.caps: tuple[int | None, ...] = tuple(r.cap(bs, in_flight, config.max_model_len) for r in self.rules)
        # verify_and_split_kv_cache_groups: equal specs (the kind and its
        # fields; one block size) merged in order of first appearance, the
        # downward-closed ones (full attention) first (stable); a spec is
        # (its rules, group ids)
        merged: dict[KVCacheGroup, list[int]] = {}
        for i, g in enumerate(self.groups):
            merged.setdefault(replace(g, block_size=0), []).append(i)
        specs = [(self.rules[ids[0]], tuple(ids)) for ids in merged.values()]
        specs.sort(key=lambda s: not s[0].downward_closed)
        self.specs = specs
        self.simple = len(specs) == 2 and specs[0][0].downward_closed
        self.unitary = len(self.groups) == 1
        #: Scheduler.need_mamba_block_aligned_split: a Mamba group with caching on
        #: the groups that free the blocks they skip (window, chunk, state): (g, rules)
        self.skippers = tuple((g, r) for g, r in enumerate(self.rules) if r.skips)
        #: a group keeps recurrent state (Mamba)
        self.keeps_state = any(r.keeps_state for r in self.rules)
        self.aligns = self.caching and self.keeps_state
        threshold = config.long_prefill_token_threshold
        batch = config.max_num_batched_tokens
        self.max_prefill = min(batch, threshold) if threshold > 0 else batch

    def split(self, start: int, n: int, num_prompt: int, num_tokens: int, junction: int) -> int:
        """Scheduler._mamba_block_aligned_split (docs/spec.md, "Mamba
        groups"): a prefill chunk from ``start`` ends on a block boundary
        unless it reaches the prefill's end, never runs past the last
        cacheable state, stops at a block-floored junction."""
        prefill_end = num_prompt if num_prompt > num_tokens - 1 else num_tokens - 1
        if start >= prefill_end:
            return n
        bs = self.bs
        end = start + n
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= self.max_prefill:
                end = aligned
        stop = end
        if start % bs:
            nxt = (start // bs + 1) * bs
            if start < nxt < stop:
                stop = nxt
        last = (num_tokens - 1) // bs * bs
        if start < last < stop:
            stop = last
        if start < junction < end:
            floored = start + (junction - start) // bs * bs
            if start < floored < stop:
                stop = floored
        return stop - start if stop > start else 0

    def hit(self, lookup: Callable[[int, int], int | None], max_length: int) -> tuple[list[list[int]], int, int]:
        """find_longest_cache_hit: every group's hit blocks, the hit length,
        the uncached common prefix (``lookup(g, i)``: group g's cached block
        i or None)."""
        bs = self.bs
        n = len(self.groups)
        if self.unitary:
            found, length = self._group_hit(self.specs[0], lookup, max_length)
            return found, length, 0
        blocks: list[list[int] | None] = [None] * n
        lengths = [0] * n
        hit_length, longest = max_length, 0
        while True:
            curr = hit_length
            for spec in self.specs:
                first = spec[1][0]
                if spec[0].downward_closed and blocks[first] is not None:
                    curr = min(curr, lengths[first])
                    continue
                found, curr = self._group_hit(spec, lookup, curr)
                for gid, got in zip(spec[1], found):
                    blocks[gid], lengths[gid] = got, curr
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self.simple:
                break
        for spec in self.specs:
            if spec[0].downward_closed:
                for gid in spec[1]:
                    kept = blocks[gid]
                    if kept is not None:
                        del kept[_cdiv(hit_length, bs):]
        return [b if b is not None else [] for b in blocks], hit_length, longest - hit_length

    def _group_hit(
        self, spec: tuple[GroupRules, tuple[int, ...]], lookup: Callable[[int, int], int | None], max_length: int
    ) -> tuple[list[list[int]], int]:
        rules, gids = spec

        def look(i: int) -> list[int] | None:
            out = []
            for g in gids:
                b = lookup(g, i)
                if b is None:
                    return None
                out.append(b)
            return out

        return rules.hit(look, len(gids), max_length, self.bs)


class GroupedRequest(Protocol):
    request_id: str
    block_ids: list[int]
    num_cached_blocks: int
    group_block_ids: list[list[int]]
    group_num_cached_blocks: list[int]
    shared_prefix_end: int
    num_tokens: int
    num_prompt_tokens: int
    key_root: str
    identity_marks: dict[int, str]
    num_computed_tokens: int
    num_in_flight_tokens: int
    next_full_at: int
    num_slots: int
    group_skip_from: int
    state_tracks: dict[int, list[int]]
    group_block_tuples: tuple[tuple[int, ...], ...] | None
    cached_block_tuple: tuple[int, ...] | None

    def token_range(self, start: int, end: int) -> tuple[int, ...]: ...

    @property
    def spec(self) -> RequestSpec: ...


Q = TypeVar("Q", bound=GroupedRequest)


class GroupsMixin(Generic[Q]):
    """ImplScheduler's coordinator for a hybrid layout."""

    _bs: int
    _ref: list[int]
    _fq: Any
    _px: PrefixIndex
    _caching: bool
    _hash_la: int
    _layout: Layout
    #: the keys a Mamba group cached this step (MambaManager.cached_blocks_this_step)
    _cached_now: set[Any]

    def _allocate(self, k: int) -> list[int]:
        raise NotImplementedError

    def _free(self, table: list[int]) -> None:
        raise NotImplementedError

    def _allocate_one(self) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------ tables

    @staticmethod
    def _tables(req: Q) -> list[list[int]]:
        return [req.block_ids, *req.group_block_ids]

    def _g_tables(self, req: Q) -> list[list[int]]:
        return [req.block_ids, *req.group_block_ids]

    @staticmethod
    def _group_tuples(req: Q) -> tuple[tuple[int, ...], ...]:
        """The plan's group_block_ids, cached on the request until a table
        changes (every change sets ``gtuple`` to None)."""
        gt = req.group_block_tuples
        if gt is None:
            first = req.cached_block_tuple  # group 0's, shared with the plan's block_ids
            if first is None:
                first = req.cached_block_tuple = tuple(req.block_ids)
            gt = req.group_block_tuples = (first, *(tuple(t) for t in req.group_block_ids))
        return gt

    def _g_slots(self, req: Q) -> int:
        """The token slots every group's table has (the shortest table's): a
        running request's step up to there allocates nothing."""
        n = len(req.block_ids)
        for t in req.group_block_ids:
            if len(t) < n:
                n = len(t)
        return n * self._bs

    def _clear_groups(self, req: Q) -> None:
        req.block_ids = []
        req.num_cached_blocks = 0
        req.group_block_ids = [[] for _ in req.group_block_ids]
        req.group_num_cached_blocks = [0] * len(req.group_num_cached_blocks)
        req.group_block_tuples = None
        req.group_skip_from = 0
        req.state_tracks = {}
        req.num_slots = 0
        if self._caching:
            req.next_full_at = 0  # the next cache call sets it

    def _g_free_request(self, req: Q) -> None:
        """KVCacheCoordinator.free: each group's table tail first (null
        blocks skipped), group after group."""
        for t in self._tables(req):
            self._free([b for b in t if b])
        self._clear_groups(req)

    def _g_pop_for_free(self, req: Q) -> list[int]:
        """pop_blocks_for_free: every table without its leading null blocks,
        group after group (freed later tail first)."""
        out: list[int] = []
        for t in self._tables(req):
            i = 0
            while i < len(t) and t[i] == NULL:
                i += 1
            out.extend(b for b in t[i:] if b)
        self._clear_groups(req)
        return out

    def _g_held_blocks(self, req: Q) -> tuple[int, ...]:
        return tuple(b for t in self._tables(req) for b in t if b)

    # ------------------------------------------------------------ keys

    def _roots(self, req: Q, g: int) -> tuple[str, dict[int, str]]:
        if g == 0:
            return req.key_root, req.identity_marks
        sfx = f"{GROUP_KEY_SEPARATOR}{g}"
        return req.key_root + sfx, {i: m + sfx for i, m in req.identity_marks.items()}

    def _chain(self, req: Q, g: int, upto: int, create: bool) -> list[KeyNode | None]:
        """The key nodes of group g's blocks 0 .. upto - 1 (None past the
        first missing one; ``create``: interned without holders instead)."""
        bs = self._bs
        px = self._px
        intern = px.intern
        root, marks = self._roots(req, g)
        parent: Parent = root
        out: list[KeyNode | None] = []
        for i in range(upto):
            if marks and i in marks and i > 0:
                assert isinstance(parent, KeyNode)
                parent = (parent, marks[i])
            ikey = (parent, req.token_range(i * bs, (i + 1) * bs + self._hash_la))
            node = intern.get(ikey)
            if node is None:
                if not create:
                    out.extend([None] * (upto - i))
                    return out
                node = KeyNode(ikey, 0)
                node.holders = []
                node.refs = 0
                intern[ikey] = node
                up = parent if isinstance(parent, KeyNode) else parent[0] if isinstance(parent, tuple) else None
                if up is not None:
                    up.refs += 1
            out.append(node)
            parent = node
        return out

    def _g_register_block(self, req: Q, g: int, i: int, block: int, prev: KeyNode | None = None) -> KeyNode:
        """Register ``block`` as group g's block i (its key's chain interned);
        ``prev``: the node of block i - 1 when the caller holds it. Returns
        the block's node."""
        bs = self._bs
        parent: Parent
        if i == 0:
            root, marks = self._roots(req, g)
            parent = root
        else:
            if prev is None:
                # the node of block i - 1 when this group keyed it (the block
                # is held, so its key stays); else (a window's block left
                # unkeyed, a null block) the chain from block 0
                before = (req.block_ids if g == 0 else req.group_block_ids[g - 1])[i - 1]
                prev = self._px.block_node[before] if before != NULL else None
                if prev is None:
                    prev = self._chain(req, g, i, True)[-1]
                assert prev is not None
            parent = prev
            marks = req.identity_marks
            if marks and i in marks:
                _, marks = self._roots(req, g)
                parent = (prev, marks[i])
        return self._px.register(block, parent, req.token_range(i * bs, (i + 1) * bs + self._hash_la))

    def _g_cache(self, req: Q, num_tokens: int) -> None:
        """KVCacheCoordinator.cache_blocks: the blocks full at ``num_tokens``
        (at most the known tokens) get their group's key, a sliding-window
        group's only those its mask keeps; the null block never. With EAGLE's
        hash lookahead L a block waits for the L tokens after it."""
        if not self._caching:
            return
        bs = self._bs
        end = min(num_tokens, req.num_tokens - self._hash_la) // bs
        lay = self._layout
        partial = lay.partial_unit
        boundaries: list[int] | None = None
        events = self._px.events
        least = NEVER
        for g, rules in enumerate(lay.rules):
            if g == 0:
                table, start = req.block_ids, req.num_cached_blocks
            else:
                table, start = req.group_block_ids[g - 1], req.group_num_cached_blocks[g - 1]
            if start < end:
                mask = None
                if rules.masks:
                    if boundaries is None:
                        boundaries = [req.num_prompt_tokens - 1]
                        if req.shared_prefix_end:
                            boundaries.append(req.shared_prefix_end)
                    mask = rules.cache_mask(start, end, bs, boundaries)
                kept = [] if mask is not None and True not in mask else (
                    self._g_key_blocks(req, g, rules, table, start, end, mask))
                if events is not None:
                    events.append(stored_keyed(req, table, self._px.block_node, start, end, kept, bs, g,
                                               lay.groups[g].kind, self._hash_la))
                if g == 0:
                    req.num_cached_blocks = end
                else:
                    req.group_num_cached_blocks[g - 1] = end
                start = end
            if start < least:
                least = start
            if partial and rules.caches_partial_tail:
                self._g_partial_tail(req, g, rules, table, end * bs)
        # the least token count at which a group has a new full block to key
        req.next_full_at = (least + 1) * bs

    def _g_key_blocks(self, req: Q, g: int, rules: GroupRules, table: list[int], start: int, end: int,
                      mask: list[bool] | None) -> list[int]:
        """Key group g's blocks start .. end - 1 that are not null and that
        ``mask`` keeps (None: all), in order; the indices keyed. A Mamba
        state keyed joins the states cached this step."""
        kept: list[int] = []
        prev: KeyNode | None = None  # the node of the block just keyed
        for i in range(start, end):
            block = table[i]
            if block == NULL or (mask is not None and not mask[i - start]):
                prev = None
                continue
            prev = self._g_register_block(req, g, i, block, prev)
            kept.append(i)
            if rules.keeps_state:
                self._cached_now.add(prev.full_key())
        return kept

    def _g_partial_tail(self, req: Q, g: int, rules: GroupRules, table: list[int], cacheable: int) -> None:
        """FullAttentionManager._cache_partial_tail_block with ``cacheable``
        tokens (rounded down to the block size): the prompt's last hash
        boundary inside a full block becomes a partial entry of it (spec:
        KVPool.cache_partial_tail). A partial tail is only registered in the
        call that keys its block (or takes it in a hit), so the calls
        ``next_full_at`` skips would change nothing."""
        hb, bs = self._layout.partial_unit, self._bs
        t = (req.num_prompt_tokens - 1) // hb * hb
        if t == 0 or t > cacheable or t % bs == 0 or t // bs >= len(table) or table[t // bs] == NULL:
            return
        block = table[t // bs]
        spec = req.spec

        def key_at(n: int) -> BlockKey:
            return (spec.block_identity(n), req.token_range(0, n))

        key = key_at(t)

        def stored() -> BlockStored:
            return BlockStored(
                block_keys=(key,), parent_key=key_at(t - hb) if t > hb else None,
                token_ids=key[1][t - hb:], block_size=hb, lora_id=spec.lora_id or None,
                medium=MEDIUM_GPU, group=g, kind=rules.vllm_kind)

        self._px.add_partial(block, group_block_key(key, g), stored)

    # ------------------------------------------------------------ hits and counts

    def _g_find_hit(self, req: Q) -> tuple[list[list[int]], int]:
        """get_computed_blocks: each group's hit and the hit length; records
        the shared-prefix junction."""
        req.shared_prefix_end = 0
        lay = self._layout
        if not self._caching:
            return [[] for _ in lay.groups], 0
        bs = self._bs
        max_length = req.num_tokens - max(1, self._hash_la)  # only hashed blocks hit
        max_blocks = max_length // bs
        chains: dict[int, list[KeyNode | None]] = {}

        def lookup(g: int, i: int) -> int | None:
            chain = chains.get(g)
            if chain is None:
                chain = chains[g] = self._chain(req, g, max_blocks, False)
            node = chain[i]
            if node is None or not node.holders:
                return None
            return node.holders[0]

        hits, length, uncached = lay.hit(lookup, max_length)
        req.shared_prefix_end = length + uncached if uncached else 0
        return hits, length

    def _num_evictable(self, blocks: Sequence[int]) -> int:
        ref = self._ref
        return sum(1 for b in blocks if b != NULL and ref[b] == 0)

    def _g_need(self, req: Q, num_tokens: int, hit: list[list[int]] | None, computed: int, cap: bool = False) -> int:
        """get_num_blocks_to_allocate summed over the groups."""
        lay = self._layout
        bs = self._bs
        total = 0
        needed = _cdiv(num_tokens, bs)
        for g, rules in enumerate(lay.rules):
            table = req.block_ids if g == 0 else req.group_block_ids[g - 1]
            if rules.keeps_state:
                if hit:
                    total += self._state_need(table, num_tokens, hit[g])
                else:  # _state_need without a hit: at most one block past the table
                    k = needed - len(table)
                    total += k if k < 1 else 1
                continue
            required = needed
            c = lay.caps[g]
            if cap and c is not None:
                required = min(required, c)
            skipped = rules.skipped_tokens(computed) // bs if rules.skips else 0
            if not hit:  # a running request: no hit blocks to take from the free queue
                total += max(required - max(skipped, len(table)), 0)
                continue
            new = hit[g]
            total += max(required - max(skipped, len(new) + len(table)), 0)
            total += self._num_evictable(new[max(0, skipped - len(table)):])
        return total

    def _state_need(self, table: list[int], num_tokens: int, new: Sequence[int]) -> int:
        """MambaManager.get_num_blocks_to_allocate ("align"): a hit on a state
        cached this step waits (more than the pool); else at most one new
        block past the table and the hit, plus the hit's free blocks."""
        if new:
            node = self._px.block_node[new[-1]]
            if node is not None and node.full_key() in self._cached_now:
                return len(self._ref) + 1
        k = _cdiv(num_tokens, self._bs) - len(new) - len(table)
        if k > 1:
            k = 1
        return k + self._num_evictable(new)

    def _state_grow(self, req: Q, g: int, table: list[int], num_tokens: int) -> bool:
        """MambaManager.allocate_new_blocks ("align"): the table's last block
        becomes the previous state, null places up to the last one, one new
        block there."""
        track = req.state_tracks.get(g)
        if track is None:
            track = req.state_tracks[g] = [0, -1, 0]
        required = _cdiv(num_tokens, self._bs)
        prev = len(table)
        if required <= prev:
            track[0] = 1
            return False
        if track[0] or prev:
            track[1] = prev - 1
        if prev < required - 1:
            table.extend([NULL] * (required - 1 - prev))
        table.append(self._allocate_one())
        track[0] = 1
        nxt = self._state_next(table, track)
        if nxt < req.group_skip_from:
            req.group_skip_from = nxt
        return True

    def _state_next(self, table: list[int], track: list[int]) -> int:
        """The fewest processed tokens at which ``_state_retire`` frees a
        block, the table and its track as they are: past the block after the
        previous state, or past the first unretired block that is not null
        (NEVER when there is none). Below it the call changes nothing."""
        bs = self._bs
        nxt = NEVER
        ls = track[1]
        if ls >= 0 and table[ls] != NULL:
            nxt = (ls + 1) * bs + 1
        for i in range(track[2], len(table)):
            if table[i] != NULL:
                if (i + 1) * bs + 1 < nxt:
                    nxt = (i + 1) * bs + 1
                break
        return nxt

    def _state_retire(self, req: Q, g: int, table: list[int], processed: int) -> int:
        """MambaManager.remove_skipped_blocks ("align"): the unretired blocks
        before the last processed token's state (nulls skipped), then the
        previous state once processed passes the block after it. Returns
        ``_state_next`` after it."""
        track = req.state_tracks.get(g)
        if track is None:
            track = req.state_tracks[g] = [0, -1, 0]
        bs = self._bs
        if processed > 1:
            last = (processed - 1) // bs
            if last > len(table):
                last = len(table)
            if track[2] < last:
                freed = []
                for i in range(last - 1, track[2] - 1, -1):
                    if table[i] != NULL:
                        freed.append(table[i])
                        table[i] = NULL
                track[2] = last
                if freed:
                    self._free_ordered(freed)
                    req.group_block_tuples = None
                    if g == 0:
                        req.cached_block_tuple = None
        ls = track[1]
        if 0 <= ls < _cdiv(processed, bs) - 1 and table[ls] != NULL:
            self._free([table[ls]])
            table[ls] = NULL
            req.group_block_tuples = None
            if g == 0:
                req.cached_block_tuple = None
        return self._state_next(table, track)

    # ------------------------------------------------------------ allocation

    def _g_take_hit(self, req: Q, hit: list[list[int]], num_local: int, num_external: int) -> None:
        """allocate_new_computed_blocks: every group takes its hit (the
        blocks the window skips become null), then blocks for the external
        tokens it keeps."""
        bs = self._bs
        lay = self._layout
        tables = self._tables(req)
        total = num_local + num_external
        ref = self._ref
        fq = self._fq
        if lay.keeps_state:
            req.group_skip_from = 0  # a state table grows: the next step retires what it may
        for g, rules in enumerate(lay.rules):
            skipped = rules.skipped_tokens(total) // bs
            kept = list(hit[g][skipped:]) if hit else []
            if self._caching:
                for b in kept:
                    if b == NULL:
                        continue
                    if ref[b] == 0:
                        fq.remove(b)
                    ref[b] += 1
            tables[g].extend([NULL] * skipped + kept)
            req.group_block_tuples = None
            if g == 0:
                req.num_cached_blocks = len(tables[g])
            else:
                req.group_num_cached_blocks[g - 1] = len(tables[g])
        if num_external <= 0:
            return
        for g, rules in enumerate(lay.rules):
            if min(total - rules.skipped_tokens(total), num_external) <= 0:
                continue
            k = max(0, _cdiv(total, bs) - len(tables[g]))
            if k:
                tables[g].extend(self._allocate(k))

    def _g_grow(self, req: Q, num_tokens: int) -> bool:
        """allocate_new_blocks: each group's table to cdiv(num_tokens).
        Whether a table grew."""
        bs = self._bs
        grew = False
        for g, rules in enumerate(self._layout.rules):
            t = req.block_ids if g == 0 else req.group_block_ids[g - 1]
            if rules.keeps_state:
                if not self._state_grow(req, g, t, num_tokens):
                    continue
            else:
                k = _cdiv(num_tokens, bs) - len(t)
                if k <= 0:
                    continue
                if k == 1:
                    t.append(self._allocate_one())
                else:
                    t.extend(self._allocate(k))
            grew = True
            if g == 0:
                req.cached_block_tuple = None
        if grew:
            req.group_block_tuples = None
        return grew

    def _g_remove_skipped(self, req: Q, processed: int) -> None:
        """remove_skipped_blocks: each sliding-window group frees the blocks
        wholly before its window, each chunked-local group those wholly
        before the chunk of the next token (last skipped first), null in
        their places; ``req.group_skip_from`` becomes the processed-token count at
        which the next call would free a block."""
        bs = self._bs
        gskip = NEVER
        for g, rules in self._layout.skippers:
            table = req.block_ids if g == 0 else req.group_block_ids[g - 1]
            if rules.keeps_state:
                nxt = self._state_retire(req, g, table, processed)
                if nxt < gskip:
                    gskip = nxt
                continue
            skipped = rules.skipped_tokens(processed)
            n = min(skipped // bs, len(table)) if skipped > 0 else 0
            # blocks 0 .. n - 1 are null once this call is done (the null
            # blocks are a prefix of the table), so until skipped_tokens
            # passes block n, calling again changes nothing
            nxt = rules.next_skip(n, bs)
            if nxt < gskip:
                gskip = nxt
            if n <= 0:
                continue
            freed: list[int] = []
            for i in range(n - 1, -1, -1):
                if table[i] == NULL:
                    break
                freed.append(table[i])
                table[i] = NULL
            if freed:
                req.group_block_tuples = None
                if g == 0:  # a lone sliding-window group
                    req.cached_block_tuple = None
                self._free_ordered(freed)
        req.group_skip_from = gskip

    def _free_ordered(self, ordered: list[int]) -> None:
        """BlockPool.free_blocks of blocks already in eviction order."""
        self._free(ordered[::-1])
