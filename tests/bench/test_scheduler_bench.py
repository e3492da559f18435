"""The benchmark runs (quick mode) and produces rows. No timing asserts."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from schedspec.impl import ImplScheduler
from schedspec.bench.scheduler import TABLE_COLUMNS, Row, format_table, run_bench, table_cells
from schedspec.cli.main import main as schedspec_main
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
    assert main(["--against", "impl,spec", "--running", "16", "--quick"]) == 0
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
    assert lines[2].startswith("decode-8             impl          5      0.500     0.250")


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
