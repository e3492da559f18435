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

A kind that keeps a recurrent state instead of keys and values
(``keeps_state``: ``MambaState``) does not attend: its layers run the
recurrence of ``MambaState`` (``gates``, ``scan``) from the state block the
plan names and write the state after the step's last token to the block the
plan names for it.
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
    #: whether its layers keep one recurrent state per request (in state
    #: blocks) instead of every position's keys and values
    keeps_state: ClassVar[bool] = False
    #: the config fields vLLM forces for a layout with this kind (what the
    #: matrix's baseline and variants must turn on)
    requires: ClassVar[tuple[str, ...]] = ()

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

    # A kind that keeps a state (``keeps_state``) overrides these four.

    def read_place(self, computed: int, block_size: int) -> int | None:
        """The table place of the state a step starting at ``computed``
        reads (None: it starts from the zero state)."""
        raise NotImplementedError(f"{self.name} keeps no state")

    def write_place(self, end: int, block_size: int) -> int:
        """The table place the state after ``end`` tokens is written to."""
        raise NotImplementedError(f"{self.name} keeps no state")

    def gates(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token and channel: the recurrence's decay and input."""
        raise NotImplementedError(f"{self.name} keeps no state")

    def scan(self, a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The recurrence over the rows of ``a`` and ``b`` from ``h0``."""
        raise NotImplementedError(f"{self.name} keeps no state")

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


class MambaState(AttentionKind):
    """MambaSpec in "align" mode (spec/mamba.py): a layer keeps one
    recurrent state per request, no key or value per position. The state
    after ``end`` tokens lives in the block of position ``end - 1`` of the
    group's table (the state after ``(i + 1) * block_size`` tokens in block
    i: a checkpoint); a step reads the state after its first
    ``num_computed_tokens`` c from the block of position ``c - 1`` (none for
    c = 0: the zero state) and writes the state after its last token to the
    block of position ``c + n - 1``. Every other place of the table may hold
    the null block (the blocks MambaManager freed or skipped). vLLM's worker
    does the same in two moves (vllm/v1/worker/mamba_utils.py,
    preprocess_mamba: the state of place ``(c - 1) // block_size`` is copied
    to place ``cdiv(c + n, block_size) - 1``, where the kernel then runs in
    place).

    The recurrence is a small gated linear one, per channel of the layer's
    key/value width: ``h_t = a_t * h_{t-1} + (1 - a_t) * v_t``,
    ``y_t = o_proj(q_t * h_t)`` (h broadcast over a KV head's query heads),
    with the gate ``a_t = 1/2 + k_t / (2 (1 + |k_t|))`` in (0, 1), q, k, v
    the layer's own projections (no RoPE). Only correctly rounded
    operations, so a state is bitwise the same however the tokens were
    batched or chunked."""

    name = "mamba"
    letter = "M"
    local = True
    keeps_state = True
    inside = "the state the step reads"
    freed_feature = "state_restored"
    table_words = "a Mamba state"
    # vllm/model_executor/models/config.py, MambaModelConfig.verify_and_update_config:
    # prefix caching selects "align" mode, which asserts chunked prefill
    requires = ("enable_prefix_caching", "enable_chunked_prefill")

    def first_keys(self, size: int, pos: torch.Tensor, chunk_shift: int = 0) -> torch.Tensor:
        return pos  # attends nothing: no key before the query is read

    def describe(self, size: int) -> str:
        return "mamba state"

    def kv_group(self, size: int) -> KVCacheGroup:
        return KVCacheGroup(self.name)

    def read_place(self, computed: int, block_size: int) -> int | None:
        return (computed - 1) // block_size if computed > 0 else None

    def write_place(self, end: int, block_size: int) -> int:
        return (end - 1) // block_size

    def gates(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token and channel: the decay a in (0, 1) and the input (1 - a) v."""
        a = 0.5 + 0.5 * (k / (1.0 + k.abs()))
        return a, (1.0 - a) * v

    def scan(self, a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The recurrence over rows of ``a``, ``b`` ([n, S]) from the state
        ``h0`` ([S]): ``out[t] = a[t] * out[t-1] + b[t]`` (``out[-1]`` is h0),
        one row at a time; returns the last state."""
        h = h0
        for t in range(int(a.shape[0])):
            torch.add(a[t] * h, b[t], out=out[t])
            h = out[t]
        return h


FULL_ATTENTION = FullAttention()
SLIDING_WINDOW = SlidingWindow()
CHUNKED_LOCAL = ChunkedLocal()
MAMBA_STATE = MambaState()

#: Every attention kind, by its ``KVCacheGroup.kind`` name, in group order
#: (full attention, then sliding window, then chunked local, then Mamba).
ATTENTION: dict[str, AttentionKind] = {
    k.name: k for k in (FULL_ATTENTION, SLIDING_WINDOW, CHUNKED_LOCAL, MAMBA_STATE)}


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
    kinds = [k for k in ATTENTION.values() if k.name in names and k.freed_feature and not k.keeps_state]
    states = [f"{freed[k.freed_feature]} entries restored {k.table_words} from a checkpoint block"
              for k in ATTENTION.values() if k.name in names and k.keeps_state]
    if not kinds and states:
        return ", ".join(states)
    if not any(k.chunked for k in kinds):
        words = f"{freed[SLIDING_WINDOW.freed_feature]} entries read {SLIDING_WINDOW.table_words} holding freed (null) blocks"
    else:
        tables = [f"{k.table_words} ({freed[k.freed_feature]})" for k in kinds]
        words = f"entries that read {' and '.join(tables)} holding freed (null) blocks"
    return ", ".join([words, *states])
