"""An explicit-state model checker over the executable spec, in the manner of TLC.

Breadth-first exploration of every state the reference scheduler can reach from
the empty scheduler under a finite alphabet of events:

- ``add S``: a request of shape S (a fixed, id-free description: prompt, max
  tokens, priority, stop / eos tokens, salt); its id and arrival are assigned
  in arrival order, so an id enters the canonical state only through order;
- ``abort #k``: abort the k-th unfinished request (in arrival order);
- ``step``: ``schedule()``, the deterministic fake model (harness/oracle.py,
  FakeModel, small vocabulary) reading the context back through the plan's
  block tables, ``update()``;
- ``reset`` / ``reset+running``: ``reset_prefix_cache()`` without and with
  ``reset_running_requests``.

Equal states are explored once: a canonical fingerprint covers the scheduler's
whole observable state (every request's shape, status, output, computed
tokens, block table and keyed-block count; the queues; the requests finished
or preempted since the last plan; the KV ref counts, free-queue order, keys
and index order) up to these reductions: request ids are replaced by their
arrival rank, the step counter is dropped, ``num_preemptions`` is kept only as
zero / non-zero, and the PRIORITY waiting list (unordered in the spec) is a
set. docs/modelcheck.md says why these are sound and why renaming block ids
is not.

Checked on every explored transition: every invariant of the catalogue
(evaluated statelessly, see ``_Checker``), the fake model's reads (the context
read through the block tables is the request's tokens) and the KV contents
(every computed slot and every keyed block holds what the state says), and,
unless turned off, ImplScheduler replaying the same transition from the same
state with an equal StepPlan and equal views. Over the whole graph: deadlock
freedom (no state with unfinished requests whose step-only run never drains)
and a liveness bound: with no new arrivals every request finishes within L
steps, where L is the worst case over the reachable graph, reported with its
path.

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from schedspec.invariants import CATALOGUE, History, Invariant, Transition, Violation
from schedspec.invariants.core import TransitionKind
from schedspec.spec.interface import (
    Policy,
    RequestSpec,
    RequestStatus,
    ScheduleKind,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)
from schedspec.spec.kv_cache import KVPool
from schedspec.spec.scheduler import SpecScheduler, _Request
from schedspec.check import trace as tracefile
from schedspec.check.oracle import FakeModel
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Step, Workload

# ---------------------------------------------------------------------------
# What is explored: request shapes, spaces (one config each) and bounds
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A request without an id: what a client sends. ``stop_after`` k > 0 makes
    the k-th token the fake model generates for this prompt a stop token
    (resolved per space, since it depends on the model's seed and vocab)."""

    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_after: int = 0

    def request(self, request_id: str, arrival: int) -> RequestSpec:
        return RequestSpec(
            request_id=request_id,
            prompt_token_ids=self.prompt,
            max_tokens=self.max_tokens,
            priority=self.priority,
            arrival=arrival,
            stop_token_ids=self.stop_token_ids,
            eos_token_id=self.eos_token_id,
            ignore_eos=self.ignore_eos,
            cache_salt=self.cache_salt,
        )

    def describe(self) -> str:
        parts = [f"prompt {list(self.prompt)}", f"max_tokens {self.max_tokens}"]
        if self.priority:
            parts.append(f"priority {self.priority}")
        if self.stop_token_ids:
            parts.append(f"stop {list(self.stop_token_ids)}")
        if self.eos_token_id is not None:
            parts.append(f"eos {self.eos_token_id}" + (" (ignored)" if self.ignore_eos else ""))
        if self.cache_salt:
            parts.append(f"salt {self.cache_salt!r}")
        return f"{self.name}: " + ", ".join(parts)


@dataclass(frozen=True)
class Space:
    """One configuration explored completely: the scheduler config, the
    request shapes, and at most ``max_requests`` requests known to the
    scheduler at a time (unfinished, or finished and not yet reported)."""

    name: str
    config: SchedulerConfig
    shapes: tuple[Shape, ...]
    max_requests: int
    vocab: int = 4
    oracle_seed: int = 0

    def resolved_shapes(self) -> tuple[Shape, ...]:
        """The shapes with ``stop_after`` turned into a concrete stop token."""
        out = []
        for s in self.shapes:
            if s.stop_after > 0:
                toks = generated_tokens(s.prompt, s.stop_after, self.vocab, self.oracle_seed, self.config.block_size)
                s = Shape(s.name, s.prompt, s.max_tokens, s.priority, s.stop_token_ids + (toks[-1],),
                          s.eos_token_id, s.ignore_eos, s.cache_salt, 0)
            out.append(s)
        return tuple(out)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config": self.config.to_dict(),
            "shapes": [s.describe() for s in self.resolved_shapes()],
            "max_requests": self.max_requests,
            "vocab": self.vocab,
            "oracle_seed": self.oracle_seed,
        }


@dataclass(frozen=True)
class Bound:
    name: str
    spaces: tuple[Space, ...]


def generated_tokens(prompt: tuple[int, ...], n: int, vocab: int, seed: int, block_size: int) -> tuple[int, ...]:
    """The first ``n`` tokens the fake model generates for ``prompt`` when the
    scheduler is right (the model then reads back exactly the request's tokens)."""
    model = FakeModel(block_size, vocab, seed)
    toks = list(prompt)
    for _ in range(n):
        toks.append(model.sample_token(tuple(toks)))
    return tuple(toks[len(prompt):])


# Shapes for block size 2 (prompt token ids from a vocabulary of 4):
# A and B share their first block, so one can hit the other's cached block; C
# is A's prompt under a salt (same tokens, another prefix); D is distinct and
# stops on a stop token (its 2nd generated token); E fills exactly one block
# and stops on eos if the model says 0; L is long and of low priority; P is a
# short prompt of high priority (PRIORITY serves the lowest value first and
# preempts the greatest). Generation lengths are small, so requests finish
# within a few steps, yet two requests of A and B outgrow a pool of 4 blocks
# and preempt each other.
_A = Shape("A", (1, 2, 3), 3)
_A2 = Shape("A", (1, 2, 3), 2)
_B = Shape("B", (1, 2, 0, 3), 2, priority=1)
_C = Shape("C", (1, 2, 3), 2, cache_salt="s")
_D = Shape("D", (3,), 3, stop_after=2)
_Dlow = Shape("D", (3,), 3, priority=1, stop_after=2)
_E = Shape("E", (2, 1), 2, eos_token_id=0)
_L = Shape("L", (1, 2, 3, 0, 1), 2, priority=2)
_P = Shape("P", (1, 2), 3)

#: The common config: blocks of 2 tokens, 4 usable blocks (one request of
#: max_model_len 8 fits), 4 tokens per step, 2 running requests.
_BASE: dict[str, Any] = dict(block_size=2, num_blocks=5, max_num_batched_tokens=4, max_num_seqs=2, max_model_len=8)


def _space(name: str, shapes: tuple[Shape, ...], max_requests: int, **overrides: Any) -> Space:
    return Space(name, SchedulerConfig(**{**_BASE, **overrides}), shapes, max_requests)


def _small() -> Bound:
    # A pool of 3 usable blocks (6 tokens) and 3 tokens per step: two requests
    # preempt each other, chunk their prefills and hit each other's prefix.
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    return Bound("small", (
        _space("fcfs-cache-tight", (_A, _B), 2, **tight),
        _space("priority-cache-tight", (_A, _B), 2, policy=Policy.PRIORITY, **tight),
        _space("priority-nocache-threshold", (_A, _Dlow), 2, policy=Policy.PRIORITY,
               enable_prefix_caching=False, long_prefill_token_threshold=2),
        _space("fcfs-cache-salt-tight", (_A2, _C), 2, **tight),
    ))


def _medium() -> Bound:
    return Bound("medium", (
        *_small().spaces,
        _space("fcfs-cache", (_A, _B), 2),
        _space("fcfs-cache-stop", (_A, _B, _D), 2),
        _space("priority-cache", (_B, _P), 2, policy=Policy.PRIORITY),
        _space("priority-cache-long", (_A, _L), 2, policy=Policy.PRIORITY),
        _space("fcfs-cache-nochunk", (_A, _B), 2, enable_chunked_prefill=False, max_num_batched_tokens=8),
        _space("fcfs-cache-threshold-noreserve", (_A, _B), 2, long_prefill_token_threshold=2,
               scheduler_reserve_full_isl=False),
        _space("fcfs-cache-eos", (_A2, _E), 2),
    ))


def _large() -> Bound:
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    return Bound("large", (
        *_medium().spaces,
        _space("fcfs-cache-3req", (_A, _B), 3),
        _space("priority-cache-3req", (_B, _P), 3, policy=Policy.PRIORITY),
        _space("fcfs-cache-tight-3seqs", (_A, _B), 3, max_num_seqs=3, **tight),
        _space("priority-nocache-threshold-3req", (_A, _Dlow), 3, policy=Policy.PRIORITY,
               enable_prefix_caching=False, long_prefill_token_threshold=2),
    ))


BOUNDS: dict[str, Callable[[], Bound]] = {"small": _small, "medium": _medium, "large": _large}


def bound(name: str) -> Bound:
    try:
        return BOUNDS[name]()
    except KeyError:
        raise ValueError(f"unknown bound {name!r} (expected one of {', '.join(BOUNDS)})") from None


# ---------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------

STEP, RESET, RESET_RUNNING = 0, 1, 2
_FIRST_ADD = 3


class Alphabet:
    """Event codes: 0 step, 1 reset, 2 reset+running, 3.. add shape i, then
    abort of the k-th unfinished request."""

    def __init__(self, shapes: Sequence[Shape], max_requests: int) -> None:
        self.shapes = tuple(shapes)
        self.first_abort = _FIRST_ADD + len(self.shapes)
        self.size = self.first_abort + max_requests

    def add(self, i: int) -> int:
        return _FIRST_ADD + i

    def abort(self, k: int) -> int:
        return self.first_abort + k

    def label(self, code: int) -> str:
        if code == STEP:
            return "step"
        if code == RESET:
            return "reset"
        if code == RESET_RUNNING:
            return "reset+running"
        if code < self.first_abort:
            return f"add {self.shapes[code - _FIRST_ADD].name}"
        return f"abort #{code - self.first_abort}"


# ---------------------------------------------------------------------------
# Cloning and fingerprints of the spec's state
# ---------------------------------------------------------------------------

_new = object.__new__
_PROTO = pickle.HIGHEST_PROTOCOL


def clone_spec(s: SpecScheduler) -> SpecScheduler:
    """A copy of a SpecScheduler (or a subclass that adds no mutable state of
    its own) that shares only immutable values: the spec's plain lists and
    dicts are copied by hand, several times faster than ``copy.deepcopy``."""
    new: SpecScheduler = _new(type(s))
    d = new.__dict__
    d.update(s.__dict__)
    kv = s.kv
    nkv: KVPool = _new(type(kv))
    kd = nkv.__dict__
    kd.update(kv.__dict__)
    kd["ref_cnt"] = kv.ref_cnt[:]
    kd["free_queue"] = kv.free_queue[:]
    kd["block_key"] = kv.block_key.copy()
    kd["index"] = {k: v[:] for k, v in kv.index.items()}
    d["kv"] = nkv
    reqs = {}
    for rid, r in s.requests.items():
        nr: _Request = _new(_Request)
        rd = nr.__dict__
        rd.update(r.__dict__)
        rd["output"] = r.output[:]
        rd["blocks"] = r.blocks[:]
        reqs[rid] = nr
    d["requests"] = reqs
    d["waiting"] = s.waiting[:]
    d["running"] = s.running[:]
    d["finished"] = s.finished.copy()
    d["preempted"] = s.preempted.copy()
    return new


#: A canonical fingerprint: a nested tuple of ints, strings and None.
Fingerprint = tuple[Any, ...]


class Canon:
    """Computes canonical fingerprints. Request ids are replaced by their
    arrival rank among the requests the state knows (unfinished, and finished
    since the last plan). The checker gives the k-th request of a path, of
    shape i, the id ``r{k}`` and the arrival ``k * len(shapes) + i``, so the
    arrival orders requests as their ids do and also names the shape."""

    def __init__(self, num_shapes: int, priority: bool) -> None:
        self.num_shapes = num_shapes
        self.priority = priority

    def fingerprint(self, s: SpecScheduler) -> Fingerprint:
        reqs = s.requests
        fin = s.finished
        ns = self.num_shapes
        rows: list[Any] = []
        if fin:
            known: list[tuple[int, str]] = [(r.spec.arrival, rid) for rid, r in reqs.items()]
            known += [(v.arrival, rid) for rid, v in fin.items()]
            known.sort()
            ids = [rid for _, rid in known]
        else:
            ids = list(reqs)  # insertion order is arrival order
        rank = {rid: i for i, rid in enumerate(ids)}
        for rid in ids:
            r = reqs.get(rid)
            if r is not None:
                rows.append((r.spec.arrival % ns, r.status._value_, tuple(r.output), r.num_computed,
                             tuple(r.blocks), r.num_cached_blocks, r.num_preemptions > 0))
            else:
                v = fin[rid]
                rows.append((v.arrival % ns, v.status._value_, v.output_token_ids, v.num_computed_tokens,
                             v.block_ids, -1, v.num_preemptions > 0))
        if self.priority:
            # The PRIORITY waiting list is unordered (the head is the least
            # key); only the service order is observable.
            waiting = tuple(sorted([rank[r] for r in s.waiting]))
        else:
            waiting = tuple([rank[r] for r in s.waiting])
        kv = s.kv
        keys = kv.block_key
        if keys:
            key_part: Any = tuple(sorted(keys.items()))
            multi: Any = tuple(sorted([tuple(v) for v in kv.index.values() if len(v) > 1]))
        else:
            key_part = multi = ()
        return (
            tuple(rows),
            waiting,
            tuple([rank[r] for r in s.running]),
            tuple(sorted([rank[r] for r in s.preempted])) if s.preempted else (),
            tuple(kv.ref_cnt),
            tuple(kv.free_queue),
            key_part,
            multi,
        )


def expected_memory(s: SpecScheduler) -> dict[int, int]:
    """What the KV slots hold if the state tells the truth: every computed
    position of an unfinished request holds its token, every keyed block
    holds the last block of its key's tokens."""
    bs = s.kv.block_size
    mem: dict[int, int] = {}
    for b, (_, toks) in s.kv.block_key.items():
        base = b * bs
        tail = toks[len(toks) - bs:]
        for off in range(len(tail)):
            mem[base + off] = tail[off]
    for r in s.requests.values():
        n = r.num_computed
        if not n:
            continue
        toks = r.spec.prompt_token_ids + tuple(r.output)
        blocks = r.blocks
        for pos in range(min(n, len(blocks) * bs, len(toks))):
            mem[blocks[pos // bs] * bs + pos % bs] = toks[pos]
    return mem


class _MemoModel(FakeModel):
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


# ---------------------------------------------------------------------------
# Stateless invariant checks
# ---------------------------------------------------------------------------


class _Checker:
    """Runs the catalogue on one transition at a time, with no memory of the
    path that led there (the model checker reaches a state by many paths).

    A Monitor keeps a History for two invariants. ``output-append-only`` reads
    it only for requests absent from ``t.before`` (none here: every transition
    starts from a full view). ``finished-reported-once`` reads the ids
    reported by earlier plans; a plan that reports an id not in
    ``before.finished`` already fails its other clause, so an empty History
    loses nothing. State invariants run once per canonical state (they read
    ``t.after`` only, and the reductions keep every such verdict)."""

    def __init__(self, invariants: Sequence[Invariant]) -> None:
        self._history = History()
        self.state = tuple(inv for inv in invariants if inv.scope == "state")
        kinds: tuple[TransitionKind, ...] = ("add", "abort", "schedule", "update", "reset")
        self.by_kind: dict[str, tuple[Invariant, ...]] = {
            k: tuple(inv for inv in invariants if inv.scope == "transition" and k in inv.kinds) for k in kinds
        }

    def check_state(self, view: SchedulerView) -> list[Violation]:
        """The state invariants of one view (as the "after" of a no-op)."""
        return self.check(Transition("reset", view, view), True, transition=False)

    def check(self, t: Transition, state_too: bool, transition: bool = True) -> list[Violation]:
        invs = self.by_kind[t.kind] if transition else ()
        if state_too:
            invs = invs + self.state
        # The invariants only read the History, and here it is always empty:
        # one shared instance. The fast pass collects every finding in one
        # comprehension; if any check raises, the slow pass below reruns them
        # one by one so that the exception is reported under its invariant.
        h = self._history
        try:
            return [Violation(inv.id, msg, rid) for inv in invs for rid, msg in inv.check_fn(t, h)]
        except Exception:
            pass
        out: list[Violation] = []
        for inv in invs:
            try:
                found = inv.check_fn(t, h)
                for rid, msg in found:
                    out.append(Violation(inv.id, msg, rid))
            except Exception as exc:  # a malformed view must not crash the checker
                out.append(Violation(inv.id, f"could not check the {t.kind} transition: {type(exc).__name__}: {exc}"))
        return out


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Counterexample:
    kind: str  # "violation" | "divergence" | "deadlock" | "error"
    message: str
    violations: tuple[Violation, ...]
    labels: tuple[str, ...]  # the events, as the checker names them
    workload: Workload  # the same events with concrete requests, ready for a trace
    vocab: int
    oracle_seed: int

    def describe(self) -> str:
        lines = [f"{self.kind}: {self.message}"]
        lines += [f"  [{v.invariant_id}]" + (f" {v.request_id}:" if v.request_id else "") + f" {v.message}"
                  for v in self.violations]
        lines.append(f"  shortest path ({len(self.labels)} events): " + ", ".join(self.labels))
        return "\n".join(lines)

    def write_trace(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tracefile.write(path, tracefile.Trace(self.workload, vocab=self.vocab, oracle_seed=self.oracle_seed))
        return path


@dataclass
class SpaceResult:
    space: Space
    states: int = 0
    transitions: int = 0
    depth: int = 0
    elapsed: float = 0.0
    impl_transitions: int = 0  # transitions the impl replayed and matched
    liveness_bound: int | None = None  # steps to drain, worst case over the graph
    liveness_labels: tuple[str, ...] = ()  # path to the worst state, then its steps
    liveness_workload: Workload | None = None
    failure: Counterexample | None = None
    complete: bool = False  # the whole space was explored (no failure, no state cap)
    coverage: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0  # CPU time of this process and its workers

    @property
    def states_per_s(self) -> float:
        return self.states / self.elapsed if self.elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "space": self.space.describe(),
            "states": self.states,
            "transitions": self.transitions,
            "depth": self.depth,
            "elapsed_s": round(self.elapsed, 3),
            "states_per_s": round(self.states_per_s, 1),
            "impl_transitions": self.impl_transitions,
            "complete": self.complete,
            "liveness_bound": self.liveness_bound,
            "liveness_path": list(self.liveness_labels),
            "coverage": self.coverage,
            "cpu_s": round(self.cpu_s, 3),
            "failure": None if self.failure is None else {
                "kind": self.failure.kind,
                "message": self.failure.message,
                "violations": [{"id": v.invariant_id, "message": v.message, "request_id": v.request_id}
                               for v in self.failure.violations],
                "path": list(self.failure.labels),
            },
        }


@dataclass
class BoundResult:
    bound: str
    spaces: list[SpaceResult] = field(default_factory=list)

    @property
    def failure(self) -> Counterexample | None:
        for r in self.spaces:
            if r.failure is not None:
                return r.failure
        return None

    @property
    def states(self) -> int:
        return sum(r.states for r in self.spaces)

    @property
    def transitions(self) -> int:
        return sum(r.transitions for r in self.spaces)

    @property
    def elapsed(self) -> float:
        return sum(r.elapsed for r in self.spaces)

    def as_dict(self) -> dict[str, Any]:
        bounds = [r.liveness_bound for r in self.spaces if r.liveness_bound is not None]
        cpu = sum(r.cpu_s for r in self.spaces)
        return {
            "bound": self.bound,
            "result": "fail" if self.failure is not None else "pass",
            "states": self.states,
            "transitions": self.transitions,
            "depth": max((r.depth for r in self.spaces), default=0),
            "elapsed_s": round(self.elapsed, 3),
            "states_per_s": round(self.states / self.elapsed, 1) if self.elapsed > 0 else None,
            "cpu_s": round(cpu, 3),
            "states_per_cpu_s": round(self.states / cpu, 1) if cpu > 0 else None,
            "liveness_bound": max(bounds) if bounds else None,
            "spaces": [r.as_dict() for r in self.spaces],
        }


# ---------------------------------------------------------------------------
# The explorer
# ---------------------------------------------------------------------------


_NO_VIEW: Any = None  # stands for the views nobody reads when the search runs blind


class _Found(Exception):
    def __init__(self, kind: str, message: str, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.violations = tuple(violations)

    def __reduce__(self) -> tuple[Any, ...]:  # travels from the worker processes
        return (_Found, (self.kind, self.message, self.violations))


@dataclass(slots=True)
class _Entry:
    """A state waiting to be expanded. ``state`` is the SpecScheduler and
    ``impl`` the ImplScheduler in the same state (None without the
    differential), both pickled when states travel between processes, and
    both None in a worker's result for a state that worker already sent
    (the main process has it); ``adds`` how many requests the path to it added
    (the next one is ``r{adds + 1}``)."""

    idx: int
    state: Any
    impl: Any
    adds: int

    def __reduce__(self) -> tuple[Any, ...]:  # compact between processes
        return (_Entry, (self.idx, self.state, self.impl, self.adds))


@dataclass(slots=True)
class _Expansion:
    idx: int
    #: (event code, fingerprint, successor entry with idx -1, has unfinished requests)
    successors: list[tuple[int, Fingerprint, _Entry, bool]]
    #: the first failure: (event code or -1 for the state itself, what was found)
    failure: tuple[int, _Found] | None = None
    #: how many of these transitions showed each COVERAGE item
    coverage: list[int] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Expansion, (self.idx, self.successors, self.failure, self.coverage))


#: What the explored transitions exercised (counted once per transition).
COVERAGE = (
    "steps that preempt",
    "admissions with a prefix-cache hit",
    "partial prefill chunks",
    "resumed admissions",
    "requests stopped by a stop token or eos",
    "requests length-capped",
    "resets that dropped the cache",
    "resets that preempted running requests",
    "aborts of running requests",
)


class Expander:
    """Expands one state: checks it, applies every enabled event to a copy
    with every check on, returns the successors with their fingerprints.

    ``scheduler_cls`` is the scheduler explored: SpecScheduler or a subclass
    that keeps its state in the spec's fields (the tests use a broken one).
    ``impl_cls`` (built as ``impl_cls(config)``) is the scheduler replayed on
    every transition and compared with it (None: no differential). ``pickled``: successors are
    returned pickled, to travel to another process."""

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
        self.checker = _Checker(invariants)
        self.canon = Canon(len(self.shapes), space.config.policy == Policy.PRIORITY)
        self.model = _MemoModel(space.config.block_size, space.vocab, space.oracle_seed)
        self.pickled = pickled
        self._cov: list[int] = [0] * len(COVERAGE)
        #: no invariants and no differential: skip the views (to measure the search alone)
        self.blind = not invariants and impl_cls is None
        #: fingerprints of the successors this (worker) process already sent
        self.shipped: set[Fingerprint] = set()

    def request(self, shape_index: int, k: int) -> RequestSpec:
        """The k-th request of a path (1-based), of the given shape."""
        return self.shapes[shape_index].request(f"r{k}", k * len(self.shapes) + shape_index)

    def root(self) -> _Entry:
        s = self.cls(self.config)
        impl: Any = None
        if self.impl_cls is not None:
            impl = self.impl_cls(self.config)
        if self.pickled:
            return _Entry(0, pickle.dumps(s, _PROTO), pickle.dumps(impl, _PROTO), 0)
        return _Entry(0, s, impl, 0)

    def enabled(self, s: SpecScheduler) -> list[int]:
        a = self.alphabet
        codes = [STEP, RESET, RESET_RUNNING]
        if len(s.requests) + len(s.finished) < self.space.max_requests:
            codes += [a.add(i) for i in range(len(self.shapes))]
        codes += [a.abort(k) for k in range(len(s.requests))]
        return codes

    # -------------------------------------------------------------- checks

    def _observe(self, kind: TransitionKind, before: SchedulerView, sched: SpecScheduler, state_too: bool,
                 **kw: Any) -> SchedulerView:
        if self.blind:
            return before
        after = sched.view()
        found = self.checker.check(Transition(kind=kind, before=before, after=after, **kw), state_too)
        if found:
            raise _Found("violation", f"{len(found)} invariant violation(s) after {kind}", found)
        return after

    @staticmethod
    def _compare(what: str, ours: object, theirs: object) -> None:
        if ours != theirs:
            from schedspec.check.driver import describe_difference

            raise _Found("divergence", describe_difference(what, "spec", ours, "impl", theirs))

    # -------------------------------------------------------------- one state

    def expand(self, entry: _Entry) -> _Expansion:
        s: SpecScheduler = pickle.loads(entry.state) if self.pickled else entry.state
        out = _Expansion(entry.idx, [], None, [0] * len(COVERAGE))
        self._cov = out.coverage
        try:
            before = s.view() if not self.blind else _NO_VIEW
            found = self.checker.check_state(before) if not self.blind else []
            if found:
                raise _Found("violation", f"{len(found)} invariant violation(s) in a reachable state", found)
        except _Found as f:
            out.failure = (-1, f)
            return out
        except Exception as exc:  # the scheduler crashed: a finding
            out.failure = (-1, _Found("error", f"{type(exc).__name__}: {exc}"))
            return out
        memory = expected_memory(s)
        use_impl = self.impl_cls is not None
        # Each transition replays on its own copy of the impl: its clone()
        # if it has one (a scheduler knows how to copy itself fastest),
        # else a pickle round trip.
        impl_blob = b""
        own: Any = None
        if use_impl:
            if self.pickled:
                impl_blob = entry.impl
            else:
                own = entry.impl
                if not callable(getattr(own, "clone", None)):
                    impl_blob = pickle.dumps(own, _PROTO)
        shipped = self.shipped
        codes = self.enabled(s)
        last = codes[-1]
        for code in codes:
            impl: Any = None
            if use_impl:
                if own is not None and code == last:
                    impl = own  # in-process, the last transition consumes the entry's own copy
                elif impl_blob:
                    impl = pickle.loads(impl_blob)
                else:
                    impl = own.clone()
            try:
                s2, fp, adds = self.apply(s, code, before, memory, entry.adds, impl)
            except _Found as f:
                out.failure = (code, f)
                return out
            except Exception as exc:  # the scheduler crashed: a finding
                out.failure = (code, _Found("error", f"{type(exc).__name__}: {exc}"))
                return out
            if not self.pickled:
                succ = _Entry(-1, s2, impl, adds)
            elif fp in shipped:
                succ = _Entry(-1, None, None, adds)
            else:
                shipped.add(fp)
                succ = _Entry(-1, pickle.dumps(s2, _PROTO), pickle.dumps(impl, _PROTO) if use_impl else None, adds)
            out.successors.append((code, fp, succ, bool(s2.requests)))
        return out

    def apply(
        self,
        s: SpecScheduler,
        code: int,
        before: SchedulerView,
        memory: dict[int, int],
        adds: int,
        impl: Any = None,
    ) -> tuple[SpecScheduler, Fingerprint, int]:
        """Apply one event to a copy of ``s`` with every transition check on;
        returns the successor, its fingerprint and its count of adds. Raises
        _Found on a failed check. (The successor's own state invariants are
        checked when it is expanded, once per distinct state.)"""
        s2 = clone_spec(s)
        a = self.alphabet
        if code == STEP:
            plan = s2.schedule()
            # The state in the middle of a step is not explored on its own:
            # check its state invariants here.
            mid = self._observe("schedule", before, s2, True, plan=plan)
            if impl is not None:
                self._compare("schedule()", plan, impl.schedule())
                self._compare("view()", mid, impl.view())
            model = self.model
            model.slots = dict(memory)
            truth = {rid: r.spec.prompt_token_ids + tuple(r.output) for rid, r in s.requests.items()}
            result, mismatches = model.run(plan, truth)
            if mismatches:
                m = mismatches[0]
                raise _Found("violation", "the model read a context that is not the request's tokens", (
                    Violation("kv-context", f"{m.request_id}: position {m.position} holds {m.found}, "
                              f"the request's token there is {m.expected}", m.request_id),))
            s2.update(plan, result)
            cov = self._cov
            if plan.scheduled:
                for e in plan.scheduled:
                    if e.kind is not ScheduleKind.RUNNING:
                        if e.num_computed_tokens > 0:
                            cov[1] += 1
                        if e.kind is ScheduleKind.RESUMED:
                            cov[3] += 1
                    if not e.samples:
                        cov[2] += 1
                if len(plan.preempted_ids) > len(s.preempted):
                    cov[0] += 1
                for rid, v in s2.finished.items():
                    if v.status is RequestStatus.FINISHED_STOPPED:
                        cov[4] += 1
                    elif v.status is RequestStatus.FINISHED_LENGTH_CAPPED:
                        cov[5] += 1
            after = self._observe("update", mid, s2, False, plan=plan, result=result)
            slots = model.slots
            for slot, tok in expected_memory(s2).items():
                got = slots.get(slot)
                if got != tok:
                    b, off = divmod(slot, self.config.block_size)
                    raise _Found("violation", "the KV contents are not what the state says", (
                        Violation("kv-contents", f"block {b} offset {off} holds {got}, the state says {tok}"),))
            if impl is not None:
                impl.update(plan, result)
                self._compare("view()", after, impl.view())
            return s2, self.canon.fingerprint(s2), adds
        kind: TransitionKind
        kw: dict[str, Any] = {}
        if code == RESET or code == RESET_RUNNING:
            kind = "reset"
            ok = s2.reset_prefix_cache(code == RESET_RUNNING)
            if ok and s.kv.block_key:
                self._cov[6] += 1
            if code == RESET_RUNNING and s.running:
                self._cov[7] += 1
            if impl is not None:
                self._compare("reset_prefix_cache()", ok, impl.reset_prefix_cache(code == RESET_RUNNING))
        elif code < a.first_abort:
            kind = "add"
            adds += 1
            req = self.request(code - _FIRST_ADD, adds)
            s2.add(req)
            kw["request"] = req
            if impl is not None:
                impl.add(req)
        else:
            kind = "abort"
            rid = list(s2.requests)[code - a.first_abort]
            if s.requests[rid].status is RequestStatus.RUNNING:
                self._cov[8] += 1
            s2.abort(rid)
            kw["request_id"] = rid
            if impl is not None:
                impl.abort(rid)
        after = self._observe(kind, before, s2, False, **kw)
        if impl is not None:
            self._compare("view()", after, impl.view())
        return s2, self.canon.fingerprint(s2), adds

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
            if code == STEP:
                events.append(Step())
                if run:
                    plan = sched.schedule()
                    result, _ = model.run(plan)
                    sched.update(plan, result)
            elif code == RESET or code == RESET_RUNNING:
                events.append(ResetPrefixCache(code == RESET_RUNNING))
                if run:
                    sched.reset_prefix_cache(code == RESET_RUNNING)
            elif code < a.first_abort:
                adds += 1
                req = self.request(code - _FIRST_ADD, adds)
                events.append(AddRequest(req))
                if run:
                    sched.add(req)
            else:
                rid = list(sched.requests)[code - a.first_abort]
                events.append(Abort(rid))
                if run:
                    sched.abort(rid)
        return Workload(self.config, tuple(events), seed=None)


# Worker processes: one Expander each, built once.
_WORKER: Expander | None = None


def _worker_init(space: Space, cls: type[SpecScheduler], impl_cls: Callable[[SchedulerConfig], Scheduler] | None,
                 invariants: Sequence[Invariant]) -> None:
    global _WORKER
    _WORKER = Expander(space, cls, impl_cls, invariants, pickled=True)


def _worker_expand(entry: _Entry) -> _Expansion:
    assert _WORKER is not None
    return _WORKER.expand(entry)


def _cpu_time() -> float:
    """CPU seconds of this process and of its finished children (the workers)."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Explorer:
    """Explores one Space breadth-first, level by level, from the empty
    scheduler; ``workers`` > 1 expands each level in that many processes
    (fork), merging their results in order, so state numbering, counts and
    counterexamples do not depend on it."""

    def __init__(
        self,
        space: Space,
        *,
        scheduler_cls: type[SpecScheduler] = SpecScheduler,
        impl_cls: Callable[[SchedulerConfig], Scheduler] | None = None,
        invariants: Sequence[Invariant] = CATALOGUE,
        max_states: int | None = None,
        workers: int = 1,
        progress: Callable[[SpaceResult, int], None] | None = None,
    ) -> None:
        self.space = space
        self.cls = scheduler_cls
        self.impl_cls = impl_cls
        self.invariants = tuple(invariants)
        self.max_states = max_states
        self.workers = max(1, workers)
        self.progress = progress
        self.expander = Expander(space, scheduler_cls, impl_cls, invariants,
                                 pickled=self.workers > 1)
        self.alphabet = self.expander.alphabet
        self.parent: list[int] = [-1]
        self.via: list[int] = [-1]

    def run(self) -> SpaceResult:
        res = SpaceResult(self.space)
        start = time.perf_counter()
        cpu0 = _cpu_time()
        ex = self.expander
        root = ex.root()
        s0: SpecScheduler = pickle.loads(root.state) if ex.pickled else root.state
        seen: dict[Fingerprint, int] = {ex.canon.fingerprint(s0): 0}
        parent, via = self.parent, self.via
        step_succ: list[int] = [-1]
        busy = bytearray(b"\x00")
        depth_of = [0]
        level: list[_Entry] = [root]
        transitions = 0
        best: tuple[int, int, int, _Found] | None = None  # (path length, idx, code, found)
        capped = False
        coverage = [0] * len(COVERAGE)
        pool: Any = None
        if self.workers > 1:
            import multiprocessing

            pool = multiprocessing.get_context("fork").Pool(
                self.workers, _worker_init, (self.space, self.cls, self.impl_cls, self.invariants))
        try:
            depth = 0
            while level and best is None and not capped:
                nxt: list[_Entry] = []
                results: Iterator[_Expansion]
                if pool is not None:
                    chunk = max(1, min(64, len(level) // (self.workers * 8)))
                    results = pool.imap(_worker_expand, level, chunk)
                else:
                    results = map(ex.expand, level)
                for r in results:
                    idx = r.idx
                    for i, c in enumerate(r.coverage):
                        coverage[i] += c
                    if r.failure is not None:
                        code, f = r.failure
                        length = depth_of[idx] + (0 if code < 0 else 1)
                        if best is None or length < best[0]:
                            best = (length, idx, code, f)
                        continue
                    if best is not None:
                        continue  # finish the level only to look for a shorter failure
                    for code, fp, succ, has_requests in r.successors:
                        transitions += 1
                        j = seen.get(fp)
                        if j is None:
                            j = len(parent)
                            seen[fp] = j
                            parent.append(idx)
                            via.append(code)
                            step_succ.append(-1)
                            busy.append(has_requests)
                            depth_of.append(depth + 1)
                            assert succ.state is not None, "a worker withheld a state the main process lacks"
                            succ.idx = j
                            nxt.append(succ)
                        if code == STEP:
                            step_succ[idx] = j
                    if self.max_states is not None and len(parent) >= self.max_states:
                        capped = True
                        break
                if nxt and best is None:
                    depth += 1
                level = nxt
                res.states, res.transitions, res.depth = len(parent), transitions, depth
                res.elapsed = time.perf_counter() - start
                if self.progress is not None:
                    self.progress(res, len(level))
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        res.elapsed = time.perf_counter() - start
        res.cpu_s = _cpu_time() - cpu0
        res.states, res.transitions = len(parent), transitions
        res.impl_transitions = transitions if self.impl_cls is not None else 0
        res.coverage = dict(zip(COVERAGE, coverage))
        if best is not None:
            _, idx, code, f = best
            codes = self.path(idx) + ([code] if code >= 0 else [])
            res.failure = self.counterexample(f.kind, f.message, f.violations, codes)
            return res
        if capped:
            return res
        self._liveness(res, step_succ, busy, depth_of)
        res.complete = res.failure is None
        return res

    # -------------------------------------------------------------- liveness

    def _liveness(self, res: SpaceResult, succ: list[int], busy: bytearray, depth_of: list[int]) -> None:
        """Steps to drain from every state, on the functional graph of the step
        event: dist = 0 without unfinished requests, else 1 + dist(step
        successor). A step-only run that cycles through states with
        unfinished requests never finishes them: a deadlock (or livelock)."""
        n = len(succ)
        dist = [0 if not busy[i] else -1 for i in range(n)]  # -1 unknown, -2 on the path, -3 never drains
        stuck = False
        for i in range(n):
            if dist[i] != -1:
                continue
            path: list[int] = []
            j = i
            while dist[j] == -1:
                dist[j] = -2
                path.append(j)
                j = succ[j]
            d = dist[j]
            if d == -2 or d == -3:  # a cycle of busy states, or the way into one
                stuck = True
                for k in path:
                    dist[k] = -3
                continue
            for k in reversed(path):
                d += 1
                dist[k] = d
        if stuck:
            # The shallowest state that cannot drain, then its steps once around the cycle.
            start = min((i for i in range(n) if dist[i] == -3), key=lambda i: (depth_of[i], i))
            codes = self.path(start)
            on_run: list[int] = []
            j = start
            while j not in on_run:
                on_run.append(j)
                codes.append(STEP)
                j = succ[j]
            cycle = len(on_run) - on_run.index(j)
            res.failure = self.counterexample(
                "deadlock",
                f"from a state with unfinished requests (depth {depth_of[start]}) steps alone never finish "
                f"them: the step-only run enters a cycle of {cycle} state(s)",
                (), codes)
            return
        worst = max(range(n), key=lambda i: (dist[i], -i))
        res.liveness_bound = dist[worst]
        codes = self.path(worst) + [STEP] * dist[worst]
        res.liveness_labels = tuple(self.alphabet.label(c) for c in codes)
        res.liveness_workload = self.expander.workload(codes)

    # -------------------------------------------------------------- paths

    def path(self, idx: int) -> list[int]:
        codes: list[int] = []
        while idx > 0:
            codes.append(self.via[idx])
            idx = self.parent[idx]
        codes.reverse()
        return codes

    def counterexample(self, kind: str, message: str, violations: Sequence[Violation],
                       codes: list[int]) -> Counterexample:
        wl = self.expander.workload(codes, run_last=kind == "deadlock")
        return Counterexample(kind, message, tuple(violations), tuple(self.alphabet.label(c) for c in codes), wl,
                              self.space.vocab, self.space.oracle_seed)


# ---------------------------------------------------------------------------
# Running bounds
# ---------------------------------------------------------------------------


def impl_available() -> bool:
    try:
        from schedspec import impl

        return hasattr(impl, "ImplScheduler")
    except ImportError:
        return False


def impl_class() -> Callable[[SchedulerConfig], Scheduler]:
    """impl.ImplScheduler (a class: it travels to worker processes by name)."""
    from schedspec.impl import ImplScheduler

    cls: Callable[[SchedulerConfig], Scheduler] = ImplScheduler
    return cls


def check_bound(
    name: str,
    *,
    use_impl: bool = True,
    scheduler_cls: type[SpecScheduler] = SpecScheduler,
    max_states: int | None = None,
    log: TextIO | None = None,
    spaces: Sequence[str] | None = None,
    workers: int = 1,
    invariants: Sequence[Invariant] = CATALOGUE,
) -> BoundResult:
    """Explore every space of a bound in turn; stop at the first failure."""
    b = bound(name)
    out = BoundResult(name)
    for space in b.spaces:
        if spaces is not None and space.name not in spaces:
            continue
        progress = _progress_printer(log, space.name) if log is not None else None
        r = Explorer(space, scheduler_cls=scheduler_cls, impl_cls=impl_class() if use_impl else None,
                     invariants=invariants,
                     max_states=max_states, workers=workers, progress=progress).run()
        out.spaces.append(r)
        if log is not None:
            log.write(format_row(r) + "\n")
            log.flush()
        if r.failure is not None:
            break
    return out


def _progress_printer(log: TextIO, name: str) -> Callable[[SpaceResult, int], None]:
    last = [time.monotonic()]

    def show(r: SpaceResult, frontier: int) -> None:
        now = time.monotonic()
        if now - last[0] < 5.0:
            return
        last[0] = now
        log.write(f"  {name}: depth {r.depth}, {r.states:,} states, {r.transitions:,} transitions, "
                  f"frontier {frontier:,}\n")
        log.flush()

    return show


def format_row(r: SpaceResult) -> str:
    live = "-" if r.liveness_bound is None else str(r.liveness_bound)
    status = "FAIL" if r.failure is not None else ("ok" if r.complete else "partial")
    per_cpu = r.states / r.cpu_s if r.cpu_s > 0 else 0.0
    return (f"{r.space.name:34s} {r.states:>10,} {r.transitions:>11,} {r.depth:>6} {r.elapsed:>9.1f}s "
            f"{r.states_per_s:>10,.0f} {r.cpu_s:>8.1f}s {per_cpu:>10,.0f} {live:>9}  {status}")


def table_header() -> str:
    return (f"{'space':34s} {'states':>10} {'transitions':>11} {'depth':>6} {'time':>10} "
            f"{'states/s':>10} {'cpu':>9} {'states/cpu-s':>10} {'liveness':>9}  result")


def write_json(path: Path, result: BoundResult, extra: dict[str, Any] | None = None) -> None:
    data = result.as_dict()
    if extra:
        data.update(extra)
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------------------
# The `schedspec modelcheck` command
# ---------------------------------------------------------------------------



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bound", default="small", choices=sorted(BOUNDS),
                   help="which spaces to explore (docs/modelcheck.md; default small)")
    p.add_argument("--json", default=None, help="write a JSON summary here")
    p.add_argument("--no-impl", action="store_true", help="skip the ImplScheduler differential")
    p.add_argument("--out", default="schedspec-out/modelcheck", help="where a counterexample trace goes")
    p.add_argument("--workers", default=None, help="processes expanding states (default: the CPUs available)")
    p.add_argument("--space", action="append", default=None, help="explore only this space (repeatable)")
    p.add_argument("--max-states", default=None, help="stop each space after this many states (partial)")
    p.add_argument("--scheduler", default=None, metavar="MODULE:CLASS",
                   help="explore this SpecScheduler subclass instead of the spec (e.g. a patched spec)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def default_workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def _scheduler_class(text: str | None) -> type[SpecScheduler]:
    if text is None:
        return SpecScheduler
    from schedspec.adapters.registry import import_class
    from schedspec.cli.main import UsageError

    cls = import_class(text, "--scheduler")
    if not issubclass(cls, SpecScheduler):
        raise UsageError(f"--scheduler: {text!r} is not a subclass of spec.scheduler.SpecScheduler "
                         "(the model checker copies the spec's fields)")
    return cls


def run_command(args: argparse.Namespace) -> int:
    """`schedspec modelcheck`: 0 everything held over the whole bound, 1 a
    failure (its shortest counterexample is written as a trace), 2 bad usage."""
    scheduler_cls = _scheduler_class(args.scheduler)
    from schedspec.cli.main import UsageError, positive_int

    workers = default_workers() if args.workers is None else positive_int("--workers", args.workers)
    max_states = None if args.max_states is None else positive_int("--max-states", args.max_states)
    b = bound(args.bound)
    names = [s.name for s in b.spaces]
    if args.space:
        unknown = [n for n in args.space if n not in names]
        if unknown:
            raise UsageError(f"--space: {unknown[0]!r} is not a space of bound {args.bound} "
                                       f"(its spaces: {', '.join(names)})")
    use_impl = not args.no_impl
    note = ""
    if use_impl and not impl_available():
        use_impl = False
        note = " (impl.ImplScheduler is not importable: differential skipped)"
    log = None if args.quiet else sys.stderr
    print(f"modelcheck: bound {args.bound}, {len(args.space or names)} space(s); {len(CATALOGUE)} invariants on "
          f"every transition, the fake model's KV reads and contents, deadlock and liveness; "
          + ("ImplScheduler replaying every transition" if use_impl else "no impl differential") + note
          + f"; {workers} worker(s)")
    print(table_header())
    result = BoundResult(args.bound)
    for space in b.spaces:
        if args.space and space.name not in args.space:
            continue
        progress = _progress_printer(log, space.name) if log is not None else None
        r = Explorer(space, scheduler_cls=scheduler_cls, impl_cls=impl_class() if use_impl else None,
                     max_states=max_states, workers=workers, progress=progress).run()
        result.spaces.append(r)
        print(format_row(r), flush=True)
        if r.failure is not None:
            break
    total = SpaceResult(Space("total", b.spaces[0].config, (), 0))
    total.states, total.transitions, total.elapsed = result.states, result.transitions, result.elapsed
    total.depth = max((r.depth for r in result.spaces), default=0)
    bounds = [r for r in result.spaces if r.liveness_bound is not None]
    worst = max(bounds, key=lambda r: r.liveness_bound or 0) if bounds else None
    total.liveness_bound = worst.liveness_bound if worst else None
    total.complete = all(r.complete for r in result.spaces)
    total.cpu_s = sum(r.cpu_s for r in result.spaces)
    total.failure = result.failure
    print(format_row(total))
    extra: dict[str, Any] = {"impl": use_impl, "workers": workers, "invariants": len(CATALOGUE)}
    failure = result.failure
    if failure is not None:
        space_name = result.spaces[-1].space.name
        trace_path = failure.write_trace(Path(args.out) / f"{args.bound}-{space_name}.jsonl")
        against = args.scheduler or ("impl" if failure.kind == "divergence" else "spec")
        print(f"FAILED in space {space_name}: {failure.describe()}")
        print(f"counterexample: {len(failure.labels)} events (the shortest), written to {trace_path}")
        print(f"replay it: schedspec replay {trace_path} --against {against}")
        extra["trace"] = str(trace_path)
        extra["replay"] = f"schedspec replay {trace_path} --against {against}"
    else:
        if worst is not None:
            print(f"liveness: with no new arrivals every request finishes within {worst.liveness_bound} steps "
                  f"(worst case: space {worst.space.name}, path: {', '.join(worst.liveness_labels)})")
        what = "completely explored" if total.complete else "explored up to --max-states (partial)"
        print(f"OK: {result.states:,} states and {result.transitions:,} transitions {what}: every invariant held, "
              "no deadlock" + (", plans and views of ImplScheduler equal to the spec's" if use_impl else ""))
    if args.json:
        write_json(Path(args.json), result, extra)
    return 0 if failure is None else 1
