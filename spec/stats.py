"""The scheduler statistics: what vLLM 0.33's scheduler reports each step for
dashboards and autoscalers, the fields that depend on scheduling. The types
every scheduler reports (``make_stats()``, an optional method of the
Scheduler protocol); the spec's record of them is spec/stats_record.py.

vLLM builds a SchedulerStats (vllm/v1/metrics/stats.py) in
Scheduler.make_stats (vllm/v1/core/sched/scheduler.py), which
update_from_output calls once at its end when the scheduler was built with
``log_stats=True``; the engine hands it to the stat loggers. What it holds,
and where each field is counted:

- ``num_running_reqs``, ``num_waiting_reqs``, ``num_skipped_waiting_reqs``:
  make_stats reads get_request_counts (running; waiting plus
  kv_holding_waiting) and ``deferred_waiting`` (the waiting requests passed
  over, reported apart: num_waiting_reqs leaves them out).
- ``kv_cache_usage``: KVCacheManager.usage -> BlockPool.get_usage,
  ``1.0 - free / (num_gpu_blocks - 1)`` (the null block left out; 0 for a
  pool of the null block alone), free counting the cached blocks no request
  holds (spec/stats_record.py, ``kv_cache_usage``, is that very expression).
- ``prefix_cache_stats``: KVCacheManager.record_prefix_cache_stats, called in
  schedule()'s WAITING loop for a request that looked the prefix cache up
  (nothing computed before) once its blocks are allocated ("Record at
  admission so unscheduled lookups are not counted"), with caching on:
  ``num_tokens`` queried, the local hit's tokens (PrefixCacheStats.record;
  a request preempted before is counted in the ``preempted_*`` fields
  instead). ``reset`` is set by a successful reset_prefix_cache.
  make_prefix_cache_stats hands the record over and starts a fresh one.
- ``spec_decoding_stats``: update_from_output, for each entry that verified
  drafts and sampled (the output of a request gone, of a failed KV load or
  dropped as stale is skipped before): make_spec_decoding_stats ->
  SpecDecodingStats.observe_draft (vllm/v1/spec_decode/metrics.py) with the
  drafts scheduled less those its grammar invalidated, and the accepted
  ones (sampled less the bonus token). None in a step with none.
- ``num_preemptions``: not a SchedulerStats field. vLLM counts a preemption
  as a PREEMPTED event (_preempt_request, ``request.record_event`` with
  log_stats on), which the front end sums into
  IterationStats.num_preempted_reqs (vllm/v1/metrics/stats.py,
  update_from_events) when the request's next output carries it. Here it is
  the preemptions (by schedule() and by reset_prefix_cache) since the last
  statistics, so its sum over a run is vLLM's.

Left out, as they do not depend on scheduling or on a feature the spec
models: step_counter and current_wave (data parallelism),
num_kv_fetch_reqs_by_stage (the connector's fetch stages, all 0 here),
iteration_details, kv_cache_eviction_events, cudagraph_stats and perf_stats
(timing), kv_connector_stats and ec_connector_stats (the worker's),
connector_prefix_cache_stats (the connector's own hit record), and
waiting_lora_adapters / running_lora_adapters, which make_stats in 0.33
leaves empty (the front end counts adapters from the request events).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """vLLM's PrefixCacheStats (vllm/v1/metrics/stats.py) less
    ``hits_by_source`` (the connector's tiers): the lookups recorded since
    the last statistics."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass(frozen=True)
class SpecDecodingStats:
    """vLLM's SpecDecodingStats (vllm/v1/spec_decode/metrics.py): the drafts
    verified by one update, per position too (``num_spec_tokens`` long)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_draft_tokens_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerStats:
    """One step's statistics (module docstring): vLLM's SchedulerStats
    fields that depend on scheduling, and the step's preemptions."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = PrefixCacheStats()
    spec_decoding_stats: SpecDecodingStats | None = None
    num_preemptions: int = 0
