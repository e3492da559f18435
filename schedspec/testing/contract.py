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
(``make_machine``) in one of the two modes every command shares:

- ``mode = "lockstep"`` (the default while ``reference`` is set): plans and
  views equal to the reference scheduler's at every step (``reference`` is a
  name the adapter registry resolves: ``"spec"``, the default, ``"impl"``,
  ``"vllm"`` or ``MODULE:CLASS``), and the chosen invariants (default all);
- ``mode = "invariants"`` (the default when ``reference = None``): the
  scheduler alone, no comparison, the chosen invariants only (default
  ``"safety"``): for a scheduler that does not follow vLLM's policy.

``invariants`` is the selector of ``--invariants`` (``"safety,-quiescence"``,
``"policy:fcfs"``, ids ...). Configs and events are drawn within the
scheduler's declared ``CAPABILITIES`` (or the ``capabilities`` attribute);
invariants it cannot take are skipped. The scheduler is probed for
conformance (methods, signatures, the types of its first views and plan)
before the run. A failure's Hypothesis notes are the shrunk run as a script
of events, naming the scheduler as ``scheduler_name``; with ``trace_sink`` set
the workload is also written as a trace (replay it with ``schedspec replay``).
``hypothesis_settings`` sets the number of examples and steps. Without it the
run takes, in this order: the profile named by the HYPOTHESIS_PROFILE
environment variable (one the suite registered), the profile the suite loaded
(``settings.load_profile``, or pytest's ``--hypothesis-profile``), or, when
none is loaded, Hypothesis's defaults for state machines. schedspec.testing
registers, loads and changes no profile.
"""

from __future__ import annotations

import inspect
import os
import unittest
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import run_state_machine_as_test

from schedspec.adapters.registry import class_capabilities, factory_of, resolve
from schedspec.check.capabilities import Capabilities
from schedspec.check.conformance import check_conformance
from schedspec.check.deadline import DEFAULT_CALL_TIMEOUT, CallTimeout, guarded
from schedspec.check.gate import check_record, resolve_selection
from schedspec.invariants import Mode, Selection
from schedspec.spec.interface import SchedSpecError, SchedulerConfig, SchedulerFactory
from schedspec.testing.stateful import CallHung, make_machine


class ContractError(SchedSpecError, TypeError):
    """A SchedulerContract subclass set up wrongly (the message says how)."""


def hypothesis_settings_in_force(explicit: settings | None = None) -> settings | None:
    """The settings a contract runs under: ``explicit``; else the profile
    HYPOTHESIS_PROFILE names (ContractError when the suite registered none of
    that name); else the loaded profile; None (Hypothesis's state-machine
    defaults) when the loaded one is Hypothesis's own default. Registers and
    loads nothing."""
    if explicit is not None:
        return explicit
    name = os.environ.get("HYPOTHESIS_PROFILE")
    if name:
        try:
            return settings.get_profile(name)
        except InvalidArgument:
            raise ContractError(
                f"HYPOTHESIS_PROFILE={name!r}: no Hypothesis profile of that name is registered "
                "(register it with settings.register_profile in your conftest.py)"
            ) from None
    current = settings()
    if current == settings.get_profile("default"):
        return None
    return current


def contract_selection(mode: Mode | None, reference: str | None, invariants: str | None,
                       capabilities: Capabilities) -> Selection:
    """The check a contract runs (see the module doc)."""
    chosen: Mode = mode if mode is not None else ("lockstep" if reference is not None else "invariants")
    if chosen == "lockstep" and reference is None:
        raise ContractError("mode = 'lockstep' compares with a reference: set `reference` (e.g. 'spec') "
                            "or use mode = 'invariants'")
    return resolve_selection(chosen, invariants, capabilities)


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
    #: what it is held equal to in lockstep ("spec", "impl", ...); None: invariants mode
    reference: ClassVar[str | None] = "spec"
    #: "lockstep" or "invariants"; None: lockstep with a reference, invariants without
    mode: ClassVar[Mode | None] = None
    #: the --invariants selector; None: the mode's default (all / safety)
    invariants: ClassVar[str | None] = None
    #: what the scheduler supports; None: its class's CAPABILITIES (all, if none)
    capabilities: ClassVar[Capabilities | None] = None
    #: check every invariant after every operation
    check_invariants: ClassVar[bool] = True
    #: Hypothesis settings of the run; None: the settings in force
    hypothesis_settings: ClassVar[settings | None] = None
    #: where a failing workload is written as a trace
    trace_sink: ClassVar[Path | None] = None
    #: the scheduler's name in failures; None: the class's (or the factory's) qualified name
    scheduler_name: ClassVar[str | None] = None
    #: the deadline of one call into a scheduler, in seconds (None: none): a
    #: call past it fails the test, naming the method and the step, unshrunk
    #: (main thread and POSIX only: check/deadline.py)
    call_timeout: ClassVar[float | None] = DEFAULT_CALL_TIMEOUT

    __test__ = False  # the base class itself is no test; every subclass is

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__test__ = True

    def test_scheduler_meets_the_contract(self) -> None:
        cls = type(self)
        if cls.scheduler is None:
            raise TypeError(f"{cls.__qualname__}: set the class attribute `scheduler` to the scheduler under test")
        caps = cls.capabilities if cls.capabilities is not None else class_capabilities(cls.scheduler)
        selection = contract_selection(cls.mode, cls.reference, cls.invariants, caps)
        run_settings = hypothesis_settings_in_force(cls.hypothesis_settings)
        factories: dict[str, SchedulerFactory] = {}
        if selection.compares and cls.reference is not None:
            factories[cls.reference] = resolve(cls.reference).factory
        candidate = as_factory(cls.scheduler)
        name = cls.scheduler_name or str(getattr(cls.scheduler, "__qualname__", None) or type(cls.scheduler).__name__)
        if name in factories:
            name += " (under test)"
        factories[name] = candidate
        with guarded(cls.call_timeout):
            try:
                self._run(cls, name, caps, selection, run_settings, factories)
            except CallTimeout as exc:  # while probing it, before the state machine
                self.fail(f"{name}: {exc.describe(f'{exc.method} (while probing it)')}")
            except CallHung as exc:
                self.fail(str(exc) + ("" if cls.trace_sink is None else f"\n(trace written to {cls.trace_sink})"))

    def _run(self, cls: type[SchedulerContract], name: str, caps: Capabilities, selection: Selection,
             run_settings: settings | None, factories: dict[str, SchedulerFactory]) -> None:
        check_conformance(name, factories[name], caps.restrict_config(SchedulerConfig()))
        machine = make_machine(
            factories,
            check_invariants=cls.check_invariants,
            compare_views=selection.compares,
            trace_sink=cls.trace_sink,
            name=f"{cls.__name__}Machine",
            capabilities=caps,
            invariants=selection.invariants,
            check_record=check_record(selection),
        )
        run_state_machine_as_test(machine, settings=run_settings)
