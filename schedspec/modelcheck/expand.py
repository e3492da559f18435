"""Expansion of one state: check it, apply every enabled event to a copy with
every check on, and return the successors with their fingerprints.

Checked on every transition: the invariants of the catalogue (statelessly,
see checks.py), the fake model's reads (the context read through the block
tables is the request's tokens) and the KV contents (every computed slot and
every keyed block holds what the state says), and, when a scheduler under
test is given (target.py), that scheduler taking the same transition from the
same state: with an equal plan and equal views (lockstep), or with the chosen
invariants holding on its own transitions (invariants mode). Everything the
checker reads of a state it reads through the scheduler's public ``view()``;
it copies a state with the scheduler's own ``clone()``.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast

from schedspec.check.deadline import CLOCK, CallTimeout
from schedspec.check.completion import scheduler_has_no_work
from schedspec.check.records import describe_difference
from schedspec.check.oracle import FakeModel, KVWorker
from schedspec.check.workload import (
    Abort,
    AddRequest,
    Event,
    GrammarReady,
    KVLoadDone,
    KVLoadFailed,
    KVSaveDone,
    Pause,
    ResetPrefixCache,
    Resume,
    Schedule,
    SessionInput,
    Step,
    Update,
    Workload,
)
from schedspec.invariants import CATALOGUE, History, Invariant, Transition, Violation
from schedspec.invariants.core import ALL_KINDS, TransitionKind
from schedspec.modelcheck.checks import StatelessChecker
from schedspec.modelcheck.coverage import Coverage
from schedspec.modelcheck.events import KV_OPS, PAUSE_STATE_OF, RESET, RESET_RUNNING, STEP, Alphabet
from schedspec.modelcheck.kvworld import KVWorld, forced_reports, kv_enabled, report_event
from schedspec.modelcheck import sessions
from schedspec.modelcheck.model import MemoModel
from schedspec.modelcheck.result import Finding
from schedspec.modelcheck.space import Space
from schedspec.modelcheck.state import Canon, Fingerprint, expected_memory, hidden_gate_state, kv_key
from schedspec.spec.effects import enable as enable_effects
from schedspec.spec import coverage as rule_coverage
from schedspec.modelcheck.target import PICKLE_PROTOCOL, Against, CopyMethod, copy_method, deep_copy, shared_objects
from schedspec.spec.errors import ProtocolError
from schedspec.spec.interface import (
    PauseState,
    Policy,
    RequestSpec,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)
from schedspec.spec.request_state import GrammarState
from schedspec.spec.runner_v2 import decode_stagger
from schedspec.spec.scheduler import SpecScheduler

T = TypeVar("T")

__all__ = ["PICKLE_PROTOCOL", "Entry", "Expander", "Expansion", "MemoModel", "Successor"]


@dataclass(frozen=True, slots=True)
class Flight:
    """What a state holds besides the scheduler with async scheduling: the
    plans awaiting update() with the results the fake model gave them (it
    runs a plan when it is scheduled, as the worker does), and the model's
    memory: its KV slots and, per request, its in-flight outputs, proposals
    and rejected counts (what fills a -1). The fingerprint covers all but
    the slots; the slots a correct scheduler reads are those its state
    vouches for or an in-flight plan wrote (docs/modelcheck.md, "Async
    scheduling")."""

    pairs: tuple[tuple[StepPlan, StepResult], ...] = ()
    outputs: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    proposals: tuple[tuple[str, tuple[int, ...]], ...] = ()
    rejected: tuple[tuple[str, int], ...] = ()
    slots: tuple[tuple[int, int], ...] = ()
    #: the requests of the model's last k - 1 plans, oldest first (what it
    #: keeps outputs for; empty with k = 2: FakeModel's rows)
    recent: tuple[tuple[str, ...], ...] = ()

    @property
    def plans(self) -> tuple[StepPlan, ...]:
        return tuple(p for p, _ in self.pairs)

    def load(self, model: FakeModel) -> None:
        """Put the model in this state."""
        model.slots = dict(self.slots)
        model.outputs = {rid: dict(o) for rid, o in self.outputs}
        model.proposals = dict(self.proposals)
        model.rejected = dict(self.rejected)
        model._recent = [frozenset(r) for r in self.recent]

    @staticmethod
    def of(model: FakeModel, pairs: tuple[tuple[StepPlan, StepResult], ...]) -> Flight:
        return Flight(pairs, tuple(sorted((rid, tuple(sorted(o.items()))) for rid, o in model.outputs.items())),
                      tuple(sorted(model.proposals.items())), tuple(sorted(model.rejected.items())),
                      tuple(sorted(model.slots.items())), tuple(tuple(sorted(r)) for r in model._recent))

    def key(self, v: SchedulerView) -> Fingerprint:
        """The in-flight part of a fingerprint, request ids renamed by
        arrival rank (the ids ``r{k}`` sort by arrival), together with the
        ranks of the requests the view knows (tying it to the view's part)."""
        ids = set(v.requests) | set(v.finished)
        for p, r in self.pairs:
            ids.update(e.request_id for e in p.scheduled)
            ids.update(p.preempted_ids)
            ids.update(p.finished_ids)
        ids.update(rid for rid, _ in self.outputs)
        ids.update(rid for rid, _ in self.proposals)
        ids.update(rid for rid, _ in self.rejected)
        for recent in self.recent:
            ids.update(recent)
        rank = {rid: i for i, rid in enumerate(sorted(ids, key=lambda r: (len(r), r)))}
        known = sorted(set(v.requests) | set(v.finished), key=lambda r: (len(r), r))
        plans = tuple((
            tuple((rank[e.request_id], e.kind, e.num_computed_tokens, e.num_scheduled_tokens, e.num_tokens,
                   e.block_ids, e.token_ids, e.spec_token_ids, e.num_output_placeholders) for e in p.scheduled),
            tuple(rank[x] for x in p.preempted_ids),
            tuple(rank[x] for x in p.finished_ids),
            tuple(sorted((rank[x], t) for x, t in r.sampled.items())),
            tuple(sorted((rank[x], t) for x, t in r.draft_token_ids.items())),
        ) for p, r in self.pairs)
        return (
            tuple(rank[x] for x in known),
            plans,
            tuple(sorted((rank[x], o) for x, o in self.outputs)),
            tuple(sorted((rank[x], o) for x, o in self.proposals)),
            tuple(sorted((rank[x], o) for x, o in self.rejected)),
            tuple(tuple(sorted(rank[x] for x in r)) for r in self.recent),
        )


@dataclass(slots=True)
class Entry:
    """A state waiting to be expanded. ``state`` is the SpecScheduler and
    ``impl`` the scheduler under test in the same state (None without one, or
    when it is rebuilt by replay), both pickled when states travel between
    processes, and both None in a worker's result for a state that worker
    already sent (the main process has it); ``adds`` how many requests the
    path to it added (the next one is ``r{adds + 1}``); ``view`` the state's
    view when it was already taken (in-process only: it does not travel);
    ``codes`` the path to it (kept only for a scheduler under test that is
    copied by replay); ``memory`` the KV slots of the scheduler under test
    (invariants mode only: it runs its own plans)."""

    idx: int
    state: Any
    impl: Any
    adds: int
    view: SchedulerView | None = None
    codes: tuple[int, ...] = ()
    memory: dict[int, int] | None = None
    #: async scheduling: the plans in flight and the fake model (see Flight)
    flight: Flight | None = None
    #: a pause with clear_cache waits for the engine to go idle (the driver's
    #: pending cache clear, part of the state)
    clear: bool = False
    #: invariants mode with async scheduling: the plans in flight of the
    #: scheduler under test and its fake model (it runs its own plans)
    tflight: Flight | None = None
    #: a space with a KV connector: the worker's state and the model's KV (kvworld.py)
    kv: KVWorld | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # compact between processes
        return (Entry, (self.idx, self.state, self.impl, self.adds, None, self.codes, self.memory, self.flight,
                        self.clear, self.tflight, self.kv))


@dataclass(slots=True)
class Expansion:
    idx: int
    #: (event code, fingerprint, successor entry with idx -1, has unfinished requests)
    successors: list[tuple[int, Fingerprint, Entry, bool]]
    #: the first failure: (event code or -1 for the state itself, what was found)
    failure: tuple[int, Finding] | None = None
    #: what these transitions exercised
    coverage: Coverage = field(default_factory=Coverage)
    #: the spec's rules these transitions took (spec/rule_names.py), and how often
    rules: dict[str, int] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Expansion, (self.idx, self.successors, self.failure, self.coverage, self.rules))


class Successor(NamedTuple):
    state: SpecScheduler
    view: SchedulerView
    fingerprint: Fingerprint
    adds: int
    memory: dict[int, int] | None = None  # the KV slots of the scheduler under test (invariants mode)
    flight: Flight | None = None  # async scheduling: the plans in flight and the model
    clear: bool = False  # a cache clear waits for the engine to go idle
    tflight: Flight | None = None  # invariants mode, async: the scheduler under test's flight
    kv: KVWorld | None = None  # a KV connector: the worker's state and the model's KV


def plan_key(plan: StepPlan, mid: SchedulerView) -> Fingerprint:
    """A plan up to the renaming of request ids and without its step number:
    ids become their rank among the ids ``mid`` (the state the plan left)
    knows and the plan names. The checker's ids are ``r{k}``, k in arrival
    order, so this is the order the fingerprint of ``mid`` ranks them in."""
    ids = set(mid.requests)
    ids.update(mid.finished)
    ids.update(e.request_id for e in plan.scheduled)
    ids.update(plan.preempted_ids)
    ids.update(plan.finished_ids)
    rank = {rid: i for i, rid in enumerate(sorted(ids, key=lambda r: (len(r), r)))}
    return (
        tuple([(rank[e.request_id], e.kind, e.num_computed_tokens, e.num_scheduled_tokens, e.num_tokens, e.block_ids,
                e.token_ids, e.spec_token_ids, e.num_output_placeholders) for e in plan.scheduled]),
        tuple([rank[r] for r in plan.preempted_ids]),
        tuple([rank[r] for r in plan.finished_ids]),
    )


def _call(who: str, method: str, fn: Callable[..., T], *args: Any) -> T:
    """Call one method of a scheduler; a crash becomes a Finding naming the
    scheduler and the method."""
    CLOCK.start(who, method)  # under the deadline of check/deadline.py
    try:
        return fn(*args)
    except Finding:
        raise
    except CallTimeout as exc:
        raise Finding("timeout", exc.describe(f"{who}.{method}()")) from None
    except Exception as exc:
        raise Finding("error", f"{who}.{method}() raised {type(exc).__name__}: {exc}") from None
    finally:
        CLOCK.stop()


def _pickled(sched: Any) -> bytes | None:
    """The scheduler under test pickled to travel to a worker; None when it does not pickle
    (the worker replays the state's path on a fresh instance instead)."""
    try:
        return pickle.dumps(sched, PICKLE_PROTOCOL)
    except Exception:
        return None


class Expander:
    """Expands one state: checks it, applies every enabled event to a copy
    with every check on, returns the successors with their fingerprints.

    ``scheduler_cls`` is the scheduler explored: SpecScheduler or a subclass
    (the tests use broken ones) whose ``clone()`` copies all of its state.
    ``against`` is the scheduler under test (None: none); ``impl_cls`` (built
    as ``impl_cls(config)``) is shorthand for a lockstep ``Against`` named
    "impl". ``invariants`` are checked on the spec's transitions (unless
    ``against`` is in invariants mode: then its own invariants are checked on
    its own transitions). ``copy`` says how the scheduler under test is
    copied (decided on a fresh one when None). ``pickled``: successors are
    returned pickled, to travel to another process. ``incremental`` False
    checks every middle of a step in full (the checker before it learnt not
    to: the verdicts are the same, see _first_mid)."""

    def __init__(
        self,
        space: Space,
        scheduler_cls: type[SpecScheduler] = SpecScheduler,
        impl_cls: Callable[[SchedulerConfig], Scheduler] | None = None,
        invariants: Sequence[Invariant] = CATALOGUE,
        pickled: bool = False,
        against: Against | None = None,
        copy: CopyMethod | None = None,
        incremental: bool = True,
    ) -> None:
        self.space = space
        self.config = space.config
        self.cls = scheduler_cls
        if against is None and impl_cls is not None:
            against = Against("impl", impl_cls, "lockstep", tuple(invariants))
        self.against = against
        self.impl_cls = against.factory if against is not None else None
        self.lockstep = against is not None and against.lockstep
        #: invariants mode: the checks on the scheduler under test's own transitions
        self.tchecker = StatelessChecker(against.invariants) if against is not None and not self.lockstep else None
        self.shapes = space.resolved_shapes()
        #: k, the plans the engine keeps in flight (async scheduling, a
        #: pipeline: config.max_concurrent_batches); with k > 1 states hold
        #: the plans in flight (Flight)
        self.depth = space.config.max_concurrent_batches
        self.is_async = self.depth > 1
        #: V2's decode throttle: each request's steps left before it may
        #: decode again is part of the state (throttle_part)
        self.stagger = decode_stagger(space.config)
        #: a KV connector (sync scheduling): the worker's reports are events and its state part of a state
        self.kv_on = space.config.kv_connector and not self.is_async
        self.alphabet = Alphabet(self.shapes, space.max_requests,
                                 space.abort_in_step and not self.is_async and not self.kv_on,
                                 aborts=against is None or against.aborts,
                                 resets=space.resets and (against is None or against.resets),
                                 async_scheduling=self.is_async, pauses=space.pauses,
                                 grammar=any(sh.structured_output for sh in self.shapes),
                                 kv_ops=self._kv_ops(space) if self.kv_on else (),
                                 sessions=any(sh.resumable for sh in self.shapes), depth=self.depth)
        spec_invariants = () if self.tchecker is not None else tuple(invariants)
        self.checker = StatelessChecker(spec_invariants)
        #: a space with an admission gate: its state is in the fingerprint
        self.gated = bool(space.gates())
        self.canon = Canon(len(self.shapes), space.config.policy == Policy.PRIORITY, self.gated,
                           space.config.prefill_schedule_interval, space.config.is_hybrid)
        k = space.config.num_speculative_tokens
        groups = space.config.groups if space.config.is_hybrid else ()
        rows = self.depth - 1  # the plans whose outputs fill a -1 (check/driver.py builds its model alike)
        self.model = MemoModel(space.config.block_size, space.vocab, space.oracle_seed, k, space.acceptance, groups,
                               rows)
        self.tmodel = MemoModel(space.config.block_size, space.vocab, space.oracle_seed, k, space.acceptance, groups,
                                rows)
        self.kv_bound = space.kv_report_bound
        self.pickled = pickled
        self.copy: CopyMethod | None = copy if against is not None else None
        self._shared: dict[int, object] = {}
        #: the counters of the expansion under way
        self.coverage = Coverage()
        #: no invariants and no lockstep: no checks on the spec's views (to measure the search alone)
        self.blind = not spec_invariants and not self.lockstep
        #: fingerprints of the successors this (worker) process already sent
        self.shipped: set[Fingerprint] = set()
        #: the name failures of the scheduler under test go by
        self.tname = against.name if against is not None else "impl"
        #: check a middle of a step once per distinct middle (see _first_mid)
        self.incremental = incremental and not self.blind
        self._mids: set[Fingerprint] = set()
        self._updates: set[tuple[Fingerprint, Fingerprint]] = set()
        #: a KV connector: the History the transition under way is checked
        #: with (built from the state's KVWorld, folded forward by _check)
        self._hist: History | None = None

    @staticmethod
    def _kv_ops(space: Space) -> tuple[str, ...]:
        """The worker's reports explored: the space's (all by default); with
        more than one KV cache group a failure is the whole load's
        (failed_recving: vLLM raises on invalid_block_ids there) and a
        synchronous load does not fail (check/oracle.py, KVWorker)."""
        ops = space.kv_ops or tuple(op for op, *_ in KV_OPS)
        if len(space.config.groups) > 1:
            ops = tuple(op for op in ops if op in ("done", "failed", "save"))
        return ops

    def request(self, shape_index: int, k: int) -> RequestSpec:
        """The k-th request of a path (1-based), of the given shape."""
        return self.shapes[shape_index].request(f"r{k}", k * len(self.shapes) + shape_index)

    def root(self) -> Entry:
        s = self.cls(self.config)
        enable_effects(s)  # effect coverage, carried by the spec's clones (spec/effects.py)
        impl: Any = None
        memory: dict[int, int] | None = None
        if self.against is not None:
            impl = _call(self.tname, "__init__", self.against.factory, self.config)
            if self.copy is None:
                self.copy = copy_method(impl)
            if self.copy == "deepcopy":
                self._shared = shared_objects(impl)
            if not self.lockstep:
                memory = {}
        flight = Flight() if self.is_async else None
        tflight = Flight() if self.is_async and memory is not None else None
        kv = KVWorld() if self.kv_on else None
        if self.pickled:
            blob = _pickled(impl) if self.copy in ("clone", "pickle") else None
            return Entry(0, pickle.dumps(s, PICKLE_PROTOCOL), blob, 0, None, (), memory, flight, False, tflight, kv)
        return Entry(0, s, impl, 0, s.view(), (), memory, flight, False, tflight, kv)

    def fingerprint(self, entry: Entry) -> Fingerprint:
        """The fingerprint of a state held by an entry (the root's, in practice)."""
        s: SpecScheduler = pickle.loads(entry.state) if self.pickled else entry.state
        v = entry.view if entry.view is not None else s.view()
        return self.full_fingerprint(v, entry.flight, s, entry.clear, entry.kv)

    def full_fingerprint(self, v: SchedulerView, flight: Flight | None, s: object = None,
                         clear: bool = False, kv: KVWorld | None = None) -> Fingerprint:
        """The state's fingerprint: the view's, with async scheduling the
        plans in flight and the model's, and in a space with an admission
        gate what the spec ``s`` keeps of the gates beyond its view and
        whether a cache clear is pending; with a KV connector the view's
        connector state and the worker's (state.kv_key)."""
        fp = self.canon.fingerprint(v)
        if flight is not None:
            fp += (flight.key(v),)
        if self.gated:
            fp += (hidden_gate_state(s, v), clear)
        if self.alphabet.sessions:
            fp += (sessions.session_state(s, v),)
        if kv is not None:
            fp += (kv_key(v, kv.loads, kv.saves, kv.queue, kv.now, self.kv_bound, kv.invalid),)
        if self.stagger:
            fp += (throttle_part(s, v),)
        return fp

    def enabled(self, v: SchedulerView, flight: Flight | None = None, s: object = None,
                kv: KVWorld | None = None) -> list[int]:
        grammar_waiting: list[int] = []
        if self.alphabet.grammar:
            requests: Any = getattr(s, "requests", {})
            for k, (rid, r) in enumerate(v.requests.items()):
                if (r.status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                        and getattr(requests.get(rid), "grammar", None) in (None, GrammarState.COMPILING)):
                    grammar_waiting.append(k)
        return self.alphabet.enabled(len(v.requests) + len(v.finished), len(v.requests),
                                     len(flight.pairs) if flight is not None else 0, int(v.pause_state),
                                     grammar_waiting,
                                     kv_enabled(self.alphabet, v, kv, self.config.block_size) if kv else (),
                                     sessions.enabled_updates(self.alphabet, self.shapes, self.config, s, v),
                                     self._known_by_shape(v))

    def _known_by_shape(self, v: SchedulerView) -> list[int]:
        """How many known requests (unfinished, or finished and not yet
        reported) each shape has, for the shapes' ``max_at_once`` (empty when
        no shape has one): the k-th request of shape i arrives at k * n + i."""
        n = len(self.shapes)
        if not any(sh.max_at_once for sh in self.shapes):
            return []
        counts = [0] * n
        for r in (*v.requests.values(), *v.finished.values()):
            counts[r.spec.arrival % n] += 1
        return counts

    # -------------------------------------------------------------- checks

    def _check(self, kind: TransitionKind, before: SchedulerView, after: SchedulerView, state_too: bool,
               **kw: Any) -> None:
        if self.blind:
            return
        t = Transition(kind=kind, before=before, after=after, **kw)
        h = self._hist
        found = self.checker.check(t, state_too, history=h)
        if found:
            raise Finding("violation", f"{len(found)} invariant violation(s) after {kind}", found)
        if h is not None:
            # what a Monitor's History folds in: the loads a plan starts, and
            # the invalid blocks awaiting recomputation
            h.record_loads_and_invalid_blocks(t)

    def _tcheck(self, kind: TransitionKind, before: SchedulerView, after: SchedulerView, **kw: Any) -> None:
        """The chosen invariants on a transition of the scheduler under test (invariants mode)."""
        assert self.tchecker is not None
        found = self.tchecker.check(Transition(kind=kind, before=before, after=after, **kw), True)
        if found:
            raise Finding("violation", f"{len(found)} invariant violation(s) of {self.tname} after {kind}", found)

    # The middle of a step is not a state of the graph, yet many steps pass
    # through the same one: schedule() forgets what told their before-states
    # apart (the requests finished or preempted since the last plan, the
    # order of a PRIORITY waiting list). On the small bound 19,956 steps pass
    # through 1,980 distinct middles. What is checked there is checked once
    # per distinct middle (``incremental``): its state invariants (they read
    # the state alone, and the fingerprint keeps their verdict, as for the
    # states of the graph), and the update's transition invariants once per
    # distinct (middle, plan): the plan, up to the renaming of ids, with the
    # middle state fixes the model's result (the model's reads are checked
    # on every step) and the state after. The KV contents after each step
    # and a scheduler under test are checked on every step.

    def _mid_fingerprint(self, mid: SchedulerView, s: object = None) -> Fingerprint | None:
        if not self.incremental:
            return None
        fp = self.canon.fingerprint(mid)
        if self.alphabet.sessions:
            fp += (sessions.session_state(s, mid),)
        return fp + (hidden_gate_state(s, mid),) if self.gated else fp

    def _first_mid(self, fp: Fingerprint | None) -> bool:
        """Whether the state invariants of this middle of a step must run (its first time)."""
        if fp is None:
            return True
        if fp in self._mids:
            return False
        self._mids.add(fp)
        return True

    def _first_update(self, mid_fp: Fingerprint, mid: SchedulerView, plan: StepPlan) -> bool:
        """Whether the update from this middle by this plan is new."""
        key = (mid_fp, plan_key(plan, mid))
        if key in self._updates:
            return False
        self._updates.add(key)
        return True

    def _check_state(self, v: SchedulerView) -> None:
        found = self.checker.check_state(v) if not self.blind else []
        if found:
            raise Finding("violation", f"{len(found)} invariant violation(s) in a reachable state", found)

    def _compare(self, what: str, ours: object, theirs: object) -> None:
        if ours != theirs:
            raise Finding("divergence", describe_difference(what, "spec", ours, self.tname, theirs))

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
            out.failure = (-1, Finding("error", f"spec.view() raised {type(exc).__name__}: {exc}"))
            return out
        memory = expected_memory(before) if entry.flight is None and entry.kv is None else {}
        source = self._target_source(entry)
        codes = self.enabled(before, entry.flight, s, entry.kv)
        last = codes[-1]
        # The spec counts the rules it takes into one counter its clones
        # share: a fresh one for this state's transitions counts each once.
        rules = rule_coverage.new_counts()
        rule_coverage.attach(s, rules)
        for code in codes:
            try:
                impl, tmem = source(code == last)
                if entry.kv is not None:
                    ksucc = self.apply_kv(s, code, before, entry.kv, entry.adds, impl)
                    if ksucc is None:  # a report its step does not deliver: not explored
                        continue
                    succ = ksucc
                else:
                    succ = (self.apply(s, code, before, memory, entry.adds, impl, tmem, entry.clear)
                            if entry.flight is None
                            else self.apply_async(s, code, before, entry.flight, entry.adds, impl, entry.clear,
                                                  entry.tflight, tmem))
            except Finding as f:
                out.failure = (code, f)
                out.rules = dict(rules)
                return out
            except Exception as exc:  # the explored scheduler crashed (the one under test raises Findings)
                out.failure = (code, Finding("error", f"the explored scheduler raised {type(exc).__name__}: {exc}"))
                out.rules = dict(rules)
                return out
            # the path travels with every state: a copy that fails falls back to replaying it
            path = entry.codes + (code,) if self.against is not None else ()
            out.successors.append((code, succ.fingerprint, self._entry(succ, impl, path), _busy(succ)))
        out.rules = dict(rules)
        return out

    def _target_source(self, entry: Entry) -> Callable[[bool], tuple[Any, dict[int, int] | None]]:
        """Where each transition's copy of the scheduler under test (and of
        its KV memory, in invariants mode) comes from; called with True for
        the state's last transition, which may consume the entry's own copy.
        A scheduler knows how to copy itself fastest (target.copy_method)."""
        if self.against is None:
            return lambda last: (None, None)
        mem = entry.memory
        m = self.copy
        own = entry.impl

        def with_memory(t: Any) -> tuple[Any, dict[int, int] | None]:
            return t, (None if mem is None else dict(mem))

        codes = entry.codes

        def copied(copy: Callable[[], Any]) -> tuple[Any, dict[int, int] | None]:
            """A copy made by ``copy``; one that fails is no finding of the scheduler's: the path
            to the state is replayed on a fresh instance instead."""
            try:
                return with_memory(copy())
            except Finding:
                raise
            except Exception:
                return self._replay(codes)

        if m == "replay":
            return lambda last: with_memory(own) if last and own is not None else self._replay(codes)
        if self.pickled:  # clone or pickle: the entry holds a pickle (None: it did not pickle)
            blob: bytes | None = own
            return lambda last: self._replay(codes) if blob is None else copied(lambda: pickle.loads(blob))
        if m == "clone":
            return lambda last: with_memory(own) if last else copied(own.clone)
        if m == "pickle":
            return lambda last: with_memory(own) if last else copied(
                lambda: pickle.loads(pickle.dumps(own, PICKLE_PROTOCOL)))
        shared = self._shared
        return lambda last: with_memory(own) if last else copied(lambda: deep_copy(own, shared))

    def _replay(self, codes: Sequence[int]) -> tuple[Any, dict[int, int] | None]:
        """A fresh scheduler under test brought to the state at the end of
        ``codes`` by replaying them (its own plans through a fresh fake
        model: in lockstep these equal the spec's, whose results the
        exploration fed it; in invariants mode they are what it ran)."""
        assert self.against is not None
        t = _call(self.tname, "__init__", self.against.factory, self.config)
        replay = _Replay(t, self.space.model())
        for event in self.workload(codes).events:
            replay.perform(event)
        return t, (None if self.lockstep else dict(replay.model.slots))

    def _entry(self, succ: Successor, impl: Any, codes: tuple[int, ...]) -> Entry:
        """The successor as an entry of the next level (pickled once per worker)."""
        if not self.pickled:
            return Entry(-1, succ.state, impl, succ.adds, succ.view, codes, succ.memory, succ.flight, succ.clear,
                         succ.tflight, succ.kv)
        if succ.fingerprint in self.shipped:
            return Entry(-1, None, None, succ.adds)
        self.shipped.add(succ.fingerprint)
        blob = _pickled(impl) if self.copy in ("clone", "pickle") else None
        return Entry(-1, pickle.dumps(succ.state, PICKLE_PROTOCOL), blob, succ.adds, None, codes, succ.memory,
                     succ.flight, succ.clear, succ.tflight, succ.kv)

    # -------------------------------------------------------------- one transition

    def apply(
        self,
        s: SpecScheduler,
        code: int,
        before: SchedulerView,
        memory: dict[int, int],
        adds: int,
        impl: Any = None,
        tmem: dict[int, int] | None = None,
        clear: bool = False,
    ) -> Successor:
        """Apply one event to a copy of ``s`` (whose view is ``before`` and
        whose KV holds ``memory``) with every transition check on, and to
        ``impl``, the scheduler under test in the same state (KV memory
        ``tmem`` in invariants mode); ``clear``: a pause's cache clear waits
        for the engine to go idle. Returns the successor, its view, its
        fingerprint, its count of adds and the memory of the scheduler under
        test. Raises Finding on a failed check. (The successor's own state
        invariants are checked when it is expanded, once per distinct state.)"""
        s2 = s.clone()
        a = self.alphabet
        if code == STEP or (a.abort_in_step and a.is_step_abort(code)):
            rid = list(before.requests)[a.abort_index(code)] if code != STEP else None
            after = self._apply_step(s2, before, memory, impl, rid)
            if impl is not None and tmem is not None:
                tmem = self._target_step(impl, tmem, rid)
        else:
            after, adds, clear = self._apply_admin(s2, code, before, adds, impl, clear)
        after, clear = self._settle(s2, after, impl, clear, ())
        return Successor(s2, after, self.full_fingerprint(after, None, s2, clear), adds, tmem, None, clear)

    def apply_kv(self, s: SpecScheduler, code: int, before: SchedulerView, world: KVWorld, adds: int,
                 impl: Any = None) -> Successor | None:
        """One event of a space with a KV connector (sync scheduling): a
        step, with the worker's report the code names (kvworld.report_event)
        and those the bounded wait forces, delivered by the check engine's
        KVWorker; or an admin event (the worker learns each added prompt).
        None for a report the step does not deliver (a synchronous failure
        of a request the step does not load): that path is not explored."""
        self._hist = h = History()
        h.loads = {rid: load for rid, (load, _) in world.loads.items()}
        h.invalid_blocks = dict(world.invalid)
        try:
            succ = self._apply_kv(s, code, before, world, adds, impl)
        finally:
            self._hist = None
        if succ is None or self.blind:
            return succ
        assert succ.kv is not None
        kv = dataclasses.replace(succ.kv, invalid=dict(h.invalid_blocks))
        fp = self.full_fingerprint(succ.view, None, succ.state, False, kv)
        return Successor(succ.state, succ.view, fp, succ.adds, succ.memory, succ.flight, succ.clear, succ.tflight, kv)

    def _apply_kv(self, s: SpecScheduler, code: int, before: SchedulerView, world: KVWorld, adds: int,
                  impl: Any = None) -> Successor | None:
        a = self.alphabet
        if code != STEP and not a.is_kv(code):
            if self.against is not None and not self.lockstep:
                raise Finding("error", "invariants mode is not offered with a KV connector (lockstep only)")
            s2 = s.clone()
            after, adds, _ = self._apply_admin(s2, code, before, adds, impl)
            if a.is_add(code):
                req = list(after.requests.values())[-1]
                world = world.added(req.request_id, req.spec.prompt_token_ids)
            return Successor(s2, after, self.full_fingerprint(after, None, s2, False, world), adds, None, None,
                             False, None, world)
        s2 = s.clone()
        model = self.model
        model.slots = dict(world.slots)
        model.outputs, model.proposals, model.rejected = {}, {}, {}
        worker = world.worker(self.config, model, self.kv_bound)
        user = report_event(a, code, before, world) if code != STEP else None
        if user is not None:
            worker.post(user)
        plan = s2.schedule()
        mid = s2.view()
        self._check("schedule", before, mid, self._first_mid(self._mid_fingerprint(mid, s2)), plan=plan,
                    in_flight=(plan,))
        lockstep = impl is not None and self.lockstep
        if lockstep:
            self._compare("schedule()", plan, _call(self.tname, "schedule", impl.schedule))
            self._compare("view()", mid, _call(self.tname, "view", impl.view))
        for event in forced_reports(worker, plan.step, self.kv_bound):
            worker.post(event)
            self.coverage.kv_forced += 1
        failing = worker.before(plan)
        _load_grammars(model, before)
        truth = {rid: r.spec.prompt_token_ids + r.output_token_ids for rid, r in before.requests.items()
                 if rid not in failing}
        result = _execute_plan(model, plan, truth)
        result = worker.after(plan, mid, result)
        if user is not None and any(e is user for e in worker.queue):
            return None
        self.coverage.count_kv(plan, result)
        s2.update(plan, result)
        worker.updated(plan.step)
        after = s2.view()
        self.coverage.count_step(plan, before, after)
        self._check("update", mid, after, False, plan=plan, result=result)
        # an invalid block awaiting recomputation holds no valid KV, though
        # under "recompute" vLLM keeps it in the prefix cache until its
        # holder rewrites it (the invariants' History tracks it)
        skip = set(self._hist.invalid_blocks) if self._hist is not None else set()
        self._check_contents(after, model.slots, skip=skip)
        if lockstep:
            _call(self.tname, "update", impl.update, plan, result)
            self._compare("view()", after, _call(self.tname, "view", impl.view))
        self._take_outputs(s2, impl if lockstep else None)
        new = KVWorld.of(worker, plan.step, model.slots, after)
        return Successor(s2, after, self.full_fingerprint(after, None, s2, False, new), adds, None, None, False,
                         None, new)

    def apply_async(self, s: SpecScheduler, code: int, before: SchedulerView, flight: Flight, adds: int,
                    impl: Any = None, clear: bool = False, tflight: Flight | None = None,
                    tmem: dict[int, int] | None = None) -> Successor:
        """_apply_async, with V2's decode throttle checked against a
        History that holds what a Monitor remembers along any path to the
        state: each request's last sampling step (decoded_at), which is the
        state's own stamp (throttle_part) less the stagger."""
        if not self.stagger or self.blind:
            return self._apply_async(s, code, before, flight, adds, impl, clear, tflight, tmem)
        self._hist = h = History()
        requests: Any = getattr(s, "requests", {})
        h.decoded_at = {rid: r.next_decode_eligible_step - self.stagger for rid, r in requests.items()
                        if getattr(r, "next_decode_eligible_step", 0)}
        try:
            return self._apply_async(s, code, before, flight, adds, impl, clear, tflight, tmem)
        finally:
            self._hist = None

    def _apply_async(self, s: SpecScheduler, code: int, before: SchedulerView, flight: Flight, adds: int,
                     impl: Any = None, clear: bool = False, tflight: Flight | None = None,
                     tmem: dict[int, int] | None = None) -> Successor:
        """One event of a space with plans in flight (async scheduling, a
        pipeline of k = config.max_concurrent_batches): ``step`` schedules a
        plan (and the fake model runs it) while fewer than k are in flight,
        else it delivers the oldest; ``update`` delivers the oldest of 1 ..
        k - 1 (vllm/v1/engine/core.py, step_with_batch_queue); add,
        abort, reset and the gate events come between them. Every transition
        is checked with the plans in flight after it; lockstep compares the
        scheduler under test's plans and views; invariants mode runs the
        scheduler under test's own plans (``tflight``: its plans in flight
        and its fake model) and checks its own transitions."""
        s2 = s.clone()
        a = self.alphabet
        who = self.tname
        lockstep = impl is not None and self.lockstep
        target = impl is not None and not self.lockstep
        if target and tflight is None:
            raise Finding("error", f"invariants mode on an async space needs {who} copied by clone, pickle or "
                                   "deepcopy (its plans in flight travel with the state)")
        tb = _call(who, "view", impl.view) if target else None
        pairs = flight.pairs
        if code == STEP and len(pairs) < self.depth:
            plan = s2.schedule()
            after = s2.view()
            plans = flight.plans + (plan,)
            self._check("schedule", before, after, True, plan=plan, in_flight=plans)
            if lockstep:
                self._compare("schedule()", plan, _call(who, "schedule", impl.schedule))
            model = self.model
            flight.load(model)
            _load_grammars(model, before)
            truth = self._async_truth(before, pairs)
            result = _execute_plan(model, plan, truth)
            new = Flight.of(model, pairs + ((plan, result),))
            if target:
                assert tb is not None and tflight is not None
                tflight = self._target_schedule(impl, tb, tflight)
        elif code == STEP or code == a.update:
            (plan, result), rest = pairs[0], pairs[1:]
            s2.update(plan, result)
            after = s2.view()
            self.coverage.count_step(plan, before, after)
            self._check("update", before, after, True, plan=plan, result=result,
                        in_flight=tuple(p for p, _ in rest))
            self._check_contents(after, dict(flight.slots))
            if lockstep:
                _call(who, "update", impl.update, plan, result)
            self._take_outputs(s2, impl if lockstep else None)
            new = dataclasses.replace(flight, pairs=rest)
            if target:
                assert tb is not None and tflight is not None
                tflight = self._target_update(impl, tb, tflight)
        else:
            kind, kw, adds, clear = self._admin_event(s2, code, before, adds, impl, clear)
            after = s2.view()
            self._check_kind(kind, before, after, True, in_flight=flight.plans, **kw)
            new = flight
            if target:
                assert tb is not None and tflight is not None
                self._tcheck_kind(kind, tb, _call(who, "view", impl.view), in_flight=tflight.plans, **kw)
        if lockstep:
            self._compare("view()", after, _call(who, "view", impl.view))
        after, clear = self._settle(s2, after, impl, clear, new.plans, tflight.plans if tflight else ())
        return Successor(s2, after, self.full_fingerprint(after, new, s2, clear), adds, tmem, new, clear, tflight)

    def _target_schedule(self, t: Any, tb: SchedulerView, tflight: Flight) -> Flight:
        """Invariants mode, async: the scheduler under test schedules its own
        plan and its own fake model runs it (reads checked); returns its
        flight with the plan added."""
        who = self.tname
        plan = _call(who, "schedule", t.schedule)
        tm = _call(who, "view", t.view)
        self._tcheck("schedule", tb, tm, plan=plan, in_flight=tflight.plans + (plan,))
        model = self.tmodel
        tflight.load(model)
        _load_grammars(model, tb)
        result = _execute_plan(model, plan, self._async_truth(tb, tflight.pairs), who)
        return Flight.of(model, tflight.pairs + ((plan, result),))

    def _target_update(self, t: Any, tb: SchedulerView, tflight: Flight) -> Flight:
        """Invariants mode, async: the scheduler under test takes the oldest
        of its plans in flight with its model's result; the KV contents after."""
        who = self.tname
        (plan, result), rest = tflight.pairs[0], tflight.pairs[1:]
        _call(who, "update", t.update, plan, result)
        ta = _call(who, "view", t.view)
        self._tcheck("update", tb, ta, plan=plan, result=result, in_flight=tuple(p for p, _ in rest))
        self._check_contents(ta, dict(tflight.slots), who)
        return dataclasses.replace(tflight, pairs=rest)

    def _settle(self, s2: SpecScheduler, after: SchedulerView, impl: Any, clear: bool,
                in_flight: tuple[StepPlan, ...], t_in_flight: tuple[StepPlan, ...] = ()) -> tuple[SchedulerView, bool]:
        """A pause's pending cache clear, once the engine is idle after an
        event (as the check driver does it: vllm/v1/engine/core.py,
        _finish_pause -> reset_prefix_cache(reset_running_requests=True)) on
        the spec and the scheduler under test; returns the view after and
        whether the clear still waits."""
        if not clear or not engine_idle(after, len(in_flight)):
            return after, clear
        who = self.tname
        tb = _call(who, "view", impl.view) if impl is not None and not self.lockstep else None
        ok = s2.reset_prefix_cache(True)
        self.coverage.count_reset(after, True, ok)
        self.coverage.pause_clears += 1
        new = s2.view()
        self._check("reset", after, new, True, in_flight=in_flight)
        if impl is not None:
            theirs = _call(who, "reset_prefix_cache", impl.reset_prefix_cache, True)
            ta = _call(who, "view", impl.view)
            if self.lockstep:
                self._compare("reset_prefix_cache()", ok, theirs)
                self._compare("view()", new, ta)
            else:
                assert tb is not None
                self._tcheck("reset", tb, ta, in_flight=t_in_flight)
        return new, False

    @staticmethod
    def _async_truth(v: SchedulerView, pairs: tuple[tuple[StepPlan, StepResult], ...]) -> dict[str, tuple[int, ...]]:
        """Each running request's tokens as the engine knows them: the
        delivered ones, then the outputs of the plans in flight (what the
        model's context must read back). Requests waiting or preempted with
        output in flight are left to the KV contents check."""
        truth: dict[str, tuple[int, ...]] = {}
        for rid, r in v.requests.items():
            toks = r.spec.prompt_token_ids + r.output_token_ids
            if any(p.get(rid) is not None for p, _ in pairs):
                if r.status is not RequestStatus.RUNNING:
                    continue
                for _, res in pairs:
                    toks += tuple(res.sampled.get(rid, ()))
            truth[rid] = toks
        return truth

    def _apply_step(self, s2: SpecScheduler, before: SchedulerView, memory: dict[int, int],
                    impl: Any, abort: str | None = None) -> SchedulerView:
        """schedule(), the fake model, update(), with the request ``abort``
        aborted while the plan is in flight when given; the states in the
        middle of the step are not explored on their own, so their state
        invariants are checked here."""
        plan = s2.schedule()
        mid = before if self.blind else s2.view()
        mid_fp = self._mid_fingerprint(mid, s2)
        self._check("schedule", before, mid, self._first_mid(mid_fp), plan=plan, in_flight=(plan,))
        lockstep = impl is not None and self.lockstep
        if lockstep:
            self._compare("schedule()", plan, _call(self.tname, "schedule", impl.schedule))
            self._compare("view()", mid, _call(self.tname, "view", impl.view))
        if abort is not None:
            self.coverage.count_abort(before, abort)
            s2.abort(abort)
            mid2 = before if self.blind else s2.view()
            mid_fp = self._mid_fingerprint(mid2, s2)
            self._check("abort", mid, mid2, self._first_mid(mid_fp), request_id=abort, in_flight=(plan,))
            if lockstep:
                _call(self.tname, "abort", impl.abort, abort)
                self._compare("view()", mid2, _call(self.tname, "view", impl.view))
            mid = mid2
        result = self._run_model(plan, before, memory)
        s2.update(plan, result)
        after = s2.view()
        self.coverage.count_step(plan, before, after)
        if mid_fp is None or self._first_update(mid_fp, mid, plan):
            self._check("update", mid, after, False, plan=plan, result=result)
        self._check_contents(after, self.model.slots)
        if lockstep:
            _call(self.tname, "update", impl.update, plan, result)
            self._compare("view()", after, _call(self.tname, "view", impl.view))
        self._take_outputs(s2, impl if lockstep else None)
        return after

    def _take_outputs(self, s2: SpecScheduler, impl: Any) -> None:
        """After an update, as the check's driver: the KV cache events
        (config.enable_kv_cache_events; spec/kv_events.py) taken and the
        statistics (a spec built with log_stats; spec/stats.py) made, each
        compared with the scheduler under test's in lockstep (``impl``)."""
        if self.config.enable_kv_cache_events:
            ours = s2.take_kv_events()
            if impl is not None:
                self._compare("take_kv_events()", ours,
                              tuple(_call(self.tname, "take_kv_events", impl.take_kv_events)))
        if s2.stats_record is not None:
            stats = s2.make_stats()
            if impl is not None:
                self._compare("make_stats()", stats, _call(self.tname, "make_stats", impl.make_stats))

    def _target_step(self, t: Any, tmem: dict[int, int], abort: str | None = None) -> dict[int, int]:
        """Invariants mode: the scheduler under test schedules its own plan
        (``abort`` is aborted while it is in flight, when given), the fake
        model runs it on its KV memory ``tmem`` (reads checked), it takes
        the result; the chosen invariants on every part, the KV contents
        after. Returns its memory after the step."""
        who = self.tname
        tb = _call(who, "view", t.view)
        plan = _call(who, "schedule", t.schedule)
        tm = _call(who, "view", t.view)
        self._tcheck("schedule", tb, tm, plan=plan, in_flight=(plan,))
        if abort is not None:
            _call(who, "abort", t.abort, abort)
            tm2 = _call(who, "view", t.view)
            self._tcheck("abort", tm, tm2, request_id=abort, in_flight=(plan,))
            tm = tm2
        model = self.tmodel
        model.slots = tmem
        model.outputs, model.proposals, model.rejected = {}, {}, {}
        _load_grammars(model, tb)
        truth = {rid: r.spec.prompt_token_ids + r.output_token_ids for rid, r in tb.requests.items()}
        result = _execute_plan(model, plan, truth, who)
        _call(who, "update", t.update, plan, result)
        ta = _call(who, "view", t.view)
        self._tcheck("update", tm, ta, plan=plan, result=result)
        self._check_contents(ta, model.slots, who)
        return model.slots

    def _run_model(self, plan: StepPlan, before: SchedulerView, memory: dict[int, int]) -> StepResult:
        """The fake model on a KV holding ``memory``, reading every context
        back through the plan's block tables and comparing it with the tokens."""
        model = self.model
        model.slots = dict(memory)
        # Synchronous steps: nothing is in flight between them, so the
        # model's per-request outputs and proposals (what fills a -1) start
        # empty; the drafts the scheduler verifies are in its state.
        model.outputs, model.proposals, model.rejected = {}, {}, {}
        _load_grammars(model, before)
        truth = {rid: r.spec.prompt_token_ids + r.output_token_ids for rid, r in before.requests.items()}
        result = _execute_plan(model, plan, truth)
        return result

    def _check_contents(self, after: SchedulerView, slots: dict[int, int], who: str = "",
                        skip: set[int] | frozenset[int] = frozenset()) -> None:
        """Every slot the state vouches for holds what it says (but in the
        blocks ``skip``)."""
        for slot, tok in expected_memory(after).items():
            got = slots.get(slot)
            if got != tok:
                b, off = divmod(slot, self.config.block_size)
                if b in skip:
                    continue
                whose = f" of {who}" if who else ""
                raise Finding("violation", f"the KV contents{whose} are not what the state says", (
                    Violation("kv-contents", f"block {b} offset {off} holds {got}, the state says {tok}"),))

    def _admin_event(self, s2: SpecScheduler, code: int, before: SchedulerView, adds: int,
                     impl: Any, clear: bool = False) -> tuple[str, dict[str, Any], int, bool]:
        """Perform a reset, an add, an abort, a pause event or a grammar
        report on the spec and on the scheduler under test (comparing reset
        answers in lockstep); returns the transition's kind ("pause" and
        "grammar" besides the invariants' kinds), its keyword fields, the
        count of adds and whether a cache clear waits."""
        a = self.alphabet
        who = self.tname
        kw: dict[str, Any] = {}
        kind: str
        if code == RESET or code == RESET_RUNNING:
            kind = "reset"
            running_too = code == RESET_RUNNING
            outcome: bool | str
            try:
                outcome = ok = s2.reset_prefix_cache(running_too)
                self.coverage.count_reset(before, running_too, ok)
            except ProtocolError:
                # with a KV connector the boundary refuses a reset that would
                # leave blocks held (a load in flight, blocks kept for a
                # save), the scheduler unchanged: an outcome, as the check
                # driver takes it
                # (sessions: a session waiting holds its blocks, spec/sessions.py)
                if not (self.config.kv_connector or a.sessions):
                    raise
                outcome = "refused"
                self.coverage.kv_resets_refused += self.config.kv_connector
            if impl is not None:
                try:
                    theirs: bool | str = _call(who, "reset_prefix_cache", impl.reset_prefix_cache, running_too)
                except Finding:
                    if not (self.config.kv_connector or a.sessions):
                        raise
                    theirs = "refused"
                if self.lockstep:
                    self._compare("reset_prefix_cache()", outcome, theirs)
        elif a.is_add(code):
            kind = "add"
            adds += 1
            req = kw["request"] = self.request(a.shape_index(code), adds)
            s2.add(req)
            if impl is not None:
                _call(who, "add", impl.add, req)
        elif a.is_pause(code):
            kind = "pause"
            _, mode, clear_cache = a.pause_event(code)
            state = PauseState(PAUSE_STATE_OF[mode])
            s2.set_pause_state(state)
            self.coverage.pauses += 1
            if impl is not None:
                _call(who, "set_pause_state", _optional(who, impl, "set_pause_state"), state)
            clear = clear or clear_cache
        elif a.is_session(code):
            kind = "session"
            update = sessions.update_for(a, self.shapes, before, code)
            s2.session_update(update)
            if impl is not None:
                _call(who, "session_update", _optional(who, impl, "session_update"), update)
        elif a.is_grammar(code):
            kind = "grammar"
            k, ok = a.grammar_event(code)
            rid = kw["request_id"] = list(before.requests)[k]
            s2.grammar_ready(rid, ok)
            self.coverage.grammar_reports += 1
            if impl is not None:
                _call(who, "grammar_ready", _optional(who, impl, "grammar_ready"), rid, ok)
        else:
            kind = "abort"
            rid = kw["request_id"] = list(before.requests)[a.abort_index(code)]
            self.coverage.count_abort(before, rid)
            s2.abort(rid)
            if impl is not None:
                _call(who, "abort", impl.abort, rid)
        return kind, kw, adds, clear

    def _check_kind(self, kind: str, before: SchedulerView, after: SchedulerView, state_too: bool,
                    **kw: Any) -> None:
        """The invariants on a transition of any kind: a kind the invariants
        do not know (a pause event, a grammar report) has its after-state
        checked (its state invariants) when ``state_too``."""
        if kind in ALL_KINDS:
            self._check(kind, before, after, state_too, **kw)
        elif state_too:
            self._check_state(after)

    def _tcheck_kind(self, kind: str, before: SchedulerView, after: SchedulerView, **kw: Any) -> None:
        """As _check_kind, on the scheduler under test (invariants mode)."""
        if kind in ALL_KINDS:
            self._tcheck(kind, before, after, **kw)
            return
        assert self.tchecker is not None
        found = self.tchecker.check_state(after)
        if found:
            raise Finding("violation", f"{len(found)} invariant violation(s) of {self.tname} after {kind}", found)

    def _apply_admin(self, s2: SpecScheduler, code: int, before: SchedulerView, adds: int,
                     impl: Any, clear: bool = False) -> tuple[SchedulerView, int, bool]:
        """A reset, an add, an abort or a gate event between steps; returns
        the view after it, the count of adds and whether a cache clear waits."""
        who = self.tname
        tb = _call(who, "view", impl.view) if impl is not None and not self.lockstep else None
        kind, kw, adds, clear = self._admin_event(s2, code, before, adds, impl, clear)
        after = s2.view()
        self._check_kind(kind, before, after, False, **kw)
        if impl is not None:
            theirs_after = _call(who, "view", impl.view)
            if self.lockstep:
                self._compare("view()", after, theirs_after)
            else:
                assert tb is not None
                self._tcheck_kind(kind, tb, theirs_after, **kw)
        return after, adds, clear

    # -------------------------------------------------------------- paths

    def workload(self, codes: Sequence[int], run_last: bool = True) -> Workload:
        """The events of a path with concrete requests, named as the checker
        named them (the k-th add is ``r{k}``; ``abort #j`` names the j-th
        unfinished request at that point). With ``run_last`` False the last
        event is named but not performed (it may be the one that crashes).
        With "prefix" draft acceptance and drafts, each step records the
        model's output (Schedule with its result, then Update), since the
        checker's model keys that acceptance otherwise than a replay's."""
        sched: SpecScheduler = self.cls(self.config)
        model = self.space.model()
        events: list[Event] = []
        a = self.alphabet
        adds = 0
        worker = (KVWorker(self.config, model, self.kv_bound) if self.kv_on else None)
        replay = _Replay(sched, model, worker)
        record = self.space.acceptance == "prefix" and self.config.num_speculative_tokens > 0
        for i, code in enumerate(codes):
            run = run_last or i < len(codes) - 1
            these: list[Event]
            if worker is not None and (code == STEP or a.is_kv(code)):
                # a step with a connector: the report the code names, those
                # the bounded wait forces (explicit, so that the driver's
                # worker delivers the same), then the step
                world = KVWorld({rid: (ld.load, ld.step) for rid, ld in worker.loads.items()},
                                dict(worker.saves), tuple(worker.queue))
                these = [report_event(a, code, sched.view(), world)] if code != STEP else []
                probe = KVWorker(self.config, None, self.kv_bound)
                probe.loads, probe.saves, probe.queue = worker.loads, worker.saves, list(worker.queue) + these
                these += forced_reports(probe, replay.plans + 1, self.kv_bound)
                these.append(Step())
            elif a.async_scheduling and code == STEP:
                these = [Schedule()] if len(replay.in_flight) < self.depth else [Update()]
            elif a.async_scheduling and code == a.update:
                these = [Update()]
            elif code == STEP:
                these = [Schedule(), Update()] if record else [Step()]
            elif code == RESET or code == RESET_RUNNING:
                these = [ResetPrefixCache(code == RESET_RUNNING)]
            elif a.is_add(code):
                adds += 1
                these = [AddRequest(self.request(a.shape_index(code), adds))]
            elif a.is_step_abort(code):
                these = [Schedule(), Abort(list(sched.view().requests)[a.abort_index(code)]), Update()]
            elif a.is_pause(code):
                _, mode, clear_cache = a.pause_event(code)
                these = [Resume() if mode is None else Pause(mode, clear_cache)]
            elif a.is_session(code):
                these = [SessionInput(sessions.update_for(a, self.shapes, sched.view(), code))]
            elif a.is_grammar(code):
                k, ok = a.grammar_event(code)
                these = [GrammarReady(list(sched.view().requests)[k], ok)]
            else:
                these = [Abort(list(sched.view().requests)[a.abort_index(code)])]
            for event in these:
                if run:
                    result = replay.perform(event)
                    if record and isinstance(event, Schedule) and result is not None:
                        event = Schedule(result)
                events.append(event)
        return Workload(self.config, tuple(events), seed=None)


def throttle_part(s: object, v: SchedulerView) -> Fingerprint:
    """Model Runner V2's decode throttle (spec/runner_v2.py) as a state
    keeps it beyond its view: per unfinished request, by arrival, the
    schedule() calls left before the RUNNING loop takes it again
    (next_decode_eligible_step less the step counter, 0 once eligible),
    read from the reference scheduler's public fields (empty for a
    scheduler without them). The step number itself is left out, as the
    plans' are."""
    requests: Any = getattr(s, "requests", {})
    step: int = getattr(s, "step", 0)
    return tuple(max(0, getattr(requests.get(rid), "next_decode_eligible_step", 0) - step) for rid in v.requests)


def _busy(succ: Successor) -> bool:
    """Whether steps alone must drain the state's requests (the liveness
    bound: with no new arrivals, no pause and every grammar reported): it
    has an unfinished request, is not paused, and not every request it has
    waits for a grammar still compiling. A paused state is left to its
    resume, a compiling grammar to its report; each leads to a state
    checked as any."""
    v = succ.view
    if succ.kv is not None and (v.kv_held_by_finished or succ.kv.loads or succ.kv.saves):
        return True  # blocks held for the connector: the bounded wait's reports free them
    if not v.requests or v.pause_state != PauseState.UNPAUSED:
        return False
    requests: Any = getattr(succ.state, "requests", {})
    return any((r.status is not RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                or getattr(requests.get(rid), "grammar", None) not in (None, GrammarState.COMPILING))
               and not sessions.waits_for_input(r.status) for rid, r in v.requests.items())


def engine_idle(v: SchedulerView, in_flight: int) -> bool:
    """Whether vLLM's engine core would find no work (EngineCore.has_work),
    as the check driver judges it before a pause's cache clear: no plan in
    flight, nothing finished left to report, and no unfinished request as
    Scheduler.get_num_unfinished_requests counts them under the pause state
    (PAUSED_ALL: none; PAUSED_NEW: running ones and waiting ones holding KV
    blocks)."""
    return not in_flight and scheduler_has_no_work(v)



def _execute_plan(model: FakeModel, plan: StepPlan, truth: Any, who: str | None = None) -> StepResult:
    """The fake model executes ``plan`` against ``truth`` (request id -> its
    tokens); a context it reads that is not the request's tokens is a
    kv-context violation (of scheduler ``who`` when named)."""
    result, mismatches = model.run(plan, truth)
    if mismatches:
        m = mismatches[0]
        of = f" of {who}" if who else ""
        raise Finding("violation", f"the model read a context{of} that is not the request's tokens", (
            Violation("kv-context", f"{m.request_id}: position {m.position} holds {m.found}, "
                      f"the request's token there is {m.expected}", m.request_id),))
    return result

def _load_grammars(model: FakeModel, v: SchedulerView) -> None:
    """The model samples each request of ``v`` under its grammar (the check
    driver tells it at add; the checker's model serves many states)."""
    model.grammars = {rid: frozenset(r.spec.grammar_rejects) for rid, r in v.requests.items() if r.spec.grammar_rejects}


def _optional(who: str, sched: Any, method: str) -> Callable[..., Any]:
    """A gate's optional method of the scheduler under test; a Finding
    naming it when the scheduler lacks it."""
    fn = getattr(sched, method, None)
    if not callable(fn):
        raise Finding("error", f"{who} has no {method}() (the optional method of that admission gate)")
    return cast(Callable[..., Any], fn)


class _Replay:
    """Performs a path's events on one scheduler with its own fake model, as
    the check driver does: plans in flight between Schedule and Update, the
    model told each request's grammar at add, and a pause's cache clear once
    the engine is idle."""

    def __init__(self, sched: Scheduler, model: FakeModel, worker: KVWorker | None = None) -> None:
        self.sched = sched
        self.model = model
        self.in_flight: list[tuple[StepPlan, StepResult]] = []
        self.clear = False
        #: the KV connector's worker (sync scheduling), as the check driver runs it
        self.worker = worker
        #: the plans scheduled so far (the next one's step is this + 1)
        self.plans = 0

    def perform(self, event: Event) -> StepResult | None:
        """One event; returns the model's result of a Schedule or Step."""
        sched, model = self.sched, self.model
        result: StepResult | None = None
        worker = self.worker
        if isinstance(event, Step):
            plan = sched.schedule()
            self.plans += 1
            if worker is not None:
                worker.before(plan)
            result, _ = model.run(plan)
            if worker is not None:
                result = worker.after(plan, sched.view(), result)
            sched.update(plan, result)
            if worker is not None:
                worker.updated(plan.step)
        elif isinstance(event, (KVLoadDone, KVLoadFailed, KVSaveDone)):
            if worker is not None:
                worker.post(event)
        elif isinstance(event, Schedule):
            self.plans += 1
            plan = sched.schedule()
            result, _ = model.run(plan)
            self.in_flight.append((plan, result))
        elif isinstance(event, Update):
            sched.update(*self.in_flight.pop(0))
        elif isinstance(event, ResetPrefixCache):
            try:
                sched.reset_prefix_cache(event.reset_running_requests)
            except ProtocolError:
                if worker is None:
                    raise
        elif isinstance(event, AddRequest):
            sched.add(event.request)
            model.set_grammar(event.request.request_id, event.request.grammar_rejects)
            if worker is not None:
                worker.add(event.request.request_id, event.request.prompt_token_ids)
        elif isinstance(event, Abort):
            sched.abort(event.request_id)
        elif isinstance(event, Pause):
            getattr(sched, "set_pause_state")(PauseState.PAUSED_ALL if event.mode == "all" else PauseState.PAUSED_NEW)
            self.clear = self.clear or event.clear_cache
        elif isinstance(event, Resume):
            getattr(sched, "set_pause_state")(PauseState.UNPAUSED)
        elif isinstance(event, GrammarReady):
            getattr(sched, "grammar_ready")(event.request_id, event.ok)
        if self.clear and engine_idle(sched.view(), len(self.in_flight)):
            self.clear = False
            sched.reset_prefix_cache(True)
        return result
