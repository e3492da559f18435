"""What the explored transitions exercised, as named counters.

Each counter counts transitions (or plan entries, or finished requests) that
showed one behaviour, once each, so that a zero says "the bound never reached
this". The checking engine's ``Stats`` counts a run's volume instead
(preempted requests, tokens, every abort and reset); the checker asks other
questions of its graph (did a reset drop the cache? did an abort hit a running
request?), so it keeps its own counters.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from schedspec.spec.interface import RequestStatus, ScheduleKind, SchedulerView, StepPlan, StepResult

#: The JSON / report label of every counter, in field order.
LABELS: dict[str, str] = {
    "preempting_steps": "steps that preempt",
    "hit_admissions": "admissions with a prefix-cache hit",
    "partial_chunks": "partial prefill chunks",
    "resumed_admissions": "resumed admissions",
    "stopped": "requests stopped by a stop token or eos",
    "length_capped": "requests length-capped",
    "dropping_resets": "resets that dropped the cache",
    "preempting_resets": "resets that preempted running requests",
    "running_aborts": "aborts of running requests",
    "pauses": "pause and resume events",
    "pause_clears": "cache clears completing a pause",
    "grammar_reports": "grammar reports (compiled or failed)",
    "kv_sync_loads": "synchronous KV loads",
    "kv_async_loads": "asynchronous KV loads started",
    "kv_loads_done": "KV loads reported done",
    "kv_loads_failed": "KV loads reported failed (whole)",
    "kv_invalid_blocks": "invalid blocks reported",
    "kv_saves_done": "KV saves reported done",
    "kv_forced": "reports forced by the bounded wait",
    "kv_resets_refused": "resets refused with blocks held for the connector",
}

#: The labels, in order (what the JSON summary's ``coverage`` maps).
COVERAGE: tuple[str, ...] = tuple(LABELS.values())

#: The labels of the admission gates' events (zero in a bound without them).
GATE_COVERAGE: tuple[str, ...] = (LABELS["pauses"], LABELS["pause_clears"], LABELS["grammar_reports"])

#: The labels of the KV connector's events (zero in a bound without one).
KV_COVERAGE: tuple[str, ...] = tuple(LABELS[n] for n in LABELS if n.startswith("kv_"))


@dataclass(slots=True)
class Coverage:
    preempting_steps: int = 0
    hit_admissions: int = 0
    partial_chunks: int = 0
    resumed_admissions: int = 0
    stopped: int = 0
    length_capped: int = 0
    dropping_resets: int = 0
    preempting_resets: int = 0
    running_aborts: int = 0
    pauses: int = 0
    pause_clears: int = 0
    grammar_reports: int = 0
    kv_sync_loads: int = 0
    kv_async_loads: int = 0
    kv_loads_done: int = 0
    kv_loads_failed: int = 0
    kv_invalid_blocks: int = 0
    kv_saves_done: int = 0
    kv_forced: int = 0
    kv_resets_refused: int = 0

    def count_step(self, plan: StepPlan, before: SchedulerView, after: SchedulerView) -> None:
        """One step from ``before`` (a state between steps) through ``plan`` to ``after``."""
        if not plan.scheduled:
            return
        for e in plan.scheduled:
            if e.kind is not ScheduleKind.RUNNING:
                if e.num_computed_tokens > 0:
                    self.hit_admissions += 1
                if e.kind is ScheduleKind.RESUMED:
                    self.resumed_admissions += 1
            if not e.samples:
                self.partial_chunks += 1
        if len(plan.preempted_ids) > len(before.preempted_since_plan):
            self.preempting_steps += 1
        for v in after.finished.values():
            if v.status is RequestStatus.FINISHED_STOPPED:
                self.stopped += 1
            elif v.status is RequestStatus.FINISHED_LENGTH_CAPPED:
                self.length_capped += 1

    def count_kv(self, plan: StepPlan, result: StepResult) -> None:
        """The connector's part of one step: the loads its plan starts and
        the worker's reports its result carries."""
        for load in plan.kv_loads:
            if load.asynchronous:
                self.kv_async_loads += 1
            else:
                self.kv_sync_loads += 1
        failed = set(result.failed_recving)
        self.kv_loads_done += len([r for r in result.finished_recving if r not in failed])
        self.kv_loads_failed += len(failed)
        self.kv_invalid_blocks += len(result.invalid_block_ids)
        self.kv_saves_done += len(result.finished_sending)

    def count_reset(self, before: SchedulerView, running_too: bool, dropped: bool) -> None:
        if dropped and before.kv.block_keys:
            self.dropping_resets += 1
        if running_too and before.running:
            self.preempting_resets += 1

    def count_abort(self, before: SchedulerView, request_id: str) -> None:
        if before.requests[request_id].status is RequestStatus.RUNNING:
            self.running_aborts += 1

    def merge(self, other: Coverage) -> None:
        """Add ``other``'s counts to these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        """Label -> count, in the order of ``COVERAGE``."""
        return {label: getattr(self, name) for name, label in LABELS.items()}
