"""The step executor: a StepPlan in, a StepResult (greedy tokens) out.

The executor owns the paged KV cache of one scheduler configuration
(``num_blocks`` x ``block_size``). For each plan it checks what a model runner
relies on (block tables that cover the scheduled positions, no slot in the
null block 0, no two tokens writing one slot, the token ids it was handed),
flattens every scheduled token of every request into one ``StepBatch``, runs
one forward and samples greedily for each entry whose ``samples`` is true.

The executor is a ``schedspec.check.oracle.Model``: ``execute(plan, context)``
returns the StepResult and keeps each sampled logits row in ``logits``, keyed
by request and the position of the token it sampled, so the check driver can
step it like the fake model.

A ``Fault`` deliberately corrupts one entry of one step (a wrong block in the
table, or shifted positions, or a chunked-local table with a block of the
current chunk nulled); the equivalence matrix's negative control uses it to
show that a wrong KV address is caught.

Speculative decoding and async scheduling, as vLLM's worker runs them:

- An entry with drafts gets a logits row for its last real token and for each
  draft; verification is greedy (vLLM's rejection sampler with greedy
  sampling): drafts are accepted while each equals the argmax of the row
  before it, and the step returns the accepted drafts and then the bonus
  token. Each sampled token's row is kept in ``logits`` at its position.
- With ``config.num_speculative_tokens`` = k > 0 the executor proposes drafts
  after every sampling step by prompt lookup (vLLM's ngram proposer): the
  longest suffix of 3, 2 or 1 tokens that occurred earlier in the request's
  tokens, and the k tokens that followed it there. They come back in
  ``StepResult.draft_token_ids``. Drafts never change greedy output: a right
  draft saves a step, a wrong one is rejected.
- A -1 in the scheduled tokens is an output still in flight: the executor
  fills it from its own last output of the request at that position, and a -1
  draft from its own last proposals (none for a new or resumed request: such a
  draft is never accepted). When the entry counts in-flight placeholders and
  the in-flight step rejected drafts, its positions are optimistic and are
  shifted back by the rejected count (the worker's deferred correction).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch

from schedspec.spec.interface import (
    KVCacheGroup,
    KVLoad,
    ScheduledRequest,
    ScheduleKind,
    SchedSpecError,
    SchedulerConfig,
    StepPlan,
    StepResult,
)

from schedspec.gpu_runner.model import (
    GroupAttention,
    LlamaWeights,
    PagedKVCache,
    PagedLlama,
    StepBatch,
    set_cuda_determinism,
)
from schedspec.gpu_runner.reference import reference_states


class PlanError(SchedSpecError, ValueError):
    """A plan that no model runner could execute; names the request and field."""

    def __init__(self, step: int, request_id: str, field_name: str, message: str) -> None:
        super().__init__(f"step {step}: request {request_id!r}: {field_name}: {message}")
        self.step = step
        self.request_id = request_id
        self.field = field_name


FaultKind = Literal["block_table", "position", "kv_load", "chunk_null", "state_checkpoint"]
FAULT_KINDS = ("block_table", "position", "kv_load", "chunk_null", "state_checkpoint")


@dataclass
class Fault:
    """Corrupt one scheduled entry once: the first entry of ``request_id`` (any
    request when None) at or after plan step ``step``.

    ``block_table``: the entry's last block is replaced, for this step, by
    a block that no entry of the plan holds (when the pool has one), so its K/V are written to and read from
    the wrong place. ``position``: the entry's positions are shifted by +1 for
    RoPE (the slots stay right). ``kv_load``: the first connector load of the
    request (``step`` does not apply) copies, into each position, the stored
    K/V of the next position (of the one before, for the store's last): a
    store that is off by one. ``chunk_null``: the entry's chunked-local
    table gets the null block 0 in place of the block holding its current
    chunk's first position (a scheduler that frees the chunk it is in; the
    executor must refuse the plan). It fires only on an entry past its
    first chunk, of a config with a chunked-local group.
    ``state_checkpoint``: the first entry that restores a state (a new or
    resumed request past position 0, in a layout with a state group)
    starts, in every state layer, from the state one block earlier, the
    checkpoint at ``num_computed_tokens - block_size`` of the same tokens
    (the dense reference's; the zero state at 0): a state restored from the
    wrong checkpoint."""

    kind: FaultKind
    step: int = 0
    request_id: str | None = None
    fired: list[str] = field(default_factory=list)
    #: requests it never fires on (``state_checkpoint``: those aborted)
    exclude: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class StepOutput:
    """The StepResult plus, per sampling entry, its logits row ([V] float32 on
    the CPU) for comparisons."""

    result: StepResult
    logits: Mapping[str, torch.Tensor]
    num_tokens: int
    seconds: float
    #: (request id, position of a sampled token) -> its logits row
    rows_by_position: Mapping[tuple[str, int], torch.Tensor] = field(default_factory=dict)


def pick_device(device: str = "auto", *, deterministic_algorithms: bool = False) -> torch.device:
    """``auto``: CUDA when available, else the CPU. On CUDA the determinism
    settings (``set_cuda_determinism``) are made here, before any CUDA op;
    ``deterministic_algorithms`` also turns on
    ``torch.use_deterministic_algorithms`` (on any device)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    if device.startswith("cuda"):
        set_cuda_determinism(deterministic_algorithms)
    elif deterministic_algorithms:
        torch.use_deterministic_algorithms(True)
    return torch.device(device)


def model_kv_cache_groups(model: PagedLlama) -> tuple[KVCacheGroup, ...]:
    """The scheduler's ``kv_cache_groups`` for the model's layers: () for a
    model whose layers all attend fully, else one group per layer group (a
    full-attention group, then the sliding-window one, then the
    chunked-local one, those the model has)."""
    if not model.is_hybrid:
        return ()
    return tuple(a.rule.kv_group(a.size) for a in model.group_attn)


class KVStore:
    """The KV connector's store: the K/V an earlier run computed, per request
    and position (every layer), with the token it was computed for.

    An executor given one as ``kv_record`` fills it with every position it
    computes (the first time: a recomputation keeps the first); one given
    as ``kv_source`` copies from it when the connector's worker loads KV
    (``Executor.load_kv``)."""

    def __init__(self) -> None:
        #: (request id, position) -> (K, V), each [layers, kv_heads, head_dim]
        self.kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        #: (request id, position) -> the token whose K/V it is
        self.tokens: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        return len(self.kv)

    def holds(self, request_id: str, position: int) -> bool:
        return (request_id, position) in self.kv


class Executor:
    """Executes StepPlans of one scheduler configuration on one model.

    For a hybrid model (``PagedLlama(sliding_window=W)``,
    ``PagedLlama(chunked_local=C)``) the config's ``kv_cache_groups`` must be
    the model's (``model_kv_cache_groups``): each layer reads and writes its
    group's table of ``group_block_ids``, all groups in the one pool of
    blocks (a plane per layer)."""

    def __init__(
        self,
        model: PagedLlama | LlamaWeights,
        config: SchedulerConfig,
        *,
        fault: Fault | None = None,
        keep_logits: bool = True,
        kv_record: KVStore | None = None,
        kv_source: KVStore | None = None,
    ) -> None:
        if isinstance(model, LlamaWeights):
            model = PagedLlama(model, window=config.max_model_len)
        self.model = model
        self.config = config
        if config.max_model_len > model.window:
            raise ValueError(
                f"config.max_model_len ({config.max_model_len}) exceeds the model's attention "
                f"window ({model.window}); build the PagedLlama with window >= max_model_len"
            )
        want = model_kv_cache_groups(model)
        if tuple(config.kv_cache_groups) != want and not (not want and not config.is_hybrid):
            raise ValueError(
                f"config.kv_cache_groups {[g.to_dict() for g in config.kv_cache_groups]} do not match the "
                f"model's layers {[g.to_dict() for g in want]}"
            )
        #: the sliding window of each KV cache group (0: none)
        self.group_windows: tuple[int, ...] = model.group_windows
        #: how each KV cache group attends
        self.group_attn: tuple[GroupAttention, ...] = model.group_attn
        self.kv_record = kv_record
        self.kv_source = kv_source
        #: counts of the hybrid layout: entries whose sliding-window table
        #: held the null block (freed blocks), the same for a chunked-local
        #: table (``cl_null_entries``), admissions (new or resumed)
        #: with a prefix-cache hit (beyond the tokens the connector loaded),
        #: in any layout and in a hybrid one (a hit valid in every group)
        self.null_block_entries = 0
        self.cl_null_entries = 0
        self.local_hit_entries = 0
        self.hybrid_hit_entries = 0
        #: entries that restored a state (a state group's) from a prefix hit
        self.state_restores = 0
        #: request id -> the end of its last connector load
        self._loaded: dict[str, int] = {}
        #: counts of the connector: loads performed, tokens copied from the store
        self.kv_loads = 0
        self.kv_loaded_tokens = 0
        self.cache = PagedKVCache.allocate(model.config, config.num_blocks, config.block_size, model.device,
                                           states=any(a.rule.keeps_state for a in model.group_attn))
        self.fault = fault
        self.keep_logits = keep_logits
        self.steps = 0
        self.tokens = 0
        self.seconds = 0.0
        #: (request id, position of the sampled token) -> its logits row, kept by ``execute``
        self.logits: dict[tuple[str, int], torch.Tensor] = {}
        self.num_speculative_tokens = config.num_speculative_tokens
        #: request id -> position -> its last sampled tokens (what fills a -1)
        self.outputs: dict[str, dict[int, int]] = {}
        #: request id -> drafts proposed after its last step (what fills a -1 draft)
        self.proposals: dict[str, tuple[int, ...]] = {}
        #: request id -> drafts its last sampling step rejected (the optimistic shift)
        self.rejected: dict[str, int] = {}
        #: the request ids of the last k - 1 plans (k = max_concurrent_batches): a
        #: request's outputs are kept while any of them scheduled it, as V2's
        #: per-request state keeps a throttled decode's sampled tokens (pp plans
        #: later it reads them)
        self._recent: list[frozenset[str]] = []
        self._keep_plans = max(1, config.max_concurrent_batches - 1)
        #: counts: drafts verified and accepted, entries planned with outputs in flight
        self.drafts_verified = 0
        self.drafts_accepted = 0
        self.in_flight_entries = 0

    def reset(self) -> None:
        """Zero the whole cache (a fresh run on the same pool)."""
        self.cache.k.zero_()
        self.cache.v.zero_()
        if self.cache.state is not None:
            self.cache.state.zero_()

    # ------------------------------------------------------------------ batch

    def build_batch(
        self, plan: StepPlan, known_tokens: Mapping[str, Sequence[int]] | None = None
    ) -> StepBatch:
        """Validate ``plan`` and flatten it. ``known_tokens[rid]``, when given,
        is every token the request has (prompt, outputs, then the outputs in
        flight); the scheduled ``token_ids`` (with every -1 filled) must be its
        slice at the scheduled positions, drafts aside."""
        return self._prepare(plan, known_tokens)[0]

    def _base(self, s: ScheduledRequest) -> int:
        """The true position of the entry's first token (see the module text)."""
        if s.num_output_placeholders > 0:
            return s.num_computed_tokens - self.rejected.get(s.request_id, 0)
        return s.num_computed_tokens

    def _filled(self, plan: StepPlan, s: ScheduledRequest, base: int) -> tuple[list[int], list[bool]]:
        """The entry's tokens with every -1 filled, and which drafts are valid."""
        rid = s.request_id
        d = len(s.spec_token_ids)
        first_draft = s.num_scheduled_tokens - d
        mine = self.outputs.get(rid, {})
        proposals = self.proposals.get(rid, ()) if s.kind is ScheduleKind.RUNNING else ()
        toks: list[int] = []
        valid: list[bool] = []
        for j, t in enumerate(s.token_ids):
            if j >= first_draft:
                i = j - first_draft
                if t == -1:
                    t = proposals[i] if i < len(proposals) else -1
                valid.append(t != -1)
                toks.append(t if t != -1 else 0)  # an invalid draft computes token 0 and is never accepted
                continue
            if t == -1:
                if base + j not in mine:
                    raise PlanError(plan.step, rid, "token_ids",
                                    f"a -1 at position {base + j} where nothing of the request is in flight")
                t = mine[base + j]
            toks.append(t)
        return toks, valid

    def _prepare(
        self, plan: StepPlan, known_tokens: Mapping[str, Sequence[int]] | None
    ) -> tuple[StepBatch, list[_Sampler]]:
        bs = self.config.block_size
        nb = self.cache.num_blocks
        window = self.model.window
        vocab = self.model.config.vocab_size
        ngroups = len(self.group_attn)
        toks: list[int] = []
        positions: list[int] = []
        group_slots: list[list[int]] = [[] for _ in range(ngroups)]
        slots = group_slots[0]
        token_request: list[int] = []
        group_key_rows: list[list[list[int]]] = [[] for _ in range(ngroups)]
        seq_start: list[int] = []
        seq_len: list[int] = []
        ctx_len: list[int] = []
        logit_rows: list[int] = []
        samplers: list[_Sampler] = []
        seen: set[str] = set()
        rules = [a.rule for a in self.group_attn]
        state_read: list[list[int]] = [[] for _ in range(ngroups)]
        state_write: list[list[int]] = [[] for _ in range(ngroups)]
        for r, s in enumerate(plan.scheduled):
            rid = s.request_id

            def bad(field_name: str, message: str) -> PlanError:
                return PlanError(plan.step, rid, field_name, message)

            if rid in seen:
                raise bad("request_id", "scheduled twice in one plan")
            seen.add(rid)
            n, c = s.num_scheduled_tokens, self._base(s)
            d = len(s.spec_token_ids)
            if n < 1 or len(s.token_ids) != n:
                raise bad("token_ids", f"{len(s.token_ids)} token ids for {n} scheduled tokens")
            if d > n:
                raise bad("spec_token_ids", f"{d} drafts in {n} scheduled tokens")
            if c < 0:
                raise bad("num_computed_tokens", f"negative ({c})")
            end = c + n
            if end > window:
                raise bad("num_scheduled_tokens", f"position {end - 1} is past the window {window}")
            limit = s.num_tokens + s.num_output_placeholders + d
            if s.num_computed_tokens + n > limit:
                raise bad("num_scheduled_tokens", f"computes up to {s.num_computed_tokens + n} of {limit} "
                          "known, in-flight and draft tokens")
            need = (end + bs - 1) // bs
            tables = self._tables(plan, s, c, end)
            table = tables[0]
            for g, rule in enumerate(rules):
                if rule.keeps_state:
                    place = rule.read_place(c, bs)
                    state_read[g].append(0 if place is None else tables[g][place])
                    state_write[g].append(tables[g][rule.write_place(end, bs)])
            filled, valid = self._filled(plan, s, c)
            for t in filled:
                if not 0 <= t < vocab:
                    raise bad("token_ids", f"token {t} outside the vocabulary of {vocab}")
            if known_tokens is not None and rid in known_tokens:
                want = tuple(known_tokens[rid][c:end - d])
                if tuple(filled[: n - d]) != want:
                    raise bad("token_ids", f"scheduled {tuple(filled[: n - d])!r}, the request has {want!r} there")
            pos = list(range(c, end))
            fault = self.fault
            if fault is not None and fault.kind in ("block_table", "position", "kv_load") and not fault.fired and (
                plan.step >= fault.step) and (
                fault.request_id is None or fault.request_id == rid
            ):
                fault.fired.append(f"step {plan.step} request {rid}: {fault.kind}")
                if fault.kind == "kv_load":
                    fault.fired.clear()  # a load fault fires on the load (load_kv), not here
                elif fault.kind == "block_table":
                    used = {b for e in plan.scheduled for b in e.block_ids}
                    spare = [b for b in range(nb - 1, 0, -1) if b not in used]
                    table[need - 1] = spare[0] if spare else table[need - 2] if need > 1 else 1
                else:
                    pos = [p + 1 for p in pos]
            seq_start.append(len(toks))
            seq_len.append(n)
            ctx_len.append(end)
            for p, t in zip(range(c, end), filled):
                toks.append(t)
                token_request.append(r)
                for g, tab in enumerate(tables):
                    group_slots[g].append(tab[p // bs] * bs + p % bs)
            positions.extend(pos)
            for g, tab in enumerate(tables):
                row = [b * bs + j for b in tab for j in range(bs)][:window]
                group_key_rows[g].append(row + [0] * (window - len(row)))
            if s.samples:
                last_row = len(toks) - 1 - d
                samplers.append(_Sampler(rid, len(logit_rows), end - d - 1, tuple(filled[n - d:]), tuple(valid)))
                logit_rows.extend(range(last_row, last_row + d + 1))
            if s.num_output_placeholders:
                self.in_flight_entries += 1
        all_slots = [x for g, xs in enumerate(group_slots) if not rules[g].keeps_state for x in xs]
        if len(set(all_slots)) != len(all_slots):
            dup = next(x for x in all_slots if all_slots.count(x) > 1)
            raise PlanError(plan.step, "*", "block_ids", f"two tokens write slot {dup} in one step")
        for g, writes in enumerate(state_write):
            if len(set(writes)) != len(writes):
                dup = next(x for x in writes if writes.count(x) > 1)
                raise PlanError(plan.step, "*", f"group_block_ids[{g}]", f"two requests write state block {dup} in one step")
        dev = self.model.device

        def t64(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=dev)

        def keys(rows: list[list[int]]) -> torch.Tensor:
            return torch.tensor(rows, dtype=torch.int64, device=dev).reshape(len(rows), window)

        batch = StepBatch(
            token_ids=t64(toks),
            positions=t64(positions),
            slot_mapping=t64(slots),
            token_request=t64(token_request),
            key_slots=keys(group_key_rows[0]),
            seq_start=seq_start,
            seq_len=seq_len,
            ctx_len=ctx_len,
            logit_rows=t64(logit_rows),
            window=window,
            group_slot_mapping=tuple(t64(xs) for xs in group_slots[1:]),
            group_key_slots=tuple(keys(rows) for rows in group_key_rows[1:]),
            state_read=tuple(tuple(xs) for xs in state_read),
            state_write=tuple(tuple(xs) for xs in state_write),
        )
        return batch, samplers

    def _tables(self, plan: StepPlan, s: ScheduledRequest, c: int, end: int) -> list[list[int]]:
        """The entry's block table per KV cache group (``group_block_ids``
        for a hybrid config, else ``block_ids``), checked: each covers
        positions up to ``end``, holds only blocks of the pool, and the null
        block 0 only in a sliding-window or chunked-local group's places
        wholly before the first key the step reads (position ``c - W + 1``
        for a window of W, ``(c // C) * C`` for chunks of C: the current
        chunk's start): reading one at or after it is a PlanError naming the
        group and the position."""
        bs, nb = self.config.block_size, self.cache.num_blocks
        rid = s.request_id
        need = (end + bs - 1) // bs
        if self.config.is_hybrid:
            if len(s.group_block_ids) != len(self.group_attn):
                raise PlanError(plan.step, rid, "group_block_ids",
                                f"{len(s.group_block_ids)} tables for {len(self.group_attn)} KV cache groups")
            if tuple(s.block_ids) != tuple(s.group_block_ids[0]):
                raise PlanError(plan.step, rid, "block_ids", "is not group 0's table of group_block_ids")
            raw = [list(t) for t in s.group_block_ids]
        else:
            raw = [list(s.block_ids)]
        hybrid = self.config.is_hybrid
        self._chunk_null_fault(plan, s, c, raw)
        freed: set[str] = set()  # the counters of the kinds whose tables hold a null block
        for g, (tab, attn) in enumerate(zip(raw, self.group_attn)):
            name = f"group_block_ids[{g}]" if hybrid else "block_ids"
            what_group = f"KV cache group {g} ({attn.describe()}): " if hybrid else ""
            if len(tab) < need:
                raise PlanError(plan.step, rid, name, f"{what_group}{len(tab)} blocks cannot hold {end} tokens of {bs}")
            if attn.rule.keeps_state:
                self._check_state_table(plan, s, c, end, name, what_group, tab, attn)
                continue
            first_read = attn.first_key(c)
            inside = attn.rule.inside
            for i, b in enumerate(tab):
                if not 0 <= b < nb:
                    raise PlanError(plan.step, rid, name, f"{what_group}the table holds block {b} outside the pool of {nb}")
                if b != 0:
                    continue
                if not attn.rule.local:
                    raise PlanError(plan.step, rid, name, f"{what_group}the table holds the null block 0")
                freed.add(attn.rule.entries_counter)
                if i * bs + bs > first_read and i * bs < end:
                    pos = max(i * bs, first_read)
                    raise PlanError(plan.step, rid, name,
                                    f"{what_group}position {pos} lies inside {inside} "
                                    f"(from {first_read}) but its block is the null block 0 (freed)")
        for counter in freed:  # null_block_entries, cl_null_entries (gpu_runner/attention_kinds.py)
            setattr(self, counter, getattr(self, counter) + 1)
        if s.kind is not ScheduleKind.RUNNING and s.num_computed_tokens > self._loaded.get(rid, 0):
            # an admission with a prefix-cache hit beyond what the connector loaded
            self.local_hit_entries += 1
            if hybrid:
                self.hybrid_hit_entries += 1
            if any(a.rule.keeps_state for a in self.group_attn):
                self.state_restores += 1
        return raw

    def _check_state_table(self, plan: StepPlan, s: ScheduledRequest, c: int, end: int, name: str,
                           what_group: str, tab: list[int], attn: GroupAttention) -> None:
        """A state group's table (``keeps_state``): blocks of the pool, the
        null block anywhere but where the step reads its state (the place
        of position c - 1) and where it writes the state after its last token
        (the place of position end - 1)."""
        bs, nb = self.config.block_size, self.cache.num_blocks
        for b in tab:
            if not 0 <= b < nb:
                raise PlanError(plan.step, s.request_id, name, f"{what_group}the table holds block {b} outside the pool of {nb}")
        read = attn.rule.read_place(c, bs)
        if read is not None and tab[read] == 0:
            raise PlanError(plan.step, s.request_id, name,
                            f"{what_group}the state after {c} tokens is read from place {read}, "
                            "but it holds the null block 0 (freed)")
        write = attn.rule.write_place(end, bs)
        if tab[write] == 0:
            raise PlanError(plan.step, s.request_id, name,
                            f"{what_group}the state after {end} tokens is written to place {write}, "
                            "but it holds the null block 0")

    def _chunk_null_fault(self, plan: StepPlan, s: ScheduledRequest, c: int, raw: list[list[int]]) -> None:
        """``Fault("chunk_null")``: null the block of the current chunk's
        first position in the entry's chunked-local table (once)."""
        fault = self.fault
        if fault is None or fault.kind != "chunk_null" or fault.fired or plan.step < fault.step or (
                fault.request_id is not None and fault.request_id != s.request_id):
            return
        for g, attn in enumerate(self.group_attn):
            # past its first chunk: a scheduler that frees one chunk too many
            if attn.rule.chunked and g < len(raw) and attn.first_key(c) >= attn.size:
                i = attn.first_key(c) // self.config.block_size
                if i < len(raw[g]) and raw[g][i] != 0:
                    raw[g][i] = 0
                    fault.fired.append(f"step {plan.step} request {s.request_id}: chunk_null "
                                       f"(group {g}'s block {i}, position {attn.first_key(c)}, nulled)")
                    return

    def _state_checkpoint_fault(self, plan: StepPlan, batch: StepBatch,
                                known_tokens: Mapping[str, Sequence[int]] | None) -> list[tuple[int, int, torch.Tensor]]:
        """``Fault("state_checkpoint")``: the first entry that restores a
        state starts from the checkpoint one block earlier; its read blocks
        hold that state for this forward only. Returns (layer, block, the
        state to put back) for each block it overwrote."""
        fault, state = self.fault, self.cache.state
        if fault is None or fault.kind != "state_checkpoint" or fault.fired or plan.step < fault.step:
            return []
        if state is None or known_tokens is None:  # no state layer (or no tokens to recompute from)
            return []
        bs = self.config.block_size
        for r, s in enumerate(plan.scheduled):
            c = s.num_computed_tokens
            if s.kind is ScheduleKind.RUNNING or c <= 0 or s.request_id not in known_tokens or (
                    s.request_id in fault.exclude) or (
                    fault.request_id is not None and fault.request_id != s.request_id):
                continue
            wrong = reference_states(self.model, list(known_tokens[s.request_id][:max(c - bs, 0)]))
            saved: list[tuple[int, int, torch.Tensor]] = []
            for layer, g in enumerate(self.model.layer_group):
                if self.group_attn[g].rule.keeps_state:
                    block = batch.state_read[g][r]
                    saved.append((layer, block, state[layer, block].clone()))
                    state[layer, block] = wrong[layer]
            fault.fired.append(f"step {plan.step} request {s.request_id}: state_checkpoint (the state after "
                               f"{max(c - bs, 0)} tokens restored where the one after {c} belongs)")
            return saved
        return []

    # ------------------------------------------------------------------ the KV connector's worker side

    def load_kv(self, load: KVLoad, tokens: Sequence[int], upto: int | None = None) -> None:
        """Perform one connector load (the check driver's KVWorker calls it:
        synchronous loads before the step's forward, asynchronous ones when
        it reports them finished): copy the stored K/V of positions
        ``load.start .. load.end - 1`` (below ``upto`` when given) from
        ``kv_source`` into the load's blocks, each layer through its KV cache
        group's table (``group_block_ids``; a sliding-window or chunked-local
        table's null blocks take nothing). ``tokens`` is the request's prompt: the store
        must hold K/V computed for those very tokens."""
        rid = load.request_id
        end = load.end if upto is None else min(load.end, upto)
        if end <= load.start:
            return
        step = self.steps  # the plan the load comes with (the next one executed)

        def bad(message: str) -> PlanError:
            return PlanError(step, rid, "kv_loads", message)

        if self.kv_source is None:
            raise bad("a connector load, but the executor has no KV store (source)")
        bs, nb = self.config.block_size, self.cache.num_blocks
        fault = self.fault
        shift = fault is not None and fault.kind == "kv_load" and not fault.fired and (
            fault.request_id is None or fault.request_id == rid)
        src: list[int] = []
        for p in range(load.start, end):
            if not self.kv_source.holds(rid, p):
                raise bad(f"the store holds no K/V of position {p}")
            if p < len(tokens) and self.kv_source.tokens[(rid, p)] != tokens[p]:
                raise bad(f"the store's K/V of position {p} is for token {self.kv_source.tokens[(rid, p)]}, "
                          f"the request has {tokens[p]} there")
            q = p
            if shift:
                q = p + 1 if self.kv_source.holds(rid, p + 1) else p - 1
            src.append(q)
        if shift and fault is not None:
            fault.fired.append(f"load of request {rid} positions {load.start}..{end - 1}: stored K/V shifted by one")
        tables = load.group_block_ids if self.config.is_hybrid else (load.block_ids,)
        if len(tables) != len(self.group_attn):
            raise bad(f"{len(tables)} tables for {len(self.group_attn)} KV cache groups")
        dev = self.model.device
        for g, tab in enumerate(tables):
            w = self.group_attn[g].rule.local  # a group whose freed blocks are nulls
            keep = []
            for p, q in zip(range(load.start, end), src):
                i = p // bs
                if i >= len(tab):
                    raise bad(f"group {g}'s table of {len(tab)} blocks cannot hold position {p}")
                b = tab[i]
                if not 0 <= b < nb or (b == 0 and not w):
                    raise bad(f"group {g}'s table gives block {b} for position {p}")
                if b != 0:
                    keep.append((b * bs + p % bs, q))
            if not keep:
                continue
            slot_t = torch.tensor([x for x, _ in keep], dtype=torch.int64, device=dev)
            ks = torch.stack([self.kv_source.kv[(rid, q)][0] for _, q in keep], dim=1)  # [L, n, KVH, Dh]
            vs = torch.stack([self.kv_source.kv[(rid, q)][1] for _, q in keep], dim=1)
            for layer, lg in enumerate(self.model.layer_group):
                if lg != g:
                    continue
                kc, vc = self.cache.flat(layer)
                kc.index_copy_(0, slot_t, ks[layer].to(dev))
                vc.index_copy_(0, slot_t, vs[layer].to(dev))
        self.kv_loads += 1
        self.kv_loaded_tokens += end - load.start
        self._loaded[rid] = load.end

    def _record(self, plan: StepPlan, batch: StepBatch) -> None:
        """Keep, in ``kv_record``, the K/V this step computed for each real token
        (drafts aside) that the store does not hold yet."""
        store = self.kv_record
        if store is None:
            return
        per_group: list[tuple[torch.Tensor, torch.Tensor]] = []
        for g in range(len(self.group_attn)):
            slots = batch.slots_of(g)
            layers = [i for i, lg in enumerate(self.model.layer_group) if lg == g]
            k = torch.stack([self.cache.flat(i)[0].index_select(0, slots) for i in layers])
            v = torch.stack([self.cache.flat(i)[1].index_select(0, slots) for i in layers])
            per_group.append((k, v))
        # layer i is the n-th layer of its group: its rows in per_group
        nth = [self.model.layer_group[:i].count(g) for i, g in enumerate(self.model.layer_group)]
        k_all = torch.stack([per_group[g][0][nth[i]] for i, g in enumerate(self.model.layer_group)])  # [L, N, KVH, Dh]
        v_all = torch.stack([per_group[g][1][nth[i]] for i, g in enumerate(self.model.layer_group)])
        toks = batch.token_ids.tolist()
        if self.fault is not None and self.fault.kind == "position":
            return  # a store filled by a faulty run is no store
        for s, start, length in zip(plan.scheduled, batch.seq_start, batch.seq_len):
            base = int(batch.positions[start])
            for j in range(length - len(s.spec_token_ids)):
                key = (s.request_id, base + j)
                if key not in store.kv:
                    store.kv[key] = (k_all[:, start + j].clone(), v_all[:, start + j].clone())
                    store.tokens[key] = toks[start + j]

    # ------------------------------------------------------------------ run

    def run(self, plan: StepPlan, known_tokens: Mapping[str, Sequence[int]] | None = None) -> StepOutput:
        """One forward over ``plan``; greedy tokens (accepted drafts, then the
        bonus token), drafts proposed for the next step, and each sampled
        token's logits row keyed by request (all of them, in order, under
        ``rows_by_position``)."""
        t0 = time.perf_counter()
        if not plan.scheduled:
            return StepOutput(StepResult({}), {}, 0, 0.0)
        batch, samplers = self._prepare(plan, known_tokens)
        restore = self._state_checkpoint_fault(plan, batch, known_tokens)
        logits = self.model.forward(batch, self.cache)
        for layer, block, saved in restore:
            assert self.cache.state is not None
            self.cache.state[layer, block] = saved
        if self.kv_record is not None:
            self._record(plan, batch)
        argmax = torch.argmax(logits, dim=-1).tolist()
        sampled: dict[str, tuple[int, ...]] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        positions: dict[tuple[str, int], int] = {}  # (request, position of a sampled token) -> logits row
        for sm in samplers:
            out: list[int] = []
            for i in range(len(sm.drafts) + 1):
                tok = int(argmax[sm.first_row + i])
                out.append(tok)
                positions[(sm.request_id, sm.last + 1 + i)] = sm.first_row + i
                if i == len(sm.drafts) or not sm.valid[i] or sm.drafts[i] != tok:
                    break
            accepted = len(out) - 1
            self.drafts_verified += len(sm.drafts)
            self.drafts_accepted += accepted
            sampled[sm.request_id] = tuple(out)
            self.outputs[sm.request_id] = {sm.last + 1 + i: t for i, t in enumerate(out)}
            self.rejected[sm.request_id] = len(sm.drafts) - accepted
            if self.num_speculative_tokens and known_tokens is not None and sm.request_id in known_tokens:
                history = list(known_tokens[sm.request_id][: sm.last + 1]) + list(out)
                proposal = prompt_lookup(history, self.num_speculative_tokens)
                if proposal:
                    drafts[sm.request_id] = proposal
        self._recent = [*self._recent, frozenset(plan.scheduled_ids)][-self._keep_plans:]
        keep = set().union(*self._recent)
        for store in (self.outputs, self.rejected):
            for rid in [r for r in store if r not in keep]:
                del store[rid]
        self.proposals = dict(drafts)
        rows: dict[str, torch.Tensor] = {}
        by_position: dict[tuple[str, int], torch.Tensor] = {}
        if self.keep_logits:
            cpu = logits.detach().to("cpu")
            by_position = {key: cpu[row] for key, row in positions.items()}
            for (rid, _), row in sorted(positions.items(), key=lambda kv: kv[1]):
                rows[rid] = cpu[row]  # the last sampled token's row
        dt = time.perf_counter() - t0
        self.steps += 1
        self.tokens += batch.num_tokens
        self.seconds += dt
        return StepOutput(StepResult(sampled, drafts), rows, batch.num_tokens, dt, by_position)

    def execute(self, plan: StepPlan, context: Mapping[str, Sequence[int]] | None = None) -> StepResult:
        """``run`` as a Model: the result, with each sampled token's row kept in
        ``logits`` at (request, its position)."""
        out = self.run(plan, context)
        self.logits.update(out.rows_by_position)
        return out.result


@dataclass(frozen=True)
class _Sampler:
    """A sampling entry of a batch: its first logits row, the position of its
    last real token, and its drafts (with which ones are valid ids)."""

    request_id: str
    first_row: int
    last: int
    drafts: tuple[int, ...]
    valid: tuple[bool, ...]


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = 3) -> tuple[int, ...]:
    """Drafts by prompt lookup (vllm/v1/spec_decode/ngram_proposer.py): the
    longest suffix of ``max_ngram`` .. 1 tokens that also occurs earlier in
    ``tokens`` (the latest such occurrence), and up to ``k`` tokens that
    followed it there; () when no suffix recurs."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        suffix = tuple(tokens[n_tok - n:])
        for start in range(n_tok - n - 1, -1, -1):
            if tuple(tokens[start:start + n]) == suffix:
                follow = tuple(tokens[start + n:start + n + k])
                if follow:
                    return follow
    return ()
