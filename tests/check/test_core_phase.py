"""The check's core phase (schedspec/check/gate.py, is_core): the first workloads
of a run, and one in every few after, are synchronous with no gate and no KV
feature, aimed at the core's rules by their own counts, so a core bug of a
full-featured scheduler is met as soon as on a scheduler with nothing else to draw."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schedspec.adapters.registry import impl_capabilities
from schedspec.check import gate
from schedspec.check.features import MODES
from schedspec.check.workload import Workload
from schedspec.cli.main import main
from schedspec.impl import ImplScheduler
from schedspec.spec.scheduler import SpecScheduler


def test_the_phase_is_the_first_workloads_then_one_in_every_few() -> None:
    assert [gate.is_core(i) for i in range(gate.CORE_FIRST)] == [True] * gate.CORE_FIRST
    after = [gate.is_core(i) for i in range(gate.CORE_FIRST, gate.CORE_FIRST + 3 * gate.CORE_EVERY)]
    assert after.count(True) == 3
    # a time budget or a long run: the whole first phase; a short run: a quarter of it first
    assert gate.core_first(None, 200) == gate.core_first(20000, 200) == gate.CORE_FIRST
    assert gate.core_first(2000, 200) == 2 and gate.core_first(100, 200) == 1


def test_core_workloads_draw_nothing_but_the_core_and_the_others_everything(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made: list[tuple[bool, Workload]] = []
    real = gate.make_workload

    def make(settings: gate.CheckSettings, seed: int, n: int, counts: Any, core: bool = False, swarm: int = -1) -> Workload:
        made.append((core, real(settings, seed, n, counts, core, swarm)))
        return made[-1][1]
    monkeypatch.setattr(gate, "make_workload", make)
    settings = gate.CheckSettings(against="impl", total_steps=(gate.CORE_FIRST + 6) * 20, workload_steps=20,
                                  capabilities=impl_capabilities(), modes=MODES, out_dir=tmp_path)
    outcome = gate.run_check({"spec": SpecScheduler, "impl": ImplScheduler}, settings)
    assert outcome.failure is None
    first = gate.core_first(settings.total_steps, settings.workload_steps)
    assert [c for c, _ in made] == [gate.is_core(i, first) for i in range(len(made))]
    for core, w in made:
        drawn = [f for f in w.features if f.startswith(("gate:", "kv:"))]
        if core:
            assert drawn == [] and not w.config.async_scheduling and not w.config.num_speculative_tokens
            assert w.name.endswith(", core")
        else:
            assert not w.name.endswith(", core")
    others = [w for core, w in made if not core]
    assert any(f.startswith(("gate:", "kv:")) for w in others for f in w.features)


def test_a_core_bug_of_a_full_featured_scheduler_is_caught_early(tmp_path: Path) -> None:
    """PRIORITY's skipped running request (vLLM #49097) in impl with every mode,
    gate and KV feature declared: spread over them it survived 4,000 steps; the
    core phase meets it in the second workload."""
    rc = main(["check", "--against", "tests.bugzoo.zoo_full:PrioritySkipAfterPreempt", "--steps", "4000",
               "--quiet", "--shrink-time", "5", "--out", str(tmp_path)])
    assert rc == 1


def test_the_docs_say_the_phase_as_the_code_sets_it() -> None:
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "coverage.md").read_text().split())
    words = {2: "two", 3: "three", 4: "four"}
    assert f"the first {gate.CORE_FIRST} workloads of a run (a quarter of a shorter run" in doc
    assert f"then one in {words[gate.CORE_EVERY]}, are synchronous" in doc
