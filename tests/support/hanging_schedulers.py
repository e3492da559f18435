"""Schedulers that hang (for the deadline tests): each is the spec until
its hang, which is a Python loop, a sleep or a lock wait that never ends."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from schedspec.spec.interface import SchedulerConfig, StepPlan
from schedspec.spec.scheduler import SpecScheduler


def _forever(how: str) -> None:
    if how == "sleep":
        while True:
            time.sleep(1)
    elif how == "lock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # waits on itself for ever
    else:
        n = 0
        while True:  # a busy Python loop
            n += 1


class Hang(SpecScheduler):
    """schedule() blocks at its 50th call (the case of the issue)."""

    calls = 0

    def schedule(self) -> StepPlan:
        self.calls += 1
        if self.calls >= 50:
            _forever("sleep")
        return super().schedule()


class HangLoop(SpecScheduler):
    """schedule() spins in a Python loop at its 5th call."""

    calls = 0

    def schedule(self) -> StepPlan:
        self.calls += 1
        if self.calls >= 5:
            _forever("loop")
        return super().schedule()


class HangLock(SpecScheduler):
    """schedule() waits on a lock for ever at its 5th call."""

    calls = 0

    def schedule(self) -> StepPlan:
        self.calls += 1
        if self.calls >= 5:
            _forever("lock")
        return super().schedule()


class HangInUpdate(SpecScheduler):
    updates = 0

    def update(self, plan: Any, result: Any) -> None:
        self.updates += 1
        if self.updates >= 3:
            _forever("sleep")
        super().update(plan, result)


class HangInAdd(SpecScheduler):
    adds = 0

    def add(self, request: Any) -> None:
        self.adds += 1
        if self.adds >= 3:
            _forever("sleep")
        super().add(request)


class HangInView(SpecScheduler):
    views = 0

    def view(self) -> Any:
        self.views += 1
        if self.views >= 20:
            _forever("sleep")
        return super().view()


class HangBuilding(SpecScheduler):
    def __init__(self, config: SchedulerConfig) -> None:
        _forever("sleep")


class Slow(SpecScheduler):
    """Healthy but slow: 20 ms a step (a 200-step workload takes 4 s)."""

    def schedule(self) -> StepPlan:
        time.sleep(0.02)
        return super().schedule()


class Marker(SpecScheduler):
    """The spec, touching the file SCHEDSPEC_TEST_MARKER at its first
    schedule() (a subprocess test waits for it before it sends a signal)."""

    def schedule(self) -> StepPlan:
        marker = os.environ.get("SCHEDSPEC_TEST_MARKER")
        if marker and not Path(marker).exists():
            Path(marker).write_text("scheduling\n")
        return super().schedule()
