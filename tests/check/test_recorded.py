"""Trace format 5 (the plans a recorded engine made) and a replay held to
them (schedspec/check/recorded.py, ``schedspec replay``): no engine needed,
the recorded plans here are the spec's own, then altered."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from schedspec.check import recorded
from schedspec.check import trace as tracefile
from schedspec.check.run import run_workload
from schedspec.check.workload import AddRequest, Event, RecordedPlan, Schedule, Step, Update, Workload
from schedspec.cli.main import main
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import RequestSpec, SchedulerConfig, StepResult

CONFIG = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=4,
                         max_model_len=32, enable_chunked_prefill=True)


def _plain() -> Workload:
    events: list[Event] = [AddRequest(RequestSpec("a", tuple(range(1, 11)), max_tokens=4)),
                           AddRequest(RequestSpec("b", tuple(range(3, 17)), max_tokens=3, arrival=1))]
    events += [Step()] * 3 + [AddRequest(RequestSpec("c", (5, 6, 7), max_tokens=2, arrival=2))] + [Step()] * 8
    return Workload(CONFIG, tuple(events))


def _recorded(workload: Workload) -> tuple[Workload, list[RecordedPlan]]:
    """``workload`` with every Step as a Schedule carrying the spec's plan, then an Update."""
    runner, failure = run_workload(workload, {"spec": SpecScheduler}, keep_history=True)
    assert failure is None and runner.history
    plans = [RecordedPlan.of(r.plan) for r in runner.history]
    events: list[Event] = []
    k = 0
    for e in workload.events:
        if isinstance(e, Step):
            events += [Schedule(None, plans[k]), Update(k + 1)]
            k += 1
        else:
            events.append(e)
    return Workload(workload.config, tuple(events)), plans


def _altered(workload: Workload, step: int, result: StepResult | None = None) -> Workload:
    """The recorded plan of ``step`` with its first entry scheduling one token more."""
    events = list(workload.events)
    n = 0
    for i, e in enumerate(events):
        if isinstance(e, Schedule):
            n += 1
            if n == step:
                assert e.plan is not None
                rid, kind, done, k, d = e.plan.scheduled[0]
                events[i] = Schedule(result, dataclasses.replace(
                    e.plan, scheduled=((rid, kind, done, k + 1, d),) + e.plan.scheduled[1:]))
    return Workload(workload.config, tuple(events))


def test_format_5_round_trips_and_is_written_only_when_plans_are_recorded() -> None:
    workload, plans = _recorded(_plain())
    text = tracefile.dumps(tracefile.Trace(workload))
    assert json.loads(text.splitlines()[0])["schedspec_trace"] == 5
    assert '"plan": {"finished": [], "preempted": [], "scheduled": [["a", "new", 0, 10, 0]' in text
    back = tracefile.loads(text, "t.jsonl")
    assert back.workload == workload
    assert recorded.recorded_plans(back.events) == {i + 1: p for i, p in enumerate(plans)}
    assert json.loads(tracefile.dumps(tracefile.Trace(_plain())).splitlines()[0])["schedspec_trace"] == 1


@pytest.mark.parametrize("edit, where", [
    (lambda h, e: (dict(h, schedspec_trace=9), e), "t.jsonl:1: schedspec_trace: unsupported version 9 "
                                                    "(this reads 1, 2, 3, 4, 5, 6, 7, 8)"),
    (lambda h, e: (dict(h, schedspec_trace=4), e), "t.jsonl:4: plan: needs trace format version 5"),
    (lambda h, e: (h, [dict(e[0], plan={"scheduled": [["a", "bogus", 0, 10, 0]]})] + e[1:]),
     "t.jsonl:4: plan.scheduled[0][1]:"),
    (lambda h, e: (h, [dict(e[0], plan={"scheduled": [["a", "new", 0, 0, 0]]})] + e[1:]),
     "t.jsonl:4: plan.scheduled[0][3]:"),
    (lambda h, e: (h, [dict(e[0], plan={"preempted": []})] + e[1:]), "t.jsonl:4: plan.scheduled: missing"),
])
def test_a_captured_trace_of_unknown_version_or_bad_plan_is_refused_naming_file_line_field(edit, where) -> None:  # type: ignore[no-untyped-def]
    workload, _ = _recorded(_plain())
    lines = [json.loads(line) for line in tracefile.dumps(tracefile.Trace(workload)).splitlines()]
    header, rest = edit(lines[0], lines[3:])
    text = "\n".join(json.dumps(x) for x in [header, *lines[1:3], *rest])
    with pytest.raises(tracefile.TraceError) as err:
        tracefile.loads(text, "t.jsonl")
    assert str(err.value).startswith(where)


def test_compare_plans_names_the_first_step_that_differs() -> None:
    workload, plans = _recorded(_plain())
    runner, failure = run_workload(workload, {"spec": SpecScheduler}, keep_history=True)
    assert failure is None
    assert recorded.compare_plans(CONFIG, workload.events, runner.history or []) == (len(plans), None)
    altered = _altered(workload, 2)
    compared, mismatch = recorded.compare_plans(CONFIG, altered.events, runner.history or [])
    assert compared == 1 and mismatch is not None and mismatch.step == 2 and mismatch.difference is None
    assert "the num_scheduled_tokens differs" in mismatch.message


def _write(tmp_path: Path, workload: Workload) -> str:
    path = tmp_path / "captured.jsonl"
    tracefile.write(path, tracefile.Trace(workload))
    return str(path)


@pytest.mark.parametrize("against", ["spec", "impl"])
def test_replay_of_a_captured_trace_holds_the_plans_to_the_recorded_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], against: str) -> None:
    workload, plans = _recorded(_plain())
    assert main(["replay", _write(tmp_path, workload), "--against", against]) == 0
    assert f"{len(plans)} plans equal to the recorded engine's" in capsys.readouterr().out
    assert main(["replay", _write(tmp_path, _altered(workload, 2)), "--against", against]) == 1
    out = capsys.readouterr().out
    assert "1 plans equal to the recorded engine's (vLLM 0.32), then step 2: the plan differs" in out
    assert "not a documented 0.32 -> 0.33 difference" in out


def test_a_documented_difference_is_reported_as_such_not_as_a_bug(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    known = recorded.VersionDifference("one-token-more", "0.32 schedules one token more here",
                                       lambda config, want, got: want.scheduled[0][3] == got.scheduled[0].num_scheduled_tokens + 1)
    monkeypatch.setattr(recorded, "DIFFERENCES", (known,))
    workload, _ = _recorded(_plain())
    path = _write(tmp_path, _altered(workload, 2))
    for args in ([path], [path, path]):  # one trace, and several
        assert main(["replay", *args, "--against", "spec"]) == 0
        out = capsys.readouterr().out
        assert "the documented vLLM 0.32 -> 0.33 difference one-token-more" in out
    # step 1 recorded b sampling, which the spec's plan (b's first chunk) does not
    path = _write(tmp_path, _altered(workload, 1, StepResult(sampled={"b": (1,)})))
    assert main(["replay", path, "--against", "spec"]) == 0
    out = capsys.readouterr().out
    assert "difference one-token-more" in out and "then, its consequence: error at step 1" in out
