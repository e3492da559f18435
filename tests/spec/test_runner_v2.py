"""The model runner choice (Model Runner V2) and pipeline_parallel_size:
the config fields, what vLLM refuses, and the trace format version 7."""

from __future__ import annotations

import dataclasses
import json

import pytest

from schedspec.check.trace import TraceError, loads
from schedspec.spec.interface import ConfigError, SchedulerConfig


def test_defaults_are_the_v1_runner_without_pipeline() -> None:
    c = SchedulerConfig()
    assert c.model_runner == "v1" and c.pipeline_parallel_size == 1
    assert "model_runner" not in c.to_dict() and "pipeline_parallel_size" not in c.to_dict()


def test_round_trip() -> None:
    c = SchedulerConfig(model_runner="v2", pipeline_parallel_size=3, async_scheduling=True)
    assert SchedulerConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("kw, field", [
    ({"model_runner": "v3"}, "model_runner"),
    ({"model_runner": 2}, "model_runner"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ({"pipeline_parallel_size": 5}, "pipeline_parallel_size"),
    # VllmConfig._get_v1_model_runner_unsupported_features
    ({"pipeline_parallel_size": 2, "async_scheduling": True}, "pipeline_parallel_size"),
])
def test_refused_naming_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**kw)  # type: ignore[arg-type]
    assert err.value.field == field


def test_v1_runner_with_pipeline_but_sync_is_accepted() -> None:
    assert SchedulerConfig(pipeline_parallel_size=2).pipeline_parallel_size == 2


def test_version_6_trace_cannot_name_the_runner() -> None:
    header = {"schedspec_trace": 6, "config": {"model_runner": "v2"}}
    with pytest.raises(TraceError, match="config.model_runner: needs trace format version 7"):
        loads(json.dumps(header) + "\n", path="t.jsonl")


# -- the decode throttle (spec/runner_v2.py), spec and impl, and its invariant

from schedspec.impl import ImplScheduler  # noqa: E402
from schedspec.spec.interface import RequestSpec, StepPlan, StepResult  # noqa: E402
from schedspec.spec.scheduler import SpecScheduler  # noqa: E402


def _config(runner: str, pp: int) -> SchedulerConfig:
    return SchedulerConfig(block_size=4, num_blocks=33, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64,
                           async_scheduling=True, model_runner=runner, pipeline_parallel_size=pp)


def _drive(sched: object, steps: int) -> list[StepPlan]:
    """Two requests decoding with one step in flight (the async driver):
    schedule N+1, then update N."""
    s: object = sched
    for i in range(2):
        s.add(RequestSpec(f"r{i}", (1, 2, 3, 4 + i), 40))  # type: ignore[attr-defined]
    plans: list[StepPlan] = [s.schedule()]  # type: ignore[attr-defined]
    for _ in range(steps):
        plans.append(s.schedule())  # type: ignore[attr-defined]
        done = plans[-2]
        s.update(done, StepResult({e.request_id: (7,) for e in done.scheduled if e.samples}))  # type: ignore[attr-defined]
    return plans


def _steps_of(plans: list[StepPlan], rid: str) -> list[int]:
    return [p.step for p in plans if p.get(rid) is not None]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_v2_pipeline_async_decodes_every_pp_steps(pp: int) -> None:
    spec = SpecScheduler(_config("v2", pp))
    steps = _steps_of(_drive(spec, 12), "r0")
    # the prefill samples in step 1; then one decode every pp steps
    assert steps == list(range(1, 14, pp))
    assert spec.rules["v2.decode_throttled"] > 0


@pytest.mark.parametrize("runner, pp", [("v1", 1), ("v2", 1)])
def test_no_throttle_without_v2_pipeline(runner: str, pp: int) -> None:
    # ("v1", pp > 1) with async scheduling is refused by the config
    assert _steps_of(_drive(SpecScheduler(_config(runner, pp)), 8), "r0") == list(range(1, 10))


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_impl_throttles_as_the_spec(pp: int) -> None:
    assert _drive(ImplScheduler(_config("v2", pp)), 15) == _drive(SpecScheduler(_config("v2", pp)), 15)


# -- the generator (schedspec/check/runner_draw.py)

from schedspec.check.random_workloads import random_workload  # noqa: E402


def test_the_generator_draws_both_runners_and_every_pipeline_size() -> None:
    drawn = set()
    for seed in range(150):
        w = random_workload(seed, 5, modes=("sync", "async"), runner=True)
        c = w.config
        assert not (c.model_runner == "v1" and c.async_scheduling and c.pipeline_parallel_size > 1)
        assert f"runner:{c.model_runner}/pp{c.pipeline_parallel_size}" in w.features
        drawn.add((c.model_runner, c.pipeline_parallel_size, c.async_scheduling))
        # the rest of the workload is the one its seed always gave where the
        # plans in flight are as many (the generator's steps follow k)
        plain = random_workload(seed, 5, modes=("sync", "async"))
        assert plain.config.model_runner == "v1"
        if c.max_concurrent_batches == plain.config.max_concurrent_batches:
            assert w.events == plain.events
        assert dataclasses.replace(c, model_runner="v1", pipeline_parallel_size=1) == plain.config
    assert {pp for r, pp, a in drawn if r == "v1" and not a} == {1, 2, 3, 4}
    assert {pp for r, pp, a in drawn if r == "v2" and a} == {1, 2, 3, 4}


def test_the_runner_draw_gives_only_configs_the_spec_accepts_in_every_mode() -> None:
    """Spec mode (drafts, no async) refuses a synchronous pipeline: the
    runner draw keeps it at one plan in flight, and still draws both runners."""
    from schedspec.check.runner_draw import with_runner

    with_drafts = 0
    for seed in range(60):
        c = random_workload(seed, 5, modes=("spec",), runner=True, pipeline=True).config
        if c.num_speculative_tokens:
            with_drafts += 1
            assert c.pipeline_parallel_size == 1
    assert with_drafts > 30
    sync_drafts = SchedulerConfig(num_speculative_tokens=2)
    assert {with_runner(sync_drafts, s).model_runner for s in range(40)} == {"v1", "v2"}
    assert {with_runner(sync_drafts, s).pipeline_parallel_size for s in range(40)} == {1}


@pytest.mark.parametrize("runner, asynchronous, pp, batches", [
    ("v1", False, 1, 1), ("v1", True, 1, 2), ("v1", False, 3, 3),
    ("v2", False, 1, 1), ("v2", True, 1, 2), ("v2", True, 3, 4), ("v2", False, 4, 4),
])
def test_max_concurrent_batches_as_vllm(runner: str, asynchronous: bool, pp: int, batches: int) -> None:
    # VllmConfig.max_concurrent_batches: the sliding-window caps reserve that many token budgets
    c = SchedulerConfig(model_runner=runner, async_scheduling=asynchronous, pipeline_parallel_size=pp)
    assert c.max_concurrent_batches == batches


def test_a_pipeline_reserves_more_for_a_sliding_window_group() -> None:
    from schedspec.spec.interface import KVCacheGroup
    from schedspec.spec.kv_groups import GroupLayout

    kw: dict[str, object] = dict(block_size=4, num_blocks=40, max_num_batched_tokens=16, max_model_len=128,
                                 kv_cache_groups=(KVCacheGroup(kind="sliding_window", sliding_window=8),))
    one = GroupLayout.of(SchedulerConfig(**kw))  # type: ignore[arg-type]
    three = GroupLayout.of(SchedulerConfig(pipeline_parallel_size=3, **kw))  # type: ignore[arg-type]
    c1, c3 = one.admission_caps[0], three.admission_caps[0]
    assert c1 is not None and c3 is not None and c3 > c1
