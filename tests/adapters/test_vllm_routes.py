"""Every route takes a vLLM Scheduler or AsyncScheduler subclass as ``check``
does, running what the class supports and listing what was skipped:
``equivalence`` (and it catches a bug-zoo defect written as a subclass of
each), ``replay`` (a trace in the other mode is turned, with a note),
``modelcheck`` (a bound it cannot run names the bounds it can) and the pytest
API (SchedulerContract). Small runs: one workload of a tiny random model on
the CPU, a few Hypothesis examples."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from hypothesis import HealthCheck, settings  # noqa: E402

from schedspec.check import trace as tracefile  # noqa: E402
from schedspec.check.workload import AddRequest, KVLoadFailed, Step, Workload  # noqa: E402
from schedspec.cli.main import main  # noqa: E402
from schedspec.spec.interface import RequestSpec, SchedulerConfig  # noqa: E402
from schedspec.testing import SchedulerContract  # noqa: E402

MOD = "tests.adapters.vllm_subclasses"
SMALL = ["--model", "random:seed=1,vocab=256,hidden=64,layers=1", "--workloads", "1", "--mode", "fast",
         "--device", "cpu", "--max-model-len", "64", "--no-negative", "--no-connector", "--quiet"]


def _equivalence(cls: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["equivalence", "--against", f"{MOD}:{cls}", *SMALL, "--out", str(tmp_path)])
    return rc, capsys.readouterr().out


def test_equivalence_runs_a_scheduler_subclass_skipping_the_async_variants(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _equivalence("Plain", tmp_path, capsys)
    assert rc == 0, out
    assert "EQUIVALENT" in out and "chunked-budget" in out
    assert "skipped, unsupported by the scheduler: async (needs async_scheduling=True)" in out
    assert "async-spec-all (needs async_scheduling=True)" in out


def test_equivalence_runs_an_async_scheduler_subclass_with_async_scheduling_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _equivalence("PlainAsync", tmp_path, capsys)
    assert rc == 0, out
    assert "run with async scheduling on (the scheduler schedules only asynchronously): baseline, chunked-budget" in out
    assert "skipped, unsupported" not in out and "async-spec-all" in out


@pytest.mark.parametrize("cls", ["ShortChunk", "ShortChunkAsync"])
def test_equivalence_catches_a_broken_vllm_subclass(cls: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _equivalence(cls, tmp_path, capsys)
    assert rc == 1, out
    assert "NOT EQUIVALENT" in out and "DIVERGED w0/chunked-budget" in out
    # a variant whose run stalls is a failed comparison, not a traceback
    assert "stall" in out and (tmp_path / "equivalence-seed0.json").exists()


def test_replay_turns_a_sync_trace_for_an_async_scheduler_subclass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = SchedulerConfig(block_size=1, num_blocks=13, max_num_batched_tokens=16, max_num_seqs=3, max_model_len=12,
                          kv_connector=True, kv_load_failure_policy="recompute")
    req = RequestSpec("r", (0, 0, 0, 3), 2, kv_external_tokens=2)
    path = tmp_path / "t.jsonl"
    tracefile.write(path, tracefile.Trace(Workload(cfg, (AddRequest(req), KVLoadFailed("r"), Step(), Step()))))
    assert main(["replay", str(path), "--against", f"{MOD}:PlainAsync"]) == 0
    out = capsys.readouterr().out
    assert "schedules only asynchronously: replayed in that mode" in out and "OK: replayed" in out
    # the synchronous scheduler takes it as it is
    assert main(["replay", str(path), "--against", f"{MOD}:Plain"]) == 0
    assert "NOTE" not in capsys.readouterr().out
    # and an async trace is turned synchronous for it
    tracefile.write(path, tracefile.Trace(Workload(dataclasses.replace(cfg, async_scheduling=True),
                                                   (AddRequest(req), Step(), Step()))))
    assert main(["replay", str(path), "--against", f"{MOD}:Plain"]) == 0
    assert "schedules only synchronously" in capsys.readouterr().out


def test_modelcheck_names_the_bounds_an_async_scheduler_subclass_can_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["modelcheck", "--against", f"{MOD}:PlainAsync", "--quiet"]) == 2
    assert "the bounds with spaces it supports: --bound modes (3 spaces)" in capsys.readouterr().err
    assert main(["modelcheck", "--against", f"{MOD}:PlainAsync", "--bound", "modes", "--space",
                 "async-fcfs-tight-1req", "--max-states", "200", "--workers", "1", "--quiet"]) == 0
    assert "spaces outside the declared capabilities, left out" not in capsys.readouterr().out


_TINY = settings(max_examples=2, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck),
                 database=None)


@pytest.mark.parametrize("cls", ["Plain", "PlainAsync"])
def test_the_pytest_api_takes_a_vllm_subclass_in_the_mode_it_supports(cls: str) -> None:
    import importlib

    target = getattr(importlib.import_module(MOD), cls)
    case = type(f"Test{cls}", (SchedulerContract,), {"scheduler": target, "hypothesis_settings": _TINY})
    case("test_scheduler_meets_the_contract").test_scheduler_meets_the_contract()
