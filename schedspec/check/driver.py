"""Drives one scheduler, or several in lockstep, through a workload.

For every event each scheduler performs the operation; with invariants on,
a Monitor per scheduler sees the (before, after) views of every operation; in
lockstep, the StepPlans (block ids included) and the views must be equal after
every operation. The first failure stops the run and says where and why.

Each scheduler steps its own model, any ``Model`` (the fake model by default;
the equivalence matrix passes torch executors). ``run`` applies a workload's
events; ``run_to_completion`` also steps on until every request has finished.
A scheduler that raises, or returns the wrong type, is a Failure of kind
"error" that names the scheduler, its class, the method and the last frame.
"""

from __future__ import annotations

import inspect
import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, Mapping

from schedspec.invariants import Monitor, Transition, Violation
from schedspec.spec.interface import (
    RequestError,
    RequestView,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
    SchedulerFactory,
)
from schedspec.check.oracle import ContextError, FakeModel, Model
from schedspec.check.stats import Stats
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Step


@dataclass(frozen=True)
class StepRecord:
    """What the step table and the timeline picture show for one step."""

    step: int
    plan: StepPlan
    view_after: SchedulerView


@dataclass(frozen=True)
class Failure:
    kind: str  # "violation" | "divergence" | "error" | "stall"
    event_index: int
    step: int
    scheduler: str
    message: str
    violations: tuple[Violation, ...] = ()
    #: what a scheduler or model raised (kind "error"), for a caller that re-raises it
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        head = f"{self.kind} at event {self.event_index} (step {self.step}) in {self.scheduler}"
        lines = [head, "  " + self.message]
        for v in self.violations:
            lines.append(f"  [{v.invariant_id}] {v.message}")
        return "\n".join(lines)


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
    ) -> None:
        self.config = config
        self.names = list(factories)
        self.scheds: dict[str, Scheduler] = {n: f(config) for n, f in factories.items()}
        self.models: dict[str, Model] = (
            {n: models[n] for n in self.names} if models is not None
            else {n: FakeModel(config.block_size, vocab, oracle_seed) for n in self.names}
        )
        self.monitors = {n: Monitor() for n in self.names} if check_invariants else {}
        self.compare_views = compare_views and len(self.names) > 1
        self.need_views = check_invariants or self.compare_views or keep_history
        self.views: dict[str, SchedulerView] = (
            {n: s.view() for n, s in self.scheds.items()} if self.need_views else {}
        )
        self.truth: dict[str, list[int]] = {}  # request id -> prompt + sampled tokens
        self.aborted: set[str] = set()
        self.stats = Stats()
        self.event_index = -1
        self.history: list[StepRecord] | None = [] if keep_history else None
        self.step_in_progress = 0  # the step being run, 0 between steps
        self.last_plan: StepPlan | None = None  # the primary's plan of the last step
        #: every request the primary reported finished, by id (run_to_completion keeps it)
        self.finished: dict[str, RequestView] = {}
        self._where = ("?", "?")  # (scheduler name, method) of the call in progress

    @property
    def primary(self) -> Scheduler:
        return self.scheds[self.names[0]]

    def _fail(self, kind: str, name: str, message: str, violations: tuple[Violation, ...] = (),
              exception: BaseException | None = None) -> Failure:
        return Failure(kind, self.event_index, self.step_in_progress or self.stats.steps, name, message,
                       violations, exception)

    def _observe(self, name: str, t_kind: str, before: SchedulerView, **kw: object) -> Failure | None:
        if not self.need_views:
            return None
        self._where = (name, "view")
        after = self.scheds[name].view()
        if not isinstance(after, SchedulerView):
            return self._wrong_type(name, "view", after, SchedulerView)
        self.views[name] = after
        monitor = self.monitors.get(name)
        if monitor is None:
            return None
        t = Transition(kind=t_kind, before=before, after=after, **kw)  # type: ignore[arg-type]
        found = monitor.observe(t)
        if found:
            return self._fail("violation", name, f"{len(found)} invariant violation(s) after {t_kind}", tuple(found))
        return None

    def _compare(self, what: str, values: dict[str, object]) -> Failure | None:
        first = self.names[0]
        for name in self.names[1:]:
            if values[name] != values[first]:
                return self._fail("divergence", name, describe_difference(what, first, values[first], name, values[name]))
        return None

    def _wrong_type(self, name: str, method: str, value: object, want: type) -> Failure:
        cls = type(self.scheds[name])
        where = _definition(getattr(cls, method, None))
        return self._fail(
            "error", name,
            f"{cls.__qualname__}.{method}() returned {type(value).__name__}, not {want.__name__}"
            + (f" (defined at {where})" if where else ""),
        )

    def apply(self, event: Event) -> Failure | None:
        self.event_index += 1
        self._where = ("?", "?")
        try:
            return self._apply(event)
        except Exception as exc:  # a scheduler crashed: that is a finding, not our crash
            name, method = self._where
            if method == "execute":
                who = f"the model of {name} ({type(self.models[name]).__qualname__}.execute)"
            elif name in self.scheds:
                who = f"{type(self.scheds[name]).__qualname__}.{method}()"
            else:
                who = "?"
            frame = _last_frame(exc)
            return self._fail("error", name, f"{who} raised {type(exc).__name__}: {exc}"
                              + (f" (last frame: {frame})" if frame else ""), exception=exc)

    def _apply(self, event: Event) -> Failure | None:
        if isinstance(event, AddRequest):
            req = event.request
            for name in self.names:
                before = self.views.get(name)
                self._where = (name, "add")
                self.scheds[name].add(req)
                if before is not None and (f := self._observe(name, "add", before, request=req)):
                    return f
            self.truth[req.request_id] = list(req.prompt_token_ids)
        elif isinstance(event, Abort):
            rid = event.request_id
            outcomes: dict[str, object] = {}
            for name in self.names:
                before = self.views.get(name)
                self._where = (name, "abort")
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
            results: dict[str, object] = {}
            for name in self.names:
                before = self.views.get(name)
                self._where = (name, "reset_prefix_cache")
                results[name] = self.scheds[name].reset_prefix_cache(event.reset_running_requests)
                if not isinstance(results[name], bool):
                    return self._wrong_type(name, "reset_prefix_cache", results[name], bool)
                if before is not None and (f := self._observe(name, "reset", before)):
                    return f
            if (f := self._compare("reset_prefix_cache()", results)):
                return f
            self.stats.resets += 1
        elif isinstance(event, Step):
            return self._step()
        else:
            raise TypeError(f"unknown event {event!r}")
        return self._compare_views()

    def _compare_views(self) -> Failure | None:
        if not self.compare_views:
            return None
        return self._compare("view()", dict(self.views))

    def _step(self) -> Failure | None:
        self.step_in_progress = self.stats.steps + 1
        try:
            return self._step_inner()
        finally:
            self.step_in_progress = 0

    def _step_inner(self) -> Failure | None:
        if self.need_views:  # finished requests are reported once, by the next plan
            for rv in self.views[self.names[0]].finished.values():
                self.stats.finished[rv.status.value] += 1
        plans: dict[str, StepPlan] = {}
        for name in self.names:
            before = self.views.get(name)
            self._where = (name, "schedule")
            plans[name] = self.scheds[name].schedule()
            if not isinstance(plans[name], StepPlan):
                return self._wrong_type(name, "schedule", plans[name], StepPlan)
            if before is not None and (f := self._observe(name, "schedule", before, plan=plans[name])):
                self._record_failed_step(name, plans[name])
                return f
        if (f := self._compare("schedule()", dict(plans))) or (f := self._compare_views()):
            self._record_failed_step(f.scheduler, plans[f.scheduler])
            return f
        plan = plans[self.names[0]]
        self.last_plan = plan
        self.stats.absorb(plan)
        truth = {rid: toks for rid, toks in self.truth.items() if rid not in self.aborted}
        results: dict[str, StepResult] = {}
        for name in self.names:
            self._where = (name, "execute")
            try:
                results[name] = self.models[name].execute(plans[name], truth)
            except ContextError as exc:
                m = exc.mismatch
                return self._fail(
                    "violation",
                    name,
                    "the model read a context that is not the request's tokens",
                    (Violation("kv-context", str(exc), m.request_id),),
                )
        if (f := self._compare("model output", dict(results))):
            return f
        for name in self.names:
            before = self.views.get(name)
            self._where = (name, "update")
            self.scheds[name].update(plans[name], results[name])
            if before is not None and (
                f := self._observe(name, "update", before, plan=plans[name], result=results[name])
            ):
                return f
        for rid, toks in results[self.names[0]].sampled.items():
            if rid in self.truth and rid not in self.aborted:
                self.truth[rid].extend(toks)
        if self.history is not None:
            self.history.append(StepRecord(plan.step, plan, self.views[self.names[0]]))
        return self._compare_views()

    def compare_final_views(self) -> Failure | None:
        """Views of all schedulers at the end of a run must be equal."""
        views: dict[str, object] = {n: s.view() for n, s in self.scheds.items()}
        return self._compare("final view()", views)

    def _record_failed_step(self, name: str, plan: StepPlan) -> None:
        """The step table ends with the plan that failed, as that scheduler made it."""
        if self.history is not None and name in self.views:
            self.history.append(StepRecord(plan.step, plan, self.views[name]))

    def run(self, events: tuple[Event, ...] | list[Event]) -> Failure | None:
        for event in events:
            failure = self.apply(event)
            if failure is not None:
                return failure
        return None

    def run_to_completion(
        self, events: tuple[Event, ...] | list[Event], *, max_steps: int = 20_000, max_idle_steps: int = 3
    ) -> Failure | None:
        """Apply ``events``, then step on until every request has finished.

        Before each step (one of the events' or one after them), the run ends
        when every request added so far has finished and no AddRequest is
        ahead; the events left then are aborts of finished requests.
        Finished requests are collected into ``finished`` from the primary's
        view. A run that reaches ``max_steps`` steps, or schedules nothing
        more than ``max_idle_steps`` times in a row with no arrival ahead, is
        a Failure of kind "stall"."""
        last_add = max((i for i, e in enumerate(events) if isinstance(e, AddRequest)), default=-1)
        idle = 0
        i = 0
        while True:
            if i < len(events) and not isinstance(events[i], Step):
                if (f := self.apply(events[i])):
                    return f
                i += 1
                continue
            arrivals_ahead = i <= last_add
            self._collect_finished()
            if not arrivals_ahead and self.finished.keys() >= self.truth.keys():
                return None
            if self.stats.steps >= max_steps:
                return self._fail("stall", self.names[0], f"not finished after {max_steps} steps")
            if (f := self.apply(Step())):
                return f
            i += 1
            self._collect_finished()
            if self.last_plan is not None and self.last_plan.scheduled:
                idle = 0
            elif not arrivals_ahead:
                idle += 1
                if idle > max_idle_steps:
                    return self._fail("stall", self.names[0], "the scheduler schedules nothing with requests left")

    def _collect_finished(self) -> None:
        for rid, rv in self.primary.view().finished.items():
            self.finished.setdefault(rid, rv)


def _relative(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if rel.startswith("..") else rel


def _last_frame(exc: BaseException) -> str:
    """file:line in function of the innermost frame of ``exc``'s traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f"{_relative(last.filename)}:{last.lineno} in {last.name}"


def _definition(fn: object) -> str:
    """file:line where a method is defined, or "" when unknown."""
    try:
        target = inspect.unwrap(fn)  # type: ignore[arg-type]
        path = inspect.getsourcefile(target)
        _, line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        return ""
    return f"{_relative(path)}:{line}" if path else ""


def describe_difference(what: str, name_a: str, a: object, name_b: str, b: object) -> str:
    """A short account of how two plans or views differ."""
    if isinstance(a, StepPlan) and isinstance(b, StepPlan):
        lines = [f"{what} differs between {name_a} and {name_b}:"]
        for label, x, y in (("preempted", a.preempted_ids, b.preempted_ids), ("finished", a.finished_ids, b.finished_ids)):
            if x != y:
                lines.append(f"  {label}: {name_a}={list(x)} {name_b}={list(y)}")
        ea = {s.request_id: s for s in a.scheduled}
        eb = {s.request_id: s for s in b.scheduled}
        if list(ea) != list(eb):
            lines.append(f"  scheduled: {name_a}={list(ea)} {name_b}={list(eb)}")
        for rid in ea.keys() & eb.keys():
            if ea[rid] != eb[rid]:
                lines.append(f"  {rid}: {name_a}={_entry(ea[rid])} {name_b}={_entry(eb[rid])}")
        return "\n".join(lines)
    if isinstance(a, SchedulerView) and isinstance(b, SchedulerView):
        lines = [f"{what} differs between {name_a} and {name_b}:"]
        for fname in ("step", "waiting", "running"):
            if getattr(a, fname) != getattr(b, fname):
                lines.append(f"  {fname}: {name_a}={getattr(a, fname)} {name_b}={getattr(b, fname)}")
        for rid in sorted(set(a.requests) | set(b.requests)):
            ra, rb = a.requests.get(rid), b.requests.get(rid)
            if ra != rb:
                lines.append(f"  request {rid}: {name_a}={ra} {name_b}={rb}")
        if set(a.finished) != set(b.finished) or a.finished != b.finished:
            lines.append(f"  finished: {name_a}={sorted(a.finished)} {name_b}={sorted(b.finished)}")
        for fname in ("ref_cnt", "free_queue"):
            if getattr(a.kv, fname) != getattr(b.kv, fname):
                lines.append(f"  kv.{fname}: {name_a}={getattr(a.kv, fname)} {name_b}={getattr(b.kv, fname)}")
        if dict(a.kv.block_keys) != dict(b.kv.block_keys):
            ka, kb = dict(a.kv.block_keys), dict(b.kv.block_keys)
            diff = sorted(k for k in set(ka) | set(kb) if ka.get(k) != kb.get(k))
            lines.append(f"  kv.block_keys differ for blocks {diff}")
        if dict(a.kv.cache_index) != dict(b.kv.cache_index):
            lines.append("  kv.cache_index differs")
        return "\n".join(lines)
    return f"{what} differs: {name_a}={a!r} {name_b}={b!r}"


def _entry(s: object) -> str:
    from schedspec.spec.interface import ScheduledRequest

    assert isinstance(s, ScheduledRequest)
    return (f"({s.kind.value}, computed={s.num_computed_tokens}, n={s.num_scheduled_tokens}, "
            f"blocks={list(s.block_ids)})")
