"""gpu_runner: the Mamba state layer (``MambaState``, letter M): its state
read from and written to the group's state blocks the plan names, the dense
reference, the matrix's Mamba layouts and the wrong-checkpoint control.

CPU only; nothing in this file needs a device.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from schedspec.spec.errors import ConfigError  # noqa: E402
from schedspec.spec.interface import (  # noqa: E402
    KVCacheGroup,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    StepPlan,
)

from schedspec.gpu_runner.attention_kinds import MAMBA_STATE  # noqa: E402
from schedspec.gpu_runner.equivalence import (  # noqa: E402
    baseline_config,
    check_reference,
    connector_variants,
    default_variants,
    inflight_variants,
    make_workloads,
    negative_control,
    run_matrix,
    run_one,
    spec_factory,
)
from schedspec.gpu_runner.executor import Executor, PlanError, model_kv_cache_groups  # noqa: E402
from schedspec.gpu_runner.loaders import random_llama  # noqa: E402
from schedspec.gpu_runner.model import LlamaWeights, PagedLlama, layer_kinds  # noqa: E402
from schedspec.gpu_runner.reference import reference_logits, reference_states  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)

MML = 64
BS = 16
GROUPS = (KVCacheGroup("full_attention"), KVCacheGroup("mamba"))


@pytest.fixture(scope="module")
def small() -> LlamaWeights:
    return random_llama(7, vocab_size=300, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, tie_embeddings=False, max_position=256)


def _model(w: LlamaWeights, mode: str = "exact", pattern: str = "FM") -> PagedLlama:
    return PagedLlama(w, mode=mode, window=MML, layer_pattern=pattern)  # type: ignore[arg-type]


def _cfg(**kw: Any) -> SchedulerConfig:
    return replace(baseline_config(MML, groups=GROUPS), **kw)


def _prompt(seed: int, n: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 300) for _ in range(n)]


def _entry(rid: str, computed: int, toks: list[int], known: int, tables: tuple[tuple[int, ...], ...],
           kind: ScheduleKind | None = None) -> ScheduledRequest:
    kind = kind or (ScheduleKind.RUNNING if computed else ScheduleKind.NEW)
    return ScheduledRequest(rid, kind, computed, len(toks), known, tables[0], tuple(toks), group_block_ids=tables)


def _run(ex: Executor, rid: str, prompt: list[int], start: int, chunks: list[int],
         tables: list[tuple[tuple[int, ...], ...]], kind: ScheduleKind | None = None) -> Any:
    """Every position's logits from ``start`` on, the prompt computed in
    ``chunks``, step i through ``tables[i]``."""
    rows, c = [], start
    for step, (n, tab) in enumerate(zip(chunks, tables)):
        entry = _entry(rid, c, prompt[c:c + n], len(prompt), tab, kind if step == 0 else None)
        batch = ex.build_batch(StepPlan(step + 1, (entry,), (), ()))
        batch.logit_rows = torch.arange(0, n)
        rows.append(ex.model.forward(batch, ex.cache).clone())
        c += n
    return torch.cat(rows)


def test_the_layout_and_the_kind() -> None:
    assert layer_kinds(3, layer_pattern="FM") == ("full_attention", "mamba", "full_attention")
    assert (MAMBA_STATE.read_place(0, BS), MAMBA_STATE.read_place(16, BS), MAMBA_STATE.read_place(17, BS)) == (None, 0, 1)
    assert (MAMBA_STATE.write_place(16, BS), MAMBA_STATE.write_place(17, BS)) == (0, 1)
    a, b = MAMBA_STATE.gates(torch.tensor([-1e6, 0.0, 1e6]), torch.ones(3))
    assert bool((a > 0).all() and (a < 1).all()) and float(a[1]) == 0.5 and torch.equal(b, 1 - a)


def test_the_config_carries_the_mamba_group(small: LlamaWeights) -> None:
    model = _model(small)
    assert model.is_hybrid and model_kv_cache_groups(model) == GROUPS
    assert model.describe_layout() == "F M F"
    base = baseline_config(MML, groups=GROUPS)
    # vLLM's "align" mode: prefix caching and chunked prefill are forced on
    assert base.enable_prefix_caching and base.enable_chunked_prefill
    with pytest.raises(ConfigError):
        replace(base, enable_prefix_caching=False)
    # the state planes only for a model with a state layer
    assert Executor(model, base).cache.state is not None
    assert Executor(PagedLlama(small, window=MML), baseline_config(MML)).cache.state is None


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_paged_state_equals_the_dense_reference_however_chunked_and_restored(small: LlamaWeights, mode: str) -> None:
    """The prompt in chunks on the state grid (and off it, a decode's way),
    its state blocks nulled where the plan may null them, and a second
    request that restores the checkpoint after 32 tokens from its block:
    every position's logits are the reference's (bitwise in exact mode)."""
    model = _model(small, mode)
    prompt = _prompt(3)
    ref = reference_logits(model, prompt)

    def same(got: Any, want: Any) -> bool:
        return bool(torch.equal(got, want)) if mode == "exact" else float((got - want).abs().max()) < 1e-4

    ex = Executor(model, _cfg())
    full = (1, 2, 3, 4)
    # chunks 16, 16, 28: states written to blocks 5, 6, then 8 (the places before null)
    got = _run(ex, "a", prompt, 0, [16, 16, 28], [(full[:1], (5,)), (full[:2], (5, 6)), (full, (0, 6, 0, 8))])
    assert same(got, ref)
    # a decode-like split: a state updated in place inside its block, then the next block
    ex2 = Executor(model, _cfg())
    got = _run(ex2, "a", prompt, 0, [16, 3, 13, 28],
               [(full[:1], (5,)), (full[:2], (5, 6)), (full[:2], (0, 6)), (full, (0, 6, 0, 8))])
    assert same(got, ref)
    # a second request restores the state after 32 tokens (block 6) and its keys (blocks 1, 2)
    other = prompt[:32] + _prompt(4, 20)
    got = _run(ex, "b", other, 32, [20], [((1, 2, 10, 11), (0, 6, 0, 12))], kind=ScheduleKind.NEW)
    assert same(got, reference_logits(model, other)[32:])
    assert torch.allclose(ex.cache.state[1, 6], reference_states(model, prompt[:32])[1], atol=1e-5)
    # the null block is the zero state, and stays zero
    assert not ex.cache.state[:, 0].any()


def test_a_null_state_block_where_a_state_is_read_or_written_is_a_plan_error(small: LlamaWeights) -> None:
    ex = Executor(_model(small), _cfg())
    toks = [5, 6]
    ex.build_batch(StepPlan(7, (_entry("r9", 32, toks, 34, ((1, 2, 3), (0, 6, 7))),), (), ()))
    with pytest.raises(PlanError) as info:  # the state after 32 tokens lives in place 1
        ex.build_batch(StepPlan(7, (_entry("r9", 32, toks, 34, ((1, 2, 3), (0, 0, 7))),), (), ()))
    msg = str(info.value)
    assert "step 7" in msg and "'r9'" in msg and "group_block_ids[1]" in msg and "mamba state" in msg
    assert "read from place 1" in msg and "null block" in msg
    with pytest.raises(PlanError, match="written to place 2"):
        ex.build_batch(StepPlan(7, (_entry("r9", 32, toks, 34, ((1, 2, 3), (0, 6, 0))),), (), ()))
    with pytest.raises(PlanError, match="two requests write state block 7"):
        ex.build_batch(StepPlan(7, (_entry("r9", 32, toks, 34, ((1, 2, 3), (0, 6, 7))),
                                    _entry("r8", 0, toks, 2, ((4,), (7,)))), (), ()))


def test_the_variants_the_layout_refuses_are_left_out_and_named() -> None:
    refused: list[tuple[str, str]] = []
    names = [v.name for v in default_variants(MML, groups=GROUPS, refused=refused)
             + inflight_variants(MML, groups=GROUPS, refused=refused)
             + connector_variants(MML, groups=GROUPS, refused=refused)]
    assert names == ["chunked-budget", "chunked-threshold", "prefix-cache", "tiny-pool", "all-fcfs", "all-priority",
                     "async", "async-all"]
    assert [n for n, _ in refused] == ["spec-decode", "async-spec", "async-spec-all", "kv-sync", "kv-async",
                                       "kv-all", "kv-async-spec"]
    assert "num_speculative_tokens" in refused[0][1] and "kv_connector" in refused[3][1]
    # no layout refuses a variant without a Mamba group
    plain: list[tuple[str, str]] = []
    inflight_variants(MML, refused=plain)
    assert not plain


def test_mamba_matrix_gives_every_baseline_token_and_catches_a_wrong_checkpoint(small: LlamaWeights) -> None:
    model = _model(small)
    workloads = make_workloads(2, seed=0, vocab_size=300, max_model_len=MML)
    variants = default_variants(MML, groups=GROUPS)[4:] + inflight_variants(MML, groups=GROUPS)[1:]
    assert [v.name for v in variants] == ["all-fcfs", "all-priority", "async-all"]
    report = run_matrix(spec_factory, model, workloads, variants, baseline=baseline_config(MML, groups=GROUPS),
                        reference=True)
    assert report.ok, report.table()
    for v in variants:
        assert {"chunked", "preempted"} <= v.expects
        # where the variant must hit the prefix cache, a hit restores a state
        assert ("state_restored" in v.expects) == ("hybrid_hit" in v.expects) == ("cache_hit" in v.expects)
    assert all(c.logits_compared == c.logits_bitwise > 0 for c in report.comparisons)
    assert all(r.ok and r.logits_bitwise == r.logits_compared > 0 for r in report.reference)
    assert sum(c.inflight["state_restored"] for c in report.comparisons) > 0
    faults = {n.fault: n for n in report.negative}
    assert set(faults) == {"block_table", "position", "state_checkpoint"}
    assert all(n.caught for n in report.negative)
    assert "state_checkpoint" in faults["state_checkpoint"].fired[0]
    assert "entries restored a Mamba state from a checkpoint block" in report.table()


def test_the_wrong_checkpoint_control_on_its_own(small: LlamaWeights) -> None:
    """The state_checkpoint fault fires on the first restore and the run
    diverges from the baseline; on a run that never restores it never fires
    (and so is not caught)."""
    model = _model(small, "fast")
    workload = make_workloads(1, seed=1, vocab_size=300, max_model_len=MML)[0]
    base_cfg = baseline_config(MML, groups=GROUPS)
    base = run_one(spec_factory, model, base_cfg, workload, variant="baseline")
    assert check_reference(model, base, workload).ok
    variant = default_variants(MML, groups=GROUPS)[2]  # prefix-cache
    nc = negative_control(spec_factory, model, base, workload, variant, "state_checkpoint", mode="fast")
    assert nc.fired and nc.caught, nc
    lone = replace(workload, events=workload.events[:1])
    lone_base = run_one(spec_factory, model, base_cfg, lone, variant="baseline")
    nc = negative_control(spec_factory, model, lone_base, lone, variant, "state_checkpoint", mode="fast")
    assert not nc.fired and not nc.caught


def test_cli_runs_a_mamba_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main as schedspec_main

    rc = schedspec_main(["equivalence", "--model", "random:seed=1,vocab=256,hidden=64,layers=2", "--workloads", "1",
                         "--device", "cpu", "--max-model-len", "64", "--layer-pattern", "FM", "--quiet",
                         "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "layers F M" in out and "equal the dense, non-paged reference" in out
    assert "negative control state_checkpoint" in out or "no run restored a Mamba state" in out
    assert "left out, refused with the layout's KV cache groups: spec-decode" in out
    assert rc in (0, 1)  # one workload may leave a guard unmet; the run itself worked
    assert "DIVERGED" not in out and "MISSED" not in out


def test_mamba_states_survive_plans_in_flight(small: LlamaWeights) -> None:
    """k plans in flight (pipeline parallelism, V2's async): the state blocks
    a plan in flight reads are not overwritten before it runs."""
    from schedspec.gpu_runner.pipeline import pipeline_variants

    model = _model(small, pattern="MF")
    variants = pipeline_variants(MML, groups=GROUPS)[3:]
    assert [v.name for v in variants] == ["pipeline-3-tiny", "pipeline-2-async-v2"]
    workloads = make_workloads(1, seed=4, vocab_size=300, max_model_len=MML)
    report = run_matrix(spec_factory, model, workloads, variants, baseline=baseline_config(MML, groups=GROUPS),
                        reference=True, negative=False)
    assert report.ok, report.table()
    assert all(c.logits_compared == c.logits_bitwise > 0 for c in report.comparisons)
    assert sum(c.inflight["state_restored"] for c in report.comparisons) > 0
