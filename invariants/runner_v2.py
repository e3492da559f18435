"""Model Runner V2's decode throttle (spec/runner_v2.py): with the V2 runner,
pipeline parallelism and async scheduling, a running request is scheduled at
most once every ``pipeline_parallel_size`` steps after a step in which it
sampled. History.decoded_at remembers each request's last sampling step."""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import ScheduleKind
from schedspec.spec.runner_v2 import decode_stagger

from schedspec.invariants.core import Finding, History, Transition, transition_invariant


def throttled(t: Transition, h: History, rid: str) -> bool:
    """Whether the RUNNING loop passes over running request ``rid`` in the
    plan of ``t`` for the decode throttle (its last sampling step is fewer
    than the stagger steps back)."""
    stagger = decode_stagger(t.before.config)
    last = h.decoded_at.get(rid)
    return bool(stagger) and t.plan is not None and last is not None and t.plan.step < last + stagger


@transition_invariant(
    "v2-decode-throttle",
    "Model Runner V2 with pipeline parallelism and async scheduling: a running request is scheduled "
    "(as RUNNING) no sooner than pipeline_parallel_size steps after a step in which it sampled.",
    "vllm/v1/core/sched/async_scheduler.py, AsyncScheduler._update_after_schedule: "
    "next_decode_eligible_step = current_step + decode_stagger (pp_size) when use_v2_model_runner; "
    "vllm/v1/core/sched/scheduler.py, schedule(), the RUNNING loop: current_step < "
    "request.next_decode_eligible_step: continue.",
    ("schedule",),
    tags=("policy:vllm-step",),
)
def v2_decode_throttle(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    stagger = decode_stagger(t.before.config)
    if not stagger:
        return
    for s in t.plan.scheduled:
        last = h.decoded_at.get(s.request_id)
        if s.kind == ScheduleKind.RUNNING and last is not None and t.plan.step < last + stagger:
            yield s.request_id, (
                f"scheduled in step {t.plan.step}, {t.plan.step - last} step(s) after it sampled in step {last}; "
                f"the V2 runner's pipeline of {stagger} lets it run again in step {last + stagger}"
            )
