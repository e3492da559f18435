"""Schedulers for the mode, capability and conformance tests."""

from __future__ import annotations

from typing import Any

from schedspec.check.capabilities import Capabilities
from schedspec.spec.interface import Policy, SchedulerView, StepPlan, StepResult
from schedspec.spec.scheduler import SpecScheduler


class FcfsOnly(SpecScheduler):
    """The spec, declared to support FCFS only, no threshold, no prefix-cache reset."""

    CAPABILITIES = Capabilities(
        policies=frozenset({Policy.FCFS}), long_prefill_threshold=False, reset_prefix_cache=False
    )

    def __init__(self, config: Any) -> None:
        assert config.policy == Policy.FCFS and config.long_prefill_token_threshold == 0
        super().__init__(config)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        raise AssertionError("reset_prefix_cache is declared unsupported")


class ListQueues(SpecScheduler):
    """view() reports the waiting queue as a list."""

    def view(self) -> SchedulerView:
        v = super().view()
        object.__setattr__(v, "waiting", list(v.waiting))
        return v


class UpdateTakesOne(SpecScheduler):
    def update(self, plan: StepPlan) -> None:  # type: ignore[override]
        raise AssertionError("never called")


class HasUpdateFromOutput(SpecScheduler):
    """A protocol scheduler that happens to have a method named like vLLM's."""

    def update_from_output(self, plan: StepPlan, result: StepResult) -> None:
        self.update(plan, result)
