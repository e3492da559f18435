"""Invariants of one schedule() call: budgets, the plan against the state,
admission and preemption order, progress and starvation."""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import (
    PauseState,
    Policy,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerView,
)

from schedspec.invariants._util import (
    admission_candidate,
    sessions_hold,
    waiting_order,
    admission_fits,
    admitted,
    block_key,
    cdiv,
    effective_threshold,
    holds_kv_blocks,
    is_prefix,
    kv_holding_prefix,
    queue_key,
    running_chunk,
    defers_frees,
    sliding_groups,
    tables,
    tables_extend,
    step_victims,
    victim_key,
)
from schedspec.invariants.core import Finding, History, Transition, TransitionKind, transition_invariant
from schedspec.invariants.mamba import aligned_away, aligned_want, aligns_chunks
from schedspec.invariants.inflight import live_entries
from schedspec.invariants.runner_v2 import throttled

_SCHED: tuple[TransitionKind, ...] = ("schedule",)
_KIND_FROM = {
    ScheduleKind.RUNNING: RequestStatus.RUNNING,
    ScheduleKind.NEW: RequestStatus.WAITING,
    ScheduleKind.RESUMED: RequestStatus.PREEMPTED,
}


@transition_invariant(
    "token-budget",
    "A step schedules at most max_num_batched_tokens tokens in all, and every scheduled "
    "request gets at least one.",
    "vllm/v1/core/sched/scheduler.py, schedule(): token_budget starts at "
    "max_num_scheduled_tokens (= max_num_batched_tokens) and each scheduled request's "
    "num_new_tokens (> 0; 0 means skip) is taken from it.",
    _SCHED,
    tags=("safety",),
)
def token_budget(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    budget = t.before.config.max_num_batched_tokens
    total = t.plan.total_num_scheduled_tokens
    if total > budget:
        yield None, f"step {t.plan.step} schedules {total} tokens, max_num_batched_tokens is {budget}"
    for s in t.plan.scheduled:
        if s.num_scheduled_tokens <= 0:
            yield s.request_id, f"scheduled with {s.num_scheduled_tokens} tokens"


@transition_invariant(
    "max-num-seqs-per-step",
    "A step schedules at most max_num_seqs requests.",
    "vllm/v1/worker/gpu_input_batch.py, InputBatch: max_num_reqs (= max_num_seqs) rows per step.",
    _SCHED,
    tags=("safety",),
)
def max_num_seqs_per_step(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    n, cap = len(t.plan.scheduled), t.before.config.max_num_seqs
    if n > cap:
        ids = ", ".join(s.request_id for s in t.plan.scheduled)
        yield None, f"step {t.plan.step} schedules {n} requests, max_num_seqs is {cap}: {ids}"


@transition_invariant(
    "long-prefill-threshold",
    "While more than one request is running or waiting at the start of a step, no request is "
    "given more than long_prefill_token_threshold tokens (when that is > 0).",
    "vllm/v1/core/sched/scheduler.py, schedule(): num_new_tokens is cut to "
    "long_prefill_token_threshold in both loops; the threshold is 0 when "
    "num_running + num_waiting <= 1.",
    _SCHED,
    tags=("safety",),
    requires=("long_prefill_threshold",),
)
def long_prefill_threshold(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    thr = effective_threshold(t.before)
    if thr <= 0:
        return
    for s in t.plan.scheduled:
        if s.num_scheduled_tokens > thr:
            yield s.request_id, (
                f"given {s.num_scheduled_tokens} tokens, long_prefill_token_threshold is {thr} "
                f"({len(t.before.running)} running + {len(t.before.waiting)} waiting)"
            )


@transition_invariant(
    "chunked-prefill-disabled",
    "With chunked prefill off (and no long-prefill threshold in force) every scheduled request "
    "is given all its remaining tokens: no partial prefill chunk, but one cut just before an "
    "encoder input, and the continuation of a request such a cut left mid-prompt (a running "
    "entry still inside the prompt, with an encoder input at or before its computed tokens), "
    "which the token budget may cut too.",
    "vllm/v1/core/sched/scheduler.py, schedule(), WAITING loop: without enable_chunked_prefill "
    "a request whose remaining tokens exceed the budget stops admission (break) instead of being "
    "chunked; config requires max_num_batched_tokens >= max_model_len then. "
    "_try_schedule_encoder_inputs cuts the chunk before an encoder input after that check, and "
    "the RUNNING loop never reads enable_chunked_prefill (num_new_tokens = min(..., token_budget)).",
    _SCHED,
    tags=("safety",),
)
def chunked_prefill_disabled(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.before.config
    if cfg.enable_chunked_prefill or cfg.long_prefill_token_threshold > 0:
        return
    for s in t.plan.scheduled:
        r = t.after.requests.get(s.request_id)
        end = s.num_computed_tokens + s.num_scheduled_tokens
        if r is not None and any(m.offset == end for m in r.spec.mm_inputs):
            # an encoder input beyond the encoder budget or cache cuts the
            # chunk before it, chunked prefill or not (_try_schedule_encoder_inputs)
            continue
        if (
            r is not None
            and s.kind == ScheduleKind.RUNNING
            and s.num_computed_tokens < len(r.spec.prompt_token_ids)
            and any(m.offset <= s.num_computed_tokens for m in r.spec.mm_inputs)
        ):
            # a request an encoder cut left mid-prompt: the RUNNING loop never
            # reads enable_chunked_prefill and cuts its continuation by the
            # token budget like any other
            continue
        if not s.samples:
            yield s.request_id, (
                f"given a partial chunk ({s.num_computed_tokens} + {s.num_scheduled_tokens} of "
                f"{s.num_tokens} tokens) with chunked prefill disabled"
            )


@transition_invariant(
    "scheduled-are-running",
    "Every scheduled request is scheduled once and is RUNNING and in the running queue after the step.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the RUNNING loop schedules members of "
    "self.running; the WAITING loop appends each admitted request to self.running with status RUNNING.",
    _SCHED,
    tags=("safety",),
)
def scheduled_are_running(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    seen: set[str] = set()
    running = set(t.after.running)
    for s in t.plan.scheduled:
        rid = s.request_id
        if rid in seen:
            yield rid, "scheduled twice in one step"
        seen.add(rid)
        r = t.after.requests.get(rid)
        if rid not in running or r is None or r.status != RequestStatus.RUNNING:
            where = "not unfinished" if r is None else f"status {r.status.name}"
            yield rid, f"scheduled but not running after the step ({where}, in running queue: {rid in running})"


@transition_invariant(
    "plan-entry-kinds",
    "Each entry's kind says what the request was before the step: RUNNING entries were RUNNING, "
    "NEW entries WAITING, RESUMED entries PREEMPTED (so the runner knows whose state to build).",
    "vllm/v1/core/sched/scheduler.py, schedule(): running requests go to scheduled_running_reqs, "
    "admitted ones to scheduled_new_reqs (status WAITING) or scheduled_resumed_reqs (status "
    "PREEMPTED); output.py, NewRequestData / CachedRequestData; a request whose KV load finished "
    "is promoted to WAITING or PREEMPTED first (_handle_blocked_waiting_request).",
    _SCHED,
    tags=("safety",),
)
def plan_entry_kinds(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    for s in t.plan.scheduled:
        b = t.before.requests.get(s.request_id)
        if b is None:
            yield s.request_id, f"scheduled as {s.kind.name} but was not an unfinished request"
            continue
        want = _KIND_FROM[s.kind]
        if b.status != want and not (
            # a grammar found compiled in this step's WAITING loop: admitted as NEW
            s.kind == ScheduleKind.NEW and b.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        ) and not (
            # a finished KV load promoted in this step's WAITING loop: WAITING,
            # or PREEMPTED if it was preempted before (_handle_blocked_waiting_request)
            b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and s.kind == (ScheduleKind.RESUMED if b.num_preemptions else ScheduleKind.NEW)
        ):
            yield s.request_id, f"scheduled as {s.kind.name} but its status was {b.status.name}"


@transition_invariant(
    "plan-order",
    "A plan lists the running requests first, in running-queue order, then the admissions.",
    "vllm/v1/core/sched/scheduler.py, schedule(): scheduled_running_reqs are filled in the order "
    "of self.running before the WAITING loop runs, which appends the admissions.",
    _SCHED,
    tags=("policy:vllm-step",),
)
def plan_order(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    seen_admission = False
    for s in t.plan.scheduled:
        if s.kind == ScheduleKind.RUNNING and seen_admission:
            yield s.request_id, "a RUNNING entry comes after an admission in the plan"
        seen_admission |= s.kind != ScheduleKind.RUNNING
    order = {rid: i for i, rid in enumerate(t.before.running)}
    positions = [order.get(s.request_id, -1) for s in t.plan.scheduled if s.kind == ScheduleKind.RUNNING]
    if positions != sorted(positions):
        ids = [s.request_id for s in t.plan.scheduled if s.kind == ScheduleKind.RUNNING]
        yield None, f"RUNNING entries {ids} are not in running-queue order {list(t.before.running)}"


@transition_invariant(
    "plan-matches-state",
    "Each entry's computed count, known tokens and block table match the request: after the step "
    "num_computed_tokens = computed before + scheduled and the table is the entry's, of at least "
    "cdiv(computed + scheduled, block_size) blocks, extending the old one; running requests left "
    "out keep their count and table; plan.step = view.step = previous step + 1.",
    "vllm/v1/core/sched/scheduler.py, schedule() / _make_cached_request_data (new_block_ids are "
    "appended) and _update_after_schedule (num_computed_tokens += num_scheduled_tokens); "
    "current_step += 1 on each call.",
    _SCHED,
    tags=("safety",),
)
def plan_matches_state(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    bs = t.before.config.block_size
    if t.plan.step != t.before.step + 1 or t.after.step != t.plan.step:
        yield None, f"plan.step {t.plan.step}, view step {t.before.step} before and {t.after.step} after"
    for s in t.plan.scheduled:
        rid = s.request_id
        b = t.before.requests.get(rid)
        a = t.after.requests.get(rid)
        if b is None or a is None:
            continue  # scheduled-are-running / plan-entry-kinds say so
        if s.num_tokens != b.num_tokens:
            yield rid, f"entry says {s.num_tokens} known tokens, the request had {b.num_tokens}"
        if s.kind == ScheduleKind.RUNNING:
            if s.num_computed_tokens != b.num_computed_tokens:
                yield rid, (
                    f"entry starts at {s.num_computed_tokens} computed tokens, the request had "
                    f"{b.num_computed_tokens}"
                )
            if not tables_extend(t.before.config, b, s):
                yield rid, f"block table {_tables_text(b)} was not extended but replaced by {_tables_text(s)}"
        done = s.num_computed_tokens + s.num_scheduled_tokens
        if a.num_computed_tokens != done:
            yield rid, (
                f"has {a.num_computed_tokens} computed tokens after the step, want "
                f"{s.num_computed_tokens} + {s.num_scheduled_tokens} = {done}"
            )
        if tables(a) != tables(s):
            yield rid, f"entry block table {_tables_text(s)} differs from the request's {_tables_text(a)}"
        if len(s.block_ids) < cdiv(done, bs):
            yield rid, f"entry holds {len(s.block_ids)} blocks for {done} tokens, needs at least {cdiv(done, bs)}"
    scheduled = set(t.plan.scheduled_ids)
    for rid in t.after.running:
        if rid in scheduled:
            continue
        b = t.before.requests.get(rid)
        a = t.after.requests.get(rid)
        if b is None or a is None:
            continue
        # (allocate_slots frees a sliding window's skipped blocks before it
        # finds no room: kv_cache_manager.py, remove_skipped_blocks)
        same = a.num_computed_tokens == b.num_computed_tokens and len(a.block_ids) == len(b.block_ids)
        if not (same and tables_extend(t.before.config, b, a)):
            yield rid, (
                f"not scheduled, yet its computed tokens/blocks changed from {b.num_computed_tokens}/"
                f"{_tables_text(b)} to {a.num_computed_tokens}/{_tables_text(a)}"
            )


def _tables_text(r: RequestView | ScheduledRequest) -> str:
    return str(list(r.block_ids)) if not r.group_block_ids else str([list(x) for x in r.group_block_ids])


@transition_invariant(
    "plan-blocks-exact",
    "Each entry's block table has exactly cdiv(computed + scheduled, block_size) blocks: vLLM "
    "allocates for the scheduled tokens only.",
    "vllm/v1/core/kv_cache_manager.py, allocate_slots(num_new_tokens, num_lookahead_tokens=0): "
    "the table grows to cdiv(num_computed_tokens + num_new_tokens, block_size) blocks.",
    _SCHED,
    tags=("policy:vllm-allocation",),
)
def plan_blocks_exact(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.before.config
    bs = cfg.block_size
    for s in t.plan.scheduled:
        done = s.num_computed_tokens + s.num_scheduled_tokens
        want = cdiv(min(done + cfg.num_lookahead_tokens, cfg.max_model_len), bs)
        b = t.before.requests.get(s.request_id)
        if b is not None and (s.kind == ScheduleKind.RUNNING or ((cfg.kv_connector or b.spec.resumable) and b.block_ids)):
            # a table keeps the blocks of drafts rejected since it grew, and
            # a request promoted after a KV connector load keeps the load's
            # table though a failure truncated its computed tokens, a session
            # that went on the table of its last chunk (the dropped token's slot)
            want = max(want, len(b.block_ids))
        if len(s.block_ids) != want:
            yield s.request_id, f"entry holds {len(s.block_ids)} blocks for {done} tokens, vLLM holds {want}"


@transition_invariant(
    "plan-token-ids",
    "Each entry's token_ids are the request's tokens at positions computed .. computed + "
    "scheduled - 1 (prompt then output).",
    "vllm/v1/core/sched/output.py, NewRequestData (prompt_token_ids, num_computed_tokens) / "
    "CachedRequestData.num_computed_tokens with SchedulerOutput.num_scheduled_tokens: the model "
    "runner computes the request's tokens from position num_computed_tokens on.",
    _SCHED,
    tags=("safety",),
)
def plan_token_ids(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    for s in t.plan.scheduled:
        b = t.before.requests.get(s.request_id)
        if b is None:
            continue
        c, n = s.num_computed_tokens, s.num_scheduled_tokens
        # then -1 per in-flight placeholder, then the drafts (interface.py, ScheduledRequest)
        seq = b.all_token_ids + (-1,) * s.num_output_placeholders + s.spec_token_ids
        want = seq[c : c + n]
        if s.token_ids != want or len(s.token_ids) != n:
            yield s.request_id, f"token_ids {list(s.token_ids)} are not tokens [{c}:{c + n}] = {list(want)}"


@transition_invariant(
    "computed-within-known",
    "A request never has more computed tokens than known tokens: computed <= num_tokens in every "
    "view, and computed + scheduled <= num_tokens in every plan entry.",
    "vllm/v1/core/sched/scheduler.py, schedule(): num_new_tokens = num_tokens_with_spec - "
    "num_computed_tokens at most (RUNNING loop), request.num_tokens - num_computed_tokens "
    "(WAITING loop); a prefix hit is capped at num_tokens - 1.",
    tags=("safety",),
)
def computed_within_known(t: Transition, h: History) -> Iterator[Finding]:
    cfg = t.after.config
    # Without async scheduling the drafts of each step in flight (at most
    # k, one step or a pipeline's) are computed but neither known nor
    # placeholders until its update; with it, the placeholders count them.
    drafts = 0 if cfg.async_scheduling else cfg.num_speculative_tokens * cfg.max_concurrent_batches
    for rid, r in t.after.requests.items():
        known = r.num_tokens + r.num_output_placeholders
        if not 0 <= r.num_computed_tokens <= known + drafts:
            yield rid, f"{r.num_computed_tokens} computed tokens, {r.num_tokens} known"
    if t.kind == "schedule" and t.plan is not None:
        for s in t.plan.scheduled:
            known = s.num_tokens + s.num_output_placeholders + len(s.spec_token_ids)
            if s.num_computed_tokens < 0 or s.num_computed_tokens + s.num_scheduled_tokens > known:
                yield s.request_id, (
                    f"entry computes {s.num_computed_tokens} + {s.num_scheduled_tokens} tokens of "
                    f"{s.num_tokens} known"
                )


@transition_invariant(
    "max-model-len",
    "An unfinished request has fewer than max_model_len tokens, and no entry computes past "
    "max_model_len (computed + scheduled <= max_model_len).",
    "vllm/v1/core/sched/scheduler.py, schedule(): num_new_tokens <= max_model_len - "
    "num_computed_tokens - 1 (a slot is kept for the sampled token); utils.py, check_stop finishes "
    "a request at num_tokens >= max_model_len; input_processor.py rejects prompts of "
    "max_model_len tokens or more.",
    tags=("safety",),
)
def max_model_len(t: Transition, h: History) -> Iterator[Finding]:
    mml = t.after.config.max_model_len
    for rid, r in t.after.requests.items():
        if r.num_tokens >= mml and r.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            # (a session capped by max_model_len waits for its end: sessions.py)
            yield rid, f"unfinished with {r.num_tokens} tokens, max_model_len is {mml}"
    if t.kind == "schedule" and t.plan is not None:
        for s in t.plan.scheduled:
            end = s.num_computed_tokens + s.num_scheduled_tokens
            if end > mml:
                yield s.request_id, f"entry computes up to position {end}, max_model_len is {mml}"


@transition_invariant(
    "cache-hit-identical-prefix",
    "An admission's computed tokens are a prefix-cache hit: a whole number of blocks, fewer than "
    "its known tokens (0 with caching off), and each hit block i was cached (before the step, or "
    "by another request scheduled in it whose block's last position this step or one of its steps "
    "in flight computes, or by a finished KV load promoted in it) under the request's own key (salt, "
    "tokens[:(i+1)*block_size]); with a synchronous KV load the hit is what precedes the loaded range.",
    "vllm/v1/core/kv_cache_manager.py, get_computed_blocks: find_longest_cache_hit matches the "
    "request's block hashes (salt and token prefix chained) against cached full blocks, capped at "
    "num_tokens - 1; allocate_slots touches those blocks and puts them first in the table.",
    _SCHED,
    tags=("safety",),
)
def cache_hit_identical_prefix(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    bs = t.before.config.block_size
    caching = t.before.config.enable_prefix_caching
    loads = {ld.request_id: ld for ld in t.plan.kv_loads}
    for s in admitted(t.plan):
        rid, c = s.request_id, s.num_computed_tokens
        b = t.before.requests.get(rid)
        if b is None:
            continue
        if b.num_computed_tokens:
            continue  # computed by a finished KV connector load (kv-load-consistent)
        if c == 0:
            continue
        if rid in loads:
            # a synchronous load: the hit is what precedes the loaded range
            if c >= s.num_tokens:
                yield rid, f"admitted with {c} computed tokens of {s.num_tokens}: at most {s.num_tokens - 1} may be"
            c = loads[rid].start
            if c == 0:
                continue
        if not caching:
            yield rid, f"admitted with {c} computed tokens while prefix caching is off"
            continue
        if c % bs != 0:
            yield rid, f"admitted with a hit of {c} tokens, not a whole number of {bs}-token blocks"
        if c >= s.num_tokens:
            yield rid, f"admitted with a hit of {c} tokens of {s.num_tokens}: at most {s.num_tokens - 1} may hit"
        # Blocks another request scheduled in this step keyed now: blocks
        # whose last position this step computes, or a step of that request
        # still in flight does (with async scheduling a block's last token
        # becomes known at the update of the step after the one computing it,
        # and allocate_slots keys it when the request is next scheduled; steps
        # run in order, so its KV exists when this step runs). An in-flight
        # step whose request's drafts were rejected since it was planned
        # computes its positions that many places earlier (the runner
        # rewinds to the accepted tokens), so the rewound places count too.
        others = {e.block_ids[j] for e in t.plan.scheduled if e.request_id != rid
                  for j in filled_places(e, t, bs)}
        others |= promoted_blocks(t)
        for i in range(min(c // bs, len(s.block_ids))):
            blk = s.block_ids[i]
            if blk == 0:
                continue  # a sliding-window group's skipped place (groups-prefix-hit-valid)
            want = block_key(b, i, bs, t.after.config.num_hash_lookahead_tokens)
            if t.after.kv.block_keys.get(blk) != want:
                yield rid, f"hit block {blk} (index {i}) does not carry the request's key after the step"
            elif t.before.kv.block_keys.get(blk) != want and blk not in others:
                yield rid, (
                    f"hit block {blk} (index {i}) was not cached under the request's key before the "
                    f"step, nor filled by another request in it"
                )


def promoted_blocks(t: Transition) -> set[int]:
    """Blocks a schedule() call caches as it promotes finished KV loads: the
    tables (every group's) of requests waiting for a load reported done
    before the call, up to their computed tokens (scheduler.py,
    _update_waiting_for_remote_kv -> cache_blocks); and the full blocks a
    synchronous load of the step fills (allocate_slots caches them with the
    external tokens counted computed; the load completes before the forward)."""
    bs = t.before.config.block_size
    out: set[int] = set()
    if t.plan is not None:
        for load in t.plan.kv_loads:
            if not load.asynchronous:
                tabs = load.group_block_ids or (load.block_ids,)
                out.update(
                    x for tab in tabs for j, x in enumerate(tab) if x and load.start < (j + 1) * bs <= load.end
                )
    for rid in t.before.kv_loads_done:
        r = t.before.requests.get(rid)
        if r is not None and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            out.update(x for tab in tables(r) for x in tab[: r.num_computed_tokens // bs] if x)
    return out


def filled_places(e: ScheduledRequest, t: Transition, bs: int) -> set[int]:
    """The indices of the blocks of ``e``'s request whose last position this
    step or one of its live steps in flight computes. An in-flight entry
    planned before an update rejected drafts computes its places ``shift``
    earlier, ``shift`` being how far the last in-flight entry's end is past
    the request's computed tokens before this step (vllm/v1/core/sched/
    scheduler.py, update_from_output: num_computed_tokens -= num_rejected,
    the model runner's async inputs start at the corrected position)."""
    entries = own_live_entries(e, t)
    before = t.before.requests.get(e.request_id)
    inflight = [f for f in entries if f is not e]  # t.in_flight holds this step's plan too
    shift = 0
    if before is not None and inflight and e.kind == ScheduleKind.RUNNING:
        last = inflight[-1]
        shift = max(0, last.num_computed_tokens + last.num_scheduled_tokens - before.num_computed_tokens)
    out: set[int] = set()
    for f in entries:
        lo = f.num_computed_tokens - (shift if f is not e else 0)
        hi = f.num_computed_tokens + f.num_scheduled_tokens
        out.update(j for j in range(len(e.block_ids)) if lo < (j + 1) * bs <= hi)
    return out


def own_live_entries(e: ScheduledRequest, t: Transition) -> list[ScheduledRequest]:
    """The entry ``e`` of this step's plan and the entries of the same
    request in the plans still in flight from its current admission on (the
    stale ones, from before a preemption, left out)."""
    r = t.after.requests.get(e.request_id)
    return [*(live_entries(r, t.in_flight) if r is not None else []), e]


@transition_invariant(
    "preemption-resets",
    "A request preempted (by schedule() or by reset_prefix_cache(reset_running_requests=True)) was "
    "RUNNING and is now PREEMPTED, in the waiting queue, with 0 computed tokens, no blocks and one "
    "more preemption, is not scheduled in that step, and is listed in the next plan's preempted_ids.",
    "vllm/v1/core/sched/scheduler.py, _preempt_request: frees the blocks, sets status PREEMPTED and "
    "num_computed_tokens 0, num_preemptions += 1, prepends to waiting, records the id in "
    "reset_preempted_req_ids, which the next SchedulerOutput reports as preempted_req_ids.",
    kinds=("schedule", "reset"),
    tags=("safety",),
)
def preemption_resets(t: Transition, h: History) -> Iterator[Finding]:
    newly = [
        rid
        for rid, b in t.before.requests.items()
        if b.status == RequestStatus.RUNNING
        and (a := t.after.requests.get(rid)) is not None
        and a.status == RequestStatus.PREEMPTED
    ]
    if t.kind == "schedule":
        assert t.plan is not None
        victims = step_victims(t)
        listed = set(t.plan.preempted_ids)
        for rid in sorted(set(t.before.preempted_since_plan) - listed):
            yield rid, "preempted before the step but missing from the plan's preempted_ids"
        if t.after.preempted_since_plan:
            yield None, f"preempted_since_plan is {list(t.after.preempted_since_plan)} right after a plan"
        if len(set(t.plan.preempted_ids)) != len(t.plan.preempted_ids):
            yield None, f"preempted_ids has duplicates: {list(t.plan.preempted_ids)}"
        scheduled = set(t.plan.scheduled_ids)
    else:
        victims = newly
        listed = set(t.after.preempted_since_plan)
        scheduled = set()
    for rid in newly:
        if rid not in listed:
            yield rid, "was preempted but is not reported as preempted"
    for rid in victims:
        b = t.before.requests.get(rid)
        a = t.after.requests.get(rid)
        if b is None or b.status != RequestStatus.RUNNING:
            yield rid, f"reported preempted but was {'not unfinished' if b is None else b.status.name}"
            continue
        if a is None:
            yield rid, "reported preempted but is no longer an unfinished request"
            continue
        if a.status != RequestStatus.PREEMPTED or rid not in t.after.waiting:
            yield rid, f"preempted but has status {a.status.name}, in waiting: {rid in t.after.waiting}"
        if a.num_computed_tokens != 0 or a.block_ids:
            yield rid, (
                f"preempted but kept {a.num_computed_tokens} computed tokens and blocks "
                f"{list(a.block_ids)}"
            )
        if a.num_preemptions != b.num_preemptions + 1:
            yield rid, f"num_preemptions went from {b.num_preemptions} to {a.num_preemptions}, not +1"
        if rid in scheduled:
            yield rid, "is both preempted and scheduled in the same step"


@transition_invariant(
    "no-admission-with-preemption",
    "A step that preempts any request admits none from the waiting queue.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the WAITING loop runs only "
    "`if not preempted_reqs`.",
    _SCHED,
    tags=("policy:vllm-step",),
)
def no_admission_with_preemption(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    victims = step_victims(t)
    adm = [s.request_id for s in admitted(t.plan)]
    if victims and adm:
        yield None, f"step {t.plan.step} preempted {victims} and still admitted {adm}"


@transition_invariant(
    "full-sequence-reserved",
    "With scheduler_reserve_full_isl, the last request admitted in a step had room for its whole "
    "sequence (capped at max_model_len) when it was admitted: its blocks after the step plus the "
    "free blocks left cover cdiv(min(num_tokens, max_model_len), block_size).",
    "vllm/v1/core/kv_cache_manager.py, KVCacheManager.allocate_slots: with "
    "full_sequence_must_fit (scheduler_reserve_full_isl) an admission fails unless the blocks of the "
    "whole sequence fit the free pool (in every KV cache group; a layout with a sliding window, "
    "whose groups count only their window, is left out); nothing after the last admission takes a "
    "block in the step.",
    _SCHED,
    tags=("policy:vllm-allocation",),
)
def full_sequence_reserved(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.after.config
    adm = admitted(t.plan)
    if not cfg.scheduler_reserve_full_isl or not adm:
        return
    if sliding_groups(cfg):
        return  # a sliding window needs only its window's blocks (its admission cap), not counted here
    last = adm[-1]
    ngroups = len(cfg.groups)
    held = sum(len(tab) for tab in tables(last))
    need = ngroups * cdiv(min(last.num_tokens, cfg.max_model_len), cfg.block_size)
    free = t.after.kv.num_free_blocks
    if held + free < need:
        yield last.request_id, (
            f"admitted with {held} blocks and {free} left free, but its {min(last.num_tokens, cfg.max_model_len)}"
            f" tokens need {need} blocks: the whole sequence did not fit"
        )


def in_order_past_gates(adm: list[str], order: list[str], after: SchedulerView,
                        stale: frozenset[str] = frozenset()) -> bool:
    """Whether ``adm`` are admitted in ``order`` with only requests an
    admission gate passes over (skip_request) left behind before the last of
    them: one still waiting for its grammar, one with a LoRA adapter (the
    max_loras check) or with encoder inputs (no token fits this step), or one
    of ``stale`` (stale_passed_over)."""
    pos = [order.index(rid) for rid in adm if rid in order]
    if len(pos) != len(adm) or pos != sorted(pos):
        return False
    grammar = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    for rid in order[: pos[-1] if pos else 0]:
        if rid in adm:
            continue
        r = after.requests.get(rid)
        if r is None or not (r.status in (grammar, RequestStatus.WAITING_FOR_REMOTE_KVS,
                                          RequestStatus.WAITING_FOR_STREAMING_REQ)
                             or r.spec.lora_id or r.spec.mm_inputs or rid in stale):
            return False
    return True


def stale_passed_over(t: Transition) -> frozenset[str]:
    """The queued requests the WAITING loop may pass over for their stale
    output (scheduler.py, schedule(): ``num_stale_output_tokens and not
    drop_stale_output: skip_request``, "It drains within the pipeline
    depth"): with k >= 3 plans in flight, a request preempted with steps in
    flight still has some of them in flight at a later schedule; those with
    an entry in a plan in flight before this one. (With k <= 2 the stale
    output drains at the update before the next schedule.)"""
    if t.before.config.max_concurrent_batches <= 2 or t.plan is None:
        return frozenset()
    return frozenset(s.request_id for p in t.in_flight if p.step != t.plan.step for s in p.scheduled
                     if s.request_id in t.before.waiting)


def kv_holds_pool(t: Transition) -> bool:
    """Whether, with a KV connector, the step starts a load or blocks are held
    outside the running requests (a load in flight, a finished request's
    pending save or load, a promoted load waiting): then the pool is not all
    free with nothing running, a waiting request may wait for a load, and
    vLLM reserves blocks for loads in flight (scheduler.py, schedule():
    _inflight_prefill_reserved_blocks, skip_request into kv_holding_waiting)."""
    v = t.before
    if not v.config.kv_connector:
        return False
    return bool(
        (t.plan is not None and t.plan.kv_loads)
        or v.kv_held_by_finished
        or _deferred_frees(v)
        or any(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            or (r.status != RequestStatus.RUNNING and r.num_computed_tokens)
            for r in v.requests.values()
        )
    )


def _deferred_frees(v: SchedulerView) -> bool:
    """Whether blocks freed behind a step in flight are still fenced (async
    scheduling with a KV connector: scheduler.py, _free_request_blocks appends
    to deferred_frees, _drain_deferred_frees returns them once the step is
    processed): held by no request, yet not free."""
    if not defers_frees(v.config):
        return False
    held = {b for r in v.requests.values() for t in tables(r) for b in t}
    held |= {b for blocks in v.kv_held_by_finished.values() for b in blocks}
    free = set(v.kv.free_queue)
    return any(c > 0 and b not in held and b not in free for b, c in enumerate(v.kv.ref_cnt) if b)


@transition_invariant(
    "fcfs-admission-order",
    "FCFS: the requests admitted in a step are the first ones of the waiting queue, in queue order.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the WAITING loop peeks the head of the "
    "FCFSRequestQueue (request_queue.py) and stops (break) at the first request that does not fit.",
    _SCHED,
    tags=("policy:fcfs",),
    requires=("policy_fcfs",),
)
def fcfs_admission_order(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    if t.before.config.policy != Policy.FCFS:
        return
    adm = [s.request_id for s in admitted(t.plan)]
    head = list(t.before.waiting[: len(adm)])
    if adm != head and not in_order_past_gates(adm, list(t.before.waiting), t.after, stale_passed_over(t)):
        yield None, f"admitted {adm}, but the head of the waiting queue was {head}"


def _priority_queues(v: SchedulerView, h: History) -> list[list[str]]:
    """The live waiting requests as vLLM's queues in service order: without a
    KV connector the one waiting queue; with one, kv_holding_waiting then
    waiting, each a heap listed in order. Every request holding blocks
    (holds_kv_blocks) is in the first; one promoted from an asynchronous load
    with nothing computed (in the history's loads) may be in either, so the
    split is put where the order restarts, if it can be."""
    live = [rid for rid in v.waiting if rid in v.requests]
    if not v.config.kv_connector:
        return [live]
    strict = [i for i, rid in enumerate(live) if holds_kv_blocks(v, rid)]
    maybe = set(kv_holding_prefix(v, h))
    lo = strict[-1] + 1 if strict else 0
    hi = next((i for i, rid in enumerate(live) if rid not in maybe), len(live))
    keys = [queue_key(v.requests[rid]) for rid in live]
    d = next((i for i in range(1, len(live)) if keys[i] < keys[i - 1]), None)
    k = d if d is not None and lo <= d <= max(lo, hi) else lo
    return [live[:k], live[k:]]


@transition_invariant(
    "priority-admission-order",
    "PRIORITY: the requests admitted in a step are the waiting requests of least (priority, "
    "arrival, request_id), in that order; the waiting view lists them in that order.",
    "vllm/v1/core/sched/request_queue.py, PriorityRequestQueue (a heap on Request.__lt__: "
    "priority, arrival_time, request_id); scheduler.py, schedule() admits from its head and stops "
    "at the first that does not fit.",
    tags=("policy:priority",),
    requires=("policy_priority",),
)
def priority_admission_order(t: Transition, h: History) -> Iterator[Finding]:
    if t.after.config.policy != Policy.PRIORITY:
        return
    # With a KV connector the view lists vLLM's kv_holding_waiting (requests
    # holding KV blocks), drained first, then its waiting queue: two heaps.
    for part in _priority_queues(t.after, h):
        keys = [queue_key(t.after.requests[rid]) for rid in part]
        if keys != sorted(keys):
            yield None, f"waiting queue {part} is not in (priority, arrival, request_id) order"
    if t.kind != "schedule" or t.plan is None:
        return
    adm = [s.request_id for s in admitted(t.plan)]
    cands = [
        rid
        for part in _priority_queues(t.before, h)
        for rid in sorted(part, key=lambda rid: queue_key(t.before.requests[rid]))
    ]
    if adm != cands[: len(adm)] and not in_order_past_gates(adm, cands, t.after, stale_passed_over(t)):
        yield None, f"admitted {adm}, but in priority order the waiting queue starts {cands[: len(adm)]}"


@transition_invariant(
    "fcfs-victim-suffix",
    "FCFS: the requests preempted in a step are the last ones of the running queue before it.",
    "vllm/v1/core/sched/scheduler.py, schedule(): under FCFS the victim is self.running.pop(), "
    "the last running request, until the request being scheduled fits or is itself popped.",
    _SCHED,
    tags=("policy:fcfs", "policy:vllm-victim"),
    requires=("policy_fcfs",),
)
def fcfs_victim_suffix(t: Transition, h: History) -> Iterator[Finding]:
    if t.before.config.policy != Policy.FCFS:
        return
    victims = step_victims(t)
    if not victims:
        return
    tail = t.before.running[len(t.before.running) - len(victims) :]
    if set(victims) != set(tail):
        yield None, (
            f"preempted {sorted(victims)}, but the last {len(victims)} of the running queue "
            f"{list(t.before.running)} are {list(tail)}"
        )


@transition_invariant(
    "priority-victim-choice",
    "PRIORITY: no request still running after a step has a greater (priority, arrival) than a "
    "request preempted in it.",
    "vllm/v1/core/sched/scheduler.py, schedule(): under PRIORITY the victim is "
    "max(self.running, key=(priority, arrival_time)).",
    _SCHED,
    tags=("policy:priority", "policy:vllm-victim"),
    requires=("policy_priority",),
)
def priority_victim_choice(t: Transition, h: History) -> Iterator[Finding]:
    if t.before.config.policy != Policy.PRIORITY:
        return
    for v in step_victims(t):
        bv = t.before.requests.get(v)
        if bv is None:
            continue
        for rid in t.after.running:
            r = t.after.requests.get(rid)
            if r is not None and victim_key(r) > victim_key(bv):
                yield v, (
                    f"preempted with (priority, arrival) {victim_key(bv)} while {rid} with "
                    f"{victim_key(r)} keeps running"
                )


@transition_invariant(
    "progress",
    "A step that starts with an unfinished request schedules at least one.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the first running request can preempt every "
    "other (or, under PRIORITY, only preempts itself while another remains), and the pool holds "
    "max_model_len tokens (kv_cache_planning.py, check_enough_kv_cache_memory), so some running "
    "request always fits; with none running the whole pool is free and the head's first chunk fits. "
    "With a KV connector it stands aside while loads hold blocks or requests wait for them "
    "(WAITING_FOR_REMOTE_KVS, kv_holding_waiting, delayed frees, and with async scheduling a "
    "victim whose step is in flight, which stops the RUNNING loop), and for two vLLM liveness defects: "
    "after an asynchronous load failed whole under recompute (_update_waiting_for_remote_kv leaves "
    "the request in _inflight_prefills), and a head whose asynchronous load cannot fit beside "
    "_spec_decode_step_blocks even in an empty pool (docs/divergences.md).",
    _SCHED,
    tags=("safety",),
)
def progress(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    if sessions_hold(t.before):
        return  # sessions hold slots or blocks while they wait: session-liveness bounds that
    if t.before.pause_state != PauseState.UNPAUSED:
        return  # a paused scheduler admits nothing new, or schedules nothing
    if t.before.config.prefill_schedule_interval > 1:
        return  # the cadence holds the prefills of a step whose decoding request preempts itself
    if len(t.in_flight) > 1 and any(r.spec.mm_inputs for r in t.before.requests.values()):
        return  # the step in flight still holds the encoder cache a chunk needs
    if t.plan.preempted_ids and any(
        any(m.offset + m.length > r.num_computed_tokens for m in r.spec.mm_inputs)
        for rid in t.before.running
        if (r := t.before.requests.get(rid)) is not None
    ):
        # a running request whose chunk starts at an encoder input the cache
        # cannot hold yet (a later request still references its entries) is
        # passed over (_try_schedule_encoder_inputs); that later request may
        # then preempt itself for KV, which releases its encoder entries for
        # the next step: the step's progress is the preemption
        return
    grammar = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    if all(r.status == grammar for r in t.before.requests.values()):
        return  # requests waiting for their grammar are passed over
    if any(throttled(t, h, rid) for rid in t.before.running):
        # V2's decode throttle passes a running request over while it holds
        # its blocks and slot: the others may not fit (a pipeline bubble)
        return
    if kv_holds_pool(t):
        return  # KV loads in flight hold blocks and their requests wait (kv_holds_pool)
    if defers_frees(t.before.config) and len(t.in_flight) > 1:
        # the RUNNING loop stops rather than preempt a victim whose step is in
        # flight (scheduler.py, _request_blocks_can_be_freed: "A deferred free
        # will not help with immediate allocation."); that step's update frees
        return
    if not t.before.running and any(failed_load_blocks_reload(t.before, h, rid) for rid in t.before.waiting):
        return  # vLLM's liveness defect after a failed load (failed_load_blocks_reload)
    head = admission_candidate(t.before)
    if not t.before.running and head is not None and _async_load_over_reserve(t.before, h, head):
        return  # an asynchronous load that does not fit beside the reservation (speculative step, stale loads)
    if any(r.num_output_placeholders > 0 for r in t.before.requests.values()):
        # async scheduling: a request whose step is in flight may have nothing
        # left to schedule (max_tokens surely reached, max_model_len), and
        # holds its blocks until the update
        return
    if t.before.config.pipeline_parallel_size > 1 and any(p.scheduled for p in t.in_flight if p.step != t.plan.step):
        # a pipeline's plans in flight: their requests have nothing to
        # schedule until their update, and hold their blocks (and seats) until then
        return
    if not t.plan.scheduled:
        yield None, (
            f"step {t.plan.step} scheduled nothing with {len(t.before.running)} running and "
            f"{len(t.before.waiting)} waiting"
        )
        return


@transition_invariant(
    "progress-admits-head",
    "When nothing is running at the start of a step, it admits the head of the waiting queue.",
    "vllm/v1/core/sched/scheduler.py, schedule(): with self.running empty the whole pool is free "
    "and the WAITING loop admits the head's first chunk (the pool holds max_model_len tokens); "
    "with a KV connector it stands aside while loads hold blocks or requests wait for them, and "
    "for vLLM's liveness defect: a head whose asynchronous load failed whole under recompute stays "
    "in _inflight_prefills (_update_waiting_for_remote_kv), its own need reserved against its "
    "reload (_inflight_prefill_reserved_blocks), never admitted with under twice that need free "
    "(docs/divergences.md).",
    _SCHED,
    tags=("policy:vllm-step",),
)
def progress_admits_head(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    if sessions_hold(t.before):
        return  # sessions hold slots or blocks while they wait: session-liveness bounds that
    if t.before.pause_state != PauseState.UNPAUSED or kv_holds_pool(t):
        return
    head = admission_candidate(t.before)
    # a request waiting for its grammar ahead of the head may find it compiled
    # and be admitted first (the view does not say whether it has compiled)
    ahead = waiting_order(t.before)
    ahead = ahead[: ahead.index(head) + 1] if head is not None else []
    if any(failed_load_blocks_reload(t.before, h, rid) for rid in t.before.waiting):
        # served first (kv_holding_waiting), it stops the WAITING loop
        return
    if head is not None and _async_load_over_reserve(t.before, h, head):
        return
    if head in stale_passed_over(t):
        return  # passed over while its stale output is in flight (k >= 3 plans)
    if not t.before.running and head is not None and not set(ahead) & set(t.plan.scheduled_ids):
        yield head, "nothing was running, yet the head of the waiting queue was not admitted"


def _async_load_over_reserve(v: SchedulerView, h: History, rid: str) -> bool:
    """Whether ``rid``'s asynchronous load may not fit beside what vLLM
    reserves: it admits a load only if it fits beside reserved_blocks =
    _inflight_prefill_reserved_blocks() + _spec_decode_step_blocks
    (scheduler.py, schedule()), which the pool's max_model_len guarantee
    does not cover: one speculative step with drafts, and the stale
    reservation of every other request whose asynchronous load failed whole
    under "recompute" (failed_load_reservation; vLLM 0.33's liveness defect,
    docs/divergences.md)."""
    cfg = v.config
    r = v.requests.get(rid)
    if r is None or not cfg.kv_connector:
        return False
    if not r.spec.kv_load_async or r.spec.kv_external_tokens <= 0 or r.num_computed_tokens or r.block_ids:
        return False
    stale = sum(failed_load_reservation(v, h, x) for x in v.waiting if x != rid)
    if not cfg.num_speculative_tokens and not stale:
        return False
    k, bs, g = cfg.num_speculative_tokens + cfg.num_lookahead_tokens, cfg.block_size, len(cfg.groups)
    need = cdiv(min(r.num_tokens, cfg.max_model_len) + 1 + k, bs) * g + cdiv(k, bs) * g
    return need + stale > v.kv.num_free_blocks


def failed_load_blocks_reload(v: SchedulerView, h: History, rid: str) -> bool:
    """A vLLM 0.33 liveness defect (docs/divergences.md): a request whose
    asynchronous load failed under the "recompute" policy with nothing usable
    (promoted by _update_waiting_for_remote_kv with no computed token and no
    block) stays in Scheduler._inflight_prefills, so
    _inflight_prefill_reserved_blocks counts its own whole need in the
    reservation its next asynchronous load must leave free, beside the stale
    reservations of every other such request and one speculative step
    (_spec_decode_step_blocks): with fewer free blocks than that it is never
    admitted again."""
    need = failed_load_reservation(v, h, rid)
    if need <= 0:
        return False
    stale = sum(failed_load_reservation(v, h, x) for x in v.waiting)
    cfg = v.config
    spec_step = 0
    if cfg.num_speculative_tokens:
        spec_step = len(cfg.groups) * cdiv(1 + cfg.num_speculative_tokens + cfg.num_lookahead_tokens, cfg.block_size)
    return need + stale + spec_step > v.kv.num_free_blocks


def failed_load_reservation(v: SchedulerView, h: History, rid: str) -> int:
    """The blocks vLLM 0.33 keeps reserved for request ``rid`` whose
    asynchronous load failed whole under "recompute" (it lingers in
    _inflight_prefills with no computed token and no block:
    failed_load_blocks_reload), or 0 when ``rid`` is not such a request.
    The reservation holds back every admission, not only its own reload."""
    r = v.requests.get(rid)
    load = h.loads.get(rid)
    cfg = v.config
    if r is None or load is None or not load.asynchronous or cfg.kv_load_failure_policy != "recompute":
        return 0
    if r.status != RequestStatus.WAITING or r.num_computed_tokens or r.block_ids or not r.spec.kv_load_async:
        return 0
    if r.spec.kv_external_tokens <= 0:
        return 0
    n = min(len(r.spec.prompt_token_ids) + len(r.output_token_ids), cfg.max_model_len)
    if cfg.num_speculative_tokens:  # _request_remaining_blocks: one step with drafts and lookahead
        n += 1 + cfg.num_speculative_tokens + cfg.num_lookahead_tokens
    return cdiv(n, cfg.block_size) * len(cfg.groups)


@transition_invariant(
    "work-conserving-admission",
    "Admission stops only for a reason: after a step without preemption that leaves tokens in the "
    "budget and room under max_num_seqs, the head of the waiting queue does not fit (its whole "
    "sequence, counting cached hits, exceeds the free blocks, or chunked prefill is off and its "
    "prompt exceeds the budget left).",
    "vllm/v1/core/sched/scheduler.py, schedule(), WAITING loop: `while token_budget > 0`, "
    "break on max_num_active_reqs, on a prompt over the budget without chunked prefill, or when "
    "kv_cache_manager.allocate_slots(full_sequence_must_fit=scheduler_reserve_full_isl) returns None; "
    "it stands aside for a head with an external prefix, while KV loads hold blocks (the load's "
    "blocks and _inflight_prefill_reserved_blocks are not what it counts), while a request whose "
    "asynchronous load failed whole under \"recompute\" lingers in _inflight_prefills (vLLM 0.33's "
    "stale reservation, docs/divergences.md) and for hybrid layouts "
    "(the coordinator's summed get_num_blocks_to_allocate and hit are not what it counts).",
    _SCHED,
    tags=("policy:vllm-step",),
)
def work_conserving_admission(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    if sessions_hold(t.before):
        return  # sessions hold slots or blocks while they wait: session-liveness bounds that
    cfg = t.after.config
    if step_victims(t):
        return
    # the tokens the head may take: min(token_budget, input_budget - draft_slots),
    # a draft model charging each scheduled request and the head one slot
    left = (cfg.max_num_batched_tokens - t.plan.total_num_scheduled_tokens
            - cfg.num_draft_slots * (len(t.plan.scheduled) + 1))
    if left <= 0 or len(t.after.running) >= cfg.max_num_seqs:
        return
    if t.after.pause_state != PauseState.UNPAUSED or cfg.prefill_schedule_interval > 1:
        return  # paused, or the prefill cadence may hold admissions this step
    head = admission_candidate(t.after)
    if head is None or t.after.requests[head].spec.mm_inputs:
        return  # an encoder input beyond the budget or the cache may stop it
    if head in stale_passed_over(t):
        return  # passed over while its stale output is in flight (k >= 3 plans)
    if kv_holds_pool(t) or t.after.requests[head].spec.kv_external_tokens:
        return  # a load's blocks and reservation are not what admission_fits counts
    if any(failed_load_reservation(t.after, h, rid) for rid in t.after.waiting):
        return  # vLLM's stale reservation of a failed load holds admissions back (failed_load_blocks_reload)
    if cfg.is_hybrid:
        return  # admission_fits counts one full-attention group's blocks and hit
    why = admission_fits(t.after, t.after.requests[head], left, effective_threshold(t.before))
    if why is not None:
        yield head, f"admission stopped though the head of the waiting queue fits: {why}"


@transition_invariant(
    "running-served-while-budget",
    "Without async scheduling or drafts, a request running before a step and still running after it "
    "is left out of the step only when the step spends the whole token budget.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the RUNNING loop visits self.running in order while "
    "token_budget > 0 and gives each request num_new_tokens >= 1 (it is 0 only with output "
    "placeholders or drafts, or when a Mamba layout's _mamba_block_aligned_split leaves a prefill "
    "chunk short of the next block boundary none) unless the request is preempted; a preemption "
    "ahead of the current request steps the loop index back so nobody is skipped.",
    _SCHED,
    tags=("policy:vllm-step",),
)
def running_served_while_budget(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    cfg = t.before.config
    if cfg.async_scheduling or cfg.num_speculative_tokens:
        return
    if cfg.prefill_schedule_interval > 1 or t.before.pause_state == PauseState.PAUSED_ALL:
        return  # the prefill cadence holds running prefill chunks in some steps; paused
    left = cfg.max_num_batched_tokens - t.plan.total_num_scheduled_tokens
    if left <= 0 or defers_frees(cfg) and len(t.in_flight) > 1:
        return  # (a victim whose step is in flight stops the RUNNING loop: progress says so)
    scheduled = set(t.plan.scheduled_ids)
    # a pipeline's plans in flight (k > 1): a request whose decode is in
    # one of them has no token to schedule (num_new_tokens == 0: continue)
    busy = {s.request_id for p in t.in_flight if p.step != t.plan.step for s in p.scheduled}
    order = {rid: i for i, rid in enumerate(t.before.running)}
    for rid in t.before.running:
        a = t.after.requests.get(rid)
        if rid not in scheduled | busy and a is not None and a.status == RequestStatus.RUNNING and not a.spec.mm_inputs:
            if aligns_chunks(cfg) and (r := t.before.requests.get(rid)) is not None:
                # the budget when the loop reached it: all but what the requests ahead of it took
                ahead = sum(s.num_scheduled_tokens for s in t.plan.scheduled
                            if order.get(s.request_id, len(order)) < order[rid])
                if aligned_away(cfg, r, cfg.max_num_batched_tokens - ahead, effective_threshold(t.before)):
                    continue  # its aligned chunk is 0 tokens: it waits for a bigger budget
            yield rid, (
                f"running but not scheduled in step {t.plan.step}, though {left} of the "
                f"{cfg.max_num_batched_tokens} budget tokens were left"
            )


@transition_invariant(
    "no-starvation",
    "The head of the running queue is served in every step: FCFS, it is scheduled with "
    "min(remaining tokens, max_num_batched_tokens, threshold) tokens; PRIORITY, it is scheduled "
    "so, or preempted in that step.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the RUNNING loop starts at self.running[0] with "
    "the whole budget; under FCFS it may preempt every request behind it (self.running.pop()) and "
    "one request of max_model_len tokens always fits the pool; under PRIORITY it may instead be "
    "the max((priority, arrival_time)) victim; with async scheduling and a KV connector the head may "
    "wait when the victim's free is deferred (\"A deferred free will not help\").",
    _SCHED,
    tags=("policy:vllm-step",),
)
def no_starvation(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    if sessions_hold(t.before):
        return  # sessions hold slots or blocks while they wait: session-liveness bounds that
    if not t.before.running:
        return
    rid = t.before.running[0]
    r = t.before.requests.get(rid)
    if r is None:
        return
    cfg = t.before.config
    if t.before.pause_state == PauseState.PAUSED_ALL or cfg.prefill_schedule_interval > 1:
        return  # nothing runs while paused; the cadence may hold a prefill chunk
    if r.spec.mm_inputs and t.plan.get(rid) is None:
        return  # an encoder input beyond the budget or cache may leave it no token
    if throttled(t, h, rid):
        return  # Model Runner V2's decode throttle passes it over (invariants/runner_v2.py)
    # the head's budget: min(token_budget, input_budget - draft_slots)
    want = running_chunk(r, cfg.max_num_batched_tokens - cfg.num_draft_slots, effective_threshold(t.before),
                         cfg.max_model_len)
    entry = t.plan.get(rid)
    preempted = rid in step_victims(t)
    if cfg.policy == Policy.PRIORITY and preempted:
        return
    if entry is None:
        if want > 0 and not defers_frees(cfg) and not (preempted and kv_holds_pool(t)):
            # (nor when it preempts itself while a KV connector holds blocks
            # outside the running queue: a finished request's pending save, a
            # load in flight; the pool then need not hold its whole sequence)
            # (with async scheduling and a KV connector, the head's allocation
            # may fail with the victim's free deferred: scheduler.py, schedule(),
            # "A deferred free will not help with immediate allocation")
            yield rid, f"head of the running queue was not scheduled in step {t.plan.step} (wanted {want} tokens)"
    elif entry.num_scheduled_tokens != want and not r.spec.mm_inputs and not (
        aligns_chunks(cfg) and aligned_want(cfg, r, want, entry.num_scheduled_tokens)
    ):
        yield rid, (
            f"head of the running queue was given {entry.num_scheduled_tokens} tokens, want "
            f"min(remaining {r.num_tokens - r.num_computed_tokens}, budget "
            f"{cfg.max_num_batched_tokens}, threshold) = {want}"
        )
