"""``schedspec bench --kv-events --stats``: every scheduler with the KV cache
events on (config.enable_kv_cache_events) and built with ``log_stats``, and
each timed step pays for them as vLLM's does: vLLM 0.33's
``Scheduler.update_from_output`` takes the block pool's events
(``kv_cache_manager.take_events()``, published as one batch) and, with
``log_stats``, makes the statistics (``make_stats()``) inside the call the
bench times; a schedspec scheduler's timed ``update()`` is followed by its
``take_kv_events()`` and ``make_stats()`` (``WithOutputs``), timed with it."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, cast

from schedspec.adapters.vllm_adapter import VllmScheduler
from schedspec.spec.interface import Scheduler, SchedulerConfig, SchedulerFactory, StepPlan, StepResult


class WithOutputs:
    """``inner`` whose update() also takes the events and makes the statistics."""

    def __init__(self, inner: Scheduler, events: bool, stats: bool) -> None:
        self.inner, self.events, self.stats = inner, events, stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update(self, plan: StepPlan, result: StepResult) -> None:
        inner: Any = self.inner
        inner.update(plan, result)
        if self.events:
            inner.take_kv_events()
        if self.stats:
            inner.make_stats()


def with_outputs(factories: Mapping[str, SchedulerFactory], events: bool,
                 stats: bool) -> dict[str, SchedulerFactory]:
    """The factories with the outputs on (vLLM's own update_from_output pays for them)."""

    def wrap(factory: SchedulerFactory) -> SchedulerFactory:
        def build(config: SchedulerConfig) -> Scheduler:
            config = dataclasses.replace(config, enable_kv_cache_events=events or config.enable_kv_cache_events)
            sched: Scheduler = cast(Any, factory)(config, log_stats=stats) if stats else factory(config)
            if isinstance(sched, VllmScheduler) or not (events or stats):
                return sched
            return cast(Scheduler, WithOutputs(sched, events, stats))

        return build

    return {name: wrap(f) for name, f in factories.items()}
