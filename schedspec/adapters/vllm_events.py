"""vLLM's KV cache events as the spec's (spec/kv_events.py).

With ``config.enable_kv_cache_events`` the adapter builds vLLM's scheduler
with KVEventsConfig(enable_kv_cache_events=True, publisher="null")
(vllm_config.py) and puts an ``EventCapture`` where the scheduler keeps its
publisher: Scheduler.update_from_output takes the block pool's queue once
per step (KVCacheManager.take_events) and publishes it as one KVEventBatch,
which the capture keeps. The adapter turns the captured events into the
spec's right after the update, while every block hash they name still has a
known content (BlockKeys.event_key)."""

from __future__ import annotations

from typing import Any, TypeVar

from schedspec.spec.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

from schedspec.adapters.vllm_load import VllmAdapterError
from schedspec.adapters.vllm_views import BlockKeys


class EventCapture:
    """Stands in for vLLM's EventPublisher (vllm/distributed/kv_events.py):
    keeps every published batch's events, binds nothing."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        return None

    def get_publisher_config(self) -> None:
        return None

    def take(self) -> list[Any]:
        out, self.events = self.events, []
        return out


class ReusedMarks:
    """The ids of the events vLLM's ``BlockPool.emit_cached_block_events``
    queued (a prefix hit reported for a request whose kv_cache_report_mode is
    "full"), which vLLM's BlockStored does not tell apart: the pool's method
    is wrapped on the instance, runs as it is, and what it appended to
    ``kv_event_queue`` is noted. ``translate`` marks those ``reused``."""

    def __init__(self, pool: Any) -> None:
        self.ids: set[int] = set()
        original = pool.emit_cached_block_events

        def emit_cached_block_events(*args: Any, **kwargs: Any) -> None:
            before = len(pool.kv_event_queue)
            original(*args, **kwargs)
            self.ids.update(id(e) for e in pool.kv_event_queue[before:])

        pool.emit_cached_block_events = emit_cached_block_events


T = TypeVar("T")


def _given(value: T | None, field: str) -> T:
    """A field vLLM's device block pool always fills (None: outside the modelled configuration)."""
    if value is None:
        raise VllmAdapterError(f"vLLM published a KV cache event without {field}")
    return value


def translate(events: list[Any], keys: BlockKeys, marks: ReusedMarks | None = None) -> list[KVCacheEvent]:
    """vLLM's events (BlockStored, BlockRemoved, AllBlocksCleared) as the
    spec's; those ``marks`` noted (then forgotten) are ``reused``."""
    from schedspec.adapters import vllm_names as v

    reused = set() if marks is None else marks.ids
    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, v.BlockStored):
            out.append(BlockStored(
                block_keys=tuple(keys.event_key(h) for h in e.block_hashes),
                parent_key=None if e.parent_block_hash is None else keys.event_key(e.parent_block_hash),
                token_ids=tuple(e.token_ids),
                block_size=e.block_size,
                lora_id=e.lora_id,
                medium=_given(e.medium, "BlockStored.medium"),
                group=_given(e.group_idx, "BlockStored.group_idx"),
                kind=_given(e.kv_cache_spec_kind, "BlockStored.kv_cache_spec_kind"),
                reused=id(e) in reused,
                lookahead_token_ids=None if e.lookahead_token_ids is None
                else tuple(tuple(t) for t in e.lookahead_token_ids),
            ))
        elif isinstance(e, v.BlockRemoved):
            out.append(BlockRemoved(tuple(keys.event_key(h) for h in e.block_hashes),
                                    _given(e.medium, "BlockRemoved.medium"), _given(e.group_idx, "BlockRemoved.group_idx")))
        elif isinstance(e, v.AllBlocksCleared):
            out.append(AllBlocksCleared())
        else:
            raise VllmAdapterError(f"vLLM published a KV cache event of type {type(e).__name__}, "
                                 "outside the modelled BlockStored, BlockRemoved and AllBlocksCleared")
    reused.clear()
    return out
