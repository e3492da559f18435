"""The encoder fields of what vLLM hands its model runner, held to the plan
(the rest: vllm_message.py).

vLLM 0.33.0, vllm/v1/core/sched/scheduler.py:
- ``scheduled_encoder_input_stats`` (Scheduler._make_scheduled_encoder_input_stats):
  None without ``log_stats`` and ``enable_logging_iteration_details``, or when
  no encoder input runs; otherwise the number of inputs the step encodes and
  their embeddings (``mm_position.get_num_embeds()``: each input's length
  here, the adapter sets no ``is_embed``);
- ``encoder_input_updates`` (Scheduler._get_encoder_input_updates): empty
  with the V1 model runner; with the V2 one, request -> input index ->
  payload, only for requests the step schedules and inputs they have.
"""

from __future__ import annotations

from typing import Any, Mapping

from schedspec.spec.interface import StepPlan

from schedspec.adapters.vllm_requests import Live


def encoder_problems(out: Any, plan: StepPlan, live: Mapping[str, Live]) -> list[str]:
    """The encoder fields of ``out`` that are not what ``plan`` implies."""
    problems: list[str] = []
    inputs = [(s.request_id, i) for s in plan.scheduled for i in s.encoder_inputs]
    stats = getattr(out, "scheduled_encoder_input_stats", None)  # a field an older vLLM lacks
    if stats is not None:
        embeds = sum(live[rid].spec.mm_inputs[i].length for rid, i in inputs)
        if (stats.num_inputs, stats.output_tokens) != (len(inputs), embeds) or not inputs:
            problems.append(f"scheduled_encoder_input_stats counts {stats.num_inputs} inputs and "
                            f"{stats.output_tokens} embeddings, the plan's encoder inputs {len(inputs)} and {embeds}")
    updates = getattr(out, "encoder_input_updates", None) or {}
    scheduled = {s.request_id for s in plan.scheduled}
    for rid, per_input in updates.items():
        if rid not in scheduled:
            problems.append(f"encoder_input_updates names {rid!r}, which the plan does not schedule")
        elif any(not 0 <= i < len(live[rid].spec.mm_inputs) for i in per_input):
            problems.append(f"encoder_input_updates of {rid!r} names inputs {sorted(per_input)}, "
                            f"the request has {len(live[rid].spec.mm_inputs)}")
    return problems
