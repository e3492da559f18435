"""The reference scheduler: vLLM 0.33.0's v1 Scheduler, written to be read.

Each rule names the vLLM function whose behaviour it captures; unless said
otherwise the file is vllm/v1/core/sched/scheduler.py (Scheduler) and the KV
side lives in spec/kv_cache.py. Speed is no concern here.

schedule() follows vLLM's Scheduler.schedule phase by phase: the RUNNING loop
(``_schedule_running``), the WAITING loop (``_schedule_waiting``), then the
plan and the advance of computed tokens (``_make_plan``, vLLM's
SchedulerOutput and ``_update_after_schedule``).

Two options of SchedulerConfig change the rules, one spec for all four
modes:

- ``num_speculative_tokens`` (k > 0): speculative decoding with the ngram
  method, drafts supplied through StepResult.draft_token_ids. Drafts count in
  ``num_tokens_with_spec`` and the token budget, rejected drafts roll
  ``num_computed_tokens`` back, drafts are dropped on preemption, new decodes
  are padded to 1 + k tokens.
- ``async_scheduling``: vLLM's AsyncScheduler
  (vllm/v1/core/sched/async_scheduler.py). One plan may be in flight when the
  next is scheduled; its output tokens are counted as
  ``num_output_placeholders`` (already in ``num_computed_tokens``) until its
  update; a request preempted with a step in flight gets that step's output
  as stale output (``num_stale_output_tokens``) and is not resumed before it
  has drained.

The admission gates, each off by default (SchedulerConfig, RequestSpec):

- the watermark: a waiting request is admitted only if ``watermark_blocks``
  stay free (kv_cache_manager.py, KVCacheManager.allocate_slots);
- the prefill cadence (``prefill_schedule_interval``): prefill is held until
  the interval since the last prefill-carrying step has passed;
- the pause state (``set_pause_state``): PAUSED_NEW admits nothing from the
  waiting queue, PAUSED_ALL schedules nothing;
- LoRA (``max_loras``): a waiting request whose adapter would exceed
  max_loras distinct adapters is passed over; the adapter is part of its
  blocks' prefix-cache keys;
- structured outputs: a request waits for its grammar (``grammar_ready``)
  and is passed over until it compiles; a failed compile finishes it with
  FINISHED_ERROR; drafts are cut at the first token its grammar refuses;
- the multimodal encoder (``max_num_encoder_input_tokens``,
  ``encoder_cache_size``): which encoder inputs run in a step, the chunk cut
  before an input that does not fit, and the encoder cache (KVPool's sibling
  EncoderCache in spec/kv_cache.py).

The KV cache groups (``kv_cache_groups``): one full-attention group by
default, or full-attention and sliding-window groups drawing from one pool,
each request with a table per group (spec/kv_groups.py, KVPool's coordinator
methods in spec/kv_cache.py: vLLM's KV cache coordinator).

The KV connector (``kv_connector``, spec/connector.py): external prefix hits
loaded within the admitting step or asynchronously (WAITING_FOR_REMOTE_KVS,
kv_holding_waiting), the worker's reports (loads done or failed, invalid
blocks, saves done), blocks kept by finished requests, and with async
scheduling the deferred frees of defer_block_free.

The modelled configuration: no
streaming (resumable) requests, no pipeline parallelism, no data
parallelism, chunked multimodal inputs allowed (disable_chunked_mm_input
off), every encoder placeholder an embedding, the V1 model runner.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from schedspec.spec.interface import (
    BlockKey,
    KVLoad,
    PauseState,
    Policy,
    RequestSpec,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
    is_legal_transition,
)
from schedspec.spec.connector import (
    ConnectorMixin,
    external_hit,
    get_num_new_matched_tokens,
    request_finished_delays_free,
)
from schedspec.spec.kv_cache import EncoderCache, KVPool
from schedspec.spec.request_state import RequestState as _Request
from schedspec.spec.kv_groups import GroupLayout
from schedspec.spec.protocol import (
    check_abort,
    check_add,
    check_config,
    check_grammar_ready,
    check_kv_reports,
    check_kv_reset,
    check_mm_lengths,
    check_pause_state,
    check_reset,
    check_result,
    check_schedule,
)
from schedspec.spec.rules import (
    admission_blocks_needed,
    admission_chunk,
    blocks_for_tokens,
    choose_victim,
    decode_padding,
    effective_threshold,
    max_hit_blocks,
    num_scheduled_drafts,
    priority_key,
    running_chunk,
    stop_reason,
    surely_reaches_max_tokens,
)

_new = object.__new__


@dataclass
class _StepState:
    """What one schedule() call has decided so far (vLLM's locals of
    Scheduler.schedule: ``token_budget``, ``num_scheduled_tokens``,
    ``preempted_reqs``)."""

    token_budget: int
    threshold: int  # the long-prefill threshold in force this step (0 = off)
    # request id -> (kind, computed before, scheduled, drafts verified);
    # dict order = scheduling order
    scheduled: dict[str, tuple[ScheduleKind, int, int, tuple[int, ...]]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    # vLLM's prefill_scheduled: a running request scheduled this step was
    # continuing a prefill (its is_prefill_chunk from the previous schedule).
    prefill_scheduled: bool = False
    # The prefill cadence: hold prefill this step (defer_prefills); whether a
    # waiting request was admitted with prompt left to compute.
    defer_prefills: bool = False
    prefill_admitted: bool = False
    # LoRA: the adapters of the running queue and this step's admissions.
    loras: set[int] = field(default_factory=set)
    # The encoder: its compute budget left, and the inputs each scheduled
    # request runs this step.
    encoder_budget: int = 0
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)


class SpecScheduler(ConnectorMixin):
    """Implements spec.interface.Scheduler."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = check_config(config)
        # rule coverage (spec/coverage.py, spec/rule_names.py): one counter, shared with the KV pool and clones
        self.rules: Counter[str] = Counter()
        self.kv = KVPool(config.num_blocks, config.block_size, config.enable_prefix_caching, self.rules,
                         layout=GroupLayout.of(config))
        self.requests: dict[str, _Request] = {}  # unfinished requests
        self.waiting: list[str] = []  # FCFS: queue order; PRIORITY: unordered, head = min key
        self.running: list[str] = []
        self.finished: dict[str, RequestView] = {}  # finished since the last plan
        self.preempted: set[str] = set()  # preempted since the last plan
        self.step = 0
        # The plans awaiting update(), oldest first: at most one at rest, two
        # for a moment with async scheduling (a tuple, so clones share it).
        self.in_flight: tuple[StepPlan, ...] = ()
        # The admission gates' state (vLLM's Scheduler fields of these names).
        self.pause_state = PauseState.UNPAUSED
        self.num_executed_steps = 0
        self.last_prefill_step = -config.prefill_schedule_interval  # the first step is never held
        self.prefill_capacity_bound = False
        # deferred_waiting: waiting requests passed over by a WAITING loop (or
        # added waiting for a grammar) and not admitted since
        self.deferred: set[str] = set()
        # grammar_compile_error_reqs: finished with FINISHED_ERROR at the next update
        self.grammar_errors: set[str] = set()
        self.encoder = EncoderCache(config.encoder_cache_size)
        # identifier -> length of every encoder input ever added (check_mm_lengths)
        self.mm_lengths: dict[str, int] = {}
        self._init_connector()  # the KV connector's state (spec/connector.py)

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def outstanding(self) -> StepPlan | None:
        """The oldest plan awaiting update(), the next one to be updated."""
        return self.in_flight[0] if self.in_flight else None

    def clone(self) -> SpecScheduler:
        """An independent scheduler in the same state (the model checker
        replays every transition of a state on its own copy). Only immutable
        values are shared (the config, request specs, views, the outstanding
        plans in flight); the lists and dicts are copied by hand, several
        times faster than ``copy.deepcopy``. A subclass that adds mutable state of its own
        must extend this."""
        new: SpecScheduler = _new(type(self))
        d = new.__dict__
        d.update(self.__dict__)
        d["kv"] = self.kv.clone()
        d["requests"] = {rid: r.copy() for rid, r in self.requests.items()}
        d["waiting"] = self.waiting[:]
        d["running"] = self.running[:]
        d["finished"] = self.finished.copy()
        d["preempted"] = self.preempted.copy()
        d["deferred"] = self.deferred.copy()
        d["grammar_errors"] = self.grammar_errors.copy()
        d["encoder"] = self.encoder.clone()
        d["mm_lengths"] = self.mm_lengths.copy()
        self._clone_connector(d)
        return new

    # ------------------------------------------------------------------ queues

    def _waiting_order(self) -> list[str]:
        """The waiting queues in service order: kv_holding_waiting (requests
        holding KV blocks, only with a KV connector), drained first, then the
        waiting queue."""
        return self._queue_order(self.kv_holding) + self._queue_order(self.waiting)

    def _queue_order(self, queue: list[str]) -> list[str]:
        """A waiting queue in service order. FCFS: a deque
        (request_queue.py, FCFSRequestQueue). PRIORITY: a heap on
        (priority, arrival, request_id) (PriorityRequestQueue, Request.__lt__)."""
        if self._config.policy == Policy.FCFS:
            return list(queue)
        return sorted(queue, key=self._priority_key)

    def _remove_waiting(self, request_id: str) -> None:
        """Take a request out of whichever waiting queue holds it
        (``waiting.remove_requests`` and ``kv_holding_waiting.remove_requests``)."""
        if request_id in self.kv_holding:
            self.kv_holding.remove(request_id)
        else:
            self.waiting.remove(request_id)

    def _priority_key(self, request_id: str) -> tuple[int, int, str]:
        s = self.requests[request_id].spec
        return priority_key(priority=s.priority, arrival=s.arrival, request_id=s.request_id)

    def _prepend_waiting(self, request_id: str) -> None:
        """A preempted request goes back to the front of the waiting queue
        (_preempt_request: ``self.waiting.prepend_request``; for PRIORITY the
        heap orders it by key instead)."""
        self.waiting.insert(0, request_id)

    # ------------------------------------------------------------------ events

    def add(self, request: RequestSpec) -> None:
        """add_request. The input processor rejects an empty prompt and a
        prompt that leaves no room for one output token
        (vllm/v1/engine/input_processor.py, _validate_model_input), so no
        request that can never run enters the scheduler (spec/protocol.py,
        check_add)."""
        request = check_add(request, self._config, self.requests, self.finished)
        check_mm_lengths(request, self.mm_lengths)
        for mm in request.mm_inputs:
            self.mm_lengths[mm.identifier] = mm.length
        req = _Request(spec=request)
        if self._config.is_hybrid:  # one table per KV cache group
            req.hybrid = True
            req.group_blocks = [[] for _ in self._config.groups[1:]]
            req.group_num_cached = [0] * (len(self._config.groups) - 1)
        if request.structured_output:
            # Request.__init__: a request with structured output starts
            # waiting for its grammar; _enqueue_waiting_request defers it
            self.rules["grammar.wait_at_add"] += 1  # pragma: no mutate
            req.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            self.deferred.add(request.request_id)
        self.requests[request.request_id] = req
        self.waiting.append(request.request_id)

    def set_pause_state(self, state: PauseState) -> None:
        """set_pause_state: PAUSED_NEW stops admissions from the waiting queue
        (only requests holding KV blocks for a KV connector's load, in
        kv_holding_waiting, may be admitted), PAUSED_ALL schedules nothing;
        UNPAUSED resumes."""
        self.pause_state = check_pause_state(state)

    def grammar_ready(self, request_id: str, ok: bool = True) -> None:
        """The structured-output manager finished compiling the request's
        grammar (vllm/v1/structured_output/__init__.py, StructuredOutputManager
        grammar_init: ``structured_output_request.grammar`` is set, or an
        Exception for a failed compile). The request stays waiting for its
        grammar until the WAITING loop looks at it
        (_handle_blocked_waiting_request)."""
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        check_grammar_ready(
            request_id, ok, None if req is None else req.status,
            reported=req is not None and req.grammar is not None,
        )
        assert req is not None
        req.grammar = ok

    def abort(self, request_id: str) -> None:
        """finish_requests(request_id, FINISHED_ABORTED): any unfinished request,
        in any state; its blocks are freed at once."""
        req = check_abort(request_id, self.requests)
        self.rules["abort.running"] += req.status == RequestStatus.RUNNING  # pragma: no mutate
        self.rules["abort.waiting"] += req.status == RequestStatus.WAITING  # pragma: no mutate
        self.rules["abort.preempted"] += req.status == RequestStatus.PREEMPTED  # pragma: no mutate
        self.rules["grammar.abort_waiting"] += req.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR  # pragma: no mutate
        self._finish_request(req, RequestStatus.FINISHED_ABORTED)

    def _finish_request(self, req: _Request, status: RequestStatus) -> None:
        """finish_requests for one request: it leaves its queue and is freed.
        A request loading asynchronously whose load was not reported yet keeps
        its blocks until the worker reports it (``delay_free_blocks``: the
        worker may still be writing them)."""
        rid = req.request_id
        delay = False
        if req.status == RequestStatus.RUNNING:
            self.running.remove(rid)
        else:
            self._remove_waiting(rid)
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            delay = rid not in self.kv_loads_done
            self.rules["connector.finish_during_load"] += delay  # pragma: no mutate
            self.rules["connector.finish_after_load"] += not delay  # pragma: no mutate
            self.kv_loads_done.discard(rid)
            self.kv_loads_failed.discard(rid)
        self._finish(req, status, delay)

    def _finish(self, req: _Request, status: RequestStatus, delay_free_blocks: bool = False) -> None:
        """_free_request: forget the request, report its id in the next plan's
        finished ids, free its blocks unless they are kept
        (``delay_free_blocks``, or the connector's request_finished asks for
        it: _connector_finished); a request keeping its blocks waits in
        ``held`` (vLLM: Scheduler.requests) for the worker's report."""
        req.set_status(status)
        rid = req.request_id
        self.inflight_prefills.discard(rid)
        if self._config.kv_connector:
            # _connector_finished: blocks out of a sliding window are freed
            # before the table goes to the connector (processed-token basis)
            self.kv.remove_skipped_blocks(req, max(0, req.num_computed_tokens - req.num_in_flight_tokens))
        if self._config.kv_connector and request_finished_delays_free(req.spec.kv_save_async, status):
            self.rules["connector.save_delays_free"] += 1  # pragma: no mutate
            delay_free_blocks = True
        self._free_encoder_refs(req)
        self.deferred.discard(rid)
        del self.requests[rid]
        if delay_free_blocks:
            self.held[rid] = req
            self.finished[rid] = dataclasses.replace(req.view(), block_ids=())
        else:
            self._free_request_blocks(req)
            self.finished[rid] = req.view()

    def _free_encoder_refs(self, req: _Request) -> None:
        """encoder_cache_manager.free(request): drop every encoder-cache
        reference the request holds."""
        if req.spec.mm_inputs:
            self.encoder.free(req.request_id, [m.identifier for m in req.spec.mm_inputs])

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """reset_prefix_cache. With reset_running_requests, every running request
        is preempted first, last first, so they come back in their order. With
        async scheduling a step may be in flight (spec/protocol.py,
        check_reset); the output of that step is then dropped for the requests
        preempted here (``drop_stale_output=True``): they may be resumed at
        once and recompute those positions."""
        check_reset(self.in_flight, self._config)
        if reset_running_requests and self._config.kv_connector:
            check_kv_reset(self._blocks_kept_after_reset())
        if reset_running_requests:
            while self.running:
                self.rules["preempt.reset_running"] += 1  # pragma: no mutate
                self._preempt_request(self.requests[self.running.pop()], drop_stale_output=True)
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ KV

    def _preempt_request(self, req: _Request, drop_stale_output: bool = False) -> None:
        """_preempt_request: free every block, forget all computed tokens (the
        KV is recomputed on resume), keep the generated tokens. The drafts go
        (PR #31955's rule: ``request.spec_token_ids = []``). Async scheduling:
        every token in flight becomes stale output, delivered on its update
        but leaving the reset counters alone; the placeholders go.
        ``drop_stale_output`` (reset_prefix_cache) drops that output instead,
        and a share still undrained from an earlier drop-mode preemption stays
        dropped."""
        req.set_status(RequestStatus.PREEMPTED)
        self._free_request_blocks(req)
        self.inflight_prefills.discard(req.request_id)
        self._free_encoder_refs(req)
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.drop_stale_output = drop_stale_output or (
            req.drop_stale_output and req.num_stale_output_tokens > 0
        )
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self._prepend_waiting(req.request_id)
        self.preempted.add(req.request_id)

    def _cache_blocks(self, req: _Request, num_tokens: int) -> None:
        """Give a key to every block that is full once ``num_tokens`` tokens are
        computed. Called at allocation time, before the step runs
        (KVCacheManager.allocate_slots -> cache_blocks with
        ``min(computed + new, request.num_tokens)``). Every KV cache group
        caches its own blocks under its own keys (KVPool.cache_blocks). Only
        blocks of known tokens have a hash to cache them under
        (SingleTypeKVCacheManager.cache_blocks: ``min(num_tokens,
        num_hashed_tokens)``), which binds after a failed load truncated the
        computed tokens below output still in flight."""
        bs = self._config.block_size
        num_tokens = min(num_tokens, req.num_tokens)
        self.kv.cache_blocks(req, num_tokens, len(req.spec.prompt_token_ids), lambda i: req.block_key(i, bs))

    def _allocate_running(self, req: _Request, n: int) -> bool:
        """KVCacheManager.allocate_slots for a running request (no new hits):
        slots for ``n`` tokens past the computed ones plus
        ``num_lookahead_tokens`` (``num_tokens_need_slot``), at most
        max_model_len; only known tokens are cached (drafts and placeholders
        are not: ``min(..., request.num_tokens)``). First the blocks wholly
        outside a sliding window are freed, on the processed-token basis
        (computed tokens not in flight: remove_skipped_blocks), even when the
        allocation then fails; the blocks needed are summed over the KV cache
        groups (KVCacheCoordinator.get_num_blocks_to_allocate)."""
        cfg = self._config
        target = min(req.num_computed_tokens + n + cfg.num_lookahead_tokens, cfg.max_model_len)
        processed = max(0, min(req.num_computed_tokens, cfg.max_model_len) - req.num_in_flight_tokens)
        self.kv.remove_skipped_blocks(req, processed)
        need = self.kv.get_num_blocks_to_allocate(req, target, None, req.num_computed_tokens)
        if need > self.kv.num_free:
            return False
        self.kv.allocate_new_blocks(req, target)
        self._cache_blocks(req, min(req.num_computed_tokens + n, req.num_tokens))
        return True

    def _get_computed_blocks(self, req: _Request) -> list[list[int]]:
        """KVCacheManager.get_computed_blocks: the longest prefix-cache hit
        valid in every KV cache group, at most ``num_tokens - 1`` tokens
        (the coordinator's find_longest_cache_hit; for the plain layout the
        longest run of cached full blocks from the start): each group's hit
        blocks, ``len(hit[0]) * block_size`` tokens. The request records its
        shared-prefix junction (the hit plus the uncached common prefix a
        group cut, else 0: Request.shared_prefix_boundary)."""
        req.shared_prefix_boundary = 0
        if not self.kv.enable_caching:
            return [[] for _ in self._config.groups]
        bs = self._config.block_size
        hits, num_hit_tokens, uncached = self.kv.find_longest_cache_hit(
            lambda i: req.block_key(i, bs), req.num_tokens - 1
        )
        req.shared_prefix_boundary = num_hit_tokens + uncached if uncached else 0
        hit = num_hit_tokens // bs
        full = max_hit_blocks(num_tokens=req.num_tokens, block_size=bs)
        self.rules["kv.miss"] += full > 0 and not hit  # pragma: no mutate
        self.rules["kv.hit_partial"] += 0 < hit < full  # pragma: no mutate
        self.rules["kv.hit_full"] += 0 < hit == full  # pragma: no mutate
        self.rules["kv.hit_capped"] += 0 < hit == full and req.num_tokens % bs == 0  # pragma: no mutate
        return hits

    def _allocate_admission(
        self, req: _Request, hit: list[list[int]], n: int, computed: int, load_async: bool = False, reserved: int = 0
    ) -> bool:
        """KVCacheManager.allocate_slots for a waiting request with its prefix
        hit, ``computed`` tokens counted computed before this step (the local
        hit plus the connector's external tokens, or what a promoted load left
        computed, whose blocks the request holds). With
        scheduler_reserve_full_isl the whole sequence must fit first
        (``full_sequence_must_fit``), then this step's tokens, leaving
        ``reserved`` blocks free (an asynchronous load's reservation). The
        external tokens' blocks come after the hit's (allocate_new_computed_blocks,
        allocate_external_computed_blocks), then this step's; an asynchronous
        load allocates no lookahead slots and caches nothing yet
        (``delay_cache_blocks``)."""
        cfg = self._config
        num_hit_tokens = len(hit[0]) * cfg.block_size if hit else 0
        # a promoted load holds its blocks and has no hit and no external tokens
        num_external = 0 if req.blocks else computed - num_hit_tokens
        # The watermark: a waiting or preempted request leaves watermark_blocks
        # free, and only when some request is running (allocate_slots with
        # has_scheduled_reqs=bool(self.running)), in both of its checks.
        watermark = cfg.watermark_blocks if self.running else 0

        def fits(target_tokens: int, headroom: int, cap: bool = False) -> bool:
            # summed over the KV cache groups; the full-sequence gate caps a
            # sliding-window group at its admission cap (apply_admission_cap)
            need = self.kv.get_num_blocks_to_allocate(req, target_tokens, hit, computed, cap)
            return need + headroom <= self.kv.num_free

        def held_by_watermark(target_tokens: int, cap: bool = False) -> bool:
            return watermark > 0 and fits(target_tokens, 0, cap)

        full = min(req.num_tokens, cfg.max_model_len)
        if cfg.scheduler_reserve_full_isl and not fits(full, watermark, True):
            self.rules["admit.blocked_full_sequence"] += 1  # pragma: no mutate
            self.rules["watermark.blocked_full_sequence"] += held_by_watermark(full, True)  # pragma: no mutate
            return False
        # blocks wholly outside a sliding window (a promoted load's) are freed
        # before the count (allocate_slots -> remove_skipped_blocks)
        self.kv.remove_skipped_blocks(req, max(0, computed - req.num_in_flight_tokens))
        lookahead = 0 if load_async else cfg.num_lookahead_tokens
        target = min(computed + n + lookahead, cfg.max_model_len)
        if not fits(target, watermark + reserved):
            self.rules["admit.blocked_blocks"] += 1  # pragma: no mutate
            self.rules["watermark.blocked"] += held_by_watermark(target)  # pragma: no mutate
            self.rules["connector.load_blocked_reserve"] += reserved > 0 and fits(target, watermark)  # pragma: no mutate
            return False
        self.rules["watermark.admitted"] += watermark > 0  # pragma: no mutate
        if any(hit) or num_external > 0:
            # every group takes its hit, then the external tokens' blocks
            # (KVCacheCoordinator.allocate_new_computed_blocks)
            self.kv.allocate_new_computed_blocks(req, hit, num_hit_tokens, num_external)
        self.kv.allocate_new_blocks(req, target)
        if not load_async:
            self._cache_blocks(req, min(computed + n, req.num_tokens))
        return True

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan:
        """schedule(): running requests first, then waiting ones, and those only
        in a step that preempted nobody."""
        check_schedule(self.in_flight, self._config)
        cfg = self._config
        self.step += 1
        threshold = effective_threshold(
            threshold=cfg.long_prefill_token_threshold,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.kv_holding),  # get_request_counts
        )
        st = _StepState(
            token_budget=cfg.max_num_batched_tokens,
            threshold=threshold,
            encoder_budget=cfg.max_num_encoder_input_tokens,
            defer_prefills=self._defer_prefills(),
        )
        if self.pause_state == PauseState.PAUSED_ALL:
            self.rules["pause.all_empty_step"] += 1  # pragma: no mutate
            st.token_budget = 0  # "Do not schedule any requests when paused."
        self.rules["schedule.threshold_active"] += threshold > 0  # pragma: no mutate
        self._schedule_running(st)
        # The LoRA adapters of every running request, scheduled this step or not
        st.loras = {r.spec.lora_id for r in map(self.requests.__getitem__, self.running) if r.spec.lora_id > 0}
        assert not cfg.max_loras or len(st.loras) <= cfg.max_loras
        self.rules["schedule.waiting_skipped"] += len(st.preempted) > 0 and len(self.waiting) + len(self.kv_holding) > 0  # pragma: no mutate
        if not st.preempted and self.pause_state != PauseState.PAUSED_ALL:
            self._schedule_waiting(st)
        assert len(self.running) <= cfg.max_num_seqs
        self._advance_cadence(st)
        return self._make_plan(st)

    def _defer_prefills(self) -> bool:
        """The local prefill cadence (schedule(), "Local prefill cadence"):
        with prefill_schedule_interval > 1, hold prefill in this step when
        fewer than the interval executed steps have passed since the last
        prefill-carrying step (counting this one), some running request is
        decoding, and the last release did not leave the waiting queue
        backed up (prefill_capacity_bound)."""
        interval = self._config.prefill_schedule_interval
        hold = (
            interval > 1
            and not self.prefill_capacity_bound
            and (self.num_executed_steps + 1) - self.last_prefill_step < interval
            and any(not self.requests[r].is_prefill_chunk for r in self.running)
        )
        self.rules["cadence.hold"] += hold  # pragma: no mutate
        return hold

    def _advance_cadence(self, st: _StepState) -> None:
        """The end of schedule(): a step that scheduled tokens counts as
        executed; one that carried prefill (a running chunk or an admission
        with prompt left) restarts the cadence interval."""
        if st.scheduled:
            self.num_executed_steps += 1
        if self._config.prefill_schedule_interval > 1 and (st.prefill_scheduled or st.prefill_admitted):
            self.rules["cadence.restart"] += 1  # pragma: no mutate
            self.last_prefill_step = self.num_executed_steps

    def _schedule_running(self, st: _StepState) -> None:
        """Phase 1, the RUNNING loop: each running request in queue order gets
        its next chunk, preempting others (or itself) when the pool is short."""
        cfg = self._config
        i = 0
        while i < len(self.running) and st.token_budget > 0:
            req = self.requests[self.running[i]]
            if req.num_output_placeholders and surely_reaches_max_tokens(
                num_computed=req.num_computed_tokens,
                num_output_placeholders=req.num_output_placeholders,
                num_prompt_tokens=len(req.spec.prompt_token_ids),
                max_tokens=req.spec.max_tokens,
            ):
                self.rules["running.skip_max_tokens_in_flight"] += 1  # pragma: no mutate
                i += 1  # async: the steps in flight finish it ("continue" in vLLM)
                continue
            if st.defer_prefills and req.is_prefill_chunk:
                self.rules["cadence.running_chunk_held"] += 1  # pragma: no mutate
                i += 1  # a prefill chunk waits for a cadence-aligned step
                continue
            n = running_chunk(
                num_tokens=req.num_tokens,
                num_computed=req.num_computed_tokens,
                threshold=st.threshold,
                token_budget=st.token_budget,
                max_model_len=cfg.max_model_len,
                num_spec_tokens=len(req.spec_token_ids),
                num_output_placeholders=req.num_output_placeholders,
            )
            wanted = n
            enc_inputs, n, enc_budget, enc_dups = self._schedule_encoder_inputs(
                req, req.num_computed_tokens, n, st.encoder_budget
            )
            if n == 0:
                self.rules["running.skip_no_tokens"] += wanted == 0  # pragma: no mutate
                self.rules["encoder.running_no_token"] += wanted > 0  # pragma: no mutate
                i += 1  # skipped, not a stop ("continue" in vLLM)
                continue
            allocated, i = self._allocate_or_preempt(st, req, n, i)
            if not allocated:
                if cfg.policy == Policy.PRIORITY and req.status == RequestStatus.PREEMPTED:
                    self.rules["running.self_preempted_continue"] += 1  # pragma: no mutate
                    continue  # it preempted itself; later requests may still fit
                self.rules["running.self_preempted_break"] += 1  # pragma: no mutate
                return  # vLLM: break out of the RUNNING loop
            self.rules["running.scheduled"] += 1  # pragma: no mutate
            self.rules["running.prefill_chunk"] += (  # pragma: no mutate
                req.num_computed_tokens + n < req.num_tokens + req.num_output_placeholders
            )
            st.prefill_scheduled |= req.is_prefill_chunk
            drafts = self._take_drafts(req, n)
            st.scheduled[req.request_id] = (ScheduleKind.RUNNING, req.num_computed_tokens, n, drafts)
            st.token_budget -= n
            self._commit_encoder_inputs(st, req, enc_inputs, enc_budget, enc_dups)
            i += 1
        self.rules["running.stop_budget"] += i < len(self.running)  # pragma: no mutate

    def _take_drafts(self, req: _Request, n: int) -> tuple[int, ...]:
        """The drafts a running request verifies in a step of ``n`` tokens: as
        many of its drafts as the step reaches past its known and in-flight
        tokens (``scheduled_spec_decode_tokens``). Scheduling consumes them
        all (``request.spec_token_ids = []``): the next ones come from
        update_draft_token_ids, or, with async scheduling, as placeholders
        after this schedule (scheduler.py, schedule(), the RUNNING loop,
        "Speculative decode related")."""
        if not req.spec_token_ids:
            return ()
        m = num_scheduled_drafts(
            num_new_tokens=n,
            num_computed=req.num_computed_tokens,
            num_tokens=req.num_tokens,
            num_output_placeholders=req.num_output_placeholders,
            num_drafts=len(req.spec_token_ids),
        )
        self.rules["spec.drafts_scheduled"] += m > 0  # pragma: no mutate
        self.rules["spec.drafts_cut"] += 0 < m < len(req.spec_token_ids)  # pragma: no mutate
        self.rules["spec.drafts_unscheduled"] += m == 0  # pragma: no mutate
        drafts = tuple(req.spec_token_ids[:m])
        req.spec_token_ids = []
        return drafts

    def _allocate_or_preempt(self, st: _StepState, req: _Request, n: int, i: int) -> tuple[bool, int]:
        """allocate_slots for ``req`` (at index ``i`` of the running queue); while
        it fails, preempt the lowest-priority running request and retry. A
        victim already scheduled this step gives its budget back (PRIORITY
        only). Returns whether ``req`` got its blocks (False once it preempted
        itself) and its index after the victims left the queue. Such a victim's
        blocks keep the keys its allocate_slots gave them this step although
        no step computes their KV, so its resume can hit them: vLLM 0.33 does
        the same (docs/divergences.md, "vLLM behaviours found")."""
        while not self._allocate_running(req, n):
            keys = [self._priority_key(r)[:2] for r in self.running]
            v = choose_victim(policy=self._config.policy, running_keys=keys)
            if not self._blocks_can_be_freed(self.requests[self.running[v]]):
                # defer_block_free: "A deferred free will not help with
                # immediate allocation." (break)
                self.rules["connector.victim_in_flight"] += 1  # pragma: no mutate
                return False, i
            self.rules["preempt.fcfs_tail"] += self._config.policy == Policy.FCFS  # pragma: no mutate
            self.rules["preempt.priority_victim"] += self._config.policy == Policy.PRIORITY  # pragma: no mutate
            victim = self.requests[self.running.pop(v)]
            if v < i:
                self.rules["preempt.victim_ahead"] += 1  # pragma: no mutate
                i -= 1
            if victim.request_id in st.scheduled:
                self.rules["preempt.budget_give_back"] += 1  # pragma: no mutate
                st.token_budget += st.scheduled.pop(victim.request_id)[2]
                given_back = st.encoder_inputs.pop(victim.request_id, [])
                # its encoder inputs give their embeddings back to the budget
                self.rules["encoder.budget_given_back"] += len(given_back) > 0  # pragma: no mutate
                st.encoder_budget += sum(victim.spec.mm_inputs[j].length for j in given_back)
            # requires_kv_delivery (kv_both is a producer): the victim's
            # in-flight output is dropped, not delivered
            self._preempt_request(victim, drop_stale_output=self._config.kv_connector)
            st.preempted.append(victim.request_id)
            if victim is req:
                self.rules["preempt.self"] += 1  # pragma: no mutate
                return False, i
        return True, i

    def _schedule_waiting(self, st: _StepState) -> None:
        """Phase 2, the WAITING loop (only in a step that preempted nobody):
        admit from the head of kv_holding_waiting (requests holding KV blocks,
        drained first and the only ones admitted under PAUSED_NEW), then of
        the waiting queue, while the budget, max_num_seqs and the pool allow;
        the first request that cannot be admitted stops the loop
        (head-of-line). A request passed over (skip_request) leaves its queue
        for the step and is put back at its head after the loop, into
        kv_holding_waiting if it now holds blocks."""
        skipped: tuple[list[str], list[str]] = ([], [])  # step_skipped_kv_holding, step_skipped_waiting
        stopped = False
        while st.token_budget > 0:
            queue = self.kv_holding
            if not queue and self.pause_state == PauseState.UNPAUSED:
                queue = self.waiting
            if not queue:
                # PAUSED_NEW: nothing but requests holding KV blocks is admitted
                self.rules["pause.new_no_admission"] += bool(self.waiting)  # pragma: no mutate
                stopped = bool(self.waiting)
                break
            if len(self.running) >= self._config.max_num_seqs:
                self.rules["waiting.stop_max_num_seqs"] += 1  # pragma: no mutate
                stopped = True
                break
            req = self.requests[self._queue_order(queue)[0]]
            admitted = None if self._pass_over(st, req) else self._admit(st, req, queue)
            if admitted is None:
                # skip_request: it stays deferred until admitted
                queue.remove(req.request_id)
                self.deferred.add(req.request_id)
                skipped[0 if self._holds_kv_blocks(req) else 1].append(req.request_id)
                continue
            if not admitted:
                stopped = True
                break  # head-of-line: nothing behind it is tried
        if not stopped:
            self.rules["waiting.stop_budget"] += bool(self.waiting or self.kv_holding)  # pragma: no mutate
        self.kv_holding[:0] = skipped[0]
        self.waiting[:0] = skipped[1]
        if not st.defer_prefills:
            # a release step records whether it left the queue backed up
            self.prefill_capacity_bound = len(self.waiting) + len(self.kv_holding) > len(self.deferred)

    @staticmethod
    def _holds_kv_blocks(req: _Request) -> bool:
        """_holds_kv_blocks: a waiting request with computed tokens (a
        promoted load) or loading holds blocks."""
        return req.num_computed_tokens > 0 or req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def _pass_over(self, st: _StepState, req: _Request) -> bool:
        """The WAITING loop's checks before the prefix lookup that pass the
        request over (skip_request) instead of stopping the loop: a load not
        reported yet, a grammar still compiling or failed
        (_handle_blocked_waiting_request), stale output in flight, an adapter
        beyond max_loras. A reported load is promoted here
        (_update_waiting_for_remote_kv)."""
        cfg = self._config
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if req.request_id not in self.kv_loads_done:
                self.rules["connector.skip_loading"] += 1  # pragma: no mutate
                return True
            self._update_waiting_for_remote_kv(req)
        if req.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            if req.grammar is None:
                self.rules["grammar.skip_compiling"] += 1  # pragma: no mutate
                return True
            if req.grammar is False:
                # grammar_compile_error_reqs: finished at the next update
                self.rules["grammar.compile_error"] += 1  # pragma: no mutate
                self.grammar_errors.add(req.request_id)
                return True
            self.rules["grammar.ready"] += 1  # pragma: no mutate
            req.set_status(RequestStatus.WAITING)
        if req.num_stale_output_tokens and not req.drop_stale_output:
            # Async scheduling: output of a step in flight when it was
            # preempted will still be delivered; resuming now could resample
            # a position that output fills.
            self.rules["waiting.skip_stale_output"] += 1  # pragma: no mutate
            return True
        lora = req.spec.lora_id
        if cfg.max_loras and lora and len(st.loras) == cfg.max_loras and lora not in st.loras:
            # "Scheduling would exceed max_loras, skip."
            self.rules["lora.skip_max_loras"] += 1  # pragma: no mutate
            return True
        self.rules["lora.admitted_adapter"] += lora > 0  # pragma: no mutate
        return False

    def _prefix_lookup(self, req: _Request) -> tuple[list[list[int]], int, int, bool]:
        """The WAITING loop's lookup for a request with nothing computed: the
        local prefix hit (_get_local_prefix_cache_hit), then, with a KV
        connector, the external tokens it offers beyond the block-aligned
        local hit (get_num_new_matched_tokens) under the partial-tail rules.
        Returns the hit blocks, the tokens computed (local + external), the
        external tokens, and whether they load asynchronously."""
        cfg = self._config
        hit = self._get_computed_blocks(req)
        local = len(hit[0]) * cfg.block_size
        if not cfg.kv_connector:
            return hit, local, 0, False
        aligned = local - local % cfg.block_size
        offered, load_async = get_num_new_matched_tokens(req.spec.kv_external_tokens, req.spec.kv_load_async, aligned)
        local, ext, load_async = external_hit(local, cfg.block_size, offered, load_async)
        self.rules["connector.external_hit"] += ext > 0  # pragma: no mutate
        self.rules["connector.external_within_local"] += 0 < req.spec.kv_external_tokens <= aligned  # pragma: no mutate
        assert local + ext <= req.num_tokens
        return hit, local + ext, ext, load_async

    def _admit(self, st: _StepState, req: _Request, queue: list[str]) -> bool | None:
        """One admission of the WAITING loop: the prefix hit (local and
        external), the chunk past it, the encoder inputs, the blocks; then the
        request moves to the running queue as NEW or RESUMED. False when it
        cannot be admitted and the loop stops, None when it is passed over (an
        encoder input leaves it no token this step, or an asynchronous load
        starts); nothing else changes then, but for the encoder cache as vLLM
        leaves it. A request whose load was promoted keeps its blocks and
        computed tokens ("WAITING reqs have num_computed_tokens > 0 after
        async KV recvs are completed")."""
        if req.num_computed_tokens == 0:
            # a promoted load of a one-token prompt keeps its block with
            # nothing computed (num_tokens - 1 = 0): it is looked up again,
            # and the stateless connector offers the token again
            self.rules["connector.reload_held"] += bool(req.blocks)  # pragma: no mutate
            hit, computed, ext, load_async = self._prefix_lookup(req)
        else:
            self.rules["connector.admit_loaded"] += 1  # pragma: no mutate
            hit, computed, ext, load_async = [[] for _ in self._config.groups], req.num_computed_tokens, 0, False
        if load_async:
            return self._start_async_load(req, hit, computed, ext)
        if st.defer_prefills and computed < req.num_tokens - 1:
            self.rules["cadence.admission_held"] += 1  # pragma: no mutate
            return False  # "defer this step's local prefill compute" (break)
        n, drafts = self._admission_tokens(st, req, computed)
        if n == 0:
            return False
        enc_inputs, n, enc_budget, enc_dups = self._schedule_encoder_inputs(req, computed, n, st.encoder_budget)
        if n == 0:
            self.rules["encoder.admission_passed_over"] += 1  # pragma: no mutate
            return None  # "Requeue it so it does not stall the requests behind it."
        if not self._allocate_admission(req, hit, n, computed):
            self._free_encoder_refs(req)  # "untouch the request from the encode cache manager"
            return False  # head-of-line: nothing behind it is tried
        self._record_load(req, computed - ext, ext, asynchronous=False)
        rid = req.request_id
        self.deferred.discard(rid)
        if req.spec.lora_id:
            st.loras.add(req.spec.lora_id)
        st.prefill_admitted |= computed < req.num_tokens - 1
        queue.remove(rid)
        self.running.append(rid)
        kind = ScheduleKind.NEW if req.status == RequestStatus.WAITING else ScheduleKind.RESUMED
        self.rules["admit.new"] += kind == ScheduleKind.NEW  # pragma: no mutate
        self.rules["admit.resumed"] += kind == ScheduleKind.RESUMED  # pragma: no mutate
        self.rules["admit.prefill_chunk"] += computed + n < req.num_tokens  # pragma: no mutate
        if self._config.kv_connector and computed + n < req.num_tokens:
            self.inflight_prefills.add(rid)
        req.set_status(RequestStatus.RUNNING)
        req.num_computed_tokens = computed
        st.scheduled[rid] = (kind, computed, n, drafts)
        st.token_budget -= n
        self._commit_encoder_inputs(st, req, enc_inputs, enc_budget, enc_dups)
        return True

    def _start_async_load(self, req: _Request, hit: list[list[int]], computed: int, ext: int) -> bool | None:
        """An asynchronous load starts (schedule(), ``load_kv_async``):
        blocks for the local hit and the external tokens, no new work and no
        lookahead slots, leaving the in-flight prefills' reservation free;
        the request becomes WAITING_FOR_REMOTE_KVS with the loaded tokens
        counted computed, joins the in-flight prefills, and is passed over
        (skip_request, into kv_holding_waiting). False when the blocks do not
        fit (the loop stops)."""
        if not self._allocate_admission(req, hit, 0, computed, load_async=True, reserved=self._async_load_reserve()):
            self._free_encoder_refs(req)
            return False
        self._record_load(req, computed - ext, ext, asynchronous=True)
        req.set_status(RequestStatus.WAITING_FOR_REMOTE_KVS)
        req.num_computed_tokens = computed
        self.inflight_prefills.add(req.request_id)
        return None

    def _admission_tokens(
        self, st: _StepState, req: _Request, num_hit_tokens: int
    ) -> tuple[int, tuple[int, ...]]:
        """The tokens an admission schedules past its prefix hit, and its
        drafts: a padded decode of 1 + k tokens with k placeholder drafts, or
        the prompt chunk the threshold and the budget allow. 0 when the loop
        stops (the padding or, with chunked prefill off, the prompt does not
        fit the budget)."""
        cfg = self._config
        padded: int | None = req.num_tokens - num_hit_tokens
        if cfg.num_speculative_tokens and padded == 1:
            padded = decode_padding(
                num_new_tokens=1,
                num_computed=num_hit_tokens,
                num_spec_tokens=cfg.num_speculative_tokens,
                prefill_scheduled=st.prefill_scheduled,
                running_scheduled=any(e[0] == ScheduleKind.RUNNING for e in st.scheduled.values()),
                max_model_len=cfg.max_model_len,
                token_budget=st.token_budget,
            )
        if padded is None:
            self.rules["admit.blocked_padding"] += 1  # pragma: no mutate
            return 0, ()  # vLLM: "Prefer to not schedule than schedule un-padded" (break)
        drafts: tuple[int, ...] = ()
        if padded > req.num_tokens - num_hit_tokens:
            # a padded decode: 1 + k tokens, the k drafts placeholders (-1)
            self.rules["admit.padded_decode"] += 1  # pragma: no mutate
            n = padded
            drafts = (-1,) * cfg.num_speculative_tokens
        else:
            n = admission_chunk(
                num_tokens=req.num_tokens,
                num_hit_tokens=num_hit_tokens,
                threshold=st.threshold,
                token_budget=st.token_budget,
                chunked_prefill=cfg.enable_chunked_prefill,
            )
        if n == 0:
            self.rules["admit.blocked_chunking_off"] += 1  # pragma: no mutate
        return n, drafts  # 0: chunked prefill off and the prompt does not fit the budget

    # ------------------------------------------------------------------ encoder

    def _schedule_encoder_inputs(
        self, req: _Request, num_computed: int, n: int, budget: int
    ) -> tuple[list[int], int, int, list[int]]:
        """_try_schedule_encoder_inputs: of the request's encoder inputs that
        overlap this step's tokens ``num_computed .. num_computed + n - 1``
        (get_mm_features_in_window), in order: one whose identifier this step
        already runs for the request is a duplicate; a cached one is reused
        (the request takes a reference); the first that does not fit the
        encoder budget or the cache (can_allocate, which evicts freeable
        entries to make room) stops the scan and cuts the chunk just before
        it, or to nothing when the chunk starts inside it. Returns the inputs
        to run, the chunk, the budget left after them, the duplicates."""
        mm = req.spec.mm_inputs
        if n == 0 or not mm:
            return [], n, budget, []
        rid = req.request_id
        to_run: list[int] = []
        duplicates: list[int] = []
        running_now: set[str] = set()
        num_embeds = 0
        end = num_computed + n
        for i, m in enumerate(mm):
            if m.end <= num_computed or m.offset >= end:
                continue  # outside the window
            if m.identifier in running_now:
                self.rules["encoder.duplicate_input"] += 1  # pragma: no mutate
                duplicates.append(i)
                continue
            if self.encoder.check_and_update_cache(rid, i, m.identifier):
                self.rules["encoder.cache_hit"] += 1  # pragma: no mutate
                continue
            num_freed = len(self.encoder.freed)
            fits = self.encoder.can_allocate(m.length, budget, num_embeds)
            self.rules["encoder.evicted"] += len(self.encoder.freed) > num_freed  # pragma: no mutate
            if not fits:
                if num_computed < m.offset:
                    self.rules["encoder.chunk_cut"] += 1  # pragma: no mutate
                    n = min(n, m.offset - num_computed)
                else:
                    self.rules["encoder.blocked_inside"] += 1  # pragma: no mutate
                    n = 0
                break
            num_embeds += m.length
            budget -= m.length
            running_now.add(m.identifier)
            to_run.append(i)
        return to_run, n, budget, duplicates

    def _commit_encoder_inputs(
        self, st: _StepState, req: _Request, inputs: list[int], budget: int, duplicates: list[int]
    ) -> None:
        """A scheduled request's encoder inputs run: the budget is spent and
        each takes its cache space (_allocate_encoder_inputs); a duplicate
        takes a reference to the entry its twin allocates."""
        if not inputs:
            return
        self.rules["encoder.scheduled"] += 1  # pragma: no mutate
        st.encoder_inputs[req.request_id] = inputs
        st.encoder_budget = budget
        mm = req.spec.mm_inputs
        for i in inputs:
            self.encoder.allocate(req.request_id, i, mm[i].identifier, mm[i].length)
        for i in duplicates:
            self.encoder.check_and_update_cache(req.request_id, i, mm[i].identifier)

    def _free_encoder_inputs(self, req: _Request) -> None:
        """update_from_output, _free_encoder_inputs: after a step has run, the
        request drops its reference to every input wholly inside its computed
        tokens past the placeholders (no rejection can roll back into it)."""
        done = req.num_computed_tokens - req.num_output_placeholders
        mm = req.spec.mm_inputs
        for i in self.encoder.cached_input_ids(req.request_id):
            if mm[i].end <= done:
                self.rules["encoder.input_done"] += 1  # pragma: no mutate
                self.encoder.free_encoder_input(req.request_id, i, mm[i].identifier)

    def _make_plan(self, st: _StepState) -> StepPlan:
        """Phase 3: the plan in scheduling order (vLLM's SchedulerOutput), then
        each scheduled request's computed tokens advance
        (_update_after_schedule) and the finished and preempted ids since the
        previous plan are handed over.

        Scheduler._update_after_schedule: ``num_computed_tokens`` and
        ``num_in_flight_tokens`` grow by the scheduled tokens;
        ``is_prefill_chunk`` says whether the step stops short of the known and
        in-flight tokens. AsyncScheduler._update_after_schedule
        (sched/async_scheduler.py) then, for every entry that samples, counts
        its output as placeholders (1 + its drafts) and gives it k placeholder
        drafts (-1) for its next step, whose ids only the model runner knows."""
        cfg = self._config
        entries = []
        if self.defer_block_free and st.scheduled:
            # the fence advances only for a step with scheduled tokens
            self.sched_step_seq += 1
        for rid, (kind, computed, n, drafts) in st.scheduled.items():
            req = self.requests[rid]
            entries.append(
                ScheduledRequest.of(rid, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
                                    all_token_ids=req.all_token_ids, block_ids=tuple(req.blocks),
                                    group_block_ids=req.group_block_ids(),
                                    spec_token_ids=drafts,
                                    num_output_placeholders=req.num_output_placeholders,
                                    encoder_inputs=tuple(st.encoder_inputs.get(rid, ())))
            )
            req.num_computed_tokens = computed + n
            req.num_in_flight_tokens += n
            req.last_sched_seq = self.sched_step_seq
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
            if not req.is_prefill_chunk:
                self.inflight_prefills.discard(rid)
            if cfg.async_scheduling and not req.is_prefill_chunk:
                self.rules["async.placeholders_added"] += 1  # pragma: no mutate
                req.num_output_placeholders += 1 + len(drafts)
                req.spec_token_ids = [-1] * cfg.num_speculative_tokens
        plan = StepPlan(
            step=self.step,
            scheduled=tuple(entries),
            preempted_ids=tuple(sorted(self.preempted)),
            finished_ids=tuple(sorted(self.finished)),
            freed_encoder_inputs=tuple(self.encoder.get_freed_mm_hashes()),
            kv_loads=tuple(self.pending_loads),
        )
        self.pending_loads = []
        self.preempted = set()
        self.finished = {}
        self.in_flight = self.in_flight + (plan,)
        return plan

    # ------------------------------------------------------------------ update

    def update(self, plan: StepPlan, result: StepResult) -> None:
        """update_from_output, for each scheduled request in plan order: drain
        its in-flight (and stale) tokens; roll back the rejected drafts;
        append the sampled tokens one by one, checking stop after each
        (vllm/v1/core/sched/utils.py, check_stop) and trimming the rest of an
        accepted run after a stop; consume the placeholders; cache the blocks
        the verified tokens filled. Then, without async scheduling, the drafts
        proposed after the step (update_draft_token_ids, which the engine core
        calls next: vllm/v1/engine/core.py, EngineCore.post_step).

        With a KV connector, in vLLM's order: the deferred frees whose fence
        has passed (a step with scheduled tokens), the failed loads
        (_handle_failed_recving) and invalid blocks (_handle_invalid_blocks),
        whose requests' output of this step is skipped; after the output, the
        errors (FINISHED_ERROR under policy "fail"), then the finished loads
        and saves (_update_from_kv_xfer_finished)."""
        cfg = self._config
        check_result(plan, self.in_flight, result, self.requests, cfg)
        check_kv_reports(plan, result, cfg, self.kv_loading, self.held, self.running)
        if self.defer_block_free and plan.total_num_scheduled_tokens > 0:
            self._drain_deferred_frees()
        failed = self._handle_failed_recving(result.failed_recving)
        if result.invalid_block_ids:
            failed |= self._handle_invalid_blocks(set(result.invalid_block_ids), plan)
        stopped: list[str] = []
        for s in plan.scheduled:
            req = self.requests.get(s.request_id)
            toks = result.sampled.get(s.request_id, ())
            self.rules["update.no_token"] += not toks  # pragma: no mutate
            if req is None:
                # aborted, or finished by an earlier step, while this one ran
                self.rules["update.request_gone"] += 1  # pragma: no mutate
                continue
            stale = self._drain_in_flight(req, s.num_scheduled_tokens)
            if s.request_id in failed:
                # "skip failed or rescheduled requests from KV load failure"
                self.rules["connector.output_skipped"] += 1  # pragma: no mutate
                continue
            if stale and req.drop_stale_output:
                self.rules["async.stale_dropped"] += 1  # pragma: no mutate
                continue  # drop-mode stale output is discarded entirely
            if s.spec_token_ids and toks:
                self._roll_back_rejected(req, len(s.spec_token_ids) - (len(toks) - 1), stale)
            if req.spec.mm_inputs:
                self._free_encoder_inputs(req)  # "only after the step has actually executed"
            if toks:
                self._take_output(req, toks, stale, stopped)
        self.running = [r for r in self.running if r not in stopped]
        self._finish_errors(failed if cfg.kv_load_failure_policy == "fail" else set())
        if cfg.kv_connector:
            self._update_from_kv_xfer_finished(result)
        self.in_flight = self.in_flight[1:]
        if not cfg.async_scheduling:
            self._update_draft_token_ids(result)

    def _take_output(self, req: _Request, toks: tuple[int, ...], stale: bool, stopped: list[str]) -> None:
        """update_from_output for one request's sampled tokens: append them
        and check stop; a token its grammar refuses ends it with
        FINISHED_ERROR; cache the blocks the verified tokens filled; a stopped
        request is freed (a running one leaves the running queue with the
        others after the loop: ``stopped``)."""
        had_placeholders = req.num_output_placeholders > 0
        was_running = req.status == RequestStatus.RUNNING
        num_output = len(req.output_token_ids)
        status = self._update_request_with_output(req, toks, stale)
        if set(req.output_token_ids[num_output:]) & set(req.spec.grammar_rejects):
            # structured_output_manager.accept_tokens fails: "Terminating request."
            self.rules["grammar.refused_sample"] += 1  # pragma: no mutate
            status = RequestStatus.FINISHED_ERROR
        if not stale and was_running and (had_placeholders or self._config.num_speculative_tokens > 0):
            # KVCacheManager.cache_blocks(request, num_computed_tokens -
            # num_in_flight_tokens): the blocks the verified tokens filled
            self._cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)
        if status is None:
            return
        if was_running:
            stopped.append(req.request_id)
        else:
            # stale output stopped a preempted request: it leaves the
            # waiting queue (update_from_output, stopped_preempted_reqs)
            self.rules["async.stale_output_stopped"] += 1  # pragma: no mutate
            self._remove_waiting(req.request_id)
        self._finish(req, status)

    def _finish_errors(self, failed_loads: set[str]) -> None:
        """update_from_output: the requests whose grammar failed to compile,
        as the WAITING loops since the last update found them, and under
        kv_load_failure_policy "fail" those whose load failed, finish with
        FINISHED_ERROR (finish_requests; one aborted meanwhile is gone). vLLM
        walks a set; the spec takes the ids in sorted order."""
        errors, self.grammar_errors = self.grammar_errors, set()
        for rid in sorted(errors | failed_loads):
            req = self.requests.get(rid)
            if req is None:
                continue
            self.rules["grammar.finished_error"] += rid in errors  # pragma: no mutate
            self.rules["connector.failed_load_error"] += rid in failed_loads  # pragma: no mutate
            self._finish_request(req, RequestStatus.FINISHED_ERROR)

    def _drain_in_flight(self, req: _Request, n: int) -> bool:
        """This step's tokens are no longer in flight; if the request was
        preempted after the step was scheduled, they are drained from its
        stale share and the output is stale (update_from_output). Returns
        whether it is."""
        req.num_in_flight_tokens -= n
        if req.num_stale_output_tokens > 0:
            self.rules["async.stale_output"] += 1  # pragma: no mutate
            req.num_stale_output_tokens -= n
            assert req.num_stale_output_tokens >= 0
            return True
        return False

    def _roll_back_rejected(self, req: _Request, num_rejected: int, stale: bool) -> None:
        """Rejected drafts were counted as computed (and, with async
        scheduling, as placeholders): take them back (update_from_output,
        ``num_computed_tokens -= num_rejected``). A stale rejection count
        predates the preemption's reset and does not apply."""
        self.rules["spec.all_accepted"] += num_rejected == 0  # pragma: no mutate
        self.rules["spec.some_rejected"] += num_rejected > 0  # pragma: no mutate
        if stale:
            return
        if req.num_computed_tokens > 0:
            req.num_computed_tokens -= num_rejected
        if req.num_output_placeholders > 0:
            req.num_output_placeholders -= num_rejected

    def _update_request_with_output(
        self, req: _Request, toks: tuple[int, ...], stale: bool
    ) -> RequestStatus | None:
        """_update_request_with_output: append the tokens one by one and check
        stop after each; a stop inside an accepted run drops the tokens after
        it, and num_computed_tokens covers every kept token but the last one.
        Every returned token resolves a placeholder, the dropped ones too.
        Returns the finished status, or None if the request goes on."""
        status: RequestStatus | None = None
        for num_new, token in enumerate(toks, 1):
            status = self._append_and_check_stop(req, token)
            if status is not None:
                self.rules["spec.stop_inside_run"] += num_new < len(toks)  # pragma: no mutate
                if not stale:
                    req.num_computed_tokens -= len(toks) - num_new
                break
        if not stale and req.num_output_placeholders > 0:
            req.num_output_placeholders -= len(toks)
            assert req.num_output_placeholders >= 0
        return status

    def _append_and_check_stop(self, req: _Request, token: int) -> RequestStatus | None:
        """Append ``token`` to ``req``'s output; return its finished status if
        it stops (utils.py, check_stop)."""
        req.output_token_ids.append(token)
        reason = stop_reason(
            token=token,
            num_output_tokens=len(req.output_token_ids),
            num_tokens=req.num_tokens,
            max_tokens=req.spec.max_tokens,
            max_model_len=self._config.max_model_len,
            eos_token_id=req.spec.eos_token_id,
            ignore_eos=req.spec.ignore_eos,
            stop_token_ids=req.spec.stop_token_ids,
        )
        if reason is None:
            return None
        eos = token == req.spec.eos_token_id and not req.spec.ignore_eos
        self.rules["stop.eos"] += eos  # pragma: no mutate
        self.rules["stop.stop_token"] += reason == "stop" and not eos  # pragma: no mutate
        self.rules["stop.max_model_len"] += reason == "length" and req.num_tokens >= self._config.max_model_len  # pragma: no mutate
        self.rules["stop.max_tokens"] += reason == "length" and req.num_tokens < self._config.max_model_len  # pragma: no mutate
        return RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH_CAPPED

    def _update_draft_token_ids(self, result: StepResult) -> None:
        """update_draft_token_ids (sync scheduling only: with async
        scheduling the drafts stay in the model runner and the scheduler holds
        placeholders). Drafts for a finished request are ignored; drafts after
        a partial prefill chunk are dropped; otherwise they replace the
        request's drafts."""
        for rid, drafts in result.draft_token_ids.items():
            req = self.requests.get(rid)
            if req is None:
                self.rules["spec.drafts_for_finished"] += 1  # pragma: no mutate
                continue
            if req.is_prefill_chunk:
                req.spec_token_ids = []
                continue
            self.rules["spec.drafts_set"] += len(drafts) > 0  # pragma: no mutate
            req.spec_token_ids = self._validate_drafts(req, list(drafts))

    def _validate_drafts(self, req: _Request, drafts: list[int]) -> list[int]:
        """StructuredOutputManager.validate_tokens
        (vllm/v1/structured_output/__init__.py): for a request with a grammar,
        the longest prefix of the drafts its grammar accepts; the modelled
        grammar refuses the tokens of ``grammar_rejects`` wherever they come."""
        if not req.spec.structured_output:
            return drafts
        for i, tok in enumerate(drafts):
            if tok in req.spec.grammar_rejects:
                self.rules["grammar.drafts_cut"] += 1  # pragma: no mutate
                return drafts[:i]
        return drafts

    # ------------------------------------------------------------------ view

    def view(self) -> SchedulerView:
        return SchedulerView(
            config=self._config,
            step=self.step,
            requests={rid: self._request_view(r) for rid, r in self.requests.items()},
            waiting=tuple(self._waiting_order()),
            running=tuple(self.running),
            kv=self.kv.view(),
            finished=dict(self.finished),
            preempted_since_plan=tuple(sorted(self.preempted)),
            pause_state=self.pause_state,
            encoder_cache={h: self.encoder.num_embeds[h] for h in self.encoder.cached},
            encoder_cache_free=self.encoder.num_free_slots,
            **self._cadence_view(),
            **self._connector_view(),
        )

    def _request_view(self, req: _Request) -> RequestView:
        if self._config.prefill_schedule_interval == 1:
            return req.view()
        return req.view_with_cadence()

    def _cadence_view(self) -> dict[str, Any]:
        """The prefill cadence's counters, when the cadence is on."""
        if self._config.prefill_schedule_interval == 1:
            return {}
        return {
            "num_executed_steps": self.num_executed_steps,
            "last_prefill_step": self.last_prefill_step,
            "prefill_capacity_bound": self.prefill_capacity_bound,
        }
