"""The equivalence variants of k plans in flight (pipeline parallelism): the
baseline's workloads run with ``pipeline_parallel_size`` 2 to 4 (k plans in
flight, the driver's Step updating the oldest once k are: vllm/v1/engine/core.py,
EngineCore.step_with_batch_queue), with chunked prefill and a small token
budget so a prefill's chunks go out while the previous one is in flight, and
one with a tiny pool (preemption with steps in flight), and Model Runner V2
with async scheduling (k = pp + 1 plans in flight and the decode throttle:
vllm/config/vllm.py, VllmConfig.max_concurrent_batches; vllm/v1/core/sched/
scheduler.py, Scheduler.schedule). Each must give the baseline's tokens and
logits."""

from __future__ import annotations

from dataclasses import replace

from schedspec.gpu_runner.equivalence import Variant, baseline_config, least_pool
from schedspec.spec.interface import KVCacheGroup


def pipeline_variants(max_model_len: int, block_size: int = 16, max_num_seqs: int = 8,
                      groups: tuple[KVCacheGroup, ...] = ()) -> tuple[Variant, ...]:
    """``pipeline-2`` .. ``pipeline-4`` (chunked), ``pipeline-3-tiny``
    (preempting) and ``pipeline-2-async-v2`` (three plans in flight, the
    decode throttle)."""
    base = baseline_config(max_model_len, block_size, max_num_seqs, groups)
    chunked = replace(base, enable_chunked_prefill=True, max_num_batched_tokens=max(max_num_seqs, 2 * block_size),
                      long_prefill_token_threshold=min(block_size, max_model_len))
    out = [Variant(f"pipeline-{k}", replace(chunked, pipeline_parallel_size=k), frozenset({"chunked"}))
           for k in (2, 3, 4)]
    three = replace(chunked, pipeline_parallel_size=3)
    out.append(Variant("pipeline-3-tiny", replace(three, num_blocks=least_pool(three)),
                       frozenset({"chunked", "preempted"})))
    out.append(Variant("pipeline-2-async-v2", replace(chunked, pipeline_parallel_size=2, async_scheduling=True,
                                                      model_runner="v2"), frozenset({"chunked", "in_flight"})))
    return tuple(out)
