"""A check as a CI job sees it: a scheduler that hangs is a finding within
the budget and the deadline, not a job killed at the runner's timeout;
SIGINT and SIGTERM end a run with a summary, the JSON and JUnit written and
the conventional exit status; every output path is checked before the run;
the counterexample line counts what its table shows."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest

from schedspec.check.deadline import guard_available

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"

posix_only = pytest.mark.skipif(guard_available() is not None, reason=str(guard_available()))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SUPPORT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _schedspec(*argv: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "schedspec", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=_env(), timeout=timeout)
    return done, time.monotonic() - t0


@posix_only
def test_a_scheduler_that_blocks_at_its_50th_schedule_is_a_finding_not_a_hung_job(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 300 steps: a run too short for the dense phase (check/dense_phase.py), whose 40-step
    # workloads never make a 50th schedule(): the first workload has 200 steps
    done, elapsed = _schedspec("check", "--against", "hanging_schedulers:Hang", "--steps", "300", "--call-timeout",
                               "1", "--quiet", "--out", str(out), "--json", str(tmp_path / "s.json"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert elapsed < 5 + 1 + 20  # the first workload, the deadline, the interpreter's start on a busy machine
    text = done.stdout
    assert "timeout at event" in text and "(step 50) in hanging_schedulers:Hang" in text, text
    assert re.search(r"Hang\.schedule\(\) did not return: still running after 1\.\d s", text), text
    assert "counterexample: " in text and "the last one's call hung" in text
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["result"] == "fail" and summary["failure"]["kind"] == "timeout"
    replay = summary["failure"]["replay"]
    assert replay.endswith("--against hanging_schedulers:Hang --call-timeout 1")
    trace = summary["failure"]["trace"]
    again, _ = _schedspec("replay", trace, "--against", "hanging_schedulers:Hang", "--call-timeout", "1")
    assert again.returncode == 1
    head = re.search(r"timeout at event (\d+) \(step 50\)", text)
    assert head is not None and f"FAILED: timeout at event {head.group(1)} (step 50)" in again.stdout, again.stdout


@posix_only
def test_a_hang_while_building_the_scheduler_is_a_finding_with_a_trace(tmp_path: Path) -> None:
    done, _ = _schedspec("check", "--against", "hanging_schedulers:HangBuilding", "--steps", "100",
                         "--call-timeout", "0.5", "--quiet", "--out", str(tmp_path / "out"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "HangBuilding: construction (while building and probing it) did not return" in done.stdout + done.stderr
    assert "counterexample: no events (it hung before the first)" in done.stdout
    assert (tmp_path / "out" / "warm-up" / "trace.jsonl").exists()


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_call_timeout_is_a_usage_error(value: str) -> None:
    done, _ = _schedspec("check", "--steps", "10", "--call-timeout", value)
    assert done.returncode == 2 and "--call-timeout" in done.stderr


@posix_only
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_check_with_a_summary_and_its_exit_status(
        sig: signal.Signals, status: int, tmp_path: Path) -> None:
    marker = tmp_path / "scheduling"
    proc = subprocess.Popen(
        [sys.executable, "-m", "schedspec", "check", "--against", "hanging_schedulers:Marker", "--steps", "1000000",
         "--quiet", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "s.json"), "--junit",
         str(tmp_path / "j.xml")],
        cwd=ROOT, env=_env(SCHEDSPEC_TEST_MARKER=str(marker)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "the check never started scheduling"
        time.sleep(2.0)  # into the run (how far depends on the machine's load)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, out + err
    assert "Traceback" not in err and "Traceback" not in out, err
    name = sig.name
    assert re.search(rf"interrupted \({name}\) after \d+ steps in \d+ workloads?: no violation so far", out), out
    assert "rule coverage:" in out  # the coverage so far
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["result"] == "interrupted" and summary["interrupted"]["signal"] == name
    assert summary["interrupted"]["exit_status"] == status
    suite = ElementTree.parse(tmp_path / "j.xml").getroot()
    assert suite.get("errors") == "1" and suite.get("failures") == "0"
    case = suite.find("testcase")
    assert case is not None and case.find("error") is not None
    assert "no violation so far" in (case.find("error").get("message") or "")  # type: ignore[union-attr]


def test_the_json_folder_is_created_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "not" / "yet" / "s.json"
    done, _ = _schedspec("check", "--steps", "50", "--kv", "none", "--quiet", "--json", str(path),
                         "--junit", str(tmp_path / "j" / "j.xml"), "--out", str(tmp_path / "o" / "p"))
    assert done.returncode == 0, done.stderr
    assert json.loads(path.read_text())["result"] == "pass"
    assert (tmp_path / "j" / "j.xml").exists()


@pytest.mark.parametrize("flag", ["--json", "--junit", "--out", "--coverage"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(flag: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    bad = blocker / "x" / "out.json"
    against = ["--against", "vllm"] if flag == "--coverage" else []
    if flag == "--coverage" and not _vllm_available():
        pytest.skip("--coverage measures vLLM's scheduler: vLLM is not installed")
    outs = {"--json": [], "--junit": [], "--out": [], "--coverage": ["--out", str(tmp_path / "o")]}
    done, elapsed = _schedspec("check", *against, "--steps", "200000", "--quiet", flag, str(bad), *outs[flag])
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{flag} {bad}" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "OK:" not in done.stdout and elapsed < 60  # refused before 200,000 steps


def test_an_output_file_path_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    done, _ = _schedspec("check", "--steps", "100", "--json", str(tmp_path))
    assert done.returncode == 2 and f"--json {tmp_path}: is a folder" in done.stderr


@pytest.mark.parametrize("command", [["modelcheck", "--bound", "small"], ["replay", "vectors"]])
def test_modelcheck_takes_the_deadline_flag_and_checks_its_outputs(command: list[str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x\n")
    if command[0] == "modelcheck":
        done, _ = _schedspec(*command, "--json", str(blocker / "m.json"))
        assert done.returncode == 2 and "--json" in done.stderr, done.stderr
    done, _ = _schedspec(*command, "--call-timeout", "-2")
    assert done.returncode == 2 and "--call-timeout" in done.stderr


def _vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@posix_only
def test_equivalence_reports_a_hang_as_a_finding(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done, _ = _schedspec("equivalence", "--against", "hanging_schedulers:HangLoop", "--workloads", "1",
                         "--call-timeout", "0.5", "--no-negative", "--quiet", "--out", str(tmp_path / "o"),
                         timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: w0/" in done.stdout and "HangLoop.schedule() did not return" in done.stdout, done.stdout
    assert "(step 5)" in done.stdout


def test_equivalence_checks_its_outputs_and_its_deadline_flag_first(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    blocker = tmp_path / "a-file"
    blocker.write_text("x\n")
    done, _ = _schedspec("equivalence", "--workloads", "1", "--png", str(blocker / "m.png"))
    assert done.returncode == 2 and f"--png {blocker / 'm.png'}" in done.stderr, done.stderr
    done, _ = _schedspec("equivalence", "--workloads", "1", "--call-timeout", "-1")
    assert done.returncode == 2 and "--call-timeout" in done.stderr


@posix_only
def test_modelcheck_reports_a_hang_with_a_trace_whose_replay_hangs_the_same(tmp_path: Path) -> None:
    done, _ = _schedspec("modelcheck", "--against", "hanging_schedulers:HangLoop", "--bound", "small",
                         "--call-timeout", "0.5", "--quiet", "--out", str(tmp_path / "mc"), timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "timeout: hanging_schedulers:HangLoop.schedule() did not return" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr
    replay = re.search(r"replay it: schedspec replay (\S+) --against hanging_schedulers:HangLoop --call-timeout 0.5",
                       done.stdout)
    assert replay is not None, done.stdout
    again, _ = _schedspec("replay", replay.group(1), "--against", "hanging_schedulers:HangLoop",
                          "--call-timeout", "0.5")
    assert again.returncode == 1 and "HangLoop.schedule() did not return" in again.stdout, again.stdout


def test_ctrl_c_outside_a_run_is_exit_130_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import schedspec.cli.invariants as command
    from schedspec.cli.main import main

    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "run", interrupted)
    assert main(["invariants"]) == 130
    assert "interrupted (SIGINT)" in capsys.readouterr().err
