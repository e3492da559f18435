"""Trace files: a workload as JSON Lines, versioned, replayable against any scheduler.

Format version 1 (JSON Schema: harness/trace.schema.json, docs/trace-format.md):

    line 1   {"schedspec_trace": 1, "config": {...SchedulerConfig...},
              "vocab": 64, "oracle_seed": 0, "seed": 7}
    then one event per line:
             {"op": "add", "request": {...RequestSpec...}}
             {"op": "abort", "request_id": "r3"}
             {"op": "step"}
             {"op": "reset_prefix_cache", "reset_running_requests": false}

Blank lines and lines starting with ``#`` are ignored. Every problem raises
TraceError naming the file, the line and the field; nothing else escapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from schedspec.spec.interface import ConfigError, RequestError, RequestSpec, SchedulerConfig, SchedSpecError
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Step, Workload

TRACE_VERSION = 1
_REQUEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "request_id": str,
    "prompt_token_ids": list,
    "max_tokens": int,
    "priority": int,
    "arrival": int,
    "stop_token_ids": list,
    "eos_token_id": (int, type(None)),
    "ignore_eos": bool,
    "cache_salt": (str, type(None)),
}
_REQUIRED_REQUEST_FIELDS = ("request_id", "prompt_token_ids", "max_tokens")


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
    lines = [json.dumps(header, sort_keys=True)]
    lines += [json.dumps(event_to_json(e), sort_keys=True) for e in trace.events]
    return "\n".join(lines) + "\n"


def write(path: str | Path, trace: Trace) -> None:
    Path(path).write_text(dumps(trace))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_ok(value: object, expected: type | tuple[type, ...]) -> bool:
    types = expected if isinstance(expected, tuple) else (expected,)
    if int in types and isinstance(value, bool):
        return False
    return isinstance(value, types)


def _parse_request(where: tuple[str, int], obj: object, config: SchedulerConfig) -> RequestSpec:
    path, line = where
    if not isinstance(obj, dict):
        raise TraceError(path, line, "request", f"must be an object, got {type(obj).__name__}")
    for key in obj:
        if key not in _REQUEST_FIELDS:
            raise TraceError(path, line, f"request.{key}", "unknown field")
    for key in _REQUIRED_REQUEST_FIELDS:
        if key not in obj:
            raise TraceError(path, line, f"request.{key}", "missing")
    for key, value in obj.items():
        if not _type_ok(value, _REQUEST_FIELDS[key]):
            raise TraceError(path, line, f"request.{key}", f"wrong type: {value!r}")
    for key in ("prompt_token_ids", "stop_token_ids"):
        for i, tok in enumerate(obj.get(key, [])):
            if not _is_int(tok) or tok < 0:
                raise TraceError(path, line, f"request.{key}[{i}]", f"must be a non-negative integer, got {tok!r}")
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


def _parse_header(path: str, line: int, obj: object) -> tuple[SchedulerConfig, int, int, int | None]:
    if not isinstance(obj, dict):
        raise TraceError(path, line, "header", "the first line must be a JSON object")
    if "schedspec_trace" not in obj:
        raise TraceError(path, line, "schedspec_trace", "missing: this is not a schedspec trace")
    version = obj["schedspec_trace"]
    if version != TRACE_VERSION:
        raise TraceError(path, line, "schedspec_trace", f"unsupported version {version!r} (this reads {TRACE_VERSION})")
    for key in obj:
        if key not in ("schedspec_trace", "config", "vocab", "oracle_seed", "seed"):
            raise TraceError(path, line, key, "unknown header field")
    if "config" not in obj:
        raise TraceError(path, line, "config", "missing")
    raw = obj["config"]
    if not isinstance(raw, dict):
        raise TraceError(path, line, "config", "must be an object")
    for key, value in raw.items():
        if key != "policy" and not isinstance(value, (int, bool)):
            raise TraceError(path, line, f"config.{key}", f"wrong type: {value!r}")
    try:
        config = SchedulerConfig.from_dict(raw)
    except ConfigError as exc:
        raise TraceError(path, line, f"config.{exc.field}", str(exc)) from None
    except TypeError as exc:
        raise TraceError(path, line, "config", str(exc)) from None
    vocab = obj.get("vocab", 64)
    if not _is_int(vocab) or vocab < 2:
        raise TraceError(path, line, "vocab", f"must be an integer >= 2, got {vocab!r}")
    oracle_seed = obj.get("oracle_seed", 0)
    if not _is_int(oracle_seed) or oracle_seed < 0:
        raise TraceError(path, line, "oracle_seed", f"must be a non-negative integer, got {oracle_seed!r}")
    seed = obj.get("seed")
    if seed is not None and not _is_int(seed):
        raise TraceError(path, line, "seed", f"must be an integer or null, got {seed!r}")
    return config, vocab, oracle_seed, seed


def _parse_event(
    where: tuple[str, int], obj: object, config: SchedulerConfig, seen: set[str]
) -> Event:
    path, line = where
    if not isinstance(obj, dict):
        raise TraceError(path, line, "event", f"must be a JSON object, got {type(obj).__name__}")
    op = obj.get("op")
    allowed: Mapping[str, tuple[str, ...]] = {
        "add": ("op", "request"),
        "abort": ("op", "request_id"),
        "step": ("op",),
        "reset_prefix_cache": ("op", "reset_running_requests"),
    }
    if not isinstance(op, str) or op not in allowed:
        raise TraceError(path, line, "op", f"unknown event {op!r} (expected one of {sorted(allowed)})")
    assert isinstance(op, str)
    for key in obj:
        if key not in allowed[op]:
            raise TraceError(path, line, key, f"unknown field for {op!r}")
    if op == "add":
        if "request" not in obj:
            raise TraceError(path, line, "request", "missing")
        req = _parse_request(where, obj["request"], config)
        if req.request_id in seen:
            raise TraceError(path, line, "request.request_id", f"duplicate request id {req.request_id!r}")
        seen.add(req.request_id)
        return AddRequest(req)
    if op == "abort":
        rid = obj.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise TraceError(path, line, "request_id", f"must be a non-empty string, got {rid!r}")
        if rid not in seen:
            raise TraceError(path, line, "request_id", f"{rid!r} was never added before this line")
        return Abort(rid)
    if op == "step":
        return Step()
    flag = obj.get("reset_running_requests", False)
    if not isinstance(flag, bool):
        raise TraceError(path, line, "reset_running_requests", f"must be a boolean, got {flag!r}")
    return ResetPrefixCache(flag)


def loads(text: str, path: str = "<trace>") -> Trace:
    header: tuple[SchedulerConfig, int, int, int | None] | None = None
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
    config, vocab, oracle_seed, seed = header
    return Trace(Workload(config, tuple(events), seed), vocab=vocab, oracle_seed=oracle_seed)


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
