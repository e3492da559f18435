"""The workload model: what happens to a scheduler, one event at a time.

A workload is a SchedulerConfig plus a sequence of events. Events are plain
frozen values so a workload can be written to a trace and replayed against any
scheduler. A Step event means: ``plan = schedule()``, run the model,
``update(plan, result)``.

With async scheduling (``config.async_scheduling``) a Step is one step of
vLLM's engine core with a batch queue of two (vllm/v1/engine/core.py,
EngineCore.step_with_batch_queue): schedule a new plan and run the model on
it, then, when two plans are in flight, update the oldest. So after the first
Step one plan is always in flight, and every event between two Steps comes
between schedule(N) and update(N). The finer events Schedule and Update spell
an interleaving out (an abort between schedule(N+1) and update(N), say):
a Step is exactly Schedule() followed, in sync mode or when two plans are then
in flight, by Update().

This module is the event language only: the events, their validation, the
in-flight protocol and the Workload that holds them (check/trace.py writes
and reads them). What a workload may turn on is named in check/features.py;
the generators live beside it (check/random_workloads.py,
check/coverage_guided.py, with the draws of check/config_space.py,
check/gate_requests.py and check/kv_requests.py), and the vLLM defects they
steer around are the table of check/defects.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from schedspec.spec.interface import RequestSpec, SchedSpecError, SchedulerConfig, SessionUpdate, StepPlan, StepResult


@dataclass(frozen=True)
class AddRequest:
    request: RequestSpec


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Step:
    pass


@dataclass(frozen=True)
class ResetPrefixCache:
    reset_running_requests: bool = False


#: The pause modes of a Pause event: "new" is vLLM's PAUSED_NEW (the engine
#: core's "abort" and "wait" pause modes: nothing new is admitted, running
#: requests drain), "all" is PAUSED_ALL (its "keep" mode: nothing is scheduled).
PAUSE_MODES: tuple[str, ...] = ("new", "all")


@dataclass(frozen=True)
class Pause:
    """The engine core pauses the scheduler (vllm/v1/engine/core.py,
    EngineCore.pause_scheduler): ``set_pause_state(PAUSED_NEW)`` for mode
    "new", ``set_pause_state(PAUSED_ALL)`` for mode "all". With
    ``clear_cache`` the prefix cache is reset, running requests included,
    once the pause completes: when the engine has no work left
    (EngineCore._finish_pause, called at once or from the idle callback)."""

    mode: str = "new"
    clear_cache: bool = False

    def __post_init__(self) -> None:
        if self.mode not in PAUSE_MODES:
            raise ValueError(f"Pause.mode must be one of {', '.join(PAUSE_MODES)}, got {self.mode!r}")
        if not isinstance(self.clear_cache, bool):
            raise ValueError(f"Pause.clear_cache must be a boolean, got {self.clear_cache!r}")


@dataclass(frozen=True)
class Resume:
    """``set_pause_state(UNPAUSED)`` (EngineCore.resume_scheduler)."""


@dataclass(frozen=True)
class GrammarReady:
    """The structured-output manager finished compiling the grammar of a
    request waiting in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR; ``ok=False``:
    the compile failed."""

    request_id: str
    ok: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"GrammarReady.request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.ok, bool):
            raise ValueError(f"GrammarReady.ok must be a boolean, got {self.ok!r}")


@dataclass(frozen=True)
class RecordedPlan:
    """The plan a recorded scheduler made at a Schedule (trace format 5,
    written by the engine's recorder, schedspec/engine/recorder.py): per
    entry, in plan order, ``(request id, kind, num_computed_tokens,
    num_scheduled_tokens, number of drafts)``; the preempted and finished
    ids, sorted. A replay holds the scheduler's plan to it
    (schedspec/check/recorded.py); the drivers ignore it."""

    scheduled: tuple[tuple[str, str, int, int, int], ...] = ()
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()

    @classmethod
    def of(cls, plan: StepPlan) -> RecordedPlan:
        return cls(
            tuple((s.request_id, s.kind.value, s.num_computed_tokens, s.num_scheduled_tokens,
                   len(s.spec_token_ids)) for s in plan.scheduled),
            tuple(sorted(plan.preempted_ids)), tuple(sorted(plan.finished_ids)))


@dataclass(frozen=True)
class Schedule:
    """``plan = schedule()`` and run the model on it; the plan is then in
    flight until an Update. ``result``, when given, is the model's output for
    the requests it names (a recorded output: the fake model takes these
    tokens and drafts instead of its own). ``plan``, when given, is the plan
    the recorded scheduler made here (RecordedPlan)."""

    result: StepResult | None = None
    plan: RecordedPlan | None = None


@dataclass(frozen=True)
class Update:
    """``update(plan, result)`` of the oldest plan in flight. ``step``, when
    given, names that plan (the n-th plan of the run is step n): an Update
    naming another step is a malformed workload."""

    step: int | None = None


@dataclass(frozen=True)
class KVLoadDone:
    """The KV connector's worker reports the asynchronous load of request
    ``request_id`` finished (StepResult.finished_recving). The driver's
    worker queues it and delivers it in the next StepResult where it is
    meaningful: the request has an asynchronous load in flight (it waits in
    WAITING_FOR_REMOTE_KVS, or was aborted during the load and still holds
    its blocks). While the request is unfinished and no load of it is in
    flight the event waits (the load starts at its admission); once the
    request is finished and holds nothing, it is dropped."""

    request_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"KVLoadDone.request_id must be a non-empty string, got {self.request_id!r}")


@dataclass(frozen=True)
class KVLoadFailed:
    """The worker reports a load of request ``request_id`` failed.
    ``block_index`` None: the whole asynchronous load failed
    (StepResult.failed_recving, with the request in finished_recving);
    ``i``: the block at index ``i`` of the request's group-0 table could not
    be filled (StepResult.invalid_block_ids; for an asynchronous load the
    request is also in finished_recving). ``i`` is taken within the loaded
    blocks (an index before them names the load's first block, one after
    them its last). A synchronous load is reported failed in the result of
    the step that loads it (its sample is discarded, as vLLM's
    update_from_output skips the request); ``None`` there names the load's
    first block. With more than one KV cache group the worker never reports
    invalid_block_ids (vLLM raises there, _handle_invalid_blocks): an
    asynchronous load is reported in failed_recving instead, and the event
    for a synchronous load is dropped (failed_recving only concerns a
    request in WAITING_FOR_REMOTE_KVS). Waits and is dropped as KVLoadDone."""

    request_id: str
    block_index: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"KVLoadFailed.request_id must be a non-empty string, got {self.request_id!r}")
        if self.block_index is not None and (
            not isinstance(self.block_index, int) or isinstance(self.block_index, bool) or self.block_index < 0
        ):
            raise ValueError(f"KVLoadFailed.block_index must be None or an integer >= 0, got {self.block_index!r}")


@dataclass(frozen=True)
class KVSaveDone:
    """The worker reports the asynchronous save of finished request
    ``request_id`` finished (StepResult.finished_sending): its held blocks
    are freed. Meaningful while the request is finished and holds its blocks
    for a save (SchedulerView.kv_held_by_finished); waits while it is
    unfinished, dropped once it is finished and holds nothing."""

    request_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"KVSaveDone.request_id must be a non-empty string, got {self.request_id!r}")


@dataclass(frozen=True)
class SessionInput:
    """The client sends a streaming-input session its next chunk, or ends it
    (vLLM: add_request with the session's id; the scheduler's optional
    ``session_update``, spec/sessions.py). It may come at any time: while
    the session runs, is preempted, or waits for input."""

    update: SessionUpdate


Event = Union[AddRequest, Abort, Step, ResetPrefixCache, Schedule, Update, Pause, Resume, GrammarReady,
              KVLoadDone, KVLoadFailed, KVSaveDone, SessionInput]

#: The KV connector's worker events (a scheduler without the kv_connector
#: capability cannot take them).
KV_EVENTS: tuple[type, ...] = (KVLoadDone, KVLoadFailed, KVSaveDone)
KVEvent = Union[KVLoadDone, KVLoadFailed, KVSaveDone]

#: The bounded wait: the worker reports every asynchronous load (done) and
#: every pending save at the latest this many steps after it started (the
#: load's plan, or the first plan after the request finished holding its
#: blocks), as a connector's timeout does, so no block is held forever.
KV_REPORT_BOUND = 8

#: The event types of the admission gates (a scheduler without the gate's
#: optional method cannot take them).
GATE_EVENTS: tuple[type, ...] = (Pause, Resume, GrammarReady)


class EventError(SchedSpecError, ValueError):
    """A workload event that breaks the in-flight protocol (an Update with
    nothing in flight or for another step, a Schedule while the scheduler
    may not take one). ``index`` is the event's position in the workload."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"event {index}: {message}")
        self.index = index


class InFlight:
    """The plans in flight, counted the way a driver schedules them: the n-th
    schedule() of a run is step n. The trace loader and the driver both walk a
    workload's events through one of these, so a workload that breaks the
    in-flight protocol is refused before any scheduler sees it."""

    def __init__(self, async_scheduling: bool, depth: int | None = None) -> None:
        self.async_scheduling = async_scheduling
        #: k, the plans in flight once schedule() returns
        #: (SchedulerConfig.max_concurrent_batches; None: two with async
        #: scheduling, else one)
        self.depth = depth
        self.scheduled = 0
        self.steps: list[int] = []  # the steps in flight, oldest first

    @classmethod
    def of(cls, config: SchedulerConfig) -> InFlight:
        """The protocol of ``config``: k = its max_concurrent_batches."""
        return cls(config.async_scheduling, config.max_concurrent_batches)

    @property
    def limit(self) -> int:
        """How many plans may be in flight once schedule() returns."""
        if self.depth is not None:
            return self.depth
        return 2 if self.async_scheduling else 1

    def schedule(self) -> str | None:
        """Count a schedule(); the reason it may not happen, or None."""
        if len(self.steps) >= self.limit:
            if self.limit > 2:
                return (f"schedule with steps {', '.join(map(str, self.steps))} in flight: {self.limit} plans "
                        f"may be in flight (pipeline_parallel_size), so step {self.steps[0]} must be updated first")
            if self.async_scheduling:
                return (f"schedule with steps {self.steps[0]} and {self.steps[1]} in flight: "
                        f"step {self.steps[0]} must be updated first")
            return (f"schedule with step {self.steps[0]} in flight: without async scheduling "
                    "every plan is updated before the next schedule")
        self.scheduled += 1
        self.steps.append(self.scheduled)
        return None

    def update(self, step: int | None) -> str | None:
        """Count an update() of ``step`` (None: the oldest in flight); the
        reason it may not happen, or None."""
        if step is not None and step > self.scheduled:
            return f"update for step {step}, which was never planned (the last plan is step {self.scheduled})"
        if not self.steps:
            if step is None:
                return "update with no plan in flight"
            return f"update for step {step}, which was already updated"
        if step is not None and step != self.steps[0]:
            if step in self.steps:
                return f"update for step {step} out of order: step {self.steps[0]} is in flight before it"
            return f"update for step {step}, which was already updated"
        self.steps.pop(0)
        return None

    def step(self) -> tuple[bool, str | None]:
        """Count a Step event: (whether it updates, the reason it may not happen)."""
        if (why := self.schedule()) is not None:
            return False, why
        if len(self.steps) >= self.limit:  # the batch queue is full
            self.steps.pop(0)
            return True, None
        return False, None

    def reset(self) -> str | None:
        """Whether reset_prefix_cache may come now: never between a schedule
        and its update without async scheduling; with it, while at most one
        plan is in flight (vLLM's engine core serves a reset between two
        engine steps); with k plans in flight, while at most k - 1 are."""
        if len(self.steps) > self.limit - 1:
            return f"reset_prefix_cache with step(s) {self.steps} in flight"
        return None


@dataclass(frozen=True)
class Workload:
    """A configuration and the events to feed a scheduler built from it.

    ``name`` and ``features`` (what the workload was built to contain, such as
    "shared-prefix" or "aborts") are for reports; drivers read neither."""

    config: SchedulerConfig
    events: tuple[Event, ...]
    seed: int | None = None
    name: str = ""
    features: tuple[str, ...] = ()

    @property
    def num_steps(self) -> int:
        """The plans the events schedule (Step and Schedule events)."""
        return sum(1 for e in self.events if isinstance(e, (Step, Schedule)))

    @property
    def requests(self) -> tuple[RequestSpec, ...]:
        """The requests the workload adds, in order."""
        return tuple(e.request for e in self.events if isinstance(e, AddRequest))

    def arrival_steps(self) -> dict[str, int]:
        """Request id -> the number of steps before it is added."""
        out: dict[str, int] = {}
        steps = 0
        for e in self.events:
            if isinstance(e, (Step, Schedule)):
                steps += 1
            elif isinstance(e, AddRequest):
                out[e.request.request_id] = steps
        return out

    def abort_steps(self) -> tuple[tuple[int, str], ...]:
        """(the number of steps before it, request id) of every abort, in order."""
        out: list[tuple[int, str]] = []
        steps = 0
        for e in self.events:
            if isinstance(e, (Step, Schedule)):
                steps += 1
            elif isinstance(e, Abort):
                out.append((steps, e.request_id))
        return tuple(out)


def keep_protocol(events: Sequence[Event], async_scheduling: bool, depth: int | None = None) -> list[Event]:
    """``events`` within the in-flight protocol of a mode: a Step, Schedule or
    reset_prefix_cache the mode does not allow at that point, and an Update
    with nothing in flight, are dropped; Updates lose their step numbers (they
    update the oldest plan either way). The identity on events that keep it,
    step numbers aside. The shrinker's candidates and a workload whose mode a
    scheduler cannot run go through it. ``depth``: k (InFlight)."""
    flight = InFlight(async_scheduling, depth)
    out: list[Event] = []
    for e in events:
        if isinstance(e, Step):
            probe = InFlight(async_scheduling, depth)
            probe.scheduled, probe.steps = flight.scheduled, list(flight.steps)
            if probe.step()[1] is not None:
                continue
            flight.step()
        elif isinstance(e, Schedule):
            if flight.schedule() is not None:
                continue
        elif isinstance(e, Update):
            if flight.update(None) is not None:
                continue
            e = Update()
        elif isinstance(e, ResetPrefixCache) and flight.reset() is not None:
            continue
        out.append(e)
    return out


def describe_event(event: Event) -> str:
    """One event as a line of a script: ``add(RequestSpec(...))``, ``step()``,
    ``abort('r3')``, ``reset_prefix_cache(reset_running_requests=True)``,
    ``schedule()``, ``update(step=3)``."""
    if isinstance(event, AddRequest):
        return f"add({event.request!r})"
    if isinstance(event, Abort):
        return f"abort({event.request_id!r})"
    if isinstance(event, Step):
        return "step()"
    if isinstance(event, Schedule):
        return "schedule()" if event.result is None else f"schedule(result={event.result!r})"
    if isinstance(event, Update):
        return "update()" if event.step is None else f"update(step={event.step})"
    if isinstance(event, Pause):
        return f"pause(mode={event.mode!r}, clear_cache={event.clear_cache})"
    if isinstance(event, Resume):
        return "resume()"
    if isinstance(event, GrammarReady):
        return f"grammar_ready({event.request_id!r}" + (")" if event.ok else ", ok=False)")
    if isinstance(event, KVLoadDone):
        return f"kv_load_done({event.request_id!r})"
    if isinstance(event, KVLoadFailed):
        return f"kv_load_failed({event.request_id!r}" + (
            ")" if event.block_index is None else f", block_index={event.block_index})")
    if isinstance(event, KVSaveDone):
        return f"kv_save_done({event.request_id!r})"
    if isinstance(event, SessionInput):
        return f"session_update({event.update!r})"
    return f"reset_prefix_cache(reset_running_requests={event.reset_running_requests})"


def timed_events(
    requests: Sequence[RequestSpec], arrive_at: Mapping[str, int], aborts: Sequence[tuple[int, str]] = ()
) -> tuple[Event, ...]:
    """Events from a timetable: a request that arrives at step N (counted
    from 0) is an AddRequest before the (N+1)th Step, an abort at step N an
    Abort after that step's arrivals. No Step follows the last arrival or
    abort: a driver that runs to completion steps on from there."""
    adds = sorted(requests, key=lambda r: (arrive_at[r.request_id], r.arrival))
    kills = sorted(aborts)
    last = max([arrive_at[r.request_id] for r in adds] + [step for step, _ in kills], default=0)
    events: list[Event] = []
    a = k = 0
    for step in range(last + 1):
        if step:
            events.append(Step())
        while a < len(adds) and arrive_at[adds[a].request_id] <= step:
            events.append(AddRequest(adds[a]))
            a += 1
        while k < len(kills) and kills[k][0] <= step:
            events.append(Abort(kills[k][1]))
            k += 1
    return tuple(events)
