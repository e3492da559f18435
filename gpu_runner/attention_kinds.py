"""The runner's attention kinds: one class per kind of KV cache group, found
through ``ATTENTION`` by the group's ``kind`` name (spec/kv_kinds.py's
registry).

What the runner knows of a kind: which keys a query attends (the paged
model's mask, ``first_key``/``first_keys``, and the dense reference's rule,
``reference_allowed``, written from the rule itself), its letter in a
``layer_pattern`` and the model argument that sizes it, the scheduler's
KVCacheGroup for its layers, and how the executor and the equivalence report
count the null entries of its tables. ``GroupAttention`` (model.py) is a
kind and its size; model.py, reference.py, executor.py and equivalence.py
call these and never compare a kind's name. A new kind is one class here and
its entry in ``ATTENTION``.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch

from schedspec.spec.interface import KVCacheGroup


class AttentionKind:
    """Full attention (vLLM's FullAttentionSpec): a query attends every
    earlier position; its tables never hold the null block."""

    #: the ``KVCacheGroup.kind`` name
    name: ClassVar[str] = "full_attention"
    #: its letter in a model's ``layer_pattern``
    letter: ClassVar[str] = "F"
    #: the PagedLlama argument that sizes it ("" for none)
    flag: ClassVar[str] = ""
    #: whether a query attends only part of the context (its freed blocks
    #: are the null block in its tables)
    local: ClassVar[bool] = False
    #: whether it cuts positions into chunks (the ``chunk_null`` fault's
    #: target, the chunk the fault workloads are built around)
    chunked: ClassVar[bool] = False
    #: what a step reads of it, as a plan error says it
    inside: ClassVar[str] = "the context"
    #: the executor's counter of entries that read its table holding a
    #: freed (null) block, and the equivalence feature it reports as
    entries_counter: ClassVar[str] = ""
    freed_feature: ClassVar[str] = ""
    #: how the equivalence report names its table
    table_words: ClassVar[str] = ""

    def first_key(self, size: int, pos: int) -> int:
        """The first position a token at ``pos`` attends (it attends
        ``first_key(pos) .. pos``)."""
        return 0

    def first_keys(self, size: int, pos: torch.Tensor, chunk_shift: int = 0) -> torch.Tensor:
        """``first_key`` of every position of ``pos`` (a tensor);
        ``chunk_shift`` moves a chunk's start (negative controls only)."""
        return torch.zeros_like(pos)

    def reference_allowed(self, size: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Whether query position q attends key position k, from the rule
        itself (k <= q is the caller's)."""
        return torch.ones_like(k <= q)

    def window(self, size: int) -> int:
        """Its sliding window (0: none)."""
        return 0

    def describe(self, size: int) -> str:
        return "full attention"

    def kv_group(self, size: int) -> KVCacheGroup:
        """The scheduler's KV cache group for layers of this kind."""
        return KVCacheGroup(self.name)


class FullAttention(AttentionKind):
    """FullAttentionSpec."""


class SlidingWindow(AttentionKind):
    """SlidingWindowSpec: a token at p attends keys p - W + 1 .. p."""

    name = "sliding_window"
    letter = "S"
    flag = "sliding_window"
    local = True
    inside = "the window the step reads"
    entries_counter = "null_block_entries"
    freed_feature = "sw_freed"
    table_words = "a sliding-window table"

    def first_key(self, size: int, pos: int) -> int:
        return max(0, pos - size + 1)

    def first_keys(self, size: int, pos: torch.Tensor, chunk_shift: int = 0) -> torch.Tensor:
        return pos - size + 1

    def reference_allowed(self, size: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q - k < size

    def window(self, size: int) -> int:
        return size

    def describe(self, size: int) -> str:
        return f"sliding window {size}"

    def kv_group(self, size: int) -> KVCacheGroup:
        return KVCacheGroup(self.name, sliding_window=size)


class ChunkedLocal(AttentionKind):
    """ChunkedLocalAttentionSpec: positions are cut into chunks of C; a token
    at p attends keys (p // C) * C .. p."""

    name = "chunked_local"
    letter = "C"
    flag = "chunked_local"
    local = True
    chunked = True
    inside = "the current chunk"
    entries_counter = "cl_null_entries"
    freed_feature = "cl_freed"
    table_words = "a chunked-local table"

    def first_key(self, size: int, pos: int) -> int:
        return pos // size * size

    def first_keys(self, size: int, pos: torch.Tensor, chunk_shift: int = 0) -> torch.Tensor:
        return torch.div(pos, size, rounding_mode="floor") * size + chunk_shift

    def reference_allowed(self, size: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return k // size == q // size

    def describe(self, size: int) -> str:
        return f"chunked local {size}"

    def kv_group(self, size: int) -> KVCacheGroup:
        return KVCacheGroup(self.name, attention_chunk_size=size)


FULL_ATTENTION = FullAttention()
SLIDING_WINDOW = SlidingWindow()
CHUNKED_LOCAL = ChunkedLocal()

#: Every attention kind, by its ``KVCacheGroup.kind`` name, in group order
#: (full attention, then sliding window, then chunked local).
ATTENTION: dict[str, AttentionKind] = {k.name: k for k in (FULL_ATTENTION, SLIDING_WINDOW, CHUNKED_LOCAL)}


def attention_of(name: str) -> AttentionKind:
    """The attention kind named ``name`` (ValueError for an unknown one)."""
    kind = ATTENTION.get(name)
    if kind is None:
        raise ValueError(f"unknown attention kind {name!r}")
    return kind


def freed_report(names: set[str], freed: Mapping[str, int]) -> str:
    """The equivalence report's words for the entries that read a table of
    the kinds ``names`` holding freed (null) blocks (``freed``: the counts
    by feature); the sliding-window reports' wording for a layout with no
    chunked-local group."""
    kinds = [k for k in ATTENTION.values() if k.name in names and k.freed_feature]
    if not any(k.chunked for k in kinds):
        return f"{freed[SLIDING_WINDOW.freed_feature]} entries read {SLIDING_WINDOW.table_words} holding freed (null) blocks"
    tables = [f"{k.table_words} ({freed[k.freed_feature]})" for k in kinds]
    return f"entries that read {' and '.join(tables)} holding freed (null) blocks"
