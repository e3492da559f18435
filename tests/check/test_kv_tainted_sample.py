"""Async scheduling with a failed synchronous KV load (recompute): the plan
made before the update that reports the failure reads the unfilled block, yet
vLLM keeps what it samples (update_from_output skips only that update's own
failed_kv_load_req_ids), so the request's next tokens follow that sample. The
driver once dropped it from the context the fake model must read back, and
reported a kv-context violation ("position 4 holds 40, the request's token
there is None") where spec and vLLM agree step by step; it also made the
guided generator's simulation fail silently and emit a Step with two plans in
flight (`schedule with steps 50 and 51 in flight`)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from schedspec.check.driver import Runner
from schedspec.check.workload import AddRequest, KVLoadFailed, Step
from schedspec.spec.interface import RequestSpec, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler

CFG = SchedulerConfig(block_size=1, num_blocks=24, max_model_len=16, max_num_batched_tokens=8, max_num_seqs=2,
                      long_prefill_token_threshold=1,
                      async_scheduling=True, kv_connector=True, kv_load_failure_policy="recompute")
EVENTS = [AddRequest(RequestSpec("r", (7, 5, 0, 11), 2, kv_external_tokens=2)), KVLoadFailed("r", 1),
          Step(), Step(), Step()]


def run(factories: dict[str, type]) -> tuple[Runner, object]:
    r = Runner(CFG, factories, vocab=64, check_invariants=True)
    return r, r.run_to_completion(EVENTS)


def test_the_sample_of_the_plan_before_the_failure_report_is_kept() -> None:
    """Step 1 loads r's first 2 tokens (block 1 fails) and computes 2..3;
    step 2, planned before update 1, samples after the placeholder of step
    1's output. Update 1 skips r (failed_kv_load_req_ids) and truncates it
    to 1 computed token; update 2 appends step 2's sample (vLLM keeps it):
    the driver's context has it too. What stays is vLLM's own stale
    placeholder: the skipped output of step 1 still counts in
    num_output_placeholders, so step 3 plans a -1 at position 4 that no
    output fills (docs/divergences.md), which the fake model reports."""
    r, failure = run({"spec": SpecScheduler})
    assert failure is not None and failure.step == 3
    (v,) = failure.violations
    assert v.invariant_id == "kv-context" and "position 4: a -1 placeholder" in v.message
    # not the old report: the sample of step 2 is in the context
    assert "holds" not in v.message


REQUIRE = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_vllm_plans_the_same_stale_placeholder() -> None:
    """In lockstep vLLM plans and views equal the spec's up to the same
    finding (no mismatch is reported first)."""
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.adapters.vllm_load import load_vllm

    load_vllm()
    _, failure = run({"spec": SpecScheduler, "vllm": VllmScheduler})
    assert failure is not None and failure.step == 3
    assert [v.invariant_id for v in failure.violations] == ["kv-context"]
