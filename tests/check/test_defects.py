"""The vLLM defects the generators steer around are a table of records
(schedspec/check/defects.py): each names its docs/divergences.md entry, the
draws it changes, and when it applies."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
from pathlib import Path

import pytest

from schedspec.check.defects import (
    ABORT_AFTER_FAILED_SYNC_LOAD,
    ASYNC_LOAD,
    DEFECTS,
    FAIL_ASYNC_LOAD_AT_BLOCK,
    FAIL_SYNC_LOAD,
    KNOBS,
    avoid,
)
from schedspec.check.kv_requests import KVRequests
from schedspec.spec.interface import KVCacheGroup, MMInput, RequestSpec, SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]

CFG = SchedulerConfig(block_size=2, num_blocks=40, max_model_len=32, max_num_batched_tokens=32,
                      kv_connector=True, kv_load_failure_policy="fail")
REQ = RequestSpec("r", tuple(range(1, 9)), 1)


def test_the_records_are_well_formed_and_every_knob_is_used() -> None:
    names = [d.name for d in DEFECTS]
    assert len(set(names)) == len(names)
    for d in DEFECTS:
        # a record steers the generators (knobs) or, where that would cost rules, is named when met
        # (witness); one the scheduler's own choice makes (no draw) is named by the trace's shape
        assert (d.knobs or d.witness or d.witnessed is not None) and (d.knobs | d.witness) <= set(KNOBS), d.name
        assert d.behaviour and d.section and d.reported_by, d.name
    assert set().union(*(d.knobs for d in DEFECTS)) == set(KNOBS)


def test_each_defect_has_its_entry_in_the_divergences_document() -> None:
    text = (ROOT / "docs" / "divergences.md").read_text()
    for d in DEFECTS:
        assert f"**{d.section}" in text, f"{d.name}: no entry titled {d.section!r} in docs/divergences.md"


def test_nothing_is_avoided_for_a_plain_request() -> None:
    assert not any(avoid(k, CFG, REQ) for k in (ASYNC_LOAD, FAIL_SYNC_LOAD, FAIL_ASYNC_LOAD_AT_BLOCK))
    # an asynchronous load's request may be aborted after a failure
    assert not avoid(ABORT_AFTER_FAILED_SYNC_LOAD, CFG, RequestSpec("a", (1, 2), 1, kv_external_tokens=1,
                                                                    kv_load_async=True))


def test_each_defect_steers_its_draws() -> None:
    one_token = RequestSpec("r", (5,), 1)
    assert avoid(ASYNC_LOAD, CFG, one_token)
    spec = SchedulerConfig(block_size=2, num_blocks=17, max_model_len=32, max_num_batched_tokens=32,
                           num_speculative_tokens=2, kv_connector=True)
    assert avoid(ASYNC_LOAD, spec, RequestSpec("r", tuple(range(1, 30)), 1))
    assert not avoid(ASYNC_LOAD, spec, RequestSpec("r", tuple(range(1, 5)), 1))
    assert avoid(FAIL_SYNC_LOAD, dataclasses.replace(CFG, async_scheduling=True), REQ)
    assert avoid(FAIL_SYNC_LOAD, CFG, RequestSpec("r", tuple(range(1, 9)), 1, mm_inputs=(MMInput(1, 2, "m"),)))
    window = dataclasses.replace(CFG, kv_load_failure_policy="recompute",
                                 kv_cache_groups=(KVCacheGroup("sliding_window", sliding_window=4),))
    assert avoid(FAIL_SYNC_LOAD, window, REQ) and avoid(FAIL_ASYNC_LOAD_AT_BLOCK, window, REQ)
    assert avoid(ABORT_AFTER_FAILED_SYNC_LOAD, CFG, RequestSpec("s", (1, 2), 1, kv_external_tokens=1))


def test_the_generator_draws_no_async_load_of_a_one_token_prompt() -> None:
    kv = KVRequests(CFG, random.Random(1))
    drawn = [kv.decorate(RequestSpec(f"x{i}", (7,), 1)) for i in range(200)]
    assert not any(r.kv_load_async for r in drawn)


def test_a_defect_of_the_schedulers_own_choice_is_named_by_the_trace_shape() -> None:
    from schedspec.check.defects import known_defect
    from schedspec.spec.interface import Policy

    priority = dataclasses.replace(CFG, policy=Policy.PRIORITY, enable_prefix_caching=True)
    hit = known_defect(priority, [], {"kv-context"})
    assert hit is not None and hit.name == "victim-preempted-in-its-step"
    # FCFS, or no prefix cache, or another report: not that defect
    assert known_defect(dataclasses.replace(priority, policy=Policy.FCFS), [], {"kv-context"}) is None
    assert known_defect(dataclasses.replace(priority, enable_prefix_caching=False), [], {"kv-context"}) is None
    assert known_defect(priority, [], {"block-conservation"}) is None


def test_the_async_load_prefill_livelock_is_named_on_its_trace() -> None:
    """The soak's counterexample (sync, seed 768, shrunk to two requests): the spec stalls, and the
    stall is the documented livelock, not a finding against the scheduler under test."""
    from schedspec.check import trace as tracefile
    from schedspec.check.defects import failure_reports, known_defect
    from schedspec.check.run import run_workload
    from schedspec.spec.interface import Policy
    from schedspec.spec.scheduler import SpecScheduler

    t = tracefile.read(ROOT / "tests" / "check" / "data" / "async-load-and-self-preempting-prefill-livelock.jsonl")
    failure = run_workload(t.workload, {"spec": SpecScheduler}, t.vocab, oracle_seed=t.oracle_seed)[1]
    assert failure is not None and failure.kind == "stall", failure
    hit = known_defect(t.workload.config, t.workload.events, failure_reports(failure.kind, ()))
    assert hit is not None and hit.name == "async-load-prefill-livelock"
    fcfs = dataclasses.replace(t.workload.config, policy=Policy.FCFS)
    assert known_defect(fcfs, t.workload.events, {"stall"}) is None


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("SCHEDSPEC_REQUIRE_VLLM") != "1",
                    reason="vLLM is not installed")
def test_a_silent_session_holding_the_pool_is_named_on_its_trace() -> None:
    """`check --sessions` (sync, seed 19, shrunk): a session waiting for input holds 13 of 20
    blocks, the preempted request behind it needs its whole sequence and never fits; the spec and
    vLLM alike stall (stream-liveness), and the stall is the documented defect."""
    from schedspec.check import trace as tracefile
    from schedspec.check.defects import failure_reports, known_defect
    from schedspec.check.run import run_workload
    from schedspec.invariants import select
    from schedspec.spec.scheduler import SpecScheduler
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.adapters.vllm_load import load_vllm

    t = tracefile.read(ROOT / "tests" / "check" / "data" / "silent-stream-holds-the-pool.jsonl")
    load_vllm()
    factories = {"spec": SpecScheduler, "vllm": VllmScheduler}
    failure = run_workload(t.workload, factories, t.vocab, oracle_seed=t.oracle_seed,
                           invariants=select("all", "lockstep"))[1]
    assert failure is not None and failure.scheduler == "spec", failure
    assert [v.invariant_id for v in failure.violations] == ["stream-liveness"]
    hit = known_defect(t.workload.config, t.workload.events, failure_reports(failure.kind, ["stream-liveness"]))
    assert hit is not None and hit.name == "silent-stream-holds-the-pool"
    assert known_defect(t.workload.config, [], {"stream-liveness"}) is None  # no session: not that defect
