"""The checking engine's KV cache group kinds: one class per kind, found
through ``KINDS`` by the group's ``kind`` name (spec/kv_kinds.py's registry).

What the engine knows of a kind: how the generator draws a group of it
(check/kv_requests.py, draw_kv_groups), which ``Stats`` counter the null entries
of its tables count to (check/stats.py), and which positions the fake
model's oracle expects a query to read back through its table
(check/oracle.py, the kind's attention rule, written apart from the spec's
get_num_skipped_tokens so the oracle stays an independent check). A new kind
is one class here and its entry in ``KINDS``.
"""

from __future__ import annotations

import random
from typing import ClassVar

from schedspec.spec.interface import KVCacheGroup


class CheckKind:
    """Full attention: drawn as the default group, a query reads the whole
    context, its tables never hold the null block."""

    #: the Stats field the new null entries of its tables add to (a
    #: full-attention table has none; an unknown kind counts as a window)
    frees_stat: ClassVar[str] = "sliding_window_frees"

    def draw(self, block_size: int, rng: random.Random) -> KVCacheGroup:
        """A group of this kind, its parameters drawn from ``rng``."""
        return KVCacheGroup()

    def local(self, group: KVCacheGroup) -> bool:
        """Whether a query reads only part of the context (its manager frees
        the blocks before that part)."""
        return False

    def first_read(self, group: KVCacheGroup, end: int) -> int:
        """The first position the query at position ``end - 1`` reads."""
        return 0


class FullAttention(CheckKind):
    """FullAttentionManager: every earlier position."""


class SlidingWindow(CheckKind):
    """SlidingWindowManager: the last W positions, a window of 1 to 4 blocks,
    block-aligned half the time, else ending inside its last block."""

    frees_stat = "sliding_window_frees"

    def draw(self, block_size: int, rng: random.Random) -> KVCacheGroup:
        k = rng.randint(1, 4)
        window = k * block_size if rng.random() < 0.5 else rng.randint((k - 1) * block_size + 1, k * block_size)
        return KVCacheGroup("sliding_window", sliding_window=window)

    def local(self, group: KVCacheGroup) -> bool:
        return True

    def first_read(self, group: KVCacheGroup, end: int) -> int:
        return max(0, end - group.sliding_window)


class ChunkedLocal(CheckKind):
    """ChunkedLocalAttentionManager: the positions of the query's own chunk;
    a chunk of 1 to 4 whole blocks (vLLM's chunked local attention backend
    takes no other), short so that a few hundred steps free blocks."""

    frees_stat = "chunked_local_frees"

    def draw(self, block_size: int, rng: random.Random) -> KVCacheGroup:
        return KVCacheGroup("chunked_local", attention_chunk_size=rng.randint(1, 4) * block_size)

    def local(self, group: KVCacheGroup) -> bool:
        return True

    def first_read(self, group: KVCacheGroup, end: int) -> int:
        chunk = group.attention_chunk_size
        return max(0, end - 1) // chunk * chunk


class Mamba(CheckKind):
    """MambaManager in "align" mode: a query reads its state, the block
    holding the state of its last position (written through the group's
    table by the chunk that reaches it); every earlier place may be the
    null block."""

    frees_stat = "mamba_frees"

    def draw(self, block_size: int, rng: random.Random) -> KVCacheGroup:
        return KVCacheGroup("mamba")

    def local(self, group: KVCacheGroup) -> bool:
        return True

    def first_read(self, group: KVCacheGroup, end: int) -> int:
        return max(0, end - 1)


FULL_ATTENTION = FullAttention()
SLIDING_WINDOW = SlidingWindow()
CHUNKED_LOCAL = ChunkedLocal()
MAMBA = Mamba()

#: Every kind the engine knows, by its ``KVCacheGroup.kind`` name.
KINDS: dict[str, CheckKind] = {
    "full_attention": FULL_ATTENTION,
    "sliding_window": SLIDING_WINDOW,
    "chunked_local": CHUNKED_LOCAL,
    "mamba": MAMBA,
}


def check_kind(name: str) -> CheckKind:
    """The engine's class of the kind named ``name`` (an unknown name: the
    base class, full attention's rules)."""
    return KINDS.get(name, FULL_ATTENTION)
