"""Deadlines on the calls into a scheduler (check/deadline.py): a call that
hangs (a Python loop, a sleep, a lock wait; in schedule, update, add, view or
construction) is a finding of kind "timeout" naming the scheduler, the
method, the step and the time it ran; the check's time budget holds within a
workload; off the main thread the guard says why it cannot work."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from schedspec.check import trace as tracefile
from schedspec.check.deadline import CLOCK, CallTimeout, check_timeout, guarded, guard_available
from schedspec.check.gate import CheckSettings, run_check
from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.spec.interface import SchedulerFactory
from schedspec.spec.scheduler import SpecScheduler
from tests.support import hanging_schedulers as hs

pytestmark = pytest.mark.skipif(guard_available() is not None, reason=str(guard_available()))


def _run(cls: type, steps: int = 60, deadline: float = 0.5) -> tuple[float, object]:
    workload = random_workload(3, steps)
    t0 = time.monotonic()
    with guarded(deadline):
        runner, failure = run_workload(workload, {"spec": SpecScheduler, "mine": cls})
    return time.monotonic() - t0, failure


@pytest.mark.parametrize("cls, method", [
    (hs.HangLoop, "schedule"), (hs.HangLock, "schedule"), (hs.HangInUpdate, "update"),
    (hs.HangInAdd, "add"), (hs.HangInView, "view"),
])
def test_a_call_that_hangs_is_a_timeout_naming_the_method(cls: type, method: str) -> None:
    elapsed, failure = _run(cls)
    assert failure is not None and failure.kind == "timeout", failure  # type: ignore[attr-defined]
    assert failure.scheduler == "mine"  # type: ignore[attr-defined]
    message = failure.message  # type: ignore[attr-defined]
    assert f"{cls.__qualname__}.{method}() did not return" in message, message
    assert "s (the deadline of one call is 0.5 s" in message
    assert elapsed < 5.0
    assert CLOCK.scheduler is None  # nothing left noted once the run is over


def test_a_hang_while_building_is_a_timeout_before_the_first_event() -> None:
    elapsed, failure = _run(hs.HangBuilding)
    assert failure is not None and failure.kind == "timeout"  # type: ignore[attr-defined]
    assert failure.event_index == -1  # type: ignore[attr-defined]
    assert "HangBuilding(config) did not return" in failure.message  # type: ignore[attr-defined]


def test_the_step_named_is_the_one_whose_call_hung() -> None:
    _, failure = _run(hs.HangLoop, deadline=0.3)
    assert failure is not None and failure.step == 5  # type: ignore[attr-defined]


def test_a_healthy_run_is_unchanged_under_the_guard() -> None:
    workload = random_workload(5, 80)
    plain = run_workload(workload, {"spec": SpecScheduler, "impl": SpecScheduler})[0].stats
    with guarded(0.5):
        guarded_stats = run_workload(workload, {"spec": SpecScheduler, "impl": SpecScheduler})[0].stats
    assert plain.steps == guarded_stats.steps and plain.as_dict() == guarded_stats.as_dict()


def test_the_check_writes_the_trace_up_to_the_hang_unshrunk(tmp_path: Path) -> None:
    factories: dict[str, SchedulerFactory] = {"spec": SpecScheduler, "hang": hs.Hang}
    t0 = time.monotonic()
    outcome = run_check(factories, CheckSettings(against="hang", time_budget=5.0, total_steps=300, call_timeout=0.5,
                                                 out_dir=tmp_path, modes=("sync",), kv=()))
    assert time.monotonic() - t0 < 5.0 + 0.5 + 3.0
    assert outcome.failure is not None and outcome.failure.kind == "timeout"
    assert outcome.failure.step == 50 and "Hang.schedule()" in outcome.failure.message
    assert outcome.trace_path is not None and outcome.counterexample is not None
    trace = tracefile.read(outcome.trace_path)
    assert len(trace.events) == outcome.failure.event_index + 1  # the events up to the call that hung
    # replayed, the trace hangs at the same event and step
    with guarded(0.5):
        again = run_workload(trace.workload, factories, trace.vocab, trace.oracle_seed)[1]
    assert again is not None and again.kind == "timeout"
    assert (again.event_index, again.step) == (outcome.failure.event_index, outcome.failure.step)


def test_the_time_budget_holds_within_a_workload(tmp_path: Path) -> None:
    # 20 ms a step: one 200-step workload alone would take 4 s (8 s with the spec's steps)
    t0 = time.monotonic()
    outcome = run_check({"spec": SpecScheduler, "slow": hs.Slow},
                        CheckSettings(against="slow", time_budget=1.0, out_dir=tmp_path, modes=("sync",), kv=()))
    assert outcome.failure is None and outcome.ok
    assert time.monotonic() - t0 < 3.5
    assert 0 < outcome.steps < 200


def test_off_the_main_thread_the_guard_says_why_and_runs_unguarded() -> None:
    said: list[object] = []

    def body() -> None:
        said.append(guard_available())
        with guarded(0.1) as why:
            said.append(why)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert said[0] == said[1] and "main thread" in str(said[0])


def test_a_deadline_must_be_positive() -> None:
    assert check_timeout("--call-timeout", 0) is None
    assert check_timeout("--call-timeout", 2.5) == 2.5
    with pytest.raises(ValueError, match="--call-timeout"):
        check_timeout("--call-timeout", -1)


def test_the_guard_restores_the_previous_alarm_handler() -> None:
    import signal

    before = signal.getsignal(signal.SIGALRM)
    with guarded(1.0):
        assert signal.getsignal(signal.SIGALRM) is not before
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with pytest.raises(CallTimeout):  # a call noted on the clock, past the deadline
        with guarded(0.2):
            CLOCK.start("mine", "schedule")
            time.sleep(2)
    CLOCK.stop()
