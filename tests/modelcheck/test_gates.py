"""The model checker with the admission gates (bound ``gates``), and what the
async and speculative-decoding spaces gained beside them: "prefix" draft
acceptance keyed on the tokens, invariants mode on async spaces, a space that
reaches the RUNNING loop's skip of a request with nothing to compute."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from schedspec.adapters.registry import resolve
from schedspec.check import trace as tracefile
from schedspec.check.capabilities import Capabilities
from schedspec.check.features import GATES
from schedspec.check.workload import Schedule
from schedspec.cli.main import main
from schedspec.invariants import CATALOGUE
from schedspec.modelcheck import BoundResult, Expander, Explorer, bound, check_bound, expected_memory
from schedspec.modelcheck.coverage import GATE_COVERAGE
from schedspec.modelcheck.events import STEP
from schedspec.modelcheck.model import MemoModel
from schedspec.modelcheck.space import Space
from schedspec.modelcheck.target import Against
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.interface import PauseState, StepPlan
from schedspec.spec.rule_names import RULES, reachable_in
from schedspec.spec.scheduler import SpecScheduler

HERE = Path(__file__).resolve().parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REQUIRE_VLLM = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"

#: Gate rules the gates bound does not reach, and why (docs/modelcheck.md,
#: "Admission gates").
UNREACHED_GATE_RULES = {
    # a preemption in the RUNNING loop after the preempted request's encoder
    # inputs were scheduled in the same step: needs a third running request
    "encoder.budget_given_back",
}


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


def _space(bound_name: str, name: str) -> Space:
    return next(s for s in bound(bound_name).spaces if s.name == name)


class AdmitsWhilePaused(SpecScheduler):
    """Admits waiting requests under PAUSED_NEW as if unpaused (the view still
    reports the pause): the invariant ``paused-admits-nothing`` catches it."""

    CAPABILITIES = Capabilities(async_scheduling=True).with_gates()

    def schedule(self) -> StepPlan:
        saved = self.pause_state
        if saved == PauseState.PAUSED_NEW:
            self.pause_state = PauseState.UNPAUSED
        try:
            return super().schedule()
        finally:
            self.pause_state = saved


@pytest.fixture(scope="module")
def gates() -> BoundResult:
    return check_bound("gates", use_impl=False, workers=1)


def test_the_gates_bound_covers_every_gate_and_explores_clean(gates: BoundResult) -> None:
    assert gates.failure is None
    assert {g for r in gates.spaces for g in r.space.gates()} == set(GATES)
    for r in gates.spaces:
        assert r.complete and r.space.gates(), r.space.name
        assert r.states > 1000 and r.transitions > r.states and r.liveness_bound is not None, r.space.name
    covered = {k: sum(r.coverage[k] for r in gates.spaces) for k in GATE_COVERAGE}
    assert all(v > 0 for v in covered.values()), covered
    # every space of both modes of scheduling: pause is explored sync and async
    assert {r.space.config.async_scheduling for r in gates.spaces if "pause" in r.space.gates()} == {False, True}


def test_the_gates_bound_reaches_the_gate_rules(gates: BoundResult) -> None:
    counts = rule_coverage.new_counts()
    for r in gates.spaces:
        rule_coverage.merge(counts, r.rules)
    from schedspec.check.features import GATE_CAPABILITIES

    # the admission gates' capabilities (the KV connector's and hybrid groups'
    # rules have bounds of their own: tests/modelcheck/test_kv.py)
    gate_caps = tuple(sorted(set(GATE_CAPABILITIES.values())))
    gate_rules = [n for n in reachable_in(["sync", "async", "spec", "async-spec"], gate_caps) if RULES[n].gates]
    assert gate_rules, "no rule of the spec names a gate"
    missing = set(rule_coverage.unreached(counts, gate_rules))
    assert missing <= UNREACHED_GATE_RULES, missing - UNREACHED_GATE_RULES
    for r in gates.spaces:  # each space reaches rules of its own gates
        own = {n for n in gate_rules if set(RULES[n].gates) & {_cap(g) for g in r.space.gates()}}
        assert own & set(rule_coverage.reached(r.rules)), r.space.name


def _cap(gate: str) -> str:
    from schedspec.check.features import GATE_CAPABILITIES

    return GATE_CAPABILITIES[gate]


def test_the_gate_state_is_part_of_the_fingerprint() -> None:
    ex = Expander(_space("gates", "fcfs-pause-tight"))
    root = ex.root()
    assert root.view is not None
    s1 = ex.apply(root.state, ex.alphabet.add(0), root.view, {}, 0)
    pause = ex.alphabet.first_pause  # "pause new"
    s2 = ex.apply(s1.state, pause, s1.view, {}, s1.adds)
    assert s2.view.pause_state == PauseState.PAUSED_NEW and s2.fingerprint != s1.fingerprint
    assert pause not in ex.enabled(s2.view, None, s2.state)  # already paused so
    resume = ex.alphabet.first_pause + 4
    s3 = ex.apply(s2.state, resume, s2.view, {}, s2.adds)
    assert s3.fingerprint == s1.fingerprint  # resumed: the state it was
    # a pause with a cache clear: at once on an idle engine (PAUSED_NEW with
    # only a request that holds nothing), else once the running ones drain
    s4 = ex.apply(s1.state, pause + 1, s1.view, {}, s1.adds)
    assert not s4.clear and s4.fingerprint == s2.fingerprint
    r1 = ex.apply(s1.state, STEP, s1.view, {}, s1.adds)
    assert r1.view.running
    r2 = ex.apply(r1.state, pause + 1, r1.view, expected_memory(r1.view), r1.adds)
    assert r2.clear and r2.fingerprint != ex.apply(r1.state, pause, r1.view, {}, r1.adds).fingerprint
    r = r2
    while r.clear:
        r = ex.apply(r.state, STEP, r.view, expected_memory(r.view), r.adds, clear=r.clear)
    assert not r.view.running and not r.view.kv.block_keys  # drained, then the cache cleared
    # a grammar reported is another state than one still compiling
    gx = Expander(_space("gates", "fcfs-grammar-tight"))
    groot = gx.root()
    assert groot.view is not None
    g1 = gx.apply(groot.state, gx.alphabet.add(0), groot.view, {}, 0)
    ok = gx.alphabet.grammar_code(0, True)
    assert ok in gx.enabled(g1.view, None, g1.state)
    g2 = gx.apply(g1.state, ok, g1.view, {}, g1.adds)
    assert g2.view == g1.view and g2.fingerprint != g1.fingerprint
    assert ok not in gx.enabled(g2.view, None, g2.state)  # a grammar compiles once
    wl = gx.workload([gx.alphabet.add(0), ok, STEP])
    assert [type(e).__name__ for e in wl.events] == ["AddRequest", "GrammarReady", "Step"]


def test_a_gate_invariant_fires_on_a_broken_scheduler(tmp_path: Path) -> None:
    r = Explorer(_space("gates", "fcfs-pause-tight"), scheduler_cls=AdmitsWhilePaused).run()
    assert r.failure is not None and r.failure.kind == "violation"
    assert {v.invariant_id for v in r.failure.violations} == {"paused-admits-nothing"}
    assert "pause new" in r.failure.labels and r.failure.labels[-1] == "step"
    trace = r.failure.write_trace(tmp_path / "cx.jsonl")
    assert tracefile.read(trace).gates == ("pause",)
    assert main(["replay", str(trace), "--against", "test_gates:AdmitsWhilePaused"]) == 1
    assert main(["replay", str(trace), "--against", "spec"]) == 0


def test_invariants_mode_explores_async_spaces() -> None:
    space = _space("gates", "async-pause-1req")
    clean = Explorer(space, against=Against("spec", SpecScheduler, "invariants", CATALOGUE)).run()
    assert clean.complete and clean.failure is None and clean.mode == "invariants"
    broken = Explorer(space, against=Against("broken", AdmitsWhilePaused, "invariants", CATALOGUE)).run()
    assert broken.failure is not None and "of broken" in broken.failure.message
    assert {v.invariant_id for v in broken.failure.violations} == {"paused-admits-nothing"}
    impl = Explorer(_space("modes", "async-spec1-all-fcfs-1req"),
                    against=Against("impl", resolve("impl").factory, "invariants", CATALOGUE)).run()
    assert impl.complete and impl.failure is None


def test_prefix_acceptance_is_keyed_on_the_tokens(tmp_path: Path) -> None:
    m = MemoModel(2, 4, 2, 2, "prefix")
    ctx = (1, 2, 3)
    assert m.drafts_right("r1", 2, ctx) == m.drafts_right("r7", 2, ctx)
    assert {m.drafts_right("r1", 2, (a, b, c)) for a in range(4) for b in range(4) for c in range(4)} == {0, 1, 2}
    space = _space("modes-large", "spec2-prefix-fcfs-tight")
    r = Explorer(space).run()
    assert r.complete and r.failure is None
    assert {"spec.all_accepted", "spec.some_rejected"} <= set(rule_coverage.reached(r.rules))
    assert r.liveness_workload is not None
    # a path's workload records the model's outputs (a replay's model keys
    # "prefix" on the request id), and replays clean
    ex = Expander(space)
    codes = [ex.alphabet.add(0), STEP, STEP, STEP]
    wl = ex.workload(codes)
    assert [type(e).__name__ for e in wl.events][:3] == ["AddRequest", "Schedule", "Update"]
    assert all(e.result is not None for e in wl.events if isinstance(e, Schedule))
    path = tmp_path / "prefix.jsonl"
    tracefile.write(path, tracefile.Trace(wl, vocab=space.vocab, oracle_seed=space.oracle_seed))
    assert main(["replay", str(path), "--against", "spec"]) == 0


def test_a_space_reaches_the_skip_of_a_running_request_with_nothing_to_compute() -> None:
    r = Explorer(_space("modes-large", "async-long-1req")).run()
    assert r.complete and r.failure is None
    assert r.rules["running.skip_no_tokens"] > 0


def test_the_existing_spaces_keep_their_state_counts() -> None:
    # docs/modelcheck.md, "Speculative decoding and async scheduling": the
    # gates add nothing to a space without them
    res = check_bound("modes", use_impl=False, invariants=(), workers=1)
    assert {r.space.name: (r.states, r.transitions) for r in res.spaces} == {
        "spec1-all-fcfs-tight": (4098, 16734),
        "spec1-none-fcfs-tight": (4308, 17562),
        "spec2-all-fcfs-stop": (1602, 7254),
        "spec2-none-priority": (5940, 24456),
        "async-fcfs-tight-1req": (6702, 18180),
        "async-spec1-all-fcfs-1req": (3624, 9909),
        "async-spec2-none-fcfs-1req": (2850, 7602),
    }


def test_the_cli_explores_the_gates_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["modelcheck", "--bound", "gates", "--space", "lora1-2adapters-tight", "--quiet", "--workers", "1",
               "--require-rules", "lora.skip_max_loras,lora.admitted_adapter"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "with the lora gate(s)" in out
    if not resolve("impl").capabilities.lora:
        assert "impl differential left out: impl does not support max_loras=1" in out


@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE_VLLM, reason="vLLM is not installed")
def test_vllm_takes_every_transition_of_a_gate_space(capsys: pytest.CaptureFixture[str]) -> None:
    if not resolve("vllm").capabilities.lora:
        pytest.skip("the vLLM adapter does not declare LoRA")
    rc = main(["modelcheck", "--bound", "gates", "--space", "lora1-2adapters-tight", "--against", "vllm",
               "--quiet", "--workers", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "vllm took all" in out


def test_a_deepcopy_copies_a_future_in_its_state() -> None:
    from concurrent.futures import Future

    from schedspec.modelcheck.target import deep_copy

    pending: Future[int] = Future()
    done: Future[list[int]] = Future()
    done.set_result([1, 2])
    failed: Future[int] = Future()
    failed.set_exception(ValueError("no grammar"))
    holder = {"pending": pending, "done": done, "failed": failed}
    copy = deep_copy(holder, {})
    assert not copy["pending"].done() and copy["pending"] is not pending
    assert copy["done"].result() == [1, 2] and copy["done"].result() is not done.result()
    assert isinstance(copy["failed"].exception(), ValueError)
    copy["pending"].set_result(3)  # the copy resolves apart from the original
    assert not pending.done()


def test_impl_takes_every_transition_of_the_gate_spaces_it_declares() -> None:
    names = ["fcfs-grammar-tight", "fcfs-encoder-tight"]
    caps = resolve("impl").capabilities
    res = check_bound("gates", spaces=names, workers=1)
    assert res.failure is None
    for r in res.spaces:
        if set(r.space.gates()) <= set(caps.gates()):
            assert r.impl_transitions == r.transitions and not r.note, r.space.name
        else:
            assert r.impl_transitions == 0 and r.note.startswith("impl differential left out"), r.space.name


def test_the_gates_large_bound_runs_the_gates_together() -> None:
    large = bound("gates-large")
    assert [s.name for s in large.spaces[:len(bound("gates").spaces)]] == [s.name for s in bound("gates").spaces]
    combined = large.spaces[len(bound("gates").spaces):]
    assert {g for s in combined for g in s.gates()} == set(GATES)
    assert all(len(s.gates()) >= 4 for s in combined)
    r = Explorer(combined[0]).run()
    assert r.complete and r.failure is None and r.liveness_bound is not None
    assert {"lora.admitted_adapter", "grammar.ready", "encoder.scheduled", "cadence.hold"} <= set(
        rule_coverage.reached(r.rules))
