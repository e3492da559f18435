"""One observed operation of a scheduler (Transition) and the kinds of
operation: the types every invariant reads, in a module of their own so the
invariants' helpers (``_util``) and the Monitor's history (``core``) can both
use them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schedspec.spec.interface import RequestSpec, SchedulerView, StepPlan, StepResult
from schedspec.spec.kv_events import KVCacheEvent
from schedspec.spec.stats import SchedulerStats

#: The operations a transition can be: the five calls of the Scheduler
#: protocol that change state, and the two optional gate calls, "pause"
#: (set_pause_state, UNPAUSED included) and "grammar" (grammar_ready).
TransitionKind = Literal["add", "abort", "schedule", "update", "reset", "pause", "grammar"]
ALL_KINDS: frozenset[TransitionKind] = frozenset(
    {"add", "abort", "schedule", "update", "reset", "pause", "grammar"}
)


@dataclass(frozen=True)
class Transition:
    """One operation of a scheduler, as a driver observed it."""

    kind: TransitionKind
    before: SchedulerView  # view() before the operation
    after: SchedulerView  # view() after it
    plan: StepPlan | None = None  # "schedule": the plan returned; "update": the plan completed
    result: StepResult | None = None  # "update" only
    request: RequestSpec | None = None  # "add" only
    request_id: str | None = None  # "abort" and "grammar" only
    #: the plans awaiting update() after the operation, oldest first (with
    #: async scheduling one may stay in flight across operations)
    in_flight: tuple[StepPlan, ...] = ()
    #: "update" with config.enable_kv_cache_events: the KV cache events the
    #: scheduler gave right after it (take_kv_events, spec/kv_events.py)
    kv_events: tuple[KVCacheEvent, ...] = ()
    #: "update" only: the statistics make_stats() reported after it (a
    #: scheduler built with log_stats; spec/stats.py), else None
    stats: SchedulerStats | None = None
