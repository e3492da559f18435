"""Shrink a failing workload to a short one that fails the same way.

Delta debugging over the event list (drop chunks, then single events), then
simplifications of the remaining requests (shorter prompts, fewer max_tokens,
no stop tokens). An abort is dropped together with the request it names.
Every candidate keeps the in-flight protocol: an Update with nothing in
flight, a Schedule or Step while the scheduler may not take one, and a
reset_prefix_cache between a schedule and its update where the mode forbids
it are dropped; Updates lose their step numbers (they update the oldest plan,
which is what the numbers said), and a recorded output keeps only the
requests still added.
The admission gates shrink too: gate events are dropped like any other (a
grammar_ready stays only for a request still added with structured output),
the config's gates are turned off one at a time (max_loras, the watermark,
fewer plans in flight (a smaller pipeline_parallel_size),
the prefill cadence, the encoder budget; the requests' adapters and encoder
inputs go with them), and each request can lose its adapter, its structured
output (with its grammar_ready) or its encoder inputs; a shorter prompt keeps
the encoder inputs that still fit inside it.
The KV features shrink the same way: the worker's events are dropped like
any other (one stays only for a request still added that still loads
asynchronously, loads, or saves, as its kind needs, in a config with a
connector), the connector and the hybrid groups are turned off (the
requests' connector fields go with the connector) and the groups cut to
fewer, and each request can lose its asynchronous save, its asynchronous
load, or its external prefix (halved, or dropped).
A candidate counts as failing when it reproduces a failure of the same kind
(violation / divergence / error), and for violations the same invariant.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from schedspec.check.records import Failure
from schedspec.spec.interface import RequestSpec, SchedSpecError, SchedulerConfig, StepResult
from schedspec.check.workload import (
    Abort,
    AddRequest,
    Event,
    GrammarReady,
    KVLoadDone,
    KVLoadFailed,
    KVSaveDone,
    Schedule,
    SessionInput,
    Step,
    Workload,
    keep_protocol,
)

Check = Callable[[Workload], Failure | None]


def signature(f: Failure) -> tuple[str, frozenset[str]]:
    """What must stay the same while shrinking: the kind and the invariant
    ids; for a crash, the scheduler that raised and the exception's type."""
    if f.kind == "error" and f.exception is not None:
        return (f.kind, frozenset({f"{f.scheduler} raised {type(f.exception).__name__}"}))
    return (f.kind, frozenset(v.invariant_id for v in f.violations))


def _fit_request(r: RequestSpec, config: SchedulerConfig) -> RequestSpec:
    """``r`` without the gate fields ``config`` cannot take: no adapter with
    LoRA off, no encoder inputs without an encoder, no full KV cache report
    without the events."""
    if r.lora_id and not config.max_loras:
        r = dataclasses.replace(r, lora_id=0)
    if r.mm_inputs and not config.has_encoder:
        r = dataclasses.replace(r, mm_inputs=())
    if r.kv_cache_report_mode != "incremental" and not config.enable_kv_cache_events:
        r = dataclasses.replace(r, kv_cache_report_mode="incremental")
    if not config.kv_connector and (r.kv_external_tokens or r.kv_load_async or r.kv_save_async):
        r = dataclasses.replace(r, kv_external_tokens=0, kv_load_async=False, kv_save_async=False)
    return r


def _kv_event_fits(e: Event, requests: dict[str, RequestSpec], config: SchedulerConfig | None) -> bool:
    """Whether a worker event still names a request that can take it (as
    the trace loader requires)."""
    if config is not None and not config.kv_connector:
        return False
    r = requests.get(getattr(e, "request_id", ""))
    if r is None:
        return False
    if isinstance(e, KVLoadDone):
        return r.kv_load_async
    if isinstance(e, KVSaveDone):
        return r.kv_save_async
    assert isinstance(e, KVLoadFailed)
    if not r.kv_external_tokens:
        return False
    block_size = config.block_size if config is not None else 1
    return e.block_index is None or e.block_index < -(-r.kv_external_tokens // block_size)


def _consistent(events: list[Event], async_scheduling: bool = False,
                config: SchedulerConfig | None = None) -> list[Event]:
    if config is not None:
        events = [AddRequest(_fit_request(e.request, config)) if isinstance(e, AddRequest) else e for e in events]
    added = {e.request.request_id for e in events if isinstance(e, AddRequest)}
    structured = {e.request.request_id for e in events if isinstance(e, AddRequest) and e.request.structured_output}
    requests: dict[str, RequestSpec] = {}
    out: list[Event] = []
    ready: set[str] = set()
    ended: set[str] = set()
    depth = config.max_concurrent_batches if config is not None else None
    for e in keep_protocol(events, async_scheduling, depth):
        if isinstance(e, AddRequest):
            requests[e.request.request_id] = e.request
        if isinstance(e, Abort) and e.request_id not in added:
            continue
        if isinstance(e, (KVLoadDone, KVLoadFailed, KVSaveDone)) and not _kv_event_fits(e, requests, config):
            continue
        if isinstance(e, SessionInput):
            # as the trace loader takes it: a resumable request added
            # before it, whose end was not sent before
            rid = e.update.request_id
            known = requests.get(rid)
            if known is None or not known.resumable or rid in ended:
                continue
            if e.update.end:
                ended.add(rid)
        if isinstance(e, GrammarReady):
            if e.request_id not in structured or e.request_id in ready:
                continue
            ready.add(e.request_id)
        if isinstance(e, Schedule) and e.result is not None:
            e = Schedule(StepResult(
                sampled={r: t for r, t in e.result.sampled.items() if r in added},
                draft_token_ids={r: t for r, t in e.result.draft_token_ids.items() if r in added},
            ))
        out.append(e)
    return out


def shrink(workload: Workload, failure: Failure, check: Check, budget_s: float = 60.0) -> tuple[Workload, Failure]:
    deadline = time.monotonic() + budget_s
    target = signature(failure)
    best_events = list(workload.events[: failure.event_index + 1])
    best_failure = failure
    best_config = workload.config

    def attempt(events: list[Event], config: SchedulerConfig | None = None) -> bool:
        nonlocal best_events, best_failure, best_config
        cfg = best_config if config is None else config
        events = _consistent(events, cfg.async_scheduling, cfg)
        if not events:
            return False
        cand = dataclasses.replace(workload, config=cfg, events=tuple(events))
        f = check(cand)
        if f is not None and signature(f) == target:
            best_events = list(events[: f.event_index + 1])
            best_failure = f
            best_config = cfg
            return True
        return False

    _ddmin(lambda: best_events, attempt, deadline)
    # a config that needs fewer steps (with the same events, or every other
    # step dropped), then drop events again; the requests are simplified last
    while time.monotonic() < deadline and any(
        attempt(events, c) for c in _config_options(best_config) for events in (best_events, _halve_steps(best_events))
    ):
        _ddmin(lambda: best_events, attempt, deadline)
    _simplify_requests(lambda: best_events, attempt, deadline)
    return dataclasses.replace(workload, config=best_config, events=tuple(best_events)), best_failure


def _config_options(config: SchedulerConfig) -> list[SchedulerConfig]:
    """Configs that run the same events in fewer steps: no long-prefill
    threshold; with chunked prefill, a token budget twice as large (up to
    max_model_len). Each is tried in turn; an invalid one is left out."""
    changes: list[dict[str, object]] = []
    if config.long_prefill_token_threshold > 0:
        changes.append({"long_prefill_token_threshold": 0})
    # the admission gates off, one at a time
    if config.max_loras:
        changes.append({"max_loras": 0})
    if config.watermark:
        changes.append({"watermark": 0.0})
    if config.prefill_schedule_interval != 1:
        changes.append({"prefill_schedule_interval": 1})
    if config.has_encoder:
        changes.append({"max_num_encoder_input_tokens": 0, "encoder_cache_size": 0})
    # the KV features off, the groups cut to fewer
    if config.kv_connector:
        changes.append({"kv_connector": False, "kv_load_failure_policy": "fail"})
    if config.is_hybrid:
        changes.append({"kv_cache_groups": ()})
        if len(config.kv_cache_groups) > 2:
            changes.append({"kv_cache_groups": config.kv_cache_groups[:2]})
    # fewer plans in flight (pipeline_parallel_size, down to one)
    changes.extend({"pipeline_parallel_size": k} for k in range(1, config.pipeline_parallel_size))
    if config.enable_chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
        changes.append({"max_num_batched_tokens": min(2 * config.max_num_batched_tokens, config.max_model_len)})
    out = []
    for change in changes:
        try:
            out.append(dataclasses.replace(config, **change))  # type: ignore[arg-type]
        except SchedSpecError:
            continue
    return out


def _halve_steps(events: list[Event]) -> list[Event]:
    """The events with every second Step left out."""
    out: list[Event] = []
    steps = 0
    for e in events:
        if isinstance(e, Step):
            steps += 1
            if steps % 2 == 0:
                continue
        out.append(e)
    return out


def _ddmin(best: Callable[[], list[Event]], attempt: Callable[[list[Event]], bool], deadline: float) -> None:
    """Delta debugging over the events: drop chunks, then single events."""
    n = 2
    while len(best()) >= 2 and time.monotonic() < deadline:
        best_events = best()
        chunk = max(1, len(best_events) // n)
        progressed = False
        for start in range(0, len(best_events), chunk):
            if time.monotonic() >= deadline:
                break
            cand = best_events[:start] + best_events[start + chunk:]
            if attempt(cand):
                n = max(n - 1, 2)
                progressed = True
                break
        if not progressed:
            if chunk == 1:
                break
            n = min(n * 2, len(best_events))


def _simplify_requests(best: Callable[[], list[Event]], attempt: Callable[[list[Event]], bool],
                       deadline: float) -> None:
    """Shorter prompts, fewer max_tokens, no stop tokens, eos, salt or
    priority, no adapter, grammar or encoder inputs (``_request_options``)."""
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        best_events = best()
        for i, e in enumerate(best_events):
            if not isinstance(e, AddRequest):
                continue
            options = _request_options(e.request)
            for opt in options:
                cand = list(best_events)
                cand[i] = AddRequest(opt)
                if attempt(cand):
                    changed = True
                    break
            if changed:
                break


def _request_options(r: RequestSpec) -> list[RequestSpec]:
    """Simpler versions of ``r``, each one change away (a change that makes
    no valid request is left out)."""
    options: list[RequestSpec] = []
    makers: list[Callable[[], RequestSpec]] = []
    if len(r.prompt_token_ids) > 1:
        half = r.prompt_token_ids[: max(1, len(r.prompt_token_ids) // 2)]
        makers.append(lambda: _with_prompt(r, half))
        makers.append(lambda: _with_prompt(r, r.prompt_token_ids[:-1]))
    if r.max_tokens > 1:
        makers.append(lambda: dataclasses.replace(r, max_tokens=max(1, r.max_tokens // 2)))
    if r.stop_token_ids:
        makers.append(lambda: dataclasses.replace(r, stop_token_ids=()))
    if r.eos_token_id is not None:
        makers.append(lambda: dataclasses.replace(r, eos_token_id=None))
    if r.cache_salt is not None:
        makers.append(lambda: dataclasses.replace(r, cache_salt=None))
    if r.priority != 0:
        makers.append(lambda: dataclasses.replace(r, priority=0))
    for make in makers:
        try:
            options.append(make())
        except SchedSpecError:
            continue
    options.extend(_gate_options(r))
    options.extend(_kv_options(r))
    return options


def _with_prompt(r: RequestSpec, prompt: tuple[int, ...]) -> RequestSpec:
    """``r`` with a shorter prompt, keeping the encoder inputs inside it and
    its external prefix within it."""
    ext = min(r.kv_external_tokens, len(prompt) if r.kv_load_async else len(prompt) - 1)
    return dataclasses.replace(r, prompt_token_ids=prompt,
                               mm_inputs=tuple(m for m in r.mm_inputs if m.end <= len(prompt)),
                               kv_external_tokens=ext, kv_load_async=r.kv_load_async and ext > 0)


def _kv_options(r: RequestSpec) -> list[RequestSpec]:
    """``r`` with one of its connector fields dropped or cut: its
    asynchronous save, its asynchronous load, its external prefix (halved,
    then none)."""
    out: list[RequestSpec] = []
    if r.kv_save_async:
        out.append(dataclasses.replace(r, kv_save_async=False))
    if r.kv_load_async:
        # a synchronous load leaves a prompt token to compute
        ext = min(r.kv_external_tokens, len(r.prompt_token_ids) - 1)
        out.append(dataclasses.replace(r, kv_load_async=False, kv_external_tokens=ext))
    if r.kv_external_tokens:
        if r.kv_external_tokens > 1:
            out.append(dataclasses.replace(r, kv_external_tokens=r.kv_external_tokens // 2))
        out.append(dataclasses.replace(r, kv_external_tokens=0, kv_load_async=False))
    return out


def _gate_options(r: RequestSpec) -> list[RequestSpec]:
    """``r`` with one of its gate fields dropped: its adapter, its grammar's
    refused tokens, its structured output, its encoder inputs (all, then the
    last one), its full KV cache report."""
    out: list[RequestSpec] = []
    if r.kv_cache_report_mode != "incremental":
        out.append(dataclasses.replace(r, kv_cache_report_mode="incremental"))
    if r.lora_id:
        out.append(dataclasses.replace(r, lora_id=0))
    if r.grammar_rejects:
        out.append(dataclasses.replace(r, grammar_rejects=()))
    if r.structured_output:
        out.append(dataclasses.replace(r, structured_output=False, grammar_rejects=()))
    if r.mm_inputs:
        out.append(dataclasses.replace(r, mm_inputs=()))
        if len(r.mm_inputs) > 1:
            out.append(dataclasses.replace(r, mm_inputs=r.mm_inputs[:-1]))
    return out


def count_steps(events: tuple[Event, ...] | list[Event]) -> int:
    return sum(1 for e in events if isinstance(e, (Step, Schedule)))
