"""The check tests a scheduler's clone() inside the run (the model checker
and the shrinker rely on it: schedspec/modelcheck/target.py).

Every FORK_EVERY steps, at steps FORK_OFFSET, FORK_OFFSET + FORK_EVERY, ...,
and on the step after the KV connector's worker reported transfers, each
scheduler under test (not the reference) that has a clone() is forked:
it is cloned, the original makes the step's plan and is dropped, and the run
goes on with the clone, which must make the same plan and then every later
one the reference makes. Half-way between two such forks, the fork comes at
an update instead (``due_update``): the original takes the update and is
dropped, then the clone takes it. A clone that shares a list or dict with
its original sees the original's step; one that misses a field decides
differently.
"""

from __future__ import annotations

from typing import Protocol

from schedspec.check.oracle import KVReport
from schedspec.check.records import Failure, describe_difference, wrong_type
from schedspec.check.stats import Stats
from schedspec.check.workload import InFlight
from schedspec.spec.interface import Scheduler, StepPlan, StepResult


class Runner(Protocol):
    """What this module reads and writes of the driver (check/driver.py, Runner)."""

    scheds: dict[str, Scheduler]
    where: tuple[str, str]
    stats: Stats
    flight: InFlight
    last_fork: int

    def fail(self, kind: str, name: str, message: str) -> Failure: ...

FORK_EVERY = 16
FORK_OFFSET = 3


def due(step: int, every: int, reported: bool = False) -> bool:
    """Whether the ``step``-th plan forks the schedulers under test: every
    ``every`` steps, and the plan after a step whose KV connector worker
    ``reported`` transfers (loads done or failed, saves done, invalid
    blocks: the bookkeeping a clone must carry just then)."""
    return every > 0 and (reported or step % every == FORK_OFFSET % every)


def due_update(step: int, every: int, sessions: bool = False) -> bool:
    """Whether the update of the ``step``-th plan forks the schedulers under
    test: every ``every`` steps, half-way between two forks of ``due``; with
    ``sessions`` (the run was given one) every ``every // 4`` steps, since a
    session's stop moves it through what only update() touches (the sessions
    continuing at their stop)."""
    if sessions:
        every = max(2, every // 4)
    return every > 1 and step % every == (FORK_OFFSET + every // 2) % every


def fork_update(runner: Runner, name: str, plan: StepPlan, result: StepResult) -> Failure | None:
    """Fork scheduler ``name`` before the update of ``plan``: the original
    takes the update and is dropped, and the clone, put in its place, takes
    the same update next (the driver's own call). A container the two share
    then holds the original's update too, which the clone's view, events
    or next plans show."""
    sched = runner.scheds[name]
    twin = _clone(runner, name)
    if twin is None or isinstance(twin, Failure):
        return twin
    runner.where = (name, "update")
    sched.update(plan, result)
    _replace(runner, name, twin)
    return None


def reports(report: KVReport) -> bool:
    """Whether the worker's ``report`` names a transfer of the KV connector."""
    return bool(report.finished_recving or report.finished_sending or report.failed_recving
                or report.invalid_block_ids)


def fork(runner: Runner, name: str, forked: dict[str, StepPlan]) -> Failure | None:
    """Fork scheduler ``name`` of ``runner`` (nothing without a clone()):
    the original's plan goes into ``forked``, the clone takes its place."""
    sched = runner.scheds[name]
    twin = _clone(runner, name)
    if twin is None or isinstance(twin, Failure):
        return twin
    runner.where = (name, "schedule")
    plan = sched.schedule()
    if not isinstance(plan, StepPlan):
        return runner.fail("error", name, wrong_type(type(sched), "schedule", plan, StepPlan))
    forked[name] = plan
    _replace(runner, name, twin)
    return None


def _clone(runner: Runner, name: str) -> Scheduler | Failure | None:
    """The clone() of scheduler ``name`` (None: it has none; a Failure: it
    returned something of another type)."""
    sched = runner.scheds[name]
    clone = getattr(sched, "clone", None)
    if not callable(clone):
        return None
    runner.where = (name, "clone")
    twin = clone()
    if not isinstance(twin, type(sched)):
        return runner.fail("error", name, wrong_type(type(sched), "clone", twin, type(sched)))
    return twin


def _replace(runner: Runner, name: str, twin: Scheduler) -> None:
    """The clone goes on in the original's place (counted, and named in any later failure)."""
    runner.scheds[name] = twin
    runner.stats.forks += 1
    runner.last_fork = runner.flight.scheduled


def compare(runner: Runner, forked: dict[str, StepPlan], plans: dict[str, StepPlan]) -> Failure | None:
    """The original's plan against its clone's, for each forked scheduler
    (the driver records the clone's plan as the failed step)."""
    for name, before in forked.items():
        if before != plans[name]:
            return runner.fail("divergence", name, describe_difference(
                "schedule() of a scheduler and of its clone()", f"{name} (the original)", before,
                f"{name} (its clone)", plans[name]))
    return None
