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
    "At most k = max_concurrent_batches plans are in flight, in step order: a schedule adds the "
    "newest, and an update completes the oldest, which then leaves the batch queue (each plan "
    "is updated once).",
    "vllm/v1/engine/core.py, EngineCore.step_with_batch_queue: schedule() only while "
    "len(batch_queue) < batch_queue_size (vllm/config/vllm.py, max_concurrent_batches), "
    "batch_queue.appendleft then batch_queue.pop: the oldest future is the one awaited and "
    "its output the one update_from_output takes.",
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
    "Without async scheduling, the plans in flight never compute a position of a request twice: "
    "its entries in them cover disjoint positions, and at most one of them samples (a request "
    "whose sampling step is in flight is not scheduled again before its update), so each output "
    "token is produced and delivered once.",
    "vllm/v1/core/sched/scheduler.py, Scheduler._update_after_schedule (num_computed_tokens += "
    "num_scheduled_tokens at schedule time) and schedule(), the RUNNING loop (num_new_tokens = "
    "num_tokens_with_spec + num_output_placeholders - num_computed_tokens; 0: continue).",
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
