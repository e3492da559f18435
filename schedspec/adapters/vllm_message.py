"""What vLLM hands its model runner, held to the plan: the fields of a
SchedulerOutput that the plan does not carry.

The lockstep compares the plan (StepPlan, rebuilt from the SchedulerOutput by
vllm_views.plan_of) and the view with the spec's. A scheduler can still hand
the worker something wrong in a field neither carries: a resumed request's
token history, the output count the runner sizes its buffers by, a flag the
runner branches on. ``check_message`` derives each such field from the plan,
the scheduler's own request state (which the lockstep holds to the spec) and
the configuration, and compares; docs/divergences.md, "What the worker receives",
lists every field of vLLM 0.33's SchedulerOutput, NewRequestData and
CachedRequestData with how it is covered.

vLLM 0.33.0 sources: vllm/v1/core/sched/output.py (the dataclasses),
vllm/v1/core/sched/scheduler.py (Scheduler.schedule, _make_cached_request_data,
_update_after_schedule, _get_new_block_ids_to_zero, reset_prefix_cache), with
the V1 model runner; what Model Runner V2 and pipeline parallelism change is
held in schedspec/adapters/vllm_runner.py.
"""

from __future__ import annotations

from typing import Any, Mapping

from schedspec.spec.interface import SchedulerConfig, StepPlan

from schedspec.adapters.vllm_kinds import mamba_cache_mode
from schedspec.adapters.vllm_load import VllmAdapterError
from schedspec.adapters.vllm_message_encoder import encoder_problems
from schedspec.adapters.vllm_requests import Live
from schedspec.adapters.vllm_runner import v2_message_problems


class MessageCheck:
    """The message half of the lockstep: call ``check`` with every
    SchedulerOutput right after schedule() and its plan; ``reset`` when a
    prefix-cache reset preempted every running request."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        # Scheduler.prev_step_scheduled_req_ids: the last plan's requests.
        self.prev_scheduled: frozenset[str] = frozenset()

    def reset(self) -> None:
        """Scheduler.reset_prefix_cache(reset_running_requests=True) clears
        prev_step_scheduled_req_ids: every request is flushed from the
        runner's persistent batch and comes back with its whole history."""
        self.prev_scheduled = frozenset()

    def check(self, out: Any, plan: StepPlan, live: Mapping[str, Live]) -> None:
        problems = message_problems(out, plan, live, self.config, self.prev_scheduled)
        self.prev_scheduled = frozenset(s.request_id for s in plan.scheduled)
        if problems:
            raise VllmAdapterError(
                f"step {plan.step}: the SchedulerOutput vLLM hands its model runner disagrees with its plan: "
                + "; ".join(problems))


def _new_token_ids_problems(cached: Any, entries: Mapping[str, Any], config: SchedulerConfig) -> list[str]:
    """CachedRequestData.new_token_ids (_make_cached_request_data): with
    pipeline parallelism and no async scheduling the scheduler sends each
    cached request's tokens to compute, drafts left out
    (``all_token_ids[num_computed_tokens : num_computed_tokens + n]``), since
    the first stage's worker never sees what the last one sampled."""
    if config.pipeline_parallel_size == 1 or config.async_scheduling:
        if cached.new_token_ids:
            return [f"CachedRequestData.new_token_ids is {cached.new_token_ids!r} without pipeline parallelism"]
        return []
    if len(cached.new_token_ids) != len(cached.req_ids):
        return [f"CachedRequestData.new_token_ids has {len(cached.new_token_ids)} lists for "
                f"{len(cached.req_ids)} cached requests"]
    problems = []
    for rid, sent in zip(cached.req_ids, cached.new_token_ids):
        e = entries.get(rid)
        if e is not None and list(sent) != list(e.token_ids[: e.num_scheduled_tokens - len(e.spec_token_ids)]):
            problems.append(f"CachedRequestData.new_token_ids of {rid!r} is {list(sent)}, not the tokens the plan "
                            f"computes")
    return problems


def message_problems(out: Any, plan: StepPlan, live: Mapping[str, Live], config: SchedulerConfig,
                     prev_scheduled: frozenset[str]) -> list[str]:
    """Every field of ``out`` that is not what ``plan`` (with the requests'
    state in ``live`` and ``prev_scheduled``, the previous plan's requests)
    implies, as a sentence naming the field and the request."""
    async_scheduling = config.async_scheduling
    v2 = config.model_runner == "v2"  # Model Runner V2's message (vllm_runner.py)
    problems: list[str] = []
    entries = {s.request_id: s for s in plan.scheduled}
    total = sum(s.num_scheduled_tokens for s in plan.scheduled)
    if out.total_num_scheduled_tokens != total:
        problems.append(f"total_num_scheduled_tokens is {out.total_num_scheduled_tokens}, the plan schedules {total}")
    for new in out.scheduled_new_reqs:
        spec = live[new.req_id].spec
        # NewRequestData.from_request: the prompt as the request holds it
        if list(new.prompt_token_ids or ()) != list(spec.prompt_token_ids):
            problems.append(f"NewRequestData.prompt_token_ids of {new.req_id!r} is not its prompt")
        lora = new.lora_request.adapter_id if new.lora_request is not None else 0
        if lora != spec.lora_id:
            problems.append(f"NewRequestData.lora_request of {new.req_id!r} names adapter {lora}, "
                            f"the request {spec.lora_id}")
        params = new.sampling_params
        if params is None or params.max_tokens != spec.max_tokens:
            problems.append(f"NewRequestData.sampling_params of {new.req_id!r} are not the request's")
        # the V2 runner's whole-sequence copy (vllm_runner.py); DeepSeek's sliding-window replay
        if (new.prefill_token_ids is not None and not v2) or new.replay_start != 0:
            problems.append(f"NewRequestData of {new.req_id!r} carries prefill_token_ids or a replay_start, "
                            f"which the V1 model runner and the modelled layouts never get")
        if len(new.mm_features or ()) > len(spec.mm_inputs):
            problems.append(f"NewRequestData.mm_features of {new.req_id!r} has {len(new.mm_features)} inputs, "
                            f"the request {len(spec.mm_inputs)}")
    cached = out.scheduled_cached_reqs
    # _make_cached_request_data: new_token_ids only with pipeline parallelism
    # and no async scheduling: otherwise the runner caches the sampled tokens
    # itself and the list stays empty.
    problems += _new_token_ids_problems(cached, entries, config)
    for i, rid in enumerate(cached.req_ids):
        entry = entries.get(rid)
        if entry is None:
            problems.append(f"CachedRequestData names {rid!r}, which the plan does not schedule")
            continue
        req = live[rid].req
        # the whole history iff the runner may have dropped the request from
        # its persistent batch: it was not in the previous plan
        if v2:
            pass  # no all_token_ids (v2_message_problems)
        elif rid in prev_scheduled and rid in cached.all_token_ids:
            problems.append(f"CachedRequestData.all_token_ids sends {rid!r}'s history though the previous plan "
                            f"scheduled it")
        elif rid not in prev_scheduled:
            sent = cached.all_token_ids.get(rid)
            if sent is None:
                problems.append(f"CachedRequestData.all_token_ids leaves out {rid!r}, which the previous plan did "
                                f"not schedule (the model runner has no history for it)")
            elif list(sent) != list(req.all_token_ids):
                problems.append(f"CachedRequestData.all_token_ids of {rid!r} is not its prompt and output")
        # num_output_tokens: the request's outputs and those in flight, as
        # the plan states them (placeholders before this step's own)
        outputs = entry.num_tokens - len(live[rid].spec.prompt_token_ids) + entry.num_output_placeholders
        if cached.num_output_tokens[i] != outputs:
            problems.append(f"CachedRequestData.num_output_tokens of {rid!r} is {cached.num_output_tokens[i]}, "
                            f"the plan implies {outputs}")
    if v2:
        problems.extend(v2_message_problems(out, plan, live))
    # _update_after_schedule: a structured-output request that samples
    grammar = any(s.samples and live[s.request_id].spec.structured_output for s in plan.scheduled)
    if bool(out.has_structured_output_requests) != grammar:
        problems.append(f"has_structured_output_requests is {out.has_structured_output_requests}, the plan "
                        f"implies {grammar}")
    # AsyncScheduler._update_after_schedule: a structured-output request that
    # samples with tokens already in flight (the bitmask must wait for them)
    pending = async_scheduling and any(
        s.samples and s.num_output_placeholders > 0 and live[s.request_id].spec.structured_output
        for s in plan.scheduled)
    if bool(out.pending_structured_output_tokens) != pending:
        problems.append(f"pending_structured_output_tokens is {out.pending_structured_output_tokens}, the plan "
                        f"implies {pending}")
    # schedule(): a request admitted with external tokens loaded synchronously
    sync_loads = any(not load.asynchronous and load.end > load.start for load in plan.kv_loads)
    if bool(out.has_sync_kv_loads) != sync_loads:
        problems.append(f"has_sync_kv_loads is {out.has_sync_kv_loads}, the plan's loads imply {sync_loads}")
    # the fields the modelled configurations leave at their defaults
    fixed: dict[str, object] = {
        # no dynamic speculative decoding: the configured draft length
        "num_spec_tokens_to_schedule": config.num_speculative_tokens,
        # needs_kv_cache_zeroing: no modelled layout asks for it
        "new_block_ids_to_zero": None,
        # take_kv_cache_block_copies: copy-on-write of partial blocks, not modelled
        "kv_cache_block_copies": None,
        # the 0.33 scheduler never fills it (the runner finds common prefixes itself)
        "num_common_prefix_blocks": [],
        # the connector's own view of the blocks, cleared before dispatch
        "kv_connector_block_state": None,
        # EncoderCacheManager.get_manager_metadata returns None in 0.33
        "ec_manager_metadata": None,
        # _get_encoder_input_updates: {} with the V1 runner; with V2 the
        # modelled encoder inputs carry no data (MultiModalFeatureSpec.data None)
        "encoder_input_updates": {},
    }
    if mamba_cache_mode(config.groups) == "align":
        # KVCacheConfig.needs_kv_cache_zeroing with a Mamba group: the ids of
        # the attention blocks allocated since the last step, those freed
        # again by a preemption in it included; not modelled yet (no plan
        # field carries them), only their type is checked
        fixed.pop("new_block_ids_to_zero")
        problems.extend(zeroed_problems(out.new_block_ids_to_zero))
    # scheduled_encoder_input_stats, encoder_input_updates: vllm_message_encoder.py
    problems.extend(encoder_problems(out, plan, live))
    for name, want in fixed.items():
        # a field an older vLLM lacks (the engine's 0.32, docs/engine.md) is
        # not compared; 0.33's fields are held to its dataclass by a test
        got = getattr(out, name, want)
        if got != want:
            problems.append(f"{name} is {got!r}, expected {want!r} here")
    return problems


def zeroed_problems(got: Any) -> list[str]:
    """Scheduler._get_new_block_ids_to_zero with a Mamba group: None or a
    list of block ids (their values are not modelled yet)."""
    if got is None or (isinstance(got, list) and all(isinstance(b, int) and b > 0 for b in got)):
        return []
    return [f"new_block_ids_to_zero is {got!r}, not None or a list of block ids"]
