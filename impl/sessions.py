"""Streaming-input sessions (resumable requests) in the impl: the same
decisions as spec/sessions.py. A scheduler that never saw a resumable request
pays nothing per step for them: a live session holds the gated rules (as a
grammar does), so the plain paths never look."""

from __future__ import annotations

from typing import Any

import dataclasses

from schedspec.spec.interface import RequestError, RequestSpec, RequestStatus, SchedulerConfig, SessionUpdate
from schedspec.spec.protocol import check_resumable

from schedspec.impl.request import Request

WAITING_FOR_STREAMING = RequestStatus.WAITING_FOR_STREAMING_REQ
_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING

__all__ = ["SessionsMixin", "WAITING_FOR_STREAMING", "check_resumable"]


class SessionsMixin:
    """ImplScheduler's sessions."""

    # provided by ImplScheduler
    _config: SchedulerConfig
    _requests: dict[str, Request]
    _kv_holding_waiting: list[Request]
    _connector: bool
    _deferred: set[str]
    _waiting: Any
    _max_model_len: int
    _finish_request: Any

    def _init_sessions(self) -> None:
        self._live_sessions = 0  # unfinished resumable requests
        self._num_waiting_for_streaming = 0  # num_waiting_for_streaming_input
        self._streaming_queues: dict[str, tuple[SessionUpdate, ...]] = {}
        self._session_bound: dict[str, int] = {}
        self._continuing: list[Request] = []

    def _clone_sessions(self, d: dict[str, Any], remap: dict[int, Request]) -> None:
        d["_streaming_queues"] = self._streaming_queues.copy()
        d["_session_bound"] = self._session_bound.copy()
        d["_continuing"] = [remap[id(r)] for r in self._continuing]
        if not self._connector:  # continuing sessions holding blocks wait there (the connector copies its own)
            d["_kv_holding_waiting"] = [remap[id(r)] for r in self._kv_holding_waiting]

    def _add_session(self, spec: RequestSpec) -> None:
        if not self._streaming_queues:
            # the first session of a scheduler: containers of its own, since a
            # clone without sessions shares the empty ones (clone copies them
            # only while a session is live)
            self._streaming_queues, self._session_bound, self._continuing = {}, {}, []
            if not self._connector:
                self._kv_holding_waiting = list(self._kv_holding_waiting)
        self._live_sessions += 1
        self._streaming_queues[spec.request_id] = ()
        self._session_bound[spec.request_id] = len(spec.prompt_token_ids) + spec.max_tokens

    def session_update(self, update: SessionUpdate) -> None:
        """The next chunk (or the end) of a session: applied at once to a
        session waiting for input, else queued for its next stop."""
        if not isinstance(update, SessionUpdate):
            raise TypeError(f"update must be a SessionUpdate, got {type(update).__name__}")
        rid = update.request_id
        req = self._requests.get(rid)
        if req is None:
            raise RequestError(rid, "request_id", "no unfinished session with this id")
        if not req.spec.resumable:
            raise RequestError(rid, "resumable", "the request is not resumable")
        queued = self._streaming_queues[rid]
        if queued and queued[-1].end:
            raise RequestError(rid, "end", "the session's end is already queued")
        if not update.end:
            bound = self._session_bound[rid] + len(update.prompt_token_ids) + update.max_tokens
            if bound >= self._max_model_len:
                raise RequestError(rid, "prompt_token_ids",
                                   f"the session's chunks and max_tokens would exceed max_model_len "
                                   f"{self._max_model_len}")
            self._session_bound[rid] = bound
        if req.status is not WAITING_FOR_STREAMING:
            self._streaming_queues[rid] = queued + (update,)
        elif not update.end:
            self._apply_chunk(req, update)
        else:
            self._finish_request(req, RequestStatus.FINISHED_ABORTED)

    def _apply_chunk(self, req: Request, update: SessionUpdate) -> None:
        """_update_request_as_session: the last sampled token goes, the kept
        outputs and the chunk join the prompt, max_tokens is the chunk's."""
        keep = req.output[:-1]
        prompt = req.prompt_token_ids + tuple(keep) + update.prompt_token_ids
        req.spec = dataclasses.replace(req.spec, prompt_token_ids=prompt, max_tokens=update.max_tokens)
        req.prompt_token_ids = prompt
        n = len(prompt)
        req.num_prompt_tokens = n
        req.num_tokens = n
        req.output = []
        req.last_token_ids = prompt[-1:]
        req.length_cap_at = n + min(update.max_tokens, self._max_model_len - n)
        req.max_tokens_end = n + update.max_tokens
        req.cached_block_tuple = None
        if req.status is WAITING_FOR_STREAMING:
            self._num_waiting_for_streaming -= 1
        req.status = _WAITING

    def _handle_stopped(self, req: Request) -> bool:
        """_handle_stopped_request: True when the session ends here."""
        req.num_computed_tokens -= req.num_output_placeholders
        req.spec_token_ids = ()
        req.drop_stale_output = True
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        rid = req.request_id
        queued = self._streaming_queues[rid]
        if not queued:
            req.status = WAITING_FOR_STREAMING
            self._num_waiting_for_streaming += 1
            return False
        self._streaming_queues[rid] = queued[1:]
        if queued[0].end:
            return True
        self._apply_chunk(req, queued[0])
        return False

    def _enqueue_continuing(self) -> None:
        """The continuing sessions, in output order, join kv_holding_waiting
        (holding computed tokens) or the waiting queue; one waiting for input
        is deferred."""
        for req in self._continuing:
            if req.status is WAITING_FOR_STREAMING:
                self._deferred.add(req.request_id)
            if req.num_computed_tokens > 0:
                self._kv_holding_waiting.append(req)
            else:
                self._waiting.push_back(req)
        self._continuing = []

    def _clear_unproposed(self, scheduled: list[Request], drafted: Any) -> None:
        """Sync speculative decoding: a scheduled session with no proposal
        loses the drafts left from before its stop (spec/sessions.py)."""
        for req in scheduled:
            if req.spec_token_ids and req.spec.resumable and req.request_id not in drafted \
                    and self._requests.get(req.request_id) is req:
                req.spec_token_ids = ()

    def _session_blocks_kept(self) -> str | None:
        """A session that waits holding blocks: reset_prefix_cache with
        reset_running_requests cannot free them (vLLM raises)."""
        for rid in self._streaming_queues:
            req = self._requests[rid]
            if req.status is not _RUNNING and (req.block_ids or any(req.group_block_ids)):
                return f"session {rid!r} holds blocks while it waits ({req.status.value})"
        return None

    def _forget_session(self, req: Request) -> None:
        if req.status is WAITING_FOR_STREAMING:
            self._num_waiting_for_streaming -= 1
        self._live_sessions -= 1
        del self._streaming_queues[req.request_id]
        del self._session_bound[req.request_id]
