"""Declared capabilities: configs, requests and workloads kept within them
(the identity when everything is supported), invariants skipped by premise."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from schedspec.check.capabilities import GATE_CAPABILITY_NAMES, FULL, Capabilities, CapabilityError, capabilities_of
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import Abort, AddRequest, ResetPrefixCache
from schedspec.invariants import CATALOGUE, BY_ID
from schedspec.spec.interface import Policy, SchedulerConfig
from schedspec.testing.strategies import configs, requests

NARROW = Capabilities(
    policies=frozenset({Policy.FCFS}), chunked_prefill=False, long_prefill_threshold=False,
    prefix_caching=False, salts=False, stop_tokens=False, abort=False, reset_prefix_cache=False,
    min_block_size=4,
)


def test_full_capabilities_change_nothing() -> None:
    for seed in range(30):
        w = random_workload(seed, 60)
        assert FULL.restrict_workload(w) is w
    assert FULL.is_full and "async_scheduling" in FULL.describe()


def test_a_narrow_declaration_keeps_seeded_workloads_within_it() -> None:
    for seed in range(40):
        w = NARROW.restrict_workload(random_workload(seed, 60))
        assert NARROW.workload_problems(w) == []
        cfg = w.config
        assert cfg.policy == Policy.FCFS and not cfg.enable_chunked_prefill and cfg.block_size >= 4
        assert cfg.max_num_batched_tokens >= cfg.max_model_len
        assert (cfg.num_blocks - 1) * cfg.block_size >= cfg.max_model_len  # one request still fits
        assert not any(isinstance(e, (Abort, ResetPrefixCache)) for e in w.events)
        for e in w.events:
            if isinstance(e, AddRequest):
                assert e.request.cache_salt is None and not e.request.stop_token_ids
                assert e.request.eos_token_id is None


@settings(max_examples=150, deadline=None)
@given(configs(capabilities=NARROW))
def test_the_config_strategy_draws_within_a_declaration(cfg: object) -> None:
    assert NARROW.config_problems(cfg) == []  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(requests("r1", 1, 32, [(1, 2, 3, 4)], capabilities=NARROW))
def test_the_request_strategy_draws_within_a_declaration(req: object) -> None:
    assert NARROW.request_problems(req) == []  # type: ignore[arg-type]


def test_invariants_whose_premise_is_unsupported_are_skipped_with_the_reason() -> None:
    kept, skipped = NARROW.split(CATALOGUE)
    why = dict(skipped)
    assert why["priority-admission-order"] == "needs policy_priority"
    assert why["long-prefill-threshold"] == "needs long_prefill_threshold"
    assert why["reset-prefix-cache"] == "needs reset_prefix_cache"
    assert BY_ID["token-budget"] in kept and len(kept) + len(skipped) == len(CATALOGUE)
    # the invariants of the admission gates need their gate; with every gate, nothing is skipped
    # (and those of the KV connector and hybrid groups, kv_connector / hybrid_kv, theirs)
    # (and those of the KV cache events, kv_events, theirs: an output a scheduler opts into)
    kv = {"kv_connector", "hybrid_kv", "kv_events"}
    gated = tuple(inv for inv in CATALOGUE if inv.requires & (set(GATE_CAPABILITY_NAMES) | kv))
    assert gated
    assert FULL.split(CATALOGUE)[1] == tuple((inv.id, "needs " + ", ".join(sorted(inv.requires))) for inv in gated)
    kv_only = tuple((inv.id, "needs " + ", ".join(sorted(inv.requires))) for inv in CATALOGUE if inv.requires & kv)
    assert kv_only and FULL.with_gates().split(CATALOGUE)[1] == kv_only
    events_only = tuple((inv.id, "needs kv_events") for inv in CATALOGUE if "kv_events" in inv.requires)
    assert events_only and FULL.with_gates().with_kv().split(CATALOGUE)[1] == events_only
    every = dataclasses.replace(FULL.with_gates().with_kv(), kv_events=True)
    assert every.split(CATALOGUE) == (CATALOGUE, ())


def test_malformed_declarations_are_refused() -> None:
    with pytest.raises(CapabilityError, match="non-empty"):
        Capabilities(policies=frozenset())
    with pytest.raises(CapabilityError, match="min_block_size"):
        Capabilities(min_block_size=0)

    class Bad:
        CAPABILITIES = {"policies": ["FCFS"]}

    with pytest.raises(CapabilityError, match="not a schedspec.check.capabilities.Capabilities"):
        capabilities_of(Bad)
    assert capabilities_of(object) is FULL


def test_round_trip_as_data() -> None:
    assert Capabilities.from_dict(NARROW.to_dict()) == NARROW
    with pytest.raises(CapabilityError, match="unknown capabilities"):
        Capabilities.from_dict({"teleport": True})
    assert dataclasses.replace(NARROW, abort=True).names() - NARROW.names() == {"abort"}


def test_the_strategies_and_the_machine_draw_the_gates_a_declaration_supports() -> None:
    from hypothesis import settings as hsettings

    from schedspec.check.features import gates_of
    from schedspec.testing.strategies import configs

    seen: set[str] = set()
    caps = Capabilities().with_gates(("lora", "watermark", "cadence", "encoder"))

    @hsettings(max_examples=60, derandomize=True, deadline=None)
    @given(configs(capabilities=caps), configs())
    def draw(gated: SchedulerConfig, plain: SchedulerConfig) -> None:
        seen.update(gates_of(gated))
        assert gates_of(plain) == ()  # a declaration without gates draws none

    draw()
    assert seen == {"lora", "watermark", "cadence", "encoder"}


def test_the_state_machine_runs_the_gates_on_the_spec() -> None:
    from hypothesis import settings as hsettings
    from hypothesis.stateful import run_state_machine_as_test

    from schedspec.adapters.registry import resolve
    from schedspec.testing.stateful import RunTally, make_machine

    target = resolve("spec")
    tally = RunTally()
    # the gates alone (the KV features have their own machine: tests/testing/test_kv_strategies.py)
    caps = dataclasses.replace(target.capabilities, kv_connector=False, hybrid_kv=False)
    machine = make_machine({"spec": target.factory}, capabilities=caps, tally=tally, name="GateMachine")
    run_state_machine_as_test(
        machine, settings=hsettings(max_examples=30, stateful_step_count=50, derandomize=True, deadline=None))
    total = tally.total
    assert total.pauses and total.paused_steps and total.grammars_ready and total.encoder_inputs
    assert total.lora_steps
