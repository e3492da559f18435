"""Two vLLM 0.33 defects around a failed synchronous KV load under
"recompute", found by `schedspec check --kv connector --modes sync --seed 300`
(docs/divergences.md). Spec and vLLM agree on both step by step; the check
names each, and its generator leaves the combination out
(schedspec/check/defects.py) so the default check stays on what vLLM
computes correctly.

- A shared invalid block whose recomputing holder is aborted: vLLM lets the
  second holder count the block computed because the first one will
  recompute it (_update_requests_with_invalid_blocks,
  marked_invalid_block_ids); once the first is aborted nobody does, and the
  second reads the invalid KV. `invalid-block-not-computed` fires at the
  abort, and the fake model finds the context wrong at the next step.
- A recompute that rewinds a request before an encoder input it never
  encoded, while its own later input (scheduled in the failed step) fills the
  encoder cache: the input cannot be scheduled until that entry is freed,
  which needs the request to pass it; vLLM never schedules it again."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import pytest

from schedspec.check.driver import Runner
from schedspec.check.records import Failure
from schedspec.check.defects import keep_failed_sync_loads_alive
from schedspec.check.workload import Abort, AddRequest, Event, KVLoadFailed, Step
from schedspec.spec.interface import KVCacheGroup, MMInput, Policy, RequestSpec, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler

REQUIRE = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

SHARED_CFG = SchedulerConfig(block_size=1, num_blocks=42, max_model_len=32, max_num_batched_tokens=32, max_num_seqs=8,
                             enable_chunked_prefill=False, policy=Policy.PRIORITY, scheduler_reserve_full_isl=False,
                             kv_connector=True, kv_load_failure_policy="recompute")
SHARED: list[Event] = [
    AddRequest(RequestSpec("r46", (12, 11), 1, ignore_eos=True, priority=954, arrival=46)),
    AddRequest(RequestSpec("r47", (12, 11), 1, ignore_eos=True, arrival=47, kv_external_tokens=1)),
    KVLoadFailed("r47", 0), Step(), Abort("r47"), Step(),
]

ENCODER_CFG = SchedulerConfig(block_size=2, num_blocks=17, max_model_len=32, max_num_batched_tokens=40, max_num_seqs=1,
                              enable_chunked_prefill=False, scheduler_reserve_full_isl=False,
                              max_num_encoder_input_tokens=4, encoder_cache_size=4,
                              kv_connector=True, kv_load_failure_policy="recompute")
ENCODER: list[Event] = [
    AddRequest(RequestSpec("r91", (8, 7, 15, 9, 15, 3, 10, 14, 13, 3), 1, ignore_eos=True, arrival=91,
                           kv_external_tokens=6, mm_inputs=(MMInput(1, 4, "mm2"), MMInput(6, 4, "mm3")))),
    KVLoadFailed("r91"),
]


def _run(cfg: SchedulerConfig, events: list[Event], factories: dict[str, Any]) -> Failure | None:
    r = Runner(cfg, factories, vocab=64, check_invariants=True)
    return r.run_to_completion(events)


def test_an_aborted_recomputing_holder_leaves_the_shared_invalid_block_read_as_computed() -> None:
    failure = _run(SHARED_CFG, SHARED, {"spec": SpecScheduler})
    assert failure is not None
    found = {v.invariant_id: v.message for v in failure.violations}
    assert "invalid-block-not-computed" in found, found
    assert failure.kind == "violation" and "r46" in str(failure.violations) and "invalid block 1 (index 0)" in found["invalid-block-not-computed"]


def test_without_the_abort_the_first_holder_recomputes_and_nothing_fires() -> None:
    assert _run(SHARED_CFG, [e for e in SHARED if not isinstance(e, Abort)], {"spec": SpecScheduler}) is None


def test_a_rewind_before_an_unencoded_input_never_progresses() -> None:
    failure = _run(ENCODER_CFG, ENCODER, {"spec": SpecScheduler})
    assert failure is not None
    ids = {v.invariant_id for v in failure.violations}
    assert "progress" in ids, failure


def test_the_generator_keeps_a_failed_sync_load_alive() -> None:
    assert keep_failed_sync_loads_alive(list(SHARED), SHARED_CFG) == [e for e in SHARED if not isinstance(e, Abort)]
    # an asynchronous load's request may still be aborted (aborts during loads)
    async_req = AddRequest(RequestSpec("a", (1, 2, 3), 1, kv_external_tokens=2, kv_load_async=True))
    kept: list[Event] = [async_req, KVLoadFailed("a"), Abort("a")]
    assert keep_failed_sync_loads_alive(list(kept), SHARED_CFG) == kept
    # an abort before the failure is reported stays
    early: list[Event] = [SHARED[1], Abort("r47"), KVLoadFailed("r47", 0)]
    assert keep_failed_sync_loads_alive(list(early), SHARED_CFG) == early


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
@pytest.mark.parametrize("case", ["shared", "encoder"])
def test_vllm_agrees_up_to_the_same_finding(case: str) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.adapters.vllm_load import load_vllm

    load_vllm()
    cfg, events = (SHARED_CFG, SHARED) if case == "shared" else (ENCODER_CFG, ENCODER)
    failure = _run(cfg, events, {"spec": SpecScheduler, "vllm": VllmScheduler})
    assert failure is not None
    ids = {v.invariant_id for v in failure.violations}
    # a violation the spec and vLLM share, not a divergence between them
    assert failure.kind == "violation", failure.describe()
    assert ids & {"invalid-block-not-computed", "progress"}, failure.describe()


# The same defect through a preemption (`check --against spec --kv all --seed 2000`, seed 2001,
# shrunk): under "recompute" vLLM keeps a failed synchronous load's invalid blocks in the prefix
# cache for the recompute (_handle_invalid_blocks evicts only under "fail"); r51 is preempted
# before it recomputes them, and its own resumption hits them: 3 tokens counted computed through
# invalid block 7. The generator cannot leave this out (any request may be preempted), so the
# default check meets it, rarely, as a violation in the spec itself.
PREEMPT_CFG = SchedulerConfig(block_size=1, num_blocks=17, max_model_len=16, max_num_batched_tokens=48, max_num_seqs=4,
                              enable_chunked_prefill=False, policy=Policy.PRIORITY, scheduler_reserve_full_isl=False,
                              num_speculative_tokens=4,
                              kv_cache_groups=(KVCacheGroup("chunked_local", attention_chunk_size=4),),
                              kv_connector=True, kv_load_failure_policy="recompute")
PREEMPT: list[Event] = [
    AddRequest(RequestSpec("r51", (3, 7, 2, 4), 1, priority=1, arrival=51, kv_external_tokens=3)),
    KVLoadFailed("r51", 2),
    AddRequest(RequestSpec("r140", (12, 0, 5, 2, 5, 8, 6, 9, 3, 3), 1, arrival=140, kv_external_tokens=10,
                           kv_load_async=True)),
    AddRequest(RequestSpec("r171", (13, 10, 15, 12, 13, 2, 9, 12, 14, 13), 2, ignore_eos=True, arrival=171)),
]


def test_a_preempted_recompute_leaves_its_invalid_blocks_cached_for_its_own_resumption() -> None:
    failure = _run(PREEMPT_CFG, PREEMPT, {"spec": SpecScheduler})
    assert failure is not None and failure.kind == "violation", failure
    (v,) = failure.violations
    assert v.invariant_id == "invalid-block-not-computed" and "invalid block 7 (index 2)" in v.message, v
    assert failure.step == 3


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_vllm_resumes_the_preempted_request_through_the_invalid_block_too() -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.adapters.vllm_load import load_vllm

    load_vllm()
    failure = _run(PREEMPT_CFG, PREEMPT, {"spec": SpecScheduler, "vllm": VllmScheduler})
    assert failure is not None and failure.kind == "violation", failure
    assert {v.invariant_id for v in failure.violations} == {"invalid-block-not-computed"}


# Recompute into a freed sliding window through an asynchronous load (`check --against spec
# --kv all --seed 7000`, seed 7009): a lone window of 9 tokens, a 16-token load failing at block
# 0 under "recompute"; the promotion keeps 8 computed tokens whose window block was already
# nulled at the load's end, and the recompute attends it (docs/divergences.md).
WINDOW_CFG = SchedulerConfig(block_size=8, num_blocks=8, max_model_len=48, max_num_batched_tokens=4, max_num_seqs=2,
                             policy=Policy.PRIORITY, scheduler_reserve_full_isl=False, async_scheduling=True,
                             num_speculative_tokens=3,
                             kv_cache_groups=(KVCacheGroup("sliding_window", sliding_window=9),),
                             kv_connector=True, kv_load_failure_policy="recompute")
WINDOW: list[Event] = [
    AddRequest(RequestSpec("r126", (10, 3, 8, 11, 12, 9, 11, 7, 4, 10, 15, 13, 13, 13, 0, 1), 1, arrival=126,
                           kv_external_tokens=16, kv_load_async=True)),
    KVLoadFailed("r126", 0),
]


def test_a_failed_async_load_recomputes_into_its_freed_window() -> None:
    failure = _run(WINDOW_CFG, WINDOW, {"spec": SpecScheduler})
    assert failure is not None and failure.kind == "violation", failure
    assert {v.invariant_id for v in failure.violations} == {"group-tables-cover"}, failure.describe()


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_vllm_recomputes_into_the_freed_window_too() -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.adapters.vllm_load import load_vllm

    load_vllm()
    failure = _run(WINDOW_CFG, WINDOW, {"spec": SpecScheduler, "vllm": VllmScheduler})
    assert failure is not None and failure.kind == "violation", failure
    assert {v.invariant_id for v in failure.violations} == {"group-tables-cover"}


def test_the_generator_fails_no_load_into_a_window_under_recompute() -> None:
    import random

    from schedspec.check.kv_requests import KVRequests

    kv = KVRequests(WINDOW_CFG, random.Random(0))
    req = RequestSpec("x", tuple(range(1, 17)), 1)
    for i in range(400):
        kv.decorate(dataclasses.replace(req, request_id=f"x{i}"))
    drawn = [e for _, e in kv.due if isinstance(e, KVLoadFailed)]
    assert drawn and all(e.block_index is None for e in drawn)
