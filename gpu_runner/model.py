"""A Llama-family decoder whose KV cache is paged.

The model is a plain set of float32 tensors (``LlamaWeights``) and two forward
functions over one flattened step batch (``StepBatch``): every scheduled token
of every request, prefill chunks and decodes mixed. Each layer first writes the
step's keys and values into their slots of the paged cache
``[layers, num_blocks, block_size, kv_heads, head_dim]`` and then attends, for
each token, over its own request's positions ``0 .. pos`` found through the
request's block table.

Two modes:

``exact``
    Batch invariant. Every per-token computation runs in tiles of a fixed
    number of rows (``tile_rows``, padded with dummy rows), so each matmul,
    reduction and softmax is always the same kernel call on the same shapes,
    whatever the batch composition and chunk boundaries. Attention reads a
    fixed window of ``window`` keys (positions ``0 .. window-1`` through the
    block table, later positions masked to ``-inf``), so its reductions have a
    fixed length and order too. Elementwise operations are either correctly
    rounded IEEE operations (add, mul, div, sqrt) or run on rows whose length
    is a multiple of 64 (the SwiGLU hidden size is zero-padded), so no element
    ever falls into a scalar "tail" loop that rounds differently from the
    vector body. The result: a token's logits are bitwise identical however it
    was batched. ``tests/gpu_runner/test_gpu_runner.py`` proves it on the machine it
    runs on.

``fast``
    Ordinary batched kernels: one matmul over all tokens, attention per request
    over exactly its context. Tokens usually agree; logits agree within a
    tolerance that the equivalence report states.

Hybrid KV cache groups: ``PagedLlama(sliding_window=W)`` gives some layers
(``sw_layers``) a sliding window of W positions, ``PagedLlama(chunked_local=C)``
some layers (``cl_layers``) chunked local attention (a token attends only the
earlier positions of its own chunk of C positions), both together a layout of
full, sliding-window and chunked-local layers (``layer_pattern``); each layer
belongs to a KV cache group (``layer_group``: the full-attention layers, then
the sliding-window ones, then the chunked-local ones; ``group_attn`` says how
each group attends) and reads and writes the cache through that group's block
tables (``StepBatch.slots_of`` / ``keys_of``), all groups sharing the block
ids of the one pool.

torch is imported here and only inside ``schedspec.gpu_runner``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F

from schedspec.gpu_runner.attention_kinds import (
    ATTENTION,
    CHUNKED_LOCAL,
    FULL_ATTENTION,
    SLIDING_WINDOW,
    AttentionKind,
    attention_of,
)

Mode = Literal["exact", "fast"]
RopeStyle = Literal["half", "interleaved"]

#: Rows of an elementwise tensor in exact mode are padded to a multiple of this,
#: so vectorised loops never leave a scalar remainder inside a row.
VECTOR_PAD = 64


class ModelError(ValueError):
    """A model configuration or checkpoint is unusable; the message says why."""


#: cuBLAS picks its workspace (and with it some reduction splits) by this; a
#: fixed config makes its fp32 GEMMs run-to-run deterministic. It is read when
#: the cuBLAS handle is created, so it must be set before the first CUDA matmul.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"

#: A capture hook: called with a capture point's name and its tensor.
Capture = Callable[[str, torch.Tensor], None]


def set_cuda_determinism(deterministic_algorithms: bool = False) -> None:
    """What batch-invariant, bitwise logits need on CUDA, set before the first
    CUDA op: a fixed cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``, setdefault:
    a value already in the environment is kept), TF32 off, cuDNN deterministic,
    no reduced-precision reductions in fp16/bf16 GEMMs; and, opt-in,
    ``torch.use_deterministic_algorithms(True)`` (which raises on an op with no
    deterministic implementation; index_copy_ and index_select have one)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if deterministic_algorithms:
        torch.use_deterministic_algorithms(True)


def determinism_facts(device: torch.device | str) -> dict[str, Any]:
    """The settings in force and the machine, for reports: torch and CUDA
    versions, the device's name, and each determinism setting's value."""
    dev = torch.device(device)
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
    }
    if dev.type == "cuda":
        facts.update({
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "fp16_reduced_precision": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            "bf16_reduced_precision": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        })
    return facts


def describe_facts(facts: dict[str, Any]) -> str:
    """One line of ``determinism_facts``."""
    parts = [f"torch {facts.get('torch')}", f"CUDA {facts.get('cuda')}", f"{facts.get('device_name')}"]
    keys = ("CUBLAS_WORKSPACE_CONFIG", "tf32_matmul", "tf32_cudnn", "cudnn_deterministic",
            "fp16_reduced_precision", "bf16_reduced_precision", "deterministic_algorithms")
    parts += [f"{k}={facts[k]}" for k in keys if k in facts]
    return ", ".join(parts)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    rope_style: RopeStyle = "half"
    max_position: int = 2048
    name: str = "llama"

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelError(f"model config {f} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_style not in ("half", "interleaved"):
            raise ModelError(f"rope_style must be 'half' or 'interleaved', got {self.rope_style!r}")
        if not self.rope_theta > 0 or not self.rms_norm_eps >= 0:
            raise ModelError("rope_theta must be positive and rms_norm_eps non-negative")

    @property
    def num_params(self) -> int:
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * i
        return v * d * (1 if self.tie_embeddings else 2) + d + self.num_layers * per_layer


@dataclass
class LayerWeights:
    """One decoder layer, in ``F.linear`` layout ([out, in])."""

    attn_norm: torch.Tensor  # [D]
    wqkv: torch.Tensor  # [(H + 2 KVH) * Dh, D]
    wo: torch.Tensor  # [D, H * Dh]
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: torch.Tensor  # [2 * I_pad, D]: gate rows then up rows, zero-padded
    w_down: torch.Tensor  # [D, I_pad], zero-padded columns


@dataclass
class LlamaWeights:
    """All parameters of a model, float32, on one device."""

    config: ModelConfig
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]; the same tensor as ``embed`` when tied
    intermediate_padded: int = 0
    source: str = ""

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, device: torch.device | str) -> LlamaWeights:
        dev = torch.device(device)
        embed = self.embed.to(dev)
        lm_head = embed if self.lm_head is self.embed else self.lm_head.to(dev)
        layers = [
            LayerWeights(
                attn_norm=lw.attn_norm.to(dev),
                wqkv=lw.wqkv.to(dev),
                wo=lw.wo.to(dev),
                mlp_norm=lw.mlp_norm.to(dev),
                w_gate_up=lw.w_gate_up.to(dev),
                w_down=lw.w_down.to(dev),
            )
            for lw in self.layers
        ]
        return LlamaWeights(
            self.config, embed, layers, self.norm.to(dev), lm_head, self.intermediate_padded, self.source
        )


@dataclass(frozen=True)
class RawLayer:
    """One layer as loaders hand it over, in ``F.linear`` layout, RoPE rows in
    the order the config's ``rope_style`` expects."""

    attn_norm: torch.Tensor
    wq: torch.Tensor  # [H * Dh, D]
    wk: torch.Tensor  # [KVH * Dh, D]
    wv: torch.Tensor  # [KVH * Dh, D]
    wo: torch.Tensor  # [D, H * Dh]
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor  # [I, D]
    w_up: torch.Tensor  # [I, D]
    w_down: torch.Tensor  # [D, I]


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def build_weights(
    config: ModelConfig,
    embed: torch.Tensor,
    layers: list[RawLayer],
    norm: torch.Tensor,
    lm_head: torch.Tensor | None,
    source: str = "",
) -> LlamaWeights:
    """Check shapes, convert to float32, fuse QKV and gate/up, pad the SwiGLU
    hidden size to a multiple of ``VECTOR_PAD`` with zeros (which changes no
    value: silu(0) * 0 = 0 and the padded down-projection columns are 0)."""
    c = config
    d, dh = c.hidden_size, c.head_dim
    q_out, kv_out = c.num_heads * dh, c.num_kv_heads * dh

    def f32(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != shape:
            raise ModelError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        out = t.detach().to(torch.float32).contiguous()
        if not bool(torch.isfinite(out).all()):
            raise ModelError(f"{name}: contains a non-finite value")
        return out

    if len(layers) != c.num_layers:
        raise ModelError(f"expected {c.num_layers} layers, got {len(layers)}")
    i_pad = _round_up(c.intermediate_size, VECTOR_PAD)
    pad_rows = i_pad - c.intermediate_size
    out_layers: list[LayerWeights] = []
    for n, raw in enumerate(layers):
        p = f"layer {n}"
        wq = f32(f"{p} wq", raw.wq, (q_out, d))
        wk = f32(f"{p} wk", raw.wk, (kv_out, d))
        wv = f32(f"{p} wv", raw.wv, (kv_out, d))
        gate = f32(f"{p} w_gate", raw.w_gate, (c.intermediate_size, d))
        up = f32(f"{p} w_up", raw.w_up, (c.intermediate_size, d))
        down = f32(f"{p} w_down", raw.w_down, (d, c.intermediate_size))
        zeros_rows = gate.new_zeros(pad_rows, d)
        out_layers.append(
            LayerWeights(
                attn_norm=f32(f"{p} attn_norm", raw.attn_norm, (d,)),
                wqkv=torch.cat([wq, wk, wv], 0).contiguous(),
                wo=f32(f"{p} wo", raw.wo, (d, q_out)),
                mlp_norm=f32(f"{p} mlp_norm", raw.mlp_norm, (d,)),
                w_gate_up=torch.cat([gate, zeros_rows, up, zeros_rows], 0).contiguous(),
                w_down=torch.cat([down, down.new_zeros(d, pad_rows)], 1).contiguous(),
            )
        )
    emb = f32("embed", embed, (c.vocab_size, d))
    if c.tie_embeddings:
        head = emb
    else:
        if lm_head is None:
            raise ModelError("untied embeddings need an lm_head")
        head = f32("lm_head", lm_head, (c.vocab_size, d))
    return LlamaWeights(c, emb, out_layers, f32("norm", norm, (d,)), head, i_pad, source)


# --------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------


def rope_tables(config: ModelConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * theta_i``, ``theta_i = base^(-2i/Dh)``, computed in
    float64 and rounded once to float32; shape [length, Dh/2]."""
    dh = config.head_dim
    i = torch.arange(dh // 2, dtype=torch.float64)
    theta = config.rope_theta ** (-2.0 * i / dh)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), theta)
    return angles.cos().to(torch.float32).to(device), angles.sin().to(torch.float32).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle) -> torch.Tensor:
    """x: [N, heads, Dh]; cos, sin: [N, Dh/2]. ``half`` rotates (x_i, x_{i+Dh/2})
    pairs (Hugging Face's rotate_half); ``interleaved`` rotates adjacent pairs
    (x_{2i}, x_{2i+1}) as glassllm and GPT-J do. Only correctly rounded
    elementwise operations, so the result does not depend on the batch."""
    c = cos[:, None, :]
    s = sin[:, None, :]
    if style == "half":
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


# --------------------------------------------------------------------------
# The step batch and the paged cache
# --------------------------------------------------------------------------


@dataclass
class PagedKVCache:
    """K and V, each [layers, num_blocks, block_size, kv_heads, head_dim],
    and the recurrent states of a state layer (Mamba), [layers, num_blocks,
    kv_heads * head_dim]: one state per block. Block 0 is the null block: it
    stays zero."""

    k: torch.Tensor
    v: torch.Tensor
    state: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, states: bool = False
    ) -> PagedKVCache:
        """Zeroed planes; ``states``: the state planes too (a model with a
        state layer)."""
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return cls(
            torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros(config.num_layers, num_blocks, config.num_kv_heads * config.head_dim,
                        dtype=torch.float32, device=device) if states else None,
        )

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[2])

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer views [num_blocks * block_size, kv_heads, head_dim] (slot-major)."""
        k = self.k[layer]
        v = self.v[layer]
        return k.view(-1, k.shape[-2], k.shape[-1]), v.view(-1, v.shape[-2], v.shape[-1])


@dataclass
class StepBatch:
    """One step, flattened: ``N`` tokens of ``R`` requests, request-contiguous.

    ``key_slots[r, j]`` is the cache slot of request r's position j for
    ``j < window`` (slot 0, in the null block, past the end of its table);
    ``seq_start/seq_len`` give each request's computed tokens in the flat
    batch, ``ctx_len`` its context length after the step.
    """

    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64, where each token's K/V is written
    token_request: torch.Tensor  # [N] int64, index into the request axis
    key_slots: torch.Tensor  # [R, window] int64
    seq_start: list[int]
    seq_len: list[int]
    ctx_len: list[int]
    logit_rows: torch.Tensor  # [S] int64, rows whose logits are wanted
    window: int
    #: hybrid KV cache groups: per group after the first, its slot mapping
    #: ([N]) and key slots ([R, window]) through that group's block tables
    #: (``slot_mapping`` and ``key_slots`` are group 0's)
    group_slot_mapping: tuple[torch.Tensor, ...] = ()
    group_key_slots: tuple[torch.Tensor, ...] = ()
    #: per KV cache group that keeps a state (Mamba), else empty: per
    #: request, the block whose state the step starts from (0, the null
    #: block's zero state, for a request at position 0) and the block the
    #: state after its last token is written to
    state_read: tuple[tuple[int, ...], ...] = ()
    state_write: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def slots_of(self, group: int) -> torch.Tensor:
        """Where the step's K/V of a layer of KV cache group ``group`` go."""
        return self.slot_mapping if group == 0 else self.group_slot_mapping[group - 1]

    def keys_of(self, group: int) -> torch.Tensor:
        """The key slots [R, window] a layer of KV cache group ``group`` reads."""
        return self.key_slots if group == 0 else self.group_key_slots[group - 1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, per row."""
    ms = (x * x).mean(dim=-1, keepdim=True)
    return x / torch.sqrt(ms + eps) * weight


def mlp(x: torch.Tensor, lw: LayerWeights, i_pad: int, eps: float) -> torch.Tensor:
    """A layer's MLP block: RMSNorm, then SwiGLU over the zero-padded hidden size."""
    h = rms_norm(x, lw.mlp_norm, eps)
    gu = F.linear(h, lw.w_gate_up)
    act = F.silu(gu[:, :i_pad]) * gu[:, i_pad:]
    return F.linear(act, lw.w_down)


#: Which layers a sliding window (``sw_layers``) or chunked local attention
#: (``cl_layers``) applies to, when one of the two is on alone.
SW_LAYERS = ("odd", "even", "all")
#: The attention of a layer, by its letter in a ``layer_pattern``: vLLM's
#: FullAttentionSpec, SlidingWindowSpec and ChunkedLocalAttentionSpec
#: (gpu_runner/attention_kinds.py).
LAYER_LETTERS = {k.letter: k.name for k in ATTENTION.values()}
#: The group order: full attention, then sliding window, then chunked local.
ATTENTION_KINDS = tuple(ATTENTION)
#: The layout when both a sliding window and a chunked-local chunk are on and
#: no pattern is given: layer i is F, S, C by i mod 3 (4 layers: F S C F).
DEFAULT_MIXED_PATTERN = "FSC"


@dataclass(frozen=True)
class GroupAttention:
    """How the layers of one KV cache group attend: ``full_attention`` (every
    earlier position), ``sliding_window`` (the last ``size`` positions) or
    ``chunked_local`` (positions are cut into chunks of ``size``; a token
    attends the earlier positions of its own chunk). The rule of each kind
    is its class in gpu_runner/attention_kinds.py (``rule``)."""

    kind: str = FULL_ATTENTION.name
    size: int = 0

    @property
    def rule(self) -> AttentionKind:
        """The kind's attention rule."""
        return attention_of(self.kind)

    def first_key(self, pos: int) -> int:
        """The first position a token at ``pos`` attends (it attends
        ``first_key(pos) .. pos``)."""
        return self.rule.first_key(self.size, pos)

    def first_keys(self, pos: torch.Tensor, chunk_shift: int = 0) -> torch.Tensor:
        """``first_key`` of every position of ``pos`` (a tensor);
        ``chunk_shift`` moves a chunk's start (negative controls only)."""
        return self.rule.first_keys(self.size, pos, chunk_shift)

    def describe(self) -> str:
        return self.rule.describe(self.size)


def _select(num_layers: int, which: str, what: str) -> list[bool]:
    if which not in SW_LAYERS:
        raise ModelError(f"{what} must be one of {', '.join(SW_LAYERS)}, got {which!r}")
    return [which == "all" or (i % 2 == 1) == (which == "odd") for i in range(num_layers)]


def layer_kinds(num_layers: int, sliding_window: int = 0, sw_layers: str = "odd", chunked_local: int = 0,
                cl_layers: str = "odd", layer_pattern: str = "") -> tuple[str, ...]:
    """The attention kind of each layer. ``layer_pattern`` (letters F, S, C,
    M for a Mamba state layer, repeated over the layers) when given; else a sliding window alone on
    ``sw_layers``, chunked local attention alone on ``cl_layers``, both by
    ``DEFAULT_MIXED_PATTERN``; else full attention everywhere."""
    sizes = dict(sliding_window=sliding_window, chunked_local=chunked_local)  # by the kinds' flags
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ModelError(f"{name} must be an integer >= 0, got {v!r}")
    pattern = layer_pattern or (DEFAULT_MIXED_PATTERN if sliding_window and chunked_local else "")
    if pattern:
        bad = sorted(set(pattern) - set(LAYER_LETTERS))
        if bad:
            raise ModelError(f"layer_pattern takes the letters {', '.join(LAYER_LETTERS)}, got {bad[0]!r} in {pattern!r}")
        kinds = tuple(LAYER_LETTERS[pattern[i % len(pattern)]] for i in range(num_layers))
        for k in ATTENTION.values():
            if not k.flag:
                continue
            size = sizes[k.flag]
            if (k.name in kinds) != bool(size):
                raise ModelError(f"layer_pattern {pattern!r} over {num_layers} layers "
                                 f"{'has' if k.name in kinds else 'has no'} {k.name} layers but {k.flag} is {size}")
        return kinds
    if sliding_window:
        sel, kind, what = _select(num_layers, sw_layers, "sw_layers"), SLIDING_WINDOW.name, "sw_layers"
    elif chunked_local:
        sel, kind, what = _select(num_layers, cl_layers, "cl_layers"), CHUNKED_LOCAL.name, "cl_layers"
    else:
        return (FULL_ATTENTION.name,) * num_layers
    if not any(sel):
        raise ModelError(f"{what}={sw_layers if sliding_window else cl_layers} selects no layer of {num_layers}")
    return tuple(kind if x else FULL_ATTENTION.name for x in sel)


def layer_layout(num_layers: int, sliding_window: int = 0, sw_layers: str = "odd", chunked_local: int = 0,
                 cl_layers: str = "odd", layer_pattern: str = "") -> tuple[tuple[int, ...], tuple[GroupAttention, ...]]:
    """The KV cache group of each layer and how each group attends: the
    layers of one kind make one group, in ``ATTENTION_KINDS`` order, as vLLM
    groups layers by their KV cache spec (``layer_kinds`` picks the kinds)."""
    kinds = layer_kinds(num_layers, sliding_window, sw_layers, chunked_local, cl_layers, layer_pattern)
    sizes = dict(sliding_window=sliding_window, chunked_local=chunked_local)  # by the kinds' flags
    size = {k.name: sizes.get(k.flag, 0) for k in ATTENTION.values()}
    present = [k for k in ATTENTION_KINDS if k in kinds]
    return tuple(present.index(k) for k in kinds), tuple(GroupAttention(k, size[k]) for k in present)


def layer_groups(num_layers: int, sliding_window: int, sw_layers: str = "odd") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The KV cache group of each layer and the window of each group (0 =
    full attention): without a sliding window one full-attention group; with
    one, the full-attention layers (if any) make group 0 and the
    sliding-window layers (``odd``, ``even`` or ``all`` layer indices) the
    next group, as vLLM groups layers by their KV cache spec."""
    if sliding_window < 0:
        raise ModelError(f"sliding_window must be >= 0, got {sliding_window}")
    groups, attn = layer_layout(num_layers, sliding_window, sw_layers)
    return groups, tuple(a.size for a in attn)


class PagedLlama:
    """Runs ``LlamaWeights`` over ``StepBatch``es against a ``PagedKVCache``.

    ``sliding_window`` W > 0 makes the model hybrid: the layers ``sw_layers``
    selects attend only to the last W positions (a token at position p reads
    keys p-W+1 .. p) through their own KV cache group's block tables
    (``layer_group``, ``group_attn``); the others attend every position.
    ``chunked_local`` C > 0 does the same for chunked local attention on
    ``cl_layers`` (a token at p reads keys (p // C) * C .. p); with both, or
    with ``layer_pattern``, the layers mix full, sliding-window and
    chunked-local attention; its letter M makes a layer a Mamba state layer
    (attention_kinds.py, ``MambaState``: a recurrence whose state lives in
    its group's state blocks, ``PagedKVCache.state``). In exact mode a
    local layer still reads the fixed
    window of keys and masks those before its first key to ``-inf`` too, so
    its reductions keep their length and order.

    ``chunk_start_shift`` (0; negative controls only) moves every chunk's
    start by that many positions in the mask: -1 makes each token also attend
    the last position of the chunk before its own, a mask off by one that the
    dense reference (``schedspec.gpu_runner.reference``) must catch."""

    def __init__(self, weights: LlamaWeights, *, mode: Mode = "exact", tile_rows: int = 16, window: int = 0,
                 sliding_window: int = 0, sw_layers: str = "odd", chunked_local: int = 0, cl_layers: str = "odd",
                 layer_pattern: str = "", chunk_start_shift: int = 0):
        if mode not in ("exact", "fast"):
            raise ModelError(f"mode must be 'exact' or 'fast', got {mode!r}")
        if tile_rows < 1:
            raise ModelError(f"tile_rows must be >= 1, got {tile_rows}")
        if sliding_window < 0:
            raise ModelError(f"sliding_window must be >= 0, got {sliding_window}")
        #: KV cache group of each layer, and how each group attends
        self.layer_group, self.group_attn = layer_layout(
            weights.config.num_layers, sliding_window, sw_layers, chunked_local, cl_layers, layer_pattern)
        #: each group's sliding window (0: none)
        self.group_windows = tuple(a.rule.window(a.size) for a in self.group_attn)
        self.sliding_window = sliding_window
        self.sw_layers = sw_layers
        self.chunked_local = chunked_local
        self.cl_layers = cl_layers
        self.layer_pattern = layer_pattern
        self.chunk_start_shift = chunk_start_shift
        self.weights = weights
        self.config = weights.config
        self.mode: Mode = mode
        self.tile_rows = tile_rows
        c = weights.config
        limit = window or c.max_position
        #: the fixed attention window of exact mode (and the longest context).
        self.window = _round_up(limit, VECTOR_PAD)
        self.device = weights.device
        self.cos, self.sin = rope_tables(c, self.window, self.device)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        if self.device.type == "cuda":
            # TF32 would make fp32 matmuls shape dependent in their rounding;
            # the rest keeps cuBLAS and cuDNN run-to-run deterministic.
            set_cuda_determinism(torch.are_deterministic_algorithms_enabled())

    @property
    def is_hybrid(self) -> bool:
        """Whether any layer attends other than fully (a sliding window or
        chunked local attention)."""
        return any(a.rule.local for a in self.group_attn)

    @property
    def layer_attn(self) -> tuple[GroupAttention, ...]:
        """How each layer attends."""
        return tuple(self.group_attn[g] for g in self.layer_group)

    def describe_layout(self) -> str:
        """The layers' attention in words, e.g. ``F S C F (sliding window 32, chunked local 48)``."""
        sizes = ", ".join(a.describe() for a in self.group_attn if a.rule.flag)
        return " ".join(a.rule.letter for a in self.layer_attn) + (f" ({sizes})" if sizes else "")

    def with_chunk_start_shift(self, shift: int) -> PagedLlama:
        """The same model (same weights, layout, mode) with the chunked-local
        mask's chunk start moved by ``shift`` (a negative control)."""
        return PagedLlama(self.weights, mode=self.mode, tile_rows=self.tile_rows, window=self.window,
                          sliding_window=self.sliding_window, sw_layers=self.sw_layers,
                          chunked_local=self.chunked_local, cl_layers=self.cl_layers,
                          layer_pattern=self.layer_pattern, chunk_start_shift=shift)

    def _group_masks(self, pos: torch.Tensor) -> list[torch.Tensor]:
        """Per KV cache group, [n, 1, window]: True where a key is not
        attended (after the query, or before its group's first key: the
        sliding window's start, the chunk's start)."""
        key_pos = torch.arange(self.window, device=pos.device)
        after = key_pos[None, :] > pos[:, None]
        out = []
        for a in self.group_attn:
            m = after if not a.rule.local else after | (
                key_pos[None, :] < a.first_keys(pos, self.chunk_start_shift)[:, None])
            out.append(m[:, None, :])
        return out

    def _state_mix(self, layer: int, group: int, qkv: torch.Tensor, batch: StepBatch,
                   cache: PagedKVCache) -> torch.Tensor:
        """A state layer (``AttentionKind.keeps_state``) over the step: per
        request, its recurrence from the state in its read block, the state
        after its last token written to its write block; returns the rows'
        ``q * h`` ([rows, H * Dh], zero past the batch's tokens), what the
        output projection takes."""
        c = self.config
        H, KVH, Dh = c.num_heads, c.num_kv_heads, c.head_dim
        nq, nkv = H * Dh, KVH * Dh
        rule = self.group_attn[group].rule
        if cache.state is None:
            raise ModelError("the cache has no state planes for a state layer")
        states = cache.state[layer]
        q = qkv[:, :nq]
        a, b = rule.gates(qkv[:, nq:nq + nkv], qkv[:, nq + nkv:])
        hs = qkv.new_zeros(qkv.shape[0], nkv)
        reads, writes = batch.state_read[group], batch.state_write[group]
        for r, (start, length) in enumerate(zip(batch.seq_start, batch.seq_len)):
            rows = slice(start, start + length)
            last = rule.scan(a[rows], b[rows], states[reads[r]], hs[rows])
            states[writes[r]] = last
        mixed: torch.Tensor = q.reshape(-1, KVH, H // KVH, Dh) * hs.view(-1, KVH, 1, Dh)
        return mixed.reshape(-1, nq)

    # ------------------------------------------------------------------ forward

    @torch.no_grad()
    def forward(self, batch: StepBatch, cache: PagedKVCache, capture: Capture | None = None) -> torch.Tensor:
        """Write this step's K/V into the cache and return the logits of
        ``batch.logit_rows`` as [S, V] float32.

        ``capture`` (off by default; when off the forward runs exactly the same
        operations) is called with each intermediate tensor of the step's real
        rows, in order: ``embed``, per layer ``layer{i}.attn`` (the attention
        block's output, o_proj included), ``layer{i}.attn_residual`` (the
        residual stream after it), ``layer{i}.mlp`` (the MLP's output),
        ``layer{i}.residual`` (the stream after the layer), then ``final_norm``
        (of the logits rows) and ``logits``."""
        if batch.window != self.window:
            raise ModelError(f"batch built for window {batch.window}, model runs {self.window}")
        if self.mode == "exact":
            return self._forward_exact(batch, cache, capture)
        return self._forward_fast(batch, cache, capture)

    def _qkv(self, x: torch.Tensor, lw: LayerWeights, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Fast mode: the whole batch at once."""
        c = self.config
        qkv = F.linear(rms_norm(x, lw.attn_norm, c.rms_norm_eps), lw.wqkv)
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qk = apply_rope(qkv[:, : nq + nkv].reshape(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin, c.rope_style)
        v = qkv[:, nq + nkv :].reshape(-1, c.num_kv_heads, c.head_dim)
        return qk[:, : c.num_heads], qk[:, c.num_heads :], v

    def _forward_exact(self, batch: StepBatch, cache: PagedKVCache, capture: Capture | None = None) -> torch.Tensor:
        c, w = self.config, self.weights
        T = self.tile_rows
        n = batch.num_tokens
        n_pad = _round_up(max(n, 1), T)
        pad = n_pad - n
        H, KVH, Dh = c.num_heads, c.num_kv_heads, c.head_dim
        G = H // KVH
        nq, nkv = H * Dh, KVH * Dh
        eps = c.rms_norm_eps
        # Dummy rows: token 0 at position 0 of a request whose window is all
        # null-block slots; they write nothing and their output is dropped.
        tok = torch.cat([batch.token_ids, batch.token_ids.new_zeros(pad)])
        pos = torch.cat([batch.positions, batch.positions.new_zeros(pad)])
        # Per KV cache group: [n_pad, 1, window]: True where the key lies
        # after the query (or before the group's sliding window).
        group_masked = self._group_masks(pos)
        cos, sin = self.cos[pos], self.sin[pos]
        tiles = [slice(i, i + T) for i in range(0, n_pad, T)]
        group_tile_keys = []
        for g in range(len(self.group_windows)):
            ks_g = batch.keys_of(g)
            key_slots = torch.cat([ks_g[batch.token_request], ks_g.new_zeros(pad, self.window)])
            group_tile_keys.append([key_slots[t].reshape(-1) for t in tiles])
        x = w.embed[tok]
        if capture is not None:
            capture("embed", x[:n])
            attn_out, attn_res, mlp_out = x.new_zeros(x.shape), x.new_zeros(x.shape), x.new_zeros(x.shape)
        qkv = x.new_empty(n_pad, nq + 2 * nkv)
        for layer, lw in enumerate(w.layers):
            # Per tile: the reduction of RMSNorm and the QKV matmul.
            for t in tiles:
                torch.matmul(rms_norm(x[t], lw.attn_norm, eps), lw.wqkv.t(), out=qkv[t])
            group = self.layer_group[layer]
            state_mixed = None
            if self.group_attn[group].rule.keeps_state:
                state_mixed = self._state_mix(layer, group, qkv, batch, cache)
            # Whole batch: RoPE is correctly rounded elementwise arithmetic.
            qk = apply_rope(qkv[:, : nq + nkv].reshape(n_pad, H + KVH, Dh), cos, sin, c.rope_style)
            # The softmax scale goes into q (one correctly rounded multiply per element).
            q = (qk[:, :H] * self.scale).reshape(n_pad, KVH, G, Dh)
            masked, tile_keys = group_masked[group], group_tile_keys[group]
            kc, vc = cache.flat(layer)
            if state_mixed is None:
                kc.index_copy_(0, batch.slots_of(group), qk[:n, H:])
                vc.index_copy_(0, batch.slots_of(group), qkv[:n, nq + nkv :].reshape(n, KVH, Dh))
            out = x.new_empty(x.shape)
            mixed = x.new_empty(T, KVH, G, Dh)
            for t, slots in zip(tiles, tile_keys):
                if state_mixed is not None:  # a state layer: its recurrence's output, no key read
                    mixed.copy_(state_mixed[t].view(T, KVH, G, Dh))
                else:
                    # The tile's key windows, position order: [T, window, KVH, Dh].
                    ks = kc.index_select(0, slots).view(T, self.window, KVH, Dh)
                    vs = vc.index_select(0, slots).view(T, self.window, KVH, Dh)
                    qt = q[t]
                    for g in range(KVH):
                        # Strided views, no copies: [T, G, Dh] @ [T, Dh, window].
                        scores = torch.bmm(qt[:, g], ks[:, :, g].transpose(1, 2))
                        probs = torch.softmax(scores.masked_fill_(masked[t], float("-inf")), dim=-1)
                        torch.bmm(probs, vs[:, :, g], out=mixed[:, g])
                if capture is None:
                    h = x[t] + F.linear(mixed.view(T, nq), lw.wo)
                    out[t] = h + mlp(h, lw, w.intermediate_padded, eps)
                    continue
                a = F.linear(mixed.view(T, nq), lw.wo)
                h = x[t] + a
                m = mlp(h, lw, w.intermediate_padded, eps)
                out[t] = h + m
                attn_out[t], attn_res[t], mlp_out[t] = a, h, m
            x = out
            if capture is not None:
                for name, tensor in (("attn", attn_out), ("attn_residual", attn_res), ("mlp", mlp_out), ("residual", x)):
                    capture(f"layer{layer}.{name}", tensor[:n])
        rows = batch.logit_rows
        s = int(rows.shape[0])
        s_pad = _round_up(max(s, 1), T)
        xs = torch.cat([x[rows], x.new_zeros(s_pad - s, c.hidden_size)])
        logits = x.new_empty(s_pad, c.vocab_size)
        normed = x.new_empty(s_pad, c.hidden_size) if capture is not None else None
        for i in range(0, s_pad, T):
            xn = rms_norm(xs[i : i + T], w.norm, eps)
            if normed is not None:
                normed[i : i + T] = xn
            torch.matmul(xn, w.lm_head.t(), out=logits[i : i + T])
        if capture is not None and normed is not None:
            capture("final_norm", normed[:s])
            capture("logits", logits[:s])
        return logits[:s]

    def _forward_fast(self, batch: StepBatch, cache: PagedKVCache, capture: Capture | None = None) -> torch.Tensor:
        c, w = self.config, self.weights
        x = w.embed[batch.token_ids]
        if capture is not None:
            capture("embed", x)
        pos = batch.positions
        cos, sin = self.cos[pos], self.sin[pos]
        G = c.num_heads // c.num_kv_heads
        dev = self.device
        for layer, lw in enumerate(w.layers):
            group = self.layer_group[layer]
            attn = self.group_attn[group]
            if attn.rule.keeps_state:
                qkv = F.linear(rms_norm(x, lw.attn_norm, c.rms_norm_eps), lw.wqkv)
                mixed = self._state_mix(layer, group, qkv, batch, cache).view(x.shape[0], c.num_heads, c.head_dim)
            else:
                q, k, v = self._qkv(x, lw, cos, sin)
                kc, vc = cache.flat(layer)
                kc.index_copy_(0, batch.slots_of(group), k)
                vc.index_copy_(0, batch.slots_of(group), v)
                mixed = x.new_empty(x.shape[0], c.num_heads, c.head_dim)
            spans = [] if attn.rule.keeps_state else list(zip(batch.seq_start, batch.seq_len, batch.ctx_len))
            for r, (start, length, ctx) in enumerate(spans):
                slots = batch.keys_of(group)[r, :ctx]
                ks = kc[slots].repeat_interleave(G, dim=1).transpose(0, 1)  # [H, ctx, Dh]
                vs = vc[slots].repeat_interleave(G, dim=1).transpose(0, 1)
                qr = q[start : start + length].transpose(0, 1)  # [H, len, Dh]
                qpos = pos[start : start + length]
                kpos = torch.arange(ctx, device=dev)[None, :]
                allowed = kpos <= qpos[:, None]
                if attn.rule.local:
                    allowed = allowed & (kpos >= attn.first_keys(qpos, self.chunk_start_shift)[:, None])
                o = F.scaled_dot_product_attention(qr, ks, vs, attn_mask=allowed, scale=self.scale)
                mixed[start : start + length] = o.transpose(0, 1)
            a = F.linear(mixed.reshape(x.shape[0], -1), lw.wo)
            h = x + a
            m = mlp(h, lw, w.intermediate_padded, c.rms_norm_eps)
            x = h + m
            if capture is not None:
                for name, tensor in (("attn", a), ("attn_residual", h), ("mlp", m), ("residual", x)):
                    capture(f"layer{layer}.{name}", tensor)
        xs = rms_norm(x[batch.logit_rows], w.norm, c.rms_norm_eps)
        logits = F.linear(xs, w.lm_head)
        if capture is not None:
            capture("final_norm", xs)
            capture("logits", logits)
        return logits
