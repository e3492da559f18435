"""Input validation of the interface's values: what makes a SchedulerConfig
or a RequestSpec acceptable, and the typed error naming the field when it is
not. SchedulerConfig and RequestSpec (spec/interface.py) call these from
``__post_init__``, so an invalid value is never built and never reaches a
scheduler.

The checks read the fields by name; this module imports only the errors, so
the interface can depend on it and not the other way round.
"""

from __future__ import annotations

from typing import Protocol, cast

from schedspec.spec.errors import ConfigError, RequestError
from schedspec.spec.kv_kinds import KINDS, GroupFields


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


#: Upper bounds that keep a hostile config from exhausting memory (the pool
#: is an array of num_blocks entries).
LIMITS = {
    "block_size": 1 << 16,
    "num_blocks": 1 << 24,
    "max_num_batched_tokens": 1 << 24,
    "max_num_seqs": 1 << 20,
    "max_model_len": 1 << 24,
    "max_loras": 1 << 10,
    "prefill_schedule_interval": 1 << 20,
    "max_num_encoder_input_tokens": 1 << 24,
    "encoder_cache_size": 1 << 24,
}

#: The most draft tokens per step the spec models (0 = speculative decoding off).
MAX_SPECULATIVE_TOKENS = 8

_INT_FIELDS = (
    "block_size",
    "num_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "long_prefill_token_threshold",
    "num_speculative_tokens",
    "max_loras",
    "prefill_schedule_interval",
    "max_num_encoder_input_tokens",
    "encoder_cache_size",
)
_BOOL_FIELDS = (
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "scheduler_reserve_full_isl",
    "async_scheduling",
    "kv_connector",
)
_POSITIVE_FIELDS = (
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "prefill_schedule_interval",
)
_NON_NEGATIVE_FIELDS = (
    "long_prefill_token_threshold",
    "max_loras",
    "max_num_encoder_input_tokens",
    "encoder_cache_size",
)


#: The most KV cache groups a modelled layout has.
MAX_KV_CACHE_GROUPS = 4

#: The attention kinds a KV cache group may have (spec/interface.py re-exports
#: it): the registry of spec/kv_kinds.py (vllm/v1/kv_cache_interface.py,
#: FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec).
KV_GROUP_KINDS = tuple(KINDS)

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


def validate_config(config: ConfigFields, policy_type: type, group_type: type | None = None) -> None:
    """Raise ConfigError for the first invalid field of ``config``: first the
    type of each field (``policy`` must be a ``policy_type``), then each
    field's own range, then the relations between fields. ``group_type`` is
    the type every ``kv_cache_groups`` item must have."""
    _check_config_types(config, policy_type)
    _check_config_ranges(config)
    _check_config_relations(config)
    _check_kv_fields(config, group_type)
    _check_groups_fit(config)


def _check_groups_fit(config: ConfigFields) -> None:
    """vllm/v1/core/kv_cache_planning.py, check_enough_kv_cache_memory with
    max_memory_usage_bytes summed over the layers (one per group): the engine
    refuses to start unless one request of max_model_len tokens fits in every
    KV cache group at once, all drawing from the one pool. A full-attention
    group holds cdiv(max_model_len, block_size) blocks of it, a
    sliding-window group its admission cap (vllm/v1/kv_cache_interface.py,
    SlidingWindowSpec.max_admission_blocks_per_request: the window's W - 1
    tokens and every token in flight, one batch or two with async
    scheduling, at most max_model_len, one block more). The plain layout is
    the check of _check_config_relations."""
    if not config.kv_cache_groups:
        return
    bs, mml = config.block_size, config.max_model_len
    in_flight = (2 if config.async_scheduling else 1) * config.max_num_batched_tokens
    need = []
    for g in config.kv_cache_groups:
        # the group kind's max_admission_blocks_per_request (spec/kv_kinds.py);
        # a kind with no cap (full attention) holds the whole sequence
        group = cast(GroupFields, g)  # validated by _check_kv_fields
        cap = KINDS[group.kind].admission_cap(group, bs, in_flight, mml)
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
    for name in _INT_FIELDS:
        value = getattr(config, name)
        if not is_int(value):
            raise ConfigError(name, f"must be an integer, got {value!r}")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(name, f"must be a boolean, got {getattr(config, name)!r}")
    if not isinstance(config.policy, policy_type):
        raise ConfigError("policy", f"must be a Policy, got {config.policy!r}")
    w = config.watermark
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise ConfigError("watermark", f"must be a number, got {w!r}")


def _check_config_ranges(config: ConfigFields) -> None:
    for name in _POSITIVE_FIELDS:
        if getattr(config, name) <= 0:
            raise ConfigError(name, f"must be positive, got {getattr(config, name)}")
    for name, limit in LIMITS.items():
        if getattr(config, name) > limit:
            raise ConfigError(name, f"{getattr(config, name)} is beyond the supported maximum {limit}")
    if config.num_blocks < 2:
        raise ConfigError(
            "num_blocks",
            f"must be at least 2 (block 0 is the reserved null block), got {config.num_blocks}",
        )
    for name in _NON_NEGATIVE_FIELDS:
        if getattr(config, name) < 0:
            raise ConfigError(name, f"must be >= 0, got {getattr(config, name)}")
    # vllm/config/scheduler.py, SchedulerConfig.watermark: a fraction of the
    # pool in [0, 1).
    if not 0.0 <= config.watermark < 1.0:
        raise ConfigError("watermark", f"must be in [0, 1), got {config.watermark!r}")
    k = config.num_speculative_tokens
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(
            "num_speculative_tokens",
            f"must be between 0 (off) and {MAX_SPECULATIVE_TOKENS}, got {k}",
        )


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
    if k > 0 and config.max_num_batched_tokens < 1 + k:
        raise ConfigError(
            "max_num_batched_tokens",
            f"({config.max_num_batched_tokens}) must hold one decode with its drafts: "
            f"1 + num_speculative_tokens = {1 + k}",
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


def validate_request(request: RequestFields, mm_type: type | None = None) -> None:
    """Raise RequestError for the first invalid field of ``request``, in field
    order. ``mm_type`` is the type every ``mm_inputs`` item must have."""
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise RequestError(str(rid), "request_id", "must be a non-empty string")
    if not isinstance(request.prompt_token_ids, tuple):
        raise RequestError(rid, "prompt_token_ids", "must be a tuple of token ids")
    if len(request.prompt_token_ids) == 0:
        raise RequestError(rid, "prompt_token_ids", "the prompt cannot be empty")
    _check_token_ids(rid, "prompt_token_ids", request.prompt_token_ids)
    if not is_int(request.max_tokens) or request.max_tokens < 1:
        raise RequestError(rid, "max_tokens", f"must be an integer >= 1, got {request.max_tokens!r}")
    for name in ("priority", "arrival"):
        if not is_int(getattr(request, name)):
            raise RequestError(rid, name, f"must be an integer, got {getattr(request, name)!r}")
    if not isinstance(request.stop_token_ids, tuple):
        raise RequestError(rid, "stop_token_ids", "must be a tuple of token ids")
    _check_token_ids(rid, "stop_token_ids", request.stop_token_ids)
    eos = request.eos_token_id
    if eos is not None and (not is_int(eos) or eos < 0):
        raise RequestError(rid, "eos_token_id", f"must be a non-negative integer or None, got {eos!r}")
    if not isinstance(request.ignore_eos, bool):
        raise RequestError(rid, "ignore_eos", f"must be a boolean, got {request.ignore_eos!r}")
    if request.cache_salt is not None and not isinstance(request.cache_salt, str):
        raise RequestError(rid, "cache_salt", f"must be a string or None, got {request.cache_salt!r}")
    if request.cache_salt and request.cache_salt.startswith("\x00"):
        # Block identities of adapter or encoder requests start with NUL
        # (RequestSpec.block_identity); a salt must never look like one.
        raise RequestError(rid, "cache_salt", "must not start with a NUL character")
    if request.cache_salt and "\x1d" in request.cache_salt:
        # The group separator ends the identity of a KV cache group's block
        # keys (interface.GROUP_KEY_SEPARATOR); a salt must never fake one.
        raise RequestError(rid, "cache_salt", "must not contain the group separator character \\x1d")
    _check_gate_fields(request, mm_type)


def _check_gate_fields(request: RequestFields, mm_type: type | None) -> None:
    rid = request.request_id
    if not is_int(request.lora_id) or request.lora_id < 0:
        raise RequestError(rid, "lora_id", f"must be an integer >= 0 (0 = no adapter), got {request.lora_id!r}")
    if not isinstance(request.structured_output, bool):
        raise RequestError(rid, "structured_output", f"must be a boolean, got {request.structured_output!r}")
    if not isinstance(request.grammar_rejects, tuple):
        raise RequestError(rid, "grammar_rejects", "must be a tuple of token ids")
    _check_token_ids(rid, "grammar_rejects", request.grammar_rejects)
    if request.grammar_rejects and not request.structured_output:
        raise RequestError(rid, "grammar_rejects", "a grammar needs structured_output=True")
    if not isinstance(request.mm_inputs, tuple):
        raise RequestError(rid, "mm_inputs", "must be a tuple of MMInput")
    _check_mm_inputs(request, mm_type)
    _check_kv_request_fields(request)


def _check_kv_request_fields(request: RequestFields) -> None:
    rid = request.request_id
    ext = request.kv_external_tokens
    if not is_int(ext) or ext < 0:
        raise RequestError(rid, "kv_external_tokens", f"must be an integer >= 0, got {ext!r}")
    if ext > len(request.prompt_token_ids):
        raise RequestError(
            rid, "kv_external_tokens",
            f"({ext}) exceeds the prompt ({len(request.prompt_token_ids)} tokens): the store holds prompt KV only",
        )
    for name in ("kv_load_async", "kv_save_async"):
        if not isinstance(getattr(request, name), bool):
            raise RequestError(rid, name, f"must be a boolean, got {getattr(request, name)!r}")
    if request.kv_load_async and not ext:
        raise RequestError(rid, "kv_load_async", "an asynchronous load needs kv_external_tokens > 0")


def _check_mm_inputs(request: RequestFields, mm_type: type | None) -> None:
    """Encoder inputs: sorted by offset, non-overlapping, inside the prompt,
    length >= 1, a non-empty identifier, equal identifiers of equal length
    (vLLM's mm_hash names the encoder output, so its size is fixed)."""
    rid = request.request_id
    prev_end = 0
    lengths: dict[str, int] = {}
    for i, mm in enumerate(request.mm_inputs):
        name = f"mm_inputs[{i}]"
        if mm_type is not None and not isinstance(mm, mm_type):
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
