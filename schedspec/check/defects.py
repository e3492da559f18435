"""The vLLM 0.33 defects the generators steer around, as data.

Each record names a behaviour of vLLM 0.33 that the default check would
otherwise meet again and again (a stall, a read of invalid KV) although it is
already written up in docs/divergences.md: what vLLM does, the entry there
(its title), what reports it in a trace that still holds it, the generator's
draws it changes (``knobs``) and the predicate that says when it applies to a
request under a config. The generators ask ``avoid(knob, config, request)``
before a draw and leave the draw out (or take the safe one) when a record
applies; replayed traces and hand-written cases may still hold every
combination, so the spec, the invariants and the fake model keep reporting
them.

A defect vLLM fixes is one record less; a new one is one record more, with
its knob where the generator makes that draw (check/kv_requests.py,
``KVRequests.decorate``; ``keep_failed_sync_loads_alive`` for the events).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

from schedspec.spec.interface import Policy, RequestSpec, SchedulerConfig
from schedspec.spec.kv_kinds import kind_of

from schedspec.check.workload import Abort, AddRequest, Event, KVLoadDone, KVLoadFailed, SessionInput

# The draws a defect can change (what ``knobs`` holds):

#: an external prefix loaded asynchronously (avoided: the load is synchronous)
ASYNC_LOAD = "async load"
#: a synchronous load reported failed (avoided: no failure is drawn)
FAIL_SYNC_LOAD = "failed synchronous load"
#: an asynchronous load failed at one block (avoided: it fails as a whole)
FAIL_ASYNC_LOAD_AT_BLOCK = "asynchronous load failed at a block"
#: an abort of a request after its synchronous load was reported failed
#: (avoided: the abort is left out)
ABORT_AFTER_FAILED_SYNC_LOAD = "abort after a failed synchronous load"

KNOBS: tuple[str, ...] = (ASYNC_LOAD, FAIL_SYNC_LOAD, FAIL_ASYNC_LOAD_AT_BLOCK, ABORT_AFTER_FAILED_SYNC_LOAD)


@dataclass(frozen=True)
class Defect:
    """One vLLM 0.33 behaviour the generators steer around."""

    #: a short name (what tests and reports call it)
    name: str
    #: what vLLM does, in a sentence, with the file and function
    behaviour: str
    #: the title the entry of docs/divergences.md starts with
    section: str
    #: what reports it when a trace holds it (an invariant id, the fake
    #: model's kv-context, a stall)
    reported_by: str
    #: the generator's draws it changes (KNOBS)
    knobs: frozenset[str]
    #: whether it applies to ``request`` under ``config``
    applies: Callable[[SchedulerConfig, RequestSpec], bool]
    #: what a run that meets it fails with: the invariant ids, and "stall"
    #: for a failure of kind stall (``known_defect`` matches on them)
    reports: frozenset[str] = frozenset()
    #: draws (KNOBS) that mark a trace holding it without being avoided: a
    #: defect the generators cannot steer around without losing the rules
    #: those draws reach (it is named when met, never drawn around)
    witness: frozenset[str] = frozenset()
    #: for a witnessed defect, what else the trace must hold (None: nothing);
    #: for one with neither knobs nor witness draws (the scheduler's own
    #: choice makes it, no draw of the generator), all the trace must hold
    witnessed: Callable[[SchedulerConfig, list[Event]], bool] | None = None


def _one_token_prompt(config: SchedulerConfig, request: RequestSpec) -> bool:
    return len(request.prompt_token_ids) <= 1


def _async_load_over_spec_reserve(config: SchedulerConfig, request: RequestSpec) -> bool:
    """Whether an asynchronous load of the request's prompt can never be
    admitted: vLLM admits one only if its blocks fit beside
    ``_spec_decode_step_blocks``, a reservation it makes even with nothing
    running (counted per group, without a sliding window's cap: on the safe
    side)."""
    if not config.num_speculative_tokens:
        return False
    n = len(request.prompt_token_ids)
    bs, groups = config.block_size, len(config.groups)
    step = 1 + config.num_speculative_tokens + config.num_lookahead_tokens
    need = groups * (-(-min(n, config.max_model_len) // bs) + -(-step // bs))
    return need > config.num_blocks - 1


def _async_scheduling(config: SchedulerConfig, request: RequestSpec) -> bool:
    return config.async_scheduling


def _has_encoder_inputs(config: SchedulerConfig, request: RequestSpec) -> bool:
    return bool(request.mm_inputs)


def _recompute_with_skipping_group(config: SchedulerConfig, request: RequestSpec) -> bool:
    """Under "recompute" with a group that frees blocks before the request's
    end (a sliding window, a chunk), a load failure that leaves tokens to
    recompute after the load's first block rewinds the request below blocks
    already nulled."""
    return config.kv_load_failure_policy == "recompute" and any(
        kind_of(g).skips for g in config.kv_cache_groups
    )


def _synchronous_load(config: SchedulerConfig, request: RequestSpec) -> bool:
    return not request.kv_load_async


def _recomputed_synchronous_load(config: SchedulerConfig, request: RequestSpec) -> bool:
    return config.kv_load_failure_policy == "recompute" and not request.kv_load_async


def _cached_synchronous_load(config: SchedulerConfig, request: RequestSpec) -> bool:
    return config.enable_prefix_caching and not request.kv_load_async


def _priority_with_prefix_caching(config: SchedulerConfig, events: list[Event]) -> bool:
    return config.policy == Policy.PRIORITY and config.enable_prefix_caching


def _a_session(config: SchedulerConfig, events: list[Event]) -> bool:
    return any(isinstance(e, SessionInput) for e in events) or any(
        isinstance(e, AddRequest) and e.request.resumable for e in events)


def _priority_with_an_async_load(config: SchedulerConfig, events: list[Event]) -> bool:
    return config.policy == Policy.PRIORITY and any(
        isinstance(e, AddRequest) and e.request.kv_load_async and e.request.kv_external_tokens for e in events)


def _any_request(config: SchedulerConfig, request: RequestSpec) -> bool:
    return True


def _failed_load_shares_a_block(config: SchedulerConfig, events: list[Event]) -> bool:
    """Whether a request whose synchronous load the events fail shares its
    first block of external tokens with another request of the events."""
    added = {e.request.request_id: e.request for e in events if isinstance(e, AddRequest)}
    bs = config.block_size
    for e in events:
        req = added.get(e.request_id) if isinstance(e, KVLoadFailed) else None
        if req is None or req.kv_load_async or req.kv_external_tokens < bs:
            continue
        head = req.prompt_token_ids[:bs]
        if any(o is not req and o.prompt_token_ids[:bs] == head for o in added.values()):
            return True
    return False


#: Every defect the generators steer around, in the order docs/divergences.md
#: writes them up.
DEFECTS: tuple[Defect, ...] = (
    Defect(
        name="one-token-async-load",
        behaviour=("a one-token prompt loaded asynchronously is promoted with no token computed, so the "
                   "waiting loop asks the stateless connector again and loads it after every report, never "
                   "finishing (scheduler.py, _update_waiting_for_remote_kv and schedule())"),
        section="A one-token prompt loaded asynchronously",
        reported_by="a stall",
        knobs=frozenset({ASYNC_LOAD}),
        applies=_one_token_prompt,
        reports=frozenset({"stall", "progress"}),
    ),
    Defect(
        name="async-load-over-spec-reserve",
        behaviour=("with speculative decoding an asynchronous load is admitted only if its blocks fit beside "
                   "_spec_decode_step_blocks, reserved even with nothing running: a prompt within that "
                   "reservation of the whole pool waits for ever (scheduler.py, schedule(), the WAITING loop)"),
        section="An asynchronous load within one speculative step of the whole pool is never admitted",
        reported_by="a stall (progress and progress-admits-head stand aside for it)",
        knobs=frozenset({ASYNC_LOAD}),
        applies=_async_load_over_spec_reserve,
        reports=frozenset({"stall", "progress", "progress-admits-head"}),
    ),
    Defect(
        name="stale-placeholder-after-failed-sync-load",
        behaviour=("with async scheduling update_from_output skips a request whose synchronous load failed "
                   "before giving back its output placeholder, so later plans carry a -1 that no output fills "
                   "(scheduler.py, update_from_output, failed_kv_load_req_ids)"),
        section="A stale output placeholder after a failed synchronous load",
        reported_by="kv-context (the fake model)",
        knobs=frozenset({FAIL_SYNC_LOAD}),
        applies=_async_scheduling,
        reports=frozenset({"kv-context"}),
    ),
    Defect(
        name="recompute-into-freed-window",
        behaviour=("under \"recompute\" a load failure truncates the request's computed tokens below blocks its "
                   "sliding window or chunk already replaced by the null block, and the recomputed tokens "
                   "attend positions whose blocks are gone (scheduler.py, _update_requests_with_invalid_blocks)"),
        section="Recompute into a freed sliding window",
        reported_by="group-tables-cover",
        knobs=frozenset({FAIL_SYNC_LOAD, FAIL_ASYNC_LOAD_AT_BLOCK}),
        applies=_recompute_with_skipping_group,
        reports=frozenset({"group-tables-cover"}),
    ),
    Defect(
        name="shared-invalid-block-holder-aborted",
        behaviour=("under \"recompute\" a second holder of a shared invalid block keeps counting it computed "
                   "because the first holder will recompute it; if that holder is aborted first, the second "
                   "reads invalid KV (scheduler.py, _update_requests_with_invalid_blocks, "
                   "marked_invalid_block_ids)"),
        section="A shared invalid block whose recomputing holder is aborted or preempted is read as",
        reported_by="invalid-block-not-computed",
        knobs=frozenset({ABORT_AFTER_FAILED_SYNC_LOAD}),
        applies=_synchronous_load,
        reports=frozenset({"invalid-block-not-computed"}),
    ),
    Defect(
        name="shared-invalid-block-holder-preempted",
        behaviour=("under \"recompute\" the invalid blocks of a failed synchronous load stay in the prefix "
                   "cache: a preemption of their holder before its recompute leaves them keyed, and the next "
                   "hit counts invalid KV as computed (scheduler.py, _update_requests_with_invalid_blocks); the "
                   "preemption is the scheduler's, so no draw avoids it"),
        section="A shared invalid block whose recomputing holder is aborted or preempted is read as",
        reported_by="invalid-block-not-computed",
        knobs=frozenset(),
        applies=_recomputed_synchronous_load,
        reports=frozenset({"invalid-block-not-computed"}),
        witness=frozenset({FAIL_SYNC_LOAD}),
    ),
    Defect(
        name="same-step-hit-on-failed-sync-load",
        behaviour=("a request admitted in the step of another's synchronous load with a prefix hit on the "
                   "blocks that load writes keeps them as computed when the load is reported failed; only the "
                   "loading request recomputes (scheduler.py, _update_requests_with_invalid_blocks); avoiding "
                   "it would mean never failing a load whose prefix is shared"),
        section="A prefix hit in the step of a synchronous load that fails reads the invalid block",
        reported_by="kv-context (the fake model)",
        knobs=frozenset(),
        applies=_cached_synchronous_load,
        reports=frozenset({"kv-context"}),
        witness=frozenset({FAIL_SYNC_LOAD}),
        witnessed=_failed_load_shares_a_block,
    ),
    Defect(
        name="silent-stream-holds-the-pool",
        behaviour=("a streaming-input session waiting for its client's next chunk keeps every block it holds "
                   "and a running slot for as long as the client is silent; nothing preempts it, so a request "
                   "that needs those blocks waits as long (scheduler.py, _handle_stopped_request and the "
                   "WAITING loop's num_waiting_for_streaming_input); the client's silence is no draw to avoid"),
        section="A silent streaming-input request holds its blocks",
        reported_by="stream-liveness",
        knobs=frozenset(),
        applies=_any_request,
        reports=frozenset({"stream-liveness"}),
        witnessed=_a_session,
    ),
    Defect(
        name="victim-preempted-in-its-step",
        behaviour=("under PRIORITY a victim preempted in the step that scheduled it keeps the prefix-cache keys "
                   "its allocate_slots gave the blocks its chunk was to fill; _preempt_request frees them keyed, "
                   "the step no longer writes them, and a later hit reads KV never written (scheduler.py, "
                   "schedule() RUNNING loop and _preempt_request); the preemption is the scheduler's, so no "
                   "draw avoids it"),
        section="A victim preempted in the step that scheduled it leaves prefix-cache keys on blocks whose KV",
        reported_by="kv-context (the fake model)",
        knobs=frozenset(),
        applies=_any_request,
        reports=frozenset({"kv-context"}),
        witnessed=_priority_with_prefix_caching,
    ),
    Defect(
        name="async-load-prefill-livelock",
        behaviour=("under PRIORITY an asynchronous load admitted into the blocks a whole-pool prefill's "
                   "self-preemption freed holds them while the prefill resumes (a request waiting for its KV is "
                   "no victim), the prefill preempts itself again, and the loaded request, once running, is "
                   "preempted by priority and loads again (scheduler.py, schedule() RUNNING loop, "
                   "_preempt_request; the WAITING loop's load admission)"),
        section="An asynchronous load and a prefill that needs the whole pool take turns for ever",
        reported_by="stall",
        knobs=frozenset(),
        applies=_any_request,
        reports=frozenset({"stall"}),
        witnessed=_priority_with_an_async_load,
    ),
    Defect(
        name="rewind-before-unencoded-input",
        behaviour=("a recompute that rewinds a request before an encoder input it never encoded, while its "
                   "own later input fills the encoder cache, leaves it never scheduled again (scheduler.py, "
                   "_try_schedule_encoder_inputs; encoder_cache_manager.py, can_allocate)"),
        section="A recompute that rewinds a request before an encoder input it never encoded can stall it",
        reported_by="progress",
        knobs=frozenset({FAIL_SYNC_LOAD}),
        applies=_has_encoder_inputs,
        reports=frozenset({"stall", "progress"}),
    ),
)


def avoid(knob: str, config: SchedulerConfig, request: RequestSpec) -> bool:
    """Whether the draw ``knob`` (KNOBS) for ``request`` under ``config``
    would meet a defect of DEFECTS: the generator then leaves it out."""
    return any(knob in d.knobs and d.applies(config, request) for d in DEFECTS)


def keep_failed_sync_loads_alive(events: list[Event], config: SchedulerConfig) -> list[Event]:
    """``events`` less the aborts that ABORT_AFTER_FAILED_SYNC_LOAD avoids:
    an abort of a request after the worker reported its synchronous load
    failed ("shared-invalid-block-holder-aborted")."""
    sync = {e.request.request_id for e in events
            if isinstance(e, AddRequest) and avoid(ABORT_AFTER_FAILED_SYNC_LOAD, config, e.request)}
    failed: set[str] = set()
    out: list[Event] = []
    for e in events:
        if isinstance(e, KVLoadFailed) and e.request_id in sync:
            failed.add(e.request_id)
        if isinstance(e, Abort) and e.request_id in failed:
            continue
        out.append(e)
    return out


def _loads(events: Iterable[Event]) -> Iterator[tuple[Event, RequestSpec | None]]:
    """Each event with the request it names as last added before it (None
    for one that names none or an unknown request)."""
    added: dict[str, RequestSpec] = {}
    for e in events:
        if isinstance(e, AddRequest):
            added[e.request.request_id] = e.request
            yield e, e.request
        else:
            rid = getattr(e, "request_id", None)
            yield e, added.get(rid) if isinstance(rid, str) else None


def _sync_load(request: RequestSpec) -> bool:
    return bool(request.kv_external_tokens) and not request.kv_load_async


def draws(defect: Defect, config: SchedulerConfig, events: Iterable[Event]) -> tuple[str, ...]:
    """The requests of ``events`` that hold a draw ``defect`` changes where
    it applies under ``config`` (the generator would have left it out): an
    asynchronous load, a failed synchronous load, an asynchronous load failed
    at a block, an abort after a failed synchronous load."""
    out: dict[str, None] = {}
    failed: set[str] = set()
    for e, req in _loads(events):
        if req is None or not defect.applies(config, req):
            continue
        rid = req.request_id
        if isinstance(e, AddRequest) and ASYNC_LOAD in defect.knobs and req.kv_external_tokens and req.kv_load_async:
            out[rid] = None
        elif isinstance(e, KVLoadFailed):
            if _sync_load(req):
                failed.add(rid)
                if FAIL_SYNC_LOAD in defect.knobs | defect.witness:
                    out[rid] = None
            elif req.kv_load_async and e.block_index is not None and FAIL_ASYNC_LOAD_AT_BLOCK in defect.knobs:
                out[rid] = None
        elif isinstance(e, Abort) and rid in failed and ABORT_AFTER_FAILED_SYNC_LOAD in defect.knobs:
            out[rid] = None
    return tuple(out)


def known_defect(config: SchedulerConfig, events: Iterable[Event], reported: Iterable[str]) -> Defect | None:
    """The defect of DEFECTS that explains a failure reporting ``reported``
    (invariant ids, "stall" for a stall) on a workload of ``config`` and
    ``events``: one reported that way whose draw the events hold where it
    applies. None when none does (a bug of ours, or a defect not written up)."""
    ids = set(reported)
    events = list(events)
    for d in DEFECTS:
        if not d.reports & ids:
            continue
        if not d.knobs and not d.witness:  # the scheduler's own choice: the trace's shape alone says
            if d.witnessed is not None and d.witnessed(config, events):
                return d
        elif draws(d, config, events) and (d.witnessed is None or d.witnessed(config, events)):
            return d
    return None


def failure_reports(kind: str, violation_ids: Iterable[str]) -> frozenset[str]:
    """What a failure of ``kind`` with ``violation_ids`` reports, as
    ``Defect.reports`` names it."""
    return frozenset(violation_ids) | ({"stall"} if kind == "stall" else set())


def describe(defect: Defect) -> str:
    """The line a run that met ``defect`` says."""
    return f"known vLLM 0.33 defect: {defect.section}, docs/divergences.md ({defect.name})"


def steer(events: Iterable[Event], config: SchedulerConfig) -> tuple[Event, ...]:
    """``events`` with every draw a defect of DEFECTS avoids under
    ``config`` taken out, as the generators would have drawn them for it:
    an avoided asynchronous load becomes synchronous (leaving a token to
    compute; its load reports dropped), an avoided failed synchronous load is
    not reported, an avoided failure at a block fails the load as a whole,
    and an abort after a failed synchronous load is left out. For a workload
    drawn under another config (a capability declaration turning async
    scheduling on or off, a block size raised): the identity on one the
    generators drew for ``config``."""
    out: list[Event] = []
    made_sync: set[str] = set()
    for e, req in _loads(events):
        if isinstance(e, AddRequest):
            r = e.request
            made_sync.discard(r.request_id)
            if r.kv_external_tokens and r.kv_load_async and avoid(ASYNC_LOAD, config, r):
                ext = min(r.kv_external_tokens, len(r.prompt_token_ids) - 1)
                r = replace(r, kv_external_tokens=max(ext, 0), kv_load_async=False)
                made_sync.add(r.request_id)
                e = AddRequest(r)
            out.append(e)
            continue
        if req is not None and isinstance(e, (KVLoadDone, KVLoadFailed)) and req.request_id in made_sync:
            continue
        if req is not None and isinstance(e, KVLoadFailed):
            if _sync_load(req) and avoid(FAIL_SYNC_LOAD, config, req):
                continue
            if req.kv_load_async and e.block_index is not None and avoid(FAIL_ASYNC_LOAD_AT_BLOCK, config, req):
                e = KVLoadFailed(e.request_id, None)
        out.append(e)
    return tuple(keep_failed_sync_loads_alive(out, config))
