"""The reference scheduler: vLLM 0.33.0's v1 Scheduler, written to be read.

Each rule names the vLLM function whose behaviour it captures; unless said
otherwise the file is vllm/v1/core/sched/scheduler.py (Scheduler). Speed is
no concern here.

This module is the base path, what every configuration runs: the queues, the
request events (add, abort, finish), schedule() phase by phase as vLLM's
Scheduler.schedule runs it (the RUNNING loop ``_schedule_running``, the
WAITING loop ``_schedule_waiting``, then the plan and the advance of
computed tokens ``_make_plan``: vLLM's SchedulerOutput and
``_update_after_schedule``), and update() (vLLM's update_from_output). What a
feature adds to it lives in a part of its own, each a mixin of SpecScheduler
whose module docstring says where it enters the base path:

- spec/gates.py: the admission gates (the pause state, the prefill cadence,
  the watermark, LoRA, structured outputs), each off by default;
- spec/encoder.py: the multimodal encoder, its budget and its cache;
- spec/async_drafts.py: speculative decoding (``num_speculative_tokens``)
  and async scheduling (``async_scheduling``, vLLM's AsyncScheduler), one
  spec for all four modes;
- spec/connector.py: the KV connector (``kv_connector``): external prefix
  hits loaded within the admitting step or asynchronously
  (WAITING_FOR_REMOTE_KVS, kv_holding_waiting), the worker's reports, blocks
  kept by finished requests, and with async scheduling the deferred frees of
  defer_block_free;
- spec/kv_cache.py and spec/kv_groups.py: the paged KV pool with prefix
  caching, and the KV cache groups (``kv_cache_groups``): one full-attention
  group by default, or full-attention, sliding-window and chunked-local
  attention groups drawing from one pool, each request with a table per
  group (KVPool's coordinator methods: vLLM's KV cache coordinator).

The named results the decisions hand each other are in spec/step_state.py.
Rule coverage (spec/coverage.py): a branch names itself through one
``self._rule("NAME")`` call, a decision with several named outcomes through
a ``*_rules`` classifier next to it.

- spec/sessions.py: streaming-input sessions (resumable requests), their
  updates, WAITING_FOR_STREAMING_REQ and the in-place update.

The modelled configuration: no pipeline
parallelism, no data parallelism, the V1 model runner.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from schedspec.spec.async_drafts import AsyncDraftsMixin
from schedspec.spec.connector import (
    ConnectorMixin,
    external_hit,
    get_num_new_matched_tokens,
    request_finished_delays_free,
)
from schedspec.spec.encoder import EncoderMixin, EncoderPlan
from schedspec.spec.effects import EffectTracker
from schedspec.spec.gates import GatesMixin
from schedspec.spec.sessions import SessionsMixin, check_resumable
from schedspec.spec.interface import (
    BlockKey,
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
)
from schedspec.spec.kv_cache import EncoderCache, KVPool
from schedspec.spec.kv_groups import GroupLayout
from schedspec.spec.mamba import block_aligned_split
from schedspec.spec.protocol import (
    check_abort,
    check_add,
    check_config,
    check_kv_reports,
    check_kv_reset,
    check_mm_lengths,
    check_reset,
    check_result,
    check_schedule,
)
from schedspec.spec.request_state import GrammarState, RequestState as _Request
from schedspec.spec.stats import SchedulerStats
from schedspec.spec.stats_record import StatsRecorder, kv_cache_usage
from schedspec.spec.rules import (
    admission_chunk,
    choose_victim,
    decode_padding,
    effective_threshold,
    max_hit_blocks,
    priority_key,
    running_chunk,
    stop_reason,
    surely_reaches_max_tokens,
)
from schedspec.spec.kv_events import KVCacheEvent
from schedspec.spec.runner_v2 import can_skip_drafts, decode_stagger, decode_throttled, drafts_unused
from schedspec.spec.step_state import (
    Admission,
    AdmissionChunk,
    PrefixHit,
    RunningAllocation,
    Scheduled,
    StepState,
)

_new = object.__new__


class SpecScheduler(GatesMixin, EncoderMixin, AsyncDraftsMixin, ConnectorMixin, SessionsMixin):
    """Implements spec.interface.Scheduler."""

    #: effect coverage (spec/effects.py): None, or the tracker spec.effects.enable attached
    effects: EffectTracker | None = None
    #: A call it refuses raises spec/protocol.py's error and changes nothing
    #: (the check probes it: check/rejects.py).
    PROTOCOL_ERRORS = True

    def __init__(self, config: SchedulerConfig, log_stats: bool = False) -> None:
        self._config = check_config(config)
        # rule coverage (spec/coverage.py, spec/rule_names.py): one counter, shared with the KV pool and clones
        self.rules: Counter[str] = Counter()
        self.kv = KVPool(config.num_blocks, config.block_size, config.enable_prefix_caching, self.rules,
                         layout=GroupLayout.of(config), hash_lookahead=config.num_hash_lookahead_tokens)
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
        self._init_sessions()  # streaming-input sessions (spec/sessions.py)
        if config.enable_kv_cache_events:  # KV cache events (spec/kv_events.py)
            self.kv.events = []
        # log_stats (vLLM's Scheduler argument): the statistics' record (spec/stats.py)
        self.stats_record: StatsRecorder | None = StatsRecorder(config.num_speculative_tokens) if log_stats else None

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
        self._clone_sessions(d)
        if self.stats_record is not None:
            d["stats_record"] = self.stats_record.copy()
        if self.effects is not None:
            d["effects"] = self.effects.copy()
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
        """Take a request out of whichever waiting queue holds it and out of
        the deferred set (``waiting.remove_requests``,
        ``kv_holding_waiting.remove_requests`` and
        ``deferred_waiting.difference_update``, together in finish_requests
        and for update_from_output's stopped_preempted_reqs)."""
        if request_id in self.kv_holding:
            self.kv_holding.remove(request_id)
        else:
            self.waiting.remove(request_id)
        self.deferred.discard(request_id)

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
        check_resumable(request, self._config)
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
            self._rule("grammar.wait_at_add")  # pragma: no mutate
            req.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            self.deferred.add(request.request_id)
        self.requests[request.request_id] = req
        self.waiting.append(request.request_id)
        if request.resumable:
            self._add_session(request)

    def abort(self, request_id: str) -> None:
        """finish_requests(request_id, FINISHED_ABORTED): any unfinished request,
        in any state; its blocks are freed at once."""
        req = check_abort(request_id, self.requests)
        self._rules(abort_rules(req.status))  # pragma: no mutate
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
            self._rule("connector.finish_during_load" if delay else "connector.finish_after_load")  # pragma: no mutate
            self.kv_loads_done.discard(rid)
            self.kv_loads_failed.discard(rid)
        self._finish(req, status, delay)

    def _finish(self, req: _Request, status: RequestStatus, delay_free_blocks: bool = False) -> None:
        """_free_request: forget the request, report its id in the next plan's
        finished ids, free its blocks unless they are kept
        (``delay_free_blocks``, or the connector's request_finished asks for
        it: _connector_finished); a request keeping its blocks waits in
        ``held`` (vLLM: Scheduler.requests) for the worker's report."""
        if req.spec.resumable:
            self._forget_session(req)
        req.set_status(status)
        rid = req.request_id
        self.inflight_prefills.discard(rid)
        if self._config.kv_connector:
            # _connector_finished: blocks out of a sliding window or before a
            # local-attention chunk are freed before the table goes to the
            # connector (processed-token basis)
            self.kv.remove_skipped_blocks(req, max(0, req.num_computed_tokens - req.num_in_flight_tokens))
        if self._config.kv_connector and request_finished_delays_free(req.spec.kv_save_async, status):
            self._rule("connector.save_delays_free")  # pragma: no mutate
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
        if reset_running_requests and self.streaming_queues:
            check_kv_reset(self._session_blocks_kept())  # spec/sessions.py
        if reset_running_requests:
            while self.running:
                self._rule("preempt.reset_running")  # pragma: no mutate
                self._preempt_request(self.requests[self.running.pop()], drop_stale_output=True)
        done = self.kv.reset_prefix_cache()
        if done and self.stats_record is not None:
            self.stats_record.record_reset()  # KVCacheManager.reset_prefix_cache: reset = True
        return done

    def take_kv_events(self) -> tuple[KVCacheEvent, ...]:
        """The KV cache events since the last take (spec/kv_events.py;
        KVCacheManager.take_events, which Scheduler.update_from_output calls
        once per step); () with ``enable_kv_cache_events`` off."""
        return tuple(self.kv.take_events())

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
        if self.stats_record is not None:
            self.stats_record.num_preemptions += 1  # the PREEMPTED event (spec/stats.py)
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
        computed tokens below output still in flight. With EAGLE's hash
        lookahead L a block's hash waits for the L tokens after it
        (get_request_block_hasher: ``request.num_tokens - L``), so a full
        block is cached only once they are known."""
        hashed = req.num_tokens - self._config.num_hash_lookahead_tokens
        bs = self._config.block_size
        self._rule("kv.hash_lookahead_wait", self.kv.enable_caching and hashed // bs < num_tokens // bs)  # pragma: no mutate
        num_tokens = min(num_tokens, hashed)
        self.kv.cache_blocks(req, num_tokens, len(req.spec.prompt_token_ids), self._key_of(req), req.spec.lora_id,
                             req.prefix_key)

    def _key_of(self, req: _Request) -> Callable[[int], BlockKey]:
        """Block i's prefix-cache key for ``req`` (request.block_hashes[i]),
        with the config's hash lookahead (RequestState.block_key)."""
        bs, lookahead = self._config.block_size, self._config.num_hash_lookahead_tokens
        return lambda i: req.block_key(i, bs, lookahead)

    def _allocate_running(self, req: _Request, n: int) -> bool:
        """KVCacheManager.allocate_slots for a running request (no new hits):
        slots for ``n`` tokens past the computed ones plus
        ``num_lookahead_tokens`` (``num_tokens_need_slot``), at most
        max_model_len; only known tokens are cached (drafts and placeholders
        are not: ``min(..., request.num_tokens)``). First the blocks wholly
        outside a sliding window, or wholly before the current chunk of a
        chunked-local attention group, are freed, on the processed-token basis
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
        group cut, else 0: Request.shared_prefix_boundary). A hit of a
        request whose kv_cache_report_mode is "full" is reported as events
        then (KVPool.emit_cached_block_events)."""
        req.shared_prefix_boundary = 0
        if not self.kv.enable_caching:
            return [[] for _ in self._config.groups]
        bs = self._config.block_size
        # only hashed blocks can hit: with hash lookahead L, num_tokens - L tokens
        # (get_request_block_hasher), never past num_tokens - 1
        max_length = req.num_tokens - max(1, self._config.num_hash_lookahead_tokens)
        hit = self.kv.find_longest_cache_hit(self._key_of(req), max_length)
        if hit.num_tokens > 0 and req.spec.kv_cache_report_mode == "full":
            # reported at lookup, whether or not the admission then succeeds
            self.kv.emit_cached_block_events(hit.blocks, self._key_of(req), req.spec.lora_id)
        if hit.num_uncached_tokens:
            req.shared_prefix_boundary = hit.num_tokens + hit.num_uncached_tokens
        self._rules(prefix_hit_rules(hit.num_tokens, req.num_tokens, bs))  # pragma: no mutate
        return hit.blocks

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
            # sliding-window or chunked-local group at its admission cap
            # (apply_admission_cap)
            need = self.kv.get_num_blocks_to_allocate(req, target_tokens, hit, computed, cap)
            return need + headroom <= self.kv.num_free

        def held_by_watermark(target_tokens: int, cap: bool = False) -> bool:
            # rule coverage only: the blocks would fit but for the watermark
            return watermark > 0 and fits(target_tokens, 0, cap)  # pragma: no mutate

        full = min(req.num_tokens, cfg.max_model_len)
        if cfg.scheduler_reserve_full_isl and not fits(full, watermark, True):
            self._rules(blocked_admission_rules(True, held_by_watermark(full, True)))  # pragma: no mutate
            return False
        # blocks wholly outside a sliding window or before a local-attention
        # chunk (a promoted load's) are freed before the count
        # (allocate_slots -> remove_skipped_blocks)
        self.kv.remove_skipped_blocks(req, max(0, computed - req.num_in_flight_tokens))
        lookahead = 0 if load_async else cfg.num_lookahead_tokens
        target = min(computed + n + lookahead, cfg.max_model_len)
        if not fits(target, watermark + reserved):
            self._rules(blocked_admission_rules(False, held_by_watermark(target), reserved > 0 and fits(target, watermark)))  # pragma: no mutate
            return False
        self._rule("watermark.admitted", watermark > 0)  # pragma: no mutate
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
        if self.effects is not None:
            self.effects.before_schedule(self)
        cfg = self._config
        self.step += 1
        self.kv.new_step_starts()  # kv_cache_manager.new_step_starts()
        threshold = effective_threshold(
            threshold=cfg.long_prefill_token_threshold,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.kv_holding),  # get_request_counts
        )
        st = StepState(
            token_budget=cfg.max_num_batched_tokens,
            input_budget=cfg.max_num_batched_tokens,
            threshold=threshold,
            encoder_budget=cfg.max_num_encoder_input_tokens,
            defer_prefills=self._defer_prefills(),
            # vLLM's drafts_needed starts as not can_skip_drafts (spec/runner_v2.py)
            drafts_needed=not can_skip_drafts(cfg),
        )
        if self.pause_state == PauseState.PAUSED_ALL:
            self._rule("pause.all_empty_step")  # pragma: no mutate
            st.token_budget = 0  # "Do not schedule any requests when paused."
        self._rule("schedule.threshold_active", threshold > 0)  # pragma: no mutate
        self._schedule_running(st)
        # The LoRA adapters of every running request, scheduled this step or not
        st.loras = {r.spec.lora_id for r in map(self.requests.__getitem__, self.running) if r.spec.lora_id > 0}
        assert not cfg.max_loras or len(st.loras) <= cfg.max_loras
        self._rule("schedule.waiting_skipped", len(st.preempted) > 0 and len(self.waiting) + len(self.kv_holding) > 0)  # pragma: no mutate
        if not st.preempted and self.pause_state != PauseState.PAUSED_ALL:
            self._schedule_waiting(st)
        assert len(self.running) <= cfg.max_num_seqs
        self._advance_cadence(st)
        plan = self._make_plan(st)
        if self.stats_record is not None and cfg.async_scheduling:
            self.stats_record.note_plan(plan, self.requests)
        if self.effects is not None:
            self.effects.after_schedule(self, plan)
        return plan

    def _schedule_running(self, st: StepState) -> None:
        """Phase 1, the RUNNING loop: each running request in queue order gets
        its next chunk, preempting others (or itself) when the pool is short."""
        cfg = self._config
        i = 0
        while i < len(self.running) and st.token_budget > 0:
            if st.input_budget <= cfg.num_draft_slots:
                self._rule("running.stop_draft_slots")  # pragma: no mutate
                return  # no room for a token besides the draft slots (break)
            req = self.requests[self.running[i]]
            if self._running_passed_over(st, req):
                i += 1  # "continue" in vLLM
                continue
            n = running_chunk(
                num_tokens=req.num_tokens,
                num_computed=req.num_computed_tokens,
                threshold=st.threshold,
                token_budget=st.request_token_budget(cfg.num_draft_slots),
                max_model_len=cfg.max_model_len,
                num_spec_tokens=len(req.spec_token_ids),
                num_output_placeholders=req.num_output_placeholders,
            )
            n = self._state_aligned_split(req, req.num_computed_tokens, n)
            enc = self._schedule_encoder_inputs(req, req.num_computed_tokens, n, st.encoder_budget)
            if enc.num_tokens == 0:
                # nothing to compute, or an encoder input that does not fit
                # starts the chunk (running_chunk: n >= 0)
                self._rule("running.skip_no_tokens" if n == 0 else "encoder.running_no_token")  # pragma: no mutate
                i += 1  # skipped, not a stop ("continue" in vLLM)
                continue
            n = enc.num_tokens
            allocation = self._allocate_or_preempt(st, req, n, i)
            i = allocation.index
            if not allocation.allocated:
                if cfg.policy == Policy.PRIORITY and req.status == RequestStatus.PREEMPTED:
                    self._rule("running.self_preempted_continue")  # pragma: no mutate
                    continue  # it preempted itself; later requests may still fit
                self._rule("running.self_preempted_break")  # pragma: no mutate
                return  # vLLM: break out of the RUNNING loop
            self._rules(running_scheduled_rules(req.num_computed_tokens + n, req.num_tokens + req.num_output_placeholders))  # pragma: no mutate
            st.prefill_scheduled |= req.is_prefill_chunk
            drafts = self._take_drafts(req, n)
            st.scheduled[req.request_id] = Scheduled(ScheduleKind.RUNNING, req.num_computed_tokens, n, drafts)
            st.token_budget -= n
            st.input_budget -= n + cfg.num_draft_slots
            self._note_drafts_needed(st, req, req.num_computed_tokens, n)
            self._commit_encoder_inputs(st, req, enc)
            i += 1
        self._rule("running.stop_budget", i < len(self.running))  # pragma: no mutate

    def _running_passed_over(self, st: StepState, req: _Request) -> bool:
        """Whether the RUNNING loop passes ``req`` over before its chunk."""
        if req.num_output_placeholders and surely_reaches_max_tokens(
            num_computed=req.num_computed_tokens,
            num_output_placeholders=req.num_output_placeholders,
            num_prompt_tokens=len(req.spec.prompt_token_ids),
            max_tokens=req.spec.max_tokens,
        ):
            self._rule("running.skip_max_tokens_in_flight")  # pragma: no mutate
            return True  # async: the steps in flight finish it
        if decode_throttled(self.step, req.next_decode_eligible_step):
            self._rule("v2.decode_throttled")  # pragma: no mutate
            return True  # V2 + PP + async: its last decode was too recent (spec/runner_v2.py)
        if st.defer_prefills and req.is_prefill_chunk:
            self._rule("cadence.running_chunk_held")  # pragma: no mutate
            return True  # a prefill chunk waits for a cadence-aligned step
        return False

    def _allocate_or_preempt(self, st: StepState, req: _Request, n: int, i: int) -> RunningAllocation:
        """allocate_slots for ``req`` (at index ``i`` of the running queue); while
        it fails, preempt the lowest-priority running request and retry. A
        victim already scheduled this step gives its budget back (PRIORITY
        only). ``req`` may end up preempting itself, or stop at a victim whose
        blocks cannot be freed yet (defer_block_free). Such a victim's
        blocks keep the keys its allocate_slots gave them this step although
        no step computes their KV, so its resume can hit them: vLLM 0.33 does
        the same (docs/divergences.md, "vLLM behaviours found")."""
        while not self._allocate_running(req, n):
            keys = [(r.spec.priority, r.spec.arrival) for r in map(self.requests.__getitem__, self.running)]
            v = choose_victim(policy=self._config.policy, running_keys=keys)
            if not self._blocks_can_be_freed(self.requests[self.running[v]]):
                # defer_block_free: "A deferred free will not help with
                # immediate allocation." (break)
                self._rule("connector.victim_in_flight")  # pragma: no mutate
                return RunningAllocation(allocated=False, index=i)
            self._rule("preempt.fcfs_tail" if self._config.policy == Policy.FCFS else "preempt.priority_victim")  # pragma: no mutate
            victim = self.requests[self.running.pop(v)]
            if v < i:
                self._rule("preempt.victim_ahead")  # pragma: no mutate
                i -= 1
            if victim.request_id in st.scheduled:
                self._rule("preempt.budget_give_back")  # pragma: no mutate
                if self.effects is not None:  # effect coverage: what the budget got back (spec/effects.py)
                    self.effects.given_back += st.scheduled[victim.request_id].num_scheduled_tokens
                restored = st.scheduled.pop(victim.request_id).num_scheduled_tokens
                st.token_budget += restored
                st.input_budget += restored + self._config.num_draft_slots
                given_back = st.encoder_inputs.pop(victim.request_id, [])
                # its encoder inputs give their embeddings back to the budget
                self._rule("encoder.budget_given_back", len(given_back) > 0)  # pragma: no mutate
                st.encoder_budget += sum(victim.spec.mm_inputs[j].length for j in given_back)
            # requires_kv_delivery (kv_both is a producer): the victim's
            # in-flight output is dropped, not delivered
            self._preempt_request(victim, drop_stale_output=self._config.kv_connector)
            st.preempted.append(victim.request_id)
            if victim is req:
                self._rule("preempt.self")  # pragma: no mutate
                return RunningAllocation(allocated=False, index=i)
        return RunningAllocation(allocated=True, index=i)

    def _schedule_waiting(self, st: StepState) -> None:
        """Phase 2, the WAITING loop (only in a step that preempted nobody):
        admit from the head of kv_holding_waiting (requests holding KV blocks,
        drained first and the only ones admitted under PAUSED_NEW), then of
        the waiting queue, while the budget, max_num_seqs and the pool allow;
        the first request that cannot be admitted stops the loop
        (head-of-line). A request passed over (skip_request) leaves its queue
        for the step and is put back at its head after the loop, into
        kv_holding_waiting if it now holds blocks."""
        skipped_holding: list[str] = []  # step_skipped_kv_holding
        skipped_waiting: list[str] = []  # step_skipped_waiting
        stopped = False
        while st.token_budget > 0:
            queue = self.kv_holding
            if not queue and self.pause_state == PauseState.UNPAUSED:
                queue = self.waiting
            if not queue:
                # PAUSED_NEW: nothing but requests holding KV blocks is admitted
                self._rule("pause.new_no_admission", bool(self.waiting))  # pragma: no mutate
                stopped = bool(self.waiting)
                break
            if st.input_budget <= self._config.num_draft_slots:
                self._rule("waiting.stop_draft_slots")  # pragma: no mutate
                break  # no room for a token besides the draft slots
            if len(self.running) + self.num_waiting_for_streaming_input >= self._config.max_num_seqs:
                # paused sessions hold a model-runner slot ("num_running")
                self._rule("sessions.slots_held", len(self.running) < self._config.max_num_seqs)  # pragma: no mutate
                self._rule("waiting.stop_max_num_seqs")  # pragma: no mutate
                stopped = True
                break
            req = self.requests[self._queue_order(queue)[0]]
            outcome = Admission.PASSED_OVER if self._pass_over(st, req) else self._admit(st, req, queue)
            if outcome is Admission.PASSED_OVER:
                # skip_request: it stays deferred until admitted
                queue.remove(req.request_id)
                self.deferred.add(req.request_id)
                (skipped_holding if self._holds_kv_blocks(req) else skipped_waiting).append(req.request_id)
                continue
            if outcome is Admission.STOPS_LOOP:
                stopped = True
                break  # head-of-line: nothing behind it is tried
        if not stopped:
            self._rule("waiting.stop_budget", bool(self.waiting or self.kv_holding))  # pragma: no mutate
        self.kv_holding[:0] = skipped_holding
        self.waiting[:0] = skipped_waiting
        if not st.defer_prefills:
            # a release step records whether it left the queue backed up
            self.prefill_capacity_bound = len(self.waiting) + len(self.kv_holding) > len(self.deferred)

    @staticmethod
    def _holds_kv_blocks(req: _Request) -> bool:
        """_holds_kv_blocks: a waiting request with computed tokens (a
        promoted load) or loading holds blocks."""
        return req.num_computed_tokens > 0 or req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def _pass_over(self, st: StepState, req: _Request) -> bool:
        """The WAITING loop's checks before the prefix lookup that pass the
        request over (skip_request) instead of stopping the loop: a load not
        reported yet, a grammar still compiling or failed
        (_handle_blocked_waiting_request), stale output in flight, an adapter
        beyond max_loras. A reported load is promoted here
        (_update_waiting_for_remote_kv)."""
        cfg = self._config
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if req.request_id not in self.kv_loads_done:
                self._rule("connector.skip_loading")  # pragma: no mutate
                return True
            self._update_waiting_for_remote_kv(req)
        if req.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            if req.grammar is GrammarState.COMPILING:
                self._rule("grammar.skip_compiling")  # pragma: no mutate
                return True
            if req.grammar is GrammarState.FAILED:
                # grammar_compile_error_reqs: finished at the next update
                self._rule("grammar.compile_error")  # pragma: no mutate
                self.grammar_errors.add(req.request_id)
                return True
            self._rule("grammar.ready")  # pragma: no mutate
            req.set_status(RequestStatus.WAITING)
        if req.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            # _handle_blocked_waiting_request: a session waiting for input
            self._rule("sessions.skip_waiting_for_input")  # pragma: no mutate
            return True
        if req.num_stale_output_tokens and not req.drop_stale_output:
            # Async scheduling: output of a step in flight when it was
            # preempted will still be delivered; resuming now could resample
            # a position that output fills.
            self._rule("waiting.skip_stale_output")  # pragma: no mutate
            return True
        lora = req.spec.lora_id
        if cfg.max_loras and lora and len(st.loras) == cfg.max_loras and lora not in st.loras:
            # "Scheduling would exceed max_loras, skip."
            self._rule("lora.skip_max_loras")  # pragma: no mutate
            return True
        self._rule("lora.admitted_adapter", lora > 0)  # pragma: no mutate
        return False

    def _prefix_lookup(self, req: _Request) -> PrefixHit:
        """The WAITING loop's lookup for a request with nothing computed: the
        local prefix hit (_get_local_prefix_cache_hit), then, with a KV
        connector, the external tokens it offers beyond the block-aligned
        local hit (get_num_new_matched_tokens) under the partial-tail rules."""
        cfg = self._config
        hit = self._get_computed_blocks(req)
        local = len(hit[0]) * cfg.block_size
        if not cfg.kv_connector:
            return PrefixHit(hit, local)
        aligned = local - local % cfg.block_size
        offer = get_num_new_matched_tokens(req.spec.kv_external_tokens, req.spec.kv_load_async, aligned)
        taken = external_hit(local, cfg.block_size, offer.num_external_tokens, offer.load_async)
        self._rules(external_tokens_rules(taken.num_external_tokens, req.spec.kv_external_tokens, aligned))  # pragma: no mutate
        assert taken.num_local_tokens + taken.num_external_tokens <= req.num_tokens
        return PrefixHit(hit, taken.num_local_tokens + taken.num_external_tokens, taken.num_external_tokens,
                         taken.load_async)

    def _admit(self, st: StepState, req: _Request, queue: list[str]) -> Admission:
        """One admission of the WAITING loop: the prefix hit (local and
        external), the chunk past it, the encoder inputs, the blocks; then the
        request starts running (``_start_running``). It stops the loop when it
        cannot be admitted, and is passed over when an encoder input leaves it
        no token this step or an asynchronous load starts; nothing else
        changes then, but for the encoder cache as vLLM leaves it. A request
        whose load was promoted keeps its blocks and computed tokens
        ("WAITING reqs have num_computed_tokens > 0 after async KV recvs are
        completed")."""
        if req.num_computed_tokens == 0:
            # a promoted load of a one-token prompt keeps its block with
            # nothing computed (num_tokens - 1 = 0): it is looked up again,
            # and the stateless connector offers the token again
            self._rule("connector.reload_held", bool(req.blocks))  # pragma: no mutate
            hit = self._prefix_lookup(req)
        else:
            # a promoted load, or a session resuming its kept blocks (spec/sessions.py)
            self._rule("sessions.admit_continued" if req.spec.resumable else "connector.admit_loaded")  # pragma: no mutate
            hit = PrefixHit([[] for _ in self._config.groups], req.num_computed_tokens)
        if hit.load_async:
            return self._start_async_load(req, hit)
        computed = hit.num_computed_tokens
        if st.defer_prefills and computed < req.num_tokens - 1:
            self._rule("cadence.admission_held")  # pragma: no mutate
            return Admission.STOPS_LOOP  # "defer this step's local prefill compute" (break)
        chunk = self._admission_tokens(st, req, computed)
        chunk = AdmissionChunk(self._state_aligned_split(req, computed, chunk.num_tokens), chunk.spec_token_ids)
        if chunk.num_tokens == 0:
            return Admission.STOPS_LOOP
        enc = self._schedule_encoder_inputs(req, computed, chunk.num_tokens, st.encoder_budget)
        if enc.num_tokens == 0:
            self._rule("encoder.admission_passed_over")  # pragma: no mutate
            return Admission.PASSED_OVER  # "Requeue it so it does not stall the requests behind it."
        if not self._allocate_admission(req, hit.blocks, enc.num_tokens, computed):
            self._free_encoder_refs(req)  # "untouch the request from the encode cache manager"
            return Admission.STOPS_LOOP  # head-of-line: nothing behind it is tried
        self._start_running(st, req, queue, hit, enc, chunk.spec_token_ids)
        return Admission.ADMITTED

    def _start_running(
        self, st: StepState, req: _Request, queue: list[str], hit: PrefixHit, enc: EncoderPlan,
        drafts: tuple[int, ...],
    ) -> None:
        """An admitted request leaves its waiting queue for the running queue,
        NEW or RESUMED (after a preemption), scheduled this step for the
        chunk ``enc`` left it past its hit; its adapter joins the step's
        LoRA adapters, a synchronous load of the connector's tokens is
        recorded, and a request with prompt left joins the in-flight
        prefills (schedule(), the end of the WAITING loop's body)."""
        computed, n, rid = hit.num_computed_tokens, enc.num_tokens, req.request_id
        self._record_load(req, computed - hit.num_external_tokens, hit.num_external_tokens, asynchronous=False)
        self._record_prefix_cache_stats(req, computed - hit.num_external_tokens)
        self.deferred.discard(rid)
        if req.spec.lora_id:
            st.loras.add(req.spec.lora_id)
        st.prefill_admitted |= computed < req.num_tokens - 1
        queue.remove(rid)
        self.running.append(rid)
        kind = ScheduleKind.NEW if req.status == RequestStatus.WAITING else ScheduleKind.RESUMED
        self._rules(admission_rules(kind, computed + n, req.num_tokens))  # pragma: no mutate
        if self._config.kv_connector and computed + n < req.num_tokens:
            self.inflight_prefills.add(rid)
        req.set_status(RequestStatus.RUNNING)
        req.num_computed_tokens = computed
        st.scheduled[rid] = Scheduled(kind, computed, n, drafts)
        st.token_budget -= n
        st.input_budget -= n + self._config.num_draft_slots
        self._note_drafts_needed(st, req, computed, n)
        self._commit_encoder_inputs(st, req, enc)

    def _note_drafts_needed(self, st: StepState, req: _Request, computed: int, n: int) -> None:
        """Scheduler.schedule, after scheduling a request in either loop:
        ``drafts_needed = drafts_needed or not self._drafts_unused(request,
        num_computed_tokens, num_new_tokens)`` (vllm/v1/core/sched/scheduler.py;
        spec/runner_v2.py). Set, it stays set if the request is preempted
        later in the step."""
        st.drafts_needed = st.drafts_needed or not drafts_unused(
            num_tokens=req.num_tokens, num_computed=computed, num_new_tokens=n,
            num_output_tokens=len(req.output_token_ids), num_output_placeholders=req.num_output_placeholders,
            max_tokens=req.spec.max_tokens,
        )

    def _start_async_load(self, req: _Request, hit: PrefixHit) -> Admission:
        """An asynchronous load starts (schedule(), ``load_kv_async``):
        blocks for the local hit and the external tokens, no new work and no
        lookahead slots, leaving the in-flight prefills' reservation free;
        the request becomes WAITING_FOR_REMOTE_KVS with the loaded tokens
        counted computed, joins the in-flight prefills, and is passed over
        (skip_request, into kv_holding_waiting). It stops the loop when the
        blocks do not fit."""
        computed = hit.num_computed_tokens
        if not self._allocate_admission(req, hit.blocks, 0, computed, load_async=True,
                                        reserved=self._async_load_reserve()):
            self._free_encoder_refs(req)
            return Admission.STOPS_LOOP
        self._record_load(req, computed - hit.num_external_tokens, hit.num_external_tokens, asynchronous=True)
        self._record_prefix_cache_stats(req, computed - hit.num_external_tokens)
        req.set_status(RequestStatus.WAITING_FOR_REMOTE_KVS)
        req.num_computed_tokens = computed
        self.inflight_prefills.add(req.request_id)
        return Admission.PASSED_OVER

    def _state_aligned_split(self, req: _Request, start: int, n: int) -> int:
        """Scheduler._mamba_block_aligned_split, applied to every chunk when
        a Mamba group is in "align" mode (need_mamba_block_aligned_split):
        spec/mamba.py, block_aligned_split, from ``start`` computed tokens."""
        cfg = self._config
        if not self.kv.layout.aligns_chunks or n <= 0:
            return n
        threshold = cfg.long_prefill_token_threshold
        cut = block_aligned_split(
            start, n, len(req.spec.prompt_token_ids), req.num_tokens, cfg.block_size,
            min(cfg.max_num_batched_tokens, threshold) if threshold > 0 else cfg.max_num_batched_tokens,
            req.shared_prefix_boundary,
        )
        self._rule("mamba.chunk_aligned", cut < n)  # pragma: no mutate
        self._rule("mamba.chunk_none", cut == 0)  # pragma: no mutate
        return cut

    def _admission_tokens(self, st: StepState, req: _Request, num_hit_tokens: int) -> AdmissionChunk:
        """The tokens an admission schedules past its prefix hit, and its
        drafts: a padded decode of 1 + k tokens with k placeholder drafts, or
        the prompt chunk the threshold and the budget allow. 0 tokens when
        the loop stops (the padding or, with chunked prefill off, the prompt
        does not fit the budget)."""
        cfg = self._config
        padded: int | None = req.num_tokens - num_hit_tokens
        if cfg.num_speculative_tokens and padded == 1:
            padded = decode_padding(
                num_new_tokens=1,
                num_computed=num_hit_tokens,
                num_spec_tokens=cfg.num_speculative_tokens,
                prefill_scheduled=st.prefill_scheduled,
                running_scheduled=st.running_scheduled(),
                max_model_len=cfg.max_model_len,
                token_budget=st.request_token_budget(cfg.num_draft_slots),
            )
        if padded is None:
            self._rule("admit.blocked_padding")  # pragma: no mutate
            return AdmissionChunk(0)  # vLLM: "Prefer to not schedule than schedule un-padded" (break)
        if padded > req.num_tokens - num_hit_tokens:
            # a padded decode: 1 + k tokens, the k drafts placeholders (-1)
            self._rule("admit.padded_decode")  # pragma: no mutate
            return AdmissionChunk(padded, (-1,) * cfg.num_speculative_tokens)
        n = admission_chunk(
            num_tokens=req.num_tokens,
            num_hit_tokens=num_hit_tokens,
            threshold=st.threshold,
            token_budget=st.request_token_budget(cfg.num_draft_slots),
            chunked_prefill=cfg.enable_chunked_prefill,
        )
        # 0: chunked prefill off and the prompt does not fit the budget
        self._rule("admit.blocked_chunking_off", n == 0)  # pragma: no mutate
        return AdmissionChunk(n)

    def _make_plan(self, st: StepState) -> StepPlan:
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
        for rid, e in st.scheduled.items():
            req = self.requests[rid]
            entries.append(
                ScheduledRequest.of(rid, e.kind, num_computed_tokens=e.num_computed_tokens,
                                    num_scheduled_tokens=e.num_scheduled_tokens,
                                    all_token_ids=req.all_token_ids, block_ids=tuple(req.blocks),
                                    group_block_ids=req.group_block_ids(),
                                    spec_token_ids=e.spec_token_ids,
                                    num_output_placeholders=req.num_output_placeholders,
                                    encoder_inputs=tuple(st.encoder_inputs.get(rid, ())))
            )
            req.num_computed_tokens = e.num_computed_tokens + e.num_scheduled_tokens
            req.num_in_flight_tokens += e.num_scheduled_tokens
            req.last_sched_seq = self.sched_step_seq
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
            if not req.is_prefill_chunk:
                self.inflight_prefills.discard(rid)
            if cfg.async_scheduling and not req.is_prefill_chunk:
                self._rule("async.placeholders_added")  # pragma: no mutate
                req.num_output_placeholders += 1 + len(e.spec_token_ids)
                req.spec_token_ids = [-1] * cfg.num_speculative_tokens
                if stagger := decode_stagger(cfg):  # spec/runner_v2.py
                    req.next_decode_eligible_step = self.step + stagger
        plan = StepPlan(
            step=self.step,
            scheduled=tuple(entries),
            preempted_ids=tuple(sorted(self.preempted)),
            finished_ids=tuple(sorted(self.finished)),
            freed_encoder_inputs=tuple(self.encoder.get_freed_mm_hashes()),
            kv_loads=tuple(self.pending_loads),
            skip_drafts=not st.drafts_needed,
        )
        self._rule("v2.drafts_skipped", plan.skip_drafts)  # pragma: no mutate
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
            self._rule("update.no_token", not toks)  # pragma: no mutate
            if req is None:
                # aborted, or finished by an earlier step, while this one ran
                self._rule("update.request_gone")  # pragma: no mutate
                continue
            stale = self._drain_in_flight(req, s.num_scheduled_tokens)
            if s.request_id in failed:
                # "skip failed or rescheduled requests from KV load failure"
                self._rule("connector.output_skipped")  # pragma: no mutate
                continue
            if stale and req.drop_stale_output:
                self._rule("async.stale_dropped")  # pragma: no mutate
                continue  # drop-mode stale output is discarded entirely
            if s.spec_token_ids and toks:
                self._count_drafts(plan, s, toks)
                self._roll_back_rejected(req, len(s.spec_token_ids) - (len(toks) - 1), stale)
            if req.spec.mm_inputs:
                self._free_encoder_inputs(req)  # "only after the step has actually executed"
            if toks:
                self._take_output(req, toks, stale, stopped)
        self.running = [r for r in self.running if r not in stopped]
        self._enqueue_continuing()  # sessions that go on (spec/sessions.py)
        self._finish_errors(failed if cfg.kv_load_failure_policy == "fail" else set())
        if cfg.kv_connector:
            self._update_from_kv_xfer_finished(result)
        self.in_flight = self.in_flight[1:]
        self._after_outputs(plan, result)

    def _after_outputs(self, plan: StepPlan, result: StepResult) -> None:
        """The end of update(): without async scheduling the drafts proposed
        after the step (update_draft_token_ids); the statistics (log_stats)
        and the effects' observer (spec/effects.py) when attached."""
        cfg = self._config
        if not cfg.async_scheduling:
            self._update_draft_token_ids(result)
            if self.streaming_queues and cfg.num_speculative_tokens:
                self._clear_unproposed(plan, result)  # spec/sessions.py
        if self.stats_record is not None:
            self._stats_after_update(plan, result)
        if self.effects is not None:
            self.effects.after_update(self, plan)

    def _count_drafts(self, plan: StepPlan, s: ScheduledRequest, toks: tuple[int, ...]) -> None:
        """make_spec_decoding_stats (log_stats): the entry's drafts less those its grammar
        invalidated; accepted: the sampled tokens less the bonus token."""
        if self.stats_record is not None:
            invalid = s.num_invalid_spec_tokens + self.stats_record.num_invalid(plan, s.request_id)
            self.stats_record.observe_draft(len(s.spec_token_ids) - invalid, max(len(toks) - 1, 0))

    def _stats_after_update(self, plan: StepPlan, result: StepResult) -> None:
        """The statistics' record after an update (log_stats; spec/stats_record.py): the next
        plan's drafts are checked once this update is in."""
        assert self.stats_record is not None
        self.stats_record.updated(plan)
        if self.in_flight and self._config.num_speculative_tokens:
            self.stats_record.deferred_drafts(self.in_flight[0], plan, result, self.requests)

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
            self._rule("grammar.refused_sample")  # pragma: no mutate
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
            # waiting queue and the deferred set (update_from_output,
            # stopped_preempted_reqs); a session that goes on is enqueued
            # again after the loop
            self._rule("async.stale_output_stopped")  # pragma: no mutate
            self._remove_waiting(req.request_id)
        if req.spec.resumable and status != RequestStatus.FINISHED_ERROR and not self._handle_stopped_request(req):
            self.continuing.append(req.request_id)  # a session goes on (spec/sessions.py)
            return
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
            self._rules(finished_error_rules(rid in errors, rid in failed_loads))  # pragma: no mutate
            self._finish_request(req, RequestStatus.FINISHED_ERROR)

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
                self._rule("spec.stop_inside_run", num_new < len(toks))  # pragma: no mutate
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
        self._rules(stop_rules(reason, token, req.spec, req.num_tokens, self._config.max_model_len))  # pragma: no mutate
        return RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH_CAPPED

    # ------------------------------------------------------------------ statistics

    def _record_prefix_cache_stats(self, req: _Request, num_hits: int) -> None:
        """schedule()'s WAITING loop, once an admission's blocks are allocated
        (sync or asynchronous load): a request that looked the prefix cache up
        (nothing computed before: ``did_prefix_cache_lookup``) records its
        tokens and its local hit, with caching on
        (KVCacheManager.record_prefix_cache_stats; spec/stats.py)."""
        if self.stats_record is not None and req.num_computed_tokens == 0 and self.kv.enable_caching:
            self.stats_record.record_lookup(req.num_tokens, num_hits, req.num_preemptions > 0)

    def make_stats(self) -> SchedulerStats | None:
        """Scheduler.make_stats, which update_from_output calls at its end:
        the statistics since the last ones (spec/stats.py); None without
        ``log_stats``. The driver calls it once after each update()."""
        if self.stats_record is None:
            return None
        waiting = len(self.waiting) + len(self.kv_holding)  # get_request_counts
        usage = kv_cache_usage(self.kv.num_free, self.kv.num_blocks)
        return self.stats_record.make(len(self.running), waiting, len(self.deferred), usage)

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


# ---------------------------------------------------------------- rule coverage
# The named branches (spec/rule_names.py) a decision with several outcomes
# took, from the values at hand: SpecScheduler counts what these yield.


def abort_rules(status: RequestStatus) -> Iterator[str]:  # pragma: no mutate block
    """abort(): the status the aborted request had."""
    if status == RequestStatus.RUNNING:
        yield "abort.running"
    if status == RequestStatus.WAITING:
        yield "abort.waiting"
    if status == RequestStatus.PREEMPTED:
        yield "abort.preempted"
    if status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        yield "grammar.abort_waiting"


def prefix_hit_rules(num_hit_tokens: int, num_tokens: int, block_size: int) -> Iterator[str]:  # pragma: no mutate block
    """_get_computed_blocks: a request of ``num_tokens`` tokens hit
    ``num_hit_tokens`` (whole blocks) of the at most ``full`` blocks a hit
    may cover (max_hit_blocks: never the last token); a capped hit is a full
    one of a block-aligned prompt, whose last block is recomputed."""
    hit = num_hit_tokens // block_size
    full = max_hit_blocks(num_tokens=num_tokens, block_size=block_size)
    if full > 0 and not hit:
        yield "kv.miss"
    if 0 < hit < full:
        yield "kv.hit_partial"
    if 0 < hit == full:
        yield "kv.hit_full"
    if 0 < hit == full and num_tokens % block_size == 0:
        yield "kv.hit_capped"


def blocked_admission_rules(full_sequence: bool, by_watermark: bool,
                            by_reserve: bool = False) -> Iterator[str]:  # pragma: no mutate block
    """_allocate_admission refused the blocks, for the whole sequence
    (scheduler_reserve_full_isl) or for this step; ``by_watermark``: they
    would fit without the watermark; ``by_reserve``: without an asynchronous
    load's reservation."""
    if full_sequence:
        yield "admit.blocked_full_sequence"
    else:
        yield "admit.blocked_blocks"
    if full_sequence and by_watermark:
        yield "watermark.blocked_full_sequence"
    if not full_sequence and by_watermark:
        yield "watermark.blocked"
    if by_reserve:
        yield "connector.load_blocked_reserve"


def running_scheduled_rules(num_computed_after: int, num_known: int) -> Iterator[str]:  # pragma: no mutate block
    """The RUNNING loop scheduled a request, to ``num_computed_after`` tokens
    of its ``num_known`` (known and in flight): short of them, a prefill chunk."""
    yield "running.scheduled"
    if num_computed_after < num_known:
        yield "running.prefill_chunk"


def admission_rules(kind: ScheduleKind, num_computed_after: int, num_tokens: int) -> Iterator[str]:  # pragma: no mutate block
    """The WAITING loop admitted a request as ``kind``, to
    ``num_computed_after`` of its ``num_tokens``: short of them, a chunk."""
    if kind == ScheduleKind.NEW:
        yield "admit.new"
    else:
        yield "admit.resumed"
    if num_computed_after < num_tokens:
        yield "admit.prefill_chunk"


def external_tokens_rules(num_external: int, kv_external_tokens: int, aligned: int) -> Iterator[str]:  # pragma: no mutate block
    """_prefix_lookup with a KV connector: it took ``num_external`` tokens of
    the request's ``kv_external_tokens``, past the block-aligned local hit."""
    if num_external > 0:
        yield "connector.external_hit"
    if 0 < kv_external_tokens <= aligned:
        yield "connector.external_within_local"


def finished_error_rules(grammar_failed: bool, load_failed: bool) -> Iterator[str]:  # pragma: no mutate block
    """_finish_errors: why a request finishes with FINISHED_ERROR."""
    if grammar_failed:
        yield "grammar.finished_error"
    if load_failed:
        yield "connector.failed_load_error"


def stop_rules(reason: str, token: int, spec: RequestSpec, num_tokens: int,
               max_model_len: int) -> Iterator[str]:  # pragma: no mutate block
    """_append_and_check_stop: why ``token`` stopped the request (check_stop's
    ``reason`` "stop" or "length")."""
    eos = token == spec.eos_token_id and not spec.ignore_eos
    if eos:
        yield "stop.eos"
    if reason == "stop" and not eos:
        yield "stop.stop_token"
    if reason == "length" and num_tokens >= max_model_len:
        yield "stop.max_model_len"
    if reason == "length" and num_tokens < max_model_len:
        yield "stop.max_tokens"
