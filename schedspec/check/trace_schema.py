"""The trace's JSON Schema (trace.schema.json) written from the dataclasses.

The schema's definitions of a config, a request and an encoder input are
generated from the fields of SchedulerConfig (with KVCacheGroup), RequestSpec
and MMInput: each field's type annotation and its Declaration
(spec/validate.py: bounds, choices), the fields without a default required.
The rest of the schema (the header, the events, the model output) is the
trace format's own and is kept as the file has it. A field added to one of
the dataclasses reaches the schema by running

    python -m schedspec.check.trace_schema            (rewrites the file)
    python -m schedspec.check.trace_schema --check    (exit 1 when it is stale)

and tests/check/test_trace_schema.py fails while the shipped file is stale.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import typing
from typing import Any

from schedspec.check.trace import SCHEMA_PATH
from schedspec.spec.interface import KV_GROUP_KINDS, KVCacheGroup, MMInput, RequestSpec, SchedulerConfig
from schedspec.spec.validate import Declaration, declared

NONNEG = {"$ref": "#/$defs/nonneg"}
TOKENS = {"$ref": "#/$defs/tokens"}
#: The dataclasses the schema defines once and refers to by name.
_DEFINED = {MMInput: "mm_input"}


def _number(kind: Any, d: Declaration) -> dict[str, Any]:
    if kind is int and d.minimum == 0 and d.maximum is None:
        return dict(NONNEG)
    out: dict[str, Any] = {"type": "integer" if kind is int else "number"}
    if d.minimum is not None:
        out["minimum"] = d.minimum
    if d.maximum is not None:
        out["maximum"] = d.maximum
    if d.below is not None:
        out["exclusiveMaximum"] = int(d.below) if float(d.below).is_integer() else d.below
    return out


def field_schema(kind: Any, d: Declaration) -> dict[str, Any]:
    """The schema of one field of type ``kind`` declaring ``d``, as a trace
    writes it (tuples as arrays, enums by value)."""
    if kind is bool:
        return {"type": "boolean"}
    if kind in (int, float):
        return _number(kind, d)
    if kind is str:
        if d.choices:
            return {"enum": list(d.choices)}
        return {"type": "string", "minLength": d.min_length} if d.min_length else {"type": "string"}
    if kind == str | None:
        return {"type": ["string", "null"]}
    if kind == int | None:
        return {"oneOf": [_number(int, d), {"type": "null"}]}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return {"enum": [member.value for member in kind]}
    if kind == tuple[int, ...]:
        return {"allOf": [dict(TOKENS), {"minItems": d.min_items}]} if d.min_items else dict(TOKENS)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        out: dict[str, Any] = {"type": "array"}
        if d.max_items is not None:
            out["maxItems"] = d.max_items
        out["items"] = {"$ref": f"#/$defs/{_DEFINED[item]}"} if item in _DEFINED else object_schema(item)
        return out
    raise TypeError(f"no JSON Schema for a field of type {kind!r}")


def object_schema(cls: type) -> dict[str, Any]:
    """A JSON object with the fields of dataclass ``cls`` and no others."""
    if cls is KVCacheGroup:
        return _group_schema()
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    out: dict[str, Any] = {"type": "object"}
    if required:
        out["required"] = required
    out["additionalProperties"] = False
    out["properties"] = {name: field_schema(kind, d) for name, kind, d in declared(cls)}
    return out


def _group_schema() -> dict[str, Any]:
    """A KV cache group: its ``kind`` (required) one of the kinds, its other
    fields counts (0: none, or the config's)."""
    properties = {name: {"enum": list(KV_GROUP_KINDS)} if name == "kind" else dict(NONNEG)
                  for name, _, _ in declared(KVCacheGroup)}
    return {"type": "object", "additionalProperties": False, "required": ["kind"], "properties": properties}


def trace_schema(current: dict[str, Any]) -> dict[str, Any]:
    """``current`` (the schema as shipped) with its config, request and
    encoder-input definitions written from the dataclasses."""
    out: dict[str, Any] = json.loads(json.dumps(current))
    out["$defs"]["config"] = object_schema(SchedulerConfig)
    out["$defs"]["request"] = object_schema(RequestSpec)
    out["$defs"]["mm_input"] = object_schema(MMInput)
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    shipped = SCHEMA_PATH.read_text()
    text = render(trace_schema(json.loads(shipped)))
    if args == ["--check"]:
        if text != shipped:
            print(f"{SCHEMA_PATH} is stale: run python -m schedspec.check.trace_schema", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m schedspec.check.trace_schema [--check]", file=sys.stderr)
        return 2
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
