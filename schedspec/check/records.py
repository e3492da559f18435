"""What a run leaves: the record of each step (what the step table and the
timeline picture show), the Failure that stops it, and the words a failure
is told in: how two plans or views differ, where a scheduler's method is
defined, the last frames of what it raised."""

from __future__ import annotations

import dataclasses
import inspect
import os
import traceback
from dataclasses import dataclass, field

from schedspec.invariants import Violation
from schedspec.spec.interface import RequestView, SchedulerView, StepPlan, StepResult


@dataclass(frozen=True)
class StepRecord:
    """What the step table and the timeline picture show for one step."""

    step: int
    plan: StepPlan
    view_after: SchedulerView
    #: the model's output for the plan (None where the step failed before it)
    result: StepResult | None = None
    #: the step numbers of the plans in flight once this plan was scheduled
    #: (this one included); one plan in sync mode
    in_flight: tuple[int, ...] = ()
    #: the step whose update() came in the same engine step (async: the plan
    #: before; sync: this one); None when no update followed
    updated: int | None = None


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
    #: the steps whose plans awaited update() when it failed (async scheduling)
    in_flight: tuple[int, ...] = ()

    def describe(self) -> str:
        head = f"{self.kind} at event {self.event_index} (step {self.step}) in {self.scheduler}"
        if self.event_index < 0:
            head = f"{self.kind} before the first event (building the scheduler) in {self.scheduler}"
        if self.in_flight:
            head += f", step(s) {', '.join(map(str, self.in_flight))} in flight"
        lines = [head, "  " + self.message]
        for v in self.violations:
            lines.append(f"  [{v.invariant_id}] {v.message}")
        return "\n".join(lines)


def _relative(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if rel.startswith("..") else rel


def callable_name(f: object) -> str:
    """A factory's name for a message: the class or function it is."""
    target = getattr(f, "__wrapped__", f)
    return str(getattr(target, "__qualname__", None) or getattr(type(target), "__qualname__", repr(target)))


def build_failure(name: str, call: str, exc: BaseException, below: str) -> Failure:
    """The Failure of a scheduler that raised while being built (``call``
    is what raised, e.g. ``Mine(config)``; ``below``: last_frames')."""
    return Failure("error", -1, 0, name, raised(call, exc, below), exception=exc)


def raised(who: str, exc: BaseException, below: str) -> str:
    """``who`` raised ``exc``, with its last frames below the driver (the
    file ``below``)."""
    frames = last_frames(exc, below)
    label = "last frame" if len(frames) == 1 else "last frames, innermost first"
    return f"{who} raised {type(exc).__name__}: {exc}" + (f" ({label}: {'; '.join(frames)})" if frames else "")


def culprit(name: str, method: str, scheduler: object | None, model: object | None) -> tuple[str, str]:
    """(scheduler name, who) of what raised during ``method``, the call the
    driver had in progress on scheduler ``name`` ("?" for none): the model
    beside it, the KV connector's worker, the invariant checks on its view,
    the scheduler's method, or the driver itself."""
    if method == "execute":
        return name, f"the model of {name} ({type(model).__qualname__}.execute)"
    if method == "kv worker":
        return name, f"the KV connector's worker beside {name} (KVWorker, reading its plan and view)"
    if method == "invariants":
        return name, (f"the invariant checks on the view of {name} "
                      f"(what {type(scheduler).__qualname__}.view() returned)")
    if scheduler is not None:
        return name, f"{type(scheduler).__qualname__}.{method}()"
    return "driver", "the checking driver, with no scheduler call in progress,"


def wrong_type(cls: type, method: str, value: object, want: type) -> str:
    """What a scheduler whose ``method`` returned the wrong type is told."""
    where = definition(getattr(cls, method, None))
    return (f"{cls.__qualname__}.{method}() returned {type(value).__name__}, not {want.__name__}"
            + (f" (defined at {where})" if where else ""))


def last_frames(exc: BaseException, below: str, n: int = 3) -> list[str]:
    """file:line in function of the innermost ``n`` frames of ``exc``'s
    traceback that lie below the driver (innermost first): those of the file
    ``below`` (the driver's) are left out."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != below]
    return [f"{_relative(f.filename)}:{f.lineno} in {f.name}" for f in reversed(frames[-n:])]


def definition(fn: object) -> str:
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
                lines.append(f"  request {rid}: {_view_difference(ra, rb, name_a, name_b)}")
        if set(a.finished) != set(b.finished):
            lines.append(f"  finished: {name_a}={sorted(a.finished)} {name_b}={sorted(b.finished)}")
        for rid in sorted(set(a.finished) & set(b.finished)):
            if a.finished[rid] != b.finished[rid]:
                lines.append(f"  finished request {rid}: {_view_difference(a.finished[rid], b.finished[rid], name_a, name_b)}")
        for fname in ("preempted_since_plan", "pause_state", "encoder_cache", "encoder_cache_free",
                      "num_executed_steps", "last_prefill_step"):
            va, vb = getattr(a, fname, None), getattr(b, fname, None)
            if va != vb:
                lines.append(f"  {fname}: {name_a}={va!r} {name_b}={vb!r}")
        for fname in ("ref_cnt", "free_queue"):
            if getattr(a.kv, fname) != getattr(b.kv, fname):
                lines.append(f"  kv.{fname}: {name_a}={getattr(a.kv, fname)} {name_b}={getattr(b.kv, fname)}")
        if dict(a.kv.block_keys) != dict(b.kv.block_keys):
            ka, kb = dict(a.kv.block_keys), dict(b.kv.block_keys)
            diff = sorted(k for k in set(ka) | set(kb) if ka.get(k) != kb.get(k))
            lines.append(f"  kv.block_keys differ for blocks {diff}")
        if dict(a.kv.cache_index) != dict(b.kv.cache_index):
            lines.append("  kv.cache_index differs")
        if dict(a.kv.partial_index) != dict(b.kv.partial_index):
            lines.append("  kv.partial_index differs")
        return "\n".join(lines)
    return f"{what} differs: {name_a}={a!r} {name_b}={b!r}"


def _view_difference(a: RequestView | None, b: RequestView | None, name_a: str, name_b: str) -> str:
    """The fields in which two request views differ, a field of the request
    (``spec``) named as the view's own (the whole views when one is missing)."""
    if a is None or b is None or type(a) is not type(b):
        return f"{name_a}={a} {name_b}={b}"
    pairs = [(f.name, getattr(x, f.name), getattr(y, f.name))
             for x, y in ((a.spec, b.spec), (a, b)) for f in dataclasses.fields(x) if f.name != "spec"]
    diff = [f"{name}: {name_a}={va!r} {name_b}={vb!r}" for name, va, vb in pairs if va != vb]
    return "; ".join(diff) if diff else f"{name_a}={a} {name_b}={b}"


def _entry(s: object) -> str:
    from schedspec.spec.interface import ScheduledRequest

    assert isinstance(s, ScheduledRequest)
    return (f"({s.kind.value}, computed={s.num_computed_tokens}, n={s.num_scheduled_tokens}, "
            f"blocks={list(s.block_ids)})")
