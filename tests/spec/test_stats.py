"""The spec's scheduler statistics (spec/stats.py, spec/stats_record.py):
counted where vLLM 0.33 counts them, handed over and started afresh by
make_stats, None without log_stats."""

from __future__ import annotations

from schedspec.spec import RequestSpec, SchedulerConfig, SpecScheduler, StepResult
from schedspec.spec.stats import PrefixCacheStats, SpecDecodingStats
from schedspec.spec.stats_record import StatsRecorder, kv_cache_usage

CFG = SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32)


def step(s: SpecScheduler, drafts: dict[str, tuple[int, ...]] | None = None, accept: int = 0) -> None:
    plan = s.schedule()
    sampled = {e.request_id: tuple(range(40, 41 + min(accept, len(e.spec_token_ids))))
               for e in plan.scheduled if e.samples}
    s.update(plan, StepResult(sampled, drafts or {}))


def test_without_log_stats_there_are_none() -> None:
    s = SpecScheduler(CFG)
    s.add(RequestSpec("a", (1, 2, 3), 2))
    step(s)
    assert s.make_stats() is None


def test_a_lookup_is_counted_at_admission_and_handed_over_once() -> None:
    s = SpecScheduler(CFG, log_stats=True)
    s.add(RequestSpec("a", tuple(range(1, 10)), 4))
    step(s)
    first = s.make_stats()
    assert first is not None and first.prefix_cache_stats == PrefixCacheStats(requests=1, queries=9, hits=0)
    assert first.num_running_reqs == 1 and first.num_waiting_reqs == 0
    # 3 blocks in use of 8 usable (9 tokens + the slot of the next: 3 blocks)
    assert first.kv_cache_usage == 1.0 - 5 / 8
    s.add(RequestSpec("b", tuple(range(1, 10)) + (77,), 4))
    step(s)
    second = s.make_stats()
    assert second is not None and second.prefix_cache_stats == PrefixCacheStats(requests=1, queries=10, hits=8)
    step(s)
    third = s.make_stats()
    assert third is not None and third.prefix_cache_stats == PrefixCacheStats()  # started afresh


def test_caching_off_records_no_lookup_and_a_failed_reset_no_reset() -> None:
    s = SpecScheduler(SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=32, max_model_len=32,
                                      enable_prefix_caching=False), log_stats=True)
    s.add(RequestSpec("a", tuple(range(1, 10)), 4))
    step(s)
    stats = s.make_stats()
    assert stats is not None and stats.prefix_cache_stats == PrefixCacheStats()
    assert not s.reset_prefix_cache()  # a request holds blocks: refused, so no reset reported
    step(s)
    stats = s.make_stats()
    assert stats is not None and not stats.prefix_cache_stats.reset


def test_a_resumed_request_counts_as_preempted_and_the_reset_is_reported() -> None:
    s = SpecScheduler(CFG, log_stats=True)
    s.add(RequestSpec("a", tuple(range(1, 10)), 4))
    step(s)
    s.make_stats()
    assert s.reset_prefix_cache(reset_running_requests=True)
    step(s)
    stats = s.make_stats()
    assert stats is not None and stats.num_preemptions == 1
    assert stats.prefix_cache_stats == PrefixCacheStats(reset=True, preempted_requests=1, preempted_queries=10,
                                                        preempted_hits=0)


def test_drafts_are_counted_per_update_and_per_position() -> None:
    s = SpecScheduler(SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=32, max_model_len=32,
                                      num_speculative_tokens=2), log_stats=True)
    s.add(RequestSpec("a", tuple(range(1, 6)), 10))
    step(s, drafts={"a": (7, 8)})
    stats = s.make_stats()
    assert stats is not None and stats.spec_decoding_stats is None  # a prefill verifies no draft
    step(s, drafts={"a": (7, 8)}, accept=1)
    stats = s.make_stats()
    assert stats is not None
    assert stats.spec_decoding_stats == SpecDecodingStats(2, 1, 2, 1, (1, 0), (1, 1))


def test_the_recorder_copies_are_independent_and_usage_is_vllms_arithmetic() -> None:
    r = StatsRecorder(2)
    c = r.copy()
    r.record_lookup(9, 8, preempted=False)
    r.observe_draft(2, 1)
    assert c.prefix == PrefixCacheStats() and c.drafts is None
    assert kv_cache_usage(2, 4) == 1.0 - 2 / 3 != (3 - 2) / 3  # vLLM's 1 - free / usable, to the bit
    assert kv_cache_usage(0, 1) == 0.0


def test_a_clone_keeps_its_own_statistics() -> None:
    s = SpecScheduler(CFG, log_stats=True)
    s.add(RequestSpec("a", tuple(range(1, 10)), 4))
    step(s)
    c = s.clone()
    assert s.make_stats() == c.make_stats()
    assert s.stats_record is not c.stats_record
