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

The modelled configuration: one full-attention KV group, no KV connectors, no
LoRA, no multimodal inputs, no structured output, no streaming (resumable)
requests, no pipeline parallelism, watermark 0, the V1 model runner.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from schedspec.spec.interface import (
    BlockKey,
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
from schedspec.spec.kv_cache import KVPool
from schedspec.spec.protocol import (
    check_abort,
    check_add,
    check_config,
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
class _Request:
    """One unfinished request, with vLLM's field names (vllm/v1/request.py,
    Request)."""

    spec: RequestSpec
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # the block table
    num_cached_blocks: int = 0  # blocks of the table already given a key
    num_preemptions: int = 0
    # Speculative decoding: the drafts for the next step (-1 = a placeholder
    # whose id only the model runner knows).
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: output tokens in flight, already in num_computed_tokens.
    num_output_placeholders: int = 0
    # Tokens scheduled in steps not yet updated (every plan in flight).
    num_in_flight_tokens: int = 0
    # Of those, the tokens of steps scheduled before the last preemption:
    # their output is stale (delivered, or dropped if drop_stale_output).
    num_stale_output_tokens: int = 0
    drop_stale_output: bool = False
    # Whether the last step scheduled for it stopped short of its known and
    # in-flight tokens (vLLM's is_prefill_chunk, set after each schedule).
    is_prefill_chunk: bool = False

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.spec.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output_token_ids)

    def block_key(self, block_index: int, block_size: int) -> BlockKey:
        """The content key of this request's block ``block_index`` (vLLM:
        ``request.block_hashes[block_index]``, a chained hash of the same
        tokens)."""
        return (self.spec.salt, self.all_token_ids[: (block_index + 1) * block_size])

    def set_status(self, new: RequestStatus) -> None:
        assert is_legal_transition(self.status, new), f"{self.request_id}: {self.status} -> {new}"
        self.status = new

    def copy(self) -> _Request:
        """An independent copy: the lists are copied, the frozen spec shared."""
        new: _Request = _new(_Request)
        d = new.__dict__
        d.update(self.__dict__)
        d["output_token_ids"] = self.output_token_ids[:]
        d["blocks"] = self.blocks[:]
        d["spec_token_ids"] = self.spec_token_ids[:]
        return new

    def view(self) -> RequestView:
        return RequestView.of(
            self.spec,
            status=self.status,
            output_token_ids=tuple(self.output_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            block_ids=tuple(self.blocks),
            num_preemptions=self.num_preemptions,
            num_output_placeholders=self.num_output_placeholders,
            spec_token_ids=tuple(self.spec_token_ids),
        )


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


class SpecScheduler:
    """Implements spec.interface.Scheduler."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = check_config(config)
        # rule coverage (spec/coverage.py, spec/rule_names.py): one counter, shared with the KV pool and clones
        self.rules: Counter[str] = Counter()
        self.kv = KVPool(config.num_blocks, config.block_size, config.enable_prefix_caching, self.rules)
        self.requests: dict[str, _Request] = {}  # unfinished requests
        self.waiting: list[str] = []  # FCFS: queue order; PRIORITY: unordered, head = min key
        self.running: list[str] = []
        self.finished: dict[str, RequestView] = {}  # finished since the last plan
        self.preempted: set[str] = set()  # preempted since the last plan
        self.step = 0
        # The plans awaiting update(), oldest first: at most one at rest, two
        # for a moment with async scheduling (a tuple, so clones share it).
        self.in_flight: tuple[StepPlan, ...] = ()

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
        return new

    # ------------------------------------------------------------------ queues

    def _waiting_order(self) -> list[str]:
        """The waiting queue in service order. FCFS: a deque
        (request_queue.py, FCFSRequestQueue). PRIORITY: a heap on
        (priority, arrival, request_id) (PriorityRequestQueue, Request.__lt__)."""
        if self._config.policy == Policy.FCFS:
            return list(self.waiting)
        return sorted(self.waiting, key=self._priority_key)

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
        self.requests[request.request_id] = _Request(spec=request)
        self.waiting.append(request.request_id)

    def abort(self, request_id: str) -> None:
        """finish_requests(request_id, FINISHED_ABORTED): any unfinished request,
        in any state; its blocks are freed at once."""
        req = check_abort(request_id, self.requests)
        if req.status == RequestStatus.RUNNING:
            self.rules["abort.running"] += 1  # pragma: no mutate
            self.running.remove(request_id)
        else:
            self.rules["abort.waiting"] += req.status == RequestStatus.WAITING  # pragma: no mutate
            self.rules["abort.preempted"] += req.status == RequestStatus.PREEMPTED  # pragma: no mutate
            self.waiting.remove(request_id)
        self._finish(req, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: _Request, status: RequestStatus) -> None:
        """_free_request: free the blocks, forget the request, report its id in
        the next plan's finished ids."""
        req.set_status(status)
        self.kv.free(req.blocks)
        req.blocks = []
        del self.requests[req.request_id]
        self.finished[req.request_id] = req.view()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """reset_prefix_cache. With reset_running_requests, every running request
        is preempted first, last first, so they come back in their order. With
        async scheduling a step may be in flight (spec/protocol.py,
        check_reset); the output of that step is then dropped for the requests
        preempted here (``drop_stale_output=True``): they may be resumed at
        once and recompute those positions."""
        check_reset(self.in_flight, self._config)
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
        self.kv.free(req.blocks)
        req.blocks = []
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
        ``min(computed + new, request.num_tokens)``)."""
        if not self.kv.enable_caching:
            return
        bs = self._config.block_size
        new_full = range(req.num_cached_blocks, num_tokens // bs)
        self.kv.cache_full_blocks(
            [req.blocks[i] for i in new_full], [req.block_key(i, bs) for i in new_full]
        )
        req.num_cached_blocks = max(req.num_cached_blocks, num_tokens // bs)

    def _allocate_running(self, req: _Request, n: int) -> bool:
        """KVCacheManager.allocate_slots for a running request (no new hits):
        slots for ``n`` tokens past the computed ones plus
        ``num_lookahead_tokens`` (``num_tokens_need_slot``), at most
        max_model_len; only known tokens are cached (drafts and placeholders
        are not: ``min(..., request.num_tokens)``)."""
        cfg = self._config
        target = min(req.num_computed_tokens + n + cfg.num_lookahead_tokens, cfg.max_model_len)
        total = blocks_for_tokens(num_tokens=target, block_size=self._config.block_size)
        need = max(total - len(req.blocks), 0)
        if need > self.kv.num_free:
            return False
        req.blocks.extend(self.kv.get_new_blocks(need))
        self._cache_blocks(req, min(req.num_computed_tokens + n, req.num_tokens))
        return True

    def _get_computed_blocks(self, req: _Request) -> list[int]:
        """KVCacheManager.get_computed_blocks: the longest run of cached full
        blocks from the start, at most ``num_tokens - 1`` tokens."""
        if not self.kv.enable_caching:
            return []
        bs = self._config.block_size
        hit: list[int] = []
        for i in range(max_hit_blocks(num_tokens=req.num_tokens, block_size=bs)):
            block = self.kv.get_cached_block(req.block_key(i, bs))
            if block is None:
                break
            hit.append(block)
        full = max_hit_blocks(num_tokens=req.num_tokens, block_size=bs)
        self.rules["kv.miss"] += full > 0 and not hit  # pragma: no mutate
        self.rules["kv.hit_partial"] += 0 < len(hit) < full  # pragma: no mutate
        self.rules["kv.hit_full"] += 0 < len(hit) == full  # pragma: no mutate
        self.rules["kv.hit_capped"] += 0 < len(hit) == full and req.num_tokens % bs == 0  # pragma: no mutate
        return hit

    def _allocate_admission(self, req: _Request, hit: list[int], n: int) -> bool:
        """KVCacheManager.allocate_slots for a waiting request with its prefix
        hit. With scheduler_reserve_full_isl the whole sequence must fit first
        (``full_sequence_must_fit``), then this step's tokens."""
        cfg = self._config
        bs = cfg.block_size
        evictable = sum(1 for b in hit if self.kv.ref_cnt[b] == 0)

        def fits(target_tokens: int) -> bool:
            need = admission_blocks_needed(
                target_tokens=target_tokens,
                block_size=bs,
                num_hit_blocks=len(hit),
                num_evictable_hits=evictable,
            )
            return need <= self.kv.num_free

        if cfg.scheduler_reserve_full_isl and not fits(min(req.num_tokens, cfg.max_model_len)):
            self.rules["admit.blocked_full_sequence"] += 1  # pragma: no mutate
            return False
        num_hit_tokens = len(hit) * bs
        target = min(num_hit_tokens + n + cfg.num_lookahead_tokens, cfg.max_model_len)
        if not fits(target):
            self.rules["admit.blocked_blocks"] += 1  # pragma: no mutate
            return False
        self.kv.touch(hit)
        req.blocks = list(hit)
        req.num_cached_blocks = len(hit)
        num_new = max(blocks_for_tokens(num_tokens=target, block_size=bs) - len(hit), 0)
        req.blocks.extend(self.kv.get_new_blocks(num_new))
        self._cache_blocks(req, min(num_hit_tokens + n, req.num_tokens))
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
            num_waiting=len(self.waiting),
        )
        st = _StepState(token_budget=cfg.max_num_batched_tokens, threshold=threshold)
        self.rules["schedule.threshold_active"] += threshold > 0  # pragma: no mutate
        self._schedule_running(st)
        self.rules["schedule.waiting_skipped"] += len(st.preempted) > 0 and len(self.waiting) > 0  # pragma: no mutate
        if not st.preempted:
            self._schedule_waiting(st)
        assert len(self.running) <= cfg.max_num_seqs
        return self._make_plan(st)

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
            n = running_chunk(
                num_tokens=req.num_tokens,
                num_computed=req.num_computed_tokens,
                threshold=st.threshold,
                token_budget=st.token_budget,
                max_model_len=cfg.max_model_len,
                num_spec_tokens=len(req.spec_token_ids),
                num_output_placeholders=req.num_output_placeholders,
            )
            if n == 0:
                self.rules["running.skip_no_tokens"] += 1  # pragma: no mutate
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
            self.rules["preempt.fcfs_tail"] += self._config.policy == Policy.FCFS  # pragma: no mutate
            self.rules["preempt.priority_victim"] += self._config.policy == Policy.PRIORITY  # pragma: no mutate
            victim = self.requests[self.running.pop(v)]
            if v < i:
                self.rules["preempt.victim_ahead"] += 1  # pragma: no mutate
                i -= 1
            if victim.request_id in st.scheduled:
                self.rules["preempt.budget_give_back"] += 1  # pragma: no mutate
                st.token_budget += st.scheduled.pop(victim.request_id)[2]
            self._preempt_request(victim)
            st.preempted.append(victim.request_id)
            if victim is req:
                self.rules["preempt.self"] += 1  # pragma: no mutate
                return False, i
        return True, i

    def _schedule_waiting(self, st: _StepState) -> None:
        """Phase 2, the WAITING loop (only in a step that preempted nobody):
        admit from the head of the waiting queue while the budget, max_num_seqs
        and the pool allow; the first request that cannot be admitted stops
        the loop (head-of-line)."""
        skipped = 0  # requests passed over this step, at the head of the queue
        while st.token_budget > 0 and len(self.waiting) > skipped:
            if len(self.running) >= self._config.max_num_seqs:
                self.rules["waiting.stop_max_num_seqs"] += 1  # pragma: no mutate
                return  # vLLM: break
            req = self.requests[self._waiting_order()[skipped]]
            if req.num_stale_output_tokens and not req.drop_stale_output:
                # Async scheduling: output of a step in flight when it was
                # preempted will still be delivered; resuming now could
                # resample a position that output fills. vLLM's skip_request
                # pops it and prepends it again after the loop, so it keeps
                # its place at the head.
                self.rules["waiting.skip_stale_output"] += 1  # pragma: no mutate
                skipped += 1
                continue
            if not self._admit(st, req):
                return  # vLLM: break
        self.rules["waiting.stop_budget"] += len(self.waiting) > skipped  # pragma: no mutate

    def _admit(self, st: _StepState, req: _Request) -> bool:
        """One admission of the WAITING loop: the prefix hit, the chunk past it,
        the blocks; then the request moves to the running queue as NEW or
        RESUMED. False when it cannot be admitted (nothing changes)."""
        cfg = self._config
        assert req.num_computed_tokens == 0 and not req.blocks
        hit = self._get_computed_blocks(req)
        num_hit_tokens = len(hit) * cfg.block_size
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
            return False  # vLLM: "Prefer to not schedule than schedule un-padded" (break)
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
            return False  # chunked prefill off and the prompt does not fit the budget
        if not self._allocate_admission(req, hit, n):
            return False  # head-of-line: nothing behind it is tried
        rid = req.request_id
        self.waiting.remove(rid)
        self.running.append(rid)
        kind = ScheduleKind.NEW if req.status == RequestStatus.WAITING else ScheduleKind.RESUMED
        self.rules["admit.new"] += kind == ScheduleKind.NEW  # pragma: no mutate
        self.rules["admit.resumed"] += kind == ScheduleKind.RESUMED  # pragma: no mutate
        self.rules["admit.prefill_chunk"] += num_hit_tokens + n < req.num_tokens  # pragma: no mutate
        req.set_status(RequestStatus.RUNNING)
        req.num_computed_tokens = num_hit_tokens
        st.scheduled[rid] = (kind, num_hit_tokens, n, drafts)
        st.token_budget -= n
        return True

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
        for rid, (kind, computed, n, drafts) in st.scheduled.items():
            req = self.requests[rid]
            entries.append(
                ScheduledRequest.of(rid, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
                                    all_token_ids=req.all_token_ids, block_ids=tuple(req.blocks),
                                    spec_token_ids=drafts,
                                    num_output_placeholders=req.num_output_placeholders)
            )
            req.num_computed_tokens = computed + n
            req.num_in_flight_tokens += n
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
            if cfg.async_scheduling and not req.is_prefill_chunk:
                self.rules["async.placeholders_added"] += 1  # pragma: no mutate
                req.num_output_placeholders += 1 + len(drafts)
                req.spec_token_ids = [-1] * cfg.num_speculative_tokens
        plan = StepPlan(
            step=self.step,
            scheduled=tuple(entries),
            preempted_ids=tuple(sorted(self.preempted)),
            finished_ids=tuple(sorted(self.finished)),
        )
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
        calls next: vllm/v1/engine/core.py, EngineCore.post_step)."""
        cfg = self._config
        check_result(plan, self.in_flight, result, self.requests, cfg)
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
            if stale and req.drop_stale_output:
                self.rules["async.stale_dropped"] += 1  # pragma: no mutate
                continue  # drop-mode stale output is discarded entirely
            if s.spec_token_ids and toks:
                self._roll_back_rejected(req, len(s.spec_token_ids) - (len(toks) - 1), stale)
            if not toks:
                continue
            had_placeholders = req.num_output_placeholders > 0
            was_running = req.status == RequestStatus.RUNNING
            status = self._update_request_with_output(req, toks, stale)
            if not stale and was_running and (had_placeholders or cfg.num_speculative_tokens > 0):
                # KVCacheManager.cache_blocks(request, num_computed_tokens -
                # num_in_flight_tokens): the blocks the verified tokens filled
                self._cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)
            if status is not None:
                if was_running:
                    stopped.append(req.request_id)
                else:
                    # stale output stopped a preempted request: it leaves the
                    # waiting queue (update_from_output, stopped_preempted_reqs)
                    self.rules["async.stale_output_stopped"] += 1  # pragma: no mutate
                    self.waiting.remove(req.request_id)
                self._finish(req, status)
        self.running = [r for r in self.running if r not in stopped]
        self.in_flight = self.in_flight[1:]
        if not cfg.async_scheduling:
            self._update_draft_token_ids(result)

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
            req.spec_token_ids = list(drafts)

    # ------------------------------------------------------------------ view

    def view(self) -> SchedulerView:
        return SchedulerView(
            config=self._config,
            step=self.step,
            requests={rid: r.view() for rid, r in self.requests.items()},
            waiting=tuple(self._waiting_order()),
            running=tuple(self.running),
            kv=self.kv.view(),
            finished=dict(self.finished),
            preempted_since_plan=tuple(sorted(self.preempted)),
        )
