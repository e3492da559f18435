"""Invariants of the scheduler statistics (spec/stats.py): what a scheduler
built with ``log_stats`` reports after an update (``Transition.stats``) must
agree with its state and with what the checker saw. A scheduler that reports
none (``stats`` None) passes them all."""

from __future__ import annotations

from typing import Iterator

from schedspec.invariants.core import Finding, History, Transition, preemptions_in, transition_invariant

#: How far the reported usage may be from used / usable: vLLM computes
#: ``1.0 - free / usable`` (BlockPool.get_usage), which rounds differently
#: from ``(usable - free) / usable`` by at most a few units in the last place.
USAGE_TOLERANCE = 1e-12


@transition_invariant(
    "stats-kv-usage",
    f"kv_cache_usage is the used over the usable blocks (num_blocks - 1), to {USAGE_TOLERANCE:g}.",
    "vllm/v1/core/block_pool.py, BlockPool.get_usage: 1 - free / (num_gpu_blocks - 1).",
    ("update",),
    tags=("safety",),
)
def stats_kv_usage(t: Transition, h: History) -> Iterator[Finding]:
    if t.stats is None:
        return
    usable = t.after.kv.num_blocks - 1
    free = len(t.after.kv.free_queue)
    want = (usable - free) / usable if usable > 0 else 0.0
    got = t.stats.kv_cache_usage
    if not abs(got - want) <= USAGE_TOLERANCE:
        yield None, (f"kv_cache_usage {got!r}, but {usable - free} of {usable} usable blocks are in use "
                     f"({want!r})")


@transition_invariant(
    "stats-hits-within-queries",
    "Prefix-cache hits <= queries - requests (a lookup leaves one token), new and preempted alike.",
    "vllm/v1/core/kv_cache_manager.py, record_prefix_cache_stats: the hit is capped at num_tokens - 1.",
    ("update",),
    tags=("safety",),
)
def stats_hits_within_queries(t: Transition, h: History) -> Iterator[Finding]:
    if t.stats is None:
        return
    p = t.stats.prefix_cache_stats
    for label, requests, queries, hits in (("", p.requests, p.queries, p.hits),
                                            ("preempted_", p.preempted_requests, p.preempted_queries,
                                             p.preempted_hits)):
        if min(requests, queries, hits) < 0:
            yield None, f"negative prefix-cache counts: {label}requests {requests}, queries {queries}, hits {hits}"
        elif hits > queries - requests:
            yield None, (f"{label}hits {hits} of {label}queries {queries} over {label}requests {requests}: "
                         "more than the lookups may hit (each leaves one token)")


@transition_invariant(
    "stats-queue-counts",
    "The running count is the running queue's length; waiting plus skipped, the waiting queues'.",
    "vllm/v1/core/sched/scheduler.py, make_stats: get_request_counts() and deferred_waiting.",
    ("update",),
    tags=("safety",),
)
def stats_queue_counts(t: Transition, h: History) -> Iterator[Finding]:
    s = t.stats
    if s is None:
        return
    if s.num_running_reqs != len(t.after.running):
        yield None, f"num_running_reqs {s.num_running_reqs}, but {len(t.after.running)} requests run"
    if s.num_waiting_reqs < 0 or s.num_skipped_waiting_reqs < 0 or (
            s.num_waiting_reqs + s.num_skipped_waiting_reqs != len(t.after.waiting)):
        yield None, (f"num_waiting_reqs {s.num_waiting_reqs} + num_skipped_waiting_reqs "
                     f"{s.num_skipped_waiting_reqs}, but {len(t.after.waiting)} requests wait")


@transition_invariant(
    "stats-preemptions-counted",
    "The preemption count is the preemptions seen since the previous statistics.",
    "vllm/v1/core/sched/scheduler.py, _preempt_request: a PREEMPTED event (IterationStats.num_preempted_reqs).",
    ("update",),
    tags=("safety",),
)
def stats_preemptions_counted(t: Transition, h: History) -> Iterator[Finding]:
    if t.stats is None:
        return
    seen = h.preemptions_since_stats + preemptions_in(t)
    if t.stats.num_preemptions != seen:
        yield None, f"num_preemptions {t.stats.num_preemptions}, but {seen} preemptions since the last statistics"


@transition_invariant(
    "stats-drafts-within-proposed",
    "Drafts within the plan's, accepted within proposed, per position too.",
    "vllm/v1/core/sched/scheduler.py, make_spec_decoding_stats -> SpecDecodingStats.observe_draft.",
    ("update",),
    tags=("safety",),
)
def stats_drafts_within_proposed(t: Transition, h: History) -> Iterator[Finding]:
    d = t.stats.spec_decoding_stats if t.stats is not None else None
    if d is None or t.plan is None:
        return
    entries = [s for s in t.plan.scheduled if s.spec_token_ids]
    proposed = sum(len(s.spec_token_ids) for s in entries)
    if d.num_drafts > len(entries) or d.num_draft_tokens > proposed:
        yield None, (f"{d.num_drafts} drafts of {d.num_draft_tokens} tokens, but the plan verified "
                     f"{len(entries)} drafts of {proposed} tokens")
    if not 0 <= d.num_accepted_tokens <= d.num_draft_tokens:
        yield None, f"{d.num_accepted_tokens} draft tokens accepted of {d.num_draft_tokens} proposed"
    acc, drafted = d.num_accepted_tokens_per_pos, d.num_draft_tokens_per_pos
    if len(acc) != d.num_spec_tokens or len(drafted) != d.num_spec_tokens:
        yield None, f"per-position counts {acc} / {drafted} for {d.num_spec_tokens} speculative tokens"
        return
    if sum(acc) != d.num_accepted_tokens or sum(drafted) != d.num_draft_tokens:
        yield None, f"per-position counts {acc} / {drafted} do not sum to {d.num_accepted_tokens} / {d.num_draft_tokens}"
    for i in range(d.num_spec_tokens):
        if not 0 <= acc[i] <= drafted[i] <= d.num_drafts or (i and (acc[i] > acc[i - 1] or drafted[i] > drafted[i - 1])):
            yield None, f"position {i}: {acc[i]} accepted of {drafted[i]} drafted ({d.num_drafts} drafts)"
            break
