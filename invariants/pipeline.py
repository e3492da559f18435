"""Invariants of k plans in flight (pipeline parallelism:
SchedulerConfig.pipeline_parallel_size, k = max_concurrent_batches).

vLLM's engine core keeps up to k scheduler outputs in its batch queue and
updates the oldest first (vllm/v1/engine/core.py,
EngineCore.step_with_batch_queue). The plain Scheduler has no output
placeholders, so a request's decode in flight leaves it nothing to schedule
(num_new_tokens = num_tokens - num_computed_tokens = 0) until its update;
only a prefill goes on chunk by chunk. The placeholders of async scheduling
and the tokens each update delivers are held by invariants/inflight.py.
"""

from __future__ import annotations

from typing import Iterator

from schedspec.invariants.core import Finding, History, Transition, transition_invariant
from schedspec.invariants.inflight import live_entries


@transition_invariant(
    "in-flight-within-k",
    "At most k = max_concurrent_batches plans in flight, in step order; an update completes the "
    "oldest, once.",
    "vllm/v1/engine/core.py, EngineCore.step_with_batch_queue (schedule while len(batch_queue) < "
    "batch_queue_size; batch_queue.pop takes the oldest).",
    ("schedule", "update"),
    tags=("safety",),
)
def in_flight_within_k(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    k = t.after.config.max_concurrent_batches
    steps = [p.step for p in t.in_flight]
    if len(steps) > k:
        yield None, f"{len(steps)} plans in flight (steps {steps}), k = max_concurrent_batches is {k}"
    if steps != sorted(set(steps)):
        yield None, f"plans in flight out of step order: {steps}"
    if t.kind == "schedule" and steps and steps[-1] != t.plan.step:
        yield None, f"step {t.plan.step} was scheduled but the newest plan in flight is step {steps[-1]}"
    if t.kind == "update" and (t.plan.step in steps or any(s < t.plan.step for s in steps)):
        yield None, (f"update completed step {t.plan.step} while steps {steps} are in flight: the "
                     "oldest plan is updated first, and once")


@transition_invariant(
    "pipeline-no-recompute",
    "Without async scheduling, a request's entries in the plans in flight cover disjoint "
    "positions and at most one samples: each output is produced once.",
    "vllm/v1/core/sched/scheduler.py, _update_after_schedule (num_computed_tokens advanced at "
    "schedule time); the RUNNING loop (num_new_tokens 0: continue).",
    ("schedule",),
    tags=("safety",),
)
def pipeline_no_recompute(t: Transition, h: History) -> Iterator[Finding]:
    cfg = t.after.config
    if cfg.async_scheduling or cfg.max_concurrent_batches < 2:
        return
    for rid, r in t.after.requests.items():
        entries = live_entries(r, t.in_flight)
        if len(entries) < 2:
            continue
        sampling = [e for e in entries if e.samples]
        if len(sampling) > 1:
            yield rid, f"{len(sampling)} steps in flight sample it: the later ones produce a token already in flight"
        spans = sorted((e.num_computed_tokens, e.num_computed_tokens + e.num_scheduled_tokens) for e in entries)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                yield rid, f"steps in flight compute positions {spans}: position {start} twice"
                break
