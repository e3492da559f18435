"""The hash block size (vLLM's CacheConfig.prefix_match_unit): the values
vLLM 0.33 refuses are refused with a ConfigError naming ``hash_block_size``,
a value below the block size (partial-block entries) is accepted in a
hybrid layout without a Mamba group or a KV connector and refused as not
modelled with either, the rest is accepted; a trace carries it from
format version 7; the vLLM adapter hands it to vLLM's own resolution and
vLLM refuses and accepts the same values (spec/validate.py,
_check_hash_block_size; vllm/v1/core/kv_cache_utils.py,
resolve_kv_cache_block_sizes)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schedspec.check import trace as tracefile
from schedspec.spec import ConfigError, SchedulerConfig
from schedspec.spec.interface import KVCacheGroup

HYBRID = (KVCacheGroup(), KVCacheGroup("sliding_window", sliding_window=8))


def config(hash_block_size: int, groups: tuple[KVCacheGroup, ...] = (), **kw: Any) -> SchedulerConfig:
    return SchedulerConfig(block_size=16, num_blocks=64, max_model_len=64, kv_cache_groups=groups,
                           hash_block_size=hash_block_size, **kw)


def refusal(hash_block_size: int, groups: tuple[KVCacheGroup, ...] = (), **kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        config(hash_block_size, groups, **kw)
    assert info.value.field == "hash_block_size"
    return info.value.message


def test_the_default_and_the_block_size_are_accepted() -> None:
    assert config(0).hash_block_size == 0
    assert config(16).hash_block_size == 16
    assert config(16, HYBRID).hash_block_size == 16


def test_one_group_takes_only_the_block_size() -> None:
    assert "must be 0 or block_size (16) with one KV cache group" in refusal(8)
    assert "must be 0 or block_size (16)" in refusal(32)


def test_a_size_not_dividing_every_group_is_refused() -> None:
    assert "must divide every KV cache group's block size, got block size 16" in refusal(5, HYBRID)
    assert "must divide" in refusal(32, HYBRID)


def test_a_size_below_the_block_size_is_modelled_without_mamba_or_a_connector() -> None:
    assert config(8, HYBRID).hash_block_size == 8
    assert config(1, HYBRID).hash_block_size == 1
    assert "with a KV connector: fine-grained partial" in refusal(8, HYBRID, kv_connector=True)
    mamba = (KVCacheGroup(), KVCacheGroup("mamba"))
    assert "with a Mamba group: fine-grained partial" in refusal(8, mamba)
    assert "with the EAGLE drafter" in refusal(8, HYBRID, drafter="eagle", num_speculative_tokens=2)
    assert config(8, HYBRID, drafter="draft_model", num_speculative_tokens=2).hash_block_size == 8


def test_without_block_hashes_vllm_ignores_it() -> None:
    # resolve_kv_cache_block_sizes returns the block size when neither prefix
    # caching nor a connector reads block hashes
    assert config(8, enable_prefix_caching=False).hash_block_size == 8
    assert config(8, HYBRID, enable_prefix_caching=False).hash_block_size == 8


def test_negative_and_oversized_values_are_refused() -> None:
    assert "must be >= 0" in refusal(-1)
    assert "beyond the supported maximum" in refusal(1 << 17)


def header(version: int, **cfg: Any) -> str:
    base = dict(block_size=16, num_blocks=64, max_model_len=64)
    base.update(cfg)
    return json.dumps({"schedspec_trace": version, "config": base})


def test_a_trace_carries_it_from_version_7() -> None:
    with pytest.raises(tracefile.TraceError) as info:
        tracefile.loads(header(6, hash_block_size=16) + "\n", "t.jsonl")
    assert "config.hash_block_size" in str(info.value) and "version 7" in str(info.value)
    trace = tracefile.loads(header(7, hash_block_size=16) + "\n", "t.jsonl")
    assert trace.config.hash_block_size == 16
    again = tracefile.loads(tracefile.dumps(trace), "t2.jsonl")
    assert again.config.hash_block_size == 16
    assert json.loads(tracefile.dumps(trace).splitlines()[0])["schedspec_trace"] == 7


def test_a_trace_with_a_refused_size_names_the_field() -> None:
    with pytest.raises(tracefile.TraceError) as info:
        tracefile.loads(header(7, hash_block_size=5) + "\n", "t.jsonl")
    assert "config.hash_block_size" in str(info.value)


@pytest.fixture(scope="module")
def vllm_loaded() -> Any:
    pytest.importorskip("vllm")
    from schedspec.adapters.vllm_load import load_vllm

    return load_vllm()


def _resolve(cfg: SchedulerConfig, unit: int | None) -> int:
    from schedspec.adapters import vllm_names as v
    from schedspec.adapters.vllm_config import build_vllm_config

    vllm_config, kv_cache_config = build_vllm_config(cfg)
    vllm_config.cache_config.prefix_match_unit = unit
    _, hash_block_size = v.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return int(hash_block_size)


def test_vllm_resolves_the_accepted_sizes_and_refuses_the_refused_ones(vllm_loaded: Any) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    for cfg in (config(0), config(16), config(16, HYBRID)):
        assert VllmScheduler(cfg).sched.kv_cache_manager.coordinator.block_pool.hash_block_size == 16
    assert VllmScheduler(config(8, HYBRID)).sched.kv_cache_manager.coordinator.block_pool.hash_block_size == 8
    # vLLM refuses what the spec refuses as vLLM's refusals ...
    with pytest.raises(ValueError, match="prefix_match_unit"):
        _resolve(config(16), 8)
    with pytest.raises(ValueError, match="prefix_match_unit"):
        _resolve(config(16, HYBRID), 5)
    # ... and accepts the finer hash the spec accepts
    assert _resolve(config(16, HYBRID), 8) == 8
