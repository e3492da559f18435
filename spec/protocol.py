"""The protocol boundary: the checks every scheduler makes, with the same
errors and messages, before it changes anything.

The spec, the fast implementation (impl/) and the vLLM adapter all call these,
so a caller that breaks the add / abort / schedule / update protocol gets the
same exception whichever scheduler it drives. Each check raises or returns;
none changes the scheduler, so an operation that raises changes nothing.

The two input rules at ``add`` are vLLM's own, enforced before its scheduler
sees a request: a duplicate id, and a prompt that leaves no room for one
output token (vllm/v1/engine/input_processor.py, _validate_model_input).
"""

from __future__ import annotations

from typing import Container, Mapping, TypeVar

from schedspec.spec.interface import (
    ProtocolError,
    RequestError,
    RequestSpec,
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
    return request


def check_abort(request_id: str, unfinished: Mapping[str, T]) -> T:
    """abort(): the id must name an unfinished request; returns its record."""
    record = unfinished.get(request_id)
    if record is None:
        raise RequestError(request_id, "request_id", "no unfinished request with this id")
    return record


def check_schedule(outstanding: StepPlan | None) -> None:
    """schedule(): not while a plan awaits its update()."""
    if outstanding is not None:
        raise ProtocolError("schedule() called again before update() of the previous plan")


def check_reset(outstanding: StepPlan | None) -> None:
    """reset_prefix_cache(): not while a plan awaits its update()."""
    if outstanding is not None:
        raise ProtocolError("reset_prefix_cache between schedule() and update()")


def is_token_ids(toks: object) -> bool:
    """A tuple of non-negative ints (bools are not token ids)."""
    return isinstance(toks, tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks
    )


def check_update(plan: StepPlan, outstanding: StepPlan | None, result: object) -> StepResult:
    """update(), first: ``plan`` is the outstanding plan and ``result`` a StepResult."""
    if outstanding is None or (plan is not outstanding and plan != outstanding):
        raise ProtocolError(f"update() with a plan that is not the outstanding one (step {plan.step})")
    if not isinstance(result, StepResult):
        raise ProtocolError(f"result must be a StepResult, got {type(result).__name__}")
    return result


def check_sampled(plan: StepPlan, result: StepResult, unfinished: Container[str]) -> None:
    """update(), then: tokens only for scheduled requests, each a tuple of token
    ids; one token for every step that completes a request's known tokens,
    none for a partial prefill chunk. A request aborted while the step ran
    (no longer in ``unfinished``) may get anything well-formed: it is dropped."""
    planned = {s.request_id for s in plan.scheduled}
    for rid, toks in result.sampled.items():
        if rid not in planned:
            raise ProtocolError(f"result has tokens for {rid!r}, which the plan did not schedule")
        if not is_token_ids(toks):
            raise ProtocolError(f"result for {rid!r} must be a tuple of token ids, got {toks!r}")
    for s in plan.scheduled:
        if s.request_id not in unfinished:
            continue
        got = len(result.sampled.get(s.request_id, ()))
        want = 1 if s.samples else 0
        if got != want:
            what = "a completed step" if s.samples else "a partial prefill chunk"
            raise ProtocolError(f"result for {s.request_id!r} has {got} tokens; {what} takes {want}")


def check_result(
    plan: StepPlan, outstanding: StepPlan | None, result: object, unfinished: Container[str]
) -> StepResult:
    """Every check of update(), in order."""
    checked = check_update(plan, outstanding, result)
    check_sampled(plan, checked, unfinished)
    return checked


__all__ = [
    "check_abort",
    "check_add",
    "check_config",
    "check_reset",
    "check_result",
    "check_sampled",
    "check_schedule",
    "check_update",
    "is_token_ids",
]
