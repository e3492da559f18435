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

Speculative decoding and async scheduling, as vLLM's worker does them:

- Drafts. After every step that samples, the fake model proposes drafts for
  the request's next step (``StepResult.draft_token_ids``, at most
  ``num_speculative_tokens``): its own greedy continuation, made wrong on
  purpose where the acceptance mode says so. ``"all"``: every draft is what
  the model will sample; ``"none"``: the first draft never is; ``"prefix"``:
  a keyed hash of the request and position picks how many leading drafts are
  right (0 .. k), so every acceptance pattern is reachable.
- Verification is greedy, as vLLM's rejection sampler with greedy sampling:
  output i is sampled from the context through draft i (read back through
  the block table like every other context), and draft i+1 is accepted while
  every draft before it was and it equals output i. The step returns the a
  accepted drafts, then the bonus token (the output after the last accepted
  draft): 1 + a tokens.
- In-flight positions. A scheduled -1 is an output the scheduler has not
  seen yet: the fake model fills it from what it sampled at that position in
  the request's last step, and a -1 draft from its own last proposals
  (kept only for the requests of the previous plan, as the worker's batch) (vllm/v1/worker/gpu_model_runner.py,
  _update_states and _prepare_input_ids). When the entry counts in-flight
  placeholders and the in-flight step rejected drafts, the entry's positions
  are optimistic: the model shifts them back by the rejected count, as the
  worker's deferred spec-decode correction does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, runtime_checkable

from schedspec.spec.interface import ScheduleKind, SchedSpecError, ScheduledRequest, StepPlan, StepResult


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
    """The KV read back for a sampling step is not the request's tokens (or,
    with ``reason``, an in-flight position the model cannot fill)."""

    request_id: str
    position: int
    expected: int | None
    found: int | None
    reason: str = ""


class ContextError(SchedSpecError):
    """The fake model read a context that is not the request's tokens."""

    def __init__(self, mismatch: ContextMismatch) -> None:
        if mismatch.reason:
            text = f"{mismatch.request_id}: position {mismatch.position}: {mismatch.reason}"
        else:
            text = (f"{mismatch.request_id}: position {mismatch.position} holds {mismatch.found}, "
                    f"the request's token there is {mismatch.expected}")
        super().__init__(text)
        self.mismatch = mismatch


class ScriptError(SchedSpecError, ValueError):
    """A recorded model output that does not fit the plan it is given for."""


#: How the fake model's drafts fare under verification (see the module text).
ACCEPTANCE_MODES: tuple[str, ...] = ("all", "none", "prefix")

#: A draft slot the model has nothing for: never equal to a sampled token.
_NO_TOKEN = -1


class FakeModel:
    """A Model on a dictionary of slots; ``run`` also returns every context
    mismatch instead of raising at the first.

    ``acceptance`` is one of ACCEPTANCE_MODES; None picks one from ``seed``
    (``ACCEPTANCE_MODES[seed % 3]``), so a workload's oracle seed also draws
    how its drafts fare."""

    def __init__(
        self,
        block_size: int,
        vocab: int = 64,
        seed: int = 0,
        *,
        num_speculative_tokens: int = 0,
        acceptance: str | None = None,
    ) -> None:
        if vocab < 2:
            raise ValueError("vocab must be at least 2")
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be at least 0")
        if acceptance is None:
            acceptance = ACCEPTANCE_MODES[seed % len(ACCEPTANCE_MODES)]
        if acceptance not in ACCEPTANCE_MODES:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE_MODES)}, got {acceptance!r}")
        self.block_size = block_size
        self.vocab = vocab
        self.seed = seed
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance = acceptance
        self.slots: dict[int, int] = {}  # slot (block * block_size + offset) -> token id
        #: request id -> position -> the token the model sampled there (what fills a -1)
        self.outputs: dict[str, dict[int, int]] = {}
        #: request id -> the drafts proposed after its last step (what fills a -1 draft)
        self.proposals: dict[str, tuple[int, ...]] = {}
        #: request id -> drafts its last sampling step rejected (the worker's correction)
        self.rejected: dict[str, int] = {}
        #: request id -> the token ids its structured-output grammar refuses
        self.grammars: dict[str, frozenset[int]] = {}

    def set_grammar(self, request_id: str, rejects: Sequence[int]) -> None:
        """Request ``request_id`` samples under a grammar that refuses
        ``rejects`` (RequestSpec.grammar_rejects): the model never samples one
        of them for it, as a structured-output bitmask keeps the sampler off
        refused tokens (its drafts, made wrong on purpose, still may hold one)."""
        if rejects:
            self.grammars[request_id] = frozenset(rejects)
        else:
            self.grammars.pop(request_id, None)

    def _slot(self, block_ids: tuple[int, ...], pos: int) -> int | None:
        idx = pos // self.block_size
        if idx >= len(block_ids):
            return None
        return block_ids[idx] * self.block_size + pos % self.block_size

    def sample_token(self, context: tuple[int | None, ...]) -> int:
        h = hashlib.blake2b(digest_size=8, key=self.seed.to_bytes(8, "little"))
        h.update(repr(context).encode())
        return int.from_bytes(h.digest(), "little") % self.vocab

    def sample_for(self, request_id: str, context: tuple[int | None, ...]) -> int:
        """The token request ``request_id`` samples after ``context``:
        ``sample_token``'s, or under a grammar the first token from there on
        (cyclically) that the grammar allows."""
        tok = self.sample_token(context)
        refused = self.grammars.get(request_id)
        if refused:
            for j in range(self.vocab):
                if (tok + j) % self.vocab not in refused:
                    return (tok + j) % self.vocab
        return tok

    def _read(self, block_ids: tuple[int, ...], end: int) -> tuple[int | None, ...]:
        """Positions 0 .. end-1 as read back through ``block_ids``."""
        out: list[int | None] = []
        for pos in range(end):
            slot = self._slot(block_ids, pos)
            out.append(None if slot is None else self.slots.get(slot))
        return tuple(out)

    def execute(self, plan: StepPlan, context: Mapping[str, Sequence[int]] | None = None) -> StepResult:
        truth = None if context is None else {rid: tuple(toks) for rid, toks in context.items()}
        result, mismatches = self.run(plan, truth)
        if mismatches:
            raise ContextError(mismatches[0])
        return result

    def execute_recorded(
        self, plan: StepPlan, recorded: StepResult, context: Mapping[str, Sequence[int]] | None = None
    ) -> StepResult:
        """``execute`` with a recorded output: the tokens and drafts of the
        requests ``recorded`` names replace the model's own (ScriptError when
        they do not fit the plan)."""
        truth = None if context is None else {rid: tuple(toks) for rid, toks in context.items()}
        result, mismatches = self.run(plan, truth, recorded)
        if mismatches:
            raise ContextError(mismatches[0])
        return result

    def _positions(self, s: ScheduledRequest) -> int:
        """The true position of the entry's first scheduled token: its
        ``num_computed_tokens`` less the drafts the in-flight step rejected,
        when the entry counts that step's output as placeholders."""
        if s.num_output_placeholders > 0:
            return s.num_computed_tokens - self.rejected.get(s.request_id, 0)
        return s.num_computed_tokens

    def _fill(self, s: ScheduledRequest, base: int, mismatches: list[ContextMismatch]) -> list[int]:
        """The entry's tokens with every -1 filled as the worker fills it."""
        rid = s.request_id
        num_drafts = len(s.spec_token_ids)
        first_draft = s.num_scheduled_tokens - num_drafts
        known = self.outputs.get(rid, {})
        proposals = self.proposals.get(rid, ()) if s.kind is ScheduleKind.RUNNING else ()
        filled: list[int] = []
        for j, tok in enumerate(s.token_ids):
            if tok == -1:
                if j >= first_draft:
                    i = j - first_draft
                    tok = proposals[i] if i < len(proposals) else _NO_TOKEN
                elif base + j in known:
                    tok = known[base + j]
                else:
                    mismatches.append(ContextMismatch(
                        rid, base + j, None, None,
                        "a -1 placeholder where the model has sampled nothing "
                        "(no output of this request is in flight at that position)"))
            filled.append(tok)
        return filled

    def run(
        self,
        plan: StepPlan,
        true_tokens: dict[str, tuple[int, ...]] | None = None,
        recorded: StepResult | None = None,
    ) -> tuple[StepResult, list[ContextMismatch]]:
        """Execute one plan. ``true_tokens`` (request id -> its tokens as the
        driver knows them, in-flight outputs included) turns on the direct
        context check; ``recorded`` replaces the model's output for the
        requests it names."""
        mismatches: list[ContextMismatch] = []
        # Fill and write every scheduled token first, as a runner writes the
        # KV of the whole batch before attention reads it.
        layout: list[tuple[ScheduledRequest, int, list[int]]] = []
        for s in plan.scheduled:
            base = self._positions(s)
            filled = self._fill(s, base, mismatches)
            layout.append((s, base, filled))
            for j, tok in enumerate(filled):
                pos = base + j
                slot = self._slot(s.block_ids, pos)
                if slot is not None and tok != _NO_TOKEN and s.block_ids[pos // self.block_size] != 0:
                    self.slots[slot] = tok
        sampled: dict[str, tuple[int, ...]] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        for s, base, filled in layout:
            rid = s.request_id
            self.proposals.pop(rid, None)
            self.rejected.pop(rid, None)
            if not s.samples:
                self.outputs.pop(rid, None)
                continue
            num_drafts = len(s.spec_token_ids)
            last = base + s.num_scheduled_tokens - num_drafts - 1  # the last real token's position
            if true_tokens is not None and rid in true_tokens:
                truth = true_tokens[rid]
                ctx = self._read(s.block_ids, last + 1)
                for pos in range(last + 1):
                    want = truth[pos] if pos < len(truth) else None
                    if ctx[pos] != want:
                        mismatches.append(ContextMismatch(rid, pos, want, ctx[pos]))
                        break
            toks = self._verify(s, last, filled[len(filled) - num_drafts:], recorded)
            sampled[rid] = toks
            accepted = len(toks) - 1
            self.outputs[rid] = {last + 1 + i: tok for i, tok in enumerate(toks)}
            self.rejected[rid] = num_drafts - accepted
            if recorded is not None and rid in recorded.draft_token_ids:
                proposal = tuple(recorded.draft_token_ids[rid])
            else:
                proposal = self._propose(s, last + accepted, toks[-1])
            if proposal:
                drafts[rid] = proposal
                self.proposals[rid] = proposal
        # What fills a -1 lives as long as the worker's batch row: the
        # requests of this plan (a request's in-flight output is always its
        # output in the plan just before).
        keep = set(plan.scheduled_ids)
        for store in (self.outputs, self.proposals, self.rejected):
            for rid in [r for r in store if r not in keep]:
                del store[rid]
        if recorded is not None:
            unknown = sorted(set(recorded.sampled) - set(sampled))
            if unknown:
                raise ScriptError(
                    f"step {plan.step}: the recorded output has tokens for {unknown[0]!r}, "
                    "which this plan does not sample")
        return StepResult(sampled=sampled, draft_token_ids=drafts), mismatches

    def _verify(
        self, s: ScheduledRequest, last: int, draft: list[int], recorded: StepResult | None
    ) -> tuple[int, ...]:
        """Greedy verification: the accepted drafts, then the bonus token."""
        rid = s.request_id
        if recorded is not None and rid in recorded.sampled:
            toks = tuple(recorded.sampled[rid])
            if not 1 <= len(toks) <= 1 + len(draft):
                raise ScriptError(
                    f"the recorded output for {rid!r} has {len(toks)} tokens; its entry verifies "
                    f"{len(draft)} drafts, so it takes 1 to {1 + len(draft)}")
            return toks
        out: list[int] = []
        for i in range(len(draft) + 1):
            tok = self.sample_for(rid, self._read(s.block_ids, last + 1 + i))
            out.append(tok)
            if i == len(draft) or draft[i] != tok:
                break
        return tuple(out)

    def drafts_right(self, request_id: str, position: int, context: tuple[int | None, ...]) -> int:
        """"prefix" acceptance: how many (0 .. k) of the k drafts proposed
        after ``context`` (the request's tokens through ``position``, read
        back, then the bonus token) are right; a hash of the request id and
        the position. A subclass may key it on something else (the model
        checker keys it on ``context``, which its states hold)."""
        h = hashlib.blake2b(digest_size=8, key=self.seed.to_bytes(8, "little"))
        h.update(f"{request_id}:{position}".encode())
        return int.from_bytes(h.digest(), "little") % (self.num_speculative_tokens + 1)

    def _propose(self, s: ScheduledRequest, last: int, bonus: int) -> tuple[int, ...]:
        """Drafts for the request's next step, after its context through
        position ``last`` and then ``bonus``."""
        k = self.num_speculative_tokens
        if k == 0:
            return ()
        ctx = after = self._read(s.block_ids, last + 1) + (bonus,)
        perfect: list[int] = []
        for _ in range(k):
            tok = self.sample_for(s.request_id, ctx)
            perfect.append(tok)
            ctx = ctx + (tok,)
        if self.acceptance == "all":
            right = k
        elif self.acceptance == "none":
            right = 0
        else:
            right = self.drafts_right(s.request_id, last, after)
        if right < k:
            perfect[right] = (perfect[right] + 1) % self.vocab
        return tuple(perfect)
