"""The check's narrow workloads (schedspec/check/narrow.py): after the first
phase, one workload in CORE_EVERY is a random workload of one family, the
families in rotation, so a path that needs one feature under pressure is met
without waiting behind every other draw of a guided workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schedspec.adapters.registry import impl_capabilities
from schedspec.check import gate, narrow
from schedspec.check.features import MODES
from schedspec.check.workload import Workload
from schedspec.impl import ImplScheduler
from schedspec.spec.scheduler import SpecScheduler


def _settings(tmp_path: Path, **kw: Any) -> gate.CheckSettings:
    return gate.CheckSettings(against="impl", capabilities=impl_capabilities(), modes=MODES, out_dir=tmp_path, **kw)


def test_the_rotation_is_every_family_the_scheduler_supports(tmp_path: Path) -> None:
    assert narrow.families(_settings(tmp_path)) == (
        "plain", "kv:connector", "kv:hybrid", "sessions", "pipeline", "runner")
    only = _settings(tmp_path, kv=("hybrid",), engine=("sessions", "drafter"))
    assert narrow.families(only) == ("plain", "kv:hybrid", "sessions")
    assert narrow.families(_settings(tmp_path, kv=(), engine=())) == ("plain",)


def test_a_random_run_has_no_narrow_turn(tmp_path: Path) -> None:
    assert narrow.has_narrow(_settings(tmp_path))
    for kw in ({"generator": "random"}, {"sessions": True}, {"pipeline": True}, {"runner": True}):
        assert not narrow.has_narrow(_settings(tmp_path, **kw))


def test_the_turns_are_after_the_first_phase_between_the_core_ones() -> None:
    every = gate.CORE_EVERY
    assert [narrow.is_narrow(i, 4, every) for i in range(4)] == [False] * 4
    after = [i for i in range(6, 6 + 4 * every) if narrow.is_narrow(i, 4, every)]
    assert len(after) == 4 and all(i % every == narrow.NARROW_OFFSET for i in after)
    assert every >= 3  # a core, a narrow and at least one guided workload in each
    assert not any(narrow.is_narrow(i, 0, every) and gate.is_core(i, 0) for i in range(30))


@pytest.mark.parametrize("turn,family", list(enumerate(("plain", "kv:connector", "kv:hybrid", "sessions",
                                                         "pipeline", "runner"))))
def test_each_turn_draws_its_family_and_nothing_of_the_others(tmp_path: Path, turn: int, family: str) -> None:
    settings = _settings(tmp_path)
    seen = []
    for seed in range(12):
        w = narrow.narrow_workload(settings, seed, 30, turn)
        assert w.name == "narrow" and w.features[0] == f"family:{family}"
        c = w.config
        connector, hybrid = c.kv_connector, bool(c.kv_cache_groups)
        sessions = any(getattr(e, "request", None) is not None and e.request.resumable for e in w.events)
        v2, k = c.model_runner == "v2", c.pipeline_parallel_size
        assert connector <= (family == "kv:connector") and hybrid <= (family == "kv:hybrid")
        assert sessions <= (family == "sessions")
        assert (k > 1) <= (family in ("pipeline", "runner")) and v2 <= (family == "runner")
        seen.append({"kv:connector": connector, "kv:hybrid": hybrid, "sessions": sessions,
                     "pipeline": k > 1, "runner": v2 or k > 1, "plain": True}[family])
    assert any(seen), f"no workload of turn {turn} drew {family}"


def test_a_guided_run_interleaves_them_and_they_run_clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    kinds: list[str] = []
    real_make, real_narrow = gate.make_workload, gate.narrow_workload

    def make(settings: gate.CheckSettings, seed: int, n: int, counts: Any, core: bool = False,
             swarm: int = -1) -> Workload:
        kinds.append("core" if core else "guided")
        return real_make(settings, seed, n, counts, core, swarm)

    def narrowed(settings: gate.CheckSettings, seed: int, n: int, turn: int) -> Workload:
        kinds.append(f"narrow {turn}")
        return real_narrow(settings, seed, n, turn)
    monkeypatch.setattr(gate, "make_workload", make)
    monkeypatch.setattr(gate, "narrow_workload", narrowed)
    settings = _settings(tmp_path, total_steps=60 * 20, workload_steps=20)
    outcome = gate.run_check({"spec": SpecScheduler, "impl": ImplScheduler}, settings)
    assert outcome.failure is None
    first = gate.core_first(settings.total_steps, settings.workload_steps)
    turns = [k for k in kinds if k.startswith("narrow")]
    assert turns == [f"narrow {t}" for t in range(len(turns))] and len(turns) >= 4, (first, kinds)
    for i, k in enumerate(kinds):
        assert k.startswith("narrow") == narrow.is_narrow(i, first, gate.CORE_EVERY)
