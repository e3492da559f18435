"""The KV connector, as vLLM 0.33's scheduler drives it with the modelled
connector (spec/interface.py, SchedulerConfig.kv_connector).

Two parts. The modelled connector's scheduler side, as pure functions: what
vLLM's KVConnectorBase_V1 methods return for it
(vllm/distributed/kv_transfer/kv_connector/v1/base.py). And ConnectorMixin,
the part of SpecScheduler (spec/scheduler.py) that handles the connector's
state: the asynchronous loads (WAITING_FOR_REMOTE_KVS), the worker's reports
in update(), the blocks a finished request keeps for an asynchronous save or
an unfinished load, and the deferred frees of async scheduling. Unless said
otherwise every function cited is in vllm/v1/core/sched/scheduler.py
(Scheduler).

Where the connector enters the base path (spec/scheduler.py): the WAITING
loop serves kv_holding_waiting first, passes over a request whose load is
not reported yet and promotes a reported one (_pass_over,
``_update_waiting_for_remote_kv``); the prefix lookup adds the external
tokens (_prefix_lookup: ``get_num_new_matched_tokens``, ``external_hit``);
an admission records its load (``_record_load``) or starts an asynchronous
one (_start_async_load, leaving ``_async_load_reserve`` free); the RUNNING
loop stops at a victim whose free is deferred (``_blocks_can_be_freed``);
finishing keeps the blocks of a request loading or saving (_finish_request,
_finish: ``request_finished_delays_free``, ``held``); update() drains the
deferred frees, handles the failed loads and invalid blocks before the
output and the finished transfers after it; reset_prefix_cache refuses while
blocks stay held (``_blocks_kept_after_reset``).

The modelled configuration: kv_role "kv_both" (so the scheduler is both a KV
producer and a KV consumer: ``requires_kv_delivery`` is True, and with async
scheduling ``defer_block_free`` is on), no aux-output or EC connector, no
HiSparse (``defer_async_loads`` off), no DSV41 bounded replay
(``prefix_replay_tokens`` 0), no partial prefix-cache hits
(``enable_partial_hash_hits`` off: a local hit is whole blocks, so the
partial-tail rules of the WAITING loop never cut anything), the connector
returns False from ``has_pending_block_frees`` and
``supports_divergent_local_hybrid_hits`` (their base-class defaults).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple

from schedspec.spec.interface import (
    KVLoad,
    RequestStatus,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from schedspec.spec.coverage import CountsRules
from schedspec.spec.kv_cache import KVPool
from schedspec.spec.rules import blocks_for_tokens

if TYPE_CHECKING:
    from schedspec.spec.request_state import RequestState as _Request


# ---------------------------------------------------------------- the modelled connector


class MatchedTokens(NamedTuple):
    """What get_num_new_matched_tokens returns: the external tokens offered,
    and whether they load asynchronously."""

    num_external_tokens: int
    load_async: bool


class ExternalHit(NamedTuple):
    """The WAITING loop's split of a prefix hit after the partial-tail rules:
    the local tokens kept, the external tokens taken, and whether those load
    asynchronously."""

    num_local_tokens: int
    num_external_tokens: int
    load_async: bool


def get_num_new_matched_tokens(
    kv_external_tokens: int, kv_load_async: bool, num_computed_tokens: int
) -> MatchedTokens:
    """KVConnectorBase_V1.get_num_new_matched_tokens of the modelled
    connector: the external tokens beyond ``num_computed_tokens`` (the
    block-aligned local hit vLLM presents), and whether they load
    asynchronously. Stateless: asked at every admission.

    post: __return__.num_external_tokens >= 0
    post: __return__.load_async == (kv_load_async and __return__.num_external_tokens > 0)
    """
    n = max(0, kv_external_tokens - num_computed_tokens)
    return MatchedTokens(n, kv_load_async and n > 0)


def external_hit(
    num_local_tokens: int, block_size: int, offered: int, load_async: bool
) -> ExternalHit:
    """The WAITING loop's partial-tail rules (schedule(), "Present a
    block-aligned local hit to the connector"): with a local hit ending inside
    a block, a strictly longer remote hit drops the sub-block tail; a remote
    hit no longer than it loads nothing. The modelled local hit is whole blocks
    (partial hash hits are off), so the tail is always 0 and the offer is
    taken as it is.

    pre: num_local_tokens >= 0 and block_size > 0 and offered >= 0
    post: __return__.num_local_tokens + __return__.num_external_tokens >= num_local_tokens - num_local_tokens % block_size
    """
    tail = num_local_tokens % block_size
    if tail and offered > tail:
        return ExternalHit(num_local_tokens - tail, offered, load_async)
    if tail:
        return ExternalHit(num_local_tokens, 0, False)
    return ExternalHit(num_local_tokens, offered, load_async)


def request_finished_delays_free(kv_save_async: bool, status: RequestStatus) -> bool:
    """KVConnectorBase_V1.request_finished of the modelled connector: it
    keeps the blocks (delay_free_blocks) of a request that asked for an
    asynchronous save and finished normally (stopped or length-capped), not
    of an aborted or failed one.

    post: not __return__ or kv_save_async
    """
    return kv_save_async and status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
    )


def loaded_block_range(start: int, end: int, block_size: int) -> range:
    """The indices of a request's group-0 table that a load of tokens
    ``start .. end - 1`` writes (``start`` is block aligned).

    pre: 0 <= start <= end and block_size > 0
    """
    return range(start // block_size, blocks_for_tokens(num_tokens=end, block_size=block_size))


def truncate_at_invalid(
    table: list[int], num_computed: int, block_size: int, invalid: Iterable[int]
) -> int | None:
    """_update_requests_with_invalid_blocks for one request alone: the index
    of the first block among those holding its computed tokens that is
    invalid, or None."""
    bad = set(invalid)
    for idx, block in enumerate(table[: blocks_for_tokens(num_tokens=num_computed, block_size=block_size)]):
        if block in bad:
            return idx
    return None


# ---------------------------------------------------------------- the scheduler's part


class DeferredFree(NamedTuple):
    """A table whose free is deferred (defer_block_free): its blocks go back
    to the pool once the step ``fence`` has been processed."""

    fence: int  # sched_step_seq when the free was deferred
    blocks: list[int]


class InvalidBlocks(NamedTuple):
    """_update_requests_with_invalid_blocks's result for a set of requests."""

    affected: set[str]  # the requests truncated at an invalid block
    evict: list[int]  # the blocks to evict: each truncation's from there on


class ConnectorMixin(CountsRules):
    """The connector's state and handlers of SpecScheduler (vLLM Scheduler's
    fields of the same meaning are named at each)."""

    # provided by SpecScheduler
    _config: SchedulerConfig
    rules: Counter[str]
    kv: KVPool
    requests: dict[str, _Request]
    running: list[str]
    waiting: list[str]

    def _init_connector(self) -> None:
        # kv_holding_waiting: waiting requests that hold KV blocks (an
        # asynchronous load, or its promotion), drained before ``waiting``
        self.kv_holding: list[str] = []
        # finished requests still holding blocks (_free_request with
        # delay_free_blocks; vLLM keeps them in Scheduler.requests)
        self.held: dict[str, _Request] = {}
        # finished_recving_kv_req_ids / failed_recving_kv_req_ids
        self.kv_loads_done: set[str] = set()
        self.kv_loads_failed: set[str] = set()
        # asynchronous loads started and not reported: request -> the blocks
        # the load writes (the protocol checks reports against them)
        self.kv_loading: dict[str, tuple[int, ...]] = {}
        # _inflight_prefills: requests still prefilling (admitted with a
        # chunk left, or loading asynchronously)
        self.inflight_prefills: set[str] = set()
        # this schedule's loads (update_state_after_alloc), for the plan
        self.pending_loads: list[KVLoad] = []
        # defer_block_free (several batches in flight, max_concurrent_batches
        # > 1, with a consumer connector: Scheduler.__init__,
        # multiple_inflight_batches): sched_step_seq, processed_step_seq,
        # deferred_frees
        self.defer_block_free = self._config.kv_connector and self._config.max_concurrent_batches > 1
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: list[DeferredFree] = []

    def _clone_connector(self, d: dict[str, object]) -> None:
        """SpecScheduler.clone's share for the connector's containers."""
        d["kv_holding"] = self.kv_holding[:]
        d["held"] = {rid: r.copy() for rid, r in self.held.items()}
        d["kv_loads_done"] = self.kv_loads_done.copy()
        d["kv_loads_failed"] = self.kv_loads_failed.copy()
        d["kv_loading"] = self.kv_loading.copy()
        d["inflight_prefills"] = self.inflight_prefills.copy()
        d["pending_loads"] = self.pending_loads[:]
        d["deferred_frees"] = [DeferredFree(f.fence, f.blocks[:]) for f in self.deferred_frees]

    # ------------------------------------------------------------ freeing

    def _blocks_can_be_freed(self, req: _Request) -> bool:
        """_request_blocks_can_be_freed: with defer_block_free, a request's
        blocks return to the pool only once its last scheduled step has been
        processed."""
        return not self.defer_block_free or req.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, req: _Request) -> None:
        """_free_request_blocks: free the table now, or defer it behind a
        fence (the steps scheduled so far) while a step may still write it."""
        if self._blocks_can_be_freed(req):
            self.kv.free_request(req)  # every KV cache group's table (KVCacheCoordinator.free)
            return
        blocks = self.kv.pop_blocks_for_free(req)  # every group's (pop_blocks_for_free)
        if blocks:
            self._rule("connector.free_deferred")  # pragma: no mutate
            self.deferred_frees.append(DeferredFree(self.sched_step_seq, blocks))

    def _drain_deferred_frees(self) -> None:
        """update_from_output, first (a step with scheduled tokens):
        processed_step_seq advances and _drain_deferred_frees returns each
        deferred table whose fence has passed, oldest first, tail first
        (``free_blocks(reversed(blocks))``)."""
        self.processed_step_seq += 1
        while self.deferred_frees and self.deferred_frees[0].fence <= self.processed_step_seq:
            self._rule("connector.deferred_drained")  # pragma: no mutate
            self.kv.free(self.deferred_frees.pop(0).blocks)

    def _free_blocks(self, rid: str) -> None:
        """_free_blocks: a held finished request's blocks go (freed, or
        deferred) and vLLM forgets the request."""
        self._free_request_blocks(self.held.pop(rid))

    # ------------------------------------------------------------ admission

    def _remaining_blocks(self, req: _Request) -> int:
        """_request_remaining_blocks: the blocks ``req`` still needs for its
        whole sequence (plus one speculative step with drafts), as
        get_num_blocks_to_allocate counts them for its table."""
        cfg = self._config
        num_tokens = min(req.num_tokens, cfg.max_model_len)
        if cfg.num_speculative_tokens:
            num_tokens += 1 + cfg.num_speculative_tokens + cfg.num_lookahead_tokens
        # summed over the KV cache groups, a sliding-window or chunked-local
        # group at its admission cap
        return self.kv.get_num_blocks_to_allocate(req, num_tokens, None, req.num_computed_tokens, True)

    def _async_load_reserve(self) -> int:
        """schedule(), an asynchronous load's ``reserved_blocks``: what the
        in-flight prefills still need (_inflight_prefill_reserved_blocks) plus
        one speculative step's blocks per group (_spec_decode_step_blocks)."""
        cfg = self._config
        spec_step = 0
        if cfg.num_speculative_tokens:
            n = 1 + cfg.num_speculative_tokens + cfg.num_lookahead_tokens
            spec_step = len(cfg.groups) * blocks_for_tokens(num_tokens=n, block_size=cfg.block_size)
        return sum(self._remaining_blocks(self.requests[r]) for r in self.inflight_prefills) + spec_step

    def _record_load(self, req: _Request, start: int, num_external: int, asynchronous: bool) -> None:
        """update_state_after_alloc of the modelled connector: a load of the
        external tokens into the request's blocks, for build_connector_meta."""
        if num_external <= 0:
            return
        end = start + num_external
        self._rule("connector.load_async" if asynchronous else "connector.load_sync")  # pragma: no mutate
        self.pending_loads.append(
            KVLoad(req.request_id, start, end, tuple(req.blocks), asynchronous, req.group_block_ids())
        )
        if asynchronous:
            span = loaded_block_range(start, end, self._config.block_size)
            self.kv_loading[req.request_id] = tuple(req.blocks[i] for i in span)

    def _update_waiting_for_remote_kv(self, req: _Request) -> None:
        """_update_waiting_for_remote_kv, called by
        _handle_blocked_waiting_request once the load was reported: cache the
        loaded blocks (after a failure, those below the truncation; none left
        computed frees the blocks at once), leave the last token to compute
        when everything was loaded, and become WAITING (PREEMPTED if the
        request was ever preempted)."""
        rid = req.request_id
        if rid in self.kv_loads_failed:
            self.kv_loads_failed.remove(rid)
            if req.num_computed_tokens:
                self._rule("connector.failed_load_kept")  # pragma: no mutate
                self._cache_loaded(req)
            else:
                self._rule("connector.failed_load_freed")  # pragma: no mutate
                self.kv.free_request(req)  # kv_cache_manager.free: never deferred
        else:
            self._rule("connector.load_promoted")  # pragma: no mutate
            self._cache_loaded(req)
        if req.num_computed_tokens == req.num_tokens:
            self._rule("connector.load_last_token")  # pragma: no mutate
            req.num_computed_tokens = req.num_tokens - 1
        self.kv_loads_done.remove(rid)
        req.set_status(RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING)

    def _cache_loaded(self, req: _Request) -> None:
        """KVCacheManager.cache_blocks(request, num_computed_tokens)."""
        self._cache_blocks(req, req.num_computed_tokens)

    def _cache_blocks(self, req: _Request, num_tokens: int) -> None:
        raise NotImplementedError  # SpecScheduler._cache_blocks

    # ------------------------------------------------------------ update

    def _handle_failed_recving(self, failed: Iterable[str]) -> set[str]:
        """_handle_failed_recving: a whole load failed. Recompute: nothing
        of it counts as computed (the request stays loading until its load
        is reported finished). Fail: the requests are returned, to finish
        with FINISHED_ERROR."""
        affected: set[str] = set()
        for rid in sorted(failed):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._rule("connector.failed_ignored")  # pragma: no mutate
                continue
            affected.add(rid)
            if self._config.kv_load_failure_policy == "recompute":
                self._rule("connector.failed_recompute")  # pragma: no mutate
                req.num_computed_tokens = 0
                self.kv_loads_failed.add(rid)
        return set() if self._config.kv_load_failure_policy == "recompute" else affected

    def _handle_invalid_blocks(self, invalid: set[int], plan: StepPlan) -> set[str]:
        """_handle_invalid_blocks: the asynchronous loads (kv_holding_waiting
        in WAITING_FOR_REMOTE_KVS, nothing cached yet), then the running
        requests (synchronous loads, cached at allocation), each truncated at
        its first invalid block. Fail: the blocks from there on lose their
        keys (evict_blocks) and every affected request is returned, to finish
        with FINISHED_ERROR. Recompute: the loading ones are marked failed and
        the running ones returned (their output of this step is skipped)."""
        scheduled = {s.request_id: s.num_scheduled_tokens for s in plan.scheduled}
        loading = [r for r in self.kv_holding if self.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        loads = self._update_requests_with_invalid_blocks(loading, invalid, scheduled)
        running = self._update_requests_with_invalid_blocks(self.running, invalid, scheduled)
        if not loads.affected and not running.affected:
            return set()
        if self._config.kv_load_failure_policy == "fail":
            self._rule("connector.invalid_fail")  # pragma: no mutate
            self.kv.evict_blocks(running.evict)
            return loads.affected | running.affected
        self._rule("connector.invalid_recompute")  # pragma: no mutate
        self.kv_loads_failed |= loads.affected
        return running.affected

    def _update_requests_with_invalid_blocks(
        self, rids: list[str], invalid: set[int], scheduled: Mapping[str, int]
    ) -> InvalidBlocks:
        """_update_requests_with_invalid_blocks: each request's computed
        tokens (less this plan's) are truncated at its first invalid block;
        a block already marked by an earlier request leaves a later one its
        computed tokens (the first recomputes it)."""
        bs = self._config.block_size
        affected: set[str] = set()
        evict: list[int] = []
        marked: set[int] = set()
        for rid in rids:
            req = self.requests[rid]
            computed = req.num_computed_tokens - scheduled.get(rid, 0)
            table = req.blocks[: blocks_for_tokens(num_tokens=computed, block_size=bs)]
            hits = [i for i, b in enumerate(table) if b in invalid]
            if not hits:
                continue
            affected.add(rid)
            fresh = [i for i in hits if table[i] not in marked]
            marked.update(table[i] for i in hits)
            if fresh:
                self._rule("connector.invalid_truncated")  # pragma: no mutate
                req.num_computed_tokens = fresh[0] * bs
                evict.extend(b for b in req.blocks[fresh[0]:] if b not in evict)
            else:
                self._rule("connector.invalid_shared")  # pragma: no mutate
                req.num_computed_tokens = computed
        return InvalidBlocks(affected, evict)

    def _update_from_kv_xfer_finished(self, result: StepResult) -> None:
        """_update_from_kv_xfer_finished, last in update_from_output: a
        reported load marks a loading request done (promoted by the next
        WAITING loop), or frees a finished request that kept its blocks for
        it; a reported save frees the finished request's blocks."""
        for rid in sorted(result.finished_recving):
            self.kv_loading.pop(rid, None)
            if rid in self.requests:
                self._rule("connector.load_done")  # pragma: no mutate
                self.kv_loads_done.add(rid)
            else:
                self._rule("connector.load_done_after_finish")  # pragma: no mutate
                self._free_blocks(rid)
        for rid in sorted(result.finished_sending):
            self._rule("connector.save_done")  # pragma: no mutate
            self._free_blocks(rid)

    # ------------------------------------------------------------ view

    def _blocks_kept_after_reset(self) -> str | None:
        """Why blocks would stay held after reset_prefix_cache preempted every
        running request (vLLM then raises RuntimeError), or None."""
        if self.held:
            return f"finished request {min(self.held)!r} keeps its blocks for the connector"
        for rid in self.kv_holding:
            if any(self.kv.tables(self.requests[rid])):
                return f"waiting request {rid!r} holds blocks for a KV load"
        if self.deferred_frees or not all(self._blocks_can_be_freed(self.requests[r]) for r in self.running):
            return "a step in flight still writes blocks whose free is deferred (defer_block_free)"
        return None

    def _connector_view(self) -> dict[str, Any]:
        """The view's connector fields, only with a connector."""
        if not self._config.kv_connector:
            return {}
        return {
            # group 0's table, then the other groups' (null blocks left out)
            "kv_held_by_finished": {
                rid: tuple(b for t in self.kv.tables(r) for b in t if b) for rid, r in sorted(self.held.items())
            },
            "kv_loads_done": tuple(sorted(self.kv_loads_done)),
            "kv_loads_failed": tuple(sorted(self.kv_loads_failed)),
        }

