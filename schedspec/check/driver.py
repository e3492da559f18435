"""Drives one scheduler, or several in lockstep, through a workload.

Each scheduler performs every event; a Monitor per scheduler sees the
(before, after) views; in lockstep the StepPlans, views, KV events and
statistics (``make_stats()``) must be equal after every operation; the first
failure stops the run and says where and why. Each scheduler steps its own
model (the fake one by default). ``run_to_completion`` steps on until every
request has finished.

With k plans in flight (async scheduling, pipeline parallelism) a Step
schedules a plan and runs the model on it, then updates the oldest once k are
in flight, as vLLM's EngineCore.step_with_batch_queue does; Schedule and Update
events spell any other legal interleaving out. The outputs of plans in flight
join the context the model checks until their update delivers them (or
vLLM's ``drop_stale_output`` drops them).
A scheduler that raises, or returns the wrong type, is a Failure of kind
"error" that names the scheduler, its class, the method and the last frame.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from schedspec.invariants import Invariant, Monitor, Transition, Violation
from schedspec.invariants.core import ALL_KINDS
from schedspec.spec.kv_events import KVCacheEvent
from schedspec.spec.interface import (
    PauseState,
    ProtocolError,
    RequestError,
    RequestStatus,
    RequestView,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
    SchedulerFactory,
)
from schedspec.check import completion, fork, rejects, session_events
from schedspec.check.completion import scheduler_has_no_work
from schedspec.check.deadline import CLOCK, CallTimeout
from schedspec.check.deferral import Deferral
from schedspec.check.oracle import ContextError, FakeModel, KVWorker, Model, without_aborted
from schedspec.check.records import (
    Failure,
    StepRecord,
    build_failure,
    callable_name,
    culprit,
    describe_difference,
    raised,
    wrong_type,
)
from schedspec.check.stats import Stats
from schedspec.spec.stats import SchedulerStats
from schedspec.check.workload import (
    Abort,
    AddRequest,
    Event,
    EventError,
    GrammarReady,
    InFlight,
    KVLoadDone,
    KVLoadFailed,
    KVSaveDone,
    Pause,
    ResetPrefixCache,
    Resume,
    Schedule,
    Step,
    Update,
)


@dataclass
class _Pending:
    """A plan in flight: every scheduler's plan and its model's output."""

    step: int  # the n-th plan of the run
    plans: dict[str, StepPlan]
    results: dict[str, StepResult]
    #: requests whose output in this plan reset_prefix_cache dropped, or whose
    #: synchronous KV load failed in it (the scheduler discards that output)
    dropped: set[str] = field(default_factory=set)
    #: request id -> the invalid block of its synchronous KV load that failed in this plan
    kv_failed: dict[str, int] = field(default_factory=dict)
    #: the requests of this plan that read a block a synchronous load failed
    #: to fill (in this plan or one in flight before it): samples discarded
    kv_affected: set[str] = field(default_factory=set)


class Runner:
    """Feeds events to one or more schedulers built from the same config."""

    def __init__(
        self,
        config: SchedulerConfig,
        factories: dict[str, SchedulerFactory],
        *,
        vocab: int = 64,
        oracle_seed: int = 0,
        check_invariants: bool = True,
        compare_views: bool = True,
        keep_history: bool = False,
        models: Mapping[str, Model] | None = None,
        acceptance: str | None = None,
        invariants: Sequence[Invariant] | None = None,
        fork_every: int = fork.FORK_EVERY,
        reject_every: int = rejects.REJECT_EVERY,
    ) -> None:
        self.config = config
        self.fork_every = fork_every  # schedulers under test forked every so many steps (check/fork.py)
        self.last_fork = 0  # the last step at which one was replaced by its clone
        self.reported = False  # the worker reported on the connector's transfers (fork.due)
        self.rejects = rejects.Rejects(reject_every)  # refused calls probed (check/rejects.py)
        self.names = list(factories)
        #: a scheduler that raised while being built or on its first view():
        #: every apply() and run() returns it, naming the scheduler and the call
        self.build_failure: Failure | None = None
        self.scheds: dict[str, Scheduler] = {}
        self.where_now = ("?", "?")
        self._timed_out_step = 0  # the step whose call ran past its deadline
        for n, f in factories.items():
            try:
                self.where = (n, "construction")
                self.scheds[n] = f(config)
            except CallTimeout as exc:
                self.build_failure = Failure("timeout", -1, 0, n, exc.describe(f"{callable_name(f)}(config)"),
                                             exception=exc)
                break
            except Exception as exc:
                self.build_failure = build_failure(n, f"{callable_name(f)}(config)", exc, __file__)
                break
            finally:
                CLOCK.stop()
        self.models: dict[str, Model] = (
            {n: models[n] for n in self.names} if models is not None
            else {
                n: FakeModel(config.block_size, vocab, oracle_seed,
                             num_speculative_tokens=config.num_speculative_tokens, acceptance=acceptance,
                             groups=config.groups if config.is_hybrid else (), rows=config.max_concurrent_batches - 1)
                for n in self.names
            }
        )
        #: the KV connector's worker beside each scheduler (with a connector)
        self.workers: dict[str, KVWorker] = (
            {n: KVWorker(config, m if isinstance(m, FakeModel) else None) for n, m in self.models.items()}
            if config.kv_connector else {}
        )
        #: the invariants each Monitor checks (None: the whole catalogue)
        self.monitors = (
            {n: (Monitor() if invariants is None else Monitor(invariants)) for n in self.names}
            if check_invariants else {}
        )
        self.compare_views = compare_views and len(self.names) > 1
        self.need_views = check_invariants or self.compare_views or keep_history
        self.deferral = Deferral(self)  # the invariants once per identical transition (check/deferral.py)
        self.views: dict[str, SchedulerView] = {}
        for n, s in self.scheds.items() if self.need_views and self.build_failure is None else ():
            try:
                self.where = (n, "view")
                self.views[n] = s.view()
            except CallTimeout as exc:
                self.build_failure = Failure("timeout", -1, 0, n, exc.describe(f"{type(s).__qualname__}.view()"),
                                             exception=exc)
                break
            except Exception as exc:
                self.build_failure = build_failure(n, f"{type(s).__qualname__}.view()", exc, __file__)
                break
            finally:
                CLOCK.stop()
        self.truth: dict[str, list[int]] = {}  # request id -> prompt + delivered sampled tokens
        self.aborted: set[str] = set()
        self.stats = Stats(group_kinds=tuple(g.kind for g in config.groups) if config.is_hybrid else ())
        self.event_index = -1
        self.history: list[StepRecord] | None = [] if keep_history else None
        self.step_in_progress = 0  # the step being run, 0 between steps
        self.last_plan: StepPlan | None = None  # the primary's plan of the last step
        #: every request the primary reported finished, by id (run_to_completion keeps it)
        self.finished: dict[str, RequestView] = {}
        #: the in-flight protocol as the events drive it, and the plans in flight
        self.flight = InFlight.of(config)
        self.pending: list[_Pending] = []
        #: a Pause with clear_cache waits for the engine to go idle, then
        #: resets the prefix cache (vllm/v1/engine/core.py, _finish_pause)
        self.clear_pending = False
        #: request id -> its LoRA adapter (requests with one)
        self.adapters: dict[str, int] = {}
        #: the pause state the events set (what the stats count paused steps by)
        self.pause_state = PauseState.UNPAUSED
        #: run() stopped before the last event (its stop_at passed)
        self.stopped = False
        #: with config.enable_kv_cache_events: called with (step, events) for
        #: each non-empty batch of the first scheduler (spec/kv_events.py)
        self.kv_event_sink: Callable[[int, tuple[KVCacheEvent, ...]], None] | None = None

    @property
    def where(self) -> tuple[str, str]:
        """(scheduler name, method) of the call in progress; setting it notes
        the call on the deadline clock (check/deadline.py)."""
        return self.where_now

    @where.setter
    def where(self, where: tuple[str, str]) -> None:
        self.where_now = where
        if where[0] == "?":
            CLOCK.stop()
        else:
            CLOCK.start(*where)

    def _timeout_failure(self, exc: CallTimeout) -> Failure:
        """The Failure of a call that ran past its deadline (kind "timeout"),
        naming the scheduler, the method, the step and the time it ran."""
        name, who = culprit(exc.scheduler, exc.method, self.scheds.get(exc.scheduler),
                            self.models.get(exc.scheduler))
        step = self.step_in_progress or self._timed_out_step or self.stats.steps
        return Failure("timeout", self.event_index, step, name, exc.describe(who), exception=exc,
                       in_flight=self.in_flight if self.flight.limit > 1 else ())

    def timed(self, call: Callable[[], Failure | None]) -> Failure | None:
        """``call()`` (one of the runner's own methods), a call into a
        scheduler that runs past its deadline returned as a Failure."""
        try:
            return call()
        except CallTimeout as exc:
            return self._timeout_failure(exc)
        finally:
            CLOCK.stop()

    @property
    def primary(self) -> Scheduler:
        return self.scheds[self.names[0]]

    @property
    def in_flight(self) -> tuple[int, ...]:
        """The steps whose plans await update(), oldest first."""
        return tuple(p.step for p in self.pending)

    def fail(self, kind: str, name: str, message: str, violations: tuple[Violation, ...] = (),
              exception: BaseException | None = None) -> Failure:
        if kind != "violation" and self.deferral.waiting and (found := self.deferral.flush()):
            return found  # a violation before it, as when each call was checked at once
        message += (f"\n  ({name} runs on a clone() of itself made at step {self.last_fork}: check/fork.py)"
                    if self.last_fork and name != self.names[0] else "")
        return Failure(kind, self.event_index, self.step_in_progress or self.stats.steps, name, message,
                       violations, exception, self.in_flight if self.flight.limit > 1 else ())

    def _observe(self, name: str, t_kind: str, before: SchedulerView, **kw: object) -> Failure | None:
        if not self.need_views:
            return None
        self.where = (name, "view")
        after = self.scheds[name].view()
        if not isinstance(after, SchedulerView):
            return self._wrong_type(name, "view", after, SchedulerView)
        self.views[name] = after
        monitor = self.monitors.get(name)
        if monitor is None or t_kind not in ALL_KINDS:
            return None
        in_flight = tuple(p.plans[name] for p in self.pending)
        if t_kind == "schedule" and isinstance(kw.get("plan"), StepPlan):
            in_flight += (kw["plan"],)  # type: ignore[operator]
        t = Transition(kind=t_kind, before=before, after=after, in_flight=in_flight, **kw)  # type: ignore[arg-type]
        self.where = (name, "invariants")
        return self.deferral.observe(name, monitor, t)

    def _compare(self, what: str, values: dict[str, object]) -> Failure | None:
        first = self.names[0]
        for name in self.names[1:]:
            if values[name] != values[first]:
                return self.fail("divergence", name, describe_difference(what, first, values[first], name, values[name]))
        return None

    def _wrong_type(self, name: str, method: str, value: object, want: type) -> Failure:
        return self.fail("error", name, wrong_type(type(self.scheds[name]), method, value, want))

    def apply(self, event: Event) -> Failure | None:
        """Apply one event. An event that breaks the in-flight protocol (an
        Update with nothing in flight, a Schedule while the scheduler may not
        take one) raises EventError and changes nothing: that is a malformed
        workload, not a finding about a scheduler."""
        if self.build_failure is not None:
            return self.build_failure
        self._check_event(event)
        self.event_index += 1
        self.where = ("?", "?")
        try:
            failure = self._apply(event)
            if failure is None and self.clear_pending and self._engine_idle():
                failure = self._finish_pause()
            return failure
        except CallTimeout as exc:  # a call ran past its deadline: a finding too
            return self._timeout_failure(exc)
        except Exception as exc:  # a scheduler crashed: that is a finding, not our crash
            name, method = self.where
            name, who = culprit(name, method, self.scheds.get(name), self.models.get(name))
            return self.fail("error", name, raised(who, exc, __file__), exception=exc)
        finally:
            CLOCK.stop()

    def _check_event(self, event: Event) -> None:
        """Raise EventError when ``event`` may not come now."""
        probe = self._probe()
        if isinstance(event, Step):
            why = probe.step()[1]
        elif isinstance(event, Schedule):
            why = probe.schedule()
        elif isinstance(event, Update):
            why = probe.update(event.step)
        elif isinstance(event, ResetPrefixCache):
            why = probe.reset()
        else:
            why = None
        if why is not None:
            raise EventError(self.event_index + 1, why)

    def _apply(self, event: Event) -> Failure | None:
        if isinstance(event, AddRequest):
            req = event.request
            for name in self.names:
                before = self.views.get(name)
                self.where = (name, "add")
                self.scheds[name].add(req)
                if before is not None and (f := self._observe(name, "add", before, request=req)):
                    return f
            if (f := self.rejects.after_add(self, req)):
                return f
            self.truth[req.request_id] = session_events.added(self, req)
            for worker in self.workers.values():
                worker.add(req.request_id, req.prompt_token_ids)
            if req.lora_id:
                self.adapters[req.request_id] = req.lora_id
            if req.grammar_rejects:
                for model in self.models.values():
                    if isinstance(model, FakeModel):
                        model.set_grammar(req.request_id, req.grammar_rejects)
        elif isinstance(event, Abort):
            rid = event.request_id
            outcomes: dict[str, object] = {}
            for name in self.names:
                before = self.views.get(name)
                self.where = (name, "abort")
                try:
                    self.scheds[name].abort(rid)
                    outcomes[name] = "aborted"
                except RequestError:
                    outcomes[name] = "not live"
                    continue
                if before is not None and (f := self._observe(name, "abort", before, request_id=rid)):
                    return f
            if (f := self._compare(f"abort({rid!r})", outcomes)):
                return f
            if outcomes[self.names[0]] == "aborted":
                self.stats.aborts += 1
                self.aborted.add(rid)
        elif isinstance(event, ResetPrefixCache):
            if (f := self._reset(event.reset_running_requests)):
                return f
        elif isinstance(event, Pause):
            state = PauseState.PAUSED_ALL if event.mode == "all" else PauseState.PAUSED_NEW
            if (f := self.set_pause_state(state)):
                return f
            self.stats.pauses += 1
            self.clear_pending = self.clear_pending or event.clear_cache
        elif isinstance(event, Resume):
            if (f := self.set_pause_state(PauseState.UNPAUSED)):
                return f
        elif isinstance(event, (GrammarReady, session_events.SessionInput)):
            if (f := self._grammar_ready(event) if isinstance(event, GrammarReady) else session_events.apply(self, event)):
                return f
        elif isinstance(event, (KVLoadDone, KVLoadFailed, KVSaveDone)):
            # the worker queues it: it reaches a scheduler in a later
            # StepResult (without a connector there is no worker: dropped)
            for worker in self.workers.values():
                worker.post(event)
            return None
        elif isinstance(event, Step):
            # sync: schedule, run, update; async: one engine step with a batch
            # queue of two (schedule and run a plan, then update the oldest
            # once two are in flight)
            if (f := self._scheduled(None)):
                return f
            if len(self.pending) >= self.flight.limit:
                return self._updated(None)
            return None
        elif isinstance(event, Schedule):
            return self._scheduled(event.result)
        elif isinstance(event, Update):
            return self._updated(event.step)
        else:
            raise TypeError(f"unknown event {event!r}")
        return self.check_views()

    def _reset(self, reset_running_requests: bool) -> Failure | None:
        """reset_prefix_cache on every scheduler, the results compared."""
        running: tuple[str, ...] = ()
        if self.pending and reset_running_requests:
            self.where = (self.names[0], "view")
            running = (self.views.get(self.names[0]) or self.primary.view()).running
        results: dict[str, object] = {}
        for name in self.names:
            before = self.views.get(name)
            self.where = (name, "reset_prefix_cache")
            try:
                results[name] = self.scheds[name].reset_prefix_cache(reset_running_requests)
            except ProtocolError:
                # with a KV connector the boundary refuses a reset that would
                # leave blocks held (a load in flight, blocks kept for a save):
                # an outcome compared like an abort's, not a failure
                if not (self.config.kv_connector or session_events.active(self)):
                    raise
                results[name] = "refused"
                continue
            if not isinstance(results[name], bool):
                return self._wrong_type(name, "reset_prefix_cache", results[name], bool)
            if before is not None and (f := self._observe(name, "reset", before)):
                return f
        if (f := self._compare("reset_prefix_cache()", results)):
            return f
        if results[self.names[0]] == "refused":
            return None
        # The requests it preempts lose the output still in flight
        # (scheduler.py, reset_prefix_cache: drop_stale_output=True).
        for pending in self.pending:
            pending.dropped.update(running)
        self.stats.resets += 1
        return None

    def _optional(self, name: str, method: str) -> object:
        """A scheduler's optional gate method; a TypeError naming it when the
        scheduler lacks it (its capabilities should have kept the event out)."""
        fn = getattr(self.scheds[name], method, None)
        if not callable(fn):
            raise TypeError(f"{type(self.scheds[name]).__qualname__} has no {method}() (the optional "
                            f"method of that admission gate), yet the workload uses it")
        return fn

    def set_pause_state(self, state: PauseState) -> Failure | None:
        for name in self.names:
            before = self.views.get(name)
            self.where = (name, "set_pause_state")
            self._optional(name, "set_pause_state")(state)  # type: ignore[operator]
            if before is not None and (f := self._observe(name, "pause", before)):
                return f
        self.pause_state = state
        return None

    def _grammar_ready(self, event: GrammarReady) -> Failure | None:
        """grammar_ready on every scheduler: a refusal (the request is not
        waiting for a grammar: aborted, say) is an outcome compared like an
        abort's, not a failure."""
        rid = event.request_id
        outcomes: dict[str, object] = {}
        for name in self.names:
            before = self.views.get(name)
            self.where = (name, "grammar_ready")
            try:
                self._optional(name, "grammar_ready")(rid, event.ok)  # type: ignore[operator]
                outcomes[name] = "ready" if event.ok else "failed"
            except (ProtocolError, RequestError):
                outcomes[name] = "refused"
                continue
            if before is not None and (f := self._observe(name, "grammar", before, request_id=rid)):
                return f
        if (f := self._compare(f"grammar_ready({rid!r})", outcomes)):
            return f
        if outcomes[self.names[0]] == "ready":
            self.stats.grammars_ready += 1
        elif outcomes[self.names[0]] == "failed":
            self.stats.grammars_failed += 1
        return None

    def _engine_idle(self) -> bool:
        """Whether vLLM's engine core would find no work (EngineCore.has_work:
        no plan in flight, nothing finished left to report, no unfinished
        request as Scheduler.get_num_unfinished_requests counts them under
        the pause state), judged on the first scheduler's view.

        With async scheduling an empty plan in flight counts as none: vLLM's
        engine core schedules nothing when its scheduler has no request
        (EngineCore.step_with_batch_queue) and only drains its batch queue,
        where the driver schedules empty plans (a reset may come with one
        plan in flight, never two)."""
        if self.pending:
            if self.flight.limit == 1 or len(self.pending) >= self.flight.limit:
                return False
            if any(p.plans[self.names[0]].scheduled for p in self.pending):
                return False
        self.where = (self.names[0], "view")
        view = self.views.get(self.names[0]) if self.need_views else None
        return scheduler_has_no_work(view or self.primary.view())

    def _finish_pause(self) -> Failure | None:
        """The pause completed on an idle engine: its cache clear
        (EngineCore._finish_pause -> _reset_caches: reset_prefix_cache with
        reset_running_requests=True)."""
        self.clear_pending = False
        self.stats.cache_clears += 1
        if (f := self._reset(True)):
            return f
        return self.check_views()

    def _probe(self) -> InFlight:
        probe = InFlight(self.flight.async_scheduling, self.flight.depth)
        probe.scheduled, probe.steps = self.flight.scheduled, list(self.flight.steps)
        return probe

    def check_views(self) -> Failure | None:
        if not self.compare_views:
            return None
        return self._compare("view()", dict(self.views)) or self.deferral.settle()

    def _scheduled(self, recorded: StepResult | None) -> Failure | None:
        self.flight.schedule()
        self.step_in_progress = self.flight.scheduled
        try:
            return self._schedule_inner(self.flight.scheduled, recorded)
        except CallTimeout:
            self._timed_out_step = self.step_in_progress
            raise
        finally:
            self.step_in_progress = 0

    def _updated(self, step: int | None) -> Failure | None:
        pending = self.pending[0]
        self.flight.update(step)
        self.step_in_progress = pending.step
        try:
            return self._update_inner(pending)
        except CallTimeout:
            self._timed_out_step = self.step_in_progress
            raise
        finally:
            self.step_in_progress = 0

    def _context(self) -> dict[str, list[int]]:
        """Each live request's tokens: the delivered ones, then the outputs of
        the plans in flight (what the model's context must read back)."""
        truth = {rid: toks for rid, toks in self.truth.items() if rid not in self.aborted}
        for pending in self.pending:
            for rid, toks in pending.results[self.names[0]].sampled.items():
                if rid in truth and rid not in pending.dropped:
                    truth[rid] = truth[rid] + list(toks)
        return truth

    def _schedule_inner(self, step: int, recorded: StepResult | None) -> Failure | None:
        if self.need_views:  # finished requests are reported once, by the next plan
            for rv in self.views[self.names[0]].finished.values():
                self.stats.finished[rv.status.value] += 1
        plans: dict[str, StepPlan] = {}
        forked: dict[str, StepPlan] = {}
        for name in self.names:
            before = self.views.get(name)
            if fork.due(step, self.fork_every, self.reported) and name != self.names[0] and (
                    f := fork.fork(self, name, forked)):
                return f
            self.where = (name, "schedule")
            plans[name] = self.scheds[name].schedule()
            if not isinstance(plans[name], StepPlan):
                return self._wrong_type(name, "schedule", plans[name], StepPlan)
            if before is not None and (f := self._observe(name, "schedule", before, plan=plans[name])):
                self._record_failed_step(name, plans[name])
                return f
        if ((forked and (f := fork.compare(self, forked, plans))) or (f := self._compare("schedule()", dict(plans)))
                or (f := self.check_views())):
            self._record_failed_step(f.scheduler, plans[f.scheduler])
            return f
        plan = plans[self.names[0]]
        self.last_plan = plan
        self.stats.absorb(plan)
        if self.pause_state != PauseState.UNPAUSED:
            self.stats.paused_steps += 1
        if self.adapters and any(rid in self.adapters for rid in plan.scheduled_ids):
            self.stats.lora_steps += 1
        truth = self._context()
        # requests whose synchronous load failed in a plan still in flight:
        # a plan made before that update reads the unfilled block too, and
        # the scheduler discards what it samples for them
        tainted: set[str] = set().union(*(p.kv_affected for p in self.pending)) if self.pending else set()
        results: dict[str, StepResult] = {}
        for name in self.names:
            self.where = (name, "execute")
            model = self.models[name]
            worker = self.workers.get(name)
            seen = truth
            if worker is not None:
                # the connector's loads of this plan: synchronous ones written
                # before the forward; a request whose synchronous load fails
                # here is not checked (its sample is discarded)
                self.where = (name, "kv worker")
                failing = worker.before(plans[name]) | tainted
                self.where = (name, "execute")
                if failing:
                    seen = {rid: toks for rid, toks in truth.items() if rid not in failing}
            try:
                if recorded is not None:
                    if not isinstance(model, FakeModel):
                        raise TypeError(f"a recorded output needs the fake model, not {type(model).__qualname__}")
                    results[name] = model.execute_recorded(plans[name], recorded, seen)
                else:
                    results[name] = model.execute(plans[name], seen)
                if worker is not None:
                    self.where = (name, "kv worker")
                    view = self.views.get(name) if self.need_views else None
                    results[name] = worker.after(plans[name], view or self.scheds[name].view(), results[name])
            except ContextError as exc:
                m = exc.mismatch
                return self.fail(
                    "violation",
                    name,
                    "the model read a context that is not the request's tokens",
                    (Violation("kv-context", str(exc), m.request_id),),
                )
        if (f := self._compare("model output", dict(results))):
            return f
        failed: dict[str, int] = {}
        own: set[str] = set()
        if self.workers:
            worker = self.workers[self.names[0]]
            self._count_kv(worker, plan)
            self.reported = fork.reports(worker.last)  # the next plan forks (fork.due)
            # a request whose synchronous load failed in this plan (and the
            # plan's readers of its block): the scheduler discards its sample
            # (vLLM skips it in update_from_output: failed_kv_load_req_ids)
            failed = dict(worker.last.sync_blocks)
            own = set(worker.last.sync_failed)
            tainted |= own
        affected = tainted & set(plan.scheduled_ids)
        # a plan made before the update that reports the failure reads the
        # unfilled block too (its context is not checked), but vLLM keeps its
        # sample: failed_kv_load_req_ids is the reporting update's own
        dropped = own & set(plan.scheduled_ids)
        self.pending.append(_Pending(step, plans, results, dropped, failed, affected))
        if self.history is not None:
            self.history.append(StepRecord(plan.step, plan, self.views[self.names[0]], results[self.names[0]],
                                           self.in_flight))
        return None

    def _update_inner(self, pending: _Pending) -> Failure | None:
        plans, results = pending.plans, pending.results
        self.pending.pop(0)
        if pending.kv_failed:
            results = {name: self._meaningful(name, r, pending) for name, r in results.items()}
        if self.aborted:  # no tokens for a request aborted meanwhile, on odd steps (oracle.without_aborted)
            results = {name: without_aborted(r, self.aborted, pending.step) for name, r in results.items()}
        if (f := self.rejects.before_update(self, pending.step, plans, results)):
            return f
        events_on = self.config.enable_kv_cache_events
        batches: dict[str, object] = {}
        made: dict[str, object] = {}  # the statistics
        forking = fork.due_update(pending.step, self.fork_every, session_events.active(self))
        for name in self.names:
            before = self.views.get(name)
            if forking and name != self.names[0] and (f := fork.fork_update(self, name, plans[name], results[name])):
                return f
            self.where = (name, "update")
            self.scheds[name].update(plans[name], results[name])
            batches[name] = self._take_kv_events(name) if events_on else ()
            stats = made[name] = self._make_stats(name)
            if isinstance(stats, Failure):
                return stats
            if before is not None and (f := self._observe(
                    name, "update", before, plan=plans[name], result=results[name],
                    kv_events=batches.get(name, ()), **({"stats": stats} if stats is not None else {}))):
                return f
        if any(s is not None for s in made.values()) and (f := self._compare("make_stats()", made)):
            return f
        self.stats.stats_reports += any(s is not None for s in made.values())
        for worker in self.workers.values():
            worker.updated(pending.step)
        for rid, toks in session_events.delivered(self, results[self.names[0]]).items():
            if rid in self.truth and rid not in self.aborted and rid not in pending.dropped:
                self.truth[rid].extend(toks)
        if self.history is not None:
            self._mark_updated(pending.step)
        if events_on and (f := self._kv_events_taken(pending.step, batches)):
            return f
        return self.check_views()

    def _take_kv_events(self, name: str) -> tuple[KVCacheEvent, ...]:
        """A scheduler's KV cache events since the last take, right after its update, as
        vLLM's update_from_output takes them (spec/kv_events.py)."""
        self.where = (name, "take_kv_events")
        return tuple(self._optional(name, "take_kv_events")())  # type: ignore[operator]

    def _kv_events_taken(self, step: int, batches: dict[str, object]) -> Failure | None:
        """The update's events compared in lockstep; the first scheduler's counted and sunk."""
        if (f := self._compare("take_kv_events()", batches)):
            return f
        batch = batches[self.names[0]]
        assert isinstance(batch, tuple)
        self.stats.kv_cache_events += len(batch)
        if batch and self.kv_event_sink is not None:
            self.kv_event_sink(step, batch)
        return None

    def _make_stats(self, name: str) -> SchedulerStats | Failure | None:
        """The optional make_stats() after an update (spec/stats.py); None without log_stats."""
        make = getattr(self.scheds[name], "make_stats", None)
        if not callable(make):
            return None
        self.where = (name, "make_stats")
        stats = make()
        if stats is not None and not isinstance(stats, SchedulerStats):
            return self._wrong_type(name, "make_stats", stats, SchedulerStats)
        return stats

    def _meaningful(self, name: str, result: StepResult, pending: _Pending) -> StepResult:
        """``result`` as it reaches update(): the invalid block of a
        synchronous load whose request no longer runs (aborted after the
        plan was made) is left out, as vLLM's _handle_invalid_blocks, which
        only scans the running requests, ignores it."""
        view = self.views.get(name) if self.need_views else None
        view = view or self.scheds[name].view()
        gone = {b for rid, b in pending.kv_failed.items()
                if rid not in view.requests or view.requests[rid].status != RequestStatus.RUNNING}
        if not gone:
            return result
        keep = {b for rid, b in pending.kv_failed.items() if b not in gone}
        blocks = tuple(b for b in result.invalid_block_ids if b not in gone or b in keep)
        return dataclasses.replace(result, invalid_block_ids=blocks)

    def _count_kv(self, worker: KVWorker, plan: StepPlan) -> None:
        """The connector's statistics of one step (the first scheduler's worker)."""
        report = worker.last
        self.stats.kv_load_failures += len(report.failed_recving) + len(report.invalid_block_ids)
        self.stats.kv_saves += len(report.finished_sending)
        self.stats.kv_timeouts += report.timed_out
        view = self.views.get(self.names[0]) if self.need_views else None
        held = (view or self.primary.view()).kv_held_by_finished
        self.stats.held_block_steps += sum(len(blocks) for blocks in held.values())

    def quiesce(self, max_steps: int = 5_000) -> Failure | None:
        """Step on past the events until quiescent, every block checked free
        (check/completion.py, ``quiesce``); a call past its deadline is
        returned as a Failure."""
        return self.timed(lambda: completion.quiesce(self, max_steps))

    def _mark_updated(self, step: int) -> None:
        """The last record gets this update (and the view after it); in sync
        mode that is the plan's own record."""
        assert self.history is not None
        if not self.history:
            return
        last = self.history[-1]
        self.history[-1] = StepRecord(last.step, last.plan, self.views[self.names[0]], last.result,
                                      last.in_flight, step)

    def compare_final_views(self) -> Failure | None:
        """Views of all schedulers at the end of a run must be equal."""
        return self.timed(self._compare_final_views)

    def _compare_final_views(self) -> Failure | None:
        views: dict[str, object] = {}
        for n, s in self.scheds.items():
            self.where = (n, "view")
            views[n] = s.view()
        return self._compare("final view()", views)

    def _record_failed_step(self, name: str, plan: StepPlan) -> None:
        """The step table ends with the plan that failed, as that scheduler made it."""
        if self.history is not None and name in self.views:
            self.history.append(StepRecord(plan.step, plan, self.views[name], None,
                                           self.in_flight + (self.flight.scheduled,)))

    def run(self, events: tuple[Event, ...] | list[Event], stop_at: float | None = None) -> Failure | None:
        """Apply ``events`` in order up to the first failure. ``stop_at`` (a
        time.monotonic() value): stop between two events once it has passed,
        setting ``stopped`` (a check's time budget, honoured within a workload)."""
        if self.build_failure is not None:
            return self.build_failure
        for event in events:
            if stop_at is not None and time.monotonic() >= stop_at:
                self.stopped = True
                return None
            failure = self.apply(event)
            if failure is not None:
                return failure
        return None

    def drain(self) -> Failure | None:
        """Update every plan still in flight, oldest first."""
        while self.pending:
            if (f := self.apply(Update())):
                return f
        return None

    def run_to_completion(
        self, events: tuple[Event, ...] | list[Event], *, max_steps: int = 20_000, max_idle_steps: int = 3
    ) -> Failure | None:
        """Apply ``events``, then step on until every request has finished
        (check/completion.py, ``run_to_completion``); a call past its deadline
        is returned as a Failure."""
        return self.timed(lambda: completion.run_to_completion(self, events, max_steps=max_steps,
                                                               max_idle_steps=max_idle_steps))
