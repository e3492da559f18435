"""Reading requests, configs and KV cache groups from JSON objects (the trace
format): a bad object is refused with an error naming the request, the field
and what is wrong, exactly; a good one reads back what ``to_dict`` wrote."""

from __future__ import annotations

from typing import Any

import pytest

from schedspec.spec import ConfigError, MMInput, RequestError, RequestSpec, SchedulerConfig
from schedspec.spec.interface import KVCacheGroup, block_key_group, group_block_key

BASE: dict[str, Any] = {"request_id": "r1", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}


def request_error(data: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        RequestSpec.from_dict(data)
    return info.value


def config_error(fn: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn()
    return info.value


# -- RequestSpec.from_dict ---------------------------------------------------


@pytest.mark.parametrize(("data", "kind"), [([1], "list"), (None, "NoneType"), ("r1", "str")])
def test_a_request_that_is_not_an_object_is_refused_by_its_type(data: Any, kind: str) -> None:
    e = request_error(data)
    assert (e.request_id, e.field) == ("<request>", "<request>")
    assert str(e) == f"request '<request>': <request>: must be an object, got {kind}"


def test_an_unknown_field_is_named_with_the_request_first_in_sorted_order() -> None:
    e = request_error({**BASE, "zz": 1, "aa": 2})
    assert (e.request_id, e.field) == ("r1", "aa")
    assert str(e) == "request 'r1': aa: unknown field"


def test_an_unknown_field_of_a_request_without_an_id_names_a_placeholder() -> None:
    e = request_error({"bogus": 1})
    assert (e.request_id, e.field) == ("<request>", "bogus")
    assert str(e) == "request '<request>': bogus: unknown field"


def test_a_request_id_that_is_not_a_string_is_named_as_its_text() -> None:
    e = request_error({"request_id": 7, "bogus": 1})
    assert e.request_id == "7"
    assert str(e) == "request '7': bogus: unknown field"


def test_a_missing_required_field_is_named_in_the_message() -> None:
    e = request_error({"request_id": "r1", "max_tokens": 2})
    assert (e.request_id, e.field) == ("r1", "<request>")
    assert str(e).startswith("request 'r1': <request>: ")
    assert "missing 1 required positional argument: 'prompt_token_ids'" in str(e)


def test_a_missing_id_is_named_by_the_placeholder() -> None:
    e = request_error({"prompt_token_ids": [1], "max_tokens": 2})
    assert (e.request_id, e.field) == ("<request>", "<request>")
    assert "'request_id'" in str(e)


def test_lists_become_tuples_and_omitted_fields_take_their_defaults() -> None:
    r = RequestSpec.from_dict({**BASE, "structured_output": True, "grammar_rejects": [5], "stop_token_ids": [9, 8]})
    assert r == RequestSpec("r1", (1, 2, 3), 2, stop_token_ids=(9, 8), structured_output=True, grammar_rejects=(5,))
    assert isinstance(r.prompt_token_ids, tuple) and isinstance(r.grammar_rejects, tuple)
    assert RequestSpec.from_dict(BASE) == RequestSpec("r1", (1, 2, 3), 2)
    assert RequestSpec.from_dict({**BASE, "prompt_token_ids": (1, 2, 3)}) == RequestSpec("r1", (1, 2, 3), 2)


def test_a_string_field_given_a_list_is_refused_not_turned_into_a_tuple() -> None:
    with pytest.raises(RequestError) as info:
        RequestSpec.from_dict({**BASE, "cache_salt": ["a"]})
    assert info.value.field == "cache_salt"


def test_mm_inputs_are_read_from_objects_or_taken_as_given() -> None:
    given = MMInput(0, 1, "a")
    r = RequestSpec.from_dict({**BASE, "mm_inputs": [given, {"offset": 1, "length": 2, "identifier": "b"}]})
    assert r.mm_inputs == (given, MMInput(1, 2, "b"))
    r = RequestSpec.from_dict({**BASE, "mm_inputs": (given,)})
    assert r.mm_inputs == (given,)


@pytest.mark.parametrize(
    "item",
    [
        {"offset": 0, "length": 1, "identifier": "a", "extra": 1},
        {"offset": 0, "length": 1},
        [0, 1, "a"],
        "a",
    ],
)
def test_a_bad_mm_input_is_named_by_its_index(item: Any) -> None:
    e = request_error({**BASE, "mm_inputs": [MMInput(0, 1, "a"), item]})
    assert (e.request_id, e.field) == ("r1", "mm_inputs[1]")
    assert str(e) == "request 'r1': mm_inputs[1]: must be an object with offset, length and identifier"


def test_to_dict_writes_each_later_field_that_differs_from_its_default() -> None:
    """A default later field is skipped, the later fields after it still
    written (``continue``, not ``break``)."""
    r = RequestSpec("r1", (1, 2, 3), 2, structured_output=True, kv_save_async=True)
    d = r.to_dict()
    assert d["structured_output"] is True and d["kv_save_async"] is True
    assert "lora_id" not in d and "kv_load_async" not in d
    assert RequestSpec.from_dict(d) == r


# -- KVCacheGroup.from_dict / to_dict ----------------------------------------


def test_a_group_reads_every_field_and_defaults_to_full_attention() -> None:
    assert KVCacheGroup.from_dict({}) == KVCacheGroup()
    assert KVCacheGroup.from_dict({}).kind == "full_attention"
    g = KVCacheGroup.from_dict({"kind": "chunked_local", "attention_chunk_size": 8, "block_size": 4})
    assert (g.kind, g.sliding_window, g.block_size, g.attention_chunk_size) == ("chunked_local", 0, 4, 8)
    g = KVCacheGroup.from_dict({"kind": "sliding_window", "sliding_window": 6})
    assert (g.kind, g.sliding_window, g.block_size, g.attention_chunk_size) == ("sliding_window", 6, 0, 0)
    same = KVCacheGroup("sliding_window", 3)
    assert KVCacheGroup.from_dict(same) is same  # type: ignore[arg-type]


def test_a_group_writes_only_its_set_fields_and_reads_them_back() -> None:
    g = KVCacheGroup("chunked_local", attention_chunk_size=8, block_size=4)
    assert g.to_dict() == {"kind": "chunked_local", "attention_chunk_size": 8, "block_size": 4}
    assert KVCacheGroup.from_dict(g.to_dict()) == g
    assert KVCacheGroup().to_dict() == {"kind": "full_attention"}


def test_a_bad_group_is_named_by_where_it_is() -> None:
    e = config_error(lambda: KVCacheGroup.from_dict({"zz": 1, "aa": 2}))
    assert (e.field, e.message) == ("kv_cache_groups.aa", "unknown field")
    assert str(e) == "config.kv_cache_groups.aa: unknown field"
    e = config_error(lambda: KVCacheGroup.from_dict(3))  # type: ignore[arg-type]
    assert (e.field, e.message) == ("kv_cache_groups", "must be an object, got int")
    e = config_error(lambda: KVCacheGroup.from_dict([], "groups[2]"))  # type: ignore[arg-type]
    assert str(e) == "config.groups[2]: must be an object, got list"


# -- SchedulerConfig.from_dict -------------------------------------------------


def test_config_groups_must_be_a_list_and_each_is_named_by_its_index() -> None:
    e = config_error(lambda: SchedulerConfig.from_dict({"kv_cache_groups": "full_attention"}))
    assert (e.field, e.message) == ("kv_cache_groups", "must be a list, got str")
    assert str(e) == "config.kv_cache_groups: must be a list, got str"
    e = config_error(lambda: SchedulerConfig.from_dict({"kv_cache_groups": [{}, {"bogus": 1}]}))
    assert str(e) == "config.kv_cache_groups[1].bogus: unknown field"
    e = config_error(lambda: SchedulerConfig.from_dict({"kv_cache_groups": [{}, 5]}))
    assert str(e) == "config.kv_cache_groups[1]: must be an object, got int"


# -- group block keys ------------------------------------------------------------


def test_a_block_key_names_its_group_even_when_the_salt_holds_the_separator() -> None:
    toks = (1, 2)
    assert block_key_group(("salt", toks)) == 0
    assert block_key_group(group_block_key(("salt", toks), 3)) == 3
    assert block_key_group(group_block_key(("salt", toks), 12)) == 12
    assert block_key_group(group_block_key(("a\x1d7", toks), 2)) == 2
    # a group-0 key whose salt holds the separator followed by text: group 0
    assert block_key_group(("a\x1dx", toks)) == 0
    assert block_key_group(("\x1d", toks)) == 0
