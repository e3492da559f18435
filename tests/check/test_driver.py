"""The check driver: failures that name the scheduler, the model protocol,
running to completion, and the one statistics type."""

from __future__ import annotations

import inspect

import pytest

from schedspec.check.driver import Runner
from schedspec.check.oracle import FakeModel, Model
from schedspec.check.stats import Stats
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import Abort, AddRequest, Step, Workload, timed_events
from schedspec.spec.interface import RequestSpec, SchedulerConfig, StepPlan, StepResult
from schedspec.spec.scheduler import SpecScheduler
from tests.support import buggy_schedulers
from tests.support.buggy_schedulers import RaisingSchedule, WrongTypeSchedule

CFG = SchedulerConfig(block_size=2, num_blocks=17, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=24)


def _req(rid: str, n: int = 3, max_tokens: int = 4) -> RequestSpec:
    return RequestSpec(request_id=rid, prompt_token_ids=tuple(range(1, n + 1)), max_tokens=max_tokens)


def _line_of(cls: type, text: str) -> int:
    lines, first = inspect.getsourcelines(cls)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_a_scheduler_that_raises_is_named_with_its_method_and_last_frame() -> None:
    runner = Runner(CFG, {"spec": SpecScheduler, "mine": RaisingSchedule})
    failure = runner.run([AddRequest(_req("a", 6)), Step(), Step(), Step()])
    assert failure is not None and failure.kind == "error"
    assert failure.scheduler == "mine"
    text = failure.describe()
    line = _line_of(RaisingSchedule, "raise RuntimeError")
    assert "RaisingSchedule.schedule() raised RuntimeError: the batch is full of surprises" in text
    assert f"tests/support/buggy_schedulers.py:{line} in schedule" in text
    assert " in ?" not in text
    assert isinstance(failure.exception, RuntimeError)


def test_a_scheduler_that_returns_the_wrong_type_is_named_with_its_method() -> None:
    runner = Runner(CFG, {"spec": SpecScheduler, "mine": WrongTypeSchedule})
    failure = runner.run([AddRequest(_req("a")), Step()])
    assert failure is not None and failure.kind == "error" and failure.scheduler == "mine"
    line = _line_of(WrongTypeSchedule, "def schedule")
    assert "WrongTypeSchedule.schedule() returned list, not StepPlan" in failure.message
    assert f"tests/support/buggy_schedulers.py:{line}" in failure.message


def test_a_raising_add_names_add() -> None:
    class RefusesAll(SpecScheduler):
        def add(self, request: RequestSpec) -> None:
            raise KeyError(request.request_id)

    failure = Runner(CFG, {"mine": RefusesAll}).run([AddRequest(_req("a"))])
    assert failure is not None and failure.scheduler == "mine"
    assert "RefusesAll.add() raised KeyError: 'a'" in failure.message
    assert "test_driver.py:" in failure.message and "in add" in failure.message


def test_the_cli_reports_a_raising_scheduler_by_name(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main

    rc = main(["check", "--against", "tests.support.buggy_schedulers:RaisingSchedule", "--steps", "60",
               "--quiet", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert rc == 1
    line = _line_of(RaisingSchedule, "raise RuntimeError")
    assert "in tests.support.buggy_schedulers:RaisingSchedule" in text
    assert f"RaisingSchedule.schedule() raised RuntimeError" in text
    assert f"buggy_schedulers.py:{line} in schedule" in text
    assert hasattr(buggy_schedulers, "RaisingSchedule")


class CountingModel:
    """A Model that samples token 1 for every sampling entry."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan, context: object = None) -> StepResult:
        self.plans.append(plan)
        return StepResult({s.request_id: (1,) for s in plan.scheduled if s.samples})


def test_the_driver_steps_any_model_and_the_fake_model_is_one() -> None:
    assert isinstance(FakeModel(2), Model)
    model = CountingModel()
    assert isinstance(model, Model)
    runner = Runner(CFG, {"spec": SpecScheduler}, models={"spec": model})
    assert runner.run([AddRequest(_req("a")), Step(), Step()]) is None
    assert len(model.plans) == 2 and runner.truth["a"] == [1, 2, 3, 1, 1]


def test_run_to_completion_steps_until_every_request_finished() -> None:
    reqs = [_req("a", max_tokens=3), _req("b", max_tokens=2), _req("c", max_tokens=5)]
    events = timed_events(reqs, {"a": 0, "b": 2, "c": 2}, [(3, "c")])
    assert [type(e).__name__ for e in events] == ["AddRequest", "Step", "Step", "AddRequest", "AddRequest",
                                                  "Step", "Abort"]
    runner = Runner(CFG, {"spec": SpecScheduler}, check_invariants=True)
    assert runner.run_to_completion(events) is None
    assert set(runner.finished) == {"a", "b", "c"}
    assert len(runner.finished["a"].output_token_ids) == 3
    assert runner.finished["c"].status.value == "finished_aborted"
    assert runner.stats.aborts == 1


def test_run_to_completion_reports_a_stall() -> None:
    class Idle(SpecScheduler):
        PROTOCOL_ERRORS = False  # its update() takes anything

        def schedule(self) -> StepPlan:
            return StepPlan(self.step + 1, (), (), ())

        def update(self, plan: StepPlan, result: StepResult) -> None:
            pass

    failure = Runner(CFG, {"idle": Idle}, check_invariants=False).run_to_completion([AddRequest(_req("a"))])
    assert failure is not None and failure.kind == "stall" and failure.scheduler == "idle"
    assert "schedules nothing" in failure.message
    failure = Runner(CFG, {"spec": SpecScheduler}).run_to_completion([AddRequest(_req("a", max_tokens=30))],
                                                                       max_steps=3)
    assert failure is not None and failure.kind == "stall" and "after 3 steps" in failure.message


def test_stats_absorb_merge_and_features() -> None:
    w = random_workload(3, 80)
    runner = Runner(w.config, {"spec": SpecScheduler})
    assert runner.run(w.events) is None
    s = runner.stats
    assert s.steps == w.num_steps
    assert s.feature("chunked") == s.chunks and s.feature("cache_hit") == s.hit_tokens
    assert s.feature("preempted") == s.preemptions
    with pytest.raises(ValueError, match="feature"):
        s.feature("nope")
    total = Stats()
    total.merge(s)
    total.merge(s)
    assert total.steps == 2 * s.steps and total.as_dict()["prefill_chunks"] == 2 * s.chunks
    assert sum(total.finished.values()) == 2 * sum(s.finished.values())


def test_workload_timetable_round_trips() -> None:
    reqs = [_req("a"), _req("b")]
    w = Workload(CFG, timed_events(reqs, {"a": 1, "b": 0}, [(4, "a")]))
    assert w.arrival_steps() == {"b": 0, "a": 1}
    assert w.abort_steps() == ((4, "a"),)
    assert [r.request_id for r in w.requests] == ["b", "a"]
    assert isinstance(w.events[-1], Abort) and w.num_steps == 4
