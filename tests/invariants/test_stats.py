"""The statistics invariants (invariants/stats.py): each holds on the
transitions the spec makes with log_stats, and fires, under its id, on a
crafted transition that breaks it in one place; a scheduler that reports no
statistics passes them all."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from schedspec.invariants import BY_ID, CATALOGUE, Monitor, Transition
from schedspec.invariants.core import History
from schedspec.spec import RequestSpec, SchedulerConfig, SpecScheduler, StepPlan, StepResult
from schedspec.spec.stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats

STATS_IDS = (
    "stats-kv-usage",
    "stats-hits-within-queries",
    "stats-queue-counts",
    "stats-preemptions-counted",
    "stats-drafts-within-proposed",
)


def config(**kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(block_size=4, num_blocks=7, max_num_batched_tokens=32, max_num_seqs=4,
                                max_model_len=24)
    base.update(kw)
    return SchedulerConfig(**base)


class StatsRecorder:
    """Drives a SpecScheduler built with log_stats and keeps every
    transition, each update's with the statistics make_stats reported."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.s = SpecScheduler(cfg, log_stats=True)
        self.log: list[Transition] = []

    def _op(self, kind: str, fn: Any, **kw: Any) -> Any:
        before = self.s.view()
        out = fn()
        if kind == "update":
            kw["stats"] = self.s.make_stats()
        plan = out if kind == "schedule" else kw.pop("plan", None)
        self.log.append(Transition(kind, before, self.s.view(), plan=plan,  # type: ignore[arg-type]
                                   in_flight=self.s.in_flight, **kw))
        return out

    def add(self, rid: str, prompt: tuple[int, ...], max_tokens: int = 8) -> None:
        r = RequestSpec(rid, prompt, max_tokens)
        self._op("add", lambda: self.s.add(r), request=r)

    def step(self, drafts: dict[str, tuple[int, ...]] | None = None, accept: int = 0) -> StepPlan:
        plan: StepPlan = self._op("schedule", self.s.schedule)
        sampled = {e.request_id: tuple(range(40, 41 + min(accept, len(e.spec_token_ids))))
                   for e in plan.scheduled if e.samples}
        result = StepResult(sampled, drafts or {})
        self._op("update", lambda: self.s.update(plan, result), plan=plan, result=result)
        return plan

    def reset(self, running: bool) -> None:
        self._op("reset", lambda: self.s.reset_prefix_cache(running))

    def updates(self) -> list[Transition]:
        return [t for t in self.log if t.kind == "update"]


def busy() -> StatsRecorder:
    """Hits, a preemption by a running request short of blocks, a reset
    preempting the running ones: 6 usable blocks of 4 tokens."""
    r = StatsRecorder(config())
    r.add("a", tuple(range(1, 9)), max_tokens=12)  # 2 blocks
    r.step()
    r.add("b", tuple(range(1, 9)) + (50,), max_tokens=12)  # hits a's 2 blocks
    r.add("c", tuple(range(60, 69)), max_tokens=12)
    for _ in range(10):  # b is preempted in the 9th
        r.step()
    r.reset(True)
    r.step()
    return r


def drafting() -> StatsRecorder:
    """Speculative decoding (k = 2): drafts proposed after each step, one accepted."""
    r = StatsRecorder(config(num_speculative_tokens=2))
    r.add("a", tuple(range(1, 6)))
    r.step(drafts={"a": (7, 8)})
    r.step(drafts={"a": (7, 8)}, accept=1)
    r.step(drafts={"a": (7, 8)}, accept=1)
    return r


def clean(r: StatsRecorder) -> None:
    m = Monitor(CATALOGUE)
    for t in r.log:
        assert m.observe(t) == [], t.kind


def test_every_stats_invariant_is_catalogued_as_safety() -> None:
    assert [inv.id for inv in CATALOGUE if inv.id.startswith("stats-")] == list(STATS_IDS)
    assert all(BY_ID[i].tags == ("safety",) and BY_ID[i].kinds == {"update"} for i in STATS_IDS)


def test_the_spec_with_log_stats_keeps_them_and_reports_what_they_read() -> None:
    r, d = busy(), drafting()
    clean(r)
    clean(d)
    stats = [t.stats for t in r.updates()]
    assert all(s is not None for s in stats)
    assert sum(s.prefix_cache_stats.hits for s in stats if s) >= 8  # b hit a's blocks
    assert sum(s.num_preemptions for s in stats if s) >= 2
    assert any(s.prefix_cache_stats.reset for s in stats if s)
    drafts = [t.stats.spec_decoding_stats for t in d.updates() if t.stats and t.stats.spec_decoding_stats]
    assert drafts and sum(x.num_accepted_tokens for x in drafts) >= 1


def with_stats(t: Transition, **changes: Any) -> Transition:
    assert t.stats is not None
    return dataclasses.replace(t, stats=dataclasses.replace(t.stats, **changes))


def fires(inv_id: str, t: Transition, history: History | None = None) -> list[str]:
    found = BY_ID[inv_id].check(t, history)
    assert inv_id in {v.invariant_id for v in Monitor([BY_ID[inv_id]]).observe(t)} or history is not None or not found
    return [v.message for v in found]


def last_update(r: StatsRecorder) -> Transition:
    return r.updates()[-1]


def test_usage_off_by_a_block_fires() -> None:
    t = last_update(busy())
    assert not fires("stats-kv-usage", t)
    assert t.stats is not None
    assert fires("stats-kv-usage", with_stats(t, kv_cache_usage=t.stats.kv_cache_usage + 1 / 6))
    # vLLM's own rounding (1 - free / usable) is within the tolerance
    usable, free = t.after.kv.num_blocks - 1, len(t.after.kv.free_queue)
    assert not fires("stats-kv-usage", with_stats(t, kv_cache_usage=1.0 - free / usable))


def test_hits_beyond_queries_fire() -> None:
    t = last_update(busy())
    assert fires("stats-hits-within-queries", with_stats(t, prefix_cache_stats=PrefixCacheStats(
        requests=1, queries=8, hits=8)))  # a lookup must leave one token
    assert fires("stats-hits-within-queries", with_stats(t, prefix_cache_stats=PrefixCacheStats(
        preempted_requests=2, preempted_queries=9, preempted_hits=8)))
    assert not fires("stats-hits-within-queries", with_stats(t, prefix_cache_stats=PrefixCacheStats(
        requests=1, queries=9, hits=8)))


def test_queue_counts_off_the_view_fire() -> None:
    t = last_update(busy())
    assert t.stats is not None
    assert fires("stats-queue-counts", with_stats(t, num_running_reqs=t.stats.num_running_reqs + 1))
    assert fires("stats-queue-counts", with_stats(t, num_waiting_reqs=t.stats.num_waiting_reqs + 1))
    moved = with_stats(t, num_waiting_reqs=t.stats.num_waiting_reqs - 1,
                       num_skipped_waiting_reqs=t.stats.num_skipped_waiting_reqs + 1)
    assert (t.stats.num_waiting_reqs == 0) == bool(fires("stats-queue-counts", moved))


def test_a_preemption_not_counted_fires_with_history() -> None:
    r = busy()
    m = Monitor([BY_ID["stats-preemptions-counted"]])
    seen = 0
    for t in r.log:
        if t.kind == "update" and t.stats is not None and t.stats.num_preemptions:
            seen += 1
            # the same update reporting one preemption fewer, against the history so far
            assert fires("stats-preemptions-counted",
                         with_stats(t, num_preemptions=t.stats.num_preemptions - 1), m.history)
        assert m.observe(t) == []
    assert seen >= 2  # by schedule() and by the reset


def test_drafts_accepted_beyond_proposed_fire() -> None:
    t = next(t for t in drafting().updates() if t.stats and t.stats.spec_decoding_stats)
    assert t.stats is not None and t.stats.spec_decoding_stats is not None
    d = t.stats.spec_decoding_stats
    assert not fires("stats-drafts-within-proposed", t)
    too_many = dataclasses.replace(d, num_accepted_tokens=d.num_draft_tokens + 1,
                                   num_accepted_tokens_per_pos=(d.num_drafts, d.num_draft_tokens + 1 - d.num_drafts))
    assert fires("stats-drafts-within-proposed", with_stats(t, spec_decoding_stats=too_many))
    assert fires("stats-drafts-within-proposed", with_stats(t, spec_decoding_stats=dataclasses.replace(
        d, num_drafts=d.num_drafts + 1)))
    skewed = dataclasses.replace(d, num_accepted_tokens_per_pos=(0, d.num_accepted_tokens))
    assert d.num_accepted_tokens == 0 or fires("stats-drafts-within-proposed", with_stats(t, spec_decoding_stats=skewed))


def test_no_statistics_no_finding() -> None:
    t = dataclasses.replace(last_update(busy()), stats=None)
    for inv_id in STATS_IDS:
        assert not fires(inv_id, t)


@pytest.mark.parametrize("inv_id", STATS_IDS)
def test_each_fires_on_a_report_of_nonsense(inv_id: str) -> None:
    """One report breaking every statistic at once fires each invariant."""
    t = last_update(drafting())
    bad = SchedulerStats(num_running_reqs=7, num_waiting_reqs=-1, kv_cache_usage=2.0,
                         prefix_cache_stats=PrefixCacheStats(requests=1, queries=1, hits=1),
                         spec_decoding_stats=SpecDecodingStats(2, 5, 1, 3, (3, 0), (1, 0)), num_preemptions=3)
    assert fires(inv_id, dataclasses.replace(t, stats=bad))
