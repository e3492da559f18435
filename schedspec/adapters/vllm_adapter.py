"""vLLM 0.33.0's real v1 Scheduler behind schedspec's Scheduler protocol.

``VllmScheduler(config)`` builds vLLM's ``Scheduler`` (or a user subclass, as
vLLM accepts for ``scheduler_cls``) for exactly the configuration the spec
models, feeds it our events, and translates its ``SchedulerOutput`` into our
``StepPlan`` and its internal state into our ``SchedulerView``, so vLLM can run
in lockstep with the spec and be held to the same invariants.

No GPU, no weights, no hub: the model is a tiny Llama ``config.json`` in a
temporary directory and the KV cache is a ``KVCacheConfig`` with no tensors
(../shared/VLLM_NOTES.md, beside the repository, says how vLLM 0.33 runs with
no GPU). vLLM and torch are imported lazily, on the first ``VllmScheduler``;
importing this module imports neither.

What the translation relies on (vLLM 0.33.0, file vllm/v1/core/sched/scheduler.py
unless said otherwise):

* ``SchedulerOutput.num_scheduled_tokens`` is filled in scheduling order
  (running loop, then admissions), so its key order is the plan's order.
* A request in ``scheduled_new_reqs`` is NEW; one whose id is in
  ``scheduled_cached_reqs.resumed_req_ids`` is RESUMED (with
  ``VLLM_USE_V2_MODEL_RUNNER=0``, pinned here); any other cached one is RUNNING.
* vLLM sends a new or resumed request's whole block table and only the new
  blocks of a running one (vllm/v1/worker/gpu_model_runner.py, _update_states).
  The adapter rebuilds each table from those messages, as a model runner does,
  and checks it against the KV manager's own table every step.
* vLLM keys cached blocks by a chained SHA-256 of their tokens; the spec keys
  them by content, ``(salt or "", tokens from the start through the block)``.
  The adapter records, for every request it ever handed to vLLM, which content
  each of the request's block hashes stands for, and reports content keys.

The two modes beyond the synchronous default:

* ``config.async_scheduling``: vLLM's ``AsyncScheduler``
  (vllm/v1/core/sched/async_scheduler.py), driven as the engine core's
  ``step_with_batch_queue`` drives it (vllm/v1/engine/core.py): schedule() for
  step N+1 may come while step N awaits its update; updates come in plan
  order. An entry's ``num_output_placeholders`` is the request's count before
  this step's own (``_update_after_schedule`` adds 1 + the step's drafts to
  every entry that samples), its drafts are vLLM's -1 placeholders, and the
  drafts in a result never reach vLLM (the worker keeps them).
* ``config.num_speculative_tokens`` = k > 0: a ``speculative_config`` of k
  n-gram drafts, built on the CPU without weights as vLLM's own
  tests/v1/core/utils.py (``create_scheduler``) builds one: method ``ngram``
  for the synchronous scheduler, ``ngram_gpu`` with async scheduling (the
  n-gram method vLLM's V1 model runner accepts with async scheduling, with the
  same scheduler-side numbers: no lookahead slots, no extra drafting slots).
  An entry's ``spec_token_ids`` are ``scheduled_spec_decode_tokens``; a result's
  ``sampled`` (accepted drafts, then the bonus token) is the
  ``ModelRunnerOutput``'s ``sampled_token_ids``; in sync mode its
  ``draft_token_ids`` go to ``update_draft_token_ids`` after
  ``update_from_output``, for the plan's entries in plan order, as the engine
  core's ``post_step`` hands over the worker's proposals.

The admission gates, each off unless the config or request turns it on:

* ``watermark`` and ``prefill_schedule_interval`` go into vLLM's
  scheduler_config as they are; ``max_loras`` > 0 makes a ``lora_config``.
* A request's ``lora_id`` becomes a ``LoRARequest`` (lora_int_id = the id, a
  name and path derived from it, which vLLM's block hashes chain in). Block
  keys carry ``RequestSpec.block_identity`` (salt, adapter, encoder inputs).
* ``structured_output``: the request carries a constraint, so vLLM adds it in
  WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR; its grammar is a Future (what the
  structured-output manager's background compile hands over) that
  ``grammar_ready`` resolves with a modelled grammar refusing
  ``grammar_rejects``, or with an error. The manager's backend is a stub that
  only allocates bitmasks; the adapter asks for the grammar bitmask where the
  engine core does (after schedule(), or for an async plan with structured
  tokens in flight after the previous update, with the worker's drafts
  checked first: update_draft_token_ids_in_output).
* ``mm_inputs`` become MultiModalFeatureSpecs (positions, size, identifier,
  no data); the encoder budget and cache size are set on the scheduler as
  vLLM's own scheduler tests do, a text-only model having none.
* ``set_pause_state`` is vLLM's; views report its pause state, the encoder
  cache and the prefill cadence's counters (normalised to their idle values
  without a cadence, where vLLM keeps counting to no effect).

A fidelity collector (schedspec/adapters/fidelity.py) may ask for a trace
function around every call the adapter makes into vLLM's scheduler
(``trace_vllm_calls``), so that only vLLM's own work is traced.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from schedspec.adapters.vllm_kinds import vllm_kind
from schedspec.check.capabilities import Capabilities
from schedspec.spec.interface import (
    BlockKey,
    KVLoad,
    KVView,
    MMInput,
    PauseState,
    Policy,
    RequestSpec,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedSpecError,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
    group_block_key,
)

from schedspec.spec.protocol import (
    check_abort,
    check_add,
    check_config,
    check_grammar_ready,
    check_kv_reports,
    check_kv_reset,
    check_mm_lengths,
    check_pause_state,
    check_reset,
    check_result,
    check_schedule,
)

VLLM_VERSION = "0.33.0"


class VllmUnavailable(SchedSpecError, ImportError):
    """vLLM (or the exact pinned version of it) is not installed."""


class VllmAdapterError(SchedSpecError, RuntimeError):
    """vLLM did something the modelled configuration cannot explain: a state
    outside the modelled ones, an option it silently changed, or a block table
    it sent that is not the one it keeps."""


# --------------------------------------------------------------------------
# Loading vLLM once per process
# --------------------------------------------------------------------------

#: A Llama small enough to describe, never loaded: the scheduler only reads
#: the architecture, the vocabulary and the context length from it.
_TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 1 << 20,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: Environment vLLM must see before it is imported. VLLM_USE_V2_MODEL_RUNNER
#: decides how a resumed request is reported (see the module docstring).
_PINNED_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}


def _default_cache_root() -> str:
    """Where vLLM caches what it learns about the model architecture (the
    first ModelConfig spends seconds in a subprocess finding out)."""
    explicit = os.environ.get("VLLM_CACHE_ROOT")
    if explicit:
        return explicit
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "schedspec" / "vllm"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return str(home)
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"schedspec-vllm-cache-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return str(fallback)


@dataclass(frozen=True)
class _Vllm:
    """The vLLM names the adapter uses, imported once."""

    CacheConfig: Any
    DeviceConfig: Any
    ModelConfig: Any
    VllmSchedulerConfig: Any
    VllmConfig: Any
    FullAttentionSpec: Any
    KVCacheConfig: Any
    KVCacheGroupSpec: Any
    KVCacheBlock: Any
    SamplingParams: Any
    Request: Any
    VRequestStatus: Any
    ModelRunnerOutput: Any
    Scheduler: Any
    AsyncScheduler: Any
    SpeculativeConfig: Any
    DraftTokenIds: Any
    StructuredOutputManager: Any
    LoRAConfig: Any
    LoRARequest: Any
    StructuredOutputsParams: Any
    MultiModalFeatureSpec: Any
    PlaceholderRange: Any
    EncoderCacheManager: Any
    VPauseState: Any
    KVTransferConfig: Any
    SlidingWindowSpec: Any
    ChunkedLocalAttentionSpec: Any
    KVConnectorOutput: Any
    torch: Any
    get_block_hash: Any
    get_group_id: Any
    register_all_kvcache_specs: Any
    block_hasher: Any  # block_size -> hasher
    float32: Any
    model_dir: str


def _drop_kv_failure_records(record: logging.LogRecord) -> bool:
    """A logging filter: False for vLLM's record of requests failed by a KV
    load failure (the modelled "fail" policy), True for every other one."""
    return not str(record.msg).startswith("Failing %d request(s) due to KV load failure")


_LOCK = threading.Lock()
_LOADED: _Vllm | None = None
_SPECS_REGISTERED = False


def load_vllm() -> _Vllm:
    """Import vLLM with the environment pinned; raise VllmUnavailable with a
    pointer to scripts/install_vllm.sh when it is missing or not 0.33.0."""
    global _LOADED
    with _LOCK:
        if _LOADED is not None:
            return _LOADED
        for name, value in _PINNED_ENV.items():
            os.environ[name] = value
        os.environ["VLLM_CACHE_ROOT"] = _default_cache_root()
        # vLLM configures its loggers only inside its engine; here its warnings
        # (a refused prefix-cache reset, say) would reach the root logger.
        vllm_logger = logging.getLogger("vllm")
        if vllm_logger.level == logging.NOTSET:
            vllm_logger.setLevel(logging.ERROR)
        # A failed KV load under the "fail" policy is a modelled event, which
        # vLLM logs as an error (scheduler.py, _handle_invalid_blocks).
        logging.getLogger("vllm.v1.core.sched.scheduler").addFilter(_drop_kv_failure_records)
        try:
            import vllm
        except ImportError as exc:
            raise VllmUnavailable(
                f"vLLM is not importable ({exc}); install it with scripts/install_vllm.sh VENV"
            ) from exc
        if getattr(vllm, "__version__", None) != VLLM_VERSION:
            raise VllmUnavailable(
                f"vLLM {VLLM_VERSION} is required, found {getattr(vllm, '__version__', '?')}; "
                "install it with scripts/install_vllm.sh VENV"
            )
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            VllmConfig,
        )
        from vllm.config import SchedulerConfig as VllmSchedulerConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import (
            KVCacheBlock,
            get_block_hash,
            get_group_id,
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.config import SpeculativeConfig
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.config import KVTransferConfig
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.request import RequestStatus as VRequestStatus
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.config import LoRAConfig
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
        from vllm.v1.core.sched.interface import PauseState as VPauseState

        init_none_hash(sha256)
        model_dir = tempfile.mkdtemp(prefix="schedspec-tiny-llama-")
        atexit.register(shutil.rmtree, model_dir, True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(_TINY_LLAMA, f)

        def block_hasher(block_size: int) -> Any:
            return get_request_block_hasher(block_size, sha256)

        _LOADED = _Vllm(
            CacheConfig=CacheConfig,
            DeviceConfig=DeviceConfig,
            ModelConfig=ModelConfig,
            VllmSchedulerConfig=VllmSchedulerConfig,
            VllmConfig=VllmConfig,
            FullAttentionSpec=FullAttentionSpec,
            KVCacheConfig=KVCacheConfig,
            KVCacheGroupSpec=KVCacheGroupSpec,
            KVCacheBlock=KVCacheBlock,
            SamplingParams=SamplingParams,
            Request=Request,
            VRequestStatus=VRequestStatus,
            ModelRunnerOutput=ModelRunnerOutput,
            Scheduler=Scheduler,
            AsyncScheduler=AsyncScheduler,
            SpeculativeConfig=SpeculativeConfig,
            DraftTokenIds=DraftTokenIds,
            StructuredOutputManager=StructuredOutputManager,
            LoRAConfig=LoRAConfig,
            LoRARequest=LoRARequest,
            StructuredOutputsParams=StructuredOutputsParams,
            MultiModalFeatureSpec=MultiModalFeatureSpec,
            PlaceholderRange=PlaceholderRange,
            EncoderCacheManager=EncoderCacheManager,
            VPauseState=VPauseState,
            KVTransferConfig=KVTransferConfig,
            SlidingWindowSpec=SlidingWindowSpec,
            ChunkedLocalAttentionSpec=ChunkedLocalAttentionSpec,
            KVConnectorOutput=KVConnectorOutput,
            torch=torch,
            get_block_hash=get_block_hash,
            get_group_id=get_group_id,
            register_all_kvcache_specs=register_all_kvcache_specs,
            block_hasher=block_hasher,
            float32=torch.float32,
            model_dir=model_dir,
        )
        return _LOADED


def build_vllm_config(v: _Vllm, config: SchedulerConfig) -> tuple[Any, Any]:
    """The VllmConfig and KVCacheConfig for ``config``: every option the spec
    models set from it, every other one set explicitly to its neutral value,
    and the result read back so that a value vLLM changed on its own fails
    here instead of as a mysterious divergence later."""
    model_config = v.ModelConfig(
        model=v.model_dir,
        tokenizer=v.model_dir,
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
    )
    vllm_config = v.VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=v.DeviceConfig(device="cpu"),
        speculative_config=_speculative_config(v, config),
        kv_transfer_config=_kv_transfer_config(v, config),
        ec_transfer_config=None,
        lora_config=_lora_config(v, config),
        kv_events_config=None,
    )
    # The engine sets this after profiling the GPU; the scheduler asserts on it.
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    kv_cache_config = v.KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=_kv_cache_groups(v, config),
        # what the engine copies from CacheConfig (default 0: sliding-window
        # groups keep only semantic checkpoints), kv_cache_planning.py
        # get_kv_cache_config_from_groups; spec/kv_groups.py RETENTION_INTERVAL
        prefix_cache_retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
    )
    _check_effective(vllm_config, config)
    global _SPECS_REGISTERED
    with _LOCK:
        if not _SPECS_REGISTERED:  # what the engine core does once (v1/engine/core.py)
            _into_vllm(v.register_all_kvcache_specs, vllm_config)
            _SPECS_REGISTERED = True
    return vllm_config, kv_cache_config


def _kv_cache_groups(v: _Vllm, config: SchedulerConfig) -> list[Any]:
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
    common = dict(block_size=config.block_size, num_kv_heads=1, head_size=1, dtype=v.float32)
    if not config.is_hybrid:
        return [v.KVCacheGroupSpec(["layer"], v.FullAttentionSpec(**common))]
    groups = []
    for g, group in enumerate(config.groups):
        spec = vllm_kind(group).kv_cache_spec(v, group, common)
        groups.append(v.KVCacheGroupSpec([f"layer.{g}"], spec))
    return groups


def _kv_transfer_config(v: _Vllm, config: SchedulerConfig) -> Any:
    """vLLM's kv_transfer_config for ``config``: None without a connector,
    else the modelled connector (schedspec/adapters/vllm_connector.py) in the
    role of both producer and consumer, with the config's load-failure
    policy: the class without hybrid-allocator support for the plain layout,
    the one declaring it (SupportsHMA) for a hybrid layout."""
    if not config.kv_connector:
        return None
    from schedspec.adapters import vllm_connector

    name = vllm_connector.HMA_CONNECTOR_NAME if config.is_hybrid else vllm_connector.CONNECTOR_NAME
    return v.KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=vllm_connector.__name__,
        kv_role="kv_both",
        kv_load_failure_policy=config.kv_load_failure_policy,
    )


#: The n-gram method per mode: vLLM's V1 model runner refuses ``ngram`` with
#: async scheduling and takes ``ngram_gpu`` (vllm/config/vllm.py,
#: VllmConfig.__post_init__); the scheduler reads the same numbers from both.
_NGRAM_METHOD = {False: "ngram", True: "ngram_gpu"}


def _speculative_config(v: _Vllm, config: SchedulerConfig) -> Any:
    """vLLM's speculative_config for ``config``: None with speculative decoding
    off, else k n-gram drafts (no draft model, no weights)."""
    k = config.num_speculative_tokens
    if not k:
        return None
    return v.SpeculativeConfig(
        method=_NGRAM_METHOD[config.async_scheduling],
        num_speculative_tokens=k,
        prompt_lookup_max=k,
        prompt_lookup_min=1,
    )


def _lora_config(v: _Vllm, config: SchedulerConfig) -> Any:
    """vLLM's lora_config for ``config``: None with LoRA off (max_loras 0),
    else one allowing ``max_loras`` adapters per batch. The scheduler reads
    only max_loras from it (scheduler.py, schedule: ``scheduled_loras``); the
    rank is the smallest vLLM accepts, as no adapter is ever loaded."""
    if not config.max_loras:
        return None
    return v.LoRAConfig(max_loras=config.max_loras, max_lora_rank=8)


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
        "use_v2_model_runner": (vc.use_v2_model_runner, False),
        "num_speculative_tokens": (vc.num_speculative_tokens, k),
        "num_lookahead_tokens": (vc.num_lookahead_tokens, config.num_lookahead_tokens),
        "max_num_new_slots_for_drafting": (
            spec.max_num_new_slots_for_drafting if spec is not None else 0,
            0,
        ),
        "num_speculative_tokens_per_batch_size": (
            spec.num_speculative_tokens_per_batch_size if spec is not None else None,
            None,
        ),
        "num_prefill_lookahead_tokens": (vc.num_prefill_lookahead_tokens, 0),
        "num_hash_lookahead_tokens": (vc.num_hash_lookahead_tokens, 0),
        "pipeline_parallel_size": (vc.parallel_config.pipeline_parallel_size, 1),
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


# --------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------

_STATUS_NAMES = {
    "WAITING": RequestStatus.WAITING,
    "RUNNING": RequestStatus.RUNNING,
    "PREEMPTED": RequestStatus.PREEMPTED,
    "FINISHED_STOPPED": RequestStatus.FINISHED_STOPPED,
    "FINISHED_LENGTH_CAPPED": RequestStatus.FINISHED_LENGTH_CAPPED,
    "FINISHED_ABORTED": RequestStatus.FINISHED_ABORTED,
    "FINISHED_IGNORED": RequestStatus.FINISHED_IGNORED,
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    "FINISHED_ERROR": RequestStatus.FINISHED_ERROR,
    "WAITING_FOR_REMOTE_KVS": RequestStatus.WAITING_FOR_REMOTE_KVS,
}

class _Grammar:
    """The modelled grammar of a structured-output request, in the place of a
    compiled xgrammar/guidance matcher (vllm/v1/structured_output/
    backend_types.py, StructuredOutputGrammar): stateless, it refuses the
    token ids in ``rejects`` and accepts every other one. What the scheduler
    and the structured-output manager call on a grammar: ``validate_tokens``
    (the longest prefix of drafts with no refused token), ``accept_tokens``,
    ``rollback``, ``fill_bitmask``, ``is_terminated`` and ``reset``."""

    def __init__(self, rejects: tuple[int, ...]) -> None:
        self.rejects = frozenset(rejects)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return not any(t in self.rejects for t in tokens)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.rejects:
                return tokens[:i]
        return list(tokens)

    def rollback(self, num_tokens: int) -> None:
        pass  # stateless: nothing advanced

    def fill_bitmask(self, bitmask: Any, batch_index: int) -> None:
        row = bitmask[batch_index]
        row.fill_(-1)
        if self.rejects:
            bits = row.numpy().view("uint32")
            for t in self.rejects:
                if 0 <= t >> 5 < len(bits):  # an id past the vocabulary is never sampled anyway
                    bits[t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


class _GrammarBackend:
    """The one method of a structured-output backend the scheduler's path
    reaches without a tokenizer (StructuredOutputManager.grammar_bitmask,
    ``allocate_token_bitmask``): one row of vocab bits per mask."""

    def __init__(self, torch: Any, vocab_size: int) -> None:
        self._torch = torch
        self._words = (vocab_size + 31) // 32

    def allocate_token_bitmask(self, max_num_seqs: int) -> Any:
        return self._torch.full((max_num_seqs, self._words), -1, dtype=self._torch.int32)

    def destroy(self) -> None:
        pass


@dataclass(frozen=True)
class RawStep:
    """One ``VllmScheduler.raw_step``: seconds inside vLLM's schedule() and
    update_from_output() (wall clock and process CPU time), how many requests
    the step scheduled, and whether each got exactly one token (decode)."""

    wall_s: float
    cpu_s: float
    scheduled: int
    decode: bool


# --------------------------------------------------------------------------
# Tracing the calls into vLLM
# --------------------------------------------------------------------------

_TraceFn = Callable[..., Any]
_CALL_TRACER: _TraceFn | None = None


def trace_vllm_calls(tracer: _TraceFn | None) -> _TraceFn | None:
    """Run every call the adapter makes into vLLM's scheduler (construction,
    add, abort, reset, schedule, update, drafts) with ``tracer`` installed as
    the thread's ``sys.settrace`` function, or stop with None; returns the
    tracer installed before. Nothing else the process runs is traced."""
    global _CALL_TRACER
    previous, _CALL_TRACER = _CALL_TRACER, tracer
    return previous


def _into_vllm(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    tracer = _CALL_TRACER
    if tracer is None:
        return fn(*args, **kwargs)
    outer = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.settrace(outer)


def is_async_scheduler_class(cls: type) -> bool:
    """Whether ``cls`` is vLLM's AsyncScheduler or a subclass of it: such a
    class is driven with a step in flight (``async_scheduling``), any other
    vLLM Scheduler class synchronously."""
    v = load_vllm()
    return isinstance(cls, type) and issubclass(cls, v.AsyncScheduler)


#: What ``vllm`` (vLLM's own Scheduler and AsyncScheduler, picked by the
#: config) supports: everything the spec does, in all four modes, with every
#: admission gate (LoRA, structured outputs, pause states, the watermark, the
#: prefill cadence, the encoder budget), the KV connector (the modelled one,
#: schedspec/adapters/vllm_connector.py) and hybrid KV cache groups.
VLLM_CAPABILITIES = Capabilities(async_scheduling=True, speculative_decoding=True).with_gates().with_kv()


def capabilities_of_class(cls: type) -> Capabilities:
    """What a user's vLLM scheduler class supports through the adapter:
    speculative decoding, every admission gate, the KV connector and hybrid
    KV cache groups always (the adapter drives them through vLLM's own
    Scheduler code); async scheduling for an AsyncScheduler
    subclass (which is driven only with a step in flight: a synchronous
    config is refused when it is built)."""
    is_async = is_async_scheduler_class(cls)
    return Capabilities(async_scheduling=is_async, speculative_decoding=True,
                        sync_scheduling=not is_async).with_gates().with_kv()


class _SortedSet(set):  # type: ignore[type-arg]
    """A set that iterates in sorted order. vLLM frees the requests of a
    result's ``finished_recving`` and ``finished_sending`` in the order it
    iterates those sets (scheduler.py, _update_from_kv_xfer_finished): for
    request-id strings, an order that depends on the process's hash seed.
    The spec frees them in sorted order, one of the orders vLLM may take;
    the adapter hands vLLM sets that take it (docs/divergences.md)."""

    def __iter__(self) -> Any:
        return iter(sorted(set.__iter__(self)))


@dataclass
class _Live:
    spec: RequestSpec
    req: Any  # vllm.v1.request.Request
    num_hashed: int = 0  # block hashes already translated to content keys


class VllmScheduler:
    """Implements spec.interface.Scheduler on top of vLLM's real Scheduler.

    ``scheduler_cls`` may name a subclass of vLLM's Scheduler (what vLLM takes
    as ``scheduler_cls``); it is built exactly as vLLM's engine builds one. A
    subclass of AsyncScheduler needs ``config.async_scheduling`` and any
    other class needs it off (``is_async_scheduler_class`` tells which). By
    default the class is vLLM's AsyncScheduler with async scheduling on, its
    Scheduler otherwise.
    """

    CAPABILITIES = VLLM_CAPABILITIES

    def __init__(self, config: SchedulerConfig, scheduler_cls: type | None = None) -> None:
        config = check_config(config)
        v = load_vllm()
        if scheduler_cls is not None and not isinstance(scheduler_cls, type):
            raise TypeError(f"scheduler_cls must be a class, got {scheduler_cls!r}")
        self._v = v
        self._config = config
        if scheduler_cls is None:
            cls = v.AsyncScheduler if config.async_scheduling else v.Scheduler
        else:
            cls = scheduler_cls
            if issubclass(cls, v.AsyncScheduler) != config.async_scheduling:
                kind = "a subclass of vLLM's AsyncScheduler" if config.async_scheduling else (
                    "a vLLM Scheduler class that is not an AsyncScheduler")
                raise VllmAdapterError(
                    f"{cls.__qualname__}: async_scheduling={config.async_scheduling} needs {kind} "
                    "(vLLM drives an AsyncScheduler with a step in flight, any other scheduler "
                    "synchronously)"
                )
        self._vllm_config, kv_cache_config = build_vllm_config(v, config)
        self.sched: Any = _into_vllm(
            cls,
            vllm_config=self._vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=v.StructuredOutputManager(self._vllm_config),
            block_size=config.block_size,
            log_stats=False,
        )
        for attr in ("requests", "waiting", "running", "kv_cache_manager", "finished_req_ids"):
            if not hasattr(self.sched, attr):
                raise VllmAdapterError(
                    f"{cls.__name__} has no attribute {attr!r}: the adapter reads vLLM "
                    "Scheduler internals and needs a subclass of vllm's Scheduler"
                )
        if config.has_encoder:
            self._set_encoder_budget(config)
        self._pin_finish_order()
        # The structured-output manager's backend (a tokenizer-bound compiler
        # in vLLM): only the bitmask allocation is reached, grammars are ours.
        som = self.sched.structured_output_manager
        som.backend = _GrammarBackend(v.torch, self._vllm_config.model_config.get_vocab_size())
        som.backend_name = "schedspec"
        managers = self.sched.kv_cache_manager.coordinator.single_type_managers
        groups = config.groups
        if len(managers) != len(groups):
            raise VllmAdapterError(
                f"vLLM built {len(managers)} KV cache groups; the config has {len(groups)}")
        for g, (manager, group) in enumerate(zip(managers, groups)):
            if type(manager).__name__ != vllm_kind(group).manager_name:  # adapters/vllm_kinds.py
                raise VllmAdapterError(
                    f"vLLM built a {type(manager).__name__} for KV cache group {g} ({group.kind})")
        if self._config.kv_connector:
            from schedspec.adapters.vllm_connector import SchedspecKVConnector

            if not isinstance(self.sched.connector, SchedspecKVConnector):
                raise VllmAdapterError(
                    f"vLLM built the KV connector {type(self.sched.connector).__name__}, not the "
                    "modelled SchedspecKVConnector")
        # per group: request id -> its block table (group 0's is block_ids)
        self._group_blocks_of: list[Any] = [m.req_to_blocks for m in managers]
        self._blocks_of: Any = managers[0].req_to_blocks
        self._hybrid = config.is_hybrid
        self._connector = config.kv_connector
        self._statuses = {v.VRequestStatus[name]: ours for name, ours in _STATUS_NAMES.items()}
        self._block_hasher = v.block_hasher(config.block_size)
        self._live: dict[str, _Live] = {}
        self._finished: dict[str, RequestView] = {}
        # every group's block table as a model runner sees it
        self._tables: dict[str, list[list[int]]] = {}
        self._keys: dict[bytes, BlockKey] = {}  # vLLM block hash -> content key
        self._prune_at = 4096  # forget keys nobody can ask for once there are this many
        self._step = 0
        # plans awaiting update, oldest first, each with vLLM's SchedulerOutput
        self._in_flight: list[tuple[StepPlan, Any]] = []
        self._async = config.async_scheduling
        self._drafts = config.num_speculative_tokens > 0 and not config.async_scheduling
        self._mm_lengths: dict[str, int] = {}  # every mm identifier seen -> its length
        self._grammars: dict[str, Any] = {}  # request id -> the Future of its grammar
        # request id -> the group-0 blocks its asynchronous load writes, until
        # the worker reports the load (finished_recving)
        self._kv_loading: dict[str, tuple[int, ...]] = {}

    def _pin_finish_order(self) -> None:
        """update_from_output finishes the requests of a step's errors (a
        grammar that failed to compile, a failed KV load under the "fail"
        policy) by handing finish_requests a set of request ids, whose
        iteration order (and so the order their blocks are freed in) depends
        on the process's hash seed. The spec takes them in sorted order, one
        of the orders vLLM may take; the adapter has vLLM take it too: a set
        handed to the scheduler's finish_requests (which makes a set of any
        collection it gets) is finished one request at a time, in sorted
        order. Nothing finish_requests does to one request reads another's
        state, so this is the set's walk in that order
        (docs/divergences.md)."""
        finish = self.sched.finish_requests

        def finish_requests(request_ids: Any, finished_status: Any) -> Any:
            if not isinstance(request_ids, (set, frozenset)):
                return finish(request_ids, finished_status)
            done: list[Any] = []
            for rid in sorted(request_ids):
                done.extend(finish(rid, finished_status))
            return done

        self.sched.finish_requests = finish_requests

    def _set_encoder_budget(self, config: SchedulerConfig) -> None:
        """The encoder budget and cache of a multimodal model. vLLM derives both
        from the model's processor (vllm/multimodal/encoder_budget.py,
        MultiModalBudget) when the model supports multimodal inputs; with no
        model the scheduler gets them set as vLLM's own scheduler tests set
        them: its ``max_num_encoder_input_tokens`` and an EncoderCacheManager
        of ``encoder_cache_size`` embeddings (scheduler.py, __init__, builds
        exactly these from the budget)."""
        sched = self.sched
        if sched.max_num_encoder_input_tokens or sched.encoder_cache_manager.cache_size:
            raise VllmAdapterError("vLLM built an encoder budget of its own for a text-only model")
        sched.max_num_encoder_input_tokens = config.max_num_encoder_input_tokens
        sched.encoder_cache_manager = self._v.EncoderCacheManager(cache_size=config.encoder_cache_size)

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    # ------------------------------------------------------------------ events

    def add(self, request: RequestSpec) -> None:
        # The spec's boundary: vLLM's own input processor rejects these before
        # the scheduler ever sees them.
        request = check_add(request, self._config, self._live, self._finished)
        check_mm_lengths(request, self._mm_lengths)
        rid = request.request_id
        req = self.vllm_request(request)
        live = _Live(request, req)
        self._record_keys(live)
        if request.structured_output:
            # What StructuredOutputManager.grammar_init does: the grammar
            # compiles in the background; the scheduler polls the Future.
            future: Future[Any] = Future()
            req.structured_output_request.grammar = future
            self._grammars[rid] = future
        _into_vllm(self.sched.add_request, req)
        self._live[rid] = live
        for mm in request.mm_inputs:
            self._mm_lengths.setdefault(mm.identifier, mm.length)

    def set_pause_state(self, state: PauseState) -> None:
        """vLLM's Scheduler.set_pause_state, as the engine core's
        pause_scheduler/resume call it."""
        state = check_pause_state(state)
        _into_vllm(self.sched.set_pause_state, self._v.VPauseState(int(state)))

    def grammar_ready(self, request_id: str, ok: bool = True) -> None:
        """The request's grammar finished compiling (``ok=False``: it failed):
        its Future gets the modelled grammar or the compile error, which the
        waiting loop finds when it next reaches the request
        (scheduler.py, _handle_blocked_waiting_request)."""
        live = self._live.get(request_id) if isinstance(request_id, str) else None
        status = self._status(live.req) if live is not None else None
        future = self._grammars.get(request_id) if isinstance(request_id, str) else None
        # resolved already, though the waiting loop may not have looked yet
        reported = future is not None and future.done()
        check_grammar_ready(request_id, ok, status, reported)
        assert live is not None and future is not None
        if ok:
            future.set_result(_Grammar(live.spec.grammar_rejects))
        else:
            future.set_exception(ValueError(f"grammar of {request_id!r} failed to compile"))

    def vllm_request(self, request: RequestSpec) -> Any:
        """The vLLM Request for ``request``, as the engine would hand it to the
        scheduler (no bookkeeping of this adapter's; the benchmark adds these
        straight to vLLM's scheduler)."""
        v = self._v
        params = v.SamplingParams(
            max_tokens=request.max_tokens,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            # any constraint makes a structured-output request; the grammar
            # itself is the modelled one (grammar_ready)
            structured_outputs=(
                v.StructuredOutputsParams(regex=".*") if request.structured_output else None
            ),
        )
        # What the engine's input processor does with the tokenizer's eos id:
        # with ignore_eos the id is not set, so check_stop never matches it.
        params.update_from_generation_config({}, request.eos_token_id)
        transfer = self._kv_transfer_params(request)
        if transfer is not None:
            # what vLLM's Request reads its kv_transfer_params from
            params.extra_args = {"kv_transfer_params": transfer}
        return v.Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(request.arrival),
            priority=request.priority,
            cache_salt=request.cache_salt,
            block_hasher=self._block_hasher,
            lora_request=self._lora_request(request.lora_id),
            mm_features=[self._mm_feature(mm) for mm in request.mm_inputs] or None,
        )

    def _kv_transfer_params(self, request: RequestSpec) -> dict[str, Any] | None:
        """The modelled connector's fields of ``request``, as the request's
        kv_transfer_params (vllm_connector.kv_transfer_params)."""
        if not self._connector:
            return None
        from schedspec.adapters.vllm_connector import kv_transfer_params

        return kv_transfer_params(request.kv_external_tokens, request.kv_load_async,
                                  request.kv_save_async)

    def _lora_request(self, lora_id: int) -> Any:
        """Adapter ``lora_id`` as the engine names it: lora_int_id is the id,
        and the name and path (what vLLM's block hashes chain in:
        kv_cache_utils.py, _gen_lora_extra_hash_keys) derive from it, so equal
        ids share blocks and different ones never do."""
        if not lora_id:
            return None
        return self._v.LoRARequest(
            lora_name=f"schedspec-lora-{lora_id}", lora_int_id=lora_id,
            lora_path=f"/schedspec/lora/{lora_id}",
        )

    def _mm_feature(self, mm: MMInput) -> Any:
        """An encoder input as vLLM's input processor hands it over (positions,
        size and identifier; no data: the model runner is not ours)."""
        v = self._v
        return v.MultiModalFeatureSpec(
            data=None, modality="image", identifier=mm.identifier,
            mm_position=v.PlaceholderRange(offset=mm.offset, length=mm.length),
        )

    # ------------------------------------------------------------------ raw timing

    def raw_add(self, request: RequestSpec) -> None:
        """Add ``request`` straight to vLLM's scheduler, without this adapter's
        bookkeeping (a content key per block hash, for its views), which would
        otherwise dominate a memory measurement. A scheduler fed this way is
        stepped with ``raw_step`` only; ``schedule``/``update``/``view`` do
        not know its requests."""
        self.sched.add_request(self.vllm_request(request))

    def raw_step(self, sample: Callable[[int], int]) -> RawStep:
        """One step of vLLM's own ``schedule()`` + ``update_from_output()``,
        bypassing the translation to StepPlans and views: what vLLM's
        scheduling costs. The model output is fake: a request that reaches
        its known tokens samples ``sample(num_tokens)``. Only the two vLLM
        calls are timed, on the wall clock and on the process's CPU clock."""
        wall, cpu = time.perf_counter, time.process_time
        inner = self.sched
        t0, c0 = wall(), cpu()
        out = inner.schedule()
        t1, c1 = wall(), cpu()
        ids = list(out.num_scheduled_tokens)
        reqs = inner.requests
        sampled: list[list[int]] = []
        for rid in ids:
            r = reqs[rid]
            # vLLM advanced num_computed_tokens in schedule(); a step samples
            # when it reaches the request's known tokens.
            sampled.append([sample(r.num_tokens)] if r.num_computed_tokens >= r.num_tokens else [])
        runner_output = self._v.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        t2, c2 = wall(), cpu()
        inner.update_from_output(out, runner_output)
        t3, c3 = wall(), cpu()
        return RawStep(
            wall_s=(t1 - t0) + (t3 - t2),
            cpu_s=(c1 - c0) + (c3 - c2),
            scheduled=len(ids),
            decode=all(n == 1 for n in out.num_scheduled_tokens.values()),
        )

    def abort(self, request_id: str) -> None:
        check_abort(request_id, self._live)
        _into_vllm(self.sched.finish_requests, request_id, self._v.VRequestStatus.FINISHED_ABORTED)
        self._collect_finished([request_id])

    def _plans(self) -> list[StepPlan]:
        return [plan for plan, _ in self._in_flight]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        check_reset(self._plans(), self._config)
        if reset_running_requests and self._connector:
            check_kv_reset(self._blocks_kept_after_reset())
        done = _into_vllm(self.sched.reset_prefix_cache, reset_running_requests=reset_running_requests)
        return bool(done)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan:
        check_schedule(self._plans(), self._config)
        out = _into_vllm(self.sched.schedule)
        self._step += 1
        self._finished = {}
        new = {nr.req_id: nr for nr in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        cached_index = {rid: i for i, rid in enumerate(cached.req_ids)}
        resumed = cached.resumed_req_ids
        for rid in out.preempted_req_ids:  # a resumed request gets its whole table again
            self._tables.pop(rid, None)
        spec_tokens = out.scheduled_spec_decode_tokens
        encoder_inputs = out.scheduled_encoder_inputs
        invalid = out.num_invalid_spec_tokens or {}
        entries = []
        for rid, n in out.num_scheduled_tokens.items():
            req = self._live[rid].req
            drafts = tuple(spec_tokens.get(rid, ()))
            placeholders = req.num_output_placeholders
            if self._async and not req.is_prefill_chunk:
                # AsyncScheduler._update_after_schedule counted this step's own
                # sampled token and drafts already; the plan states the count
                # the step was scheduled with.
                placeholders -= 1 + len(drafts)
            if rid in new:
                kind = ScheduleKind.NEW
                computed = new[rid].num_computed_tokens
                tables = [list(ids) for ids in new[rid].block_ids]
            else:
                i = cached_index[rid]
                computed = cached.num_computed_tokens[i]
                sent = cached.new_block_ids[i]
                if rid in resumed:
                    kind = ScheduleKind.RESUMED
                    tables = [list(ids) for ids in sent] if sent is not None else self._no_tables()
                else:
                    kind = ScheduleKind.RUNNING
                    tables = self._tables.get(rid) or self._no_tables()
                    if sent is not None:
                        tables = [old + list(ids) for old, ids in zip(tables, sent)]
            kept = self._check_tables(rid, tables)
            self._tables[rid] = kept
            entries.append(
                ScheduledRequest.of(rid, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
                                    all_token_ids=req.all_token_ids, block_ids=tuple(kept[0]),
                                    spec_token_ids=drafts, num_output_placeholders=placeholders,
                                    encoder_inputs=tuple(encoder_inputs.get(rid, ())),
                                    num_invalid_spec_tokens=invalid.get(rid, 0),
                                    group_block_ids=(
                                        tuple(tuple(t) for t in kept) if self._hybrid else ()))
            )
        plan = StepPlan(
            step=self._step,
            scheduled=tuple(entries),
            preempted_ids=tuple(sorted(out.preempted_req_ids)),
            finished_ids=tuple(sorted(out.finished_req_ids)),
            freed_encoder_inputs=tuple(out.free_encoder_mm_hashes),
            kv_loads=self._kv_loads(out),
        )
        bs = self._config.block_size
        for load in plan.kv_loads:
            if load.asynchronous:
                first, end = load.start // bs, -(-load.end // bs)
                self._kv_loading[load.request_id] = load.block_ids[first:end]
        self._in_flight.append((plan, out))
        if self._grammars and not (self._async and out.pending_structured_output_tokens):
            # What the engine core does before sampling (core.py, step and
            # step_with_batch_queue): the grammar bitmask of the batch. A plan
            # whose structured-output requests still have tokens in flight
            # gets it after the previous step's update.
            _into_vllm(self.sched.get_grammar_bitmask, out)
        return plan

    def _no_tables(self) -> list[list[int]]:
        return [[] for _ in self._group_blocks_of]

    def _check_tables(self, rid: str, tables: list[list[int]]) -> list[list[int]]:
        """The request's tables as vLLM's KV manager keeps them, after checking
        that they are the ones vLLM sent (the model runner's copy, rebuilt
        from the messages). A sliding-window or chunked-local group's
        manager replaces a block that left the window (the chunk) by the null
        block 0 in place (remove_skipped_blocks) without telling the worker,
        which nulls such entries itself: there the sent table may still name
        the freed block."""
        kept = self._group_tables(rid)
        ok = len(tables) == len(kept) and all(
            len(sent) == len(own) and all(s == k or k == 0 for s, k in zip(sent, own))
            for sent, own in zip(tables, kept)
        )
        if not ok:
            raise VllmAdapterError(
                f"step {self._step}: vLLM sent {rid!r} block tables {tables} that are not "
                f"its own {kept}"
            )
        return kept

    def _blocks_kept_after_reset(self) -> str | None:
        """Why blocks would stay held after reset_prefix_cache preempted every
        running request, or None: vLLM then raises RuntimeError ("Failed to
        reset KV cache even when all the running requests are preempted"),
        which the spec's boundary refuses first (check_kv_reset)."""
        sched = self.sched
        held = sorted(rid for rid, r in sched.requests.items() if r.is_finished())
        if held:
            return f"finished request {held[0]!r} keeps its blocks for the connector"
        for r in sched.kv_holding_waiting:
            if any(self._group_tables(r.request_id)):
                return f"waiting request {r.request_id!r} holds blocks for a KV load"
        # Scheduler._request_blocks_can_be_freed, read through its public fields
        fenced = sched.defer_block_free and any(r.last_sched_seq > sched.processed_step_seq for r in sched.running)
        if sched.deferred_frees or fenced:
            return "a step in flight still writes blocks whose free is deferred (defer_block_free)"
        return None

    def _kv_loads(self, out: Any) -> tuple[KVLoad, ...]:
        """The connector's loads of this step (its metadata, built by vLLM's
        schedule(): _build_kv_connector_meta), in admission order."""
        meta = getattr(out, "kv_connector_metadata", None)
        if meta is None:
            return ()
        return tuple(
            KVLoad(
                request_id=load.request_id,
                start=load.start,
                end=load.end,
                block_ids=load.group_block_ids[0],
                asynchronous=load.asynchronous,
                group_block_ids=load.group_block_ids if self._hybrid else (),
            )
            for load in meta.loads
        )

    # ------------------------------------------------------------------ update

    def _check_result(self, plan: StepPlan, result: StepResult) -> Any:
        """The spec's protocol checks, so a bad update never reaches vLLM;
        vLLM's SchedulerOutput for ``plan`` (the oldest in flight)."""
        check_result(plan, self._plans(), result, self._live, self._config)
        if self._connector:
            sched = self.sched
            held = {rid for rid, r in sched.requests.items() if r.is_finished()}
            running = {r.request_id for r in sched.running}
            check_kv_reports(plan, result, self._config, self._kv_loading, held, running)
        return self._in_flight[0][1]

    def update(self, plan: StepPlan, result: StepResult) -> None:
        out = self._check_result(plan, result)
        ids = [s.request_id for s in plan.scheduled]
        runner_output = self._v.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[list(result.sampled.get(rid, ())) for rid in ids],
            kv_connector_output=self._kv_connector_output(result),
        )
        self._in_flight.pop(0)
        for rid in result.finished_recving:
            self._kv_loading.pop(rid, None)
        _into_vllm(self.sched.update_from_output, out, runner_output)
        if self._async and self._in_flight:
            deferred = self._in_flight[0][1]
            if deferred.pending_structured_output_tokens:
                self._deferred_bitmask(deferred, plan, result)
        if self._drafts and ids:
            # What EngineCore.post_step hands over after a step that ran: the
            # worker's proposals for every request of the batch.
            drafts = result.draft_token_ids
            _into_vllm(self.sched.update_draft_token_ids, self._v.DraftTokenIds(
                req_ids=list(ids), draft_token_ids=[list(drafts.get(rid, ())) for rid in ids]))
        for rid in ids:
            live = self._live.get(rid)
            if live is not None:
                self._record_keys(live)
        if self._connector:
            # a failed load under the "fail" policy finishes requests that
            # were not scheduled (update_from_output, failed_kv_load_req_ids)
            self._collect_finished(list(self._live))
        else:
            self._collect_finished(ids)
        if self._grammars:
            # a grammar that failed to compile finishes its request here
            # (update_from_output, grammar_compile_error_reqs)
            self._collect_finished([rid for rid in self._grammars if rid in self._live])
            self._grammars = {rid: f for rid, f in self._grammars.items() if rid in self._live}
        if len(self._keys) > self._prune_at:
            self._prune_keys()

    def _kv_connector_output(self, result: StepResult) -> Any:
        """The worker's connector reports of ``result`` as vLLM's
        KVConnectorOutput (what the model runner puts in
        ModelRunnerOutput.kv_connector_output), None when there are none."""
        if not (result.finished_recving or result.finished_sending or result.failed_recving
                or result.invalid_block_ids):
            return None
        return self._v.KVConnectorOutput(
            finished_sending=_SortedSet(result.finished_sending) or None,
            finished_recving=_SortedSet(result.finished_recving) or None,
            failed_recving=_SortedSet(result.failed_recving),
            invalid_block_ids=_SortedSet(result.invalid_block_ids),
        )

    def _deferred_bitmask(self, deferred: Any, plan: StepPlan, result: StepResult) -> None:
        """The engine core's deferred sampling of an async plan whose
        structured-output requests had tokens in flight (core.py,
        step_with_batch_queue): once the previous step's output is in, the
        worker's drafts for the plan are checked against the grammar
        (update_draft_token_ids_in_output: refused drafts become -1 and count
        in num_invalid_spec_tokens) and the bitmask is computed."""
        if self._config.num_speculative_tokens:
            ids = [s.request_id for s in plan.scheduled]
            drafts = result.draft_token_ids
            _into_vllm(self.sched.update_draft_token_ids_in_output, self._v.DraftTokenIds(
                req_ids=list(ids), draft_token_ids=[list(drafts.get(rid, ())) for rid in ids]),
                deferred)
        _into_vllm(self.sched.get_grammar_bitmask, deferred)

    def _collect_finished(self, candidates: list[str]) -> None:
        """Move requests vLLM has finished (and forgotten) into ``finished``."""
        for rid in candidates:
            live = self._live.get(rid)
            if live is None or not live.req.is_finished():
                continue
            del self._live[rid]
            self._tables.pop(rid, None)
            self._finished[rid] = self._request_view(live, finished=True)

    # ------------------------------------------------------------------ keys

    def _record_keys(self, live: _Live) -> None:
        """Remember which content every new block hash of the request stands
        for: (salt, all tokens through that block)."""
        hashes = live.req.block_hashes
        if live.num_hashed == len(hashes):
            return
        bs = self._config.block_size
        tokens = live.req.all_token_ids
        for i in range(live.num_hashed, len(hashes)):
            end = (i + 1) * bs
            key: BlockKey = (live.spec.block_identity(end), tuple(tokens[:end]))
            known = self._keys.setdefault(hashes[i], key)
            if known != key:
                raise VllmAdapterError(f"vLLM block hash collision: {known} and {key}")
        live.num_hashed = len(hashes)

    def _prune_keys(self) -> None:
        """Keep only the keys of hashes vLLM can still show us: those in its
        prefix cache and those of live requests (a request added later records
        its own again), so a long run does not hold every prefix it ever saw."""
        get_block_hash = self._v.get_block_hash
        pool = self.sched.kv_cache_manager.block_pool
        keep = {get_block_hash(h) for h in pool.cached_block_hash_to_block._cache}
        for live in self._live.values():
            keep.update(live.req.block_hashes[: live.num_hashed])
        self._keys = {h: k for h, k in self._keys.items() if h in keep}
        self._prune_at = max(4096, 2 * len(self._keys))

    def _key(self, hash_with_group: bytes) -> BlockKey:
        """The content key of a cached block: its block hash's content, of
        its KV cache group (group_block_key; group 0's keys as always)."""
        key = self._keys.get(self._v.get_block_hash(hash_with_group))
        if key is None:
            raise VllmAdapterError(f"vLLM holds a block hash {hash_with_group.hex()} of no known request")
        return group_block_key(key, self._v.get_group_id(hash_with_group))

    # ------------------------------------------------------------------ view

    def _table(self, rid: str) -> list[int]:
        """The request's block table as vLLM's KV manager keeps it. Read with
        .get: the manager's defaultdict must not grow an entry."""
        blocks = self._blocks_of.get(rid)
        return [b.block_id for b in blocks] if blocks else []

    def _group_tables(self, rid: str) -> list[list[int]]:
        """Every group's block table of the request, in group order (a
        sliding-window or chunked-local group's with the null block 0 where
        it freed one)."""
        out = []
        for blocks_of in self._group_blocks_of:
            blocks = blocks_of.get(rid)
            out.append([b.block_id for b in blocks] if blocks else [])
        return out

    def _held_by_finished(self) -> dict[str, tuple[int, ...]]:
        """Finished requests vLLM keeps in Scheduler.requests because their
        blocks are not freed yet (an asynchronous save not yet reported, or an
        abort or failure during an asynchronous load not yet reported:
        _free_request with delay_free_blocks), with the blocks they hold:
        group 0's table, then the other groups' (null entries left out)."""
        held: dict[str, tuple[int, ...]] = {}
        for rid, req in self.sched.requests.items():
            if req.is_finished():
                held[rid] = tuple(b for t in self._group_tables(rid) for b in t if b != 0)
        return dict(sorted(held.items()))

    def _status(self, req: Any) -> RequestStatus:
        status = self._statuses.get(req.status)
        if status is None:
            raise VllmAdapterError(
                f"request {req.request_id!r} is in vLLM state {req.status.name}, outside the "
                "modelled configuration"
            )
        return status

    def _request_view(self, live: _Live, finished: bool = False) -> RequestView:
        s, req = live.spec, live.req
        groups: tuple[tuple[int, ...], ...] = ()
        if finished:
            blocks: tuple[int, ...] = ()
        elif self._hybrid:
            groups = tuple(tuple(t) for t in self._group_tables(s.request_id))
            blocks = groups[0]
        else:
            blocks = tuple(self._table(s.request_id))
        return RequestView.of(
            s,
            status=self._status(req),
            output_token_ids=tuple(req.output_token_ids),
            num_computed_tokens=req.num_computed_tokens,
            block_ids=blocks,
            num_preemptions=req.num_preemptions,
            num_output_placeholders=req.num_output_placeholders,
            spec_token_ids=tuple(req.spec_token_ids),
            # read by the prefill cadence only (scheduler.py, schedule:
            # defer_prefills) and only of unfinished requests; reported with
            # it on
            is_prefill_chunk=(bool(req.is_prefill_chunk) and not finished
                              and self._config.prefill_schedule_interval > 1),
            group_block_ids=groups,
        )

    def _encoder_view(self) -> tuple[dict[str, int], int]:
        """The encoder cache: every cached output (referenced or freeable, not
        yet evicted) with its embeddings, and the free space."""
        if not self._config.has_encoder:
            return {}, 0
        ecm = self.sched.encoder_cache_manager
        return dict(ecm.num_embeds_by_hash), ecm.num_free_slots

    def _kv_view(self) -> KVView:
        pool = self.sched.kv_cache_manager.block_pool
        if pool.cached_block_hashes_by_block:
            raise VllmAdapterError("vLLM registered partial-block hashes, outside the modelled configuration")
        ref_cnt = tuple(0 if b.is_null else b.ref_cnt for b in pool.blocks)
        free_queue = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
        block_keys = {
            b.block_id: self._key(b.block_hash) for b in pool.blocks if b.block_hash is not None
        }
        cache_index: dict[BlockKey, tuple[int, ...]] = {}
        for h, held in pool.cached_block_hash_to_block._cache.items():
            if isinstance(held, self._v.KVCacheBlock):
                ids: tuple[int, ...] = (held.block_id,)
            else:
                ids = tuple(held)  # dict block_id -> block, in insertion (lookup) order
            if ids:
                cache_index[self._key(h)] = ids
        return KVView(
            num_blocks=self._config.num_blocks,
            block_size=self._config.block_size,
            ref_cnt=ref_cnt,
            free_queue=free_queue,
            block_keys=block_keys,
            cache_index=cache_index,
        )

    def view(self) -> SchedulerView:
        sched = self.sched
        for rid in self._live:
            if rid not in sched.requests:
                raise VllmAdapterError(f"vLLM dropped request {rid!r} without finishing it")
        waiting = tuple(r.request_id for r in sched.kv_holding_waiting) + tuple(
            r.request_id for r in sched.waiting
        )
        encoder_cache, encoder_free = self._encoder_view()
        cadence = self._config.prefill_schedule_interval > 1
        return SchedulerView(
            config=self._config,
            step=self._step,
            requests={rid: self._request_view(live) for rid, live in self._live.items()},
            waiting=waiting,
            running=tuple(r.request_id for r in sched.running),
            kv=self._kv_view(),
            finished=dict(self._finished),
            preempted_since_plan=tuple(sorted(sched.reset_preempted_req_ids)),
            pause_state=PauseState(int(sched.pause_state)),
            encoder_cache=encoder_cache,
            encoder_cache_free=encoder_free,
            # vLLM counts executed steps and notes a backed-up queue always,
            # and stamps the last prefill step only with a cadence; without
            # one none of them has any effect
            num_executed_steps=sched.num_executed_steps if cadence else 0,
            last_prefill_step=sched.last_prefill_step if cadence else -1,
            prefill_capacity_bound=bool(sched.prefill_capacity_bound) if cadence else False,
            kv_held_by_finished=self._held_by_finished() if self._connector else {},
            kv_loads_done=tuple(sorted(sched.finished_recving_kv_req_ids)),
            kv_loads_failed=tuple(sorted(sched.failed_recving_kv_req_ids)),
        )
