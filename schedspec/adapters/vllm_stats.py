"""vLLM 0.33's scheduler statistics as schedspec's SchedulerStats
(spec/stats.py).

The adapter builds vLLM's Scheduler with ``log_stats=True`` when asked
(VllmScheduler(config, log_stats=True)); update_from_output then ends with
Scheduler.make_stats and puts the SchedulerStats in one of its
EngineCoreOutputs (``scheduler_stats``). ``stats_of`` maps it field by field
(no arithmetic of ours: ``kv_cache_usage`` is vLLM's float as it computed
it). The preemptions, which vLLM reports as PREEMPTED request events rather
than in SchedulerStats, are counted by ``PreemptionCounter`` around the
scheduler's own ``_preempt_request`` (every preemption goes through it: the
RUNNING loop's and reset_prefix_cache's).
"""

from __future__ import annotations

from typing import Any

from schedspec.spec.stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats


class PreemptionCounter:
    """Counts the calls of a vLLM scheduler's ``_preempt_request`` (wrapped
    on the instance, so a subclass's own override still runs)."""

    def __init__(self, sched: Any) -> None:
        self.count = 0
        preempt = sched._preempt_request

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return preempt(*args, **kwargs)

        sched._preempt_request = counted

    def take(self) -> int:
        """The preemptions since the last take."""
        n, self.count = self.count, 0
        return n


def scheduler_stats_in(outputs: Any) -> Any:
    """The SchedulerStats update_from_output returned (in the first of its
    EngineCoreOutputs that carries one), or None."""
    for eco in (outputs or {}).values():
        stats = getattr(eco, "scheduler_stats", None)
        if stats is not None:
            return stats
    return None


def stats_of(stats: Any, num_preemptions: int) -> SchedulerStats:
    """vLLM's SchedulerStats as ours (the fields spec/stats.py keeps)."""
    p = stats.prefix_cache_stats
    prefix = PrefixCacheStats(
        reset=bool(p.reset), requests=p.requests, queries=p.queries, hits=p.hits,
        preempted_requests=p.preempted_requests, preempted_queries=p.preempted_queries,
        preempted_hits=p.preempted_hits,
    )
    d = stats.spec_decoding_stats
    drafts = None if d is None else SpecDecodingStats(
        num_spec_tokens=d.num_spec_tokens, num_drafts=d.num_drafts, num_draft_tokens=d.num_draft_tokens,
        num_accepted_tokens=d.num_accepted_tokens,
        num_accepted_tokens_per_pos=tuple(d.num_accepted_tokens_per_pos),
        num_draft_tokens_per_pos=tuple(d.num_draft_tokens_per_pos),
    )
    return SchedulerStats(
        num_running_reqs=stats.num_running_reqs, num_waiting_reqs=stats.num_waiting_reqs,
        num_skipped_waiting_reqs=stats.num_skipped_waiting_reqs, kv_cache_usage=float(stats.kv_cache_usage),
        prefix_cache_stats=prefix, spec_decoding_stats=drafts, num_preemptions=num_preemptions,
    )
