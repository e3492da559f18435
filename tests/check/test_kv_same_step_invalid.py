"""A prefix hit in the step of a synchronous load that fails reads the
invalid block: found by the spec's own KV state machine
(tests/testing/test_kv_strategies.py) run for thousands of examples, and
shrunk to three events. r3 loads four tokens of its prompt synchronously;
r6, with the same prompt, is admitted in the same step with a prefix hit on
those four tokens; the worker reports r3's load failed (block 1 invalid,
under "recompute"). r3 recomputes, but r6 has already read position 3 from
the invalid block: the fake model reports kv-context. vLLM 0.33 does the
same (``schedspec replay TRACE --against vllm --mode invariants``), so the
spec is in lockstep with it; the spec's owners decide whether it becomes a
documented defect the generators steer around (check/defects.py) or a fix.
"""

from __future__ import annotations

import pytest

from schedspec.check.run import failure_of
from schedspec.check.workload import AddRequest, KVLoadFailed, Workload
from schedspec.spec.interface import Policy, RequestSpec, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler

CONFIG = SchedulerConfig(block_size=1, num_blocks=13, max_num_batched_tokens=16, max_num_seqs=3, max_model_len=12,
                         enable_chunked_prefill=True, long_prefill_token_threshold=3, enable_prefix_caching=True,
                         policy=Policy.FCFS, kv_connector=True, kv_load_failure_policy="recompute")
PROMPT = (0, 0, 0, 0, 3)
EVENTS = (
    AddRequest(RequestSpec("r3", PROMPT, 1, arrival=3, kv_external_tokens=4)),
    AddRequest(RequestSpec("r6", PROMPT, 1, arrival=6)),
    KVLoadFailed("r3"),
)


def test_the_reproduction_fails_as_reported() -> None:
    failure = failure_of(Workload(CONFIG, EVENTS), {"spec": SpecScheduler})
    assert failure is not None and [v.invariant_id for v in failure.violations] == ["kv-context"]
    assert "r6: position 3" in failure.violations[0].message


@pytest.mark.xfail(strict=True, reason="a prefix hit in the step of a synchronous load that fails reads the invalid "
                                       "block (spec and vLLM 0.33 alike; reported to the spec's owners)")
def test_a_same_step_hit_on_a_failed_synchronous_load_reads_no_invalid_block() -> None:
    assert failure_of(Workload(CONFIG, EVENTS), {"spec": SpecScheduler}) is None
