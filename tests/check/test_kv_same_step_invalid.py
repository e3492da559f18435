"""A prefix hit in the step of a synchronous load that fails reads the
invalid block: found by the spec's own KV state machine
(tests/testing/test_kv_strategies.py) run for thousands of examples, and
shrunk to three events. r3 loads four tokens of its prompt synchronously;
r6, with the same prompt, is admitted in the same step with a prefix hit on
those four tokens; the worker reports r3's load failed (block 1 invalid,
under "recompute"). r3 recomputes, but r6 has already read position 3 from
the invalid block: the fake model reports kv-context. vLLM 0.33 does the
same (``schedspec replay TRACE --against vllm --mode invariants``): a
documented vLLM defect (docs/divergences.md), which a check names when the
reference meets it (check/defects.py, same-step-hit-on-failed-sync-load).
"""

from __future__ import annotations

from schedspec.check.defects import failure_reports, known_defect
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


def test_the_reproduction_fails_as_reported_and_is_named_as_the_documented_defect() -> None:
    failure = failure_of(Workload(CONFIG, EVENTS), {"spec": SpecScheduler})
    assert failure is not None and [v.invariant_id for v in failure.violations] == ["kv-context"]
    assert "r6: position 3" in failure.violations[0].message
    defect = known_defect(CONFIG, EVENTS, failure_reports(failure.kind, ["kv-context"]))
    assert defect is not None and defect.name == "same-step-hit-on-failed-sync-load"


def test_without_the_failed_load_nothing_is_named() -> None:
    assert failure_of(Workload(CONFIG, EVENTS[:2]), {"spec": SpecScheduler}) is None
    assert known_defect(CONFIG, EVENTS[:2], {"kv-context"}) is None
