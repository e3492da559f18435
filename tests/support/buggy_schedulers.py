"""Deliberately broken schedulers the tests hold the gate against."""

from __future__ import annotations

import dataclasses
from typing import Any

from schedspec.check.capabilities import FULL as SPEC_STATS_CAPABILITIES
from schedspec.spec.scheduler import SpecScheduler


class LeakyAbort(SpecScheduler):
    """Forgets to free the last block of an aborted request."""

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and req.blocks:
            req.blocks = req.blocks[:-1]
        super().abort(request_id)


class WrongVictim(SpecScheduler):
    """FCFS preemption takes the FIRST running request instead of the last."""

    def schedule(self):  # type: ignore[no-untyped-def]
        import schedspec.spec.scheduler as mod

        original = mod.choose_victim
        mod.choose_victim = lambda policy, running_keys: 0  # type: ignore[assignment]
        try:
            return super().schedule()
        finally:
            mod.choose_victim = original


class NotAScheduler:
    pass


class RaisingSchedule(SpecScheduler):
    """schedule() raises once a request has waited through two steps."""

    def schedule(self):  # type: ignore[no-untyped-def]
        if self.step >= 2 and self.requests:
            raise RuntimeError("the batch is full of surprises")
        return super().schedule()


class WrongTypeSchedule(SpecScheduler):
    """schedule() returns the plan's entries as a list instead of a StepPlan."""

    def schedule(self):  # type: ignore[no-untyped-def]
        return list(super().schedule().scheduled)


class MiscountedPreemptions(SpecScheduler):
    """Reports scheduler statistics (Capabilities.stats) but counts each
    preemption twice."""

    CAPABILITIES = dataclasses.replace(SPEC_STATS_CAPABILITIES, stats=True)

    def make_stats(self) -> Any:
        stats = super().make_stats()
        if stats is not None and stats.num_preemptions:
            stats = dataclasses.replace(stats, num_preemptions=2 * stats.num_preemptions)
        return stats
