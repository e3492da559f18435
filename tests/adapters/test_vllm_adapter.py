"""vLLM 0.33.0's real Scheduler through schedspec/adapters/vllm_adapter.py.

Plan shapes on hand-made workloads, the adapter's boundary (the spec's errors,
an operation that raises changes nothing), a consistent view, and lockstep with
the spec: equal StepPlans (block ids included) and equal views after every
operation, over seeded random workloads, targeted ones and the Hypothesis
state machine. Each admission gate (watermark, prefill cadence, pause, LoRA,
structured outputs, encoder budget) on a crafted workload, vLLM's plan as its
rule decides it and the spec beside it (TestGates).

These tests need vLLM 0.33.0 (scripts/install_vllm.sh). Without it they are
skipped, unless SCHEDSPEC_REQUIRE_VLLM=1, when they fail instead. Knobs:
SCHEDSPEC_VLLM_WORKLOADS (random lockstep workloads, default 40),
SCHEDSPEC_VLLM_STEPS (steps per workload, default 120), and
SCHEDSPEC_VLLM_MODE_WORKLOADS / SCHEDSPEC_VLLM_MODE_STEPS (the lockstep
workloads of each of the four modes, default 3 of 60 steps).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Step
from schedspec.spec.interface import (
    Policy,
    ProtocolError,
    RequestError,
    RequestSpec,
    RequestStatus,
    ScheduleKind,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)
from schedspec.spec.scheduler import SpecScheduler

ROOT = Path(__file__).resolve().parents[2]
REQUIRE = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
WORKLOADS = int(os.environ.get("SCHEDSPEC_VLLM_WORKLOADS", "40"))
STEPS = int(os.environ.get("SCHEDSPEC_VLLM_STEPS", "120"))
MODE_WORKLOADS = int(os.environ.get("SCHEDSPEC_VLLM_MODE_WORKLOADS", "3"))
MODE_STEPS = int(os.environ.get("SCHEDSPEC_VLLM_MODE_STEPS", "60"))

needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not HAVE_VLLM and not REQUIRE,
        reason="vLLM is not installed (scripts/install_vllm.sh VENV); "
        "set SCHEDSPEC_REQUIRE_VLLM=1 to fail instead of skipping",
    ),
]


@pytest.fixture(scope="module")
def vllm_loaded() -> Any:
    """Import vLLM once (15-30 s); with SCHEDSPEC_REQUIRE_VLLM=1 a missing or
    wrong vLLM fails here, loudly."""
    from schedspec.adapters.vllm_load import load_vllm

    return load_vllm()


def vllm_factory(config: SchedulerConfig) -> Scheduler:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    sched: Scheduler = VllmScheduler(config)
    return sched


def spec_factory(config: SchedulerConfig) -> Scheduler:
    return SpecScheduler(config)


def req(rid: str, prompt: tuple[int, ...] | range, max_tokens: int = 4, **kw: Any) -> RequestSpec:
    return RequestSpec(rid, tuple(prompt), max_tokens, **kw)


def run_step(s: Scheduler, token: Callable[[str], int] = lambda rid: 7) -> StepPlan:
    plan = s.schedule()
    s.update(plan, StepResult({x.request_id: (token(x.request_id),) for x in plan.scheduled if x.samples}))
    return plan


def check_view(view: SchedulerView) -> None:
    """What must hold of any view the adapter builds from vLLM's state."""
    cfg = view.config
    kv = view.kv
    assert len(kv.ref_cnt) == cfg.num_blocks and kv.ref_cnt[0] == 0
    holders = [0] * cfg.num_blocks
    for r in view.requests.values():
        assert not r.status.is_finished
        for b in r.block_ids:
            holders[b] += 1
        if r.status != RequestStatus.RUNNING:
            assert r.block_ids == () and r.num_computed_tokens == 0
        else:
            assert len(r.block_ids) * cfg.block_size >= r.num_computed_tokens
    assert tuple(holders) == kv.ref_cnt
    assert sorted(kv.free_queue) == [b for b in range(1, cfg.num_blocks) if holders[b] == 0]
    assert set(view.waiting) | set(view.running) == set(view.requests)
    assert not set(view.waiting) & set(view.running)
    assert {r for r in view.running if view.requests[r].status == RequestStatus.RUNNING} == set(view.running)
    for block, key in kv.block_keys.items():
        assert block in kv.cache_index[key]
        salt, tokens = key
        assert len(tokens) % cfg.block_size == 0 and tokens
    assert sum(len(v) for v in kv.cache_index.values()) == len(kv.block_keys)
    if not cfg.enable_prefix_caching:
        assert not kv.block_keys
    for r in view.finished.values():
        assert r.status.is_finished and r.block_ids == ()


def lockstep(config: SchedulerConfig, events: list[Event] | tuple[Event, ...], invariants: bool = True) -> Runner:
    runner = Runner(config, {"spec": spec_factory, "vllm": vllm_factory}, check_invariants=invariants)
    failure = runner.run(tuple(events))
    assert failure is None, failure.describe()
    return runner


# ----------------------------------------------------------------------------- no vLLM needed


def test_importing_the_adapter_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, schedspec.adapters.vllm_adapter, schedspec.adapters.registry\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'))\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


# ----------------------------------------------------------------------------- plan shapes


@pytest.mark.usefixtures("vllm_loaded")
class TestPlans:
    pytestmark = needs_vllm

    def test_prefix_hit_in_the_admitting_step(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32)
        s = vllm_factory(cfg)
        s.add(req("a", range(10), max_tokens=2))
        s.add(req("b", range(10), max_tokens=2, arrival=1))
        plan = s.schedule()
        a, b = plan.scheduled
        assert (a.request_id, a.kind, a.num_computed_tokens, a.num_scheduled_tokens) == ("a", ScheduleKind.NEW, 0, 10)
        assert a.token_ids == tuple(range(10)) and a.num_tokens == 10 and len(a.block_ids) == 3
        # vLLM caches full blocks at allocation time, so b hits a's two full blocks at once.
        assert (b.kind, b.num_computed_tokens, b.num_scheduled_tokens, b.token_ids) == (ScheduleKind.NEW, 8, 2, (8, 9))
        assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
        s.update(plan, StepResult({"a": (5,), "b": (6,)}))
        plan = s.schedule()
        assert [(x.kind, x.num_computed_tokens, x.num_scheduled_tokens, x.token_ids) for x in plan.scheduled] == [
            (ScheduleKind.RUNNING, 10, 1, (5,)),
            (ScheduleKind.RUNNING, 10, 1, (6,)),
        ]
        s.update(plan, StepResult({"a": (1,), "b": (1,)}))  # max_tokens=2: both finish
        view = s.view()
        check_view(view)
        assert {r: v.status for r, v in view.finished.items()} == {
            "a": RequestStatus.FINISHED_LENGTH_CAPPED,
            "b": RequestStatus.FINISHED_LENGTH_CAPPED,
        }
        assert view.finished["a"].output_token_ids == (5, 1)
        plan = s.schedule()
        assert plan.scheduled == () and plan.finished_ids == ("a", "b")
        assert s.view().finished == {}

    def test_chunked_prefill_samples_only_at_the_end(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32)
        s = vllm_factory(cfg)
        s.add(req("a", range(20), max_tokens=1))
        chunks = []
        while True:
            plan = s.schedule()
            (x,) = plan.scheduled
            chunks.append((x.num_computed_tokens, x.num_scheduled_tokens, x.samples, len(x.block_ids)))
            s.update(plan, StepResult({"a": (3,)} if x.samples else {}))
            if x.samples:
                break
        assert chunks == [(0, 8, False, 2), (8, 8, False, 4), (16, 4, True, 5)]
        assert s.view().finished["a"].status == RequestStatus.FINISHED_LENGTH_CAPPED

    def test_preemption_and_resumption(self) -> None:
        # 6 usable blocks of 2 tokens; two requests outgrow the pool together.
        cfg = SchedulerConfig(block_size=2, num_blocks=7, max_num_batched_tokens=16, max_num_seqs=2,
                              max_model_len=12, enable_prefix_caching=False)
        s = vllm_factory(cfg)
        s.add(req("a", range(5), max_tokens=6))
        s.add(req("b", range(10, 15), max_tokens=6, arrival=1))
        kinds: list[tuple[str, ScheduleKind]] = []
        preempted: list[str] = []
        for _ in range(30):
            plan = run_step(s)
            check_view(s.view())
            kinds += [(x.request_id, x.kind) for x in plan.scheduled if x.kind != ScheduleKind.RUNNING]
            preempted += plan.preempted_ids
            for x in plan.scheduled:
                if x.kind == ScheduleKind.RESUMED:
                    assert x.num_computed_tokens == 0 and x.num_tokens > 5
                    assert x.token_ids == tuple(range(10, 15)) + (7,) * (x.num_tokens - 5)
            if not s.view().requests:
                break
        assert preempted == ["b"]  # FCFS: the last running request
        assert ("b", ScheduleKind.RESUMED) in kinds
        assert not s.view().requests

    def test_eos_stop_tokens_and_ignore_eos(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32)
        s = vllm_factory(cfg)
        s.add(req("eos", (1, 2), max_tokens=5, eos_token_id=7))
        s.add(req("ignored", (1, 2), max_tokens=2, eos_token_id=7, ignore_eos=True, arrival=1))
        s.add(req("stop", (1, 2), max_tokens=5, stop_token_ids=(7,), ignore_eos=True, arrival=2))
        s.add(req("plain", (1, 2), max_tokens=5, arrival=3))
        run_step(s, lambda rid: 7)
        view = s.view()
        assert view.finished["eos"].status == RequestStatus.FINISHED_STOPPED
        assert view.finished["stop"].status == RequestStatus.FINISHED_STOPPED
        assert set(view.requests) == {"ignored", "plain"}
        run_step(s, lambda rid: 7)
        assert s.view().finished["ignored"].status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert "plain" in s.view().requests  # no eos id: 7 is just a token

    def test_abort_in_every_state(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=8, max_num_seqs=1, max_model_len=32)
        s = vllm_factory(cfg)
        s.add(req("run", range(12), max_tokens=5))
        s.add(req("wait", range(3), max_tokens=5, arrival=1))
        plan = s.schedule()
        s.abort("run")  # between schedule and update: its output is dropped
        s.update(plan, StepResult({}))
        s.abort("wait")
        view = s.view()
        check_view(view)
        assert {r: v.status for r, v in view.finished.items()} == {
            "run": RequestStatus.FINISHED_ABORTED,
            "wait": RequestStatus.FINISHED_ABORTED,
        }
        assert view.kv.num_free_blocks == cfg.num_usable_blocks
        assert s.schedule().finished_ids == ("run", "wait")

    def test_reset_prefix_cache(self) -> None:
        cfg = SchedulerConfig(block_size=2, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=16)
        s = vllm_factory(cfg)
        s.add(req("a", range(6), max_tokens=3))
        run_step(s)
        assert s.view().kv.block_keys
        assert s.reset_prefix_cache() is False  # a running request holds blocks
        assert s.view().kv.block_keys
        assert s.reset_prefix_cache(reset_running_requests=True) is True
        view = s.view()
        assert not view.kv.block_keys and view.waiting == ("a",) and view.preempted_since_plan == ("a",)
        plan = run_step(s)
        assert plan.preempted_ids == ("a",)
        (x,) = plan.scheduled
        assert (x.kind, x.num_computed_tokens, x.num_scheduled_tokens) == (ScheduleKind.RESUMED, 0, 7)

    def test_priority_waiting_order(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=32, policy=Policy.PRIORITY)
        s = vllm_factory(cfg)
        for rid, prio, arrival in (("x", 2, 0), ("y", 0, 5), ("z", 0, 1), ("w", 1, 1), ("v", 0, 1)):
            s.add(req(rid, (1,), priority=prio, arrival=arrival))
        assert s.view().waiting == ("v", "z", "y", "w", "x")

    def test_a_user_subclass_runs_in_lockstep(self, vllm_loaded: Any) -> None:
        calls: list[int] = []

        class Counting(vllm_loaded.Scheduler):  # type: ignore[misc, name-defined]
            def schedule(self, *args: Any, **kwargs: Any) -> Any:
                calls.append(1)
                return super().schedule(*args, **kwargs)

        from schedspec.adapters.vllm_adapter import VllmScheduler

        cfg = SchedulerConfig(block_size=2, num_blocks=9, max_num_batched_tokens=8, max_num_seqs=3, max_model_len=16)
        w = random_workload(7, 40)
        runner = Runner(
            w.config,
            {"spec": spec_factory, "user": lambda c: VllmScheduler(c, scheduler_cls=Counting)},
        )
        assert runner.run(w.events) is None
        assert len(calls) == runner.stats.steps > 0
        assert cfg  # the class also builds for any valid config
        VllmScheduler(cfg, scheduler_cls=Counting)


# ----------------------------------------------------------------------------- the boundary


@pytest.mark.usefixtures("vllm_loaded")
class TestBoundary:
    pytestmark = needs_vllm
    cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=16)

    def test_bad_requests_raise_the_spec_errors_and_change_nothing(self) -> None:
        s, ref = vllm_factory(self.cfg), spec_factory(self.cfg)
        for sched in (s, ref):
            sched.add(req("a", range(5)))
        before = s.view()
        for bad in (req("a", range(3)), req("long", range(16))):
            errors = []
            for sched in (s, ref):
                with pytest.raises(RequestError) as info:
                    sched.add(bad)
                errors.append((info.value.field, str(info.value)))
            assert errors[0] == errors[1]
        with pytest.raises(RequestError):
            s.abort("nobody")
        assert s.view() == before == ref.view()
        with pytest.raises(TypeError):
            s.add("a")  # type: ignore[arg-type]

    def test_finished_ids_stay_taken_until_reported(self) -> None:
        s = vllm_factory(self.cfg)
        s.add(req("a", range(3), max_tokens=1))
        run_step(s)
        with pytest.raises(RequestError):
            s.add(req("a", range(3)))
        s.schedule()  # reports "a" as finished: the id is free again
        s2 = vllm_factory(self.cfg)
        s2.add(req("a", range(3), max_tokens=1))
        run_step(s2)
        s2.update(s2.schedule(), StepResult({}))
        s2.add(req("a", range(3)))

    def test_protocol_errors(self) -> None:
        s = vllm_factory(self.cfg)
        s.add(req("a", range(10), max_tokens=3))
        plan = s.schedule()  # 8 of 10 tokens: a partial chunk
        with pytest.raises(ProtocolError):
            s.schedule()
        with pytest.raises(ProtocolError):
            s.reset_prefix_cache()
        before = s.view()
        for bad in (
            StepResult({"a": (1,)}),  # a partial chunk samples nothing
            StepResult({"zz": (1,)}),
            StepResult({"a": (-1,)}),
        ):
            with pytest.raises(ProtocolError):
                s.update(plan, bad)
            assert s.view() == before
        with pytest.raises(ProtocolError):
            s.update(StepPlan(99, (), (), ()), StepResult({}))
        s.update(plan, StepResult({}))
        with pytest.raises(ProtocolError):
            s.update(plan, StepResult({}))


# ----------------------------------------------------------------------------- lockstep


def _events(*items: Event | list[Event]) -> list[Event]:
    out: list[Event] = []
    for item in items:
        out.extend(item if isinstance(item, list) else [item])
    return out


def steps(n: int) -> list[Event]:
    return [Step() for _ in range(n)]


def adds(*requests: RequestSpec) -> list[Event]:
    return [AddRequest(r) for r in requests]


TARGETED: dict[str, tuple[SchedulerConfig, list[Event]]] = {
    # PRIORITY: the victim is the lowest-priority running request, wherever
    # it stands in the running queue.
    "priority-preempts-lowest": (
        SchedulerConfig(block_size=2, num_blocks=9, max_num_batched_tokens=16, max_num_seqs=3,
                        max_model_len=16, policy=Policy.PRIORITY, enable_prefix_caching=False),
        _events(adds(req("lo", range(6), 8, priority=2), req("hi", range(10, 16), 8, priority=0, arrival=1),
                     req("mid", range(20, 23), 8, priority=1, arrival=2)), steps(20)),
    ),
    # PRIORITY: "lo" runs ahead of "hi" in the running queue (admitted first);
    # in step 4 the pool is full, "lo" cannot grow, is itself the victim and
    # preempts itself; "hi" behind it still runs.
    "priority-self-preemption": (
        SchedulerConfig(block_size=1, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=3,
                        max_model_len=11, policy=Policy.PRIORITY, enable_prefix_caching=False),
        _events(adds(req("lo", range(4), 8, priority=1)), steps(1),
                adds(req("hi", range(10, 14), 8, priority=0, arrival=1)), steps(10)),
    ),
    # PRIORITY: in step 4 "lo" is scheduled first, then "hi" cannot grow and
    # preempts "lo", which is taken out of the step and its budget returned.
    "priority-unschedule": (
        SchedulerConfig(block_size=2, num_blocks=9, max_num_batched_tokens=16, max_num_seqs=3,
                        max_model_len=16, policy=Policy.PRIORITY, enable_prefix_caching=False),
        _events(adds(req("lo", range(6), 8, priority=2)), steps(1),
                adds(req("hi", range(10, 15), 8, priority=0, arrival=1)), steps(12)),
    ),
    "no-chunked-prefill": (
        SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=20, max_num_seqs=3,
                        max_model_len=20, enable_chunked_prefill=False),
        _events(adds(req("a", range(15), 3), req("b", range(12), 3, arrival=1), req("c", range(4), 3, arrival=2)),
                steps(12)),
    ),
    "long-prefill-threshold": (
        SchedulerConfig(block_size=2, num_blocks=20, max_num_batched_tokens=16, max_num_seqs=3,
                        max_model_len=24, long_prefill_token_threshold=3),
        _events(adds(req("a", range(20), 2)), steps(2), adds(req("b", range(20), 2, arrival=1)), steps(12)),
    ),
    "reserve-full-isl-off": (
        SchedulerConfig(block_size=2, num_blocks=9, max_num_batched_tokens=4, max_num_seqs=3,
                        max_model_len=16, scheduler_reserve_full_isl=False),
        _events(adds(req("a", range(14), 2), req("b", range(20, 34), 2, arrival=1)), steps(25)),
    ),
    "reset-with-running-requests": (
        SchedulerConfig(block_size=2, num_blocks=17, max_num_batched_tokens=8, max_num_seqs=3, max_model_len=16),
        _events(adds(req("a", range(9), 6), req("b", range(9), 6, arrival=1), req("c", range(4), 6, arrival=2)),
                steps(2), ResetPrefixCache(True), steps(1), ResetPrefixCache(False), steps(12), ResetPrefixCache(False),
                adds(req("d", range(9), 2, arrival=3)), steps(4)),
    ),
    "salted-prefixes": (
        SchedulerConfig(block_size=2, num_blocks=17, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=16),
        _events(adds(req("a", range(7), 2), req("b", range(7), 2, cache_salt="s", arrival=1),
                     req("c", range(7), 2, cache_salt="s", arrival=2), req("d", range(7), 2, cache_salt="", arrival=3)),
                steps(4)),
    ),
    "abort-mid-step-and-queued": (
        SchedulerConfig(block_size=2, num_blocks=9, max_num_batched_tokens=6, max_num_seqs=2, max_model_len=16),
        _events(adds(req("a", range(9), 4), req("b", range(9), 4, arrival=1), req("c", range(5), 4, arrival=2)),
                steps(1), Abort("b"), steps(1), Abort("c"), Abort("a"), Abort("a"), steps(3)),
    ),
}


@pytest.mark.usefixtures("vllm_loaded")
@pytest.mark.parametrize("name", sorted(TARGETED))
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_lockstep_targeted(name: str) -> None:
    config, events = TARGETED[name]
    runner = lockstep(config, events)
    assert runner.stats.steps == sum(isinstance(e, Step) for e in events)


@pytest.mark.usefixtures("vllm_loaded")
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_lockstep_random_workloads() -> None:
    """Seeded random workloads: shared prefixes, salts, chunked prefill, tiny
    pools with preemption, FCFS and PRIORITY, aborts, stop and eos tokens,
    prefix-cache resets. Every mechanism must actually fire."""
    fired = {"preemptions": 0, "hit_admissions": 0, "chunks": 0, "aborts": 0, "resets": 0}
    policies = set()
    start, total = time.perf_counter(), 0
    for seed in range(WORKLOADS):
        w = random_workload(seed, STEPS)
        runner = Runner(w.config, {"spec": spec_factory, "vllm": vllm_factory})
        failure = runner.run(w.events)
        assert failure is None, f"seed {seed}, config {w.config}\n{failure.describe()}"
        total += runner.stats.steps
        policies.add(w.config.policy)
        for name in fired:
            fired[name] += getattr(runner.stats, name)
    elapsed = time.perf_counter() - start
    print(f"\nlockstep spec+vllm with invariants: {total} steps in {elapsed:.1f} s = {total / elapsed:.0f} steps/s")
    if WORKLOADS >= 20:
        assert all(fired.values()), fired
        assert policies == {Policy.FCFS, Policy.PRIORITY}


@pytest.mark.usefixtures("vllm_loaded")
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_forgetting_unreachable_block_keys_changes_nothing() -> None:
    """The adapter forgets the content of hashes vLLM can no longer show;
    pruning at every step must leave plans and views equal to the spec's."""
    from schedspec.adapters.vllm_adapter import VllmScheduler

    built: list[VllmScheduler] = []

    def pruning(config: SchedulerConfig) -> Scheduler:
        sched = VllmScheduler(config)
        sched._keys._prune_at = 0
        built.append(sched)
        return sched

    for seed in (3, 11, 12):
        w = random_workload(seed, 80)
        runner = Runner(w.config, {"spec": spec_factory, "vllm": pruning})
        failure = runner.run(w.events)
        assert failure is None, failure.describe()
    assert all(s._keys._prune_at == 4096 for s in built)


@pytest.mark.usefixtures("vllm_loaded")
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_lockstep_state_machine() -> None:
    """The Hypothesis state machine (schedspec/testing/stateful.py) over spec and vLLM."""
    from hypothesis import HealthCheck, settings

    from schedspec.testing.stateful import make_machine

    machine = make_machine({"spec": spec_factory, "vllm": vllm_factory}, name="SpecVsVllm")
    case = machine.TestCase
    case.settings = settings(
        max_examples=int(os.environ.get("SCHEDSPEC_VLLM_EXAMPLES", "25")),
        stateful_step_count=40,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    case("runTest").runTest()


@pytest.mark.usefixtures("vllm_loaded")
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_lockstep_state_machine_with_every_gate() -> None:
    """The state machine within vLLM's declaration: the four modes and every
    admission gate (pause, resume and grammar-ready rules among its events)."""
    from hypothesis import HealthCheck, settings

    from schedspec.adapters.vllm_adapter import VLLM_CAPABILITIES
    from schedspec.testing.stateful import make_machine

    import dataclasses

    # the gates are the subject: the KV features (tests/adapters/test_vllm_connector.py) left out
    gates_only = dataclasses.replace(VLLM_CAPABILITIES, kv_connector=False, hybrid_kv=False)
    machine = make_machine({"spec": spec_factory, "vllm": vllm_factory}, name="SpecVsVllmGates",
                           capabilities=gates_only)
    case = machine.TestCase
    case.settings = settings(
        max_examples=int(os.environ.get("SCHEDSPEC_VLLM_EXAMPLES", "25")),
        stateful_step_count=40,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    case("runTest").runTest()


@pytest.mark.usefixtures("vllm_loaded")
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_raw_step_schedules_as_the_protocol_does() -> None:
    """raw_add + raw_step (vLLM's own schedule() and update_from_output(),
    what the benchmark times) make the same decisions as add + schedule +
    update through the adapter, given the same tokens."""
    from schedspec.adapters.vllm_adapter import VllmScheduler

    config = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=3,
                             max_model_len=40, enable_prefix_caching=True)
    requests = [req(f"r{i}", range(10 * i, 10 * i + 9 + i), max_tokens=8) for i in range(4)]

    def sample(num_tokens: int) -> int:
        return 100 + num_tokens

    through, raw = VllmScheduler(config), VllmScheduler(config)
    for r in requests:
        through.add(r)
        raw.raw_add(r)
    steps = preemptions = 0
    while through.view().requests:
        plan = through.schedule()
        through.update(plan, StepResult({s.request_id: (sample(s.num_tokens),) for s in plan.scheduled
                                         if s.samples}))
        got = raw.raw_step(sample)
        assert got.scheduled == len(plan.scheduled)
        assert got.decode == all(s.num_scheduled_tokens == 1 for s in plan.scheduled)
        assert got.wall_s >= 0 and got.cpu_s >= 0
        steps += 1
        preemptions += len(plan.preempted_ids)
        assert steps < 100
    assert preemptions > 0  # the pool is small enough that decisions matter
    assert not raw.sched.requests  # every request finished, in the same step count


# ----------------------------------------------------------------------------- async scheduling, spec decoding


def _update_oldest(s: Scheduler, in_flight: list[StepPlan], sampled: Callable[[Any], tuple[int, ...]] = lambda e: (7,),
                   drafts: dict[str, tuple[int, ...]] | None = None) -> StepPlan:
    plan = in_flight.pop(0)
    s.update(plan, StepResult({e.request_id: sampled(e) for e in plan.scheduled if e.samples}, drafts or {}))
    return plan


@pytest.mark.usefixtures("vllm_loaded")
class TestModes:
    pytestmark = needs_vllm

    def test_each_mode_builds_its_vllm_scheduler(self, vllm_loaded: Any) -> None:
        from schedspec.adapters.vllm_adapter import VllmScheduler

        for asyn in (False, True):
            for k in (0, 3):
                s = VllmScheduler(SchedulerConfig(async_scheduling=asyn, num_speculative_tokens=k))
                assert isinstance(s.sched, vllm_loaded.AsyncScheduler) == asyn
                vc = s._vllm_config
                assert (vc.scheduler_config.async_scheduling, vc.num_speculative_tokens) == (asyn, k)
                assert vc.num_lookahead_tokens == 0
                if k:
                    assert vc.speculative_config.method == ("ngram_gpu" if asyn else "ngram")

    def test_async_plans_carry_placeholders(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=32, async_scheduling=True)
        s = vllm_factory(cfg)
        s.add(req("a", range(5), max_tokens=3))
        first = s.schedule()
        second = s.schedule()  # step 2 planned while step 1 is in flight
        (x,) = second.scheduled
        # the token step 1 samples is in flight: a -1 at position 5, counted as computed
        assert (x.num_computed_tokens, x.num_scheduled_tokens, x.num_output_placeholders, x.token_ids) == (5, 1, 1, (-1,))
        assert x.samples and x.num_tokens == 5
        assert s.view().requests["a"].num_output_placeholders == 2
        before = s.view()
        with pytest.raises(ProtocolError):
            s.schedule()  # never two plans in flight
        with pytest.raises(ProtocolError):
            s.update(second, StepResult({"a": (7,)}))  # out of order
        assert s.view() == before
        s.update(first, StepResult({"a": (7,)}))
        view = s.view().requests["a"]
        assert (view.output_token_ids, view.num_output_placeholders, view.num_computed_tokens) == ((7,), 1, 6)
        third = s.schedule()
        (y,) = third.scheduled
        assert (y.num_computed_tokens, y.num_output_placeholders, y.token_ids) == (6, 1, (-1,))
        s.update(second, StepResult({"a": (8,)}))
        s.update(third, StepResult({"a": (9,)}))  # max_tokens=3: finished
        assert s.view().finished["a"].output_token_ids == (7, 8, 9)

    def test_sync_drafts_are_verified_in_the_next_step(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=32, num_speculative_tokens=2)
        s = vllm_factory(cfg)
        s.add(req("a", range(5), max_tokens=10))
        plan = s.schedule()
        s.update(plan, StepResult({"a": (7,)}, {"a": (30, 31)}))
        assert s.view().requests["a"].spec_token_ids == (30, 31)
        plan = s.schedule()
        (x,) = plan.scheduled
        assert (x.num_computed_tokens, x.num_scheduled_tokens, x.spec_token_ids, x.token_ids) == (5, 3, (30, 31), (7, 30, 31))
        assert s.view().requests["a"].spec_token_ids == ()  # handed to the step
        s.update(plan, StepResult({"a": (30, 9)}))  # one draft accepted, then the bonus token
        view = s.view().requests["a"]
        # the rejected draft rolls num_computed_tokens back: 5 + 3 - 1
        assert (view.output_token_ids, view.num_computed_tokens) == ((7, 30, 9), 7)
        before = s.view()
        plan = s.schedule()
        for bad in (StepResult({"a": (1, 2)}),  # no drafts this step: exactly one token
                    StepResult({"a": (1,)}, {"a": (1, 2, 3)}),  # more drafts than k
                    StepResult({"a": (1,)}, {"zz": (1,)})):  # drafts for a request not scheduled
            with pytest.raises(ProtocolError):
                s.update(plan, bad)
        s.update(plan, StepResult({"a": (1,)}))
        assert before.requests["a"].output_token_ids + (1,) == s.view().requests["a"].output_token_ids

    def test_async_spec_decoding_schedules_placeholder_drafts(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=32, async_scheduling=True, num_speculative_tokens=2)
        s = vllm_factory(cfg)
        s.add(req("a", range(5), max_tokens=10))
        in_flight = [s.schedule(), s.schedule()]
        (x,) = in_flight[1].scheduled
        assert (x.spec_token_ids, x.num_output_placeholders, x.token_ids) == ((-1, -1), 1, (-1, -1, -1))
        _update_oldest(s, in_flight, drafts={"a": (3, 4)})  # drafts never reach vLLM in async mode
        in_flight.append(s.schedule())
        _update_oldest(s, in_flight, sampled=lambda e: (5,))  # both drafts rejected
        view = s.view().requests["a"]
        assert view.output_token_ids == (7, 5)
        assert view.num_output_placeholders == 3 and view.spec_token_ids == (-1, -1)

    def test_user_async_scheduler_class(self, vllm_loaded: Any) -> None:
        from schedspec.adapters.registry import factory_of
        from schedspec.adapters.vllm_adapter import VllmScheduler, capabilities_of_class
        from schedspec.adapters.vllm_load import VllmAdapterError

        class MyAsync(vllm_loaded.AsyncScheduler):  # type: ignore[misc, name-defined]
            pass

        class MySync(vllm_loaded.Scheduler):  # type: ignore[misc, name-defined]
            pass

        assert capabilities_of_class(MyAsync).async_scheduling
        assert not capabilities_of_class(MySync).async_scheduling
        assert capabilities_of_class(MySync).speculative_decoding
        with pytest.raises(VllmAdapterError, match="not an AsyncScheduler"):
            VllmScheduler(SchedulerConfig(), scheduler_cls=MyAsync)
        with pytest.raises(VllmAdapterError, match="needs a subclass of vLLM's AsyncScheduler"):
            VllmScheduler(SchedulerConfig(async_scheduling=True), scheduler_cls=MySync)
        w = random_workload(3, 40, modes=("async-spec",))
        runner = Runner(w.config, {"spec": spec_factory, "user": factory_of(MyAsync, "test")},
                        check_invariants=False)
        assert runner.run(w.events) is None
        assert isinstance(runner.scheds["user"].sched, MyAsync)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("vllm_loaded")
@pytest.mark.parametrize("mode", ["sync", "async", "spec", "async-spec"])
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_lockstep_in_each_mode(mode: str) -> None:
    """A few short seeded workloads of each mode: plans and views equal to the
    spec's after every operation (the long runs are in docs/divergences.md)."""
    total = 0
    for seed in range(MODE_WORKLOADS):
        w = random_workload(seed, MODE_STEPS, modes=(mode,))
        runner = Runner(w.config, {"spec": spec_factory, "vllm": vllm_factory}, check_invariants=False)
        failure = runner.run(w.events)
        assert failure is None, f"seed {seed}, config {w.config}\n{failure.describe()}"
        total += runner.stats.steps
    assert total == MODE_WORKLOADS * MODE_STEPS


# ----------------------------------------------------------------------------- admission gates


class Pair:
    """The same operations on vLLM and on the spec: each step's plans must be
    equal (block ids included), and so must the views after it. ``step``
    returns the plan; a test states what vLLM's rule makes of it."""

    names = ("vllm", "spec")

    def __init__(self, config: SchedulerConfig) -> None:
        factories = {"vllm": vllm_factory, "spec": spec_factory}
        self.scheds = {name: factories[name](config) for name in self.names}

    def call(self, method: str, *args: Any, **kwargs: Any) -> None:
        for s in self.scheds.values():
            getattr(s, method)(*args, **kwargs)
        self.same_views()

    def add(self, *requests: RequestSpec) -> None:
        for r in requests:
            self.call("add", r)

    def step(self, token: int = 7, drafts: dict[str, tuple[int, ...]] | None = None) -> StepPlan:
        plans = {name: s.schedule() for name, s in self.scheds.items()}
        assert all(plan == plans["vllm"] for plan in plans.values()), plans
        plan = plans["vllm"]
        result = StepResult({x.request_id: (token,) for x in plan.scheduled if x.samples}, drafts or {})
        for name, s in self.scheds.items():
            s.update(plans[name], result)
        self.same_views()
        return plan

    def same_views(self) -> None:
        views = {name: s.view() for name, s in self.scheds.items()}
        check_view(views["vllm"])
        for view in views.values():
            assert view == views["vllm"], _view_difference(views["vllm"], view)

    def view(self) -> SchedulerView:
        return self.scheds["vllm"].view()


def _view_difference(a: SchedulerView, b: SchedulerView) -> str:
    import dataclasses

    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x != y:
            out.append(f"{f.name}: vllm {x!r}\n    spec {y!r}")
    return "\n".join(out)


def shape(plan: StepPlan) -> list[tuple[str, int]]:
    return [(x.request_id, x.num_scheduled_tokens) for x in plan.scheduled]


@pytest.mark.usefixtures("vllm_loaded")
class TestGates:
    """Each admission gate on a crafted workload where vLLM 0.33's rule decides
    the plan, with the spec beside it."""

    pytestmark = needs_vllm

    def test_watermark_holds_back_a_second_admission(self) -> None:
        # watermark_blocks = int(0.3 * 11) = 3 (KVCacheManager.__init__)
        cfg = SchedulerConfig(block_size=4, num_blocks=11, max_num_batched_tokens=40, max_num_seqs=4,
                              max_model_len=40, watermark=0.3)
        p = Pair(cfg)
        # alone, "a" needs 9 of the 10 usable blocks: no watermark applies while
        # nothing runs (allocate_slots: has_scheduled_reqs)
        p.add(req("a", range(33), max_tokens=2))
        assert shape(p.step()) == [("a", 33)]
        p.step()
        p.step()  # a finished: its blocks are free again (and cached)
        assert "a" in p.view().finished or not p.view().requests
        p.add(req("b", range(100, 116), max_tokens=8), req("c", range(200, 220), max_tokens=8))
        # b takes 4 blocks; c needs 5 + 3 (watermark) of the 6 left: it waits
        assert shape(p.step()) == [("b", 16)]
        assert p.view().waiting == ("c",)
        free = sum(1 for n in p.view().kv.ref_cnt[1:] if n == 0)
        assert free >= cfg.watermark_blocks

    def test_prefill_cadence_holds_admissions_between_prefill_steps(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=32, prefill_schedule_interval=3)
        p = Pair(cfg)
        p.add(req("a", range(8), max_tokens=8))
        assert shape(p.step()) == [("a", 8)]  # executed step 1 prefills
        v = p.view()
        assert (v.num_executed_steps, v.last_prefill_step) == (1, 1)
        p.add(req("b", range(50, 58), max_tokens=4))
        # executed steps 2 and 3 come less than 3 after step 1: decode only
        assert shape(p.step()) == [("a", 1)]
        assert shape(p.step()) == [("a", 1)]
        assert shape(p.step()) == [("a", 1), ("b", 8)]  # step 4 = 1 + 3
        v = p.view()
        assert (v.num_executed_steps, v.last_prefill_step) == (4, 4)

    def test_pause_states(self) -> None:
        from schedspec.spec.interface import PauseState

        cfg = SchedulerConfig(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32)
        p = Pair(cfg)
        p.add(req("a", range(8), max_tokens=6))
        p.step()
        p.call("set_pause_state", PauseState.PAUSED_NEW)
        p.add(req("b", range(50, 58)))
        assert shape(p.step()) == [("a", 1)]  # running requests go on, nothing new
        assert p.view().pause_state == PauseState.PAUSED_NEW
        p.call("set_pause_state", PauseState.PAUSED_ALL)
        assert shape(p.step()) == []  # nothing at all
        p.call("set_pause_state", PauseState.UNPAUSED)
        assert shape(p.step()) == [("a", 1), ("b", 8)]
        for s in p.scheds.values():
            with pytest.raises(ProtocolError):
                s.set_pause_state(1)  # type: ignore[attr-defined]
        p.same_views()

    def test_max_loras_skips_a_third_adapter_and_keys_blocks_by_adapter(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=30, max_num_batched_tokens=64, max_num_seqs=8,
                              max_model_len=32, max_loras=1)
        p = Pair(cfg)
        p.add(req("a", range(8), lora_id=1), req("b", range(8), lora_id=2),
              req("c", range(8), lora_id=1), req("d", range(8)))
        # b's adapter would be a second one in the step: skipped, not a stop
        # (schedule, waiting loop: max_loras)
        # (c shares a's adapter and prompt: a prefix hit of one block)
        assert shape(p.step()) == [("a", 8), ("c", 4), ("d", 8)]
        assert p.view().waiting == ("b",)
        kv = p.view().kv
        # same tokens, three identities: a and c share their blocks, d has its own
        a, c, d = (p.view().requests[r].block_ids for r in "acd")
        assert a[:1] == c[:1] and not set(a) & set(d)
        assert len({key[0] for key in kv.block_keys.values()}) == 2

    def test_lora_refused_when_off(self) -> None:
        p = Pair(SchedulerConfig())
        for s in p.scheds.values():
            with pytest.raises(ProtocolError, match="lora_id"):
                s.add(req("x", range(4), lora_id=1))
        p.same_views()

    def test_grammar_waits_then_admits_and_a_failed_one_finishes_in_error(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32)
        p = Pair(cfg)
        p.add(req("a", range(8), structured_output=True, grammar_rejects=(5,)), req("b", range(50, 58)))
        assert shape(p.step()) == [("b", 8)]  # a is skipped, b behind it is not
        assert p.view().requests["a"].status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        for s in p.scheds.values():
            with pytest.raises(ProtocolError):
                s.grammar_ready("b")  # type: ignore[attr-defined]
            with pytest.raises(ProtocolError):
                s.grammar_ready("nobody")  # type: ignore[attr-defined]
        p.same_views()
        p.call("grammar_ready", "a")
        for s in p.scheds.values():
            with pytest.raises(ProtocolError, match="already reported"):
                s.grammar_ready("a")  # type: ignore[attr-defined]  # a grammar compiles once
        p.same_views()
        assert shape(p.step()) == [("b", 1), ("a", 8)]
        assert p.view().requests["a"].status == RequestStatus.RUNNING
        p.add(req("c", range(60, 68), structured_output=True))
        p.call("grammar_ready", "c", ok=False)
        p.step()  # the waiting loop finds the error; the step's update finishes c
        assert p.view().finished["c"].status == RequestStatus.FINISHED_ERROR
        assert p.step().finished_ids == ("c",)

    def test_grammar_truncates_sync_drafts(self) -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=32, num_speculative_tokens=3)
        p = Pair(cfg)
        p.add(req("a", range(8), max_tokens=10, structured_output=True, grammar_rejects=(9,)))
        p.call("grammar_ready", "a")
        p.step(drafts={"a": (5, 9, 6)})
        # validate_tokens keeps the longest prefix with no refused token
        assert p.view().requests["a"].spec_token_ids == (5,)
        (x,) = p.step().scheduled
        assert x.spec_token_ids == (5,) and x.num_scheduled_tokens == 2

    def test_encoder_budget_cuts_a_chunk_before_an_input_and_shares_the_cache(self) -> None:
        from schedspec.spec.interface import MMInput

        cfg = SchedulerConfig(block_size=4, num_blocks=30, max_num_batched_tokens=64, max_num_seqs=4,
                              max_model_len=32, max_num_encoder_input_tokens=6, encoder_cache_size=10)
        p = Pair(cfg)
        p.add(req("a", range(16), mm_inputs=(MMInput(2, 4, "x"), MMInput(8, 5, "y"))),
              req("b", range(100, 116), mm_inputs=(MMInput(2, 4, "x"),)))
        plan = p.step()
        # a: x (4 embeddings) fits the budget of 6, y (5) does not: the chunk
        # stops before y (_try_schedule_encoder_inputs); b finds x cached
        assert [(x.request_id, x.num_scheduled_tokens, x.encoder_inputs) for x in plan.scheduled] == [
            ("a", 8, (0,)), ("b", 16, ())]
        assert p.view().encoder_cache == {"x": 4}
        plan = p.step()
        assert [(x.request_id, x.num_scheduled_tokens, x.encoder_inputs) for x in plan.scheduled] == [
            ("a", 8, (1,)), ("b", 1, ())]
        v = p.view()
        assert v.encoder_cache == {"x": 4, "y": 5} and v.encoder_cache_free == 1
        # a third input that needs the space: the unreferenced entries are evicted
        p.add(req("c", range(200, 216), mm_inputs=(MMInput(0, 6, "z"),)))
        plan = p.step()
        assert ("c", 16, (0,)) in [(x.request_id, x.num_scheduled_tokens, x.encoder_inputs) for x in plan.scheduled]
        # both were freeable (their requests computed past them), oldest first;
        # the plan that evicts them tells the workers (free_encoder_mm_hashes)
        assert plan.freed_encoder_inputs == ("x", "y")
        assert p.view().encoder_cache == {"z": 6}

    def test_encoder_inputs_the_boundary_refuses(self) -> None:
        from schedspec.spec.interface import MMInput

        p = Pair(SchedulerConfig(max_num_encoder_input_tokens=6, encoder_cache_size=10))
        p.add(req("a", range(16), mm_inputs=(MMInput(2, 4, "x"),)))
        for s in p.scheds.values():
            # more than the budget could ever run
            with pytest.raises(ProtocolError, match=r"mm_inputs\[0\]"):
                s.add(req("b", range(16), mm_inputs=(MMInput(0, 7, "y"),)))
            # one identifier, another size (vLLM would fail it at schedule time)
            with pytest.raises(ProtocolError, match="length"):
                s.add(req("c", range(16), mm_inputs=(MMInput(0, 5, "x"),)))
        p.same_views()
        off = Pair(SchedulerConfig())
        for s in off.scheds.values():
            with pytest.raises(ProtocolError, match="mm_inputs"):
                s.add(req("d", range(16), mm_inputs=(MMInput(0, 2, "z"),)))

    def test_encoder_budget_given_back_by_a_victim_scheduled_in_the_step(self) -> None:
        from schedspec.spec.interface import MMInput

        # PRIORITY: "a" (low priority) is scheduled first in step 3 with its
        # encoder input, then "b"'s decode finds the pool empty and preempts
        # it; the encoder budget "a" took is given back (schedule, RUNNING
        # loop: preempted_encoder_inputs)
        cfg = SchedulerConfig(block_size=2, num_blocks=11, max_num_batched_tokens=8, max_num_seqs=4,
                              max_model_len=20, long_prefill_token_threshold=4, policy=Policy.PRIORITY,
                              scheduler_reserve_full_isl=False, max_num_encoder_input_tokens=4,
                              encoder_cache_size=8)
        p = Pair(cfg)
        p.add(req("a", range(18), max_tokens=2, priority=1, mm_inputs=(MMInput(12, 4, "A"),)))
        assert shape(p.step()) == [("a", 8)]  # alone: no threshold
        p.add(req("b", range(100, 104), max_tokens=6, priority=0, arrival=1))
        assert shape(p.step()) == [("a", 4), ("b", 4)]
        plan = p.step()
        assert plan.preempted_ids == ("a",)
        assert [(x.request_id, x.num_scheduled_tokens, x.encoder_inputs) for x in plan.scheduled] == [("b", 1, ())]
        # its entry was allocated, then released by the preemption: cached, freeable
        assert p.view().encoder_cache == {"A": 4}

    def test_cadence_restarted_by_a_victim_scheduled_in_the_step(self) -> None:
        # PRIORITY, cadence 2: at the release step 4 "a" (low priority) gets
        # its prefill chunk first, then "b"'s decode finds the pool empty and
        # preempts it. No prefill runs in step 4, yet vLLM stamps it as the
        # last prefill step (schedule: prefill_scheduled is set when "a" is
        # scheduled and not cleared when it is preempted), so the next prefill
        # is held until step 6 rather than 5. The spec does the same
        # (docs/divergences.md).
        cfg = SchedulerConfig(block_size=2, num_blocks=11, max_num_batched_tokens=8, max_num_seqs=4,
                              max_model_len=20, long_prefill_token_threshold=4, policy=Policy.PRIORITY,
                              scheduler_reserve_full_isl=False, prefill_schedule_interval=2)
        p = Pair(cfg)
        p.add(req("a", range(18), max_tokens=2, priority=1))
        assert shape(p.step()) == [("a", 8)]
        p.add(req("b", range(100, 103), max_tokens=8, priority=0, arrival=1))
        assert shape(p.step()) == [("a", 4), ("b", 3)]
        assert shape(p.step()) == [("b", 1)]  # held: a's chunk waits
        plan = p.step()
        assert shape(plan) == [("b", 1)] and plan.preempted_ids == ("a",)
        v = p.view()
        assert (v.num_executed_steps, v.last_prefill_step) == (4, 4)

    def test_encoder_budget_cuts_a_chunk_with_chunked_prefill_off(self) -> None:
        from schedspec.spec.interface import MMInput

        # chunked prefill off only refuses a prompt beyond the token budget
        # (schedule, WAITING loop); the encoder's cut comes after it
        # (_try_schedule_encoder_inputs) and still makes a partial chunk
        cfg = SchedulerConfig(block_size=4, num_blocks=30, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=32, enable_chunked_prefill=False,
                              max_num_encoder_input_tokens=6, encoder_cache_size=10)
        p = Pair(cfg)
        p.add(req("a", range(16), mm_inputs=(MMInput(2, 4, "x"), MMInput(8, 4, "y"))))
        (x,) = p.step().scheduled
        assert (x.num_scheduled_tokens, x.encoder_inputs, x.samples) == (8, (0,), False)
        (x,) = p.step().scheduled
        assert (x.num_computed_tokens, x.num_scheduled_tokens, x.encoder_inputs) == (8, 8, (1,))

    def test_vllm_and_its_scheduler_classes_declare_every_gate(self, vllm_loaded: Any) -> None:
        from schedspec.adapters.registry import resolve
        from schedspec.adapters.vllm_adapter import capabilities_of_class
        from schedspec.check.features import GATES

        assert resolve("vllm").capabilities.gates() == GATES
        assert capabilities_of_class(vllm_loaded.Scheduler).gates() == GATES
        assert capabilities_of_class(vllm_loaded.AsyncScheduler).gates() == GATES

    def test_the_modelled_grammar(self, vllm_loaded: Any) -> None:
        from schedspec.adapters.vllm_requests import Grammar

        g = Grammar((5, 40, 95, 10**6))
        assert g.validate_tokens([1, 2, 40, 3]) == [1, 2] and g.validate_tokens([1, 2]) == [1, 2]
        assert g.accept_tokens("r", [1, 2]) and not g.accept_tokens("r", [2, 5])
        bitmask = vllm_loaded.torch.full((2, 3), -1, dtype=vllm_loaded.torch.int32)
        g.fill_bitmask(bitmask, 1)  # one bit cleared per refused id in the vocabulary
        assert bitmask[0].tolist() == [-1, -1, -1]
        assert [int(w) for w in bitmask[1].numpy().view("uint32")] == [
            0xFFFFFFFF ^ (1 << 5), 0xFFFFFFFF ^ (1 << 8), 0xFFFFFFFF ^ (1 << 31)]
