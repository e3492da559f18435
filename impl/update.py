"""update(plan, result): the model's output applied to the requests of the
oldest plan in flight (vLLM's Scheduler.update_from_output).

Two paths, one per kind of step bookkeeping that schedule() keeps:

- ``_update_sync``, synchronous scheduling without drafts or gates: one token
  per sampling entry, validated and applied in one pass over the plan; on
  input it does not vouch for, it undoes the appended tokens and lets the
  protocol's own check (spec/protocol.py, check_sampled) raise the spec's
  error.
- ``_update_general``, everything else (async scheduling, drafts, the gates,
  the KV connector): the result checked in one pass first (``_result_ok``),
  then per entry the in-flight and stale tokens drained, rejected drafts
  rolled back, tokens appended with a stop check after each, placeholders
  consumed, the blocks the verified tokens filled keyed. Beside each plan in
  flight schedule() keeps one int per entry (``code``: tokens scheduled
  times k + 2, plus the most tokens it may sample), so neither pass reads
  the plan entries.
"""

from __future__ import annotations

from typing import AbstractSet, Any

from schedspec.spec.interface import RequestStatus, SchedulerConfig, StepPlan, StepResult
from schedspec.spec.protocol import check_sampled, check_update, is_token_ids

from schedspec.impl.request import ERROR, LENGTH_CAPPED, NO_TOKENS, PREEMPTED, RUNNING, Request, STOPPED, WAITING
from schedspec.impl.sessions import WAITING_FOR_STREAMING

_NO_FAILED: frozenset[str] = frozenset()
# what _apply_output left of the request
_UNFINISHED, _STOPPED_RUNNING, _FINISHED = object(), object(), object()
# a session stopped and goes on (impl/sessions.py): it leaves the running
# queue, takes drafts as an unfinished request does
_CONTINUED = object()


class _Bad(Exception):
    """Internal: the fast pass of _update_sync met input it does not vouch for."""


class UpdateMixin:
    """ImplScheduler's update paths."""

    # provided by ImplScheduler and its other parts
    _config: SchedulerConfig
    _requests: dict[str, Request]
    _running: list[Request]
    _inflight: list[StepPlan]
    _inflight_reqs: list[list[Request]]
    _inflight_codes: list[list[int]]
    _grammar_errors: set[str]
    _general: bool
    _gated: bool
    _async: bool
    _caching: bool
    _connector: bool
    _fail_policy: bool
    _num_spec_tokens: int
    _encoder_cache: Any
    _finish: Any
    _finish_request: Any
    _unqueue: Any
    _register: Any
    _encoder_done: Any
    _kv_reports: Any
    _kv_finished: Any
    _log_stats: bool
    _stats_drafts: Any
    _stats_updated: Any
    # streaming-input sessions (impl/sessions.py)
    _live_sessions: int
    _continuing: list[Request]
    _handle_stopped: Any
    _enqueue_continuing: Any
    _clear_unproposed: Any

    def update(self, plan: StepPlan, result: StepResult) -> None:
        if self._general:
            self._update_general(plan, result)
        else:
            self._update_sync(plan, result)
        if self._log_stats and self._num_spec_tokens:
            self._stats_updated(plan, result)

    def _update_sync(self, plan: StepPlan, result: StepResult) -> None:
        """Synchronous scheduling without drafts or gates: validate and
        apply in one pass, undo on input it does not vouch for."""
        check_update(plan, self._inflight, result)
        sampled = result.sampled
        get_tokens = sampled.get
        scheduled = self._inflight_reqs[0]
        others = 0  # entries that are not a live sampling step
        extra = 0  # tokens present for those entries
        stopped: list[Request] = []
        bad = -1
        req: Request | None = None
        try:
            for req in scheduled:
                tokens = get_tokens(req.request_id)
                if req.status is not RUNNING:  # aborted while the step ran
                    others += 1
                    if tokens is not None:
                        extra += 1
                        if not is_token_ids(tokens):
                            raise _Bad
                    continue
                num_tokens = req.num_tokens
                if req.num_computed_tokens >= num_tokens:  # this step samples
                    if tokens.__class__ is not tuple:
                        raise _Bad
                    (token,) = tokens
                    if token.__class__ is not int or token < 0:
                        raise _Bad
                    req.output.append(token)
                    num_tokens += 1
                    req.num_tokens = num_tokens
                    req.last_token_ids = tokens
                    if num_tokens >= req.length_cap_at or token in req.stop_token_ids:
                        stopped.append(req)
                else:
                    others += 1
                    if tokens is not None:
                        extra += 1
                        if tokens.__class__ is not tuple or len(tokens) != 0:
                            raise _Bad
            if len(scheduled) - others + extra != len(sampled) or result.draft_token_ids:
                # tokens for a request the plan did not schedule, or drafts
                # (which must then be empty tuples): the plain way decides
                bad = len(scheduled)
        except (_Bad, ValueError):
            assert req is not None
            bad = scheduled.index(req)
        if bad >= 0:
            self._rollback(plan, bad)
            check_sampled(plan, result, self._requests, self._config)  # raises the spec's error
            # Valid after all (e.g. an int subclass as a token): the plain way.
            stopped = self._append_slow(plan, result)
        if stopped:
            for req in stopped:
                self._finish(req, STOPPED if req.last_token_ids[0] in req.stop_token_ids else LENGTH_CAPPED)
            self._running = [r for r in self._running if r.status is RUNNING]
        del self._inflight[0]
        del self._inflight_reqs[0]
        del self._inflight_codes[0]

    def _rollback(self, plan: StepPlan, bad: int) -> None:
        """Undo the tokens the fast pass appended to the entries before
        position ``bad``."""
        for entry, req in zip(plan.scheduled[:bad], self._inflight_reqs[0]):
            if req.status is RUNNING and entry.samples:
                req.output.pop()
                req.num_tokens -= 1
                req.last_token_ids = (req.output[-1],) if req.output else req.prompt_token_ids[-1:]

    def _append_slow(self, plan: StepPlan, result: StepResult) -> list[Request]:
        stopped: list[Request] = []
        for entry in plan.scheduled:
            req = self._requests.get(entry.request_id)
            tokens = result.sampled.get(entry.request_id, ())
            if req is None or not tokens:
                continue
            token = tokens[0]
            req.output.append(token)
            req.num_tokens += 1
            req.last_token_ids = (token,)
            if req.num_tokens >= req.length_cap_at or token in req.stop_token_ids:
                stopped.append(req)
        return stopped

    # ------------------------------------------------------------------ general rules

    def _result_ok(self, result: StepResult, scheduled: list[Request], codes: list[int]) -> bool:
        """Whether ``result`` surely passes the protocol's checks of the
        sampled tokens and the drafts (spec/protocol.py, check_sampled and
        check_drafts), in one pass over the plan's requests and codes (the
        oldest plan in flight). False means "not sure": the protocol's own
        check then raises its error, or finds it valid after all."""
        sampled = result.sampled
        drafts = result.draft_token_ids
        if sampled.__class__ is not dict or (drafts and drafts.__class__ is not dict):
            return False
        get_tokens = sampled.get
        get_drafts = drafts.get if drafts else None
        num_spec = self._num_spec_tokens
        base = num_spec + 2
        requests = self._requests
        present = 0
        with_drafts = 0
        for req, code in zip(scheduled, codes):
            request_id = req.request_id
            tokens = get_tokens(request_id)
            most = code % base  # 1 + drafts; 0: a partial prefill chunk
            if tokens is None:
                if most and request_id in requests:
                    return False
            else:
                present += 1
                if tokens.__class__ is not tuple:
                    return False
                count = len(tokens)
                if count == 1:  # (the common case, without the loop)
                    token = tokens[0]
                    if token.__class__ is not int or token < 0:
                        return False
                    if not most and request_id in requests:
                        return False
                else:
                    for token in tokens:
                        if token.__class__ is not int or token < 0:
                            return False
                    if (count > most or not count) if most else count:
                        if request_id in requests:  # a request finished meanwhile may get anything well-formed
                            return False
            if get_drafts is not None:
                proposed = get_drafts(request_id)
                if proposed is not None:
                    with_drafts += 1
                    if proposed.__class__ is not tuple or len(proposed) > num_spec:
                        return False
                    for token in proposed:
                        if token.__class__ is not int or token < 0:
                            return False
                    if proposed and not most:
                        return False  # drafts after a partial prefill chunk
        if present != len(sampled):
            return False  # tokens for a request the plan did not schedule
        if get_drafts is not None and with_drafts != len(drafts):
            return False  # drafts for a request the plan did not schedule
        return True

    def _apply_stale(self, req: Request, num_scheduled: int, tokens: tuple[int, ...]) -> bool:
        """The output of a step scheduled before ``req`` was last preempted:
        drained from its stale share; dropped after a reset, else appended
        with the stop checks, leaving the computed tokens, the placeholders
        and the keys alone (they were reset by the preemption). Returns
        whether it stopped a running request."""
        req.num_stale_output_tokens -= num_scheduled
        if req.drop_stale_output:
            return False
        if req.mm_inputs and self._encoder_cache is not None:
            self._encoder_done(req)
        if not tokens:
            return False
        was_running = req.status is RUNNING
        output = req.output
        num_tokens = req.num_tokens
        finished: RequestStatus | None = None
        for token in tokens:
            output.append(token)
            num_tokens += 1
            if token in req.stop_token_ids:
                finished = STOPPED
                break
            if num_tokens >= req.length_cap_at:
                finished = LENGTH_CAPPED
                break
        if req.grammar_rejects and not req.grammar_rejects.isdisjoint(output[req.num_tokens - req.num_prompt_tokens :]):
            finished = ERROR  # a token its grammar refuses: the request errs
        req.num_tokens = num_tokens
        req.last_token_ids = (output[-1],)
        if finished is None:
            return False
        if not was_running:
            self._unqueue(req)  # a stale output stopped a preempted request
        if self._live_sessions and req.spec.resumable and finished is not ERROR and not self._handle_stopped(req):
            self._continuing.append(req)  # a session goes on (impl/sessions.py)
            return was_running
        self._finish(req, finished)
        return was_running


    @staticmethod
    def _set_drafts(req: Request, drafts: tuple[int, ...]) -> None:
        """update_draft_token_ids for one unfinished request: none after a
        partial prefill chunk; its grammar keeps those before the first
        refused one."""
        if req.is_prefill_chunk:
            req.spec_token_ids = NO_TOKENS
        elif req.grammar_rejects and not req.grammar_rejects.isdisjoint(drafts):
            rejects = req.grammar_rejects
            cut = 0
            while drafts[cut] not in rejects:
                cut += 1
            req.spec_token_ids = drafts[:cut]
        else:
            req.spec_token_ids = drafts

    def _finish_grammar_errors(self, failed_loads: AbstractSet[str] | None = None) -> None:
        """The requests whose grammar failed, as the WAITING loops since the
        last update found them, and under kv_load_failure_policy "fail" those
        whose KV load failed, finish with FINISHED_ERROR, in id order."""
        errors, self._grammar_errors = self._grammar_errors, set()
        if failed_loads:
            errors |= failed_loads
        for request_id in sorted(errors):
            req = self._requests.get(request_id)
            if req is None:
                continue  # aborted meanwhile
            self._finish_request(req, ERROR)

    def _update_general(self, plan: StepPlan, result: StepResult) -> None:
        """update() with async scheduling, speculative decoding or a gate:
        the checks and the connector's reports, then each entry in plan
        order (``_apply_output``), then the grammars and loads that failed.
        The entry almost every step has (a running request's tokens that do
        not finish it) is written out in the loop: about 0.5 us an entry less than
        ``_apply_output`` (docs/impl.md, "The steady entry in update")."""
        check_update(plan, self._inflight, result)
        scheduled = self._inflight_reqs[0]
        codes = self._inflight_codes[0]
        if not self._result_ok(result, scheduled, codes):
            check_sampled(plan, result, self._requests, self._config)  # raises the spec's error
        # the KV connector's reports: the requests whose output is skipped
        failed = self._kv_reports(plan, result) if self._connector else _NO_FAILED
        if self._log_stats and self._num_spec_tokens:
            self._stats_drafts(plan, result, failed)
        late_drafts: list[Request] = []
        base = self._num_spec_tokens + 2
        get_request = self._requests.get
        get_tokens = result.sampled.get
        keyed_after = self._caching
        speculative = self._num_spec_tokens > 0
        # Drafts proposed after the step (sync speculative decoding): each
        # request that is still unfinished once its entry is applied takes
        # its own (none after a partial prefill chunk). Applying them entry by
        # entry equals applying them after the loop: an entry changes only its
        # own request, and every drafted request has an entry (checked above).
        drafted = result.draft_token_ids if not self._async else None
        get_drafts = drafted.get if drafted else None
        gated = self._gated
        any_stopped = False
        for r, code in zip(scheduled, codes):
            if failed and r.request_id in failed:
                # a failed or truncated KV load: its output of this step is skipped
                self._skip_output(r, code // base, get_drafts, late_drafts)
                continue
            if r.status is RUNNING:
                # A running request with nothing stale and no gate of
                # update's to apply, whose tokens neither stop it nor reach
                # its length cap (almost every entry): written out here.
                tokens = get_tokens(r.request_id, NO_TOKENS)
                count = len(tokens)
                num_tokens = r.num_tokens + count
                if (
                    count
                    and num_tokens < r.length_cap_at
                    and not r.num_stale_output_tokens
                    and (tokens[0] not in r.stop_token_ids if count == 1 else r.stop_token_ids.isdisjoint(tokens))
                    and not (gated and (r.mm_inputs or r.grammar_rejects))
                ):
                    num_scheduled = code // base
                    r.num_in_flight_tokens -= num_scheduled
                    rejected = code - num_scheduled * base - count  # drafts rejected
                    if rejected:  # computed tokens (and placeholders) roll back
                        r.num_computed_tokens -= rejected
                        if r.num_output_placeholders > 0:
                            r.num_output_placeholders -= rejected
                    if count == 1:
                        r.output.append(tokens[0])
                        r.last_token_ids = tokens
                    else:
                        r.output.extend(tokens)
                        r.last_token_ids = tokens[-1:]
                    r.num_tokens = num_tokens
                    placeholders = r.num_output_placeholders
                    if placeholders > 0:
                        r.num_output_placeholders = placeholders - count
                    if keyed_after and (placeholders > 0 or speculative):
                        verified = r.num_computed_tokens - r.num_in_flight_tokens
                        if verified > num_tokens:  # only known tokens have keys (after a failed load)
                            verified = num_tokens
                        if verified >= r.next_full_at:
                            self._register(r, verified)
                    if get_drafts is not None:
                        drafts = get_drafts(r.request_id)
                        if drafts is not None:
                            if r.is_prefill_chunk or r.grammar_rejects:
                                self._set_drafts(r, drafts)
                            else:
                                r.spec_token_ids = drafts
                    continue
                req = r
            else:
                found = get_request(r.request_id)
                if found is None:
                    continue  # finished (aborted, or stopped) while the step ran
                req = found
            outcome = self._apply_output(req, code, get_tokens(req.request_id, NO_TOKENS))
            if outcome is _UNFINISHED:
                if get_drafts is not None:
                    drafts = get_drafts(req.request_id)
                    if drafts is not None:
                        self._set_drafts(req, drafts)
            elif outcome is _STOPPED_RUNNING:
                any_stopped = True
            elif outcome is _CONTINUED:
                any_stopped = True
                if get_drafts is not None:
                    drafts = get_drafts(req.request_id)
                    if drafts is not None:
                        self._set_drafts(req, drafts)
        if self._live_sessions and speculative and not self._async:
            self._clear_unproposed(scheduled, result.draft_token_ids)  # impl/sessions.py
        self._after_update(failed, result, late_drafts, any_stopped)

    def _after_update(
        self, failed: AbstractSet[str], result: StepResult, late_drafts: list[Request], any_stopped: bool
    ) -> None:
        """After the entries: the running queue loses the finished, the
        failed grammars (and under kv_load_failure_policy "fail" the failed
        loads) finish, the connector's finished transfers are applied, and
        the plan leaves the in-flight list."""
        if any_stopped:
            self._running = [r for r in self._running if r.status is RUNNING]
        if self._continuing:
            self._enqueue_continuing()
        if failed and self._fail_policy:
            self._finish_grammar_errors(failed)
        elif self._grammar_errors:
            self._finish_grammar_errors()
        if self._connector:
            self._kv_finished(result)
            drafted = result.draft_token_ids
            for req in late_drafts:
                if self._requests.get(req.request_id) is req:
                    self._set_drafts(req, drafted[req.request_id])
        del self._inflight[0]
        del self._inflight_reqs[0]
        del self._inflight_codes[0]

    def _skip_output(self, r: Request, num_scheduled: int, get_drafts: Any, late_drafts: list[Request]) -> None:
        """A failed or truncated KV load: the entry's output is skipped; its
        drafts are applied after the errors finish."""
        req = r if r.status is RUNNING else self._requests.get(r.request_id)
        if req is None:
            return
        req.num_in_flight_tokens -= num_scheduled
        if req.num_stale_output_tokens > 0:
            req.num_stale_output_tokens -= num_scheduled
        if get_drafts is not None and get_drafts(req.request_id) is not None:
            late_drafts.append(req)

    def _apply_output(self, req: Request, code: int, tokens: tuple[int, ...]) -> object:
        """One entry's output, by the general rules: its in-flight tokens
        drained (a stale output drained from the stale share), rejected drafts
        rolled back, the tokens appended with the stop checks, placeholders
        consumed, the blocks the verified tokens filled keyed. Returns
        _UNFINISHED, _STOPPED_RUNNING (it finished a running request) or
        _FINISHED (it finished a waiting or preempted one)."""
        was_running = req.status is RUNNING
        base = self._num_spec_tokens + 2
        num_scheduled = code // base
        req.num_in_flight_tokens -= num_scheduled
        if req.num_stale_output_tokens > 0:
            stopped = self._apply_stale(req, num_scheduled, tokens)
            status = req.status
            if status is RUNNING or status is PREEMPTED or status is WAITING or status is WAITING_FOR_STREAMING:
                return _CONTINUED if req in self._continuing else _UNFINISHED
            return _STOPPED_RUNNING if stopped else _FINISHED  # the stale output finished it
        encoder_on = self._encoder_cache is not None
        if not tokens:
            if encoder_on and req.mm_inputs:
                self._encoder_done(req)  # a partial chunk: only once the step has run
            return _UNFINISHED
        sampled_most = code - num_scheduled * base  # 1 + the entry's drafts (it samples)
        num_drafts = sampled_most - 1 if sampled_most else 0
        if num_drafts and num_drafts + 1 != len(tokens):
            # rejected drafts: computed tokens (and placeholders) roll back
            rejected = num_drafts + 1 - len(tokens)
            if req.num_computed_tokens > 0:
                req.num_computed_tokens -= rejected
            if req.num_output_placeholders > 0:
                req.num_output_placeholders -= rejected
        if encoder_on and req.mm_inputs:
            self._encoder_done(req)  # only once the step has run
        num_before = req.num_tokens
        placeholders = req.num_output_placeholders
        finished = self._append_tokens(req, tokens)
        if req.grammar_rejects and not req.grammar_rejects.isdisjoint(req.output[num_before - req.num_prompt_tokens :]):
            finished = ERROR  # a token its grammar refuses: the request errs
        if placeholders > 0:
            req.num_output_placeholders = placeholders - len(tokens)
        if self._caching and was_running and (placeholders > 0 or self._num_spec_tokens > 0):
            verified = min(req.num_computed_tokens - req.num_in_flight_tokens, req.num_tokens)
            if verified >= req.next_full_at:  # only known tokens have keys (after a failed load)
                self._register(req, verified)
        if finished is None:
            return _UNFINISHED
        if not was_running:
            self._unqueue(req)
        if self._live_sessions and req.spec.resumable and finished is not ERROR and not self._handle_stopped(req):
            self._continuing.append(req)  # a session goes on (impl/sessions.py)
            return _CONTINUED
        self._finish(req, finished)
        return _STOPPED_RUNNING if was_running else _FINISHED

    @staticmethod
    def _append_tokens(req: Request, tokens: tuple[int, ...]) -> RequestStatus | None:
        """Append a step's tokens with a stop check after each; a stop inside
        an accepted run drops the rest (and its computed tokens). Returns the
        finishing status, if any."""
        output = req.output
        num_tokens = req.num_tokens
        stop = req.stop_token_ids
        finished: RequestStatus | None = None
        count = len(tokens)
        if count == 1:
            token = tokens[0]
            output.append(token)
            num_tokens += 1
            req.last_token_ids = tokens
            if token in stop:
                finished = STOPPED
            elif num_tokens >= req.length_cap_at:
                finished = LENGTH_CAPPED
        elif num_tokens + count < req.length_cap_at and stop.isdisjoint(tokens):
            # no token of the run stops it: appended at once
            output.extend(tokens)
            num_tokens += count
            req.last_token_ids = tokens[-1:]
        else:
            length_cap_at = req.length_cap_at
            kept = 0
            for token in tokens:
                output.append(token)
                num_tokens += 1
                kept += 1
                if token in stop:
                    finished = STOPPED
                    break
                if num_tokens >= length_cap_at:
                    finished = LENGTH_CAPPED
                    break
            req.last_token_ids = (output[-1],)
            if finished is not None:
                req.num_computed_tokens -= count - kept
        req.num_tokens = num_tokens
        return finished
