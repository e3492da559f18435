"""What a scheduler supports, and keeping a check within it.

A scheduler that is not a vLLM clone may have no priority queue, no chunked
prefill, no prefix cache, no abort. It declares what it does support as a
``CAPABILITIES`` class attribute (a :class:`Capabilities`); a class without
one is taken to support everything the spec does in the default config (sync,
no speculative decoding, no admission gate: LoRA, structured outputs, pause
states, the watermark, the prefill cadence and the encoder budget are each
opted into, as async scheduling is; so are the KV connector, ``kv_connector``,
and hybrid KV cache groups, ``hybrid_kv``).

Everything that makes input for a check stays within the declaration: the
seeded workloads, the Hypothesis strategies and the model checker's spaces
draw their configs and events as usual and pass them through
:meth:`Capabilities.restrict_config` / :meth:`Capabilities.restrict_workload`
(with every capability on, both are the identity, so existing seeds draw the
same workloads). Invariants whose premise a scheduler does not support (see
``Invariant.requires``) are skipped and listed as skipped.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, Final, Iterable, Literal, Mapping

from schedspec.invariants.core import Invariant
from schedspec.spec.interface import Policy, RequestSpec, SchedSpecError, SchedulerConfig

from schedspec.check.defects import steer
from schedspec.check.features import (
    ENGINE_CAPABILITIES,
    ENGINE_FEATURES,
    GATE_CAPABILITIES,
    GATES,
    KV_CAPABILITIES,
    KV_FEATURES,
    gates_of,
)
from schedspec.check.gate_requests import with_gates
from schedspec.check.workload import (
    KV_EVENTS,
    Abort,
    AddRequest,
    Event,
    GrammarReady,
    Pause,
    ResetPrefixCache,
    Resume,
    SessionInput,
    Workload,
    keep_protocol,
)

#: The names an invariant may list in ``requires`` (one per capability).
CAPABILITY_NAMES: frozenset[str] = frozenset(
    {
        "policy_fcfs",
        "policy_priority",
        "chunked_prefill",
        "long_prefill_threshold",
        "prefix_caching",
        "salts",
        "stop_tokens",
        "abort",
        "reset_prefix_cache",
        "async_scheduling",
        "speculative_decoding",
        # the admission gates (schedspec.check.features.GATES)
        "lora",
        "structured_output",
        "pause",
        "watermark",
        "prefill_cadence",
        "encoder",
        # the KV connector and hybrid KV cache groups (features.KV_FEATURES)
        "kv_connector",
        "hybrid_kv",
        # the KV cache events (spec/kv_events.py): take_kv_events()
        "kv_events",
        # the engine features (features.ENGINE_FEATURES)
        "sessions",
        "pipeline",
        "runner_v2",
        "drafters",
    }
)

#: The capability names of the admission gates, in features.GATES order.
GATE_CAPABILITY_NAMES: tuple[str, ...] = tuple(GATE_CAPABILITIES[g] for g in GATES)


#: A switch a scheduler keeps on, never off (``prefix_caching=ALWAYS``): the
#: checks then draw only configs with it on. ``True`` is "either" (drawn on and
#: off), ``False`` "off".
ALWAYS: Final = "always"
Switch = bool | Literal["always"]
#: The admission gates whose switch is a config value, so a scheduler can
#: keep them on in every config (features.GATES names): LoRA (max_loras), the
#: watermark, the prefill cadence (prefill_schedule_interval), the encoder
#: budget. Structured outputs and pause states are about requests and events,
#: not the config: a workload without them is no config the scheduler could
#: refuse, so those two take only True or False.
CONFIG_GATES: tuple[str, ...] = ("lora", "watermark", "cadence", "encoder")
#: The capabilities that take ALWAYS: the config switches, speculative
#: decoding (num_speculative_tokens > 0) and the CONFIG_GATES.
SWITCHES: tuple[str, ...] = ("chunked_prefill", "long_prefill_threshold", "prefix_caching", "speculative_decoding",
                             *(GATE_CAPABILITIES[g] for g in CONFIG_GATES))
#: The drafts per step a restriction gives a config of an always-drafting
#: scheduler (fewer where a long-prefill threshold is lower).
ALWAYS_DRAFTS: Final = 2


class CapabilityError(SchedSpecError, ValueError):
    """A capability declaration that is malformed, or that a check cannot
    honour (a fixed config or trace outside it, an invariant chosen by id
    whose premise it lacks)."""


@dataclass(frozen=True)
class Capabilities:
    """What a scheduler supports. The defaults are the spec's (everything but
    async scheduling, speculative decoding and the admission gates, which a
    scheduler opts into)."""

    policies: frozenset[Policy] = frozenset({Policy.FCFS, Policy.PRIORITY})
    chunked_prefill: Switch = True
    long_prefill_threshold: Switch = True
    prefix_caching: Switch = True  # False: only enable_prefix_caching=False; ALWAYS: only True
    salts: bool = True  # cache_salt on requests
    stop_tokens: bool = True  # eos_token_id and stop_token_ids on requests
    abort: bool = True
    reset_prefix_cache: bool = True
    min_block_size: int = 1
    async_scheduling: bool = False
    #: ALWAYS: num_speculative_tokens > 0 in every config (the spec modes only)
    speculative_decoding: Switch = False
    #: False: only async scheduling (a vLLM AsyncScheduler subclass, which
    #: vLLM's engine core always drives with a step in flight)
    sync_scheduling: bool = True
    # The admission gates, each opted into as async scheduling is (those of
    # CONFIG_GATES also take ALWAYS: the gate on in every config):
    #: LoRA adapters: config.max_loras and request.lora_id
    lora: Switch = False
    #: structured outputs: request.structured_output / grammar_rejects and
    #: grammar_ready() (the optional Scheduler method); True or False only:
    #: a request without a grammar is no config a scheduler could refuse
    structured_output: bool = False
    #: pause states: set_pause_state() (the optional Scheduler method); True
    #: or False only: pauses are events, the config has no pause switch
    pause: bool = False
    #: config.watermark
    watermark: Switch = False
    #: config.prefill_schedule_interval
    prefill_cadence: Switch = False
    #: the multimodal encoder budget and cache: config.max_num_encoder_input_tokens /
    #: encoder_cache_size and request.mm_inputs
    encoder: Switch = False
    # The KV features, each opted into as the gates are:
    #: the KV connector: config.kv_connector / kv_load_failure_policy, the
    #: requests' kv_external_tokens / kv_load_async / kv_save_async, the
    #: worker's events (KVLoadDone, KVLoadFailed, KVSaveDone)
    kv_connector: bool = False
    #: hybrid KV cache groups: config.kv_cache_groups other than one
    #: full-attention group
    hybrid_kv: bool = False
    #: KV cache events: config.enable_kv_cache_events and take_kv_events()
    #: (the optional Scheduler method: the events since the last take,
    #: spec/kv_events.py), opted into as the KV features are
    kv_events: bool = False
    #: the scheduler statistics (spec/stats.py): the class takes a
    #: ``log_stats`` keyword (as vLLM's Scheduler does) and reports them
    #: through the optional ``make_stats()`` after each update
    #: (``schedspec check`` draws it on per workload: check/outputs.py)
    stats: bool = False
    # The engine features (features.ENGINE_FEATURES), opted into as the KV
    # features are:
    #: streaming-input sessions: RequestSpec.resumable and session_update()
    #: (the optional Scheduler method; spec/sessions.py)
    sessions: bool = False
    #: pipeline_parallel_size 2..4: up to that many plans in flight
    #: (schedule() again before the oldest plan's update)
    pipeline: bool = False
    #: model_runner "v2": Model Runner V2's decisions (spec/runner_v2.py)
    runner_v2: bool = False
    #: drafter "draft_model" or "eagle": lookahead slots, EAGLE's hash lookahead
    drafters: bool = False

    def __post_init__(self) -> None:
        if not (self.sync_scheduling or self.async_scheduling):
            raise CapabilityError("Capabilities: a scheduler must support sync or async scheduling")
        if not isinstance(self.policies, frozenset) or not self.policies:
            raise CapabilityError(f"Capabilities.policies must be a non-empty frozenset of Policy, got {self.policies!r}")
        for p in self.policies:
            if not isinstance(p, Policy):
                raise CapabilityError(f"Capabilities.policies holds {p!r}, not a Policy")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in SWITCHES:
                if value is not True and value is not False and value != ALWAYS:
                    raise CapabilityError(f"Capabilities.{f.name} must be True (on or off), False (off) or "
                                          f"{ALWAYS!r} (on), got {value!r}")
            elif f.type == "bool" and not isinstance(value, bool):
                why = ""
                if value == ALWAYS:
                    why = f" ({ALWAYS!r} is taken by {', '.join(SWITCHES)}" + (
                        f": {f.name} is about requests and events, not the config"
                        if f.name in GATE_CAPABILITY_NAMES else "") + ")"
                raise CapabilityError(f"Capabilities.{f.name} must be True or False, got {value!r}{why}")
        if not isinstance(self.min_block_size, int) or self.min_block_size < 1:
            raise CapabilityError(f"Capabilities.min_block_size must be an int >= 1, got {self.min_block_size!r}")

    @property
    def is_full(self) -> bool:
        """True when the declaration restricts nothing the default config space
        draws (a switch declared ALWAYS keeps its off half out)."""
        if self.always():
            return False
        plain = dataclasses.replace(self, async_scheduling=False, speculative_decoding=False, lora=False,
                                    structured_output=False, pause=False, watermark=False,
                                    prefill_cadence=False, encoder=False, kv_connector=False, hybrid_kv=False,
                                    kv_events=False, stats=False, sessions=False, pipeline=False,
                                    runner_v2=False, drafters=False)
        return self == FULL or plain == FULL

    def always(self) -> tuple[str, ...]:
        """The capabilities (SWITCHES) declared ALWAYS, in SWITCHES order."""
        return tuple(name for name in SWITCHES if getattr(self, name) == ALWAYS)

    def gates(self) -> tuple[str, ...]:
        """The admission gates (features.GATES) this declaration supports."""
        return tuple(g for g in GATES if getattr(self, GATE_CAPABILITIES[g]))

    def always_gates(self) -> tuple[str, ...]:
        """The admission gates declared ALWAYS (on in every config), in GATES order."""
        return tuple(g for g in GATES if getattr(self, GATE_CAPABILITIES[g]) == ALWAYS)

    def with_gates(self, gates: Iterable[str] = GATES) -> "Capabilities":
        """This declaration with the admission gates ``gates`` (features.GATES
        names; default all of them) supported too (one declared ALWAYS stays so)."""
        changes: dict[str, Any] = {}
        for g in gates:
            if g not in GATE_CAPABILITIES:
                raise CapabilityError(f"unknown gate {g!r} (choose from {', '.join(GATES)})")
            if not getattr(self, GATE_CAPABILITIES[g]):
                changes[GATE_CAPABILITIES[g]] = True
        return dataclasses.replace(self, **changes)

    def _supported(self, names: tuple[str, ...], capability: Mapping[str, str]) -> tuple[str, ...]:
        """Those of ``names`` whose capability (``capability[name]``) this declaration has."""
        return tuple(k for k in names if getattr(self, capability[k]))

    def _with(self, names: Iterable[str], capability: Mapping[str, str], known: tuple[str, ...],
              what: str) -> "Capabilities":
        """This declaration with the capabilities of ``names`` on; CapabilityError
        naming an unknown ``what``."""
        changes: dict[str, Any] = {}
        for k in names:
            if k not in capability:
                raise CapabilityError(f"unknown {what} {k!r} (choose from {', '.join(known)})")
            changes[capability[k]] = True
        return dataclasses.replace(self, **changes)

    def kv(self) -> tuple[str, ...]:
        """The KV features (features.KV_FEATURES) this declaration supports."""
        return self._supported(KV_FEATURES, KV_CAPABILITIES)

    def with_kv(self, kv: Iterable[str] = KV_FEATURES) -> "Capabilities":
        """This declaration with the KV features ``kv`` (features.KV_FEATURES
        names; default both) supported too."""
        return self._with(kv, KV_CAPABILITIES, KV_FEATURES, "KV feature")

    def engine(self) -> tuple[str, ...]:
        """The engine features (features.ENGINE_FEATURES) this declaration supports."""
        return self._supported(ENGINE_FEATURES, ENGINE_CAPABILITIES)

    def with_engine(self, engine: Iterable[str] = ENGINE_FEATURES) -> "Capabilities":
        """This declaration with the engine features ``engine``
        (features.ENGINE_FEATURES names; default all) supported too."""
        return self._with(engine, ENGINE_CAPABILITIES, ENGINE_FEATURES, "engine feature")

    def drawable_engine(self, engine: Iterable[str]) -> tuple[str, ...]:
        """``engine`` less the engine features this declaration does not
        support, in ENGINE_FEATURES order."""
        wanted = set(engine)
        return tuple(k for k in self.engine() if k in wanted)

    def drawable_modes(self, modes: Iterable[str]) -> tuple[str, ...]:
        """``modes`` (features.MODES) less those this declaration does not
        support (with ``speculative_decoding=ALWAYS``, all but the spec
        modes), in the order given; when none is left, its plainest mode
        (sync, or async for a scheduler that only schedules asynchronously;
        with drafts for one that always has them)."""
        drafts = self.speculative_decoding == ALWAYS
        kept = tuple(m for m in modes
                     if not (m.startswith("async") and not self.async_scheduling)
                     and not (not m.startswith("async") and not self.sync_scheduling)
                     and not (m.endswith("spec") and not self.speculative_decoding)
                     and not (drafts and not m.endswith("spec")))
        plainest = "sync" if self.sync_scheduling else "async"
        return kept or ((("spec" if plainest == "sync" else "async-spec") if drafts else plainest),)

    def drawable_gates(self, gates: Iterable[str]) -> tuple[str, ...]:
        """``gates`` less those this declaration does not support, in GATES
        order. CapabilityError when ``gates`` leaves out a gate declared
        ALWAYS (a run without it would build the scheduler with the gate off)."""
        wanted, have = set(gates), self.gates()
        left_out = [g for g in self.always_gates() if g not in wanted]
        if left_out:
            fields = ", ".join(f"Capabilities.{GATE_CAPABILITIES[g]}={ALWAYS!r}" for g in left_out)
            asked = ", ".join(g for g in GATES if g in wanted) or "none"
            raise CapabilityError(f"{fields}: the gate(s) {', '.join(left_out)} on in every config, but the "
                                  f"gates to draw ({asked}) leave them out")
        return tuple(g for g in GATES if g in wanted and g in have)

    def drawable_kv(self, kv: Iterable[str]) -> tuple[str, ...]:
        """``kv`` less the KV features this declaration does not support, in
        KV_FEATURES order."""
        wanted = set(kv)
        return tuple(k for k in self.kv() if k in wanted)

    def names(self) -> frozenset[str]:
        """The capability names (CAPABILITY_NAMES) this declaration supports."""
        out = {name for name in CAPABILITY_NAMES if getattr(self, name, False) in (True, ALWAYS)}
        out |= {f"policy_{p.name.lower()}" for p in self.policies}
        return frozenset(out)

    def missing(self) -> tuple[str, ...]:
        """The capability names it lacks, sorted."""
        return tuple(sorted(CAPABILITY_NAMES - self.names()))

    def describe(self) -> str:
        missing = self.missing()
        extra = [] if self.min_block_size == 1 else [f"block_size >= {self.min_block_size}"]
        always = self.always()
        if not missing and not extra and not always:
            return "all capabilities"
        text = "without " + ", ".join(list(missing) + extra) if missing else ", ".join(extra)
        if always:
            text += ("; " if text else "") + "always " + ", ".join(always)
        return text

    # ------------------------------------------------------------------ input

    def config_problems(self, config: SchedulerConfig) -> list[str]:
        """What in ``config`` lies outside this declaration (empty: it fits)."""
        out: list[str] = []
        if config.policy not in self.policies:
            out.append(f"policy {config.policy.name}")
        if config.enable_chunked_prefill and not self.chunked_prefill:
            out.append("enable_chunked_prefill=True")
        if not config.enable_chunked_prefill and self.chunked_prefill == ALWAYS:
            out.append("enable_chunked_prefill=False")
        if config.long_prefill_token_threshold > 0 and not self.long_prefill_threshold:
            out.append(f"long_prefill_token_threshold={config.long_prefill_token_threshold}")
        if config.long_prefill_token_threshold <= 0 and self.long_prefill_threshold == ALWAYS:
            out.append("long_prefill_token_threshold=0")
        if config.enable_prefix_caching and not self.prefix_caching:
            out.append("enable_prefix_caching=True")
        if not config.enable_prefix_caching and self.prefix_caching == ALWAYS:
            out.append("enable_prefix_caching=False")
        if config.block_size < self.min_block_size:
            out.append(f"block_size={config.block_size} (< {self.min_block_size})")
        if getattr(config, "async_scheduling", False) and not self.async_scheduling:
            out.append("async_scheduling=True")
        if not getattr(config, "async_scheduling", False) and not self.sync_scheduling:
            out.append("async_scheduling=False")
        if getattr(config, "num_speculative_tokens", 0) and not self.speculative_decoding:
            out.append(f"num_speculative_tokens={getattr(config, 'num_speculative_tokens', 0)}")
        if not getattr(config, "num_speculative_tokens", 0) and self.speculative_decoding == ALWAYS:
            out.append("num_speculative_tokens=0")
        if config.max_loras and not self.lora:
            out.append(f"max_loras={config.max_loras}")
        if not config.max_loras and self.lora == ALWAYS:
            out.append("max_loras=0")
        if config.watermark and not self.watermark:
            out.append(f"watermark={config.watermark}")
        if not config.watermark and self.watermark == ALWAYS:
            out.append(f"watermark={config.watermark}")
        if config.prefill_schedule_interval != 1 and not self.prefill_cadence:
            out.append(f"prefill_schedule_interval={config.prefill_schedule_interval}")
        if config.prefill_schedule_interval == 1 and self.prefill_cadence == ALWAYS:
            out.append("prefill_schedule_interval=1")
        if not self.encoder and (config.max_num_encoder_input_tokens
                                 or config.encoder_cache_size):
            out.append("an encoder budget (max_num_encoder_input_tokens / encoder_cache_size)")
        if self.encoder == ALWAYS and not (config.max_num_encoder_input_tokens or config.encoder_cache_size):
            out.append("no encoder budget (max_num_encoder_input_tokens=0, encoder_cache_size=0)")
        if config.kv_connector and not self.kv_connector:
            out.append("kv_connector=True")
        if config.is_hybrid and not self.hybrid_kv:
            out.append("hybrid kv_cache_groups")
        if config.enable_kv_cache_events and not self.kv_events:
            out.append("enable_kv_cache_events=True")
        if config.pipeline_parallel_size > 1 and not self.pipeline:
            out.append(f"pipeline_parallel_size={config.pipeline_parallel_size}")
        if config.model_runner == "v2" and not self.runner_v2:
            out.append("model_runner='v2'")
        if config.drafter != "ngram" and not self.drafters:
            out.append(f"drafter={config.drafter!r}")
        return out

    def request_problems(self, request: RequestSpec) -> list[str]:
        out: list[str] = []
        if request.cache_salt and not self.salts:
            out.append(f"{request.request_id}: cache_salt")
        if (request.stop_token_ids or request.eos_token_id is not None) and not self.stop_tokens:
            out.append(f"{request.request_id}: stop tokens / eos")
        if request.lora_id and not self.lora:
            out.append(f"{request.request_id}: lora_id")
        if request.structured_output and not self.structured_output:
            out.append(f"{request.request_id}: structured_output")
        if request.mm_inputs and not self.encoder:
            out.append(f"{request.request_id}: mm_inputs")
        if (request.kv_external_tokens or request.kv_load_async or request.kv_save_async) and not self.kv_connector:
            out.append(f"{request.request_id}: kv_external_tokens / kv_load_async / kv_save_async")
        if request.resumable and not self.sessions:
            out.append(f"{request.request_id}: resumable")
        return out

    def workload_problems(self, workload: Workload) -> list[str]:
        """What in a fixed workload (a trace to replay, a hand-written case)
        lies outside this declaration."""
        out = self.config_problems(workload.config)
        for e in workload.events:
            if isinstance(e, AddRequest):
                out.extend(self.request_problems(e.request))
            elif isinstance(e, Abort) and not self.abort:
                out.append(f"abort({e.request_id!r})")
            elif isinstance(e, ResetPrefixCache) and not self.reset_prefix_cache:
                out.append("reset_prefix_cache")
            elif isinstance(e, (Pause, Resume)) and not self.pause:
                out.append("pause / resume (set_pause_state)")
            elif isinstance(e, GrammarReady) and not self.structured_output:
                out.append("grammar_ready")
            elif isinstance(e, KV_EVENTS) and not self.kv_connector:
                out.append("KV connector events (kv_load_done / kv_load_failed / kv_save_done)")
            elif isinstance(e, SessionInput) and not self.sessions:
                out.append("streaming input (session_update)")
        return list(dict.fromkeys(out))

    def restrict_config(self, config: SchedulerConfig) -> SchedulerConfig:
        """The nearest config within this declaration: an unsupported policy
        becomes the first supported one (FCFS first), chunked prefill off (the
        budget raised to max_model_len), the threshold 0, caching off, the
        block size raised to the minimum (the pool grown to hold a request of
        max_model_len), async and speculative decoding off; a switch declared
        ALWAYS turned on (the threshold half the budget; ALWAYS_DRAFTS drafts,
        fewer below a lower threshold, the budget raised to hold one decode
        with them; a gate by gate_requests.with_gates on a generator of fixed
        seed, so the restriction is deterministic). The identity on a config
        that fits."""
        if not self.config_problems(config):
            return config
        changes: dict[str, Any] = {}
        if config.policy not in self.policies:
            changes["policy"] = Policy.FCFS if Policy.FCFS in self.policies else sorted(self.policies, key=lambda p: p.name)[0]
        if config.enable_chunked_prefill and not self.chunked_prefill:
            changes["enable_chunked_prefill"] = False
            changes["max_num_batched_tokens"] = max(config.max_num_batched_tokens, config.max_model_len)
        if not config.enable_chunked_prefill and self.chunked_prefill == ALWAYS:
            changes["enable_chunked_prefill"] = True
        if config.long_prefill_token_threshold > 0 and not self.long_prefill_threshold:
            changes["long_prefill_token_threshold"] = 0
        if config.long_prefill_token_threshold <= 0 and self.long_prefill_threshold == ALWAYS:
            changes["long_prefill_token_threshold"] = max(1, config.max_num_batched_tokens // 2)
        if config.enable_prefix_caching and not self.prefix_caching:
            changes["enable_prefix_caching"] = False
        if not config.enable_prefix_caching and self.prefix_caching == ALWAYS:
            changes["enable_prefix_caching"] = True
        if config.block_size < self.min_block_size:
            bs = self.min_block_size
            changes["block_size"] = bs
            usable = max(-(-config.max_model_len // bs), -(-(config.num_blocks - 1) * config.block_size // bs))
            changes["num_blocks"] = usable + 1
        if getattr(config, "async_scheduling", False) and not self.async_scheduling:
            changes["async_scheduling"] = False
        if not getattr(config, "async_scheduling", False) and not self.sync_scheduling:
            changes["async_scheduling"] = True
        if getattr(config, "num_speculative_tokens", 0) and not self.speculative_decoding:
            changes["num_speculative_tokens"] = 0
        if not getattr(config, "num_speculative_tokens", 0) and self.speculative_decoding == ALWAYS:
            changes.update(_with_drafts(config, changes))
        if config.max_loras and not self.lora:
            changes["max_loras"] = 0
        if config.watermark and not self.watermark:
            changes["watermark"] = 0.0
        if config.prefill_schedule_interval != 1 and not self.prefill_cadence:
            changes["prefill_schedule_interval"] = 1
        if not self.encoder and (config.max_num_encoder_input_tokens
                                 or config.encoder_cache_size):
            changes["max_num_encoder_input_tokens"] = 0
            changes["encoder_cache_size"] = 0
        if config.kv_connector and not self.kv_connector:
            changes["kv_connector"] = False
            changes["kv_load_failure_policy"] = "fail"
        if config.is_hybrid and not self.hybrid_kv:
            changes["kv_cache_groups"] = ()
        if config.enable_kv_cache_events and not self.kv_events:
            changes["enable_kv_cache_events"] = False
        if config.pipeline_parallel_size > 1 and not self.pipeline:
            changes["pipeline_parallel_size"] = 1
        if config.model_runner == "v2" and not self.runner_v2:
            changes["model_runner"] = "v1"
        if config.drafter != "ngram" and not self.drafters:
            changes["drafter"] = "ngram"
        try:
            out = dataclasses.replace(config, **changes)
        except SchedSpecError:
            if not config.is_hybrid:
                raise
            # a layout the restricted config cannot take (a Mamba group needs
            # prefix caching and chunked prefill, and no drafts): the plain one
            changes.update(kv_cache_groups=(), hash_block_size=0)
            out = dataclasses.replace(config, **changes)
        off = [g for g in self.always_gates() if g not in gates_of(out)]
        if off:
            out = with_gates(out, off, random.Random("schedspec-always-gates"))
            still = [g for g in off if g not in gates_of(out)]
            if still:
                raise CapabilityError(f"Capabilities.{GATE_CAPABILITIES[still[0]]}={ALWAYS!r}: the gate "
                                      f"{still[0]} cannot be turned on in {out!r}")
        return out

    def restrict_request(self, request: RequestSpec) -> RequestSpec:
        changes: dict[str, Any] = {}
        if request.cache_salt and not self.salts:
            changes["cache_salt"] = None
        if (request.stop_token_ids or request.eos_token_id is not None) and not self.stop_tokens:
            changes["stop_token_ids"] = ()
            changes["eos_token_id"] = None
        if request.lora_id and not self.lora:
            changes["lora_id"] = 0
        if request.structured_output and not self.structured_output:
            changes["structured_output"] = False
            changes["grammar_rejects"] = ()
        if request.mm_inputs and not self.encoder:
            changes["mm_inputs"] = ()
        if (request.kv_external_tokens or request.kv_load_async or request.kv_save_async) and not self.kv_connector:
            changes["kv_external_tokens"] = 0
            changes["kv_load_async"] = False
            changes["kv_save_async"] = False
        if request.resumable and not self.sessions:
            changes["resumable"] = False
        return dataclasses.replace(request, **changes) if changes else request

    def restrict_events(self, events: Iterable[Event]) -> tuple[Event, ...]:
        out: list[Event] = []
        for e in events:
            if isinstance(e, AddRequest):
                r = self.restrict_request(e.request)
                out.append(e if r is e.request else AddRequest(r))
            elif isinstance(e, Abort) and not self.abort:
                continue
            elif isinstance(e, ResetPrefixCache) and not self.reset_prefix_cache:
                continue
            elif isinstance(e, (Pause, Resume)) and not self.pause:
                continue
            elif isinstance(e, GrammarReady) and not self.structured_output:
                continue
            elif isinstance(e, KV_EVENTS) and not self.kv_connector:
                continue
            elif isinstance(e, SessionInput) and not self.sessions:
                continue
            else:
                out.append(e)
        return tuple(out)

    def restrict_workload(self, workload: Workload) -> Workload:
        """The workload within this declaration (the identity on one that fits)."""
        features = features_within(self, workload.features)
        if not self.workload_problems(workload):
            return workload if features == workload.features else dataclasses.replace(workload, features=features)
        config = self.restrict_config(workload.config)
        events = self.restrict_events(workload.events)
        if config.max_concurrent_batches != workload.config.max_concurrent_batches:
            # schedule/update events of an async workload, within the sync protocol
            events = tuple(keep_protocol(events, config.async_scheduling, config.max_concurrent_batches))
        # the draws a documented vLLM defect rules out under the new config
        # (a failed synchronous load once async scheduling is on)
        events = steer(events, config)
        return dataclasses.replace(workload, config=config, events=events, features=features)

    # ------------------------------------------------------------- invariants

    def split(self, invariants: Iterable[Invariant]) -> tuple[tuple[Invariant, ...], tuple[tuple[str, str], ...]]:
        """The invariants whose premise it supports, and the others as
        ``(id, "needs <capability>")``."""
        have = self.names()
        kept: list[Invariant] = []
        skipped: list[tuple[str, str]] = []
        for inv in invariants:
            lacking = sorted(inv.requires - have)
            if lacking:
                skipped.append((inv.id, "needs " + ", ".join(lacking)))
            else:
                kept.append(inv)
        return tuple(kept), tuple(skipped)

    # --------------------------------------------------------------- records

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["policies"] = sorted(p.name for p in self.policies)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Capabilities":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise CapabilityError(f"unknown capabilities {sorted(unknown)}; known: {sorted(fields)}")
        kw = dict(d)
        if "policies" in kw:
            try:
                kw["policies"] = frozenset(Policy[name] for name in kw["policies"])
            except KeyError as exc:
                raise CapabilityError(f"unknown policy {exc.args[0]!r} in capabilities") from None
        return cls(**kw)


def _with_drafts(config: SchedulerConfig, changes: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that give ``config`` (with ``changes``) drafts: k =
    ALWAYS_DRAFTS, below a long-prefill threshold (one of 1 raised to 2, as
    a padded decode of 1 + k tokens must not be cut), the budget raised to
    hold one such decode."""
    budget = changes.get("max_num_batched_tokens", config.max_num_batched_tokens)
    threshold = changes.get("long_prefill_token_threshold", config.long_prefill_token_threshold)
    k = ALWAYS_DRAFTS
    out: dict[str, Any] = {}
    if threshold > 0:
        k = min(k, max(1, threshold - 1))
        if threshold <= k:
            out["long_prefill_token_threshold"] = k + 1
    out["num_speculative_tokens"] = k
    out["max_num_batched_tokens"] = max(budget, 1 + k)
    return out


#: Everything the spec supports in its default (sync, no speculative decoding,
#: no admission gate) form.
FULL = Capabilities()


Need = Callable[[Capabilities], bool]
_CHUNKS: Need = lambda c: bool(c.chunked_prefill or c.long_prefill_threshold)  # noqa: E731
_CACHE: Need = lambda c: bool(c.prefix_caching)  # noqa: E731

#: The spec's rules (spec/rule_names.py) a declaration can put out of reach,
#: with what the run must be able to draw for each.
RULE_NEEDS: Mapping[str, Need] = {
    "schedule.threshold_active": lambda c: bool(c.long_prefill_threshold),
    "running.prefill_chunk": _CHUNKS,
    "update.no_token": _CHUNKS,
    "admit.prefill_chunk": lambda c: bool(c.chunked_prefill),
    "admit.blocked_chunking_off": lambda c: c.chunked_prefill != ALWAYS,
    "running.self_preempted_break": lambda c: Policy.FCFS in c.policies,
    "preempt.fcfs_tail": lambda c: Policy.FCFS in c.policies,
    "running.self_preempted_continue": lambda c: Policy.PRIORITY in c.policies,
    "preempt.priority_victim": lambda c: Policy.PRIORITY in c.policies,
    "preempt.victim_ahead": lambda c: Policy.PRIORITY in c.policies,
    "preempt.reset_running": lambda c: c.reset_prefix_cache,
    "kv.reset_ok": lambda c: c.reset_prefix_cache,
    "kv.reset_refused": lambda c: c.reset_prefix_cache,
    **{name: _CACHE for name in ("kv.miss", "kv.hit_partial", "kv.hit_full", "kv.hit_capped", "kv.touch_free",
                                 "kv.touch_shared", "kv.evict_cached", "kv.evict_keeps_duplicate",
                                 "kv.cache_duplicate_key", "kv.free_back")},
    "stop.eos": lambda c: c.stop_tokens,
    "stop.stop_token": lambda c: c.stop_tokens,
    "abort.waiting": lambda c: c.abort,
    "abort.preempted": lambda c: c.abort,
    "abort.running": lambda c: c.abort,
    "update.request_gone": lambda c: c.abort,
}

#: The guided generator's switches (check/coverage_guided.FEATURES) a
#: declaration can take away, with what each needs.
FEATURE_NEEDS: Mapping[str, Need] = {
    "priority": lambda c: Policy.PRIORITY in c.policies,
    "rising_priority": lambda c: Policy.PRIORITY in c.policies,
    "no_chunking": lambda c: c.chunked_prefill != ALWAYS,
    "no_caching": lambda c: c.prefix_caching != ALWAYS,
    "threshold": lambda c: bool(c.long_prefill_threshold),
    "salts": lambda c: c.salts,
    "stops": lambda c: c.stop_tokens,
    "eos": lambda c: c.stop_tokens,
    "aborts": lambda c: c.abort,
    "resets": lambda c: c.reset_prefix_cache,
    "reset_running": lambda c: c.reset_prefix_cache,
}


def rules_within(capabilities: Capabilities, names: Iterable[str]) -> tuple[str, ...]:
    """``names`` (rules, in order) less those the declaration puts out of reach (RULE_NEEDS)."""
    return tuple(n for n in names if n not in RULE_NEEDS or RULE_NEEDS[n](capabilities))


def features_within(capabilities: Capabilities, features: Iterable[str]) -> tuple[str, ...]:
    """A workload's features less those the declaration took away (FEATURE_NEEDS)."""
    return tuple(f for f in features if f not in FEATURE_NEEDS or FEATURE_NEEDS[f](capabilities))



def capabilities_of(obj: object) -> Capabilities:
    """The ``CAPABILITIES`` a scheduler class (or instance, or a factory that
    carries one) declares; FULL when it declares none."""
    caps = getattr(obj, "CAPABILITIES", None)
    if caps is None:
        return FULL
    if not isinstance(caps, Capabilities):
        raise CapabilityError(
            f"{getattr(obj, '__qualname__', type(obj).__name__)}.CAPABILITIES is a {type(caps).__name__}, "
            "not a schedspec.check.capabilities.Capabilities"
        )
    return caps
