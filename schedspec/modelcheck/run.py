"""Running a bound: every space in turn, stopping at the first failure."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from schedspec.invariants import CATALOGUE, Invariant
from schedspec.modelcheck import outputs
from schedspec.modelcheck.explore import Explorer
from schedspec.modelcheck.result import BoundResult, SpaceResult
from schedspec.modelcheck.space import Space, bound, select_spaces, space_problems
from schedspec.modelcheck.target import Against
from schedspec.spec.interface import Scheduler, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler


def impl_available() -> bool:
    try:
        from schedspec import impl

        return hasattr(impl, "ImplScheduler")
    except ImportError:
        return False


def impl_problems(space: Space) -> list[str]:
    """What of ``space`` ImplScheduler does not support (its declared
    capabilities: an admission gate it lacks); empty when it supports all."""
    from schedspec.adapters.registry import resolve

    return space_problems(space, resolve("impl").capabilities)


def impl_class() -> Callable[[SchedulerConfig], Scheduler]:
    """impl.ImplScheduler (a class: it travels to worker processes by name)."""
    from schedspec.impl import ImplScheduler

    cls: Callable[[SchedulerConfig], Scheduler] = ImplScheduler
    return cls


def default_workers() -> int:
    """The CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def check_bound(
    name: str,
    *,
    use_impl: bool = True,
    scheduler_cls: type[SpecScheduler] = SpecScheduler,
    max_states: int | None = None,
    log: TextIO | None = None,
    spaces: Sequence[str] | None = None,
    workers: int = 1,
    invariants: Sequence[Invariant] = CATALOGUE,
    on_space: Callable[[SpaceResult], None] | None = None,
    against: Against | None = None,
    kv_events: bool = False,
    stats: bool = False,
) -> BoundResult:
    """Explore the spaces of a bound (all, or those named in ``spaces``) in
    turn; stop at the first failure. ``against`` is the scheduler under test
    (it replaces the impl differential of ``use_impl``, which leaves out
    the spaces with an admission gate ImplScheduler does not support: their
    results carry a note). ``log`` gets a progress line every few
    seconds; ``on_space`` each space's result as soon as it is done.
    ``kv_events`` / ``stats``: the KV cache events and the statistics on,
    compared after every update (modelcheck/outputs.py).
    ModelCheckError for an unknown bound or space."""
    if kv_events:  # the kv-events-* invariants fold the stream's history, which no explored state carries
        invariants = outputs.stateless(invariants)
        against = against if against is None else dataclasses.replace(
            against, invariants=outputs.stateless(against.invariants))
    if stats:
        scheduler_cls, against = outputs.LoggedSpec if scheduler_cls is SpecScheduler else scheduler_cls, \
            outputs.logged_against(against)
    b = bound(name)
    chosen = select_spaces(b, spaces)
    out = BoundResult(name)
    for space in chosen:
        progress = progress_printer(log, space.name) if log is not None else None
        impl = impl_class() if use_impl and against is None else None
        problems = impl_problems(space) if impl is not None else []
        if problems:
            impl = None  # a gate ImplScheduler does not support: the spec alone
        if stats and impl is not None:
            impl = outputs.logged(impl)
        space = outputs.with_events(space) if kv_events else space
        r = Explorer(space, scheduler_cls=scheduler_cls, impl_cls=impl, invariants=invariants, max_states=max_states,
                     workers=workers, progress=progress, against=against).run()
        if problems:
            r.note = "impl differential left out: impl does not support " + ", ".join(problems)
        out.spaces.append(r)
        if on_space is not None:
            on_space(r)
        if r.failure is not None:
            break
    return out


def progress_printer(log: TextIO, name: str, every_s: float = 5.0) -> Callable[[SpaceResult, int], None]:
    """A progress callback for an Explorer: one line on ``log`` at most every ``every_s`` seconds."""
    last = [time.monotonic()]

    def show(r: SpaceResult, frontier: int) -> None:
        now = time.monotonic()
        if now - last[0] < every_s:
            return
        last[0] = now
        log.write(f"  {name}: depth {r.depth}, {r.states:,} states, {r.transitions:,} transitions, "
                  f"frontier {frontier:,}\n")
        log.flush()

    return show
