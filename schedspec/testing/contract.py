"""Hold your own scheduler to the spec inside your pytest (or unittest) suite.

    # in your project's test suite, e.g. test_my_scheduler.py
    from schedspec.testing import SchedulerContract
    from mypkg.sched import MyScheduler      # implements schedspec.spec.interface.Scheduler

    class TestMyScheduler(SchedulerContract):
        scheduler = MyScheduler

``SchedulerContract`` is a ``unittest.TestCase`` (pytest collects it too); the
base class itself is no test, every subclass is, with one test,
``test_scheduler_meets_the_contract``. ``scheduler`` is a class implementing
our Scheduler protocol, a factory ``config -> Scheduler``, or a vLLM scheduler
class (a subclass of vllm.v1.core.sched.scheduler.Scheduler, as passed to
vLLM's scheduler_cls), which the vLLM adapter wraps (``as_factory``). The test
runs the Hypothesis state machine of ``schedspec.testing.stateful``
(``make_machine``): every invariant after every operation
(``check_invariants``) and, unless ``reference = None``, plans and views equal
to the reference scheduler's at every step (``reference`` is a name the
adapter registry resolves: ``"spec"``, the default, ``"impl"``, ``"vllm"`` or
``MODULE:CLASS``). A failure's Hypothesis notes are the shrunk run as a script
of events, naming the scheduler as ``scheduler_name``; with ``trace_sink`` set
the workload is also written as a trace (replay it with ``schedspec replay``).
``hypothesis_settings`` (default: the settings in force) sets the number of
examples and steps; schedspec.testing registers no Hypothesis profile, so the
settings in force are those the suite loads (in its conftest.py, say) or
Hypothesis's defaults.
"""

from __future__ import annotations

import inspect
import unittest
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from schedspec.adapters.registry import factory_of, resolve
from schedspec.spec.interface import SchedulerFactory
from schedspec.testing.stateful import make_machine


def as_factory(target: Any) -> SchedulerFactory:
    """A factory ``config -> Scheduler`` for a scheduler class (ours, or a vLLM
    scheduler class, which the adapter wraps: the registry decides, as for
    ``--against``) or a factory."""
    if inspect.isclass(target):
        return factory_of(target, f"{target.__qualname__} (SchedulerContract.scheduler)")
    if callable(target):
        factory: SchedulerFactory = target
        return factory
    raise TypeError(f"expected a scheduler class or a factory, got {target!r}")


class SchedulerContract(unittest.TestCase):
    """Subclass it and set ``scheduler``; the subclass is a test case."""

    #: the scheduler under test: a class, a vLLM scheduler class or a factory
    scheduler: ClassVar[type | SchedulerFactory | None] = None
    #: what it is held equal to ("spec", "impl", ...); None: invariants only
    reference: ClassVar[str | None] = "spec"
    #: check every invariant after every operation
    check_invariants: ClassVar[bool] = True
    #: Hypothesis settings of the run; None: the settings in force
    hypothesis_settings: ClassVar[settings | None] = None
    #: where a failing workload is written as a trace
    trace_sink: ClassVar[Path | None] = None
    #: the scheduler's name in failures
    scheduler_name: ClassVar[str] = "candidate"

    __test__ = False  # the base class itself is no test; every subclass is

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__test__ = True

    def test_scheduler_meets_the_contract(self) -> None:
        cls = type(self)
        if cls.scheduler is None:
            raise TypeError(f"{cls.__qualname__}: set the class attribute `scheduler` to the scheduler under test")
        factories: dict[str, SchedulerFactory] = {}
        if cls.reference is not None:
            factories[cls.reference] = resolve(cls.reference).factory
        factories[cls.scheduler_name] = as_factory(cls.scheduler)
        machine = make_machine(
            factories,
            check_invariants=cls.check_invariants,
            compare_views=cls.reference is not None,
            trace_sink=cls.trace_sink,
            name=f"{cls.__name__}Machine",
        )
        run_state_machine_as_test(machine, settings=cls.hypothesis_settings)
