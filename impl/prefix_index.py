"""The prefix-cache index, keyed by interned chained keys.

The spec keys a cached full block by its content, ``BlockKey = (salt, every
token from the start of the request through the end of the block)``. Building
and hashing that tuple costs O(position) per block. Here the key of block i is
the pair ``(key node of block i - 1, the block's own tokens)`` (for block 0:
``(salt, tokens)``), interned to a ``KeyNode``: two blocks get the same node
exactly when their salts and full prefixes are equal (induction on i), so the
index behaves like the spec's, at O(block_size) per block.

A node lives while it has holders (blocks registered under it) or children
(nodes whose parent it is); it is dropped when both reach zero, so the intern
table never outgrows the cache. ``holders`` is an insertion-ordered dict used
as an ordered set: a lookup returns the first holder, a removal is O(1), and
the order is the spec's ``cache_index`` order.
"""

from __future__ import annotations

from typing import Union

from spec.interface import BlockKey


class KeyNode:
    __slots__ = ("parent", "tokens", "holders", "refs", "ikey")

    def __init__(self, parent: Union["KeyNode", str], tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.tokens = tokens
        self.holders: dict[int, None] = {}
        self.refs = 0  # len(holders) + number of child nodes
        self.ikey: tuple[Union[KeyNode, str], tuple[int, ...]] = (parent, tokens)

    def full_key(self) -> BlockKey:
        """The spec's BlockKey of this node (slow; for views)."""
        chunks: list[tuple[int, ...]] = []
        node: KeyNode | str = self
        while isinstance(node, KeyNode):
            chunks.append(node.tokens)
            node = node.parent
        toks: list[int] = []
        for c in reversed(chunks):
            toks.extend(c)
        return (node, tuple(toks))


Parent = Union[KeyNode, str]


class PrefixIndex:
    """Intern table plus per-block key. ``block_node[b]`` is the key node of
    block ``b`` or None."""

    __slots__ = ("intern", "block_node")

    def __init__(self, num_blocks: int) -> None:
        self.intern: dict[tuple[Parent, tuple[int, ...]], KeyNode] = {}
        self.block_node: list[KeyNode | None] = [None] * num_blocks

    def lookup(self, parent: Parent, tokens: tuple[int, ...]) -> KeyNode | None:
        """The node with holders under this key, or None (no cached block)."""
        node = self.intern.get((parent, tokens))
        if node is None or not node.holders:
            return None
        return node

    def register(self, block: int, parent: Parent, tokens: tuple[int, ...]) -> None:
        ikey = (parent, tokens)
        node = self.intern.get(ikey)
        if node is None:
            node = KeyNode(parent, tokens)
            self.intern[ikey] = node
            if isinstance(parent, KeyNode):
                parent.refs += 1
        node.holders[block] = None
        node.refs += 1
        self.block_node[block] = node

    def evict(self, block: int) -> None:
        """Drop the key of ``block`` (which has one)."""
        node = self.block_node[block]
        assert node is not None
        self.block_node[block] = None
        del node.holders[block]
        node.refs -= 1
        while node.refs == 0:
            del self.intern[node.ikey]
            parent = node.parent
            if not isinstance(parent, KeyNode):
                break
            parent.refs -= 1
            node = parent

    def clear(self) -> None:
        self.intern.clear()
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
                key = node.full_key()
                memo[id(node)] = key
                index[key] = tuple(node.holders)
            block_keys[b] = key
        return block_keys, index
