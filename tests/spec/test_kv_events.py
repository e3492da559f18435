"""The spec's KV cache events (spec/kv_events.py): what it emits where vLLM
0.33's block pool does, in its order; their JSON form; events off costs no
queue."""

from __future__ import annotations

import json

import pytest

from schedspec.spec import SpecScheduler
from schedspec.spec.interface import KVCacheGroup, RequestSpec, StepResult
from schedspec.spec.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventError,
    event_from_dict,
    event_to_dict,
    plain_key,
)
from tests.helpers import cfg, req, step


def _spec(**kw: object) -> SpecScheduler:
    return SpecScheduler(cfg(enable_kv_cache_events=True, **kw))


def test_events_off_queue_nothing() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 9))
    step(s)
    assert s.kv.events is None and s.take_kv_events() == ()


def test_a_prefill_stores_its_full_blocks_in_one_event_and_a_decode_names_its_parent() -> None:
    s = _spec()
    s.add(req("a", 7, max_tokens=4))
    step(s)
    (first,) = s.take_kv_events()
    assert first == BlockStored(block_keys=(("", (0, 1, 2, 3)),), parent_key=None, token_ids=(0, 1, 2, 3),
                                block_size=4, lora_id=None, medium=MEDIUM_GPU, group=0, kind="full_attention")
    step(s)  # the 8th token is computed: block 1 becomes full
    (second,) = s.take_kv_events()
    assert second.block_keys == (("", (0, 1, 2, 3, 4, 5, 6, 7)),)
    assert second.parent_key == ("", (0, 1, 2, 3)) and second.token_ids == (4, 5, 6, 7)
    assert s.take_kv_events() == ()  # taken once


def test_the_lora_adapter_and_salt_travel_with_the_block() -> None:
    s = _spec(max_loras=1)
    s.add(req("a", 5, lora_id=3, cache_salt="s"))
    step(s)
    (e,) = s.take_kv_events()
    assert isinstance(e, BlockStored) and e.lora_id == 3
    assert e.block_keys[0][0] == RequestSpec("x", (0,) * 5, 1, lora_id=3, cache_salt="s").block_identity(4)


def test_eviction_removes_each_key_once_and_a_reset_clears() -> None:
    s = _spec(num_blocks=5, max_model_len=16)  # 4 usable blocks
    s.add(req("a", 9, max_tokens=1))
    step(s)
    step(s)
    s.take_kv_events()
    s.add(req("b", [5] * 9, max_tokens=1))  # needs 3 blocks: evicts the cached ones, head of the queue first
    step(s)
    events = s.take_kv_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_keys) == 1 and e.group == 0 for e in removed)
    assert events.index(removed[0]) < max(i for i, e in enumerate(events) if isinstance(e, BlockStored))
    while s.requests:
        step(s)
    s.take_kv_events()
    assert s.reset_prefix_cache()
    assert s.take_kv_events() == (AllBlocksCleared(),)


def test_a_refused_reset_emits_nothing() -> None:
    s = _spec()
    s.add(req("a", 9))
    step(s)
    s.take_kv_events()
    assert not s.reset_prefix_cache()
    assert s.take_kv_events() == ()


def test_a_sliding_window_group_reports_its_kind_and_only_the_blocks_its_mask_keeps() -> None:
    s = _spec(num_blocks=40, max_model_len=32,
              kv_cache_groups=(KVCacheGroup(), KVCacheGroup("sliding_window", 4)))
    s.add(req("a", 17, max_tokens=1))
    step(s)
    full, window = s.take_kv_events()
    assert isinstance(full, BlockStored) and isinstance(window, BlockStored)
    assert (full.group, full.kind, window.group, window.kind) == (0, "full_attention", 1, "sliding_window")
    assert len(full.block_keys) == 4 and len(window.block_keys) < 4
    assert window.token_ids == full.token_ids  # the skipped blocks' tokens too, as vLLM's all_token_ids slice
    # the keys carry group 0's spelling; the index holds them under the group's
    assert all(plain_key(k) == k for k in window.block_keys)


def test_a_clone_keeps_its_own_queue() -> None:
    s = _spec()
    s.add(req("a", 9))
    plan = s.schedule()
    c = s.clone()
    s.update(plan, StepResult({"a": (1,)}))
    assert s.take_kv_events() and c.take_kv_events()
    assert s.take_kv_events() == () and c.take_kv_events() == ()


def test_every_event_round_trips_through_json() -> None:
    events = [
        BlockStored((("", (1, 2)),), ("x", (0,)), (1, 2), 2, 7, MEDIUM_GPU, 1, "sliding_window"),
        BlockRemoved((("", (1, 2)),), MEDIUM_GPU, 0),
        AllBlocksCleared(),
    ]
    for e in events:
        assert event_from_dict(json.loads(json.dumps(event_to_dict(e)))) == e


@pytest.mark.parametrize("raw, field", [
    ([], "an event is a JSON object"),
    ({"type": "BlockEvicted"}, "type"),
    ({"type": "AllBlocksCleared", "x": 1}, "x: unknown field"),
    ({"type": "BlockRemoved", "block_keys": [["", [1]]], "medium": "GPU", "group": -1}, "group"),
    ({"type": "BlockRemoved", "block_keys": [[1, [1]]], "medium": "GPU", "group": 0}, "block_keys[0]"),
    ({"type": "BlockStored", "block_keys": [], "parent_key": None, "token_ids": ["a"], "block_size": 4,
      "lora_id": None, "medium": "GPU", "group": 0, "kind": "full_attention"}, "token_ids"),
])
def test_a_malformed_event_is_refused_naming_the_field(raw: object, field: str) -> None:
    with pytest.raises(KVEventError, match=field.replace("[", r"\[").replace("]", r"\]")):
        event_from_dict(raw)


def test_the_switch_is_a_validated_config_field() -> None:
    from schedspec.spec.interface import ConfigError, SchedulerConfig

    with pytest.raises(ConfigError, match="config.enable_kv_cache_events: must be a boolean"):
        SchedulerConfig(enable_kv_cache_events="yes")  # type: ignore[arg-type]
    assert "enable_kv_cache_events" not in SchedulerConfig().to_dict()  # a default config serializes as before
    assert SchedulerConfig.from_dict(cfg(enable_kv_cache_events=True).to_dict()).enable_kv_cache_events


def test_evict_blocks_removes_keys_in_the_order_of_vllms_set() -> None:
    """vLLM's evict_blocks iterates the set it is given: blocks [2, 9] added in
    that order iterate 9, 2 (9 lands in slot 1 of the set's table)."""
    s = _spec()
    pool = s.kv
    pool.cache_full_blocks([2, 9], [("", (1,)), ("", (1, 2))])
    pool.events = []
    pool.evict_blocks([2, 9])
    assert [e.block_keys for e in pool.take_events()] == [(("", (1, 2)),), (("", (1,)),)]
    assert list({2, 9}) == [9, 2]
