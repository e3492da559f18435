"""Invariants of the admission gates: LoRA adapters, structured-output
grammars, pause states, the watermark, the prefill cadence and the multimodal
encoder. Each requires the capability of its gate (names in
schedspec.check.capabilities), so a scheduler without the gate skips it."""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import (
    PauseState,
    RequestStatus,
    RequestView,
    ScheduleKind,
    SchedulerView,
    StepPlan,
)

from schedspec.invariants._util import holders, kv_holding_prefix
from schedspec.invariants.core import Finding, History, Transition, state_invariant, transition_invariant

_GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


# ---------------------------------------------------------------- LoRA


@transition_invariant(
    "max-loras",
    "No step schedules requests of more than max_loras distinct LoRA adapters, and the running "
    "queue never holds more.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the WAITING loop skips a request whose adapter "
    "would make len(scheduled_loras) exceed lora_config.max_loras, and asserts "
    "len(scheduled_loras) <= max_loras over the running requests (the model runner holds at most "
    "max_loras adapters in its slots).",
    ("schedule",),
    tags=("safety",),
    requires=("lora",),
)
def max_loras(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    limit = t.after.config.max_loras
    if not limit:
        return
    in_plan = sorted(
        {r.spec.lora_id for r in _scheduled_views(t.after, t.plan) if r.spec.lora_id}
    )
    if len(in_plan) > limit:
        yield None, f"step {t.plan.step} schedules adapters {in_plan}, more than max_loras {limit}"
    running = sorted({t.after.requests[rid].spec.lora_id for rid in t.after.running if rid in t.after.requests} - {0})
    if len(running) > limit:
        yield None, f"the running queue holds adapters {running}, more than max_loras {limit}"


def _scheduled_views(v: SchedulerView, plan: StepPlan) -> list[RequestView]:
    return [v.requests[s.request_id] for s in plan.scheduled if s.request_id in v.requests]


def _block_end(v: SchedulerView, index: int) -> int:
    return (index + 1) * v.config.block_size


@state_invariant(
    "shared-block-one-adapter",
    "Requests that share a KV block use the same LoRA adapter (or all the base model).",
    "vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys / _gen_lora_extra_hash_keys: "
    "the adapter's name is an extra key of every block hash, so a prefix-cache hit never crosses "
    "adapters (the KV differs per adapter).",
    tags=("safety",),
    requires=("lora",),
)
def shared_block_one_adapter(v: SchedulerView) -> Iterator[Finding]:
    for b, hs in sorted(holders(v).items()):
        ids = {rid: v.requests[rid].spec.lora_id for rid, _ in hs}
        if len(set(ids.values())) > 1:
            yield None, f"block {b} is shared by requests of different adapters: {dict(sorted(ids.items()))}"


@state_invariant(
    "shared-block-one-image-set",
    "Requests that share a KV block have the same encoder inputs, at the same positions, in the "
    "part of the sequence up to that block's end.",
    "vllm/v1/core/kv_cache_utils.py, _gen_mm_extra_hash_keys: each block hash carries the "
    "identifier and offset of every multimodal input overlapping it, chained over the blocks "
    "before it, so a hit never reuses KV computed from another image.",
    tags=("safety",),
    requires=("encoder",),
)
def shared_block_one_image_set(v: SchedulerView) -> Iterator[Finding]:
    for b, hs in sorted(holders(v).items()):
        seen: dict[tuple[tuple[int, str], ...], str] = {}
        for rid, i in hs:
            end = _block_end(v, i)
            key = tuple((m.offset, m.identifier) for m in v.requests[rid].spec.mm_inputs if m.offset < end)
            seen.setdefault(key, rid)
        if len(seen) > 1:
            yield None, (
                f"block {b} is shared by requests with different encoder inputs before its end: "
                + "; ".join(f"{rid}: {list(k)}" for k, rid in sorted(seen.items(), key=lambda kv: kv[1]))
            )


# ---------------------------------------------------------------- structured outputs


@state_invariant(
    "grammar-wait-holds-nothing",
    "A request waiting for its grammar is in the waiting queue and has no blocks, no computed "
    "tokens, no output and no drafts.",
    "vllm/v1/core/sched/scheduler.py, _handle_blocked_waiting_request: the WAITING loop passes "
    "such a request over until its grammar has compiled (and then makes it WAITING before "
    "admitting it); nothing else schedules it.",
    tags=("safety",),
    requires=("structured_output",),
)
def grammar_wait_holds_nothing(v: SchedulerView) -> Iterator[Finding]:
    waiting = set(v.waiting)
    for rid, r in sorted(v.requests.items()):
        if r.status != _GRAMMAR:
            continue
        if rid not in waiting:
            yield rid, "waits for its grammar but is not in the waiting queue"
        if r.block_ids or r.num_computed_tokens or r.output_token_ids or r.spec_token_ids:
            yield rid, (
                f"waits for its grammar yet holds blocks {list(r.block_ids)}, "
                f"{r.num_computed_tokens} computed tokens, {len(r.output_token_ids)} outputs, "
                f"drafts {list(r.spec_token_ids)}"
            )


@transition_invariant(
    "grammar-wait-not-scheduled",
    "A step schedules a request that waited for its grammar only as a new admission whose grammar "
    "compiled (it is RUNNING after the step); no request is still waiting for its grammar after a "
    "step that scheduled it.",
    "vllm/v1/core/sched/scheduler.py, schedule(), WAITING loop: _handle_blocked_waiting_request "
    "returns False (skip_request) while structured_output_request.grammar is None or an "
    "Exception, else sets the status to WAITING so the request is admitted as new.",
    ("schedule",),
    tags=("safety",),
    requires=("structured_output",),
)
def grammar_wait_not_scheduled(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    for s in t.plan.scheduled:
        b = t.before.requests.get(s.request_id)
        a = t.after.requests.get(s.request_id)
        if b is not None and b.status == _GRAMMAR and s.kind != ScheduleKind.NEW:
            yield s.request_id, f"waited for its grammar and was scheduled as {s.kind.name}"
        if a is not None and a.status == _GRAMMAR:
            yield s.request_id, f"scheduled in step {t.plan.step} while still waiting for its grammar"


@transition_invariant(
    "drafts-obey-grammar",
    "Without async scheduling, the drafts a step verifies for a request with a grammar contain no "
    "token its grammar refuses.",
    "vllm/v1/core/sched/scheduler.py, update_draft_token_ids: the drafts proposed after a step go "
    "through StructuredOutputManager.validate_tokens, which keeps the longest prefix the grammar "
    "accepts (vllm/v1/structured_output/__init__.py).",
    ("schedule",),
    tags=("safety",),
    requires=("structured_output",),
)
def drafts_obey_grammar(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    if t.after.config.async_scheduling:
        return  # the scheduler holds placeholders; the model runner validates
    for s in t.plan.scheduled:
        r = t.after.requests.get(s.request_id)
        if r is None or not r.spec.grammar_rejects:
            continue
        bad = [tok for tok in s.spec_token_ids if tok in r.spec.grammar_rejects]
        if bad:
            yield s.request_id, f"verifies drafts {list(s.spec_token_ids)} holding refused tokens {bad}"


# ---------------------------------------------------------------- pause


@transition_invariant(
    "paused-admits-nothing",
    "While paused, a step admits nothing from the waiting queue (PAUSED_NEW: only running requests "
    "and, with a KV connector, requests holding KV blocks for a load are scheduled) or schedules nothing at all (PAUSED_ALL: an empty plan, no preemption).",
    "vllm/v1/core/sched/scheduler.py, schedule(): PAUSED_ALL sets token_budget to 0 and skips the "
    "WAITING loop; under PAUSED_NEW the WAITING loop serves only kv_holding_waiting (requests "
    "holding KV blocks: a KV connector's loads, which it may admit); set_pause_state.",
    ("schedule",),
    tags=("safety",),
    requires=("pause",),
)
def paused_admits_nothing(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    state = t.before.pause_state
    if state == PauseState.UNPAUSED:
        return
    if state == PauseState.PAUSED_ALL:
        if t.plan.scheduled:
            yield None, f"PAUSED_ALL, yet step {t.plan.step} schedules {list(t.plan.scheduled_ids)}"
        victims = sorted(set(t.plan.preempted_ids) - set(t.before.preempted_since_plan))
        if victims:
            yield None, f"PAUSED_ALL, yet step {t.plan.step} preempts {victims}"
        return
    held = set(kv_holding_prefix(t.before, h)) if t.before.config.kv_connector else set()
    # sessions that went on hold their blocks in kv_holding_waiting too (spec/sessions.py)
    held |= {rid for rid in t.before.waiting if (r := t.before.requests.get(rid)) is not None
             and r.spec.resumable and r.num_computed_tokens > 0}
    for s in t.plan.scheduled:
        if s.kind != ScheduleKind.RUNNING and s.request_id not in held:
            yield s.request_id, f"PAUSED_NEW, yet admitted as {s.kind.name} in step {t.plan.step}"


# ---------------------------------------------------------------- watermark


@transition_invariant(
    "watermark-kept",
    "After a step that admitted a request while another was running, at least watermark_blocks "
    "blocks are free.",
    "vllm/v1/core/kv_cache_manager.py, allocate_slots: a WAITING or PREEMPTED request is given "
    "blocks only if num_blocks_to_allocate + watermark_blocks <= the free blocks, when "
    "has_scheduled_reqs (the running queue is not empty); watermark_blocks = "
    "int(watermark * num_gpu_blocks). Admissions come last in a step, so the headroom the last "
    "of them left is still there after it.",
    ("schedule",),
    tags=("policy:vllm-watermark",),
    requires=("watermark",),
)
def watermark_kept(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    wm = t.after.config.watermark_blocks
    adm = [s.request_id for s in t.plan.scheduled if s.kind != ScheduleKind.RUNNING]
    if not wm or not adm:
        return
    ran_before = [rid for rid in t.after.running if rid not in adm]
    if len(adm) < 2 and not ran_before:
        return  # a lone admission into an empty running queue has no watermark
    free = t.after.kv.num_free_blocks
    if free < wm:
        yield adm[-1], (
            f"admitted with a request running, leaving {free} free blocks, below the watermark "
            f"of {wm} (int({t.after.config.watermark} * {t.after.config.num_blocks}))"
        )


# ---------------------------------------------------------------- prefill cadence


def _carries_prefill(t: Transition) -> list[str]:
    """The requests of the step that carry prefill as vLLM's cadence counts
    it: an admission with prompt left (num_computed_tokens < num_tokens - 1,
    prefill_admitted) or a running request whose last step was a prefill
    chunk (prefill_scheduled)."""
    assert t.plan is not None
    out = []
    for s in t.plan.scheduled:
        b = t.before.requests.get(s.request_id)
        if s.kind != ScheduleKind.RUNNING:
            if s.num_computed_tokens < s.num_tokens - 1:
                out.append(s.request_id)
        elif b is not None and b.is_prefill_chunk:
            out.append(s.request_id)
    return out


@transition_invariant(
    "prefill-cadence",
    "With prefill_schedule_interval > 1: a step that starts with a decoding request, fewer than "
    "the interval executed steps after the last prefill-carrying step, and no capacity escape, "
    "carries no prefill; each step counts as executed when it schedules a token, and a "
    "prefill-carrying step restarts the interval.",
    "vllm/v1/core/sched/scheduler.py, schedule(): the local prefill cadence sets defer_prefills "
    "when (num_executed_steps + 1) - last_prefill_step < local_prefill_interval, not "
    "prefill_capacity_bound and some running request is not a prefill chunk; the RUNNING loop "
    "then skips prefill chunks and the WAITING loop breaks at a request with prompt left; "
    "num_executed_steps and last_prefill_step are stamped at the end of schedule().",
    ("schedule",),
    tags=("policy:vllm-cadence",),
    requires=("prefill_cadence",),
)
def prefill_cadence(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    b, a = t.before, t.after
    interval = b.config.prefill_schedule_interval
    if interval <= 1:
        return
    decoding = [rid for rid in b.running if rid in b.requests and not b.requests[rid].is_prefill_chunk]
    held = (
        not b.prefill_capacity_bound
        and (b.num_executed_steps + 1) - b.last_prefill_step < interval
        and bool(decoding)
    )
    carriers = _carries_prefill(t)
    if held and carriers:
        yield carriers[0], (
            f"step {t.plan.step} carries prefill for {carriers} {b.num_executed_steps + 1 - b.last_prefill_step} "
            f"executed steps after the last prefill step ({b.last_prefill_step}), inside the interval "
            f"{interval}, while {decoding[0]} decodes"
        )
    want_exec = b.num_executed_steps + (1 if t.plan.scheduled else 0)
    if a.num_executed_steps != want_exec:
        yield None, f"num_executed_steps went {b.num_executed_steps} -> {a.num_executed_steps}, want {want_exec}"
    # a PRIORITY victim scheduled before its preemption in this step leaves
    # the plan but still counts (prefill_scheduled is not taken back)
    victims = [v for v in t.plan.preempted_ids if v not in b.preempted_since_plan]
    maybe = any(b.requests[v].is_prefill_chunk for v in victims if v in b.requests)
    allowed = {want_exec} if carriers else ({b.last_prefill_step, want_exec} if maybe else {b.last_prefill_step})
    if a.last_prefill_step not in allowed:
        yield None, (
            f"last_prefill_step went {b.last_prefill_step} -> {a.last_prefill_step}, want "
            + " or ".join(str(x) for x in sorted(allowed))
        )


# ---------------------------------------------------------------- encoder


@transition_invariant(
    "encoder-budget",
    "A step runs encoder inputs of at most max_num_encoder_input_tokens embeddings in all, each "
    "overlapping its request's scheduled tokens (EAGLE: one more), and each cached after the step; the identifiers "
    "it reports freed are no longer cached.",
    "vllm/v1/core/sched/scheduler.py, _try_schedule_encoder_inputs: encoder_compute_budget starts "
    "at max_num_encoder_input_tokens and each scheduled input's embeddings are taken from it "
    "(EncoderCacheManager.can_allocate checks it), only inputs overlapping "
    "[num_computed_tokens, num_computed_tokens + num_new_tokens + shift_computed_tokens) are scheduled, "
    "_allocate_encoder_inputs reserves their cache space; get_freed_mm_hashes reports only "
    "entries not cached again.",
    ("schedule",),
    tags=("safety",),
    requires=("encoder",),
)
def encoder_budget(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    a = t.after
    total = 0
    for s in t.plan.scheduled:
        r = a.requests.get(s.request_id)
        if r is None:
            continue
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
        end += a.config.num_prefill_lookahead_tokens  # EAGLE reads the token after the chunk
        for i in s.encoder_inputs:
            if not 0 <= i < len(r.spec.mm_inputs):
                yield s.request_id, f"runs encoder input {i}, which it does not have"
                continue
            m = r.spec.mm_inputs[i]
            total += m.length
            if m.end <= start or m.offset >= end:
                yield s.request_id, (
                    f"runs encoder input {i} at {m.offset}..{m.end - 1} outside its tokens {start}..{end - 1}"
                )
            if m.identifier not in a.encoder_cache:
                yield s.request_id, f"runs encoder input {i} ({m.identifier!r}), which is not cached after the step"
    if total > a.config.max_num_encoder_input_tokens:
        yield None, (
            f"step {t.plan.step} runs {total} encoder embeddings, beyond max_num_encoder_input_tokens "
            f"{a.config.max_num_encoder_input_tokens}"
        )
    for ident in t.plan.freed_encoder_inputs:
        if ident in a.encoder_cache:
            yield None, f"step {t.plan.step} reports {ident!r} freed, but it is still cached"


@state_invariant(
    "encoder-cache-within-size",
    "The encoder cache's entries and its free space add up to encoder_cache_size, and no "
    "input is freed from it while a running request is in the middle of it (an input the KV "
    "connector loaded is never encoded here: a failed load may cut inside it).",
    "vllm/v1/core/encoder_cache_manager.py, EncoderCacheManager: allocate takes num_free_slots, "
    "an eviction in can_allocate gives it back, and only entries no request references "
    "(freeable) are evicted; a request drops its reference to an input only once its computed "
    "tokens past the placeholders cover it (scheduler.py, _free_encoder_inputs), or when it is "
    "preempted or finishes.",
    tags=("safety",),
    requires=("encoder",),
)
def encoder_cache_within_size(v: SchedulerView) -> Iterator[Finding]:
    size = v.config.encoder_cache_size
    used = sum(v.encoder_cache.values())
    if v.encoder_cache_free < 0 or used + v.encoder_cache_free != size:
        yield None, (
            f"the encoder cache holds {used} embeddings with {v.encoder_cache_free} free, "
            f"which does not add up to encoder_cache_size {size}"
        )
    for rid in v.running:
        r = v.requests.get(rid)
        if r is None:
            continue
        done = r.num_computed_tokens - r.num_output_placeholders
        for i, m in enumerate(r.spec.mm_inputs):
            if m.offset < r.spec.kv_external_tokens and v.config.kv_connector:
                # loaded by the KV connector, never encoded here: a failed load
                # can cut the computed tokens inside it, and the next schedule()
                # encodes it again (_update_requests_with_invalid_blocks, then
                # _try_schedule_encoder_inputs finds it neither computed nor cached)
                continue
            if m.offset < r.num_computed_tokens and m.end > done and m.identifier not in v.encoder_cache:
                yield rid, (
                    f"is inside encoder input {i} ({m.identifier!r} at {m.offset}..{m.end - 1}, "
                    f"{r.num_computed_tokens} computed), which is not in the encoder cache"
                )
