"""Streaming-input sessions (resumable requests): what they add to the base
path (spec/scheduler.py).

A resumable request (``RequestSpec.resumable``, vLLM's Request.resumable) is
a session whose input keeps arriving: the client sends each further chunk as
a ``SessionUpdate`` (vLLM: add_request with the session's id), at any time,
while the request runs, is preempted or waits. A chunk that arrives while the
session still generates for its previous chunk is queued
(``streaming_queue``). When the session stops (a stop token, max_tokens), it
does not finish (``_handle_stopped_request``): it keeps its blocks, drops the
work still in flight and resumes from its materialized frontier; the next
queued chunk updates it in place (``_update_request_as_session``: the last
sampled token is dropped, the kept outputs join the prompt, the chunk is
appended, block keys follow the new tokens) and it waits again, now WAITING;
with no chunk queued it waits in WAITING_FOR_STREAMING_REQ, which the WAITING
loop passes over (_handle_blocked_waiting_request) and which still holds a
model-runner slot (``num_waiting_for_streaming_input`` counts against
max_num_seqs at admission). The end of the session (``SessionUpdate.end``)
finishes a waiting session at once (FINISHED_ABORTED, as vLLM's
finish_requests is called), or, queued, finishes it at its next stop with its
stop status.

Where it enters the base path: ``add`` refuses what is not modelled;
``_finish_request`` keeps the count; the WAITING loop's slot check
(``_schedule_waiting``) and its pass-over (``_pass_over``); the update's stop
(``_take_output``), with the continuing sessions enqueued after the output
loop (``update``).

vLLM 0.33: vllm/v1/core/sched/scheduler.py (Scheduler.add_request,
_update_request_as_session, _handle_stopped_request, _enqueue_waiting_request,
_handle_blocked_waiting_request, finish_requests, schedule()'s WAITING loop,
update_from_output) and vllm/v1/request.py (StreamingUpdate,
RequestStatus.WAITING_FOR_STREAMING_REQ).

Not modelled (refused at add, RequestError naming ``resumable``): a session
under the PRIORITY policy (vLLM updates the arrival time of a request inside
its priority heap), with structured outputs, encoder inputs or the KV
connector's fields.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from schedspec.spec.coverage import CountsRules
from schedspec.spec.interface import (
    RequestError,
    RequestSpec,
    RequestStatus,
    SchedulerConfig,
    SessionUpdate,
    StepPlan,
    StepResult,
)

from schedspec.spec.protocol import check_resumable as check_resumable

if TYPE_CHECKING:
    from schedspec.spec.request_state import RequestState as _Request


class SessionsMixin(CountsRules):
    """SpecScheduler's streaming-input sessions."""

    # provided by SpecScheduler
    _config: SchedulerConfig
    requests: dict[str, _Request]
    running: list[str]
    waiting: list[str]
    kv_holding: list[str]
    deferred: set[str]

    def _init_sessions(self) -> None:
        # Request.streaming_queue of each live session: its chunks not applied
        # yet, None for the end (a tuple per session, so clones share them)
        self.streaming_queues: dict[str, tuple[SessionUpdate, ...]] = {}
        # Scheduler.num_waiting_for_streaming_input
        self.num_waiting_for_streaming_input = 0
        # update_from_output's continuing_reqs, enqueued after the output loop
        self.continuing: list[str] = []
        # what each session may still reach: check_session_length's bound
        self.session_bound: dict[str, int] = {}

    def _clone_sessions(self, d: dict[str, object]) -> None:
        d["streaming_queues"] = self.streaming_queues.copy()
        d["continuing"] = self.continuing[:]
        d["session_bound"] = self.session_bound.copy()

    def _add_session(self, request: RequestSpec) -> None:
        """add_request: a resumable request gets an empty streaming_queue."""
        self._rule("sessions.added")  # pragma: no mutate
        self.streaming_queues[request.request_id] = ()
        self.session_bound[request.request_id] = len(request.prompt_token_ids) + request.max_tokens

    def session_update(self, update: SessionUpdate) -> None:
        """add_request for an existing session (scheduler.py, add_request): a
        session waiting in WAITING_FOR_STREAMING_REQ takes the chunk at once
        (_update_request_as_session) or, for the end, finishes
        (finish_requests(FINISHED_ABORTED)); otherwise the update is queued
        for its next stop. Bad input raises RequestError and changes nothing:
        an unknown or finished id, a request that is not resumable, an update
        after the end, a chunk that would take the session past max_model_len."""
        if not isinstance(update, SessionUpdate):
            raise TypeError(f"update must be a SessionUpdate, got {type(update).__name__}")
        req = self._check_session_update(update)
        rid = update.request_id
        if not update.end:
            self.session_bound[rid] += len(update.prompt_token_ids) + update.max_tokens
        if req.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            self._rule("sessions.update_queued")  # pragma: no mutate
            self.streaming_queues[rid] = self.streaming_queues[rid] + (update,)
        elif not update.end:
            self._rule("sessions.update_applied")  # pragma: no mutate
            self._update_request_as_session(req, update)
        else:
            self._rule("sessions.ended_waiting")  # pragma: no mutate
            self._finish_request(req, RequestStatus.FINISHED_ABORTED)

    def _check_session_update(self, update: SessionUpdate) -> _Request:
        rid = update.request_id
        req = self.requests.get(rid)
        if req is None:
            raise RequestError(rid, "request_id", "no unfinished session with this id")
        if not req.spec.resumable:
            raise RequestError(rid, "resumable", "the request is not resumable")
        queued = self.streaming_queues[rid]
        if queued and queued[-1].end:
            raise RequestError(rid, "end", "the session's end is already queued")
        if not update.end and self.session_bound[rid] + len(update.prompt_token_ids) + update.max_tokens \
                >= self._config.max_model_len:
            raise RequestError(rid, "prompt_token_ids",
                               f"the session's chunks and max_tokens would exceed max_model_len "
                               f"{self._config.max_model_len}")
        return req

    def _update_request_as_session(self, req: _Request, update: SessionUpdate) -> None:
        """_update_request_as_session: drop the last sampled token (never
        computed: ``keep_end >= num_computed_tokens``), fold the kept outputs
        into the prompt, append the chunk; max_tokens is the chunk's. The
        block keys follow the tokens (spec/request_state.py, block_key), so
        the keys past ``keep_end`` are recomputed as vLLM's update_block_hashes
        does. The session becomes WAITING."""
        keep_end = req.num_tokens - 1
        assert keep_end >= req.num_computed_tokens
        kept = tuple(req.output_token_ids[: keep_end - len(req.spec.prompt_token_ids)])
        req.spec = dataclasses.replace(
            req.spec,
            prompt_token_ids=req.spec.prompt_token_ids + kept + update.prompt_token_ids,
            max_tokens=update.max_tokens,
        )
        req.output_token_ids = []
        if req.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self.num_waiting_for_streaming_input -= 1
        req.set_status(RequestStatus.WAITING)

    def _handle_stopped_request(self, req: _Request) -> bool:
        """_handle_stopped_request, for a session that stopped: drop its work
        in flight (its output becomes stale and is dropped), resume from the
        materialized frontier (num_computed_tokens less the placeholders), and
        take the next queued chunk, or wait in WAITING_FOR_STREAMING_REQ.
        Returns True when the queue held the session's end: it finishes."""
        req.num_computed_tokens -= req.num_output_placeholders
        assert req.num_computed_tokens >= 0
        req.spec_token_ids = []
        req.drop_stale_output = True
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        queued = self.streaming_queues[req.request_id]
        if not queued:
            self._rule("sessions.wait_for_input")  # pragma: no mutate
            req.set_status(RequestStatus.WAITING_FOR_STREAMING_REQ)
            self.num_waiting_for_streaming_input += 1
            return False
        self.streaming_queues[req.request_id] = queued[1:]
        if queued[0].end:
            self._rule("sessions.ended_at_stop")  # pragma: no mutate
            return True
        self._rule("sessions.continued_at_stop")  # pragma: no mutate
        self._update_request_as_session(req, queued[0])
        return False

    def _enqueue_continuing(self) -> None:
        """update_from_output, after the output loop: each continuing session,
        in output order, is enqueued (_enqueue_waiting_request): deferred when
        it waits for input, into kv_holding_waiting when it holds blocks
        (computed tokens), else into the waiting queue."""
        for rid in self.continuing:
            req = self.requests[rid]
            if req.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                self.deferred.add(rid)
            (self.kv_holding if req.num_computed_tokens > 0 else self.waiting).append(rid)
        self.continuing = []

    def _clear_unproposed(self, plan: StepPlan, result: StepResult) -> None:
        """update_draft_token_ids gets the worker's proposals for every
        request of the batch (vllm/v1/engine/core.py, post_step), an empty one
        where it proposed none, which clears a request's drafts. Only a
        session can still hold drafts when it is scheduled: those set after
        its stop, which its admission leaves (the WAITING loop never reads
        spec_token_ids); so a scheduled session without a proposal loses them."""
        for s in plan.scheduled:
            req = self.requests.get(s.request_id)
            if req is not None and req.spec.resumable and s.request_id not in result.draft_token_ids \
                    and req.spec_token_ids:
                self._rule("sessions.stale_drafts_cleared")  # pragma: no mutate
                req.spec_token_ids = []

    def _session_blocks_kept(self) -> str | None:
        """reset_prefix_cache(reset_running_requests=True): preempting the
        running requests frees no block of a session that waits (for input,
        or to resume its next chunk), so vLLM's reset fails and raises
        RuntimeError (scheduler.py, reset_prefix_cache: "Failed to reset KV
        cache even when all the running requests are preempted"); the
        boundary refuses it first (check_kv_reset). Why, or None."""
        for rid in self.streaming_queues:
            req = self.requests[rid]
            if req.status != RequestStatus.RUNNING and (req.blocks or any(req.group_blocks)):
                return f"session {rid!r} holds blocks while it waits ({req.status.value})"
        return None

    def _forget_session(self, req: _Request) -> None:
        """A finished request leaves the session books (finish_requests
        decrements the count for a session waiting for input)."""
        if req.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self.num_waiting_for_streaming_input -= 1
        self.streaming_queues.pop(req.request_id, None)
        self.session_bound.pop(req.request_id, None)

    if TYPE_CHECKING:
        def _finish_request(self, req: _Request, status: RequestStatus) -> None: ...

