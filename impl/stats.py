"""ImplScheduler's statistics (``log_stats``): the same SchedulerStats as
the spec's (spec/stats.py), counted where vLLM counts them. Off by default,
when the phases' only cost is one test of ``_log_stats`` at an admission, a
preemption, a reset and (with drafts) an update.

The counters are plain ints and tuples, so ``clone`` shares nothing mutable.
"""

from __future__ import annotations

from typing import AbstractSet, Any

from schedspec.spec.interface import StepPlan, StepResult
from schedspec.spec.stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats

_new = object.__new__


class StatsMixin:
    """The statistics' record and ``make_stats``."""

    # provided by ImplScheduler and its other parts
    _requests: dict[str, Any]
    _running: list[Any]
    _waiting: Any
    _kv_holding_waiting: Any
    _deferred: set[str]
    _fq: Any
    _caching: bool
    _num_spec_tokens: int
    _config: Any
    _inflight: list[StepPlan]

    def _init_stats(self, log_stats: bool) -> None:
        self._log_stats = log_stats
        self._stats_zero()
        self._st_num_preemptions = 0
        # async scheduling with drafts: the plans whose sampling the engine
        # defers for structured output (steps), and the drafts their
        # grammars invalidated (step -> request id -> count); replaced, never
        # changed in place, so clones share them safely
        self._st_deferred: frozenset[int] = frozenset()
        self._st_invalid: dict[int, dict[str, int]] = {}

    def _stats_note_plan(self, plan: StepPlan) -> None:
        """pending_structured_output_tokens (AsyncScheduler._update_after_schedule)."""
        requests = self._requests
        for s in plan.scheduled:
            if s.samples and s.num_output_placeholders > 0 and requests[s.request_id].spec.structured_output:
                self._st_deferred = self._st_deferred | {plan.step}
                return

    def _stats_updated(self, plan: StepPlan, result: StepResult) -> None:
        """After an update: the plan's records go; the next plan in flight,
        if its sampling was deferred, has the worker's drafts checked against
        its grammars (update_draft_token_ids_in_output): the placeholders
        the accepted prefix leaves over are invalid drafts."""
        if plan.step in self._st_deferred:
            self._st_deferred = self._st_deferred - {plan.step}
        if plan.step in self._st_invalid:
            self._st_invalid = {k: v for k, v in self._st_invalid.items() if k != plan.step}
        if not self._inflight or self._inflight[0].step not in self._st_deferred:
            return
        nxt = self._inflight[0]
        self._st_deferred = self._st_deferred - {nxt.step}
        counts: dict[str, int] = {}
        ran = {s.request_id for s in plan.scheduled}  # the worker's drafts are for the requests it ran
        for s in nxt.scheduled:
            n = len(s.spec_token_ids)
            req = self._requests.get(s.request_id)
            if not n or req is None or s.request_id not in ran:
                continue
            drafts = result.draft_token_ids.get(s.request_id, ())[:n]
            keep = len(drafts)
            if req.spec.structured_output:
                rejects = req.spec.grammar_rejects
                keep = next((i for i, tok in enumerate(drafts) if tok in rejects), keep)
            if keep < n:
                counts[s.request_id] = n - keep
        if counts:
            self._st_invalid = {**self._st_invalid, nxt.step: counts}

    def _stats_zero(self) -> None:
        """A fresh prefix-cache record and no drafts (make_prefix_cache_stats)."""
        self._st_reset = False
        self._st_requests = self._st_queries = self._st_hits = 0
        self._st_p_requests = self._st_p_queries = self._st_p_hits = 0
        self._st_drafts: SpecDecodingStats | None = None

    def _stats_lookup(self, req: Any, num_hits: int) -> None:
        """KVCacheManager.record_prefix_cache_stats, at an admission whose
        blocks are allocated, for a request that looked the cache up (the
        caller checks: nothing computed before, caching on)."""
        if req.num_preemptions:
            self._st_p_requests += 1
            self._st_p_queries += req.num_tokens
            self._st_p_hits += num_hits
        else:
            self._st_requests += 1
            self._st_queries += req.num_tokens
            self._st_hits += num_hits

    def _stats_drafts(self, plan: StepPlan, result: StepResult, failed: AbstractSet[str]) -> None:
        """update_from_output's make_spec_decoding_stats, before the entries
        are applied: each entry with drafts that sampled, unless its request
        is gone, its KV load failed or its output is stale and dropped. The
        update's counts are summed in locals and stored once."""
        sampled = result.sampled
        requests = self._requests
        invalid = self._st_invalid.get(plan.step) if self._st_invalid else None
        k = self._num_spec_tokens
        num_drafts = num_draft_tokens = num_accepted = 0
        accepted_at = [0] * (k + 1)  # drafts by accepted tokens
        drafted_at = [0] * (k + 1)  # drafts by draft tokens
        for s in plan.scheduled:
            drafts = s.spec_token_ids
            if not drafts:
                continue
            tokens = sampled.get(s.request_id)
            if not tokens:
                continue
            req = requests.get(s.request_id)
            if req is None or s.request_id in failed or (req.num_stale_output_tokens > 0 and req.drop_stale_output):
                continue
            n = len(drafts) - s.num_invalid_spec_tokens
            if invalid:
                n -= invalid.get(s.request_id, 0)
            a = len(tokens) - 1
            num_drafts += 1
            num_draft_tokens += n
            num_accepted += a
            accepted_at[a] += 1
            drafted_at[min(n, k)] += 1
        if not num_drafts:
            return
        d = self._st_drafts or SpecDecodingStats(k, 0, 0, 0, (0,) * k, (0,) * k)
        # position i counts the drafts with more than i tokens (accepted, drafted)
        acc = list(d.num_accepted_tokens_per_pos)
        dft = list(d.num_draft_tokens_per_pos)
        more_acc = more_dft = 0
        for i in range(k - 1, -1, -1):
            more_acc += accepted_at[i + 1]
            more_dft += drafted_at[i + 1]
            acc[i] += more_acc
            dft[i] += more_dft
        self._st_drafts = SpecDecodingStats(k, d.num_drafts + num_drafts, d.num_draft_tokens + num_draft_tokens,
                                            d.num_accepted_tokens + num_accepted, tuple(acc), tuple(dft))

    def make_stats(self) -> SchedulerStats | None:
        """Scheduler.make_stats (called once after each update); None without
        ``log_stats``."""
        if not self._log_stats:
            return None
        usable = self._config.num_blocks - 1
        usage = 1.0 - self._fq.size / usable if usable > 0 else 0.0
        deferred = len(self._deferred)
        waiting = len(self._waiting) + len(self._kv_holding_waiting) - deferred
        # both records built by filling a fresh instance's __dict__ in field
        # order, as plan_entry builds a plan entry (impl/request.py): equal to
        # the constructors' (tests/impl/test_stats.py), at about a third of the cost
        prefix = _new(PrefixCacheStats)
        fields = prefix.__dict__
        fields["reset"] = self._st_reset
        fields["requests"] = self._st_requests
        fields["queries"] = self._st_queries
        fields["hits"] = self._st_hits
        fields["preempted_requests"] = self._st_p_requests
        fields["preempted_queries"] = self._st_p_queries
        fields["preempted_hits"] = self._st_p_hits
        out = _new(SchedulerStats)
        fields = out.__dict__
        fields["num_running_reqs"] = len(self._running)
        fields["num_waiting_reqs"] = waiting
        fields["num_skipped_waiting_reqs"] = deferred
        fields["kv_cache_usage"] = usage
        fields["prefix_cache_stats"] = prefix
        fields["spec_decoding_stats"] = self._st_drafts
        fields["num_preemptions"] = self._st_num_preemptions
        self._stats_zero()
        self._st_num_preemptions = 0
        return out
