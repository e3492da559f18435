"""The alphabet: every event the checker may apply to a state, as a small int.

Codes 0-2 are fixed (``EventCode``); then one ``add`` per request shape of the
space, then one ``abort`` per position in the list of unfinished requests
(``abort #k`` aborts the k-th in arrival order), then, in a space that allows
it, one ``step, abort #k mid-step`` per position: ``schedule()``, the abort of
the k-th unfinished request while the plan is in flight, the model, ``update()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

from schedspec.modelcheck.space import Shape


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
                 aborts: bool = True, resets: bool = True, async_scheduling: bool = False) -> None:
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
        #: async scheduling: ``step`` is the engine's turn (schedule() while
        #: fewer than two plans are in flight, else update() of the oldest),
        #: and ``update`` (this code) delivers the oldest of one plan in flight
        self.async_scheduling = async_scheduling
        self.update = self.size
        if async_scheduling:
            self.size += 1

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

    def enabled(self, known: int, unfinished: int, in_flight: int = 0) -> list[int]:
        """The codes enabled in a state where the scheduler knows ``known``
        requests (unfinished, or finished and not yet reported), ``unfinished``
        of them unfinished, and ``in_flight`` plans await update (async
        scheduling): adds only below the space's request bound, resets with
        at most one plan in flight, ``update`` with exactly one."""
        codes = [STEP.value]
        if self.resets and in_flight <= 1:
            codes += [RESET.value, RESET_RUNNING.value]
        if self.async_scheduling and in_flight == 1:
            codes.append(self.update)
        if known < self.max_requests:
            codes += [self.add(i) for i in range(len(self.shapes))]
        if self.aborts:
            codes += [self.abort(k) for k in range(unfinished)]
            if self.abort_in_step:
                codes += [self.step_abort(k) for k in range(unfinished)]
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
        if code < self.first_abort:
            return f"add {self.shapes[self.shape_index(code)].name}"
        if self.is_step_abort(code):
            return f"step, abort #{self.abort_index(code)} mid-step"
        return f"abort #{self.abort_index(code)}"
