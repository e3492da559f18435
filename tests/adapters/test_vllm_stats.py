"""vLLM 0.33's scheduler statistics through the adapter (VllmScheduler built
with log_stats=True): equal to the spec's and impl's after every update in
every mode and KV layout, under the statistics invariants."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from schedspec.adapters.registry import resolve
from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.check.scheduler_stats import with_stats
from schedspec.spec import RequestSpec, SchedulerConfig, StepResult

REQUIRE = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed (scripts/install_vllm.sh)"),
]


def factories() -> dict[str, Any]:
    return {n: with_stats(resolve(n).factory) for n in ("spec", "impl", "vllm")}


@pytest.mark.parametrize("modes,kv", [(("sync",), ()), (("async",), ()), (("spec",), ()), (("async-spec",), ()),
                                      (("sync", "async-spec"), ("hybrid",)), (("sync", "async"), ("connector",))])
def test_vllms_statistics_equal_the_specs(modes: tuple[str, ...], kv: tuple[str, ...]) -> None:
    reports = 0
    for seed in range(2):
        w = random_workload(seed, 80, modes=modes, kv=kv)
        runner, failure = run_workload(w, factories(), oracle_seed=seed)
        assert failure is None, failure.describe()
        reports += runner.stats.stats_reports
    assert reports >= 100


def test_the_mapping_reads_vllms_own_numbers() -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    cfg = SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=32, max_model_len=32)
    assert VllmScheduler(cfg).make_stats() is None  # log_stats off: vLLM's make_stats returns None
    v = VllmScheduler(cfg, log_stats=True)
    v.add(RequestSpec("a", tuple(range(1, 10)), 4))
    plan = v.schedule()
    v.update(plan, StepResult({"a": (5,)}, {}))
    stats = v.make_stats()
    assert stats is not None and stats.prefix_cache_stats.queries == 9 and stats.num_running_reqs == 1
    assert stats.kv_cache_usage == v.sched.kv_cache_manager.usage  # vLLM's float, as it computed it
    assert v.make_stats() is None  # handed over once per update
