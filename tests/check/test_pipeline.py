"""k plans in flight (pipeline_parallel_size): the config and its bad input,
the protocol in the spec and impl, the engine loop, traces of version 7, the
generator's draw and the shrinker."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

from schedspec.check import trace as tracefile
from schedspec.check.driver import Runner
from schedspec.check.pipeline import allowed_sizes, describe
from schedspec.check.random_workloads import random_workload
from schedspec.check.shrink import _config_options
from schedspec.check.trace import TraceError
from schedspec.check.workload import AddRequest, Event, ResetPrefixCache, Schedule, Step, Update, Workload
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import (
    ConfigError,
    KVCacheGroup,
    ProtocolError,
    RequestSpec,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from schedspec.spec.scheduler import SpecScheduler
from tests.check.test_inflight import Recorder, _recorder

BASE = SchedulerConfig(block_size=2, num_blocks=33, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)
PP3 = dataclasses.replace(BASE, pipeline_parallel_size=3)
BOTH: list[Callable[[SchedulerConfig], Any]] = [SpecScheduler, ImplScheduler]


def _req(rid: str, n: int = 3, max_tokens: int = 6) -> RequestSpec:
    return RequestSpec(request_id=rid, prompt_token_ids=tuple(range(1, n + 1)), max_tokens=max_tokens, ignore_eos=True)


def _result(plan: StepPlan, token: int = 7) -> StepResult:
    return StepResult({e.request_id: (token,) for e in plan.scheduled if e.samples})


# -- the config --------------------------------------------------------------


@pytest.mark.parametrize(("pp", "async_", "k"), [(1, False, 1), (2, False, 2), (3, False, 3), (4, False, 4),
                                                (1, True, 2)])
def test_max_concurrent_batches_is_vllms(pp: int, async_: bool, k: int) -> None:
    """vllm/config/vllm.py, VllmConfig.max_concurrent_batches under the V1 model runner."""
    config = dataclasses.replace(BASE, pipeline_parallel_size=pp, async_scheduling=async_)
    assert config.max_concurrent_batches == k


@pytest.mark.parametrize(("kw", "words"), [
    ({"pipeline_parallel_size": 0}, "must be positive"),
    ({"pipeline_parallel_size": 5}, "maximum 4"),
    ({"pipeline_parallel_size": True}, "must be an integer"),
    ({"pipeline_parallel_size": 2, "async_scheduling": True}, "refuses pipeline parallelism with async scheduling"),
])
def test_a_pipeline_size_vllm_does_not_take_is_a_config_error_naming_the_field(kw: dict[str, object],
                                                                                words: str) -> None:
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(BASE, **kw)  # type: ignore[arg-type]
    assert e.value.field == "pipeline_parallel_size" and words in str(e.value)


def test_drafts_of_a_synchronous_pipeline_are_refused_as_not_modelled() -> None:
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(BASE, pipeline_parallel_size=2, num_speculative_tokens=2)
    assert e.value.field == "num_speculative_tokens" and "not modelled" in str(e.value)
    assert dataclasses.replace(BASE, async_scheduling=True, num_speculative_tokens=2).max_concurrent_batches == 2


def test_a_sliding_window_group_reserves_for_every_plan_in_flight() -> None:
    """VllmConfig.max_in_flight_tokens = max_concurrent_batches * max_num_batched_tokens: a pool
    that fits one plan's window does not fit four."""
    groups = (KVCacheGroup(), KVCacheGroup(kind="sliding_window", sliding_window=4))
    config = SchedulerConfig(block_size=2, num_blocks=30, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=32, kv_cache_groups=groups)
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(config, pipeline_parallel_size=4)
    assert e.value.field == "num_blocks"


# -- the protocol, in the spec and impl ---------------------------------------


@pytest.mark.parametrize("make", BOTH)
def test_schedule_runs_while_k_minus_1_plans_are_in_flight_and_no_more(make: Callable[[SchedulerConfig], Any]) -> None:
    s = make(PP3)
    s.add(_req("a", n=12))
    plans = [s.schedule() for _ in range(3)]
    assert [p.step for p in plans] == [1, 2, 3]
    before = s.view()
    with pytest.raises(ProtocolError) as e:
        s.schedule()
    assert e.value.field == "plan" and e.value.step == 1 and "must be updated first" in str(e.value)
    assert s.view() == before  # an operation that raises changes nothing
    with pytest.raises(ProtocolError, match="out of order"):
        s.update(plans[1], _result(plans[1]))
    with pytest.raises(ProtocolError):
        s.reset_prefix_cache()  # three in flight: the engine serves a reset with at most k - 1
    for p in plans:
        s.update(p, _result(p))


@pytest.mark.parametrize("make", BOTH)
def test_a_pipeline_chunks_a_prefill_ahead_and_holds_a_decode_until_its_update(
        make: Callable[[SchedulerConfig], Any]) -> None:
    """Scheduler._update_after_schedule advances num_computed_tokens at schedule time, so the
    next chunk of a prefill goes out while the last is in flight, and a decode (num_new_tokens
    = num_tokens - num_computed_tokens = 0) waits for its update."""
    s = make(dataclasses.replace(PP3, max_num_batched_tokens=8, long_prefill_token_threshold=4))
    s.add(_req("a", n=10))
    s.add(_req("b", n=1, max_tokens=3))  # one padding request keeps the threshold active
    p1, p2, p3 = s.schedule(), s.schedule(), s.schedule()
    a_steps = [(p.get("a").num_computed_tokens, p.get("a").num_scheduled_tokens) for p in (p1, p2, p3)
               if p.get("a") is not None]
    assert a_steps == [(0, 4), (4, 4), (8, 2)]  # the chunks pipelined
    assert p1.get("b") is not None and p2.get("b") is None and p3.get("b") is None  # its decode waits
    s.update(p1, _result(p1))
    p4 = s.schedule()
    assert p4.get("b") is not None and p4.get("a") is None


def test_reset_prefix_cache_with_k_minus_1_plans_in_flight_is_served() -> None:
    s = SpecScheduler(PP3)
    s.add(_req("a"))
    s.schedule()
    s.schedule()
    assert s.reset_prefix_cache() in (True, False)


# -- the engine loop (step_with_batch_queue) ----------------------------------


def test_a_step_updates_the_oldest_plan_once_k_are_in_flight() -> None:
    runner = Runner(PP3, {"spec": Recorder}, check_invariants=False)
    assert runner.run([AddRequest(_req("a", n=12)), Step(), Step(), Step(), Step()]) is None
    assert _recorder(runner).log == ["schedule 1", "schedule 2", "schedule 3", "update 1", "schedule 4", "update 2"]
    assert runner.in_flight == (3, 4)


def test_a_fourth_schedule_with_three_in_flight_is_refused_before_any_scheduler() -> None:
    runner = Runner(PP3, {"spec": Recorder}, check_invariants=False)
    events: list[Event] = [AddRequest(_req("a")), Schedule(), Schedule(), Schedule(), Schedule()]
    with pytest.raises(Exception, match="3 plans may be in flight"):
        runner.run(events)


def test_spec_and_impl_agree_with_k_in_flight_to_completion() -> None:
    for seed in range(6):
        w = random_workload(seed, 40, pipeline=True)
        runner = Runner(w.config, {"spec": SpecScheduler, "impl": ImplScheduler})
        assert runner.run_to_completion(w.events) is None, (seed, w.config.pipeline_parallel_size)


# -- traces (version 7) --------------------------------------------------------


def test_a_trace_with_a_pipeline_is_version_7_and_reads_back() -> None:
    w = Workload(config=PP3, events=(AddRequest(_req("a")), Step(), Step(), Update()))
    text = tracefile.dumps(tracefile.Trace(w))
    assert json.loads(text.splitlines()[0])["schedspec_trace"] == 7
    back = tracefile.loads(text)
    assert back.workload.config.pipeline_parallel_size == 3 and tracefile.dumps(back) == text


def test_a_default_trace_is_written_as_before() -> None:
    text = tracefile.dumps(tracefile.Trace(Workload(config=BASE, events=(Step(),))))
    assert json.loads(text.splitlines()[0])["schedspec_trace"] == 1


@pytest.mark.parametrize(("version", "config", "words"), [
    (6, {"pipeline_parallel_size": 2}, "needs trace format version 7"),
    (7, {"pipeline_parallel_size": 5}, "maximum of 4"),
    (7, {"pipeline_parallel_size": 2, "async_scheduling": True}, "refuses pipeline parallelism with async scheduling"),
])
def test_a_bad_pipeline_size_in_a_trace_names_file_line_and_field(version: int, config: dict[str, object],
                                                                   words: str, tmp_path: Path) -> None:
    header = {"schedspec_trace": version, "config": {**BASE.to_dict(), **config}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n")
    with pytest.raises(TraceError) as e:
        tracefile.read(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:1: config.pipeline_parallel_size:") and words in msg


def test_old_traces_replay_unchanged() -> None:
    """A version-6-or-older trace has no pipeline size: one plan (two with async) in flight."""
    for seed in range(3):
        w = random_workload(seed, 10, modes=("sync", "async"))
        back = tracefile.loads(tracefile.dumps(tracefile.Trace(w)))
        assert back.workload.config.pipeline_parallel_size == 1


# -- the generator, the shrinker, the reports ----------------------------------


def test_the_generator_draws_every_pipeline_size_the_config_allows() -> None:
    seen: Counter[tuple[bool, int]] = Counter()
    for seed in range(60):
        w = random_workload(seed, 4, modes=("sync", "async"), pipeline=True)
        seen[(w.config.async_scheduling, w.config.pipeline_parallel_size)] += 1
        k = w.config.max_concurrent_batches
        assert (f"pipeline:k={k}" in w.features) == (w.config.pipeline_parallel_size > 1)
    assert {pp for a, pp in seen if not a} == {1, 2, 3, 4}
    assert {pp for a, pp in seen if a} == {1}  # V1: async scheduling with pipeline size 1 only
    assert allowed_sizes(dataclasses.replace(BASE, async_scheduling=True)) == (1,)


def test_without_the_draw_a_workload_is_the_one_its_seed_always_gave() -> None:
    for seed in range(5):
        a = random_workload(seed, 20, modes=("sync", "async"))
        assert a.config.pipeline_parallel_size == 1
        b = random_workload(seed, 20, modes=("sync", "async"), pipeline=True)
        if b.config.pipeline_parallel_size == 1:
            assert a == b


def test_the_shrinker_tries_fewer_plans_in_flight() -> None:
    sizes = {c.pipeline_parallel_size for c in _config_options(dataclasses.replace(PP3, pipeline_parallel_size=4))}
    assert {1, 2, 3} <= sizes


def test_reports_name_k() -> None:
    assert describe(PP3) == "k=3 (pipeline_parallel_size 3)"
    assert describe(BASE) == ""


class OnePlanOnly(SpecScheduler):
    """The spec, refusing to schedule while a plan awaits its update (a scheduler written
    for the synchronous protocol alone)."""

    def schedule(self) -> StepPlan:
        if self.in_flight and not self._config.async_scheduling:
            raise RuntimeError("a plan is still in flight")
        return super().schedule()


def test_check_pipeline_runs_impl_in_lockstep_and_a_failure_names_k(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main

    out = str(tmp_path)
    rc = main(["check", "--against", "impl", "--pipeline", "--modes", "sync", "--steps", "300", "--quiet",
               "--out", out])
    first = capsys.readouterr().out
    assert rc == 0, first
    rc = main(["check", "--against", "tests.check.test_pipeline:OnePlanOnly", "--pipeline", "--modes", "sync",
               "--steps", "300", "--out", out])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert rc == 1 and "pipeline:k=" in text and "a plan is still in flight" in text


def test_a_save_reported_at_the_bound_arrives_k_minus_1_steps_later() -> None:
    # an asynchronous save whose report the worker sends at the bound (step 12,
    # 8 steps after the finish) arrives with step 12's update, which three plans
    # in flight deliver after step 14: quiescence waits for it
    from schedspec.check.run import run_workload
    t = tracefile.read(Path(__file__).parent / "data" / "pipeline-save-reported-late.jsonl")
    assert t.workload.config.max_concurrent_batches == 3
    runner, failure = run_workload(t.workload, {"spec": SpecScheduler, "impl": ImplScheduler},
                                   vocab=t.vocab, oracle_seed=t.oracle_seed)
    assert failure is None
    assert runner.stats.steps >= 14
