"""Invariants of async scheduling and speculative decoding: output
placeholders, steps in flight, drafts.

The plans in flight are read from ``Transition.in_flight`` (the plans
awaiting update() after the operation, which the driver fills in); an
entry of an in-flight plan is *stale* for a request preempted after the plan
was made (vllm/v1/core/sched/scheduler.py, _preempt_request:
``num_stale_output_tokens = num_in_flight_tokens``). A preempted request is
re-admitted only once its stale output is drained, or at once when
reset_prefix_cache preempted it and its stale output is dropped; so for a
running request every in-flight entry before its latest admission entry is
stale, and for a waiting or preempted one every in-flight entry is.
"""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import (
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    StepPlan,
)

from schedspec.invariants._util import cdiv, kv_load_failed, lookup, session_went_on
from schedspec.invariants.core import Finding, History, Transition, transition_invariant

_S = RequestStatus
_QUEUED = (_S.WAITING, _S.PREEMPTED, _S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, _S.WAITING_FOR_STREAMING_REQ)


def live_entries(r: RequestView, in_flight: tuple[StepPlan, ...]) -> list[ScheduledRequest]:
    """The entries of ``r`` in the plans in flight that are not stale: none
    for a queued request; for a running one, those from its latest admission
    entry on (all of them if that admission has been updated already)."""
    if r.status in _QUEUED:
        return []
    found: list[ScheduledRequest] = []
    for plan in in_flight:
        e = plan.get(r.request_id)
        if e is None:
            continue
        if e.kind != ScheduleKind.RUNNING:
            found = []  # an admission: what came before belongs to an earlier life
        found.append(e)
    return found


def kept_tokens(r: RequestView, toks: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
    """The tokens update() appends to ``r`` from a result: all of them, or up
    to and including the first after which check_stop stops the request
    (vllm/v1/core/sched/scheduler.py, _update_request_with_output;
    sched/utils.py, check_stop)."""
    for i, tok in enumerate(toks, 1):
        eos = r.spec.eos_token_id is not None and not r.spec.ignore_eos and tok == r.spec.eos_token_id
        stop = eos or tok in r.spec.stop_token_ids
        if stop or len(r.output_token_ids) + i >= r.spec.max_tokens or r.num_tokens + i >= max_model_len:
            return tuple(toks[:i])
    return tuple(toks)


@transition_invariant(
    "placeholders-match-in-flight",
    "A request's num_output_placeholders is never negative and equals the output tokens of its "
    "steps in flight: 1 + the drafts of each in-flight entry that samples, not stale (async "
    "scheduling); 0 without async scheduling and for a waiting or preempted request.",
    "vllm/v1/core/sched/async_scheduler.py, AsyncScheduler._update_after_schedule "
    "(num_output_placeholders += 1 + len(scheduled spec tokens)); scheduler.py, update_from_output "
    "(-= num_rejected) and _update_request_with_output (-= the returned tokens); "
    "_preempt_request (= 0). PRs #38624, #47900, #48245, #57562 fixed counts gone negative. With a "
    "KV connector, a failed load's update skips the request's output and keeps that step's "
    "placeholder, so a request with an external prefix may count more.",
    tags=("safety",),
)
def placeholders_match_in_flight(t: Transition, h: History) -> Iterator[Finding]:
    is_async = t.after.config.async_scheduling
    for rid, r in t.after.requests.items():
        p = r.num_output_placeholders
        if p < 0:
            yield rid, f"num_output_placeholders is {p}"
            continue
        want = 0
        if is_async:
            want = sum(1 + len(e.spec_token_ids) for e in live_entries(r, t.in_flight) if e.samples)
        if p > want and t.after.config.kv_connector and r.spec.kv_external_tokens:
            # a failed KV load's update skips the request's output and leaves
            # the placeholder of that step counted (update_from_output:
            # failed_kv_load_req_ids continue before _update_request_with_output)
            continue
        if p != want:
            steps = [plan.step for plan in t.in_flight if plan.get(rid) is not None]
            yield rid, (
                f"{r.status.name} with {p} output placeholders after {t.kind}, but its steps in "
                f"flight {steps} will produce {want} output tokens"
            )


@transition_invariant(
    "within-max-model-len-with-lookahead",
    "No request computes past max_model_len, drafts and lookahead included: every entry ends at "
    "most at max_model_len - 1 (a slot stays for the sampled token), every request's computed "
    "count stays below max_model_len, and no block table exceeds cdiv(max_model_len, block_size).",
    "vllm/v1/core/sched/scheduler.py, schedule(): num_new_tokens <= max_model_len - "
    "num_computed_tokens - num_sampled_tokens_per_step (RUNNING loop), padding only when "
    "num_computed_tokens + 1 + k + 1 <= max_model_len (WAITING loop); kv_cache_manager.py, "
    "allocate_slots: num_tokens_need_slot = min(... + num_lookahead_tokens, max_model_len). "
    "PRs #53812, #53962 fixed padding past max_model_len.",
    tags=("safety",),
)
def within_max_model_len_with_lookahead(t: Transition, h: History) -> Iterator[Finding]:
    cfg = t.after.config
    mml = cfg.max_model_len
    most_blocks = cdiv(mml, cfg.block_size)
    for rid, r in t.after.requests.items():
        if r.num_computed_tokens > mml - 1:
            yield rid, f"{r.num_computed_tokens} computed tokens, max_model_len is {mml}"
        if len(r.block_ids) > most_blocks:
            yield rid, f"holds {len(r.block_ids)} blocks, max_model_len {mml} needs at most {most_blocks}"
    if t.kind == "schedule" and t.plan is not None:
        for e in t.plan.scheduled:
            end = e.num_computed_tokens + e.num_scheduled_tokens
            if end > mml - 1:
                yield e.request_id, (
                    f"entry computes positions up to {end} ({len(e.spec_token_ids)} drafts), leaving no "
                    f"slot for the sampled token within max_model_len {mml}"
                )


@transition_invariant(
    "preempted-carries-no-drafts",
    "A waiting or preempted request holds no drafts and no output placeholders: preemption drops "
    "both, and an admission schedules no drafts of its past (only the -1 padding of a new decode).",
    "vllm/v1/core/sched/scheduler.py, _preempt_request: spec_token_ids = [], "
    "num_output_placeholders = 0 (PR #31955: spec tokens kept across preemption); the WAITING "
    "loop's pad_spec_decode schedules [-1] * num_spec_tokens.",
    tags=("safety",),
)
def preempted_carries_no_drafts(t: Transition, h: History) -> Iterator[Finding]:
    for rid, r in t.after.requests.items():
        if r.status in _QUEUED and (r.spec_token_ids and not r.spec.resumable or r.num_output_placeholders):
            # (a session that went on keeps the drafts proposed after its stop: sessions.py)
            yield rid, (
                f"{r.status.name} with drafts {list(r.spec_token_ids)} and "
                f"{r.num_output_placeholders} output placeholders"
            )
    if t.kind == "schedule" and t.plan is not None:
        for e in t.plan.scheduled:
            if e.kind != ScheduleKind.RUNNING and any(tok != -1 for tok in e.spec_token_ids):
                yield e.request_id, f"{e.kind.name} entry verifies drafts {list(e.spec_token_ids)} of its past"


@transition_invariant(
    "drafts-bounded",
    "At most num_speculative_tokens drafts per request and per entry (none with speculative "
    "decoding off), only in entries that sample; a running entry verifies a prefix of the drafts "
    "the request held; with async scheduling the drafts a request holds are -1 placeholders.",
    "vllm/v1/core/sched/scheduler.py, schedule(): scheduled_spec_decode_tokens[req_id] = "
    "spec_token_ids[:num_scheduled_spec_tokens], set only when num_scheduled_spec_tokens > 0; "
    "async_scheduler.py, _update_after_schedule: spec_token_ids = [-1] * num_spec_tokens.",
    tags=("safety",),
)
def drafts_bounded(t: Transition, h: History) -> Iterator[Finding]:
    cfg = t.after.config
    k = cfg.num_speculative_tokens
    for rid, r in t.after.requests.items():
        if len(r.spec_token_ids) > k:
            yield rid, f"holds {len(r.spec_token_ids)} drafts, num_speculative_tokens is {k}"
        if cfg.async_scheduling and any(tok != -1 for tok in r.spec_token_ids):
            yield rid, f"holds draft ids {list(r.spec_token_ids)} under async scheduling (placeholders are -1)"
    if t.kind == "schedule" and t.plan is not None:
        for e in t.plan.scheduled:
            if len(e.spec_token_ids) > k:
                yield e.request_id, f"entry verifies {len(e.spec_token_ids)} drafts, num_speculative_tokens is {k}"
            if e.spec_token_ids and not e.samples:
                yield e.request_id, f"entry verifies drafts {list(e.spec_token_ids)} in a partial prefill chunk"
            b = t.before.requests.get(e.request_id)
            if e.kind == ScheduleKind.RUNNING and b is not None:
                held = b.spec_token_ids
                if e.spec_token_ids != held[: len(e.spec_token_ids)]:
                    yield e.request_id, (
                        f"entry verifies drafts {list(e.spec_token_ids)}, the request held {list(held)}"
                    )


@transition_invariant(
    "spec-tokens-in-budget",
    "Drafts are scheduled tokens: an entry verifying d drafts schedules them as its last d tokens "
    "(computed + scheduled = known + placeholders + d), and the step's tokens, drafts included, "
    "stay within max_num_batched_tokens.",
    "vllm/v1/core/sched/scheduler.py, schedule(): num_new_tokens = num_tokens_with_spec + "
    "num_output_placeholders - num_computed_tokens is taken from token_budget (draft_slots is 0 "
    "for the ngram method); num_scheduled_spec_tokens = num_new_tokens + num_computed_tokens - "
    "num_tokens - num_output_placeholders.",
    ("schedule",),
    tags=("safety",),
)
def spec_tokens_in_budget(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    budget = t.before.config.max_num_batched_tokens
    total = t.plan.total_num_scheduled_tokens
    drafts = sum(len(e.spec_token_ids) for e in t.plan.scheduled)
    if total > budget:
        yield None, f"step {t.plan.step} schedules {total} tokens ({drafts} of them drafts), budget {budget}"
    for e in t.plan.scheduled:
        d = len(e.spec_token_ids)
        if not d:
            continue
        end = e.num_computed_tokens + e.num_scheduled_tokens
        want = e.num_tokens + e.num_output_placeholders + d
        if end != want or e.num_scheduled_tokens < d:
            yield e.request_id, (
                f"entry schedules {e.num_scheduled_tokens} tokens from {e.num_computed_tokens} with "
                f"{d} drafts: it should end at known {e.num_tokens} + placeholders "
                f"{e.num_output_placeholders} + drafts {d} = {want}, not {end}"
            )


@transition_invariant(
    "in-flight-output-delivered-once",
    "No token is lost or duplicated across steps in flight, preemption and abort: update() "
    "appends to each request of the plan exactly its result's tokens up to a stop, unless the "
    "request is gone (aborted or finished meanwhile) or the entry is stale; stale output goes to "
    "a preempted request whole or not at all, never to one re-admitted since (it recomputes "
    "those positions); requests outside the plan keep their output.",
    "vllm/v1/core/sched/scheduler.py, update_from_output: request None or finished: continue; "
    "num_stale_output_tokens drained per step, drop_stale_output discards it; "
    "_update_request_with_output trims after a stop; the WAITING loop skips a request with "
    "deliverable stale output (skip_request). PR #28787 fixed a truncated history under async + "
    "preemption, #42043 a dropped first token.",
    ("update",),
    tags=("safety",),
)
def in_flight_output_delivered_once(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    sampled = t.result.sampled if t.result is not None else {}
    mml = t.before.config.max_model_len
    failed = kv_load_failed(t)
    for rid, b in t.before.requests.items():
        a = lookup(t.after, rid)
        if a is None:
            continue
        if session_went_on(b, a):
            continue  # a session stopped and went on (sessions.py: session-continuation)
        got = a.output_token_ids[len(b.output_token_ids):]
        if rid in failed and not got:
            continue  # a failed KV load's request gets no output (update_from_output skips it)
        if a.output_token_ids[: len(b.output_token_ids)] != b.output_token_ids:
            yield rid, f"output {list(b.output_token_ids)} became {list(a.output_token_ids)}"
            continue
        e = t.plan.get(rid)
        if e is None or not e.samples:
            if got:
                yield rid, f"got tokens {list(got)} from a step that samples none for it"
            continue
        kept = kept_tokens(b, tuple(sampled.get(rid, ())), mml)
        readmitted = b.status == _S.RUNNING and any(
            (x := p.get(rid)) is not None and x.kind != ScheduleKind.RUNNING for p in t.in_flight
        )
        if b.status in _QUEUED:
            if got not in (kept, ()):
                yield rid, f"stale output {list(kept)} of a preempted request arrived as {list(got)}"
        elif readmitted:
            if got:
                yield rid, (
                    f"stale output {list(got)} delivered to a request re-admitted since: the positions "
                    "it recomputes get a second token"
                )
        elif got != kept:
            yield rid, f"appended {list(got)} from result {list(sampled.get(rid, ()))}, want {list(kept)}"


@transition_invariant(
    "verified-frontier",
    "After an update, a running request whose step sampled has computed every known token but the "
    "last (the bonus token): num_computed_tokens - num_output_placeholders = num_tokens - 1, so "
    "rejected drafts and the tokens trimmed after a stop are no longer counted as computed.",
    "vllm/v1/core/sched/scheduler.py, update_from_output: num_computed_tokens -= num_rejected "
    "(and num_output_placeholders -= num_rejected); _update_request_with_output: "
    "num_computed_tokens -= len(new_token_ids) - num_new at a stop, num_output_placeholders -= "
    "the returned tokens. PR #53962 fixed a negative token count the step after a padded draft.",
    ("update",),
    tags=("safety",),
)
def verified_frontier(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    failed = kv_load_failed(t)
    for e in t.plan.scheduled:
        if not e.samples or e.request_id in failed:
            continue  # (a failed KV load truncates the computed tokens instead)
        a = t.after.requests.get(e.request_id)
        b = t.before.requests.get(e.request_id)
        if a is None or b is None or a.status != _S.RUNNING or b.status != _S.RUNNING:
            continue  # finished, aborted, or preempted since: nothing verified to compare
        if any((x := p.get(a.request_id)) is not None and x.kind != ScheduleKind.RUNNING for p in t.in_flight):
            continue  # re-admitted since the step was scheduled: its output was stale
        if (
            t.after.config.kv_connector
            and e.request_id in h.loads
            and b.num_computed_tokens < e.num_computed_tokens + e.num_scheduled_tokens
        ):
            # async scheduling: an earlier update found this request's KV load
            # failed and truncated its computed tokens after this step was
            # scheduled (_update_requests_with_invalid_blocks); vLLM still
            # appends this step's sample (failed_kv_load_req_ids is that
            # update's own), ahead of the tokens it recomputes
            continue
        frontier = a.num_computed_tokens - a.num_output_placeholders
        if frontier != a.num_tokens - 1:
            yield a.request_id, (
                f"after step {t.plan.step} it has {a.num_computed_tokens} computed tokens and "
                f"{a.num_output_placeholders} placeholders for {a.num_tokens} known: the verified "
                f"frontier is {frontier}, want {a.num_tokens - 1}"
            )
