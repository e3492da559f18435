"""The counterexample report: the step table, the timeline figure (drawn with
matplotlib, checked on the Figure before it is saved), the PNG, and the
fallback without matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from schedspec.check import report
from schedspec.check.driver import Runner
from schedspec.check.records import Failure, StepRecord
from schedspec.check.random_workloads import random_workload
from schedspec.spec.scheduler import SpecScheduler


def _records(seed: int, steps: int) -> list[StepRecord]:
    workload = random_workload(seed, steps)
    runner = Runner(workload.config, {"spec": SpecScheduler}, keep_history=True)
    assert runner.run(workload.events) is None
    assert runner.history
    return runner.history


def _failure(step: int) -> Failure:
    return Failure("divergence", 3, step, "pkg:Mine", "plans differ at step " + str(step))


def test_cell_states_cover_every_request_and_step() -> None:
    records = _records(1, 12)
    order, grid, usage = report.cell_states(records)
    assert len(grid) == len(usage) == len(records)
    assert all(len(col) == len(order) for col in grid)
    assert {s for col in grid for s in col} <= set(report.STATES)
    assert all(0.0 <= u <= 1.0 for u in usage)
    assert any(s in ("prefill", "decode") for col in grid for s in col)


def test_timeline_figure_has_labelled_axes_legend_and_failure_mark() -> None:
    pytest.importorskip("matplotlib")
    records = _records(2, 15)
    failing = records[len(records) // 2].step
    fig = report.timeline_figure(records, failure=_failure(failing))
    grid_ax, kv_ax = fig.axes
    assert grid_ax.get_ylabel() == "request"
    assert kv_ax.get_xlabel() == "step"
    assert "KV pool" in kv_ax.get_ylabel()
    order = report.cell_states(records)[0]
    assert [t.get_text() for t in grid_ax.get_yticklabels()] == order
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    for word in ("waiting", "prefill (chunk)", "decode", "preempted", "finished", "KV-pool usage",
                 f"failing step ({failing})"):
        assert word in labels, (word, labels)
    title = fig._suptitle.get_text() if fig._suptitle is not None else ""  # noqa: SLF001 - matplotlib's own attribute
    assert "pkg:Mine" in title and "divergence" in title and f"step {failing}" in title
    usage_line = kv_ax.get_lines()[0]
    assert len(usage_line.get_xdata()) == len(records)
    # the failing column is framed in both axes
    assert len(grid_ax.patches) == 1 and len(kv_ax.patches) == 1


def test_no_failure_mark_without_a_failing_step() -> None:
    pytest.importorskip("matplotlib")
    fig = report.timeline_figure(_records(3, 6))
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert not any(label.startswith("failing step") for label in labels)
    assert not fig.axes[0].patches


@pytest.mark.parametrize(("seed", "steps"), [(4, 2), (5, 40)])
def test_timeline_png_is_a_png_of_sensible_size(seed: int, steps: int, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = _records(seed, steps)
    path = report.timeline_png(records, tmp_path / "t.png", failure=_failure(records[-1].step))
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 600 <= width <= 2400 and 250 <= height <= 1400, (width, height)


def test_without_matplotlib_the_picture_is_refused_cleanly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(report.PlotUnavailable, match=r"schedspec\[plots\]"):
        report.timeline_png(_records(6, 5), tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_counterexample_without_matplotlib_keeps_the_text_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from schedspec.cli.main import main

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "support"))
    rc = main(["check", "--against", "buggy_schedulers:WrongVictim", "--steps", "20000", "--out", str(tmp_path)])
    assert rc == 1
    (folder,) = tmp_path.iterdir()
    assert {p.name for p in folder.iterdir()} == {"trace.jsonl", "steps.txt", "summary.json"}
    assert json.loads((folder / "summary.json").read_text())["kind"] == "violation"
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if "timeline.png skipped" in line]
    assert len(skipped) == 1 and "matplotlib is not installed" in skipped[0]


def _mode_records(mode: str, seed: int = 2, steps: int = 14) -> list[StepRecord]:
    workload = random_workload(seed, steps, modes=(mode,))
    runner = Runner(workload.config, {"spec": SpecScheduler}, oracle_seed=seed, keep_history=True)
    assert runner.run(workload.events) is None
    assert runner.history
    return runner.history


def test_the_step_table_shows_placeholders_drafts_and_the_plans_in_flight() -> None:
    text = report.step_table(_mode_records("async-spec"))
    assert "[in flight 1,2; updated 1]" in text
    assert " ~1 d" in text  # a placeholder in flight and drafts verified
    assert any(f"d{k}:{a}" in text for k in range(1, 5) for a in range(k + 1))
    sync = report.step_table(_mode_records("sync"))
    assert "in flight" not in sync and "~" not in sync


def test_in_flight_spans_overlap_only_with_async_scheduling() -> None:
    sync = report.in_flight_spans(_mode_records("spec"))
    assert all(first == last for _, first, last in sync)
    spans = report.in_flight_spans(_mode_records("async"))
    assert all(last == first + 1 for _, first, last in spans[:-1])
    assert spans[-1][1] == spans[-1][2]  # the last plan is still in flight


def test_draft_counts_are_the_accepted_of_the_verified() -> None:
    records = _mode_records("spec")
    counts = report.draft_counts(records)
    assert counts and all(0 <= accepted <= drafts for drafts, accepted in counts.values())
    assert report.draft_counts(_mode_records("sync")) == {}


def test_the_async_timeline_has_a_band_of_plans_in_flight() -> None:
    pytest.importorskip("matplotlib")
    records = _mode_records("async-spec")
    fig = report.timeline_figure(records)
    grid, band, kv = fig.axes[:3]
    assert band.get_ylabel() == "plans in\nflight"
    assert len(band.patches) == len(records)
    assert {t.get_text() for t in grid.texts} >= {f"{a}/{d}" for d, a in report.draft_counts(records).values()}
    assert len(report.timeline_figure(_mode_records("sync")).axes) == 2
