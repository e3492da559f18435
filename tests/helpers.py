"""The scenario vocabulary the tests share: a small config, a request, a step,
a plan as plain tuples, an exact error message, and spec and impl side by side.

    cfg(**kw)          SchedulerConfig: 4-token blocks, 8 usable blocks, a budget of 64
                       tokens, 8 sequences, max_model_len 32; ``kw`` overrides
    req(rid, prompt)   RequestSpec; an int prompt means tokens 0 .. prompt-1
    step(s, token)     one schedule() + update() in which every sampling entry gets ``token``
    entries(plan)      (request id, kind, num_computed_tokens, num_scheduled_tokens) per entry
    message(fn, exc)   the text of the exception ``fn`` raises
    Twin(config)       spec and impl driven by the same operations, compared after each
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from schedspec.check.driver import Runner
from schedspec.check.records import Failure
from schedspec.check.run import run_workload
from schedspec.check.workload import Workload
from schedspec.impl import ImplScheduler
from schedspec.spec import (
    RequestSpec,
    Scheduler,
    SchedulerConfig,
    SpecScheduler,
    StepPlan,
    StepResult,
)
from schedspec.spec.interface import SchedulerFactory


def cfg(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(
        block_size=4, num_blocks=9, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=32
    )
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def req(rid: str, prompt: list[int] | int, max_tokens: int = 4, **kw: object) -> RequestSpec:
    toks = tuple(range(prompt)) if isinstance(prompt, int) else tuple(prompt)
    return RequestSpec(rid, toks, max_tokens, **kw)  # type: ignore[arg-type]


def step(s: Scheduler, token: int = 7) -> StepPlan:
    """One schedule() + update() in which every sampling entry gets ``token``."""
    plan = s.schedule()
    s.update(plan, StepResult({e.request_id: (token,) for e in plan.scheduled if e.samples}))
    return plan


def entries(plan: StepPlan) -> list[tuple[str, str, int, int]]:
    return [(e.request_id, e.kind.value, e.num_computed_tokens, e.num_scheduled_tokens) for e in plan.scheduled]


def message(fn: Callable[[], object], exc: type[BaseException] = Exception) -> str:
    with pytest.raises(exc) as info:
        fn()
    return str(info.value)


#: Both schedulers, for tests parametrized over them (``@spec_and_impl``).
SCHEDULERS: list[Callable[[SchedulerConfig], Any]] = [SpecScheduler, ImplScheduler]
spec_and_impl = pytest.mark.parametrize("make", SCHEDULERS, ids=["spec", "impl"])


def lockstep(workload: Workload, factories: dict[str, SchedulerFactory] | None = None, vocab: int = 64,
             oracle_seed: int = 0) -> tuple[Runner, Failure | None]:
    """Run ``workload`` on spec and impl (or ``factories``) in lockstep with the
    fake model and every invariant, as ``schedspec check`` and ``replay`` do."""
    chosen: dict[str, SchedulerFactory] = factories or {"spec": SpecScheduler, "impl": ImplScheduler}
    return run_workload(workload, chosen, vocab, oracle_seed)


# ---------------------------------------------------------------- spec and impl side by side


class BothRaised(Exception):
    """Spec and impl raised the same exception, with the same message."""


class Twin:
    """Spec and impl driven by the same operations: after each one, equal
    outcomes (value, or exception type and message) and equal views."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.spec = SpecScheduler(config)
        self.impl = ImplScheduler(config)

    def both(self, op: Callable[[Any], Any]) -> Any:
        """``op`` on spec and impl: the same value (returned) or the same error
        (raised as BothRaised), and equal views after."""
        outcomes = []
        for s in (self.spec, self.impl):
            try:
                outcomes.append(("ok", op(s)))
            except Exception as exc:  # noqa: BLE001 - compared below
                outcomes.append((type(exc).__name__, str(exc)))
        assert outcomes[0] == outcomes[1]
        assert self.spec.view() == self.impl.view()
        kind, value = outcomes[0]
        if kind != "ok":
            raise BothRaised(f"{kind}: {value}")
        return value

    def expect_error(self, op: Callable[[Any], Any]) -> str:
        with pytest.raises(BothRaised) as info:
            self.both(op)
        return str(info.value)

    def add(self, r: RequestSpec) -> None:
        self.both(lambda s: s.add(r))

    def abort(self, rid: str) -> None:
        self.both(lambda s: s.abort(rid))

    def reset(self, running: bool = False) -> bool:
        result: bool = self.both(lambda s: s.reset_prefix_cache(running))
        return result

    def schedule(self) -> StepPlan:
        plan: StepPlan = self.both(lambda s: s.schedule())
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> None:
        self.both(lambda s: s.update(plan, result))

    def step(self, token: int | Callable[[str], int] = 7) -> StepPlan:
        plan = self.schedule()
        tok = token if callable(token) else (lambda rid: token)
        self.update(plan, StepResult({e.request_id: (tok(e.request_id),) for e in plan.scheduled if e.samples}))
        return plan


class Tok(int):
    """A token id of an int subclass: valid, and off impl's fast path."""


def truncated_sync_load_in_flight(s: Any, max_tokens: int = 4) -> None:
    """Async scheduling with a connector under "recompute", on a scheduler or
    a Twin: request "a" (14 tokens, 8 loaded synchronously) is scheduled
    twice; the first step's update reports its second loaded block invalid
    while the second step is in flight; a third step is scheduled, then both
    are updated (docs/divergences.md, "A stale output placeholder after a
    failed synchronous load")."""
    s.add(req("a", 14, max_tokens=max_tokens, kv_external_tokens=8))
    first = s.schedule()
    second = s.schedule()
    s.update(first, StepResult({"a": (5,)}, invalid_block_ids=first.kv_loads[0].block_ids[1:2]))
    third = s.schedule()
    s.update(second, StepResult({"a": (6,)}))
    s.update(third, StepResult({"a": (7,)}))

