"""What a run found: per space and per bound, with the shortest counterexample
(a replayable workload) when a check failed, and the table and JSON they
print as."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedspec.check import trace as tracefile
from schedspec.check.workload import Workload
from schedspec.invariants import Violation
from schedspec.modelcheck.space import Space
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.effects import effect_counts
from schedspec.spec.interface import SchedulerConfig


class Finding(Exception):
    """A failed check on one transition (or state): raised inside the
    expansion, carried back from a worker, turned into a Counterexample."""

    def __init__(self, kind: str, message: str, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.violations = tuple(violations)

    def __reduce__(self) -> tuple[Any, ...]:  # travels from the worker processes
        return (Finding, (self.kind, self.message, self.violations))


@dataclass(frozen=True)
class Counterexample:
    kind: str  # "violation" | "divergence" | "deadlock" | "error"
    message: str
    violations: tuple[Violation, ...]
    labels: tuple[str, ...]  # the events, as the checker names them
    workload: Workload  # the same events with concrete requests, ready for a trace
    vocab: int
    oracle_seed: int

    def describe(self) -> str:
        lines = [f"{self.kind}: {self.message}"]
        lines += [f"  [{v.invariant_id}]" + (f" {v.request_id}:" if v.request_id else "") + f" {v.message}"
                  for v in self.violations]
        lines.append(f"  shortest path ({len(self.labels)} events): " + ", ".join(self.labels))
        return "\n".join(lines)

    def write_trace(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tracefile.write(path, tracefile.Trace(self.workload, vocab=self.vocab, oracle_seed=self.oracle_seed))
        return path


@dataclass
class SpaceResult:
    space: Space
    states: int = 0
    transitions: int = 0
    depth: int = 0
    elapsed: float = 0.0
    impl_transitions: int = 0  # transitions the scheduler under test took (and matched, in lockstep)
    liveness_bound: int | None = None  # steps to drain, worst case over the graph
    liveness_labels: tuple[str, ...] = ()  # path to the worst state, then its steps
    liveness_workload: Workload | None = None
    failure: Counterexample | None = None
    complete: bool = False  # the whole space was explored (no failure, no state cap)
    coverage: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0  # CPU time of this process and its workers
    against: str | None = None  # the scheduler under test, as --against names it
    mode: str = ""  # lockstep | invariants (with a scheduler under test)
    copy: str = ""  # how the scheduler under test was copied (target.copy_method)
    rules: Counter[str] = field(default_factory=Counter)  # the spec's named rules taken, and how often
    note: str = ""  # why the default impl differential left this space out (a gate impl lacks)

    @property
    def states_per_s(self) -> float:
        return self.states / self.elapsed if self.elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "space": self.space.describe(),
            "states": self.states,
            "transitions": self.transitions,
            "depth": self.depth,
            "elapsed_s": round(self.elapsed, 3),
            "states_per_s": round(self.states_per_s, 1),
            "impl_transitions": self.impl_transitions,
            "against": self.against,
            "mode": self.mode or None,
            "copy": self.copy or None,
            "complete": self.complete,
            "liveness_bound": self.liveness_bound,
            "liveness_path": list(self.liveness_labels),
            "coverage": self.coverage,
            "rules": rule_coverage.as_dict(self.rules),
            "effects": effect_counts(self.rules),
            "cpu_s": round(self.cpu_s, 3),
            "note": self.note or None,
            "failure": None if self.failure is None else {
                "kind": self.failure.kind,
                "message": self.failure.message,
                "violations": [{"id": v.invariant_id, "message": v.message, "request_id": v.request_id}
                               for v in self.failure.violations],
                "path": list(self.failure.labels),
            },
        }


@dataclass
class BoundResult:
    bound: str
    spaces: list[SpaceResult] = field(default_factory=list)

    @property
    def failure(self) -> Counterexample | None:
        for r in self.spaces:
            if r.failure is not None:
                return r.failure
        return None

    @property
    def states(self) -> int:
        return sum(r.states for r in self.spaces)

    @property
    def transitions(self) -> int:
        return sum(r.transitions for r in self.spaces)

    @property
    def elapsed(self) -> float:
        return sum(r.elapsed for r in self.spaces)

    @property
    def rules(self) -> Counter[str]:
        """The spec's named rules the explored transitions took, over every space."""
        total: Counter[str] = Counter()
        for r in self.spaces:
            total.update(r.rules)
        return total

    def worst_liveness(self) -> SpaceResult | None:
        """The space with the greatest liveness bound (None: no space has one)."""
        bounds = [r for r in self.spaces if r.liveness_bound is not None]
        return max(bounds, key=lambda r: r.liveness_bound or 0) if bounds else None

    def total(self) -> SpaceResult:
        """One row for the whole bound: the table's last line."""
        config = self.spaces[0].space.config if self.spaces else SchedulerConfig()
        total = SpaceResult(Space("total", config, (), 0))
        total.states, total.transitions, total.elapsed = self.states, self.transitions, self.elapsed
        total.depth = max((r.depth for r in self.spaces), default=0)
        worst = self.worst_liveness()
        total.liveness_bound = worst.liveness_bound if worst else None
        total.complete = all(r.complete for r in self.spaces)
        total.cpu_s = sum(r.cpu_s for r in self.spaces)
        total.failure = self.failure
        total.rules = self.rules
        return total

    def as_dict(self) -> dict[str, Any]:
        bounds = [r.liveness_bound for r in self.spaces if r.liveness_bound is not None]
        cpu = sum(r.cpu_s for r in self.spaces)
        return {
            "bound": self.bound,
            "result": "fail" if self.failure is not None else "pass",
            "states": self.states,
            "transitions": self.transitions,
            "depth": max((r.depth for r in self.spaces), default=0),
            "elapsed_s": round(self.elapsed, 3),
            "states_per_s": round(self.states / self.elapsed, 1) if self.elapsed > 0 else None,
            "cpu_s": round(cpu, 3),
            "states_per_cpu_s": round(self.states / cpu, 1) if cpu > 0 else None,
            "liveness_bound": max(bounds) if bounds else None,
            "rules": rule_coverage.as_dict(self.rules),
            "rules_unreached": rule_coverage.unreached(self.rules),
            "effects": effect_counts(self.rules),
            "spaces": [r.as_dict() for r in self.spaces],
        }


def format_row(r: SpaceResult) -> str:
    live = "-" if r.liveness_bound is None else str(r.liveness_bound)
    status = "FAIL" if r.failure is not None else ("ok" if r.complete else "partial")
    per_cpu = r.states / r.cpu_s if r.cpu_s > 0 else 0.0
    return (f"{r.space.name:34s} {r.states:>10,} {r.transitions:>11,} {r.depth:>6} {r.elapsed:>9.1f}s "
            f"{r.states_per_s:>10,.0f} {r.cpu_s:>8.1f}s {per_cpu:>10,.0f} {live:>9}  {status}")


def table_header() -> str:
    return (f"{'space':34s} {'states':>10} {'transitions':>11} {'depth':>6} {'time':>10} "
            f"{'states/s':>10} {'cpu':>9} {'states/cpu-s':>10} {'liveness':>9}  result")


def write_json(path: Path, result: BoundResult, extra: dict[str, Any] | None = None) -> None:
    data = result.as_dict()
    if extra:
        data.update(extra)
    path.write_text(json.dumps(data, indent=2) + "\n")
