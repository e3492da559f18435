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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch

from schedspec.spec.interface import SchedSpecError, SchedulerConfig, StepPlan, StepResult

from schedspec.gpu_runner.model import LlamaWeights, PagedKVCache, PagedLlama, StepBatch


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


def pick_device(device: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
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

    def reset(self) -> None:
        """Zero the whole cache (a fresh run on the same pool)."""
        self.cache.k.zero_()
        self.cache.v.zero_()

    # ------------------------------------------------------------------ batch

    def build_batch(
        self, plan: StepPlan, known_tokens: Mapping[str, Sequence[int]] | None = None
    ) -> StepBatch:
        """Validate ``plan`` and flatten it. ``known_tokens[rid]``, when given,
        is every token the request has (prompt then outputs); the scheduled
        ``token_ids`` must be its slice at the scheduled positions."""
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
        seen: set[str] = set()
        for r, s in enumerate(plan.scheduled):
            rid = s.request_id

            def bad(field_name: str, message: str) -> PlanError:
                return PlanError(plan.step, rid, field_name, message)

            if rid in seen:
                raise bad("request_id", "scheduled twice in one plan")
            seen.add(rid)
            n, c = s.num_scheduled_tokens, s.num_computed_tokens
            if n < 1 or len(s.token_ids) != n:
                raise bad("token_ids", f"{len(s.token_ids)} token ids for {n} scheduled tokens")
            if c < 0:
                raise bad("num_computed_tokens", f"negative ({c})")
            end = c + n
            if end > window:
                raise bad("num_scheduled_tokens", f"position {end - 1} is past the window {window}")
            if end > s.num_tokens:
                raise bad("num_scheduled_tokens", f"computes up to {end} of {s.num_tokens} known tokens")
            table = list(s.block_ids)
            need = (end + bs - 1) // bs
            if len(table) < need:
                raise bad("block_ids", f"{len(table)} blocks cannot hold {end} tokens of {bs}")
            for b in table:
                if not 0 < b < nb:
                    what = "the null block 0" if b == 0 else f"block {b} outside the pool of {nb}"
                    raise bad("block_ids", f"the table holds {what}")
            for t in s.token_ids:
                if not 0 <= t < vocab:
                    raise bad("token_ids", f"token {t} outside the vocabulary of {vocab}")
            if known_tokens is not None and rid in known_tokens:
                want = tuple(known_tokens[rid][c:end])
                if tuple(s.token_ids) != want:
                    raise bad("token_ids", f"scheduled {s.token_ids!r}, the request has {want!r} there")
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
            for p, t in zip(range(c, end), s.token_ids):
                toks.append(t)
                slots.append(table[p // bs] * bs + p % bs)
                token_request.append(r)
            positions.extend(pos)
            row = [b * bs + j for b in table for j in range(bs)][:window]
            key_rows.append(row + [0] * (window - len(row)))
            if s.samples:
                logit_rows.append(len(toks) - 1)
        if len(set(slots)) != len(slots):
            dup = next(x for x in slots if slots.count(x) > 1)
            raise PlanError(plan.step, "*", "block_ids", f"two tokens write slot {dup} in one step")
        dev = self.model.device

        def t64(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=dev)

        return StepBatch(
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

    # ------------------------------------------------------------------ run

    def run(self, plan: StepPlan, known_tokens: Mapping[str, Sequence[int]] | None = None) -> StepOutput:
        t0 = time.perf_counter()
        if not plan.scheduled:
            return StepOutput(StepResult({}), {}, 0, 0.0)
        batch = self.build_batch(plan, known_tokens)
        logits = self.model.forward(batch, self.cache)
        sampled_ids = torch.argmax(logits, dim=-1).tolist()
        samplers = [s.request_id for s in plan.scheduled if s.samples]
        sampled = {rid: (int(tok),) for rid, tok in zip(samplers, sampled_ids)}
        rows: dict[str, torch.Tensor] = {}
        if self.keep_logits:
            cpu = logits.detach().to("cpu")
            rows = {rid: cpu[i] for i, rid in enumerate(samplers)}
        dt = time.perf_counter() - t0
        self.steps += 1
        self.tokens += batch.num_tokens
        self.seconds += dt
        return StepOutput(StepResult(sampled), rows, batch.num_tokens, dt)

    def execute(self, plan: StepPlan, context: Mapping[str, Sequence[int]] | None = None) -> StepResult:
        """``run`` as a Model: the result, with each sampled row kept in ``logits``."""
        out = self.run(plan, context)
        if out.logits:
            for s in plan.scheduled:
                row = out.logits.get(s.request_id)
                if row is not None:
                    self.logits[(s.request_id, s.num_tokens)] = row
        return out.result
