"""k plans in flight give the baseline's tokens: the pipeline variants
(gpu_runner/pipeline.py) through the torch runner (CPU here, CUDA where there is one)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from schedspec.gpu_runner.equivalence import baseline_config, make_workloads, run_matrix, spec_factory  # noqa: E402
from schedspec.gpu_runner.loaders import random_llama  # noqa: E402
from schedspec.gpu_runner.model import PagedLlama  # noqa: E402
from schedspec.gpu_runner.pipeline import pipeline_variants  # noqa: E402
from schedspec.impl.scheduler import ImplScheduler  # noqa: E402


@pytest.mark.parametrize("scheduler", ["spec", "impl"])
def test_k_plans_in_flight_give_every_baseline_token_bitwise(scheduler: str) -> None:
    weights = random_llama(3, vocab_size=300, hidden_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
                           intermediate_size=200, tie_embeddings=False, max_position=256)
    model = PagedLlama(weights, mode="exact", window=64)
    workloads = make_workloads(1, seed=5, vocab_size=weights.config.vocab_size, max_model_len=64)
    variants = pipeline_variants(64)
    assert [v.config.max_concurrent_batches for v in variants] == [2, 3, 4, 3, 3]
    factory = spec_factory if scheduler == "spec" else ImplScheduler
    report = run_matrix(factory, model, workloads, variants, baseline=baseline_config(64), negative=False)
    assert report.ok, report.table()
    for c in report.comparisons:
        assert c.tokens_compared > 0 and c.logits_compared == c.logits_bitwise > 0
