"""gpu_runner's CUDA-run tooling, on the CPU: the SmolLM2-shaped random model,
the determinism settings and facts, the report's timings and baseline tokens,
--repeat, cross-device comparison with localisation, the largest-batch probe,
the summary script and the CLI. The CUDA variants skip without a device."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from schedspec.gpu_runner.crossdevice import cross_device  # noqa: E402
from schedspec.gpu_runner.equivalence import (  # noqa: E402
    MatrixReport,
    baseline_config,
    default_variants,
    make_workloads,
    merge_repeats,
    run_equivalence,
    run_matrix,
    spec_factory,
)
from schedspec.gpu_runner.executor import Executor  # noqa: E402
from schedspec.gpu_runner.loaders import LIKE_SHAPES, load_model, random_llama  # noqa: E402
from schedspec.gpu_runner.maxbatch import probe_max_batch  # noqa: E402
from schedspec.gpu_runner.model import (  # noqa: E402
    LlamaWeights,
    ModelError,
    PagedLlama,
    determinism_facts,
    set_cuda_determinism,
)
from schedspec.spec.interface import ScheduledRequest, ScheduleKind, SchedulerConfig, StepPlan  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
TINY = "random:seed=1,vocab=256,hidden=64,layers=1"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def small() -> LlamaWeights:
    return random_llama(3, vocab_size=300, hidden_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
                        intermediate_size=200, max_position=256)


def _perturbed(w: LlamaWeights, layer: int, delta: float) -> LlamaWeights:
    layers = [dataclasses.replace(lw) for lw in w.layers]
    g = torch.Generator().manual_seed(0)
    layers[layer].wo = layers[layer].wo + delta * torch.randn(layers[layer].wo.shape, generator=g)
    return dataclasses.replace(w, layers=layers)


def _prompt_batch(model: PagedLlama, n: int = 40, seed: int = 0) -> tuple[Executor, StepPlan]:
    cfg = SchedulerConfig(block_size=16, num_blocks=65, max_num_batched_tokens=1024, max_model_len=model.window)
    rng = random.Random(seed)
    toks = tuple(rng.randrange(4, model.config.vocab_size) for _ in range(n))
    e = ScheduledRequest("p", ScheduleKind.NEW, 0, n, n, (1, 2, 3, 4), toks)
    return Executor(model, cfg), StepPlan(1, (e,), (), ())


# --------------------------------------------------------------------------
# random:like=smollm2
# --------------------------------------------------------------------------


def test_random_like_smollm2_has_its_shape_and_distinct_greedy_tokens() -> None:
    w = load_model("random:like=smollm2,seed=4")
    c = w.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.max_position, c.rope_theta, c.rope_style) == (1536, 49152, 8192, 1e5, "half")
    assert c.tie_embeddings and w.lm_head is w.embed
    assert 134_000_000 < c.num_params < 136_000_000  # SmolLM2-135M
    assert all(torch.equal(lw.attn_norm, torch.ones(576)) for lw in w.layers)
    assert abs(float(w.layers[0].wqkv.std()) - 0.02) < 1e-3
    model = PagedLlama(w, mode="exact", window=64)
    ex, plan = _prompt_batch(model, 32)
    batch = ex.build_batch(plan)
    batch.logit_rows = torch.arange(32)
    logits = model.forward(batch, ex.cache)
    top = logits.topk(2, dim=-1).values
    margin = top[:, 0] - top[:, 1]
    assert float(margin.min()) > 1e-5  # no greedy tie within float noise
    assert len(set(logits.argmax(-1).tolist())) > 1
    assert torch.equal(load_model("random:like=smollm2,seed=4").embed, w.embed)


def test_random_like_unknown_names_the_known_shapes() -> None:
    with pytest.raises(ModelError, match="known: smollm2"):
        load_model("random:like=gpt5")
    with pytest.raises(ModelError, match="takes only seed"):
        load_model("random:like=smollm2,layers=2")
    assert "smollm2" in LIKE_SHAPES


# --------------------------------------------------------------------------
# Determinism settings
# --------------------------------------------------------------------------


def test_determinism_facts_and_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    facts = determinism_facts("cpu")
    assert facts["torch"] == torch.__version__ and facts["device_name"] == "cpu"
    assert facts["deterministic_algorithms"] is False
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    set_cuda_determinism(False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.deterministic
    assert not torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    set_cuda_determinism(False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # setdefault keeps the user's


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_deterministic_algorithms_allow_every_op_the_runner_uses(small: LlamaWeights, device: str) -> None:
    """index_copy_, index_select, masked_fill_, SDPA, argmax: none raises
    under torch.use_deterministic_algorithms(True), in either mode."""
    torch.use_deterministic_algorithms(True)
    try:
        w = small.to(device)
        wls = make_workloads(1, seed=1, vocab_size=300, max_model_len=64)
        for mode in ("exact", "fast"):
            rep = run_matrix(spec_factory, PagedLlama(w, mode=mode, window=64), wls, default_variants(64)[:2],
                             baseline=baseline_config(64), negative=False)
            assert not rep.divergent
            assert rep.environment["deterministic_algorithms"] is True
    finally:
        torch.use_deterministic_algorithms(False)


# --------------------------------------------------------------------------
# Report: baseline tokens, timings, rates, repeats
# --------------------------------------------------------------------------


def test_report_has_baseline_outputs_timings_and_rates(small: LlamaWeights) -> None:
    wls = make_workloads(2, seed=3, vocab_size=300, max_model_len=64)
    rep = run_matrix(spec_factory, PagedLlama(small, window=64), wls, default_variants(64)[:2],
                     baseline=baseline_config(64), negative=False)
    assert set(rep.baseline_outputs) == {"w3", "w4"}
    assert all(isinstance(t, int) for outs in rep.baseline_outputs["w3"].values() for toks in [outs] for t in toks)
    js = json.loads(rep.dumps())
    assert js["baseline_outputs"] == rep.baseline_outputs
    assert js["environment"]["torch"] == torch.__version__
    for c in js["comparisons"]:
        assert c["tokens_generated"] > 0 and c["seconds"] > 0 and c["forward_seconds"] > 0
    base = js["baselines"]["w3"]
    assert base["tokens_generated"] == sum(len(t) for t in rep.baseline_outputs["w3"].values()) and base["seconds"] > 0
    assert js["rates"]["baseline"]["steps_per_s"] > 0 and js["rates"]["chunked-budget"]["tok_per_s"] > 0
    table = rep.table()
    assert "steps/s" in table and "tok/s" in table and "environment: torch" in table
    assert "max|dl|" in table and "EQUIVALENT" in table  # the existing columns and lines stay


def test_repeat_runs_the_matrix_again_and_a_differing_repeat_fails() -> None:
    rep = run_equivalence(model=TINY, device="cpu", mode="exact", workloads=1, max_model_len=64, negative=False, repeat=2)
    assert rep.repeats == 2 and not rep.repeat_failures
    assert all(len(v) == 2 for v in rep.repeat_rates.values())
    assert "2 repeats; rates are medians" in rep.table()
    assert json.loads(rep.dumps())["rates"]["baseline"]["per_repeat"]
    again = run_equivalence(model=TINY, device="cpu", mode="exact", workloads=1, max_model_len=64, negative=False)
    other = run_equivalence(model=TINY, device="cpu", mode="exact", workloads=1, max_model_len=64, negative=False)
    other.comparisons[0].digest = "tampered"
    merged = merge_repeats([again, other])
    assert not merged.ok and "differs from repeat 1" in merged.repeat_failures[0]
    assert "REPEAT repeat 2" in merged.table()


# --------------------------------------------------------------------------
# Cross-device
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_the_capture_hook_off_or_on_changes_no_bits(small: LlamaWeights, mode: str) -> None:
    model = PagedLlama(small, mode=mode, window=64)  # type: ignore[arg-type]
    seen: list[str] = []
    outs = []
    for hook in (None, lambda name, t: seen.append(name)):
        ex, plan = _prompt_batch(model, 37)
        batch = ex.build_batch(plan)
        batch.logit_rows = torch.arange(37)
        outs.append((model.forward(batch, ex.cache, capture=hook), ex.cache.k.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert seen[0] == "embed" and seen[1:5] == ["layer0.attn", "layer0.attn_residual", "layer0.mlp", "layer0.residual"]
    assert seen[-2:] == ["final_norm", "logits"] and len(seen) == 1 + 4 * 2 + 2


def test_cross_device_identical_models_are_equal(small: LlamaWeights) -> None:
    wls = make_workloads(2, seed=0, vocab_size=300, max_model_len=64)
    rep = cross_device(spec_factory, PagedLlama(small, window=64), PagedLlama(small, window=64), wls,
                       baseline=baseline_config(64))
    assert rep.ok and all(w.rows_bitwise == w.rows_compared > 0 for w in rep.workloads)
    assert "TOKENS EQUAL" in rep.table() and json.loads(rep.dumps())["ok"]


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_cross_device_localises_a_perturbed_weight_at_its_layer(small: LlamaWeights, mode: str) -> None:
    wls = make_workloads(3, seed=0, vocab_size=300, max_model_len=64)
    a = PagedLlama(small, mode=mode, window=64)  # type: ignore[arg-type]
    # a tiny change moves logits but no token: reported, not a failure
    soft = cross_device(spec_factory, a, PagedLlama(_perturbed(small, 1, 1e-3), mode=mode, window=64),  # type: ignore[arg-type]
                        wls, baseline=baseline_config(64))
    assert soft.ok and sum(w.rows_bitwise for w in soft.workloads) < sum(w.rows_compared for w in soft.workloads)
    assert max(w.max_abs_diff for w in soft.workloads) > 0
    ld = soft.workloads[0].logit_difference
    assert ld is not None and ld.token_a == ld.token_b and ld.first_capture is not None
    assert ld.first_capture.name == "layer1.attn" and "first logits row not bitwise equal" in soft.table()
    rep = cross_device(spec_factory, a, PagedLlama(_perturbed(small, 1, 0.3), mode=mode, window=64),  # type: ignore[arg-type]
                       wls, baseline=baseline_config(64))
    assert not rep.ok
    bad = next(w for w in rep.workloads if not w.equal)
    d = bad.difference
    assert d is not None and d.token_a != d.token_b and len(d.top2_a) == 2 and d.margin_a >= 0
    first = d.first_capture
    assert first is not None and first.name == "layer1.attn", d.captures[:8]
    before = [c for c in d.captures if c.name in ("embed", "layer0.attn", "layer0.mlp", "layer0.residual")]
    assert len(before) == 4 and all(c.max_abs_diff == 0 for c in before)
    text = rep.table()
    assert "first difference at layer1.attn" in text and "TOKENS DIFFER" in text


@CUDA
def test_cross_device_cuda_against_cpu(small: LlamaWeights) -> None:
    from schedspec.gpu_runner.executor import pick_device

    pick_device("cuda")
    wls = make_workloads(2, seed=0, vocab_size=300, max_model_len=64)
    rep = cross_device(spec_factory, PagedLlama(small.to("cuda"), window=64), PagedLlama(small, window=64), wls,
                       baseline=baseline_config(64))
    assert rep.environment[0]["device_name"] != "cpu" and rep.environment[0]["CUBLAS_WORKSPACE_CONFIG"]
    print(rep.table())  # equal or explained: both are results, not failures of the tool
    assert all(w.equal or (w.difference is not None and w.difference.captures) for w in rep.workloads)


# --------------------------------------------------------------------------
# Largest batch
# --------------------------------------------------------------------------


def test_max_batch_probe_doubles_until_the_cap(small: LlamaWeights) -> None:
    rep = probe_max_batch(PagedLlama(small, mode="fast", window=64), prompt_len=64, max_batch_tokens=512, repeats=1)
    assert [r.requests for r in rep.rows] == [1, 2, 4, 8]
    assert rep.largest is not None and rep.largest.tokens == 512 and "over the cap" in rep.stopped
    assert all(r.ms > 0 and r.tokens_per_s > 0 for r in rep.rows)
    assert "largest batch handled: 8 x 64 = 512" in rep.table() and json.loads(rep.dumps())["largest_tokens"] == 512


def test_max_batch_probe_stops_at_out_of_memory(small: LlamaWeights, monkeypatch: pytest.MonkeyPatch) -> None:
    model = PagedLlama(small, mode="exact", window=32)
    real = model.forward

    def forward(batch, cache, capture=None):  # type: ignore[no-untyped-def]
        if batch.num_tokens > 64:
            raise MemoryError("simulated")
        return real(batch, cache, capture)

    monkeypatch.setattr(model, "forward", forward)
    rep = probe_max_batch(model, prompt_len=32, max_batch_tokens=10_000, repeats=1)
    assert [r.ok for r in rep.rows] == [True, True, False] and "out of memory" in rep.stopped
    assert rep.largest is not None and rep.largest.tokens == 64
    with pytest.raises(ValueError):
        probe_max_batch(model, prompt_len=65)


@CUDA
def test_max_batch_probe_on_cuda_reports_peak_memory(small: LlamaWeights) -> None:
    rep = probe_max_batch(PagedLlama(small.to("cuda"), mode="fast", window=64), prompt_len=64, max_batch_tokens=256)
    assert rep.largest is not None and rep.largest.peak_mb > 0


# --------------------------------------------------------------------------
# CLI and the summary script
# --------------------------------------------------------------------------


def _cli(argv: list[str]) -> int:
    from schedspec.cli.main import main

    return main(["equivalence", *argv])


def test_cli_cross_device_max_batch_and_repeat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", TINY, "--device", "cpu", "--max-model-len", "64", "--quiet"]
    assert _cli([*common, "--cross-device", "cpu", "--workloads", "1", "--json", str(tmp_path / "x.json")]) == 0
    assert "TOKENS EQUAL" in capsys.readouterr().out
    assert json.loads((tmp_path / "x.json").read_text())["kind"] == "cross-device"
    assert _cli([*common, "--max-batch", "--prompt-len", "32", "--max-batch-tokens", "64", "--mode", "fast"]) == 0
    assert "largest batch handled: 2 x 32" in capsys.readouterr().out
    assert _cli([*common, "--workloads", "1", "--repeat", "2", "--no-negative", "--json", str(tmp_path / "r.json")]) in (0, 1)
    assert json.loads((tmp_path / "r.json").read_text())["repeats"] == 2
    assert _cli([*common, "--repeat", "0"]) == 2
    assert _cli([*common, "--cross-device", "tpu"]) == 2
    assert _cli([*common, "--cross-device", "cpu", "--max-batch"]) == 2
    assert _cli(["--model", "random:like=nope", "--device", "cpu", "--cross-device", "cpu", "--quiet"]) == 2
    assert _cli([*common, "--max-batch", "--prompt-len", "0"]) == 2


def test_summary_merges_parts_and_compares_devices(tmp_path: Path) -> None:
    paths = []
    for seed in (0, 1):
        rep = run_equivalence(model=TINY, device="cpu", workloads=1, seed=seed, max_model_len=64, negative=False)
        p = tmp_path / f"cpu-{seed}.json"
        p.write_text(rep.dumps())
        paths.append(p)
    # the same matrix as if run on CUDA: one token changed in w1's baseline
    cuda = json.loads(paths[0].read_text())
    part2 = json.loads(paths[1].read_text())
    cuda["device"] = "cuda:0"
    cuda["comparisons"] += part2["comparisons"]
    cuda["baseline_outputs"].update(part2["baseline_outputs"])
    req = sorted(cuda["baseline_outputs"]["w1"])[0]
    cuda["baseline_outputs"]["w1"][req][0] += 1
    (tmp_path / "cuda.json").write_text(json.dumps(cuda))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "equivalence_summary.py"), *map(str, paths),
                          str(tmp_path / "cuda.json"), "--out", str(tmp_path / "s.md")],
                         capture_output=True, text=True, check=True).stdout
    assert f"### {TINY}, exact mode: 2 workloads on the CPU, 2 on CUDA" in out
    assert "| variant | CPU steps/s | CUDA steps/s | ratio |" in out and "| chunked-budget |" in out
    assert "equal workloads 1/2; first difference w1/" in out
    assert (tmp_path / "s.md").read_text() == out


def test_module_runs_from_the_checkout_without_the_editable_install(tmp_path: Path) -> None:
    """As on the GPU machine: ``python3 -m schedspec`` from the repository
    root with PYTHONPATH=<site dir>:. and no .pth processing (-S)."""
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{site}:.", "HOME": str(tmp_path)}
    code = ("import sys, schedspec.gpu_runner.equivalence as e; assert 'site-packages' not in e.__file__, e.__file__; "
            "from schedspec.cli.main import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-S", "-c", code, "equivalence", "--model", TINY, "--device", "cpu",
                          "--cross-device", "cpu", "--workloads", "1", "--max-model-len", "64", "--quiet"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "TOKENS EQUAL" in run.stdout
    help_run = subprocess.run([sys.executable, "-S", "-m", "schedspec", "equivalence", "--help"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert help_run.returncode == 0 and "--cross-device" in help_run.stdout, help_run.stderr[-2000:]
