"""The check's narrow workloads (schedspec/check/narrow.py): after the first
phase, one workload in NARROW_EVERY is a random workload of one family, the
families in rotation, inserted between the core and guided ones, so a path that needs one feature under pressure is met
without waiting behind every other draw of a guided workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schedspec.adapters.registry import impl_capabilities
from schedspec.check import gate, narrow
from schedspec.check.features import MODES
from schedspec.check.workload import AddRequest, Workload
from schedspec.impl import ImplScheduler
from schedspec.spec.scheduler import SpecScheduler


def _settings(tmp_path: Path, **kw: Any) -> gate.CheckSettings:
    return gate.CheckSettings(against="impl", capabilities=impl_capabilities(), modes=MODES, out_dir=tmp_path, **kw)


def test_the_rotation_is_every_family_the_scheduler_supports(tmp_path: Path) -> None:
    full = _settings(tmp_path)
    assert narrow.families(full.drawn_kv, full.drawn_engine) == (
        "plain", "kv:connector", "kv:hybrid", "sessions", "pipeline", "runner")
    only = _settings(tmp_path, kv=("hybrid",), engine=("sessions", "drafter"))
    assert narrow.families(only.drawn_kv, only.drawn_engine) == ("plain", "kv:hybrid", "sessions")
    assert narrow.families((), ()) == ("plain",)


def test_a_run_random_throughout_has_no_narrow_turn(tmp_path: Path) -> None:
    assert not _settings(tmp_path).random_throughout
    for kw in ({"generator": "random"}, {"sessions": True}, {"pipeline": True}, {"runner": True}):
        assert _settings(tmp_path, **kw).random_throughout


def test_the_turns_come_after_the_first_phase_one_in_narrow_every() -> None:
    every = narrow.NARROW_EVERY
    kinds, base, turns = [], 0, 0
    for _ in range(5 + 4 * every):
        if narrow.is_narrow(base, 5, turns):
            kinds.append("narrow")
            turns += 1
        else:
            kinds.append("other")
            base += 1
    assert kinds[:5] == ["other"] * 5 and kinds[5] == "narrow"
    assert kinds[5:] == (["narrow"] + ["other"] * (every - 1)) * 4


@pytest.mark.parametrize("turn,family", list(enumerate(("plain", "kv:connector", "kv:hybrid", "sessions",
                                                         "pipeline", "runner"))))
def test_each_turn_draws_its_family_and_nothing_of_the_others(tmp_path: Path, turn: int, family: str) -> None:
    settings = _settings(tmp_path)
    rotation = narrow.families(settings.drawn_kv, settings.drawn_engine)
    seen = []
    for seed in range(12):
        w = narrow.narrow_workload(seed, 30, rotation[turn], settings.vocab, settings.drawn_modes,
                                   settings.drawn_gates, settings.capabilities.always_gates())
        assert w.name == "narrow" and w.features[0] == f"family:{family}"
        c = w.config
        connector, hybrid = c.kv_connector, bool(c.kv_cache_groups)
        sessions = any(isinstance(e, AddRequest) and e.request.resumable for e in w.events)
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

    def narrowed(seed: int, n: int, family: str, *rest: Any) -> Workload:
        kinds.append(f"narrow {family}")
        return real_narrow(seed, n, family, *rest)
    monkeypatch.setattr(gate, "make_workload", make)
    monkeypatch.setattr(gate, "narrow_workload", narrowed)
    settings = _settings(tmp_path, total_steps=60 * 20, workload_steps=20)
    outcome = gate.run_check({"spec": SpecScheduler, "impl": ImplScheduler}, settings)
    assert outcome.failure is None
    first = gate.core_first(settings.total_steps, settings.workload_steps)
    turns = [k for k in kinds if k.startswith("narrow")]
    rotation = narrow.families(settings.drawn_kv, settings.drawn_engine)
    assert turns == [f"narrow {rotation[t % len(rotation)]}" for t in range(len(turns))] and len(turns) >= 4, kinds
    base = done = 0
    for k in kinds:
        assert k.startswith("narrow") == narrow.is_narrow(base, first, done), (base, done, kinds)
        done += k.startswith("narrow")
        base += not k.startswith("narrow")
    others = [k for k in kinds if not k.startswith("narrow")]
    assert others == ["core" if gate.is_core(i, first) else "guided" for i in range(len(others))]


def test_the_core_and_guided_workloads_are_those_of_a_run_without_narrow_ones(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # narrow workloads take seeds of their own and stay out of the guided
    # focus's counts, so inserting them changes no other workload of the run
    real_make, real_families = gate.make_workload, gate.families

    def run(with_narrow: bool) -> tuple[list[tuple[int, Workload]], list[int]]:
        made: list[tuple[int, Workload]] = []

        def make(settings: gate.CheckSettings, seed: int, n: int, counts: Any, core: bool = False,
                 swarm: int = -1) -> Workload:
            made.append((seed, real_make(settings, seed, n, counts, core, swarm)))
            return made[-1][1]
        monkeypatch.setattr(gate, "make_workload", make)
        monkeypatch.setattr(gate, "families", real_families if with_narrow else lambda _kv, _engine: ())
        outcome = gate.run_check({"spec": SpecScheduler, "impl": ImplScheduler},
                                 _settings(tmp_path, total_steps=40 * 20, workload_steps=20))
        assert outcome.failure is None
        return made, outcome.seeds

    plain, plain_seeds = run(False)
    mixed, mixed_seeds = run(True)
    k = min(len(mixed), len(plain)) - 1  # the last one is cut to the steps the goal has left
    assert k > gate.CORE_FIRST // 2 and mixed[:k] == plain[:k]
    narrow_seeds = [s for s in mixed_seeds if s >= narrow.NARROW_SEEDS]
    assert narrow_seeds == [narrow.narrow_seed(0, t, 1, 1) for t in range(len(narrow_seeds))] and narrow_seeds
    assert [s for s in mixed_seeds if s < narrow.NARROW_SEEDS][:k] == plain_seeds[:k]


def test_the_docs_say_the_share_as_the_code_sets_it() -> None:
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "coverage.md").read_text().split())
    words = {2: "two", 3: "three", 4: "four"}
    assert f"after the first phase, one workload in {words[narrow.NARROW_EVERY]} is a plain random workload" in doc
    families = "(gates only, the connector, hybrid groups, sessions, a pipeline, the model runner)"
    full = _settings(Path("."))
    assert families in doc and len(narrow.families(full.drawn_kv, full.drawn_engine)) == families.count(",") + 1
