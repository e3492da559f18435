"""The check forks a scheduler under test now and then (Runner._fork): its
clone() goes on in its place, after the original made the step's plan. A
clone that shares a container with its original, or leaves a field out, is a
finding of the check itself, not only of the model checker."""

from __future__ import annotations

from typing import Any

import pytest

from schedspec.check import fork
from schedspec.check.fork import FORK_EVERY, FORK_OFFSET, due_update
from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import SchedulerConfig, StepPlan
from schedspec.spec.scheduler import SpecScheduler


def _sharing(attr: str, doc: str) -> type[ImplScheduler]:
    """impl whose clone() leaves ``attr`` shared with the original."""

    class Sharing(ImplScheduler):
        def clone(self) -> "Sharing":
            twin = super().clone()
            twin.__dict__[attr] = getattr(self, attr)
            assert isinstance(twin, Sharing)
            return twin

    Sharing.__name__ = Sharing.__qualname__ = "Shares" + "".join(w.title() for w in attr.strip("_").split("_"))
    Sharing.__doc__ = doc
    return Sharing


SharesRunning = _sharing("_running", "clone() leaves the running list shared with the original.")
SharesFreeQueue = _sharing("_fq", "clone() leaves the free-block queue shared with the original.")
SharesLoadsDone = _sharing("_loads_done", "clone() leaves the set of loads reported done shared with the original.")
SharesContinuing = _sharing("_continuing", "clone() leaves the sessions continuing at their stop shared with the original.")


class NoClone:
    """impl behind a wrapper with no clone(): never forked."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.inner = ImplScheduler(config)

    def __getattr__(self, name: str) -> Any:
        if name == "clone":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def schedule(self) -> StepPlan:
        return self.inner.schedule()


def _first_failure(cls: Any, seeds: range) -> tuple[int, Any]:
    for seed in seeds:
        runner, failure = run_workload(random_workload(seed, 120), {"spec": SpecScheduler, "impl": cls})
        if failure is not None:
            return seed, failure
    raise AssertionError(f"{cls.__name__}: no failure on seeds {seeds}")


def test_impl_is_forked_and_holds() -> None:
    forks = 0
    for seed in range(6):
        runner, failure = run_workload(random_workload(seed, 120), {"spec": SpecScheduler, "impl": ImplScheduler})
        assert failure is None, failure.describe()
        forks += runner.stats.forks
        steps = runner.stats.steps
        # the reference is never forked; impl at each fork step it reached
        # (sync: each step's update too, half-way between two forks at a plan)
        assert runner.stats.forks == len([s for s in range(1, steps + 1) if s % FORK_EVERY == FORK_OFFSET]) + len(
            [s for s in range(1, steps + 1) if due_update(s, FORK_EVERY)])
        assert isinstance(runner.scheds["impl"], ImplScheduler)
    assert forks > 0


def test_a_clone_sharing_a_list_is_caught_and_named() -> None:
    seed, failure = _first_failure(SharesRunning, range(20))
    assert failure.scheduler == "impl"
    assert "clone() of itself made at step" in failure.describe()


def test_a_clone_sharing_the_free_queue_is_caught() -> None:
    seed, failure = _first_failure(SharesFreeQueue, range(20))
    assert failure.scheduler == "impl"
    assert "clone()" in failure.describe()


def test_a_scheduler_without_clone_is_not_forked() -> None:
    runner, failure = run_workload(random_workload(1, 120), {"spec": SpecScheduler, "impl": NoClone})
    assert failure is None, failure.describe()
    assert runner.stats.forks == 0 and runner.stats.steps > FORK_EVERY


def test_the_docs_give_the_fork_period() -> None:
    from pathlib import Path
    text = " ".join((Path(__file__).parents[2] / "docs" / "adapters.md").read_text().split())
    assert f"every {FORK_EVERY} steps it clones each scheduler under test" in text
    assert f"every {FORK_EVERY // 4} steps in a run with sessions" in text


def _connector_failure(cls: Any, seeds: range) -> tuple[int, Any, int]:
    forks = 0
    for seed in seeds:
        runner, failure = run_workload(random_workload(seed, 120, kv=("connector",)), {"spec": SpecScheduler, "impl": cls})
        forks += runner.stats.forks
        if failure is not None:
            return seed, failure, forks
    return -1, None, forks


def test_the_plan_after_a_connector_report_forks_too() -> None:
    from schedspec.check.fork import due

    assert due(FORK_OFFSET, FORK_EVERY) and not due(FORK_OFFSET + 1, FORK_EVERY)
    assert due(FORK_OFFSET + 1, FORK_EVERY, reported=True) and not due(5, 0, reported=True)
    # impl holds, forked more often than every FORK_EVERY steps where the connector reports
    seed, failure, forks = _connector_failure(ImplScheduler, range(4))
    assert failure is None
    assert forks > 4 * (120 // FORK_EVERY)


def test_a_clone_sharing_the_loads_reported_done_is_caught() -> None:
    seed, failure, _ = _connector_failure(SharesLoadsDone, range(12))
    assert failure is not None and failure.scheduler == "impl", "no failure"
    assert "clone()" in failure.describe()


def _session_failure(cls: Any, seeds: range) -> Any:
    for seed in seeds:
        _, failure = run_workload(random_workload(seed, 120, sessions=True), {"spec": SpecScheduler, "impl": cls})
        if failure is not None:
            return failure
    return None


def test_a_clone_sharing_what_only_update_touches_is_caught_at_an_update_fork() -> None:
    assert due_update(FORK_OFFSET + FORK_EVERY // 2, FORK_EVERY) and not due_update(FORK_OFFSET, FORK_EVERY)
    quarter = FORK_EVERY // 4
    assert due_update(FORK_OFFSET + quarter // 2, FORK_EVERY, sessions=True)
    assert due_update(FORK_OFFSET + quarter // 2 + quarter, FORK_EVERY, sessions=True)
    assert _session_failure(ImplScheduler, range(6)) is None
    failure = _session_failure(SharesContinuing, range(20))
    assert failure is not None and failure.scheduler == "impl" and "clone()" in failure.describe()
    # the forks at a plan alone do not see it: the original never takes an update
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fork, "due_update", lambda step, every, sessions=False: False)
        assert _session_failure(SharesContinuing, range(20)) is None
