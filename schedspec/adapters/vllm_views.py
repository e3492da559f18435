"""vLLM's state translated back into schedspec's: a SchedulerOutput as a
StepPlan, a vLLM Request as a RequestView, the block pool as a KVView, the
encoder cache, and the requests finished but holding blocks.

What the translation relies on (vLLM 0.33.0, vllm/v1/core/sched/scheduler.py
unless said otherwise):

* ``SchedulerOutput.num_scheduled_tokens`` is filled in scheduling order
  (running loop, then admissions), so its key order is the plan's order.
* A request in ``scheduled_new_reqs`` is NEW; one whose id is in
  ``scheduled_cached_reqs.resumed_req_ids`` is RESUMED (with
  the V1 model runner; V2 sends it among the new ones, ``resumed_as_new``);
  any other cached one is RUNNING.
* vLLM sends a new or resumed request's whole block table and only the new
  blocks of a running one (vllm/v1/worker/gpu_model_runner.py, _update_states).
  BlockTables rebuilds each table from those messages, as a model runner
  does, and checks it against the KV manager's own table every step.
* vLLM keys cached blocks by a chained SHA-256 of their tokens; the spec keys
  them by content, ``(salt or "", tokens from the start through the block)``.
  BlockKeys records, for every request the adapter ever handed to vLLM,
  which content each of the request's block hashes stands for, and reports
  content keys.
* With async scheduling an entry's ``num_output_placeholders`` is the
  request's count before this step's own (``_update_after_schedule`` adds
  1 + the step's drafts to every entry that samples).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from schedspec.spec.interface import (
    BlockKey,
    KVView,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    StepPlan,
    group_block_key,
)

from schedspec.adapters.vllm_kv import kv_loads
from schedspec.adapters.vllm_load import VllmAdapterError
from schedspec.adapters.vllm_requests import Live

_STATUS_NAMES = {
    "WAITING": RequestStatus.WAITING,
    "RUNNING": RequestStatus.RUNNING,
    "PREEMPTED": RequestStatus.PREEMPTED,
    "FINISHED_STOPPED": RequestStatus.FINISHED_STOPPED,
    "FINISHED_LENGTH_CAPPED": RequestStatus.FINISHED_LENGTH_CAPPED,
    "FINISHED_ABORTED": RequestStatus.FINISHED_ABORTED,
    "FINISHED_IGNORED": RequestStatus.FINISHED_IGNORED,
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    "FINISHED_ERROR": RequestStatus.FINISHED_ERROR,
    "WAITING_FOR_REMOTE_KVS": RequestStatus.WAITING_FOR_REMOTE_KVS,
    "WAITING_FOR_STREAMING_REQ": RequestStatus.WAITING_FOR_STREAMING_REQ,
}


class Statuses:
    """vLLM's request states as ours; a state outside the modelled ones is a
    VllmAdapterError."""

    def __init__(self) -> None:
        from schedspec.adapters.vllm_names import VRequestStatus

        self._ours = {VRequestStatus[name]: ours for name, ours in _STATUS_NAMES.items()}

    def of(self, req: Any) -> RequestStatus:
        status = self._ours.get(req.status)
        if status is None:
            raise VllmAdapterError(
                f"request {req.request_id!r} is in vLLM state {req.status.name}, outside the "
                "modelled configuration"
            )
        return status


class BlockTables:
    """Every group's block table of each request: as vLLM's KV managers keep
    them (``managers``, one per group), and as a model runner rebuilds them
    from the messages of vLLM's plans (``sent``)."""

    def __init__(self, managers: list[Any]) -> None:
        #: per group: request id -> its blocks (group 0's is the block table)
        self._group_blocks_of: list[Any] = [m.req_to_blocks for m in managers]
        #: request id -> every group's table as the model runner holds it
        self.sent: dict[str, list[list[int]]] = {}

    def table(self, rid: str) -> list[int]:
        """The request's block table as vLLM's KV manager keeps it. Read with
        .get: the manager's defaultdict must not grow an entry."""
        blocks = self._group_blocks_of[0].get(rid)
        return [b.block_id for b in blocks] if blocks else []

    def groups(self, rid: str) -> list[list[int]]:
        """Every group's block table of the request, in group order (a
        sliding-window or chunked-local group's with the null block 0 where
        it freed one)."""
        out = []
        for blocks_of in self._group_blocks_of:
            blocks = blocks_of.get(rid)
            out.append([b.block_id for b in blocks] if blocks else [])
        return out

    def none(self) -> list[list[int]]:
        return [[] for _ in self._group_blocks_of]

    def check(self, rid: str, tables: list[list[int]], step: int) -> list[list[int]]:
        """The request's tables as vLLM's KV manager keeps them, after checking
        that they are the ones vLLM sent (the model runner's copy, rebuilt
        from the messages). A sliding-window or chunked-local group's
        manager replaces a block that left the window (the chunk) by the null
        block 0 in place (remove_skipped_blocks) without telling the worker,
        which nulls such entries itself: there the sent table may still name
        the freed block."""
        kept = self.groups(rid)
        ok = len(tables) == len(kept) and all(
            len(sent) == len(own) and all(s == k or k == 0 for s, k in zip(sent, own))
            for sent, own in zip(tables, kept)
        )
        if not ok:
            raise VllmAdapterError(
                f"step {step}: vLLM sent {rid!r} block tables {tables} that are not "
                f"its own {kept}"
            )
        return kept


def plan_of(out: Any, step: int, live: Mapping[str, Live], tables: BlockTables, *, async_scheduling: bool,
            hybrid: bool, resumed_as_new: frozenset[str] = frozenset()) -> StepPlan:
    """vLLM's SchedulerOutput ``out`` of plan ``step`` as a StepPlan, each
    request's tables rebuilt from what vLLM sent (``tables.sent``) and
    checked against its own."""
    new = {nr.req_id: nr for nr in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    cached_index = {rid: i for i, rid in enumerate(cached.req_ids)}
    resumed = cached.resumed_req_ids
    for rid in out.preempted_req_ids:  # a resumed request gets its whole table again
        tables.sent.pop(rid, None)
    spec_tokens = out.scheduled_spec_decode_tokens
    encoder_inputs = out.scheduled_encoder_inputs
    invalid = out.num_invalid_spec_tokens or {}
    entries = []
    for rid, n in out.num_scheduled_tokens.items():
        req = live[rid].req
        drafts = tuple(spec_tokens.get(rid, ()))
        placeholders = req.num_output_placeholders
        if async_scheduling and not req.is_prefill_chunk:
            # AsyncScheduler._update_after_schedule counted this step's own
            # sampled token and drafts already; the plan states the count
            # the step was scheduled with.
            placeholders -= 1 + len(drafts)
        if rid in new:
            # Model Runner V2 sends a resumed request as new (vllm_runner.py)
            kind = ScheduleKind.RESUMED if rid in resumed_as_new else ScheduleKind.NEW
            computed = new[rid].num_computed_tokens
            sent = [list(ids) for ids in new[rid].block_ids]
        else:
            i = cached_index[rid]
            computed = cached.num_computed_tokens[i]
            message = cached.new_block_ids[i]
            if rid in resumed:
                kind = ScheduleKind.RESUMED
                sent = [list(ids) for ids in message] if message is not None else tables.none()
            else:
                kind = ScheduleKind.RUNNING
                sent = tables.sent.get(rid) or tables.none()
                if message is not None:
                    sent = [old + list(ids) for old, ids in zip(sent, message)]
        kept = tables.check(rid, sent, step)
        tables.sent[rid] = kept
        entries.append(
            ScheduledRequest.of(rid, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
                                all_token_ids=req.all_token_ids, block_ids=tuple(kept[0]),
                                spec_token_ids=drafts, num_output_placeholders=placeholders,
                                encoder_inputs=tuple(encoder_inputs.get(rid, ())),
                                num_invalid_spec_tokens=invalid.get(rid, 0),
                                group_block_ids=(
                                    tuple(tuple(t) for t in kept) if hybrid else ()))
        )
    return StepPlan(
        step=step,
        scheduled=tuple(entries),
        preempted_ids=tuple(sorted(out.preempted_req_ids)),
        finished_ids=tuple(sorted(out.finished_req_ids)),
        freed_encoder_inputs=tuple(out.free_encoder_mm_hashes),
        kv_loads=kv_loads(out, hybrid),
        # V2 with a draft model (spec/runner_v2.py); vLLM 0.32's engine lacks the field
        skip_drafts=bool(getattr(out, "skip_drafts", False)),
    )


class BlockKeys:
    """vLLM's block hashes as the spec's content keys: which content every
    block hash of a request handed to vLLM stands for."""

    def __init__(self, block_size: int, lookahead: int = 0) -> None:
        self.block_size = block_size
        self.lookahead = lookahead  # tokens past a block its hash covers (EAGLE)
        self._keys: dict[bytes, BlockKey] = {}  # vLLM block hash -> content key
        self._prune_at = 4096  # forget keys nobody can ask for once there are this many
        self._ints: dict[int, BlockKey] | None = None  # event_key's int hashes, built when asked

    def record(self, live: Live) -> None:
        """Remember which content every new block hash of the request stands
        for: (salt, all tokens through that block and the lookahead after it)."""
        hashes = live.req.block_hashes
        if live.num_hashed == len(hashes):
            return
        bs = self.block_size
        tokens = live.req.all_token_ids
        for i in range(live.num_hashed, len(hashes)):
            end = (i + 1) * bs + self.lookahead
            key: BlockKey = (live.spec.block_identity(end), tuple(tokens[:end]))
            known = self._keys.setdefault(hashes[i], key)
            if known != key:
                raise VllmAdapterError(f"vLLM block hash collision: {known} and {key}")
        live.num_hashed = len(hashes)

    def prune_if_large(self, pool: Any, live: Iterable[Live]) -> None:
        """Keep only the keys of hashes vLLM can still show us: those in its
        prefix cache (the block pool ``pool``) and those of live requests (a
        request added later records its own again), so a long run does not
        hold every prefix it ever saw. Only once there are many."""
        if len(self._keys) <= self._prune_at:
            return
        from schedspec.adapters.vllm_names import get_block_hash

        keep = {get_block_hash(h) for h in pool.cached_block_hash_to_block._cache}
        for one in live:
            keep.update(one.req.block_hashes[: one.num_hashed])
        self._keys = {h: k for h, k in self._keys.items() if h in keep}
        self._prune_at = max(4096, 2 * len(self._keys))

    def event_key(self, external: bytes | int) -> BlockKey:
        """The content key (as group 0 spells it) of a block hash as vLLM's
        KV cache events carry it (kv_cache_utils.maybe_convert_block_hash:
        the hash, or with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES its low 64
        bits big-endian as an int)."""
        if isinstance(external, bytes):
            key = self._keys.get(external)
        else:
            ints = self._ints
            if ints is None or external not in ints:
                ints = self._ints = {int.from_bytes(h, "big") & ((1 << 64) - 1): k for h, k in self._keys.items()}
            key = ints.get(external)
        if key is None:
            raise VllmAdapterError(f"a vLLM KV cache event names a block hash {external!r} of no known request")
        return key

    def key(self, hash_with_group: bytes) -> BlockKey:
        """The content key of a cached block: its block hash's content, of
        its KV cache group (group_block_key; group 0's keys as always)."""
        from schedspec.adapters.vllm_names import BlockHashWithGroupId, get_block_hash, get_group_id

        hashed = BlockHashWithGroupId(hash_with_group)
        key = self._keys.get(get_block_hash(hashed))
        if key is None:
            raise VllmAdapterError(f"vLLM holds a block hash {hash_with_group.hex()} of no known request")
        return group_block_key(key, get_group_id(hashed))


def request_view(live: Live, status: RequestStatus, tables: BlockTables, config: SchedulerConfig,
                 finished: bool = False) -> RequestView:
    """A live request (``finished``: one vLLM just finished) as a RequestView."""
    s, req = live.spec, live.req
    groups: tuple[tuple[int, ...], ...] = ()
    if finished:
        blocks: tuple[int, ...] = ()
    elif config.is_hybrid:
        groups = tuple(tuple(t) for t in tables.groups(s.request_id))
        blocks = groups[0]
    else:
        blocks = tuple(tables.table(s.request_id))
    return RequestView.of(
        s,
        status=status,
        output_token_ids=tuple(req.output_token_ids),
        num_computed_tokens=req.num_computed_tokens,
        block_ids=blocks,
        num_preemptions=req.num_preemptions,
        num_output_placeholders=req.num_output_placeholders,
        spec_token_ids=tuple(req.spec_token_ids),
        # read by the prefill cadence only (scheduler.py, schedule:
        # defer_prefills) and only of unfinished requests; reported with
        # it on
        is_prefill_chunk=(bool(req.is_prefill_chunk) and not finished
                          and config.prefill_schedule_interval > 1),
        group_block_ids=groups,
    )


def held_by_finished(sched: Any, tables: BlockTables) -> dict[str, tuple[int, ...]]:
    """Finished requests vLLM keeps in Scheduler.requests because their
    blocks are not freed yet (an asynchronous save not yet reported, or an
    abort or failure during an asynchronous load not yet reported:
    _free_request with delay_free_blocks), with the blocks they hold:
    group 0's table, then the other groups' (null entries left out)."""
    held: dict[str, tuple[int, ...]] = {}
    for rid, req in sched.requests.items():
        if req.is_finished():
            held[rid] = tuple(b for t in tables.groups(rid) for b in t if b != 0)
    return dict(sorted(held.items()))


def encoder_view(sched: Any, config: SchedulerConfig) -> tuple[dict[str, int], int]:
    """The encoder cache: every cached output (referenced or freeable, not
    yet evicted) with its embeddings, and the free space."""
    if not config.has_encoder:
        return {}, 0
    ecm = sched.encoder_cache_manager
    return dict(ecm.num_embeds_by_hash), ecm.num_free_slots


def kv_view(sched: Any, keys: BlockKeys, config: SchedulerConfig) -> KVView:
    """vLLM's block pool as a KVView: reference counts, the free queue, the
    content key of every cached block and the prefix-cache index. vLLM keeps
    partial-block entries (BlockPool.cache_partial_block: a block's
    block_hash or one of its cached_block_hashes_by_block) in the same index;
    a key whose prefix ends inside a block is one, and goes to
    ``partial_index`` (a block whose only key is partial has none in
    ``block_keys``)."""
    from schedspec.adapters.vllm_names import KVCacheBlock

    pool = sched.kv_cache_manager.block_pool
    bs = config.block_size
    ref_cnt = tuple(0 if b.is_null else b.ref_cnt for b in pool.blocks)
    free_queue = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    block_keys: dict[int, BlockKey] = {}

    def whole(key: BlockKey) -> bool:  # a key of whole blocks (each with EAGLE's lookahead after it)
        return (len(key[1]) - keys.lookahead) % bs == 0

    for b in pool.blocks:
        if b.block_hash is not None:
            key = keys.key(b.block_hash)
            if whole(key):
                block_keys[b.block_id] = key
    cache_index: dict[BlockKey, tuple[int, ...]] = {}
    partial_index: dict[BlockKey, tuple[int, ...]] = {}
    for h, held in pool.cached_block_hash_to_block._cache.items():
        if isinstance(held, KVCacheBlock):
            ids: tuple[int, ...] = (held.block_id,)
        else:
            ids = tuple(held)  # dict block_id -> block, in insertion (lookup) order
        if ids:
            key = keys.key(h)
            (cache_index if whole(key) else partial_index)[key] = ids
    return KVView(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        ref_cnt=ref_cnt,
        free_queue=free_queue,
        block_keys=block_keys,
        cache_index=cache_index,
        partial_index=partial_index,
    )
