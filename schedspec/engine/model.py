"""The engine's default model: a seeded tiny Llama in the Hugging Face
format, fp32, made locally (no hub).

Its shape, and why:
- head_dim 64: vLLM's CPU attention refuses smaller heads ("Unsupported CPU
  attention configuration");
- 2 layers, hidden 128, 2 query heads over 1 KV head (grouped-query
  attention, as the models vLLM serves), vocab 512: a step costs
  milliseconds;
- initializer_range 0.3 instead of Llama's 0.02: with the usual range the
  logits are nearly flat (a median top-1/top-2 margin of 0.06 on random
  prompts), so fp32 noise between batch shapes could flip a greedy token;
  at 0.3 the median margin is 0.78, about a million times the noise the CPU
  attention shows between batch shapes (about 5e-7);
- untied embeddings, max_position_embeddings 2048.

Runs on the engine's side: imports torch and transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: bump when the shape or the seed changes: the directory name carries it
MODEL_NAME = "schedspec-tiny-llama-v1"
SEED = 0
CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "initializer_range": 0.3,
    "tie_word_embeddings": False,
}


def default_model_dir() -> Path:
    """$SCHEDSPEC_ENGINE_MODEL_DIR, else the user's cache."""
    explicit = os.environ.get("SCHEDSPEC_ENGINE_MODEL_DIR")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")))
    return cache / "schedspec" / "engine-models" / MODEL_NAME


def ensure_model(path: Path | None = None) -> Path:
    """The default model at ``path`` (made there when missing): weights drawn
    from torch's generator seeded with SEED, saved as safetensors."""
    target = path or default_model_dir()
    marker = target / "schedspec-model.json"
    if marker.exists():
        return target
    import importlib

    import torch

    transformers: Any = importlib.import_module("transformers")  # the engine's own version
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**CONFIG, torch_dtype="float32")
    model = transformers.LlamaForCausalLM(config).eval()
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(target), safe_serialization=True)
    marker.write_text(json.dumps({"name": MODEL_NAME, "seed": SEED, "config": CONFIG}, indent=1))
    return target
