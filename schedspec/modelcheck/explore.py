"""Breadth-first exploration of one space: levels, the seen set, the workers.

Each level of states is expanded (in this process or in worker processes),
the successors are merged in order into the state graph, the new ones make
the next level. The first failure ends the search once its level is done
(a shorter failure may still be found in it); the graph then gives the
shortest path to it. A complete search ends with the liveness analysis.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from schedspec.check.deadline import in_worker
from schedspec.invariants import CATALOGUE, Invariant, Violation
from schedspec.modelcheck.coverage import Coverage
from schedspec.modelcheck.events import STEP
from schedspec.modelcheck.expand import Entry, Expander, Expansion
from schedspec.modelcheck.liveness import Deadlock, analyse
from schedspec.modelcheck.result import Counterexample, Finding, SpaceResult
from schedspec.modelcheck.space import Space
from schedspec.modelcheck.state import Fingerprint
from schedspec.modelcheck.target import Against, CopyMethod, copy_method, travels
from schedspec.spec.interface import Scheduler, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler


class StateGraph:
    """Every state found so far, numbered in the order found (the root is 0):
    the seen set (fingerprint -> number) and, per state, its parent, the
    event that first reached it, its step successor (-1 until known), whether
    it has unfinished requests and its depth."""

    def __init__(self, root: Fingerprint) -> None:
        self.seen: dict[Fingerprint, int] = {root: 0}
        self.parent: list[int] = [-1]
        self.via: list[int] = [-1]
        self.step_succ: list[int] = [-1]
        self.busy = bytearray(b"\x00")
        self.depth: list[int] = [0]

    def __len__(self) -> int:
        return len(self.parent)

    def add(self, fp: Fingerprint, parent: int, code: int, busy: bool) -> int:
        """Number a new state reached from ``parent`` by ``code``."""
        j = len(self.parent)
        self.seen[fp] = j
        self.parent.append(parent)
        self.via.append(code)
        self.step_succ.append(-1)
        self.busy.append(busy)
        self.depth.append(self.depth[parent] + 1)
        return j

    def path(self, idx: int) -> list[int]:
        """The event codes of the (shortest) path from the root to ``idx``."""
        codes: list[int] = []
        while idx > 0:
            codes.append(self.via[idx])
            idx = self.parent[idx]
        codes.reverse()
        return codes


# Worker processes: one Expander each, built once.
_WORKER: Expander | None = None


def _worker_init(space: Space, cls: type[SpecScheduler], against: Against | None, invariants: Sequence[Invariant],
                 copy: CopyMethod | None) -> None:
    global _WORKER
    in_worker()  # the deadline on the scheduler's calls, signals left to the parent
    _WORKER = Expander(space, cls, None, invariants, pickled=True, against=against, copy=copy)


def _worker_expand(entry: Entry) -> Expansion:
    assert _WORKER is not None
    return _WORKER.expand(entry)


def cpu_time() -> float:
    """CPU seconds of this process and of its finished children (the workers)."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Explorer:
    """Explores one Space breadth-first, level by level, from the empty
    scheduler; ``workers`` > 1 expands each level in that many processes
    (fork), merging their results in order, so state numbering, counts and
    counterexamples do not depend on it.

    ``against`` is the scheduler under test (target.py), ``impl_cls`` the
    shorthand for a lockstep one named "impl". A scheduler under test that can
    only be copied by deepcopy does not travel between processes: its space
    is then explored in this process alone (``workers`` becomes 1)."""

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
        against: Against | None = None,
    ) -> None:
        if against is None and impl_cls is not None:
            against = Against("impl", impl_cls, "lockstep", tuple(invariants))
        self.space = space
        self.cls = scheduler_cls
        self.against = against
        self.impl_cls = against.factory if against is not None else None
        self.invariants = tuple(invariants)
        self.max_states = max_states
        self.workers = max(1, workers)
        self.progress = progress
        #: how the scheduler under test is copied (target.copy_method), decided on a fresh one
        self.copy: CopyMethod | None = None
        if against is not None:
            self.copy = copy_method(against.factory(space.config))
            if not travels(self.copy):
                self.workers = 1
        self.expander = Expander(space, scheduler_cls, None, invariants, pickled=self.workers > 1, against=against,
                                 copy=self.copy)
        self.alphabet = self.expander.alphabet
        self.graph = StateGraph(())
        self.transitions = 0
        self.coverage = Coverage()
        #: how often the explored transitions took each named rule of the spec
        self.rules: Counter[str] = Counter()
        #: the shortest failure so far: (path length, state, event code or -1, what was found)
        self.best: tuple[int, int, int, Finding] | None = None
        self.capped = False

    def run(self) -> SpaceResult:
        res = SpaceResult(self.space)
        start, cpu0 = time.perf_counter(), cpu_time()
        root = self.expander.root()
        self.graph = StateGraph(self.expander.fingerprint(root))
        pool = self._pool()
        try:
            self._explore(root, pool, res, start)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        res.elapsed = time.perf_counter() - start
        res.cpu_s = cpu_time() - cpu0
        res.states, res.transitions = len(self.graph), self.transitions
        res.impl_transitions = self.transitions if self.impl_cls is not None else 0
        if self.against is not None:
            res.against, res.mode, res.copy = self.against.name, self.against.mode, self.copy or ""
        res.coverage = self.coverage.as_dict()
        res.rules = Counter(self.rules)
        if self.best is not None:
            _, idx, code, f = self.best
            codes = self.graph.path(idx) + ([code] if code >= 0 else [])
            res.failure = self.counterexample(f.kind, f.message, f.violations, codes)
        elif not self.capped:
            self._liveness(res)
            res.complete = res.failure is None
        return res

    def _pool(self) -> Any:
        if self.workers == 1:
            return None
        import multiprocessing

        return multiprocessing.get_context("fork").Pool(
            self.workers, _worker_init, (self.space, self.cls, self.against, self.invariants, self.copy))

    def _explore(self, root: Entry, pool: Any, res: SpaceResult, start: float) -> None:
        level = [root]
        depth = 0
        while level and self.best is None and not self.capped:
            nxt: list[Entry] = []
            for r in self._expansions(level, pool):
                self.coverage.merge(r.coverage)
                for name, n in r.rules.items():
                    self.rules[name] += n
                if r.failure is not None:
                    self._note_failure(r.idx, *r.failure)
                elif self.best is None:  # else finish the level only to look for a shorter failure
                    self._merge(r, nxt)
                    if self.max_states is not None and len(self.graph) >= self.max_states:
                        self.capped = True
                        break
            if nxt and self.best is None:
                depth += 1
            level = nxt
            res.states, res.transitions, res.depth = len(self.graph), self.transitions, depth
            res.elapsed = time.perf_counter() - start
            if self.progress is not None:
                self.progress(res, len(level))

    def _expansions(self, level: list[Entry], pool: Any) -> Iterator[Expansion]:
        if pool is None:
            return map(self.expander.expand, level)
        chunk = max(1, min(64, len(level) // (self.workers * 8)))
        results: Iterator[Expansion] = pool.imap(_worker_expand, level, chunk)
        return results

    def _note_failure(self, idx: int, code: int, f: Finding) -> None:
        length = self.graph.depth[idx] + (0 if code < 0 else 1)
        if self.best is None or length < self.best[0]:
            self.best = (length, idx, code, f)

    def _merge(self, r: Expansion, nxt: list[Entry]) -> None:
        """Number the new successors of one state and queue them."""
        g = self.graph
        seen = g.seen
        idx = r.idx
        for code, fp, succ, busy in r.successors:
            self.transitions += 1
            j = seen.get(fp)
            if j is None:
                j = g.add(fp, idx, code, busy)
                assert succ.state is not None, "a worker withheld a state the main process lacks"
                succ.idx = j
                nxt.append(succ)
            if code == STEP:
                g.step_succ[idx] = j

    # -------------------------------------------------------------- liveness

    def _liveness(self, res: SpaceResult) -> None:
        g = self.graph
        found = analyse(g.step_succ, g.busy, g.depth)
        if isinstance(found, Deadlock):
            codes = g.path(found.start) + [STEP.value] * found.steps
            res.failure = self.counterexample(
                "deadlock",
                f"from a state with unfinished requests (depth {g.depth[found.start]}) steps alone never finish "
                f"them: the step-only run enters a cycle of {found.cycle} state(s)",
                (), codes)
            return
        res.liveness_bound = found.steps
        codes = g.path(found.worst) + [STEP.value] * found.steps
        res.liveness_labels = tuple(self.alphabet.label(c) for c in codes)
        res.liveness_workload = self.expander.workload(codes)

    # -------------------------------------------------------------- paths

    def path(self, idx: int) -> list[int]:
        return self.graph.path(idx)

    def counterexample(self, kind: str, message: str, violations: Sequence[Violation],
                       codes: list[int]) -> Counterexample:
        wl = self.expander.workload(codes, run_last=kind == "deadlock")
        return Counterexample(kind, message, tuple(violations), tuple(self.alphabet.label(c) for c in codes), wl,
                              self.space.vocab, self.space.oracle_seed)

