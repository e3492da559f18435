"""The KV cache groups of a config are validated field by field: each bad
group is refused with a ConfigError naming the group, its field and the
value, exactly (spec/validate.py, _check_group; spec/kv_kinds.py, each
kind's own fields)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from schedspec.spec import ConfigError, Policy, SchedulerConfig
from schedspec.spec.interface import KVCacheGroup
from schedspec.spec.validate import validate_config

KINDS_TEXT = "must be one of 'full_attention', 'sliding_window', 'chunked_local', 'mamba'"


def refused(*groups: Any, block_size: int = 4) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(block_size=block_size, num_blocks=64, max_model_len=32, kv_cache_groups=tuple(groups))
    return info.value


def accepted(*groups: Any, block_size: int = 4) -> SchedulerConfig:
    return SchedulerConfig(block_size=block_size, num_blocks=64, max_model_len=32, kv_cache_groups=tuple(groups))


@pytest.mark.parametrize(
    ("groups", "field", "text"),
    [
        ((KVCacheGroup(), 5), "kv_cache_groups[1]", "must be a KVCacheGroup, got int"),
        ((KVCacheGroup(), {"kind": "full_attention"}), "kv_cache_groups[1]", "must be a KVCacheGroup, got dict"),
        ((KVCacheGroup("linear_attention"),), "kv_cache_groups[0].kind", f"{KINDS_TEXT}, got 'linear_attention'"),
        ((KVCacheGroup(), KVCacheGroup("sliding_window", "w")),  # type: ignore[arg-type]
         "kv_cache_groups[1]", "sliding_window, attention_chunk_size and block_size must be integers, got 'w', 0, 0"),
        ((KVCacheGroup(block_size="4"),),  # type: ignore[arg-type]
         "kv_cache_groups[0]", "sliding_window, attention_chunk_size and block_size must be integers, got 0, 0, '4'"),
        ((KVCacheGroup("chunked_local", attention_chunk_size=None),),  # type: ignore[arg-type]
         "kv_cache_groups[0]", "sliding_window, attention_chunk_size and block_size must be integers, got 0, None, 0"),
        ((KVCacheGroup(attention_chunk_size="x"),),  # type: ignore[arg-type]
         "kv_cache_groups[0]", "sliding_window, attention_chunk_size and block_size must be integers, got 0, 'x', 0"),
        ((KVCacheGroup("sliding_window", 0),), "kv_cache_groups[0].sliding_window",
         "a sliding-window group needs a window >= 1, got 0"),
        ((KVCacheGroup(), KVCacheGroup(sliding_window=3)), "kv_cache_groups[1].sliding_window",
         "a full-attention group has no window, got 3"),
        ((KVCacheGroup("sliding_window", 4, attention_chunk_size=8),), "kv_cache_groups[0].attention_chunk_size",
         "a sliding_window group has no attention chunk, got 8"),
        ((KVCacheGroup(attention_chunk_size=8),), "kv_cache_groups[0].attention_chunk_size",
         "a full_attention group has no attention chunk, got 8"),
        ((KVCacheGroup("chunked_local", 4, attention_chunk_size=8),), "kv_cache_groups[0].sliding_window",
         "a chunked-local group has no window, got 4"),
        ((KVCacheGroup("chunked_local"),), "kv_cache_groups[0].attention_chunk_size",
         "a chunked-local group needs a chunk >= 1 token, got 0"),
        ((KVCacheGroup(), KVCacheGroup("chunked_local", attention_chunk_size=6)), "kv_cache_groups[1].attention_chunk_size",
         "(6) must be a multiple of block_size (4): vLLM's chunked local attention backend refuses any other chunk"),
        ((KVCacheGroup(block_size=6),), "kv_cache_groups[0].block_size",
         "(6) must be a multiple of the hash block size block_size (4), as vLLM's hybrid coordinator requires"),
        ((KVCacheGroup(block_size=-4),), "kv_cache_groups[0].block_size",
         "(-4) must be a multiple of the hash block size block_size (4), as vLLM's hybrid coordinator requires"),
        ((KVCacheGroup(), KVCacheGroup(block_size=8)), "kv_cache_groups[1].block_size",
         "(8) differs from block_size (4): the modelled layouts give every group the config's block size "
         "(0 = the config's)"),
    ],
)
def test_a_bad_group_is_named_with_its_field_and_value(groups: tuple[Any, ...], field: str, text: str) -> None:
    e = refused(*groups)
    assert (e.field, e.message) == (field, text)
    assert str(e) == f"config.{field}: {text}"


def test_the_smallest_valid_value_of_each_group_field_is_accepted() -> None:
    accepted(KVCacheGroup("sliding_window", 1))
    accepted(KVCacheGroup("chunked_local", attention_chunk_size=4))
    accepted(KVCacheGroup(block_size=4), KVCacheGroup("sliding_window", 2, block_size=4))
    accepted(KVCacheGroup("chunked_local", attention_chunk_size=16, block_size=8), block_size=8)


def _with_groups(*groups: object) -> SchedulerConfig:
    """A valid config whose groups are swapped for ``groups`` after its own
    validation, for validate_config called without a group type."""
    c = copy.copy(SchedulerConfig(block_size=4, num_blocks=64, max_model_len=32))
    object.__setattr__(c, "kv_cache_groups", groups)
    return c


def test_without_a_group_type_a_group_is_read_by_its_attributes() -> None:
    """validate_config with no ``group_type`` takes any object as a group and
    reads its fields by name: a missing kind, window or block size is None
    (refused), a missing attention chunk is 0 (a group of a layout from before
    chunked local attention)."""
    with pytest.raises(ConfigError) as info:
        validate_config(_with_groups(object()), Policy)
    assert str(info.value) == f"config.kv_cache_groups[0].kind: {KINDS_TEXT}, got None"
    with pytest.raises(ConfigError) as info:
        validate_config(_with_groups(SimpleNamespace(kind="full_attention")), Policy)
    assert str(info.value) == ("config.kv_cache_groups[0]: sliding_window, attention_chunk_size and block_size "
                               "must be integers, got None, 0, None")
    with pytest.raises(ConfigError) as info:
        validate_config(_with_groups(SimpleNamespace(kind="full_attention", sliding_window="w", block_size=0)), Policy)
    assert str(info.value) == ("config.kv_cache_groups[0]: sliding_window, attention_chunk_size and block_size "
                               "must be integers, got 'w', 0, 0")
    validate_config(_with_groups(SimpleNamespace(kind="full_attention", sliding_window=0, block_size=0,
                                                 attention_chunk_size=0)), Policy)
