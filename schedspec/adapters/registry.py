"""Turn a --against name into a scheduler factory.

``spec`` and ``impl`` are ours; ``vllm`` is vLLM 0.33's real Scheduler through
schedspec/adapters/vllm_adapter.py; ``MODULE:CLASS`` is either a class implementing our
Scheduler protocol (built as ``CLASS(config)``) or a vLLM-compatible scheduler
class (a subclass of vLLM's Scheduler, what vLLM accepts as scheduler_cls),
which the vLLM adapter wraps. Nothing heavy is imported until asked for.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass

from schedspec.spec.interface import SchedSpecError, Scheduler, SchedulerConfig, SchedulerFactory

_PROTOCOL_METHODS = ("add", "abort", "schedule", "update", "reset_prefix_cache", "view")


class AdapterError(SchedSpecError, ValueError):
    """The --against value names nothing usable."""


@dataclass(frozen=True)
class Target:
    name: str
    factory: SchedulerFactory


def _spec(config: SchedulerConfig) -> Scheduler:
    from schedspec.spec.scheduler import SpecScheduler

    return SpecScheduler(config)


def _impl(config: SchedulerConfig) -> Scheduler:
    from schedspec.impl import ImplScheduler

    sched: Scheduler = ImplScheduler(config)
    return sched


def _vllm(config: SchedulerConfig) -> Scheduler:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    sched: Scheduler = VllmScheduler(config)
    return sched


def _is_vllm_scheduler_class(cls: type) -> bool:
    return any(
        base.__module__.startswith("vllm.v1.core.sched") for base in inspect.getmro(cls)
    ) or hasattr(cls, "update_from_output")


def _search_current_directory() -> None:
    """A user's MODULE is found as ``python -m`` would find it: the current
    directory first (the ``schedspec`` script, unlike ``python -m``, does not
    put it on the path), then the installed packages."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def import_class(spec: str, flag: str = "--against") -> type:
    """The class named by ``MODULE:CLASS`` (CLASS may be dotted); AdapterError
    naming ``flag`` and what is wrong otherwise."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise AdapterError(f"{flag} {spec!r}: expected MODULE:CLASS")
    _search_current_directory()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AdapterError(f"{flag} {spec!r}: cannot import module {module_name!r} ({exc})") from None
    obj = module
    for part in class_name.split("."):
        if not hasattr(obj, part):
            raise AdapterError(f"{flag} {spec!r}: module {module_name!r} has no attribute {class_name!r}")
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise AdapterError(f"{flag} {spec!r}: {class_name!r} is not a class")
    return obj


def factory_of(cls: type, label: str) -> SchedulerFactory:
    """The factory ``config -> Scheduler`` for a scheduler class: a class of
    our Scheduler protocol is built as is, a vLLM scheduler class (what vLLM
    takes as ``scheduler_cls``) is wrapped by the vLLM adapter; AdapterError
    starting with ``label`` for anything else."""
    if _is_vllm_scheduler_class(cls):

        def wrapped(config: SchedulerConfig) -> Scheduler:
            from schedspec.adapters.vllm_adapter import VllmScheduler

            sched: Scheduler = VllmScheduler(config, scheduler_cls=cls)
            return sched

        return wrapped
    missing = [m for m in _PROTOCOL_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise AdapterError(
            f"{label}: {cls.__qualname__} is neither a vLLM Scheduler subclass nor a "
            f"schedspec Scheduler (missing {', '.join(missing)})"
        )

    def build(config: SchedulerConfig) -> Scheduler:
        sched: Scheduler = cls(config)
        return sched

    return build


def _user_class(spec: str) -> SchedulerFactory:
    return factory_of(import_class(spec), f"--against {spec!r}")


def resolve(name: str) -> Target:
    if name == "spec":
        return Target("spec", _spec)
    if name == "impl":
        return Target("impl", _impl)
    if name == "vllm":
        return Target("vllm", _vllm)
    if ":" in name:
        return Target(name, _user_class(name))
    raise AdapterError(f"--against {name!r}: expected spec, impl, vllm or MODULE:CLASS")
