"""The scheduler statistics in a check (``schedspec check --stats``): every
scheduler built with ``log_stats=True``, as vLLM's engine builds its
Scheduler when stats are logged (vllm/v1/engine/core.py: ``log_stats``), so
the driver compares the ``make_stats()`` each reports after every update
(check/driver.py, Runner._make_stats) and hands them to the invariants
(invariants/stats.py). The statistics are spec/stats.py's SchedulerStats.

A scheduler declares it reports them with ``Capabilities.stats``: its class
takes the ``log_stats`` keyword and defines ``make_stats()``.
"""

from __future__ import annotations

from typing import Any, cast

from schedspec.spec.interface import SchedSpecError, Scheduler, SchedulerConfig, SchedulerFactory

from schedspec.check.capabilities import Capabilities


class StatsUnsupported(SchedSpecError, ValueError):
    """Statistics asked of a scheduler that does not declare them."""


def with_stats(factory: SchedulerFactory) -> SchedulerFactory:
    """``factory`` building its schedulers with ``log_stats=True`` (the
    factory takes the keyword: the registry's, a class that declares
    Capabilities.stats)."""

    def build(config: SchedulerConfig) -> Scheduler:
        sched: Scheduler = cast(Any, factory)(config, log_stats=True)
        return sched

    build.__wrapped__ = getattr(factory, "__wrapped__", factory)  # type: ignore[attr-defined]  # what a failure names
    return build


def stats_factories(factories: dict[str, SchedulerFactory],
                    capabilities: dict[str, Capabilities]) -> dict[str, SchedulerFactory]:
    """Every factory with statistics on; StatsUnsupported naming the first
    scheduler whose capabilities lack ``stats``."""
    for name in factories:
        caps = capabilities.get(name)
        if caps is None or not caps.stats:
            raise StatsUnsupported(f"{name} does not report scheduler statistics (its Capabilities.stats is "
                                   "False: a class that does takes log_stats= and defines make_stats())")
    return {name: with_stats(f) for name, f in factories.items()}
