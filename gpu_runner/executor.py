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
table, or shifted positions); the equivalence matrix's negative control uses
it to show that a wrong KV address is caught.

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

from schedspec.spec.interface import ScheduledRequest, ScheduleKind, SchedSpecError, SchedulerConfig, StepPlan, StepResult

from schedspec.gpu_runner.model import LlamaWeights, PagedKVCache, PagedLlama, StepBatch, set_cuda_determinism


class PlanError(SchedSpecError, ValueError):
    """A plan that no model runner could execute; names the request and field."""

    def __init__(self, step: int, request_id: str, field_name: str, message: str) -> None:
        super().__init__(f"step {step}: request {request_id!r}: {field_name}: {message}")
        self.step = step
        self.request_id = request_id
        self.field = field_name


FaultKind = Literal["block_table", "position"]


@dataclass
class Fault:
    """Corrupt one scheduled entry once: the first entry of ``request_id`` (any
    request when None) at or after plan step ``step``.

    ``block_table``: the entry's last block is replaced, for this step, by
    a block that no entry of the plan holds (when the pool has one), so its K/V are written to and read from
    the wrong place. ``position``: the entry's positions are shifted by +1 for
    RoPE (the slots stay right)."""

    kind: FaultKind
    step: int = 0
    request_id: str | None = None
    fired: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ("block_table", "position"):
            raise ValueError(f"fault kind must be 'block_table' or 'position', got {self.kind!r}")


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


class Executor:
    """Executes StepPlans of one scheduler configuration on one model."""

    def __init__(
        self,
        model: PagedLlama | LlamaWeights,
        config: SchedulerConfig,
        *,
        fault: Fault | None = None,
        keep_logits: bool = True,
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
        self.cache = PagedKVCache.allocate(model.config, config.num_blocks, config.block_size, model.device)
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
        #: counts: drafts verified and accepted, entries planned with outputs in flight
        self.drafts_verified = 0
        self.drafts_accepted = 0
        self.in_flight_entries = 0

    def reset(self) -> None:
        """Zero the whole cache (a fresh run on the same pool)."""
        self.cache.k.zero_()
        self.cache.v.zero_()

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
        toks: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_request: list[int] = []
        key_rows: list[list[int]] = []
        seq_start: list[int] = []
        seq_len: list[int] = []
        ctx_len: list[int] = []
        logit_rows: list[int] = []
        samplers: list[_Sampler] = []
        seen: set[str] = set()
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
            table = list(s.block_ids)
            need = (end + bs - 1) // bs
            if len(table) < need:
                raise bad("block_ids", f"{len(table)} blocks cannot hold {end} tokens of {bs}")
            for b in table:
                if not 0 < b < nb:
                    what = "the null block 0" if b == 0 else f"block {b} outside the pool of {nb}"
                    raise bad("block_ids", f"the table holds {what}")
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
            if fault is not None and not fault.fired and plan.step >= fault.step and (
                fault.request_id is None or fault.request_id == rid
            ):
                fault.fired.append(f"step {plan.step} request {rid}: {fault.kind}")
                if fault.kind == "block_table":
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
                slots.append(table[p // bs] * bs + p % bs)
                token_request.append(r)
            positions.extend(pos)
            row = [b * bs + j for b in table for j in range(bs)][:window]
            key_rows.append(row + [0] * (window - len(row)))
            if s.samples:
                last_row = len(toks) - 1 - d
                samplers.append(_Sampler(rid, len(logit_rows), end - d - 1, tuple(filled[n - d:]), tuple(valid)))
                logit_rows.extend(range(last_row, last_row + d + 1))
            if s.num_output_placeholders:
                self.in_flight_entries += 1
        if len(set(slots)) != len(slots):
            dup = next(x for x in slots if slots.count(x) > 1)
            raise PlanError(plan.step, "*", "block_ids", f"two tokens write slot {dup} in one step")
        dev = self.model.device

        def t64(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=dev)

        batch = StepBatch(
            token_ids=t64(toks),
            positions=t64(positions),
            slot_mapping=t64(slots),
            token_request=t64(token_request),
            key_slots=torch.tensor(key_rows, dtype=torch.int64, device=dev).reshape(len(key_rows), window),
            seq_start=seq_start,
            seq_len=seq_len,
            ctx_len=ctx_len,
            logit_rows=t64(logit_rows),
            window=window,
        )
        return batch, samplers

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
        logits = self.model.forward(batch, self.cache)
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
        keep = set(plan.scheduled_ids)
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
