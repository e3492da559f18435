"""gpu_runner: chunked local attention (a KV cache group per attention kind) and
the dense, non-paged reference.

CPU only; nothing in this file needs a device.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from schedspec.spec.interface import (  # noqa: E402
    KVCacheGroup,
    ScheduledRequest,
    ScheduleKind,
    Scheduler,
    SchedulerConfig,
    StepPlan,
)

from schedspec.gpu_runner.equivalence import (  # noqa: E402
    baseline_config,
    check_reference,
    default_variants,
    inflight_variants,
    make_workloads,
    mask_control,
    run_matrix,
    run_one,
    spec_factory,
)
from schedspec.gpu_runner.executor import Executor, Fault, PlanError, model_kv_cache_groups  # noqa: E402
from schedspec.gpu_runner.loaders import random_llama  # noqa: E402
from schedspec.gpu_runner.model import (  # noqa: E402
    GroupAttention,
    LlamaWeights,
    ModelError,
    PagedLlama,
    layer_kinds,
    layer_layout,
)
from schedspec.gpu_runner.reference import reference_allowed, reference_divergences, reference_logits  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)

C = 32  # the attention chunk of the tests' models (two blocks of 16)
W = 24
MML = 64
FULL, SW, CL = GroupAttention(), GroupAttention("sliding_window", W), GroupAttention("chunked_local", C)
GROUPS = (KVCacheGroup("full_attention"), KVCacheGroup("chunked_local", attention_chunk_size=C))
MIXED = (KVCacheGroup("full_attention"), KVCacheGroup("sliding_window", sliding_window=W),
         KVCacheGroup("chunked_local", attention_chunk_size=C))


@pytest.fixture(scope="module")
def small() -> LlamaWeights:
    # three layers: F C F with --chunked-local alone (odd), F S C with both
    return random_llama(7, vocab_size=300, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, tie_embeddings=False, max_position=256)


def _cfg(groups: tuple[KVCacheGroup, ...] = GROUPS, **kw: Any) -> SchedulerConfig:
    return replace(baseline_config(MML, groups=groups), **kw)


def _entry(rid: str, computed: int, toks: list[int], known: int,
           tables: tuple[tuple[int, ...], ...]) -> ScheduledRequest:
    kind = ScheduleKind.RUNNING if computed else ScheduleKind.NEW
    return ScheduledRequest(rid, kind, computed, len(toks), known, tables[0], tuple(toks), group_block_ids=tables)


def _run(model: PagedLlama, prompt: list[int], chunks: list[int],
         tables: list[tuple[tuple[int, ...], ...]]) -> Any:
    """Every position's logits, the prompt computed in ``chunks``, step i
    through ``tables[i]`` (the same blocks, some nulled, or not)."""
    ex = Executor(model, _cfg(model_kv_cache_groups(model)))
    rows, c = [], 0
    for step, (n, tab) in enumerate(zip(chunks, tables)):
        batch = ex.build_batch(StepPlan(step + 1, (_entry("p", c, prompt[c:c + n], len(prompt), tab),), (), ()))
        batch.logit_rows = torch.arange(0, n)
        rows.append(model.forward(batch, ex.cache).clone())
        c += n
    return torch.cat(rows)


def _prompt(seed: int, n: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 300) for _ in range(n)]


# --------------------------------------------------------------------------
# The layout
# --------------------------------------------------------------------------


def test_layers_are_grouped_by_attention_kind() -> None:
    assert layer_layout(4, chunked_local=C) == ((0, 1, 0, 1), (FULL, CL))
    assert layer_layout(4, chunked_local=C, cl_layers="all") == ((0, 0, 0, 0), (CL,))
    # both: F S C by layer index mod 3, groups in the order full, sliding, chunked
    assert layer_kinds(4, W, chunked_local=C) == ("full_attention", "sliding_window", "chunked_local", "full_attention")
    assert layer_layout(4, W, chunked_local=C) == ((0, 1, 2, 0), (FULL, SW, CL))
    assert layer_layout(3, W, chunked_local=C, layer_pattern="CS") == ((1, 0, 1), (SW, CL))
    assert layer_layout(2, W) == ((0, 1), (FULL, SW))  # the sliding window alone, as before
    with pytest.raises(ModelError, match="has no chunked_local layers but chunked_local is 32"):
        layer_layout(4, W, chunked_local=C, layer_pattern="FS")
    with pytest.raises(ModelError, match="has chunked_local layers but chunked_local is 0"):
        layer_layout(4, W, layer_pattern="FSC")
    with pytest.raises(ModelError, match="letters F, S, C"):
        layer_layout(4, chunked_local=C, layer_pattern="FX")
    with pytest.raises(ModelError, match="cl_layers=odd selects no layer"):
        layer_layout(1, chunked_local=C)
    with pytest.raises(ModelError, match="chunked_local must be an integer >= 0"):
        layer_layout(2, chunked_local=-1)


def test_first_key_of_each_kind() -> None:
    assert [CL.first_key(p) for p in (0, 31, 32, 33, 63, 64)] == [0, 0, 32, 32, 32, 64]
    assert [SW.first_key(p) for p in (0, 23, 24, 40)] == [0, 0, 1, 17]
    assert FULL.first_key(50) == 0
    pos = torch.arange(130)
    for a in (FULL, SW, CL):
        assert [int(x) for x in a.first_keys(pos).clamp(min=0)] == [a.first_key(p) for p in range(130)]


def test_the_config_must_carry_the_models_groups(small: LlamaWeights) -> None:
    model = PagedLlama(small, window=MML, chunked_local=C)
    assert model.is_hybrid and model_kv_cache_groups(model) == GROUPS
    assert model.describe_layout() == "F C F (chunked local 32)"
    mixed = PagedLlama(small, window=MML, sliding_window=W, chunked_local=C)
    assert model_kv_cache_groups(mixed) == MIXED
    Executor(mixed, _cfg(MIXED))
    with pytest.raises(ValueError, match="do not match the model's layers"):
        Executor(model, _cfg(MIXED))


# --------------------------------------------------------------------------
# The forward and the reference
# --------------------------------------------------------------------------


def test_the_reference_mask_is_the_rule() -> None:
    got = reference_allowed(CL, 70, 80)
    for q in range(70):
        for k in range(80):
            assert bool(got[q, k]) == (k <= q and k // C == q // C)
    assert torch.equal(reference_allowed(SW, 40, 40)[30], torch.arange(40).lt(31) & torch.arange(40).ge(7))


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_chunked_local_layers_attend_only_their_chunk(small: LlamaWeights, mode: str) -> None:
    prompt = _prompt(3)
    tables = [((1, 2, 3, 4), (5, 6, 7, 8))]
    hybrid = _run(PagedLlama(small, mode=mode, window=MML, chunked_local=C), prompt, [60], tables)  # type: ignore[arg-type]
    full = _run(PagedLlama(small, mode=mode, window=MML), prompt, [60], [((1, 2, 3, 4),)])  # type: ignore[arg-type]
    # the first chunk is the same as full attention, every later position differs
    assert torch.equal(hybrid[:C], full[:C]) or mode == "fast" and (hybrid[:C] - full[:C]).abs().max() < 1e-5
    assert all((hybrid[p] - full[p]).abs().max() > 1e-4 for p in range(C, 60))
    ref = reference_logits(PagedLlama(small, mode=mode, window=MML, chunked_local=C), prompt)  # type: ignore[arg-type]
    if mode == "exact":
        assert torch.equal(hybrid, ref)
    else:
        assert (hybrid - ref).abs().max() < 1e-4


def test_exact_logits_are_bitwise_the_references_however_chunked_and_nulled(small: LlamaWeights) -> None:
    """F S C: chunks of the prompt, other blocks, and tables that null what
    lies wholly before the current chunk (and window) give the reference's
    bits at every position."""
    model = PagedLlama(small, mode="exact", window=MML, sliding_window=W, chunked_local=C)
    prompt = _prompt(9)
    ref = reference_logits(model, prompt)
    kept = ((1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12))
    other = ((13, 2, 30, 4), (12, 6, 27, 8), (20, 21, 22, 23))
    assert torch.equal(_run(model, prompt, [60], [kept]), ref)
    for chunks in ([7, 33, 1, 19], [16, 16, 16, 12], [30, 5, 25]):
        for tabs in (kept, other):
            assert torch.equal(_run(model, prompt, chunks, [tabs] * len(chunks)), ref), chunks
    # from position 32 on the chunked table may null blocks 0 and 1 (positions 0..31),
    # the window's table block 0 once the step starts at 40 (reads 17 on)
    freed = ((1, 2, 3, 4), (0, 6, 7, 8), (0, 0, 11, 12))
    assert torch.equal(_run(model, prompt, [32, 8, 20], [kept, kept[:2] + (freed[2],), freed]), ref)


def test_a_null_block_inside_the_current_chunk_is_a_plan_error(small: LlamaWeights) -> None:
    model = PagedLlama(small, mode="exact", window=MML, chunked_local=C)
    ex = Executor(model, _cfg())
    toks = [5, 6]
    # position 40's chunk is 32..63: block 2 (32..47) is inside it, blocks 0 and 1 before it
    ex.build_batch(StepPlan(7, (_entry("r9", 40, toks, 42, ((1, 2, 3), (0, 0, 7))),), (), ()))
    with pytest.raises(PlanError) as info:
        ex.build_batch(StepPlan(7, (_entry("r9", 40, toks, 42, ((1, 2, 3), (0, 0, 0))),), (), ()))
    msg = str(info.value)
    assert "step 7" in msg and "'r9'" in msg and "group_block_ids[1]" in msg and "chunked local 32" in msg
    assert "position 32 lies inside the current chunk (from 32)" in msg
    # position 31 is still in the first chunk: block 0 is read
    with pytest.raises(PlanError, match="position 0 lies inside the current chunk"):
        ex.build_batch(StepPlan(7, (_entry("r9", 31, toks, 42, ((1, 2, 3), (0, 6, 7))),), (), ()))
    assert ex.cl_null_entries == 1 and ex.null_block_entries == 0


def test_the_chunk_null_fault_nulls_the_current_chunk_past_the_first(small: LlamaWeights) -> None:
    model = PagedLlama(small, mode="exact", window=MML, chunked_local=C)
    fault = Fault("chunk_null", request_id="r9")
    ex = Executor(model, _cfg(), fault=fault)
    toks = [5, 6]
    ex.build_batch(StepPlan(1, (_entry("r9", 20, toks, 42, ((1, 2), (5, 6))),), (), ()))  # first chunk: not yet
    assert not fault.fired
    with pytest.raises(PlanError, match="position 32 lies inside the current chunk"):
        ex.build_batch(StepPlan(2, (_entry("r9", 40, toks, 42, ((1, 2, 3), (0, 6, 7))),), (), ()))
    assert fault.fired and "group 1's block 2" in fault.fired[0]


def test_the_reference_sees_a_chunk_mask_off_by_one(small: LlamaWeights) -> None:
    model = PagedLlama(small, mode="exact", window=MML, chunked_local=C)
    prompt = _prompt(5)
    ref = reference_logits(model, prompt)
    bad = _run(model.with_chunk_start_shift(-1), prompt, [60], [((1, 2, 3, 4), (5, 6, 7, 8))])
    assert torch.equal(bad[:C], ref[:C])  # the first chunk has nothing before it
    assert not any(torch.equal(bad[p], ref[p]) for p in range(C, 60))
    # and reference_divergences says so for a run's tokens and rows
    outs = [int(torch.argmax(bad[p])) for p in range(39, 59)]
    rows = {("p", k): bad[39 + k] for k in range(20)}
    found, *_ = reference_divergences(model, {"p": prompt[:40]}, {"p": outs}, rows)
    assert found and found[0][0] == "p" and found[0][1] in ("tokens", "logits")
    good = [int(torch.argmax(ref[p])) for p in range(39, 59)]
    found, toks, nrows, bitwise, _ = reference_divergences(
        model, {"p": prompt[:40]}, {"p": good}, {("p", k): ref[39 + k] for k in range(20)})
    assert not found or found[0][1] == "tokens"  # a greedy run may leave the prompt's path: tokens decide
    assert nrows == bitwise


# --------------------------------------------------------------------------
# The matrix
# --------------------------------------------------------------------------


def test_chunked_local_matrix_equals_the_baseline_and_the_reference(small: LlamaWeights) -> None:
    model = PagedLlama(small, mode="exact", window=MML, sliding_window=W, chunked_local=C)
    groups = model_kv_cache_groups(model)
    workloads = make_workloads(2, seed=0, vocab_size=300, max_model_len=MML)
    variants = default_variants(MML, groups=groups)[4:] + inflight_variants(MML, groups=groups)[3:]
    report = run_matrix(spec_factory, model, workloads, variants, baseline=baseline_config(MML, groups=groups),
                        reference=True)
    assert report.ok, report.table()
    for v in variants:
        assert v.config.kv_cache_groups == MIXED and {"sw_freed", "cl_freed"} <= v.expects
        assert ("hybrid_hit" in v.expects) == ("cache_hit" in v.expects)
    assert all(c.logits_compared == c.logits_bitwise > 0 for c in report.comparisons)
    assert len(report.reference) == 2 and all(r.ok and r.logits_bitwise == r.logits_compared > 0
                                              for r in report.reference)
    assert sum(c.inflight["cl_freed"] for c in report.comparisons) > 0
    faults = {n.fault: n for n in report.negative}
    assert set(faults) == {"block_table", "position", "chunk_null", "chunk_mask"}
    assert all(n.caught for n in report.negative)
    assert "executor refused" in faults["chunk_null"].first and "current chunk" in faults["chunk_null"].first
    table = report.table()
    assert "a chunked-local table (" in table and "equal the dense, non-paged reference" in table
    assert report.to_json()["reference"][0]["ok"]


class _FreesTheChunk:
    """A scheduler that nulls the first block of every chunked-local table
    (frees the current chunk): its plans no runner could execute."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.inner: Scheduler = spec_factory(config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def schedule(self) -> StepPlan:
        plan = self.inner.schedule()
        entries = tuple(replace(e, group_block_ids=(e.group_block_ids[0], (0,) + tuple(e.group_block_ids[1][1:])))
                        for e in plan.scheduled)
        return replace(plan, scheduled=entries)


def test_an_unexecutable_plan_is_a_divergence_and_the_matrix_goes_on(small: LlamaWeights) -> None:
    model = PagedLlama(small, mode="exact", window=MML, chunked_local=C)
    workloads = make_workloads(1, seed=0, vocab_size=300, max_model_len=MML)
    report = run_matrix(_FreesTheChunk, model, workloads, default_variants(MML, groups=GROUPS)[:1],
                        baseline=baseline_config(MML, groups=GROUPS), negative=False)
    assert not report.ok
    assert [c.variant for c in report.divergent] == ["baseline"]
    assert report.divergent[0].divergences[0].kind == "plan"
    assert "DIVERGED w0/baseline" in report.table() and "current chunk" in report.table()


def test_the_mask_control_needs_chunked_layers(small: LlamaWeights) -> None:
    model = PagedLlama(small, mode="exact", window=MML, sliding_window=W)
    workload = make_workloads(1, seed=1, vocab_size=300, max_model_len=MML)[0]
    with pytest.raises(ValueError, match="chunked-local layers"):
        mask_control(spec_factory, model, workload, baseline_config(MML, groups=model_kv_cache_groups(model)))
    # check_reference holds for the sliding window too
    base = run_one(spec_factory, model, baseline_config(MML, groups=model_kv_cache_groups(model)), workload)
    ref = check_reference(model, base, workload)
    assert ref.ok and ref.logits_compared == ref.logits_bitwise > 0


def test_cli_runs_a_chunked_local_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main as schedspec_main

    def main(argv: list[str]) -> int:
        return schedspec_main(["equivalence", *argv])

    assert main(["--chunked-local", "-1"]) == 2
    assert main(["--layer-pattern", "FC"]) == 2
    assert main(["--chunked-local", "32", "--layer-pattern", "FX", "--model", "random:layers=2", "--device", "cpu",
                 "--workloads", "1"]) == 2
    rc = main(["--model", "random:seed=1,vocab=256,hidden=64,layers=2", "--workloads", "1", "--device", "cpu",
               "--max-model-len", "64", "--chunked-local", "32", "--no-connector", "--quiet",
               "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "layers F C (chunked local 32)" in out and "negative control chunk_mask" in out
    assert "negative control chunk_null" in out and "equal the dense, non-paged reference" in out
    assert rc in (0, 1)  # one workload may leave a guard unmet; the run itself worked
    assert "DIVERGED" not in out and "MISSED" not in out
