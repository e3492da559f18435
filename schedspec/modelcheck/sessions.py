"""Streaming-input sessions in the model checker: which ``chunk #k`` and
``end #k`` events a state enables, the update each sends, and what the spec
keeps of its sessions beyond its view (for the fingerprint).

A session is a request of a resumable shape (``Shape.resumable``); its
updates are environment events at any time, as vLLM's add_request with the
session's id arrives (spec/sessions.py): the shape's ``chunk`` with
``chunk_max_tokens`` while the session's chunks stay within
``max_model_len`` (the spec refuses the others), and the end, once.
"""

from __future__ import annotations

from typing import Any, Sequence

from schedspec.spec.interface import RequestStatus, SchedulerConfig, SchedulerView, SessionUpdate

from schedspec.modelcheck.events import Alphabet
from schedspec.modelcheck.space import Shape
from schedspec.modelcheck.state import Fingerprint

__all__ = ["enabled_updates", "update_for", "session_state", "waits_for_input"]


def _ranks(ids: set[str]) -> dict[str, int]:
    """The checker's ids ``r{k}`` by arrival order (as state.py ranks them)."""
    return {rid: i for i, rid in enumerate(sorted(ids, key=lambda r: (len(r), r)))}


def _shape(shapes: Sequence[Shape], arrival: int) -> Shape:
    """The shape of a request (Expander.request: arrival k * len(shapes) + shape)."""
    return shapes[arrival % len(shapes)]


def enabled_updates(alphabet: Alphabet, shapes: Sequence[Shape], config: SchedulerConfig, s: object,
                    v: SchedulerView) -> list[int]:
    """The session codes of state ``v``: for each unfinished session whose
    end is not queued, its end, and its next chunk where the session's bound
    (spec/sessions.py, session_bound) leaves room."""
    if not alphabet.sessions:
        return []
    queues: Any = getattr(s, "streaming_queues", {})
    bounds: Any = getattr(s, "session_bound", {})
    codes: list[int] = []
    for k, (rid, r) in enumerate(v.requests.items()):
        q = queues.get(rid)
        if q is None or (q and q[-1].end):
            continue
        sh = _shape(shapes, r.spec.arrival)
        if bounds.get(rid, 0) + len(sh.chunk) + sh.chunk_max_tokens < config.max_model_len:
            codes.append(alphabet.session_code(k, False))
        codes.append(alphabet.session_code(k, True))
    return codes


def update_for(alphabet: Alphabet, shapes: Sequence[Shape], v: SchedulerView, code: int) -> SessionUpdate:
    """The SessionUpdate a session code sends in state ``v``."""
    k, end = alphabet.session_event(code)
    rid, r = list(v.requests.items())[k]
    if end:
        return SessionUpdate(rid, end=True)
    sh = _shape(shapes, r.spec.arrival)
    return SessionUpdate(rid, sh.chunk, sh.chunk_max_tokens)


def session_state(s: object, v: SchedulerView) -> Fingerprint:
    """What the spec keeps of its sessions that its view's rows leave out,
    ids renamed by arrival rank: each session's prompt and max_tokens as its
    updates made them, its queued updates, its bound, and the requests the
    WAITING loop defers (a session waiting for input is among them)."""
    queues: Any = getattr(s, "streaming_queues", {})
    bounds: Any = getattr(s, "session_bound", {})
    deferred: Any = getattr(s, "deferred", set())
    rank = _ranks(set(v.requests) | set(v.finished) | set(deferred))
    rows = []
    for rid, q in queues.items():
        r = v.requests.get(rid)
        if r is None:
            continue
        rows.append((rank[rid], r.spec.prompt_token_ids, r.spec.max_tokens,
                     tuple((u.prompt_token_ids, u.max_tokens, u.end) for u in q), bounds.get(rid, 0)))
    return (tuple(sorted(rows)), tuple(sorted(rank[rid] for rid in deferred if rid in rank)))


def waits_for_input(status: RequestStatus) -> bool:
    """A session waiting for its next chunk: only an event moves it (not
    busy for the liveness bound, as a grammar still compiling)."""
    return status is RequestStatus.WAITING_FOR_STREAMING_REQ
