"""The running phase of schedule() (vLLM's Scheduler.schedule, RUNNING loop):
each running request in order gets its next chunk, the blocks for it, and a
plan entry; a request whose blocks the pool cannot give preempts victims
until it can (or preempts itself).

One loop serves every mode. A steady decode, the step almost every running
request takes, is decided and written in a few lines at the top of the loop
(the plan entry filled inline there: see ``_schedule_running``); every other
request goes through the general rules (``_schedule_running_request``), where
the gates, the connector, drafts, async placeholders and the hybrid groups
are branches.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from schedspec.spec.interface import ScheduledRequest, ScheduleKind, SchedulerConfig

from schedspec.impl.queues import VictimHeap
from schedspec.impl.request import NO_GROUPS, NO_TOKENS, Request, plan_entry, running_seq_of

_RUNNING_KIND = ScheduleKind.RUNNING
_new = object.__new__


class StepState:
    """What one schedule() call accumulates: the budget left (vLLM's
    ``min(token_budget, input_budget - draft_slots)``: the budget less one
    draft-slot charge per scheduled request and one for the next), the entries
    and their requests (parallel lists), one int per entry for update (its
    tokens scheduled and the most tokens it may sample, ``code``), and the
    gates' per-step marks."""

    __slots__ = (
        "budget",
        "threshold",
        "entries",
        "scheduled",
        "codes",
        "preempted",
        "prefill_scheduled",
        "prefill_admitted",
        "defer_prefill",
        "encoder_budget",
        "encoder_run",
        "blocked",
        "drafts_needed",
    )

    def __init__(self, budget: int, threshold: int, encoder_budget: int) -> None:
        self.budget = budget
        self.threshold = threshold
        self.entries: list[ScheduledRequest] = []
        self.scheduled: list[Request] = []
        self.codes: list[int] = []
        self.preempted = False
        self.prefill_scheduled = False
        self.prefill_admitted = False
        self.defer_prefill = False
        self.encoder_budget = encoder_budget
        # the encoder inputs each request runs this step (given back with it)
        self.encoder_run: dict[str, list[int]] = {}
        # a preemption stopped by a deferred free (the connector)
        self.blocked = False
        # vLLM's drafts_needed: set once a scheduled request can use the
        # drafts proposed after the step (spec/runner_v2.py); the scheduler
        # starts it set unless it can skip drafts
        self.drafts_needed = True

    def note_drafts(self, req: Request, computed: int, n: int) -> None:
        """``req`` is scheduled for ``n`` tokens past ``computed``: the step
        needs drafts unless it is a non-final prefill chunk or surely brings
        ``req`` to max_tokens (one token sampled, one more from a step in
        flight)."""
        num_tokens = req.num_tokens
        if computed + n >= num_tokens and num_tokens + (2 if req.num_output_placeholders else 1) < req.max_tokens_end:
            self.drafts_needed = True


class RunningPhase:
    """ImplScheduler's RUNNING loop."""

    # provided by ImplScheduler and its other parts
    _config: SchedulerConfig
    _running: list[Request]
    _victims: VictimHeap[Request]
    _priority: bool
    _max_model_len: int
    _lookahead: int
    _draft_slots: int
    _num_spec_tokens: int
    _async: bool
    _general: bool
    _gated: bool
    _hybrid: bool
    _groups_inline: bool
    _layout: Any  # impl/kv_groups.py, Layout
    _connector: bool
    _defer_free: bool
    _processed_seq: int
    _placeholder_drafts: tuple[int, ...]
    _stagger: int  # Model Runner V2's decode throttle (0 = off)
    _step: int
    _group_tuples: Any
    _grow_running: Any
    _preempt: Any
    _encoder_window: Any
    _encoder_commit: Any
    _unknown_tokens: Any

    def _schedule_running(self, state: StepState) -> None:
        """The RUNNING loop. A steady decode (sync: the last known token and
        the drafts proposed after the previous step; async: one step in
        flight with its 1 + k placeholders, k placeholder drafts for this
        step; no block to allocate or key under the gate rules) is written out
        here, with the plan entry filled inline: it is the one loop that runs
        once per running request per step, and a call to ``plan_entry``
        there costs 50 ns a request (docs/impl.md, "The steady decode").
        Every other request takes ``_schedule_running_request``."""
        # the loop's reads, as locals
        running, budget, threshold = self._running, state.budget, state.threshold
        max_model_len, num_spec, placeholder_drafts = self._max_model_len, self._num_spec_tokens, self._placeholder_drafts
        asynchronous, general, gated = self._async, self._general, self._gated
        groups_inline = self._groups_inline  # gated by hybrid groups alone
        staggered = self._stagger > 0
        lookahead = self._lookahead  # the drafter's slots past the step (allocate_slots)
        draft_slots = self._draft_slots  # the batch slots each request takes for the drafter
        width = 1 + num_spec  # a steady async decode: its token and k drafts
        base = num_spec + 2  # the update code's radix
        all_unknown = self._unknown_tokens(width)
        entries_append, scheduled_append, codes_append = state.entries.append, state.scheduled.append, state.codes.append
        new, entry_class, running_kind = _new, ScheduledRequest, _RUNNING_KIND
        i = 0
        count = len(running)  # changes only in the general rules (preemption)
        while i < count and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            if asynchronous:
                num_tokens = computed - num_spec
                steady = (
                    not staggered  # V2's throttle: the general rules (_running_chunk)
                    and req.num_output_placeholders == width
                    and req.spec_token_ids is placeholder_drafts
                    and req.num_tokens == num_tokens
                    and computed + 2 - width < req.max_tokens_end
                )
                n = placeholders = width
            else:
                placeholders = 0
                num_tokens = req.num_tokens
                steady = computed == num_tokens - 1
                spec_token_ids = req.spec_token_ids
                n = 1 + len(spec_token_ids) if spec_token_ids else 1
            end = computed + n
            if (
                steady
                and n <= budget
                and end < max_model_len
                and not 0 < threshold < n
                and not req.is_prefill_chunk
                and (
                    (
                        end + lookahead <= req.num_slots
                        and num_tokens < req.next_full_at
                        and (
                            not gated
                            or (
                                req.num_prompt_tokens < num_tokens
                                and computed - req.num_in_flight_tokens < req.group_skip_from
                            )
                        )
                    )
                    or (
                        (not gated or (groups_inline and req.num_prompt_tokens < num_tokens))
                        and self._grow_running(req, end)
                    )
                )
            ):
                if asynchronous:
                    token_ids = all_unknown
                    spec_token_ids = placeholder_drafts
                elif spec_token_ids:
                    token_ids = req.last_token_ids + spec_token_ids
                else:
                    token_ids = req.last_token_ids
                entry = new(entry_class)
                fields = entry.__dict__
                fields["request_id"] = req.request_id
                fields["kind"] = running_kind
                fields["num_computed_tokens"] = computed
                fields["num_scheduled_tokens"] = n
                fields["num_tokens"] = num_tokens
                table = req.cached_block_tuple
                fields["block_ids"] = table if table is not None else req.block_tuple()
                fields["token_ids"] = token_ids
                fields["spec_token_ids"] = spec_token_ids
                fields["num_output_placeholders"] = placeholders
                fields["encoder_inputs"] = NO_TOKENS
                fields["num_invalid_spec_tokens"] = 0
                groups = req.group_block_tuples
                fields["group_block_ids"] = groups if groups is not None else self._group_tuples(req)
                entries_append(entry)
                scheduled_append(req)
                if not state.drafts_needed:
                    state.note_drafts(req, computed, n)
                req.num_computed_tokens = end
                if general:
                    req.num_in_flight_tokens += n
                    req.was_prefill_chunk = False
                    codes_append(n * base + n)
                    if asynchronous:
                        req.num_output_placeholders = width + width
                    elif spec_token_ids:
                        req.spec_token_ids = NO_TOKENS
                budget -= n + draft_slots
                i += 1
                continue
            state.budget = budget
            i = self._schedule_running_request(state, req, i)
            budget = state.budget
            if i < 0:
                break
            count = len(running)
        state.budget = budget

    def _running_chunk(self, state: StepState, req: Request) -> int:
        """How many tokens ``req`` schedules this step by the general rules:
        its known tokens, output placeholders and drafts past the computed
        ones, cut by the long-prefill threshold, the budget and
        max_model_len. 0 or less: skipped this step."""
        computed = req.num_computed_tokens
        placeholders = req.num_output_placeholders
        if placeholders > 0 and computed + 2 - placeholders >= req.max_tokens_end:
            return 0  # the steps in flight surely finish it
        if self._stagger and self._step < req.next_decode_eligible_step:
            return 0  # V2 + PP + async: decoded too recently (spec/runner_v2.py)
        if state.defer_prefill and req.is_prefill_chunk:
            return 0  # a prefill chunk waits for the cadence
        n = req.num_tokens + len(req.spec_token_ids) + placeholders - computed
        threshold = state.threshold
        if 0 < threshold < n:
            n = threshold
        if n > state.budget:
            n = state.budget
        if n > self._max_model_len - computed - 1:
            n = self._max_model_len - computed - 1
        return n

    def _schedule_running_request(self, state: StepState, req: Request, i: int) -> int:
        """The general rules for the running request at index ``i``: its
        chunk, the encoder inputs in it, its blocks (preempting victims while
        the pool is short), its entry. Returns the next index, or -1 when the
        loop ends here (FCFS: it preempted itself; a deferred free blocks)."""
        n = self._running_chunk(state, req)
        if n > 0 and self._layout.aligns:  # the Mamba state grid (Layout.split)
            n = self._layout.split(req.num_computed_tokens, n, req.num_prompt_tokens, req.num_tokens,
                                   req.shared_prefix_end)
        run: list[int] = []
        duplicates: list[int] = []
        encoder_left = 0
        if n > 0 and req.mm_inputs:
            run, n, encoder_left, duplicates = self._encoder_window(req, req.num_computed_tokens, n, state.encoder_budget)
        if n <= 0:
            return i + 1
        computed = req.num_computed_tokens
        num_tokens = req.num_tokens
        end = computed + n
        if (
            end + self._lookahead > req.num_slots
            or (end if end < num_tokens else num_tokens) >= req.next_full_at
            or computed - req.num_in_flight_tokens >= req.group_skip_from
        ) and not self._grow_running(req, end):
            allocated, i = self._preempt_for(state, req, end, i)
            if not allocated:
                return i if self._priority and not state.blocked else -1
        was_chunk = req.is_prefill_chunk
        if was_chunk:
            state.prefill_scheduled = True
        placeholders = req.num_output_placeholders
        spec_token_ids = req.spec_token_ids
        if spec_token_ids:
            kept = n + computed - num_tokens - placeholders
            spec_token_ids = spec_token_ids[:kept] if kept > 0 else NO_TOKENS
        if end <= num_tokens:
            token_ids = req.last_token_ids if n == 1 and end == num_tokens else req.token_range(computed, end)
        elif not placeholders and computed == num_tokens - 1 and end == num_tokens + len(spec_token_ids):
            token_ids = req.last_token_ids + spec_token_ids  # the last known token, then the drafts
        elif self._async and computed >= num_tokens:
            # every position past the known tokens is in flight or a
            # placeholder draft: n times -1
            token_ids = self._unknown_tokens(n)
        else:
            token_ids = req.step_token_ids(computed, end, spec_token_ids)
        if run:
            state.encoder_run[req.request_id] = run
            state.encoder_budget = encoder_left
            self._encoder_commit(req, run, duplicates)
        state.entries.append(plan_entry(
            req.request_id, _RUNNING_KIND, computed, n, num_tokens, req.block_tuple(), token_ids,
            spec_token_ids, placeholders, tuple(run) if run else NO_TOKENS,
            self._group_tuples(req) if self._hybrid else NO_GROUPS,
        ))
        state.scheduled.append(req)
        if not state.drafts_needed:
            state.note_drafts(req, computed, n)
        self._advance(state, req, end, n, spec_token_ids, was_chunk)
        return i + 1

    def _advance(
        self, state: StepState, req: Request, end: int, n: int, spec_token_ids: tuple[int, ...], was_chunk: bool
    ) -> None:
        """The request advances as soon as its entry is made (computed and
        in-flight tokens, is_prefill_chunk; with async scheduling a step that
        samples counts its output as placeholders and leaves k placeholder
        drafts: AsyncScheduler._update_after_schedule), and the budget is
        charged; a victim preempted later in the step gives it back
        (``_give_back``)."""
        placeholders = req.num_output_placeholders
        state.budget -= n + self._draft_slots
        req.num_computed_tokens = end
        req.was_prefill_chunk = was_chunk
        chunk = req.is_prefill_chunk = end < req.num_tokens + placeholders
        if self._general:
            req.num_in_flight_tokens += n
            state.codes.append(n * (self._num_spec_tokens + 2) + (0 if chunk else 1 + len(spec_token_ids)))
            if self._async and not chunk:
                req.num_output_placeholders = placeholders + 1 + len(spec_token_ids)
                req.spec_token_ids = self._placeholder_drafts
            else:
                req.spec_token_ids = NO_TOKENS

    def _preempt_for(self, state: StepState, req: Request, end: int, i: int) -> tuple[bool, int]:
        """While ``req`` (at index ``i``) cannot get its blocks, preempt the
        victim (FCFS: the last running request; PRIORITY: the first with the
        largest (priority, arrival)); a victim already scheduled this step
        gives its entry, budget and encoder inputs back. Returns whether
        ``req`` got its blocks (False: it preempted itself, or with
        defer_block_free the victim's blocks are not free yet) and its index."""
        running = self._running
        while True:
            if self._priority:
                victim = self._victims.top()
                # running is in admission order, i.e. ascending running_seq
                v = bisect_left(running, victim.running_seq, key=running_seq_of)
            else:
                v = len(running) - 1
                victim = running[v]
            if self._defer_free and victim.last_scheduled_seq > self._processed_seq:
                # a deferred free will not help with immediate allocation
                state.blocked = True
                return False, i
            del running[v]
            if v < i:
                i -= 1
                self._give_back(state, victim)
            self._preempt(victim, self._connector)  # kv_both: a victim's output in flight is dropped
            state.preempted = True
            if victim is req:
                return False, i
            if self._grow_running(req, end):
                return True, i

    def _give_back(self, state: StepState, victim: Request) -> None:
        """A victim scheduled earlier in this step (unless it was skipped)
        leaves the plan: its entry, budget, in-flight tokens, is_prefill_chunk
        and encoder inputs go back. ``scheduled`` holds running entries only
        here, in running order."""
        scheduled = state.scheduled
        j = bisect_left(scheduled, victim.running_seq, key=running_seq_of)
        if j < len(scheduled) and scheduled[j] is victim:
            del scheduled[j]
            given = state.entries.pop(j).num_scheduled_tokens
            state.budget += given + self._draft_slots
            if self._general:
                del state.codes[j]
                victim.num_in_flight_tokens -= given
            victim.is_prefill_chunk = victim.was_prefill_chunk
            ran = state.encoder_run.pop(victim.request_id, None)
            if ran:  # its encoder inputs give their budget back
                state.encoder_budget += sum(victim.mm_inputs[x].length for x in ran)
