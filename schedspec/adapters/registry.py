"""Turn a --against name into a scheduler factory.

``spec`` and ``impl`` are ours; ``vllm`` is vLLM 0.33's real Scheduler through
schedspec/adapters/vllm_adapter.py; ``MODULE:CLASS`` is either a class implementing our
Scheduler protocol (built as ``CLASS(config)``) or a vLLM scheduler class (a
subclass of vLLM's SchedulerInterface, what vLLM accepts as scheduler_cls),
which the vLLM adapter wraps. A class is taken for a vLLM scheduler only when
it is one: a subclass of vLLM's SchedulerInterface (vLLM is imported to tell
only when the class has a vLLM class among its bases), never because of a
method name. A class may declare what it supports as ``CAPABILITIES``
(schedspec.check.capabilities.Capabilities); Target carries it. Nothing heavy
is imported until asked for.
"""

from __future__ import annotations

import dataclasses

import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from schedspec.check.capabilities import FULL, Capabilities, capabilities_of
from schedspec.check.conformance import method_problems
from schedspec.spec.interface import SchedSpecError, Scheduler, SchedulerConfig, SchedulerFactory

_PROTOCOL_METHODS = ("add", "abort", "schedule", "update", "reset_prefix_cache", "view")


class AdapterError(SchedSpecError, ValueError):
    """The --against value names nothing usable."""


@dataclass(frozen=True)
class Target:
    name: str
    factory: SchedulerFactory
    #: what the scheduler supports (its class's CAPABILITIES; FULL by default)
    capabilities: Capabilities = field(default=FULL)


def _spec(config: SchedulerConfig, log_stats: bool = False) -> Scheduler:
    from schedspec.spec.scheduler import SpecScheduler

    return SpecScheduler(config, log_stats=log_stats)


def _impl(config: SchedulerConfig, log_stats: bool = False) -> Scheduler:
    from schedspec.impl import ImplScheduler

    sched: Scheduler = ImplScheduler(config, log_stats=log_stats)
    return sched


def _vllm(config: SchedulerConfig, log_stats: bool = False) -> Scheduler:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    sched: Scheduler = VllmScheduler(config, log_stats=log_stats)
    return sched


def is_vllm_scheduler_class(cls: type) -> bool:
    """True iff ``cls`` subclasses vLLM's SchedulerInterface. vLLM is imported
    only when one of ``cls``'s bases comes from vLLM (otherwise it cannot be a
    subclass); a method name proves nothing."""
    if not any(getattr(base, "__module__", "").split(".")[0] == "vllm" for base in inspect.getmro(cls)):
        return False
    try:
        from vllm.v1.core.sched.interface import SchedulerInterface
    except ImportError:  # a vLLM base, yet no vLLM to import: not usable as one
        return False
    return issubclass(cls, SchedulerInterface)


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
    except Exception as exc:  # the user's module itself fails to import
        raise AdapterError(
            f"{flag} {spec!r}: importing module {module_name!r} raised {type(exc).__name__}: "
            + (str(exc).splitlines() or [""])[0]
        ) from None
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
    if is_vllm_scheduler_class(cls):

        def wrapped(config: SchedulerConfig, **kwargs: Any) -> Scheduler:
            from schedspec.adapters.vllm_adapter import VllmScheduler

            # kwargs: log_stats (schedspec.check.scheduler_stats.with_stats)
            sched: Scheduler = VllmScheduler(config, scheduler_cls=cls, **kwargs)
            return sched

        wrapped.__wrapped__ = cls  # type: ignore[attr-defined]  # what a failure names
        return wrapped
    missing = [m for m in _PROTOCOL_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise AdapterError(
            f"{label}: {cls.__qualname__} is neither a vLLM Scheduler subclass nor a "
            f"schedspec Scheduler (missing {', '.join(missing)})"
        )
    problems = method_problems(cls)
    if problems:
        raise AdapterError(f"{label}: {cls.__qualname__} is not a schedspec Scheduler: " + "; ".join(problems))

    def build(config: SchedulerConfig, **kwargs: Any) -> Scheduler:
        # kwargs: log_stats, for a class that declares Capabilities.stats
        sched: Scheduler = cls(config, **kwargs)
        return sched

    build.__wrapped__ = cls  # type: ignore[attr-defined]  # what a failure names
    return build


def class_capabilities(obj: object) -> Capabilities:
    """What a scheduler class (or factory) supports: its ``CAPABILITIES``,
    or for a vLLM scheduler class that declares none what the adapter drives
    (vllm_adapter.capabilities_of_class: an AsyncScheduler subclass only
    asynchronously, a Scheduler subclass only synchronously)."""
    if inspect.isclass(obj) and is_vllm_scheduler_class(obj) and getattr(obj, "CAPABILITIES", None) is None:
        from schedspec.adapters.vllm_adapter import capabilities_of_class

        return capabilities_of_class(obj)
    return capabilities_of(obj)


def _user_class(spec: str) -> Target:
    cls = import_class(spec)
    label = f"--against {spec!r}"
    factory = factory_of(cls, label)
    try:
        caps = class_capabilities(cls)
    except SchedSpecError as exc:
        raise AdapterError(f"{label}: {exc}") from None
    return Target(spec, factory, caps)


#: The spec and impl run every mode: async scheduling and speculative decoding too.
EVERY_MODE = Capabilities(async_scheduling=True, speculative_decoding=True)

#: The spec also takes every admission gate (LoRA, structured outputs, pause
#: states, the watermark, the prefill cadence, the encoder budget), the KV
#: connector, hybrid KV cache groups and every engine feature (sessions, a
#: pipeline, Model Runner V2, drafters).
SPEC_CAPABILITIES = dataclasses.replace(EVERY_MODE.with_gates().with_kv().with_engine(), kv_events=True, stats=True)


def impl_capabilities() -> Capabilities:
    """impl runs every mode and declares the admission gates it implements
    (ImplScheduler.GATES, by capability name), and the KV features it
    implements (ImplScheduler.KV, by capability name: kv_connector,
    hybrid_kv; none while it has no such attribute)."""
    from schedspec.check.features import GATE_CAPABILITIES, KV_CAPABILITIES
    from schedspec.impl import ImplScheduler

    kv = getattr(ImplScheduler, "KV", ())
    caps = EVERY_MODE.with_gates(g for g, cap in GATE_CAPABILITIES.items() if cap in ImplScheduler.GATES).with_kv(
        k for k, cap in KV_CAPABILITIES.items() if cap in kv).with_engine()
    # the KV cache events (spec/kv_events.py) and the statistics (spec/stats.py) where it reports them
    return dataclasses.replace(caps, kv_events=callable(getattr(ImplScheduler, "take_kv_events", None)),
                               stats=callable(getattr(ImplScheduler, "make_stats", None)))


def resolve(name: str) -> Target:
    if name == "spec":
        return Target("spec", _spec, SPEC_CAPABILITIES)
    if name == "impl":
        return Target("impl", _impl, impl_capabilities())
    if name == "vllm":
        from schedspec.adapters.vllm_adapter import VLLM_CAPABILITIES

        return Target("vllm", _vllm, VLLM_CAPABILITIES)
    if ":" in name:
        return _user_class(name)
    raise AdapterError(f"--against {name!r}: expected spec, impl, vllm or MODULE:CLASS")
