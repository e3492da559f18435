"""The CLI contract: exit 0 / 1 / 2, counterexamples that replay, messages that name the problem."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from schedspec.cli.main import main

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture(autouse=True)
def _support_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SUPPORT))


def test_check_spec_passes_and_writes_json_and_junit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--steps", "400", "--kv", "none", "--quiet", "--json", str(tmp_path / "s.json"),
               "--junit", str(tmp_path / "j.xml"), "--out", str(tmp_path / "out")])
    assert rc == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["result"] == "pass" and summary["steps"] == 400
    suite = ElementTree.parse(tmp_path / "j.xml").getroot()
    assert suite.get("failures") == "0"
    assert "OK: 400 steps" in capsys.readouterr().out


def test_shards_take_disjoint_seeds(tmp_path: Path) -> None:
    seeds = []
    for k in (1, 2, 3):
        out = tmp_path / f"s{k}.json"
        assert main(["check", "--steps", "300", "--kv", "none", "--workload-steps", "50", "--shard", f"{k}/3",
                     "--quiet", "--json", str(out)]) == 0
        seeds.append(set(json.loads(out.read_text())["workload_seeds"]))
    assert all(seeds)
    assert not (seeds[0] & seeds[1]) and not (seeds[0] & seeds[2]) and not (seeds[1] & seeds[2])


@pytest.mark.parametrize("bug", ["buggy_schedulers:LeakyAbort", "buggy_schedulers:WrongVictim"])
def test_broken_scheduler_fails_with_a_short_replayable_counterexample(
    bug: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rc = main(["check", "--against", bug, "--steps", "20000", "--quiet", "--out", str(out),
               "--json", str(tmp_path / "s.json"), "--shrink-time", "30"])
    assert rc == 1
    summary = json.loads((tmp_path / "s.json").read_text())
    trace = Path(summary["failure"]["trace"])
    folder = trace.parent
    for name in ("trace.jsonl", "steps.txt", "timeline.png", "summary.json"):
        assert (folder / name).exists(), name
    assert (folder / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert f"schedspec replay {trace} --against {bug}" in text
    steps = json.loads((folder / "summary.json").read_text())["steps"]
    assert steps <= 12, f"counterexample not short: {steps} steps"
    # deterministic replay reproduces it; the same trace is clean on the spec
    assert main(["replay", str(trace), "--against", bug]) == 1
    assert main(["replay", str(trace), "--against", "spec"]) == 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["check", "--steps", "-3"], "--steps"),
        (["check", "--steps", "many"], "--steps"),
        (["check", "--time", "0"], "--time"),
        (["check", "--steps", "5", "--time", "3"], "--steps and --time"),
        (["check", "--shard", "3/2"], "--shard"),
        (["check", "--shard", "x"], "--shard"),
        (["check", "--against", "nosuch"], "--against"),
        (["check", "--against", "no_such_module_xyz:Cls"], "cannot import"),
        (["check", "--against", "buggy_schedulers:NotAScheduler"], "missing"),
        (["check", "--against", "buggy_schedulers:Missing"], "no attribute"),
        (["replay", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_usage_exits_2_and_names_the_problem(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_replay_of_malformed_trace_names_file_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"schedspec_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "max_model_len": 32,'
        ' "max_num_batched_tokens": 32, "max_num_seqs": 4}}\n'
        '{"op": "add", "request": {"request_id": "a", "prompt_token_ids": [1, 2], "max_tokens": -1}}\n'
    )
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: request.max_tokens" in err


def test_invariants_prints_the_catalogue(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["invariants"]) == 0
    out = capsys.readouterr().out
    assert "token-budget" in out or "budget" in out
    assert "vllm/v1/core/sched/scheduler.py" in out


def test_time_budget_and_plain_progress_lines_in_ci_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # stderr is not a terminal here: progress comes as plain lines, the last one forced at the end
    rc = main(["check", "--time", "1.5", "--kv", "none", "--workload-steps", "50", "--json", str(tmp_path / "s.json")])
    assert rc == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "steps/s" in line]
    assert lines and "\r" not in err
    assert "preemptions" in lines[-1] and "prefix hits" in lines[-1] and "chunks" in lines[-1]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] >= 50 and summary["elapsed_s"] >= 1.5


def test_plans_only_lockstep_catches_a_divergence(tmp_path: Path) -> None:
    rc = main(["check", "--against", "buggy_schedulers:LeakyAbort", "--plans-only", "--kv", "none", "--steps", "5000",
               "--quiet", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "s.json")])
    assert rc == 1
    assert json.loads((tmp_path / "s.json").read_text())["failure"]["kind"] in ("divergence", "violation")
