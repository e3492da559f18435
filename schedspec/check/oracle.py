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
  right (0 .. k), so every acceptance pattern is reachable. A step that does
  not sample (a partial prefill chunk) may get drafts too, as from a drafter
  with its own forward pass (``chunk_drafts``); the scheduler drops them.
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
- Without speculative decoding the result still says an empty proposal for
  every sampling request on one step in SILENT_EVERY, as an engine whose
  drafter is off may; the scheduler has nothing to verify.
- A request aborted while its step ran: on every other step the result
  leaves its tokens out (``without_aborted``), as the protocol allows (the
  scheduler drops whatever comes for it); on the others they come as sampled.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from schedspec.spec.interface import (
    KVCacheGroup,
    KVLoad,
    ScheduleKind,
    SchedSpecError,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)
from schedspec.check.kv_kinds import CheckKind, check_kind
from schedspec.check.workload import KV_REPORT_BOUND, KVEvent, KVLoadDone, KVLoadFailed, KVSaveDone


#: Without speculative decoding, every SILENT_EVERY-th step still says an
#: empty proposal for each request that samples.
SILENT_EVERY = 8


def without_aborted(result: StepResult, aborted: set[str], step: int) -> StepResult:
    """``result`` with no tokens for the requests ``aborted`` while the step
    ran, on odd steps (vLLM's update_from_output skips a request no longer in
    Scheduler.requests, whatever it got)."""
    if not step % 2 or aborted.isdisjoint(result.sampled):
        return result
    return replace(result, sampled={rid: t for rid, t in result.sampled.items() if rid not in aborted})


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

    #: a step in this many says an empty proposal without speculative decoding (0: never)
    silent_every = SILENT_EVERY

    def __init__(
        self,
        block_size: int,
        vocab: int = 64,
        seed: int = 0,
        *,
        num_speculative_tokens: int = 0,
        acceptance: str | None = None,
        groups: Sequence[KVCacheGroup] = (),
        rows: int = 1,
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
        #: the request ids of the last ``rows`` plans: whose outputs may still
        #: be in flight (one plan, or with Model Runner V2's decode throttle
        #: under a pipeline the plans since a request's last decode: its
        #: sampled tokens live in the worker's per-request state, not in a
        #: batch row; k - 1 of k plans in flight)
        self._recent: list[frozenset[str]] = []
        self._rows = max(1, rows)
        #: request id -> position -> the token the model sampled there (what fills a -1)
        self.outputs: dict[str, dict[int, int]] = {}
        #: request id -> the drafts proposed after its last step (what fills a -1 draft)
        self.proposals: dict[str, tuple[int, ...]] = {}
        #: request id -> drafts its last sampling step rejected (the worker's correction)
        self.rejected: dict[str, int] = {}
        #: request id -> the token ids its structured-output grammar refuses
        self.grammars: dict[str, frozenset[int]] = {}
        #: the KV cache groups, for the entries that carry group tables (a
        #: hybrid layout), and each one's attention rule (check/kv_kinds.py)
        self.groups: tuple[KVCacheGroup, ...] = tuple(groups)
        self.kinds: tuple[CheckKind, ...] = tuple(check_kind(g.kind) for g in groups)
        #: False (the default): a position of a sliding-window group's window
        #: (a chunked-local group's chunk) whose block the table holds as the
        #: null block is not checked, as vLLM 0.33 reads the null block there
        #: after rewinding into the window (an asynchronous load promoted
        #: with its last token to recompute, whose block remove_skipped_blocks
        #: freed at the load's count; a failed load recomputed from its first
        #: invalid block); True: such a read is a context mismatch too
        self.strict_windows = False

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

    def _tables(self, s: ScheduledRequest) -> tuple[tuple[int, ...], ...]:
        """The block tables the entry's tokens are written through: every
        group's for a hybrid layout, else the one table."""
        return s.group_block_ids or (s.block_ids,)

    def _local(self, group: int) -> bool:
        """Whether the group reads only part of the context (a window or a
        chunk), so that its manager frees the blocks before that part."""
        return self.kinds[group].local(self.groups[group]) if group < len(self.kinds) else False

    def _first_read(self, group: int, end: int) -> int:
        """The first position the query at position end-1 reads in the
        group: 0 for full attention, the last W positions for a sliding
        window of W, the start of its chunk for a chunked-local group of C
        (vLLM's get_num_skipped_tokens of SlidingWindowManager and
        ChunkedLocalAttentionManager, for end-1 tokens computed)."""
        if group >= len(self.kinds):
            return 0
        return self.kinds[group].first_read(self.groups[group], end)

    def _groups_read(self, s: ScheduledRequest, end: int) -> list[tuple[int, tuple[int | None, ...]]]:
        """Per KV cache group, (first position, positions first .. end-1 as
        read back through the group's table): a full-attention group reads
        the whole context, a sliding-window group of W tokens the last W
        positions, a chunked-local group the positions of the last one's
        chunk (_first_read)."""
        out: list[tuple[int, tuple[int | None, ...]]] = []
        for g, table in enumerate(s.group_block_ids):
            lo = self._first_read(g, end)
            out.append((lo, self._read(table, end)[lo:]))
        return out

    def _ctx(self, s: ScheduledRequest, end: int) -> tuple[int | None, ...]:
        """What a token sampled after positions 0 .. end-1 depends on: the
        context read back through the block table; for a hybrid layout every
        group's read, one after another (a sliding-window group's window, a
        chunked-local group's chunk only)."""
        if not s.group_block_ids:
            return self._read(s.block_ids, end)
        return tuple(tok for _, part in self._groups_read(s, end) for tok in part)

    def _mismatch(self, s: ScheduledRequest, end: int, truth: tuple[int, ...]) -> ContextMismatch | None:
        """The first position below ``end`` whose read-back is not the
        request's token (every group's read for a hybrid layout)."""
        reads = self._groups_read(s, end) if s.group_block_ids else [(0, self._read(s.block_ids, end))]
        for g, (lo, ctx) in enumerate(reads):
            table = s.group_block_ids[g] if s.group_block_ids else s.block_ids
            for j, found in enumerate(ctx):
                pos = lo + j
                want = truth[pos] if pos < len(truth) else None
                if (found is None and self._local(g) and not self.strict_windows
                        and pos // self.block_size < len(table) and table[pos // self.block_size] == 0):
                    # a sliding-window (chunk) position whose block was freed: vLLM
                    # reads the null block there after a rewind into the
                    # window (a promoted load's last token, a failed load's
                    # recompute); see strict_windows
                    continue
                if found != want:
                    reason = ""
                    if s.group_block_ids:
                        reason = (f"KV cache group {g} holds {found} at this position, "
                                  f"the request's token there is {want}")
                    return ContextMismatch(s.request_id, pos, want, found, reason)
        return None

    def load_kv(self, load: KVLoad, tokens: Sequence[int], upto: int | None = None) -> None:
        """The connector's worker writes the loaded KV: tokens ``load.start``
        .. ``load.end - 1`` (below ``upto`` when given: a load that failed
        from there on) into the load's blocks, every group's for a hybrid
        layout (the null block 0 of a sliding-window table takes nothing)."""
        end = load.end if upto is None else min(load.end, upto)
        for table in load.group_block_ids or (load.block_ids,):
            for pos in range(load.start, min(end, len(tokens))):
                slot = self._slot(table, pos)
                if slot is not None and table[pos // self.block_size] != 0:
                    self.slots[slot] = tokens[pos]

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
            for table in self._tables(s):
                for j, tok in enumerate(filled):
                    pos = base + j
                    slot = self._slot(table, pos)
                    if slot is not None and tok != _NO_TOKEN and table[pos // self.block_size] != 0:
                        self.slots[slot] = tok
        sampled: dict[str, tuple[int, ...]] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        for s, base, filled in layout:
            rid = s.request_id
            self.proposals.pop(rid, None)
            self.rejected.pop(rid, None)
            if not s.samples:
                self.outputs.pop(rid, None)
                stray = self.chunk_drafts(s, base) if recorded is None else recorded.draft_token_ids.get(rid, ())
                if stray:
                    drafts[rid] = tuple(stray)
                continue
            num_drafts = len(s.spec_token_ids)
            last = base + s.num_scheduled_tokens - num_drafts - 1  # the last real token's position
            if true_tokens is not None and rid in true_tokens:
                found = self._mismatch(s, last + 1, true_tokens[rid])
                if found is not None:
                    mismatches.append(found)
            toks = self._verify(s, last, filled[len(filled) - num_drafts:], recorded)
            sampled[rid] = toks
            accepted = len(toks) - 1
            self.outputs[rid] = {last + 1 + i: tok for i, tok in enumerate(toks)}
            self.rejected[rid] = num_drafts - accepted
            if recorded is not None and rid in recorded.draft_token_ids:
                proposal = tuple(recorded.draft_token_ids[rid])
            else:
                proposal = self._propose(s, last + accepted, toks[-1])
            if proposal or self.num_speculative_tokens or (self.silent_every and plan.step % self.silent_every == 1):
                # an empty proposal is said, as a drafter with no match says
                # it; without speculative decoding too, now and then (legal:
                # StepResult.draft_token_ids, an empty tuple for any entry)
                drafts[rid] = proposal
                if self.num_speculative_tokens:
                    self.proposals[rid] = proposal
        # What fills a -1 lives as long as the worker keeps the request: the
        # requests of this plan (a request's in-flight output is its output
        # in the plan just before), or of the last ``rows`` plans.
        self._recent = [*self._recent[-(self._rows - 1):], frozenset(plan.scheduled_ids)] if self._rows > 1 else []
        keep = set(plan.scheduled_ids).union(*self._recent)
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
            tok = self.sample_for(rid, self._ctx(s, last + 1 + i))
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

    def chunk_drafts(self, s: ScheduledRequest, base: int) -> tuple[int, ...]:
        """Drafts for an entry that does not sample (a partial prefill chunk):
        a drafter with its own forward pass proposes for every request of the
        batch, and the scheduler must drop them (update_draft_token_ids). A
        hash of the request id and the chunk's first position picks 0 .. k of
        them, so both cases occur."""
        k = self.num_speculative_tokens
        if k == 0:
            return ()
        h = hashlib.blake2b(digest_size=8, key=self.seed.to_bytes(8, "little"))
        h.update(f"chunk:{s.request_id}:{base}".encode())
        n = int.from_bytes(h.digest(), "little")
        return tuple((n >> (8 * i)) % self.vocab for i in range(1, 1 + n % (k + 1)))

    def _propose(self, s: ScheduledRequest, last: int, bonus: int) -> tuple[int, ...]:
        """Drafts for the request's next step, after its context through
        position ``last`` and then ``bonus``."""
        k = self.num_speculative_tokens
        if k == 0:
            return ()
        ctx = after = self._ctx(s, last + 1) + (bonus,)
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
            if right < k and self.drafts_right(s.request_id, -1 - last, after) % 2:
                # A drafter that stops short, as vLLM's n-gram proposer does
                # when its match runs out: fewer than k drafts, all right,
                # none at all when the first would be wrong.
                return tuple(perfect[:right])
        if right < k:
            perfect[right] = (perfect[right] + 1) % self.vocab
        if right < k and self.grammars.get(s.request_id):
            # under a grammar, each draft after the first wrong one too: a
            # drafter gone astray proposes from a context the model never
            # reaches, so several drafts may be ones the grammar refuses
            for i in range(right + 1, k):
                perfect[i] = (perfect[i] + 1 + i - right) % self.vocab
        return tuple(perfect)


# ---------------------------------------------------------------------------
# The KV connector's worker side
# ---------------------------------------------------------------------------


@dataclass
class AsyncLoad:
    """An asynchronous load the worker has started and not reported."""

    load: KVLoad
    step: int  # the plan whose kv_loads started it


@dataclass
class KVReport:
    """What the worker reported in one result (the driver's statistics read it)."""

    finished_recving: tuple[str, ...] = ()
    finished_sending: tuple[str, ...] = ()
    failed_recving: tuple[str, ...] = ()
    invalid_block_ids: tuple[int, ...] = ()
    #: requests whose synchronous load failed in this plan, and those of the
    #: plan reading a block it failed to fill (their samples are discarded)
    sync_failed: tuple[str, ...] = ()
    #: request id -> the invalid block of its failed synchronous load
    sync_blocks: Mapping[str, int] = field(default_factory=dict)
    #: reports the bounded wait forced (loads done, saves done)
    timed_out: int = 0


class KVWorker:
    """The KV connector's worker, as the fake model plays it beside one
    scheduler (vLLM's KVConnectorBase_V1 worker side and its
    KVConnectorOutput).

    It reads each plan's ``kv_loads`` and the scheduler's view, queues the
    workload's KVLoadDone / KVLoadFailed / KVSaveDone events and delivers
    each in the StepResult of the first plan where it is meaningful:

    - finished_recving for an asynchronous load in flight (its request in
      WAITING_FOR_REMOTE_KVS, or aborted during the load and still holding
      its blocks); the loaded KV is written then;
    - a failed asynchronous load: failed_recving (``block_index`` None, or
      any failure with more than one KV cache group) or the invalid block in
      invalid_block_ids, the request in finished_recving too; the KV before
      the invalid block is written, nothing from it on;
    - a failed synchronous load: the invalid block in the result of the plan
      that loads it (its KV is written up to that block before the forward;
      the request still gets its sample, read from the unfilled block, which
      the scheduler discards as vLLM's update_from_output skips the request:
      the driver never counts it as the request's token); dropped with more
      than one group;
    - finished_sending for a finished request holding its blocks for an
      asynchronous save (SchedulerView.kv_held_by_finished).

    An event that is not meaningful yet waits while its request is
    unfinished; one whose request is finished and holds nothing (or was
    never added) is dropped. At most one report per request per result: a
    second event for it waits for the next.

    The bounded wait: every asynchronous load is reported done at the
    latest ``bound`` steps after the plan that started it, every pending
    save ``bound`` steps after the first plan that saw its blocks held.

    ``updated(step)`` tells the worker the result of plan ``step`` was
    applied (a request whose load was reported there and that was aborted
    before is then freed, not held for a save)."""

    def __init__(self, config: SchedulerConfig, model: FakeModel | None = None, bound: int | None = None) -> None:
        self.config = config
        self.model = model
        self.bound = KV_REPORT_BOUND if bound is None else bound
        self.block_size = config.block_size
        self.multi_group = len(config.groups) > 1
        #: the workload's worker events not yet delivered or dropped, in order
        #: (KVEvent items; typed Any so a caller may splice in other event lists it filters)
        self.queue: list[Any] = []
        #: request id -> its asynchronous load in flight
        self.loads: dict[str, AsyncLoad] = {}
        #: request id -> the step whose plan first saw it held for a save
        self.saves: dict[str, int] = {}
        #: step -> the requests its result reported (loads and saves), until updated
        self.unapplied: dict[int, set[str]] = {}
        #: request id -> its prompt (the KV the connector's store holds)
        self.prompts: dict[str, tuple[int, ...]] = {}
        #: the synchronous failures of the plan being executed (set by before())
        self._sync_invalid: dict[str, int] = {}
        #: the requests of that plan the failed blocks affect (set by before())
        self._affected: set[str] = set()
        self.last = KVReport()

    # ------------------------------------------------------------ the driver

    def add(self, request_id: str, prompt: Sequence[int]) -> None:
        self.prompts[request_id] = tuple(prompt)

    def post(self, event: KVEvent) -> None:
        """Queue a KVLoadDone, KVLoadFailed or KVSaveDone."""
        self.queue.append(event)

    def updated(self, step: int) -> None:
        self.unapplied.pop(step, None)

    @property
    def reports_pending(self) -> bool:
        """Whether an asynchronous load is in flight or a report awaits its
        update (held saves show in the view)."""
        return bool(self.loads or self.saves or self.unapplied)

    def before(self, plan: StepPlan) -> set[str]:
        """Before the plan's forward: start its asynchronous loads, write
        the KV of its synchronous loads (up to a failed block). Returns the
        requests whose synchronous load fails in this plan (their context
        is not checked and their sample is discarded)."""
        self._sync_invalid = {}
        self._affected = set()
        for load in plan.kv_loads:
            rid = load.request_id
            if load.asynchronous:
                self.loads[rid] = AsyncLoad(load, plan.step)
                continue
            failed = next((e for e in self.queue if isinstance(e, KVLoadFailed) and e.request_id == rid), None)
            upto: int | None = None
            if failed is not None:
                self.queue.remove(failed)
                if not self.multi_group:
                    index = self._index(load, failed.block_index)
                    if index is not None:
                        self._sync_invalid[rid] = load.block_ids[index]
                        upto = index * self.block_size
            self._write(load, upto)
        affected = set(self._sync_invalid)
        if self._sync_invalid:
            # every request of the plan whose computed blocks hold a block a
            # synchronous load failed to fill reads it (a prefix hit on it in
            # this very step): vLLM's _update_requests_with_invalid_blocks
            # affects it too, and its sample is discarded
            bad = set(self._sync_invalid.values())
            for entry in plan.scheduled:
                n = -(-entry.num_computed_tokens // self.block_size)
                if bad & set(entry.block_ids[:n]):
                    affected.add(entry.request_id)
        self._affected = affected
        return affected

    def after(self, plan: StepPlan, view: SchedulerView | None, result: StepResult) -> StepResult:
        """The plan's result with the worker's reports added."""
        step = plan.step
        live = set(view.requests) if view is not None else set()
        held = dict(view.kv_held_by_finished) if view is not None else {}
        load_held = set(self.loads).union(*self.unapplied.values()) if self.unapplied else set(self.loads)
        for rid in held:
            if rid not in load_held and rid not in self.saves:
                self.saves[rid] = step
        for rid in [r for r in self.saves if r not in held]:
            del self.saves[rid]  # freed some other way (not by a report of this worker)
        recving: list[str] = []
        sending: list[str] = []
        failed: list[str] = []
        invalid: list[int] = list(self._sync_invalid.values())
        reported: set[str] = set(self._sync_invalid)
        kept: list[Any] = []
        for event in self.queue:
            rid = event.request_id
            if rid in reported:
                kept.append(event)
                continue
            if isinstance(event, (KVLoadDone, KVLoadFailed)) and rid in self.loads:
                entry = self.loads.pop(rid)
                recving.append(rid)
                reported.add(rid)
                if isinstance(event, KVLoadDone):
                    self._write(entry.load, None)
                elif event.block_index is None or self.multi_group:
                    failed.append(rid)
                else:
                    index = self._index(entry.load, event.block_index)
                    if index is None:  # no block of the table to name: the load failed as a whole
                        failed.append(rid)
                    else:
                        invalid.append(entry.load.block_ids[index])
                        self._write(entry.load, index * self.block_size)
            elif isinstance(event, KVSaveDone) and rid in self.saves:
                del self.saves[rid]
                sending.append(rid)
                reported.add(rid)
            elif rid in live:
                kept.append(event)  # not meaningful yet: it waits
            # else: finished and holding nothing for it, or never added: dropped
        self.queue = kept
        timed_out = 0
        for rid, entry in list(self.loads.items()):
            if rid not in reported and step - entry.step >= self.bound:
                del self.loads[rid]
                recving.append(rid)
                reported.add(rid)
                timed_out += 1
                self._write(entry.load, None)
        for rid, start in list(self.saves.items()):
            if rid not in reported and step - start >= self.bound:
                del self.saves[rid]
                sending.append(rid)
                reported.add(rid)
                timed_out += 1
        if recving or sending:
            self.unapplied[step] = set(recving) | set(sending)
        self.last = KVReport(tuple(sorted(recving)), tuple(sorted(sending)), tuple(sorted(failed)),
                             tuple(sorted(set(invalid))), tuple(sorted(self._affected)), dict(self._sync_invalid),
                             timed_out)
        if not (recving or sending or failed or invalid):
            return result
        return StepResult(sampled=result.sampled, draft_token_ids=result.draft_token_ids,
                          finished_recving=self.last.finished_recving,
                          finished_sending=self.last.finished_sending,
                          failed_recving=self.last.failed_recving,
                          invalid_block_ids=self.last.invalid_block_ids)

    # --------------------------------------------------------------- helpers

    def _index(self, load: KVLoad, block_index: int | None) -> int | None:
        """The index in the request's group-0 table of the failed block:
        ``block_index`` taken within the loaded blocks (None: the first),
        never a null block 0 (the nearest loaded block after it, else before
        it); None when the load filled no block of that table."""
        first = load.start // self.block_size
        last = min((load.end - 1) // self.block_size, len(load.block_ids) - 1)
        if load.end <= load.start or last < first:
            return None
        i = first if block_index is None else min(max(block_index, first), last)
        # never the null block 0 (a sliding-window table's freed places): the
        # nearest loaded block after it, else before it
        for j in list(range(i, last + 1)) + list(range(i - 1, first - 1, -1)):
            if load.block_ids[j] != 0:
                return j
        return None

    def _write(self, load: KVLoad, upto: int | None) -> None:
        if self.model is not None and load.request_id in self.prompts:
            self.model.load_kv(load, self.prompts[load.request_id], upto)
