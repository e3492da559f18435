"""The outputs other systems read, in the model checker
(``schedspec modelcheck --kv-events --stats``): every space with
config.enable_kv_cache_events on, the spec and the scheduler under test
built with ``log_stats``; after every update the expander takes the KV cache
events and makes the statistics of both and compares them
(expand.Expander._take_outputs), as the check's driver does."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence, cast

from schedspec.invariants import Invariant
from schedspec.spec.interface import Scheduler, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler

from schedspec.modelcheck.space import Space
from schedspec.modelcheck.target import Against


class LoggedSpec(SpecScheduler):
    """The spec built with ``log_stats=True`` (a class, so it travels to the
    worker processes by name and its clone() keeps its type)."""

    def __init__(self, config: SchedulerConfig, log_stats: bool = True) -> None:
        super().__init__(config, log_stats=log_stats)


def with_events(space: Space) -> Space:
    """``space`` with the KV cache events on."""
    return dataclasses.replace(space, config=dataclasses.replace(space.config, enable_kv_cache_events=True))


def logged(factory: Callable[[SchedulerConfig], Scheduler]) -> Callable[[SchedulerConfig], Scheduler]:
    """``factory`` building with ``log_stats=True`` (a partial: it pickles
    where the factory does)."""
    built: Callable[[SchedulerConfig], Scheduler] = functools.partial(cast(Any, factory), log_stats=True)
    return built


def logged_against(against: Against | None) -> Against | None:
    """The scheduler under test built with ``log_stats=True``."""
    return None if against is None else dataclasses.replace(against, factory=logged(against.factory))


def stateless(invariants: Sequence[Invariant]) -> tuple[Invariant, ...]:
    """``invariants`` less those of the KV cache events (invariants/kv_events.py):
    they fold the stream into the History's router mirror, a history the
    model checker's states do not carry (a state is reached by many paths);
    the events are compared with the scheduler under test's instead."""
    return tuple(i for i in invariants if "kv_events" not in i.requires)
