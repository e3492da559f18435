"""Streaming-input sessions (resumable requests; spec/sessions.py): the
invariants that hold whatever sessions a workload sends.

- request-in-one-queue: every unfinished request is in exactly one queue
  (vLLM's upstream bugs: a running request left in the waiting queue, a
  request in two queues after a streaming request update);
- stream-input-not-early: no plan computes a position past the tokens a
  request has (so a chunk is never scheduled before it arrives), and a
  streaming request waiting for input is not scheduled;
- dropped-token-not-computed: the last sampled token of a finished chunk,
  which the next chunk drops, is never counted as computed;
- stream-liveness: with sessions waiting, the scheduler does not stall
  while the waiting loop could admit the request at its head (free blocks
  and a free slot), for more than SESSION_STALL_BOUND steps.
"""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import PauseState, RequestStatus, SchedulerView

from schedspec.invariants._util import admission_candidate, cdiv, lookup, session_went_on
from schedspec.invariants.core import Finding, History, Transition, state_invariant, transition_invariant
from schedspec.invariants.inflight import kept_tokens

_WFS = RequestStatus.WAITING_FOR_STREAMING_REQ

#: The bound of stream-liveness: empty steps in a row while the head of the
#: waiting queue could be admitted.
SESSION_STALL_BOUND = 32


@state_invariant(
    "request-in-one-queue",
    "Every unfinished request is in exactly one queue, waiting or running, once; a streaming request "
    "waiting for input is waiting, never running.",
    "vllm/v1/core/sched/scheduler.py: update_from_output removes the stopped requests from their "
    "queues before it enqueues the sessions that go on (continuing_reqs, _enqueue_waiting_request); "
    "add_request for an existing streaming request queues or applies the update in place and enqueues nothing.",
    tags=("safety",),
)
def request_in_one_queue(v: SchedulerView) -> Iterator[Finding]:
    seen: dict[str, int] = {}
    for rid in (*v.waiting, *v.running):
        seen[rid] = seen.get(rid, 0) + 1
    for rid, r in v.requests.items():
        n = seen.get(rid, 0)
        if n != 1:
            yield rid, f"{r.status.name} request is in {n} queues"
        if r.status == _WFS and rid in v.running:
            yield rid, "waits for input but is in the running queue"


@transition_invariant(
    "stream-input-not-early",
    "No plan entry computes a position past its request's known tokens (the prompt with the chunks "
    "that arrived, and the outputs) plus its output placeholders and drafts: a streaming request's next chunk "
    "is never scheduled before it arrives; a streaming request waiting for input is not scheduled.",
    "vllm/v1/core/sched/scheduler.py, schedule(): num_new_tokens = num_tokens_with_spec + "
    "num_output_placeholders - num_computed_tokens; _handle_blocked_waiting_request passes over "
    "WAITING_FOR_STREAMING_REQ; add_request applies a chunk only when it arrives.",
    ("schedule",),
    tags=("safety",),
)
def session_input_not_early(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    for s in t.plan.scheduled:
        b = lookup(t.before, s.request_id)
        if b is None or not b.spec.resumable:
            continue
        if b.status == _WFS:
            yield s.request_id, "scheduled while it waits for input (WAITING_FOR_STREAMING_REQ)"
            continue
        known = b.num_tokens + b.num_output_placeholders + len(s.spec_token_ids)
        end = s.num_computed_tokens + s.num_scheduled_tokens
        if end > known:
            yield s.request_id, (
                f"entry computes up to position {end}, past its {b.num_tokens} known tokens, "
                f"{b.num_output_placeholders} placeholders and {len(s.spec_token_ids)} drafts"
            )


@transition_invariant(
    "dropped-token-not-computed",
    "The last sampled token of a streaming request's chunk, which its next chunk drops, is never counted as "
    "computed: a streaming request waiting for input has computed at most all its tokens but the last, and "
    "when a chunk is applied at a stop its computed tokens stop before the dropped position, whose "
    "tokens before it are kept.",
    "vllm/v1/core/sched/scheduler.py, _handle_stopped_request (num_computed_tokens = "
    "num_computed_tokens - num_output_placeholders) and _update_request_as_session (keep_end = "
    "num_tokens - 1; assert keep_end >= num_computed_tokens).",
    tags=("safety",),
)
def dropped_token_not_computed(t: Transition, h: History) -> Iterator[Finding]:
    for rid, a in t.after.requests.items():
        if a.spec.resumable and a.status == _WFS and a.num_computed_tokens > a.num_tokens - 1:
            yield rid, f"waits for input with {a.num_computed_tokens} of its {a.num_tokens} tokens computed"
    if t.kind != "update" or t.result is None:
        return
    for rid, b in t.before.requests.items():
        w = lookup(t.after, rid)
        if w is None or not session_went_on(b, w) or w.status != RequestStatus.WAITING:
            continue
        mml = t.before.config.max_model_len
        old = b.all_token_ids + kept_tokens(b, tuple(t.result.sampled.get(rid, ())), mml)
        keep_end = len(old) - 1
        if w.num_computed_tokens > keep_end:
            yield rid, f"went on with {w.num_computed_tokens} computed tokens, the dropped token is at {keep_end}"
        if w.spec.prompt_token_ids[:keep_end] != old[:keep_end]:
            yield rid, f"went on with prompt {list(w.spec.prompt_token_ids)}, want it to start {list(old[:keep_end])}"


_STALLS = "_session_stalls"  # the count kept on the Monitor's History


@transition_invariant(
    "stream-liveness",
    f"With sessions waiting, no deadlock: the scheduler makes no more than {SESSION_STALL_BOUND} "
    "empty steps in a row, nothing in flight and unpaused, while the request the waiting loop "
    "reaches first could be admitted (a slot beside the running requests and the sessions waiting "
    "for input, and free blocks for its next token).",
    "vllm/v1/core/sched/scheduler.py, schedule(): the WAITING loop's num_running = len(running) + "
    "num_waiting_for_streaming_input; a streaming request waiting for input keeps its blocks "
    "(_handle_stopped_request). Upstream, a deadlock under KV pressure with sessions waiting (#49439).",
    ("schedule",),
    tags=("policy:vllm-liveness",),
)
def session_liveness(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    v = t.before
    cfg = v.config
    if t.plan.scheduled or len(t.in_flight) > 1 or not _admissible_head(v):
        setattr(h, _STALLS, 0)
        return
    if cfg.watermark or cfg.prefill_schedule_interval > 1 or cfg.kv_connector or v.pause_state != PauseState.UNPAUSED:
        return
    if not any(r.spec.resumable for r in v.requests.values()):
        return
    n = getattr(h, _STALLS, 0) + 1
    setattr(h, _STALLS, n)
    if n > SESSION_STALL_BOUND:
        yield None, f"{n} empty steps in a row while sessions wait and the head of the waiting queue could be admitted"


def _admissible_head(v: SchedulerView) -> bool:
    rid = admission_candidate(v)
    if rid is None:
        return False
    r = v.requests[rid]
    slots = len(v.running) + sum(1 for x in v.requests.values() if x.status == _WFS)
    if slots >= v.config.max_num_seqs:
        return False
    need = cdiv(r.num_tokens + 1, v.config.block_size) - len(r.block_ids) if not v.config.enable_chunked_prefill else 1
    return need <= v.kv.num_free_blocks
