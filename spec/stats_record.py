"""The spec's record of the scheduler statistics (spec/stats.py says what
each field is and where vLLM 0.33 counts it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from schedspec.spec.interface import StepPlan, StepResult
from schedspec.spec.stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats

if TYPE_CHECKING:
    from schedspec.spec.request_state import RequestState


def kv_cache_usage(num_free: int, num_blocks: int) -> float:
    """BlockPool.get_usage: ``1.0 - free / usable`` with ``usable =
    num_blocks - 1`` (the null block), 0 when nothing is usable. vLLM's own
    arithmetic, so the value is equal to the last bit."""
    usable = num_blocks - 1
    if usable <= 0:
        return 0.0
    return 1.0 - num_free / usable


class StatsRecorder:
    """What a scheduler built with ``log_stats`` counts between two
    statistics: the prefix-cache lookups (KVCacheManager.prefix_cache_stats),
    the drafts of the update (update_from_output's ``spec_decoding_stats``)
    and the preemptions."""

    def __init__(self, num_spec_tokens: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.prefix = PrefixCacheStats()
        self.drafts: SpecDecodingStats | None = None
        self.num_preemptions = 0
        #: async scheduling: the plans (by step) whose sampling the engine
        #: defers for structured output, and the drafts the grammar
        #: invalidated in each (``note_plan``, ``deferred_drafts``)
        self.deferred_steps: set[int] = set()
        self.invalid: dict[int, dict[str, int]] = {}

    def copy(self) -> StatsRecorder:
        new = StatsRecorder(self.num_spec_tokens)
        new.prefix, new.drafts, new.num_preemptions = self.prefix, self.drafts, self.num_preemptions
        new.deferred_steps = set(self.deferred_steps)
        new.invalid = {step: dict(counts) for step, counts in self.invalid.items()}
        return new

    def note_plan(self, plan: StepPlan, requests: Mapping[str, RequestState]) -> None:
        """AsyncScheduler._update_after_schedule: a plan with an entry that
        samples for a request with a grammar and output still in flight sets
        ``pending_structured_output_tokens``; the engine core then defers its
        sampling until the previous step's update (vllm/v1/engine/core.py,
        step_with_batch_queue)."""
        if any(s.samples and s.num_output_placeholders > 0 and requests[s.request_id].spec.structured_output
               for s in plan.scheduled):
            self.deferred_steps.add(plan.step)

    def deferred_drafts(self, plan: StepPlan, updated: StepPlan, result: StepResult,
                        requests: Mapping[str, RequestState]) -> None:
        """The update of ``updated``, before a deferred ``plan``: the engine
        checks the worker's drafts for it (``result.draft_token_ids``, one
        list per request of ``updated``, the step the worker ran) against
        the grammar (Scheduler.update_draft_token_ids_in_output): each entry
        of ``plan`` whose request the worker ran has its drafts, cut
        to its scheduled placeholders, keep their longest prefix the grammar
        accepts (StructuredOutputManager.validate_tokens; the modelled
        grammar refuses ``grammar_rejects``); the placeholders left over are
        its ``num_invalid_spec_tokens``, which make_spec_decoding_stats takes
        off its draft tokens. Only unfinished requests are checked."""
        if plan.step not in self.deferred_steps:
            return
        self.deferred_steps.discard(plan.step)
        counts: dict[str, int] = {}
        ran = {s.request_id for s in updated.scheduled}
        for s in plan.scheduled:
            req = requests.get(s.request_id)
            if not s.spec_token_ids or req is None or s.request_id not in ran:
                continue
            drafts = list(result.draft_token_ids.get(s.request_id, ()))[:len(s.spec_token_ids)]
            if req.spec.structured_output:
                refused = [i for i, tok in enumerate(drafts) if tok in req.spec.grammar_rejects]
                drafts = drafts[:refused[0]] if refused else drafts
            if len(s.spec_token_ids) > len(drafts):
                counts[s.request_id] = len(s.spec_token_ids) - len(drafts)
        if counts:
            self.invalid[plan.step] = counts

    def num_invalid(self, plan: StepPlan, request_id: str) -> int:
        """The entry's drafts its grammar invalidated after it was scheduled
        (``deferred_drafts``), 0 for most."""
        return self.invalid.get(plan.step, {}).get(request_id, 0)

    def updated(self, plan: StepPlan) -> None:
        """The plan is updated: its records go."""
        self.invalid.pop(plan.step, None)
        self.deferred_steps.discard(plan.step)

    def record_lookup(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """PrefixCacheStats.record: a request preempted before counts apart."""
        p = self.prefix
        if preempted:
            self.prefix = PrefixCacheStats(p.reset, p.requests, p.queries, p.hits, p.preempted_requests + 1,
                                           p.preempted_queries + num_tokens, p.preempted_hits + num_hits)
        else:
            self.prefix = PrefixCacheStats(p.reset, p.requests + 1, p.queries + num_tokens, p.hits + num_hits,
                                           p.preempted_requests, p.preempted_queries, p.preempted_hits)

    def record_reset(self) -> None:
        """KVCacheManager.reset_prefix_cache, when it succeeded: ``reset = True``."""
        p = self.prefix
        self.prefix = PrefixCacheStats(True, p.requests, p.queries, p.hits, p.preempted_requests,
                                       p.preempted_queries, p.preempted_hits)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """SpecDecodingStats.observe_draft (a fresh record on the update's
        first draft: SpecDecodingStats.new)."""
        k = self.num_spec_tokens
        d = self.drafts or SpecDecodingStats(k, 0, 0, 0, (0,) * k, (0,) * k)
        assert num_accepted_tokens <= k
        self.drafts = SpecDecodingStats(
            k, d.num_drafts + 1, d.num_draft_tokens + num_draft_tokens, d.num_accepted_tokens + num_accepted_tokens,
            tuple(c + (i < num_accepted_tokens) for i, c in enumerate(d.num_accepted_tokens_per_pos)),
            tuple(c + (i < num_draft_tokens) for i, c in enumerate(d.num_draft_tokens_per_pos)),
        )

    def make(self, num_running: int, num_waiting: int, num_deferred: int, usage: float) -> SchedulerStats:
        """make_stats: the statistics, and a fresh record
        (make_prefix_cache_stats; the drafts are the update's own)."""
        out = SchedulerStats(num_running, num_waiting - num_deferred, num_deferred, usage, self.prefix,
                             self.drafts, self.num_preemptions)
        self.prefix, self.drafts, self.num_preemptions = PrefixCacheStats(), None, 0
        return out
