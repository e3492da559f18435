"""impl's KV cache events: the same stream as the spec's (spec/kv_events.py
states the rules and cites vLLM 0.33), built only while events are on
(``PrefixIndex.events`` is a list, not None): the callers test that one
attribute and build nothing otherwise.

impl keys blocks by interned chained nodes; an event carries the spec's
BlockKey, spelled as group 0 spells it, which is computed here from the
request's own identity and tokens (one slice per block, and only with events
on). ``stored_keyed`` also leaves each registered block's key on its node
(``KeyNode.ekey``), so the block's BlockRemoved reads it instead of walking
the chain back to the root (O(position) per removal, quadratic over a long
prefix)."""

from __future__ import annotations

from typing import Protocol, Sequence

from schedspec.impl.kv_kinds import KINDS
from schedspec.impl.prefix_index import KeyNode
from schedspec.spec.interface import (
    MEDIUM_GPU,
    BlockKey,
    BlockStored,
    RequestSpec,
)


class Request(Protocol):
    """What an event reads of a request (impl/request.py's Request)."""

    def token_range(self, start: int, end: int) -> tuple[int, ...]: ...

    @property
    def identity_marks(self) -> dict[int, str]: ...

    @property
    def spec(self) -> RequestSpec: ...


def request_key(req: Request, i: int, block_size: int) -> BlockKey:
    """The group-0 key of block ``i`` of ``req`` (RequestSpec.block_identity
    and every token through the block)."""
    end = (i + 1) * block_size
    return (req.spec.block_identity(end), req.token_range(0, end))


def stored_keyed(req: Request, table: Sequence[int], block_node: Sequence[KeyNode | None], start: int,
                 end: int, kept: list[int], block_size: int, group: int, kind: str) -> BlockStored:
    """``stored``, the parent key read off the node of block ``start - 1``
    where it has one, and each kept block's node (``block_node[table[i]]``)
    given the key and group its BlockRemoved will name, where it has none yet
    (a node is one key: a second holder's key is the same)."""
    # one tuple of the tokens through block end - 1, each key a slice of it;
    # the identity computed once where it is the same for every block (no
    # identity marks: RequestSpec.block_identity of block 0)
    tokens = req.token_range(0, end * block_size)
    if req.identity_marks:
        keys = tuple((req.spec.block_identity((i + 1) * block_size), tokens[: (i + 1) * block_size]) for i in kept)
    else:
        spec = req.spec
        # block_identity is the bare salt without an adapter or encoder input
        identity = spec.salt if not (spec.lora_id or spec.mm_inputs) else spec.block_identity(block_size)
        keys = tuple((identity, tokens[: (i + 1) * block_size]) for i in kept)
    parent_key: BlockKey | None = None
    if start > 0:
        up = block_node[table[start - 1]]
        ekey = None if up is None else up.ekey
        parent_key = request_key(req, start - 1, block_size) if ekey is None else ekey[0]
    for i, key in zip(kept, keys):
        node = block_node[table[i]]
        if node is not None and node.ekey is None:
            node.ekey = (key, group)
    return BlockStored(
        block_keys=keys,
        parent_key=parent_key,
        token_ids=tokens[start * block_size :],
        block_size=block_size,
        lora_id=req.spec.lora_id or None,
        medium=MEDIUM_GPU,
        group=group,
        kind=KINDS[kind].vllm_kind,
    )


def reused(req: Request, counts: Sequence[int], kinds: Sequence[str], block_size: int) -> list[BlockStored]:
    """The "reused" BlockStored of a prefix hit of a request whose
    kv_cache_report_mode is "full" (spec/kv_events.py): for each group g
    with ``counts[g]`` > 0 hit blocks, the request's keys of blocks 0 ..
    counts[g] - 1, parent None, their tokens (one token tuple sliced)."""
    top = max(counts, default=0)
    tokens = req.token_range(0, top * block_size)
    marks = req.identity_marks
    spec = req.spec
    plain = None if marks else (spec.salt if not (spec.lora_id or spec.mm_inputs) else spec.block_identity(block_size))
    keys = tuple((plain if plain is not None else spec.block_identity((i + 1) * block_size), tokens[: (i + 1) * block_size])
                 for i in range(top))
    return [
        BlockStored(
            block_keys=keys[:n],
            parent_key=None,
            token_ids=tokens[: n * block_size],
            block_size=block_size,
            lora_id=spec.lora_id or None,
            medium=MEDIUM_GPU,
            group=g,
            kind=KINDS[kinds[g]].vllm_kind,
            reused=True,
        )
        for g, n in enumerate(counts) if n
    ]
