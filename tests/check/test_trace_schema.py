"""The shipped trace schema is what schedspec.check.trace_schema writes from the
dataclasses: a field added to SchedulerConfig, KVCacheGroup, RequestSpec or
MMInput without regenerating the schema fails here, and so does a schema
property the dataclass lacks."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from schedspec.check.trace import SCHEMA_PATH
from schedspec.check.trace_schema import field_schema, main, object_schema, render, trace_schema
from schedspec.spec.interface import KVCacheGroup, MMInput, RequestSpec, SchedulerConfig
from schedspec.spec.validate import Declaration, declare

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_schema_is_the_one_the_dataclasses_write() -> None:
    shipped = SCHEMA_PATH.read_text()
    assert render(trace_schema(json.loads(shipped))) == shipped, (
        "schedspec/check/trace.schema.json is stale: run python -m schedspec.check.trace_schema")
    assert main(["--check"]) == 0


@pytest.mark.parametrize(("cls", "where"), [
    (SchedulerConfig, ("config",)),
    (RequestSpec, ("request",)),
    (MMInput, ("mm_input",)),
    (KVCacheGroup, ("config", "properties", "kv_cache_groups", "items")),
])
def test_every_field_and_only_the_fields_are_in_the_schema(cls: type, where: tuple[str, ...]) -> None:
    node = json.loads(SCHEMA_PATH.read_text())["$defs"]
    for key in where:
        node = node[key]
    assert list(node["properties"]) == [f.name for f in dataclasses.fields(cls)]
    assert node["additionalProperties"] is False


def test_a_field_added_without_regenerating_makes_the_schema_stale() -> None:
    """The negative control: a request with one more field writes a request
    definition that differs from the shipped one."""
    wider = dataclasses.make_dataclass(
        "WiderRequest", [("priority_class", int, dataclasses.field(default=0, metadata=declare(minimum=0)))],
        bases=(RequestSpec,), frozen=True)
    shipped = json.loads(SCHEMA_PATH.read_text())["$defs"]["request"]
    written = object_schema(wider)
    assert written != shipped and written["properties"]["priority_class"] == {"$ref": "#/$defs/nonneg"}
    assert {k: v for k, v in written["properties"].items() if k != "priority_class"} == shipped["properties"]


def test_a_declaration_becomes_the_schema_of_its_field() -> None:
    assert field_schema(int, Declaration(minimum=1, maximum=8)) == {"type": "integer", "minimum": 1, "maximum": 8}
    assert field_schema(int, Declaration(minimum=0)) == {"$ref": "#/$defs/nonneg"}
    assert field_schema(int, Declaration()) == {"type": "integer"}
    assert field_schema(float, Declaration(minimum=0, below=1.0)) == {
        "type": "number", "minimum": 0, "exclusiveMaximum": 1}
    assert field_schema(str, Declaration(choices=("a", "b"))) == {"enum": ["a", "b"]}
    assert field_schema(tuple[int, ...], Declaration(min_items=1)) == {
        "allOf": [{"$ref": "#/$defs/tokens"}, {"minItems": 1}]}
    with pytest.raises(TypeError, match="no JSON Schema"):
        field_schema(complex, Declaration())


def test_the_command_says_the_shipped_schema_is_current() -> None:
    proc = subprocess.run([sys.executable, "-m", "schedspec.check.trace_schema", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
