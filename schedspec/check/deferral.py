"""The invariants of a lockstep run, checked once per identical transition.

In a lockstep run that compares views, every scheduler's transition is
checked against the same invariants over a history built from the same
transitions. When a scheduler's transition equals the reference's (the first
scheduler's: the same views before and after, plan, result, KV events and
statistics), the verdict is the reference's, which was checked at once. So
the other schedulers' transitions wait here until the driver has compared
the operation's outcomes and views:

- compared equal: a transition equal to the reference's is only folded into
  its monitor's history; one that differs (a field no comparison covers) is
  checked in full;
- any failure found before that (a divergence, an error, a fork's
  disagreement): every waiting transition is checked in full first, and a
  violation among them is reported instead, as it was when each scheduler's
  transition was checked right after its call.

The invariants were most of a lockstep check's time; this keeps every
verdict and checks each identical transition once.
"""

from __future__ import annotations

from typing import Protocol

from schedspec.check.records import Failure
from schedspec.invariants import Monitor, Transition, Violation


class _Runner(Protocol):
    names: list[str]
    compare_views: bool

    def fail(self, kind: str, name: str, message: str, violations: tuple[Violation, ...] = (),
             exception: BaseException | None = None) -> Failure: ...


class Deferral:
    """The transitions of the schedulers after the first, waiting for the
    operation's comparison (check/driver.py calls ``observe`` after each
    call, ``settle`` once the views compared equal, ``flush`` on a failure)."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner
        #: the reference's transitions since the last settle, in order
        self.reference: list[Transition] = []
        #: (scheduler, monitor, transition, index of the reference's transition it pairs with)
        self.waiting: list[tuple[str, Monitor, Transition, int]] = []
        self._counts: dict[str, int] = {}  # another scheduler -> its transitions since the last settle

    def observe(self, name: str, monitor: Monitor, t: Transition) -> Failure | None:
        """``t``, the transition of ``name``'s last call: the reference's is
        checked now, another's waits when views are compared (the driver's
        compare_views: lockstep with views compared)."""
        if not self.runner.compare_views or name == self.runner.names[0]:
            if self.runner.compare_views:
                self.reference.append(t)
            return self._report(name, t, monitor.observe(t))
        k = self._counts.get(name, 0)
        self._counts[name] = k + 1
        self.waiting.append((name, monitor, t, k))
        return None

    def settle(self) -> Failure | None:
        """After the views compared equal: each waiting transition equal to
        the reference's is recorded; any other is checked in full."""
        return self._resolve(compared=True)

    def flush(self) -> Failure | None:
        """Before a failure is reported: every waiting transition checked in
        full, the first violation returned (None: none)."""
        return self._resolve(compared=False)

    def _resolve(self, compared: bool) -> Failure | None:
        waiting, reference = self.waiting, self.reference
        self.waiting, self.reference, self._counts = [], [], {}
        for i, (name, monitor, t, k) in enumerate(waiting):
            if compared and k < len(reference) and t == reference[k]:
                monitor.record(t)
            elif (f := self._report(name, t, monitor.observe(t))):
                for _, rest, u, _ in waiting[i + 1:]:  # the run stops here: keep the histories whole
                    rest.record(u)
                return f
        return None

    def _report(self, name: str, t: Transition, found: list[Violation]) -> Failure | None:
        if not found:
            return None
        return self.runner.fail("violation", name, f"{len(found)} invariant violation(s) after {t.kind}", tuple(found))
