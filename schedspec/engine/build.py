"""Building vLLM's engine on the CPU, step by step (engine's side).

The engine arguments that work on the CPU, and why (docs/engine.md):
- ``block_size`` a multiple of 32: the CPU attention backend takes no other;
- ``num_gpu_blocks_override``: sets the KV pool on the CPU too; it counts the
  null block, so ``num_blocks - 1`` blocks are usable;
- ``skip_tokenizer_init``: the model has no tokenizer; prompts are token ids;
- ``dtype="float32"``: the reference precision; chunked prefill still changes
  logprobs at the fp32-noise level (the CPU attention is not batch-invariant),
  so tokens are compared exactly and logprobs within a tolerance;
- the engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  schedspec.engine.env.ENGINE_ENVIRON), so ``LLMEngine.step()`` is one
  schedule, forward and update, and requests can arrive between steps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from schedspec.engine.env import ENGINE_ENVIRON

#: the engine arguments every run starts from; a variant overrides some
BASE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "block_size": 32,
    "num_gpu_blocks_override": 129,
    "max_model_len": 1024,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 2048,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
    "async_scheduling": False,
    "seed": 0,
}


def build_engine(model_dir: Path, scheduler_cls: Any = None, **overrides: Any) -> Any:
    """An ``LLMEngine`` on the model at ``model_dir`` with BASE_ARGS and
    ``overrides``; ``scheduler_cls`` (a class or a dotted path) replaces
    vLLM's scheduler. The live scheduler is then
    ``engine.engine_core.engine_core.scheduler``."""
    for key, value in ENGINE_ENVIRON.items():
        os.environ.setdefault(key, value)
    from vllm import EngineArgs, LLMEngine

    args = dict(BASE_ARGS)
    args.update(overrides)
    if scheduler_cls is not None:
        args["scheduler_cls"] = scheduler_cls
    if args["block_size"] % 32:
        raise ValueError(f"block_size {args['block_size']}: vLLM's CPU attention needs a multiple of 32")
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), **args))


def live_scheduler(engine: Any) -> Any:
    """The scheduler object of an in-process engine."""
    return engine.engine_core.engine_core.scheduler
