"""Mamba groups in "align" mode against vLLM 0.33's own MambaManager and
Scheduler._mamba_block_aligned_split through the adapter: the adapter builds
a MambaSpec group with mamba_cache_mode "align", and spec, impl and vLLM run
workloads with full attention + Mamba (and a sliding window beside) in
lockstep, sync and async, every invariant checked."""

from __future__ import annotations

from typing import Any

import pytest

from schedspec.check import kv_requests
from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import KVCacheGroup, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler


@pytest.fixture(scope="module")
def vllm_loaded() -> Any:
    pytest.importorskip("vllm")
    from schedspec.adapters.vllm_load import load_vllm

    return load_vllm()


def test_the_adapter_builds_a_mamba_manager_in_align_mode(vllm_loaded: Any) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    config = SchedulerConfig(block_size=4, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=64, enable_prefix_caching=True,
                             kv_cache_groups=(KVCacheGroup(), KVCacheGroup("mamba")))
    s = VllmScheduler(config)
    managers = s.sched.kv_cache_manager.coordinator.single_type_managers
    assert [type(m).__name__ for m in managers] == ["FullAttentionManager", "MambaManager"]
    assert managers[1].mamba_cache_mode == "align" and s.sched.need_mamba_block_aligned_split


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_spec_impl_and_vllm_agree_on_mamba_layouts(vllm_loaded: Any, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    monkeypatch.setattr(kv_requests, "MAMBA_RATE", 1.0)
    layouts = set()
    steps = 0
    for seed in range(40):
        w = random_workload(seed, 150, kv=("hybrid",), modes=(mode,))
        kinds = tuple(g.kind for g in w.config.groups)
        if "mamba" not in kinds or kinds in layouts:
            continue
        layouts.add(kinds)
        runner = Runner(w.config, {"spec": SpecScheduler, "impl": ImplScheduler, "vllm": VllmScheduler})
        assert runner.run(w.events) is None, (seed, kinds)
        steps += runner.stats.steps
    assert {("full_attention", "mamba"), ("full_attention", "sliding_window", "mamba")} <= layouts
    assert any(k[0] == "mamba" for k in layouts)  # a model whose first layers are Mamba layers
    assert steps > 200
