"""vLLM built for Model Runner V2 and a pipeline (schedspec/adapters/vllm_runner.py):
the message fields V2 and pipeline parallelism change, checked on hand-made outputs,
and vLLM's own scheduler with the V2 runner in lockstep with the spec."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import pytest

from schedspec.adapters.vllm_message import message_problems
from schedspec.adapters.vllm_requests import Live
from schedspec.spec.interface import RequestSpec, ScheduledRequest, ScheduleKind, SchedulerConfig, StepPlan

PROMPT = (5, 6, 7, 8)


def _live(rid: str, outputs: tuple[int, ...] = ()) -> Live:
    spec = RequestSpec(rid, PROMPT, max_tokens=8)
    return Live(spec, SimpleNamespace(all_token_ids=list(PROMPT + outputs), num_output_tokens=len(outputs)))


def _plan(kind_a: ScheduleKind, live: dict[str, Live]) -> StepPlan:
    a = ScheduledRequest.of("a", kind_a, num_computed_tokens=0, num_scheduled_tokens=4 + 2,
                            all_token_ids=tuple(live["a"].req.all_token_ids), block_ids=(1,))
    b = ScheduledRequest.of("b", ScheduleKind.RUNNING, num_computed_tokens=5, num_scheduled_tokens=1,
                            all_token_ids=tuple(live["b"].req.all_token_ids), block_ids=(2,))
    return StepPlan(step=3, scheduled=(a, b), preempted_ids=(), finished_ids=())


def _out(prefill: Any, resumed: set[str], all_token_ids: dict[str, list[int]], new_token_ids: Any = ()) -> Any:
    new = SimpleNamespace(req_id="a", prompt_token_ids=list(PROMPT), lora_request=None, mm_features=[],
                          sampling_params=SimpleNamespace(max_tokens=8), prefill_token_ids=prefill, replay_start=0)
    cached = SimpleNamespace(req_ids=["b"], new_token_ids=list(new_token_ids), all_token_ids=all_token_ids,
                             num_output_tokens=[2], resumed_req_ids=resumed)
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, total_num_scheduled_tokens=7,
                           has_structured_output_requests=False, has_sync_kv_loads=False,
                           pending_structured_output_tokens=False)


LIVE = {"a": _live("a", (1, 2)), "b": _live("b", (3, 4))}
V2 = SchedulerConfig(model_runner="v2")


def test_v2_resumed_request_comes_as_new_with_its_history() -> None:
    plan = _plan(ScheduleKind.RESUMED, LIVE)
    assert message_problems(_out([*PROMPT, 1, 2], set(), {}), plan, LIVE, V2, frozenset()) == []


@pytest.mark.parametrize("out, words", [
    (_out(None, set(), {}), "prefill_token_ids of 'a' is not its whole token history"),
    (_out([*PROMPT, 1, 2], {"b"}, {}), "resumed_req_ids"),
    (_out([*PROMPT, 1, 2], set(), {"b": [5, 6, 7, 8, 3, 4]}), "all_token_ids names ['b'] with the V2 runner"),
])
def test_v2_message_fields_that_disagree_are_named(out: Any, words: str) -> None:
    found = message_problems(out, _plan(ScheduleKind.RESUMED, LIVE), LIVE, V2, frozenset())
    assert any(words in p for p in found), found


def test_v1_refuses_prefill_token_ids() -> None:
    found = message_problems(_out([*PROMPT, 1, 2], set(), {}), _plan(ScheduleKind.NEW, LIVE), LIVE,
                             SchedulerConfig(), frozenset({"b"}))
    assert any("prefill_token_ids" in p for p in found)


def test_pipeline_sync_sends_the_computed_tokens_back() -> None:
    pp = SchedulerConfig(pipeline_parallel_size=2)
    plan = _plan(ScheduleKind.NEW, LIVE)
    right = _out(None, set(), {}, new_token_ids=[[4]])  # b computes token 5: all_token_ids[5:6]
    assert message_problems(right, plan, LIVE, pp, frozenset({"b"})) == []
    wrong = _out(None, set(), {}, new_token_ids=[[3]])
    assert any("new_token_ids of 'b'" in p for p in message_problems(wrong, plan, LIVE, pp, frozenset({"b"})))
    # without a pipeline the list stays empty
    assert any("without pipeline parallelism" in p
               for p in message_problems(right, plan, LIVE, SchedulerConfig(), frozenset({"b"})))


@pytest.mark.vllm
@pytest.mark.parametrize("pp", [1, 3])
def test_vllm_takes_the_v2_runner_and_the_pipeline(pp: int) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    s = VllmScheduler(SchedulerConfig(async_scheduling=True, model_runner="v2", pipeline_parallel_size=pp))
    assert s.sched.use_v2_model_runner and s.sched.decode_stagger == pp
    assert s.sched.use_pp == (pp > 1)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # pinned again once built
    assert not VllmScheduler(SchedulerConfig()).sched.use_v2_model_runner


@pytest.mark.vllm
@pytest.mark.parametrize("modes, runner, pp", [
    (("async", "async-spec"), "v2", 3), (("async",), "v2", 2), (("sync",), "v2", 4), (("spec",), "v2", 1), (("sync",), "v1", 2),
])
def test_lockstep_with_vllm(modes: tuple[str, ...], runner: str, pp: int) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.check.random_workloads import random_workload
    from schedspec.check.run import run_workload
    from schedspec.spec.scheduler import SpecScheduler

    throttled = 0
    for seed in range(3):
        w = random_workload(seed, 120, modes=modes)
        w = dataclasses.replace(w, config=dataclasses.replace(w.config, model_runner=runner,
                                                              pipeline_parallel_size=pp))
        runner_, failure = run_workload(w, {"spec": SpecScheduler, "vllm": VllmScheduler})
        assert failure is None, failure
        throttled += runner_.scheds["spec"].rules["v2.decode_throttled"]
    assert (throttled > 0) == (runner == "v2" and modes[0].startswith("async") and pp > 1)


@pytest.mark.vllm
@pytest.mark.parametrize("modes, runner", [(("spec",), "v2"), (("async-spec",), "v2"), (("spec",), "v1")])
def test_draft_model_lockstep_with_vllm(modes: tuple[str, ...], runner: str) -> None:
    """A draft model (lookahead slots, a draft slot per request) in lockstep
    with vLLM's scheduler; with V2 vLLM's skip_drafts is the plan's."""
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.check.random_workloads import random_workload
    from schedspec.check.run import run_workload
    from schedspec.spec.scheduler import SpecScheduler

    skipped = 0
    for seed in range(3):
        w = random_workload(seed, 120, modes=modes)
        config = w.config
        if config.max_num_batched_tokens < 2 + config.num_speculative_tokens:
            continue  # no room for the draft slot (spec/validate.py)
        w = dataclasses.replace(w, config=dataclasses.replace(config, model_runner=runner, drafter="draft_model"))
        runner_, failure = run_workload(w, {"spec": SpecScheduler, "vllm": VllmScheduler})
        assert failure is None, failure
        skipped += runner_.scheds["spec"].rules["v2.drafts_skipped"]
    assert (skipped > 0) == (runner == "v2")


@pytest.mark.vllm
@pytest.mark.parametrize("modes, runner", [(("spec",), "v1"), (("async-spec",), "v2")])
def test_eagle_lockstep_with_vllm(modes: tuple[str, ...], runner: str) -> None:
    """An EAGLE drafter (method "eagle" on the tiny model's config): vLLM
    hashes each block with the token after it; plans, views and KV cache
    events (lookahead_token_ids included) are the spec's."""
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.check.random_workloads import random_workload
    from schedspec.check.run import run_workload
    from schedspec.spec.scheduler import SpecScheduler

    for seed in range(3):
        w = random_workload(seed, 120, modes=modes)
        config = dataclasses.replace(w.config, model_runner=runner, drafter="eagle", enable_prefix_caching=True,
                                     enable_kv_cache_events=True)
        assert config.num_hash_lookahead_tokens == 1
        s = VllmScheduler(config)
        assert s.sched.num_hash_lookahead_tokens == 1 and not s.sched.use_eagle_block_drop
        runner_, failure = run_workload(dataclasses.replace(w, config=config),
                                        {"spec": SpecScheduler, "vllm": VllmScheduler})
        assert failure is None, failure
