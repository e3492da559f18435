"""ImplScheduler: the spec's observable behaviour, at production speed.

Same decisions as spec.scheduler.SpecScheduler (plans, views, errors), written
independently: it imports only the interface types and the protocol boundary
(spec/protocol.py), never the spec's scheduling logic. Where the time goes and
what keeps it small:

- A decode step costs O(1) per running request. Each request carries
  ``cap`` (slots in its block table) and ``next_full`` (the token count at
  which its next block becomes full and gets a prefix-cache key); only a
  request whose step crosses one of them leaves the fast path.
- The block table is handed to plans as a tuple that is cached on the request
  and rebuilt only when the table changes.
- Plan entries are frozen dataclasses; building one through ``__init__``
  (``object.__setattr__`` per field) costs three times more than filling its
  ``__dict__`` directly, which yields an equal object.
- ``update`` validates and applies in one pass over the plan, and undoes the
  appended tokens if it finds bad input; the exact error is then produced by
  the spec's own boundary check (spec/protocol.py, check_sampled), so callers
  see the same exception.
- The KV pool: free queue as a linked list over arrays (impl/free_queue.py),
  interned chained prefix keys (impl/prefix_index.py), counters, no scans.
- Waiting queues and PRIORITY victims: impl/queues.py.
- Async scheduling and speculative decoding take the general path
  (``_schedule_general``, ``_update_general``): the spec's rules for
  placeholders, drafts, stale output and padded decodes, with the same
  structures; the synchronous path without drafts is the one above. Its
  RUNNING loop takes a steady decode (one step in flight with its
  placeholders, or sync drafts after the last known token; a block to
  allocate or key is done in place) in a few lines before the general
  rules, in a plain for loop while requests are steady. Beside each plan in
  flight it keeps one int per entry (tokens scheduled, most tokens sampled),
  so update() and its result check never read the plan entries.
- The admission gates (docs/impl.md, "The admission gates"): the watermark
  and LoRA decide admissions on every path; the prefill cadence, the
  encoder budget and cache, pause states and structured outputs take the
  gated path (``_schedule_gated``, ``_update_general`` with its gate rules),
  which a config with the cadence or an encoder starts on and a pause state
  or a request with a grammar moves to. Gate-free configs never reach it.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import AbstractSet, Any, Union

from schedspec.spec.interface import (
    BlockKey,
    KVLoad,
    KVView,
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

from schedspec.spec.protocol import (
    check_abort,
    check_add,
    check_config,
    check_gate_config,
    check_grammar_ready,
    check_mm_lengths,
    check_pause_state,
    check_reset,
    check_sampled,
    check_schedule,
    check_update,
    is_token_ids,
)

from schedspec.impl.connector import ConnectorMixin
from schedspec.impl.encoder_cache import EncoderCache
from schedspec.impl.free_queue import FreeBlockQueue
from schedspec.impl.kv_groups import GroupsMixin, Layout
from schedspec.impl.prefix_index import KeyNode, Parent, PrefixIndex
from schedspec.impl.queues import FcfsWaiting, PriorityWaiting, VictimHeap

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_ABORTED = RequestStatus.FINISHED_ABORTED
_ERROR = RequestStatus.FINISHED_ERROR
_GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
_PAUSED_NEW = PauseState.PAUSED_NEW
_PAUSED_ALL = PauseState.PAUSED_ALL
_K_NEW = ScheduleKind.NEW
_K_RESUMED = ScheduleKind.RESUMED
_K_RUNNING = ScheduleKind.RUNNING

_NEVER = 1 << 62  # "no next full block" when prefix caching is off
_new = object.__new__
_SR = ScheduledRequest
_NO_DRAFTS: tuple[int, ...] = ()
_NO_MARKS: dict[int, str] = {}  # never written to
_NO_REJECTS: frozenset[int] = frozenset()
_NO_FAILED: frozenset[str] = frozenset()
_NO_GROUPS: tuple[tuple[int, ...], ...] = ()


def _entry(
    rid: str,
    kind: ScheduleKind,
    c: int,
    n: int,
    nt: int,
    block_ids: tuple[int, ...],
    token_ids: tuple[int, ...],
) -> ScheduledRequest:
    """A plan entry, built by filling a fresh instance's ``__dict__`` in field
    order: equal (``==``, ``hash``, ``repr``, pickle) to one built through the
    dataclass constructor, at a third of its cost. schedule()'s decode fast
    path inlines the same code."""
    o = _new(_SR)
    d = o.__dict__
    d["request_id"] = rid
    d["kind"] = kind
    d["num_computed_tokens"] = c
    d["num_scheduled_tokens"] = n
    d["num_tokens"] = nt
    d["block_ids"] = block_ids
    d["token_ids"] = token_ids
    d["spec_token_ids"] = _NO_DRAFTS
    d["num_output_placeholders"] = 0
    d["encoder_inputs"] = _NO_DRAFTS
    d["num_invalid_spec_tokens"] = 0
    d["group_block_ids"] = _NO_GROUPS
    return o


def _run_seq(r: "_Req") -> int:
    return r.run_seq


class _Req:
    """One unfinished (or just finished) request."""

    # Slot order is memory order: the fields a decode step reads (schedule's
    # fast path, then update) come first, so they share two or three cache
    # lines; at thousands of running requests the step is bound by memory
    # traffic, not by instructions. The general path's per-step fields come
    # right after the synchronous path's.
    __slots__ = (
        # synchronous decode (schedule's fast path, then update)
        "num_computed",
        "num_tokens",
        "edge",
        "tail",
        "btuple",
        "rid",
        "status",
        "output",
        "end_at",
        "stop",
        # async scheduling and speculative decoding: the steady-decode cases
        # and update's per-entry work
        "ph",
        "drafts",
        "inflight",
        "pchunk",
        "prev_pchunk",
        "cap",
        "next_full",
        "stale",
        "max_end",
        # the rest
        "spec",
        "prompt",
        "plen",
        "blocks",
        "ncached",
        "npreempt",
        "salt",
        "priority",
        "arrival",
        "wseq",
        "run_seq",
        "drop_stale",
        # the admission gates
        "lora",
        "grammar",
        "rejects",
        "mm",
        "marks",
        # the KV connector: the sched_step_seq of the last step that
        # scheduled it (defer_block_free)
        "last_seq",
        # hybrid KV cache groups: the tables of groups 1.. (group 0's is
        # ``blocks``), how many leading blocks of each have a key, and the
        # shared-prefix junction of its last prefix lookup
        "gblocks",
        "gncached",
        "spb",
        # hybrid: the processed-token count from which a step may free
        # blocks out of a window or chunk (_NEVER for the plain layout), and
        # the group tables as the plan's tuple (cached; None after a change)
        "gskip",
        "gtuple",
    )

    def __init__(
        self,
        spec: RequestSpec,
        max_model_len: int,
        block_size: int,
        caching: bool,
        stop_sets: dict[frozenset[int], frozenset[int]],
    ) -> None:
        self.rid = spec.request_id
        self.spec = spec
        self.status = _WAITING
        self.prompt = spec.prompt_token_ids
        self.plen = len(self.prompt)
        self.output: list[int] = []
        # (last token,): a decode step's token_ids. update() stores the
        # result's own 1-tuple here, so a decode step allocates no tuple.
        self.tail: tuple[int, ...] = self.prompt[-1:]
        self.num_tokens = self.plen
        self.num_computed = 0
        self.blocks: list[int] = []
        self.btuple: tuple[int, ...] | None = ()
        self.cap = 0
        self.ncached = 0
        self.next_full = block_size if caching else _NEVER
        # The first computed-token count that leaves the decode fast path:
        # past the table's slots, or filling the next block to key.
        self.edge = 1
        self.npreempt = 0
        # the root of the block keys' chain: the salt, or the identity with
        # the LoRA adapter and the encoder inputs of block 0
        self.salt = spec.block_identity(block_size)
        self.priority = spec.priority
        self.arrival = spec.arrival
        stop = set(spec.stop_token_ids)
        if spec.eos_token_id is not None and not spec.ignore_eos:
            stop.add(spec.eos_token_id)
        # Shared among requests with equal stop sets (most have the same
        # one), so the per-token stop check reads a set that stays in cache.
        frozen = frozenset(stop)
        self.stop = stop_sets.setdefault(frozen, frozen)
        # A request is length-capped once it has max_tokens outputs or
        # max_model_len tokens in all.
        self.end_at = self.plen + min(spec.max_tokens, max_model_len - self.plen)
        self.wseq = -1
        self.run_seq = -1
        # vLLM's num_output_placeholders (output tokens in flight, counted in
        # num_computed), spec_token_ids (drafts for the next step; -1 = a
        # placeholder), num_in_flight_tokens (tokens scheduled in plans not
        # yet updated), num_stale_output_tokens and drop_stale_output (the
        # in-flight share of a preempted request), is_prefill_chunk.
        self.ph = 0
        self.drafts: tuple[int, ...] = ()
        self.inflight = 0
        self.stale = 0
        self.drop_stale = False
        self.pchunk = False
        # prompt + max_tokens (not capped by max_model_len): the max_tokens
        # skip of a request whose steps in flight surely finish it
        self.max_end = self.plen + spec.max_tokens
        self.prev_pchunk = False  # is_prefill_chunk before this step's plan
        # The admission gates: the LoRA adapter (0: none); the grammar (None
        # while it compiles, then whether it compiled) and the tokens it
        # refuses; the encoder inputs and, for the block keys, the block
        # indices (>= 1) where the identity changes, with the new identity.
        self.lora = spec.lora_id
        self.grammar: bool | None = None
        self.rejects: frozenset[int] = frozenset(spec.grammar_rejects) if spec.grammar_rejects else _NO_REJECTS
        self.mm = spec.mm_inputs
        marks = _NO_MARKS  # shared while empty: one allocation less per request
        for m in spec.mm_inputs:
            i = m.offset // block_size
            if i > 0:
                if marks is _NO_MARKS:
                    marks = {}
                marks[i] = spec.block_identity((i + 1) * block_size)
        self.marks = marks
        self.last_seq = 0
        self.gblocks: list[list[int]] = []
        self.gncached: list[int] = []
        self.spb = 0
        self.gskip = _NEVER
        self.gtuple: tuple[tuple[int, ...], ...] | None = _NO_GROUPS

    def copy(self) -> "_Req":
        """An independent copy (the lists copied, immutable values shared)."""
        n: _Req = _new(_Req)
        n.rid = self.rid
        n.spec = self.spec
        n.status = self.status
        n.prompt = self.prompt
        n.plen = self.plen
        n.output = self.output[:]
        n.tail = self.tail
        n.num_tokens = self.num_tokens
        n.num_computed = self.num_computed
        n.blocks = self.blocks[:]
        n.btuple = self.btuple
        n.cap = self.cap
        n.ncached = self.ncached
        n.next_full = self.next_full
        n.edge = self.edge
        n.npreempt = self.npreempt
        n.salt = self.salt
        n.priority = self.priority
        n.arrival = self.arrival
        n.stop = self.stop
        n.end_at = self.end_at
        n.wseq = self.wseq
        n.run_seq = self.run_seq
        n.ph = self.ph
        n.drafts = self.drafts
        n.inflight = self.inflight
        n.stale = self.stale
        n.drop_stale = self.drop_stale
        n.pchunk = self.pchunk
        n.max_end = self.max_end
        n.prev_pchunk = self.prev_pchunk
        n.lora = self.lora
        n.grammar = self.grammar
        n.rejects = self.rejects
        n.mm = self.mm
        n.marks = self.marks
        n.last_seq = self.last_seq
        n.gblocks = [t[:] for t in self.gblocks]
        n.gncached = self.gncached[:]
        n.spb = self.spb
        n.gskip = self.gskip
        n.gtuple = self.gtuple
        return n

    @property
    def is_running(self) -> bool:
        return self.status is _RUNNING

    def toks(self, a: int, b: int) -> tuple[int, ...]:
        """Tokens at positions a .. b - 1 (prompt then output)."""
        p = self.plen
        if b <= p:
            return self.prompt[a:b]
        if a >= p:
            return tuple(self.output[a - p : b - p])
        return self.prompt[a:] + tuple(self.output[: b - p])

    def block_tuple(self) -> tuple[int, ...]:
        bt = self.btuple
        if bt is None:
            bt = self.btuple = tuple(self.blocks)
        return bt

    def view(self, cadence: bool = False, groups: bool = False) -> RequestView:
        return RequestView.of(
            self.spec,
            status=self.status,
            output_token_ids=tuple(self.output),
            num_computed_tokens=self.num_computed,
            block_ids=tuple(self.blocks),
            num_preemptions=self.npreempt,
            num_output_placeholders=self.ph,
            spec_token_ids=self.drafts,
            is_prefill_chunk=cadence and self.pchunk,
            group_block_ids=(
                (tuple(self.blocks), *(tuple(t) for t in self.gblocks))
                if groups and not self.status.is_finished else _NO_GROUPS
            ),
        )

    def seq(self, a: int, b: int, drafts: tuple[int, ...]) -> tuple[int, ...]:
        """Positions a .. b - 1 of a step's sequence: the known tokens, then
        -1 for each output placeholder, then the step's drafts."""
        nt = self.num_tokens
        if b <= nt:
            return self.toks(a, b)
        head = self.toks(a, nt) if a < nt else ()
        tail = (-1,) * self.ph + drafts
        return head + tail[max(a - nt, 0) : b - nt]


Waiting = Union[FcfsWaiting[_Req], PriorityWaiting[_Req]]


class ImplScheduler(ConnectorMixin["_Req"], GroupsMixin["_Req"]):
    """Implements spec.interface.Scheduler, with the optional
    ``set_pause_state`` and ``grammar_ready``."""

    #: The KV features implemented, by capability name: the KV connector,
    #: and hybrid KV cache groups (full attention, sliding window, chunked
    #: local; impl/kv_groups.py).
    KV: tuple[str, ...] = ("kv_connector", "hybrid_kv")

    #: The admission gates implemented, by capability name
    #: (spec/protocol.py, gates_of_config).
    GATES: tuple[str, ...] = ("watermark", "prefill_cadence", "pause", "lora", "structured_output", "encoder")

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config = check_config(config)
        check_gate_config(config, self.GATES)
        self._bs = config.block_size
        self._mml = config.max_model_len
        self._caching = config.enable_prefix_caching
        self._priority = config.policy == Policy.PRIORITY
        nb = config.num_blocks
        # KV pool
        self._ref: list[int] = [0] * nb
        self._fq = FreeBlockQueue(nb)
        self._px = PrefixIndex(nb)
        # requests and queues
        self._requests: dict[str, _Req] = {}
        self._waiting: Waiting = PriorityWaiting() if self._priority else FcfsWaiting()
        self._running: list[_Req] = []
        self._victims: VictimHeap[_Req] = VictimHeap()
        self._run_seq = 0
        self._finished: dict[str, _Req] = {}
        self._preempted: set[str] = set()
        self._step = 0
        # The plans awaiting update(), oldest first, and the requests of
        # each plan's entries (parallel lists): at most one plan at rest, two
        # for a moment with async scheduling.
        self._inflight: list[StepPlan] = []
        self._inflight_reqs: list[list[_Req]] = []
        # General path: per plan in flight, one int per entry (parallel to
        # its requests): num_scheduled_tokens * (k + 2) + the most tokens the
        # entry may sample (1 + its drafts; 0 for a partial prefill chunk),
        # so that update() reads neither the plan entries nor their dicts.
        self._inflight_codes: list[list[int]] = []
        # async scheduling or speculative decoding: the general paths
        self._general = config.async_scheduling or config.num_speculative_tokens > 0
        self._k = config.num_speculative_tokens
        self._async = config.async_scheduling
        self._sync_plain = not config.async_scheduling and not config.num_speculative_tokens
        # n -> (-1,) * n: the token ids of a step wholly past the known tokens
        self._unknown: dict[int, tuple[int, ...]] = {}
        # the k placeholder drafts of a request with async scheduling: one
        # tuple, so the steady-decode test is an identity check
        self._placeholder_drafts: tuple[int, ...] = (-1,) * self._k
        # One frozenset per distinct stop set, shared by the requests that
        # have it (a cache of immutable values: clones share it too).
        self._stop_sets: dict[frozenset[int], frozenset[int]] = {}
        # The admission gates. The watermark and LoRA are on every path (they
        # decide admissions only). The prefill cadence and the encoder take
        # the gated path (_schedule_gated, and _update_general's gate rules)
        # for good; a pause state other than UNPAUSED or an unfinished
        # request with a grammar holds a scheduler on it, taken (and left) at
        # schedule() (_choose_path).
        # hybrid KV cache groups (impl/kv_groups.py): the gated path too
        self._hyb = config.is_hybrid
        self._layout = Layout(config)
        self._config_gated = (
            config.prefill_schedule_interval > 1 or config.has_encoder or config.kv_connector or self._hyb
        )
        self._gated = self._config_gated
        self._base_general = self._general
        if self._gated:
            self._general = True
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
        self._enc: EncoderCache | None = EncoderCache(config.encoder_cache_size) if config.has_encoder else None
        self._mm_lengths: dict[str, int] = {}
        # the KV connector (impl/connector.py); a config with one takes the gated path
        self._init_connector(config)

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
        req = _Req(request, self._mml, self._bs, self._caching, self._stop_sets)
        if self._hyb:
            n = len(self._layout.groups) - 1
            req.gblocks = [[] for _ in range(n)]
            req.gncached = [0] * n
            req.gskip = 0  # its first step asks the coordinator
            req.gtuple = None
        if request.structured_output:
            # it waits for its grammar, passed over until grammar_ready
            req.status = _GRAMMAR
            self._deferred.add(request.request_id)
            self._live_grammars += 1
        self._requests[request.request_id] = req
        self._waiting.push_back(req)

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
            reported=req is not None and req.grammar is not None,
        )
        assert req is not None
        req.grammar = ok

    def abort(self, request_id: str) -> None:
        req = check_abort(request_id, self._requests)
        self._finish_request(req, _ABORTED)

    def _finish_request(self, req: _Req, status: RequestStatus) -> None:
        """finish_requests for one unfinished request: it leaves its queue
        and finishes; with a KV connector, one whose asynchronous load is not
        reported yet keeps its blocks until it is."""
        delay = False
        if req.status is _RUNNING:
            running = self._running
            del running[bisect_left(running, req.run_seq, key=_run_seq)]
        else:
            self._unqueue(req)
        if req.status is _REMOTE:
            delay = req.rid not in self._loads_done
            self._loads_done.discard(req.rid)
            self._loads_failed.discard(req.rid)
        self._finish(req, status, delay)

    def _unqueue(self, req: _Req) -> None:
        """Take a waiting request out of its queue (kv_holding_waiting or
        the waiting queue)."""
        if self._kvh and req in self._kvh:
            self._kvh.remove(req)
        else:
            self._waiting.remove(req)

    def _free_own_table(self, req: _Req) -> None:
        """The plain layout without a connector: free the request's blocks
        now (tail first, kv_cache_manager.free) and leave it an empty table."""
        self._free(req.blocks)
        req.blocks = []
        req.btuple = ()
        req.cap = 0

    def _finish(self, req: _Req, status: RequestStatus, delay: bool = False) -> None:
        req.status = status
        if self._hyb and not self._conn:
            self._free_table(req)
        elif self._conn:
            if self._finish_keeps_blocks(req, status, delay):
                self._held[req.rid] = req
            else:
                self._free_table(req)
        else:
            self._free_own_table(req)
        if req.mm:
            self._release_encoder(req)
        if self._deferred:
            self._deferred.discard(req.rid)
        if req.spec.structured_output:
            self._live_grammars -= 1
        del self._requests[req.rid]
        self._finished[req.rid] = req

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        check_reset(self._inflight, self._config)
        if reset_running_requests and self._conn:
            self._check_kv_reset()
        if reset_running_requests:
            running = self._running
            while running:
                # the output of a step in flight is dropped for these
                self._preempt(running.pop(), drop_stale=True)
        if self._fq.size != self._config.num_blocks - 1:
            return False
        self._px.clear()
        return True

    # ------------------------------------------------------------------ KV

    def _free(self, table: list[int]) -> None:
        """Release a block table, tail first: unkeyed blocks to the head of the
        free queue, keyed ones to the tail."""
        if not table:
            return
        ref = self._ref
        node_of = self._px.block_node
        front: list[int] = []
        back: list[int] = []
        for b in reversed(table):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if node_of[b] is None:
                    front.append(b)
                else:
                    back.append(b)
        self._fq.prepend(front)
        self._fq.append(back)

    def _allocate(self, k: int) -> list[int]:
        taken = self._fq.popleft_n(k)
        ref = self._ref
        px = self._px
        node_of = px.block_node
        for b in taken:
            if node_of[b] is not None:
                px.evict(b)
            ref[b] = 1
        return taken

    def _register(self, req: _Req, upto: int) -> None:
        """Give keys to the blocks of ``req`` that are full once ``upto`` tokens
        are computed (requires prefix caching). Both callers (_grow and
        _admit_alloc) set ``req.edge`` from the new ``next_full`` afterwards."""
        if self._hyb:
            self._g_cache(req, upto)
            return
        bs = self._bs
        num_full = upto // bs
        i = req.ncached
        if num_full <= i:
            return
        px = self._px
        blocks = req.blocks
        parent: Parent
        if i == 0:
            parent = req.salt
        else:
            node = px.block_node[blocks[i - 1]]
            assert node is not None
            parent = node
        # each full block's own tokens: prompt slices, then output slices
        plen = req.plen
        a = i * bs
        end = num_full * bs
        if num_full == i + 1:  # one block (a decode step)
            chunks = [req.toks(a, end)]
        elif end <= plen:
            prompt = req.prompt
            chunks = [prompt[x : x + bs] for x in range(a, end, bs)]
        elif a >= plen:
            output = req.output
            chunks = [tuple(output[x : x + bs]) for x in range(a - plen, end - plen, bs)]
        else:
            toks = req.toks
            chunks = [toks(x, x + bs) for x in range(a, end, bs)]
        if req.marks:
            px.register_marked(blocks, i, parent, chunks, req.marks)
        else:
            px.register_chain(blocks, i, parent, chunks)
        req.ncached = num_full
        req.next_full = (num_full + 1) * bs

    def _grow(self, req: _Req, end: int) -> bool:
        """Slots for a running request to reach ``end`` computed tokens, and
        keys for the blocks that fill up. False (and nothing changed) when the
        pool is short."""
        bs = self._bs
        blocks = req.blocks
        need = -(-end // bs) - len(blocks)
        if need > 0:
            fq = self._fq
            if need > fq.size:
                return False
            if need == 1:  # a decode step crossing into a new block
                nxt = fq.nxt
                head = fq.head
                b = nxt[head]
                x = nxt[b]
                nxt[head] = x
                fq.prv[x] = head
                fq.size -= 1
                if self._px.block_node[b] is not None:
                    self._px.evict(b)
                self._ref[b] = 1
                blocks.append(b)
            else:
                blocks.extend(self._allocate(need))
            req.cap = len(blocks) * bs
            req.btuple = None
        if end >= req.next_full:  # never when prefix caching is off
            self._register(req, end)
        req.edge = min(req.cap + 1, req.next_full)
        return True

    def _find_hit(self, req: _Req) -> list[int]:
        if not self._caching:
            return []
        bs = self._bs
        lookup = self._px.lookup
        hit: list[int] = []
        parent: Parent = req.salt
        marks = req.marks
        for i in range(max_hit_blocks(req.num_tokens, bs)):
            if marks and i in marks:
                assert isinstance(parent, KeyNode)
                parent = (parent, marks[i])
            node = lookup(parent, req.toks(i * bs, (i + 1) * bs))
            if node is None:
                break
            hit.append(node.holders[0])
            parent = node
        return hit

    def _g_grow_running(self, req: _Req, end: int) -> bool:
        """allocate_slots for a running request of a hybrid layout: the
        blocks out of a sliding window freed first (processed tokens), even
        when the allocation then fails; the count summed over the groups."""
        c = req.num_computed
        mml = self._mml
        target = end if end < mml else mml
        # each part only where it may change something (req.gskip, req.cap,
        # req.next_full: below them it is a no-op)
        processed = max(0, min(c, mml) - req.inflight)
        if processed >= req.gskip:
            self._g_remove_skipped(req, processed)
        if target > req.cap:
            if self._g_need(req, target, None, c) > self._fq.size:
                return False
            if self._g_grow(req, target):
                req.btuple = None
            req.cap = self._g_slots(req)
        upto = min(end, req.num_tokens)
        if upto >= req.next_full:
            self._g_cache(req, upto)
        return True

    def _g_admit_alloc(
        self, req: _Req, hit: list[list[int]], n: int, wm: int, computed: int,
        load_async: bool = False, reserved: int = 0,
    ) -> bool:
        """allocate_slots for an admission of a hybrid layout (the spec's
        _allocate_admission): the full-sequence gate with the sliding-window
        admission caps, the skipped blocks of a promoted load freed, the
        count summed over the groups, the hit then the external tokens'
        blocks, then this step's."""
        bs = self._bs
        num_hit_tokens = len(hit[0]) * bs if hit else 0
        num_external = 0 if req.blocks else computed - num_hit_tokens
        if self._config.scheduler_reserve_full_isl:
            full = min(req.num_tokens, self._mml)
            if self._g_need(req, full, hit, computed, True) + wm > self._fq.size:
                return False
        self._g_remove_skipped(req, max(0, computed - req.inflight))
        target = min(computed + n, self._mml)
        if self._g_need(req, target, hit, computed) + wm + reserved > self._fq.size:
            return False
        if any(hit) or num_external > 0:
            self._g_take_hit(req, hit, num_hit_tokens, num_external)
        self._g_grow(req, target)
        if not load_async:
            self._g_cache(req, min(computed + n, req.num_tokens))
        req.cap = self._g_slots(req)
        req.btuple = None
        return True

    def _admit_alloc(
        self, req: _Req, hit: list[int], n: int, wm: int = 0,
        computed: int = -1, load_async: bool = False, reserved: int = 0,
    ) -> bool:
        """Blocks for an admission past its prefix hit; ``wm`` blocks (the
        watermark) must stay free besides. With a KV connector: ``computed``
        tokens counted computed before the step (the hit plus the external
        tokens, whose blocks come right after the hit's; or a promoted load's,
        whose blocks the request holds), an asynchronous load (``load_async``:
        nothing cached yet) and the blocks it leaves free for the in-flight
        prefills (``reserved``)."""
        bs = self._bs
        ref = self._ref
        free = self._fq.size - wm
        nhit = len(hit)
        held = len(req.blocks)  # a promoted load's table (then no hit)
        evictable = 0
        for b in hit:
            if ref[b] == 0:
                evictable += 1
        if self._config.scheduler_reserve_full_isl:
            full = min(req.num_tokens, self._mml)
            if max(-(-full // bs) - nhit - held, 0) + evictable > free:
                return False
        if computed < 0:
            computed = nhit * bs
        target = min(computed + n, self._mml)
        need = max(-(-target // bs) - nhit - held, 0)
        if need + evictable + reserved > free:
            return False
        fq = self._fq
        for b in hit:
            if ref[b] == 0:
                fq.remove(b)
            ref[b] += 1
        blocks = req.blocks if held else list(hit)
        if need:
            blocks.extend(self._allocate(need))
        req.blocks = blocks
        req.btuple = None
        req.cap = len(blocks) * bs
        if not held:
            req.ncached = nhit
            if self._caching:
                req.next_full = (nhit + 1) * bs
        if self._caching and not load_async:
            self._register(req, min(computed + n, req.num_tokens))
        req.edge = min(req.cap + 1, req.next_full)
        return True

    def _preempt(self, req: _Req, drop_stale: bool = False) -> None:
        """Free every block, forget the computed tokens and the drafts; the
        tokens in flight become stale output (kept or, with ``drop_stale``,
        dropped on their update), the placeholders go."""
        req.status = _PREEMPTED
        if req.mm:
            self._release_encoder(req)
        req.drafts = ()
        req.drop_stale = drop_stale or (req.drop_stale and req.stale > 0)
        req.stale = req.inflight
        req.ph = 0
        if self._conn or self._hyb:
            self._inflight_prefills.discard(req.rid)
            self._free_table(req)
        else:
            self._free_own_table(req)
        req.ncached = 0
        if self._caching and not self._hyb:
            req.next_full = self._bs
        req.edge = 1
        req.num_computed = 0
        req.npreempt += 1
        self._waiting.push_front(req)
        self._preempted.add(req.rid)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan:
        check_schedule(self._inflight, self._config)
        if self._gated is not (
            self._config_gated or self._live_grammars > 0 or self._pause is not PauseState.UNPAUSED
        ):
            self._choose_path()
        if self._gated:
            return self._schedule_gated()
        if self._general:
            return self._schedule_general()
        cfg = self._config
        self._step += 1
        budget = cfg.max_num_batched_tokens
        running = self._running
        waiting = self._waiting
        thr = cfg.long_prefill_token_threshold
        if len(running) + len(waiting) <= 1:
            thr = 0
        mml = self._mml
        # Plan entries and their requests, in scheduling order (parallel lists).
        ents: list[ScheduledRequest] = []
        out: list[_Req] = []
        ents_append = ents.append
        out_append = out.append
        k_running = _K_RUNNING
        new = _new
        sr = _SR
        no_drafts = _NO_DRAFTS

        # Phase 1: running requests, in order. The common case (nobody needs
        # preempting) is this plain loop; at the first request that cannot get
        # its blocks, the general loop (_schedule_running_slow) takes over.
        slow_req: _Req | None = None
        for req in running:
            if budget <= 0:
                break
            c = req.num_computed
            nt = req.num_tokens
            n = nt - c
            if n == 1:  # decoding: every cap leaves n == 1 (nt <= mml - 1)
                e = nt
                tt: tuple[int, ...] = req.tail
            else:
                if 0 < thr < n:
                    n = thr
                if n > budget:
                    n = budget
                if n > mml - c - 1:
                    n = mml - c - 1
                if n <= 0:
                    continue  # skipped, not a stop
                e = c + n
                tt = req.toks(c, e)
            if e >= req.edge and not self._grow(req, e):
                slow_req = req
                break
            o = new(sr)
            d = o.__dict__
            d["request_id"] = req.rid
            d["kind"] = k_running
            d["num_computed_tokens"] = c
            d["num_scheduled_tokens"] = n
            d["num_tokens"] = nt
            bt = req.btuple
            d["block_ids"] = bt if bt is not None else req.block_tuple()
            d["token_ids"] = tt
            d["spec_token_ids"] = no_drafts
            d["num_output_placeholders"] = 0
            d["encoder_inputs"] = no_drafts
            d["num_invalid_spec_tokens"] = 0
            d["group_block_ids"] = _NO_GROUPS
            ents_append(o)
            out_append(req)
            req.num_computed = e
            budget -= n
        preempted_now = False
        if slow_req is not None:
            budget, preempted_now = self._schedule_running_slow(
                running.index(slow_req), budget, thr, ents, out
            )

        # Phase 2: admissions, only in a step that preempted nobody.
        if not preempted_now:
            max_seqs = cfg.max_num_seqs
            chunked = cfg.enable_chunked_prefill
            bs = self._bs
            max_loras = self._max_loras
            loras = {r.lora for r in running if r.lora} if max_loras else None
            skipped: list[_Req] = []
            while budget > 0 and len(waiting):
                if len(running) >= max_seqs:
                    break
                req = waiting.peek()
                if loras is not None and req.lora and len(loras) == max_loras and req.lora not in loras:
                    skipped.append(waiting.pop_head())  # it would exceed max_loras: passed over
                    continue
                hit = self._find_hit(req)
                hit_tokens = len(hit) * bs
                nt = req.num_tokens
                n = nt - hit_tokens
                if 0 < thr < n:
                    n = thr
                if n > budget:
                    if not chunked:
                        break
                    n = budget
                if not self._admit_alloc(req, hit, n, self._watermark if running else 0):
                    break
                waiting.pop_head()
                if loras is not None and req.lora:
                    loras.add(req.lora)
                kind = _K_NEW if req.status is _WAITING else _K_RESUMED
                req.status = _RUNNING
                self._run_seq += 1
                req.run_seq = self._run_seq
                running.append(req)
                if self._priority:
                    self._victims.push(req)
                e = hit_tokens + n
                ents_append(_entry(req.rid, kind, hit_tokens, n, nt, req.block_tuple(), req.toks(hit_tokens, e)))
                out_append(req)
                req.num_computed = e
                budget -= n
            for req in reversed(skipped):
                waiting.push_front(req)
        if self._priority:
            self._victims.compact(running)

        plan = StepPlan(
            step=self._step,
            scheduled=tuple(ents),
            preempted_ids=tuple(sorted(self._preempted)),
            finished_ids=tuple(sorted(self._finished)),
        )
        self._preempted = set()
        self._finished = {}
        self._inflight.append(plan)
        self._inflight_reqs.append(out)
        return plan

    def _schedule_running_slow(
        self, i: int, budget: int, thr: int, ents: list[ScheduledRequest], out: list[_Req]
    ) -> tuple[int, bool]:
        """The RUNNING loop from index ``i`` on, with preemption: while a
        request cannot get its blocks, preempt the victim (FCFS: the last
        running request; PRIORITY: the first with the largest (priority,
        arrival)), give back the budget of a victim already scheduled, retry.
        A request that preempts itself ends the loop (FCFS) or is skipped
        (PRIORITY). Returns the remaining budget and whether anyone was
        preempted."""
        running = self._running
        mml = self._mml
        priority = self._priority
        preempted = False
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed
            nt = req.num_tokens
            n = nt - c
            if 0 < thr < n:
                n = thr
            if n > budget:
                n = budget
            if n > mml - c - 1:
                n = mml - c - 1
            if n <= 0:
                i += 1
                continue
            e = c + n
            if e >= req.edge and not self._grow(req, e):
                allocated = False
                while True:
                    if priority:
                        victim = self._victims.top()
                        # running is in admission order, i.e. ascending run_seq
                        v = bisect_left(running, victim.run_seq, key=_run_seq)
                        del running[v]
                    else:
                        v = len(running) - 1
                        victim = running.pop()
                    if v < i:
                        i -= 1
                        # Scheduled already this step (unless it was skipped)?
                        # out holds running entries only, in running order.
                        j = bisect_left(out, victim.run_seq, key=_run_seq)
                        if j < len(out) and out[j] is victim:  # give its budget back
                            del out[j]
                            budget += ents.pop(j).num_scheduled_tokens
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                    if self._grow(req, e):
                        allocated = True
                        break
                if not allocated:
                    if priority:
                        continue  # it preempted itself; later requests may still fit
                    break
            ents.append(_entry(req.rid, _K_RUNNING, c, n, nt, req.block_tuple(), req.toks(c, e)))
            out.append(req)
            req.num_computed = e
            budget -= n
            i += 1
        return budget, preempted

    # ------------------------------------------------------------------ update

    def update(self, plan: StepPlan, result: StepResult) -> None:
        if self._general:
            if self._gated and self._sync_plain:
                self._update_sync_gated(plan, result)
            else:
                self._update_general(plan, result)
            return
        check_update(plan, self._inflight, result)
        sampled = result.sampled
        get = sampled.get
        out = self._inflight_reqs[0]
        others = 0  # entries that are not a live sampling step
        extra = 0  # tokens present for those entries
        stopped: list[_Req] = []
        bad = -1
        req: _Req | None = None
        try:
            for req in out:
                toks = get(req.rid)
                if req.status is not _RUNNING:  # aborted while the step ran
                    others += 1
                    if toks is not None:
                        extra += 1
                        if not is_token_ids(toks):
                            raise _Bad
                    continue
                nt = req.num_tokens
                if req.num_computed >= nt:  # this step samples
                    if toks.__class__ is not tuple:
                        raise _Bad
                    (t,) = toks
                    if t.__class__ is not int or t < 0:
                        raise _Bad
                    req.output.append(t)
                    nt += 1
                    req.num_tokens = nt
                    req.tail = toks
                    if nt >= req.end_at or t in req.stop:
                        stopped.append(req)
                else:
                    others += 1
                    if toks is not None:
                        extra += 1
                        if toks.__class__ is not tuple or len(toks) != 0:
                            raise _Bad
            if len(out) - others + extra != len(sampled) or result.draft_token_ids:
                # tokens for a request the plan did not schedule, or drafts
                # (which must then be empty tuples): the plain way decides
                bad = len(out)
        except (_Bad, ValueError):
            assert req is not None
            bad = out.index(req)
        if bad >= 0:
            self._rollback(plan, bad)
            check_sampled(plan, result, self._requests, self._config)  # raises the spec's error
            # Valid after all (e.g. an int subclass as a token): the plain way.
            stopped = self._append_slow(plan, result)
        if stopped:
            for r in stopped:
                self._finish(r, _STOPPED if r.tail[0] in r.stop else _LENGTH)
            self._running = [r for r in self._running if r.status is _RUNNING]
        del self._inflight[0]
        del self._inflight_reqs[0]

    def _rollback(self, plan: StepPlan, bad: int) -> None:
        """Undo the tokens the fast pass appended to the entries before
        position ``bad``."""
        for s, req in zip(plan.scheduled[:bad], self._inflight_reqs[0]):
            if req.status is _RUNNING and s.samples:
                req.output.pop()
                req.num_tokens -= 1
                req.tail = (req.output[-1],) if req.output else req.prompt[-1:]

    def _append_slow(self, plan: StepPlan, result: StepResult) -> list[_Req]:
        stopped: list[_Req] = []
        for s in plan.scheduled:
            req = self._requests.get(s.request_id)
            toks = result.sampled.get(s.request_id, ())
            if req is None or not toks:
                continue
            t = toks[0]
            req.output.append(t)
            req.num_tokens += 1
            req.tail = (t,)
            if req.num_tokens >= req.end_at or t in req.stop:
                stopped.append(req)
        return stopped

    # ------------------------------------------------------------------ general path

    def _grow_to(self, req: _Req, end: int) -> bool:
        """Slots for a running request to reach ``end`` computed tokens (drafts
        and placeholders included), and keys for the blocks its known tokens
        fill. False (and nothing changed) when the pool is short."""
        if self._hyb:
            return self._g_grow_running(req, end)
        bs = self._bs
        blocks = req.blocks
        need = -(-end // bs) - len(blocks)
        if need > 0:
            if need > self._fq.size:
                return False
            blocks.extend(self._allocate(need))
            req.cap = len(blocks) * bs
            req.btuple = None
        upto = min(end, req.num_tokens)
        if upto >= req.next_full:
            self._register(req, upto)
        req.edge = min(req.cap + 1, req.next_full)
        return True

    def _schedule_general(self) -> StepPlan:
        """schedule() with async scheduling or speculative decoding: the same
        two phases as the synchronous path, with the drafts in the chunk and
        the budget (``num_tokens_with_spec``), the output placeholders of the
        step in flight, the max_tokens skip, padded new decodes and the
        stale-output skip in the WAITING loop. Each entry is made as its
        request is scheduled, and the request advances at once (computed and
        in-flight tokens, is_prefill_chunk; with async scheduling a step that
        samples counts its output as placeholders and leaves k placeholder
        drafts: AsyncScheduler._update_after_schedule); a victim preempted
        later in the step gives its entry back and has that advance undone,
        so it leaves the step as the spec's, which advances only after the
        loops."""
        cfg = self._config
        self._step += 1
        budget = cfg.max_num_batched_tokens
        running = self._running
        waiting = self._waiting
        thr = cfg.long_prefill_token_threshold
        if len(running) + len(waiting) <= 1:
            thr = 0
        mml = self._mml
        priority = self._priority
        k = self._k
        asyn = self._async
        placeholder_drafts = self._placeholder_drafts
        unknown = self._unknown
        new = _new
        sr = _SR
        no_drafts = _NO_DRAFTS
        ents: list[ScheduledRequest] = []
        out: list[_Req] = []
        prefill_scheduled = False
        preempted = False
        i = 0
        # Steady async decode (one step in flight, its output and k drafts
        # counted as 1 + k placeholders, k placeholder drafts for this step):
        # the chunk is 1 + k tokens past the known ones, all -1; a request
        # takes the general rules below only where they could decide
        # otherwise (the max_tokens skip, the threshold, the budget,
        # max_model_len, a block to allocate or to key, a prefill chunk).
        width = 1 + k
        steady = asyn and not 0 < thr < width
        sync_spec = not asyn and k > 0
        all_unknown = unknown.get(width) or unknown.setdefault(width, (-1,) * width)
        codes: list[int] = []
        base = k + 2
        steady_code = width * base + width
        ents_append = ents.append
        out_append = out.append
        codes_append = codes.append
        # The steady requests at the head of the running queue, in a plain
        # for loop (the two cases below, written once more without the index);
        # the first request that is not steady (or cannot get its block)
        # hands over to the general loop, at its index.
        if steady:
            for req in running:
                if budget < width:
                    break
                c = req.num_computed
                if not (
                    req.ph == width
                    and req.drafts is placeholder_drafts
                    and c == req.num_tokens + k
                    and c + width < mml
                    and c + 2 - width < req.max_end
                    and not req.pchunk
                    and (
                        (c + width <= req.cap and c - k < req.next_full)
                        or self._grow_to(req, c + width)
                    )
                ):
                    break
                bt = req.btuple
                o = new(sr)
                d = o.__dict__
                d["request_id"] = req.rid
                d["kind"] = _K_RUNNING
                d["num_computed_tokens"] = c
                d["num_scheduled_tokens"] = width
                d["num_tokens"] = c - k
                d["block_ids"] = bt if bt is not None else req.block_tuple()
                d["token_ids"] = all_unknown
                d["spec_token_ids"] = placeholder_drafts
                d["num_output_placeholders"] = width
                d["encoder_inputs"] = no_drafts
                d["num_invalid_spec_tokens"] = 0
                d["group_block_ids"] = _NO_GROUPS
                ents_append(o)
                out_append(req)
                codes_append(steady_code)
                req.num_computed = c + width
                req.inflight += width
                req.prev_pchunk = False
                req.ph = width + width
                budget -= width
                i += 1
        elif sync_spec:
            for req in running:
                if budget <= 0 or req.ph or req.pchunk:
                    break
                c = req.num_computed
                nt = req.num_tokens
                drafts = req.drafts
                n = 1 + len(drafts)
                e = c + n
                if not (
                    c == nt - 1
                    and n <= budget
                    and e < mml
                    and (thr <= 0 or n <= thr)
                    and ((e <= req.cap and nt < req.next_full) or self._grow_to(req, e))
                ):
                    break
                bt = req.btuple
                o = new(sr)
                d = o.__dict__
                d["request_id"] = req.rid
                d["kind"] = _K_RUNNING
                d["num_computed_tokens"] = c
                d["num_scheduled_tokens"] = n
                d["num_tokens"] = nt
                d["block_ids"] = bt if bt is not None else req.block_tuple()
                d["token_ids"] = req.tail + drafts if drafts else req.tail
                d["spec_token_ids"] = drafts
                d["num_output_placeholders"] = 0
                d["encoder_inputs"] = no_drafts
                d["num_invalid_spec_tokens"] = 0
                d["group_block_ids"] = _NO_GROUPS
                ents_append(o)
                out_append(req)
                codes_append(n * base + n)
                req.num_computed = e
                req.inflight += n
                req.prev_pchunk = False
                req.drafts = no_drafts
                budget -= n
                i += 1
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed
            ph = req.ph
            if (
                steady
                and ph == width
                and req.drafts is placeholder_drafts
                and c == req.num_tokens + k
                and width <= budget
                and c + width < mml
                and c + 2 - width < req.max_end
                and not req.pchunk
                and (
                    (c + width <= req.cap and c - k < req.next_full)
                    or self._grow_to(req, c + width)
                )
            ):
                bt = req.btuple
                o = new(sr)
                d = o.__dict__
                d["request_id"] = req.rid
                d["kind"] = _K_RUNNING
                d["num_computed_tokens"] = c
                d["num_scheduled_tokens"] = width
                d["num_tokens"] = c - k
                d["block_ids"] = bt if bt is not None else req.block_tuple()
                d["token_ids"] = all_unknown
                d["spec_token_ids"] = placeholder_drafts
                d["num_output_placeholders"] = width
                d["encoder_inputs"] = no_drafts
                d["num_invalid_spec_tokens"] = 0
                d["group_block_ids"] = _NO_GROUPS
                ents.append(o)
                out.append(req)
                codes.append(steady_code)
                req.num_computed = c + width
                req.inflight += width
                req.prev_pchunk = False
                req.ph = width + width
                budget -= width
                i += 1
                continue
            if sync_spec and not ph and not req.pchunk:
                # Steady decode with drafts, sync: the last known token and
                # the drafts proposed after the previous step.
                nt = req.num_tokens
                drafts = req.drafts
                n = 1 + len(drafts)
                e = c + n
                if (
                    c == nt - 1
                    and n <= budget
                    and e < mml
                    and (thr <= 0 or n <= thr)
                    and ((e <= req.cap and nt < req.next_full) or self._grow_to(req, e))
                ):
                    bt = req.btuple
                    o = new(sr)
                    d = o.__dict__
                    d["request_id"] = req.rid
                    d["kind"] = _K_RUNNING
                    d["num_computed_tokens"] = c
                    d["num_scheduled_tokens"] = n
                    d["num_tokens"] = nt
                    d["block_ids"] = bt if bt is not None else req.block_tuple()
                    d["token_ids"] = req.tail + drafts if drafts else req.tail
                    d["spec_token_ids"] = drafts
                    d["num_output_placeholders"] = 0
                    d["encoder_inputs"] = no_drafts
                    d["num_invalid_spec_tokens"] = 0
                    d["group_block_ids"] = _NO_GROUPS
                    ents.append(o)
                    out.append(req)
                    codes.append(n * base + n)
                    req.num_computed = e
                    req.inflight += n
                    req.prev_pchunk = False
                    req.drafts = _NO_DRAFTS
                    budget -= n
                    i += 1
                    continue
            if ph > 0 and c + 2 - ph >= req.max_end:
                i += 1  # the steps in flight surely finish it
                continue
            nt = req.num_tokens
            drafts = req.drafts
            n = nt + len(drafts) + ph - c
            if 0 < thr < n:
                n = thr
            if n > budget:
                n = budget
            if n > mml - c - 1:
                n = mml - c - 1
            if n <= 0:
                i += 1
                continue
            e = c + n
            # _grow_to only when the step needs a block or fills one to key
            if (e > req.cap or (e if e < nt else nt) >= req.next_full) and not self._grow_to(req, e):
                allocated = False
                while True:
                    if priority:
                        victim = self._victims.top()
                        v = bisect_left(running, victim.run_seq, key=_run_seq)
                        del running[v]
                    else:
                        v = len(running) - 1
                        victim = running.pop()
                    if v < i:
                        i -= 1
                        # scheduled already this step (unless it was skipped)?
                        j = bisect_left(out, victim.run_seq, key=_run_seq)
                        if j < len(out) and out[j] is victim:  # give it back
                            del out[j]
                            del codes[j]
                            given = ents.pop(j).num_scheduled_tokens
                            budget += given
                            victim.inflight -= given
                            victim.pchunk = victim.prev_pchunk
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                    if self._grow_to(req, e):
                        allocated = True
                        break
                if not allocated:
                    if priority:
                        continue  # it preempted itself; later requests may still fit
                    break
            pchunk = req.pchunk
            if pchunk:
                prefill_scheduled = True
            if drafts:
                m = n + c - nt - ph
                drafts = drafts[:m] if m > 0 else _NO_DRAFTS
            # the entry, then the request advances
            if e <= nt:
                tt = req.tail if n == 1 and e == nt else req.toks(c, e)
            elif not ph and c == nt - 1 and e == nt + len(drafts):
                tt = req.tail + drafts  # the last known token, then the drafts
            elif asyn and c >= nt:
                # every position past the known tokens is in flight or a
                # placeholder draft: n times -1
                tt = unknown.get(n) or unknown.setdefault(n, (-1,) * n)
            else:
                tt = req.seq(c, e, drafts)
            bt = req.btuple
            o = new(sr)
            d = o.__dict__
            d["request_id"] = req.rid
            d["kind"] = _K_RUNNING
            d["num_computed_tokens"] = c
            d["num_scheduled_tokens"] = n
            d["num_tokens"] = nt
            d["block_ids"] = bt if bt is not None else req.block_tuple()
            d["token_ids"] = tt
            d["spec_token_ids"] = drafts
            d["num_output_placeholders"] = ph
            d["encoder_inputs"] = no_drafts
            d["num_invalid_spec_tokens"] = 0
            d["group_block_ids"] = _NO_GROUPS
            ents.append(o)
            out.append(req)
            req.num_computed = e
            req.inflight += n
            req.prev_pchunk = pchunk
            req.pchunk = pchunk = e < nt + ph
            codes.append(n * base + (0 if pchunk else 1 + len(drafts)))
            if asyn and not pchunk:
                req.ph = ph + 1 + len(drafts)
                req.drafts = placeholder_drafts
            else:
                req.drafts = _NO_DRAFTS
            budget -= n
            i += 1

        if not preempted:
            max_seqs = cfg.max_num_seqs
            chunked = cfg.enable_chunked_prefill
            bs = self._bs
            running_scheduled = len(ents) > 0
            max_loras = self._max_loras
            loras = {r.lora for r in running if r.lora} if max_loras else None
            skipped: list[_Req] = []
            while budget > 0 and len(waiting):
                if len(running) >= max_seqs:
                    break
                req = waiting.peek()
                if req.stale and not req.drop_stale:
                    # output of a step in flight when it was preempted is still
                    # to come: it keeps its place, the loop goes on behind it
                    skipped.append(waiting.pop_head())
                    continue
                if loras is not None and req.lora and len(loras) == max_loras and req.lora not in loras:
                    skipped.append(waiting.pop_head())  # it would exceed max_loras: passed over
                    continue
                hit = self._find_hit(req)
                hit_tokens = len(hit) * bs
                nt = req.num_tokens
                n = nt - hit_tokens
                drafts = _NO_DRAFTS
                if (
                    k > 0
                    and n == 1
                    and not prefill_scheduled
                    and (running_scheduled or hit_tokens > 0)
                    and hit_tokens + 1 + k + 1 <= mml
                ):
                    # a new decode padded to 1 + k tokens (k placeholder drafts)
                    if 1 + k > budget:
                        break
                    n = 1 + k
                    drafts = placeholder_drafts
                else:
                    if 0 < thr < n:
                        n = thr
                    if n > budget:
                        if not chunked:
                            break
                        n = budget
                if not self._admit_alloc(req, hit, n, self._watermark if running else 0):
                    break
                waiting.pop_head()
                if loras is not None and req.lora:
                    loras.add(req.lora)
                kind = _K_NEW if req.status is _WAITING else _K_RESUMED
                req.status = _RUNNING
                self._run_seq += 1
                req.run_seq = self._run_seq
                running.append(req)
                if priority:
                    self._victims.push(req)
                e = hit_tokens + n
                ph = req.ph
                o = _entry(req.rid, kind, hit_tokens, n, nt, req.block_tuple(), req.seq(hit_tokens, e, drafts))
                if drafts or ph:
                    d = o.__dict__
                    d["spec_token_ids"] = drafts
                    d["num_output_placeholders"] = ph
                ents.append(o)
                out.append(req)
                req.num_computed = e
                req.inflight += n
                req.pchunk = pchunk = e < nt + ph
                codes.append(n * base + (0 if pchunk else 1 + len(drafts)))
                if asyn and not pchunk:
                    req.ph = ph + 1 + len(drafts)
                    req.drafts = placeholder_drafts
                budget -= n
            for req in reversed(skipped):
                waiting.push_front(req)
        if priority:
            self._victims.compact(running)
        plan = StepPlan(
            step=self._step,
            scheduled=tuple(ents),
            preempted_ids=tuple(sorted(self._preempted)),
            finished_ids=tuple(sorted(self._finished)),
        )
        self._preempted = set()
        self._finished = {}
        self._inflight.append(plan)
        self._inflight_reqs.append(out)
        self._inflight_codes.append(codes)
        return plan

    # ------------------------------------------------------------------ gated path

    def _choose_path(self) -> None:
        """Take the gated path (a pause state or a grammar came) or leave it
        (none is left, and no config gate needs it). A synchronous scheduler
        switches with no plan in flight; coming from the sync fast path,
        which keeps no is_prefill_chunk, the running requests get it. An
        async plan in flight scheduled on the other path is updated alike:
        the gate rules of update concern requests with encoder inputs (a
        config gate, never left) or a grammar (which holds the path)."""
        if not self._gated:
            self._gated = True
            if not self._general:
                for r in self._running:
                    r.pchunk = r.num_computed < r.num_tokens
                self._general = True
        else:
            self._gated = False
            self._general = self._base_general

    def _release_encoder(self, req: _Req) -> None:
        enc = self._enc
        if enc is not None:
            enc.release_all(req.rid, [m.identifier for m in req.mm])

    def _encoder_window(
        self, req: _Req, c: int, n: int, budget: int
    ) -> tuple[list[int], int, int, list[int]]:
        """The encoder inputs overlapping positions c .. c + n - 1, in order:
        a second input of an identifier already run this step is a
        duplicate, a cached one is reused, the first that fits neither the
        budget nor the cache cuts the chunk before it (to nothing when the
        chunk starts inside it). Returns (inputs to run, the chunk, the budget
        left, duplicates)."""
        enc = self._enc
        assert enc is not None
        rid = req.rid
        run: list[int] = []
        dups: list[int] = []
        idents: set[str] = set()
        taken = 0
        end = c + n
        for i, m in enumerate(req.mm):
            off = m.offset
            if off >= end or off + m.length <= c:
                continue
            ident = m.identifier
            if ident in idents:
                dups.append(i)
                continue
            if enc.reuse(rid, i, ident):
                continue
            size = m.length
            if not enc.make_room(size, budget, taken):
                n = min(n, off - c) if c < off else 0
                break
            taken += size
            budget -= size
            idents.add(ident)
            run.append(i)
        return run, n, budget, dups

    def _encoder_commit(self, req: _Req, run: list[int], dups: list[int]) -> None:
        enc = self._enc
        assert enc is not None
        mm = req.mm
        rid = req.rid
        for i in run:
            m = mm[i]
            enc.store(rid, i, m.identifier, m.length)
        for i in dups:
            enc.reuse(rid, i, mm[i].identifier)

    def _encoder_done(self, req: _Req) -> None:
        """After a step ran: the request drops each input that lies wholly in
        its computed tokens past the placeholders."""
        enc = self._enc
        assert enc is not None
        done = req.num_computed - req.ph
        mm = req.mm
        for i in enc.held_inputs(req.rid):
            m = mm[i]
            if m.offset + m.length <= done:
                enc.release(req.rid, i, m.identifier)

    def _schedule_gated(self) -> StepPlan:
        """schedule() with an admission gate: the general path's rules (no
        steady-decode shortcuts) plus the gates': the pause state, the
        prefill cadence (hold prefill, restart the interval), the encoder
        inputs of each chunk, and in the WAITING loop the requests passed
        over (a grammar compiling or failed, stale output, an adapter past
        max_loras, an encoder input leaving no token), the cadence's hold
        and the watermark."""
        cfg = self._config
        self._step += 1
        budget = cfg.max_num_batched_tokens
        running = self._running
        waiting = self._waiting
        thr = cfg.long_prefill_token_threshold
        kvh = self._kvh
        if len(running) + len(waiting) + len(kvh) <= 1:
            thr = 0
        conn = self._conn
        defer_free = self._defer_free
        hyb = self._hyb
        mml = self._mml
        priority = self._priority
        k = self._k
        asyn = self._async
        placeholder_drafts = self._placeholder_drafts
        base = k + 2
        ents: list[ScheduledRequest] = []
        out: list[_Req] = []
        codes: list[int] = []
        prefill_scheduled = False
        prefill_admitted = False
        preempted = False
        interval = self._interval
        defer = (
            interval > 1
            and not self._capacity_bound
            and (self._num_executed_steps + 1) - self._last_prefill_step < interval
            and any(not r.pchunk for r in running)
        )
        pause = self._pause
        if pause is _PAUSED_ALL:
            budget = 0
        enc = self._enc
        enc_budget = cfg.max_num_encoder_input_tokens
        enc_run: dict[str, list[int]] = {}
        # the steady decodes' shortcuts (sync: 1 token; async: 1 + k)
        width = 1 + k if asyn else 1
        thr_cuts = 0 < thr < width
        all_unknown = self._unknown.get(width) or self._unknown.setdefault(width, (-1,) * width)
        steady_code = width * base + width
        new = _new
        sr = _SR
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed
            ph = req.ph
            if ph > 0 and c + 2 - ph >= req.max_end:
                i += 1  # the steps in flight surely finish it
                continue
            if defer and req.pchunk:
                i += 1  # a prefill chunk waits for the cadence
                continue
            nt = req.num_tokens
            drafts = req.drafts
            # The steady decodes (past every encoder input, which lie in the
            # prompt; no block to allocate or key; not a prefill chunk, so
            # the cadence does not hold them), in a few lines: sync, one
            # known token; async, one step in flight with its 1 + k
            # placeholders and k placeholder drafts for this step.
            if (
                req.pchunk or c + width > req.cap or req.plen >= nt or thr_cuts
                or (hyb and c - req.inflight >= req.gskip)
            ):
                pass
            elif not ph:
                if not asyn and c == nt - 1 and not drafts and nt < mml and nt < req.next_full:
                    o = new(sr)
                    d = o.__dict__
                    d["request_id"] = req.rid
                    d["kind"] = _K_RUNNING
                    d["num_computed_tokens"] = c
                    d["num_scheduled_tokens"] = 1
                    d["num_tokens"] = nt
                    bt = req.btuple
                    d["block_ids"] = bt if bt is not None else req.block_tuple()
                    d["token_ids"] = req.tail
                    d["spec_token_ids"] = _NO_DRAFTS
                    d["num_output_placeholders"] = 0
                    d["encoder_inputs"] = _NO_DRAFTS
                    d["num_invalid_spec_tokens"] = 0
                    gt = req.gtuple
                    d["group_block_ids"] = gt if gt is not None else self._group_tuples(req)
                    ents.append(o)
                    out.append(req)
                    codes.append(base + 1)
                    req.num_computed = nt
                    req.inflight += 1
                    req.prev_pchunk = False
                    budget -= 1
                    i += 1
                    continue
            elif (
                ph == width
                and asyn
                and drafts is placeholder_drafts
                and c == nt + k
                and width <= budget
                and c + width < mml
                and nt < req.next_full
            ):
                o = new(sr)
                d = o.__dict__
                d["request_id"] = req.rid
                d["kind"] = _K_RUNNING
                d["num_computed_tokens"] = c
                d["num_scheduled_tokens"] = width
                d["num_tokens"] = nt
                bt = req.btuple
                d["block_ids"] = bt if bt is not None else req.block_tuple()
                d["token_ids"] = all_unknown
                d["spec_token_ids"] = placeholder_drafts
                d["num_output_placeholders"] = width
                d["encoder_inputs"] = _NO_DRAFTS
                d["num_invalid_spec_tokens"] = 0
                gt = req.gtuple
                d["group_block_ids"] = gt if gt is not None else self._group_tuples(req)
                ents.append(o)
                out.append(req)
                codes.append(steady_code)
                req.num_computed = c + width
                req.inflight += width
                req.prev_pchunk = False
                req.ph = width + width
                budget -= width
                i += 1
                continue
            n = nt + len(drafts) + ph - c
            if 0 < thr < n:
                n = thr
            if n > budget:
                n = budget
            if n > mml - c - 1:
                n = mml - c - 1
            run: list[int] = []
            dups: list[int] = []
            if n > 0 and req.mm:
                run, n, enc_left, dups = self._encoder_window(req, c, n, enc_budget)
            if n <= 0:
                i += 1
                continue
            e = c + n
            if (
                e > req.cap or (e if e < nt else nt) >= req.next_full or (hyb and c - req.inflight >= req.gskip)
            ) and not self._grow_to(req, e):
                allocated = False
                blocked = False
                while True:
                    if priority:
                        victim = self._victims.top()
                        v = bisect_left(running, victim.run_seq, key=_run_seq)
                    else:
                        v = len(running) - 1
                        victim = running[v]
                    if defer_free and victim.last_seq > self._processed_seq:
                        # a deferred free will not help with immediate allocation
                        blocked = True
                        break
                    del running[v]
                    if v < i:
                        i -= 1
                        j = bisect_left(out, victim.run_seq, key=_run_seq)
                        if j < len(out) and out[j] is victim:  # give its budget back
                            del out[j]
                            del codes[j]
                            given = ents.pop(j).num_scheduled_tokens
                            budget += given
                            victim.inflight -= given
                            victim.pchunk = victim.prev_pchunk
                            ran = enc_run.pop(victim.rid, None)
                            if ran:  # its encoder inputs give their budget back
                                enc_budget += sum(victim.mm[x].length for x in ran)
                    self._preempt(victim, conn)  # kv_both: a victim's output in flight is dropped
                    preempted = True
                    if victim is req:
                        break
                    if self._grow_to(req, e):
                        allocated = True
                        break
                if not allocated:
                    if priority and not blocked:
                        continue
                    break
            pchunk = req.pchunk
            if pchunk:
                prefill_scheduled = True
            if drafts:
                m = n + c - nt - ph
                drafts = drafts[:m] if m > 0 else _NO_DRAFTS
            o = _entry(req.rid, _K_RUNNING, c, n, nt, req.block_tuple(), req.seq(c, e, drafts))
            d = o.__dict__
            if hyb:
                d["group_block_ids"] = self._group_tuples(req)
            d["spec_token_ids"] = drafts
            d["num_output_placeholders"] = ph
            if run:
                d["encoder_inputs"] = tuple(run)
                enc_run[req.rid] = run
                enc_budget = enc_left
                self._encoder_commit(req, run, dups)
            ents.append(o)
            out.append(req)
            req.num_computed = e
            req.inflight += n
            req.prev_pchunk = pchunk
            req.pchunk = pchunk = e < nt + ph
            codes.append(n * base + (0 if pchunk else 1 + len(drafts)))
            if asyn and not pchunk:
                req.ph = ph + 1 + len(drafts)
                req.drafts = placeholder_drafts
            else:
                req.drafts = _NO_DRAFTS
            budget -= n
            i += 1

        if not preempted and pause is not _PAUSED_ALL:
            max_seqs = cfg.max_num_seqs
            chunked = cfg.enable_chunked_prefill
            bs = self._bs
            running_scheduled = len(ents) > 0
            max_loras = self._max_loras
            loras = {r.lora for r in running if r.lora} if max_loras else set()
            deferred = self._deferred
            skipped: list[_Req] = []
            skipped_kvh: list[_Req] = []  # passed over holding KV blocks
            while budget > 0:
                # kv_holding_waiting first (also under PAUSED_NEW)
                from_kvh = conn and len(kvh) > 0
                if not from_kvh and (pause is _PAUSED_NEW or not len(waiting)):
                    break  # nothing is admitted while paused
                if len(running) >= max_seqs:
                    break
                req = self._kvh_head() if from_kvh else waiting.peek()
                rid = req.rid
                passed = False
                if req.status is _REMOTE:
                    if rid not in self._loads_done:
                        passed = True  # its load is not reported yet
                    else:
                        self._promote(req)
                if passed:
                    pass
                elif req.status is _GRAMMAR:
                    if req.grammar is None:
                        passed = True  # still compiling
                    elif req.grammar is False:
                        self._grammar_errors.add(rid)  # finished at the next update
                        passed = True
                    else:
                        req.status = _WAITING
                if not passed:
                    if req.stale and not req.drop_stale:
                        passed = True
                    elif max_loras and req.lora and len(loras) == max_loras and req.lora not in loras:
                        passed = True  # it would exceed max_loras
                if passed:
                    deferred.add(rid)
                    self._skip(req, from_kvh, skipped, skipped_kvh)
                    continue
                ext = 0
                hit: Any
                if req.num_computed:  # a promoted load: its blocks and computed tokens
                    hit = [[] for _ in self._layout.groups] if hyb else []
                    computed = req.num_computed
                else:
                    if hyb:
                        hit, _ = self._g_find_hit(req)
                        computed = len(hit[0]) * bs
                    else:
                        hit = self._find_hit(req)
                        computed = len(hit) * bs
                    if conn:
                        ext, load_async = self._external_tokens(req, computed)
                        if load_async:
                            # an asynchronous load starts: blocks, no work; passed over
                            wm = self._watermark if running else 0
                            reserve = self._async_load_reserve()
                            if not (
                                self._g_admit_alloc(req, hit, 0, wm, computed + ext, True, reserve) if hyb
                                else self._admit_alloc(req, hit, 0, wm, computed + ext, True, reserve)
                            ):
                                if req.mm:
                                    self._release_encoder(req)
                                break
                            self._record_load(req, computed, ext, True)
                            req.status = _REMOTE
                            req.num_computed = computed + ext
                            self._inflight_prefills.add(rid)
                            deferred.add(rid)
                            self._skip(req, from_kvh, skipped, skipped_kvh)
                            continue
                        computed += ext
                nt = req.num_tokens
                if defer and computed < nt - 1:
                    break  # its prefill waits for the cadence
                n = nt - computed
                drafts = _NO_DRAFTS
                if (
                    k > 0
                    and n == 1
                    and not prefill_scheduled
                    and (running_scheduled or computed > 0)
                    and computed + 1 + k + 1 <= mml
                ):
                    if 1 + k > budget:
                        break
                    n = 1 + k
                    drafts = placeholder_drafts
                else:
                    if 0 < thr < n:
                        n = thr
                    if n > budget:
                        if not chunked:
                            break
                        n = budget
                run = []
                dups = []
                if req.mm:
                    run, n, enc_left, dups = self._encoder_window(req, computed, n, enc_budget)
                    if n == 0:
                        deferred.add(rid)  # no token this step: passed over
                        self._skip(req, from_kvh, skipped, skipped_kvh)
                        continue
                wm = self._watermark if running else 0
                if not (
                    self._g_admit_alloc(req, hit, n, wm, computed) if hyb
                    else self._admit_alloc(req, hit, n, wm, computed)
                ):
                    if req.mm:
                        self._release_encoder(req)
                    break
                if ext:
                    self._record_load(req, computed - ext, ext, False)
                deferred.discard(rid)
                if req.lora:
                    loras.add(req.lora)
                if computed < nt - 1:
                    prefill_admitted = True
                if from_kvh:
                    kvh.remove(req)
                else:
                    waiting.pop_head()
                if conn and computed + n < nt:
                    self._inflight_prefills.add(rid)
                kind = _K_NEW if req.status is _WAITING else _K_RESUMED
                req.status = _RUNNING
                self._run_seq += 1
                req.run_seq = self._run_seq
                running.append(req)
                if priority:
                    self._victims.push(req)
                e = computed + n
                ph = req.ph
                o = _entry(rid, kind, computed, n, nt, req.block_tuple(), req.seq(computed, e, drafts))
                d = o.__dict__
                if hyb:
                    d["group_block_ids"] = self._group_tuples(req)
                d["spec_token_ids"] = drafts
                d["num_output_placeholders"] = ph
                if run:
                    d["encoder_inputs"] = tuple(run)
                    enc_run[rid] = run
                    enc_budget = enc_left
                    self._encoder_commit(req, run, dups)
                ents.append(o)
                out.append(req)
                req.num_computed = e
                req.inflight += n
                req.pchunk = pchunk = e < nt + ph
                codes.append(n * base + (0 if pchunk else 1 + len(drafts)))
                if asyn and not pchunk:
                    req.ph = ph + 1 + len(drafts)
                    req.drafts = placeholder_drafts
                budget -= n
            for req in reversed(skipped):
                waiting.push_front(req)
            if skipped_kvh:
                kvh[:0] = skipped_kvh
            if not defer:
                # a release step records whether it left the queue backed up
                self._capacity_bound = len(waiting) + len(kvh) > len(deferred)
        if priority:
            self._victims.compact(running)
        if ents:
            self._num_executed_steps += 1
        if interval > 1 and (prefill_scheduled or prefill_admitted):
            self._last_prefill_step = self._num_executed_steps
        kv_loads: tuple[KVLoad, ...] = ()
        if conn:
            self._after_schedule_kv(out)
            kv_loads = tuple(self._pending_loads)
            self._pending_loads = []
        plan = StepPlan(
            step=self._step,
            scheduled=tuple(ents),
            preempted_ids=tuple(sorted(self._preempted)),
            finished_ids=tuple(sorted(self._finished)),
            freed_encoder_inputs=enc.take_freed() if enc is not None else (),
            kv_loads=kv_loads,
        )
        self._preempted = set()
        self._finished = {}
        self._inflight.append(plan)
        self._inflight_reqs.append(out)
        self._inflight_codes.append(codes)
        return plan

    def _result_ok(self, result: StepResult, out: list[_Req], codes: list[int]) -> bool:
        """Whether ``result`` surely passes the protocol's checks of the
        sampled tokens and the drafts (spec/protocol.py, check_sampled and
        check_drafts), in one pass over the plan's requests and codes (the
        oldest plan in flight). False means "not sure": the protocol's own
        check then raises its error, or finds it valid after all."""
        sampled = result.sampled
        drafts = result.draft_token_ids
        if sampled.__class__ is not dict or (drafts and drafts.__class__ is not dict):
            return False
        get_toks = sampled.get
        get_drafts = drafts.get if drafts else None
        k = self._k
        base = k + 2
        requests = self._requests
        present = 0
        with_drafts = 0
        for r, code in zip(out, codes):
            rid = r.rid
            toks = get_toks(rid)
            most = code % base  # 1 + drafts; 0: a partial prefill chunk
            if toks is None:
                if most and rid in requests:
                    return False
            else:
                present += 1
                if toks.__class__ is not tuple:
                    return False
                got = len(toks)
                if got == 1:  # (the common case, without the loop)
                    t = toks[0]
                    if t.__class__ is not int or t < 0:
                        return False
                    if not most and rid in requests:
                        return False
                else:
                    for t in toks:
                        if t.__class__ is not int or t < 0:
                            return False
                    if (got > most or not got) if most else got:
                        if rid in requests:  # a request finished meanwhile may get anything well-formed
                            return False
            if get_drafts is not None:
                d = get_drafts(rid)
                if d is not None:
                    with_drafts += 1
                    if d.__class__ is not tuple or len(d) > k:
                        return False
                    for t in d:
                        if t.__class__ is not int or t < 0:
                            return False
                    if d and not most:
                        return False  # drafts after a partial prefill chunk
        if present != len(sampled):
            return False  # tokens for a request the plan did not schedule
        if get_drafts is not None and with_drafts != len(drafts):
            return False  # drafts for a request the plan did not schedule
        return True

    def _apply_stale(self, req: _Req, n: int, toks: tuple[int, ...]) -> bool:
        """The output of a step scheduled before ``req`` was last preempted:
        drained from its stale share; dropped after a reset, else appended
        with the stop checks, leaving the computed tokens, the placeholders
        and the keys alone (they were reset by the preemption). Returns
        whether it stopped a running request."""
        req.stale -= n
        if req.drop_stale:
            return False
        if req.mm and self._enc is not None:
            self._encoder_done(req)
        if not toks:
            return False
        was_running = req.status is _RUNNING
        output = req.output
        nt = req.num_tokens
        finished: RequestStatus | None = None
        for t in toks:
            output.append(t)
            nt += 1
            if t in req.stop:
                finished = _STOPPED
                break
            if nt >= req.end_at:
                finished = _LENGTH
                break
        if req.rejects and not req.rejects.isdisjoint(output[req.num_tokens - req.plen :]):
            finished = _ERROR  # a token its grammar refuses: the request errs
        req.num_tokens = nt
        req.tail = (output[-1],)
        if finished is None:
            return False
        if not was_running:
            self._unqueue(req)  # a stale output stopped a preempted request
        self._finish(req, finished)
        return was_running

    def _update_sync_gated(self, plan: StepPlan, result: StepResult) -> None:
        """update() on the gated path, synchronous without drafts: one token
        per sampling entry (no placeholders, drafts or stale output), with the
        gates' rules: the encoder inputs a step completed are dropped, a token
        the grammar refuses finishes the request with FINISHED_ERROR, failed
        grammars finish after the entries."""
        check_update(plan, self._inflight, result)
        out = self._inflight_reqs[0]
        if not self._result_ok(result, out, self._inflight_codes[0]):
            check_sampled(plan, result, self._requests, self._config)  # raises the spec's error
        if self._conn:
            # the connector's reports; a failed or truncated load skips
            # entries: the general update applies the step then
            failed = self._kv_reports(plan, result)
            if failed:
                self._update_general(plan, result, failed)
                return
        get_toks = result.sampled.get
        enc_on = self._enc is not None
        any_stopped = False
        for r in out:
            r.inflight = 0
            if r.status is not _RUNNING:
                continue  # aborted while the step ran
            if enc_on and r.mm:
                self._encoder_done(r)
            toks = get_toks(r.rid)
            if not toks:
                continue  # a partial prefill chunk
            t = toks[0]
            r.output.append(t)
            nt = r.num_tokens + 1
            r.num_tokens = nt
            r.tail = toks
            if r.rejects and t in r.rejects:
                any_stopped = True
                self._finish(r, _ERROR)
            elif t in r.stop:
                any_stopped = True
                self._finish(r, _STOPPED)
            elif nt >= r.end_at:
                any_stopped = True
                self._finish(r, _LENGTH)
        if any_stopped:
            self._running = [r for r in self._running if r.status is _RUNNING]
        if self._grammar_errors:
            self._finish_grammar_errors()
        if self._conn:
            self._kv_finished(result)
        del self._inflight[0]
        del self._inflight_reqs[0]
        del self._inflight_codes[0]

    @staticmethod
    def _set_drafts(req: _Req, d: tuple[int, ...]) -> None:
        """update_draft_token_ids for one unfinished request: none after a
        partial prefill chunk; its grammar keeps those before the first
        refused one."""
        if req.pchunk:
            req.drafts = _NO_DRAFTS
        elif req.rejects and not req.rejects.isdisjoint(d):
            rejects = req.rejects
            cut = 0
            while d[cut] not in rejects:
                cut += 1
            req.drafts = d[:cut]
        else:
            req.drafts = d

    def _finish_grammar_errors(self, failed_loads: AbstractSet[str] | None = None) -> None:
        """The requests whose grammar failed, as the WAITING loops since the
        last update found them, and under kv_load_failure_policy "fail" those
        whose KV load failed, finish with FINISHED_ERROR, in id order."""
        errors, self._grammar_errors = self._grammar_errors, set()
        if failed_loads:
            errors |= failed_loads
        for rid in sorted(errors):
            req = self._requests.get(rid)
            if req is None:
                continue  # aborted meanwhile
            self._finish_request(req, _ERROR)

    def _update_general(self, plan: StepPlan, result: StepResult, reported: AbstractSet[str] | None = None) -> None:
        """update() with async scheduling or speculative decoding, for each
        entry in plan order: drain its in-flight (and stale) tokens, roll back
        the rejected drafts, append the tokens one by one with a stop check
        after each (a stop inside an accepted run drops the rest), consume the
        placeholders, key the blocks the verified tokens filled; a stale
        output that stops a preempted request finishes it. Then, without async
        scheduling, the drafts proposed after the step. ``reported``: the
        checks and the connector's reports were made (by
        _update_sync_gated), these are the requests whose output is
        skipped."""
        cfg = self._config
        if reported is None:
            check_update(plan, self._inflight, result)
        out = self._inflight_reqs[0]
        codes = self._inflight_codes[0]
        failed: AbstractSet[str]
        if reported is None:
            if not self._result_ok(result, out, codes):
                check_sampled(plan, result, self._requests, cfg)  # raises the spec's error
            # the KV connector's reports: the requests whose output is skipped
            failed = self._kv_reports(plan, result) if self._conn else _NO_FAILED
        else:
            failed = reported
        late_drafts: list[_Req] = []
        base = self._k + 2
        requests = self._requests
        get_req = requests.get
        get_toks = result.sampled.get
        caching = self._caching
        spec_on = self._k > 0
        # Drafts proposed after the step (sync speculative decoding): each
        # request that is still unfinished once its entry is applied takes
        # its own (none after a partial prefill chunk). Applying them entry by
        # entry equals applying them after the loop: an entry changes only its
        # own request, and every drafted request has an entry (checked above).
        drafted = result.draft_token_ids if not self._async else None
        get_drafts = drafted.get if drafted else None
        any_stopped = False
        # The plan's entries and their requests (parallel lists). A request
        # still running is the one its id names; any other is looked up by id,
        # as the spec does (it may have finished, or a new request may have
        # taken its id).
        # A one-token step without drafts (async decode without speculative
        # decoding) of a running request with no stale output: the general
        # rules below, written out for one token (no roll-back, no drafts).
        gated = self._gated
        one = base + 1 if get_drafts is None else -1
        enc_on = self._enc is not None
        for r, code in zip(out, codes):
            if failed and r.rid in failed:
                # a failed or truncated KV load: its output of this step is skipped
                req_f = r if r.status is _RUNNING else get_req(r.rid)
                if req_f is not None:
                    sn = code // base
                    req_f.inflight -= sn
                    if req_f.stale > 0:
                        req_f.stale -= sn
                    if get_drafts is not None and get_drafts(req_f.rid) is not None:
                        late_drafts.append(req_f)  # applied after the errors finish
                continue
            if r.status is _RUNNING:
                if code == one and not r.stale and not (gated and (r.mm or r.rejects)):
                    toks = get_toks(r.rid, _NO_DRAFTS)
                    if len(toks) == 1:
                        r.inflight -= 1
                        t = toks[0]
                        r.output.append(t)
                        nt = r.num_tokens + 1
                        r.num_tokens = nt
                        r.tail = toks
                        ph = r.ph
                        if ph > 0:
                            r.ph = ph - 1
                        if caching and (ph > 0 or spec_on):
                            upto = r.num_computed - r.inflight
                            if upto > nt:  # only known tokens have keys (after a failed load)
                                upto = nt
                            if upto >= r.next_full:
                                self._register(r, upto)
                                r.edge = min(r.cap + 1, r.next_full)
                        if t in r.stop:
                            any_stopped = True
                            self._finish(r, _STOPPED)
                        elif nt >= r.end_at:
                            any_stopped = True
                            self._finish(r, _LENGTH)
                        continue
                req = r
                was_running = True
            else:
                found = get_req(r.rid)
                if found is None:
                    continue  # finished (aborted, or stopped) while the step ran
                req = found
                was_running = req.status is _RUNNING
            rid = req.rid
            toks = get_toks(rid, _NO_DRAFTS)
            sn = code // base
            req.inflight -= sn
            if req.stale > 0:
                any_stopped = self._apply_stale(req, sn, toks) or any_stopped
                st = req.status
                if st is not _RUNNING and st is not _PREEMPTED and st is not _WAITING:
                    continue  # the stale output finished it
            elif toks:
                ntok = len(toks)
                nd = code - sn * base  # 1 + the entry's drafts (it samples)
                nd = nd - 1 if nd else 0
                if nd and nd + 1 != ntok:  # rejected drafts: computed (and placeholders) roll back
                    rejected = nd + 1 - ntok
                    if req.num_computed > 0:
                        req.num_computed -= rejected
                    if req.ph > 0:
                        req.ph -= rejected
                if enc_on and req.mm:
                    self._encoder_done(req)  # only once the step has run
                num_before = req.num_tokens
                ph = req.ph
                stop = req.stop
                output = req.output
                nt = req.num_tokens
                finished: RequestStatus | None = None
                if ntok == 1:
                    t = toks[0]
                    output.append(t)
                    nt += 1
                    req.tail = toks
                    if t in stop:
                        finished = _STOPPED
                    elif nt >= req.end_at:
                        finished = _LENGTH
                elif nt + ntok < req.end_at and stop.isdisjoint(toks):
                    # no token of the run stops it: appended at once
                    output.extend(toks)
                    nt += ntok
                    req.tail = toks[-1:]
                else:
                    end_at = req.end_at
                    kept = 0
                    for t in toks:
                        output.append(t)
                        nt += 1
                        kept += 1
                        if t in stop:
                            finished = _STOPPED
                            break
                        if nt >= end_at:
                            finished = _LENGTH
                            break
                    req.tail = (output[-1],)
                    if finished is not None:
                        # a stop inside an accepted run: the rest is dropped
                        req.num_computed -= ntok - kept
                if req.rejects and not req.rejects.isdisjoint(output[num_before - req.plen :]):
                    finished = _ERROR  # a token its grammar refuses: the request errs
                req.num_tokens = nt
                if ph > 0:
                    req.ph = ph - ntok
                if caching and was_running and (ph > 0 or spec_on):
                    upto = req.num_computed - req.inflight
                    if upto > nt:  # only known tokens have keys (after a failed load)
                        upto = nt
                    if upto >= req.next_full:
                        self._register(req, upto)
                        req.edge = min(req.cap + 1, req.next_full)
                if finished is not None:
                    if was_running:
                        any_stopped = True
                    else:
                        self._unqueue(req)
                    self._finish(req, finished)
                    continue
            elif enc_on and req.mm:
                self._encoder_done(req)  # a partial chunk: only once the step has run
            if get_drafts is not None:  # (the request is unfinished here)
                d = get_drafts(rid)
                if d is not None:
                    self._set_drafts(req, d)
        if any_stopped:
            self._running = [r for r in self._running if r.status is _RUNNING]
        if failed and self._fail_policy:
            self._finish_grammar_errors(failed)
        elif self._grammar_errors:
            self._finish_grammar_errors()
        if self._conn:
            self._kv_finished(result)
            for req in late_drafts:
                if requests.get(req.rid) is req:
                    self._set_drafts(req, drafted[req.rid])  # type: ignore[index]
        del self._inflight[0]
        del self._inflight_reqs[0]
        del self._inflight_codes[0]

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
        )
        if self._interval > 1 or self._hyb:
            # the prefill cadence reads is_prefill_chunk: reported with it on
            cadence = self._interval > 1
            hyb = self._hyb
            requests = {rid: r.view(cadence, hyb) for rid, r in self._requests.items()}
            gates: dict[str, Any] = {
                "num_executed_steps": self._num_executed_steps,
                "last_prefill_step": self._last_prefill_step,
                "prefill_capacity_bound": self._capacity_bound,
            } if cadence else {}
        else:
            requests = {rid: r.view() for rid, r in self._requests.items()}
            gates = {}
        enc = self._enc
        if enc is not None:
            gates["encoder_cache"] = dict(enc.entries)
            gates["encoder_cache_free"] = enc.free
        finished = {rid: r.view() for rid, r in self._finished.items()}
        waiting = tuple(r.rid for r in self._waiting.order())
        if self._conn:
            gates.update(self._connector_view())
            waiting = tuple(r.rid for r in self._kvh_order()) + waiting
            for rid, v in finished.items():
                if v.block_ids:  # kept for the connector: reported without them
                    finished[rid] = self._finished_view_without_blocks(v)
        return SchedulerView(
            config=self._config,
            step=self._step,
            requests=requests,
            waiting=waiting,
            running=tuple(r.rid for r in self._running),
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
        new: ImplScheduler = _new(ImplScheduler)
        d = new.__dict__
        d.update(self.__dict__)
        remap: dict[int, _Req] = {}
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
        d["_preempted"] = self._preempted.copy()
        d["_deferred"] = self._deferred.copy()
        d["_grammar_errors"] = self._grammar_errors.copy()
        d["_mm_lengths"] = self._mm_lengths.copy()
        if self._enc is not None:
            d["_enc"] = self._enc.copy()
        if self._conn:
            self._clone_connector(d, remap)
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


class _Bad(Exception):
    """Internal: the fast pass of update() met input it does not vouch for."""


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """The most full blocks a prefix-cache lookup may return: the last token
    is always computed (it yields the logits), so the hit covers at most
    ``num_tokens - 1`` tokens. (spec/rules.py has the same rule; the test
    suite compares the two with ``crosshair diffbehavior``.)"""
    return (num_tokens - 1) // block_size


__all__ = ["ImplScheduler", "BlockKey", "max_hit_blocks"]
