"""Deadlines on the calls into a scheduler under test, and interruptions
that end a run with a summary.

Every call the driver makes into a scheduler (construction, add, abort,
schedule, update, view, reset_prefix_cache, clone, ...) is noted on one
clock, ``CLOCK``: which scheduler, which method, since when. Within
``guarded(seconds)`` a ticker (``signal.setitimer(ITIMER_REAL)``, armed once
for the whole run, not per call) wakes a SIGALRM handler a few times a
second; when the call in progress has run past the deadline it raises
``CallTimeout`` in the main thread, out of the scheduler's Python loop,
``time.sleep`` or lock wait. Per call, the cost is a note on the clock (two
attribute writes and a clock read).

``CallTimeout`` and ``Interrupted`` derive from BaseException, so a
scheduler's ``except Exception`` cannot swallow them.

Where the guard cannot work, it falls back to no deadline, and
``guard_available()`` says why: off the main thread (signal handlers can
only be installed there), or on a platform without SIGALRM (Windows). A
call stuck in C code that never returns to the interpreter (a native
extension's loop holding the GIL) is not interrupted either: Python runs
signal handlers between bytecodes.

``interruptible()`` turns SIGINT and SIGTERM into ``Interrupted`` (the
signal's name and the conventional exit status, 128 + its number) so that
a run can stop where it is and report what it did.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from types import FrameType
from typing import Any, Iterator

#: The default deadline of one call into a scheduler, in seconds: no healthy
#: scheduler approaches it (a step of vLLM's scheduler takes milliseconds).
DEFAULT_CALL_TIMEOUT = 60.0


class CallTimeout(BaseException):
    """A call into a scheduler ran past its deadline."""

    def __init__(self, scheduler: str, method: str, elapsed: float, deadline: float) -> None:
        super().__init__(f"{scheduler}: {method} did not return within {deadline:g} s")
        self.scheduler = scheduler
        self.method = method
        self.elapsed = elapsed
        self.deadline = deadline

    def describe(self, who: str | None = None) -> str:
        """One line: what hung, for how long, against which deadline."""
        return (f"{who or self.method} did not return: still running after {self.elapsed:.1f} s "
                f"(the deadline of one call is {self.deadline:g} s, --call-timeout)")


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived during a run."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.name}")

    @property
    def exit_status(self) -> int:
        """128 + the signal's number: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


class CallClock:
    """The call in progress: which scheduler, which method, since when
    (``scheduler`` None: no call in progress)."""

    __slots__ = ("scheduler", "method", "since")

    def __init__(self) -> None:
        self.scheduler: str | None = None
        self.method = ""
        self.since = 0.0

    def start(self, scheduler: str, method: str) -> None:
        self.scheduler = scheduler
        self.method = method
        self.since = time.monotonic()

    def stop(self) -> None:
        self.scheduler = None


#: The one clock every driver notes its calls on.
CLOCK = CallClock()

_ACTIVE: list[float] = []  # the deadlines of the guards in force, innermost last


def guard_available() -> str | None:
    """None when ``guarded`` can enforce a deadline here; otherwise why not."""
    if not hasattr(signal, "SIGALRM") or not hasattr(signal, "setitimer"):
        return "this platform has no SIGALRM (deadlines need POSIX signals)"
    if threading.current_thread() is not threading.main_thread():
        return "not on the main thread (signal handlers run only there)"
    return None


def check_timeout(flag: str, value: float | None) -> float | None:
    """A deadline as given on the command line (None or 0: none); ValueError
    naming ``flag`` for a negative or non-finite one."""
    if value is None or value == 0:
        return None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{flag}: must be a positive number of seconds (0: no deadline), got {value}")
    return float(value)


def _tick(deadline: float) -> float:
    """How often the ticker wakes: a quarter of the deadline, at most 0.25 s."""
    return min(0.25, max(deadline / 4, 0.01))


def _on_alarm(_signum: int, _frame: FrameType | None) -> None:
    if CLOCK.scheduler is None or not _ACTIVE:
        return
    elapsed = time.monotonic() - CLOCK.since
    limit = _ACTIVE[-1]
    if elapsed > limit:
        name, method = CLOCK.scheduler, CLOCK.method
        CLOCK.stop()  # raised once: the unwinding is not timed
        raise CallTimeout(name, method, elapsed, limit)


def in_worker() -> None:
    """In a worker process forked within ``guarded`` (the model checker's
    pool): arm the ticker again (a timer does not survive fork; the handler
    and the deadline do), and leave SIGINT and SIGTERM to the parent, which
    ends the pool (SIGINT ignored, SIGTERM the default)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _ACTIVE and guard_available() is None:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, _tick(_ACTIVE[-1]), _tick(_ACTIVE[-1]))


@contextmanager
def guarded(deadline: float | None) -> Iterator[str | None]:
    """Enforce ``deadline`` seconds on every call noted on CLOCK within the
    block (None: no deadline); yields None, or why the guard cannot work here
    (then the block runs unguarded). Nested, the innermost deadline rules;
    the previous handler and timer are restored on the way out."""
    why = None if deadline is None else guard_available()
    if deadline is None or why is not None:
        yield why
        return
    tick = _tick(deadline)

    previous: Any = signal.signal(signal.SIGALRM, _on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, tick, tick)
    _ACTIVE.append(deadline)
    try:
        yield None
    finally:
        _ACTIVE.pop()
        signal.setitimer(signal.ITIMER_REAL, *old_timer)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def interruptible() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise ``Interrupted`` (once: a
    second signal while the run winds down gets the previous handler's
    behaviour). Off the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        for s, h in previous.items():
            signal.signal(s, h)
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
