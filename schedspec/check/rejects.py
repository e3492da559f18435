"""The check tests a scheduler's refusals inside the run: the Scheduler
protocol says that a call it refuses raises the spec's error and changes
nothing (spec/interface.py, Scheduler; spec/protocol.py, the checks). A
well-behaved workload never sends such a call, so a refusal that lets a bad
input through, names the wrong field, or half-applies it is never seen.

Every REJECT_EVERY steps (at steps REJECT_OFFSET, REJECT_OFFSET +
REJECT_EVERY, ...), before the real update(), each scheduler is handed the
step's result spoilt in each way of ``bad_results`` that applies to it; and
every REJECT_EVERY-th added request is followed by the bad calls of
``bad_adds`` (its id again; an encoder input of a known identifier with
another length; a session update for a request that is not resumable). The
reference must refuse each; every other scheduler must refuse it with the
same error (its class, ``field``, ``step``, ``request_id``); each must leave
its view as it was. Only a scheduler whose class sets ``PROTOCOL_ERRORS =
True`` (it raises the errors of spec/protocol.py: the spec, impl, a user's
class that opts in) is probed, and only with the methods it has.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from schedspec.check.deadline import CallTimeout
from schedspec.check.records import Failure
from schedspec.check.stats import Stats
from schedspec.spec.interface import (
    MMInput,
    RequestSpec,
    Scheduler,
    SchedSpecError,
    SchedulerConfig,
    SchedulerView,
    SessionUpdate,
    StepPlan,
    StepResult,
)

REJECT_EVERY = 4
REJECT_OFFSET = 2
#: the id no workload gives a request (the bad calls' unscheduled request)
NOBODY = "schedspec-refused"


class Runner(Protocol):
    """What this module reads and writes of the driver (check/driver.py, Runner)."""

    config: SchedulerConfig
    names: list[str]
    scheds: dict[str, Scheduler]
    views: dict[str, SchedulerView]
    where: tuple[str, str]
    stats: Stats
    need_views: bool

    def fail(self, kind: str, name: str, message: str) -> Failure: ...


def due(count: int, every: int) -> bool:
    """Whether the ``count``-th step (or added request) is probed."""
    return every > 0 and count % every == REJECT_OFFSET % every


def probed(sched: Scheduler) -> bool:
    return getattr(type(sched), "PROTOCOL_ERRORS", False) is True


#: A spoilt call: what it is (for the message), the method and its arguments.
Bad = tuple[str, str, tuple[object, ...]]


def _sampled(result: StepResult, rid: str, tokens: object) -> StepResult:
    return dataclasses.replace(result, sampled={**result.sampled, rid: tokens})  # type: ignore[dict-item]


def bad_results(plan: StepPlan, result: StepResult, live: frozenset[str], num_spec: int) -> list[Bad]:
    """The ways to spoil ``result`` that apply to ``plan`` (``live``: the
    requests still unfinished, which may get only what their entry takes)."""
    spoilt: list[tuple[str, StepResult]] = [
        (f"tokens for {NOBODY!r}, which the plan did not schedule", _sampled(result, NOBODY, (0,))),
        (f"drafts for {NOBODY!r}, which the plan did not schedule",
         dataclasses.replace(result, draft_token_ids={**result.draft_token_ids, NOBODY: ()})),
    ]
    got = [s for s in plan.scheduled if s.request_id in result.sampled]
    if got:
        s = got[0]
        toks = result.sampled[s.request_id]
        spoilt.append((f"a negative token for {s.request_id!r}",
                       _sampled(result, s.request_id, (*toks[:-1], -1) if toks else (-1,))))
        spoilt.append((f"a list, not a tuple, of tokens for {s.request_id!r}",
                       _sampled(result, s.request_id, list(toks))))
    for s in plan.scheduled:
        if s.request_id in live and s.samples:
            over = (0,) * (2 + len(s.spec_token_ids))
            spoilt.append((f"{len(over)} tokens for {s.request_id!r}, which verifies {len(s.spec_token_ids)} drafts",
                           _sampled(result, s.request_id, over)))
            spoilt.append((f"{num_spec + 1} drafts for {s.request_id!r} ({num_spec} allowed)",
                           dataclasses.replace(result, draft_token_ids={
                               **result.draft_token_ids, s.request_id: (0,) * (num_spec + 1)})))
            break
    for s in plan.scheduled:
        if s.request_id in live and not s.samples:
            spoilt.append((f"a token for {s.request_id!r}, a partial prefill chunk",
                           _sampled(result, s.request_id, (0,))))
            break
    return [(f"update(plan of step {plan.step}, a result with {what})", "update", (plan, r)) for what, r in spoilt]


def bad_adds(request: RequestSpec, known: dict[str, int]) -> list[Bad]:
    """The bad calls after ``request`` was added (``known``: the encoder
    inputs' identifiers seen so far, with their lengths)."""
    rid = request.request_id
    bad: list[Bad] = [(f"add({rid!r}) again", "add", (request,))]
    for mm in request.mm_inputs:
        if known.get(mm.identifier) == mm.length:
            length = mm.length - 1 if mm.length > 1 else 2
            inputs = tuple(MMInput(m.offset, length, m.identifier) if m.identifier == mm.identifier else m
                           for m in request.mm_inputs)
            try:
                other = dataclasses.replace(request, request_id=NOBODY, mm_inputs=inputs)
            except SchedSpecError:
                continue  # shortened, the inputs break another rule of a request
            bad.append((f"add({NOBODY!r}) with {mm.identifier!r} of length {length}, seen with {mm.length}",
                        "add", (other,)))
            break
    if not request.resumable:
        bad.append((f"session_update({rid!r}), which is not resumable", "session_update",
                    (SessionUpdate(rid, (0,), 1),)))
    return bad


def _outcome(sched: Scheduler, method: str, args: tuple[object, ...]) -> BaseException | None:
    try:
        getattr(sched, method)(*args)
    except CallTimeout:
        raise
    except Exception as exc:
        return exc
    return None


def _sig(exc: BaseException) -> tuple[str, object, object, object]:
    return (type(exc).__name__, getattr(exc, "field", None), getattr(exc, "step", None),
            getattr(exc, "request_id", None))


def _show(exc: BaseException | None) -> str:
    if exc is None:
        return "accepted it"
    name, fld, step, rid = _sig(exc)
    return f"raised {name}(field={fld!r}, step={step!r}, request_id={rid!r}): {exc}"


def probe(runner: Runner, bad: list[Bad]) -> Failure | None:
    """Hand every probed scheduler each bad call: the reference must refuse
    it, the others as the reference does, and none may change (its view
    after the calls is the view before them)."""
    refs: dict[str, BaseException] = {}
    for i, name in enumerate(runner.names):
        sched = runner.scheds[name]
        if not probed(sched):
            continue
        calls = [b for b in bad if callable(getattr(sched, b[1], None))]  # session_update is optional
        for j, (what, method, args) in enumerate(calls):
            runner.where = (name, method)
            earlier = (f" (after it refused: {'; '.join(c[0] for c in calls[:j])})" if j else "")
            exc = _outcome(sched, method, args)
            ref = refs.get(what)
            if i == 0 or ref is None:
                if exc is None:
                    return runner.fail("error", name, f"{name}.{what}: it accepted it; the protocol refuses it "
                                       f"and changes nothing{earlier} (check/rejects.py)")
                refs[what] = exc
            elif exc is None or _sig(exc) != _sig(ref):
                return runner.fail("divergence", name, f"{name}.{what}: it {_show(exc)}; {runner.names[0]} "
                                   f"{_show(ref)}{earlier} (check/rejects.py)")
            runner.stats.refusals += 1
        if calls and runner.need_views and name in runner.views:
            runner.where = (name, "view")
            if (after := sched.view()) != runner.views[name]:
                return runner.fail("divergence", name, f"{name}'s view changed across calls it refused: "
                                   + "; ".join(c[0] for c in calls)
                                   + " (a refused call changes nothing: check/rejects.py)")
    return None


class Rejects:
    """The probe's state in one run: when it is due, and the encoder
    inputs' lengths seen (for the bad add of a known identifier)."""

    def __init__(self, every: int = REJECT_EVERY) -> None:
        self.every = every
        self.adds = 0
        self.mm_lengths: dict[str, int] = {}

    def after_add(self, runner: Runner, request: RequestSpec) -> Failure | None:
        for mm in request.mm_inputs:
            self.mm_lengths.setdefault(mm.identifier, mm.length)
        self.adds += 1
        return probe(runner, bad_adds(request, self.mm_lengths)) if due(self.adds, self.every) else None

    def before_update(self, runner: Runner, step: int, plans: dict[str, StepPlan],
                      results: dict[str, StepResult]) -> Failure | None:
        if not due(step, self.every):
            return None
        first = runner.names[0]
        view = runner.views.get(first)
        live = frozenset(view.requests) if view is not None else frozenset()
        bad = bad_results(plans[first], results[first], live, runner.config.num_speculative_tokens)
        return probe(runner, bad)
