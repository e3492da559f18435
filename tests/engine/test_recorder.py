"""The recorder on vLLM 0.32's engine (``engine``): a captured trace replays
clean against the spec and impl, its plans equal to the recorded ones; the
monitor catches a planted defect and the trace it writes replays to the same
violation. And ``schedspec engine-record``'s usage errors (no engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schedspec.check import trace as tracefile
from schedspec.check.workload import Abort, RecordedPlan, Schedule
from schedspec.cli.main import main
from schedspec.engine import matrix
from tests.engine.support import engine_or_skip
from schedspec.engine.record import run_record_job

#: chunked prefill, prefix caching, a small pool (preemption), priority and n-gram drafts
VARIANT = "everything-ngram"


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine process, three engines: the recorder on VARIANT over two
    workloads, on vLLM's AsyncScheduler (async scheduling kept on) over one
    with the monitor at N = 1, and the planted defect under the monitor."""
    engine_or_skip()
    tmp = tmp_path_factory.mktemp("captured")
    workloads = [w for w in matrix.default_workloads(0) if w["name"] in ("shared-prefix", "aborts")]
    args = {v.name: v.args for v in matrix.VARIANTS}
    result = run_record_job({"workloads": workloads, "runs": [
        {"name": "recorded", "args": args[VARIANT], "trace": str(tmp / "engine.jsonl")},
        {"name": "async", "args": args["everything-async"], "trace": str(tmp / "async.jsonl"), "keep_async": True,
         "workloads": ["aborts"], "check_every": 1},
        {"name": "planted", "args": {}, "check_every": 1, "violation_out": str(tmp / "violation.jsonl"),
         "base": "schedspec.engine.planted:make_shifting_scheduler", "workloads": ["shared-prefix"]},
    ]}, timeout=600)
    return {"tmp": tmp, "result": {r["name"]: r for r in result["runs"]}}


@pytest.mark.engine
def test_a_captured_trace_holds_what_the_engine_did(captured: dict[str, Any]) -> None:
    run = captured["result"]["recorded"]
    assert run["error"] is None and run["violation"] is None, run.get("traceback")
    trace = tracefile.read(run["trace"])
    assert trace.config.enable_prefix_caching and trace.config.num_speculative_tokens == 3
    assert trace.config.num_blocks == 17 and trace.config.block_size == 32  # the null block counted
    plans = [e.plan for e in trace.events if isinstance(e, Schedule)]
    assert len(plans) == len(run["step_s"]) and all(isinstance(p, RecordedPlan) for p in plans)
    assert any(p.preempted for p in plans if p)  # the small pool preempts
    assert any(e[4] for p in plans if p for e in p.scheduled)  # drafts verified
    assert any(isinstance(e, Abort) for e in trace.events)
    results = [e.result for e in trace.events if isinstance(e, Schedule) and e.result]
    assert sum(len(r.sampled) for r in results) > 100


@pytest.mark.engine
def test_an_async_engine_is_recorded_with_its_steps_in_flight(captured: dict[str, Any]) -> None:
    run = captured["result"]["async"]
    assert run["error"] is None and run["violation"] is None, run.get("traceback")
    trace = tracefile.read(run["trace"])
    assert trace.config.async_scheduling
    ops = [type(e).__name__ for e in trace.events if type(e).__name__ in ("Schedule", "Update")]
    assert ops[:3] == ["Schedule", "Schedule", "Update"]  # step 2 planned before step 1's update
    assert any(isinstance(e, Abort) for e in trace.events)
    # the monitor saw every schedule and every update, with a plan in flight, and no violation
    assert len(run["checked_s"]) == len(ops)  # every schedule and every update


@pytest.mark.engine
@pytest.mark.parametrize("run, against", [("recorded", "spec"), ("recorded", "impl"), ("async", "spec"),
                                          ("recorded", "vllm-0.32"), ("async", "vllm-0.32")])
def test_a_captured_trace_replays_clean(captured: dict[str, Any], run: str, against: str,
                                        capfd: pytest.CaptureFixture[str]) -> None:
    """Against the spec and impl (0.33's decisions), and on the scheduler of
    the vLLM that recorded it (0.32, run in the engine's environment)."""
    path = captured["result"][run]["trace"]
    assert main(["replay", path, "--against", against]) == 0
    out = capfd.readouterr().out
    assert "plans equal to the recorded engine's (vLLM 0.32), every invariant held" in out
    if against == "vllm-0.32":
        assert "the scheduler: vLLM 0.32.0's, in the engine's environment" in out


def test_vllm_0_32_runs_the_same_replay_against_vllm() -> None:
    from schedspec.engine.replay import engine_argv

    assert engine_argv(["replay", "t.jsonl", "--against", "vllm-0.32", "--table"]) == [
        "replay", "t.jsonl", "--against", "vllm", "--table"]
    assert engine_argv(["replay", "--against=vllm-0.32", "t.jsonl"]) == ["replay", "--against=vllm", "t.jsonl"]
    assert engine_argv(["replay", "vllm-0.32", "--against", "spec"]) == ["replay", "vllm-0.32", "--against", "spec"]


def test_vllm_0_32_without_the_engine_names_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SCHEDSPEC_ENGINE_PYTHON", raising=False)
    monkeypatch.setenv("SCHEDSPEC_ENGINE_VENV", str(tmp_path / "none"))
    trace = next(Path("vectors/bugzoo").glob("*.jsonl"))
    assert main(["replay", str(trace), "--against", "vllm-0.32"]) == 2
    err = capsys.readouterr().err
    assert "--against vllm-0.32: no engine environment" in err and "scripts/setup_engine.sh" in err


@pytest.mark.engine
@pytest.mark.vllm
def test_the_monitor_catches_a_planted_defect_and_its_trace_replays_to_it(
        captured: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    violation = captured["result"]["planted"]["violation"]
    assert violation is not None and violation["step"] == 2
    assert any(v.startswith("plan-matches-state") for v in violation["violations"])
    path = violation["trace"]
    assert json.loads(Path(path).read_text().splitlines()[0])["check"] == {"mode": "invariants",
                                                                          "invariants": "safety"}
    pytest.importorskip("vllm")
    assert main(["replay", path, "--against", "schedspec.engine.planted:ShiftingScheduler"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: violation at event" in out and "(step 2)" in out
    assert "[plan-matches-state] entry starts at" in out


@pytest.mark.parametrize("argv, needle", [
    (["--variant", "nope"], "--variant: unknown variant 'nope'"),
    (["--variant", matrix.CONTROL], "--variant: unknown variant"),
    (["--check-every", "-1"], "--check-every"),
    (["--workloads", "aborts,nope"], "--workloads: unknown workload(s) nope"),
])
def test_engine_record_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    argv: list[str], needle: str) -> None:
    assert main(["engine-record", "--out", str(tmp_path / "t.jsonl"), *argv]) == 2
    assert needle in capsys.readouterr().err


def test_engine_record_out_in_a_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine-record", "--out", str(tmp_path / "no" / "t.jsonl")]) == 2
    assert "--out: no directory" in capsys.readouterr().err
