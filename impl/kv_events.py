"""impl's KV cache events: the same stream as the spec's (spec/kv_events.py
states the rules and cites vLLM 0.33), built only while events are on
(``PrefixIndex.events`` is a list, not None): the callers test that one
attribute and build nothing otherwise.

impl keys blocks by interned chained nodes; an event carries the spec's
BlockKey, spelled as group 0 spells it: the identity and every token through
the block. Each registered block's key is built once, when its BlockStored
names it, and left on its node (``KeyNode.ekey``): the next block's key is
its parent's tokens and the block's own (one tuple concatenation), and the
block's BlockRemoved reads the key instead of walking the chain back to the
root (O(position) per removal, quadratic over a long prefix).

Events are built by filling a fresh instance's ``__dict__`` in field order
(``_stored``, ``removed``), as impl/request.py's ``plan_entry`` builds a plan
entry: equal (``==``, ``hash``, ``repr``, pickle) to the frozen dataclass's
constructor's, at a fraction of its cost (tests/impl/test_kv_events.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from schedspec.impl.kv_kinds import KINDS
from schedspec.spec.interface import (
    MEDIUM_GPU,
    BlockKey,
    BlockStored,
    RequestSpec,
)

if TYPE_CHECKING:
    from schedspec.impl.prefix_index import KeyNode

_new = object.__new__
#: the kind a plain layout's BlockStored names (its one group is full attention)
FULL_ATTENTION_KIND = KINDS["full_attention"].vllm_kind


class Request(Protocol):
    """What an event reads of a request (impl/request.py's Request)."""

    def token_range(self, start: int, end: int) -> tuple[int, ...]: ...

    @property
    def identity_marks(self) -> dict[int, str]: ...

    @property
    def spec(self) -> RequestSpec: ...


def _stored(block_keys: tuple[BlockKey, ...], parent_key: BlockKey | None, token_ids: tuple[int, ...],
            block_size: int, lora_id: int | None, group: int, kind: str) -> BlockStored:
    """``BlockStored(block_keys, parent_key, token_ids, block_size, lora_id,
    MEDIUM_GPU, group, kind)`` (not reused)."""
    event = _new(BlockStored)
    fields = event.__dict__
    fields["block_keys"] = block_keys
    fields["parent_key"] = parent_key
    fields["token_ids"] = token_ids
    fields["block_size"] = block_size
    fields["lora_id"] = lora_id
    fields["medium"] = MEDIUM_GPU
    fields["group"] = group
    fields["kind"] = kind
    fields["reused"] = False
    fields["lookahead_token_ids"] = None
    return event


def request_key(req: Request, i: int, block_size: int, lookahead: int = 0) -> BlockKey:
    """The group-0 key of block ``i`` of ``req`` (RequestSpec.block_identity
    and every token through the block, and the ``lookahead`` after it)."""
    end = (i + 1) * block_size + lookahead
    return (req.spec.block_identity(end), req.token_range(0, end))


def _parent_key(req: Request, table: Sequence[int], block_node: Sequence[KeyNode | None], start: int,
                block_size: int, lookahead: int = 0) -> BlockKey:
    """The key of block ``start - 1``: read off its node where the node has
    one, else computed from the request."""
    up = block_node[table[start - 1]]
    ekey = None if up is None else up.ekey
    return request_key(req, start - 1, block_size, lookahead) if ekey is None else ekey[0]


def stored_run(req: Request, blocks: Sequence[int], block_node: Sequence[KeyNode | None], first: int,
               chunks: Sequence[tuple[int, ...]], block_size: int) -> BlockStored:
    """``stored_keyed`` for the plain layout's one group, where every new
    block is kept: blocks ``first ..`` of ``req``, whose own tokens are
    ``chunks`` (impl/allocation.py's ``_register`` cut them). Each key's
    tokens are the previous key's and the block's own, so a run costs one
    copy per key (its length) and none of the request's whole sequence."""
    spec = req.spec
    marks = req.identity_marks
    parent_key: BlockKey | None = None
    tokens: tuple[int, ...] = ()
    if first > 0:
        parent_key = _parent_key(req, blocks, block_node, first, block_size)
        tokens = parent_key[1]
    # block_identity is the bare salt without an adapter or encoder input,
    # and the same for every block without identity marks
    identity = "" if marks else spec.salt if not (spec.lora_id or spec.mm_inputs) else spec.block_identity(block_size)
    keys: list[BlockKey] = []
    i = first
    for chunk in chunks:
        tokens = tokens + chunk
        i += 1
        key = (spec.block_identity(i * block_size) if marks else identity, tokens)
        keys.append(key)
        node = block_node[blocks[i - 1]]
        if node is not None and node.ekey is None:
            node.ekey = (key, 0)
    new_tokens = chunks[0] if len(chunks) == 1 else tokens[first * block_size :]
    return _stored(tuple(keys), parent_key, new_tokens, block_size, spec.lora_id or None, 0, FULL_ATTENTION_KIND)


def stored_keyed(req: Request, table: Sequence[int], block_node: Sequence[KeyNode | None], start: int,
                 end: int, kept: list[int], block_size: int, group: int, kind: str,
                 lookahead: int = 0) -> BlockStored:
    """The BlockStored of blocks ``start .. end - 1`` of a group's table, of
    which those in ``kept`` are registered (a sliding window's mask skips
    some), the parent key read off the node of block ``start - 1`` where it
    has one, and each kept block's node (``block_node[table[i]]``) given the
    key and group its BlockRemoved will name, where it has none yet (a node
    is one key: a second holder's key is the same). With hash lookahead L
    each key runs L tokens past its block, and the event names those tokens
    (BlockPool._lookahead_token_ids)."""
    # one tuple of the tokens through block end - 1 (and L after), each key a
    # slice of it; the identity computed once where it is the same for every
    # block (no identity marks: RequestSpec.block_identity of block 0)
    tokens = req.token_range(0, end * block_size + lookahead)
    if req.identity_marks or lookahead:
        keys = tuple((req.spec.block_identity((i + 1) * block_size + lookahead),
                      tokens[: (i + 1) * block_size + lookahead]) for i in kept)
    else:
        spec = req.spec
        # block_identity is the bare salt without an adapter or encoder input
        identity = spec.salt if not (spec.lora_id or spec.mm_inputs) else spec.block_identity(block_size)
        keys = tuple((identity, tokens[: (i + 1) * block_size]) for i in kept)
    parent_key = _parent_key(req, table, block_node, start, block_size, lookahead) if start > 0 else None
    for i, key in zip(kept, keys):
        node = block_node[table[i]]
        if node is not None and node.ekey is None:
            node.ekey = (key, group)
    event = _stored(keys, parent_key, tokens[start * block_size : end * block_size], block_size,
                    req.spec.lora_id or None, group, KINDS[kind].vllm_kind)
    if lookahead:
        event.__dict__["lookahead_token_ids"] = tuple(
            tokens[(i + 1) * block_size : (i + 1) * block_size + lookahead] for i in kept)
    return event


def reused(req: Request, counts: Sequence[int], kinds: Sequence[str], block_size: int,
           lookahead: int = 0) -> list[BlockStored]:
    """The "reused" BlockStored of a prefix hit of a request whose
    kv_cache_report_mode is "full" (spec/kv_events.py): for each group g
    with ``counts[g]`` > 0 hit blocks, the request's keys of blocks 0 ..
    counts[g] - 1, parent None, their tokens (one token tuple sliced); with
    hash lookahead L, keys L tokens longer and those tokens named."""
    top = max(counts, default=0)
    tokens = req.token_range(0, top * block_size + lookahead)
    marks = req.identity_marks
    spec = req.spec
    plain = None if marks or lookahead else (
        spec.salt if not (spec.lora_id or spec.mm_inputs) else spec.block_identity(block_size))
    keys = tuple((plain if plain is not None else spec.block_identity((i + 1) * block_size + lookahead),
                  tokens[: (i + 1) * block_size + lookahead])
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
            lookahead_token_ids=tuple(tokens[(i + 1) * block_size : (i + 1) * block_size + lookahead]
                                      for i in range(n)) if lookahead else None,
        )
        for g, n in enumerate(counts) if n
    ]
