"""ImplScheduler: the spec's observable behaviour, at production speed.

Same decisions as spec.scheduler.SpecScheduler (plans, views, errors), written
independently: it imports only the interface types and the protocol boundary
(spec/protocol.py), never the spec's scheduling logic. It is cut like the
spec and like vLLM's Scheduler.schedule:

- ``schedule()``: the running phase (impl/running.py), the waiting phase
  (impl/waiting.py, only in a step that preempted nobody), plan assembly
  (``_assemble_plan``);
- ``update()``: impl/update.py;
- the request record and the plan entry: impl/request.py; the KV pool's
  operations: impl/allocation.py over impl/free_queue.py and
  impl/prefix_index.py; the waiting queues and the PRIORITY victims:
  impl/queues.py; the gates: impl/gates.py and impl/encoder_cache.py; the KV
  connector: impl/connector.py; hybrid KV cache groups: impl/kv_groups.py.

What keeps a step cheap (docs/impl.md): a steady decode costs O(1) per
running request and touches the block table only when it crosses a block
(``num_slots``) or fills one to key (``next_full_at``); the block table is
handed to plans as a tuple cached on the request; plan entries are built by
filling ``__dict__``; update validates and applies in one pass.

Three switches pick the branches of the phases: ``_general`` (async
scheduling, drafts or a gate: the per-step bookkeeping of in-flight tokens,
placeholders and the update codes), ``_gated`` (a gate, the connector or
hybrid groups: the gate rules) and ``_async``.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Union

from schedspec.spec.interface import (
    BlockKey,
    KVLoad,
    KVView,
    PauseState,
    Policy,
    RequestSpec,
    RequestStatus,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
)
from schedspec.spec.protocol import (
    check_abort,
    check_add,
    check_config,
    check_gate_config,
    check_grammar_ready,
    check_kv_reset,
    check_mm_lengths,
    check_pause_state,
    check_reset,
    check_schedule,
)

from schedspec.spec.interface import AllBlocksCleared, KVCacheEvent
from schedspec.impl.allocation import AllocationMixin, max_hit_blocks
from schedspec.impl.connector import ConnectorMixin
from schedspec.impl.encoder_cache import EncoderCache
from schedspec.impl.free_queue import FreeBlockQueue
from schedspec.impl.gates import GatesMixin
from schedspec.impl.kv_groups import GroupsMixin, Layout
from schedspec.impl.prefix_index import PrefixIndex
from schedspec.impl.queues import FcfsWaiting, PriorityWaiting, VictimHeap
from schedspec.impl.request import (
    ABORTED,
    NEVER,
    NO_TOKENS,
    PREEMPTED,
    RUNNING,
    Request,
    WAITING_FOR_GRAMMAR,
    WAITING_FOR_REMOTE_KVS,
    running_seq_of,
)
from schedspec.impl.running import RunningPhase, StepState
from schedspec.impl.sessions import SessionsMixin, check_resumable
from schedspec.impl.stats import StatsMixin
from schedspec.impl.update import UpdateMixin
from schedspec.impl.waiting import WaitingPhase

_new = object.__new__

Waiting = Union[FcfsWaiting[Request], PriorityWaiting[Request]]


class ImplScheduler(
    RunningPhase,
    WaitingPhase,
    UpdateMixin,
    AllocationMixin,
    GatesMixin,
    ConnectorMixin[Request],
    GroupsMixin[Request],
    StatsMixin,
    SessionsMixin,
):
    """Implements spec.interface.Scheduler, with the optional
    ``set_pause_state`` and ``grammar_ready``."""

    #: The KV features implemented, by capability name: the KV connector,
    #: and hybrid KV cache groups (full attention, sliding window, chunked
    #: local; impl/kv_groups.py).
    KV: tuple[str, ...] = ("kv_connector", "hybrid_kv")

    #: The admission gates implemented, by capability name
    #: (spec/protocol.py, gates_of_config).
    GATES: tuple[str, ...] = ("watermark", "prefill_cadence", "pause", "lora", "structured_output", "encoder")

    #: A call it refuses raises spec/protocol.py's error and changes nothing
    #: (the check probes it: check/rejects.py).
    PROTOCOL_ERRORS = True

    def __init__(self, config: SchedulerConfig, log_stats: bool = False) -> None:
        self._config = config = check_config(config)
        check_gate_config(config, self.GATES)
        self._bs = config.block_size
        self._max_model_len = config.max_model_len
        # the drafter's KV slots past the scheduled tokens (allocate_slots' num_lookahead_tokens)
        self._lookahead = config.num_lookahead_tokens
        # V2 with a drafter of its own forward pass may skip drafting (Scheduler.__init__, can_skip_drafts)
        self._can_skip_drafts = self._lookahead > 0 and config.model_runner == "v2"
        # the batch slots each scheduled request takes for the drafter (max_num_new_slots_for_drafting)
        self._draft_slots = config.num_draft_slots
        self._caching = config.enable_prefix_caching
        self._priority = config.policy == Policy.PRIORITY
        num_blocks = config.num_blocks
        # KV pool
        self._ref: list[int] = [0] * num_blocks
        self._fq = FreeBlockQueue(num_blocks)
        self._px = PrefixIndex(num_blocks)
        # EAGLE's hash lookahead: a block's key covers the tokens after it
        # (VllmConfig.num_hash_lookahead_tokens; impl/allocation.py)
        self._hash_la = self._px.lookahead = config.num_hash_lookahead_tokens
        # EAGLE's prefill lookahead: the encoder-input window reaches past the chunk
        self._prefill_la = config.num_prefill_lookahead_tokens
        if config.enable_kv_cache_events:  # impl/kv_events.py
            self._px.events = []
        # requests and queues
        self._requests: dict[str, Request] = {}
        self._waiting: Waiting = PriorityWaiting() if self._priority else FcfsWaiting()
        self._running: list[Request] = []
        self._victims: VictimHeap[Request] = VictimHeap()
        self._running_seq = 0
        self._finished: dict[str, Request] = {}
        self._preempted: set[str] = set()
        self._step = 0
        # The plans awaiting update(), oldest first, the requests of each
        # plan's entries and their update codes (parallel lists; the codes
        # are kept on the general rules only): at most one plan at rest, two
        # for a moment with async scheduling.
        self._inflight: list[StepPlan] = []
        self._inflight_reqs: list[list[Request]] = []
        self._inflight_codes: list[list[int]] = []
        self._num_spec_tokens = config.num_speculative_tokens
        self._async = config.async_scheduling
        # Model Runner V2's decode throttle (spec/runner_v2.py): the steps
        # between two decodes of one request, 0 = none (the fast path then
        # never reads next_decode_eligible_step)
        self._stagger = (
            config.pipeline_parallel_size if config.model_runner == "v2" and config.async_scheduling else 0
        )
        # n -> (-1,) * n: the token ids of a step wholly past the known tokens
        self._unknown: dict[int, tuple[int, ...]] = {}
        # the k placeholder drafts of a request with async scheduling: one
        # tuple, so the steady-decode test is an identity check
        self._placeholder_drafts: tuple[int, ...] = (-1,) * self._num_spec_tokens
        # One frozenset per distinct stop set, shared by the requests that
        # have it (a cache of immutable values: clones share it too).
        self._stop_sets: dict[frozenset[int], frozenset[int]] = {}
        self._hybrid = config.is_hybrid
        self._layout = Layout(config)
        self._cached_now = set()  # Mamba states cached this step (impl/kv_groups.py)
        self._init_gates(config)
        # the KV connector (impl/connector.py)
        self._init_connector(config)
        # log_stats: the statistics (impl/stats.py)
        self._init_stats(log_stats)
        self._init_sessions()  # streaming-input sessions (impl/sessions.py)

    def _init_gates(self, config: SchedulerConfig) -> None:
        """The admission gates' state, and the switches of the phases."""
        self._config_gated = (
            config.prefill_schedule_interval > 1 or config.has_encoder or config.kv_connector or self._hybrid
        )
        self._base_general = config.async_scheduling or config.num_speculative_tokens > 0
        # several plans in flight (pipeline parallelism): the general path,
        # which keeps the in-flight and stale token counts
        self._base_general |= config.max_concurrent_batches > 1
        self._gated = self._config_gated
        self._general = self._base_general or self._gated
        # hybrid groups the one config gate: a steady decode past its prompt
        # may take its blocks from the coordinator inline (impl/running.py)
        self._groups_inline = self._hybrid and not (
            config.prefill_schedule_interval > 1 or config.has_encoder or config.kv_connector
        )
        self._live_grammars = 0  # unfinished requests with a grammar
        self._pause = PauseState.UNPAUSED
        self._watermark = config.watermark_blocks
        self._max_loras = config.max_loras
        # the prefill cadence (vLLM's Scheduler fields of these names)
        self._interval = config.prefill_schedule_interval
        self._num_executed_steps = 0
        self._last_prefill_step = -self._interval
        self._capacity_bound = False
        # waiting requests passed over (or waiting for a grammar) and not
        # admitted since; grammars that failed, finished at the next update
        self._deferred: set[str] = set()
        self._grammar_errors: set[str] = set()
        self._encoder_cache: EncoderCache | None = (
            EncoderCache(config.encoder_cache_size) if config.has_encoder else None
        )
        self._mm_lengths: dict[str, int] = {}

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    # ------------------------------------------------------------------ events

    def add(self, request: RequestSpec) -> None:
        request = check_add(request, self._config, self._requests, self._finished)
        if request.mm_inputs:
            check_mm_lengths(request, self._mm_lengths)
            for m in request.mm_inputs:
                self._mm_lengths[m.identifier] = m.length
        if request.resumable:
            check_resumable(request, self._config)
        req = Request(request, self._max_model_len, self._bs, self._caching, self._stop_sets, self._hash_la)
        if self._hybrid:
            num_other = len(self._layout.groups) - 1
            req.group_block_ids = [[] for _ in range(num_other)]
            req.group_num_cached_blocks = [0] * num_other
            req.group_skip_from = 0  # its first step asks the coordinator
            req.group_block_tuples = None
        if request.structured_output:
            # it waits for its grammar, passed over until grammar_ready
            req.status = WAITING_FOR_GRAMMAR
            self._deferred.add(request.request_id)
            self._live_grammars += 1
        self._requests[request.request_id] = req
        self._waiting.push_back(req)
        if request.resumable:
            self._add_session(request)

    def set_pause_state(self, state: PauseState) -> None:
        """PAUSED_NEW admits nothing from the waiting queue, PAUSED_ALL
        schedules nothing, UNPAUSED resumes (vLLM's Scheduler.set_pause_state)."""
        self._pause = check_pause_state(state)

    def grammar_ready(self, request_id: str, ok: bool = True) -> None:
        """The request's grammar compiled (``ok``) or failed to; the WAITING
        loop reads it when it next looks at the request."""
        req = self._requests.get(request_id) if isinstance(request_id, str) else None
        check_grammar_ready(
            request_id, ok, None if req is None else req.status,
            reported=req is not None and req.grammar_ok is not None,
        )
        assert req is not None
        req.grammar_ok = ok

    def abort(self, request_id: str) -> None:
        req = check_abort(request_id, self._requests)
        self._finish_request(req, ABORTED)

    def _finish_request(self, req: Request, status: RequestStatus) -> None:
        """finish_requests for one unfinished request: it leaves its queue
        and finishes; with a KV connector, one whose asynchronous load is not
        reported yet keeps its blocks until it is."""
        delay = False
        if req.status is RUNNING:
            running = self._running
            del running[bisect_left(running, req.running_seq, key=running_seq_of)]
        else:
            self._unqueue(req)
        if req.status is WAITING_FOR_REMOTE_KVS:
            delay = req.request_id not in self._loads_done
            self._loads_done.discard(req.request_id)
            self._loads_failed.discard(req.request_id)
        self._finish(req, status, delay)

    def _unqueue(self, req: Request) -> None:
        """Take a waiting request out of its queue (kv_holding_waiting or
        the waiting queue) and out of the deferred set."""
        if self._kv_holding_waiting and req in self._kv_holding_waiting:
            self._kv_holding_waiting.remove(req)
        else:
            self._waiting.remove(req)
        if self._deferred:
            self._deferred.discard(req.request_id)

    def _finish(self, req: Request, status: RequestStatus, delay: bool = False) -> None:
        if self._live_sessions and req.spec.resumable:
            self._forget_session(req)
        req.status = status
        if self._connector and self._finish_keeps_blocks(req, status, delay):
            self._held[req.request_id] = req
        elif self._connector or self._hybrid:
            self._free_table(req)
        else:
            self._free_own_table(req)
        if req.mm_inputs:
            self._release_encoder(req)
        if self._deferred:
            self._deferred.discard(req.request_id)
        if req.spec.structured_output:
            self._live_grammars -= 1
        del self._requests[req.request_id]
        self._finished[req.request_id] = req

    def _preempt(self, req: Request, drop_stale_output: bool = False) -> None:
        """Free every block, forget the computed tokens and the drafts; the
        tokens in flight become stale output (kept or, with
        ``drop_stale_output``, dropped on their update), the placeholders go."""
        req.status = PREEMPTED
        if req.mm_inputs:
            self._release_encoder(req)
        req.spec_token_ids = NO_TOKENS
        req.drop_stale_output = drop_stale_output or (req.drop_stale_output and req.num_stale_output_tokens > 0)
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        if self._connector or self._hybrid:
            self._inflight_prefills.discard(req.request_id)
            self._free_table(req)
        else:
            self._free_own_table(req)
        req.num_cached_blocks = 0
        if self._caching and not self._hybrid:
            req.next_full_at = self._bs
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        if self._log_stats:
            self._st_num_preemptions += 1
        self._waiting.push_front(req)
        self._preempted.add(req.request_id)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        check_reset(self._inflight, self._config)
        if reset_running_requests and self._connector:
            self._check_kv_reset()
        if reset_running_requests and self._streaming_queues:
            check_kv_reset(self._session_blocks_kept())  # impl/sessions.py
        if reset_running_requests:
            running = self._running
            while running:
                # the output of a step in flight is dropped for these
                self._preempt(running.pop(), drop_stale_output=True)
        if self._fq.size != self._config.num_blocks - 1:
            return False
        self._px.clear()
        if self._px.events is not None:
            self._px.events.append(AllBlocksCleared())
        if self._log_stats:
            self._st_reset = True
        return True

    def take_kv_events(self) -> tuple[KVCacheEvent, ...]:
        """The KV cache events since the last take (spec/kv_events.py); ()
        with ``enable_kv_cache_events`` off."""
        events = self._px.events
        if not events:
            return ()
        self._px.events = []
        return tuple(events)

    def _release_encoder(self, req: Request) -> None:
        encoder_cache = self._encoder_cache
        if encoder_cache is not None:
            encoder_cache.release_all(req.request_id, [m.identifier for m in req.mm_inputs])

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan:
        """The running phase, the waiting phase (only in a step that
        preempted nobody, and not under PAUSED_ALL), the plan."""
        check_schedule(self._inflight, self._config)
        if self._gated is not (
            self._config_gated or self._live_grammars > 0 or self._pause is not PauseState.UNPAUSED
            or self._live_sessions > 0
        ):
            self._choose_path()
        self._step += 1
        if self._cached_now:
            self._cached_now.clear()  # kv_cache_manager.new_step_starts()
        state = self._start_step()
        self._schedule_running(state)
        if not state.preempted and self._pause is not PauseState.PAUSED_ALL:
            self._schedule_waiting(state)
        if self._stagger:  # V2's decode throttle: every entry that samples (not a victim given back)
            eligible = self._step + self._stagger
            for req in state.scheduled:
                if not req.is_prefill_chunk:
                    req.next_decode_eligible_step = eligible
        plan = self._assemble_plan(state)
        if self._log_stats and self._async and self._num_spec_tokens:
            self._stats_note_plan(plan)
        return plan

    def _start_step(self) -> StepState:
        """The step's budget (none under PAUSED_ALL), the long-prefill
        threshold (none for a request alone in the scheduler) and whether the
        prefill cadence holds prefills this step."""
        config = self._config
        # the input budget less the next request's draft slots (StepState)
        budget = config.max_num_batched_tokens - self._draft_slots
        if self._pause is PauseState.PAUSED_ALL:
            budget = 0
        threshold = config.long_prefill_token_threshold
        if len(self._running) + len(self._waiting) + len(self._kv_holding_waiting) <= 1:
            threshold = 0
        state = StepState(budget, threshold, config.max_num_encoder_input_tokens)
        state.drafts_needed = not self._can_skip_drafts
        interval = self._interval
        state.defer_prefill = (
            interval > 1
            and not self._capacity_bound
            and (self._num_executed_steps + 1) - self._last_prefill_step < interval
            and any(not r.is_prefill_chunk for r in self._running)
        )
        return state

    def _assemble_plan(self, state: StepState) -> StepPlan:
        """The plan: its entries, the ids preempted and finished since the
        last plan, the encoder inputs freed and the connector's loads; the
        cadence's counters; the plan joins those in flight."""
        if self._priority:
            self._victims.compact(self._running)
        if state.entries:
            self._num_executed_steps += 1
        if self._interval > 1 and (state.prefill_scheduled or state.prefill_admitted):
            self._last_prefill_step = self._num_executed_steps
        kv_loads: tuple[KVLoad, ...] = ()
        if self._connector:
            self._after_schedule_kv(state.scheduled)
            kv_loads = tuple(self._pending_loads)
            self._pending_loads = []
        encoder_cache = self._encoder_cache
        plan = StepPlan(
            step=self._step,
            scheduled=tuple(state.entries),
            preempted_ids=tuple(sorted(self._preempted)),
            finished_ids=tuple(sorted(self._finished)),
            freed_encoder_inputs=encoder_cache.take_freed() if encoder_cache is not None else (),
            kv_loads=kv_loads,
            skip_drafts=not state.drafts_needed,
        )
        self._preempted = set()
        self._finished = {}
        self._inflight.append(plan)
        self._inflight_reqs.append(state.scheduled)
        self._inflight_codes.append(state.codes)
        return plan

    def _unknown_tokens(self, n: int) -> tuple[int, ...]:
        """(-1,) * n, one tuple per n."""
        unknown = self._unknown.get(n)
        if unknown is None:
            unknown = self._unknown[n] = (-1,) * n
        return unknown

    # ------------------------------------------------------------------ view

    def view(self) -> SchedulerView:
        block_keys, cache_index = self._px.views()
        kv = KVView(
            num_blocks=self._config.num_blocks,
            block_size=self._bs,
            ref_cnt=tuple(self._ref),
            free_queue=tuple(self._fq.to_list()),
            block_keys=block_keys,
            cache_index=cache_index,
            partial_index={k: tuple(v) for k, v in self._px.partial_index.items()},
        )
        # the prefill cadence reads is_prefill_chunk: reported with it on
        cadence = self._interval > 1
        requests = {rid: r.view(cadence, self._hybrid) for rid, r in self._requests.items()}
        gates: dict[str, Any] = {
            "num_executed_steps": self._num_executed_steps,
            "last_prefill_step": self._last_prefill_step,
            "prefill_capacity_bound": self._capacity_bound,
        } if cadence else {}
        encoder_cache = self._encoder_cache
        if encoder_cache is not None:
            gates["encoder_cache"] = dict(encoder_cache.entries)
            gates["encoder_cache_free"] = encoder_cache.free
        finished = {rid: r.view() for rid, r in self._finished.items()}
        waiting = tuple(r.request_id for r in self._waiting.order())
        if self._connector:
            gates.update(self._connector_view())
            waiting = tuple(r.request_id for r in self._kv_holding_order()) + waiting
            for rid, v in finished.items():
                if v.block_ids:  # kept for the connector: reported without them
                    finished[rid] = self._finished_view_without_blocks(v)
        elif self._kv_holding_waiting:  # sessions holding their blocks (impl/sessions.py)
            waiting = tuple(r.request_id for r in self._kv_holding_order()) + waiting
        return SchedulerView(
            config=self._config,
            step=self._step,
            requests=requests,
            waiting=waiting,
            running=tuple(r.request_id for r in self._running),
            kv=kv,
            finished=finished,
            preempted_since_plan=tuple(sorted(self._preempted)),
            pause_state=self._pause,
            **gates,
        )

    # ------------------------------------------------------------------ copies

    def clone(self) -> "ImplScheduler":
        """An independent scheduler in the same state, several times faster
        than a pickle round trip (the model checker replays every transition
        of a state on its own copy). Immutable values are shared."""
        new: ImplScheduler = _new(type(self))
        d = new.__dict__
        d.update(self.__dict__)
        remap: dict[int, Request] = {}
        for reqs in (self._requests.values(), self._finished.values(), self._held.values(), *self._inflight_reqs):
            for r in reqs:
                if id(r) not in remap:
                    remap[id(r)] = r.copy()
        d["_requests"] = {rid: remap[id(r)] for rid, r in self._requests.items()}
        d["_finished"] = {rid: remap[id(r)] for rid, r in self._finished.items()}
        d["_running"] = [remap[id(r)] for r in self._running]
        d["_inflight"] = self._inflight[:]
        d["_inflight_reqs"] = [[remap[id(r)] for r in out] for out in self._inflight_reqs]
        d["_inflight_codes"] = self._inflight_codes[:]  # (lists never changed once made)
        d["_waiting"] = self._waiting.copy(remap)
        d["_victims"] = self._victims.copy(remap)
        d["_ref"] = self._ref[:]
        d["_fq"] = self._fq.copy()
        d["_px"] = self._px.copy()
        d["_cached_now"] = set(self._cached_now)
        d["_preempted"] = self._preempted.copy()
        d["_deferred"] = self._deferred.copy()
        d["_grammar_errors"] = self._grammar_errors.copy()
        d["_mm_lengths"] = self._mm_lengths.copy()
        if self._encoder_cache is not None:
            d["_encoder_cache"] = self._encoder_cache.copy()
        if self._connector:
            self._clone_connector(d, remap)
        elif self._kv_holding_waiting:
            d["_kv_holding_waiting"] = [remap[id(r)] for r in self._kv_holding_waiting]
        if self._streaming_queues:
            self._clone_sessions(d, remap)
        return new

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, Any]:
        """Sizes of the internal structures (for tests and benchmarks)."""
        return {
            "requests": len(self._requests),
            "waiting": len(self._waiting),
            "running": len(self._running),
            "free_blocks": self._fq.size,
            "interned_keys": len(self._px.intern),
        }


__all__ = ["ImplScheduler", "BlockKey", "max_hit_blocks", "NEVER"]
