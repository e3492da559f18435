"""The guided generator's focus and drain: rules one workload can hold
together, the sweep a run starts its swarm with, the bounded drain."""

from __future__ import annotations

from schedspec.check.coverage_guided import (
    SWEEP, choose_focus, drain_estimate, drain_victims, focus_conflict, sweep_lead,
)
from schedspec.spec.interface import RequestSpec, SchedulerConfig
from schedspec.spec.rule_names import RULE_NAMES
from schedspec.spec.scheduler import SpecScheduler


def test_rules_that_need_setups_one_workload_cannot_hold_conflict() -> None:
    assert focus_conflict("connector.invalid_recompute", "sessions.update_applied")
    assert focus_conflict("kv.hash_lookahead_wait", "connector.load_async")
    assert focus_conflict("mamba.chunk_aligned", "kv_groups.window_freed")
    assert focus_conflict("kv_groups.chunk_freed", "kv_groups.window_freed")
    assert not focus_conflict("connector.invalid_recompute", "kv_groups.window_freed")
    assert not focus_conflict("running.scheduled", "sessions.update_applied")


def test_no_focus_holds_two_rules_that_conflict() -> None:
    for seed in range(300):
        focus = choose_focus({}, seed)
        assert len(focus) == 3
        assert not any(focus_conflict(a, b) for a in focus for b in focus if a != b), focus


def test_a_lead_starts_the_focus_and_the_rest_fit_beside_it() -> None:
    for seed in range(100):
        focus = choose_focus({}, seed, lead=("connector.invalid_recompute",))
        assert focus[0] == "connector.invalid_recompute" and len(focus) == 3
        assert not any(focus_conflict(focus[0], rule) for rule in focus[1:]), focus


def test_the_sweep_leads_the_first_swarm_workloads_with_rules_the_run_can_reach() -> None:
    assert sweep_lead(0, RULE_NAMES) == (SWEEP[0],)
    assert [sweep_lead(i, RULE_NAMES) for i in range(len(SWEEP))] == [(rule,) for rule in SWEEP]
    assert sweep_lead(len(SWEEP), RULE_NAMES) == () and sweep_lead(-1, RULE_NAMES) == ()
    # a rule out of the run's reach is skipped, not led with
    names = [rule for rule in RULE_NAMES if rule != SWEEP[0]]
    assert sweep_lead(0, names) == (SWEEP[1],)


def test_the_drain_is_bounded_by_aborting_the_requests_with_most_work_left() -> None:
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256, num_blocks=200)
    spec = SpecScheduler(config)
    for i, (prompt, out) in enumerate(((200, 40), (10, 4), (12, 2))):
        spec.add(RequestSpec(f"r{i}", tuple(range(1, prompt + 1)), max_tokens=out))
    live = list(spec.requests.values())
    # on the long side: r0's 240 tokens a token a step (more than all 268 at 8 a step)
    assert drain_estimate(live, config) == 240
    assert drain_victims(spec, config, 1000) == []
    victims = drain_victims(spec, config, 10)
    assert victims[0] == "r0"
    assert drain_estimate([r for r in live if r.request_id not in victims], config) <= 10


def test_an_eagle_focus_keys_the_plain_layout_unless_a_group_rule_is_beside_it() -> None:
    from schedspec.check.coverage_guided import guided_workload
    kv, engine, modes = ("connector", "hybrid"), ("drafter",), ("sync", "async", "spec", "async-spec")
    alone = [guided_workload(s, 20, focus=("kv.hash_lookahead_wait",), kv=kv, engine=engine, modes=modes).config
             for s in range(12)]
    eagle = [c for c in alone if c.num_hash_lookahead_tokens]
    assert len(eagle) >= 8 and not any(c.is_hybrid for c in eagle)
    paired = [guided_workload(s, 20, focus=("kv.hash_lookahead_wait", "kv_groups.window_freed"), kv=kv,
                              engine=engine, modes=modes).config for s in range(12)]
    assert sum(1 for c in paired if c.num_hash_lookahead_tokens and c.is_hybrid) >= 4


def test_a_focus_on_partial_entries_mamba_or_eagle_turns_prefix_caching_on() -> None:
    from schedspec.check.coverage_guided import guided_workload
    kv, engine, modes = ("connector", "hybrid"), ("drafter",), ("sync", "async", "spec", "async-spec")
    for focus in (("kv_groups.partial_stored",), ("mamba.chunk_aligned",), ("kv.hash_lookahead_wait",),
                  ("kv.hash_lookahead_wait", "kv_groups.window_freed")):
        for seed in range(10):
            config = guided_workload(seed, 10, focus=focus, kv=kv, engine=engine, modes=modes).config
            assert config.enable_prefix_caching and not config.kv_connector, (focus, seed)
