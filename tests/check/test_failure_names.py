"""A scheduler that crashes is named, with the call that raised: while being
built, on its first view, inside a method, and when the invariant checks
choke on what its view() returned."""

from __future__ import annotations

import dataclasses

from schedspec.adapters.registry import factory_of
from schedspec.check.driver import Runner
from schedspec.check.workload import AddRequest, Event, Step
from schedspec.spec.interface import RequestSpec, SchedulerConfig, SchedulerView
from schedspec.spec.scheduler import SpecScheduler

CONFIG = SchedulerConfig(num_blocks=9, block_size=4, max_num_batched_tokens=16, max_model_len=16)
EVENTS: list[Event] = [AddRequest(RequestSpec("r1", (1, 2, 3), max_tokens=4)), Step(), Step(), Step()]


class CrashesWhenBuilt(SpecScheduler):
    def __init__(self, config: SchedulerConfig) -> None:
        raise RuntimeError("no such config")


class CrashesOnFirstView(SpecScheduler):
    def view(self) -> SchedulerView:
        raise KeyError("nothing to see")


class MalformedView(SpecScheduler):
    def view(self) -> SchedulerView:
        v = super().view()
        if self.step < 2:
            return v
        return dataclasses.replace(v, requests={"r1": None})  # type: ignore[dict-item]


def _run(cls: type, check_invariants: bool = True) -> str:
    runner = Runner(CONFIG, {"spec": SpecScheduler, "mine": factory_of(cls, "test")},
                    check_invariants=check_invariants)
    failure = runner.run(EVENTS)
    assert failure is not None and failure.kind == "error" and failure.scheduler == "mine"
    text = failure.describe()
    assert "in ?" not in text and "?" not in failure.message.split(" raised")[0]
    return text


def test_a_scheduler_that_cannot_be_built_is_named() -> None:
    text = _run(CrashesWhenBuilt)
    assert text.startswith("error before the first event (building the scheduler) in mine")
    assert "CrashesWhenBuilt(config) raised RuntimeError: no such config" in text
    assert "test_failure_names.py" in text  # the frame that raised


def test_a_first_view_that_raises_is_named() -> None:
    text = _run(CrashesOnFirstView)
    assert "CrashesOnFirstView.view() raised KeyError" in text


def test_every_apply_after_a_build_failure_returns_it() -> None:
    runner = Runner(CONFIG, {"mine": factory_of(CrashesWhenBuilt, "test")})
    assert runner.run([]) is runner.build_failure is not None
    assert runner.apply(Step()) is runner.build_failure


def test_invariant_checks_choking_on_a_view_name_the_view() -> None:
    text = _run(MalformedView)
    assert "the invariant checks on the view of mine (what MalformedView.view() returned) raised" in text
