"""Building vLLM's engine on the CPU, step by step (engine's side).

The engine arguments that work on the CPU, and why (docs/engine.md):
- ``block_size`` a multiple of 32: the CPU attention backend takes no other;
- ``num_gpu_blocks_override``: sets the KV pool on the CPU too; it counts the
  null block, so ``num_blocks - 1`` blocks are usable;
- ``skip_tokenizer_init``: the model has no tokenizer; prompts are token ids;
- ``gpu_memory_utilization=0.1``: on the CPU, the share of the machine's
  memory the engine must find free at start; the default 0.92 is refused on a
  shared machine, and the pool is ``num_gpu_blocks_override``'s anyway;
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
    "gpu_memory_utilization": 0.1,
}

_built = False


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
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), **args))
    _register_kernels_once()
    return engine


def _register_kernels_once() -> None:
    """vLLM 0.32's CPU platform rebinds its C++ stand-ins for the Triton
    kernels on every engine build, and a second rebind in one process fails
    ("'_lib_fn_wrapper' object has no attribute 'get'"): once one engine has
    registered them, later builds skip it."""
    global _built
    if _built:
        return
    from vllm.platforms import current_platform

    setattr(type(current_platform), "register_triton_kernel_overrides", classmethod(lambda cls: None))
    _built = True


def completion_record(output: Any) -> dict[str, Any]:
    """A RequestOutput's first completion: its token ids and the chosen
    tokens' logprobs (the request asked for one logprob)."""
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = completion.logprobs or []
    return {"tokens": tokens, "logprobs": [float(lp[t].logprob) for t, lp in zip(tokens, logprobs)]}


def live_scheduler(engine: Any) -> Any:
    """The scheduler object of an in-process engine."""
    return engine.engine_core.engine_core.scheduler


_KEEPING_ASYNC = False


def keep_async_scheduling() -> None:
    """Engine side, once per process: vLLM 0.32's CPU platform turns async
    scheduling off whatever the engine's arguments say (platforms/cpu.py,
    CpuPlatform.check_and_update_config: "async scheduling is not required
    on CPU"); this restores the arguments' value after that hook, so the
    engine core runs its batch queue of two (EngineCore.step_with_batch_queue)
    with vLLM's AsyncScheduler, as on a GPU. The CPU model runner runs it."""
    global _KEEPING_ASYNC
    if _KEEPING_ASYNC:
        return
    from vllm.platforms import current_platform

    platform = type(current_platform)
    hook: Any = getattr(platform.check_and_update_config, "__func__")

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    setattr(platform, "check_and_update_config", classmethod(check_and_update_config))
    _KEEPING_ASYNC = True
