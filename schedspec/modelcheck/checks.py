"""The invariant catalogue, evaluated on one transition at a time."""

from __future__ import annotations

from collections.abc import Sequence

from schedspec.invariants import History, Invariant, Transition, Violation
from schedspec.invariants.core import ALL_KINDS
from schedspec.spec.interface import SchedulerView


class StatelessChecker:
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
        self.by_kind: dict[str, tuple[Invariant, ...]] = {
            k: tuple(inv for inv in invariants if inv.scope == "transition" and k in inv.kinds) for k in ALL_KINDS
        }

    def check_state(self, view: SchedulerView) -> list[Violation]:
        """The state invariants of one view (as the "after" of a no-op)."""
        return self.check(Transition("reset", view, view), True, transition=False)

    def check(self, t: Transition, state_too: bool, transition: bool = True,
              history: History | None = None) -> list[Violation]:
        """The invariants of ``t`` (its kind's transition invariants, and the
        state invariants when ``state_too``). ``history``: what a Monitor
        would remember along the path (the KV connector's invariants read the
        loads started and the invalid blocks awaiting recomputation, which
        the checker carries with a state: kvworld.py); else an empty one."""
        invs = self.by_kind[t.kind] if transition else ()
        if state_too:
            invs = invs + self.state
        # The invariants only read the History, and here it is always empty:
        # one shared instance. The fast pass collects every finding in one
        # comprehension; if any check raises, the slow pass below reruns them
        # one by one so that the exception is reported under its invariant.
        h = self._history if history is None else history
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
