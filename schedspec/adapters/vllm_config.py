"""vLLM's configuration for a schedspec SchedulerConfig: the VllmConfig (model,
scheduler, cache, speculative decoding, KV transfer and LoRA configs) and the
KVCacheConfig of the modelled KV cache groups, every option the spec models
set from the config and every other one set to its neutral value, then read
back (``_check_effective``); and the check that vLLM built one manager per
group, of the group's kind (``check_managers``).

No GPU, no weights, no hub: the model is a tiny Llama ``config.json`` in a
temporary directory and the KV cache is a ``KVCacheConfig`` with no tensors.
vLLM is imported by the first call (schedspec/adapters/vllm_load.py).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

from schedspec.spec.interface import Policy, SchedulerConfig

from schedspec.adapters.vllm_kinds import mamba_cache_mode, vllm_kind
from schedspec.adapters.vllm_load import VllmAdapterError, into_vllm, load_vllm
from schedspec.adapters.vllm_runner import parallel_config, runner_env

_LOCK = threading.Lock()
_SPECS_REGISTERED = False


def build_vllm_config(config: SchedulerConfig) -> tuple[Any, Any]:
    """The VllmConfig and KVCacheConfig for ``config``: every option the spec
    models set from it, every other one set explicitly to its neutral value,
    and the result read back so that a value vLLM changed on its own fails
    here instead of as a mysterious divergence later."""
    load_vllm()
    from schedspec.adapters import vllm_names as v

    model_config = v.ModelConfig(
        model=v.MODEL_DIR,
        tokenizer=v.MODEL_DIR,
        skip_tokenizer_init=True,
        max_model_len=config.max_model_len,
        dtype="float32",
        seed=0,
    )
    scheduler_config = v.VllmSchedulerConfig(
        max_model_len=config.max_model_len,
        is_encoder_decoder=False,
        runner_type="generate",
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_scheduled_tokens=None,  # = max_num_batched_tokens
        max_num_seqs=config.max_num_seqs,
        max_num_active_seqs=None,  # = max_num_seqs
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=False,
        enable_chunked_prefill=config.enable_chunked_prefill,
        is_multimodal_model=False,
        policy=config.policy.value,
        disable_chunked_mm_input=False,
        scheduler_cls=None,
        scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
        watermark=config.watermark,
        prefill_schedule_interval=config.prefill_schedule_interval,
        async_scheduling=config.async_scheduling,
        stream_interval=1,
    )
    cache_config = v.CacheConfig(
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        prefix_caching_hash_algo="sha256",
        cache_dtype="auto",
        sliding_window=None,
        num_gpu_blocks_override=None,
        mamba_cache_mode=mamba_cache_mode(config.groups),
        prefix_match_unit=config.hash_block_size or None,
    )
    with runner_env(config):  # the model runner (vllm_runner.py)
        return _build(config, model_config, scheduler_config, cache_config)


def _build(config: SchedulerConfig, model_config: Any, scheduler_config: Any, cache_config: Any) -> tuple[Any, Any]:
    from schedspec.adapters import vllm_names as v

    parallel = parallel_config(config)
    vllm_config = v.VllmConfig(
        model_config=model_config,
        parallel_config=parallel,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=v.DeviceConfig(device="cpu"),
        speculative_config=_speculative_config(config, model_config, parallel),
        kv_transfer_config=_kv_transfer_config(config),
        ec_transfer_config=None,
        lora_config=_lora_config(config),
        # the KV cache events (spec/kv_events.py): queued by the block pool and
        # taken once per update_from_output; the "null" publisher binds no
        # socket (schedspec/adapters/vllm_events.py captures the batches)
        kv_events_config=(v.KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                          if config.enable_kv_cache_events else None),
    )
    # The engine sets this after profiling the GPU; the scheduler asserts on it.
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    kv_cache_config = v.KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=_kv_cache_groups(config),
        # what the engine copies from CacheConfig (default 0: sliding-window
        # groups keep only semantic checkpoints), kv_cache_planning.py
        # get_kv_cache_config_from_groups; spec/kv_groups.py RETENTION_INTERVAL
        prefix_cache_retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
    )
    _check_effective(vllm_config, config)
    _check_hash_block_size(v, vllm_config, kv_cache_config, config)
    global _SPECS_REGISTERED
    with _LOCK:
        if not _SPECS_REGISTERED:  # what the engine core does once (v1/engine/core.py)
            into_vllm(v.register_all_kvcache_specs, vllm_config)
            _SPECS_REGISTERED = True
    return vllm_config, kv_cache_config


def _kv_cache_groups(config: SchedulerConfig) -> list[Any]:
    """One KVCacheGroupSpec per KV cache group of ``config`` (config.groups),
    each with the config's block size and its kind's KVCacheSpec
    (adapters/vllm_kinds.py: a FullAttentionSpec, a SlidingWindowSpec of the
    group's window or a ChunkedLocalAttentionSpec of the group's attention
    chunk). The plain layout is the one
    full-attention group named ``layer``, as always; a hybrid layout's
    groups are named ``layer.G``. vLLM's engine derives these groups from the
    model's layers (vllm/v1/core/kv_cache_planning.py); its own scheduler
    tests build them by hand, as here. vLLM picks the coordinator from them
    (kv_cache_coordinator.py, get_kv_cache_coordinator): the no-prefix-cache
    one with caching off, UnitaryKVCacheCoordinator for one group,
    HybridKVCacheCoordinator for more."""
    from schedspec.adapters import vllm_names as v

    common: dict[str, Any] = dict(block_size=config.block_size, num_kv_heads=1, head_size=1, dtype=v.float32)
    if not config.is_hybrid:
        return [v.KVCacheGroupSpec(["layer"], v.FullAttentionSpec(**common))]
    groups = []
    for g, group in enumerate(config.groups):
        spec = vllm_kind(group).kv_cache_spec(v, group, common)
        groups.append(v.KVCacheGroupSpec([f"layer.{g}"], spec))
    return groups


#: The load-failure policies, as vLLM's KVTransferConfig types them.
_FAILURE_POLICIES: dict[str, Literal["recompute", "fail"]] = {"recompute": "recompute", "fail": "fail"}


def _kv_transfer_config(config: SchedulerConfig) -> Any:
    """vLLM's kv_transfer_config for ``config``: None without a connector,
    else the modelled connector (schedspec/adapters/vllm_connector.py) in the
    role of both producer and consumer, with the config's load-failure
    policy: the class without hybrid-allocator support for the plain layout,
    the one declaring it (SupportsHMA) for a hybrid layout."""
    from schedspec.adapters import vllm_names as v

    if not config.kv_connector:
        return None
    from schedspec.adapters import vllm_connector

    name = vllm_connector.HMA_CONNECTOR_NAME if config.is_hybrid else vllm_connector.CONNECTOR_NAME
    return v.KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=vllm_connector.__name__,
        kv_role="kv_both",
        kv_load_failure_policy=_FAILURE_POLICIES[config.kv_load_failure_policy],
    )


#: The n-gram method per mode: vLLM's V1 model runner refuses ``ngram`` with
#: async scheduling and takes ``ngram_gpu`` (vllm/config/vllm.py,
#: VllmConfig.__post_init__); the scheduler reads the same numbers from both.
_NGRAM_METHOD: dict[bool, Literal["ngram", "ngram_gpu"]] = {False: "ngram", True: "ngram_gpu"}


def _speculative_config(config: SchedulerConfig, target_model: Any, target_parallel: Any) -> Any:
    """vLLM's speculative_config for ``config``: None with speculative decoding
    off, else k drafts: n-gram ones (no draft model, no weights), or with
    ``drafter="draft_model"`` those of a draft model, with ``"eagle"`` an
    EAGLE drafter (method "eagle"), either on the tiny model's config.json
    (no weights are loaded: the scheduler reads only k and the method from
    it: VllmConfig.num_lookahead_tokens, num_prefill_lookahead_tokens,
    num_hash_lookahead_tokens),
    built against the target's model and parallel configs as the engine's
    arguments build it (vllm/engine/arg_utils.py)."""
    from schedspec.adapters import vllm_names as v

    k = config.num_speculative_tokens
    if not k:
        return None
    if config.drafter in ("draft_model", "eagle"):
        method: Literal["draft_model", "eagle"] = "eagle" if config.drafter == "eagle" else "draft_model"
        return v.SpeculativeConfig(method=method, model=v.MODEL_DIR, num_speculative_tokens=k,
                                   target_model_config=target_model, target_parallel_config=target_parallel)
    return v.SpeculativeConfig(
        method=_NGRAM_METHOD[config.async_scheduling],
        num_speculative_tokens=k,
        prompt_lookup_max=k,
        prompt_lookup_min=1,
    )


def _lora_config(config: SchedulerConfig) -> Any:
    """vLLM's lora_config for ``config``: None with LoRA off (max_loras 0),
    else one allowing ``max_loras`` adapters per batch. The scheduler reads
    only max_loras from it (scheduler.py, schedule: ``scheduled_loras``); the
    rank is the smallest vLLM accepts, as no adapter is ever loaded."""
    from schedspec.adapters import vllm_names as v

    if not config.max_loras:
        return None
    return v.LoRAConfig(max_loras=config.max_loras, max_lora_rank=8)


def _check_hash_block_size(v: Any, vc: Any, kv_cache_config: Any, config: SchedulerConfig) -> None:
    """The hash block size vLLM's engine resolves from CacheConfig.prefix_match_unit
    (v1/core/kv_cache_utils.py, resolve_kv_cache_block_sizes; v1/engine/core.py
    passes it to the scheduler) is the one the spec uses: the config's
    ``hash_block_size``, 0 meaning the block size."""
    _, hash_block_size = v.resolve_kv_cache_block_sizes(kv_cache_config, vc)
    if hash_block_size != (config.hash_block_size or config.block_size):
        raise VllmAdapterError(
            f"vLLM resolved the hash block size to {hash_block_size}, the spec to "
            f"{config.hash_block_size or config.block_size}"
        )


def _check_effective(vc: Any, config: SchedulerConfig) -> None:
    sc, cc, mc = vc.scheduler_config, vc.cache_config, vc.model_config
    effective = {
        "block_size": cc.block_size,
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_num_seqs": sc.max_num_seqs,
        "max_model_len": mc.max_model_len,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "long_prefill_token_threshold": sc.long_prefill_token_threshold,
        "policy": Policy(sc.policy),
        "scheduler_reserve_full_isl": sc.scheduler_reserve_full_isl,
    }
    for name, value in effective.items():
        if value != getattr(config, name):
            raise VllmAdapterError(
                f"vLLM changed {name} from {getattr(config, name)!r} to {value!r} while "
                "building its config"
            )
    k = config.num_speculative_tokens
    spec = vc.speculative_config
    neutral = {
        "async_scheduling": (bool(sc.async_scheduling), config.async_scheduling),
        "watermark": (sc.watermark, config.watermark),
        "max_num_active_seqs": (sc.max_num_active_seqs, None),
        # with a speculative_config vLLM fills it in (VllmConfig._set_max_num_scheduled_tokens)
        "max_num_scheduled_tokens": (
            sc.max_num_scheduled_tokens,
            config.max_num_batched_tokens if k else None,
        ),
        "prefill_schedule_interval": (sc.prefill_schedule_interval, config.prefill_schedule_interval),
        "max_loras": (vc.lora_config.max_loras if vc.lora_config is not None else 0, config.max_loras),
        "long_prefill_token_threshold_adaptive": (sc.long_prefill_token_threshold_adaptive, False),
        "use_v2_model_runner": (vc.use_v2_model_runner, config.model_runner == "v2"),
        "num_speculative_tokens": (vc.num_speculative_tokens, k),
        "num_lookahead_tokens": (vc.num_lookahead_tokens, config.num_lookahead_tokens),
        "max_num_new_slots_for_drafting": (
            spec.max_num_new_slots_for_drafting if spec is not None else 0,
            config.num_draft_slots,
        ),
        "num_speculative_tokens_per_batch_size": (
            spec.num_speculative_tokens_per_batch_size if spec is not None else None,
            None,
        ),
        "num_prefill_lookahead_tokens": (vc.num_prefill_lookahead_tokens, config.num_prefill_lookahead_tokens),
        "num_hash_lookahead_tokens": (getattr(vc, "num_hash_lookahead_tokens", 0), config.num_hash_lookahead_tokens),
        "pipeline_parallel_size": (vc.parallel_config.pipeline_parallel_size, config.pipeline_parallel_size),
        "max_concurrent_batches": (vc.max_concurrent_batches, config.max_concurrent_batches),
        "data_parallel_size": (vc.parallel_config.data_parallel_size, 1),
        "decode_context_parallel_size": (vc.parallel_config.decode_context_parallel_size, 1),
        "is_encoder_decoder": (mc.is_encoder_decoder, False),
        "supports_multimodal_inputs": (mc.supports_multimodal_inputs, False),
        "runner_type": (mc.runner_type, "generate"),
    }
    for name, (value, want) in neutral.items():
        if value != want:
            raise VllmAdapterError(
                f"vLLM resolved {name} to {value!r}; the modelled configuration needs {want!r}"
            )


def check_managers(managers: list[Any], config: SchedulerConfig) -> None:
    """VllmAdapterError unless vLLM built one single-type manager per KV
    cache group of ``config``, of the group's kind (adapters/vllm_kinds.py, manager_name)."""
    groups = config.groups
    if len(managers) != len(groups):
        raise VllmAdapterError(
            f"vLLM built {len(managers)} KV cache groups; the config has {len(groups)}")
    for g, (manager, group) in enumerate(zip(managers, groups)):
        if type(manager).__name__ != vllm_kind(group).manager_name:
            raise VllmAdapterError(
                f"vLLM built a {type(manager).__name__} for KV cache group {g} ({group.kind})")
