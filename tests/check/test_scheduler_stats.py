"""The scheduler statistics in a check: the driver compares each update's
make_stats() and hands them to the invariants; ``check --stats`` builds the
schedulers with log_stats and refuses one that does not declare them."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest

from schedspec.check.capabilities import FULL
from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.check.scheduler_stats import StatsUnsupported, stats_factories, with_stats
from schedspec.cli.main import main
from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler
from schedspec.spec.stats import SchedulerStats


class SameStats(SpecScheduler):
    """Reports the spec's statistics through an override (a second class, equal numbers)."""

    def make_stats(self) -> Any:
        stats = super().make_stats()
        return None if stats is None else dataclasses.replace(stats, num_running_reqs=stats.num_running_reqs)


class WrongCount(SpecScheduler):
    """Reports a waiting count one too high once anything waits."""

    def make_stats(self) -> Any:
        stats = super().make_stats()
        if stats is None or not stats.num_waiting_reqs:
            return stats
        return dataclasses.replace(stats, num_waiting_reqs=stats.num_waiting_reqs + 1)


class NotStats(SpecScheduler):
    def make_stats(self) -> Any:
        return {"num_running_reqs": 1}


def run(factories: dict[str, Any], seed: int = 3, invariants: bool = True) -> tuple[Runner, Any]:
    w = random_workload(seed, 150)
    r = Runner(w.config, factories, oracle_seed=seed, check_invariants=invariants)
    return r, r.run(w.events)


def test_equal_statistics_are_compared_once_per_update() -> None:
    r, failure = run({"a": with_stats(SpecScheduler), "b": with_stats(SameStats)})
    assert failure is None and r.stats.stats_reports == r.stats.steps > 0


def test_without_log_stats_nothing_is_compared() -> None:
    r, failure = run({"a": SpecScheduler, "b": WrongCount})
    assert failure is None and r.stats.stats_reports == 0


def test_different_statistics_are_a_divergence_naming_make_stats() -> None:
    _, failure = run({"a": with_stats(SpecScheduler), "b": with_stats(WrongCount)}, invariants=False)
    assert failure is not None and failure.kind == "divergence" and failure.scheduler == "b"
    assert "make_stats()" in failure.message


def test_a_wrong_count_alone_breaks_the_queue_invariant() -> None:
    _, failure = run({"b": with_stats(WrongCount)})
    assert failure is not None and failure.kind == "violation"
    assert {v.invariant_id for v in failure.violations} == {"stats-queue-counts"}


def test_statistics_of_the_wrong_type_are_an_error_naming_the_method() -> None:
    _, failure = run({"b": with_stats(NotStats)})
    assert failure is not None and failure.kind == "error" and "make_stats" in failure.message
    assert SchedulerStats.__name__ in failure.message


def test_stats_factories_refuse_a_scheduler_that_does_not_declare_them() -> None:
    caps = dataclasses.replace(FULL, stats=True)
    assert set(stats_factories({"a": SpecScheduler}, {"a": caps})) == {"a"}
    with pytest.raises(StatsUnsupported, match="b does not report scheduler statistics"):
        stats_factories({"a": SpecScheduler, "b": SpecScheduler}, {"a": caps, "b": FULL})


def cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_check_stats_against_impl_compares_every_update(tmp_path: Path) -> None:
    rc, out = cli(["check", "--against", "impl", "--stats", "--steps", "300", "--quiet", "--out", str(tmp_path),
                   "--json", str(tmp_path / "s.json")])
    assert rc == 0, out
    assert "stats: " in out and "make_stats() reports compared" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert "stats_reports" in json.dumps(summary)


def test_check_stats_refuses_a_class_without_the_capability(tmp_path: Path) -> None:
    rc, out = cli(["check", "--against", "schedspec.spec.scheduler:SpecScheduler", "--stats", "--steps", "10",
                   "--quiet", "--out", str(tmp_path)])
    assert rc == 2 and "--stats: " in out and "does not report scheduler statistics" in out


def test_check_stats_finds_a_miscounting_class(tmp_path: Path) -> None:
    rc, out = cli(["check", "--against", "tests.support.buggy_schedulers:MiscountedPreemptions", "--stats",
                   "--steps", "2000", "--quiet", "--out", str(tmp_path), "--shrink-time", "5"])
    assert rc == 1 and "stats-preemptions-counted" in out
    replay = next(line for line in out.splitlines() if line.startswith("replay it: "))
    assert replay.endswith(" --stats")
    trace = next(tmp_path.glob("*/trace.jsonl"))
    against = ["--against", "tests.support.buggy_schedulers:MiscountedPreemptions"]
    assert cli(["replay", str(trace), *against, "--stats"])[0] == 1
    assert cli(["replay", str(trace), *against])[0] == 0  # built without log_stats: no statistics


def test_the_stats_capability_restricts_nothing_and_round_trips() -> None:
    from schedspec.check.capabilities import Capabilities

    caps = dataclasses.replace(FULL, stats=True)
    assert caps.is_full and caps.missing() == FULL.missing()  # no draw depends on it
    assert Capabilities.from_dict(caps.to_dict()) == caps
    from schedspec.adapters.registry import resolve as resolve_target

    assert all(resolve_target(n).capabilities.stats for n in ("spec", "impl", "vllm"))
