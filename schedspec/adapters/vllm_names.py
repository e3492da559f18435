"""vLLM 0.33's names the adapter uses, imported in one place.

Importing this module imports vLLM and torch, after ``prepare()`` has pinned
vLLM's environment and checked its version (schedspec/adapters/vllm_env.py);
the adapter reaches it through ``load_vllm()`` and imports it inside the
functions that use vLLM, never at module level. It also does, once per
process, what vLLM's engine does before its scheduler hashes a block
(``init_none_hash``), and writes the tiny model's config.json (MODEL_DIR).
"""

from __future__ import annotations

from typing import Any, Callable

from schedspec.adapters.vllm_env import prepare, tiny_model_dir

prepare()

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.config import SchedulerConfig as VllmSchedulerConfig  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.interface import PauseState as VPauseState  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.request import RequestStatus as VRequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

__all__ = [
    "AsyncScheduler", "BlockHashWithGroupId", "CacheConfig", "ChunkedLocalAttentionSpec", "DeviceConfig", "DraftTokenIds",
    "EncoderCacheManager", "FullAttentionSpec", "KVCacheBlock", "KVCacheConfig", "KVCacheGroupSpec",
    "KVConnectorOutput", "MambaSpec", "KVTransferConfig", "LoRAConfig", "LoRARequest", "MODEL_DIR", "ModelConfig",
    "ModelRunnerOutput", "MultiModalFeatureSpec", "PlaceholderRange", "Request", "SamplingParams",
    "Scheduler", "SlidingWindowSpec", "SpeculativeConfig", "StructuredOutputManager",
    "StructuredOutputsParams", "VPauseState", "VRequestStatus", "VllmConfig", "VllmSchedulerConfig",
    "block_hasher", "float32", "get_block_hash", "get_group_id", "register_all_kvcache_specs", "torch",
    # the KV cache events (schedspec/adapters/vllm_events.py)
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventsConfig",
    # pipeline parallelism (schedspec/adapters/vllm_config.py)
    "ParallelConfig",
]

init_none_hash(sha256)

#: the tiny model vLLM's ModelConfig reads (vllm_env._TINY_LLAMA)
MODEL_DIR: str = tiny_model_dir()

float32 = torch.float32


def block_hasher(block_size: int, hash_lookahead: int = 0) -> Callable[[Any], Any]:
    """vLLM's request block hasher for ``block_size`` (SHA-256, as configured),
    each hash covering ``hash_lookahead`` tokens past its block as the engine
    builds it (vllm/v1/engine/core.py: VllmConfig.num_hash_lookahead_tokens)."""
    if not hash_lookahead:  # vLLM 0.32's engine takes no lookahead argument
        return get_request_block_hasher(block_size, sha256)
    return get_request_block_hasher(block_size, sha256, hash_lookahead)
