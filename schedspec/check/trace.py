"""Trace files: a workload as JSON Lines, versioned, replayable against any scheduler.

Format version 4 (JSON Schema: schedspec/check/trace.schema.json, docs/trace-format.md):

    line 1   {"schedspec_trace": 4, "config": {...SchedulerConfig...},
              "vocab": 64, "oracle_seed": 0, "seed": 7, "gates": ["lora", "pause"],
              "kv": ["connector", "hybrid"]}
    then one event per line:
             {"op": "add", "request": {...RequestSpec...}}
             {"op": "abort", "request_id": "r3"}
             {"op": "step"}
             {"op": "reset_prefix_cache", "reset_running_requests": false}
             {"op": "schedule"}                      (version 2)
             {"op": "schedule", "result": {"sampled": {"r1": [5, 9]},
                                           "draft_token_ids": {"r1": [4, 4]}}}
             {"op": "update", "step": 3}             (version 2; "step" optional)
             {"op": "pause", "mode": "new", "clear_cache": true}   (version 3)
             {"op": "resume"}                                      (version 3)
             {"op": "grammar_ready", "request_id": "r2", "ok": true} (version 3)
             {"op": "kv_load_done", "request_id": "r2"}              (version 4)
             {"op": "kv_load_failed", "request_id": "r2", "block_index": 1}  (version 4;
                                                 "block_index" null or absent: the whole load)
             {"op": "kv_save_done", "request_id": "r2"}              (version 4)

Version 2 adds the config's ``async_scheduling`` and ``num_speculative_tokens``
and the schedule / update events; version 1 traces read as they always did,
and ``dumps`` writes version 1 for a trace that uses nothing of version 2.
The in-flight protocol is checked at load: an update with nothing in flight,
for a step never planned, already updated or out of order, a schedule while
the scheduler may not take one, recorded tokens or drafts for a request never
added or already aborted, more tokens than 1 + num_speculative_tokens
(accepted beyond the drafts), drafts with speculative decoding off.

Version 3 adds the admission gates: the config's ``max_loras``,
``watermark``, ``prefill_schedule_interval``, ``max_num_encoder_input_tokens``
and ``encoder_cache_size``; the requests' ``lora_id``, ``structured_output``,
``grammar_rejects`` and ``mm_inputs``; the pause / resume / grammar_ready
events; and the header's ``gates``, the gates the workload uses (checked
against what it uses at load). At load a request with an adapter when
max_loras is 0, or with encoder inputs and no encoder budget, and a
grammar_ready for a request never added, without structured output or
already ready, are refused (one for an aborted request is kept: the
structured-output manager may finish compiling after the abort, and each
scheduler refuses it alike).

Version 4 adds the KV connector and hybrid KV cache groups: the config's
``kv_connector``, ``kv_load_failure_policy`` and ``kv_cache_groups``; the
requests' ``kv_external_tokens``, ``kv_load_async`` and ``kv_save_async``;
the kv_load_done / kv_load_failed / kv_save_done events (the connector's
worker reports, schedspec.check.oracle.KVWorker); and the header's ``kv``,
the KV features the workload uses (checked against what it uses at load).
At load a group configuration vLLM would refuse (a window of 0, a block
size other than the config's), a request with connector fields and no
connector, and a worker event with no connector, for a request never added,
for a request that never loads asynchronously (kv_load_done), never loads
(kv_load_failed), never saves (kv_save_done), or with a ``block_index``
outside the blocks the request's external prefix fills, are refused.

Version 5 adds the schedule event's ``plan``: the plan a recorded scheduler
made there (schedspec/engine/recorder.py), which a replay compares with the
scheduler's own (schedspec/check/recorded.py).

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

from schedspec.spec.interface import ConfigError, MMInput, RequestError, RequestSpec, SchedulerConfig, SchedSpecError
from schedspec.spec.interface import SessionUpdate, StepResult
from schedspec.spec.validate import declared
from schedspec.check.features import gates_of, kv_of
from schedspec.check.workload import (
    Abort,
    AddRequest,
    Event,
    GrammarReady,
    InFlight,
    KVLoadDone,
    KVLoadFailed,
    KVSaveDone,
    SessionInput,
    Pause,
    RecordedPlan,
    ResetPrefixCache,
    Resume,
    Schedule,
    Step,
    Update,
    Workload,
)

#: The version ``dumps`` writes for a trace that needs it; READ_VERSIONS are read.
TRACE_VERSION = 8
READ_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)


def fields_since(cls: type, version: int) -> tuple[str, ...]:
    """The fields of ``cls`` that trace format ``version`` brought, in field
    order (each field declares its ``since``: spec/validate.py, Declaration)."""
    return tuple(name for name, _, declaration in declared(cls) if declaration.since == version)


#: Config fields a version 1 trace cannot carry.
V2_CONFIG_FIELDS = fields_since(SchedulerConfig, 2)
#: Config fields, request fields and events of the admission gates (version 3).
V3_CONFIG_FIELDS = fields_since(SchedulerConfig, 3)
V3_REQUEST_FIELDS = fields_since(RequestSpec, 3)
V3_OPS = ("pause", "resume", "grammar_ready")
#: Config fields, request fields and events of the KV connector and hybrid
#: KV cache groups (version 4).
V4_CONFIG_FIELDS = fields_since(SchedulerConfig, 4)
V4_REQUEST_FIELDS = fields_since(RequestSpec, 4)
V4_OPS = ("kv_load_done", "kv_load_failed", "kv_save_done")
#: Streaming-input sessions (version 6): the request field and the event.
V6_REQUEST_FIELDS = fields_since(RequestSpec, 6)
V6_OPS = ("session_update",)
#: Config fields of version 7 (pipeline parallelism, the model runner, the hash block size).
V7_CONFIG_FIELDS = fields_since(SchedulerConfig, 7)
#: The request field of version 8 (a request's KV cache report mode).
V8_REQUEST_FIELDS = fields_since(RequestSpec, 8)
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
    def gates(self) -> tuple[str, ...]:
        """The admission gates the workload uses (the header's ``gates``)."""
        return gates_of(self.workload.config, self.workload.events)

    @property
    def kv(self) -> tuple[str, ...]:
        """The KV features the workload uses (the header's ``kv``)."""
        return kv_of(self.workload.config, self.workload.events)

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
    if isinstance(event, Schedule):
        out: dict[str, Any] = {"op": "schedule"}
        if event.result is not None:
            out["result"] = result_to_json(event.result)
        if event.plan is not None:
            out["plan"] = recorded_plan_to_json(event.plan)
        return out
    if isinstance(event, Update):
        return {"op": "update"} if event.step is None else {"op": "update", "step": event.step}
    if isinstance(event, Pause):
        return {"op": "pause", "mode": event.mode, "clear_cache": event.clear_cache}
    if isinstance(event, Resume):
        return {"op": "resume"}
    if isinstance(event, GrammarReady):
        return {"op": "grammar_ready", "request_id": event.request_id, "ok": event.ok}
    if isinstance(event, KVLoadDone):
        return {"op": "kv_load_done", "request_id": event.request_id}
    if isinstance(event, KVLoadFailed):
        out = {"op": "kv_load_failed", "request_id": event.request_id}
        if event.block_index is not None:
            out["block_index"] = event.block_index
        return out
    if isinstance(event, KVSaveDone):
        return {"op": "kv_save_done", "request_id": event.request_id}
    if isinstance(event, SessionInput):
        return {"op": "session_update", **event.update.to_dict()}
    raise TypeError(f"not an event: {event!r}")


def result_to_json(result: StepResult) -> dict[str, Any]:
    out: dict[str, Any] = {"sampled": {rid: list(toks) for rid, toks in result.sampled.items()}}
    if result.draft_token_ids:
        out["draft_token_ids"] = {rid: list(toks) for rid, toks in result.draft_token_ids.items()}
    return out


def recorded_plan_to_json(plan: RecordedPlan) -> dict[str, Any]:
    return {"scheduled": [list(e) for e in plan.scheduled], "preempted": list(plan.preempted),
            "finished": list(plan.finished)}


def version_of(trace: Trace) -> int:
    """The lowest format version that holds ``trace``: at least the version
    that brought each config field it writes (the field's declared ``since``)."""
    config = trace.config.to_dict()
    return max(_config_version(config), _version_of_events(trace, config))


def _config_version(config: dict[str, object]) -> int:
    since = {name: declaration.since for name, _, declaration in declared(SchedulerConfig)}
    return max((max(since.get(name, 1), _choice_since(name, value)) for name, value in config.items()), default=1)


#: config field -> {choice: the version that brought it} (Declaration.choices_since)
_CHOICES_SINCE = {name: dict(declaration.choices_since) for name, _, declaration in declared(SchedulerConfig)
                  if declaration.choices_since}


def _choice_since(name: str, value: object) -> int:
    """The version that brought ``value`` of config field ``name`` (1: any version that has the field)."""
    return _CHOICES_SINCE.get(name, {}).get(value, 1) if isinstance(value, str) else 1


def _version_of_events(trace: Trace, config: dict[str, object]) -> int:
    if any(isinstance(e, AddRequest) and any(n in e.request.to_dict() for n in V8_REQUEST_FIELDS)
           for e in trace.events):
        return 8
    if any(isinstance(e, SessionInput) or isinstance(e, AddRequest) and e.request.resumable for e in trace.events):
        return 6
    if any(isinstance(e, Schedule) and e.plan is not None for e in trace.events):
        return 5
    if trace.kv:
        return 4
    if trace.gates:
        return 3
    if any(name in config for name in V2_CONFIG_FIELDS):
        return 2
    if any(isinstance(e, (Schedule, Update)) for e in trace.events):
        return 2
    return 1


def dumps(trace: Trace) -> str:
    header = {
        "schedspec_trace": version_of(trace),
        "config": trace.config.to_dict(),
        "vocab": trace.vocab,
        "oracle_seed": trace.oracle_seed,
        "seed": trace.workload.seed,
    }
    if trace.check is not None:
        header["check"] = dict(trace.check)
    if trace.gates:
        header["gates"] = list(trace.gates)
    if trace.kv:
        header["kv"] = list(trace.kv)
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
    if "grammar_rejects" in obj:
        kwargs["grammar_rejects"] = tuple(obj["grammar_rejects"])
    if "mm_inputs" in obj:
        kwargs["mm_inputs"] = tuple(MMInput(m["offset"], m["length"], m["identifier"]) for m in obj["mm_inputs"])
    try:
        req = RequestSpec(**kwargs)
    except RequestError as exc:
        raise TraceError(path, line, f"request.{exc.field}", str(exc)) from None
    if len(req.prompt_token_ids) >= config.max_model_len:
        raise TraceError(
            path, line, "request.prompt_token_ids",
            f"prompt length {len(req.prompt_token_ids)} must be below max_model_len {config.max_model_len}",
        )
    if req.lora_id and not config.max_loras:
        raise TraceError(path, line, "request.lora_id",
                         f"adapter {req.lora_id} with LoRA off (the config's max_loras is 0)")
    if req.mm_inputs and not config.has_encoder:
        raise TraceError(path, line, "request.mm_inputs",
                         "encoder inputs with no encoder (the config's encoder_cache_size is 0)")
    if req.kv_external_tokens and not req.kv_load_async and req.kv_external_tokens >= len(req.prompt_token_ids):
        raise TraceError(path, line, "request.kv_external_tokens",
                         f"a synchronous load of all {req.kv_external_tokens} prompt tokens leaves none to compute "
                         "(vLLM asserts num_new_tokens > 0): load at most the prompt less one token, or "
                         "load asynchronously")
    if not config.kv_connector:
        for name in V4_REQUEST_FIELDS:
            if getattr(req, name):
                raise TraceError(path, line, f"request.{name}",
                                 "a KV connector field with no connector (the config's kv_connector is false)")
    return req


def _parse_header(
    path: str, line: int, obj: object
) -> tuple[SchedulerConfig, int, int, int | None, dict[str, str] | None]:
    if not isinstance(obj, dict):
        raise TraceError(path, line, "header", "the first line must be a JSON object")
    if "schedspec_trace" not in obj:
        raise TraceError(path, line, "schedspec_trace", "missing: this is not a schedspec trace")
    version = obj["schedspec_trace"]
    if not _is_int(version) or version not in READ_VERSIONS:
        raise TraceError(path, line, "schedspec_trace",
                         f"unsupported version {version!r} (this reads {', '.join(map(str, READ_VERSIONS))})")
    _schema_check((path, line), _validators().header, obj, "header", "unknown header field")
    if version == 1:
        for name in V2_CONFIG_FIELDS:
            if isinstance(obj["config"], dict) and name in obj["config"]:
                raise TraceError(path, line, f"config.{name}",
                                 "needs trace format version 2 (\"schedspec_trace\": 2)")
    if version < 3:
        for name in V3_CONFIG_FIELDS:
            if name in obj["config"]:
                raise TraceError(path, line, f"config.{name}", _NEEDS_V3)
        if "gates" in obj:
            raise TraceError(path, line, "gates", _NEEDS_V3)
    if version < 4:
        for name in V4_CONFIG_FIELDS:
            if name in obj["config"]:
                raise TraceError(path, line, f"config.{name}", _NEEDS_V4)
        if "kv" in obj:
            raise TraceError(path, line, "kv", _NEEDS_V4)
    if version < 7:
        for name in V7_CONFIG_FIELDS:
            if name in obj["config"]:
                raise TraceError(path, line, f"config.{name}", _NEEDS_V7)
    for name, value in obj["config"].items():
        needs = _choice_since(name, value)
        if needs > version:
            raise TraceError(path, line, f"config.{name}",
                             f"{value!r} needs trace format version {needs} (\"schedspec_trace\": {needs})")
    try:  # the cross-field rules the schema cannot express
        config = SchedulerConfig.from_dict(obj["config"])
    except ConfigError as exc:
        raise TraceError(path, line, f"config.{exc.field}", exc.message) from None
    except TypeError as exc:
        raise TraceError(path, line, "config", str(exc)) from None
    check = obj.get("check")
    return config, obj.get("vocab", 64), obj.get("oracle_seed", 0), obj.get("seed"), check


_NEEDS_V3 = "needs trace format version 3 (\"schedspec_trace\": 3)"
_NEEDS_V4 = "needs trace format version 4 (\"schedspec_trace\": 4)"
_NEEDS_V5 = "needs trace format version 5 (\"schedspec_trace\": 5)"
_NEEDS_V6 = "needs trace format version 6 (\"schedspec_trace\": 6)"
_NEEDS_V7 = "needs trace format version 7 (\"schedspec_trace\": 7)"
_NEEDS_V8 = "needs trace format version 8 (\"schedspec_trace\": 8)"
#: The events and request fields a later version brought, checked in this
#: order: (version, ops, request fields, the message).
_LATER_EVENTS: tuple[tuple[int, tuple[str, ...], tuple[str, ...], str], ...] = (
    (3, V3_OPS, V3_REQUEST_FIELDS, _NEEDS_V3),
    (4, V4_OPS, V4_REQUEST_FIELDS, _NEEDS_V4),
    (6, V6_OPS, V6_REQUEST_FIELDS, _NEEDS_V6),
    (8, (), V8_REQUEST_FIELDS, _NEEDS_V8),
)


class _Loading:
    """What the events before a line established: the ids added, the ids
    aborted (with their line), the plans in flight, the requests waiting for
    a grammar and those whose grammar was reported (with their line)."""

    def __init__(self, version: int, config: SchedulerConfig) -> None:
        self.version = version
        self.config = config
        self.seen: set[str] = set()
        self.aborted: dict[str, int] = {}
        self.flight = InFlight.of(config)
        self.structured: set[str] = set()
        self.grammar_reported: dict[str, int] = {}
        #: request id -> its spec (the worker events' checks read it)
        self.requests: dict[str, RequestSpec] = {}
        #: session id -> the line that ended it (session_update with end)
        self.session_ended: dict[str, int] = {}


def _parse_result(where: tuple[str, int], obj: dict[str, Any], state: _Loading) -> StepResult:
    """A recorded model output that passed the schema: tokens and drafts only
    for requests added and not aborted before this line, at most 1 +
    num_speculative_tokens tokens (the accepted drafts, then the bonus token)
    and at most num_speculative_tokens drafts each."""
    path, line = where
    k = state.config.num_speculative_tokens
    for part in ("sampled", "draft_token_ids"):
        for rid, toks in obj.get(part, {}).items():
            field = f"result.{part}.{rid}"
            if rid not in state.seen:
                raise TraceError(path, line, field, f"{rid!r} was never added before this line")
            if rid in state.aborted:
                raise TraceError(path, line, field,
                                 f"{rid!r} is finished: aborted on line {state.aborted[rid]}")
            if part == "sampled" and len(toks) > 1 + k:
                raise TraceError(path, line, field,
                                 f"{len(toks)} tokens accepted beyond the drafts: a step samples at most "
                                 f"1 + num_speculative_tokens = {1 + k}")
            if part == "draft_token_ids" and len(toks) > k:
                raise TraceError(path, line, field,
                                 f"{len(toks)} drafts, more than num_speculative_tokens = {k}")
    return StepResult(
        sampled={rid: tuple(toks) for rid, toks in obj.get("sampled", {}).items()},
        draft_token_ids={rid: tuple(toks) for rid, toks in obj.get("draft_token_ids", {}).items()},
    )


def _parse_event(where: tuple[str, int], obj: object, state: _Loading) -> Event:
    config, seen = state.config, state.seen
    path, line = where
    if not isinstance(obj, dict):
        raise TraceError(path, line, "event", f"must be a JSON object, got {type(obj).__name__}")
    op = obj.get("op")
    branches = _validators().events
    if not isinstance(op, str) or op not in branches:
        raise TraceError(path, line, "op", f"unknown event {op!r} (expected one of {sorted(branches)})")
    for version, ops, request_fields, needs in _LATER_EVENTS:
        if state.version >= version:
            continue
        if op in ops:
            raise TraceError(path, line, "op", f"{op!r} " + needs)
        if op == "add" and isinstance(obj.get("request"), dict):
            for name in request_fields:
                if name in obj["request"]:
                    raise TraceError(path, line, f"request.{name}", needs)
    _schema_check(where, branches[op], obj, "event", f"unknown field for {op!r}")
    if op == "session_update":
        return parse_session_update(where, obj, state)
    if op == "add":
        req = _parse_request(where, obj["request"], config)
        if req.request_id in seen:
            raise TraceError(path, line, "request.request_id", f"duplicate request id {req.request_id!r}")
        seen.add(req.request_id)
        state.requests[req.request_id] = req
        if req.structured_output:
            state.structured.add(req.request_id)
        return AddRequest(req)
    if op == "pause":
        return Pause(obj["mode"], obj.get("clear_cache", False))
    if op == "resume":
        return Resume()
    if op == "grammar_ready":
        return _parse_grammar_ready(where, obj, state)
    if op in V4_OPS:
        return _parse_kv_event(where, op, obj, state)
    if op == "abort":
        rid = obj["request_id"]
        if rid not in seen:
            raise TraceError(path, line, "request_id", f"{rid!r} was never added before this line")
        state.aborted.setdefault(rid, line)
        return Abort(rid)
    if op in ("schedule", "update") and state.version < 2:
        raise TraceError(path, line, "op", f"{op!r} needs trace format version 2 (\"schedspec_trace\": 2)")
    if op == "step":
        if (why := state.flight.step()[1]) is not None:
            raise TraceError(path, line, "op", why)
        return Step()
    if op == "schedule":
        if "plan" in obj and state.version < 5:
            raise TraceError(path, line, "plan", _NEEDS_V5)
        result = _parse_result(where, obj["result"], state) if "result" in obj else None
        if (why := state.flight.schedule()) is not None:
            raise TraceError(path, line, "op", why)
        plan = obj.get("plan")
        return Schedule(result, None if plan is None else RecordedPlan(
            tuple((e[0], e[1], e[2], e[3], e[4]) for e in plan["scheduled"]),
            tuple(plan.get("preempted", ())), tuple(plan.get("finished", ()))))
    if op == "update":
        step = obj.get("step")
        if (why := state.flight.update(step)) is not None:
            raise TraceError(path, line, "step" if step is not None else "op", why)
        return Update(step)
    if (why := state.flight.reset()) is not None:
        raise TraceError(path, line, "op", why)
    return ResetPrefixCache(obj.get("reset_running_requests", False))


def _parse_grammar_ready(where: tuple[str, int], obj: dict[str, Any], state: _Loading) -> GrammarReady:
    """A grammar_ready names a request added before it (aborted or not: a
    compile may finish after the abort, which the schedulers refuse alike),
    with structured output, whose grammar was not reported before."""
    path, line = where
    rid = obj["request_id"]
    if rid not in state.seen:
        raise TraceError(path, line, "request_id", f"{rid!r} was never added before this line")
    if rid not in state.structured:
        raise TraceError(path, line, "request_id",
                         f"{rid!r} has no structured output: it never waits for a grammar")
    if rid in state.grammar_reported:
        raise TraceError(path, line, "request_id",
                         f"the grammar of {rid!r} was already reported on line {state.grammar_reported[rid]}")
    state.grammar_reported[rid] = line
    return GrammarReady(rid, obj.get("ok", True))


def _parse_kv_event(where: tuple[str, int], op: str, obj: dict[str, Any], state: _Loading) -> Event:
    """A worker event names a request added before it (aborted or not: a
    load aborted midway still reports), in a workload with a KV connector;
    kv_load_done one that loads asynchronously, kv_load_failed one that
    loads (its ``block_index`` among the blocks its external prefix fills),
    kv_save_done one that saves asynchronously."""
    path, line = where
    rid = obj["request_id"]
    if not state.config.kv_connector:
        raise TraceError(path, line, "op", f"{op!r} with no KV connector (the config's kv_connector is false)")
    req = state.requests.get(rid)
    if req is None:
        raise TraceError(path, line, "request_id", f"{rid!r} was never added before this line")
    if op == "kv_load_done":
        if not req.kv_load_async:
            raise TraceError(path, line, "request_id",
                             f"{rid!r} never loads asynchronously (its kv_load_async is false): "
                             "no load of it is ever reported done")
        return KVLoadDone(rid)
    if op == "kv_save_done":
        if not req.kv_save_async:
            raise TraceError(path, line, "request_id",
                             f"{rid!r} never saves asynchronously (its kv_save_async is false)")
        return KVSaveDone(rid)
    if not req.kv_external_tokens:
        raise TraceError(path, line, "request_id",
                         f"{rid!r} never loads (its kv_external_tokens is 0): no load of it can fail")
    index = obj.get("block_index")
    blocks = -(-req.kv_external_tokens // state.config.block_size)
    if index is not None and index >= blocks:
        raise TraceError(path, line, "block_index",
                         f"{index} is outside the request's table where a load can fill it: its external "
                         f"prefix of {req.kv_external_tokens} tokens fills blocks 0 .. {blocks - 1}")
    return KVLoadFailed(rid, index)


def _check_declared(path: str, line: int, field: str, declared: object, used: list[str], what: str) -> None:
    """The header's ``field`` (when given) must name every ``what`` the
    workload uses (``used``): the gates, or the KV features."""
    if declared is None:
        return
    assert isinstance(declared, list)
    missing = [u for u in used if u not in declared]
    if missing:
        raise TraceError(path, line, field,
                         f"the trace uses the {what} {', '.join(missing)}, which the header does not list "
                         f"(it lists {', '.join(declared) or 'none'})")


def _check_kv(path: str, line: int, declared: object, workload: Workload) -> None:
    _check_declared(path, line, "kv", declared, list(kv_of(workload.config, workload.events)), "KV feature(s)")


def _check_gates(path: str, line: int, declared: object, workload: Workload) -> None:
    _check_declared(path, line, "gates", declared, list(gates_of(workload.config, workload.events)), "gate(s)")


def loads(text: str, path: str = "<trace>") -> Trace:
    header: tuple[SchedulerConfig, int, int, int | None, dict[str, str] | None] | None = None
    events: list[Event] = []
    state: _Loading | None = None
    declared_gates: object = None
    declared_kv: object = None
    header_line = 1
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
            state = _Loading(obj["schedspec_trace"], header[0])
            declared_gates, declared_kv, header_line = obj.get("gates"), obj.get("kv"), lineno
            continue
        assert state is not None
        events.append(_parse_event((path, lineno), obj, state))
    if header is None:
        raise TraceError(path, 1, "header", "empty trace: the first line must be the header")
    config, vocab, oracle_seed, seed, check = header
    workload = Workload(config, tuple(events), seed)
    _check_gates(path, header_line, declared_gates, workload)
    _check_kv(path, header_line, declared_kv, workload)
    return Trace(workload, vocab=vocab, oracle_seed=oracle_seed, check=check)


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


def parse_session_update(where: tuple[str, int], obj: dict[str, Any], state: _Loading) -> SessionInput:
    """A session_update names a resumable request added before it (aborted
    or not: the schedulers refuse an update of a finished session alike),
    whose end was not sent before; its chunk is not empty."""
    path, line = where
    rid = obj["request_id"]
    req = state.requests.get(rid)
    if req is None:
        raise TraceError(path, line, "request_id", f"{rid!r} was never added before this line")
    if not req.resumable:
        raise TraceError(path, line, "request_id", f"{rid!r} is not resumable: it takes no session update")
    ended = state.session_ended
    if rid in ended:
        raise TraceError(path, line, "request_id", f"the session {rid!r} was ended on line {ended[rid]}")
    try:
        update = SessionUpdate.from_dict({k: v for k, v in obj.items() if k != "op"})
    except RequestError as exc:
        raise TraceError(path, line, exc.field, str(exc).split(": ", 2)[-1]) from None
    if update.end:
        ended[rid] = line
    return SessionInput(update)
