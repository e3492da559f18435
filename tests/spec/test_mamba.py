"""Mamba groups in "align" mode (spec/mamba.py, spec/kv_kinds.py Mamba):
MambaManager's hit, cache mask, state-block allocation and retirement with
exact values, the scheduler's block-aligned chunk split against vLLM
0.33's own Scheduler._mamba_block_aligned_split over a grid of inputs, the
configurations refused by field, and the spec scheduling a Mamba layout."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from schedspec.spec import ConfigError, SpecScheduler
from schedspec.spec.interface import KVCacheGroup, SchedulerConfig
from schedspec.spec.kv_kinds import KINDS, NULL_BLOCK, find_mamba_hit, mamba_cache_mask
from schedspec.spec.mamba import (
    StateTrack,
    allocate_state_block,
    block_aligned_split,
    checkpoint_position,
    retire_state_blocks,
    state_blocks_to_allocate,
)

from tests.helpers import entries, message, req, step

MAMBA = KVCacheGroup("mamba")
HYB = dict(block_size=4, num_blocks=33, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
           enable_prefix_caching=True, kv_cache_groups=(KVCacheGroup(), MAMBA))


def lookup(cached: dict[int, int]):  # type: ignore[no-untyped-def]
    return lambda i: [cached[i]] if i in cached else None


def test_the_hit_is_the_rightmost_cached_state_with_nulls_before() -> None:
    # MambaManager.find_longest_cache_hit: right to left, the first cached block
    assert find_mamba_hit(lookup({0: 5, 1: 6}), 1, 13, 4) == ([[NULL_BLOCK, 6]], 8)
    assert find_mamba_hit(lookup({0: 5, 2: 7}), 1, 13, 4) == ([[NULL_BLOCK, NULL_BLOCK, 7]], 12)
    # a state past max_length is not a hit; nothing cached: an empty hit
    assert find_mamba_hit(lookup({3: 9}), 1, 15, 4) == ([[]], 0)
    assert find_mamba_hit(lookup({}), 2, 40, 4) == ([[], []], 0)


def test_only_the_boundary_states_are_cached() -> None:
    # reachable_block_mask with retention 0: the block ending on each
    # boundary aligned down (replay boundary 9 -> block 1, junction 12 -> block 2)
    assert mamba_cache_mask(0, 4, 4, [9]) == [False, True, False, False]
    assert mamba_cache_mask(1, 4, 4, [9, 12]) == [True, True, False]
    assert mamba_cache_mask(0, 2, 4, [3]) == [False, False]
    assert mamba_cache_mask(0, 3, 4, [9], retention=None) is None
    assert mamba_cache_mask(0, 6, 4, [], retention=8) == [False, True, False, True, False, True]


def test_one_state_block_a_step_behind_null_padding() -> None:
    # a fresh request's first chunk of 8 tokens: one block at place 1
    table: list[int] = []
    track = StateTrack()
    new = iter(range(10, 20))
    assert state_blocks_to_allocate(0, 8, 4, 0) == 1
    allocate_state_block(table, track, 8, 4, lambda n: [next(new) for _ in range(n)])
    assert table == [NULL_BLOCK, 10] and track == StateTrack(True, None, 0)
    # the next chunk to 16 tokens: the old state is the previous one, one new block
    assert state_blocks_to_allocate(2, 16, 4, 0) == 1
    allocate_state_block(table, track, 16, 4, lambda n: [next(new) for _ in range(n)])
    assert table == [NULL_BLOCK, 10, NULL_BLOCK, 11] and track.last_state == 1
    # a decode within the last block takes nothing
    assert state_blocks_to_allocate(4, 15, 4, 0) <= 0
    allocate_state_block(table, track, 15, 4, lambda n: [])
    assert table == [NULL_BLOCK, 10, NULL_BLOCK, 11]
    # 16 processed: the blocks before place 3 retire (last first, nulls skipped)
    assert retire_state_blocks(table, track, 16, 4) == ([10], [])
    assert table == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 11] and track.retired == 3


def test_the_previous_state_is_freed_once_processed_passes_it() -> None:
    # a hit's state block at place 1; the request computes 8..12
    table, track = [NULL_BLOCK, 7], StateTrack()
    allocate_state_block(table, track, 12, 4, lambda n: [9] * n)
    assert table == [NULL_BLOCK, 7, 9] and track.last_state == 1
    # processed 8: place 1 is not before cdiv(8, 4) - 1 = 1, nothing freed
    assert retire_state_blocks(table, track, 8, 4) == ([], [])
    # processed 12: skipped 11 tokens = 2 blocks retire [0, 2): block 7
    assert retire_state_blocks(table, track, 12, 4) == ([7], [])
    assert table == [NULL_BLOCK, NULL_BLOCK, 9]


def test_checkpoint_position_leaves_the_last_token() -> None:
    assert [checkpoint_position(n, 4) for n in (0, 1, 4, 5, 8, 9, 10)] == [0, 0, 0, 4, 4, 8, 8]


def _vllm_split(start: int, n: int, prompt: int, num_tokens: int, bs: int, batch: int, threshold: int,
                junction: int) -> int:
    sched = pytest.importorskip("vllm.v1.core.sched.scheduler")
    self: Any = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=bs), scheduler_config=SimpleNamespace(long_prefill_token_threshold=threshold),
        hash_block_size=bs, block_size=bs, mamba_partial_cache_hit=False, use_eagle_block_drop=False,
        num_hash_lookahead_tokens=0, mamba_has_prefill_checkpoint_blocks=False, mamba_prefill_checkpoint_alignment=None,
        mamba_shared_prefix_checkpoint=False, max_num_scheduled_tokens=batch,
    )
    request = SimpleNamespace(num_computed_tokens=start, num_prompt_tokens=prompt, num_tokens=num_tokens,
                              shared_prefix_boundary=junction)
    return int(sched.Scheduler._mamba_block_aligned_split(self, request, n))


def test_the_split_is_vllms_over_a_grid() -> None:
    pytest.importorskip("vllm")
    checked = 0
    for bs, prompt, out, start, n, batch, threshold, junction in itertools.product(
        (4, 16), (1, 5, 16, 23), (0, 3), (0, 3, 4, 9, 16), (1, 3, 4, 7, 12), (8, 32), (0, 6), (0, 6, 12)
    ):
        num_tokens = prompt + out
        if start >= num_tokens:
            continue
        want = _vllm_split(start, n, prompt, num_tokens, bs, batch, threshold, junction)
        got = block_aligned_split(start, n, prompt, num_tokens, bs, min(batch, threshold) if threshold else batch, junction)
        assert got == want, (bs, prompt, out, start, n, batch, threshold, junction)
        checked += 1
    assert checked > 1000


def test_configurations_vllm_refuses_or_not_modelled_are_named() -> None:
    base = dict(HYB)
    assert "kv_cache_groups[1].kind" in message(lambda: SchedulerConfig(**{**base, "enable_prefix_caching": False}), ConfigError)  # type: ignore[arg-type]
    assert "Chunked prefill is required" in message(
        lambda: SchedulerConfig(**{**base, "enable_chunked_prefill": False, "max_num_batched_tokens": 64}), ConfigError)  # type: ignore[arg-type]
    assert "num_speculative_tokens" in message(lambda: SchedulerConfig(**{**base, "num_speculative_tokens": 2}), ConfigError)  # type: ignore[arg-type]
    assert "kv_connector" in message(lambda: SchedulerConfig(**{**base, "kv_connector": True}), ConfigError)  # type: ignore[arg-type]
    # a Mamba group holds two state blocks, not max_model_len's worth
    SchedulerConfig(**{**base, "num_blocks": 16 + 2 + 1})  # type: ignore[arg-type]
    assert KINDS["mamba"].keeps_state and not KINDS["mamba"].downward_closed


def test_the_spec_cuts_chunks_to_the_state_grid_and_keeps_two_states() -> None:
    s = SpecScheduler(SchedulerConfig(**HYB))  # type: ignore[arg-type]
    s.add(req("a", 10, max_tokens=6))
    # prefill end 10, last cacheable state at 8: the chunk stops there
    p1 = step(s)
    assert entries(p1) == [("a", "new", 0, 8)]
    assert p1.scheduled[0].group_block_ids[1] == (NULL_BLOCK, p1.scheduled[0].group_block_ids[1][1])
    p2 = step(s)
    assert entries(p2) == [("a", "running", 8, 2)]
    for _ in range(5):
        step(s)
    held = [b for b in s.requests["a"].group_blocks[0] if b != NULL_BLOCK] if "a" in s.requests else []
    assert len(held) <= 2
    # a second request with the same prompt hits the state at 8 exactly
    s.add(req("b", 10, max_tokens=1))
    p = step(s)
    assert entries(p) == [("b", "new", 8, 2)]
    mamba_table = p.scheduled[0].group_block_ids[1]
    assert mamba_table[0] == NULL_BLOCK and mamba_table[1] != NULL_BLOCK


def test_a_chunk_shorter_than_a_block_waits() -> None:
    # batch 6: a stops at its last cacheable state (4 of 5 tokens); b is left
    # a budget of 2 < block 4, which cannot reach a block boundary: 0 tokens,
    # the waiting loop stops (without the split: a 5, b 1)
    s = SpecScheduler(SchedulerConfig(**{**HYB, "max_num_batched_tokens": 6, "max_num_seqs": 2}))  # type: ignore[arg-type]
    s.add(req("a", 5, max_tokens=2))
    s.add(req("b", 10, max_tokens=2))
    assert entries(s.schedule()) == [("a", "new", 0, 4)]
    assert s.rules["mamba.chunk_none"] == 1 and s.rules["mamba.chunk_aligned"] >= 1


def test_impl_makes_the_spec_plans_on_a_mamba_layout() -> None:
    # impl's own Mamba rules (impl/kv_kinds.py, impl/kv_groups.py) against the
    # spec: chunks cut to the grid, the hit at 8, two state blocks, preemption
    from schedspec.impl import ImplScheduler

    config = SchedulerConfig(**{**HYB, "num_blocks": 10, "max_model_len": 24})  # type: ignore[arg-type]
    a, b = SpecScheduler(config), ImplScheduler(config)
    for s in (a, b):
        s.add(req("x", 10, max_tokens=6))
        s.add(req("y", 13, max_tokens=5))
    for i in range(14):
        pa, pb = step(a), step(b)
        assert pa == pb, i
        if i == 3:
            for s in (a, b):
                s.add(req("z", 10, max_tokens=3))
    assert a.view() == b.view()
    assert a.rules["kv_groups.state_freed"] > 0 and sum(v for k, v in a.rules.items() if k.startswith("preempt.")) > 0


def test_the_generator_draws_mamba_layouts_only_on_opt_in() -> None:
    from schedspec.check import kv_requests

    assert kv_requests._mamba_rate("0.5") == 0.5
    with pytest.raises(ValueError, match="SCHEDSPEC_MAMBA_RATE"):
        kv_requests._mamba_rate("often")
    base = SchedulerConfig(**{**HYB, "kv_cache_groups": (KVCacheGroup(), KVCacheGroup("sliding_window", 8))})  # type: ignore[arg-type]
    assert kv_requests.with_mamba(base, kv_requests.mamba_rng(1), rate=0.0) == base
    drawn = kv_requests.with_mamba(base, kv_requests.mamba_rng(1), rate=1.0)
    assert [g.kind for g in drawn.groups] == ["full_attention", "mamba"]
    # a config that cannot take a Mamba group keeps its layout
    off = SchedulerConfig(**{**HYB, "enable_prefix_caching": False, "kv_cache_groups": base.groups})  # type: ignore[arg-type]
    assert kv_requests.with_mamba(off, kv_requests.mamba_rng(1), rate=1.0) == off


def test_a_bad_mamba_rate_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main

    monkeypatch.setenv("SCHEDSPEC_MAMBA_RATE", "often")
    try:
        rc = main(["check", "--against", "spec", "--steps", "1"])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    assert rc == 2
    assert "SCHEDSPEC_MAMBA_RATE must be a probability" in capsys.readouterr().err


def test_a_clone_keeps_its_own_state_bookkeeping() -> None:
    # the per-request StateTrack and the states cached this step are copied
    from schedspec.impl import ImplScheduler

    config = SchedulerConfig(**{**HYB, "num_blocks": 10, "max_model_len": 24})  # type: ignore[arg-type]
    for make in (SpecScheduler, ImplScheduler):
        s: Any = make(config)
        s.add(req("x", 10, max_tokens=6))
        s.add(req("y", 13, max_tokens=5))
        step(s)
        c = s.clone()
        ahead = [step(s) for _ in range(6)]
        assert [step(c) for _ in range(6)] == ahead, make.__name__
        assert c.view() == s.view()


def test_some_drawn_layouts_have_two_mamba_groups_and_impl_keeps_each_groups_state() -> None:
    # a model with more Mamba layers than one group holds has several Mamba groups,
    # each with its own table and state blocks; impl agrees with the spec on them
    from schedspec.check import kv_requests
    from schedspec.check.coverage_guided import guided_workload
    from schedspec.check.driver import Runner
    from schedspec.impl.scheduler import ImplScheduler

    base = SchedulerConfig(**{**HYB, "kv_cache_groups": (KVCacheGroup(), KVCacheGroup("sliding_window", 8))})  # type: ignore[arg-type]
    kinds = [[g.kind for g in kv_requests.with_mamba(base, kv_requests.mamba_rng(s), rate=1.0).groups]
             for s in range(40)]
    two = sum(1 for k in kinds if k.count("mamba") == 2)
    assert 4 <= two <= 24 and all(k.count("mamba") in (1, 2) for k in kinds)
    # a model whose first layers are Mamba layers (Jamba, Nemotron-H) numbers its Mamba groups first
    first = sum(1 for k in kinds if k[0] == "mamba")
    assert 4 <= first <= 24 and all(k == sorted(k, key=lambda x: x != "mamba") for k in kinds if k[0] == "mamba")
    checked = 0
    for seed in range(40):
        w = guided_workload(seed, 60, focus=("mamba.chunk_aligned",), kv=("hybrid",), modes=("sync", "async"))
        if sum(1 for g in w.config.groups if g.kind == "mamba") != 2:
            continue
        runner = Runner(w.config, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed)
        assert runner.run(w.events) is None
        assert runner.stats.mamba_frees > 0 or checked
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_layouts_with_the_mamba_groups_first_run_in_lockstep() -> None:
    # vLLM numbers the groups by each spec's first layer, so a model whose first
    # layers are Mamba layers has a Mamba group 0; spec and impl agree on it
    from schedspec.check.coverage_guided import guided_workload
    from schedspec.check.driver import Runner
    from schedspec.impl.scheduler import ImplScheduler

    checked = 0
    for seed in range(80):
        w = guided_workload(seed, 60, focus=("mamba.chunk_aligned",), kv=("hybrid",), modes=("sync", "async"))
        if w.config.groups[0].kind != "mamba":
            continue
        runner = Runner(w.config, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed)
        assert runner.run(w.events) is None
        checked += 1
        if checked == 3:
            break
    assert checked == 3
