"""The KV connector in impl: the same decisions as the spec's
(spec/connector.py), with impl's structures, written from the rules (docs/spec.md,
"The KV connector") and vLLM 0.33's scheduler (vllm/v1/core/sched/scheduler.py).

A config with ``kv_connector`` takes the gate rules for good (impl/waiting.py's
admissions, impl/running.py's deferred frees, impl/update.py's
``_update_general``); the per-request rules of the connector live here, as
methods the phases and the update call:

- the modelled connector's answers (get_num_new_matched_tokens,
  request_finished) and the loads of a plan (update_state_after_alloc,
  build_connector_meta);
- kv_holding_waiting: waiting requests that hold blocks (an asynchronous load,
  or its promotion), a plain list served before the waiting queue (it holds
  few requests; the order of the list is the spec's, which
  _handle_invalid_blocks reads);
- blocks kept by finished requests (an asynchronous save, an abort during a
  load) until the worker reports them;
- defer_block_free (async scheduling with a consumer connector): frees fenced
  until the steps that may still write the blocks are processed;
- the worker's reports in update(): failed loads, invalid blocks (truncation
  at the first invalid block, under both failure policies), finished loads
  and saves.

The plain layout only (one full-attention group): hybrid KV cache groups are
not implemented in impl (ImplScheduler.KV).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Protocol, TypeVar

from schedspec.spec.interface import (
    KVLoad,
    Policy,
    RequestSpec,
    RequestStatus,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from schedspec.spec.protocol import check_kv_reports, check_kv_reset

from schedspec.impl.queues import Queued

if TYPE_CHECKING:
    from schedspec.impl.free_queue import FreeBlockQueue
    from schedspec.impl.prefix_index import PrefixIndex
    from schedspec.impl.queues import FcfsWaiting, PriorityWaiting

_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
_SAVE_ON = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVRequest(Queued, Protocol):
    """What the connector's rules read and write of impl's request
    (impl/request.py's Request)."""

    request_id: str
    status: RequestStatus
    num_computed_tokens: int
    num_tokens: int
    block_ids: list[int]
    cached_block_tuple: tuple[int, ...] | None
    num_slots: int
    num_cached_blocks: int
    next_full_at: int
    num_preemptions: int
    last_scheduled_seq: int
    priority: int
    arrival: int
    is_prefill_chunk: bool
    waiting_seq: int
    num_in_flight_tokens: int

    @property
    def spec(self) -> RequestSpec: ...


R = TypeVar("R", bound=KVRequest)


class ConnectorMixin(Generic[R]):
    """ImplScheduler's KV connector state and rules."""

    # provided by ImplScheduler
    _config: SchedulerConfig
    _bs: int
    _caching: bool
    _requests: dict[str, R]
    _running: list[R]
    _fq: "FreeBlockQueue"
    _ref: list[int]
    _px: "PrefixIndex"
    _waiting: "FcfsWaiting[R] | PriorityWaiting[R]"

    # hybrid KV cache groups (impl/kv_groups.py, GroupsMixin)
    _hybrid: bool
    _live_sessions: int
    _g_free_request: Callable[[R], None]
    _g_pop_for_free: Callable[[R], list[int]]
    _g_held_blocks: Callable[[R], tuple[int, ...]]
    _g_remove_skipped: Callable[[R, int], None]
    _g_need: Callable[..., int]
    _group_tuples: Callable[[R], tuple[tuple[int, ...], ...]]
    _g_tables: Callable[[R], list[list[int]]]

    def _free(self, table: list[int]) -> None:
        raise NotImplementedError

    def _register(self, req: R, upto: int) -> None:
        raise NotImplementedError

    def _init_connector(self, config: SchedulerConfig) -> None:
        self._connector = config.kv_connector
        self._fail_policy = config.kv_load_failure_policy == "fail"
        # kv_holding_waiting, in the spec's list order
        self._kv_holding_waiting: list[R] = []
        # finished requests keeping their blocks (vLLM: still in Scheduler.requests)
        self._held: dict[str, R] = {}
        # finished_recving_kv_req_ids / failed_recving_kv_req_ids
        self._loads_done: set[str] = set()
        self._loads_failed: set[str] = set()
        # asynchronous loads not reported yet: request -> the blocks it writes
        self._loading: dict[str, tuple[int, ...]] = {}
        # _inflight_prefills
        self._inflight_prefills: set[str] = set()
        # this schedule's loads, for the plan (build_connector_meta)
        self._pending_loads: list[KVLoad] = []
        # defer_block_free: sched_step_seq, processed_step_seq, deferred_frees
        self._defer_free = config.kv_connector and config.max_concurrent_batches > 1
        self._sched_seq = 0
        self._processed_seq = 0
        self._deferred_frees: list[tuple[int, list[int]]] = []

    def _clone_connector(self, d: dict[str, Any], remap: dict[int, R]) -> None:
        d["_kv_holding_waiting"] = [remap[id(r)] for r in self._kv_holding_waiting]
        d["_held"] = {rid: remap[id(r)] for rid, r in self._held.items()}
        d["_loads_done"] = self._loads_done.copy()
        d["_loads_failed"] = self._loads_failed.copy()
        d["_loading"] = self._loading.copy()
        d["_inflight_prefills"] = self._inflight_prefills.copy()
        d["_pending_loads"] = self._pending_loads[:]
        d["_deferred_frees"] = [(f, b[:]) for f, b in self._deferred_frees]

    # ------------------------------------------------------------ queues

    def _kv_holding_head(self) -> R:
        """The head of kv_holding_waiting in service order."""
        kvh = self._kv_holding_waiting
        if self._config.policy == Policy.FCFS or len(kvh) == 1:
            return kvh[0]
        return min(kvh, key=lambda r: (r.priority, r.arrival, r.request_id))

    def _kv_holding_order(self) -> list[R]:
        if self._config.policy == Policy.FCFS:
            return list(self._kv_holding_waiting)
        return sorted(self._kv_holding_waiting, key=lambda r: (r.priority, r.arrival, r.request_id))

    def _skip(self, req: R, from_kvh: bool, skipped: list[R], skipped_kvh: list[R]) -> None:
        """skip_request: the WAITING loop passes ``req`` (the head of its
        queue) over; it goes back to the head of kv_holding_waiting if it now
        holds blocks (a promoted or started load), else of the waiting queue."""
        if from_kvh:
            self._kv_holding_waiting.remove(req)
        else:
            self._waiting.pop_head()
        if (self._connector or self._live_sessions) and (req.num_computed_tokens > 0 or req.status is _REMOTE):
            skipped_kvh.append(req)
        else:
            skipped.append(req)

    def _after_schedule_kv(self, out: list[R]) -> None:
        """_update_after_schedule's connector part: the fence of
        defer_block_free advances with a step that scheduled tokens, and a
        request that is no longer prefilling leaves the in-flight prefills."""
        if self._defer_free and out:
            self._sched_seq += 1
            seq = self._sched_seq
            for r in out:
                r.last_scheduled_seq = seq
        prefills = self._inflight_prefills
        if prefills:
            for r in out:
                if not r.is_prefill_chunk:
                    prefills.discard(r.request_id)

    # ------------------------------------------------------------ freeing

    def _free_table(self, req: R) -> None:
        """_free_request_blocks: free the request's table now, or, with
        defer_block_free while a step it was scheduled in is unprocessed,
        behind a fence; the request keeps an empty table."""
        now = not self._defer_free or req.last_scheduled_seq <= self._processed_seq
        if self._hybrid:
            if now:
                self._g_free_request(req)
            else:
                popped = self._g_pop_for_free(req)
                if popped:
                    self._deferred_frees.append((self._sched_seq, popped))
        elif req.block_ids:
            if now:
                self._free(req.block_ids)
            else:
                self._deferred_frees.append((self._sched_seq, req.block_ids))
        req.block_ids = []
        req.cached_block_tuple = ()
        req.num_slots = 0

    def _drain_deferred_frees(self) -> None:
        self._processed_seq += 1
        fences = self._deferred_frees
        while fences and fences[0][0] <= self._processed_seq:
            self._free(fences.pop(0)[1])

    def _finish_keeps_blocks(self, req: R, status: RequestStatus, delay: bool) -> bool:
        """_free_request's connector part: whether the finished request keeps
        its blocks (an abort during an unreported load, or the modelled
        connector's request_finished: an asynchronous save of a request that
        finished normally)."""
        self._inflight_prefills.discard(req.request_id)
        if self._hybrid:
            # the blocks out of a sliding window go before the table goes to the connector
            self._g_remove_skipped(req, max(0, req.num_computed_tokens - req.num_in_flight_tokens))
        return delay or (req.spec.kv_save_async and status in _SAVE_ON)

    # ------------------------------------------------------------ admission

    def _external_tokens(self, req: R, local: int) -> tuple[int, bool]:
        """get_num_new_matched_tokens of the modelled connector past the
        block-aligned local hit (whole blocks: the partial-tail rules never
        cut)."""
        n = req.spec.kv_external_tokens - local
        if n <= 0:
            return 0, False
        return n, req.spec.kv_load_async

    def _async_load_reserve(self) -> int:
        """An asynchronous load's reserved blocks: what the in-flight prefills
        still need for their whole sequence (one group, no cap), plus one
        speculative step's blocks."""
        cfg = self._config
        bs = self._bs
        mml = cfg.max_model_len
        k = cfg.num_speculative_tokens
        step = 1 + k + cfg.num_lookahead_tokens  # one speculative step with the drafter's lookahead
        hyb = self._hybrid
        total = _cdiv(step, bs) * (len(cfg.groups) if hyb else 1) if k else 0
        requests = self._requests
        for rid in self._inflight_prefills:
            r = requests[rid]
            num = min(r.num_tokens, mml)
            if k:
                num += step
            if hyb:  # summed over the groups, a sliding window at its admission cap
                total += self._g_need(r, num, None, r.num_computed_tokens, True)
            else:
                total += max(_cdiv(num, bs) - len(r.block_ids), 0)
        return total

    def _record_load(self, req: R, start: int, num_external: int, asynchronous: bool) -> None:
        """update_state_after_alloc: a load of the external tokens, for the plan."""
        if num_external <= 0:
            return
        end = start + num_external
        blocks = tuple(req.block_ids)
        groups = self._group_tuples(req) if self._hybrid else ()
        self._pending_loads.append(KVLoad(req.request_id, start, end, blocks, asynchronous, groups))
        if asynchronous:
            bs = self._bs
            self._loading[req.request_id] = blocks[start // bs : _cdiv(end, bs)]

    def _promote(self, req: R) -> None:
        """_update_waiting_for_remote_kv: a reported load's blocks are cached
        (after a failure only those below the truncation; nothing computed
        frees them), the last token is left to compute, and the request
        waits again."""
        rid = req.request_id
        if rid in self._loads_failed:
            self._loads_failed.remove(rid)
            if req.num_computed_tokens:
                self._cache_upto(req, req.num_computed_tokens)
            else:
                if self._hybrid:  # kv_cache_manager.free: never deferred
                    self._g_free_request(req)
                else:
                    self._free(req.block_ids)
                    req.num_cached_blocks = 0
                    if self._caching:
                        req.next_full_at = self._bs
                req.block_ids = []
                req.cached_block_tuple = ()
                req.num_slots = 0
        else:
            self._cache_upto(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1
        self._loads_done.remove(rid)
        req.status = _PREEMPTED if req.num_preemptions else _WAITING

    def _cache_upto(self, req: R, num_tokens: int) -> None:
        """cache_blocks(request, num_tokens), at most the known tokens."""
        if not self._caching:
            return
        upto = min(num_tokens, req.num_tokens)
        if upto >= req.next_full_at:
            self._register(req, upto)

    # ------------------------------------------------------------ update

    def _kv_reports(self, plan: StepPlan, result: StepResult) -> set[str]:
        """update()'s connector part before the entries: the reports checked
        (the protocol's errors), the deferred frees whose fence has passed, the
        failed loads and invalid blocks. Returns the requests whose output of
        this step is skipped (a failed or truncated load)."""
        check_kv_reports(
            plan, result, self._config, self._loading, self._held, {r.request_id for r in self._running}
        )
        if self._defer_free and plan.total_num_scheduled_tokens > 0:
            self._drain_deferred_frees()
        failed = self._handle_failed_recving(result.failed_recving)
        if result.invalid_block_ids:
            failed |= self._handle_invalid_blocks(set(result.invalid_block_ids), plan)
        return failed

    def _handle_failed_recving(self, failed: Iterable[str]) -> set[str]:
        affected: set[str] = set()
        recompute = not self._fail_policy
        for rid in sorted(failed):
            req = self._requests.get(rid)
            if req is None or req.status is not _REMOTE:
                continue
            affected.add(rid)
            if recompute:
                req.num_computed_tokens = 0
                self._loads_failed.add(rid)
        return set() if recompute else affected

    def _handle_invalid_blocks(self, invalid: set[int], plan: StepPlan) -> set[str]:
        scheduled = {s.request_id: s.num_scheduled_tokens for s in plan.scheduled}
        loading = [r for r in self._kv_holding_waiting if r.status is _REMOTE]
        async_ids, _ = self._truncate_invalid(loading, invalid, scheduled)
        sync_ids, evict = self._truncate_invalid(self._running, invalid, scheduled)
        if not async_ids and not sync_ids:
            return set()
        if self._fail_policy:
            if self._caching:
                px = self._px
                node_of = px.block_node
                # vLLM evicts in the iteration order of the set it builds
                # (spec/kv_cache.py, evict_blocks): the BlockRemoved order
                for b in evict if px.events is None else set(evict):
                    if node_of[b] is not None:
                        px.evict(b)
            return async_ids | sync_ids
        self._loads_failed |= async_ids
        return sync_ids

    def _truncate_invalid(
        self, reqs: list[R], invalid: set[int], scheduled: dict[str, int]
    ) -> tuple[set[str], list[int]]:
        """_update_requests_with_invalid_blocks: computed tokens (less this
        plan's) truncated at the first invalid block not marked by an earlier
        request."""
        bs = self._bs
        affected: set[str] = set()
        evict: list[int] = []
        marked: set[int] = set()
        for req in reqs:
            computed = req.num_computed_tokens - scheduled.get(req.request_id, 0)
            table = req.block_ids[: _cdiv(computed, bs)]
            hits = [i for i, b in enumerate(table) if b in invalid]
            if not hits:
                continue
            affected.add(req.request_id)
            fresh = [i for i in hits if table[i] not in marked]
            marked.update(table[i] for i in hits)
            if fresh:
                req.num_computed_tokens = fresh[0] * bs
                evict.extend(b for b in req.block_ids[fresh[0]:] if b not in evict)
            else:
                req.num_computed_tokens = computed
        return affected, evict

    def _kv_finished(self, result: StepResult) -> None:
        """_update_from_kv_xfer_finished: a reported load marks its request
        done (promoted by the next WAITING loop) or frees a finished one's
        blocks; a reported save frees them."""
        requests = self._requests
        held = self._held
        for rid in sorted(result.finished_recving):
            self._loading.pop(rid, None)
            if rid in requests:
                self._loads_done.add(rid)
            else:
                self._free_table(held.pop(rid))
        for rid in sorted(result.finished_sending):
            self._free_table(held.pop(rid))

    # ------------------------------------------------------------ reset, view

    def _check_kv_reset(self) -> None:
        """reset_prefix_cache(reset_running_requests=True) is refused when
        blocks would stay held (the spec's reasons, in its order)."""
        kept: str | None = None
        if self._held:
            kept = f"finished request {min(self._held)!r} keeps its blocks for the connector"
        else:
            for r in self._kv_holding_waiting:
                if r.block_ids or (self._hybrid and any(self._g_tables(r))):
                    kept = f"waiting request {r.request_id!r} holds blocks for a KV load"
                    break
            else:
                if self._deferred_frees or (
                    self._defer_free and any(r.last_scheduled_seq > self._processed_seq for r in self._running)
                ):
                    kept = "a step in flight still writes blocks whose free is deferred (defer_block_free)"
        check_kv_reset(kept)

    def _connector_view(self) -> dict[str, Any]:
        if not self._connector:
            return {}
        return {
            "kv_held_by_finished": {
                rid: self._g_held_blocks(r) if self._hybrid else tuple(b for b in r.block_ids if b)
                for rid, r in sorted(self._held.items())
            },
            "kv_loads_done": tuple(sorted(self._loads_done)),
            "kv_loads_failed": tuple(sorted(self._loads_failed)),
        }

    @staticmethod
    def _finished_view_without_blocks(view: Any) -> Any:
        return dataclasses.replace(view, block_ids=())
