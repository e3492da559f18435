"""The free-block queue as an intrusive doubly linked list over two int arrays.

vLLM keeps its free blocks in ``FreeKVCacheBlockQueue`` (kv_cache_utils.py), a
doubly linked list threaded through the block objects, so that a prefix hit can
take a block out of the middle in O(1). Here the links live in two plain lists
indexed by block id (``nxt`` and ``prv``) with two sentinels past the last
block, so every operation the scheduler needs is O(1) per block touched:

- ``popleft_n(k)``: the k blocks at the head (allocation), O(k);
- ``remove(b)``: take one block out of the middle (a prefix hit), O(1);
- ``prepend(bs)`` / ``append(bs)``: freed blocks join the head (unkeyed) or
  the tail (keyed, LRU), in the given order, O(len(bs)).

Membership is not stored: a block is in the queue exactly when its reference
count is 0, which the pool tracks.
"""

from __future__ import annotations

from array import array
from typing import Iterator


class FreeBlockQueue:
    __slots__ = ("nxt", "prv", "head", "tail", "size")

    def __init__(self, num_blocks: int) -> None:
        """Blocks 1 .. num_blocks - 1 in id order (block 0 is the null block)."""
        head = num_blocks
        tail = num_blocks + 1
        self.head = head
        self.tail = tail
        # nxt[b] = b + 1 and prv[b] = b - 1 for the inner blocks. Machine
        # ints (8 bytes a block, no int objects): the queue is touched only at
        # block boundaries, never per decoded token.
        self.nxt = array("q", range(1, num_blocks + 3))
        self.prv = array("q", range(-1, num_blocks + 1))
        first, last = 1, num_blocks - 1
        self.nxt[head] = first
        self.prv[first] = head
        self.nxt[last] = tail
        self.prv[tail] = last
        self.nxt[0] = self.prv[0] = -1  # never linked
        self.size = num_blocks - 1

    def __len__(self) -> int:
        return self.size

    def popleft_n(self, k: int) -> list[int]:
        """Remove and return the first ``k`` blocks, head first."""
        if k > self.size:
            raise IndexError(f"popleft_n({k}) from a queue of {self.size}")
        nxt = self.nxt
        out: list[int] = []
        b = nxt[self.head]
        for _ in range(k):
            out.append(b)
            b = nxt[b]
        nxt[self.head] = b
        self.prv[b] = self.head
        self.size -= k
        return out

    def remove(self, b: int) -> None:
        """Unlink ``b``, which must be in the queue."""
        p = self.prv[b]
        x = self.nxt[b]
        self.nxt[p] = x
        self.prv[x] = p
        self.size -= 1

    def prepend(self, blocks: list[int]) -> None:
        """Insert ``blocks`` at the head, so that ``blocks[0]`` becomes the head."""
        if not blocks:
            return
        nxt, prv = self.nxt, self.prv
        first = nxt[self.head]
        prev = self.head
        for b in blocks:
            nxt[prev] = b
            prv[b] = prev
            prev = b
        nxt[prev] = first
        prv[first] = prev
        self.size += len(blocks)

    def append(self, blocks: list[int]) -> None:
        """Insert ``blocks`` at the tail, in order (``blocks[-1]`` becomes the tail)."""
        if not blocks:
            return
        nxt, prv = self.nxt, self.prv
        prev = prv[self.tail]
        for b in blocks:
            nxt[prev] = b
            prv[b] = prev
            prev = b
        nxt[prev] = self.tail
        prv[self.tail] = prev
        self.size += len(blocks)

    def __iter__(self) -> Iterator[int]:
        nxt = self.nxt
        b = nxt[self.head]
        while b != self.tail:
            yield b
            b = nxt[b]

    def to_list(self) -> list[int]:
        return list(self)

    def copy(self) -> "FreeBlockQueue":
        """An independent queue in the same state."""
        new: FreeBlockQueue = object.__new__(FreeBlockQueue)
        new.nxt = self.nxt[:]
        new.prv = self.prv[:]
        new.head = self.head
        new.tail = self.tail
        new.size = self.size
        return new
