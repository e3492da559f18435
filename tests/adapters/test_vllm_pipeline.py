"""vLLM's scheduler built with a pipeline size (schedspec/adapters/vllm_config.py,
_parallel_config) in lockstep with the spec and impl, k plans in flight; and the
cached requests' new_token_ids (vllm_message.py) held to the plan."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from schedspec.adapters.vllm_message import message_problems
from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler
from tests.adapters.test_vllm_adapter import needs_vllm, vllm_factory, vllm_loaded  # noqa: F401 (a fixture)
from tests.adapters.test_vllm_message import CONFIG, _out, _plan

pytestmark = needs_vllm


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_vllms_scheduler_takes_the_pipeline_size(pp: int, vllm_loaded: Any) -> None:
    from schedspec.adapters.vllm_config import build_vllm_config

    vc, _ = build_vllm_config(SchedulerConfig(pipeline_parallel_size=pp))
    assert vc.parallel_config.pipeline_parallel_size == pp and vc.max_concurrent_batches == pp


def test_spec_impl_and_vllm_agree_with_k_plans_in_flight(vllm_loaded: Any) -> None:
    seen: dict[tuple[bool, int], int] = {}
    for seed in range(60):
        w = random_workload(seed, 40, modes=("sync", "async"), pipeline=True)
        key = (w.config.async_scheduling, w.config.max_concurrent_batches)
        if seen.get(key, 0) >= 2:
            continue
        seen[key] = seen.get(key, 0) + 1
        runner = Runner(w.config, {"spec": SpecScheduler, "impl": ImplScheduler, "vllm": vllm_factory})
        assert runner.run_to_completion(w.events) is None, (seed, w.config.pipeline_parallel_size)
    assert {(False, 1), (False, 2), (False, 3), (False, 4), (True, 2)} <= set(seen)


def test_new_token_ids_are_the_tokens_the_plan_computes_under_a_pipeline() -> None:
    plan, live = _plan()
    pp = dataclasses.replace(CONFIG, pipeline_parallel_size=2)
    b = plan.get("b")
    assert b is not None
    good = SimpleNamespace(req_ids=["b"], new_token_ids=[list(b.token_ids)], all_token_ids={}, num_output_tokens=[3])
    assert message_problems(_out(scheduled_cached_reqs=good), plan, live, pp, frozenset({"b"})) == []
    bad = SimpleNamespace(req_ids=["b"], new_token_ids=[[1]], all_token_ids={}, num_output_tokens=[3])
    found = message_problems(_out(scheduled_cached_reqs=bad), plan, live, pp, frozenset({"b"}))
    assert len(found) == 1 and "new_token_ids of 'b' is [1]" in found[0]
    none = SimpleNamespace(req_ids=["b"], new_token_ids=[], all_token_ids={}, num_output_tokens=[3])
    assert "0 lists for 1 cached" in message_problems(_out(scheduled_cached_reqs=none), plan, live, pp,
                                                       frozenset({"b"}))[0]
