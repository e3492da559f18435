"""What a counterexample says of itself matches what it shows: the summary
line counts the steps of its table (the run to quiescence after the events
included), and the timeline's title, legend and axes never overlap, for the
longest titles the reports make."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from schedspec.check import report
from schedspec.check.gate import CheckOutcome, _write_counterexample, counterexample_line
from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.check.records import Failure, StepRecord
from schedspec.check.shrink import count_steps
from schedspec.check.stats import Stats
from schedspec.check.workload import AddRequest
from schedspec.invariants import Violation
from schedspec.spec.scheduler import SpecScheduler


def _table_rows(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"^\s*\d+\s", line))


def test_the_line_counts_the_steps_run_to_quiescence_after_the_events(tmp_path: Path) -> None:
    # a workload of arrivals only, with a KV connector: every step of its
    # table is one of the run to quiescence after the events
    for seed in range(40):
        full = random_workload(seed, 30, kv=("connector",))
        if full.config.kv_connector:
            break
    else:
        pytest.skip("no connector workload drawn")
    adds = tuple(e for e in full.events if isinstance(e, AddRequest))[:2]
    workload = dataclasses.replace(full, events=adds)
    assert count_steps(workload.events) == 0
    failure = Failure("violation", 1, 1, "mine", "made up", (Violation("kv-quiescence", "made up"),))
    factories = {"spec": SpecScheduler}
    _, shown = _write_counterexample(tmp_path, workload, failure, factories, "spec", 64, seed, None, None, 60.0)
    rows = _table_rows((tmp_path / "steps.txt").read_text())
    assert shown == rows > 0
    outcome = CheckOutcome(0, 1, 1.0, Stats(), failure, seed, tmp_path, tmp_path / "trace.jsonl",
                           counterexample=workload, table_steps=shown)
    line = counterexample_line(outcome)
    assert line.startswith(f"counterexample: {rows} steps in the table (0 scheduled by its 2 events, "
                           f"{rows} run after them to quiescence)"), line


def test_the_line_is_plain_when_the_events_schedule_every_step() -> None:
    workload = random_workload(1, 6)
    failure = Failure("divergence", 3, 2, "mine", "x")
    outcome = CheckOutcome(6, 1, 1.0, Stats(), failure, 1, Path("o"), Path("o/trace.jsonl"),
                           counterexample=workload, table_steps=count_steps(workload.events))
    assert counterexample_line(outcome).startswith(
        f"counterexample: {count_steps(workload.events)} steps, {len(workload.events)} events, written to o/")


def _records(seed: int, steps: int) -> list[StepRecord]:
    workload = random_workload(seed, steps)
    runner = Runner(workload.config, {"spec": SpecScheduler}, keep_history=True)
    assert runner.run(workload.events) is None and runner.history
    return runner.history


def _overlaps(fig: object) -> list[tuple[str, str]]:
    fig.canvas.draw()  # type: ignore[attr-defined]
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = {"title": fig._suptitle.get_window_extent(renderer)}  # type: ignore[attr-defined]  # noqa: SLF001
    for i, legend in enumerate(fig.legends):  # type: ignore[attr-defined]
        boxes[f"legend {i}"] = legend.get_window_extent(renderer)
    for i, ax in enumerate(fig.axes):  # type: ignore[attr-defined]
        boxes[f"axes {i}"] = ax.get_tightbbox(renderer)
    names = list(boxes)
    found = [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if boxes[a].overlaps(boxes[b])]
    page = fig.bbox  # type: ignore[attr-defined]
    found += [(n, "the figure's edge") for n, b in boxes.items()
              if b.x0 < page.x0 - 1 or b.x1 > page.x1 + 1 or b.y0 < page.y0 - 1 or b.y1 > page.y1 + 1]
    return found


@pytest.mark.parametrize("steps", [2, 6, 15, 40])
def test_the_longest_title_overlaps_neither_the_legend_nor_the_axes(steps: int) -> None:
    pytest.importorskip("matplotlib")
    records = _records(2, steps)
    long_message = "r22: position 13: a -1 placeholder where the model has sampled nothing " * 3
    failure = Failure("violation", 3, records[len(records) // 2].step,
                      "some.long.package.module_of_the_user:AVeryLongSchedulerClassNameIndeed", "x",
                      (Violation("kv-context", long_message, "r22"), Violation("budget-respected", "y"),
                       Violation("block-conservation", "z")))
    fig = report.timeline_figure(records, failure=failure)
    assert _overlaps(fig) == []
    title = fig._suptitle.get_text()  # type: ignore[union-attr]  # noqa: SLF001
    assert "AVeryLongSchedulerClassNameIndeed" in title and "kv-context" in title


def test_a_short_title_is_left_as_it_is() -> None:
    pytest.importorskip("matplotlib")
    records = _records(2, 15)
    failure = Failure("divergence", 3, records[3].step, "pkg:Mine", "plans differ")
    fig = report.timeline_figure(records, failure=failure)
    assert fig._suptitle.get_text() == f"pkg:Mine: divergence at step {records[3].step}\nplans differ"  # type: ignore[union-attr]  # noqa: SLF001
    assert _overlaps(fig) == []
