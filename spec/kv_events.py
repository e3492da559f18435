"""The KV cache events a scheduler publishes, as vLLM 0.33's block pool emits them.

KV-aware routers rebuild each instance's prefix cache from this stream
(vllm/distributed/kv_events.py: BlockStored, BlockRemoved,
AllBlocksCleared). vLLM queues the events in its BlockPool
(vllm/v1/core/block_pool.py, ``kv_event_queue``) when
``KVEventsConfig.enable_kv_cache_events`` is on, and the scheduler takes the
whole queue once per step, at the end of ``update_from_output``
(vllm/v1/core/sched/scheduler.py: ``kv_cache_manager.take_events()``,
published as one KVEventBatch). The spec's rules, each where the pool acts
(spec/kv_cache.py):

- **stored**: each call of ``BlockPool.cache_full_blocks`` that has new full
  blocks (one per request and KV cache group, from
  ``SingleTypeKVCacheManager.cache_blocks``) emits one BlockStored after
  registering them: the keys of the blocks it registered (the null block and
  the blocks a sliding-window mask skips have none), the parent key (the key
  of the block before the first new one, or None from block 0, whether or
  not that block itself carries a key), the tokens of every new block (the
  skipped ones' too: ``all_token_ids[start:end]``), the block size, the LoRA
  adapter (None without one), the medium "GPU", the group index and its kind
  (``KVCacheManager.take_events`` annotates ``kv_cache_spec_kind``).
- **partial**: with a hash block size below the block size, a full-attention
  group's partial entry (``BlockPool.cache_partial_block``, the prompt's
  last hash boundary t inside a block) emits, when first registered on a
  block, one BlockStored of its own: the key of the first t tokens, the
  parent the key of the first t - hb (None when t is hb), the last hb
  tokens, ``block_size`` hb; removed with its block, after its full key.
- **removed**: each key a block loses when it is evicted
  (``BlockPool._maybe_evict_cached_block``: on reuse from the free queue in
  ``get_new_blocks``, or by ``evict_blocks`` after a connector's failed load)
  emits one BlockRemoved (``_emit_block_removed_events``), even when another
  block still holds that key.
- **reused**: a prefix lookup that hits (``KVCacheManager.get_computed_blocks``
  with a hit > 0) of a request whose ``kv_cache_report_mode`` is "full"
  emits, through ``KVCacheCoordinator.emit_cached_block_events``, one
  BlockStored per group with a non-empty hit (``BlockPool.
  emit_cached_block_events``): the keys of the hit's n blocks as the request
  names them (whatever the group's table holds there), parent None, the
  tokens of blocks 0 to n, the block size, the LoRA adapter, "GPU", the group
  and its kind, marked ``reused``; no block changes. It is emitted at the
  lookup, even when the admission then fails.
- **cleared**: a successful ``BlockPool.reset_prefix_cache`` emits one
  AllBlocksCleared; a refused one emits nothing.

The event types live in spec/interface.py (what impl and the adapters
import); this module states the rules and gives the events' JSON form.

vLLM names a block by its chained hash; the spec by its content, a BlockKey
(spec/interface.py). An event carries the key as group 0 spells it (vLLM's
event hashes carry no group id: ``get_block_hash``) beside its ``group``, so
``group_block_key(key, group)`` is the key in the scheduler's cache index.
"""

from __future__ import annotations

from typing import Any, Mapping

from schedspec.spec.errors import SchedSpecError
from schedspec.spec.interface import MEDIUM_GPU as MEDIUM_GPU
from schedspec.spec.interface import AllBlocksCleared as AllBlocksCleared
from schedspec.spec.interface import BlockKey
from schedspec.spec.interface import BlockRemoved as BlockRemoved
from schedspec.spec.interface import BlockStored as BlockStored
from schedspec.spec.interface import KVCacheEvent as KVCacheEvent
from schedspec.spec.interface import plain_key as plain_key

class KVEventError(SchedSpecError, ValueError):
    """A recorded event that is not one of vLLM's event types, or a field of
    one that is malformed; the message names the field."""


# ------------------------------------------------------------------ JSON


def _key_to_json(key: BlockKey) -> list[Any]:
    return [key[0], list(key[1])]


def event_to_dict(event: KVCacheEvent) -> dict[str, Any]:
    """One event as a JSON object; ``type`` is vLLM's class name."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_keys": [_key_to_json(k) for k in event.block_keys],
            "parent_key": None if event.parent_key is None else _key_to_json(event.parent_key),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "group": event.group,
            "kind": event.kind,
            **({"reused": True} if event.reused else {}),
            **({} if event.lookahead_token_ids is None
               else {"lookahead_token_ids": [list(t) for t in event.lookahead_token_ids]}),
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_keys": [_key_to_json(k) for k in event.block_keys],
                "medium": event.medium, "group": event.group}
    return {"type": "AllBlocksCleared"}


def _key_from_json(raw: object, field: str) -> BlockKey:
    if (not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[0], str)
            or not isinstance(raw[1], list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw[1])):
        raise KVEventError(f"{field}: a block key is [identity string, [token ids]], got {raw!r}")
    return (raw[0], tuple(raw[1]))


def _int(data: Mapping[str, Any], field: str, optional: bool = False) -> Any:
    value = data.get(field)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise KVEventError(f"{field}: must be an int >= 0, got {value!r}")
    return value


def event_from_dict(data: object) -> KVCacheEvent:
    """The event a JSON object (event_to_dict's form) spells; KVEventError naming the field."""
    if not isinstance(data, Mapping):
        raise KVEventError(f"an event is a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    fields = {"BlockStored": {"type", "block_keys", "parent_key", "token_ids", "block_size", "lora_id", "medium",
                              "group", "kind", "reused", "lookahead_token_ids"},
              "BlockRemoved": {"type", "block_keys", "medium", "group"},
              "AllBlocksCleared": {"type"}}
    if kind not in fields:
        raise KVEventError(f"type: not one of vLLM's event types ({', '.join(fields)}), got {kind!r}")
    unknown = sorted(set(data) - fields[kind])
    if unknown:
        raise KVEventError(f"{unknown[0]}: unknown field of {kind}")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    keys = data.get("block_keys")
    if not isinstance(keys, list):
        raise KVEventError(f"block_keys: must be a list, got {keys!r}")
    block_keys = tuple(_key_from_json(k, f"block_keys[{i}]") for i, k in enumerate(keys))
    medium = data.get("medium")
    if not isinstance(medium, str):
        raise KVEventError(f"medium: must be a string, got {medium!r}")
    group = _int(data, "group")
    if kind == "BlockRemoved":
        return BlockRemoved(block_keys, medium, group)
    parent = data.get("parent_key")
    tokens = data.get("token_ids")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise KVEventError(f"token_ids: must be a list of ints, got {tokens!r}")
    group_kind = data.get("kind")
    if not isinstance(group_kind, str):
        raise KVEventError(f"kind: must be a string, got {group_kind!r}")
    return BlockStored(
        block_keys=block_keys,
        parent_key=None if parent is None else _key_from_json(parent, "parent_key"),
        token_ids=tuple(tokens),
        block_size=_int(data, "block_size"),
        lora_id=_int(data, "lora_id", optional=True),
        medium=medium,
        group=group,
        kind=group_kind,
        reused=_reused(data),
        lookahead_token_ids=_lookahead(data),
    )


def _lookahead(data: Mapping[str, Any]) -> tuple[tuple[int, ...], ...] | None:
    value = data.get("lookahead_token_ids")
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(t, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in t) for t in value):
        raise KVEventError(f"lookahead_token_ids: must be a list of lists of ints, got {value!r}")
    return tuple(tuple(t) for t in value)


def _reused(data: Mapping[str, Any]) -> bool:
    value = data.get("reused", False)
    if not isinstance(value, bool):
        raise KVEventError(f"reused: must be a boolean, got {value!r}")
    return value
