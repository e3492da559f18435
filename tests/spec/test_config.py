"""SchedulerConfig and RequestSpec validation: every error names its field and
value with an exact message, and the values at each bound are accepted."""

from __future__ import annotations

from typing import Any

import pytest

from schedspec.spec import ConfigError, Policy, RequestError, RequestSpec, SchedulerConfig

from tests.helpers import cfg, message


@pytest.mark.parametrize(
    ("kw", "text"),
    [
        (dict(block_size="4"), "config.block_size: must be an integer, got '4'"),
        (dict(num_blocks=9.0), "config.num_blocks: must be an integer, got 9.0"),
        (dict(max_num_batched_tokens=None), "config.max_num_batched_tokens: must be an integer, got None"),
        (dict(max_num_seqs=True), "config.max_num_seqs: must be an integer, got True"),
        (dict(max_model_len="x"), "config.max_model_len: must be an integer, got 'x'"),
        (dict(long_prefill_token_threshold=1.5), "config.long_prefill_token_threshold: must be an integer, got 1.5"),
        (dict(enable_chunked_prefill=1), "config.enable_chunked_prefill: must be a boolean, got 1"),
        (dict(enable_prefix_caching=None), "config.enable_prefix_caching: must be a boolean, got None"),
        (dict(scheduler_reserve_full_isl=0), "config.scheduler_reserve_full_isl: must be a boolean, got 0"),
        (dict(policy="fcfs"), "config.policy: must be a Policy, got 'fcfs'"),
        (dict(block_size=0), "config.block_size: must be positive, got 0"),
        (dict(max_num_batched_tokens=0), "config.max_num_batched_tokens: must be positive, got 0"),
        (dict(max_num_seqs=0), "config.max_num_seqs: must be positive, got 0"),
        (dict(max_model_len=-1), "config.max_model_len: must be positive, got -1"),
        (dict(block_size=(1 << 16) + 1), "config.block_size: 65537 is beyond the supported maximum 65536"),
        (dict(num_blocks=(1 << 24) + 1), "config.num_blocks: 16777217 is beyond the supported maximum 16777216"),
        (dict(max_num_batched_tokens=(1 << 24) + 1),
         "config.max_num_batched_tokens: 16777217 is beyond the supported maximum 16777216"),
        (dict(max_num_seqs=(1 << 20) + 1), "config.max_num_seqs: 1048577 is beyond the supported maximum 1048576"),
        (dict(max_model_len=(1 << 24) + 1), "config.max_model_len: 16777217 is beyond the supported maximum 16777216"),
        (dict(num_blocks=1), "config.num_blocks: must be at least 2 (block 0 is the reserved null block), got 1"),
        (dict(long_prefill_token_threshold=-1), "config.long_prefill_token_threshold: must be >= 0, got -1"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=31),
         "config.max_num_batched_tokens: (31) is smaller than max_model_len (32) with chunked prefill disabled: "
         "longer prompts could never be scheduled"),
        (dict(max_num_batched_tokens=7), "config.max_num_batched_tokens: (7) must be >= max_num_seqs (8)"),
        (dict(long_prefill_token_threshold=33),
         "config.long_prefill_token_threshold: (33) cannot exceed max_model_len (32)"),
        (dict(num_blocks=8),
         "config.num_blocks: the pool (7 usable blocks x 4 tokens = 28) cannot hold one request of "
         "max_model_len (32) tokens"),
    ],
)
def test_a_bad_config_field_is_named_with_its_value(kw: dict[str, object], text: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg(**kw)
    assert str(info.value) == text
    assert info.value.field == text.split(":")[0].removeprefix("config.")


def test_configs_at_their_bounds_are_accepted() -> None:
    cfg(num_blocks=9, max_model_len=32)  # pool exactly one max_model_len request
    cfg(num_blocks=2, block_size=32, max_model_len=32)
    cfg(enable_chunked_prefill=False, max_num_batched_tokens=32)
    cfg(max_num_batched_tokens=8, max_num_seqs=8)
    cfg(long_prefill_token_threshold=32)
    cfg(long_prefill_token_threshold=0)
    SchedulerConfig(block_size=1 << 16, num_blocks=2, max_model_len=1 << 16, max_num_batched_tokens=1 << 16,
                    max_num_seqs=1 << 16)
    SchedulerConfig(block_size=2, num_blocks=1 << 24, max_model_len=1 << 24, max_num_batched_tokens=1 << 24,
                    max_num_seqs=1 << 20)
    assert cfg().num_usable_blocks == 8


def test_a_config_round_trips_through_a_dict_and_bad_dicts_are_named() -> None:
    c = cfg(policy=Policy.PRIORITY, enable_chunked_prefill=False, long_prefill_token_threshold=3)
    d = c.to_dict()
    assert d == {"block_size": 4, "num_blocks": 9, "max_num_batched_tokens": 64, "max_num_seqs": 8,
                 "max_model_len": 32, "enable_chunked_prefill": False, "long_prefill_token_threshold": 3,
                 "enable_prefix_caching": True, "policy": "priority", "scheduler_reserve_full_isl": True}
    assert SchedulerConfig.from_dict(d) == c
    assert SchedulerConfig.from_dict({**d, "policy": Policy.FCFS}).policy is Policy.FCFS
    assert SchedulerConfig.from_dict({"block_size": 8}) == SchedulerConfig(block_size=8)
    assert message(lambda: SchedulerConfig.from_dict([1]), ConfigError) == "config.<config>: must be an object, got list"
    assert message(lambda: SchedulerConfig.from_dict({"zz": 1, "aa": 2}), ConfigError) == "config.aa: unknown field"
    assert (message(lambda: SchedulerConfig.from_dict({"policy": "lifo"}), ConfigError)
            == "config.policy: must be one of 'fcfs', 'priority', got 'lifo'")
    assert (message(lambda: SchedulerConfig.from_dict({"policy": 1}), ConfigError)
            == "config.policy: must be one of 'fcfs', 'priority', got 1")


@pytest.mark.parametrize(
    ("args", "kw", "text"),
    [
        (("", (1,), 1), {}, "request '': request_id: must be a non-empty string"),
        ((5, (1,), 1), {}, "request '5': request_id: must be a non-empty string"),
        (("x", [1], 1), {}, "request 'x': prompt_token_ids: must be a tuple of token ids"),
        (("x", (), 1), {}, "request 'x': prompt_token_ids: the prompt cannot be empty"),
        (("x", (1, -2), 1), {}, "request 'x': prompt_token_ids[1]: must be a non-negative integer, got -2"),
        (("x", (True,), 1), {}, "request 'x': prompt_token_ids[0]: must be a non-negative integer, got True"),
        (("x", (1,), 0), {}, "request 'x': max_tokens: must be an integer >= 1, got 0"),
        (("x", (1,), 2.0), {}, "request 'x': max_tokens: must be an integer >= 1, got 2.0"),
        (("x", (1,), 1), dict(priority="0"), "request 'x': priority: must be an integer, got '0'"),
        (("x", (1,), 1), dict(arrival=1.5), "request 'x': arrival: must be an integer, got 1.5"),
        (("x", (1,), 1), dict(stop_token_ids=[1]), "request 'x': stop_token_ids: must be a tuple of token ids"),
        (("x", (1,), 1), dict(stop_token_ids=(3, -1)),
         "request 'x': stop_token_ids[1]: must be a non-negative integer, got -1"),
        (("x", (1,), 1), dict(stop_token_ids=(False,)),
         "request 'x': stop_token_ids[0]: must be a non-negative integer, got False"),
        (("x", (1,), 1), dict(eos_token_id=-1),
         "request 'x': eos_token_id: must be a non-negative integer or None, got -1"),
        (("x", (1,), 1), dict(eos_token_id="2"),
         "request 'x': eos_token_id: must be a non-negative integer or None, got '2'"),
        (("x", (1,), 1), dict(ignore_eos=1), "request 'x': ignore_eos: must be a boolean, got 1"),
        (("x", (1,), 1), dict(cache_salt=3), "request 'x': cache_salt: must be a string or None, got 3"),
    ],
)
def test_a_bad_request_field_is_named_with_its_value(args: tuple[Any, ...], kw: dict[str, Any], text: str) -> None:
    with pytest.raises(RequestError) as info:
        RequestSpec(*args, **kw)
    assert str(info.value) == text
    assert info.value.field == text.split(": ")[1]
    assert info.value.request_id == text.split("'")[1]


def test_requests_at_their_bounds_are_accepted_and_round_trip_to_a_dict() -> None:
    r = RequestSpec("x", (0,), 1, priority=-3, arrival=-1, stop_token_ids=(0,), eos_token_id=0, ignore_eos=True,
                    cache_salt="")
    assert r.salt == ""
    assert RequestSpec("y", (1,), 1, cache_salt="s").salt == "s"
    assert RequestSpec("y", (1,), 1).salt == ""
    assert r.to_dict() == {"request_id": "x", "prompt_token_ids": [0], "max_tokens": 1, "priority": -3,
                           "arrival": -1, "stop_token_ids": [0], "eos_token_id": 0, "ignore_eos": True,
                           "cache_salt": ""}


def test_every_later_field_is_written_when_set_and_read_back() -> None:
    """to_dict writes a field that came after the first trace format (its
    declared ``since``) only when it differs from its default, tuples and
    nested values as JSON lists and objects; from_dict reads it back."""
    from schedspec.spec import MMInput
    from schedspec.spec.interface import KVCacheGroup

    c = cfg(num_blocks=40, async_scheduling=True, num_speculative_tokens=2, max_loras=1, watermark=0.1,
            prefill_schedule_interval=2, max_num_encoder_input_tokens=8, encoder_cache_size=8, kv_connector=True,
            kv_load_failure_policy="recompute", kv_cache_groups=(KVCacheGroup(), KVCacheGroup("sliding_window", 4)))
    assert c.to_dict() == {
        "block_size": 4, "num_blocks": 40, "max_num_batched_tokens": 64, "max_num_seqs": 8, "max_model_len": 32,
        "enable_chunked_prefill": True, "long_prefill_token_threshold": 0, "enable_prefix_caching": True,
        "policy": "fcfs", "scheduler_reserve_full_isl": True, "async_scheduling": True, "num_speculative_tokens": 2,
        "max_loras": 1, "watermark": 0.1, "prefill_schedule_interval": 2, "max_num_encoder_input_tokens": 8,
        "encoder_cache_size": 8, "kv_connector": True, "kv_load_failure_policy": "recompute",
        "kv_cache_groups": [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 4}]}
    assert SchedulerConfig.from_dict(c.to_dict()) == c
    r = RequestSpec("r", (1, 2, 3, 4), 4, lora_id=2, structured_output=True, grammar_rejects=(3,),
                    mm_inputs=(MMInput(0, 2, "i"),), kv_external_tokens=2, kv_load_async=True, kv_save_async=True)
    assert r.to_dict() == {
        "request_id": "r", "prompt_token_ids": [1, 2, 3, 4], "max_tokens": 4, "priority": 0, "arrival": 0,
        "stop_token_ids": [], "eos_token_id": None, "ignore_eos": False, "cache_salt": None, "lora_id": 2,
        "structured_output": True, "grammar_rejects": [3], "mm_inputs": [{"offset": 0, "length": 2, "identifier": "i"}],
        "kv_external_tokens": 2, "kv_load_async": True, "kv_save_async": True}
    assert RequestSpec.from_dict(r.to_dict()) == r


def test_a_field_declared_at_run_time_is_read_back_by_declared() -> None:
    """``declare`` puts a Declaration in a field's metadata and ``declared``
    lists every field with its resolved type and declaration (none:
    ``Declaration()``), once per class."""
    import dataclasses

    from schedspec.spec.validate import Declaration, declare, declared

    @dataclasses.dataclass(frozen=True)
    class Probe:
        n: int = dataclasses.field(default=1, metadata=declare(minimum=1, maximum=8, since=2))
        s: str | None = None

    assert declared(Probe) == (("n", int, Declaration(minimum=1, maximum=8, since=2)),
                               ("s", str | None, Declaration()))
    assert declared(Probe) is declared(Probe)
    assert [name for name, _, d in declared(SchedulerConfig) if d.since == 2] == [
        "async_scheduling", "num_speculative_tokens"]


def test_kv_fields_are_refused_by_name() -> None:
    assert (message(lambda: RequestSpec("a", (1, 2), 1, kv_load_async=True), RequestError)
            == "request 'a': kv_load_async: an asynchronous load needs kv_external_tokens > 0")
    assert message(lambda: cfg(kv_cache_groups=[]), ConfigError).startswith(
        "config.kv_cache_groups: must be a tuple of KVCacheGroup, got list")
    assert message(lambda: cfg(kv_connector=True, kv_load_failure_policy="retry"), ConfigError).startswith(
        "config.kv_load_failure_policy: ")
    assert message(lambda: RequestSpec("a", (1, 2), 1, cache_salt="x\x1dy"), RequestError).startswith(
        "request 'a': cache_salt: ")
