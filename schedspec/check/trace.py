"""Trace files: a workload as JSON Lines, versioned, replayable against any scheduler.

Format version 1 (JSON Schema: schedspec/check/trace.schema.json, docs/trace-format.md):

    line 1   {"schedspec_trace": 1, "config": {...SchedulerConfig...},
              "vocab": 64, "oracle_seed": 0, "seed": 7}
    then one event per line:
             {"op": "add", "request": {...RequestSpec...}}
             {"op": "abort", "request_id": "r3"}
             {"op": "step"}
             {"op": "reset_prefix_cache", "reset_running_requests": false}

Blank lines and lines starting with ``#`` are ignored. Each line is validated
against the shipped JSON Schema with ``jsonschema`` (imported on first use);
the rules a schema cannot state (the config's cross-field rules, unique ids,
an abort after its add, a prompt below ``max_model_len``) are checked here.
Every problem raises TraceError naming the file, the line and the field;
nothing else escapes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from schedspec.spec.interface import ConfigError, RequestError, RequestSpec, SchedulerConfig, SchedSpecError
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Step, Workload

TRACE_VERSION = 1
#: The JSON Schema every line is validated against (shipped with the package).
SCHEMA_PATH = Path(__file__).with_name("trace.schema.json")


class TraceError(SchedSpecError, ValueError):
    def __init__(self, path: str, line: int, field: str, message: str) -> None:
        super().__init__(f"{path}:{line}: {field}: {message}")
        self.path = path
        self.line = line
        self.field = field


@dataclass(frozen=True)
class Trace:
    workload: Workload
    vocab: int = 64
    oracle_seed: int = 0
    #: the check that made it: {"mode": "lockstep"|"invariants", "invariants": SELECTOR}
    #: (absent: lockstep, every invariant); replay repeats it
    check: Mapping[str, str] | None = None

    @property
    def config(self) -> SchedulerConfig:
        return self.workload.config

    @property
    def events(self) -> tuple[Event, ...]:
        return self.workload.events


def event_to_json(event: Event) -> dict[str, Any]:
    if isinstance(event, AddRequest):
        return {"op": "add", "request": event.request.to_dict()}
    if isinstance(event, Abort):
        return {"op": "abort", "request_id": event.request_id}
    if isinstance(event, Step):
        return {"op": "step"}
    if isinstance(event, ResetPrefixCache):
        return {"op": "reset_prefix_cache", "reset_running_requests": event.reset_running_requests}
    raise TypeError(f"not an event: {event!r}")


def dumps(trace: Trace) -> str:
    header = {
        "schedspec_trace": TRACE_VERSION,
        "config": trace.config.to_dict(),
        "vocab": trace.vocab,
        "oracle_seed": trace.oracle_seed,
        "seed": trace.workload.seed,
    }
    if trace.check is not None:
        header["check"] = dict(trace.check)
    lines = [json.dumps(header, sort_keys=True)]
    lines += [json.dumps(event_to_json(e), sort_keys=True) for e in trace.events]
    return "\n".join(lines) + "\n"


def write(path: str | Path, trace: Trace) -> None:
    Path(path).write_text(dumps(trace))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class _Validators:
    header: Any
    events: Mapping[str, Any]  # op -> the validator of that event's branch of $defs/event


@functools.cache
def _validators() -> _Validators:
    """Validators for the header and for each event kind, built once from the
    shipped schema with the dialect it declares (Draft 2020-12). ``integer``
    is strict: JSON Schema counts 2.0 as an integer, a trace may not."""
    from jsonschema import validators

    schema = json.loads(SCHEMA_PATH.read_text())
    base = validators.validator_for(schema)
    base.check_schema(schema)
    strict = base.TYPE_CHECKER.redefine("integer", lambda _checker, value: _is_int(value))
    cls = validators.extend(base, type_checker=strict)  # type: ignore[no-untyped-call]  # untyped in types-jsonschema
    defs = schema["$defs"]

    def at(ref: str) -> Any:
        return cls({"$schema": schema["$schema"], "$defs": defs, "$ref": ref})

    events = {
        branch["properties"]["op"]["const"]: at(f"#/$defs/event/oneOf/{i}")
        for i, branch in enumerate(defs["event"]["oneOf"])
    }
    return _Validators(at("#/$defs/header"), events)


def _dotted(parts: Sequence[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _schema_check(where: tuple[str, int], validator: Any, obj: dict[str, Any], root: str, unknown: str) -> None:
    """Raise TraceError for the most relevant schema violation of ``obj``,
    naming the field (``request.prompt_token_ids[1]``)."""
    from jsonschema.exceptions import best_match

    error = best_match(validator.iter_errors(obj))
    if error is None:
        return
    path: list[str | int] = list(error.absolute_path)
    instance = error.instance
    if error.validator == "additionalProperties" and isinstance(instance, dict):
        known = error.schema.get("properties", {}) if isinstance(error.schema, dict) else {}
        path.append(sorted(k for k in instance if k not in known)[0])
        message = unknown if len(path) == 1 else "unknown field"
    elif error.validator == "required" and isinstance(instance, dict):
        required = error.validator_value if isinstance(error.validator_value, list) else []
        path.append(next(k for k in required if k not in instance))
        message = "missing"
    else:
        message = error.message
    raise TraceError(where[0], where[1], _dotted(path) or root, message)


def _parse_request(where: tuple[str, int], obj: dict[str, Any], config: SchedulerConfig) -> RequestSpec:
    """A request that passed the schema: what the schema cannot say."""
    path, line = where
    kwargs = dict(obj)
    kwargs["prompt_token_ids"] = tuple(obj["prompt_token_ids"])
    kwargs["stop_token_ids"] = tuple(obj.get("stop_token_ids", []))
    try:
        req = RequestSpec(**kwargs)
    except RequestError as exc:
        raise TraceError(path, line, f"request.{exc.field}", str(exc)) from None
    if len(req.prompt_token_ids) >= config.max_model_len:
        raise TraceError(
            path, line, "request.prompt_token_ids",
            f"prompt length {len(req.prompt_token_ids)} must be below max_model_len {config.max_model_len}",
        )
    return req


def _parse_header(
    path: str, line: int, obj: object
) -> tuple[SchedulerConfig, int, int, int | None, dict[str, str] | None]:
    if not isinstance(obj, dict):
        raise TraceError(path, line, "header", "the first line must be a JSON object")
    if "schedspec_trace" not in obj:
        raise TraceError(path, line, "schedspec_trace", "missing: this is not a schedspec trace")
    version = obj["schedspec_trace"]
    if not _is_int(version) or version != TRACE_VERSION:
        raise TraceError(path, line, "schedspec_trace", f"unsupported version {version!r} (this reads {TRACE_VERSION})")
    _schema_check((path, line), _validators().header, obj, "header", "unknown header field")
    try:  # the cross-field rules the schema cannot express
        config = SchedulerConfig.from_dict(obj["config"])
    except ConfigError as exc:
        raise TraceError(path, line, f"config.{exc.field}", str(exc)) from None
    except TypeError as exc:
        raise TraceError(path, line, "config", str(exc)) from None
    check = obj.get("check")
    return config, obj.get("vocab", 64), obj.get("oracle_seed", 0), obj.get("seed"), check


def _parse_event(
    where: tuple[str, int], obj: object, config: SchedulerConfig, seen: set[str]
) -> Event:
    path, line = where
    if not isinstance(obj, dict):
        raise TraceError(path, line, "event", f"must be a JSON object, got {type(obj).__name__}")
    op = obj.get("op")
    branches = _validators().events
    if not isinstance(op, str) or op not in branches:
        raise TraceError(path, line, "op", f"unknown event {op!r} (expected one of {sorted(branches)})")
    _schema_check(where, branches[op], obj, "event", f"unknown field for {op!r}")
    if op == "add":
        req = _parse_request(where, obj["request"], config)
        if req.request_id in seen:
            raise TraceError(path, line, "request.request_id", f"duplicate request id {req.request_id!r}")
        seen.add(req.request_id)
        return AddRequest(req)
    if op == "abort":
        rid = obj["request_id"]
        if rid not in seen:
            raise TraceError(path, line, "request_id", f"{rid!r} was never added before this line")
        return Abort(rid)
    if op == "step":
        return Step()
    return ResetPrefixCache(obj.get("reset_running_requests", False))


def loads(text: str, path: str = "<trace>") -> Trace:
    header: tuple[SchedulerConfig, int, int, int | None, dict[str, str] | None] | None = None
    events: list[Event] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            obj = json.loads(stripped)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise TraceError(path, lineno, "json", f"not valid JSON ({exc})") from None
        if header is None:
            header = _parse_header(path, lineno, obj)
            continue
        events.append(_parse_event((path, lineno), obj, header[0], seen))
    if header is None:
        raise TraceError(path, 1, "header", "empty trace: the first line must be the header")
    config, vocab, oracle_seed, seed, check = header
    return Trace(Workload(config, tuple(events), seed), vocab=vocab, oracle_seed=oracle_seed, check=check)


def read(path: str | Path) -> Trace:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise TraceError(str(p), 0, "file", f"cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TraceError(str(p), line, "encoding", "not UTF-8") from None
    return loads(text, str(p))
