"""Partial-block prefix-cache entries (a hash block size below the block
size: vLLM's prefix_match_unit): a full-attention group registers its
prompt's last hash boundary inside a block as a second key of that block once
the coordinator caches it (FullAttentionManager._cache_partial_tail_block,
BlockPool.cache_partial_block; HybridKVCacheCoordinator.get_num_cacheable_tokens
rounds to the block size), with a one-unit BlockStored; the entry goes with
its block's key (one BlockRemoved after the full key's) and with a reset.
The spec and impl emit the same events and views."""

from __future__ import annotations

from typing import Any

import pytest

from schedspec.impl import ImplScheduler
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import KVCacheGroup, group_block_key
from schedspec.spec.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from tests.helpers import cfg, req, step

FULL, WINDOW = KVCacheGroup(), KVCacheGroup("sliding_window", 4)
PROMPT = tuple(range(7))  # last hash boundary short of the final token: 6, inside block 1 (tokens 4..7)
PARTIAL = ("", PROMPT[:6])
SCHEDULERS = [SpecScheduler, ImplScheduler]


def config(groups: tuple[KVCacheGroup, ...] = (FULL, WINDOW), **kw: Any) -> Any:
    base: dict[str, Any] = dict(enable_kv_cache_events=True, hash_block_size=2, num_blocks=13, max_model_len=16,
                                kv_cache_groups=groups)
    base.update(kw)
    return cfg(**base)


def stored(group: int = 0) -> BlockStored:
    return BlockStored(block_keys=(PARTIAL,), parent_key=("", PROMPT[:4]), token_ids=(4, 5), block_size=2,
                       lora_id=None, medium=MEDIUM_GPU, group=group, kind="full_attention")


@pytest.mark.parametrize("make", SCHEDULERS)
def test_registered_once_its_block_is_cached_then_never_again(make: Any) -> None:
    s = make(config())
    s.add(req("a", list(PROMPT), max_tokens=3))
    step(s)  # 7 tokens computed: only block 0 is cacheable (4 tokens), the boundary 6 lies beyond
    assert s.view().kv.partial_index == {}
    assert stored() not in s.take_kv_events()
    step(s)  # 8 tokens: block 1 full, cached, then its partial entry
    events = s.take_kv_events()
    block1 = s.view().requests["a"].block_ids[1]
    i = events.index(stored())  # right after its group's BlockStored of block 1
    before = events[i - 1]
    assert isinstance(before, BlockStored) and before.group == 0 and before.block_keys == (("", PROMPT + (7,)),)
    assert s.view().kv.partial_index == {PARTIAL: (block1,)}
    assert s.view().kv.block_keys[block1] == ("", PROMPT + (7,))
    s.add(req("b", [50 + i for i in range(5)], max_tokens=1))
    step(s)  # a's next cache call meets the entry in place: no second BlockStored
    assert stored() not in s.take_kv_events()


@pytest.mark.parametrize("make", SCHEDULERS)
def test_removed_with_its_block_after_the_full_key(make: Any) -> None:
    s = make(config())
    s.add(req("a", list(PROMPT), max_tokens=2))
    step(s)
    step(s)  # a finishes: its blocks are free, block 1 keyed twice
    assert s.view().kv.partial_index
    s.take_kv_events()
    events: list[Any] = []
    for i in range(12):  # fresh requests until the pool hands block 1 out again
        s.add(req(f"b{i}", [100 + 10 * i + j for j in range(8)], max_tokens=1))
        step(s)
        events.extend(s.take_kv_events())
        if not s.view().kv.partial_index:
            break
    keys = [e.block_keys[0] for e in events if isinstance(e, BlockRemoved) and e.group == 0]
    full = ("", PROMPT + (7,))
    assert PARTIAL in keys and keys[keys.index(PARTIAL) - 1] == full


@pytest.mark.parametrize("make", SCHEDULERS)
def test_a_reset_drops_it(make: Any) -> None:
    s = make(config())
    s.add(req("a", list(PROMPT), max_tokens=2))
    step(s)
    step(s)
    step(s)
    assert s.view().kv.partial_index
    assert s.reset_prefix_cache()
    assert s.view().kv.partial_index == {} and isinstance(s.take_kv_events()[-1], AllBlocksCleared)


@pytest.mark.parametrize("make", SCHEDULERS)
def test_every_full_attention_group_keys_its_own_and_no_window(make: Any) -> None:
    s = make(config((FULL, WINDOW, FULL), num_blocks=19))
    s.add(req("a", list(PROMPT), max_tokens=3))
    step(s)
    step(s)
    events = [e for e in s.take_kv_events() if isinstance(e, BlockStored) and e.block_size == 2]
    assert events == [stored(0), stored(2)]
    tables = s.view().requests["a"].group_block_ids
    assert s.view().kv.partial_index == {PARTIAL: (tables[0][1],), group_block_key(PARTIAL, 2): (tables[2][1],)}


def test_the_spec_and_impl_agree_step_by_step() -> None:
    spec, impl = SpecScheduler(config()), ImplScheduler(config())
    for s in (spec, impl):
        s.add(req("a", list(PROMPT), max_tokens=6))
        s.add(req("c", list(PROMPT[:5]) + [60, 61, 62], max_tokens=3))
    for _ in range(8):
        assert step(spec) == step(impl)
        assert spec.take_kv_events() == impl.take_kv_events()
        assert spec.view().kv == impl.view().kv
