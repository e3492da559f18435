"""The spec's record of the scheduler statistics (spec/stats.py says what
each field is and where vLLM 0.33 counts it)."""

from __future__ import annotations

from schedspec.spec.stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats


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

    def copy(self) -> StatsRecorder:
        new = StatsRecorder(self.num_spec_tokens)
        new.prefix, new.drafts, new.num_preemptions = self.prefix, self.drafts, self.num_preemptions
        return new

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
