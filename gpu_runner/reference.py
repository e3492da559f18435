"""A dense reference: a request's whole sequence recomputed at once, no paging.

The matrix compares a scheduler's runs with a baseline run, and both read the
model's keys through block tables with the model's own masks: a mask that is
wrong (a chunk off by one, a window one too wide) is wrong in both, and no
comparison between them can see it. The reference computes what the tokens
*should* be without any of that machinery: the request's prompt and generated
tokens (but the last) in one batch, every layer's keys and values in a plain
contiguous tensor (no cache, no block table, no slot, nothing kept between
calls), and each layer's mask built from the attention rule itself
(``reference_allowed``: a key is attended when it is not after the query and,
for a sliding window of W, fewer than W positions before it, for chunked local
attention of C, in the same chunk, ``key // C == query // C``), not from the
model's first-key formula. A state layer (Mamba: ``keeps_state``) runs its
recurrence over the whole sequence from the zero state, no state block read
or written.

In exact mode it runs the same fixed-tile kernels as ``PagedLlama`` (tiles of
``tile_rows`` rows, a fixed window of keys, masked to ``-inf``), so its logits
are bitwise those of a correct paged run: ``check_reference`` asks every sampled
row of a run to be ``torch.equal`` to the reference's row at that position and
its token to be the reference's argmax. In fast mode it uses ordinary dense
attention and the rows must agree within a tolerance.

torch is imported here and only inside ``schedspec.gpu_runner``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from schedspec.gpu_runner.attention_kinds import attention_of
from schedspec.gpu_runner.model import GroupAttention, PagedLlama, mlp, apply_rope, rms_norm


def reference_allowed(attn: GroupAttention, n: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, width] bool: whether the query at position q (row) attends the key
    at position k (column), from the rule itself."""
    q = torch.arange(n, device=device)[:, None]
    k = torch.arange(width, device=device)[None, :]
    rule = attention_of(attn.kind)  # gpu_runner/attention_kinds.py; ValueError for an unknown kind
    return (k <= q) & rule.reference_allowed(attn.size, q, k)


@torch.no_grad()
def reference_logits(model: PagedLlama, tokens: Sequence[int]) -> torch.Tensor:
    """The logits [len(tokens), V] of every position of ``tokens``, computed
    densely in one batch with the model's weights and layer layout
    (``model.layer_attn``) but none of its paging or masks."""
    n = len(tokens)
    if not 0 < n <= model.window:
        raise ValueError(f"a reference sequence needs 1 to {model.window} tokens, got {n}")
    if model.mode == "exact":
        return _exact(model, tokens)
    return _dense(model, tokens)


def _state_rows(model: PagedLlama, attn: GroupAttention, qkv: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A state layer over the first ``n`` rows of ``qkv`` (one sequence from
    position 0, the zero state): ``q * h`` of every row ([rows, H * Dh], zero
    past n) and the state after row n - 1."""
    c = model.config
    H, KVH, Dh = c.num_heads, c.num_kv_heads, c.head_dim
    nq, nkv = H * Dh, KVH * Dh
    a, b = attn.rule.gates(qkv[:, nq:nq + nkv], qkv[:, nq + nkv:])
    hs = qkv.new_zeros(qkv.shape[0], nkv)
    last = attn.rule.scan(a[:n], b[:n], qkv.new_zeros(nkv), hs[:n])
    mixed = qkv[:, :nq].reshape(-1, KVH, H // KVH, Dh) * hs.view(-1, KVH, 1, Dh)
    return mixed.reshape(-1, nq), last


@torch.no_grad()
def reference_states(model: PagedLlama, tokens: Sequence[int]) -> torch.Tensor:
    """[layers, kv_heads * head_dim]: each state layer's state after
    ``tokens`` (zero for an empty sequence and for the other layers),
    computed densely (fast mode's kernels)."""
    c = model.config
    out = torch.zeros(c.num_layers, c.num_kv_heads * c.head_dim, device=model.device)
    if tokens:
        _dense(model, tokens, out)
    return out


def _dense(model: PagedLlama, tokens: Sequence[int], states: torch.Tensor | None = None) -> torch.Tensor:
    c, w, dev = model.config, model.weights, model.device
    n = len(tokens)
    H, KVH, Dh = c.num_heads, c.num_kv_heads, c.head_dim
    x = w.embed[torch.tensor(list(tokens), dtype=torch.int64, device=dev)]
    cos, sin = model.cos[:n], model.sin[:n]
    for layer, (lw, attn) in enumerate(zip(w.layers, model.layer_attn)):
        qkv = F.linear(rms_norm(x, lw.attn_norm, c.rms_norm_eps), lw.wqkv)
        if attn.rule.keeps_state:
            mixed, last = _state_rows(model, attn, qkv, n)
            if states is not None:
                states[layer] = last
            h = x + F.linear(mixed, lw.wo)
            x = h + mlp(h, lw, w.intermediate_padded, c.rms_norm_eps)
            continue
        qk = apply_rope(qkv[:, : (H + KVH) * Dh].reshape(n, H + KVH, Dh), cos, sin, c.rope_style)
        q = qk[:, :H].transpose(0, 1)
        k = qk[:, H:].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        v = qkv[:, (H + KVH) * Dh:].reshape(n, KVH, Dh).repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=reference_allowed(attn, n, n, dev), scale=model.scale)
        h = x + F.linear(o.transpose(0, 1).reshape(n, H * Dh), lw.wo)
        x = h + mlp(h, lw, w.intermediate_padded, c.rms_norm_eps)
    return F.linear(rms_norm(x, w.norm, c.rms_norm_eps), w.lm_head)


def _exact(model: PagedLlama, tokens: Sequence[int]) -> torch.Tensor:
    """Exact mode's kernels on shapes fixed as the paged forward fixes them:
    tiles of ``tile_rows`` rows, ``window`` keys per row, masked to -inf."""
    c, w, dev = model.config, model.weights, model.device
    T, width = model.tile_rows, model.window
    n = len(tokens)
    n_pad = -(-n // T) * T
    H, KVH, Dh = c.num_heads, c.num_kv_heads, c.head_dim
    G, nq, nkv, eps = H // KVH, H * Dh, KVH * Dh, c.rms_norm_eps
    tok = torch.tensor(list(tokens) + [0] * (n_pad - n), dtype=torch.int64, device=dev)
    # padding rows sit at position 0 and see key 0 only; their output is dropped
    pos = torch.cat([torch.arange(n, device=dev), torch.zeros(n_pad - n, dtype=torch.int64, device=dev)])
    masked = {a: ~reference_allowed(a, n_pad, width, dev)[pos][:, None, :]
              for a in set(model.layer_attn) if not a.rule.keeps_state}
    cos, sin = model.cos[pos], model.sin[pos]
    tiles = [slice(i, i + T) for i in range(0, n_pad, T)]
    x = w.embed[tok]
    qkv = x.new_empty(n_pad, nq + 2 * nkv)
    for lw, attn in zip(w.layers, model.layer_attn):
        for t in tiles:
            torch.matmul(rms_norm(x[t], lw.attn_norm, eps), lw.wqkv.t(), out=qkv[t])
        if attn.rule.keeps_state:
            mixed_rows = _state_rows(model, attn, qkv, n)[0]
            out = x.new_empty(x.shape)
            for t in tiles:
                h = x[t] + F.linear(mixed_rows[t].contiguous(), lw.wo)
                out[t] = h + mlp(h, lw, w.intermediate_padded, eps)
            x = out
            continue
        qk = apply_rope(qkv[:, : nq + nkv].reshape(n_pad, H + KVH, Dh), cos, sin, c.rope_style)
        q = (qk[:, :H] * model.scale).reshape(n_pad, KVH, G, Dh)
        # the layer's keys and values: position p in row p, zeros past the sequence
        keys = x.new_zeros(width, KVH, Dh)
        values = x.new_zeros(width, KVH, Dh)
        keys[:n] = qk[:n, H:]
        values[:n] = qkv[:n, nq + nkv:].reshape(n, KVH, Dh)
        ks = keys[None].expand(T, width, KVH, Dh).contiguous()
        vs = values[None].expand(T, width, KVH, Dh).contiguous()
        out = x.new_empty(x.shape)
        mixed = x.new_empty(T, KVH, G, Dh)
        for t in tiles:
            qt = q[t]
            for g in range(KVH):
                scores = torch.bmm(qt[:, g], ks[:, :, g].transpose(1, 2))
                probs = torch.softmax(scores.masked_fill_(masked[attn][t], float("-inf")), dim=-1)
                torch.bmm(probs, vs[:, :, g], out=mixed[:, g])
            h = x[t] + F.linear(mixed.view(T, nq), lw.wo)
            out[t] = h + mlp(h, lw, w.intermediate_padded, eps)
        x = out
    logits = x.new_empty(n_pad, c.vocab_size)
    for t in tiles:
        torch.matmul(rms_norm(x[t], w.norm, eps), w.lm_head.t(), out=logits[t])
    return logits[:n]


def reference_divergences(
    model: PagedLlama,
    prompts: Mapping[str, Sequence[int]],
    outputs: Mapping[str, Sequence[int]],
    logits: Mapping[tuple[str, int], torch.Tensor],
    *,
    atol: float = 1e-3,
) -> tuple[list[tuple[str, str, int, str]], int, int, int, float]:
    """Each request's generated tokens and sampled logits rows (``logits``
    keyed by request and output index) against ``reference_logits`` of its
    prompt and outputs: the token at output k must be the argmax of the
    reference's row at position ``len(prompt) + k - 1``, and the run's row
    must be bitwise that row (exact mode) or within ``atol`` (fast mode).

    Returns (divergences as (request, kind, output index, detail), tokens
    compared, rows compared, rows bitwise equal, the largest difference)."""
    found: list[tuple[str, str, int, str]] = []
    tokens = rows = bitwise = 0
    worst = 0.0
    for rid in sorted(outputs):
        outs = list(outputs[rid])
        if not outs:
            continue
        prompt = list(prompts[rid])
        ref = reference_logits(model, prompt + outs[:-1]).detach().to("cpu")
        for k, tok in enumerate(outs):
            row = ref[len(prompt) + k - 1]
            want = int(torch.argmax(row))
            if want != tok:
                found.append((rid, "tokens", k, f"reference {want}, run {tok}"))
                break
            tokens += 1
            got = logits.get((rid, k))
            if got is None:
                continue
            rows += 1
            if torch.equal(got, row):
                bitwise += 1
                continue
            diff = float((got - row).abs().max())
            worst = max(worst, diff)
            if model.mode == "exact" or not diff <= atol:
                found.append((rid, "logits", k, f"reference row differs, max |diff| {diff:.3g}"))
                break
    return found, tokens, rows, bitwise, worst
