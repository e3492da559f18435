"""Conformance at start-up: before a check runs, a scheduler is built once and
shown to speak the Scheduler protocol: every method there, callable with the
protocol's arguments, and its first views and plan of the protocol's types.

A failure is a ConformanceError (the CLI's exit 2) that names the scheduler,
the method, the type expected and the type found, instead of a run that fails
at step 1 with a message about something else. An exception the scheduler
raises while probed is left to the run, which reports it as a crash with the
scheduler's name and its last frames (and shrinks it).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

from schedspec.check.deadline import CLOCK
from schedspec.spec.interface import (
    KVView,
    RequestSpec,
    RequestView,
    ScheduledRequest,
    SchedSpecError,
    SchedulerConfig,
    SchedulerFactory,
    SchedulerView,
    StepPlan,
)


class ConformanceError(SchedSpecError, TypeError):
    """A scheduler that does not speak the Scheduler protocol."""


#: The optional methods of the admission gates: capability name -> (method, its arguments).
GATE_CALLS: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "pause": ("set_pause_state", ("state",)),
    "structured_output": ("grammar_ready", ("request_id", "ok")),
}

#: The protocol's methods and the arguments a driver passes them.
PROTOCOL_CALLS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("add", ("request",)),
    ("abort", ("request_id",)),
    ("schedule", ()),
    ("update", ("plan", "result")),
    ("reset_prefix_cache", ("reset_running_requests",)),
    ("view", ()),
)


class _Probe(Exception):
    """The probed scheduler raised: not a conformance matter."""


def _name_of(t: type) -> str:
    return t.__name__ if t.__module__ in ("builtins", "collections.abc") else f"{t.__module__}.{t.__qualname__}"


def _type_name(value: object) -> str:
    return _name_of(type(value))


def method_problems(cls: type) -> list[str]:
    """What in ``cls``'s methods keeps it from being a Scheduler: a missing
    method, or one that cannot take the arguments a driver passes."""
    out: list[str] = []
    for method, args in PROTOCOL_CALLS:
        fn = getattr(cls, method, None)
        if not callable(fn):
            out.append(f"{cls.__qualname__}.{method}: missing (expected a method {method}({', '.join(args)}))")
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin or C method: nothing to read
        try:
            sig.bind(object(), *[object() for _ in args])
        except TypeError as exc:
            out.append(
                f"{cls.__qualname__}.{method}{sig}: cannot be called as {method}({', '.join(args)}) ({exc})"
            )
    return out


def gate_method_problems(cls: type, capabilities: Any) -> list[str]:
    """The optional gate methods ``cls`` lacks (or cannot take the driver's
    arguments) although ``capabilities`` declares their gate."""
    out: list[str] = []
    for capability, (method, args) in GATE_CALLS.items():
        if not getattr(capabilities, capability, False):
            continue
        fn = getattr(cls, method, None)
        if not callable(fn):
            out.append(f"{cls.__qualname__}.{method}: missing, yet its capabilities declare {capability} "
                       f"(expected a method {method}({', '.join(args)}))")
            continue
        try:
            inspect.signature(fn).bind(object(), *[object() for _ in args])
        except TypeError as exc:
            out.append(f"{cls.__qualname__}.{method}: cannot be called as {method}({', '.join(args)}) ({exc})")
        except ValueError:
            continue
    return out


def check_conformance(name: str, factory: SchedulerFactory, config: SchedulerConfig,
                      capabilities: Any = None) -> None:
    """Build a scheduler from ``factory`` and probe it (see the module doc);
    ConformanceError naming ``name``, the method, expected and actual type.
    ``capabilities`` (a Capabilities): its gates' optional methods must be
    there too."""
    CLOCK.start(name, "construction")
    try:
        sched = factory(config)
    finally:
        CLOCK.stop()
    cls = type(sched)
    problems = method_problems(cls) + gate_method_problems(cls, capabilities)
    if problems:
        raise ConformanceError(f"--against {name}: not a Scheduler: " + "; ".join(problems))

    def call(method: str, *args: Any) -> Any:
        fn: Callable[..., Any] = getattr(sched, method)
        CLOCK.start(name, method)  # under a deadline (check/deadline.py)
        try:
            return fn(*args)
        except Exception as exc:
            raise _Probe() from exc
        finally:
            CLOCK.stop()

    def expect(method: str, value: object, want: Any, what: str = "") -> None:
        if not isinstance(value, want):
            raise ConformanceError(
                f"--against {name}: {cls.__qualname__}.{method}() returned {what}a {_type_name(value)}, "
                f"expected {_name_of(want)}"
            )

    def expect_view(v: object, when: str) -> None:
        expect("view", v, SchedulerView, f"{when} ")
        assert isinstance(v, SchedulerView)
        expect("view", v.kv, KVView, f"{when} a view whose .kv is ")
        expect("view", v.config, SchedulerConfig, f"{when} a view whose .config is ")
        expect("view", v.requests, Mapping, f"{when} a view whose .requests is ")
        for r in v.requests.values():
            expect("view", r, RequestView, f"{when} a view whose .requests holds ")
        for field in ("waiting", "running"):
            expect("view", getattr(v, field), tuple, f"{when} a view whose .{field} is ")

    try:
        expect_view(call("view"), "at start")
        prompt = tuple(range(1, min(4, config.max_model_len)))
        call("add", RequestSpec("schedspec-probe", prompt, 1))
        expect_view(call("view"), "after add")
        plan = call("schedule")
        expect("schedule", plan, StepPlan)
        assert isinstance(plan, StepPlan)
        expect("schedule", plan.scheduled, tuple, "a plan whose .scheduled is ")
        for entry in plan.scheduled:
            expect("schedule", entry, ScheduledRequest, "a plan whose .scheduled holds ")
        expect_view(call("view"), "after schedule")
    except _Probe:
        return
