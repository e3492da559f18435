"""The equivalence variants of k plans in flight (pipeline parallelism): the
baseline's workloads run with ``pipeline_parallel_size`` 2 to 4 (k plans in
flight, the driver's Step updating the oldest once k are: vllm/v1/engine/core.py,
EngineCore.step_with_batch_queue), with chunked prefill and a small token
budget so a prefill's chunks go out while the previous one is in flight, and
one with a tiny pool (preemption with steps in flight). Each must give the
baseline's tokens and logits."""

from __future__ import annotations

from dataclasses import replace

from schedspec.gpu_runner.equivalence import Variant, baseline_config, least_pool


def pipeline_variants(max_model_len: int, block_size: int = 16, max_num_seqs: int = 8) -> tuple[Variant, ...]:
    """``pipeline-2`` .. ``pipeline-4`` (chunked), and ``pipeline-3-tiny`` (preempting)."""
    base = baseline_config(max_model_len, block_size, max_num_seqs)
    chunked = replace(base, enable_chunked_prefill=True, max_num_batched_tokens=max(max_num_seqs, 2 * block_size),
                      long_prefill_token_threshold=min(block_size, max_model_len))
    out = [Variant(f"pipeline-{k}", replace(chunked, pipeline_parallel_size=k), frozenset({"chunked"}))
           for k in (2, 3, 4)]
    three = replace(chunked, pipeline_parallel_size=3)
    out.append(Variant("pipeline-3-tiny", replace(three, num_blocks=least_pool(three)),
                       frozenset({"chunked", "preempted"})))
    return tuple(out)
