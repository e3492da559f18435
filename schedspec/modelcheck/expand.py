"""Expansion of one state: check it, apply every enabled event to a copy with
every check on, and return the successors with their fingerprints.

Checked on every transition: the invariants of the catalogue (statelessly,
see checks.py), the fake model's reads (the context read through the block
tables is the request's tokens) and the KV contents (every computed slot and
every keyed block holds what the state says), and, when an impl is given, the
impl replaying the same transition from the same state with an equal plan and
equal views. Everything the checker reads of a state it reads through the
scheduler's public ``view()``; it copies a state with the scheduler's own
``clone()``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from schedspec.check.driver import describe_difference
from schedspec.check.oracle import FakeModel
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Step, Workload
from schedspec.invariants import CATALOGUE, Invariant, Transition, Violation
from schedspec.invariants.core import TransitionKind
from schedspec.modelcheck.checks import StatelessChecker
from schedspec.modelcheck.coverage import Coverage
from schedspec.modelcheck.events import RESET, RESET_RUNNING, STEP, Alphabet
from schedspec.modelcheck.result import Finding
from schedspec.modelcheck.space import Space
from schedspec.modelcheck.state import Canon, Fingerprint, expected_memory
from schedspec.spec.interface import (
    Policy,
    RequestSpec,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)
from schedspec.spec.scheduler import SpecScheduler

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


class MemoModel(FakeModel):
    """FakeModel with its sampler memoized (the sample is a pure function of
    the context and the seed)."""

    def __init__(self, block_size: int, vocab: int, seed: int) -> None:
        super().__init__(block_size, vocab, seed)
        self._memo: dict[tuple[int | None, ...], int] = {}

    def sample_token(self, context: tuple[int | None, ...]) -> int:
        tok = self._memo.get(context)
        if tok is None:
            tok = self._memo[context] = super().sample_token(context)
        return tok


@dataclass(slots=True)
class Entry:
    """A state waiting to be expanded. ``state`` is the SpecScheduler and
    ``impl`` the ImplScheduler in the same state (None without the
    differential), both pickled when states travel between processes, and
    both None in a worker's result for a state that worker already sent
    (the main process has it); ``adds`` how many requests the path to it added
    (the next one is ``r{adds + 1}``); ``view`` the state's view when it was
    already taken (in-process only: it does not travel)."""

    idx: int
    state: Any
    impl: Any
    adds: int
    view: SchedulerView | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # compact between processes
        return (Entry, (self.idx, self.state, self.impl, self.adds))


@dataclass(slots=True)
class Expansion:
    idx: int
    #: (event code, fingerprint, successor entry with idx -1, has unfinished requests)
    successors: list[tuple[int, Fingerprint, Entry, bool]]
    #: the first failure: (event code or -1 for the state itself, what was found)
    failure: tuple[int, Finding] | None = None
    #: what these transitions exercised
    coverage: Coverage = field(default_factory=Coverage)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Expansion, (self.idx, self.successors, self.failure, self.coverage))


class Successor(NamedTuple):
    state: SpecScheduler
    view: SchedulerView
    fingerprint: Fingerprint
    adds: int


class Expander:
    """Expands one state: checks it, applies every enabled event to a copy
    with every check on, returns the successors with their fingerprints.

    ``scheduler_cls`` is the scheduler explored: SpecScheduler or a subclass
    (the tests use broken ones) whose ``clone()`` copies all of its state.
    ``impl_cls`` (built as ``impl_cls(config)``) is the scheduler replayed on
    every transition and compared with it (None: no differential). ``pickled``:
    successors are returned pickled, to travel to another process."""

    def __init__(
        self,
        space: Space,
        scheduler_cls: type[SpecScheduler] = SpecScheduler,
        impl_cls: Callable[[SchedulerConfig], Scheduler] | None = None,
        invariants: Sequence[Invariant] = CATALOGUE,
        pickled: bool = False,
    ) -> None:
        self.space = space
        self.config = space.config
        self.cls = scheduler_cls
        self.impl_cls = impl_cls
        self.shapes = space.resolved_shapes()
        self.alphabet = Alphabet(self.shapes, space.max_requests)
        self.checker = StatelessChecker(invariants)
        self.canon = Canon(len(self.shapes), space.config.policy == Policy.PRIORITY)
        self.model = MemoModel(space.config.block_size, space.vocab, space.oracle_seed)
        self.pickled = pickled
        #: the counters of the expansion under way
        self.coverage = Coverage()
        #: no invariants and no differential: no checks on the views (to measure the search alone)
        self.blind = not invariants and impl_cls is None
        #: fingerprints of the successors this (worker) process already sent
        self.shipped: set[Fingerprint] = set()

    def request(self, shape_index: int, k: int) -> RequestSpec:
        """The k-th request of a path (1-based), of the given shape."""
        return self.shapes[shape_index].request(f"r{k}", k * len(self.shapes) + shape_index)

    def root(self) -> Entry:
        s = self.cls(self.config)
        impl: Any = None
        if self.impl_cls is not None:
            impl = self.impl_cls(self.config)
        if self.pickled:
            return Entry(0, pickle.dumps(s, PICKLE_PROTOCOL), pickle.dumps(impl, PICKLE_PROTOCOL), 0)
        return Entry(0, s, impl, 0, s.view())

    def fingerprint(self, entry: Entry) -> Fingerprint:
        """The fingerprint of a state held by an entry (the root's, in practice)."""
        if entry.view is not None:
            return self.canon.fingerprint(entry.view)
        s: SpecScheduler = pickle.loads(entry.state) if self.pickled else entry.state
        return self.canon.fingerprint(s.view())

    def enabled(self, v: SchedulerView) -> list[int]:
        return self.alphabet.enabled(len(v.requests) + len(v.finished), len(v.requests))

    # -------------------------------------------------------------- checks

    def _check(self, kind: TransitionKind, before: SchedulerView, after: SchedulerView, state_too: bool,
               **kw: Any) -> None:
        if self.blind:
            return
        found = self.checker.check(Transition(kind=kind, before=before, after=after, **kw), state_too)
        if found:
            raise Finding("violation", f"{len(found)} invariant violation(s) after {kind}", found)

    def _check_state(self, v: SchedulerView) -> None:
        found = self.checker.check_state(v) if not self.blind else []
        if found:
            raise Finding("violation", f"{len(found)} invariant violation(s) in a reachable state", found)

    @staticmethod
    def _compare(what: str, ours: object, theirs: object) -> None:
        if ours != theirs:
            raise Finding("divergence", describe_difference(what, "spec", ours, "impl", theirs))

    # -------------------------------------------------------------- one state

    def expand(self, entry: Entry) -> Expansion:
        s: SpecScheduler = pickle.loads(entry.state) if self.pickled else entry.state
        out = Expansion(entry.idx, [])
        self.coverage = out.coverage
        try:
            before = entry.view if entry.view is not None else s.view()
            self._check_state(before)
        except Finding as f:
            out.failure = (-1, f)
            return out
        except Exception as exc:  # the scheduler crashed: a finding
            out.failure = (-1, Finding("error", f"{type(exc).__name__}: {exc}"))
            return out
        memory = expected_memory(before)
        own, blob = self._impl_source(entry)
        codes = self.enabled(before)
        last = codes[-1]
        for code in codes:
            impl = self._impl_copy(own, blob, code == last)
            try:
                succ = self.apply(s, code, before, memory, entry.adds, impl)
            except Finding as f:
                out.failure = (code, f)
                return out
            except Exception as exc:  # the scheduler crashed: a finding
                out.failure = (code, Finding("error", f"{type(exc).__name__}: {exc}"))
                return out
            out.successors.append((code, succ.fingerprint, self._entry(succ, impl), bool(succ.view.requests)))
        return out

    def _impl_source(self, entry: Entry) -> tuple[Any, bytes]:
        """Where each transition's copy of the impl comes from: (the entry's
        own impl, to clone, or a pickle of it). A scheduler knows how to copy
        itself fastest: its clone() if it has one, else a pickle round trip."""
        if self.impl_cls is None:
            return None, b""
        if self.pickled:
            blob: bytes = entry.impl
            return None, blob
        own = entry.impl
        return own, b"" if callable(getattr(own, "clone", None)) else pickle.dumps(own, PICKLE_PROTOCOL)

    def _impl_copy(self, own: Any, blob: bytes, last: bool) -> Any:
        if self.impl_cls is None:
            return None
        if own is not None and last:
            return own  # in-process, the last transition consumes the entry's own copy
        if blob:
            return pickle.loads(blob)
        return own.clone()

    def _entry(self, succ: Successor, impl: Any) -> Entry:
        """The successor as an entry of the next level (pickled once per worker)."""
        if not self.pickled:
            return Entry(-1, succ.state, impl, succ.adds, succ.view)
        if succ.fingerprint in self.shipped:
            return Entry(-1, None, None, succ.adds)
        self.shipped.add(succ.fingerprint)
        impl_blob = pickle.dumps(impl, PICKLE_PROTOCOL) if self.impl_cls is not None else None
        return Entry(-1, pickle.dumps(succ.state, PICKLE_PROTOCOL), impl_blob, succ.adds)

    # -------------------------------------------------------------- one transition

    def apply(
        self,
        s: SpecScheduler,
        code: int,
        before: SchedulerView,
        memory: dict[int, int],
        adds: int,
        impl: Any = None,
    ) -> Successor:
        """Apply one event to a copy of ``s`` (whose view is ``before`` and
        whose KV holds ``memory``) with every transition check on; returns the
        successor, its view, its fingerprint and its count of adds. Raises
        Finding on a failed check. (The successor's own state invariants are
        checked when it is expanded, once per distinct state.)"""
        s2 = s.clone()
        if code == STEP:
            after = self._apply_step(s2, before, memory, impl)
        else:
            after, adds = self._apply_admin(s2, code, before, adds, impl)
        return Successor(s2, after, self.canon.fingerprint(after), adds)

    def _apply_step(self, s2: SpecScheduler, before: SchedulerView, memory: dict[int, int],
                    impl: Any) -> SchedulerView:
        """schedule(), the fake model, update(); the state in the middle of
        the step is not explored on its own, so its state invariants are
        checked here."""
        plan = s2.schedule()
        mid = before if self.blind else s2.view()
        self._check("schedule", before, mid, True, plan=plan)
        if impl is not None:
            self._compare("schedule()", plan, impl.schedule())
            self._compare("view()", mid, impl.view())
        result = self._run_model(plan, before, memory)
        s2.update(plan, result)
        after = s2.view()
        self.coverage.count_step(plan, before, after)
        self._check("update", mid, after, False, plan=plan, result=result)
        self._check_contents(after)
        if impl is not None:
            impl.update(plan, result)
            self._compare("view()", after, impl.view())
        return after

    def _run_model(self, plan: StepPlan, before: SchedulerView, memory: dict[int, int]) -> StepResult:
        """The fake model on a KV holding ``memory``, reading every context
        back through the plan's block tables and comparing it with the tokens."""
        model = self.model
        model.slots = dict(memory)
        truth = {rid: r.prompt_token_ids + r.output_token_ids for rid, r in before.requests.items()}
        result, mismatches = model.run(plan, truth)
        if mismatches:
            m = mismatches[0]
            raise Finding("violation", "the model read a context that is not the request's tokens", (
                Violation("kv-context", f"{m.request_id}: position {m.position} holds {m.found}, "
                          f"the request's token there is {m.expected}", m.request_id),))
        return result

    def _check_contents(self, after: SchedulerView) -> None:
        """Every slot the state vouches for holds what it says."""
        slots = self.model.slots
        for slot, tok in expected_memory(after).items():
            got = slots.get(slot)
            if got != tok:
                b, off = divmod(slot, self.config.block_size)
                raise Finding("violation", "the KV contents are not what the state says", (
                    Violation("kv-contents", f"block {b} offset {off} holds {got}, the state says {tok}"),))

    def _apply_admin(self, s2: SpecScheduler, code: int, before: SchedulerView, adds: int,
                     impl: Any) -> tuple[SchedulerView, int]:
        """A reset, an add or an abort between steps; returns the view after
        it and the count of adds."""
        a = self.alphabet
        kind: TransitionKind
        kw: dict[str, Any] = {}
        if code == RESET or code == RESET_RUNNING:
            kind = "reset"
            running_too = code == RESET_RUNNING
            ok = s2.reset_prefix_cache(running_too)
            self.coverage.count_reset(before, running_too, ok)
            if impl is not None:
                self._compare("reset_prefix_cache()", ok, impl.reset_prefix_cache(running_too))
        elif a.is_add(code):
            kind = "add"
            adds += 1
            req = kw["request"] = self.request(a.shape_index(code), adds)
            s2.add(req)
            if impl is not None:
                impl.add(req)
        else:
            kind = "abort"
            rid = kw["request_id"] = list(before.requests)[a.abort_index(code)]
            self.coverage.count_abort(before, rid)
            s2.abort(rid)
            if impl is not None:
                impl.abort(rid)
        after = s2.view()
        self._check(kind, before, after, False, **kw)
        if impl is not None:
            self._compare("view()", after, impl.view())
        return after, adds

    # -------------------------------------------------------------- paths

    def workload(self, codes: Sequence[int], run_last: bool = True) -> Workload:
        """The events of a path with concrete requests, named as the checker
        named them (the k-th add is ``r{k}``; ``abort #j`` names the j-th
        unfinished request at that point). With ``run_last`` False the last
        event is named but not performed (it may be the one that crashes)."""
        sched: SpecScheduler = self.cls(self.config)
        model = FakeModel(self.config.block_size, self.space.vocab, self.space.oracle_seed)
        events: list[Event] = []
        a = self.alphabet
        adds = 0
        for i, code in enumerate(codes):
            run = run_last or i < len(codes) - 1
            event: Event
            if code == STEP:
                event = Step()
            elif code == RESET or code == RESET_RUNNING:
                event = ResetPrefixCache(code == RESET_RUNNING)
            elif a.is_add(code):
                adds += 1
                event = AddRequest(self.request(a.shape_index(code), adds))
            else:
                event = Abort(list(sched.view().requests)[a.abort_index(code)])
            events.append(event)
            if run:
                _perform(sched, model, event)
        return Workload(self.config, tuple(events), seed=None)


def _perform(sched: SpecScheduler, model: FakeModel, event: Event) -> None:
    if isinstance(event, Step):
        plan = sched.schedule()
        result, _ = model.run(plan)
        sched.update(plan, result)
    elif isinstance(event, ResetPrefixCache):
        sched.reset_prefix_cache(event.reset_running_requests)
    elif isinstance(event, AddRequest):
        sched.add(event.request)
    elif isinstance(event, Abort):
        sched.abort(event.request_id)
