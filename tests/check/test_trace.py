"""The trace parser returns a Trace or a TraceError, nothing else, whatever it is fed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedspec.check import trace as tracefile
from schedspec.check.trace import TraceError
from schedspec.check.random_workloads import random_workload

VALID = tracefile.dumps(tracefile.Trace(random_workload(3, 12)))
LINES = VALID.splitlines()


def _parse(text: str) -> None:
    try:
        tracefile.loads(text, "t.jsonl")
    except TraceError as exc:
        assert exc.path == "t.jsonl" and exc.line >= 0 and exc.field


def test_roundtrip() -> None:
    t = tracefile.loads(VALID)
    assert tracefile.dumps(t) == VALID
    assert t.workload.num_steps == 12


@pytest.mark.parametrize("field, value", [("enable_kv_cache_events", True), ("async_scheduling", True)])
def test_a_config_field_of_a_later_version_is_written_under_that_version(field: str, value: object) -> None:
    """A trace whose only later-version content is one config field (the KV cache events the
    check turns on in a share of its workloads, say) is written under the version that brought
    it, and reads back."""
    from schedspec.spec.validate import declared
    from schedspec.spec.interface import SchedulerConfig

    since = {name: d.since for name, _, d in declared(SchedulerConfig)}[field]
    w = random_workload(3, 12)
    w = dataclasses.replace(w, config=dataclasses.replace(w.config, **{field: value}))
    text = tracefile.dumps(tracefile.Trace(w))
    assert json.loads(text.splitlines()[0])["schedspec_trace"] >= since
    assert getattr(tracefile.loads(text).config, field) == value


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes(data: bytes) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    _parse(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text(text: str) -> None:
    _parse(text)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**70) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _mutate(obj: Any, path: list[str | int], value: Any, delete: bool) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict) and head in obj:
        new = dict(obj)
        if delete and not rest:
            del new[head]
        else:
            new[head] = _mutate(obj[head], rest, value, delete)
        return new
    if isinstance(obj, list) and isinstance(head, int) and head < len(obj):
        new_l = list(obj)
        new_l[head] = _mutate(obj[head], rest, value, delete)
        return new_l
    return obj


def _paths(obj: Any, prefix: list[str | int]) -> list[list[str | int]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + [k])
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + [i])
    return out


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_valid_traces(data: st.DataObject) -> None:
    lines = list(LINES)
    kind = data.draw(st.sampled_from(["value", "delete", "dup_line", "drop_line", "swap", "truncate"]))
    i = data.draw(st.integers(0, len(lines) - 1))
    if kind in ("value", "delete"):
        obj = json.loads(lines[i])
        path = data.draw(st.sampled_from(_paths(obj, [])))
        value = data.draw(JSON_VALUES)
        lines[i] = json.dumps(_mutate(obj, path, value, kind == "delete"))
    elif kind == "dup_line":
        lines.insert(i, lines[i])
    elif kind == "drop_line":
        del lines[i]
    elif kind == "swap":
        j = data.draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    else:
        lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))]
    _parse("\n".join(lines))


@pytest.mark.parametrize(
    ("mutate", "line", "field"),
    [
        (lambda L: L.__setitem__(0, L[0].replace('"schedspec_trace": 1', '"schedspec_trace": 9')), 1, "schedspec_trace"),
        (lambda L: L.__setitem__(0, L[0].replace('"block_size": ', '"block_size": -')), 1, "config.block_size"),
        (lambda L: L.append('{"op": "teleport"}'), None, "op"),
        (lambda L: L.append('{"op": "abort", "request_id": "ghost"}'), None, "request_id"),
        (lambda L: L.append(L[1]), None, "request.request_id"),
        (lambda L: L.append('{"op": "step", "extra": 1}'), None, "extra"),
        (lambda L: L.append('{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [1, 2.5], "max_tokens": 1}}'), None, "request.prompt_token_ids[1]"),
        (lambda L: L.append("{not json"), None, "json"),
        # what the schema says, named down to the field
        (lambda L: L.__setitem__(0, L[0].replace('"schedspec_trace": 1', '"schedspec_trace": true')), 1, "schedspec_trace"),
        (lambda L: L.__setitem__(0, L[0].replace('"vocab": 64', '"vocab": 1')), 1, "vocab"),
        (lambda L: L.__setitem__(0, L[0].replace('{', '{"bogus": 1, ', 1)), 1, "bogus"),
        (lambda L: L.__setitem__(0, L[0].replace('"config": {', '"config": {"bogus": 1, ')), 1, "config.bogus"),
        (lambda L: L.__setitem__(0, L[0].replace('"policy": "', '"policy": "x')), 1, "config.policy"),
        (lambda L: L.append('{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [1], "max_tokens": 2.0}}'), None, "request.max_tokens"),
        (lambda L: L.append('{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [1]}}'), None, "request.max_tokens"),
        (lambda L: L.append('{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [], "max_tokens": 1}}'), None, "request.prompt_token_ids"),
        (lambda L: L.append('{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [1], "max_tokens": 1, "eos_token_id": -1}}'), None, "request.eos_token_id"),
        (lambda L: L.append('{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [1], "max_tokens": 1, "stop_token_ids": [0, true]}}'), None, "request.stop_token_ids[1]"),
        (lambda L: L.append('{"op": "add", "request": [1]}'), None, "request"),
        (lambda L: L.append('{"op": "abort"}'), None, "request_id"),
        (lambda L: L.append('{"op": "reset_prefix_cache", "reset_running_requests": 1}'), None, "reset_running_requests"),
        # what only the config's own rules say
        (lambda L: L.__setitem__(0, L[0].replace('"max_model_len": ', '"max_model_len": 9999')), 1, "config.max_num_batched_tokens"),
    ],
)
def test_each_bad_input_names_line_and_field(mutate: Any, line: int | None, field: str, tmp_path: Path) -> None:
    lines = list(LINES)
    assert lines[1].startswith('{"op": "add"')
    mutate(lines)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as e:
        tracefile.read(path)
    assert e.value.field == field
    assert e.value.line == (line if line is not None else len(lines))
    assert str(path) in str(e.value)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(VALID.encode() + b"\xff\xfe\n")
    with pytest.raises(TraceError) as e:
        tracefile.read(path)
    assert e.value.field == "encoding"


def test_messages_say_what_is_wrong(tmp_path: Path) -> None:
    cases = {
        '{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [1], "max_tokens": 2.0}}':
            "request.max_tokens: 2.0 is not of type 'integer'",
        '{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [1]}}': "request.max_tokens: missing",
        '{"op": "step", "extra": 1}': "extra: unknown field for 'step'",
        '{"op": "add", "request": {"request_id": "q", "prompt_token_ids": [1, -2], "max_tokens": 1}}':
            "request.prompt_token_ids[1]: -2 is less than the minimum of 0",
    }
    for line, message in cases.items():
        with pytest.raises(TraceError) as e:
            tracefile.loads(LINES[0] + "\n" + line, "t.jsonl")
        assert str(e.value) == f"t.jsonl:2: {message}"


def test_the_schema_names_every_config_and_request_field() -> None:
    """The shipped schema and the types it describes must not drift apart."""
    from schedspec.spec.interface import RequestSpec, SchedulerConfig

    schema = json.loads(tracefile.SCHEMA_PATH.read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(schema["$defs"]["config"]["properties"]) == {f.name for f in dataclasses.fields(SchedulerConfig)}
    request = RequestSpec("r", (1,), 1).to_dict()
    assert set(schema["$defs"]["request"]["properties"]) == {f.name for f in dataclasses.fields(RequestSpec)}
    assert set(request) == ({f.name for f in dataclasses.fields(RequestSpec)} - set(tracefile.V3_REQUEST_FIELDS)
                            - set(tracefile.V4_REQUEST_FIELDS) - set(tracefile.V6_REQUEST_FIELDS)
                            - set(tracefile.V8_REQUEST_FIELDS))
    assert set(schema["$defs"]["request"]["required"]) == {"request_id", "prompt_token_ids", "max_tokens"}


def test_every_line_of_a_written_trace_validates_against_the_schema() -> None:
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(json.loads(tracefile.SCHEMA_PATH.read_text()))
    for line in LINES:
        validator.validate(json.loads(line))


def test_importing_the_trace_module_does_not_import_jsonschema() -> None:
    import subprocess
    import sys

    code = "import sys, schedspec.check.trace; print('jsonschema' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
