"""vLLM built for the config's model runner and pipeline size, and what
Model Runner V2 changes in the SchedulerOutput it hands the runner.

The runner. vLLM 0.33 decides ``VllmConfig.use_v2_model_runner``
(vllm/config/vllm.py) from, in order, HiSparse and watermarking (not
modelled), then the environment variable ``VLLM_USE_V2_MODEL_RUNNER`` when
set, then Triton (absent from the CPU build: V1), then the features V2 does
not support. The adapter pins the variable to "0" when vLLM is imported
(vllm_env.py); ``runner_env`` sets it to "1" for a ``model_runner="v2"``
config while the VllmConfig and the scheduler are built, which is vLLM's
own documented switch, and puts "0" back. ``vllm.envs`` reads the variable
on every access (its cache is enabled only by a running engine), and the
scheduler reads the property once, in Scheduler.__init__
(``self.use_v2_model_runner``, ``can_skip_drafts``), where
``check_runner`` confirms what it got.

The pipeline: ``ParallelConfig.pipeline_parallel_size``; the scheduler
reads it as ``use_pp`` and the AsyncScheduler as ``pp_size`` and
``decode_stagger`` (vllm/v1/core/sched/async_scheduler.py, __init__). No
worker is started, so no process group is needed.

The message (vllm/v1/core/sched/scheduler.py, Scheduler.schedule, "Construct
the scheduler output", and _make_cached_request_data): with V2 a resumed
request is sent in ``scheduled_new_reqs`` with ``prefill_token_ids`` = its
whole token history (``req._all_token_ids``), and ``resumed_req_ids`` is
empty; ``CachedRequestData.all_token_ids`` is never filled (no
``prev_step_scheduled_req_ids``).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from schedspec.spec.interface import SchedulerConfig, StepPlan

from schedspec.adapters.vllm_load import VllmAdapterError
from schedspec.adapters.vllm_requests import Live

_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_LOCK = threading.RLock()


@contextmanager
def runner_env(config: SchedulerConfig) -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER`` as ``config.model_runner`` asks while the
    block runs (one thread at a time), the pinned "0" afterwards."""
    with _LOCK:
        os.environ[_ENV] = "1" if config.model_runner == "v2" else "0"
        try:
            yield
        finally:
            os.environ[_ENV] = "0"


def parallel_config(config: SchedulerConfig) -> Any:
    """vLLM's ParallelConfig with the config's pipeline size (every other
    parallelism 1)."""
    from vllm.config import ParallelConfig

    return ParallelConfig(pipeline_parallel_size=config.pipeline_parallel_size)


def check_runner(sched: Any, config: SchedulerConfig) -> None:
    """VllmAdapterError unless vLLM's scheduler took the runner and pipeline
    size of ``config``: ``use_v2_model_runner``, ``use_pp``, the drafter's
    ``num_lookahead_tokens`` and ``can_skip_drafts``, and for the
    AsyncScheduler ``decode_stagger`` (the pipeline size; 1 only on XPU)."""
    v2 = config.model_runner == "v2"
    pp = config.pipeline_parallel_size
    got = {"use_v2_model_runner": getattr(sched, "use_v2_model_runner", None), "use_pp": getattr(sched, "use_pp", None),
           "can_skip_drafts": getattr(sched, "can_skip_drafts", False),  # vLLM 0.32 never skips drafts
           "num_lookahead_tokens": getattr(sched, "num_lookahead_tokens", None)}
    want: dict[str, object] = {"use_v2_model_runner": v2, "use_pp": pp > 1,
                               "can_skip_drafts": v2 and config.num_lookahead_tokens > 0,
                               "num_lookahead_tokens": config.num_lookahead_tokens}
    if config.async_scheduling:
        got["decode_stagger"] = getattr(sched, "decode_stagger", None)
        want["decode_stagger"] = pp
    for name, value in want.items():
        if got[name] != value:
            raise VllmAdapterError(f"vLLM's scheduler has {name}={got[name]!r}; the config needs {value!r}")


def resuming(sched: Any) -> frozenset[str]:
    """The requests that schedule() would admit as resumed (V1's
    ``scheduled_resumed_reqs``; V2 sends them among the new ones): those
    PREEMPTED, and those WAITING_FOR_REMOTE_KVS that were preempted before,
    which _handle_blocked_waiting_request promotes to PREEMPTED once their
    load is done (``if request.num_preemptions``)."""
    return frozenset(
        rid for rid, r in sched.requests.items()
        if r.status.name == "PREEMPTED" or (r.status.name == "WAITING_FOR_REMOTE_KVS" and r.num_preemptions)
    )


def v2_message_problems(out: Any, plan: StepPlan, live: Mapping[str, Live]) -> list[str]:
    """What V2's SchedulerOutput must carry that the V1 runner's does not, as
    sentences naming the field and the request: a resumed request (the plan's
    RESUMED entries) among the new ones with its whole history
    as ``prefill_token_ids``, a new one with its history too, no resumed ids
    and no ``all_token_ids`` among the cached requests."""
    problems: list[str] = []
    new = {nr.req_id: nr for nr in out.scheduled_new_reqs}
    for s in plan.scheduled:
        if s.kind.value == "resumed" and s.request_id not in new:
            problems.append(f"the V2 runner gets resumed request {s.request_id!r} outside scheduled_new_reqs")
    for rid, nr in new.items():
        history = list(live[rid].req.all_token_ids)
        if list(nr.prefill_token_ids or ()) != history:
            problems.append(f"NewRequestData.prefill_token_ids of {rid!r} is not its whole token history "
                            f"({len(nr.prefill_token_ids or ())} tokens, it has {len(history)})")
    cached = out.scheduled_cached_reqs
    if cached.resumed_req_ids:
        problems.append(f"CachedRequestData.resumed_req_ids is {sorted(cached.resumed_req_ids)!r} with the V2 runner")
    if cached.all_token_ids:
        problems.append(f"CachedRequestData.all_token_ids names {sorted(cached.all_token_ids)!r} with the V2 runner "
                        "(it keeps no prev_step_scheduled_req_ids)")
    return problems

