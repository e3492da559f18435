"""The impl makes the drafter's decisions as the spec does (spec/runner_v2.py,
SchedulerConfig.drafter): lookahead slots, one draft slot per scheduled
request in the input budget, and V2's skip_drafts."""

from __future__ import annotations

import random

import pytest

from schedspec.impl import ImplScheduler
from schedspec.spec.interface import KVCacheGroup, RequestSpec, SchedulerConfig, StepPlan, StepResult
from schedspec.spec.scheduler import SpecScheduler


def _config(drafter: str, runner: str, async_scheduling: bool, **kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(block_size=4, num_blocks=24, max_num_batched_tokens=12, max_num_seqs=4,
                                   max_model_len=64, num_speculative_tokens=2, drafter=drafter, model_runner=runner,
                                   async_scheduling=async_scheduling, enable_prefix_caching=True)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def _drive(sched: object, seed: int, steps: int) -> list[StepPlan]:
    """Requests arriving over the first steps; every step that samples
    yields one token and, without async scheduling, two drafts accepted
    or not as the seed says; one plan in flight with async scheduling."""
    s: object = sched
    rng = random.Random(seed)
    reqs = [RequestSpec(f"r{i}", tuple(rng.randrange(1, 9) for _ in range(rng.randrange(1, 14))),
                        rng.randrange(1, 8)) for i in range(8)]
    plans: list[StepPlan] = []
    in_flight: list[StepPlan] = []
    depth = 2 if s._config.async_scheduling else 1  # type: ignore[attr-defined]
    for step in range(steps):
        if step < len(reqs):
            s.add(reqs[step])  # type: ignore[attr-defined]
        plan = s.schedule()  # type: ignore[attr-defined]
        plans.append(plan)
        in_flight.append(plan)
        if len(in_flight) == depth:
            done = in_flight.pop(0)
            sampled = {}
            drafts = {}
            for e in done.scheduled:
                if e.samples:
                    accepted = rng.randrange(len(e.spec_token_ids) + 1)
                    sampled[e.request_id] = tuple(rng.randrange(1, 9) for _ in range(accepted + 1))
                    drafts[e.request_id] = (rng.randrange(1, 9), rng.randrange(1, 9))
            s.update(done, StepResult(sampled, draft_token_ids=drafts))  # type: ignore[attr-defined]
    return plans


@pytest.mark.parametrize("drafter", ["draft_model", "ngram", "eagle"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_impl_plans_as_the_spec(drafter: str, runner: str, async_scheduling: bool) -> None:
    config = _config(drafter, runner, async_scheduling)
    skipped = 0
    for seed in range(6):
        spec_plans = _drive(SpecScheduler(config), seed, 40)
        assert _drive(ImplScheduler(config), seed, 40) == spec_plans
        skipped += sum(p.skip_drafts for p in spec_plans)
    assert (skipped > 0) == (drafter != "ngram" and runner == "v2")


def test_impl_charges_a_draft_slot_and_reserves_lookahead() -> None:
    config = _config("draft_model", "v1", False, max_num_batched_tokens=10, max_num_seqs=2)
    s = ImplScheduler(config)
    s.add(RequestSpec("a", tuple(range(1, 8)), 5))
    s.add(RequestSpec("b", tuple(range(11, 17)), 5))
    plan = s.schedule()
    # a: 7 tokens + 1 draft slot; b: min(3, 10 - 8 - 1) = 1
    assert [e.num_scheduled_tokens for e in plan.scheduled] == [7, 1]
    # 7 tokens and 2 lookahead slots: 3 blocks
    assert len(plan.scheduled[0].block_ids) == 3


def test_impl_skips_drafts_for_a_last_token() -> None:
    s = ImplScheduler(_config("draft_model", "v2", False))
    s.add(RequestSpec("a", (1, 2, 3), 1))
    assert s.schedule().skip_drafts


@pytest.mark.parametrize("groups", [
    (),
    (KVCacheGroup(), KVCacheGroup(kind="sliding_window", sliding_window=4)),
    (KVCacheGroup(), KVCacheGroup(kind="chunked_local", attention_chunk_size=4)),
])
def test_impl_keys_and_events_as_the_spec_with_eagle(groups: tuple[KVCacheGroup, ...]) -> None:
    """EAGLE's hash lookahead: the impl's keys (views) and KV cache events,
    lookahead_token_ids included, are the spec's, in the plain layout and
    the hybrid ones."""
    config = _config("eagle", "v1", False, enable_kv_cache_events=True, kv_cache_groups=groups)
    for seed in range(4):
        spec, impl = SpecScheduler(config), ImplScheduler(config)
        assert _drive(impl, seed, 30) == _drive(spec, seed, 30)
        assert impl.view().kv == spec.view().kv
        events = spec.take_kv_events()
        assert impl.take_kv_events() == events
        assert any(getattr(e, "lookahead_token_ids", None) for e in events)


def test_impl_widens_the_encoder_window_with_eagle() -> None:
    from schedspec.spec.interface import MMInput

    config = _config("eagle", "v1", False, max_num_batched_tokens=8, max_num_seqs=2, max_num_encoder_input_tokens=8,
                     encoder_cache_size=8)
    request = RequestSpec("a", tuple(range(1, 17)), 2, mm_inputs=(MMInput(4, 4, "x"), MMInput(8, 4, "y")))
    spec, impl = SpecScheduler(config), ImplScheduler(config)
    spec.add(request)
    impl.add(request)
    plan = impl.schedule()
    assert plan == spec.schedule() and plan.scheduled[0].encoder_inputs == (0, 1)
