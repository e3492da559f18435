"""The protocol boundary: the checks every scheduler makes, with the same
errors and messages, before it changes anything.

The spec, the fast implementation (impl/) and the vLLM adapter all call these,
so a caller that breaks the add / abort / schedule / update protocol gets the
same exception whichever scheduler it drives. Each check raises or returns;
none changes the scheduler, so an operation that raises changes nothing.

The in-flight rules (async scheduling, vllm/v1/core/sched/async_scheduler.py
driven by vllm/v1/engine/core.py, EngineCore.step_with_batch_queue):

- Without ``config.async_scheduling`` a step is schedule() then its update();
  only add() and abort() may come between them.
- With it, schedule() may be called while exactly one plan awaits update
  (never two); updates come in plan order, each exactly once. add() and
  abort() may come at any time; reset_prefix_cache() while at most one plan
  is in flight.
- In general, with k = ``config.max_concurrent_batches`` (pipeline
  parallelism: ``pipeline_parallel_size`` plans without async scheduling),
  schedule() may be called while up to k - 1 plans await update, and
  reset_prefix_cache() too; updates come oldest first, each exactly once.
- A result holds, per entry that samples, 1 + a tokens (a accepted drafts,
  at most the entry's drafts, then the bonus token) and nothing for a partial
  prefill chunk; drafts only for requests the plan scheduled, at most
  num_speculative_tokens each.

Every violation raises ProtocolError with ``step`` (the plan's step) and
``field`` (what is wrong) set, before anything changes.

The two input rules at ``add`` are vLLM's own, enforced before its scheduler
sees a request: a duplicate id, and a prompt that leaves no room for one
output token (vllm/v1/engine/input_processor.py, _validate_model_input).
"""

from __future__ import annotations

from typing import Container, Mapping, Sequence, TypeVar, Union

from schedspec.spec.interface import (
    ConfigError,
    PauseState,
    Policy,
    ProtocolError,
    RequestError,
    RequestSpec,
    RequestStatus,
    ScheduledRequest,
    SchedulerConfig,
    StepPlan,
    StepResult,
)

T = TypeVar("T")


def check_config(config: object) -> SchedulerConfig:
    """A scheduler is built from a validated SchedulerConfig and nothing else."""
    if not isinstance(config, SchedulerConfig):
        raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
    return config


def gates_of_config(config: SchedulerConfig) -> tuple[str, ...]:
    """The admission gates ``config`` turns on, by capability name:
    ``watermark`` (watermark > 0), ``prefill_cadence``
    (prefill_schedule_interval > 1), ``lora`` (max_loras >= 1), ``encoder``
    (an encoder budget and cache). Pause states and structured outputs have
    no config field: a request or a call turns them on."""
    on = []
    if config.watermark > 0:
        on.append("watermark")
    if config.prefill_schedule_interval > 1:
        on.append("prefill_cadence")
    if config.max_loras:
        on.append("lora")
    if config.has_encoder:
        on.append("encoder")
    return tuple(on)


_GATE_FIELDS = {
    "watermark": "watermark",
    "prefill_cadence": "prefill_schedule_interval",
    "lora": "max_loras",
    "encoder": "encoder_cache_size",
}


def check_gate_config(config: SchedulerConfig, supported: Container[str]) -> None:
    """For a scheduler that implements only the ``supported`` gates: refuse a
    config that turns another one on (ConfigError naming its field), rather
    than schedule as if it were off."""
    for gate in gates_of_config(config):
        if gate not in supported:
            raise ConfigError(
                _GATE_FIELDS[gate],
                f"turns on the {gate} admission gate, which this scheduler does not implement",
            )


def check_add(request: object, config: SchedulerConfig, *known: Container[str]) -> RequestSpec:
    """add(): ``request`` must be a RequestSpec whose id none of ``known`` (the
    unfinished requests, and those finished since the last plan) holds, and
    whose prompt leaves room for an output token within max_model_len."""
    if not isinstance(request, RequestSpec):
        raise TypeError(f"request must be a RequestSpec, got {type(request).__name__}")
    rid = request.request_id
    if any(rid in ids for ids in known):
        raise RequestError(rid, "request_id", "duplicate request id")
    if len(request.prompt_token_ids) >= config.max_model_len:
        raise RequestError(
            rid,
            "prompt_token_ids",
            f"prompt length {len(request.prompt_token_ids)} leaves no room for an output "
            f"token within max_model_len {config.max_model_len}",
        )
    check_gates(request, config)
    check_kv_request(request, config)
    return request


def check_kv_request(request: RequestSpec, config: SchedulerConfig) -> None:
    """add(), the KV connector's request fields: only with a connector
    (``config.kv_connector``); and a synchronous load must leave a prompt
    token to compute. The modelled connector offers every external token,
    so a synchronous load of the whole prompt would leave the admission
    nothing to schedule, which vLLM's WAITING loop asserts against
    (scheduler.py, schedule(): ``assert num_new_tokens > 0``); an
    asynchronous one is cut to ``num_tokens - 1`` when it is promoted
    (_update_waiting_for_remote_kv)."""
    rid = request.request_id
    if not config.kv_connector:
        for name in ("kv_external_tokens", "kv_load_async", "kv_save_async"):
            if getattr(request, name):
                raise ProtocolError(
                    f"request {rid!r}: {name} but the config has no KV connector (config.kv_connector is False)",
                    field=name,
                )
        return
    if not request.kv_load_async and request.kv_external_tokens >= len(request.prompt_token_ids):
        raise ProtocolError(
            f"request {rid!r}: a synchronous load of all {request.kv_external_tokens} prompt tokens leaves "
            "none to compute (vLLM asserts num_new_tokens > 0); load at most the prompt less one token, "
            "or load asynchronously",
            field="kv_external_tokens",
        )


def check_gates(request: RequestSpec, config: SchedulerConfig) -> None:
    """add(), the admission gates: a request may use a gate only when the
    config turns it on.

    - ``lora_id`` > 0 needs ``max_loras`` >= 1 (vLLM refuses a LoRA request
      when LoRA is not enabled: vllm/v1/engine/input_processor.py,
      _validate_lora).
    - ``mm_inputs`` need an encoder budget, and each input must fit both the
      encoder's compute budget and its cache: a larger one could never be
      scheduled, and vLLM's waiting loop would hold the request for ever
      (scheduler.py, _try_schedule_encoder_inputs, can_allocate).
    """
    rid = request.request_id
    if request.lora_id and not config.max_loras:
        raise ProtocolError(
            f"request {rid!r}: lora_id {request.lora_id} but LoRA is off (config.max_loras is 0)",
            field="lora_id",
        )
    if request.mm_inputs and not config.has_encoder:
        raise ProtocolError(
            f"request {rid!r}: mm_inputs but the config has no encoder "
            "(encoder_cache_size and max_num_encoder_input_tokens are 0)",
            field="mm_inputs",
        )
    limit = min(config.max_num_encoder_input_tokens, config.encoder_cache_size)
    for i, mm in enumerate(request.mm_inputs):
        if mm.length > limit:
            raise ProtocolError(
                f"request {rid!r}: mm_inputs[{i}] has {mm.length} embeddings, more than the "
                f"encoder budget ({config.max_num_encoder_input_tokens}) or cache "
                f"({config.encoder_cache_size}) can ever hold",
                field=f"mm_inputs[{i}]",
            )


def check_mm_lengths(request: RequestSpec, known: Mapping[str, int]) -> None:
    """add(): an encoder input's identifier names one encoder output, so its
    length must agree with every input of that identifier the scheduler has
    seen (``known``: identifier -> length). vLLM fails such a request at
    schedule time (scheduler.py, _reject_on_encoder_cache_embed_mismatch);
    the spec refuses it at the boundary."""
    for i, mm in enumerate(request.mm_inputs):
        seen = known.get(mm.identifier)
        if seen is not None and seen != mm.length:
            raise ProtocolError(
                f"request {request.request_id!r}: mm_inputs[{i}] {mm.identifier!r} has length "
                f"{mm.length}, but that identifier was seen with length {seen}",
                field=f"mm_inputs[{i}].length",
            )


def check_pause_state(state: object) -> PauseState:
    """set_pause_state(): ``state`` must be a PauseState."""
    if not isinstance(state, PauseState):
        raise ProtocolError(
            f"pause state must be a PauseState, got {state!r}", field="pause_state"
        )
    return state


def check_grammar_ready(
    request_id: object, ok: object, status: RequestStatus | None, reported: bool = False
) -> None:
    """grammar_ready(): ``request_id`` must name an unfinished request that
    waits for its grammar (``status`` is that request's status, None when the
    id names no unfinished request) whose compilation was not reported yet
    (``reported``: a grammar compiles once), and ``ok`` must be a boolean."""
    if not isinstance(ok, bool):
        raise ProtocolError(f"grammar_ready ok must be a boolean, got {ok!r}", field="ok")
    if status is None:
        raise ProtocolError(
            f"grammar_ready for {request_id!r}: no unfinished request with this id",
            field="request_id",
        )
    if status is not RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        raise ProtocolError(
            f"grammar_ready for {request_id!r}, which does not wait for a grammar "
            f"(status {status.value})",
            field="request_id",
        )
    if reported:
        raise ProtocolError(
            f"grammar_ready for {request_id!r}: its grammar was already reported",
            field="request_id",
        )


def check_abort(request_id: str, unfinished: Mapping[str, T]) -> T:
    """abort(): the id must name an unfinished request; returns its record."""
    record = unfinished.get(request_id)
    if record is None:
        raise RequestError(request_id, "request_id", "no unfinished request with this id")
    return record


#: The plans awaiting update(), oldest first, as a scheduler keeps them: None
#: or one plan (the synchronous protocol's single slot), or a sequence.
InFlight = Union[StepPlan, Sequence[StepPlan], None]


def in_flight(outstanding: InFlight) -> tuple[StepPlan, ...]:
    """The plans awaiting update(), oldest first, whatever form the scheduler
    keeps them in."""
    if outstanding is None:
        return ()
    if isinstance(outstanding, StepPlan):
        return (outstanding,)
    return tuple(outstanding)


def max_in_flight(config: SchedulerConfig | None) -> int:
    """How many plans may await update() when schedule() returns: k, the
    config's max_concurrent_batches (vllm/v1/engine/core.py,
    EngineCore.step_with_batch_queue: schedule() runs while the batch queue
    holds fewer than batch_queue_size = max_concurrent_batches steps, so with
    k = 2 (async scheduling) schedule() for step N+1 comes before update()
    for step N, and never a third; without async scheduling k is
    ``pipeline_parallel_size``, 1 being the plain step)."""
    return 1 if config is None else config.max_concurrent_batches


def check_schedule(outstanding: InFlight, config: SchedulerConfig | None = None) -> None:
    """schedule(): not while k = max_in_flight(config) plans await update()
    (without async scheduling and pipeline parallelism, not while one does;
    with async scheduling, not while two do)."""
    plans = in_flight(outstanding)
    if len(plans) >= max_in_flight(config):
        last = plans[-1].step
        if len(plans) == 1:
            raise ProtocolError(
                "schedule() called again before update() of the previous plan", step=last, field="plan"
            )
        steps = ", ".join(str(p.step) for p in plans)
        allows = "async scheduling allows one plan in flight" if config is not None and config.async_scheduling \
            else f"pipeline_parallel_size {len(plans)} allows {len(plans) - 1} plans in flight"
        raise ProtocolError(
            f"schedule() with steps {steps} in flight: {allows}, so step {plans[0].step} must be updated first",
            step=plans[0].step,
            field="plan",
        )


def check_reset(outstanding: InFlight, config: SchedulerConfig | None = None) -> None:
    """reset_prefix_cache(): without async scheduling, not between schedule()
    and update(). With async scheduling it may come while one plan is in
    flight, as vLLM's engine core serves it between two engine steps
    (EngineCore.reset_prefix_cache -> Scheduler.reset_prefix_cache, which
    preempts the running requests with ``drop_stale_output=True``); never
    while two are. With k plans in flight (max_in_flight), while up to k - 1
    are: the engine serves it between two steps of its batch queue."""
    plans = in_flight(outstanding)
    allowed = max_in_flight(config) - 1
    if len(plans) > allowed:
        raise ProtocolError(
            "reset_prefix_cache between schedule() and update()", step=plans[-1].step, field="plan"
        )


def check_kv_reset(kept: str | None) -> None:
    """reset_prefix_cache(reset_running_requests=True) with a KV connector:
    refused when blocks would stay held after every running request is
    preempted (``kept`` says why; None when none would): vLLM's
    reset_prefix_cache raises RuntimeError then ("Failed to reset KV cache
    even when all the running requests are preempted")."""
    if kept is not None:
        raise ProtocolError(
            f"reset_prefix_cache(reset_running_requests=True) would leave blocks held: {kept}",
            field="reset_running_requests",
        )


_KV_REPORT_FIELDS = ("finished_recving", "finished_sending", "failed_recving", "invalid_block_ids")


def check_kv_reports(
    plan: StepPlan,
    result: StepResult,
    config: SchedulerConfig,
    loading: Mapping[str, Sequence[int]],
    saving: Container[str],
    running: Container[str],
) -> None:
    """update(), the KV connector's reports (vLLM's KVConnectorOutput), each
    checked against what the scheduler holds; ``loading`` maps each request
    whose asynchronous load is not reported yet to the blocks it writes,
    ``saving`` holds the finished requests that keep their blocks (a save, or
    an abort during a load), ``running`` the running requests. Refused, with
    the field named, before anything changes:

    - any report without a connector;
    - ``finished_recving`` of a request with no asynchronous load in flight
      (vLLM asserts the request is known, and loading or finished:
      _update_from_kv_xfer_finished), or twice;
    - ``finished_sending`` of a request that keeps no blocks (vLLM asserts it
      is known and finished: _free_blocks);
    - ``failed_recving`` of a request whose load is not reported finished in
      the same result (a load ends in finished_recving, failed or not);
    - ``invalid_block_ids``: with more than one KV cache group (vLLM raises:
      _handle_invalid_blocks); a block id that is not an int in 1 ..
      num_blocks - 1 (vLLM asserts it is in the pool: BlockPool.evict_blocks;
      block 0 is the null block); a block outside every load this result
      ends: an asynchronous load reported in ``finished_recving``, or a
      synchronous load of this plan whose request still runs.
    """
    values = {name: getattr(result, name, ()) for name in _KV_REPORT_FIELDS}
    for name, value in values.items():
        if not isinstance(value, tuple):
            raise ProtocolError(f"{name} must be a tuple, got {type(value).__name__}", step=plan.step, field=name)
        if value and not config.kv_connector:
            raise ProtocolError(
                f"{name} reported but the config has no KV connector", step=plan.step, field=name
            )
    if not config.kv_connector or not any(values.values()):
        return
    recving = values["finished_recving"]
    _check_report_ids(plan, values)
    _check_report_requests(plan, values, loading, saving)
    _check_invalid_blocks(plan, values["invalid_block_ids"], config, loading, recving, running)


def _check_report_requests(
    plan: StepPlan, values: Mapping[str, tuple[object, ...]], loading: Mapping[str, Sequence[int]], saving: Container[str]
) -> None:
    """check_kv_reports: each request a report names has what is reported."""
    recving = values["finished_recving"]
    for rid in recving:
        if rid not in loading:
            raise ProtocolError(
                f"finished_recving names {rid!r}, which has no asynchronous KV load in flight",
                step=plan.step, field="finished_recving",
            )
    if len(set(recving)) != len(recving):
        raise ProtocolError("finished_recving names a request twice", step=plan.step, field="finished_recving")
    for rid in values["finished_sending"]:
        if rid not in saving or rid in loading:
            raise ProtocolError(
                f"finished_sending names {rid!r}, which keeps no blocks for a KV save",
                step=plan.step, field="finished_sending",
            )
    for rid in values["failed_recving"]:
        if rid not in recving:
            raise ProtocolError(
                f"failed_recving names {rid!r}, whose load this result does not report finished "
                "(a failed load is also reported in finished_recving)",
                step=plan.step, field="failed_recving",
            )


def _check_report_ids(plan: StepPlan, values: Mapping[str, tuple[object, ...]]) -> None:
    """check_kv_reports: the request-id fields hold request ids."""
    for name in ("finished_recving", "finished_sending", "failed_recving"):
        for rid in values[name]:
            if not isinstance(rid, str):
                raise ProtocolError(f"{name} holds {rid!r}, not a request id", step=plan.step, field=name)


def _check_invalid_blocks(
    plan: StepPlan,
    blocks: tuple[object, ...],
    config: SchedulerConfig,
    loading: Mapping[str, Sequence[int]],
    recving: tuple[str, ...],
    running: Container[str],
) -> None:
    """check_kv_reports, the invalid blocks."""
    if not blocks:
        return
    if len(config.groups) > 1:
        raise ProtocolError(
            "invalid_block_ids with more than one KV cache group: vLLM raises "
            "(_handle_invalid_blocks); report failed_recving instead",
            step=plan.step, field="invalid_block_ids",
        )
    loaded: set[int] = set()
    for rid in recving:
        loaded.update(loading[rid])
    bs = config.block_size
    for load in plan.kv_loads:
        if not load.asynchronous and load.request_id in running:
            first = load.start // bs
            loaded.update(load.block_ids[first : -(-load.end // bs)])
    for b in blocks:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 < b < config.num_blocks:
            raise ProtocolError(
                f"invalid_block_ids holds {b!r}, not a block of the pool (1 .. {config.num_blocks - 1})",
                step=plan.step, field="invalid_block_ids",
            )
        if b not in loaded:
            raise ProtocolError(
                f"invalid_block_ids holds block {b}, which no load this result ends writes "
                "(an asynchronous load in finished_recving, or a synchronous load of this plan)",
                step=plan.step, field="invalid_block_ids",
            )


def is_token_ids(toks: object) -> bool:
    """A tuple of non-negative ints (bools are not token ids)."""
    return isinstance(toks, tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks
    )


def check_update(plan: StepPlan, outstanding: InFlight, result: object) -> StepResult:
    """update(), first: ``plan`` is the oldest plan in flight (updates come in
    plan order, each exactly once) and ``result`` a StepResult."""
    plans = in_flight(outstanding)
    step = getattr(plan, "step", None)
    if not plans or (plan is not plans[0] and plan != plans[0]):
        if any(plan is p or plan == p for p in plans[1:]):
            raise ProtocolError(
                f"update() for step {step} out of order: step {plans[0].step} is in flight "
                "before it and must be updated first",
                step=step,
                field="plan",
            )
        if plans and any(p.step == step for p in plans):
            raise ProtocolError(
                f"update() with a plan for step {step} that differs from the plan scheduled "
                "for that step",
                step=step,
                field="plan",
            )
        raise ProtocolError(
            f"update() with a plan that is not the outstanding one (step {step})",
            step=step,
            field="plan",
        )
    if not isinstance(result, StepResult):
        raise ProtocolError(
            f"result must be a StepResult, got {type(result).__name__}", step=step, field="result"
        )
    return result


def check_sampled(
    plan: StepPlan,
    result: StepResult,
    unfinished: Container[str],
    config: SchedulerConfig | None = None,
) -> None:
    """update(), then: tokens only for scheduled requests, each a tuple of token
    ids; for every entry that samples, 1 + a tokens with 0 <= a <= its drafts
    (a accepted drafts then the bonus token: exactly one without drafts); none
    for a partial prefill chunk. A request aborted while the step ran (no
    longer in ``unfinished``) may get anything well-formed: it is dropped.
    Then the drafts (``check_drafts``)."""
    planned = {s.request_id for s in plan.scheduled}
    for rid, toks in result.sampled.items():
        if rid not in planned:
            raise ProtocolError(
                f"result has tokens for {rid!r}, which the plan did not schedule",
                step=plan.step,
                field="sampled",
            )
        if not is_token_ids(toks):
            raise ProtocolError(
                f"result for {rid!r} must be a tuple of token ids, got {toks!r}",
                step=plan.step,
                field="sampled",
            )
    for s in plan.scheduled:
        if s.request_id not in unfinished:
            continue
        got = len(result.sampled.get(s.request_id, ()))
        if not s.samples:
            if got:
                raise ProtocolError(
                    f"result for {s.request_id!r} has {got} tokens; a partial prefill chunk takes 0",
                    step=plan.step,
                    field="sampled",
                )
        elif not s.spec_token_ids:
            if got != 1:
                raise ProtocolError(
                    f"result for {s.request_id!r} has {got} tokens; a completed step takes 1",
                    step=plan.step,
                    field="sampled",
                )
        elif not 1 <= got <= 1 + len(s.spec_token_ids):
            raise ProtocolError(
                f"result for {s.request_id!r} has {got} tokens; a step verifying "
                f"{len(s.spec_token_ids)} drafts takes 1 to {1 + len(s.spec_token_ids)} "
                "(the accepted drafts, then the bonus token)",
                step=plan.step,
                field="sampled",
            )
    check_drafts(plan, result, config)


def check_drafts(plan: StepPlan, result: StepResult, config: SchedulerConfig | None = None) -> None:
    """update(), the drafts: ``draft_token_ids`` only for requests the plan
    scheduled, each a tuple of token ids, at most num_speculative_tokens of
    them (none when speculative decoding is off). Drafts for an entry that
    does not sample (a partial prefill chunk) are legal: a drafter with its
    own forward pass proposes for every request of the batch, and vLLM drops
    them (scheduler.py, update_draft_token_ids)."""
    drafts = getattr(result, "draft_token_ids", None)
    if not drafts:
        return
    if not isinstance(drafts, Mapping):
        raise ProtocolError(
            f"draft_token_ids must be a mapping, got {type(drafts).__name__}",
            step=plan.step,
            field="draft_token_ids",
        )
    k = config.num_speculative_tokens if config is not None else 0
    # each request's first entry, by id: one pass over the plan, not one per draft
    entries: dict[str, ScheduledRequest] | None = None
    for rid, toks in drafts.items():
        if rid.__class__ is str:
            if entries is None:
                entries = {}
                for s in plan.scheduled:
                    entries.setdefault(s.request_id, s)
            entry = entries.get(rid)
        else:
            entry = plan.get(rid) if isinstance(rid, str) else None
        if entry is None:
            raise ProtocolError(
                f"draft_token_ids for {rid!r}, which the plan did not schedule",
                step=plan.step,
                field="draft_token_ids",
            )
        if not is_token_ids(toks):
            raise ProtocolError(
                f"draft_token_ids for {rid!r} must be a tuple of token ids, got {toks!r}",
                step=plan.step,
                field="draft_token_ids",
            )
        if len(toks) > k:
            raise ProtocolError(
                f"draft_token_ids for {rid!r} has {len(toks)} drafts; num_speculative_tokens is {k}",
                step=plan.step,
                field="draft_token_ids",
            )


def check_result(
    plan: StepPlan,
    outstanding: InFlight,
    result: object,
    unfinished: Container[str],
    config: SchedulerConfig | None = None,
) -> StepResult:
    """Every check of update(), in order."""
    checked = check_update(plan, outstanding, result)
    check_sampled(plan, checked, unfinished, config)
    return checked


__all__ = [
    "check_abort",
    "check_add",
    "check_config",
    "check_drafts",
    "check_gate_config",
    "check_gates",
    "gates_of_config",
    "check_grammar_ready",
    "check_kv_reports",
    "check_kv_request",
    "check_kv_reset",
    "check_mm_lengths",
    "check_pause_state",
    "check_reset",
    "check_result",
    "check_sampled",
    "check_schedule",
    "check_update",
    "in_flight",
    "InFlight",
    "is_token_ids",
    "max_in_flight",
]


def check_resumable(request: RequestSpec, config: SchedulerConfig) -> None:
    """add(): a resumable request within the modelled sessions."""
    if not request.resumable:
        return
    rid = request.request_id
    if config.policy != Policy.FCFS:
        raise RequestError(rid, "resumable", "sessions are modelled under the FCFS policy only")
    for name in ("structured_output", "mm_inputs", "kv_external_tokens", "kv_load_async", "kv_save_async"):
        if getattr(request, name):
            raise RequestError(rid, "resumable", f"a session with {name} is not modelled")
    if config.num_hash_lookahead_tokens:
        # Scheduler._update_request_as_session keeps the hashes of the blocks
        # before keep_end, whose lookahead token may be the one it drops
        raise RequestError(rid, "resumable", "a session with EAGLE's hash lookahead is not modelled")
