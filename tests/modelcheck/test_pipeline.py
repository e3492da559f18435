"""k plans in flight in the model checker (bound ``pipeline``): a pipelined
plain Scheduler (k = 2) and the V2 runner with async scheduling and a
pipeline of 2 (k = 3) reach states with k plans in flight, the updates come
oldest first, resets while at most k - 1 are in flight, and a scheduler that
mishandles an update with a newer plan in flight is caught there (and not in
the same space with one plan in flight)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from schedspec.check.capabilities import FULL
from schedspec.cli.main import main
from schedspec.modelcheck import STEP, Explorer, Expander, Space, bound, impl_class
from schedspec.modelcheck.events import RESET
from schedspec.spec.interface import StepPlan, StepResult
from schedspec.spec.scheduler import SpecScheduler

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    # `--against test_pipeline:OlderUpdateMisread` must import this module.
    monkeypatch.syspath_prepend(str(HERE))


def _space(name: str) -> Space:
    return next(s for s in bound("pipeline").spaces if s.name == name)


class OlderUpdateMisread(SpecScheduler):
    """Bug: an update that comes while a newer plan is still in flight (the
    oldest of two) takes each sampled token off by one, as if it read the
    newer plan's row of the output. It declares the pipeline (a trace with k
    plans in flight is outside the default declaration)."""

    CAPABILITIES = FULL.with_engine(("pipeline",))

    def update(self, plan: StepPlan, result: StepResult) -> None:
        if len(self.in_flight) > 1:
            result = dataclasses.replace(result, sampled={
                rid: tuple((t + 1) % 4 for t in toks) for rid, toks in result.sampled.items()})
        super().update(plan, result)


def test_the_pipelined_scheduler_keeps_two_plans_in_flight() -> None:
    space = _space("pp2-fcfs-tight-1req")
    assert space.config.max_concurrent_batches == 2 and not space.config.async_scheduling
    ex = Expander(space, impl_cls=impl_class())
    a = ex.alphabet
    root = ex.root()
    s = ex.apply_async(root.state, a.add(0), root.view, root.flight, 0)  # type: ignore[arg-type]
    s = ex.apply_async(s.state, STEP, s.view, s.flight, s.adds)  # type: ignore[arg-type]
    assert s.flight is not None and len(s.flight.pairs) == 1
    assert a.update in ex.enabled(s.view, s.flight) and RESET in ex.enabled(s.view, s.flight)
    s2 = ex.apply_async(s.state, STEP, s.view, s.flight, s.adds)  # type: ignore[arg-type]
    assert s2.flight is not None and len(s2.flight.pairs) == 2  # A's second chunk beside its first
    enabled = ex.enabled(s2.view, s2.flight)
    assert a.update not in enabled and RESET not in enabled  # k in flight: the step updates the oldest
    s3 = ex.apply_async(s2.state, STEP, s2.view, s2.flight, s2.adds)  # type: ignore[arg-type]
    assert s3.flight is not None and s3.flight.pairs == s2.flight.pairs[1:]
    wl = ex.workload([a.add(0), STEP, STEP, STEP])
    assert [type(e).__name__ for e in wl.events] == ["AddRequest", "Schedule", "Schedule", "Update"]


def test_v2_async_with_a_pipeline_keeps_three_and_its_throttle_in_the_state() -> None:
    space = _space("v2-pp2-async-1req")
    assert space.config.max_concurrent_batches == 3
    ex = Expander(space, impl_cls=impl_class())
    a = ex.alphabet
    root = ex.root()
    s = ex.apply_async(root.state, a.add(0), root.view, root.flight, 0)  # type: ignore[arg-type]
    for n in (1, 2, 3):
        s = ex.apply_async(s.state, STEP, s.view, s.flight, s.adds)  # type: ignore[arg-type]
        assert s.flight is not None and len(s.flight.pairs) == n
        enabled = ex.enabled(s.view, s.flight)
        assert (a.update in enabled) == (n < 3) and (RESET in enabled) == (n < 3)
    # the decode throttle's stamp is a part of the fingerprint: P's prompt in
    # step 1, passed over in step 2, its decode in step 3, so it may decode
    # again 2 steps on (step 5)
    assert s.flight is not None and [len(p.scheduled) for p in s.flight.plans] == [1, 0, 1]
    assert s.fingerprint[-1] == (2,)


def test_the_pipeline_bound_reaches_k_plans_in_flight_and_its_rules() -> None:
    r = Explorer(_space("v2-async-draft-spec1-1req"), impl_cls=impl_class()).run()
    assert r.failure is None and r.states > 1000
    assert r.rules.get("v2.drafts_skipped", 0) > 0
    r = Explorer(_space("v2-pp2-async-small-2req"), impl_cls=impl_class()).run()
    assert r.failure is None
    # the throttle, and a preempted request's output in flight with k = 3
    assert r.rules.get("v2.decode_throttled", 0) > 0 and r.rules.get("waiting.skip_stale_output", 0) > 0


def test_an_update_mishandled_under_a_newer_plan_is_caught(tmp_path: Path) -> None:
    space = _space("pp2-fcfs-tight-1req")
    r = Explorer(space, impl_cls=OlderUpdateMisread).run()
    f = r.failure
    assert f is not None and f.kind == "divergence", f
    # it takes a second plan in flight: add, step, step, then the update of the first
    assert f.labels == ("add A", "step", "step", "step")
    trace = f.write_trace(tmp_path / "cx.jsonl")
    assert main(["replay", str(trace), "--against", "test_pipeline:OlderUpdateMisread"]) == 1
    assert main(["replay", str(trace), "--against", "spec"]) == 0
    # with one plan in flight at a time the same scheduler goes unnoticed
    one = dataclasses.replace(space, config=dataclasses.replace(space.config, pipeline_parallel_size=1))
    assert Explorer(one, impl_cls=OlderUpdateMisread).run().failure is None
