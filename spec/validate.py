"""Input validation of the interface's values: what makes a SchedulerConfig
or a RequestSpec acceptable, and the typed error naming the field when it is
not. SchedulerConfig and RequestSpec (spec/interface.py) call these from
``__post_init__``, so an invalid value is never built and never reaches a
scheduler.

What one field accepts is declared with the field: its type annotation and
its ``Declaration`` (``field(default=16, metadata=declare(minimum=1))``).
The checks here read both through ``declared``, and so do the trace's JSON
Schema (schedspec/check/trace_schema.py), the trace's versions and the
Hypothesis strategies; what is written here by hand is the rules between
fields and the messages.

The checks read the fields by name; this module imports only the errors, so
the interface can depend on it and not the other way round.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, cast

from schedspec.spec.errors import ConfigError, RequestError
from schedspec.spec.kv_kinds import KINDS, GroupFields


@dataclass(frozen=True)
class Declaration:
    """What a field declares beyond its type, in its dataclass field's
    metadata (``field(default=16, metadata=declare(minimum=1))``).

    A number lies in ``minimum`` .. ``maximum`` (``below``: an exclusive
    maximum); ``why`` follows a lower bound that needs saying (``must be at
    least 2 (block 0 is the reserved null block)``), and ``range_text``, with
    the bounds in braces, says the whole range at once where a field's
    message does (``between {minimum} (off) and {maximum}``). A string is
    one of ``choices``, or at least ``min_length`` long; a tuple holds
    ``min_items`` to ``max_items`` items (a tuple of token ids: each >= 0).
    ``since``: the trace format version that brought the field; a field
    since version 2 or later is written by ``to_dict`` only when it differs
    from its default, so a default value serializes as it always did, and a
    trace of an earlier version may not name it."""

    minimum: int | float | None = None
    maximum: int | None = None
    below: float | None = None
    why: str = ""
    range_text: str = ""
    choices: tuple[str, ...] = ()
    min_length: int = 0
    min_items: int = 0
    max_items: int | None = None
    since: int = 1
    #: (choice, version): a choice a later trace format version brought
    choices_since: tuple[tuple[str, int], ...] = ()


_UNDECLARED = Declaration()


def declare(**kw: Any) -> Mapping[str, Declaration]:
    """The metadata that declares a field:
    ``field(default=16, metadata=declare(minimum=1, maximum=1 << 16))``."""
    return {"declaration": Declaration(**kw)}


def declaration_of(f: dataclasses.Field[Any]) -> Declaration:
    """What field ``f`` declares (nothing: ``Declaration()``)."""
    found = f.metadata.get("declaration", _UNDECLARED)
    assert isinstance(found, Declaration)
    return found


_DECLARED: dict[type, tuple[tuple[str, Any, Declaration], ...]] = {}


def declared(cls: type) -> tuple[tuple[str, Any, Declaration], ...]:
    """Every field of dataclass ``cls`` in declaration order: its name, its
    type (the annotation resolved) and its Declaration."""
    if cls not in _DECLARED:
        hints = typing.get_type_hints(cls)
        _DECLARED[cls] = tuple((f.name, hints[f.name], declaration_of(f)) for f in dataclasses.fields(cls))
    return _DECLARED[cls]


class ConfigFields(Protocol):
    """The fields of a SchedulerConfig as the checks read them."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def long_prefill_token_threshold(self) -> int: ...

    @property
    def enable_chunked_prefill(self) -> bool: ...

    @property
    def enable_prefix_caching(self) -> bool: ...

    @property
    def scheduler_reserve_full_isl(self) -> bool: ...

    @property
    def policy(self) -> object: ...

    @property
    def async_scheduling(self) -> bool: ...

    @property
    def num_speculative_tokens(self) -> int: ...

    @property
    def max_loras(self) -> int: ...

    @property
    def watermark(self) -> float: ...

    @property
    def prefill_schedule_interval(self) -> int: ...

    @property
    def max_num_encoder_input_tokens(self) -> int: ...

    @property
    def encoder_cache_size(self) -> int: ...

    @property
    def kv_connector(self) -> bool: ...

    @property
    def kv_load_failure_policy(self) -> str: ...

    @property
    def kv_cache_groups(self) -> tuple[object, ...]: ...

    @property
    def pipeline_parallel_size(self) -> int: ...


class RequestFields(Protocol):
    """The fields of a RequestSpec as the checks read them."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...

    @property
    def max_tokens(self) -> int: ...

    @property
    def priority(self) -> int: ...

    @property
    def arrival(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def ignore_eos(self) -> bool: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def lora_id(self) -> int: ...

    @property
    def structured_output(self) -> bool: ...

    @property
    def grammar_rejects(self) -> tuple[int, ...]: ...

    @property
    def mm_inputs(self) -> tuple[object, ...]: ...

    @property
    def kv_external_tokens(self) -> int: ...

    @property
    def kv_load_async(self) -> bool: ...

    @property
    def kv_save_async(self) -> bool: ...


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


#: The most draft tokens per step the spec models (0 = speculative decoding off).
MAX_SPECULATIVE_TOKENS = 8


#: The most KV cache groups a modelled layout has.
MAX_KV_CACHE_GROUPS = 4

#: The attention kinds a KV cache group may have (spec/interface.py re-exports
#: it): the registry of spec/kv_kinds.py (vllm/v1/kv_cache_interface.py,
#: FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec).
KV_GROUP_KINDS = tuple(KINDS)

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")

#: vLLM's model runners (VllmConfig.use_v2_model_runner): "v1" or Model Runner V2
MODEL_RUNNERS = ("v1", "v2")
#: The drafters modelled (vLLM's SpeculativeConfig.method): "ngram" proposes
#: from the prompt and reserves no KV slots; "draft_model" runs a forward pass
#: of its own and reserves num_speculative_tokens lookahead slots
#: (vllm/config/vllm.py, VllmConfig.num_lookahead_tokens); "eagle" (vLLM's
#: EAGLE family, SpeculativeConfig.use_eagle) reserves them too, takes no
#: draft slot, reads one prefill token ahead and hashes blocks with it.
DRAFTERS = ("ngram", "draft_model", "eagle")

#: A request's KV cache report modes (vllm/v1/request.py, Request.__init__:
#: SamplingParams.extra_args["kv_cache_report_mode"]; vLLM reads any value
#: but "full" as "incremental", the spec accepts only the two)
KV_CACHE_REPORT_MODES = ("incremental", "full")


def validate_config(config: ConfigFields, policy_type: type, group_type: type | None = None) -> None:
    """Raise ConfigError for the first invalid field of ``config``: first the
    type of each field (``policy`` must be a ``policy_type``), then each
    field's own range, then the relations between fields. ``group_type`` is
    the type every ``kv_cache_groups`` item must have."""
    _check_config_types(config, policy_type)
    _check_config_ranges(config)
    _check_config_relations(config)
    _check_kv_fields(config, group_type)
    _check_state_groups(config)
    _check_pipeline(config)
    _check_groups_fit(config)
    _check_model_runner(config)
    _check_drafter(config)
    _check_hash_block_size(config)


def _check_hash_block_size(config: ConfigFields) -> None:
    """The hash block size (vLLM's CacheConfig.prefix_match_unit), as
    vllm/v1/core/kv_cache_utils.py, resolve_kv_cache_block_sizes, resolves
    it: ignored while neither prefix caching nor a KV connector reads block
    hashes; with one group it must be the block size ("with a single KV
    cache group, prefix-cache hits land on the block size"); with several,
    every cacheable group's block size must be a multiple of it (also
    HybridKVCacheCoordinator.__init__'s assertion). A hash block size below
    the block size makes FullAttentionManager.cache_blocks register
    partial-block entries (_cache_partial_tail_block,
    BlockPool.cache_partial_block: spec/kv_cache.py, cache_partial_tail);
    modelled without a Mamba group (with one in "align" mode vLLM turns on
    fine-grained partial hits and their copy-on-write: partial_hash_hits_enabled)
    and without a KV connector (whose block hashes would be the finer ones),
    both still refused."""
    hb = getattr(config, "hash_block_size", 0)
    if not hb or not (config.enable_prefix_caching or config.kv_connector):
        return
    sizes = [getattr(g, "block_size", 0) or config.block_size for g in config.kv_cache_groups]
    if len(config.kv_cache_groups) <= 1 and hb != config.block_size:
        raise ConfigError("hash_block_size", f"({hb}) must be 0 or block_size ({config.block_size}) with one KV "
                          "cache group: vLLM's prefix-cache hits land on the block size")
    bad = [bs for bs in sizes if bs % hb]
    if bad:
        raise ConfigError("hash_block_size", f"({hb}) must divide every KV cache group's block size, got block "
                          f"size {bad[0]}: vLLM refuses a prefix_match_unit that does not")
    if hb != config.block_size and (config.kv_connector or any(KINDS[cast(GroupFields, g).kind].keeps_state for g in config.kv_cache_groups)):
        raise ConfigError("hash_block_size", f"({hb}) below the block size ({config.block_size}) with a "
                          f"{'KV connector' if config.kv_connector else 'Mamba group'}: fine-grained partial "
                          "prefix-cache hits and their copy-on-write are not modelled")
    if hb != config.block_size and getattr(config, "drafter", "ngram") == "eagle" and config.num_speculative_tokens:
        # _cache_partial_tail_block: with EAGLE the partial boundary may reach
        # the whole prompt (token_limit = num_prompt_tokens) and its keys the
        # lookahead token: not modelled
        raise ConfigError("hash_block_size", f"({hb}) below the block size ({config.block_size}) with the EAGLE "
                          "drafter: EAGLE's partial-block entries are not modelled")


def _check_drafter(config: ConfigFields) -> None:
    """The drafter is one of DRAFTERS. EAGLE's parts the spec does not model
    are refused: with a KV connector vLLM keeps the legacy block hashes and
    drops the trailing hit block instead (VllmConfig.num_hash_lookahead_tokens;
    FullAttentionManager.find_longest_cache_hit with use_eagle). (A Mamba
    group, whose checkpoints EAGLE moves, already refuses drafts.)"""
    drafter = getattr(config, "drafter", "ngram")
    if not isinstance(drafter, str) or drafter not in DRAFTERS:
        raise ConfigError("drafter", f"must be one of {', '.join(map(repr, DRAFTERS))}, got {drafter!r}")
    if drafter != "eagle" or not config.num_speculative_tokens:
        return
    if config.kv_connector:
        raise ConfigError("drafter", "\"eagle\" with a KV connector (the trailing-block drop) is not modelled")


def _check_model_runner(config: ConfigFields) -> None:
    """What vLLM refuses of the model runner choice (vllm/config/vllm.py,
    VllmConfig._get_v1_model_runner_unsupported_features, raised by
    _validate_v1_model_runner): the V1 runner with pipeline parallelism and
    async scheduling ("MRV1 + PP>1 + async sched ... does not work")."""
    runner = getattr(config, "model_runner", "v1")
    if not isinstance(runner, str) or runner not in MODEL_RUNNERS:
        raise ConfigError("model_runner", f"must be one of {', '.join(map(repr, MODEL_RUNNERS))}, got {runner!r}")
    pp = getattr(config, "pipeline_parallel_size", 1)
    if getattr(config, "model_runner", "v1") == "v1" and pp > 1 and config.async_scheduling:
        raise ConfigError("pipeline_parallel_size", f"({pp}) > 1 with async_scheduling needs model_runner \"v2\": "
                          "vLLM's V1 model runner refuses pipeline parallelism with async scheduling")


# -- pipeline parallelism: k plans in flight ---------------------------------


def max_concurrent_batches(config: ConfigFields) -> int:
    """k, the batches (plans) the engine keeps in flight through its batch
    queue (vllm/config/vllm.py, VllmConfig.max_concurrent_batches, which
    vllm/v1/engine/core.py, EngineCore.__init__ takes as batch_queue_size):
    one per pipeline stage; with async scheduling one more under Model
    Runner V2, and two under the V1 runner, which runs async scheduling only
    without pipeline parallelism (_check_model_runner). schedule() is called
    while up to k - 1 plans are in flight (spec/protocol.py, max_in_flight)."""
    pp = config.pipeline_parallel_size
    if config.async_scheduling:
        return pp + 1 if getattr(config, "model_runner", "v1") == "v2" else 2
    return pp


def _check_pipeline(config: ConfigFields) -> None:
    """What a pipeline refuses beside the model runner's refusal of async
    scheduling with pipeline parallelism under V1 (_check_model_runner)."""
    # Not modelled: drafts of a synchronous pipeline. The engine hands them
    # over after each batch (EngineCore.post_step, update_draft_token_ids),
    # which then reads is_prefill_chunk as the newest schedule left it and
    # sets them on a request whose next step is already in flight (or that
    # was preempted since), so the next schedule verifies drafts at a
    # position whose token is still in flight.
    if config.num_speculative_tokens and config.pipeline_parallel_size > 1 and not config.async_scheduling:
        raise ConfigError(
            "num_speculative_tokens",
            "must be 0 with pipeline_parallel_size > 1 without async scheduling (the drafts of a synchronous "
            "pipeline are not modelled)",
        )


def _check_state_groups(config: ConfigFields) -> None:
    """A Mamba group (spec/mamba.py) in the modelled "align" mode: what vLLM
    refuses, and what the spec does not model, each naming the field.
    vllm/model_executor/models/config.py, MambaModelConfig.verify_and_update_config:
    prefix caching sets mamba_cache_mode "align" and the Mamba block size to
    the block size, and asserts "Chunked prefill is required for Mamba prefix
    caching"; without prefix caching a Mamba block is max_model_len tokens
    (mode "none"), a block size the modelled layouts do not have. Drafts
    (speculative blocks) and a KV connector (boundary-state offloads) are
    not modelled with a Mamba group."""
    for i, g in enumerate(config.kv_cache_groups):
        kind = KINDS.get(getattr(g, "kind", ""))
        if kind is None or not kind.keeps_state:
            continue
        where = f"kv_cache_groups[{i}].kind"
        if not config.enable_prefix_caching:
            raise ConfigError(where, "a mamba group needs enable_prefix_caching (vLLM's \"align\" mode); without it "
                              "vLLM gives the group one block of max_model_len tokens, which is not modelled")
        if not config.enable_chunked_prefill:
            raise ConfigError("enable_chunked_prefill", "must be on with a mamba group: vLLM asserts "
                              "\"Chunked prefill is required for Mamba prefix caching\"")
        if config.num_speculative_tokens:
            raise ConfigError("num_speculative_tokens", "must be 0 with a mamba group (speculative state blocks "
                              "are not modelled)")
        if config.kv_connector:
            raise ConfigError("kv_connector", "must be off with a mamba group (Mamba boundary-state offloads "
                              "are not modelled)")


def _check_groups_fit(config: ConfigFields) -> None:
    """vllm/v1/core/kv_cache_planning.py, check_enough_kv_cache_memory with
    max_memory_usage_bytes summed over the layers (one per group): the engine
    refuses to start unless one request of max_model_len tokens fits in every
    KV cache group at once, all drawing from the one pool. A full-attention
    group holds cdiv(max_model_len, block_size) blocks of it, a
    sliding-window group its admission cap (vllm/v1/kv_cache_interface.py,
    SlidingWindowSpec.max_admission_blocks_per_request: the window's W - 1
    tokens and every token in flight, one batch per plan in flight
    (max_concurrent_batches), at most max_model_len, one block more). The plain layout is
    the check of _check_config_relations."""
    if not config.kv_cache_groups:
        return
    bs, mml = config.block_size, config.max_model_len
    in_flight = max_concurrent_batches(config) * config.max_num_batched_tokens  # max_in_flight_tokens
    need = []
    for g in config.kv_cache_groups:
        # the group kind's max_admission_blocks_per_request (spec/kv_kinds.py);
        # a kind with no cap (full attention) holds the whole sequence
        group = cast(GroupFields, g)  # validated by _check_kv_fields
        kind = KINDS[group.kind]
        cap = kind.admission_cap(group, bs, in_flight, mml)
        if kind.keeps_state:
            # MambaSpec.max_memory_usage_bytes in "align" mode: two state
            # pages (no speculative or prefill-checkpoint blocks)
            cap = 2
        need.append(-(-mml // bs) if cap is None else cap)
    if sum(need) > config.num_blocks - 1:
        raise ConfigError(
            "num_blocks",
            f"the pool ({config.num_blocks - 1} usable blocks) cannot hold one request of max_model_len "
            f"({config.max_model_len}) tokens in every KV cache group: it needs {sum(need)} "
            f"({' + '.join(str(n) for n in need)}, one term per group)",
        )


def _check_kv_fields(config: ConfigFields, group_type: type | None) -> None:
    """The KV connector's and the KV cache groups' fields."""
    if config.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
        raise ConfigError(
            "kv_load_failure_policy",
            f"must be one of {', '.join(repr(p) for p in KV_LOAD_FAILURE_POLICIES)}, "
            f"got {config.kv_load_failure_policy!r}",
        )
    groups = config.kv_cache_groups
    if not isinstance(groups, tuple):
        raise ConfigError("kv_cache_groups", f"must be a tuple of KVCacheGroup, got {type(groups).__name__}")
    if len(groups) > MAX_KV_CACHE_GROUPS:
        raise ConfigError("kv_cache_groups", f"{len(groups)} groups is beyond the supported maximum {MAX_KV_CACHE_GROUPS}")
    for i, g in enumerate(groups):
        _check_group(config, f"kv_cache_groups[{i}]", g, group_type)


def _check_group(config: ConfigFields, name: str, g: object, group_type: type | None) -> None:
    """One KV cache group's fields (vllm/v1/kv_cache_interface.py, its
    KVCacheSpec), ``name`` the field path for the error."""
    if group_type is not None and not isinstance(g, group_type):
        raise ConfigError(name, f"must be a KVCacheGroup, got {type(g).__name__}")
    kind = getattr(g, "kind", None)
    window = getattr(g, "sliding_window", None)
    bs = getattr(g, "block_size", None)
    chunk = getattr(g, "attention_chunk_size", 0)
    if kind not in KV_GROUP_KINDS:
        raise ConfigError(
            f"{name}.kind", f"must be one of {', '.join(repr(k) for k in KV_GROUP_KINDS)}, got {kind!r}"
        )
    if not is_int(window) or not is_int(bs) or not is_int(chunk):
        raise ConfigError(
            name,
            f"sliding_window, attention_chunk_size and block_size must be integers, got {window!r}, {chunk!r}, {bs!r}",
        )
    assert isinstance(window, int) and isinstance(bs, int) and isinstance(chunk, int)
    # the kind's own fields and their ranges, every other kind's fields 0
    # (spec/kv_kinds.py, GroupKind.validate)
    KINDS[kind].validate(cast(GroupFields, g), config.block_size, name)
    _check_group_block_size(config, name, bs)


def _check_group_block_size(config: ConfigFields, name: str, bs: int) -> None:
    """A group's own block size: 0 (the config's), else what the modelled
    layouts and vLLM's hybrid coordinator accept."""
    # HybridKVCacheCoordinator.__init__: every cacheable group's block
    # size is a multiple of the hash block size (the config's block_size).
    if bs < 0 or (bs and bs % config.block_size):
        raise ConfigError(
            f"{name}.block_size",
            f"({bs}) must be a multiple of the hash block size block_size ({config.block_size}), "
            "as vLLM's hybrid coordinator requires",
        )
    if bs and bs != config.block_size:
        raise ConfigError(
            f"{name}.block_size",
            f"({bs}) differs from block_size ({config.block_size}): the modelled layouts "
            "give every group the config's block size (0 = the config's)",
        )


def _check_config_types(config: ConfigFields, policy_type: type) -> None:
    fields = declared(type(config))
    for name, kind, _ in fields:
        if kind is int and not is_int(getattr(config, name)):
            raise ConfigError(name, f"must be an integer, got {getattr(config, name)!r}")
    for name, kind, _ in fields:
        if kind is bool and not isinstance(getattr(config, name), bool):
            raise ConfigError(name, f"must be a boolean, got {getattr(config, name)!r}")
    if not isinstance(config.policy, policy_type):
        raise ConfigError("policy", f"must be a Policy, got {config.policy!r}")
    for name, kind, _ in fields:
        value = getattr(config, name)
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(name, f"must be a number, got {value!r}")


def _check_config_ranges(config: ConfigFields) -> None:
    """Each number within its declared bounds: first the positive ones, then
    the maxima, the lower bounds with a ``why``, the non-negative ones, the
    fractions, and last the ranges said at once (``range_text``)."""
    fields = declared(type(config))
    ints = [(name, b, getattr(config, name)) for name, kind, b in fields if kind is int]
    said_at_once = [(name, b, v) for name, b, v in ints if b.range_text]
    ints = [(name, b, v) for name, b, v in ints if not b.range_text]
    for name, b, v in ints:
        if b.minimum == 1 and v < 1:
            raise ConfigError(name, f"must be positive, got {v}")
    for name, b, v in ints:
        if b.maximum is not None and v > b.maximum:
            raise ConfigError(name, f"{v} is beyond the supported maximum {b.maximum}")
    for name, b, v in ints:
        if b.why and b.minimum is not None and v < b.minimum:
            raise ConfigError(name, f"must be at least {b.minimum} ({b.why}), got {v}")
    for name, b, v in ints:
        if b.minimum == 0 and v < 0:
            raise ConfigError(name, f"must be >= 0, got {v}")
    for name, kind, b in fields:
        value = getattr(config, name)
        # vllm/config/scheduler.py, SchedulerConfig.watermark: a fraction of
        # the pool in [0, 1).
        if kind is float and b.minimum is not None and b.below is not None and not b.minimum <= value < b.below:
            raise ConfigError(name, f"must be in [{b.minimum:g}, {b.below:g}), got {value!r}")
    for name, b, v in said_at_once:
        if b.minimum is not None and b.maximum is not None and not b.minimum <= v <= b.maximum:
            raise ConfigError(name, f"must be {b.range_text.format(minimum=b.minimum, maximum=b.maximum)}, got {v}")


def _check_config_relations(config: ConfigFields) -> None:
    # vllm/config/scheduler.py, SchedulerConfig.verify_max_model_len
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
        raise ConfigError(
            "max_num_batched_tokens",
            f"({config.max_num_batched_tokens}) is smaller than max_model_len "
            f"({config.max_model_len}) with chunked prefill disabled: longer prompts "
            "could never be scheduled",
        )
    if config.max_num_batched_tokens < config.max_num_seqs:
        raise ConfigError(
            "max_num_batched_tokens",
            f"({config.max_num_batched_tokens}) must be >= max_num_seqs ({config.max_num_seqs})",
        )
    if config.long_prefill_token_threshold > config.max_model_len:
        raise ConfigError(
            "long_prefill_token_threshold",
            f"({config.long_prefill_token_threshold}) cannot exceed max_model_len "
            f"({config.max_model_len})",
        )
    # scheduler.py, schedule(), the WAITING loop: a newly admitted decode is
    # padded to 1 + k tokens, the long-prefill threshold may then cut it, and
    # vLLM asserts ``num_new_tokens == 1 + self.num_spec_tokens``. A threshold
    # at or below k would crash vLLM's scheduler, so it is refused here.
    k = config.num_speculative_tokens
    if k > 0 and 0 < config.long_prefill_token_threshold <= k:
        raise ConfigError(
            "long_prefill_token_threshold",
            f"({config.long_prefill_token_threshold}) must be 0 or above "
            f"num_speculative_tokens ({k}): a padded decode of 1 + {k} tokens must not be cut",
        )
    # scheduler.py, schedule(), the WAITING loop: a padded decode of 1 + k
    # tokens that does not fit the budget stops the loop ("Prefer to not
    # schedule than schedule un-padded"). With a whole budget below 1 + k a
    # request whose prompt is cached up to its last token would block the
    # head of the waiting queue for ever, so such a budget is refused.
    # A draft model's slot counts too (min(token_budget, input_budget -
    # draft_slots)): vLLM accepts 1 + k and then never admits such a head.
    slots = 1 if k > 0 and getattr(config, "drafter", "ngram") == "draft_model" else 0
    if k > 0 and config.max_num_batched_tokens < 1 + k + slots:
        raise ConfigError(
            "max_num_batched_tokens",
            f"({config.max_num_batched_tokens}) must hold one decode with its drafts: "
            f"1 + num_speculative_tokens = {1 + k}" + (" and the draft model's slot" if slots else ""),
        )
    _check_gate_relations(config)
    # vllm/v1/core/kv_cache_planning.py, check_enough_kv_cache_memory: the engine
    # refuses to start unless one request of max_model_len tokens fits.
    # (A hybrid layout's groups are checked together: _check_groups_fit.)
    usable_tokens = (config.num_blocks - 1) * config.block_size
    if usable_tokens < config.max_model_len and not config.kv_cache_groups:
        raise ConfigError(
            "num_blocks",
            f"the pool ({config.num_blocks - 1} usable blocks x {config.block_size} tokens = "
            f"{usable_tokens}) cannot hold one request of max_model_len "
            f"({config.max_model_len}) tokens",
        )


def _check_gate_relations(config: ConfigFields) -> None:
    # The encoder's budget and cache come together (vllm/multimodal/budget.py,
    # MultiModalBudget: a model without a multimodal encoder has neither).
    if (config.max_num_encoder_input_tokens > 0) != (config.encoder_cache_size > 0):
        raise ConfigError(
            "encoder_cache_size",
            f"({config.encoder_cache_size}) and max_num_encoder_input_tokens "
            f"({config.max_num_encoder_input_tokens}) must be both 0 (no encoder) or both positive",
        )
    # vllm/v1/core/kv_cache_manager.py, KVCacheManager.__init__ and
    # allocate_slots: with watermark_blocks at or above the usable pool no
    # waiting request could ever be admitted.
    watermark_blocks = int(config.watermark * config.num_blocks)
    if watermark_blocks >= config.num_blocks - 1:
        raise ConfigError(
            "watermark",
            f"({config.watermark}) keeps {watermark_blocks} blocks free, at least the "
            f"{config.num_blocks - 1} usable blocks: nothing could be admitted",
        )


def _check_token_ids(rid: str, name: str, tokens: tuple[int, ...]) -> None:
    for i, tok in enumerate(tokens):
        if not is_int(tok) or tok < 0:
            raise RequestError(rid, f"{name}[{i}]", f"must be a non-negative integer, got {tok!r}")


def validate_request(request: RequestFields) -> None:
    """Raise RequestError for the first invalid field of ``request``, in field
    order: each field's declared type and bounds, then the rules that field
    carries here (_REQUEST_RULES), which may read the fields before it."""
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise RequestError(str(rid), "request_id", "must be a non-empty string")
    for name, kind, b in declared(type(request))[1:]:
        _check_request_field(rid, name, kind, b, getattr(request, name))
        for rule in _REQUEST_RULES.get(name, ()):
            rule(request)


_TOKEN_IDS: Any = tuple[int, ...]
_INT_OR_NONE: Any = int | None
_STR_OR_NONE: Any = str | None


def _check_request_field(rid: str, name: str, kind: Any, b: Declaration, value: object) -> None:
    """One field of a request against its declared type and bounds."""
    if kind == _TOKEN_IDS:
        if not isinstance(value, tuple):
            raise RequestError(rid, name, "must be a tuple of token ids")
        _check_token_ids(rid, name, value)
    elif kind is int:
        if not _int_at_least(value, b.minimum):
            least = "" if b.minimum is None else f" >= {b.minimum}" + (f" ({b.why})" if b.why else "")
            raise RequestError(rid, name, f"must be an integer{least}, got {value!r}")
    elif kind == _INT_OR_NONE:
        if value is not None and not _int_at_least(value, b.minimum):
            raise RequestError(rid, name, f"must be a non-negative integer or None, got {value!r}")
    elif kind is bool:
        if not isinstance(value, bool):
            raise RequestError(rid, name, f"must be a boolean, got {value!r}")
    elif kind == _STR_OR_NONE:
        if value is not None and not isinstance(value, str):
            raise RequestError(rid, name, f"must be a string or None, got {value!r}")
    elif kind is str and b.choices:
        if value not in b.choices:
            raise RequestError(rid, name, f"must be one of {', '.join(map(repr, b.choices))}, got {value!r}")
    elif typing.get_origin(kind) is tuple and not isinstance(value, tuple):
        raise RequestError(rid, name, f"must be a tuple of {typing.get_args(kind)[0].__name__}")


def _int_at_least(value: object, least: int | float | None) -> bool:
    return is_int(value) and isinstance(value, int) and (least is None or value >= least)


def _prompt_not_empty(request: RequestFields) -> None:
    if len(request.prompt_token_ids) == 0:
        raise RequestError(request.request_id, "prompt_token_ids", "the prompt cannot be empty")


def _salt_unlike_an_identity(request: RequestFields) -> None:
    rid, salt = request.request_id, request.cache_salt
    if salt and salt.startswith("\x00"):
        # Block identities of adapter or encoder requests start with NUL
        # (RequestSpec.block_identity); a salt must never look like one.
        raise RequestError(rid, "cache_salt", "must not start with a NUL character")
    if salt and "\x1d" in salt:
        # The group separator ends the identity of a KV cache group's block
        # keys (interface.GROUP_KEY_SEPARATOR); a salt must never fake one.
        raise RequestError(rid, "cache_salt", "must not contain the group separator character \\x1d")


def _grammar_needs_structured_output(request: RequestFields) -> None:
    if request.grammar_rejects and not request.structured_output:
        raise RequestError(request.request_id, "grammar_rejects", "a grammar needs structured_output=True")


def _external_tokens_in_prompt(request: RequestFields) -> None:
    ext = request.kv_external_tokens
    if ext > len(request.prompt_token_ids):
        raise RequestError(
            request.request_id, "kv_external_tokens",
            f"({ext}) exceeds the prompt ({len(request.prompt_token_ids)} tokens): the store holds prompt KV only",
        )


def _async_load_needs_external_tokens(request: RequestFields) -> None:
    if request.kv_load_async and not request.kv_external_tokens:
        raise RequestError(request.request_id, "kv_load_async", "an asynchronous load needs kv_external_tokens > 0")


def _check_mm_inputs(request: RequestFields) -> None:
    """Encoder inputs: sorted by offset, non-overlapping, inside the prompt,
    length >= 1, a non-empty identifier, equal identifiers of equal length
    (vLLM's mm_hash names the encoder output, so its size is fixed)."""
    rid = request.request_id
    mm_type = next(typing.get_args(kind)[0] for name, kind, _ in declared(type(request)) if name == "mm_inputs")
    prev_end = 0
    lengths: dict[str, int] = {}
    for i, mm in enumerate(request.mm_inputs):
        name = f"mm_inputs[{i}]"
        if not isinstance(mm, mm_type):
            raise RequestError(rid, name, f"must be an MMInput, got {type(mm).__name__}")
        offset = getattr(mm, "offset", None)
        length = getattr(mm, "length", None)
        ident = getattr(mm, "identifier", None)
        if not is_int(offset) or not is_int(length):
            raise RequestError(rid, name, f"offset and length must be integers, got {offset!r}, {length!r}")
        assert isinstance(offset, int) and isinstance(length, int)
        if not isinstance(ident, str) or not ident:
            raise RequestError(rid, f"{name}.identifier", f"must be a non-empty string, got {ident!r}")
        if length < 1:
            raise RequestError(rid, f"{name}.length", f"must be >= 1, got {length}")
        if offset < prev_end:
            raise RequestError(
                rid, f"{name}.offset",
                f"({offset}) must be at or past the end of the previous input ({prev_end}): "
                "inputs are sorted by offset and do not overlap",
            )
        if offset + length > len(request.prompt_token_ids):
            raise RequestError(
                rid, name,
                f"covers positions {offset}..{offset + length - 1}, past the prompt "
                f"({len(request.prompt_token_ids)} tokens)",
            )
        if lengths.setdefault(ident, length) != length:
            raise RequestError(
                rid, f"{name}.length",
                f"identifier {ident!r} has length {lengths[ident]} in an earlier input: "
                "equal identifiers name the same encoder output",
            )
        prev_end = offset + length


#: The rules between a request's fields, each run right after the field it is
#: listed under has passed its declared checks (so the fields before it are
#: sound); a field's first error is the one reported.
_REQUEST_RULES: Mapping[str, tuple[typing.Callable[[RequestFields], None], ...]] = {
    "prompt_token_ids": (_prompt_not_empty,),
    "cache_salt": (_salt_unlike_an_identity,),
    "grammar_rejects": (_grammar_needs_structured_output,),
    "mm_inputs": (_check_mm_inputs,),
    "kv_external_tokens": (_external_tokens_in_prompt,),
    "kv_save_async": (_async_load_needs_external_tokens,),  # once both KV flags are sound
}
