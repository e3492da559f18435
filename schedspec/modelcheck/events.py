"""The alphabet: every event the checker may apply to a state, as a small int.

Codes 0-2 are fixed (``EventCode``); then one ``add`` per request shape of the
space, then one ``abort`` per position in the list of unfinished requests
(``abort #k`` aborts the k-th in arrival order), then, in a space that allows
it, one ``step, abort #k mid-step`` per position: ``schedule()``, the abort of
the k-th unfinished request while the plan is in flight, the model, ``update()``;
then, in an async space, ``update``; then, in a space with the pause gate, the
five pause events (``pause new``, ``pause new+clear``, ``pause all``,
``pause all+clear``, ``resume``: check/workload.py's Pause and Resume); then,
in a space with structured outputs, ``grammar ok #k`` and ``grammar failed #k``
per position (GrammarReady for the k-th unfinished request). A space without a
gate has the codes it always had. Then, in a space with a KV connector, one
code per worker report (``KV_OPS``) and position: a step whose result carries
that report (check/workload.py's KVLoadDone / KVLoadFailed / KVSaveDone, then
Step): ``load done #k``, ``load failed #k`` (the whole load, failed_recving),
``load failed #k at block b`` (invalid_block_ids) for the k-th asynchronous
load in flight (by arrival), ``save done #k`` for the k-th finished request
holding its blocks for a save, and ``sync load failed #k at block b`` for the
k-th unfinished request, whose synchronous load in this step fails. Last, in
a space with streaming-input shapes, ``chunk #k`` and ``end #k`` per position:
the k-th unfinished request's next chunk (its shape's) or its end
(check/workload.py's SessionInput).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

from schedspec.modelcheck.space import Shape

#: The pause events, in code order: (label, pause mode or None for resume, clear_cache).
PAUSE_EVENTS: tuple[tuple[str, str | None, bool], ...] = (
    ("pause new", "new", False),
    ("pause new+clear", "new", True),
    ("pause all", "all", False),
    ("pause all+clear", "all", True),
    ("resume", None, False),
)

#: The KV connector's worker reports, in code order: (name, label, kind,
#: block index). kind "load": the k-th asynchronous load in flight; "save":
#: the k-th pending save; "sync": the k-th unfinished request's synchronous
#: load of this step. The block index is KVLoadFailed.block_index (None: the
#: whole load fails) and "done" for KVLoadDone / KVSaveDone.
KV_OPS: tuple[tuple[str, str, str, int | None | str], ...] = (
    ("done", "load done", "load", "done"),
    ("failed", "load failed", "load", None),
    ("failed@0", "load failed", "load", 0),
    ("failed@1", "load failed", "load", 1),
    ("save", "save done", "save", "done"),
    ("sync-failed@0", "sync load failed", "sync", 0),
    ("sync-failed@1", "sync load failed", "sync", 1),
)

#: The pause state (PauseState's value) a pause mode sets.
PAUSE_STATE_OF: dict[str | None, int] = {"new": 1, "all": 2, None: 0}


class EventCode(IntEnum):
    STEP = 0  # schedule(), the fake model, update()
    RESET = 1  # reset_prefix_cache()
    RESET_RUNNING = 2  # reset_prefix_cache(reset_running_requests=True)
    FIRST_ADD = 3  # add shape 0; add shape i is FIRST_ADD + i


STEP, RESET, RESET_RUNNING = EventCode.STEP, EventCode.RESET, EventCode.RESET_RUNNING


class Alphabet:
    """Event codes: 0 step, 1 reset, 2 reset+running, 3.. add shape i, then
    abort of the k-th unfinished request."""

    def __init__(self, shapes: Sequence[Shape], max_requests: int, abort_in_step: bool = False,
                 aborts: bool = True, resets: bool = True, async_scheduling: bool = False, pauses: bool = False,
                 grammar: bool = False, kv_ops: Sequence[str] = (), sessions: bool = False,
                 depth: int = 2) -> None:
        self.shapes = tuple(shapes)
        #: False: no abort events at all (a scheduler under test that takes none)
        self.aborts = aborts
        #: False: no reset events (a scheduler under test that takes none)
        self.resets = resets
        self.max_requests = max_requests
        self.first_abort = EventCode.FIRST_ADD + len(self.shapes)
        self.first_step_abort = self.first_abort + max_requests
        self.abort_in_step = abort_in_step
        self.size = self.first_step_abort + (max_requests if abort_in_step else 0)
        #: plans in flight (async scheduling or a pipeline; ``depth`` is k,
        #: config.max_concurrent_batches): ``step`` is the engine's turn
        #: (schedule() while fewer than k plans are in flight, else update()
        #: of the oldest: EngineCore.step_with_batch_queue), and ``update``
        #: (this code) delivers the oldest while 1 .. k - 1 are in flight
        self.async_scheduling = async_scheduling
        self.depth = depth if async_scheduling else 1
        self.update = self.size
        if async_scheduling:
            self.size += 1
        #: the pause events (PAUSE_EVENTS), from this code on
        self.pauses = pauses
        self.first_pause = self.size
        if pauses:
            self.size += len(PAUSE_EVENTS)
        #: grammar ok #k, then grammar failed #k, from this code on
        self.grammar = grammar
        self.first_grammar = self.size
        if grammar:
            self.size += 2 * max_requests
        #: the worker's reports explored (KV_OPS names), each for positions
        #: 0 .. kv_positions - 1 (finished requests that hold blocks do not
        #: count towards max_requests, so up to twice as many)
        known = {name for name, *_ in KV_OPS}
        bad = [op for op in kv_ops if op not in known]
        if bad:
            raise ValueError(f"unknown KV report {bad[0]!r} (expected one of {', '.join(sorted(known))})")
        self.kv_ops = tuple(op for op, *_ in KV_OPS if op in kv_ops)
        self.kv_positions = 2 * max_requests
        self.first_kv = self.size
        self.size += len(self.kv_ops) * self.kv_positions
        #: chunk #k, then end #k, from this code on (streaming-input sessions)
        self.sessions = sessions
        self.first_session = self.size
        if sessions:
            self.size += 2 * max_requests

    def add(self, i: int) -> int:
        return EventCode.FIRST_ADD + i

    def abort(self, k: int) -> int:
        return self.first_abort + k

    def is_add(self, code: int) -> bool:
        return EventCode.FIRST_ADD <= code < self.first_abort

    def shape_index(self, code: int) -> int:
        """The shape an ``add`` code adds."""
        return code - EventCode.FIRST_ADD

    def abort_index(self, code: int) -> int:
        """The position (among the unfinished requests) an ``abort`` or a
        ``step, abort`` code aborts."""
        return code - (self.first_step_abort if code >= self.first_step_abort else self.first_abort)

    def step_abort(self, k: int) -> int:
        return self.first_step_abort + k

    def is_step_abort(self, code: int) -> bool:
        """A step with an abort while its plan is in flight."""
        return self.first_step_abort <= code < self.first_step_abort + (self.max_requests if self.abort_in_step else 0)

    def is_pause(self, code: int) -> bool:
        return self.pauses and self.first_pause <= code < self.first_pause + len(PAUSE_EVENTS)

    def pause_event(self, code: int) -> tuple[str, str | None, bool]:
        """(label, mode or None for resume, clear_cache) of a pause code."""
        return PAUSE_EVENTS[code - self.first_pause]

    def is_grammar(self, code: int) -> bool:
        return self.grammar and self.first_grammar <= code < self.first_grammar + 2 * self.max_requests

    def grammar_event(self, code: int) -> tuple[int, bool]:
        """(position among the unfinished requests, ok) of a grammar code."""
        i = code - self.first_grammar
        return i % self.max_requests, i < self.max_requests

    def grammar_code(self, k: int, ok: bool) -> int:
        return self.first_grammar + k + (0 if ok else self.max_requests)

    def is_kv(self, code: int) -> bool:
        return self.first_kv <= code < self.first_session

    def is_session(self, code: int) -> bool:
        return self.sessions and self.first_session <= code < self.first_session + 2 * self.max_requests

    def session_event(self, code: int) -> tuple[int, bool]:
        """(position among the unfinished requests, end) of a session code."""
        i = code - self.first_session
        return i % self.max_requests, i >= self.max_requests

    def session_code(self, k: int, end: bool) -> int:
        return self.first_session + k + (self.max_requests if end else 0)

    def kv_code(self, op: str, k: int) -> int:
        return self.first_kv + self.kv_ops.index(op) * self.kv_positions + k

    def kv_event(self, code: int) -> tuple[str, int]:
        """(KV_OPS name, position) of a worker report code."""
        i, k = divmod(code - self.first_kv, self.kv_positions)
        return self.kv_ops[i], k

    def enabled(self, known: int, unfinished: int, in_flight: int = 0, pause_state: int = 0,
                grammar_waiting: Sequence[int] = (), kv: Sequence[int] = (),
                sessions: Sequence[int] = (), known_by_shape: Sequence[int] = ()) -> list[int]:
        """The codes enabled in a state where the scheduler knows ``known``
        requests (unfinished, or finished and not yet reported), ``unfinished``
        of them unfinished, and ``in_flight`` plans await update (async
        scheduling or a pipeline of k = ``depth``): adds only below the
        space's request bound, resets with at most k - 1 plans in flight
        (check/workload.py, InFlight.reset), ``update`` with 1 .. k - 1
        (with k the step updates the oldest); a pause to
        another pause state than ``pause_state`` (PauseState's value), resume
        while paused; a grammar report for each position in
        ``grammar_waiting`` (requests whose grammar is still compiling); no
        add of a shape whose ``max_at_once`` requests ``known_by_shape``
        (per shape index) already counts."""
        codes = [STEP.value]
        if self.resets and in_flight <= max(1, self.depth - 1):
            codes += [RESET.value, RESET_RUNNING.value]
        if self.async_scheduling and 1 <= in_flight < self.depth:
            codes.append(self.update)
        if known < self.max_requests:
            codes += [self.add(i) for i, sh in enumerate(self.shapes)
                      if not sh.max_at_once or i >= len(known_by_shape) or known_by_shape[i] < sh.max_at_once]
        if self.aborts:
            codes += [self.abort(k) for k in range(unfinished)]
            if self.abort_in_step:
                codes += [self.step_abort(k) for k in range(unfinished)]
        if self.pauses:
            codes += [self.first_pause + i for i, (_, mode, _) in enumerate(PAUSE_EVENTS)
                      if PAUSE_STATE_OF[mode] != pause_state]
        if self.grammar:
            codes += [self.grammar_code(k, ok) for ok in (True, False) for k in grammar_waiting]
        codes += kv  # the worker's reports the state makes meaningful (expand.Expander.enabled)
        codes += sessions  # the session updates the spec takes (modelcheck/sessions.py)
        return codes

    def label(self, code: int) -> str:
        if code == STEP:
            return "step"
        if code == RESET:
            return "reset"
        if code == RESET_RUNNING:
            return "reset+running"
        if self.async_scheduling and code == self.update:
            return "update"
        if self.is_pause(code):
            return self.pause_event(code)[0]
        if self.is_grammar(code):
            k, ok = self.grammar_event(code)
            return f"grammar {'ok' if ok else 'failed'} #{k}"
        if self.is_session(code):
            k, end = self.session_event(code)
            return f"{'end' if end else 'chunk'} #{k}"
        if self.is_kv(code):
            op, k = self.kv_event(code)
            _, label, _, block = next(o for o in KV_OPS if o[0] == op)
            return f"step, {label} #{k}" + (f" at block {block}" if isinstance(block, int) else "")
        if code < self.first_abort:
            return f"add {self.shapes[self.shape_index(code)].name}"
        if self.is_step_abort(code):
            return f"step, abort #{self.abort_index(code)} mid-step"
        return f"abort #{self.abort_index(code)}"
