"""The explicit-state model checker (schedspec/modelcheck/).

The small bound is explored completely, with every invariant on every
transition and ImplScheduler replaying every transition; deliberately broken
spec subclasses (defined here) are caught with a shortest counterexample that
`schedspec replay` reproduces; the deadlock and liveness analyses, the
fingerprints and the cloning are checked on their own; and CrossHair's
diffbehavior compares the spec's pure helpers with their impl counterparts.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import json
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import schedspec.spec.rules as rules
from schedspec.cli.main import main
from schedspec.check.driver import Runner
from schedspec.modelcheck import (
    STEP,
    Bound,
    Explorer,
    Expander,
    ModelCheckError,
    Shape,
    Space,
    bound,
    check_bound,
    expected_memory,
    impl_available,
    impl_class,
)
from schedspec.modelcheck.coverage import GATE_COVERAGE, KV_COVERAGE
from schedspec.spec.interface import SchedulerConfig, StepPlan
from schedspec.spec.kv_cache import KVPool
from schedspec.spec.rules import split_freed_blocks
from schedspec.spec.scheduler import SpecScheduler

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    # `--against test_modelcheck:KeyedToFront` must import this module.
    monkeypatch.syspath_prepend(str(HERE))


# ---------------------------------------------------------------------------
# Deliberately broken spec subclasses
# ---------------------------------------------------------------------------


class _KeyedToFrontPool(KVPool):
    def free(self, table: list[int]) -> None:
        # Bug: every freed block goes to the FRONT of the free queue, keyed
        # ones too, so a cached prefix is evicted first instead of last.
        tail_first = list(reversed(table))
        newly_free = []
        for b in tail_first:
            self.ref_cnt[b] -= 1
            newly_free.append(self.ref_cnt[b] == 0)
        front, back = split_freed_blocks(tail_first, newly_free, [False] * len(tail_first), self.enable_caching)
        self.free_queue = front + self.free_queue + back


class KeyedToFront(SpecScheduler):
    """Frees keyed blocks to the front of the free queue (vLLM appends them)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.kv = _KeyedToFrontPool(config.num_blocks, config.block_size, config.enable_prefix_caching)


class FirstVictim(SpecScheduler):
    """FCFS preemption takes the FIRST running request instead of the last."""

    def schedule(self) -> StepPlan:
        import schedspec.spec.scheduler as mod

        original = getattr(mod, "choose_victim")
        setattr(mod, "choose_victim", lambda policy, running_keys: 0)
        try:
            return super().schedule()
        finally:
            setattr(mod, "choose_victim", original)


class NeverAdmitsD(SpecScheduler):
    """Never admits a request whose prompt is (3,): it hides such requests
    from the waiting queue while it schedules, so they wait forever."""

    def schedule(self) -> StepPlan:
        requests = self.view().requests
        held = [rid for rid in self.waiting if requests[rid].spec.prompt_token_ids == (3,)]
        self.waiting = [rid for rid in self.waiting if rid not in held]
        try:
            return super().schedule()
        finally:
            self.waiting[:0] = held


def _space(name: str = "fcfs-cache-tight") -> Space:
    for s in bound("small").spaces:
        if s.name == name:
            return s
    raise KeyError(name)


# ---------------------------------------------------------------------------
# The small bound, completely
# ---------------------------------------------------------------------------


def test_small_bound_is_explored_completely(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mc.json"
    start = time.monotonic()
    rc = main(["modelcheck", "--bound", "small", "--json", str(out), "--out", str(tmp_path / "cx"), "--quiet"])
    elapsed = time.monotonic() - start
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(out.read_text())
    assert data["result"] == "pass"
    assert [s["space"]["name"] for s in data["spaces"]] == [s.name for s in bound("small").spaces]
    for s in data["spaces"]:
        assert s["complete"] and s["failure"] is None
        assert s["states"] > 1000 and s["transitions"] > s["states"]
        assert s["liveness_bound"] is not None and s["liveness_bound"] > 0
        if data["impl"]:
            assert s["impl_transitions"] == s["transitions"]  # 100% of the explored transitions
    # The bound exercises what it is meant to: preemption, prefix hits,
    # chunks, resumption, stop tokens, resets and aborts of running requests.
    covered = {k: sum(s["coverage"][k] for s in data["spaces"]) for k in data["spaces"][0]["coverage"]
               if k not in GATE_COVERAGE and k not in KV_COVERAGE}
    assert all(v > 0 for v in covered.values()), covered
    assert data["impl"] == impl_available()
    assert "OK:" in text and "liveness: with no new arrivals every request finishes within" in text
    print(f"small bound: {data['states']} states, {data['transitions']} transitions in {elapsed:.1f}s")


# ---------------------------------------------------------------------------
# Broken specs: shortest counterexamples that replay
# ---------------------------------------------------------------------------


def _fails_under_runner(cls: type[SpecScheduler], space: Space, codes: tuple[int, ...]) -> bool | None:
    """Run an event sequence through the check engine's driver (Monitor with
    history, persistent fake model) against ``cls`` alone. None: the sequence
    names an abort of a request that does not exist."""
    ex = Expander(space, cls)
    try:
        wl = ex.workload(codes)
    except IndexError:
        return None
    runner = Runner(space.config, {"broken": cls}, vocab=space.vocab, oracle_seed=space.oracle_seed)
    return runner.run(wl.events) is not None


def test_broken_spec_is_caught_with_a_shortest_replayable_counterexample(tmp_path: Path) -> None:
    space = _space()
    r = Explorer(space, scheduler_cls=KeyedToFront).run()
    f = r.failure
    assert f is not None and f.kind == "violation"
    assert "free-queue-lru" in {v.invariant_id for v in f.violations}
    # Freeing needs a request with a full (keyed) block: add it, step, abort.
    assert len(f.labels) == 3 and f.labels[0].startswith("add") and f.labels[1] == "step"
    # Shortest: no sequence of fewer events fails, by brute force through
    # the check engine's driver, independently of the model checker.
    alphabet = Expander(space).alphabet
    for n in range(1, len(f.labels)):
        for codes in itertools.product(range(alphabet.size), repeat=n):
            assert not _fails_under_runner(KeyedToFront, space, codes), codes
    # The trace replays and fails the same way.
    trace = f.write_trace(tmp_path / "cx.jsonl")
    assert main(["replay", str(trace), "--against", "test_modelcheck:KeyedToFront"]) == 1
    # And it is a workload the correct spec runs cleanly.
    assert main(["replay", str(trace), "--against", "spec"]) == 0


def test_deep_bug_is_caught_at_its_shortest_depth_in_parallel_too(tmp_path: Path) -> None:
    space = _space()
    serial = Explorer(space, scheduler_cls=FirstVictim).run()
    parallel = Explorer(space, scheduler_cls=FirstVictim, workers=2).run()
    for r in (serial, parallel):
        assert r.failure is not None and r.failure.kind == "violation"
        assert "fcfs-victim-suffix" in {v.invariant_id for v in r.failure.violations}
    # Breadth-first order makes the answer deterministic and shortest.
    assert serial.failure is not None and parallel.failure is not None
    assert serial.failure.labels == parallel.failure.labels
    assert serial.states == parallel.states
    # Preemption needs two running requests that outgrow the pool: no
    # shorter path exists (breadth-first), and this one replays.
    assert sum(1 for x in serial.failure.labels if x == "step") >= 2
    trace = serial.failure.write_trace(tmp_path / "deep.jsonl")
    assert main(["replay", str(trace), "--against", "test_modelcheck:FirstVictim"]) == 1


def test_cli_writes_the_counterexample_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["modelcheck", "--bound", "small", "--scheduler", "test_modelcheck:KeyedToFront", "--no-impl",
               "--out", str(out), "--json", str(tmp_path / "s.json"), "--quiet", "--workers", "1"])
    text = capsys.readouterr().out
    assert rc == 1, text
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["result"] == "fail"
    trace = Path(data["trace"])
    assert trace.exists() and "shortest" in text
    assert data["replay"] == f"schedspec replay {trace} --against test_modelcheck:KeyedToFront"
    assert main(["replay", str(trace), "--against", "test_modelcheck:KeyedToFront"]) == 1


def test_impl_divergence_is_caught() -> None:
    # Use a broken spec as the "impl": the differential must notice.
    r = Explorer(_space(), impl_cls=KeyedToFront).run()
    assert r.failure is not None and r.failure.kind == "divergence"
    assert len(r.failure.labels) == 3


class SpecWithoutClone(SpecScheduler):
    """The spec as an "impl" that cannot copy itself: the checker pickles it."""

    clone = None  # type: ignore[assignment]


def test_differential_uses_clone_when_the_impl_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pickle(*args: object, **kw: object) -> None:
        raise AssertionError("pickled an impl that has clone()")

    r = Explorer(_space("fcfs-cache-salt-tight"), impl_cls=SpecScheduler).run()
    assert r.complete and r.impl_transitions == r.transitions and r.copy == "clone"
    # Without clone() the impl travels by pickle, and the answer is the same.
    pickled = Explorer(_space("fcfs-cache-salt-tight"), impl_cls=SpecWithoutClone).run()
    assert (pickled.states, pickled.transitions, pickled.complete) == (r.states, r.transitions, True)
    assert pickled.copy == "pickle"
    monkeypatch.setattr(pickle, "loads", no_pickle)
    assert Explorer(_space("fcfs-cache-salt-tight"), impl_cls=SpecScheduler, max_states=200).run().failure is None
    # A scheduler that neither clones nor pickles is deep-copied.
    assert Explorer(_space("fcfs-cache-salt-tight"), impl_cls=SpecWithoutClone, max_states=200).copy == "deepcopy"


# ---------------------------------------------------------------------------
# Deadlock and liveness
# ---------------------------------------------------------------------------


def test_deadlock_is_found_by_the_graph_analysis() -> None:
    space = _space("priority-nocache-threshold")
    # With the invariants on, the progress invariant fires first.
    r = Explorer(space, scheduler_cls=NeverAdmitsD).run()
    assert r.failure is not None and "progress" in {v.invariant_id for v in r.failure.violations}
    # Without them, the step graph shows a state that never drains.
    r = Explorer(space, scheduler_cls=NeverAdmitsD, invariants=()).run()
    assert r.failure is not None and r.failure.kind == "deadlock"
    assert r.failure.labels[:2] == ("add D", "step")
    assert r.liveness_bound is None


def test_liveness_bound_is_the_worst_case_with_its_path() -> None:
    shape = Shape("A", (1, 2, 3), 3)
    space = Space("one", SchedulerConfig(block_size=2, num_blocks=5, max_num_batched_tokens=4, max_num_seqs=2,
                                         max_model_len=8), (shape,), 1)
    r = Explorer(space).run()
    assert r.complete
    # Prefill (samples token 1), then two decode steps (tokens 2 and 3).
    assert r.liveness_bound == 3
    assert r.liveness_labels == ("add A", "step", "step", "step")
    assert r.liveness_workload is not None and len(r.liveness_workload.events) == 4


# ---------------------------------------------------------------------------
# Fingerprints, symmetry, cloning
# ---------------------------------------------------------------------------


def _state(space: Space, codes: list[int]) -> tuple[SpecScheduler, int]:
    ex = Expander(space)
    s: SpecScheduler = ex.root().state
    adds = 0
    for code in codes:
        before = s.view()
        succ = ex.apply(s, code, before, expected_memory(before), adds)
        assert succ.view == succ.state.view() and succ.fingerprint == ex.canon.fingerprint(succ.view)
        s, adds = succ.state, succ.adds
    return s, adds


def test_ids_enter_the_fingerprint_only_through_order() -> None:
    space = _space()
    ex = Expander(space)
    a = ex.alphabet
    add_a, abort0 = a.add(0), a.abort(0)
    one, _ = _state(space, [add_a])
    other, _ = _state(space, [add_a, abort0, STEP, add_a])  # r1 gone and reported; r2 waits
    assert list(one.view().requests) == ["r1"] and list(other.view().requests) == ["r2"]
    assert one.view().step != other.view().step
    assert ex.canon.fingerprint(one.view()) == ex.canon.fingerprint(other.view())
    # ... but arrival order is kept: A then B differs from B then A.
    ab, _ = _state(space, [a.add(0), a.add(1)])
    ba, _ = _state(space, [a.add(1), a.add(0)])
    assert ex.canon.fingerprint(ab.view()) != ex.canon.fingerprint(ba.view())


def test_block_ids_and_free_queue_order_are_kept() -> None:
    space = _space()
    ex = Expander(space)
    s, _ = _state(space, [ex.alphabet.add(0), STEP, ex.alphabet.abort(0), STEP])
    t = s.clone()
    t.kv.free_queue = list(reversed(t.kv.free_queue))
    assert t.view().kv.free_queue != s.view().kv.free_queue
    assert ex.canon.fingerprint(s.view()) != ex.canon.fingerprint(t.view())


def test_clone_is_independent_and_equal() -> None:
    space = _space()
    ex = Expander(space)
    s, _ = _state(space, [ex.alphabet.add(0), ex.alphabet.add(1), STEP])
    frozen = pickle.loads(pickle.dumps(s))
    c = s.clone()
    assert c.view() == s.view() and type(c) is type(s)
    plan = c.schedule()
    from schedspec.check.oracle import FakeModel

    model = FakeModel(space.config.block_size, space.vocab, space.oracle_seed)
    model.slots = expected_memory(s.view())
    c.update(plan, model.run(plan)[0])
    c.abort(next(iter(c.view().requests)))
    c.reset_prefix_cache(True)
    assert s.view() == frozen.view()
    assert c.view() != s.view()


def test_bounds_are_well_formed() -> None:
    names = {"small", "medium", "large"}
    for name in names:
        b = bound(name)
        assert isinstance(b, Bound) and b.spaces
        assert len({s.name for s in b.spaces}) == len(b.spaces)
        for s in b.spaces:
            assert len({sh.name for sh in s.shapes}) == len(s.shapes)
            for sh in s.resolved_shapes():
                assert len(sh.prompt) < s.config.max_model_len
    # Each bound contains the smaller one.
    small, medium, large = (bound(n) for n in ("small", "medium", "large"))
    assert set(small.spaces) <= set(medium.spaces) <= set(large.spaces)


def test_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["modelcheck", "--bound", "huge"]) == 2
    assert main(["modelcheck", "--workers", "0"]) == 2
    assert main(["modelcheck", "--max-states", "many"]) == 2
    assert main(["modelcheck", "--space", "nope"]) == 2
    assert main(["modelcheck", "--scheduler", "nocolon"]) == 2
    assert main(["modelcheck", "--scheduler", "spec.interface:RequestSpec"]) == 2
    err = capsys.readouterr().err
    assert "--workers" in err and "--space" in err and "--scheduler" in err


def test_max_states_gives_a_partial_run(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["modelcheck", "--bound", "small", "--space", "fcfs-cache-tight", "--max-states", "300", "--quiet",
               "--workers", "1"])
    assert rc == 0
    assert "partial" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# CrossHair: spec/rules.py helpers against their impl counterparts
# ---------------------------------------------------------------------------

IMPL_MODULES = tuple(f"schedspec.{m}" for m in ("impl", "impl.scheduler", "impl.queues", "impl.free_queue", "impl.prefix_index", "impl.rules"))


def _rule_functions() -> list[str]:
    return [name for name, fn in inspect.getmembers(rules, inspect.isfunction) if fn.__module__ == rules.__name__]


def impl_counterparts() -> list[tuple[str, str]]:
    """(spec helper, impl function) pairs: a module-level function of impl/
    with the same name as a helper of spec/rules.py."""
    pairs = []
    for mod_name in IMPL_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name in _rule_functions():
            fn = getattr(mod, name, None)
            if inspect.isfunction(fn) and fn.__module__ == mod_name:
                pairs.append((name, f"{mod_name}.{name}"))
    return pairs


def _guarded_wrappers(tmp: Path, name: str, other: str, other_source: str = "") -> str:
    """A module with two functions that return None outside the spec helper's
    documented domain (its PEP 316 ``pre:`` lines) and otherwise call the
    spec helper and ``other``: diffbehavior then compares them on the domain."""
    fn = getattr(rules, name)
    sig = inspect.signature(fn)
    params = ", ".join(f"{p}: {sig.parameters[p].annotation}" for p in sig.parameters)
    args = ", ".join(sig.parameters)
    pres = [line.strip()[4:].strip() for line in (fn.__doc__ or "").splitlines() if line.strip().startswith("pre:")]
    guard = " and ".join(f"({p})" for p in pres) or "True"
    module, _, func = other.rpartition(".")
    src = f"""
from __future__ import annotations
from schedspec.spec.interface import Policy
import schedspec.spec.rules
{f"import {module}" if module else ""}
{other_source}

def spec_side({params}):
    if not ({guard}):
        return None
    return schedspec.spec.rules.{name}({args})

def other_side({params}):
    if not ({guard}):
        return None
    return {other}({args})
"""
    ast.parse(src)
    (tmp / "ch_pair.py").write_text(textwrap.dedent(src))
    return "ch_pair"


def _diffbehavior(tmp: Path, module: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    import os

    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{tmp}")
    return subprocess.run(
        [sys.executable, "-m", "crosshair", "diffbehavior", f"{module}.spec_side", f"{module}.other_side",
         "--per_condition_timeout=20", "--per_path_timeout=2"],
        cwd=tmp, capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.parametrize("pair", impl_counterparts() or [pytest.param(None, marks=pytest.mark.skip(
    reason="impl/ has no module-level counterpart of any spec/rules.py helper (its rules are inlined in "
           "ImplScheduler's methods); the lockstep and model-check differentials cover them"))])
def test_crosshair_spec_rules_equal_impl_counterparts(pair: tuple[str, str] | None, tmp_path: Path) -> None:
    pytest.importorskip("crosshair")
    assert pair is not None
    name, other = pair
    proc = _diffbehavior(tmp_path, _guarded_wrappers(tmp_path, name, other))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_crosshair_diffbehavior_control(tmp_path: Path) -> None:
    """The mechanism works: an equivalent rewrite of a helper shows no
    difference on its domain, a mutant does."""
    pytest.importorskip("crosshair")
    same = "def rewrite(num_tokens, block_size):\n    return max(num_tokens - 1, 0) // block_size\n"
    proc = _diffbehavior(tmp_path, _guarded_wrappers(tmp_path, "max_hit_blocks", "rewrite", same))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mutant = "def rewrite(num_tokens, block_size):\n    return num_tokens // block_size\n"
    proc = _diffbehavior(tmp_path, _guarded_wrappers(tmp_path, "max_hit_blocks", "rewrite", mutant))
    assert proc.returncode != 0
    assert "returns" in proc.stdout


def test_impl_is_replayed_when_available() -> None:
    if not impl_available():
        pytest.skip("impl.ImplScheduler is not importable yet")
    assert impl_class().__name__ == "ImplScheduler"


def test_crosshair_explores_heap_based_victim_choice(tmp_path: Path) -> None:
    """impl's choose_victim goes through heapq; CrossHair must see through it:
    a heap ordered on the wrong arrival direction differs from the spec's rule
    and diffbehavior says so, with the inputs."""
    pytest.importorskip("crosshair")
    wrong = (
        "import heapq\n"
        "def rewrite(policy, running_keys):\n"
        "    if policy == Policy.FCFS:\n"
        "        return len(running_keys) - 1\n"
        "    h = [(-p, a, i) for i, (p, a) in enumerate(running_keys)]\n"
        "    heapq.heapify(h)\n"
        "    return h[0][2]\n"
    )
    proc = _diffbehavior(tmp_path, _guarded_wrappers(tmp_path, "choose_victim", "rewrite", wrong))
    assert proc.returncode != 0
    assert "running_keys=" in proc.stdout and "returns" in proc.stdout


def test_cost_benchmark_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    """schedspec/bench/modelcheck_costs.py runs (one small space, one round)
    and reports the five modes on the same state space."""
    from schedspec.bench import modelcheck_costs

    assert modelcheck_costs.main(["--rounds", "1", "--space", "fcfs-cache-salt-tight"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("search only", "+ ", "  the same"))]
    assert len(rows) == 5
    assert len({tuple(r.split()[-6:-4]) for r in rows}) == 1, rows  # same states and transitions


def test_cost_benchmark_runs_as_a_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "schedspec.bench.modelcheck_costs", "--rounds", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--rounds must be at least 1" in proc.stderr
