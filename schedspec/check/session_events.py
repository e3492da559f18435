"""Streaming-input sessions in the checking engine: the driver's share of a
SessionInput event, the context the fake model reads for a session, and
SessionRequests, which makes generated requests resumable and sends their
chunks and ends.

A session's tokens change in place when it goes on (spec/sessions.py: the
last sampled token dropped, the chunk appended), and the work it had in
flight is dropped. So the driver's truth for a session (what the model's
context must read back) follows the first scheduler's view whenever the
session stopped, and the plans still in flight deliver nothing to it; the
lockstep comparison of views holds every other scheduler to the same tokens.
"""

from __future__ import annotations

import dataclasses
import random
import weakref
from typing import Collection, Mapping, Protocol, Sequence

from schedspec.spec.interface import (
    Policy,
    RequestError,
    RequestSpec,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    SessionUpdate,
    StepResult,
    supports_sessions,
)

from schedspec.check.records import Failure, describe_difference
from schedspec.check.workload import Event, SessionInput


class _Plan(Protocol):
    dropped: set[str]


class Runner(Protocol):
    """What this module reads and writes of the driver (check/driver.py, Runner)."""

    names: list[str]
    scheds: dict[str, Scheduler]
    views: dict[str, SchedulerView]
    need_views: bool
    truth: dict[str, list[int]]
    aborted: set[str]
    where: tuple[str, str]

    @property
    def pending(self) -> Sequence[_Plan]: ...
    @property
    def primary(self) -> Scheduler: ...
    def fail(self, kind: str, name: str, message: str) -> Failure: ...

__all__ = ["SessionInput", "SessionRequests", "added", "apply", "delivered", "session_config"]

#: Runner -> the ids of the sessions it was given (a runner without one pays nothing)
_SESSIONS: "weakref.WeakKeyDictionary[Runner, set[str]]" = weakref.WeakKeyDictionary()


def added(runner: Runner, request: RequestSpec) -> list[int]:
    """The truth of a request just added (its prompt); a session is noted."""
    if request.resumable:
        _SESSIONS.setdefault(runner, set()).add(request.request_id)
    return list(request.prompt_token_ids)


def active(runner: Runner) -> bool:
    """Whether ``runner`` was given a session (a reset it refuses is then an
    outcome: a waiting session's blocks stay held, spec/sessions.py)."""
    return bool(_SESSIONS.get(runner))


def apply(runner: Runner, event: SessionInput) -> Failure | None:
    """session_update on every scheduler; a refusal (an unknown or finished
    session, one not resumable, an update after its end) is an outcome
    compared like an abort's, naming the field, not a failure. A scheduler
    without ``session_update`` cannot take the event: an error naming it."""
    update = event.update
    rid = update.request_id
    outcomes: dict[str, object] = {}
    for name in runner.names:
        sched = runner.scheds[name]
        if not supports_sessions(sched):
            return runner.fail("error", name, f"{type(sched).__qualname__} has no session_update(): "
                                              "it cannot take streaming-input sessions")
        runner.where = (name, "session_update")
        try:
            sched.session_update(update)  # type: ignore[attr-defined]
            outcomes[name] = "taken"
        except RequestError as exc:
            outcomes[name] = f"refused ({exc.field})"
        if runner.need_views:
            runner.where = (name, "view")
            runner.views[name] = sched.view()
    first = runner.names[0]
    for name in runner.names[1:]:
        if outcomes[name] != outcomes[first]:
            return runner.fail("divergence", name, describe_difference(
                f"session_update({rid!r})", first, outcomes[first], name, outcomes[name]))
    if outcomes[runner.names[0]] == "taken":
        _resync(runner, (rid,))
    return None


def delivered(runner: Runner, result: StepResult) -> Mapping[str, tuple[int, ...]]:
    """The sampled tokens of an update that extend the truth: all of them
    without sessions. A session's truth is its tokens in the first
    scheduler's view after the update (a stop dropped or trimmed some), and
    when it stopped, the plans still in flight deliver nothing to it."""
    sessions = _SESSIONS.get(runner)
    if not sessions or not sessions.intersection(result.sampled):
        return result.sampled
    touched = [rid for rid in result.sampled if rid in sessions]
    stopped = _resync(runner, touched)
    for p in runner.pending:
        p.dropped.update(stopped)
    return {rid: toks for rid, toks in result.sampled.items() if rid not in sessions}


def _resync(runner: Runner, ids: "tuple[str, ...] | list[str]") -> list[str]:
    """Set the truth of the live sessions ``ids`` to the first scheduler's
    view; returns those that stopped (their view is not RUNNING or PREEMPTED)."""
    view = runner.views.get(runner.names[0]) if runner.need_views else None
    view = view or runner.primary.view()
    stopped = []
    for rid in ids:
        rv = view.requests.get(rid)
        if rv is None or rid in runner.aborted:
            continue
        runner.truth[rid] = list(rv.all_token_ids)
        if rv.status not in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
            stopped.append(rid)
    return stopped


# ---------------------------------------------------------------- generation


def session_rng(seed: int | str) -> random.Random:
    """The generator of a workload's session draws (its own, so a workload
    without sessions is the one its seed always gave)."""
    return random.Random(f"schedspec-sessions-{seed}")


def session_config(config: SchedulerConfig) -> SchedulerConfig:
    """A config sessions are modelled in: FCFS, no KV connector."""
    if config.policy == Policy.FCFS and not config.kv_connector:
        return config
    return dataclasses.replace(config, policy=Policy.FCFS, kv_connector=False)


class SessionRequests:
    """Makes some generated requests sessions and sends their chunks and
    ends between steps, each within what the spec takes (the session's
    chunks and max_tokens stay below max_model_len)."""

    def __init__(self, config: SchedulerConfig, rng: random.Random, vocab: int = 64) -> None:
        self.config = config
        self.rng = rng
        self.vocab = vocab
        #: live session -> the bound of its tokens (spec/sessions.py, session_bound)
        self.live: dict[str, int] = {}

    def decorate(self, request: RequestSpec) -> RequestSpec:
        if self.rng.random() >= 0.4:
            return request
        self.live[request.request_id] = len(request.prompt_token_ids) + request.max_tokens
        return dataclasses.replace(request, resumable=True)

    def forget(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def before_step(self, waiting: Collection[str] | None = None) -> list[Event]:
        """The chunks and ends sent before a step: each live session gets its
        next chunk at probability 0.15, or, where the caller knows which
        sessions wait for input (``waiting``: the guided generator reads its
        spec beside it), 0.5 for those and 0.04 for the others, so a chunk
        also lands on a waiting session (applied at once) and not only in its
        queue."""
        out: list[Event] = []
        rng = self.rng
        for rid in list(self.live):
            r = rng.random()
            p_chunk = 0.15 if waiting is None else 0.5 if rid in waiting else 0.04
            if r < p_chunk:
                chunk = tuple(rng.randrange(self.vocab) for _ in range(rng.choice((1, 2, 3, 5, 8))))
                max_tokens = rng.choice((1, 2, 4, 8))
                bound = self.live[rid] + len(chunk) + max_tokens
                if bound < self.config.max_model_len:
                    self.live[rid] = bound
                    out.append(SessionInput(SessionUpdate(rid, chunk, max_tokens)))
                    continue
                r = 0.0  # no room for another chunk: the session ends
            if r < 0.03:
                out.append(SessionInput(SessionUpdate(rid, end=True)))
                del self.live[rid]
        return out

    def finish(self) -> list[Event]:
        """The end of every session still open (so a run to completion ends)."""
        out: list[Event] = [SessionInput(SessionUpdate(rid, end=True)) for rid in self.live]
        self.live.clear()
        return out
