"""An equivalence matrix cut short by a signal reports the workloads it ran
whole, marked interrupted (table, JSON, the signal's exit status); the
workload in progress counts in nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from schedspec.cli.main import main  # noqa: E402
from tests.support.interrupting_schedulers import TermAtBuild  # noqa: E402

MODEL = "random:seed=1,vocab=256,hidden=64,layers=1"


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, term_at: int, workloads: int) -> tuple[int, dict[str, Any]]:
    """The matrix against TermAtBuild, its ``term_at``-th construction interrupted: (exit, JSON report)."""
    monkeypatch.setenv("SCHEDSPEC_TEST_TERM_AT", str(term_at))
    monkeypatch.setattr(TermAtBuild, "built", 0)
    out = tmp_path / "r.json"
    rc = main(["equivalence", "--against", "tests.support.interrupting_schedulers:TermAtBuild", "--model", MODEL,
               "--workloads", str(workloads), "--mode", "fast", "--device", "cpu", "--max-model-len", "64",
               "--quiet", "--json", str(out), "--out", str(tmp_path / "o")])
    return rc, json.loads(out.read_text())


def test_a_signal_mid_matrix_reports_the_whole_workloads(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # a foreign class without declared capabilities runs the baseline and 6 variants: 7
    # constructions a workload; the 10th is in the second
    rc, report = _run(tmp_path, monkeypatch, 10, 3)
    text = capsys.readouterr().out
    assert rc == 143, text
    assert "INTERRUPTED (SIGTERM) after 1 whole workload(s)" in text and "EQUIVALENT" not in text.replace(
        "NOT EQUIVALENT", ""), text
    assert report["interrupted"] == "SIGTERM" and report["ok"] is False
    assert report["workloads"] == ["w0"]
    assert {c["workload"] for c in report["comparisons"]} == {"w0"}
    assert set(report["baselines"]) == {"w0"} and set(report["baseline_outputs"]) == {"w0"}
    assert report["negative_controls"] == [] and report["guard_failures"] == []


def test_a_signal_in_the_first_workload_reports_none(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    rc, report = _run(tmp_path, monkeypatch, 3, 2)
    assert rc == 143
    assert "INTERRUPTED (SIGTERM) after 0 whole workload(s)" in capsys.readouterr().out
    assert report["workloads"] == [] and report["comparisons"] == [] and report["baselines"] == {}
