"""A deterministic fake model that reads its context through the paged KV.

The fake model behaves like a model runner with a KV cache: every scheduled
token is written into the slot its block table gives it, and a sampled token is
a function of the whole context *as read back from the slots* (positions
0 .. computed + scheduled - 1 through the block table). So a wrong block table,
a prefix hit on a block with other contents, a block reused while still shared,
a token emitted at the wrong moment or at the wrong position: each one changes
the generated text, and the driver also reports it directly, by comparing the
context read back with the request's true tokens.

``Model`` is what the driver needs of any model: ``execute(plan, context)``
returns the step's sampled tokens. The fake model satisfies it here; the torch
executor (schedspec.gpu_runner.executor.Executor) satisfies it on real weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, runtime_checkable

from schedspec.spec.interface import SchedSpecError, StepPlan, StepResult


@runtime_checkable
class Model(Protocol):
    """Runs the plans of one scheduler configuration, one step at a time."""

    def execute(self, plan: StepPlan, context: Mapping[str, Sequence[int]] | None = None) -> StepResult:
        """Run ``plan`` and sample a token for every entry that samples.

        ``context`` (request id -> every token the request has, prompt then
        outputs), when given, is what the scheduled tokens and the KV read
        back must agree with; a model that finds otherwise raises a
        SchedSpecError that names the request."""
        ...


@dataclass(frozen=True)
class ContextMismatch:
    """The KV read back for a sampling step is not the request's tokens."""

    request_id: str
    position: int
    expected: int | None
    found: int | None


class ContextError(SchedSpecError):
    """The fake model read a context that is not the request's tokens."""

    def __init__(self, mismatch: ContextMismatch) -> None:
        super().__init__(
            f"{mismatch.request_id}: position {mismatch.position} holds {mismatch.found}, "
            f"the request's token there is {mismatch.expected}"
        )
        self.mismatch = mismatch


class FakeModel:
    """A Model on a dictionary of slots; ``run`` also returns every context
    mismatch instead of raising at the first."""

    def __init__(self, block_size: int, vocab: int = 64, seed: int = 0) -> None:
        if vocab < 2:
            raise ValueError("vocab must be at least 2")
        self.block_size = block_size
        self.vocab = vocab
        self.seed = seed
        self.slots: dict[int, int] = {}  # slot (block * block_size + offset) -> token id

    def _slot(self, block_ids: tuple[int, ...], pos: int) -> int | None:
        idx = pos // self.block_size
        if idx >= len(block_ids):
            return None
        return block_ids[idx] * self.block_size + pos % self.block_size

    def sample_token(self, context: tuple[int | None, ...]) -> int:
        h = hashlib.blake2b(digest_size=8, key=self.seed.to_bytes(8, "little"))
        h.update(repr(context).encode())
        return int.from_bytes(h.digest(), "little") % self.vocab

    def execute(self, plan: StepPlan, context: Mapping[str, Sequence[int]] | None = None) -> StepResult:
        truth = None if context is None else {rid: tuple(toks) for rid, toks in context.items()}
        result, mismatches = self.run(plan, truth)
        if mismatches:
            raise ContextError(mismatches[0])
        return result

    def run(
        self,
        plan: StepPlan,
        true_tokens: dict[str, tuple[int, ...]] | None = None,
    ) -> tuple[StepResult, list[ContextMismatch]]:
        """Execute one plan. ``true_tokens`` (request id -> its tokens as the
        driver knows them) turns on the direct context check."""
        # Write every scheduled token first, as a runner writes the KV of the
        # whole batch before attention reads it.
        for s in plan.scheduled:
            for j, tok in enumerate(s.token_ids):
                slot = self._slot(s.block_ids, s.num_computed_tokens + j)
                if slot is not None and s.block_ids[(s.num_computed_tokens + j) // self.block_size] != 0:
                    self.slots[slot] = tok
        sampled: dict[str, tuple[int, ...]] = {}
        mismatches: list[ContextMismatch] = []
        for s in plan.scheduled:
            if not s.samples:
                continue
            end = s.num_computed_tokens + s.num_scheduled_tokens
            context: list[int | None] = []
            for pos in range(end):
                slot = self._slot(s.block_ids, pos)
                context.append(None if slot is None else self.slots.get(slot))
            ctx = tuple(context)
            sampled[s.request_id] = (self.sample_token(ctx),)
            if true_tokens is not None and s.request_id in true_tokens:
                truth = true_tokens[s.request_id]
                for pos in range(end):
                    want = truth[pos] if pos < len(truth) else None
                    if ctx[pos] != want:
                        mismatches.append(ContextMismatch(s.request_id, pos, want, ctx[pos]))
                        break
        return StepResult(sampled=sampled), mismatches
