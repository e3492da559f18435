"""The check's dense phase (schedspec/check/dense_phase.py): a run starts with
short core workloads on a small vocabulary, then one long core workload and
the swarm, so a core bug of a full-featured scheduler is met in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schedspec.adapters.registry import impl_capabilities
from schedspec.check import dense_phase, gate
from schedspec.check import trace as tracefile
from schedspec.check.features import MODES
from schedspec.check.workload import Workload
from schedspec.cli.main import main
from schedspec.impl import ImplScheduler
from schedspec.spec.scheduler import SpecScheduler


def test_the_phase_is_sized_to_the_run() -> None:
    first, steps = dense_phase.DENSE_FIRST, dense_phase.DENSE_STEPS
    assert dense_phase.dense_first(None, 200) == dense_phase.dense_first(20000, 200) == first
    assert dense_phase.dense_first(2000, 200) == 2000 // 4 // steps  # a quarter of a short run
    assert dense_phase.dense_first(100, 200) == dense_phase.dense_first(799, 200) == 0  # under four workloads
    assert dense_phase.dense_first(None, steps) == 0  # workloads no longer than the phase's: none
    # after it, one long core workload, then one in CORE_EVERY
    assert dense_phase.core_first_after(gate.CORE_FIRST, first) == 1
    assert dense_phase.core_first_after(gate.CORE_FIRST, 0) == gate.CORE_FIRST


def test_a_run_starts_with_short_core_workloads_on_the_small_vocabulary(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made: list[tuple[bool, int, int, Workload]] = []
    real = gate.make_workload

    def make(settings: gate.CheckSettings, seed: int, n: int, counts: Any, core: bool = False, swarm: int = -1) -> Workload:
        made.append((core, n, settings.vocab, real(settings, seed, n, counts, core, swarm)))
        return made[-1][3]
    monkeypatch.setattr(gate, "make_workload", make)
    monkeypatch.setattr(dense_phase, "DENSE_FIRST", 4)
    settings = gate.CheckSettings(against="impl", total_steps=4 * (4 * 40), workload_steps=60,
                                  capabilities=impl_capabilities(), modes=MODES, out_dir=tmp_path)
    assert gate.run_check({"spec": SpecScheduler, "impl": ImplScheduler}, settings).failure is None
    dense = made[:4]
    assert [(core, n, vocab) for core, n, vocab, _ in dense] == [(True, 40, dense_phase.DENSE_VOCAB)] * 4
    for _, _, _, w in dense:
        assert not [f for f in w.features if f.startswith(("gate:", "kv:"))] and not w.config.async_scheduling
    rest = made[4:]
    assert [core for core, _, _, _ in rest] == [gate.is_core(i, 1) for i in range(len(rest))]
    # each of the workload length, the last one the steps the goal has left
    assert all(n == 60 for _, n, _, _ in rest[:-1]) and 0 < rest[-1][1] <= 60
    assert all(vocab == settings.vocab for _, _, vocab, _ in rest)


def test_eos_despite_ignore_eos_is_caught_in_the_phase_and_replays(tmp_path: Path) -> None:
    """The bug needs an ignore_eos request to sample its eos: spread over every
    mode, gate and KV feature impl declares, the check took 10,090 steps (60 s)
    to meet it; the dense phase meets it in about 1,100."""
    out = tmp_path / "summary.json"
    against = "tests.bugzoo.zoo_full:EosDespiteIgnoreEos"
    rc = main(["check", "--against", against, "--steps", "8000", "--quiet", "--shrink-time", "5",
               "--json", str(out), "--out", str(tmp_path / "out")])
    assert rc == 1
    summary = json.loads(out.read_text())
    assert summary["steps"] < 2 * dense_phase.DENSE_FIRST * dense_phase.DENSE_STEPS
    trace_path = summary["failure"]["trace"]
    assert tracefile.read(Path(trace_path)).vocab == dense_phase.DENSE_VOCAB  # the trace says its vocabulary
    assert main(["replay", trace_path, "--against", against]) == 1
    assert main(["replay", trace_path, "--against", "impl"]) == 0
