"""The model checker holding another scheduler to the spec: ``--against``.

Every explored transition is taken by the scheduler under test from the same
state: in lockstep its plans and views must equal the spec's, in invariants
mode the chosen invariants must hold on its own transitions. It is copied by
its clone(), a pickle, a deepcopy or, failing all, replayed from the root.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from schedspec.adapters.registry import resolve
from schedspec.check.capabilities import Capabilities
from schedspec.cli.main import main
from schedspec.invariants import select
from schedspec.modelcheck import Explorer, bound
from schedspec.modelcheck.space import Space
from schedspec.modelcheck.target import Against, copy_method
from schedspec.spec.interface import StepPlan
from schedspec.spec.scheduler import SpecScheduler

HERE = Path(__file__).resolve().parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REQUIRE_VLLM = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


def _space(name: str) -> Space:
    return next(s for s in bound("small").spaces if s.name == name)


class CrashOnReset(SpecScheduler):
    """Crashes in reset_prefix_cache()."""

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        raise RuntimeError("boom")


class NoCopy(SpecScheduler):
    """The spec, but neither clonable, picklable nor deep-copyable (it holds a
    generator): the checker must replay it from the root."""

    clone = None  # type: ignore[assignment]

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.gen = (i for i in range(1))


class OldestVictim(SpecScheduler):
    """Under FCFS, preempts the FIRST running request instead of the last:
    then a step can preempt the only request it could have served and
    schedule nothing (the safety invariant ``progress`` catches it)."""

    def schedule(self) -> StepPlan:
        import schedspec.spec.scheduler as mod

        original = getattr(mod, "choose_victim")
        setattr(mod, "choose_victim", lambda policy, running_keys: 0)
        try:
            return super().schedule()
        finally:
            setattr(mod, "choose_victim", original)


def test_against_impl_takes_every_transition_like_the_default_differential() -> None:
    space = _space("fcfs-cache-salt-tight")
    default = Explorer(space, impl_cls=resolve("impl").factory).run()
    r = Explorer(space, against=Against("impl", resolve("impl").factory)).run()
    assert r.complete and r.failure is None
    assert (r.states, r.transitions) == (default.states, default.transitions)
    assert r.impl_transitions == r.transitions and r.against == "impl" and r.mode == "lockstep"


def test_a_diverging_scheduler_is_caught_and_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["modelcheck", "--against", "test_against:OldestVictim", "--space", "fcfs-cache-tight",
               "--out", str(tmp_path), "--quiet", "--workers", "1"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "divergence" in out and "test_against:OldestVictim" in out
    assert "--against test_against:OldestVictim" in out  # the replay command names it


def test_invariants_mode_accepts_another_policy_and_rejects_unsafe_ones() -> None:
    from tests.modelcheck.test_modelcheck import KeyedToFront  # frees cached blocks to the front: a policy, not a safety, difference

    space = _space("fcfs-cache-tight")
    safety = select(None, "invariants")
    ok = Explorer(space, against=Against("keyed-front", KeyedToFront, "invariants", safety)).run()
    assert ok.complete and ok.failure is None and ok.mode == "invariants"
    assert ok.impl_transitions == ok.transitions
    lockstep = Explorer(space, against=Against("keyed-front", KeyedToFront)).run()
    assert lockstep.failure is not None and lockstep.failure.kind == "divergence"
    stuck = Explorer(space, against=Against("oldest", OldestVictim, "invariants", safety)).run()
    assert stuck.failure is not None and "oldest after schedule" in stuck.failure.message
    assert [v.invariant_id for v in stuck.failure.violations] == ["progress"]
    crash = Explorer(space, against=Against("crashy", CrashOnReset, "invariants", safety)).run()
    assert crash.failure is not None and crash.failure.kind == "error"
    assert "crashy.reset_prefix_cache() raised RuntimeError: boom" in crash.failure.message
    assert crash.failure.labels == ("reset",)  # the shortest path: the first reset


def test_a_scheduler_that_cannot_be_copied_is_replayed() -> None:
    assert copy_method(NoCopy(_space("fcfs-cache-salt-tight").config)) == "replay"
    space = _space("fcfs-cache-salt-tight")
    ref = Explorer(space, impl_cls=SpecScheduler, max_states=400).run()
    for workers in (1, 2):
        r = Explorer(space, against=Against("nocopy", NoCopy), max_states=400, workers=workers).run()
        assert r.copy == "replay" and r.failure is None
        assert (r.states, r.transitions) == (ref.states, ref.transitions)


def test_bad_against_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in [
        (["--against", "spec"], "--against spec"),
        (["--mode", "invariants"], "--mode invariants needs --against"),
        (["--against", "impl", "--no-impl"], "--no-impl and --against"),
        (["--against", "impl", "--invariants", "no-such-invariant"], "--invariants"),
        (["--against", "nosuchmodule:Cls"], "nosuchmodule"),
    ]:
        assert main(["modelcheck", "--quiet", *argv]) == 2, argv
        assert needle in capsys.readouterr().err, argv


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE_VLLM, reason="vLLM is not installed (scripts/install_vllm.sh); "
                    "set SCHEDSPEC_REQUIRE_VLLM=1 to fail instead of skipping")
def test_small_bound_against_vllm_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mc.json"
    rc = main(["modelcheck", "--against", "vllm", "--bound", "small", "--json", str(out), "--quiet",
               "--out", str(tmp_path / "cx")])
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(out.read_text())
    assert data["result"] == "pass" and data["against"] == "vllm" and data["mode"] == "lockstep"
    assert [s["space"]["name"] for s in data["spaces"]] == [s.name for s in bound("small").spaces]
    for s in data["spaces"]:
        assert s["complete"] and s["impl_transitions"] == s["transitions"] > s["states"] > 1000
        assert s["copy"] == "deepcopy"


class NoAdminEvents(SpecScheduler):
    """Takes neither aborts nor resets, and says so."""

    CAPABILITIES = Capabilities(abort=False, reset_prefix_cache=False)

    def abort(self, request_id: str) -> None:
        raise NotImplementedError("no aborts")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        raise NotImplementedError("no resets")


def test_events_outside_the_declared_capabilities_are_not_explored(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["modelcheck", "--against", "test_against:NoAdminEvents", "--mode", "invariants",
               "--space", "fcfs-cache-salt-tight", "--quiet", "--workers", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    r = Explorer(_space("fcfs-cache-salt-tight"), against=Against("n", NoAdminEvents, aborts=False, resets=False)).run()
    full = Explorer(_space("fcfs-cache-salt-tight"), invariants=()).run()
    assert r.complete and r.failure is None and r.transitions < full.transitions and r.states < full.states
