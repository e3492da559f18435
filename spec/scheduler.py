"""The reference scheduler: vLLM 0.33.0's v1 Scheduler, written to be read.

Each rule names the vLLM function whose behaviour it captures; unless said
otherwise the file is vllm/v1/core/sched/scheduler.py (Scheduler) and the KV
side lives in spec/kv_cache.py. Speed is no concern here.

The modelled configuration: one full-attention KV group, synchronous
scheduling, no speculative decoding, no KV connectors, no LoRA, no
multimodal inputs, watermark 0, one sampled token per step.
"""

from __future__ import annotations

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
    spec: RequestSpec
    status: RequestStatus = RequestStatus.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # blocks of the table already given a key
    num_preemptions: int = 0

    @property
    def rid(self) -> str:
        return self.spec.request_id

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.spec.prompt_token_ids + tuple(self.output)

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output)

    def key(self, block_index: int, block_size: int) -> BlockKey:
        """The content key of this request's block ``block_index``."""
        return (self.spec.salt, self.tokens[: (block_index + 1) * block_size])

    def set_status(self, new: RequestStatus) -> None:
        assert is_legal_transition(self.status, new), f"{self.rid}: {self.status} -> {new}"
        self.status = new

    def copy(self) -> _Request:
        """An independent copy: the lists are copied, the frozen spec shared."""
        new: _Request = _new(_Request)
        d = new.__dict__
        d.update(self.__dict__)
        d["output"] = self.output[:]
        d["blocks"] = self.blocks[:]
        return new

    def view(self) -> RequestView:
        return RequestView.of(
            self.spec,
            status=self.status,
            output_token_ids=tuple(self.output),
            num_computed_tokens=self.num_computed,
            block_ids=tuple(self.blocks),
            num_preemptions=self.num_preemptions,
        )


class SpecScheduler:
    """Implements spec.interface.Scheduler."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = check_config(config)
        self.kv = KVPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
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
        return sorted(self.waiting, key=self._pkey)

    def _pkey(self, rid: str) -> tuple[int, int, str]:
        s = self.requests[rid].spec
        return priority_key(s.priority, s.arrival, s.request_id)

    def _enqueue_front(self, rid: str) -> None:
        """A preempted request goes back to the front of the waiting queue
        (_preempt_request: ``self.waiting.prepend_request``; for PRIORITY the
        heap orders it by key instead)."""
        self.waiting.insert(0, rid)

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
            self.running.remove(request_id)
        else:
            self.waiting.remove(request_id)
        self._finish(req, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: _Request, status: RequestStatus) -> None:
        """_free_request: free the blocks, forget the request, report its id in
        the next plan's finished ids."""
        req.set_status(status)
        self.kv.free(req.blocks)
        req.blocks = []
        del self.requests[req.rid]
        self.finished[req.rid] = req.view()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """reset_prefix_cache. With reset_running_requests, every running request
        is preempted first, last first, so they come back in their order."""
        check_reset(self.outstanding)
        if reset_running_requests:
            while self.running:
                self._preempt(self.requests[self.running.pop()])
        return self.kv.reset()

    # ------------------------------------------------------------------ KV

    def _preempt(self, req: _Request) -> None:
        """_preempt_request: free every block, forget all computed tokens (the
        KV is recomputed on resume), keep the generated tokens."""
        req.set_status(RequestStatus.PREEMPTED)
        self.kv.free(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0
        req.num_computed = 0
        req.num_preemptions += 1
        self._enqueue_front(req.rid)
        self.preempted.add(req.rid)

    def _cache_full_blocks(self, req: _Request, num_tokens: int) -> None:
        """Give a key to every block that is full once ``num_tokens`` tokens are
        computed. Called at allocation time, before the step runs
        (KVCacheManager.allocate_slots -> cache_blocks with
        ``min(computed + new, request.num_tokens)``)."""
        if not self.kv.enable_caching:
            return
        bs = self._config.block_size
        num_full = num_tokens // bs
        for i in range(req.num_cached_blocks, num_full):
            self.kv.register(req.blocks[i], req.key(i, bs))
        req.num_cached_blocks = max(req.num_cached_blocks, num_full)

    def _allocate_running(self, req: _Request, n: int) -> bool:
        """KVCacheManager.allocate_slots for a running request (no new hits)."""
        target = min(req.num_computed + n, self._config.max_model_len)
        need = max(blocks_for_tokens(target, self._config.block_size) - len(req.blocks), 0)
        if need > self.kv.num_free:
            return False
        req.blocks.extend(self.kv.allocate(need))
        self._cache_full_blocks(req, min(req.num_computed + n, req.num_tokens))
        return True

    def _find_hit(self, req: _Request) -> list[int]:
        """KVCacheManager.get_computed_blocks: the longest run of cached full
        blocks from the start, at most ``num_tokens - 1`` tokens."""
        if not self.kv.enable_caching:
            return []
        hit: list[int] = []
        for i in range(max_hit_blocks(req.num_tokens, self._config.block_size)):
            block = self.kv.lookup(req.key(i, self._config.block_size))
            if block is None:
                break
            hit.append(block)
        return hit

    def _allocate_admission(self, req: _Request, hit: list[int], n: int) -> bool:
        """KVCacheManager.allocate_slots for a waiting request with its prefix
        hit. With scheduler_reserve_full_isl the whole sequence must fit first
        (``full_sequence_must_fit``), then this step's tokens."""
        cfg = self._config
        bs = cfg.block_size
        evictable = sum(1 for b in hit if self.kv.ref_cnt[b] == 0)
        if cfg.scheduler_reserve_full_isl:
            full = min(req.num_tokens, cfg.max_model_len)
            if admission_blocks_needed(full, bs, len(hit), evictable) > self.kv.num_free:
                return False
        num_hit_tokens = len(hit) * bs
        target = min(num_hit_tokens + n, cfg.max_model_len)
        if admission_blocks_needed(target, bs, len(hit), evictable) > self.kv.num_free:
            return False
        self.kv.touch(hit)
        req.blocks = list(hit)
        req.num_cached_blocks = len(hit)
        req.blocks.extend(self.kv.allocate(max(blocks_for_tokens(target, bs) - len(hit), 0)))
        self._cache_full_blocks(req, min(num_hit_tokens + n, req.num_tokens))
        return True

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan:
        """schedule(): running requests first, then waiting ones, and those only
        in a step that preempted nobody."""
        check_schedule(self.outstanding)
        cfg = self._config
        self.step += 1
        budget = cfg.max_num_batched_tokens
        threshold = effective_threshold(
            cfg.long_prefill_token_threshold, len(self.running), len(self.waiting)
        )
        # request id -> (kind, computed before, scheduled); dict order = scheduling order
        scheduled: dict[str, tuple[ScheduleKind, int, int]] = {}
        preempted_now: list[str] = []

        # Phase 1: the RUNNING loop.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.requests[self.running[i]]
            n = running_chunk(req.num_tokens, req.num_computed, threshold, budget, cfg.max_model_len)
            if n == 0:
                i += 1  # skipped, not a stop ("continue" in vLLM)
                continue
            allocated = self._allocate_running(req, n)
            while not allocated:
                # Preempt the lowest-priority running request and retry.
                keys = [self._pkey(r)[:2] for r in self.running]
                v = choose_victim(cfg.policy, [(p, a) for p, a in keys])
                victim = self.requests[self.running.pop(v)]
                if v < i:
                    i -= 1
                if victim.rid in scheduled:  # PRIORITY only: give its budget back
                    budget += scheduled.pop(victim.rid)[2]
                self._preempt(victim)
                preempted_now.append(victim.rid)
                if victim is req:
                    break
                allocated = self._allocate_running(req, n)
            if not allocated:
                if cfg.policy == Policy.PRIORITY and req.status == RequestStatus.PREEMPTED:
                    continue  # it preempted itself; later requests may still fit
                break
            scheduled[req.rid] = (ScheduleKind.RUNNING, req.num_computed, n)
            budget -= n
            i += 1

        # Phase 2: the WAITING loop, only if nothing was preempted.
        if not preempted_now:
            while budget > 0 and self.waiting:
                if len(self.running) >= cfg.max_num_seqs:
                    break
                rid = self._waiting_order()[0]
                req = self.requests[rid]
                assert req.num_computed == 0 and not req.blocks
                hit = self._find_hit(req)
                num_hit_tokens = len(hit) * cfg.block_size
                n = admission_chunk(
                    req.num_tokens, num_hit_tokens, threshold, budget, cfg.enable_chunked_prefill
                )
                if n == 0:
                    break  # chunked prefill off and the prompt does not fit the budget
                if not self._allocate_admission(req, hit, n):
                    break  # head-of-line: nothing behind it is tried
                self.waiting.remove(rid)
                self.running.append(rid)
                kind = ScheduleKind.NEW if req.status == RequestStatus.WAITING else ScheduleKind.RESUMED
                req.set_status(RequestStatus.RUNNING)
                req.num_computed = num_hit_tokens
                scheduled[rid] = (kind, num_hit_tokens, n)
                budget -= n

        assert len(self.running) <= cfg.max_num_seqs
        # Build the plan, then advance computed tokens (_update_after_schedule).
        entries = []
        for rid, (kind, computed, n) in scheduled.items():
            req = self.requests[rid]
            entries.append(
                ScheduledRequest(
                    request_id=rid,
                    kind=kind,
                    num_computed_tokens=computed,
                    num_scheduled_tokens=n,
                    num_tokens=req.num_tokens,
                    block_ids=tuple(req.blocks),
                    token_ids=req.tokens[computed : computed + n],
                )
            )
            req.num_computed = computed + n
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
        check_result(plan, self.outstanding, result, self.requests)
        cfg = self._config
        stopped: list[str] = []
        for s in plan.scheduled:
            req = self.requests.get(s.request_id)
            toks = result.sampled.get(s.request_id, ())
            if req is None or not toks:
                continue
            req.output.append(toks[0])
            reason = stop_reason(
                toks[0],
                len(req.output),
                req.num_tokens,
                req.spec.max_tokens,
                cfg.max_model_len,
                req.spec.eos_token_id,
                req.spec.ignore_eos,
                req.spec.stop_token_ids,
            )
            if reason is not None:
                status = (
                    RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH_CAPPED
                )
                self._finish(req, status)
                stopped.append(req.rid)
        self.running = [r for r in self.running if r not in stopped]
        self.outstanding = None

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
