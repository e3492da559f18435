"""The neutral scheduler interface that every part of schedspec speaks.

spec/ owns these types; impl/, invariants/, the checking engine and the rest
of schedspec import them and never the spec's logic. Everything here is a frozen value: a StepPlan or a
SchedulerView can be compared with ``==`` across schedulers, stored in a trace
and replayed.

Validation happens at construction, at the boundary: a bad SchedulerConfig or
RequestSpec raises a typed error naming the field (the checks are in
spec/validate.py, the errors in spec/errors.py) and never reaches a scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Callable, Mapping, Protocol, Sequence, Union, runtime_checkable

# The errors are re-exported: import them from here.
from schedspec.spec.errors import ConfigError as ConfigError
from schedspec.spec.errors import ProtocolError as ProtocolError
from schedspec.spec.errors import RequestError as RequestError
from schedspec.spec.errors import SchedSpecError as SchedSpecError
from schedspec.spec.kv_kinds import FullAttention
from schedspec.spec.validate import KV_GROUP_KINDS as KV_GROUP_KINDS
from schedspec.spec.validate import (
    DRAFTERS,
    KV_CACHE_REPORT_MODES,
    KV_LOAD_FAILURE_POLICIES,
    MODEL_RUNNERS,
    MAX_KV_CACHE_GROUPS,
    MAX_SPECULATIVE_TOKENS,
    declaration_of,
    declare,
    declared,
    max_concurrent_batches,
    validate_config,
    validate_request,
)

# --------------------------------------------------------------------------
# Enums
# --------------------------------------------------------------------------


class RequestStatus(enum.Enum):
    """Request states (vllm/v1/request.py, RequestStatus), restricted to the
    ones the modelled configuration can reach."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_IGNORED = "finished_ignored"
    #: The request needs a structured-output grammar that is still compiling
    #: (vllm/v1/request.py, Request.__init__ with structured_output_request).
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = "waiting_for_structured_output_grammar"
    #: Its grammar failed to compile (vllm/v1/core/sched/scheduler.py,
    #: update_from_output, ``grammar_compile_error_reqs``).
    FINISHED_ERROR = "finished_error"
    #: An asynchronous KV-connector load of the request's external prefix is
    #: in flight; the request holds blocks for it and is not scheduled until
    #: the worker reports the load finished or failed
    #: (vllm/v1/core/sched/scheduler.py, schedule(), ``load_kv_async``, and
    #: _update_waiting_for_remote_kv).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    #: A resumable request (a streaming-input session) finished its chunk and
    #: no next chunk is queued: it keeps its blocks and waits for the next
    #: session update (vllm/v1/core/sched/scheduler.py, _handle_stopped_request).
    WAITING_FOR_STREAMING_REQ = "waiting_for_streaming_req"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
        RequestStatus.FINISHED_ERROR,
    }
)

_S = RequestStatus
#: The legal status transitions. Every status change in the spec goes through
#: ``check_transition``; an illegal one is a bug in the spec, not bad input.
#:  WAITING   -> RUNNING (admitted), FINISHED_ABORTED (abort while queued),
#:               FINISHED_IGNORED (never admissible; vLLM 0.33 rejects such a
#:               prompt before the scheduler, so the spec raises at add instead
#:               and this edge is kept only for schedulers that report it)
#:  RUNNING   -> PREEMPTED (recompute preemption), FINISHED_STOPPED (eos or a
#:               stop token), FINISHED_LENGTH_CAPPED (max_tokens or
#:               max_model_len), FINISHED_ABORTED
#:  PREEMPTED -> RUNNING (resumed), FINISHED_ABORTED, and with async
#:               scheduling FINISHED_STOPPED / FINISHED_LENGTH_CAPPED (the
#:               stale output of a step that was in flight when the request
#:               was preempted is still delivered and may stop it:
#:               scheduler.py, update_from_output, ``stopped_preempted_reqs``)
#:  RUNNING, PREEMPTED -> FINISHED_ERROR too: a sampled token the request's
#:               grammar refuses (update_from_output, accept_tokens failing)
#:  WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
#:            -> WAITING (the waiting loop finds the grammar compiled:
#:               scheduler.py, _handle_blocked_waiting_request), RUNNING (the
#:               same, then admitted in that step), FINISHED_ABORTED,
#:               FINISHED_ERROR (the grammar failed to compile; the waiting
#:               loop records it and update_from_output finishes the request),
#:               WAITING_FOR_REMOTE_KVS (the grammar found compiled, then an
#:               asynchronous load started, in one WAITING loop)
#:  WAITING, PREEMPTED -> WAITING_FOR_REMOTE_KVS (the connector starts an
#:               asynchronous load of the request's external prefix)
#:  WAITING_FOR_REMOTE_KVS
#:            -> WAITING or PREEMPTED (the load is reported finished or failed
#:               and the waiting loop promotes it: _handle_blocked_waiting_request;
#:               PREEMPTED when it was preempted before), RUNNING (the same,
#:               then admitted in that step), FINISHED_ABORTED, FINISHED_ERROR
#:               (a failed load under kv_load_failure_policy "fail")
#:  finished  -> nothing
LEGAL_TRANSITIONS: Mapping[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset(
        {_S.RUNNING, _S.FINISHED_ABORTED, _S.FINISHED_IGNORED, _S.WAITING_FOR_REMOTE_KVS}
    ),
    _S.RUNNING: frozenset(
        {
            _S.PREEMPTED,
            _S.FINISHED_STOPPED,
            _S.FINISHED_LENGTH_CAPPED,
            _S.FINISHED_ABORTED,
            _S.FINISHED_ERROR,
        }
    ),
    _S.PREEMPTED: frozenset(
        {
            _S.RUNNING,
            _S.FINISHED_ABORTED,
            _S.FINISHED_STOPPED,
            _S.FINISHED_LENGTH_CAPPED,
            _S.FINISHED_ERROR,
            _S.WAITING_FOR_REMOTE_KVS,
        }
    ),
    _S.FINISHED_STOPPED: frozenset(),
    _S.FINISHED_LENGTH_CAPPED: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
    _S.FINISHED_IGNORED: frozenset(),
    _S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: frozenset(
        {_S.WAITING, _S.RUNNING, _S.FINISHED_ABORTED, _S.FINISHED_ERROR, _S.WAITING_FOR_REMOTE_KVS}
    ),
    _S.FINISHED_ERROR: frozenset(),
    _S.WAITING_FOR_REMOTE_KVS: frozenset(
        {_S.WAITING, _S.PREEMPTED, _S.RUNNING, _S.FINISHED_ABORTED, _S.FINISHED_ERROR}
    ),
    #: a session waits for its next chunk: the chunk arrives (WAITING), or the
    #: session ends or is aborted (FINISHED_ABORTED: add_request with the
    #: finished sentinel calls finish_requests(FINISHED_ABORTED))
    _S.WAITING_FOR_STREAMING_REQ: frozenset({_S.WAITING, _S.FINISHED_ABORTED}),
}
#: Sessions (spec/sessions.py): a resumable request that stops goes on
#: instead (_handle_stopped_request): RUNNING or PREEMPTED -> WAITING (its
#: next chunk was queued: _update_request_as_session) or
#: WAITING_FOR_STREAMING_REQ (none queued yet). Legal for a resumable request only.
SESSION_TRANSITIONS: Mapping[RequestStatus, frozenset[RequestStatus]] = {
    _S.RUNNING: frozenset({_S.WAITING, _S.WAITING_FOR_STREAMING_REQ}),
    _S.PREEMPTED: frozenset({_S.WAITING, _S.WAITING_FOR_STREAMING_REQ}),
}


def is_legal_transition(old: RequestStatus, new: RequestStatus, resumable: bool = False) -> bool:
    return new in LEGAL_TRANSITIONS[old] or (resumable and new in SESSION_TRANSITIONS.get(old, ()))


class Policy(enum.Enum):
    """vllm/v1/core/sched/request_queue.py, SchedulingPolicy."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class PauseState(enum.IntEnum):
    """vllm/v1/core/sched/interface.py, PauseState: UNPAUSED schedules as
    usual; PAUSED_NEW schedules only requests that are running or hold KV
    blocks (nothing new is admitted); PAUSED_ALL schedules nothing."""

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


class ScheduleKind(enum.Enum):
    """How a request appears in a step: first admission, re-admission after a
    preemption, or continuing from the running queue."""

    NEW = "new"
    RESUMED = "resumed"
    RUNNING = "running"


# --------------------------------------------------------------------------
# Configuration and requests
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group of a hybrid model (vLLM's KVCacheGroupSpec with its
    KVCacheSpec): the layers that share one block table per request.

    ``kind`` is ``"full_attention"`` (every position stays attended:
    FullAttentionManager) or ``"sliding_window"`` (a token attends the last
    ``sliding_window`` positions; blocks wholly before that window are freed
    and replaced by the null block 0 in the request's table:
    SlidingWindowManager, remove_skipped_blocks) or ``"chunked_local"``
    (chunked local attention: positions are cut into chunks of
    ``attention_chunk_size`` tokens and a token attends only the earlier
    positions of its own chunk; blocks wholly before the chunk of the next
    token are freed and nulled: ChunkedLocalAttentionManager,
    get_num_skipped_tokens) or ``"mamba"`` (one recurrent state per request
    in "align" mode: MambaManager, spec/mamba.py). ``block_size`` 0 means the
    config's ``block_size``; the modelled layouts give every group the
    config's block size (vLLM requires each cacheable group's block size to be
    a multiple of the hash block size, HybridKVCacheCoordinator.__init__), so
    another value is refused.

    All groups draw their blocks from the one pool of ``num_blocks`` blocks
    (vLLM's single BlockPool); a block belongs to one group at a time. The
    rules of each kind are its class in spec/kv_kinds.py (``kind_of``)."""

    kind: str = FullAttention.name
    sliding_window: int = 0
    block_size: int = 0
    attention_chunk_size: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.sliding_window:
            out["sliding_window"] = self.sliding_window
        if self.attention_chunk_size:
            out["attention_chunk_size"] = self.attention_chunk_size
        if self.block_size:
            out["block_size"] = self.block_size
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "kv_cache_groups") -> KVCacheGroup:
        if isinstance(data, KVCacheGroup):
            return data
        if not isinstance(data, Mapping):
            raise ConfigError(where, f"must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", "unknown field")
        return cls(
            kind=data.get("kind", FullAttention.name),
            sliding_window=data.get("sliding_window", 0),
            block_size=data.get("block_size", 0),
            attention_chunk_size=data.get("attention_chunk_size", 0),
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler options the spec models. Defaults follow vLLM 0.33 where
    it has one; every other vLLM option is pinned by the vLLM adapter.

    ``num_blocks`` counts every KV block including block 0, which vLLM keeps as
    a reserved null block (vllm/v1/core/block_pool.py, BlockPool.__init__), so
    ``num_blocks - 1`` blocks are usable.

    ``async_scheduling`` is vLLM's AsyncScheduler
    (vllm/v1/core/sched/async_scheduler.py): schedule() for step N+1 may be
    called while step N's plan still awaits its update(), and the scheduler
    counts that step's output tokens as placeholders. ``num_speculative_tokens``
    is k, the number of draft tokens verified per step (0 = speculative
    decoding off; vLLM's speculative_config.num_speculative_tokens with the
    ngram method, whose drafts the driver supplies). Both default to off,
    which is the synchronous, one-token-per-step scheduler.

    The admission gates, each off at its default:

    - ``max_loras``: the most distinct LoRA adapters in one step (0 = LoRA
      off, vLLM's lora_config is None; n >= 1 is lora_config.max_loras).
    - ``watermark``: the fraction of the pool kept free when a waiting
      request is admitted (vLLM's scheduler_config.watermark; the manager
      keeps ``int(watermark * num_blocks)`` blocks: watermark_blocks).
    - ``prefill_schedule_interval``: vLLM's local prefill cadence (data
      parallel size 1): a prefill is admitted only once this many executed
      steps have passed since the last prefill-carrying step (1 = always).
    - ``max_num_encoder_input_tokens`` and ``encoder_cache_size``: the
      multimodal encoder's compute budget per step and its cache size, both
      in embeddings (vLLM's MultiModalBudget); both 0 = no encoder.

    The KV connector and hybrid KV cache groups, each off at its default:

    - ``kv_connector``: the scheduler has a KV connector (vLLM's
      kv_transfer_config with kv_role "kv_both"): the modelled connector
      offers each request's ``kv_external_tokens`` as an external prefix hit,
      loaded synchronously within the step or asynchronously
      (WAITING_FOR_REMOTE_KVS), and saves a finished request's blocks
      asynchronously where the request asks for it (its blocks are freed when
      the worker reports the save finished). The worker's reports arrive in
      StepResult (finished_recving, finished_sending, failed_recving,
      invalid_block_ids).
    - ``kv_load_failure_policy``: what a failed load does (vLLM's
      KVTransferConfig.kv_load_failure_policy): ``"recompute"`` truncates the
      request's computed tokens at the first invalid block and recomputes
      them; ``"fail"`` finishes the affected requests with FINISHED_ERROR.
    - ``kv_cache_groups``: the KV cache groups (``()`` = one full-attention
      group, the plain layout); two or more make vLLM's
      HybridKVCacheCoordinator, one sliding-window group its
      UnitaryKVCacheCoordinator over a SlidingWindowManager.
    """

    # Each field's bounds and the trace format version that brought it are
    # declared with it (``declare``, spec/validate.py): validation, the trace
    # schema and the strategies read them there. The maxima keep a hostile
    # config from exhausting memory (the pool is an array of num_blocks).
    block_size: int = field(default=16, metadata=declare(minimum=1, maximum=1 << 16))
    num_blocks: int = field(
        default=65, metadata=declare(minimum=2, maximum=1 << 24, why="block 0 is the reserved null block")
    )
    max_num_batched_tokens: int = field(default=256, metadata=declare(minimum=1, maximum=1 << 24))
    max_num_seqs: int = field(default=16, metadata=declare(minimum=1, maximum=1 << 20))
    max_model_len: int = field(default=256, metadata=declare(minimum=1, maximum=1 << 24))
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = field(default=0, metadata=declare(minimum=0))
    enable_prefix_caching: bool = True
    policy: Policy = Policy.FCFS
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool = field(default=False, metadata=declare(since=2))
    num_speculative_tokens: int = field(
        default=0,
        metadata=declare(
            minimum=0, maximum=MAX_SPECULATIVE_TOKENS, range_text="between {minimum} (off) and {maximum}", since=2
        ),
    )
    max_loras: int = field(default=0, metadata=declare(minimum=0, maximum=1 << 10, since=3))
    watermark: float = field(default=0.0, metadata=declare(minimum=0, below=1.0, since=3))
    prefill_schedule_interval: int = field(default=1, metadata=declare(minimum=1, maximum=1 << 20, since=3))
    max_num_encoder_input_tokens: int = field(default=0, metadata=declare(minimum=0, maximum=1 << 24, since=3))
    encoder_cache_size: int = field(default=0, metadata=declare(minimum=0, maximum=1 << 24, since=3))
    kv_connector: bool = field(default=False, metadata=declare(since=4))
    kv_load_failure_policy: str = field(
        default="fail", metadata=declare(choices=KV_LOAD_FAILURE_POLICIES, since=4)
    )
    kv_cache_groups: tuple[KVCacheGroup, ...] = field(
        default=(), metadata=declare(max_items=MAX_KV_CACHE_GROUPS, since=4)
    )
    #: vLLM's CacheConfig.prefix_match_unit, the hash block size: the token
    #: boundary prefix-cache keys are computed at (0 = vLLM's default, the GCD
    #: of the groups' block sizes: the block size in the modelled layouts);
    #: spec/validate.py, _check_hash_block_size, says what vLLM refuses
    hash_block_size: int = field(default=0, metadata=declare(minimum=0, maximum=1 << 16, since=7))
    #: vLLM's KVEventsConfig.enable_kv_cache_events: the scheduler queues the
    #: KV cache events (spec/kv_events.py) for ``take_kv_events()``
    enable_kv_cache_events: bool = field(default=False, metadata=declare(since=4))
    pipeline_parallel_size: int = field(default=1, metadata=declare(minimum=1, maximum=4, since=7))
    #: vLLM's model runner (VllmConfig.use_v2_model_runner, vllm/config/vllm.py):
    #: "v2" is Model Runner V2, whose decisions spec/runner_v2.py models
    model_runner: str = field(default="v1", metadata=declare(choices=MODEL_RUNNERS, since=7))
    #: the drafter of speculative decoding (vLLM's SpeculativeConfig.method):
    #: "draft_model" and "eagle" reserve lookahead slots (``num_lookahead_tokens``);
    #: "eagle" also hashes each block with the token after it
    #: (``num_hash_lookahead_tokens``); "eagle" came with trace format 8
    drafter: str = field(default="ngram", metadata=declare(choices=DRAFTERS, since=7,
                                                           choices_since=(("eagle", 8),)))

    def __post_init__(self) -> None:
        validate_config(self, Policy, KVCacheGroup)

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        """The KV cache groups in force: ``kv_cache_groups``, or the one
        full-attention group of the plain layout."""
        return self.kv_cache_groups or (KVCacheGroup(),)

    @property
    def is_hybrid(self) -> bool:
        """Whether the layout is other than one full-attention group (then
        plans and views carry ``group_block_ids``)."""
        return self.groups != (KVCacheGroup(),)

    @property
    def watermark_blocks(self) -> int:
        """The blocks admission keeps free (vllm/v1/core/kv_cache_manager.py,
        KVCacheManager.__init__: ``int(watermark * num_gpu_blocks)``, where
        num_gpu_blocks counts the null block too)."""
        return int(self.watermark * self.num_blocks)

    @property
    def has_encoder(self) -> bool:
        return self.encoder_cache_size > 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @cached_property
    def max_concurrent_batches(self) -> int:
        """k, the plans the engine keeps in flight (spec/validate.py,
        max_concurrent_batches): ``pipeline_parallel_size`` without async
        scheduling, two with it. Cached: every schedule() reads it."""
        return max_concurrent_batches(self)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the scheduled tokens for the drafter
        (vllm/config/vllm.py, VllmConfig.num_lookahead_tokens): 0 for the
        ngram method, num_speculative_tokens for a draft model or EAGLE
        (use_eagle() or uses_draft_model())."""
        return self.num_speculative_tokens if self.drafter in ("draft_model", "eagle") else 0

    @property
    def num_prefill_lookahead_tokens(self) -> int:
        """Prefill tokens past the scheduled ones the drafter reads
        (vllm/config/vllm.py, VllmConfig.num_prefill_lookahead_tokens): 1 for
        EAGLE (it reads the next token), 0 for the others. It widens the
        encoder-input window (Scheduler._try_schedule_encoder_inputs,
        shift_computed_tokens); the chunk-end reserve
        (Scheduler._reserve_prefill_lookahead) never binds at 1."""
        return 1 if self.drafter == "eagle" and self.num_speculative_tokens else 0

    @property
    def num_hash_lookahead_tokens(self) -> int:
        """Tokens after a block that its prefix-cache key covers
        (vllm/config/vllm.py, VllmConfig.num_hash_lookahead_tokens): EAGLE's
        prefill lookahead with prefix caching on and no KV connector, else 0.
        With it the scheduler clears use_eagle_block_drop (Scheduler.__init__:
        "Lookahead hashes prove the boundary token"), so no hit drops a block."""
        if self.kv_connector or not self.enable_prefix_caching:
            return 0
        return self.num_prefill_lookahead_tokens

    @property
    def num_draft_slots(self) -> int:
        """The batch slots a scheduled request takes beyond its tokens for
        the drafter (vllm/config/speculative.py,
        SpeculativeConfig.max_num_new_slots_for_drafting): 1 for a draft
        model, which keeps one unsliced input token; 0 for the ngram method."""
        return 1 if self.drafter == "draft_model" and self.num_speculative_tokens else 0

    def to_dict(self) -> dict[str, Any]:
        """Every field by name; the fields added after the first trace format
        (declared ``since`` a later version: ``async_scheduling``,
        ``num_speculative_tokens``, the admission gates, the KV connector and
        groups) only when they differ from their defaults, so a default
        config serializes as it always did."""
        out: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if not (declaration_of(f).since > 1 and getattr(self, f.name) == f.default)
        }
        out["policy"] = self.policy.value
        if "kv_cache_groups" in out:
            out["kv_cache_groups"] = [g.to_dict() for g in self.kv_cache_groups]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SchedulerConfig:
        if not isinstance(data, Mapping):
            raise ConfigError("<config>", f"must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], "unknown field")
        kwargs = dict(data)
        if "policy" in kwargs:
            raw = kwargs["policy"]
            if isinstance(raw, Policy):
                pass
            elif isinstance(raw, str) and raw in {p.value for p in Policy}:
                kwargs["policy"] = Policy(raw)
            else:
                raise ConfigError("policy", f"must be one of 'fcfs', 'priority', got {raw!r}")
        if "kv_cache_groups" in kwargs:
            raw_groups = kwargs["kv_cache_groups"]
            if not isinstance(raw_groups, (list, tuple)):
                raise ConfigError("kv_cache_groups", f"must be a list, got {type(raw_groups).__name__}")
            kwargs["kv_cache_groups"] = tuple(
                KVCacheGroup.from_dict(g, f"kv_cache_groups[{i}]") for i, g in enumerate(raw_groups)
            )
        return cls(**kwargs)


#: Content key of a cached full block: (the request's block identity up to
#: that block, every token id from the start of the request through the end
#: of that block). The identity is the cache salt or "" for a request without
#: a LoRA adapter or encoder inputs (RequestSpec.block_identity). The spec keys
#: its prefix cache by content, never by a digest, so no collision can fake a
#: hit.
BlockKey = tuple[str, tuple[int, ...]]

#: Ends the identity of a block key of KV cache group g >= 1 (followed by
#: ``g``), as vLLM's BlockHashWithGroupId appends the group id to the block
#: hash (vllm/v1/core/kv_cache_utils.py, make_block_hash_with_group_id): the
#: same content cached in two groups is two entries. Group 0's keys carry no
#: suffix, so the plain layout's keys are what they always were.
GROUP_KEY_SEPARATOR = "\x1d"


def group_block_key(key: BlockKey, group: int) -> BlockKey:
    """``key`` as the prefix-cache key of a block of KV cache group ``group``."""
    if group == 0:
        return key
    return (f"{key[0]}{GROUP_KEY_SEPARATOR}{group}", key[1])


def block_key_group(key: BlockKey) -> int:
    """The KV cache group a prefix-cache key belongs to (see group_block_key)."""
    ident = key[0]
    i = ident.rfind(GROUP_KEY_SEPARATOR)
    if i < 0:
        return 0
    tail = ident[i + 1 :]
    return int(tail) if tail.isdigit() else 0


@dataclass(frozen=True)
class MMInput:
    """One multimodal encoder input of a request (vLLM's MultiModalFeatureSpec):
    it covers prompt positions ``offset .. offset + length - 1`` and its
    encoder produces ``length`` embeddings. ``identifier`` is vLLM's mm_hash:
    inputs with equal identifiers share an encoder-cache entry and must have
    equal lengths."""

    offset: int = field(metadata=declare(minimum=0))
    length: int = field(metadata=declare(minimum=1))
    identifier: str = field(metadata=declare(min_length=1))

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "length": self.length, "identifier": self.identifier}


@dataclass(frozen=True)
class RequestSpec:
    """One generation request, as a client submits it.

    ``arrival`` orders requests of equal priority (vLLM's arrival_time);
    ties are broken by request_id as vLLM's Request.__lt__ does.

    With a KV connector (``SchedulerConfig.kv_connector``; a request that
    sets any of these without one is refused at add):
    ``kv_external_tokens`` is how many leading prompt tokens the connector's
    store holds for this request: the modelled connector's
    get_num_new_matched_tokens offers the part of them beyond the local
    prefix-cache hit (vllm/distributed/kv_transfer/kv_connector/v1/base.py,
    KVConnectorBase_V1.get_num_new_matched_tokens); ``kv_load_async`` makes
    that load asynchronous (the request waits in WAITING_FOR_REMOTE_KVS, as a
    disaggregated decode instance does), otherwise it is loaded within the
    step that admits the request; ``kv_save_async`` makes the connector keep
    the request's blocks when it finishes until the worker reports the save
    finished (request_finished returning delay_free_blocks, as a prefill
    instance does for its decode peer).
    """

    # Each field's bounds and the trace format version that brought it are
    # declared with it (``declare``, spec/validate.py).
    request_id: str = field(metadata=declare(min_length=1))
    prompt_token_ids: tuple[int, ...] = field(metadata=declare(min_items=1))
    max_tokens: int = field(metadata=declare(minimum=1))
    priority: int = 0
    arrival: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = field(default=None, metadata=declare(minimum=0))
    ignore_eos: bool = False
    cache_salt: str | None = None
    lora_id: int = field(default=0, metadata=declare(minimum=0, why="0 = no adapter", since=3))
    #: "full": with KV cache events on, each prefix lookup that hits also
    #: reports the hit blocks as a BlockStored per group (spec/kv_events.py,
    #: "reused"; vLLM's SamplingParams.extra_args["kv_cache_report_mode"])
    kv_cache_report_mode: str = field(default="incremental", metadata=declare(choices=KV_CACHE_REPORT_MODES, since=8))
    structured_output: bool = field(default=False, metadata=declare(since=3))
    grammar_rejects: tuple[int, ...] = field(default=(), metadata=declare(since=3))
    mm_inputs: tuple[MMInput, ...] = field(default=(), metadata=declare(since=3))
    kv_external_tokens: int = field(default=0, metadata=declare(minimum=0, since=4))
    kv_load_async: bool = field(default=False, metadata=declare(since=4))
    kv_save_async: bool = field(default=False, metadata=declare(since=4))
    #: a streaming-input session (vLLM's Request.resumable): it continues
    #: with each SessionUpdate instead of finishing (spec/sessions.py)
    resumable: bool = field(default=False, metadata=declare(since=6))

    def __post_init__(self) -> None:
        validate_request(self)

    @property
    def salt(self) -> str:
        """The salt as it enters block keys: vLLM ignores an empty salt."""
        return self.cache_salt or ""

    def block_identity(self, end: int) -> str:
        """The identity part of the key of the block ending at token ``end``:
        what vLLM's block hash chains in besides the tokens
        (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys): the
        cache salt, the LoRA adapter (_gen_lora_extra_hash_keys), and each
        encoder input overlapping a block up to this one with its position
        (_gen_mm_extra_hash_keys). As inputs of equal identifier have equal
        lengths, the inputs starting before ``end`` with their offsets say
        exactly that. Just the salt for a request with neither, so the keys of
        such requests are what they always were."""
        mm = tuple((m.offset, m.identifier) for m in self.mm_inputs if m.offset < end)
        if not self.lora_id and not mm:
            return self.salt
        return "\x00" + repr((self.salt, self.lora_id, mm))

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (tuples as lists); the fields added after the
        first trace format (declared ``since`` a later version: the admission
        gates' and the KV connector's) only when they differ from their
        defaults, so a default request serializes as it always did."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if declaration_of(f).since > 1 and value == f.default:
                continue
            if isinstance(value, tuple):
                value = [v.to_dict() if isinstance(v, MMInput) else v for v in value]
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestSpec:
        """The inverse of ``to_dict`` (lists become tuples); a bad field raises
        RequestError naming it."""
        rid = str(data.get("request_id", "<request>")) if isinstance(data, Mapping) else "<request>"
        if not isinstance(data, Mapping):
            raise RequestError(rid, "<request>", f"must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(rid, unknown[0], "unknown field")
        kwargs = dict(data)
        for name, kind, _ in declared(cls):
            if kind == tuple[int, ...] and isinstance(kwargs.get(name), list):
                kwargs[name] = tuple(kwargs[name])
        raw = kwargs.get("mm_inputs")
        if isinstance(raw, (list, tuple)):
            items = []
            for i, item in enumerate(raw):
                if isinstance(item, MMInput):
                    items.append(item)
                    continue
                if not isinstance(item, Mapping) or set(item) != {"offset", "length", "identifier"}:
                    raise RequestError(
                        rid, f"mm_inputs[{i}]", "must be an object with offset, length and identifier"
                    )
                items.append(MMInput(item["offset"], item["length"], item["identifier"]))
            kwargs["mm_inputs"] = tuple(items)
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise RequestError(rid, "<request>", str(exc)) from None


@dataclass(frozen=True)
class SessionUpdate:
    """The next input chunk of a streaming-input session, or its end
    (vLLM: add_request with the session's id, vllm/v1/request.py,
    StreamingUpdate; the end is the non-resumable final request, which
    StreamingUpdate.from_request turns into the ``None`` sentinel).

    ``prompt_token_ids`` is the chunk's new input (never empty: vLLM's input
    processor refuses an empty prompt, input_processor.py,
    _validate_model_input), ``max_tokens`` the output allowed after it.
    ``end=True`` ends the session: no chunk, and ``max_tokens`` is ignored."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = ()
    max_tokens: int = 1
    end: bool = False

    def __post_init__(self) -> None:
        rid = self.request_id if isinstance(self.request_id, str) else "<session>"
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError(rid, "request_id", "must be a non-empty string")
        if not isinstance(self.end, bool):
            raise RequestError(rid, "end", f"must be a boolean, got {self.end!r}")
        toks = self.prompt_token_ids
        if not isinstance(toks, tuple) or not all(type(t) is int and t >= 0 for t in toks):
            raise RequestError(rid, "prompt_token_ids", "must be a tuple of token ids >= 0")
        if self.end and toks:
            raise RequestError(rid, "prompt_token_ids", "an end of session carries no chunk")
        if not self.end and not toks:
            raise RequestError(rid, "prompt_token_ids", "the chunk cannot be empty (vLLM refuses an empty prompt)")
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise RequestError(rid, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")

    def to_dict(self) -> dict[str, Any]:
        if self.end:
            return {"request_id": self.request_id, "end": True}
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "max_tokens": self.max_tokens}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SessionUpdate:
        rid = str(data.get("request_id", "<session>")) if isinstance(data, Mapping) else "<session>"
        if not isinstance(data, Mapping):
            raise RequestError(rid, "<session_update>", "must be an object")
        unknown = sorted(set(data) - {"request_id", "prompt_token_ids", "max_tokens", "end"})
        if unknown:
            raise RequestError(rid, unknown[0], "unknown field")
        toks = data.get("prompt_token_ids", [])
        if not isinstance(toks, list):
            raise RequestError(rid, "prompt_token_ids", "must be a list of token ids")
        return cls(data.get("request_id"), tuple(toks), data.get("max_tokens", 1),  # type: ignore[arg-type]
                   data.get("end", False))


def supports_sessions(scheduler: object) -> bool:
    """Whether ``scheduler`` defines the optional ``session_update``
    (streaming-input sessions, spec/sessions.py)."""
    return callable(getattr(scheduler, "session_update", None))


# --------------------------------------------------------------------------
# Step plans and results
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: what a model runner needs.

    ``block_ids`` is the whole block table after this step's allocation;
    ``num_tokens`` is how many tokens the request knows (prompt + output) at
    schedule time.

    ``num_output_placeholders`` is the number of the request's output tokens
    that were in flight when the scheduler made this entry (async scheduling:
    vLLM's ``request.num_output_placeholders`` at schedule time; always 0
    without async scheduling). ``num_computed_tokens`` already counts them, as
    vLLM's does. ``spec_token_ids`` are the draft tokens this step verifies
    (vLLM's ``scheduled_spec_decode_tokens[req_id]``); a draft whose id the
    scheduler does not know is -1 (async scheduling's placeholder drafts, and
    the padding of a newly admitted decode).

    ``encoder_inputs`` are the indices into the request's ``mm_inputs`` whose
    encoder runs in this step (vLLM's ``scheduled_encoder_inputs[req_id]``).

    ``num_invalid_spec_tokens`` is vLLM's
    ``SchedulerOutput.num_invalid_spec_tokens[req_id]`` as ``schedule()``
    returns the output, and that is always 0: vLLM fills the field only
    later, on the async path, when
    ``Scheduler.update_draft_token_ids_in_output``
    (vllm/v1/core/sched/scheduler.py) checks the worker's drafts for an
    already scheduled output against the grammar, replaces the refused ones
    (from the first refused token on) by -1 and counts them there; that
    changes no scheduler state (update_from_output reads the count for
    spec-decoding statistics only). Without async scheduling,
    ``update_draft_token_ids`` cuts the request's drafts at the first refused
    token before the next plan is made, so that plan carries fewer drafts and
    no count. The spec, ImplScheduler and the vLLM adapter therefore always
    report 0, the lockstep comparison holds a scheduler to that, and no
    invariant reads the field.

    ``group_block_ids`` holds, for a hybrid layout (``config.is_hybrid``),
    the block table of every KV cache group in group order (vLLM's
    ``block_ids`` tuple per group); ``block_ids`` is then group 0's table.
    A sliding-window group's table has the null block 0 in the places of the
    blocks it freed. Empty for the plain layout.

    ``token_ids`` are the tokens to compute, at positions
    ``num_computed_tokens .. num_computed_tokens + num_scheduled_tokens - 1`` of
    the sequence: the known tokens, then -1 for each in-flight placeholder,
    then the drafts. The step samples (at least one token) iff it reaches past
    every known and in-flight token: see ``samples``.
    """

    request_id: str
    kind: ScheduleKind
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_tokens: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    spec_token_ids: tuple[int, ...] = ()
    num_output_placeholders: int = 0
    encoder_inputs: tuple[int, ...] = ()
    num_invalid_spec_tokens: int = 0
    group_block_ids: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(
        cls,
        request_id: str,
        kind: ScheduleKind,
        *,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        all_token_ids: Sequence[int],
        block_ids: tuple[int, ...],
        spec_token_ids: tuple[int, ...] = (),
        num_output_placeholders: int = 0,
        encoder_inputs: tuple[int, ...] = (),
        num_invalid_spec_tokens: int = 0,
        group_block_ids: tuple[tuple[int, ...], ...] = (),
    ) -> ScheduledRequest:
        """The entry of a request that knows ``all_token_ids`` (prompt then
        output), with ``num_output_placeholders`` output tokens in flight and
        ``spec_token_ids`` drafts to verify: ``num_tokens`` and the slice to
        compute follow from them, so every scheduler that builds its entries
        here derives them alike."""
        end = num_computed_tokens + num_scheduled_tokens
        if num_output_placeholders or spec_token_ids:
            seq: Sequence[int] = (
                tuple(all_token_ids) + (-1,) * num_output_placeholders + tuple(spec_token_ids)
            )
        else:
            seq = all_token_ids
        return cls(
            request_id=request_id,
            kind=kind,
            num_computed_tokens=num_computed_tokens,
            num_scheduled_tokens=num_scheduled_tokens,
            num_tokens=len(all_token_ids),
            block_ids=block_ids,
            token_ids=tuple(seq[num_computed_tokens:end]),
            spec_token_ids=tuple(spec_token_ids),
            num_output_placeholders=num_output_placeholders,
            encoder_inputs=tuple(encoder_inputs),
            num_invalid_spec_tokens=num_invalid_spec_tokens,
            group_block_ids=group_block_ids,
        )

    @property
    def samples(self) -> bool:
        """Whether this step reaches past every known and in-flight token, so
        the model samples: one token, plus one per accepted draft."""
        return (
            self.num_computed_tokens + self.num_scheduled_tokens
            >= self.num_tokens + self.num_output_placeholders
        )

    @property
    def max_sampled(self) -> int:
        """The most tokens the result may hold for this entry: 0 for a partial
        prefill chunk, else 1 + the drafts (every draft accepted, then the bonus
        token)."""
        return 1 + len(self.spec_token_ids) if self.samples else 0

    @property
    def is_prefill_chunk(self) -> bool:
        return not self.samples


@dataclass(frozen=True)
class KVLoad:
    """A load the KV connector asks the worker for in a step (what vLLM's
    connector metadata carries to the worker: update_state_after_alloc and
    build_connector_meta): tokens ``start .. end - 1`` of the request's
    sequence come from the connector's store into its blocks (``block_ids``,
    group 0's table; ``group_block_ids`` every group's for a hybrid layout).
    A synchronous load (``asynchronous`` False) is complete before the step's
    forward reads it; an asynchronous one is reported later in a
    StepResult's ``finished_recving`` (or ``failed_recving`` /
    ``invalid_block_ids``)."""

    request_id: str
    start: int
    end: int
    block_ids: tuple[int, ...]
    asynchronous: bool
    group_block_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StepPlan:
    """The scheduler's decision for one step, in scheduling order (running
    requests first, in running-queue order, then admissions in admission order).

    ``preempted_ids`` lists the requests preempted since the previous plan (in
    this step, or by reset_prefix_cache(reset_running_requests=True) before
    it); ``finished_ids`` the requests that finished since the previous plan.
    Both are sorted: vLLM keeps them in sets. ``freed_encoder_inputs`` lists
    the encoder-cache entries (mm identifiers) freed since the previous plan,
    in the order they were freed (vLLM's ``free_encoder_mm_hashes``).
    ``kv_loads`` lists the connector loads this step starts, in admission
    order (empty without a KV connector). ``skip_drafts``: no scheduled
    request can use the drafts proposed after this step, so the drafter may
    skip proposing them (vLLM's SchedulerOutput.skip_drafts; only with the V2
    runner and a drafter that reserves lookahead slots, spec/runner_v2.py).
    """

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...]
    finished_ids: tuple[str, ...]
    freed_encoder_inputs: tuple[str, ...] = ()
    kv_loads: tuple[KVLoad, ...] = ()
    skip_drafts: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    def get(self, request_id: str) -> ScheduledRequest | None:
        for s in self.scheduled:
            if s.request_id == request_id:
                return s
        return None

    @property
    def scheduled_ids(self) -> tuple[str, ...]:
        return tuple(s.request_id for s in self.scheduled)


@dataclass(frozen=True)
class StepResult:
    """The model's output for a plan.

    ``sampled[req]``: for every scheduled entry that samples, 1 + a tokens,
    where a (0 <= a <= the entry's drafts) is the number of drafts accepted:
    the accepted drafts in order, then the bonus token (vLLM's
    ``sampled_token_ids``); without drafts exactly one token. Nothing for a
    partial prefill chunk.

    ``draft_token_ids[req]``: the drafter's proposals made after this step, for
    the request's next step (vLLM's ``update_draft_token_ids``, which the engine
    core calls after ``update_from_output``): at most num_speculative_tokens
    ids, only for entries of this plan that sample (an empty tuple is allowed
    for any scheduled entry). With async scheduling the scheduler schedules -1
    placeholder drafts instead and ignores these ids once validated.

    The KV connector's worker side (vLLM's KVConnectorOutput in
    ModelRunnerOutput.kv_connector_output), all empty without a connector:
    ``finished_recving`` the requests whose asynchronous load finished,
    ``finished_sending`` the finished requests whose asynchronous save
    finished (their held blocks are freed), ``failed_recving`` the requests
    whose asynchronous load failed as a whole, ``invalid_block_ids`` the
    blocks a load failed to fill (vllm/v1/core/sched/scheduler.py,
    update_from_output: _handle_failed_recving, _handle_invalid_blocks,
    _update_from_kv_xfer_finished). A load ends with its request in
    ``finished_recving``, also a load that failed: the failure comes in the
    same result (``failed_recving`` or ``invalid_block_ids``), as vLLM's
    worker reports it. A report may arrive in the result of any plan, also
    one that scheduled nothing.
    """

    sampled: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    draft_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    finished_recving: tuple[str, ...] = ()
    finished_sending: tuple[str, ...] = ()
    failed_recving: tuple[str, ...] = ()
    invalid_block_ids: tuple[int, ...] = ()


# --------------------------------------------------------------------------
# Read-only views
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestView:
    """A request as a scheduler reports it: the request as submitted
    (``spec``: its every field, read as ``view.spec.max_tokens``, declared
    once in RequestSpec) and the request's state in the scheduler (the fields
    below, vLLM's Request fields of those names where vLLM has one)."""

    spec: RequestSpec
    status: RequestStatus
    output_token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]
    num_preemptions: int
    #: async scheduling: the output tokens in flight, counted in
    #: num_computed_tokens
    num_output_placeholders: int = 0
    #: the drafts held for the next step; -1 for a placeholder draft
    spec_token_ids: tuple[int, ...] = ()
    #: vLLM's Request.is_prefill_chunk (the last step scheduled for it stopped
    #: short of its known and in-flight tokens); reported only with the prefill
    #: cadence on (config.prefill_schedule_interval > 1), whose rule reads it,
    #: and False otherwise
    is_prefill_chunk: bool = False
    #: every KV cache group's block table for a hybrid layout (block_ids is
    #: group 0's), empty for the plain layout
    group_block_ids: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(
        cls,
        spec: RequestSpec,
        *,
        status: RequestStatus,
        output_token_ids: tuple[int, ...],
        num_computed_tokens: int,
        block_ids: tuple[int, ...],
        num_preemptions: int,
        num_output_placeholders: int = 0,
        spec_token_ids: tuple[int, ...] = (),
        is_prefill_chunk: bool = False,
        group_block_ids: tuple[tuple[int, ...], ...] = (),
    ) -> RequestView:
        """The view of request ``spec`` in the given state (the constructor,
        with the state by keyword)."""
        return cls(
            spec=spec,
            status=status,
            output_token_ids=output_token_ids,
            num_computed_tokens=num_computed_tokens,
            block_ids=block_ids,
            num_preemptions=num_preemptions,
            num_output_placeholders=num_output_placeholders,
            spec_token_ids=spec_token_ids,
            is_prefill_chunk=is_prefill_chunk,
            group_block_ids=group_block_ids,
        )

    @property
    def request_id(self) -> str:
        """The request's id (``spec.request_id``), the key a view shares with
        a ScheduledRequest."""
        return self.spec.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.spec.prompt_token_ids + self.output_token_ids

    @property
    def salt(self) -> str:
        return self.spec.salt

    def block_identity(self, end: int) -> str:
        """As RequestSpec.block_identity."""
        return self.spec.block_identity(end)


@dataclass(frozen=True)
class KVView:
    """The paged KV pool. ``ref_cnt[b]`` is the number of requests holding
    block ``b`` (the null block 0 reports 0); ``free_queue`` lists the free
    blocks in eviction order, head first; ``block_keys`` maps every block that
    carries a prefix-cache key to that key; ``cache_index`` lists, per key,
    the blocks registered under it in lookup order (a hit takes the first);
    ``partial_index`` the same for partial-block entries."""

    num_blocks: int
    block_size: int
    ref_cnt: tuple[int, ...]
    free_queue: tuple[int, ...]
    block_keys: Mapping[int, BlockKey]
    cache_index: Mapping[BlockKey, tuple[int, ...]]
    #: the partial prefix-cache entries (a hash block size below the block
    #: size: BlockPool.cache_partial_block), key -> the blocks registered
    #: under it in insertion order; a key here is a prefix ending inside a
    #: block, never one of cache_index
    partial_index: Mapping[BlockKey, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def keyed_blocks(self) -> set[int]:
        """The blocks that carry any prefix-cache key, a full or a partial
        one (vLLM: a block whose block_hash is set)."""
        out = set(self.block_keys)
        for blocks in self.partial_index.values():
            out.update(blocks)
        return out


@dataclass(frozen=True)
class SchedulerView:
    """A snapshot of a scheduler's whole observable state.

    ``requests`` holds every unfinished request; ``finished`` holds requests
    that finished since the last schedule() (their ids go into the next plan's
    ``finished_ids``), with their final status and output. ``waiting`` is in
    service order: with a KV connector, vLLM's kv_holding_waiting (requests
    holding blocks for a load, drained first) comes before its waiting queue.

    The admission gates' state: ``pause_state`` (vLLM's Scheduler.pause_state);
    ``encoder_cache`` maps each cached encoder output (mm identifier) to its
    embeddings and ``encoder_cache_free`` is the cache space left (vLLM's
    EncoderCacheManager.cached / num_free_slots; empty and 0 without an
    encoder); ``num_executed_steps`` and ``last_prefill_step`` are the prefill
    cadence's counters and ``prefill_capacity_bound`` its escape (vLLM's
    Scheduler fields of those names), tracked only when
    ``config.prefill_schedule_interval > 1`` (0, -1 and False otherwise).

    The KV connector's state (empty without one): ``kv_held_by_finished``
    maps each finished request that still holds blocks to them, group 0's
    table first and then the other groups' blocks (an asynchronous save not
    yet reported finished, or an abort during an asynchronous load not yet
    reported: vLLM keeps such a request in Scheduler.requests until
    _free_blocks); ``kv_loads_done`` and ``kv_loads_failed`` are the requests
    in WAITING_FOR_REMOTE_KVS whose load was reported finished, or failed,
    and which the waiting loop has not promoted yet (vLLM's
    finished_recving_kv_req_ids and failed_recving_kv_req_ids), sorted.
    """

    config: SchedulerConfig
    step: int
    requests: Mapping[str, RequestView]
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv: KVView
    finished: Mapping[str, RequestView]
    preempted_since_plan: tuple[str, ...] = ()
    pause_state: PauseState = PauseState.UNPAUSED
    encoder_cache: Mapping[str, int] = field(default_factory=dict)
    encoder_cache_free: int = 0
    num_executed_steps: int = 0
    last_prefill_step: int = -1
    prefill_capacity_bound: bool = False
    kv_held_by_finished: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    kv_loads_done: tuple[str, ...] = ()
    kv_loads_failed: tuple[str, ...] = ()


# --------------------------------------------------------------------------
# The Scheduler protocol
# --------------------------------------------------------------------------


@runtime_checkable
class Scheduler(Protocol):
    """What schedspec drives. One step is ``plan = schedule()`` then
    ``update(plan, result)``; ``add``, ``abort`` and ``reset_prefix_cache``
    may come between steps. An operation that raises changes nothing.

    With ``config.async_scheduling`` one plan may be in flight: schedule() may
    be called while exactly one plan awaits its update (never two), and the
    updates come in plan order, each exactly once; add, abort and
    reset_prefix_cache may come while a plan is in flight. In general up to
    k - 1 plans may await update at a schedule(), k being
    ``config.max_concurrent_batches`` (pipeline parallelism:
    ``pipeline_parallel_size`` without async scheduling). spec/protocol.py
    states the rules and raises ProtocolError for a call that breaks them.

    Two optional methods, which a scheduler that supports the gate defines
    (the checking engine detects them; see ``supports_pause`` and
    ``supports_grammar``):

    - ``set_pause_state(state: PauseState) -> None`` (vLLM's
      Scheduler.set_pause_state);
    - ``grammar_ready(request_id: str, ok: bool = True) -> None``: the
      structured-output grammar of a request waiting for one finished
      compiling (``ok=False``: it failed to compile). An unknown or finished
      id, or a request that does not wait for a grammar, raises ProtocolError
      naming it and changes nothing.

    And, for the scheduler statistics (spec/stats.py), a constructor keyword
    ``log_stats`` (vLLM's Scheduler argument) with
    ``make_stats() -> SchedulerStats | None``, called once after each update
    (None when built without log_stats); a class declares it with
    ``Capabilities.stats`` (schedspec/check/capabilities.py)."""

    @property
    def config(self) -> SchedulerConfig: ...

    def add(self, request: RequestSpec) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def schedule(self) -> StepPlan: ...

    def update(self, plan: StepPlan, result: StepResult) -> None: ...

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool: ...

    def view(self) -> SchedulerView: ...


def supports_pause(scheduler: object) -> bool:
    """Whether ``scheduler`` defines the optional ``set_pause_state``."""
    return callable(getattr(scheduler, "set_pause_state", None))


def supports_grammar(scheduler: object) -> bool:
    """Whether ``scheduler`` defines the optional ``grammar_ready``."""
    return callable(getattr(scheduler, "grammar_ready", None))


#: How every part of schedspec names "a way to build a scheduler": a class or
#: any callable from a validated config to a fresh Scheduler.
SchedulerFactory = Callable[[SchedulerConfig], Scheduler]


# --------------------------------------------------------------------------
# KV cache events (the rules: spec/kv_events.py)
# --------------------------------------------------------------------------

#: The medium vLLM's device block pool reports (vllm/distributed/kv_events.py, MEDIUM_GPU).
MEDIUM_GPU = "GPU"



@dataclass(frozen=True)
class BlockStored:
    """Blocks registered in the prefix cache (vLLM's BlockStored)."""

    block_keys: tuple[BlockKey, ...]
    parent_key: BlockKey | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str
    group: int
    kind: str
    #: the blocks were cached already: a prefix hit reported for a request
    #: whose kv_cache_report_mode is "full" (BlockPool.emit_cached_block_events,
    #: no block changes); vLLM's event does not say so, the adapter marks
    #: what that method queued
    reused: bool = False
    #: per block, the tokens after it that its key covers (vLLM's
    #: BlockStored.lookahead_token_ids, BlockPool._lookahead_token_ids); None
    #: without hash lookahead (SchedulerConfig.num_hash_lookahead_tokens)
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """One key a block lost (vLLM's BlockRemoved, one hash per event)."""

    block_keys: tuple[BlockKey, ...]
    medium: str
    group: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset (vLLM's AllBlocksCleared)."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def plain_key(key: BlockKey) -> BlockKey:
    """``key`` as group 0 spells it (group_block_key undone): what an event carries."""
    ident = key[0]
    i = ident.rfind(GROUP_KEY_SEPARATOR)
    if i >= 0 and ident[i + 1 :].isdigit():
        return (ident[:i], key[1])
    return key
