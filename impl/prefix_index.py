"""The prefix-cache index, keyed by interned chained keys.

The spec keys a cached full block by its content, ``BlockKey = (salt, every
token from the start of the request through the end of the block)``. Building
and hashing that tuple costs O(position) per block. Here the key of block i is
the pair ``(key node of block i - 1, the block's own tokens)`` (for block 0:
``(salt, tokens)``), interned to a ``KeyNode``: two blocks get the same node
exactly when their salts and full prefixes are equal (induction on i), so the
index behaves like the spec's, at O(block_size) per block.

A block key's identity part (RequestSpec.block_identity: the salt, the LoRA
adapter, the encoder inputs starting before the block's end) is the root of
the chain, and it can only grow along a request's blocks: where it changes
(an encoder input starts inside block i, i >= 1), block i's parent is the
pair ``(node of block i - 1, new identity)`` instead of the bare node. Two
such keys are equal exactly when the prefixes and the new identities are; a
marked key never equals an unmarked one of an equal prefix, whose identity
did not change there.

A node lives while it has holders (blocks registered under it) or children
(nodes whose parent it is); it is dropped when both reach zero, so the intern
table never outgrows the cache. ``holders`` lists the blocks registered under
the key in insertion order: a lookup returns the first, and the order is the
spec's ``cache_index`` order. It almost always holds one block (two only when
two requests computed the same block at once), so a list (O(k) removal, k
tiny) is both the fastest and the smallest choice; the node keeps the intern
key tuple itself rather than a copy of its parts.
"""

from __future__ import annotations

from typing import Callable, Union

from schedspec.spec.interface import (
    MEDIUM_GPU,
    BlockKey,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    block_key_group,
    plain_key,
)



def removed(ekey: tuple[BlockKey, int]) -> BlockRemoved:
    """``BlockRemoved((key,), MEDIUM_GPU, group)`` for a node's ``ekey``
    ``(key, group)``, built by filling its ``__dict__`` (equal to the
    constructor's: tests/impl/test_kv_events.py)."""
    event = object.__new__(BlockRemoved)
    fields = event.__dict__
    fields["block_keys"] = (ekey[0],)
    fields["medium"] = MEDIUM_GPU
    fields["group"] = ekey[1]
    return event

class KeyNode:
    __slots__ = ("ikey", "holders", "refs", "ekey")

    def __init__(self, ikey: tuple["Parent", tuple[int, ...]], block: int) -> None:
        self.ikey = ikey  # (parent node or salt, this block's tokens)
        self.holders: list[int] = [block]
        self.refs = 1  # len(holders) + number of child nodes
        #: with events on, (the key an event names, the group) as the
        #: BlockStored that registered the node named it (impl/kv_events.py),
        #: so its BlockRemoved costs O(1), not a walk of the chain; else None
        self.ekey: tuple[BlockKey, int] | None = None

    @property
    def parent(self) -> "Parent":
        return self.ikey[0]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.ikey[1]

    def full_key(self, lookahead: int = 0) -> BlockKey:
        """The spec's BlockKey of this node (slow; for views). With hash
        lookahead each node's tokens end with the ``lookahead`` tokens after
        its block, which the next node's tokens repeat."""
        chunks: list[tuple[int, ...]] = []
        identity: str | None = None
        node: KeyNode = self
        while True:
            chunks.append(node.tokens)
            parent = node.ikey[0]
            if isinstance(parent, KeyNode):
                node = parent
            elif isinstance(parent, tuple):
                if identity is None:
                    identity = parent[1]  # the nearest change is the block's identity
                node = parent[0]
            else:
                if identity is None:
                    identity = parent
                break
        toks: list[int] = []
        for c in reversed(chunks[1:]):
            toks.extend(c[: len(c) - lookahead])
        toks.extend(chunks[0])
        return (identity, tuple(toks))


#: A key's parent: the previous block's node, the chain's root identity, or
#: the previous node with the identity that changes at this block.
Parent = Union[KeyNode, str, tuple[KeyNode, str]]


def _parent_node(parent: Parent) -> KeyNode | None:
    if isinstance(parent, KeyNode):
        return parent
    if isinstance(parent, tuple):
        return parent[0]
    return None


class PrefixIndex:
    """Intern table plus per-block key. ``block_node[b]`` is the key node of
    block ``b`` or None."""

    __slots__ = ("intern", "block_node", "events", "lookahead", "partial", "partial_index")

    def __init__(self, num_blocks: int) -> None:
        #: the tokens after a block its key covers (EAGLE's hash lookahead)
        self.lookahead = 0
        self.intern: dict[tuple[Parent, tuple[int, ...]], KeyNode] = {}
        self.block_node: list[KeyNode | None] = [None] * num_blocks
        #: partial entries (a hash block size below the block size), as the
        #: spec keeps them (spec/kv_cache.py): block -> its partial keys (the
        #: group's), key -> its blocks, both in registration order; rare, so
        #: plain BlockKeys
        self.partial: dict[int, list[BlockKey]] = {}
        self.partial_index: dict[BlockKey, list[int]] = {}
        #: the KV cache events since the last take (impl/kv_events.py); None: off
        self.events: list[KVCacheEvent] | None = None

    def lookup(self, parent: Parent, tokens: tuple[int, ...]) -> KeyNode | None:
        """The node with holders under this key, or None (no cached block)."""
        node = self.intern.get((parent, tokens))
        if node is None or not node.holders:
            return None
        return node

    def register(self, block: int, parent: Parent, tokens: tuple[int, ...]) -> KeyNode:
        """Register ``block`` under the key (parent, tokens); returns its node."""
        ikey = (parent, tokens)
        node = self.intern.get(ikey)
        if node is None:
            node = KeyNode(ikey, block)
            self.intern[ikey] = node
            up = _parent_node(parent)
            if up is not None:
                up.refs += 1
        else:
            node.holders.append(block)
            node.refs += 1
        self.block_node[block] = node
        return node

    def register_chain(
        self, blocks: list[int], start: int, parent: Parent, chunks: list[tuple[int, ...]]
    ) -> None:
        """``register`` for ``blocks[start + i]`` under ``chunks[i]``, each
        block's parent being the node of the one before (the first's:
        ``parent``): one call for the blocks a step fills."""
        intern = self.intern
        block_node = self.block_node
        j = start
        for tokens in chunks:
            block = blocks[j]
            j += 1
            ikey = (parent, tokens)
            node = intern.get(ikey)
            if node is None:
                node = KeyNode(ikey, block)
                intern[ikey] = node
                if parent.__class__ is KeyNode:
                    parent.refs += 1
            else:
                node.holders.append(block)
                node.refs += 1
            block_node[block] = node
            parent = node

    def register_marked(
        self, blocks: list[int], start: int, parent: Parent, chunks: list[tuple[int, ...]],
        marks: dict[int, str],
    ) -> None:
        """``register_chain`` for a request whose identity changes at the
        block indices of ``marks`` (index -> the identity from that block on)."""
        j = start
        for tokens in chunks:
            mark = marks.get(j)
            if mark is not None and j > 0:
                assert isinstance(parent, KeyNode)
                parent = (parent, mark)
            parent = self.register(blocks[j], parent, tokens)
            j += 1

    def evict(self, block: int) -> None:
        """Drop the key of ``block`` (which has one)."""
        node = self.block_node[block]
        assert node is not None
        if self.events is not None:  # BlockPool._emit_block_removed_events
            ekey = node.ekey
            if ekey is None:
                key = node.full_key(self.lookahead)
                ekey = (plain_key(key), block_key_group(key))
            self.events.append(removed(ekey))
        self.block_node[block] = None
        if self.partial:
            self._drop_partial(block)
        node.holders.remove(block)
        node.refs -= 1
        while node.refs == 0:
            del self.intern[node.ikey]
            up = _parent_node(node.ikey[0])
            if up is None:
                break
            up.refs -= 1
            node = up

    def _drop_partial(self, block: int) -> None:
        """The partial entries of ``block`` go with its full key, each with
        its BlockRemoved after the full key's (spec: KVPool._drop_partial_keys)."""
        keys = self.partial.pop(block, None)
        if keys is None:
            return
        for key in keys:
            holders = self.partial_index[key]
            holders.remove(block)
            if not holders:
                del self.partial_index[key]
            if self.events is not None:
                self.events.append(removed((plain_key(key), block_key_group(key))))

    def add_partial(self, block: int, key: BlockKey, stored: Callable[[], BlockStored]) -> None:
        """Register ``block`` (full, keyed) under the partial ``key`` unless it
        carries it already; ``stored()`` builds the BlockStored then emitted
        (spec: KVPool.cache_partial_block)."""
        keys = self.partial.get(block)
        if keys is None:
            keys = self.partial[block] = []
        elif key in keys:
            return
        keys.append(key)
        self.partial_index.setdefault(key, []).append(block)
        if self.events is not None:
            self.events.append(stored())

    def copy(self) -> "PrefixIndex":
        """An independent index in the same state (nodes copied, parents
        remapped). A node enters the intern table after its parent and leaves
        it before, so table order visits every parent before its children."""
        new: PrefixIndex = object.__new__(PrefixIndex)
        remap: dict[int, KeyNode] = {}
        intern: dict[tuple[Parent, tuple[int, ...]], KeyNode] = {}
        for (parent, tokens), node in self.intern.items():
            if isinstance(parent, KeyNode):
                parent = remap[id(parent)]
            elif isinstance(parent, tuple):
                parent = (remap[id(parent[0])], parent[1])
            ikey = (parent, tokens)
            n: KeyNode = object.__new__(KeyNode)
            n.ikey = ikey
            n.holders = node.holders[:]
            n.refs = node.refs
            n.ekey = node.ekey
            intern[ikey] = n
            remap[id(node)] = n
        new.intern = intern
        new.block_node = [None if nd is None else remap[id(nd)] for nd in self.block_node]
        new.events = None if self.events is None else self.events[:]
        new.lookahead = self.lookahead
        new.partial = {b: keys[:] for b, keys in self.partial.items()}
        new.partial_index = {k: blocks[:] for k, blocks in self.partial_index.items()}
        return new

    def clear(self) -> None:
        self.intern.clear()
        self.partial.clear()
        self.partial_index.clear()
        n = len(self.block_node)
        self.block_node = [None] * n

    def views(self) -> tuple[dict[int, BlockKey], dict[BlockKey, tuple[int, ...]]]:
        """(block_keys, cache_index) as the spec reports them."""
        memo: dict[int, BlockKey] = {}
        block_keys: dict[int, BlockKey] = {}
        index: dict[BlockKey, tuple[int, ...]] = {}
        for b, node in enumerate(self.block_node):
            if node is None:
                continue
            key = memo.get(id(node))
            if key is None:
                key = node.full_key(self.lookahead)
                memo[id(node)] = key
                index[key] = tuple(node.holders)
            block_keys[b] = key
        return block_keys, index
