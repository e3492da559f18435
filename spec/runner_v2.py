"""Model Runner V2 (``model_runner="v2"``): the decisions of vLLM 0.33's
scheduler that branch on ``use_v2_model_runner``.

The decode throttle (V2 + pipeline parallelism + async scheduling): the
scheduler counts every schedule() call (``Scheduler.current_step``, the
spec's ``step``). After a step that leaves a request sampling (not a prefill
chunk), the AsyncScheduler stamps it ``next_decode_eligible_step =
current_step + decode_stagger`` (``decode_stagger`` is the pipeline size),
and the RUNNING loop passes over a running request while ``current_step <
next_decode_eligible_step``: one request is scheduled at most once every
``pipeline_parallel_size`` steps, matching the worker's ring of broadcast
sampled-token slots. The stamp is never reset (a preemption keeps it; a
resumed request is admitted by the WAITING loop, which does not read it).

What else V2 changes is how the plan is packaged for the runner, not what
is decided: a resumed request is sent as a new one with its whole token
history, cached requests carry no ``all_token_ids`` (no
``prev_step_scheduled_req_ids``), and the encoder inputs travel as updates.
The spec's plan keeps the kind RESUMED; the vLLM adapter's message check
(schedspec/adapters/vllm_message.py) holds vLLM's packaging to it.

Skipping drafts (``can_skip_drafts``: V2 and a drafter that reserves
lookahead slots, the config's ``drafter="draft_model"``): the plan says
``skip_drafts`` when no request scheduled in the step, preempted later in it
or not, can use the drafts proposed after it (``drafts_unused``): a
non-final prefill chunk, or a step sure to bring the request to max_tokens.
The model runner then proposes none; the plan's entries and the KV blocks do
not change. With the ngram drafter (no lookahead) or the V1 runner the plan
never skips drafts.

vLLM 0.33: vllm/v1/core/sched/scheduler.py (Scheduler.__init__:
``current_step``, ``can_skip_drafts``; Scheduler.schedule: ``current_step +=
1``, the RUNNING loop's ``current_step < request.next_decode_eligible_step``,
``drafts_needed`` and ``skip_drafts=not drafts_needed``; _drafts_unused),
vllm/v1/core/sched/async_scheduler.py (AsyncScheduler.__init__:
``decode_stagger = pp_size``; _update_after_schedule: the stamp), and
vllm/v1/request.py (Request.next_decode_eligible_step, 0 at first).
"""

from __future__ import annotations

from schedspec.spec.interface import SchedulerConfig


def decode_stagger(config: SchedulerConfig) -> int:
    """The steps between two decodes of one request the scheduler enforces:
    the pipeline size with the V2 runner and async scheduling
    (AsyncScheduler.__init__ and _update_after_schedule, which stamps only
    ``if self.use_v2_model_runner``); 0 = no throttle (the V1 runner, or the
    synchronous Scheduler, which never stamps)."""
    if config.model_runner == "v2" and config.async_scheduling:
        return config.pipeline_parallel_size
    return 0


def decode_throttled(current_step: int, next_decode_eligible_step: int) -> bool:
    """Scheduler.schedule, the RUNNING loop: ``if self.current_step <
    request.next_decode_eligible_step: continue`` (passed over, not a stop).

    post: __return__ == (current_step < next_decode_eligible_step)
    """
    return current_step < next_decode_eligible_step


def can_skip_drafts(config: SchedulerConfig) -> bool:
    """Scheduler.__init__: ``can_skip_drafts = num_lookahead_tokens > 0 and
    use_v2_model_runner`` (vllm/v1/core/sched/scheduler.py): only a drafter
    with a forward pass of its own, under the V2 runner, may skip drafting."""
    return config.num_lookahead_tokens > 0 and config.model_runner == "v2"


def drafts_unused(
    num_tokens: int, num_computed: int, num_new_tokens: int,
    num_output_tokens: int, num_output_placeholders: int, max_tokens: int,
) -> bool:
    """Scheduler._drafts_unused (vllm/v1/core/sched/scheduler.py): the drafts
    proposed for a request after this step are sure to go unused. Either the
    step is a non-final prefill chunk (``num_computed + num_new_tokens <
    num_tokens``: it samples nothing, and drafts after a chunk are dropped),
    or it samples the request's last output token: the outputs it surely has
    afterwards, one from this step and one more from a sampling step in flight
    (async placeholders), reach ``max_tokens``.

    pre: num_tokens >= 1 and num_computed >= 0 and num_new_tokens >= 0
    pre: num_output_tokens >= 0 and num_output_placeholders >= 0 and max_tokens >= 1
    post: __return__ or num_computed + num_new_tokens >= num_tokens
    """
    if num_computed + num_new_tokens < num_tokens:
        return True
    surely = num_output_tokens + 1 + (1 if num_output_placeholders > 0 else 0)
    return surely >= max_tokens
