"""The model checker with streaming-input sessions: chunk and end events at
any time (modelcheck/sessions.py), the spaces fcfs-cache-stream-1req (small)
and fcfs-nocache-stream (medium)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from schedspec.check import trace as tracefile
from schedspec.check.workload import SessionInput
from schedspec.cli.main import main
from schedspec.impl.scheduler import ImplScheduler
from schedspec.invariants import CATALOGUE
from schedspec.modelcheck import Expander, Explorer, bound
from schedspec.modelcheck.events import STEP
from schedspec.modelcheck.space import Space
from schedspec.modelcheck.target import Against
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.interface import RequestStatus, SessionUpdate
from schedspec.spec.request_state import RequestState
from schedspec.spec.scheduler import SpecScheduler

SESSION_RULES = {"sessions.added", "sessions.update_queued", "sessions.update_applied", "sessions.ended_waiting",
                 "sessions.wait_for_input", "sessions.ended_at_stop", "sessions.continued_at_stop"}


def _space(name: str, which: str = "small") -> Space:
    return next(s for s in bound(which).spaces if s.name == name)


def test_the_small_stream_space_runs_clean_against_impl_and_takes_every_session_rule() -> None:
    r = Explorer(_space("fcfs-cache-stream-1req"), impl_cls=ImplScheduler).run()
    assert r.complete and r.failure is None, r.failure and r.failure.message
    assert r.impl_transitions == r.transitions > 0
    assert SESSION_RULES <= set(rule_coverage.reached(r.rules))
    assert r.liveness_bound is not None


def test_the_session_events_are_offered_while_the_session_lives() -> None:
    ex = Expander(_space("fcfs-cache-stream-1req"))
    a = ex.alphabet
    assert a.sessions and a.label(a.session_code(0, False)) == "chunk #0" and a.label(a.session_code(0, True)) == "end #0"
    root = ex.root()
    assert not any(a.is_session(c) for c in ex.enabled(root.state.view(), None, root.state))
    s = root.state.clone()
    s.add(ex.request(0, 1))  # S, a session
    codes = ex.enabled(s.view(), None, s)
    assert a.session_code(0, False) in codes and a.session_code(0, True) in codes
    s.session_update(SessionUpdate("r1", (3,), 1))  # the one chunk its bound allows
    codes = ex.enabled(s.view(), None, s)
    assert a.session_code(0, False) not in codes and a.session_code(0, True) in codes
    s.session_update(SessionUpdate("r1", end=True))
    assert not any(a.is_session(c) for c in ex.enabled(s.view(), None, s))
    # a path's workload names the session's updates as SessionInput events
    wl = ex.workload([a.add(0), STEP, a.session_code(0, False), STEP, a.session_code(0, True)])
    assert [e.update for e in wl.events if isinstance(e, SessionInput)] == [
        SessionUpdate("r1", (3,), 1), SessionUpdate("r1", end=True)]


def test_a_session_waiting_for_input_is_not_busy_for_the_liveness_bound() -> None:
    from schedspec.modelcheck.sessions import waits_for_input

    assert waits_for_input(RequestStatus.WAITING_FOR_STREAMING_REQ)
    assert not waits_for_input(RequestStatus.WAITING)


class KeepsDroppedToken(SpecScheduler):
    """Keeps the last sampled token when a chunk is applied (vLLM drops it)."""

    def _update_request_as_session(self, req: RequestState, update: SessionUpdate) -> None:
        req.spec = dataclasses.replace(req.spec, max_tokens=update.max_tokens, prompt_token_ids=(
            req.spec.prompt_token_ids + tuple(req.output_token_ids) + update.prompt_token_ids))
        req.output_token_ids = []
        if req.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self.num_waiting_for_streaming_input -= 1
        req.set_status(RequestStatus.WAITING)


def test_a_scheduler_that_keeps_the_dropped_token_is_caught(tmp_path: Path) -> None:
    r = Explorer(_space("fcfs-cache-stream-1req"), scheduler_cls=KeepsDroppedToken, impl_cls=ImplScheduler).run()
    assert r.failure is not None and r.failure.kind == "divergence", r.failure
    assert any(lb.startswith("chunk #") for lb in r.failure.labels)
    trace = r.failure.write_trace(tmp_path / "cx.jsonl")
    assert any(isinstance(e, SessionInput) for e in tracefile.read(trace).events)
    assert main(["replay", str(trace), "--against", "impl"]) == 0


def test_invariants_mode_takes_the_session_events() -> None:
    r = Explorer(_space("fcfs-cache-stream-1req"),
                 against=Against("impl", ImplScheduler, "invariants", CATALOGUE)).run()
    assert r.complete and r.failure is None, r.failure and r.failure.message


def test_the_clone_of_impl_without_sessions_keeps_its_sessions_apart() -> None:
    """A clone made before any session shares no session container with the
    scheduler it came from (impl/sessions.py, _add_session)."""
    space = _space("fcfs-cache-stream-1req")
    a = ImplScheduler(space.config)
    b = a.clone()
    a.add(space.shapes[0].request("r1", 0))
    b.add(space.shapes[1].request("r1", 1))
    a.session_update(SessionUpdate("r1", end=True))
    assert b.view().waiting == ("r1",) and a.view().waiting == ("r1",)
    assert "r1" not in b._streaming_queues
