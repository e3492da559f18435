"""The reference scheduler: vLLM 0.33.0's v1 Scheduler, written to be read.

Each rule names the vLLM function whose behaviour it captures; unless said
otherwise the file is vllm/v1/core/sched/scheduler.py (Scheduler) and the KV
side lives in spec/kv_cache.py. Speed is no concern here.

schedule() follows vLLM's Scheduler.schedule phase by phase: the RUNNING loop
(``_schedule_running``), the WAITING loop (``_schedule_waiting``), then the
plan and the advance of computed tokens (``_make_plan``, vLLM's
SchedulerOutput and ``_update_after_schedule``).

The modelled configuration: one full-attention KV group, synchronous
scheduling, no speculative decoding, no KV connectors, no LoRA, no
multimodal inputs, watermark 0, one sampled token per step.
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
    effective_threshold,
    max_hit_blocks,
    priority_key,
    running_chunk,
    stop_reason,
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
        return new

    def view(self) -> RequestView:
        return RequestView.of(
            self.spec,
            status=self.status,
            output_token_ids=tuple(self.output_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            block_ids=tuple(self.blocks),
            num_preemptions=self.num_preemptions,
        )


@dataclass
class _StepState:
    """What one schedule() call has decided so far (vLLM's locals of
    Scheduler.schedule: ``token_budget``, ``num_scheduled_tokens``,
    ``preempted_reqs``)."""

    token_budget: int
    threshold: int  # the long-prefill threshold in force this step (0 = off)
    # request id -> (kind, computed before, scheduled); dict order = scheduling order
    scheduled: dict[str, tuple[ScheduleKind, int, int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)


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
        self.outstanding: StepPlan | None = None  # the plan awaiting update()

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    def clone(self) -> SpecScheduler:
        """An independent scheduler in the same state (the model checker
        replays every transition of a state on its own copy). Only immutable
        values are shared (the config, request specs, views, the outstanding
        plan); the lists and dicts are copied by hand, several times faster
        than ``copy.deepcopy``. A subclass that adds mutable state of its own
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
            self.rules["abort.running"] += 1
            self.running.remove(request_id)
        else:
            self.rules["abort.waiting"] += req.status == RequestStatus.WAITING
            self.rules["abort.preempted"] += req.status == RequestStatus.PREEMPTED
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
        is preempted first, last first, so they come back in their order."""
        check_reset(self.outstanding)
        if reset_running_requests:
            while self.running:
                self.rules["preempt.reset_running"] += 1
                self._preempt_request(self.requests[self.running.pop()])
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ KV

    def _preempt_request(self, req: _Request) -> None:
        """_preempt_request: free every block, forget all computed tokens (the
        KV is recomputed on resume), keep the generated tokens."""
        req.set_status(RequestStatus.PREEMPTED)
        self.kv.free(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
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
        """KVCacheManager.allocate_slots for a running request (no new hits)."""
        target = min(req.num_computed_tokens + n, self._config.max_model_len)
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
        self.rules["kv.miss"] += full > 0 and not hit
        self.rules["kv.hit_partial"] += 0 < len(hit) < full
        self.rules["kv.hit_full"] += 0 < len(hit) == full
        self.rules["kv.hit_capped"] += 0 < len(hit) == full and req.num_tokens % bs == 0
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
            self.rules["admit.blocked_full_sequence"] += 1
            return False
        num_hit_tokens = len(hit) * bs
        target = min(num_hit_tokens + n, cfg.max_model_len)
        if not fits(target):
            self.rules["admit.blocked_blocks"] += 1
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
        check_schedule(self.outstanding)
        cfg = self._config
        self.step += 1
        threshold = effective_threshold(
            threshold=cfg.long_prefill_token_threshold,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
        )
        st = _StepState(token_budget=cfg.max_num_batched_tokens, threshold=threshold)
        self.rules["schedule.threshold_active"] += threshold > 0
        self._schedule_running(st)
        self.rules["schedule.waiting_skipped"] += len(st.preempted) > 0 and len(self.waiting) > 0
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
            n = running_chunk(
                num_tokens=req.num_tokens,
                num_computed=req.num_computed_tokens,
                threshold=st.threshold,
                token_budget=st.token_budget,
                max_model_len=cfg.max_model_len,
            )
            if n == 0:
                self.rules["running.skip_no_tokens"] += 1
                i += 1  # skipped, not a stop ("continue" in vLLM)
                continue
            allocated, i = self._allocate_or_preempt(st, req, n, i)
            if not allocated:
                if cfg.policy == Policy.PRIORITY and req.status == RequestStatus.PREEMPTED:
                    self.rules["running.self_preempted_continue"] += 1
                    continue  # it preempted itself; later requests may still fit
                self.rules["running.self_preempted_break"] += 1
                return  # vLLM: break out of the RUNNING loop
            self.rules["running.scheduled"] += 1
            self.rules["running.prefill_chunk"] += req.num_computed_tokens + n < req.num_tokens
            st.scheduled[req.request_id] = (ScheduleKind.RUNNING, req.num_computed_tokens, n)
            st.token_budget -= n
            i += 1
        self.rules["running.stop_budget"] += i < len(self.running)

    def _allocate_or_preempt(self, st: _StepState, req: _Request, n: int, i: int) -> tuple[bool, int]:
        """allocate_slots for ``req`` (at index ``i`` of the running queue); while
        it fails, preempt the lowest-priority running request and retry. A
        victim already scheduled this step gives its budget back (PRIORITY
        only). Returns whether ``req`` got its blocks (False once it preempted
        itself) and its index after the victims left the queue."""
        while not self._allocate_running(req, n):
            keys = [self._priority_key(r)[:2] for r in self.running]
            v = choose_victim(policy=self._config.policy, running_keys=keys)
            self.rules["preempt.fcfs_tail"] += self._config.policy == Policy.FCFS
            self.rules["preempt.priority_victim"] += self._config.policy == Policy.PRIORITY
            victim = self.requests[self.running.pop(v)]
            if v < i:
                self.rules["preempt.victim_ahead"] += 1
                i -= 1
            if victim.request_id in st.scheduled:
                self.rules["preempt.budget_give_back"] += 1
                st.token_budget += st.scheduled.pop(victim.request_id)[2]
            self._preempt_request(victim)
            st.preempted.append(victim.request_id)
            if victim is req:
                self.rules["preempt.self"] += 1
                return False, i
        return True, i

    def _schedule_waiting(self, st: _StepState) -> None:
        """Phase 2, the WAITING loop (only in a step that preempted nobody):
        admit from the head of the waiting queue while the budget, max_num_seqs
        and the pool allow; the first request that cannot be admitted stops
        the loop (head-of-line)."""
        while st.token_budget > 0 and self.waiting:
            if len(self.running) >= self._config.max_num_seqs:
                self.rules["waiting.stop_max_num_seqs"] += 1
                return  # vLLM: break
            if not self._admit(st, self.requests[self._waiting_order()[0]]):
                return  # vLLM: break
        self.rules["waiting.stop_budget"] += len(self.waiting) > 0

    def _admit(self, st: _StepState, req: _Request) -> bool:
        """One admission of the WAITING loop: the prefix hit, the chunk past it,
        the blocks; then the request moves to the running queue as NEW or
        RESUMED. False when it cannot be admitted (nothing changes)."""
        cfg = self._config
        assert req.num_computed_tokens == 0 and not req.blocks
        hit = self._get_computed_blocks(req)
        num_hit_tokens = len(hit) * cfg.block_size
        n = admission_chunk(
            num_tokens=req.num_tokens,
            num_hit_tokens=num_hit_tokens,
            threshold=st.threshold,
            token_budget=st.token_budget,
            chunked_prefill=cfg.enable_chunked_prefill,
        )
        if n == 0:
            self.rules["admit.blocked_chunking_off"] += 1
            return False  # chunked prefill off and the prompt does not fit the budget
        if not self._allocate_admission(req, hit, n):
            return False  # head-of-line: nothing behind it is tried
        rid = req.request_id
        self.waiting.remove(rid)
        self.running.append(rid)
        kind = ScheduleKind.NEW if req.status == RequestStatus.WAITING else ScheduleKind.RESUMED
        self.rules["admit.new"] += kind == ScheduleKind.NEW
        self.rules["admit.resumed"] += kind == ScheduleKind.RESUMED
        self.rules["admit.prefill_chunk"] += num_hit_tokens + n < req.num_tokens
        req.set_status(RequestStatus.RUNNING)
        req.num_computed_tokens = num_hit_tokens
        st.scheduled[rid] = (kind, num_hit_tokens, n)
        st.token_budget -= n
        return True

    def _make_plan(self, st: _StepState) -> StepPlan:
        """Phase 3: the plan in scheduling order (vLLM's SchedulerOutput), then
        each scheduled request's computed tokens advance
        (_update_after_schedule) and the finished and preempted ids since the
        previous plan are handed over."""
        entries = []
        for rid, (kind, computed, n) in st.scheduled.items():
            req = self.requests[rid]
            entries.append(
                ScheduledRequest.of(rid, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
                                    all_token_ids=req.all_token_ids, block_ids=tuple(req.blocks))
            )
            req.num_computed_tokens = computed + n
        plan = StepPlan(
            step=self.step,
            scheduled=tuple(entries),
            preempted_ids=tuple(sorted(self.preempted)),
            finished_ids=tuple(sorted(self.finished)),
        )
        self.preempted = set()
        self.finished = {}
        self.outstanding = plan
        return plan

    # ------------------------------------------------------------------ update

    def update(self, plan: StepPlan, result: StepResult) -> None:
        """update_from_output: append each sampled token, check stop
        (vllm/v1/core/sched/utils.py, check_stop), free finished requests in
        plan order."""
        check_result(plan, self.outstanding, result, self.requests, self._config)
        stopped: list[str] = []
        for s in plan.scheduled:
            req = self.requests.get(s.request_id)
            toks = result.sampled.get(s.request_id, ())
            self.rules["update.no_token"] += not toks
            if req is None or not toks:
                continue
            if self._append_and_check_stop(req, toks[0]):
                stopped.append(req.request_id)
        self.running = [r for r in self.running if r not in stopped]
        self.outstanding = None

    def _append_and_check_stop(self, req: _Request, token: int) -> bool:
        """Append ``token`` to ``req``'s output; finish it if it stops."""
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
            return False
        eos = token == req.spec.eos_token_id and not req.spec.ignore_eos
        self.rules["stop.eos"] += eos
        self.rules["stop.stop_token"] += reason == "stop" and not eos
        self.rules["stop.max_model_len"] += reason == "length" and req.num_tokens >= self._config.max_model_len
        self.rules["stop.max_tokens"] += reason == "length" and req.num_tokens < self._config.max_model_len
        status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH_CAPPED
        self._finish(req, status)
        return True

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
