"""The benchmark runs (quick mode) and produces rows. No timing asserts."""

from __future__ import annotations

import json
import math
from pathlib import Path

from schedspec.impl import ImplScheduler
from schedspec.bench.scheduler import format_table, main, run_bench
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


def test_bench_cli_quick(capsys: object) -> None:
    assert main(["--against", "impl,spec", "--running", "16", "--quick"]) == 0


def test_bench_cli_bad_flag() -> None:
    assert main(["--against", "impl", "--running", "x"]) == 2
