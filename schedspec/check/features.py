"""What a workload may turn on, by name: the modes a scheduler runs in, the
admission gates and the KV features; parsing the names (the CLI's --modes,
--gates and --kv), reading which of them a config and its events use, and
the capability name (schedspec.check.capabilities) a scheduler declares to
take each one."""

from __future__ import annotations

from typing import Mapping, Sequence

from schedspec.spec.interface import SchedulerConfig

from schedspec.check.workload import KV_EVENTS, AddRequest, Event, GrammarReady, Pause, Resume

#: The four ways a scheduler runs: synchronous or async scheduling, each
#: without or with speculative decoding.
MODES: tuple[str, ...] = ("sync", "async", "spec", "async-spec")


def mode_of(config: SchedulerConfig) -> str:
    """The mode a config runs in (one of MODES)."""
    spec = config.num_speculative_tokens > 0
    if config.async_scheduling:
        return "async-spec" if spec else "async"
    return "spec" if spec else "sync"


def parse_modes(text: str) -> tuple[str, ...]:
    """``"sync,async-spec"`` -> ("sync", "async-spec"), in MODES order; a
    ValueError names an unknown mode."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"no mode given (choose from {', '.join(MODES)})")
    for name in names:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r} (choose from {', '.join(MODES)})")
    return tuple(m for m in MODES if m in names)


#: The admission gates of vLLM 0.33's waiting loop a workload can turn on:
#: LoRA adapters (max_loras), structured outputs (grammar readiness, grammar-
#: rejected drafts), pause states, the KV watermark, the prefill cadence
#: (prefill_schedule_interval) and the multimodal encoder budget and cache.
GATES: tuple[str, ...] = ("lora", "grammar", "pause", "watermark", "cadence", "encoder")

#: gate -> the capability name (schedspec.check.capabilities) a scheduler
#: declares to take it
GATE_CAPABILITIES: Mapping[str, str] = {
    "lora": "lora",
    "grammar": "structured_output",
    "pause": "pause",
    "watermark": "watermark",
    "cadence": "prefill_cadence",
    "encoder": "encoder",
}


def _parse_names(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """``"a,b"`` -> the names of ``known`` it lists, in ``known``'s order;
    ``"all"`` -> ``known``, ``"none"`` -> (); a ValueError names an unknown
    ``what`` (the CLI's --gates, --kv and --engine)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"no {what} given (choose from {', '.join(known)}, all or none)")
    if names == ["all"]:
        return known
    if names == ["none"]:
        return ()
    for name in names:
        if name not in known:
            extra = " (all and none stand alone)" if name in ("all", "none") else ""
            raise ValueError(f"unknown {what} {name!r}{extra} (choose from {', '.join(known)}, all or none)")
    return tuple(k for k in known if k in names)


def parse_gates(text: str) -> tuple[str, ...]:
    """``"lora,pause"`` -> ("lora", "pause"), in GATES order; ``"all"`` ->
    GATES, ``"none"`` -> (); a ValueError names an unknown gate."""
    return _parse_names(text, GATES, "gate")


def gates_of(config: SchedulerConfig, events: Sequence["Event"] = ()) -> tuple[str, ...]:
    """The gates a config and its events use, in GATES order."""
    on: set[str] = set()
    if config.max_loras:
        on.add("lora")
    if config.watermark:
        on.add("watermark")
    if config.prefill_schedule_interval != 1:
        on.add("cadence")
    if config.max_num_encoder_input_tokens or config.encoder_cache_size:
        on.add("encoder")
    for e in events:
        if isinstance(e, (Pause, Resume)):
            on.add("pause")
        elif isinstance(e, GrammarReady):
            on.add("grammar")
        elif isinstance(e, AddRequest):
            r = e.request
            if r.lora_id:
                on.add("lora")
            if r.structured_output:
                on.add("grammar")
            if r.mm_inputs:
                on.add("encoder")
    return tuple(g for g in GATES if g in on)


#: The KV features a workload can turn on: the KV connector (external prefix
#: loads, synchronous and asynchronous, asynchronous saves, the worker's
#: reports) and hybrid KV cache groups (full attention beside sliding-window
#: and chunked-local groups, or a lone sliding-window or chunked-local group).
KV_FEATURES: tuple[str, ...] = ("connector", "hybrid")

#: KV feature -> the capability name (schedspec.check.capabilities) a
#: scheduler declares to take it
KV_CAPABILITIES: Mapping[str, str] = {"connector": "kv_connector", "hybrid": "hybrid_kv"}


def parse_kv(text: str) -> tuple[str, ...]:
    """``"connector,hybrid"`` -> ("connector", "hybrid"), in KV_FEATURES
    order; ``"all"`` -> KV_FEATURES, ``"none"`` -> (); a ValueError names an
    unknown feature."""
    return _parse_names(text, KV_FEATURES, "KV feature")


def kv_of(config: SchedulerConfig, events: Sequence["Event"] = ()) -> tuple[str, ...]:
    """The KV features a config and its events use, in KV_FEATURES order."""
    on: set[str] = set()
    if config.kv_connector:
        on.add("connector")
    if config.is_hybrid:
        on.add("hybrid")
    for e in events:
        if isinstance(e, KV_EVENTS):
            on.add("connector")
        elif isinstance(e, AddRequest):
            r = e.request
            if r.kv_external_tokens or r.kv_load_async or r.kv_save_async:
                on.add("connector")
    return tuple(k for k in KV_FEATURES if k in on)


def gate_capabilities(gates: Sequence[str]) -> tuple[str, ...]:
    """The capability names of ``gates`` (what spec/rule_names.py's Rule.gates lists)."""
    return tuple(GATE_CAPABILITIES[g] for g in gates)


def kv_capabilities(kv: Sequence[str]) -> tuple[str, ...]:
    """The capability names of the KV features ``kv``."""
    return tuple(KV_CAPABILITIES[k] for k in kv)


#: The engine features a workload can turn on, each the way vLLM's engine
#: drives the scheduler: streaming-input sessions (resumable requests sent
#: chunks and ends between steps: check/session_events.py), a pipeline of k
#: plans in flight (pipeline_parallel_size 2..4: check/pipeline.py), Model
#: Runner V2 (model_runner "v2": spec/runner_v2.py) and a drafter with its own
#: forward pass (a draft model or EAGLE: lookahead slots, EAGLE's hash
#: lookahead). Drawn in a share of the workloads (check/engine_draw.py).
ENGINE_FEATURES: tuple[str, ...] = ("sessions", "pipeline", "runner", "drafter")

#: engine feature -> the capability name (schedspec.check.capabilities) a
#: scheduler declares to take it (those spec/rule_names.py's Rule.gates
#: name: sessions, runner_v2)
ENGINE_CAPABILITIES: Mapping[str, str] = {
    "sessions": "sessions", "pipeline": "pipeline", "runner": "runner_v2", "drafter": "drafters"}


def parse_engine(text: str) -> tuple[str, ...]:
    """``"sessions,runner"`` -> ("sessions", "runner"), in ENGINE_FEATURES
    order; ``"all"`` -> ENGINE_FEATURES, ``"none"`` -> (); a ValueError names
    an unknown feature."""
    return _parse_names(text, ENGINE_FEATURES, "engine feature")


def engine_of(config: SchedulerConfig, events: Sequence["Event"] = ()) -> tuple[str, ...]:
    """The engine features a config and its events use, in ENGINE_FEATURES order."""
    on: set[str] = set()
    if config.pipeline_parallel_size > 1:
        on.add("pipeline")
    if config.model_runner == "v2":
        on.add("runner")
    if config.drafter != "ngram":
        on.add("drafter")
    if any(isinstance(e, AddRequest) and e.request.resumable for e in events):
        on.add("sessions")
    return tuple(k for k in ENGINE_FEATURES if k in on)


def engine_capabilities(engine: Sequence[str]) -> tuple[str, ...]:
    """The capability names of the engine features ``engine``."""
    return tuple(ENGINE_CAPABILITIES[k] for k in engine)
