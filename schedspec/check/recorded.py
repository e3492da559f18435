"""A replay held to the plans a recorded engine made (trace format 5).

A trace captured from vLLM 0.32's engine (schedspec/engine/recorder.py)
carries, at every ``schedule`` event, the plan the engine's scheduler made
there (RecordedPlan). :func:`compare_plans` holds the plans a replay made
(its step history) to them, step by step, and names the first step where
they differ. The spec models vLLM 0.33; where 0.32 schedules otherwise, the
difference is one of DIFFERENCES, the documented list of the 0.32 -> 0.33
differences a replay has met on captured traces (docs/engine.md): a replay
reports such a step as that difference, not as a bug, and what follows it
(recorded tokens that no longer fit the plans) as its consequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from schedspec.check.records import StepRecord
from schedspec.check.workload import Event, RecordedPlan, Schedule, Step
from schedspec.spec.interface import SchedulerConfig, StepPlan


@dataclass(frozen=True)
class VersionDifference:
    """A documented way vLLM 0.32's scheduler plans differently from 0.33's
    (the spec's): ``applies`` says whether a step's mismatch is this one."""

    id: str
    statement: str
    applies: Callable[[SchedulerConfig, RecordedPlan, StepPlan], bool]


#: The documented 0.32 -> 0.33 differences the replay has met on captured
#: traces (none yet on the default workloads: see docs/engine.md).
DIFFERENCES: tuple[VersionDifference, ...] = ()


@dataclass(frozen=True)
class PlanMismatch:
    step: int
    message: str
    difference: VersionDifference | None = None

    def describe(self) -> str:
        if self.difference is not None:
            return (f"step {self.step}: the documented vLLM 0.32 -> 0.33 difference {self.difference.id} "
                    f"({self.difference.statement}): {self.message}")
        return f"step {self.step}: the plan differs from the recorded engine's: {self.message}"


def recorded_plans(events: Sequence[Event]) -> dict[int, RecordedPlan]:
    """Step number (the n-th plan of the trace is step n) -> the plan
    recorded there."""
    out: dict[int, RecordedPlan] = {}
    step = 0
    for event in events:
        if isinstance(event, (Step, Schedule)):
            step += 1
            if isinstance(event, Schedule) and event.plan is not None:
                out[step] = event.plan
    return out


def plan_mismatch(recorded: RecordedPlan, plan: StepPlan) -> str | None:
    """The first way ``plan`` differs from ``recorded``, or None."""
    ours = RecordedPlan.of(plan)
    for i, (want, got) in enumerate(zip(recorded.scheduled, ours.scheduled)):
        if want != got:
            fields = ("request", "kind", "num_computed_tokens", "num_scheduled_tokens", "drafts")
            what = next(f for f, a, b in zip(fields, want, got) if a != b)
            return (f"entry {i}: recorded {list(want)}, replayed {list(got)} "
                    f"(the {what} differs)")
    if len(recorded.scheduled) != len(ours.scheduled):
        return (f"recorded {len(recorded.scheduled)} entries "
                f"({', '.join(e[0] for e in recorded.scheduled)}), replayed {len(ours.scheduled)} "
                f"({', '.join(e[0] for e in ours.scheduled)})")
    if recorded.preempted != ours.preempted:
        return f"recorded preempted {list(recorded.preempted)}, replayed {list(ours.preempted)}"
    if recorded.finished != ours.finished:
        return f"recorded finished {list(recorded.finished)}, replayed {list(ours.finished)}"
    return None


def compare_plans(config: SchedulerConfig, events: Sequence[Event], history: Sequence[StepRecord],
                  last_plan: StepPlan | None = None) -> tuple[int, PlanMismatch | None]:
    """How many recorded plans the replay's ``history`` matched, and the
    first mismatch (classified against DIFFERENCES), or None. ``last_plan``:
    the replay's last plan, when a failure in its step (the recorded tokens
    not fitting it) kept it out of the history. A step the replay never
    reached is not compared."""
    recorded = recorded_plans(events)
    plans = [record.plan for record in history]
    if last_plan is not None and all(p.step != last_plan.step for p in plans):
        plans.append(last_plan)
    compared = 0
    for plan in plans:
        want = recorded.get(plan.step)
        if want is None:
            continue
        message = plan_mismatch(want, plan)
        if message is not None:
            known = next((d for d in DIFFERENCES if d.applies(config, want, plan)), None)
            return compared, PlanMismatch(plan.step, message, known)
        compared += 1
    return compared, None
