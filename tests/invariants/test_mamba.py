"""The Mamba groups' invariants (invariants/mamba.py): each holds on a real
transition of the spec scheduling a full-attention + Mamba layout, where
the whole catalogue is silent, and fires, under its id, once that
transition is broken in one place."""

from __future__ import annotations

import dataclasses

from schedspec.invariants import BY_ID, CATALOGUE, Transition
from schedspec.spec import SpecScheduler, StepResult
from schedspec.spec.interface import KVCacheGroup, MMInput, RequestStatus, SchedulerConfig, StepPlan

from tests.helpers import req

MAMBA_IDS = ("mamba-hit-at-checkpoint", "mamba-chunk-on-grid", "mamba-state-blocks-bounded", "mamba-progress-bound")

CFG = SchedulerConfig(block_size=4, num_blocks=33, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                      enable_prefix_caching=True, kv_cache_groups=(KVCacheGroup(), KVCacheGroup("mamba")))


def scheduled(s: SpecScheduler) -> Transition:
    before = s.view()
    plan = s.schedule()
    return Transition("schedule", before, s.view(), plan)


def finish(s: SpecScheduler, plan: StepPlan) -> None:
    s.update(plan, StepResult({e.request_id: (7,) for e in plan.scheduled if e.samples}))


def fires(inv_id: str, t: Transition) -> list[str]:
    return [v.message for v in BY_ID[inv_id].check(t)]


def silent(t: Transition) -> None:
    assert [str(v) for inv in CATALOGUE for v in inv.check(t)] == []


def first_chunk() -> Transition:
    s = SpecScheduler(CFG)
    s.add(req("a", 10, max_tokens=3))
    return scheduled(s)


def hit_step() -> Transition:
    s = SpecScheduler(CFG)
    s.add(req("a", 10, max_tokens=1))
    while s.requests.get("a") is not None:
        t = scheduled(s)
        finish(s, t.plan)  # type: ignore[arg-type]
    s.add(req("b", 10, max_tokens=1))
    return scheduled(s)


def with_entry(t: Transition, **changes: object) -> Transition:
    assert t.plan is not None
    e = dataclasses.replace(t.plan.scheduled[0], **changes)
    return dataclasses.replace(t, plan=dataclasses.replace(t.plan, scheduled=(e,) + t.plan.scheduled[1:]))


def test_a_hit_at_a_checkpointed_state_holds_and_a_wrong_state_fires() -> None:
    t = hit_step()
    assert t.plan is not None and t.plan.scheduled[0].num_computed_tokens == 8
    silent(t)
    fa, mamba = t.plan.scheduled[0].group_block_ids
    # the hit's state block is group 0's block 1 (a key of another group, another length)
    bad = with_entry(t, group_block_ids=(fa, (0, fa[1]) + mamba[2:]))
    assert any("not cached for exactly" in m for m in fires("mamba-hit-at-checkpoint", bad))
    # a block before the state block
    bad = with_entry(t, group_block_ids=(fa, (fa[0],) + mamba[1:]))
    assert any("places before the hit's state block" in m for m in fires("mamba-hit-at-checkpoint", bad))


def test_a_chunk_off_the_state_grid_fires() -> None:
    t = first_chunk()
    assert t.plan is not None and t.plan.scheduled[0].num_scheduled_tokens == 8
    silent(t)
    # 0..6 stops before the prefill's end off the grid
    assert any("off the state grid" in m for m in fires("mamba-chunk-on-grid", with_entry(t, num_scheduled_tokens=6)))
    # an encoder input may cut the chunk off the grid (vLLM splits before the encoder caps)
    a = t.before.requests["a"]
    with_image = dataclasses.replace(a, spec=dataclasses.replace(a.spec, mm_inputs=(MMInput(6, 2, "img"),)))
    cut = dataclasses.replace(with_entry(t, num_scheduled_tokens=6),
                              before=dataclasses.replace(t.before, requests={"a": with_image}))
    assert fires("mamba-chunk-on-grid", cut) == []
    # 0..10 runs past the last cacheable state at 8 (#51113's poisoned slot)
    assert any("runs past the last cacheable state at 8" in m
               for m in fires("mamba-chunk-on-grid", with_entry(t, num_scheduled_tokens=10)))


def test_too_many_state_blocks_or_blocks_kept_when_preempted_fire() -> None:
    t = first_chunk()
    a = t.after.requests["a"]
    fa, mamba = a.group_block_ids
    three = dataclasses.replace(a, group_block_ids=(fa, (20, 21, 22)[: len(mamba)] + (23,) * (3 - len(mamba))))
    after = dataclasses.replace(t.after, requests={**t.after.requests, "a": three})
    assert any("holds 3 state blocks, vLLM's bound is 2" in m
               for m in fires("mamba-state-blocks-bounded", dataclasses.replace(t, after=after)))
    preempted = dataclasses.replace(a, status=RequestStatus.PREEMPTED)
    after = dataclasses.replace(t.after, requests={**t.after.requests, "a": preempted})
    assert any("while preempted" in m for m in fires("mamba-state-blocks-bounded", dataclasses.replace(t, after=after)))


def test_computed_tokens_falling_back_without_a_preemption_fire() -> None:
    s = SpecScheduler(CFG)
    s.add(req("a", 10, max_tokens=3))
    t = scheduled(s)
    finish(s, t.plan)  # type: ignore[arg-type]
    before = s.view()
    plan = s.schedule()
    t = Transition("schedule", before, s.view(), plan)
    silent(t)
    a = t.after.requests["a"]
    assert t.before.requests["a"].num_computed_tokens == 8 and a.num_preemptions == 0
    # requeued and prefilled again from 0 with num_preemptions 0 (vllm#52520)
    requeued = dataclasses.replace(a, num_computed_tokens=0, status=RequestStatus.WAITING, block_ids=(),
                                   group_block_ids=())
    bad = dataclasses.replace(t, after=dataclasses.replace(t.after, requests={**t.after.requests, "a": requeued}))
    assert any("fell from 8 to 0 with num_preemptions still 0" in m for m in fires("mamba-progress-bound", bad))
    # the same fall with the preemption counted is a preemption, not a re-prefill
    counted = dataclasses.replace(requeued, num_preemptions=1, status=RequestStatus.PREEMPTED)
    ok = dataclasses.replace(t, after=dataclasses.replace(t.after, requests={**t.after.requests, "a": counted}))
    assert fires("mamba-progress-bound", ok) == []


def _second_chunk() -> tuple[SpecScheduler, Transition]:
    """a's 10-token prompt in chunks of 4 (the threshold): the step after the first chunk."""
    s = SpecScheduler(dataclasses.replace(CFG, long_prefill_token_threshold=4))
    s.add(req("a", 10, max_tokens=2))
    t = scheduled(s)
    finish(s, t.plan)  # type: ignore[arg-type]
    return s, scheduled(s)


def test_aligned_away_is_a_budget_too_small_to_reach_the_next_block_boundary() -> None:
    from schedspec.invariants.mamba import aligned_away

    r = dataclasses.replace(_second_chunk()[1].before.requests["a"], num_computed_tokens=4)  # 6 to go
    assert aligned_away(CFG, r, 3, 0)  # 4 + 3 ends inside a block: the aligned chunk is empty
    assert not aligned_away(CFG, r, 4, 0) and not aligned_away(CFG, r, 16, 0)
    plain = dataclasses.replace(CFG, kv_cache_groups=(KVCacheGroup(),))
    assert aligned_away(plain, r, 3, 0)  # (callers ask only where chunks are aligned: aligns_chunks)


def test_a_running_mamba_prefill_left_out_while_it_could_reach_a_boundary_is_flagged() -> None:
    _, t = _second_chunk()
    assert t.plan is not None and t.plan.get("a") is not None
    silent(t)
    left_out = dataclasses.replace(t, plan=dataclasses.replace(t.plan, scheduled=()))
    assert fires("running-served-while-budget", left_out)


def test_a_running_mamba_prefill_whose_aligned_chunk_is_empty_waits_unflagged() -> None:
    # a trace the check found: two Mamba groups, block size 2; r93's last prompt
    # block is a chunk of 1 token with 1 budget token left, which
    # _mamba_block_aligned_split cuts to 0 (it waits for a bigger budget)
    from pathlib import Path

    from schedspec.check import trace as tracefile
    from schedspec.check.run import run_workload
    from schedspec.impl import ImplScheduler

    path = Path(__file__).resolve().parents[1] / "check" / "data" / "mamba-aligned-chunk-waits.jsonl"
    t = tracefile.read(path)
    assert [g.kind for g in t.workload.config.groups].count("mamba") == 2
    runner, failure = run_workload(t.workload, {"spec": SpecScheduler, "impl": ImplScheduler}, t.vocab,
                                   oracle_seed=t.oracle_seed)
    assert failure is None, failure
    assert runner.stats.steps >= 3
