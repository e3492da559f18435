"""The benchmark runs (quick mode) and produces rows. No timing asserts."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from schedspec.impl import ImplScheduler
from schedspec.bench.scheduler import (
    DEFAULT_MODES,
    KV_LAYOUTS,
    PLAIN,
    SYNC,
    KvLayout,
    TABLE_COLUMNS,
    Mode,
    Row,
    fake_result,
    accepted_drafts,
    decode_config,
    decode_requests,
    format_table,
    not_run_notes,
    parse_kv_layouts,
    parse_modes,
    run_bench,
    sampled_tokens,
    table_cells,
    workload_plans,
)
from schedspec.cli.main import main as schedspec_main
from schedspec.spec.interface import ScheduledRequest, ScheduleKind, SchedulerConfig, SchedulerFactory, StepPlan
from schedspec.spec.scheduler import SpecScheduler


def test_run_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rows = run_bench(
        {"impl": ImplScheduler, "spec": SpecScheduler},
        running=(8, 16),
        steps=3,
        json_path=str(out),
        mixed_steps=15,
        max_seconds=1.0,
        memory=True,
        memory_running=8,
        memory_waiting=20,
    )
    workloads = {r.workload for r in rows}
    assert {"decode-8", "decode-16", "mixed"} <= workloads
    assert any(w.startswith("memory") for w in workloads)
    for r in rows:
        if r.workload.startswith("memory"):
            assert r.peak_mb is not None and r.peak_mb > 0
        else:
            assert r.steps >= 3 and math.isfinite(r.median_ms) and r.median_ms >= 0
            assert r.baseline == "spec" and r.speedup is not None
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(rows)
    assert "impl" in format_table(rows)


def main(argv: list[str]) -> int:
    return schedspec_main(["bench", *argv])


def test_bench_cli_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--against", "impl,spec", "--running", "16", "--quick", "--modes", "sync"]) == 0
    out = capsys.readouterr().out.splitlines()
    # not a terminal: the plain fixed-width table, a row per (workload, scheduler)
    assert out[0].split()[:3] == ["workload", "scheduler", "steps"] and set(out[1]) == {"-"}
    assert [line.split()[:2] for line in out[2:]] == [["decode-16", "impl"], ["decode-16", "spec"],
                                                      ["mixed", "impl"], ["mixed", "spec"]]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--against", "impl", "--running", "x"], "schedspec bench: error: --running"),
    (["--against", "impl", "--running", "0"], "--running"),
    (["--against", "nosuch"], "schedspec bench: error: --against"),
    (["--against", " , "], "no scheduler available"),
    (["--against", "impl", "--modes", "sync,turbo"], "--modes: 'turbo' is not a mode"),
    (["--against", "impl", "--modes", "async+spec9"], "1 to 8"),
    (["--against", "impl", "--modes", ","], "no mode given"),
])
def test_bench_cli_bad_flag(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_plain_table_is_the_cells_in_fixed_width_columns() -> None:
    nan = float("nan")
    rows = [Row("decode-8", "impl", 5, 0.5, 0.25, 0.75, 1.0, speedup=4.0, baseline="spec"),
            Row("decode-8", "spec", 5, 2.0, 1.0, 2.5, 3.0, speedup=1.0, baseline="spec"),
            Row("memory 8+20w", "impl", 3, nan, nan, nan, nan, peak_mb=1.25)]
    cells = table_cells(rows)
    assert cells[0] == ["decode-8", "impl", "5", "0.500", "0.250", "0.750", "1.000", "4.0x vs spec", ""]
    assert cells[1][7] == ""  # the baseline has no speed-up against itself
    assert cells[2][3:7] == ["", "", "", ""] and cells[2][8] == "1.2"
    lines = format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert len(lines[0]) == sum(w for _, w, _ in TABLE_COLUMNS) + len(TABLE_COLUMNS) - 1
    assert all(len(line) == len(lines[0]) for line in lines)
    assert lines[2].startswith("decode-8                impl          5      0.500     0.250")


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_vllm_rows_time_vllms_own_calls() -> None:
    """vLLM is timed through the adapter's public raw_step (its own
    schedule() + update_from_output()), and the decode rows reach decode."""
    from schedspec.adapters.registry import resolve

    rows = run_bench({"vllm": resolve("vllm").factory, "impl": ImplScheduler}, running=(8,), steps=3,
                     mixed_steps=10, max_seconds=1.0, memory=True, memory_running=8, memory_waiting=8)
    vllm = {r.workload: r for r in rows if r.scheduler == "vllm"}
    assert vllm["decode-8"].note == vllm["mixed"].note == "vLLM schedule()+update_from_output()"
    assert vllm["decode-8"].steps >= 3 and vllm["decode-8"].cpu_median_ms > 0
    assert all(r.baseline == "vllm" for r in rows if not r.workload.startswith("memory"))
    assert vllm["memory 8+8w"].peak_mb is not None and vllm["memory 8+8w"].peak_mb > 0
    assert all(r.note == "" for r in rows if r.scheduler == "impl")


def test_modes_parse_and_label() -> None:
    assert parse_modes("sync,async,sync+spec3,async+spec3") == DEFAULT_MODES
    assert parse_modes("async+spec, async+spec3 ,sync") == (Mode(True, 3), SYNC)
    assert [m.label for m in DEFAULT_MODES] == ["sync", "async", "sync+spec3", "async+spec3"]
    assert SYNC.suffix == "" and Mode(True, 2).suffix == " async+spec2"
    cfg = Mode(True, 2).apply(SchedulerConfig())
    assert cfg.async_scheduling and cfg.num_speculative_tokens == 2
    assert SYNC.apply(cfg) is cfg


def test_fake_model_accepts_a_position_dependent_prefix_of_the_drafts() -> None:
    counts = {accepted_drafts(p, 3) for p in range(200)}
    assert counts == {0, 1, 2, 3}  # every acceptance pattern occurs
    assert accepted_drafts(17, 0) == 0 and len(sampled_tokens(17, 0)) == 1
    for p in range(50):
        toks = sampled_tokens(p, 3)
        assert len(toks) == 1 + accepted_drafts(p, 3)
        assert toks == sampled_tokens(p, 3) and toks[:1] == sampled_tokens(p, 0)


def test_fake_model_result_reads_the_first_sampled_position_past_the_drafts() -> None:
    k = 2
    entries = (
        ScheduledRequest("a", ScheduleKind.RUNNING, 10, 3, 11, (1,), (5, 6, 7), spec_token_ids=(6, 7)),
        ScheduledRequest("b", ScheduleKind.NEW, 0, 4, 9, (2,), (1, 2, 3, 4)),  # a prefill chunk
    )
    result = fake_result(StepPlan(1, entries, (), ()), k, propose=True)
    assert set(result.sampled) == {"a"} and result.sampled["a"] == sampled_tokens(11, 2)
    nxt = 11 + len(result.sampled["a"])
    assert result.draft_token_ids == {"a": tuple(sampled_tokens(q, 0)[0] for q in range(nxt, nxt + k))}
    assert fake_result(StepPlan(1, entries, (), ()), k, propose=False).draft_token_ids == {}


def test_run_bench_modes_give_a_row_per_mode_and_name_what_could_not_run() -> None:
    class SyncOnly(ImplScheduler):
        def __init__(self, config: SchedulerConfig) -> None:
            if config.async_scheduling:
                raise ValueError("no async here")
            super().__init__(config)

    rows = run_bench({"spec": SpecScheduler, "sync-only": SyncOnly}, running=(8,), steps=3,
                     mixed_steps=10, max_seconds=1.0, memory=False,
                     modes=(SYNC, Mode(True, 0)))
    assert [(r.workload, r.scheduler, r.mode) for r in rows] == [
        ("decode-8", "spec", "sync"), ("decode-8", "sync-only", "sync"),
        ("mixed", "spec", "sync"), ("mixed", "sync-only", "sync"),
        ("decode-8 async", "spec", "async"), ("decode-8 async", "sync-only", "async"),
        ("mixed async", "spec", "async"), ("mixed async", "sync-only", "async"),
    ]
    missing = [r for r in rows if r.steps == 0]
    assert [(r.workload, r.scheduler) for r in missing] == [("decode-8 async", "sync-only"),
                                                          ("mixed async", "sync-only")]
    assert all(r.speedup is None and "no async here" in r.note for r in missing)
    assert table_cells(missing)[0][3] == "n/a"
    assert not_run_notes(rows) == [f"{r.workload} sync-only: {r.note}" for r in missing]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_vllm_runs_every_mode_with_its_own_async_scheduler_and_drafts() -> None:
    """In async and speculative modes the bench drives vLLM's scheduler as its
    engine core does (a step in flight; drafts after the step) and times the
    same calls; the decode rows reach decode in every mode."""
    from schedspec.adapters.registry import resolve

    rows = run_bench({"vllm": resolve("vllm").factory}, running=(8,), steps=3, mixed_steps=30,
                     max_seconds=1.0, memory=False, modes=DEFAULT_MODES)
    assert [r.mode for r in rows] == ["sync", "sync", "async", "async", "sync+spec3", "sync+spec3",
                                      "async+spec3", "async+spec3"]
    assert all(r.steps >= 3 and r.cpu_median_ms > 0 for r in rows), not_run_notes(rows)
    notes = {r.mode: r.note for r in rows}
    assert notes["sync+spec3"] == "vLLM schedule()+update_from_output()+update_draft_token_ids()"
    assert notes["async+spec3"] == notes["async"] == "vLLM schedule()+update_from_output()"


def test_quick_bench_runs_each_size_once(capsys: pytest.CaptureFixture[str]) -> None:
    """--quick caps the sizes at 32: the default 256,1024 give one decode-32
    row per scheduler, not two."""
    assert main(["--against", "impl", "--quick", "--modes", "sync"]) == 0
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [["decode-32", "impl"], ["mixed", "impl"]]


def test_kv_layouts_parse_and_shape_the_config() -> None:
    assert parse_kv_layouts("plain") == (PLAIN,)
    assert [x.name for x in parse_kv_layouts("all")] == list(KV_LAYOUTS)
    assert [x.name for x in parse_kv_layouts(" hybrid,connector,hybrid ")] == ["hybrid", "connector"]
    for bad, needle in (("plain,turbo", "'turbo' is not a KV layout"), (",", "no KV layout given")):
        with pytest.raises(ValueError, match=needle):
            parse_kv_layouts(bad)
    base = decode_config(8)
    assert PLAIN.apply(base, 8) is base and PLAIN.suffix == ""
    conn = KvLayout("connector").apply(base, 8)
    assert conn.kv_connector and not conn.is_hybrid and conn.num_blocks == base.num_blocks
    hyb = KvLayout("hybrid").apply(base, 8)
    assert [g.kind for g in hyb.groups] == ["full_attention", "sliding_window"]
    assert hyb.num_blocks > base.num_blocks and not hyb.kv_connector
    assert [g.kind for g in KvLayout("chunked").apply(base, 8).groups] == ["full_attention", "chunked_local"]
    assert KvLayout("chunked").suffix == " chunked"
    mamba = KvLayout("hybrid-mamba").apply(base, 8)
    assert [g.kind for g in mamba.groups] == ["full_attention", "mamba"] and mamba.num_blocks == base.num_blocks + 8 * 3
    reqs = decode_requests(6)
    assert KvLayout("hybrid").requests(reqs) == reqs
    ext = [r.kv_external_tokens for r in KvLayout("connector").requests(reqs)]
    assert ext == [0, 0, (len(reqs[2].prompt_token_ids) - 1) // 2, 0, 0, (len(reqs[5].prompt_token_ids) - 1) // 2]


def test_kv_layout_rows_carry_the_layout_and_the_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    layouts = parse_kv_layouts("plain,connector,hybrid,chunked,hybrid-mamba")
    rows = run_bench({"impl": ImplScheduler, "spec": SpecScheduler}, running=(8,), steps=3, json_path=str(out),
                     mixed_steps=12, max_seconds=1.0, memory=False, modes=(SYNC, Mode(True, 0)),
                     layouts=layouts, repeat=2)
    got = [(r.workload, r.scheduler, r.mode, r.layout) for r in rows]
    want = [(f"{w}{m.suffix}{x.suffix}", name, m.label, x.name)
            for m in (SYNC, Mode(True, 0)) for x in layouts for w in ("decode-8", "mixed")
            for name in ("impl", "spec")]
    assert got == want
    for r in rows:
        assert r.runs == 2 and r.steps >= 2 * 3 and math.isfinite(r.cpu_median_ms)
        if r.scheduler == "impl":
            assert set(r.ratios) == {"spec"} and r.ratios["spec"] > 0
        else:
            assert r.ratios == {}
    data = json.loads(out.read_text())["rows"]
    assert {d["layout"] for d in data} == {"plain", "connector", "hybrid", "chunked", "hybrid-mamba"}
    assert all(("impl/spec" in d["ratios"]) == (d["scheduler"] == "impl") for d in data)
    # the table gains the ratio column only when asked
    plain = format_table(rows).splitlines()
    with_ratios = format_table(rows, ratios=True).splitlines()
    assert "impl/spec" not in plain[0] and with_ratios[0].rstrip().endswith("impl/spec")
    assert len({len(line) for line in with_ratios}) == 1  # the workload column widened, every line alike


def test_bench_cli_kv_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--against", "impl,spec", "--running", "16", "--quick", "--modes", "async",
                 "--kv", "hybrid,chunked"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "impl/spec"
    assert [line.split()[:4] for line in lines[2:]] == [
        ["decode-16", "async", "hybrid", "impl"], ["decode-16", "async", "hybrid", "spec"],
        ["mixed", "async", "hybrid", "impl"], ["mixed", "async", "hybrid", "spec"],
        ["decode-16", "async", "chunked", "impl"], ["decode-16", "async", "chunked", "spec"],
        ["mixed", "async", "chunked", "impl"], ["mixed", "async", "chunked", "spec"]]
    assert main(["--against", "impl", "--kv", "paged"]) == 2
    assert "--kv: 'paged' is not a KV layout" in capsys.readouterr().err
    assert main(["--against", "impl", "--repeat", "0"]) == 2


@pytest.mark.parametrize("mode", [SYNC, Mode(True, 0)], ids=["sync", "async"])
@pytest.mark.parametrize("layout", ["connector", "hybrid", "chunked"])
def test_the_schedulers_of_a_layout_row_make_the_same_decisions(layout: str, mode: Mode) -> None:
    """impl, the spec and vLLM (through its adapter, when installed) make
    equal plans (block tables and group tables included) on the bench's
    decode and mixed workloads under each KV layout: a row's schedulers do
    the same work."""
    kv = KvLayout(layout)
    factories: dict[str, SchedulerFactory] = {"spec": SpecScheduler, "impl": ImplScheduler}
    if importlib.util.find_spec("vllm") is not None:
        from schedspec.adapters.registry import resolve

        factories["vllm"] = resolve("vllm").factory
    for workload, steps in (("decode", 24), ("mixed", 40)):
        plans = {name: workload_plans(f, workload, steps, mode, kv, running=8) for name, f in factories.items()}
        assert plans["impl"] == plans["spec"], (workload, layout)
        assert any(p.scheduled for p in plans["spec"])
        if "vllm" in plans:
            assert plans["vllm"] == plans["spec"], (workload, layout, "vllm")
        if layout == "connector":  # the connector loads external tokens for every third request
            assert any(p.kv_loads for p in plans["spec"])
        if kv.groups:  # every entry carries both groups' tables
            assert all(len(e.group_block_ids) == 2 for p in plans["spec"] for e in p.scheduled)
