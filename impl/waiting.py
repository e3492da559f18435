"""The waiting phase of schedule() (vLLM's Scheduler.schedule, WAITING loop),
run only in a step that preempted nobody: admit requests from the head of
kv_holding_waiting (with a KV connector) and of the waiting queue while the
budget, max_num_seqs and the pool allow. A request the gates hold (a load not
reported yet, a grammar compiling or failed, stale output still to come, an
adapter past max_loras, an encoder input leaving no token) is passed over and
keeps its place; the rest of the queue goes on behind it.
"""

from __future__ import annotations

from typing import Any

from schedspec.spec.interface import PauseState, ScheduleKind, SchedulerConfig

from schedspec.impl.kv_events import reused
from schedspec.impl.queues import FcfsWaiting, PriorityWaiting, VictimHeap
from schedspec.impl.request import (
    NO_GROUPS,
    NO_TOKENS,
    RUNNING,
    Request,
    WAITING,
    WAITING_FOR_GRAMMAR,
    WAITING_FOR_REMOTE_KVS,
    plan_entry,
)
from schedspec.impl.running import StepState
from schedspec.impl.sessions import WAITING_FOR_STREAMING

_PAUSED_NEW = PauseState.PAUSED_NEW
# what _admit did with the head request
_ADMITTED, _PASSED_OVER, _STOP = 0, 1, 2


class WaitingPhase:
    """ImplScheduler's WAITING loop."""

    # provided by ImplScheduler and its other parts
    _config: SchedulerConfig
    _running: list[Request]
    _waiting: "FcfsWaiting[Request] | PriorityWaiting[Request]"
    _victims: VictimHeap[Request]
    _kv_holding_waiting: list[Request]
    _deferred: set[str]
    _grammar_errors: set[str]
    _loads_done: set[str]
    _inflight_prefills: set[str]
    _pause: PauseState
    _bs: int
    _max_model_len: int
    _num_spec_tokens: int
    _max_loras: int
    _watermark: int
    _priority: bool
    _connector: bool
    _hybrid: bool
    _running_seq: int
    _capacity_bound: bool
    _placeholder_drafts: tuple[int, ...]
    _layout: Any
    _px: Any
    _kv_holding_head: Any
    _promote: Any
    _skip: Any
    _find_hit: Any
    _g_find_hit: Any
    _external_tokens: Any
    _async_load_reserve: Any
    _record_load: Any
    _admit_alloc: Any
    _admit_alloc_groups: Any
    _release_encoder: Any
    _encoder_window: Any
    _encoder_commit: Any
    _group_tuples: Any
    _advance: Any
    _caching: bool
    _hash_la: int
    _log_stats: bool
    _stats_lookup: Any
    _num_waiting_for_streaming: int
    _async: bool

    def _schedule_waiting(self, state: StepState) -> None:
        """The WAITING loop: kv_holding_waiting first (also under
        PAUSED_NEW), then the waiting queue; the requests passed over go back
        to the heads of their queues in their order."""
        running = self._running
        waiting = self._waiting
        kvh = self._kv_holding_waiting
        max_seqs = self._config.max_num_seqs
        loras = {r.lora_id for r in running if r.lora_id} if self._max_loras else set()
        running_scheduled = len(state.entries) > 0
        skipped: list[Request] = []
        skipped_kvh: list[Request] = []  # passed over holding KV blocks
        while state.budget > 0:
            from_kvh = len(kvh) > 0  # only with a connector, or sessions holding blocks
            if not from_kvh and (self._pause is _PAUSED_NEW or not len(waiting)):
                break  # nothing is admitted while paused
            if len(running) + self._num_waiting_for_streaming >= max_seqs:
                break  # sessions waiting for input hold a slot each
            req = self._kv_holding_head() if from_kvh else waiting.peek()
            if self._passed_over(req, loras):
                self._deferred.add(req.request_id)
                self._skip(req, from_kvh, skipped, skipped_kvh)
                continue
            start = self._admission_start(req)
            if start is None:  # an asynchronous load started: blocks, no work; passed over
                self._deferred.add(req.request_id)
                self._skip(req, from_kvh, skipped, skipped_kvh)
                continue
            hit, computed, external = start
            if computed < 0:
                break
            outcome = self._admit(state, req, hit, computed, external, from_kvh, running_scheduled, loras)
            if outcome == _STOP:
                break
            if outcome == _PASSED_OVER:
                self._deferred.add(req.request_id)  # no token this step
                self._skip(req, from_kvh, skipped, skipped_kvh)
        for req in reversed(skipped):
            waiting.push_front(req)
        if skipped_kvh:
            kvh[:0] = skipped_kvh
        if not state.defer_prefill:
            # a release step records whether it left the queue backed up
            self._capacity_bound = len(waiting) + len(kvh) > len(self._deferred)

    def _passed_over(self, req: Request, loras: set[int]) -> bool:
        """Whether the gates hold the head request this step: its KV load is
        not reported yet (a reported one is promoted), its grammar compiles
        or failed (finished at the next update), its stale output is still
        to come, or its adapter would exceed max_loras."""
        if req.status is WAITING_FOR_REMOTE_KVS:
            if req.request_id not in self._loads_done:
                return True  # its load is not reported yet
            self._promote(req)
        elif req.status is WAITING_FOR_GRAMMAR:
            if req.grammar_ok is None:
                return True  # still compiling
            if req.grammar_ok is False:
                self._grammar_errors.add(req.request_id)  # finished at the next update
                return True
            req.status = WAITING
        elif req.status is WAITING_FOR_STREAMING:
            return True  # a session waiting for its next chunk
        if req.num_stale_output_tokens and not req.drop_stale_output:
            # output of a step in flight when it was preempted is still to
            # come: it keeps its place, the loop goes on behind it
            return True
        max_loras = self._max_loras
        return bool(max_loras and req.lora_id and len(loras) == max_loras and req.lora_id not in loras)

    def _admission_start(self, req: Request) -> tuple[Any, int, int] | None:
        """Where the admission starts: (the prefix hit, the tokens computed
        before the step, the external tokens among them). None: an
        asynchronous KV load started instead (the request is passed over);
        -1 tokens computed: the pool cannot hold the load (the loop ends)."""
        bs = self._bs
        hit: Any
        if req.num_computed_tokens:  # a promoted load: its blocks and computed tokens
            hit = [[] for _ in self._layout.groups] if self._hybrid else []
            return hit, req.num_computed_tokens, 0
        if self._hybrid:
            hit, length = self._g_find_hit(req)
            computed = len(hit[0]) * bs
        else:
            hit = self._find_hit(req)
            computed = length = len(hit) * bs
        if length and self._px.events is not None and req.spec.kv_cache_report_mode == "full":
            # KVCacheManager.get_computed_blocks: the hit reported at lookup (spec/kv_events.py, "reused")
            counts = [len(h) for h in hit] if self._hybrid else [len(hit)]
            self._px.events.extend(reused(req, counts, [g.kind for g in self._layout.groups], bs,
                                          self._hash_la))
        if not self._connector:
            return hit, computed, 0
        external, load_async = self._external_tokens(req, computed)
        if not load_async:
            return hit, computed + external, external
        watermark = self._watermark if self._running else 0
        if not self._allocate_admission(req, hit, 0, watermark, computed + external, True, self._async_load_reserve()):
            if req.mm_inputs:
                self._release_encoder(req)
            return hit, -1, 0
        self._record_load(req, computed, external, True)
        if self._log_stats and self._caching:
            self._stats_lookup(req, computed)
        req.status = WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = computed + external
        self._inflight_prefills.add(req.request_id)
        return None

    def _allocate_admission(self, req: Request, hit: Any, n: int, watermark: int, computed: int,
                            load_async: bool = False, reserved: int = 0) -> bool:
        if self._hybrid:
            return bool(self._admit_alloc_groups(req, hit, n, watermark, computed, load_async, reserved))
        return bool(self._admit_alloc(req, hit, n, watermark, computed, load_async, reserved))

    def _admission_chunk(
        self, state: StepState, req: Request, computed: int, running_scheduled: bool
    ) -> tuple[int, tuple[int, ...]]:
        """The tokens an admission schedules: a new decode padded to 1 + k
        tokens (k placeholder drafts) with speculative decoding, else the
        rest of its tokens cut by the threshold and the budget; with its
        drafts. -1 tokens: the loop ends (the cadence holds its prefill, or it
        does not fit)."""
        num_tokens = req.num_tokens
        if state.defer_prefill and computed < num_tokens - 1:
            return -1, NO_TOKENS  # its prefill waits for the cadence
        n = num_tokens - computed
        num_spec = self._num_spec_tokens
        if (
            num_spec > 0
            and n == 1
            and not state.prefill_scheduled
            and (running_scheduled or computed > 0)
            and computed + 1 + num_spec + 1 <= self._max_model_len
        ):
            return (1 + num_spec if 1 + num_spec <= state.budget else -1), self._placeholder_drafts
        threshold = state.threshold
        if 0 < threshold < n:
            n = threshold
        if n > state.budget:
            if not self._config.enable_chunked_prefill:
                return -1, NO_TOKENS
            n = state.budget
        return n, NO_TOKENS

    def _admit(
        self, state: StepState, req: Request, hit: Any, computed: int, external: int,
        from_kvh: bool, running_scheduled: bool, loras: set[int],
    ) -> int:
        """Admit the head request if its chunk and blocks fit: its entry,
        then it runs. _STOP: the loop ends; _PASSED_OVER: an encoder input
        leaves it no token this step."""
        n, spec_token_ids = self._admission_chunk(state, req, computed, running_scheduled)
        if n > 0 and self._layout.aligns:
            # the Mamba state grid (Layout.split): a chunk cut to 0 ends the loop
            n = self._layout.split(computed, n, req.num_prompt_tokens, req.num_tokens, req.shared_prefix_end) or -1
        if n < 0:
            return _STOP
        num_tokens = req.num_tokens
        run: list[int] = []
        duplicates: list[int] = []
        encoder_left = 0
        if req.mm_inputs:
            run, n, encoder_left, duplicates = self._encoder_window(req, computed, n, state.encoder_budget)
            if n == 0:
                return _PASSED_OVER
        watermark = self._watermark if self._running else 0
        if not self._allocate_admission(req, hit, n, watermark, computed):
            if req.mm_inputs:
                self._release_encoder(req)
            return _STOP
        request_id = req.request_id
        if external:
            self._record_load(req, computed - external, external, False)
        if self._log_stats and self._caching and not req.num_computed_tokens:
            self._stats_lookup(req, computed - external)
        self._deferred.discard(request_id)
        if req.lora_id:
            loras.add(req.lora_id)
        if computed < num_tokens - 1:
            state.prefill_admitted = True
        if from_kvh:
            self._kv_holding_waiting.remove(req)
        else:
            self._waiting.pop_head()
        end = computed + n
        if self._connector and end < num_tokens:
            self._inflight_prefills.add(request_id)
        kind = ScheduleKind.NEW if req.status is WAITING else ScheduleKind.RESUMED
        req.status = RUNNING
        self._running_seq += 1
        req.running_seq = self._running_seq
        self._running.append(req)
        if self._priority:
            self._victims.push(req)
        if run:
            state.encoder_run[request_id] = run
            state.encoder_budget = encoder_left
            self._encoder_commit(req, run, duplicates)
        state.entries.append(plan_entry(
            request_id, kind, computed, n, num_tokens, req.block_tuple(),
            req.step_token_ids(computed, end, spec_token_ids), spec_token_ids,
            req.num_output_placeholders, tuple(run) if run else NO_TOKENS,
            self._group_tuples(req) if self._hybrid else NO_GROUPS,
        ))
        state.scheduled.append(req)
        if not state.drafts_needed:
            state.note_drafts(req, computed, n)
        kept = req.spec_token_ids  # a continued session's drafts (sync), untouched by its admission
        self._advance(state, req, end, n, spec_token_ids, req.is_prefill_chunk)
        if kept and not (self._async and not req.is_prefill_chunk):
            req.spec_token_ids = kept
        return _ADMITTED
