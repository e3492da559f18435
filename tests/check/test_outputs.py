"""The default check draws the KV cache events and the statistics on for a
share of the workloads where the scheduler declares them (check/outputs.py);
--kv-events / --stats turn them on in every workload, --no-kv-events /
--no-stats off."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from schedspec.check.capabilities import FULL
from schedspec.check.outputs import SHARE, outputs_on, with_outputs
from schedspec.check.workload import Workload
from schedspec.cli.main import main
from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler

BOTH = dataclasses.replace(FULL, kv_events=True, stats=True)


def cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_the_default_draws_each_output_for_a_share_of_the_workloads() -> None:
    draws = [outputs_on(None, None, BOTH, seed) for seed in range(400)]
    events = sum(e for e, _ in draws) / len(draws)
    stats = sum(s for _, s in draws) / len(draws)
    assert abs(events - SHARE) < 0.08 and abs(stats - SHARE) < 0.08
    assert {(True, False), (False, True), (True, True), (False, False)} <= set(draws)  # independent
    assert draws == [outputs_on(None, None, BOTH, seed) for seed in range(400)]  # by the seed alone


def test_a_setting_is_obeyed_and_an_undeclared_output_stays_off() -> None:
    assert all(outputs_on(True, True, BOTH, s) == (True, True) for s in range(50))
    assert all(outputs_on(False, False, BOTH, s) == (False, False) for s in range(50))
    assert all(outputs_on(True, None, FULL, s) == (False, False) for s in range(50))


def test_with_outputs_turns_the_events_on_and_builds_with_log_stats() -> None:
    w = Workload(SchedulerConfig(), ())
    same, factories = with_outputs(w, {"a": SpecScheduler}, False, False)
    assert same is w and factories["a"] is SpecScheduler
    on, factories = with_outputs(w, {"a": SpecScheduler}, True, True)
    assert on.config.enable_kv_cache_events
    assert factories["a"](SchedulerConfig()).make_stats() is not None  # type: ignore[attr-defined]


def test_the_default_check_compares_events_and_statistics_and_the_flags_turn_them_off(tmp_path: Path) -> None:
    base = ["check", "--against", "impl", "--steps", "800", "--workload-steps", "100", "--quiet",
            "--gates", "none", "--kv", "none", "--out", str(tmp_path)]
    rc, out = cli([*base, "--json", str(tmp_path / "on.json")])
    assert rc == 0, out
    on = json.loads((tmp_path / "on.json").read_text())["stats"]
    assert 0 < on["stats_reports"] < on["steps"]  # a share of the workloads
    assert "make_stats() reports compared" in out and "on in a share of the workloads" in out
    rc, out = cli([*base, "--no-kv-events", "--no-stats", "--events", str(tmp_path / "e.jsonl")])
    assert rc == 2 and "--no-kv-events: contradicts --events" in out
    rc, out = cli([*base, "--no-kv-events", "--no-stats", "--json", str(tmp_path / "off.json")])
    assert rc == 0, out
    off = json.loads((tmp_path / "off.json").read_text())["stats"]
    assert "stats_reports" not in off and "make_stats()" not in out and "KV cache events off" in out


@pytest.mark.parametrize("flag", ["--kv-events", "--stats"])
def test_on_and_off_together_is_a_usage_error(flag: str, tmp_path: Path) -> None:
    rc, out = cli(["check", "--against", "impl", flag, "--no-" + flag[2:], "--steps", "10", "--quiet",
                   "--out", str(tmp_path)])
    assert rc == 2 and f"--no-{flag[2:]}: contradicts {flag}" in out


def test_the_default_check_finds_a_miscounting_class_and_its_replay_takes_stats(tmp_path: Path) -> None:
    against = ["--against", "tests.support.buggy_schedulers:MiscountedPreemptions"]
    rc, out = cli(["check", *against, "--steps", "2000", "--quiet", "--out", str(tmp_path), "--shrink-time", "5"])
    assert rc == 1 and "stats-preemptions-counted" in out
    replay = next(line for line in out.splitlines() if line.startswith("replay it: "))
    assert replay.endswith(" --stats")
    rc, out = cli(["check", *against, "--steps", "2000", "--quiet", "--out", str(tmp_path / "off"), "--no-stats"])
    assert rc == 0, out


def test_a_sweep_workload_has_both_outputs_on_unless_turned_off_or_undeclared() -> None:
    assert all(outputs_on(None, None, BOTH, s, sweep=True) == (True, True) for s in range(50))
    assert all(outputs_on(False, False, BOTH, s, sweep=True) == (False, False) for s in range(50))
    assert all(outputs_on(None, None, FULL, s, sweep=True) == (False, False) for s in range(50))
    # the other workloads' draws are the ones they had
    assert [outputs_on(None, None, BOTH, s) for s in range(50)] == [
        outputs_on(None, None, BOTH, s, sweep=False) for s in range(50)]
