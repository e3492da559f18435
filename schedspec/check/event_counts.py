"""What the workloads with KV cache events on exercised: the situations that
make a stream interesting to a router (evictions, resets with and without
running requests, reuse of a cached block by another request, hits in
hybrid layouts, aborts, the connector, hits reported again), counted from the reference's rule
counts (spec/rule_names.py) and the events it emitted, so a run shows that
each happened with the events compared.

    tally = EventsTally()
    sink = tally.sink(other_sink)            # Runner.kv_event_sink, counting types
    tally.add(runner.stats, workload)        # after the workload (rules counted)
    print(tally.line())
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from schedspec.spec.kv_events import BlockStored, KVCacheEvent

from schedspec.check.stats import Stats
from schedspec.check.workload import ResetPrefixCache, Workload

Sink = Callable[[int, tuple[KVCacheEvent, ...]], None]

#: situation -> the spec's rules whose counts make it (summed)
SITUATIONS: dict[str, tuple[str, ...]] = {
    "evictions": ("kv.evict_cached",),
    "resets done": ("kv.reset_ok",),
    "resets refused": ("kv.reset_refused",),
    "requests preempted by a reset": ("preempt.reset_running",),
    "cached blocks reused by another request": ("kv.touch_free", "kv.touch_shared"),
    "aborts": ("abort.waiting", "abort.preempted", "abort.running"),
    "connector loads": ("connector.load_sync", "connector.load_async"),
    "failed loads evicting their blocks": ("connector.invalid_fail",),
    "partial entries stored": ("kv_groups.partial_stored",),
    "blocks removed with partial entries": ("kv_groups.partial_removed",),
}

#: the BlockStored events that report a prefix hit again (spec/kv_events.py, "reused")
REPORTED = "prefix hits reported in full report mode"


@dataclass
class EventsTally:
    """Counts over the workloads a check ran with KV cache events on."""

    workloads: int = 0
    steps: int = 0
    #: event type (vLLM's class name) -> events the reference emitted
    types: Counter[str] = field(default_factory=Counter)
    #: situation (SITUATIONS, and the two below) -> count
    counts: Counter[str] = field(default_factory=Counter)

    def sink(self, inner: Sink | None = None) -> Sink:
        """A Runner.kv_event_sink that counts the events by type, then hands them to ``inner``."""

        def take(step: int, batch: tuple[KVCacheEvent, ...]) -> None:
            self.types.update(type(e).__name__ for e in batch)
            self.counts[REPORTED] += sum(1 for e in batch if isinstance(e, BlockStored) and e.reused)
            if inner is not None:
                inner(step, batch)

        return take

    def add(self, stats: Stats, workload: Workload) -> None:
        """One workload run with the events on: its rule counts (``stats.rules``)
        and the resets it asked for, with and without reset_running_requests."""
        self.workloads += 1
        self.steps += stats.steps
        for name, rules in SITUATIONS.items():
            self.counts[name] += sum(stats.rules.get(r, 0) for r in rules)
        for e in workload.events:
            if isinstance(e, ResetPrefixCache):
                self.counts["resets asked with running requests" if e.reset_running_requests
                            else "resets asked without running requests"] += 1
        if workload.config.is_hybrid:
            self.counts["prefix hits in hybrid layouts"] += stats.hit_admissions

    def as_dict(self) -> dict[str, object]:
        return {"workloads": self.workloads, "steps": self.steps, "events": dict(self.types),
                "situations": dict(self.counts)}

    def line(self) -> str:
        """``events: in N workloads (S steps) with KV cache events on: ...`` (every situation, zeros too)."""
        types = ", ".join(f"{self.types.get(t, 0)} {t}" for t in ("BlockStored", "BlockRemoved", "AllBlocksCleared"))
        names = [*SITUATIONS, "resets asked with running requests", "resets asked without running requests",
                 "prefix hits in hybrid layouts", REPORTED]
        situations = ", ".join(f"{self.counts.get(n, 0)} {n}" for n in names)
        return (f"events: {self.workloads} workloads ({self.steps} steps) with KV cache events on: {types}; "
                f"{situations}")
