"""What vLLM 0.33.0 must find before it is imported: its environment pinned,
its loggers quiet, the pinned version installed, and the tiny model it reads.
schedspec.adapters.vllm_names calls ``prepare()`` before its imports.
Importing this module imports neither vLLM nor torch."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from schedspec.spec.interface import SchedSpecError

VLLM_VERSION = "0.33.0"
#: the versions prepare() accepts: VLLM_VERSION, and the engine's older one
#: once accept_version() named it (a captured trace replayed on the engine's
#: own scheduler, schedspec/engine/replay.py)
_ACCEPTED: set[str] = {VLLM_VERSION}


def accept_version(version: str) -> None:
    """Let prepare() accept ``version`` besides VLLM_VERSION. Only for the
    engine's side: a captured trace replayed on the scheduler of the vLLM
    that recorded it; fields that version lacks are not compared."""
    _ACCEPTED.add(version)


class VllmUnavailable(SchedSpecError, ImportError):
    """vLLM (or the exact pinned version of it) is not installed."""


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


def _drop_kv_failure_records(record: logging.LogRecord) -> bool:
    """A logging filter: False for vLLM's record of requests failed by a KV
    load failure (the modelled "fail" policy), True for every other one."""
    return not str(record.msg).startswith("Failing %d request(s) due to KV load failure")


def prepare() -> None:
    """What must hold before vLLM is imported: its environment pinned, its
    loggers quiet, and vLLM importable at exactly VLLM_VERSION (else
    VllmUnavailable with a pointer to scripts/install_vllm.sh).
    schedspec.adapters.vllm_names calls it before its imports."""
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
    if getattr(vllm, "__version__", None) not in _ACCEPTED:
        raise VllmUnavailable(
            f"vLLM {VLLM_VERSION} is required, found {getattr(vllm, '__version__', '?')}; "
            "install it with scripts/install_vllm.sh VENV"
        )


def tiny_model_dir() -> str:
    """A temporary folder holding the tiny Llama's config.json (removed at exit)."""
    import atexit
    import json
    import shutil

    model_dir = tempfile.mkdtemp(prefix="schedspec-tiny-llama-")
    atexit.register(shutil.rmtree, model_dir, True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(_TINY_LLAMA, f)
    return model_dir
