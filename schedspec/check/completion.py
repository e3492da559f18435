"""How a run ends: stepping on past a workload's events until every request
has finished (``run_to_completion``), or until the engine is quiescent and
every KV block is free (``quiesce``).

Both drive a Runner (check/driver.py) through its public surface alone,
typed here as the ``Driven`` protocol, so this module imports nothing of the
driver: the Runner's methods of the same names call in with a deadline
around the call.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sized

from schedspec.invariants import Violation
from schedspec.spec.interface import PauseState, RequestView, Scheduler, SchedulerConfig, SchedulerView, StepPlan
from schedspec.check.oracle import KVWorker
from schedspec.check.records import Failure
from schedspec.check.stats import Stats
from schedspec.check.workload import KV_REPORT_BOUND, Abort, AddRequest, Event, GrammarReady, Resume, Schedule, Step, Update


class Driven(Protocol):
    """What the endings read and call on a Runner."""

    #: (scheduler name, method) of the call in progress, noted on the deadline clock
    where: tuple[str, str]

    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def names(self) -> list[str]: ...
    @property
    def scheds(self) -> dict[str, Scheduler]: ...
    @property
    def primary(self) -> Scheduler: ...
    @property
    def workers(self) -> Mapping[str, KVWorker]: ...
    @property
    def pending(self) -> Sized: ...
    @property
    def stats(self) -> Stats: ...
    @property
    def last_plan(self) -> StepPlan | None: ...
    @property
    def finished(self) -> dict[str, RequestView]: ...
    @property
    def truth(self) -> Mapping[str, list[int]]: ...
    @property
    def build_failure(self) -> Failure | None: ...
    @property
    def pause_state(self) -> PauseState: ...

    def apply(self, event: Event) -> Failure | None: ...
    def drain(self) -> Failure | None: ...
    def fail(self, kind: str, name: str, message: str, violations: tuple[Violation, ...] = (),
             exception: BaseException | None = None) -> Failure: ...
    def set_pause_state(self, state: PauseState) -> Failure | None: ...
    def check_views(self) -> Failure | None: ...


def quiesce(runner: Driven, max_steps: int) -> Failure | None:
    """Quiescence at the end of a workload (with a KV connector or hybrid
    groups): step on until no request is unfinished and no worker report
    is pending, then check that every block is free.

    A pause in force is resumed first. Requests that make no progress for
    KV_REPORT_BOUND + 3 steps in a row with no report pending (waiting
    for a grammar that never comes, say) are aborted, as a client gives
    up. Once every request has finished, the held blocks must all be
    reported within KV_REPORT_BOUND + max(2, k) steps (the bounded wait; k plans in flight); then
    every block must be free (ref_cnt 0, nothing held by a finished
    request). What fails is a Failure like any other: "stall" when the
    requests never finish within ``max_steps``, "violation" of
    ``kv-quiescence`` when a report never comes or a block stays held."""
    if runner.build_failure is not None:
        return runner.build_failure
    if runner.pause_state != PauseState.UNPAUSED and all(
            callable(getattr(s, "set_pause_state", None)) for s in runner.scheds.values()):
        if (f := runner.set_pause_state(PauseState.UNPAUSED)) or (f := runner.check_views()):
            return f
    idle = 0
    after_finish = 0
    steps = 0
    while True:
        runner.where = (runner.names[0], "view")
        view = runner.primary.view()
        busy_reports = bool(view.kv_held_by_finished) or any(w.reports_pending for w in runner.workers.values())
        if not view.requests and not busy_reports:
            break
        if not view.requests:
            after_finish += 1
            # a report sent with step s arrives with its update, k - 1 steps
            # later with k plans in flight (a pipeline)
            bound = KV_REPORT_BOUND + max(2, runner.config.max_concurrent_batches)
            if after_finish > bound:
                return runner.fail("violation", runner.names[0], "quiescence: reports still pending after the bound",
                                   (Violation("kv-quiescence",
                                              f"{bound} steps after every request finished, "
                                              f"finished requests still hold blocks: "
                                              f"{dict(view.kv_held_by_finished)}"),))
        if steps >= max_steps:
            return runner.fail("stall", runner.names[0], f"not quiescent after {max_steps} steps past the events")
        if idle > KV_REPORT_BOUND + 3 and not busy_reports:
            for rid in sorted(view.requests):
                if (f := runner.apply(Abort(rid))):
                    return f
            idle = 0
            continue
        # the events may end between a schedule and its update (two plans
        # in flight with async scheduling): update first
        full = len(runner.pending) >= runner.config.max_concurrent_batches
        event: Event = Update() if full else Step()
        if (f := runner.apply(event)):
            return f
        steps += 1
        idle = 0 if runner.last_plan is not None and runner.last_plan.scheduled else idle + 1
    if (f := runner.drain()):
        return f
    return check_quiescent(runner)


def check_quiescent(runner: Driven) -> Failure | None:
    """Every block free on every scheduler: nothing referenced, nothing held."""
    for name, sched in runner.scheds.items():
        runner.where = (name, "view")
        view = sched.view()
        used = [b for b, n in enumerate(view.kv.ref_cnt) if n and b != 0]
        if used or view.kv_held_by_finished or view.requests:
            what = []
            if view.requests:
                what.append(f"unfinished requests {sorted(view.requests)}")
            if view.kv_held_by_finished:
                what.append(f"blocks held by finished requests {dict(view.kv_held_by_finished)}")
            if used:
                what.append(f"blocks still referenced {used}")
            return runner.fail("violation", name, "quiescence: not every block is free at the end",
                               (Violation("kv-quiescence", "after the last event and every report: "
                                          + "; ".join(what)),))
    return None


def run_to_completion(
    runner: Driven, events: tuple[Event, ...] | list[Event], *, max_steps: int = 20_000, max_idle_steps: int = 3
) -> Failure | None:
    """Apply ``events``, then step on until every request has finished,
    then update the plan left in flight (``drain``).

    Before each step (one of the events' or one after them), the run ends
    when every request added so far has finished and no AddRequest is
    ahead; the events left then are aborts of finished requests.
    Finished requests are collected into ``finished`` from the primary's
    view. A run that reaches ``max_steps`` steps, or schedules nothing
    more than ``max_idle_steps`` times in a row with no arrival ahead, is
    a Failure of kind "stall"."""
    # an arrival, a grammar compiled or a resume ahead: waiting is not a stall
    last_add = max((i for i, e in enumerate(events)
                    if isinstance(e, (AddRequest, GrammarReady, Resume))), default=-1)
    if runner.workers:  # a load in flight is waited for up to the bounded wait
        max_idle_steps += KV_REPORT_BOUND + 1
    # k > 2 plans in flight: a request waits k - 1 empty plans for its update
    max_idle_steps *= max(1, runner.config.max_concurrent_batches - 1)
    idle = 0
    i = 0
    while True:
        if i < len(events) and not isinstance(events[i], (Step, Schedule)):
            if (f := runner.apply(events[i])):
                return f
            i += 1
            continue
        arrivals_ahead = i <= last_add
        collect_finished(runner)
        if not arrivals_ahead and runner.finished.keys() >= runner.truth.keys():
            return runner.drain()
        if runner.stats.steps >= max_steps:
            return runner.fail("stall", runner.names[0], f"not finished after {max_steps} steps")
        if i >= len(events) and len(runner.pending) >= runner.config.max_concurrent_batches:
            event: Event = Update()  # the events ended between a Schedule and its Update
        else:
            event = events[i] if i < len(events) else Step()
        if (f := runner.apply(event)):
            return f
        i += 1
        collect_finished(runner)
        if runner.last_plan is not None and runner.last_plan.scheduled:
            idle = 0
        elif not arrivals_ahead:
            idle += 1
            if idle > max_idle_steps:
                return runner.fail("stall", runner.names[0], "the scheduler schedules nothing with requests left")


def collect_finished(runner: Driven) -> None:
    """Every request the primary reports finished, kept in ``runner.finished``."""
    runner.where = (runner.names[0], "view")
    for rid, rv in runner.primary.view().finished.items():
        runner.finished.setdefault(rid, rv)


def scheduler_has_no_work(view: SchedulerView) -> bool:
    """Whether a scheduler in this state gives vLLM's engine core no work
    (EngineCore.has_work, leaving the plans in flight aside): nothing
    finished left to report, and no unfinished request as
    Scheduler.get_num_unfinished_requests counts them under the pause state
    (PAUSED_ALL: none; PAUSED_NEW: running requests, and waiting ones that
    hold KV blocks, still drain)."""
    if view.finished:
        return False
    if view.pause_state == PauseState.PAUSED_ALL:
        return True
    if view.pause_state == PauseState.PAUSED_NEW:
        return not view.running and not any(
            rid in view.requests and view.requests[rid].num_computed_tokens > 0 for rid in view.waiting)
    return not view.requests
