"""Declared capabilities: configs, requests and workloads kept within them
(the identity when everything is supported), invariants skipped by premise."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from schedspec.check.capabilities import FULL, Capabilities, CapabilityError, capabilities_of
from schedspec.check.workload import Abort, AddRequest, ResetPrefixCache, random_workload
from schedspec.invariants import CATALOGUE, BY_ID
from schedspec.spec.interface import Policy
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
    assert FULL.split(CATALOGUE) == (CATALOGUE, ())


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
