"""Run schedspec's state machine inside your own pytest suite.

    # tests/test_my_scheduler.py
    from schedspec.testing.contract import scheduler_test_case
    from mypkg.sched import MyScheduler          # implements spec.interface.Scheduler
    TestMyScheduler = scheduler_test_case(MyScheduler)

``scheduler_test_case`` accepts a factory ``config -> Scheduler``, a class
implementing our Scheduler protocol, or a vLLM scheduler class (a subclass of
vllm.v1.core.sched.scheduler.Scheduler, as passed to vLLM's scheduler_cls),
which is wrapped by the vLLM adapter. The returned unittest.TestCase runs the
Hypothesis state machine: every invariant on every operation, and, unless
``reference=None``, plans and views equal to the reference scheduler's at every
step. On a failure Hypothesis prints the shrunk steps, and the workload is
written as a trace when ``trace_sink`` is given (replay it with
``schedspec replay``).
"""

from __future__ import annotations

import inspect
import unittest
from pathlib import Path
from typing import Any

from hypothesis import settings

from schedspec.spec.interface import Scheduler, SchedulerConfig
from schedspec.adapters.registry import resolve
from schedspec.spec.interface import SchedulerFactory
from schedspec.testing.stateful import make_machine


def _as_factory(target: Any) -> SchedulerFactory:
    if inspect.isclass(target):
        if any(b.__module__.startswith("vllm.") for b in inspect.getmro(target)):

            def wrapped(config: SchedulerConfig) -> Scheduler:
                from schedspec.adapters.vllm_adapter import VllmScheduler

                sched: Scheduler = VllmScheduler(config, scheduler_cls=target)
                return sched

            return wrapped

        cls: Any = target

        def build(config: SchedulerConfig) -> Scheduler:
            sched: Scheduler = cls(config)
            return sched

        return build
    if callable(target):
        factory: SchedulerFactory = target
        return factory
    raise TypeError(f"expected a scheduler class or a factory, got {target!r}")


def scheduler_test_case(
    target: Any,
    *,
    name: str = "candidate",
    reference: str | None = "spec",
    check_invariants: bool = True,
    settings_: settings | None = None,
    trace_sink: Path | None = None,
) -> type[unittest.TestCase]:
    factories: dict[str, SchedulerFactory] = {}
    if reference is not None:
        factories[reference] = resolve(reference).factory
    factories[name] = _as_factory(target)
    machine = make_machine(
        factories,
        check_invariants=check_invariants,
        compare_views=reference is not None,
        trace_sink=trace_sink,
        name=f"SchedSpecMachine_{name}",
    )
    case: type[unittest.TestCase] = machine.TestCase
    if settings_ is not None:
        case.settings = settings_  # type: ignore[attr-defined]
    return case
