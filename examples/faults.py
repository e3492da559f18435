"""The fault catalogue: schedulers that break the protocol rather than an invariant, and what
schedspec says to each.

Each class below is ``examples.batch_bound.BatchBoundScheduler`` with one fault, from a given
call on (the first calls pass the conformance probe unless the fault is in them). ``FAULTS``
is the catalogue's one source: ``tests/examples/test_faults.py`` runs
``schedspec check --against examples.faults:CLASS --mode invariants`` on every entry and holds
the exit status and the message to it, and ``python -m tools.faults`` writes the table of
docs/adapters.md ("Faults and what they get") from it (``--check`` fails when the doc is stale).
A method that never returns is caught by the deadline on every call (``--call-timeout``;
the rows run with 1 s). A new fault is a class and a ``Fault``: the test and the doc follow.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from examples.batch_bound import BatchBoundScheduler
from schedspec.spec.interface import RequestSpec, SchedulerConfig, SchedulerView, StepPlan, StepResult


@dataclass(frozen=True)
class Fault:
    """One row: the class, what it does wrong, the exit status and a fragment of what schedspec prints."""

    cls: str
    what: str
    exit: int
    says: str
    #: more flags for its check (the hangs: a short deadline)
    flags: tuple[str, ...] = ()


class _Counting(BatchBoundScheduler):
    """Counts the calls of each method (the fault classes fire from the N-th)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.calls: dict[str, int] = {}

    def count(self, method: str) -> int:
        self.calls[method] = self.calls.get(method, 0) + 1
        return self.calls[method]


class RaisesInInit(BatchBoundScheduler):
    def __init__(self, config: SchedulerConfig) -> None:
        raise RuntimeError("no GPU found")


class RaisesInAdd(_Counting):
    def add(self, request: RequestSpec) -> None:
        if self.count("add") >= 5:
            raise RuntimeError("queue full")
        super().add(request)


class RaisesInAbort(_Counting):
    def abort(self, request_id: str) -> None:
        raise RuntimeError("abort not wired")


class RaisesInSchedule(_Counting):
    def schedule(self) -> StepPlan:
        if self.count("schedule") >= 5:
            raise RuntimeError("out of streams")
        return super().schedule()


class RaisesInUpdate(_Counting):
    def update(self, plan: StepPlan, result: StepResult) -> None:
        if self.count("update") >= 5:
            raise KeyError("sampled")
        super().update(plan, result)


class RaisesInView(_Counting):
    def view(self) -> SchedulerView:
        if self.count("view") >= 20:
            raise AttributeError("'Seq' object has no attribute 'blocks'")
        return super().view()


class RaisesInResetPrefixCache(_Counting):
    CAPABILITIES = dataclasses.replace(BatchBoundScheduler.CAPABILITIES, reset_prefix_cache=True)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        raise RuntimeError("cache locked")


def _hang() -> None:
    """Never returns: sleeps an hour at a time (the deadline's signal ends it)."""
    while True:
        time.sleep(3600)


class HangsInInit(BatchBoundScheduler):
    def __init__(self, config: SchedulerConfig) -> None:
        _hang()


class HangsInAdd(_Counting):
    def add(self, request: RequestSpec) -> None:
        if self.count("add") >= 5:
            _hang()
        super().add(request)


class HangsInAbort(_Counting):
    def abort(self, request_id: str) -> None:
        _hang()


class HangsInSchedule(_Counting):
    def schedule(self) -> StepPlan:
        if self.count("schedule") >= 50:
            _hang()
        return super().schedule()


class HangsInUpdate(_Counting):
    def update(self, plan: StepPlan, result: StepResult) -> None:
        if self.count("update") >= 5:
            _hang()
        super().update(plan, result)


class HangsInView(_Counting):
    def view(self) -> SchedulerView:
        if self.count("view") >= 20:
            _hang()
        return super().view()


class HangsInResetPrefixCache(_Counting):
    CAPABILITIES = dataclasses.replace(BatchBoundScheduler.CAPABILITIES, reset_prefix_cache=True)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        _hang()
        return False


class ScheduleReturnsList(_Counting):
    def schedule(self) -> Any:
        return list(super().schedule().scheduled)


class ScheduleReturnsListLater(_Counting):
    def schedule(self) -> Any:
        plan = super().schedule()
        return list(plan.scheduled) if self.count("schedule") >= 5 else plan


class ViewReturnsDictLater(_Counting):
    def view(self) -> Any:
        v = super().view()
        return dataclasses.asdict(v) if self.count("view") >= 20 else v


class PlanNamesUnknownRequest(_Counting):
    def schedule(self) -> StepPlan:
        plan = super().schedule()
        if self.count("schedule") < 5 or not plan.scheduled:
            return plan
        ghost = dataclasses.replace(plan.scheduled[0], request_id="ghost")
        return dataclasses.replace(plan, scheduled=plan.scheduled + (ghost,))


class PlanNamesUnknownBlock(_Counting):
    def schedule(self) -> StepPlan:
        plan = super().schedule()
        if self.count("schedule") < 5 or not plan.scheduled:
            return plan
        first = plan.scheduled[0]
        bad = dataclasses.replace(first, block_ids=first.block_ids + (self.config.num_blocks + 7,))
        return dataclasses.replace(plan, scheduled=(bad,) + plan.scheduled[1:])


class MutatesPlanAfterReturn(_Counting):
    """Drops the last entry of the plan it returned, in place, when asked for its view."""

    last: StepPlan | None = None

    def schedule(self) -> StepPlan:
        self.last = super().schedule()
        return self.last

    def view(self) -> SchedulerView:
        if self.last is not None and self.last.scheduled and self.count("mutate") >= 5:
            object.__setattr__(self.last, "scheduled", self.last.scheduled[:-1])
            self.last = None
        return super().view()


class ChangesAViewItReturned(_Counting):
    """Keeps the request map of the view it returned and empties it at the next call."""

    kept: dict[str, Any] | None = None

    def view(self) -> SchedulerView:
        if self.kept is not None and self.count("view") >= 20:
            self.kept.clear()
        v = super().view()
        self.kept = v.requests  # type: ignore[assignment]
        return v


#: The flags of a hang's check: a short deadline on every call.
HANG_FLAGS = ("--call-timeout", "1")

#: The catalogue (the test runs every row; the doc's table is written from it).
FAULTS: tuple[Fault, ...] = (
    Fault("RaisesInInit", "its constructor raises", 2,
          "cannot build the scheduler: RuntimeError: no GPU found"),
    Fault("RaisesInAdd", "add() raises", 1, "RaisesInAdd.add() raised RuntimeError: queue full"),
    Fault("RaisesInAbort", "abort() raises", 1, "RaisesInAbort.abort() raised RuntimeError: abort not wired"),
    Fault("RaisesInSchedule", "schedule() raises", 1,
          "RaisesInSchedule.schedule() raised RuntimeError: out of streams"),
    Fault("RaisesInUpdate", "update() raises", 1, "RaisesInUpdate.update() raised KeyError: 'sampled'"),
    Fault("RaisesInView", "view() raises", 1,
          "RaisesInView.view() raised AttributeError: 'Seq' object has no attribute 'blocks'"),
    Fault("RaisesInResetPrefixCache", "reset_prefix_cache() raises", 1,
          "RaisesInResetPrefixCache.reset_prefix_cache() raised RuntimeError: cache locked"),
    Fault("HangsInInit", "its constructor never returns", 1,
          "examples.faults:HangsInInit: construction (while building and probing it) did not return", HANG_FLAGS),
    Fault("HangsInAdd", "add() never returns", 1,
          "HangsInAdd.add() did not return", HANG_FLAGS),
    Fault("HangsInAbort", "abort() never returns", 1,
          "HangsInAbort.abort() did not return", HANG_FLAGS),
    Fault("HangsInSchedule", "schedule() never returns (50th call)", 1,
          "HangsInSchedule.schedule() did not return", HANG_FLAGS),
    Fault("HangsInUpdate", "update() never returns", 1,
          "HangsInUpdate.update() did not return", HANG_FLAGS),
    Fault("HangsInView", "view() never returns (20th call)", 1,
          "HangsInView.view() did not return", HANG_FLAGS),
    Fault("HangsInResetPrefixCache", "reset_prefix_cache() never returns", 1,
          "HangsInResetPrefixCache.reset_prefix_cache() did not return", HANG_FLAGS),
    Fault("ScheduleReturnsList", "schedule() returns a list", 2,
          "ScheduleReturnsList.schedule() returned a list, expected"),
    Fault("ScheduleReturnsListLater", "the same, from its 5th call", 1,
          "ScheduleReturnsListLater.schedule() returned list, not StepPlan"),
    Fault("ViewReturnsDictLater", "view() returns a dict (20th call)", 1,
          "ViewReturnsDictLater.view() returned dict, not SchedulerView"),
    Fault("PlanNamesUnknownRequest", "a plan names an unknown request", 1,
          "[plan-entry-kinds] scheduled as NEW but was not an unfinished request"),
    Fault("PlanNamesUnknownBlock", "a plan names a block past the pool", 1,
          "[plan-matches-state] entry block table ["),
    Fault("MutatesPlanAfterReturn", "drops an entry of a plan it returned", 1,
          "[plan-matches-state] not scheduled, yet its computed tokens/blocks changed"),
    Fault("ChangesAViewItReturned", "empties a view it returned", 1,
          "[legal-status-transition] appeared with status RUNNING"),
)
