"""Hybrid KV cache groups in the spec (spec/kv_groups.py, spec/kv_cache.py):
each rule of vLLM 0.33's KV cache coordinator with exact values. The
scheduler scenarios were also run in lockstep against vLLM's own
coordinator (HybridKVCacheCoordinator, UnitaryKVCacheCoordinator,
KVCacheCoordinatorNoPrefixCache) through the vLLM adapter."""

from __future__ import annotations

import pytest

from schedspec.spec import ConfigError, SpecScheduler, StepResult
from schedspec.spec.interface import KVCacheGroup, SchedulerConfig, block_key_group, group_block_key
from schedspec.spec.kv_cache import KVPool
from schedspec.spec.mamba import StateTrack
from schedspec.spec.kv_groups import (
    GroupLayout,
    SpecGroup,
    blocks_for_free,
    blocks_to_allocate,
    find_group_hit,
    hybrid_cache_hit,
    num_skipped_tokens,
    skipped_blocks_to_free,
)
from schedspec.spec.kv_kinds import (
    NULL_BLOCK,
    admission_cap,
    chunked_local_admission_cap,
    contiguous_blocks_for_hit,
    find_chunked_local_hit,
    find_full_attention_hit,
    find_sliding_window_hit,
    sliding_window_cache_mask,
)

from tests.helpers import cfg, entries, message, req, step

FA = KVCacheGroup()


def SW(window: int) -> KVCacheGroup:
    return KVCacheGroup(kind="sliding_window", sliding_window=window)


def CL(chunk: int) -> KVCacheGroup:
    return KVCacheGroup(kind="chunked_local", attention_chunk_size=chunk)


def tables(plan_entry: object) -> tuple[tuple[int, ...], ...]:
    return getattr(plan_entry, "group_block_ids")  # type: ignore[no-any-return]


def layout(*groups: KVCacheGroup, block_size: int = 4) -> GroupLayout:
    """A layout of ``groups`` without admission caps, for the pure rules."""
    return GroupLayout(groups, block_size, True, tuple(None for _ in groups))


def cached_lookup(cached: dict[int, int]):  # type: ignore[no-untyped-def]
    """A lookup of one group: block index -> cached block (or a miss)."""
    return lambda i: [cached[i]] if i in cached else None


# ---------------------------------------------------------------- the layout


def test_the_coordinator_vllm_builds_for_each_layout() -> None:
    # kv_cache_coordinator.py, get_kv_cache_coordinator
    assert GroupLayout.of(cfg()).coordinator == "unitary"
    assert GroupLayout.of(cfg(num_blocks=18, kv_cache_groups=(SW(4),))).coordinator == "unitary"
    assert GroupLayout.of(cfg(num_blocks=18, kv_cache_groups=(FA, SW(4)))).coordinator == "hybrid"
    assert GroupLayout.of(cfg(num_blocks=18, kv_cache_groups=(FA, SW(4)),
                              enable_prefix_caching=False)).coordinator == "no_prefix_cache"
    assert not cfg().is_hybrid and cfg(num_blocks=18, kv_cache_groups=(SW(4),)).is_hybrid


def test_spec_groups_merge_equal_specs_and_put_full_attention_first() -> None:
    # HybridKVCacheCoordinator.verify_and_split_kv_cache_groups (a stable sort)
    lay = layout(SW(4), FA, SW(8), SW(4))
    assert lay.spec_groups == (
        SpecGroup("full_attention", 0, (1,)),
        SpecGroup("sliding_window", 4, (0, 3)),
        SpecGroup("sliding_window", 8, (2,)),
    )


def test_admission_cap_of_a_sliding_window_group() -> None:
    # SlidingWindowSpec.max_admission_blocks_per_request: cdiv(min(W - 1 +
    # in-flight tokens, max_model_len), block_size) + 1; in flight is one
    # batch, two with async scheduling
    assert admission_cap(4, 4, 16, 64) == 6
    assert admission_cap(4, 4, 64, 32) == 9
    lay = GroupLayout.of(cfg(kv_cache_groups=(FA, SW(5)), max_num_batched_tokens=8, max_model_len=64,
                             num_blocks=40))
    assert lay.admission_caps == (None, 4)  # cdiv(4 + 8, 4) + 1
    lay = GroupLayout.of(cfg(kv_cache_groups=(FA, SW(5)), max_num_batched_tokens=8, max_model_len=64,
                             num_blocks=40, async_scheduling=True))
    assert lay.admission_caps == (None, 6)  # cdiv(4 + 16, 4) + 1


# ---------------------------------------------------------------- pure rules


def test_skipped_tokens_and_contiguous_blocks() -> None:
    # SlidingWindowManager.get_num_skipped_tokens: all but the last W - 1
    assert [num_skipped_tokens(SW(4), n) for n in (0, 3, 4, 7)] == [0, 0, 1, 4]
    assert num_skipped_tokens(FA, 100) == 0
    # _contiguous_blocks_for_hit: cdiv(W - 1, block_size)
    assert [contiguous_blocks_for_hit(w, 4) for w in (1, 2, 5, 6, 9)] == [0, 1, 1, 2, 2]


def test_full_attention_hit_is_the_run_from_the_start() -> None:
    lookup = cached_lookup({0: 11, 1: 12, 3: 14})
    assert find_full_attention_hit(lookup, 1, 16, 4) == ([[11, 12]], 8)
    assert find_full_attention_hit(lookup, 1, 7, 4) == ([[11]], 4)  # at most max_length // block_size


def test_sliding_window_hit_scans_right_to_left_with_null_blocks_before() -> None:
    # W = 5, block 2: two contiguous blocks; the scan starts at block 5
    lookup = cached_lookup({0: 10, 1: 11, 3: 13, 4: 14, 5: 15})
    assert find_sliding_window_hit(lookup, 1, 12, 2, 5) == ([[0, 0, 0, 0, 14, 15]], 12)
    # the longest matching run ends before a miss at the right
    lookup = cached_lookup({0: 10, 1: 11, 3: 13})
    assert find_sliding_window_hit(lookup, 1, 12, 2, 5) == ([[10, 11]], 4)
    # no run long enough: the cached run from block 0 (possibly empty)
    assert find_sliding_window_hit(cached_lookup({0: 10, 3: 13}), 1, 12, 2, 5) == ([[10]], 2)
    assert find_sliding_window_hit(cached_lookup({3: 13}), 1, 12, 2, 5) == ([[]], 0)


def test_hybrid_hit_full_attention_then_the_window_cuts_it() -> None:
    # HybridKVCacheCoordinator.find_longest_cache_hit, the simple hybrid (one pass)
    lay = layout(FA, SW(5), block_size=2)
    fa = cached_lookup({0: 1, 1: 2, 2: 3, 3: 4, 4: 5})
    sw = cached_lookup({1: 21, 2: 22})
    blocks, hit, uncached = hybrid_cache_hit(lay, lambda s: fa if s.is_full else sw, 11)
    # full attention hits 10 tokens; the window's longest run of 2 ends at block 2
    assert (blocks, hit, uncached) == ([[1, 2, 3], [0, 21, 22]], 6, 4)


def test_hybrid_hit_is_a_fixed_point_over_three_spec_groups() -> None:
    # FA + SW(3) + SW(5), block size 2: SW(5) shortens the hit below what
    # SW(3) accepted, so the pass restarts and SW(3) looks again from there
    lay = layout(FA, SW(3), SW(5), block_size=2)
    looks = {
        "full_attention": cached_lookup({i: 1 + i for i in range(6)}),
        3: cached_lookup({5: 35, 2: 32}),
        5: cached_lookup({1: 51, 2: 52}),
    }
    blocks, hit, uncached = hybrid_cache_hit(
        lay, lambda s: looks["full_attention"] if s.is_full else looks[s.window], 12)
    # pass 1: FA 12, SW(3) 12 (block 5), SW(5) 6 (blocks 1, 2); pass 2: SW(3)
    # from 6 finds block 2, SW(5) keeps 6: the fixed point is 6 tokens
    assert blocks == [[1, 2, 3], [0, 0, 32], [0, 51, 52]]
    assert (hit, uncached) == (6, 6)


def test_blocks_to_allocate_counts_only_the_window() -> None:
    # get_num_blocks_to_allocate: blocks past the hit or past the skipped
    # ones, plus free hit blocks past the skipped ones
    free = lambda blocks: sum(1 for b in blocks if b in {7, 9})  # noqa: E731  (ref_cnt 0)
    # a 16-token target with a hit of 3 blocks [null, 7, 9] (12 tokens), W = 4
    assert blocks_to_allocate(SW(4), 4, None, 0, 16, [0, 7, 9], free, 12, False) == 1 + 1
    # external tokens reach past the hit: the skipped blocks dominate
    assert blocks_to_allocate(SW(4), 4, None, 0, 32, [0, 7, 9], free, 24, False) == 3 + 0
    assert blocks_to_allocate(FA, 4, None, 0, 16, [8, 7, 9], free, 12, False) == 1 + 2
    # a running request: the table covers what it has
    assert blocks_to_allocate(SW(4), 4, None, 4, 17, [], free, 16, False) == 1
    # the full-sequence gate caps a sliding-window group
    assert blocks_to_allocate(SW(4), 4, 3, 0, 64, [], free, 0, True) == 3


def test_skipped_blocks_are_freed_last_first_and_stop_at_a_null_block() -> None:
    # _remove_blocks_in_range: backward from the last skipped block
    table = [5, 6, 7, 8, 9]
    assert skipped_blocks_to_free(table, 7, 2) == [7, 6, 5]
    assert table == [0, 0, 0, 8, 9]
    assert skipped_blocks_to_free(table, 9, 2) == [8]
    assert skipped_blocks_to_free(table, 9, 2) == []
    assert skipped_blocks_to_free([5, 6], 100, 2) == [6, 5]  # capped at the table


def test_sliding_window_caches_only_before_its_boundaries() -> None:
    # reachable_block_mask, retention interval 0 (CacheConfig's default): the
    # contiguous_blocks_for_hit blocks before each boundary
    assert sliding_window_cache_mask(0, 6, 2, 5, [9]) == [False, False, True, True, False, False]
    assert sliding_window_cache_mask(2, 6, 2, 5, [9, 12]) == [True, True, True, True]
    assert sliding_window_cache_mask(0, 3, 2, 5, [9]) == [False, False, True]
    # dense retention (None) caches every block; a positive interval each segment's tail
    assert sliding_window_cache_mask(0, 6, 2, 5, [9], retention=None) is None
    assert sliding_window_cache_mask(0, 6, 2, 3, [], retention=6) == [False, False, True, False, False, True]


def test_blocks_for_free_drops_each_groups_leading_null_blocks() -> None:
    assert blocks_for_free([[1, 2], [0, 0, 7, 0, 8]]) == [1, 2, 7, 0, 8]


def test_group_keys() -> None:
    key = ("", (1, 2, 3, 4))
    assert group_block_key(key, 0) == key
    assert group_block_key(key, 2) == ("\x1d2", (1, 2, 3, 4))
    assert [block_key_group(group_block_key(key, g)) for g in range(4)] == [0, 1, 2, 3]


# ---------------------------------------------------------------- the pool


def test_free_request_frees_group_after_group_each_tail_first() -> None:
    # KVCacheCoordinator.free: each manager frees its table reversed, one
    # free_blocks call per group; leading null blocks are dropped
    pool = KVPool(9, 4, True, layout=layout(FA, SW(4)))

    class R:
        blocks = pool.get_new_blocks(3)
        num_cached_blocks = 0
        group_blocks = [[0] + pool.get_new_blocks(2)]
        group_num_cached = [0]
        shared_prefix_boundary = 0
        state_tracks: dict[int, StateTrack] = {}

    r = R()
    pool.cache_full_blocks([2], [("", (0, 1, 2, 3))])
    assert (r.blocks, r.group_blocks) == ([1, 2, 3], [[0, 4, 5]])
    pool.free_request(r)
    # group 0: 3 front, 2 keyed to the back, 1 front; then group 1: 5, 4 front
    assert pool.free_queue == [5, 4, 3, 1, 6, 7, 8, 2]
    assert (r.blocks, r.group_blocks, r.num_cached_blocks) == ([], [[]], 0)


def test_pop_blocks_for_free_then_free_is_one_reversed_free() -> None:
    # a deferred free (pop_blocks_for_free, later free_blocks(reversed(...)))
    pool = KVPool(9, 4, True, layout=layout(FA, SW(4)))

    class R:
        blocks = pool.get_new_blocks(2)
        num_cached_blocks = 0
        group_blocks = [[0] + pool.get_new_blocks(2)]
        group_num_cached = [0]
        shared_prefix_boundary = 0
        state_tracks: dict[int, StateTrack] = {}

    blocks = pool.pop_blocks_for_free(R())
    assert blocks == [1, 2, 3, 4]
    pool.free(blocks)
    assert pool.free_queue == [4, 3, 2, 1, 5, 6, 7, 8]


# ---------------------------------------------------------------- the scheduler


def test_a_hybrid_request_frees_blocks_outside_the_window_as_it_decodes() -> None:
    s = SpecScheduler(cfg(num_blocks=17, max_model_len=32, max_num_batched_tokens=16, kv_cache_groups=(FA, SW(4))))
    s.add(req("a", 14, max_tokens=6))
    plan = step(s)
    assert tables(plan.scheduled[0]) == ((1, 2, 3, 4), (5, 6, 7, 8))
    assert plan.scheduled[0].block_ids == (1, 2, 3, 4)  # group 0's table
    assert s.view().requests["a"].group_block_ids == ((1, 2, 3, 4), (5, 6, 7, 8))
    # allocate_slots first frees what the window of token 14 no longer reads:
    # tokens 0 .. 10, blocks 0 and 1, last first, unkeyed to the front
    plan = step(s)
    assert tables(plan.scheduled[0]) == ((1, 2, 3, 4), (0, 0, 7, 8))
    assert s.view().kv.free_queue == (6, 5, 9, 10, 11, 12, 13, 14, 15, 16)
    # then block 2: it is keyed (the last block before the replay boundary
    # 13), so it goes to the back
    plan = step(s)
    assert tables(plan.scheduled[0]) == ((1, 2, 3, 4), (0, 0, 0, 8))
    assert s.view().kv.free_queue == (6, 5, 9, 10, 11, 12, 13, 14, 15, 16, 7)
    plan = step(s)  # a fifth block in each group, group 0 first
    assert tables(plan.scheduled[0]) == ((1, 2, 3, 4, 6), (0, 0, 0, 8, 5))
    step(s)
    step(s)  # the sixth token finishes it: group 0's table, then group 1's
    assert s.view().kv.free_queue == (5, 8, 6, 9, 10, 11, 12, 13, 14, 15, 16, 7, 4, 3, 2, 1)
    assert s.rules["kv_groups.window_freed"] == 2


def test_keys_per_group_and_the_sliding_window_caches_only_what_a_hit_uses() -> None:
    s = SpecScheduler(cfg(num_blocks=17, max_model_len=32, max_num_batched_tokens=16, kv_cache_groups=(FA, SW(4))))
    s.add(req("a", 14, max_tokens=1))
    step(s)
    keys = s.view().kv.block_keys
    # full attention keys its three full blocks; the window only block 2,
    # the one a later hit ending at the replay boundary (13) reads
    assert {b: (block_key_group(k), len(k[1])) for b, k in keys.items()} == {
        1: (0, 4), 2: (0, 8), 3: (0, 12), 7: (1, 12)}
    assert keys[7] == group_block_key(keys[3], 1)
    assert s.rules["kv_groups.cache_masked"] == 1


def test_a_hit_valid_in_both_groups_has_null_blocks_in_the_window_group() -> None:
    s = SpecScheduler(cfg(num_blocks=17, max_model_len=32, max_num_batched_tokens=16, kv_cache_groups=(FA, SW(4))))
    s.add(req("a", 14, max_tokens=1))
    step(s)
    s.add(req("b", 14, max_tokens=1))
    plan = step(s)
    # hit 12 tokens: full attention blocks 1, 2, 3; the window block 2 only
    assert entries(plan) == [("b", "new", 12, 2)]
    assert tables(plan.scheduled[0])[0][:3] == (1, 2, 3)
    assert tables(plan.scheduled[0])[1][:3] == (0, 0, 7)
    assert s.rules["kv_groups.hit_skipped_in_window"] == 1


def test_a_full_attention_hit_cut_by_the_window_and_the_shared_prefix_junction() -> None:
    s = SpecScheduler(cfg(num_blocks=33, max_model_len=64, max_num_batched_tokens=32, kv_cache_groups=(FA, SW(4))))
    s.add(req("a", 22, max_tokens=1))
    step(s)
    # b shares a's first 16 tokens: full attention hits 16, but the window
    # group cached only a's block 4 (before a's replay boundary 21): no hit
    s.add(req("b", list(range(16)) + [50, 51, 52, 53], max_tokens=1))
    plan = step(s)
    assert entries(plan) == [("b", "new", 0, 20)]
    assert s.rules["kv_groups.hit_cut_by_group"] == 1
    # b's junction (16) makes its window group cache block 3 too
    sw_keys = {b: len(k[1]) for b, k in s.view().kv.block_keys.items() if block_key_group(k) == 1}
    assert sw_keys == {11: 20, 15: 16}
    # so c, sharing the same 16 tokens, hits them in both groups
    s.add(req("c", list(range(16)) + [60, 61, 62], max_tokens=1))
    plan = step(s)
    assert entries(plan) == [("c", "new", 16, 3)]
    assert tables(plan.scheduled[0]) == ((1, 2, 3, 4, 16), (0, 0, 0, 15, 14))


def test_admission_and_preemption_count_both_groups() -> None:
    # the smallest pool vLLM starts with: 4 + 5 blocks (validate.py, _check_groups_fit)
    s = SpecScheduler(cfg(num_blocks=10, max_model_len=16, max_num_batched_tokens=16, kv_cache_groups=(FA, SW(4))))
    s.add(req("a", 12, max_tokens=4))
    s.add(req("b", list(range(10)) + [40], max_tokens=4))
    plan = step(s)
    # b hits a's blocks 1, 2 (full attention) and 5 (the window's, cached
    # before a's replay boundary 11): one new block per group
    assert entries(plan) == [("a", "new", 0, 12), ("b", "new", 8, 3)]
    assert [tables(e) for e in plan.scheduled] == [((1, 2, 3), (4, 5, 6)), ((1, 2, 7), (0, 5, 8))]
    assert s.view().kv.free_queue == (9,)
    # a's window frees block 4 (block 5 stays with b) before a takes one block
    # per group; then b's window lets block 5 go (keyed: to the back)
    plan = step(s)
    assert [tables(e) for e in plan.scheduled] == [((1, 2, 3, 4), (0, 0, 6, 9)), ((1, 2, 7), (0, 0, 8))]
    assert s.view().kv.free_queue == (5,)
    # b needs a block in each group, one is free: b preempts itself, its
    # group 0 table freed first (7 keyed: back), then group 1's (8: front)
    plan = step(s)
    assert plan.preempted_ids == ("b",)
    assert s.view().kv.free_queue == (8, 5, 7)


def test_a_lone_sliding_window_group_without_prefix_caching() -> None:
    # UnitaryKVCacheCoordinator's manager under KVCacheCoordinatorNoPrefixCache
    s = SpecScheduler(cfg(enable_prefix_caching=False, max_num_batched_tokens=16, kv_cache_groups=(SW(3),)))
    s.add(req("a", 10, max_tokens=4))
    plan = step(s)
    assert (plan.scheduled[0].block_ids, tables(plan.scheduled[0])) == ((1, 2, 3), ((1, 2, 3),))
    plan = step(s)
    assert tables(plan.scheduled[0]) == ((0, 0, 3),)
    assert s.view().kv.free_queue == (2, 1, 4, 5, 6, 7, 8)  # no keys: to the front
    step(s)
    plan = step(s)
    assert tables(plan.scheduled[0]) == ((0, 0, 3, 2),)
    assert s.view().kv.block_keys == {}


def test_a_lone_window_group_runs_a_long_prompt_in_a_small_pool() -> None:
    # 7 usable blocks hold a 40-token prompt: the window group never holds
    # more than its admission cap (cdiv(3 + 8, 4) + 1 = 4) at once, freeing
    # each chunk's skipped blocks before it allocates (the pool of the plain
    # layout would need 16 blocks for max_model_len 64)
    s = SpecScheduler(SchedulerConfig(block_size=4, num_blocks=8, max_model_len=64, max_num_batched_tokens=8,
                                      max_num_seqs=4, kv_cache_groups=(SW(4),)))
    s.add(req("a", 40, max_tokens=2))
    got = [tables(step(s).scheduled[0])[0] for _ in range(6)]
    assert got == [(1, 2), (0, 2, 1, 3), (0, 0, 0, 3, 1, 2), (0, 0, 0, 0, 0, 2, 1, 3),
                   (0, 0, 0, 0, 0, 0, 0, 3, 1, 2), (0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 3)]
    # block 1 (at index 8, before the replay boundary 39) is the only keyed one
    assert s.view().kv.free_queue == (3, 2, 4, 5, 6, 7, 1)


def test_the_full_sequence_gate_caps_the_window_group() -> None:
    # 39 tokens: full attention needs 10 blocks; the window group is capped at
    # cdiv(min(3 + 8, 40), 4) + 1 = 4, not 10: 14 blocks fit 15 free ones
    s = SpecScheduler(cfg(num_blocks=16, max_model_len=40, max_num_batched_tokens=8,
                          kv_cache_groups=(FA, SW(4))))
    s.add(req("a", 39, max_tokens=1))
    plan = s.schedule()
    assert entries(plan) == [("a", "new", 0, 8)]
    assert s.rules["kv_groups.admission_capped"] >= 1


def test_reset_prefix_cache_needs_every_group_free() -> None:
    s = SpecScheduler(cfg(num_blocks=17, max_model_len=32, max_num_batched_tokens=16, kv_cache_groups=(FA, SW(4))))
    s.add(req("a", 14, max_tokens=2))
    step(s)
    assert s.reset_prefix_cache() is False  # a holds blocks in both groups
    step(s)  # a finishes: every group's blocks are freed
    assert s.reset_prefix_cache() is True
    assert s.view().kv.block_keys == {} and s.view().kv.cache_index == {}


def test_the_plain_layout_carries_no_group_tables() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 5))
    plan = step(s)
    assert plan.scheduled[0].group_block_ids == ()
    assert s.view().requests["a"].group_block_ids == ()
    assert s.kv.layout == GroupLayout.plain(4, True)


def test_a_finished_request_has_no_group_tables() -> None:
    s = SpecScheduler(cfg(num_blocks=18, kv_cache_groups=(FA, SW(4))))
    s.add(req("a", 5, max_tokens=1))
    step(s)
    view = s.view()
    assert view.finished["a"].group_block_ids == () and view.finished["a"].block_ids == ()
    plan = s.schedule()
    assert plan.finished_ids == ("a",)
    s.update(plan, StepResult({}))
    # freed at a's finish: group 0's (2 front, 1 keyed back), then group 1's
    # (4 front, 3 keyed back: the block before a's replay boundary 4)
    assert s.view().kv.free_queue == (4, 2, *range(5, 18), 1, 3)


# ---------------------------------------------------------------- the boundary


@pytest.mark.parametrize(
    ("groups", "field", "text"),
    [
        ((SW(0),), "kv_cache_groups[0].sliding_window", "needs a window >= 1"),
        ((KVCacheGroup(sliding_window=3),), "kv_cache_groups[0].sliding_window", "has no window"),
        ((KVCacheGroup(kind="linear_attention"),), "kv_cache_groups[0].kind", "must be one of 'full_attention', 'sliding_window', 'chunked_local', 'mamba'"),
        ((KVCacheGroup(block_size=6),), "kv_cache_groups[0].block_size", "multiple of the hash block size"),
        ((KVCacheGroup(block_size=8),), "kv_cache_groups[0].block_size", "differs from block_size"),
        ((FA,) * 5, "kv_cache_groups", "beyond the supported maximum 4"),
        ((FA, SW(4)), "num_blocks", "cannot hold one request of max_model_len (32) tokens in every KV cache group: "
                                    "it needs 17 (8 + 9, one term per group)"),
    ],
)
def test_layouts_vllm_would_refuse_are_refused(groups: tuple[KVCacheGroup, ...], field: str, text: str) -> None:
    msg = message(lambda: SchedulerConfig(block_size=4, num_blocks=9, max_model_len=32, kv_cache_groups=groups),
                  ConfigError)
    assert field in msg and text in msg


def test_kv_groups_contracts_hold() -> None:
    # the PEP 316 contracts of spec/kv_groups.py and of the kinds' pure rules
    # in spec/kv_kinds.py (admission_cap, chunked_local_admission_cap,
    # sliding_window_skipped, chunked_local_skipped, contiguous_blocks_for_hit),
    # as tests/spec/test_contracts.py checks spec/rules.py's
    pytest.importorskip("crosshair")
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "crosshair", "check", "--analysis_kind=PEP316", "--per_condition_timeout=4",
         "schedspec/spec/kv_groups.py", "schedspec/spec/kv_kinds.py"],
        cwd=root, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- chunked local attention
# single_type_kv_cache_manager.py, ChunkedLocalAttentionManager; the worked
# examples are those of its docstrings (chunk 8, block size 4).


def recording_lookup(cached: dict[int, int], asked: list[int]):  # type: ignore[no-untyped-def]
    """cached_lookup that records every block index it is asked for."""
    def lookup(i: int) -> list[int] | None:
        asked.append(i)
        return [cached[i]] if i in cached else None
    return lookup


def test_chunked_local_skips_every_token_before_the_chunk_of_the_next_one() -> None:
    # get_num_skipped_tokens: (n // C) * C; the docstring's examples 13 -> 8,
    # 8 -> 8, 7 -> 0
    assert [num_skipped_tokens(CL(8), n) for n in (13, 8, 7, 0, 16, 23)] == [8, 8, 0, 0, 16, 16]
    # a chunk that is not a multiple of the block size
    assert [num_skipped_tokens(CL(6), n) for n in (5, 6, 11, 12)] == [0, 6, 6, 12]
    # the whole blocks among them are the ones freed
    table = [5, 6, 7, 8]
    assert skipped_blocks_to_free(table, num_skipped_tokens(CL(8), 13), 4) == [6, 5]
    assert table == [0, 0, 7, 8]
    assert skipped_blocks_to_free(table, num_skipped_tokens(CL(8), 15), 4) == []  # stops at a null block
    assert skipped_blocks_to_free(table, num_skipped_tokens(CL(8), 16), 4) == [8, 7]


def test_chunked_local_hit_docstring_examples() -> None:
    # example 1: max_length 15, the next token is 15: tokens 0 .. 7 lie wholly
    # before its chunk (nulls, never looked up); block 2 (tokens 8 .. 11) is
    # looked up, block 3 is past max_length // block_size
    asked: list[int] = []
    assert find_chunked_local_hit(recording_lookup({2: 33, 3: 34}, asked), 1, 15, 4, 8) == ([[0, 0, 33]], 12)
    assert asked == [2]
    assert find_chunked_local_hit(cached_lookup({}), 1, 15, 4, 8) == ([[0, 0]], 8)
    # example 2: max_length 16: every token lies before the next token's chunk:
    # four nulls, nothing looked up
    asked = []
    assert find_chunked_local_hit(recording_lookup({0: 1, 1: 2}, asked), 1, 16, 4, 8) == ([[0, 0, 0, 0]], 16)
    assert asked == []
    # the forward search stops at the first miss; each group of the spec group gets its blocks
    look = lambda i: {2: [32, 42], 3: [33, 43], 5: [35, 45]}.get(i)  # noqa: E731
    assert find_chunked_local_hit(look, 2, 23, 4, 8) == ([[0, 0, 0, 0], [0, 0, 0, 0]], 16)
    assert find_chunked_local_hit(look, 2, 15, 4, 8) == ([[0, 0, 32], [0, 0, 42]], 12)
    assert find_chunked_local_hit(cached_lookup({}), 1, 0, 4, 8) == ([[]], 0)
    # a chunk start inside a block: the nulls stop at the block holding it
    assert find_chunked_local_hit(cached_lookup({1: 21}), 1, 11, 4, 6) == ([[0, 21]], 8)
    # the spec group's kind picks the lookup
    assert find_group_hit(SpecGroup("chunked_local", 0, (1,), 8), cached_lookup({2: 33}), 15, 4) == ([[0, 0, 33]], 12)


def test_chunked_local_groups_merge_by_chunk_size() -> None:
    lay = layout(CL(8), FA, CL(16), CL(8), SW(8))
    assert lay.spec_groups == (
        SpecGroup("full_attention", 0, (1,)),
        SpecGroup("chunked_local", 0, (0, 3), 8),
        SpecGroup("chunked_local", 0, (2,), 16),
        SpecGroup("sliding_window", 8, (4,)),
    )


def test_hybrid_hit_with_a_chunked_local_group() -> None:
    # the simple hybrid: full attention hits 3 blocks (12 tokens of max 15);
    # chunked local with max_length 12 nulls blocks 0, 1 and finds block 2
    lay = layout(FA, CL(8))
    fa = cached_lookup({0: 1, 1: 2, 2: 3})
    cl = cached_lookup({2: 13})
    assert hybrid_cache_hit(lay, lambda s: fa if s.is_full else cl, 15) == ([[1, 2, 3], [0, 0, 13]], 12, 0)
    # full attention hits 16 tokens, chunked local's chunk start is past them:
    # four nulls, the hit stands in both groups
    fa = cached_lookup({i: 1 + i for i in range(4)})
    assert hybrid_cache_hit(lay, lambda s: fa if s.is_full else cl, 19) == ([[1, 2, 3, 4], [0, 0, 0, 0]], 16, 0)
    # a miss at chunked local's first block in the chunk cuts the full-attention hit
    fa = cached_lookup({0: 1, 1: 2, 2: 3})
    assert hybrid_cache_hit(lay, lambda s: fa if s.is_full else cached_lookup({}), 15) == ([[1, 2], [0, 0]], 8, 4)


def test_hybrid_fixed_point_restarts_for_a_chunked_local_group() -> None:
    # FA + CL(8) + SW(5), block 4: three spec groups, so every cut restarts the pass.
    # pass 1: FA 20 (blocks 0 .. 4); CL from 20 looks up block 4: 20; SW from 20
    # finds block 1 only: 8. pass 2: CL from 8 gives two nulls (8); SW keeps 8.
    lay = layout(FA, CL(8), SW(5))
    looks = {
        "full_attention": cached_lookup({i: 1 + i for i in range(5)}),
        "chunked_local": cached_lookup({4: 24}),
        "sliding_window": cached_lookup({1: 31}),
    }
    blocks, hit, uncached = hybrid_cache_hit(lay, lambda s: looks[s.kind], 23)
    assert blocks == [[1, 2], [0, 0], [0, 31]]
    assert (hit, uncached) == (8, 12)


def test_admission_cap_of_a_chunked_local_group() -> None:
    # ChunkedLocalAttentionSpec.max_admission_blocks_per_request: cdiv(min(C +
    # in-flight tokens, max_model_len), block_size), no extra block
    assert chunked_local_admission_cap(8, 4, 16, 64) == 6
    assert chunked_local_admission_cap(8, 4, 64, 32) == 8
    assert chunked_local_admission_cap(6, 4, 1, 64) == 2
    lay = GroupLayout.of(cfg(kv_cache_groups=(FA, CL(8), SW(5)), max_num_batched_tokens=8, max_model_len=64,
                             num_blocks=40))
    assert lay.admission_caps == (None, 4, 4)  # cdiv(8 + 8, 4); cdiv(4 + 8, 4) + 1
    lay = GroupLayout.of(cfg(kv_cache_groups=(FA, CL(8)), max_num_batched_tokens=8, max_model_len=64,
                             num_blocks=40, async_scheduling=True))
    assert lay.admission_caps == (None, 6)  # cdiv(8 + 16, 4)


def test_blocks_to_allocate_for_a_chunked_local_group() -> None:
    free = lambda blocks: sum(1 for b in blocks if b in {7, 9})  # noqa: E731  (ref_cnt 0)
    # a 16-token target with a hit [null, null, 7] (12 tokens): 8 tokens
    # skipped (2 blocks), one new block, block 7 taken from the free queue
    assert blocks_to_allocate(CL(8), 4, None, 0, 16, [0, 0, 7], free, 12, False) == 1 + 1
    # external tokens reach the next chunk: its skipped blocks dominate
    assert blocks_to_allocate(CL(8), 4, None, 0, 24, [0, 0, 7], free, 16, False) == 2 + 0
    # the full-sequence gate caps the group; a running request counts past its table
    assert blocks_to_allocate(CL(8), 4, 4, 0, 64, [], free, 0, True) == 4
    assert blocks_to_allocate(CL(8), 4, 4, 0, 64, [], free, 0, False) == 16
    assert blocks_to_allocate(CL(8), 4, None, 4, 17, [], free, 16, False) == 1


def test_a_chunked_local_request_frees_each_chunk_as_it_passes() -> None:
    # FA + CL(8), block 4: allocate_slots frees the blocks before the chunk of
    # the next processed token (remove_skipped_blocks) before it allocates
    s = SpecScheduler(cfg(num_blocks=17, max_model_len=32, max_num_batched_tokens=16, kv_cache_groups=(FA, CL(8))))
    s.add(req("a", 10, max_tokens=8))
    got = []
    for _ in range(9):
        plan = step(s)
        got.append(tables(plan.scheduled[0]) if plan.scheduled else plan.finished_ids)
    assert got == [
        ((1, 2, 3), (4, 5, 6)),
        ((1, 2, 3), (0, 0, 6)),  # 10 computed: chunk 1 starts at 8, blocks 0, 1 go
        ((1, 2, 3), (0, 0, 6)),
        ((1, 2, 3, 7), (0, 0, 6, 8)),
        ((1, 2, 3, 7), (0, 0, 6, 8)),
        ((1, 2, 3, 7), (0, 0, 6, 8)),
        ((1, 2, 3, 7), (0, 0, 6, 8)),
        ((1, 2, 3, 7, 9), (0, 0, 0, 0, 10)),  # 16 computed: blocks 2, 3 go
        ("a",),  # finished at max_tokens
    ]
    assert s.rules["kv_groups.chunk_freed"] == 2
    # every full block of the chunked-local group was keyed (the base
    # reachable_block_mask: no mask), so freed ones went to the back, last
    # skipped first (5, 4 then 8, 6); at a's finish each group's table went
    # tail first, group 0 then group 1 without its null head: keyless 9 then
    # 10 to the front, keyed 7, 3, 2, 1 to the back
    assert s.view().kv.free_queue == (10, 9, 11, 12, 13, 14, 15, 16, 5, 4, 8, 6, 7, 3, 2, 1)
    assert s.rules["kv_groups.cache_masked"] == 0


def test_a_chunked_local_group_caches_every_full_block() -> None:
    s = SpecScheduler(cfg(num_blocks=17, max_model_len=32, max_num_batched_tokens=16, kv_cache_groups=(FA, CL(8))))
    s.add(req("a", 14, max_tokens=1))
    step(s)
    keys = s.view().kv.block_keys
    assert {b: (block_key_group(k), len(k[1])) for b, k in keys.items()} == {
        1: (0, 4), 2: (0, 8), 3: (0, 12), 5: (1, 4), 6: (1, 8), 7: (1, 12)}


def test_a_chunked_local_hit_nulls_the_blocks_before_the_chunk_start() -> None:
    s = SpecScheduler(cfg(num_blocks=17, max_model_len=32, max_num_batched_tokens=16, kv_cache_groups=(FA, CL(8))))
    s.add(req("a", 17, max_tokens=1))
    step(s)
    # b (the same 17 tokens) hits 16: full attention blocks 1 .. 4; the
    # chunked-local group four nulls (its chunk start of max_length 16 is 16)
    s.add(req("b", 17, max_tokens=1))
    plan = step(s)
    assert entries(plan) == [("a", "running", 16, 1), ("b", "new", 16, 1)]
    assert tables(plan.scheduled[1]) == ((1, 2, 3, 4, 11), (0, 0, 0, 0, 12))
    # c (16 tokens: max_length 15, the docstring's first example): two
    # nulls, then a's block 7 of chunk 1 (freed and keyed, still cached)
    s.add(req("c", 16, max_tokens=1))
    plan = step(s)
    assert entries(plan) == [("c", "new", 12, 4)]
    assert tables(plan.scheduled[0]) == ((1, 2, 3, 12), (0, 0, 7, 11))
    assert s.rules["kv_groups.hit_skipped_in_chunk"] == 2


def test_a_lone_chunked_local_group_skips_to_the_last_chunk() -> None:
    # UnitaryKVCacheCoordinator: the lookup marks every block before the chunk
    # start of max_length (39 -> 32) computed as the null block, so a fresh
    # 40-token prompt computes only its last chunk; the full-sequence gate
    # counts the group at its admission cap (cdiv(8 + 8, 4) = 4), not 11 blocks
    s = SpecScheduler(SchedulerConfig(block_size=4, num_blocks=7, max_model_len=64, max_num_batched_tokens=8,
                                      max_num_seqs=4, kv_cache_groups=(CL(8),)))
    s.add(req("a", 40, max_tokens=3))
    plan = step(s)
    assert entries(plan) == [("a", "new", 32, 8)]
    assert tables(plan.scheduled[0]) == ((0,) * 8 + (1, 2),)
    assert s.rules["kv_groups.chunk_admission_capped"] == 1  # 11 blocks for 41 tokens, capped at 4
    plan = step(s)  # 40 computed: chunk 5 starts, blocks 8, 9 go (keyed: back, last first)
    assert tables(plan.scheduled[0]) == ((0,) * 10 + (3,),)
    assert s.view().kv.free_queue == (4, 5, 6, 2, 1)


def test_the_full_sequence_gate_caps_the_chunked_local_group() -> None:
    # 39 tokens: full attention needs 10 blocks; the chunked-local group is
    # capped at cdiv(min(8 + 8, 40), 4) = 4: 14 blocks fit 15 free ones
    s = SpecScheduler(cfg(num_blocks=16, max_model_len=40, max_num_batched_tokens=8,
                          kv_cache_groups=(FA, CL(8))))
    s.add(req("a", 39, max_tokens=1))
    plan = s.schedule()
    assert entries(plan) == [("a", "new", 0, 8)]
    assert s.rules["kv_groups.chunk_admission_capped"] >= 1
    assert s.rules["kv_groups.admission_capped"] == 0


@pytest.mark.parametrize(
    ("groups", "field", "text"),
    [
        ((CL(0),), "kv_cache_groups[0].attention_chunk_size", "needs a chunk >= 1 token"),
        # vLLM's chunked local attention backend asserts a chunk of whole blocks
        # (make_local_attention_virtual_batches); with chunk 6 and block 4 the
        # hit of an 8-token prompt would be [null] (4 tokens), though token 4
        # attends tokens 0 .. 3 of its chunk
        ((CL(6),), "kv_cache_groups[0].attention_chunk_size", "must be a multiple of block_size (4)"),
        ((KVCacheGroup(attention_chunk_size=8),), "kv_cache_groups[0].attention_chunk_size", "has no attention chunk"),
        ((KVCacheGroup(kind="sliding_window", sliding_window=4, attention_chunk_size=8),),
         "kv_cache_groups[0].attention_chunk_size", "has no attention chunk"),
        ((KVCacheGroup(kind="chunked_local", attention_chunk_size=8, sliding_window=4),),
         "kv_cache_groups[0].sliding_window", "has no window"),
        # the pool-fit check with ChunkedLocalAttentionSpec's cap: 8 blocks for
        # full attention, cdiv(min(8 + 64, 32), 4) = 8 for the chunked-local group
        ((FA, CL(8)), "num_blocks", "it needs 16 (8 + 8, one term per group)"),
    ],
)
def test_chunked_local_layouts_vllm_would_refuse_are_refused(
    groups: tuple[KVCacheGroup, ...], field: str, text: str
) -> None:
    msg = message(lambda: SchedulerConfig(block_size=4, num_blocks=9, max_model_len=32, kv_cache_groups=groups),
                  ConfigError)
    assert field in msg and text in msg


CHUNKED_SCENARIOS = (
    "test_a_chunked_local_request_frees_each_chunk_as_it_passes",
    "test_a_chunked_local_group_caches_every_full_block",
    "test_a_chunked_local_hit_nulls_the_blocks_before_the_chunk_start",
    "test_a_lone_chunked_local_group_skips_to_the_last_chunk",
    "test_the_full_sequence_gate_caps_the_chunked_local_group",
)


@pytest.mark.vllm
@pytest.mark.parametrize("name", CHUNKED_SCENARIOS)
def test_chunked_local_scenarios_in_lockstep_with_vllm(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunked-local scheduler scenario above, run on the spec and on
    vLLM's scheduler (ChunkedLocalAttentionManager through the adapter) side
    by side: the same plans and, after every operation, the same free queue,
    group tables and keys; the scenario's own asserts read the spec."""
    pytest.importorskip("vllm")
    from typing import Any

    from schedspec.adapters.vllm_adapter import VllmScheduler

    spec_class = SpecScheduler

    class Both:
        def __init__(self, config: SchedulerConfig) -> None:
            self.spec, self.vllm = spec_class(config), VllmScheduler(config)
            self.rules = self.spec.rules

        def _same(self, a: Any, b: Any) -> Any:
            assert a == b
            va, vb = self.spec.view(), self.vllm.view()
            assert va.kv.free_queue == vb.kv.free_queue
            assert {k: r.group_block_ids for k, r in va.requests.items()} == {
                k: r.group_block_ids for k, r in vb.requests.items()}
            assert dict(va.kv.block_keys) == dict(vb.kv.block_keys)
            return a

        def add(self, r: Any) -> None:
            self.spec.add(r)
            self.vllm.add(r)
            self._same(None, None)

        def schedule(self) -> Any:
            return self._same(self.spec.schedule(), self.vllm.schedule())

        def update(self, plan: Any, result: Any) -> None:
            self.spec.update(plan, result)
            self.vllm.update(plan, result)
            self._same(None, None)

        def view(self) -> Any:
            return self.spec.view()

    monkeypatch.setitem(globals(), "SpecScheduler", Both)
    globals()[name]()


def test_a_chunk_of_part_blocks_would_null_a_block_the_next_token_attends() -> None:
    # why validation refuses a chunk that is not a whole number of blocks
    # (docs/divergences.md, boundary behaviour): chunk 6, block 4, max_length
    # 7 (an 8-token prompt, nothing cached): the chunk start 6 lies in block 1,
    # so block 0 is a null place and the hit is 4 tokens, though token 4 is in
    # chunk 0 and attends tokens 0 .. 3 (nothing of them is skipped)
    assert find_chunked_local_hit(cached_lookup({}), 1, 7, 4, 6) == ([[0]], 4)
    assert num_skipped_tokens(CL(6), 4) == 0


@pytest.mark.vllm
def test_vllm_nulls_a_block_the_next_token_attends_with_a_chunk_of_part_blocks() -> None:
    # the same lookup in vLLM 0.33's own ChunkedLocalAttentionManager: the
    # scheduler does not refuse such a chunk, its attention backend does
    # (make_local_attention_virtual_batches asserts chunk % block_size == 0)
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    pool = BlockPool(16, True, 4)
    spec = ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                     attention_chunk_size=6)
    blocks, hit = ChunkedLocalAttentionManager.find_longest_cache_hit(
        block_hashes=[BlockHash(b"\x00" * 32), BlockHash(b"\x01" * 32)], max_length=7, kv_cache_group_ids=[0], block_pool=pool,
        kv_cache_spec=spec, drop_eagle_block=False, alignment_tokens=4)
    assert ([[b.block_id for b in blocks[0]]], hit) == find_chunked_local_hit(cached_lookup({}), 1, 7, 4, 6)


def test_a_pool_made_without_a_layout_has_one_full_attention_group() -> None:
    pool = KVPool(9, 4, True)
    assert pool.layout == GroupLayout.plain(4, True)
    assert [g.kind for g in pool.layout.groups] == ["full_attention"]
