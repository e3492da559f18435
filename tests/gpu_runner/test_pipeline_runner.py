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


def test_cli_pipeline_adds_the_k_in_flight_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """``equivalence --pipeline`` runs the k-plans-in-flight variants in the
    matrix, V2 with async among them (three plans in flight: the executor
    must keep a throttled request's sampled tokens over two plans)."""
    from schedspec.cli.main import main as schedspec_main

    common = ["equivalence", "--model", "random:seed=1,vocab=256,hidden=64,layers=1", "--workloads", "2",
              "--device", "cpu", "--max-model-len", "64", "--quiet", "--no-connector", "--no-negative"]
    schedspec_main([*common, "--pipeline"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("pipeline-")}
    assert set(rows) >= {"pipeline-2", "pipeline-3", "pipeline-4", "pipeline-3-tiny", "pipeline-2-async-v2"}, out
    for name, cells in rows.items():
        if len(cells) > 2 and "/" in cells[1]:
            passed, total = cells[1].split("/")
            assert passed == total and int(total) > 0, (name, out)
    assert "DIVERGED" not in out, out
    schedspec_main(common)
    assert "pipeline-2" not in capsys.readouterr().out
