"""vLLM 0.33.0's real v1 Scheduler behind schedspec's Scheduler protocol.

``VllmScheduler(config)`` builds vLLM's ``Scheduler`` (or a user subclass, as
vLLM accepts for ``scheduler_cls``) for exactly the configuration the spec
models, feeds it our events, and translates its ``SchedulerOutput`` into our
``StepPlan`` and its internal state into our ``SchedulerView``, so vLLM can run
in lockstep with the spec and be held to the same invariants.

No GPU, no weights, no hub: the model is a tiny Llama ``config.json`` in a
temporary directory and the KV cache is a ``KVCacheConfig`` with no tensors
(../shared/VLLM_NOTES.md, beside the repository, says how vLLM 0.33 runs with
no GPU). vLLM and torch are imported lazily, on the first ``VllmScheduler``
(vllm_load.load_vllm); importing this module imports neither.

How vLLM is loaded and configured, how our requests become vLLM's and how
its output and state are translated back live in the modules beside this
one: vllm_load.py (and vllm_names.py), vllm_config.py, vllm_requests.py,
vllm_views.py and vllm_kv.py.

The two modes beyond the synchronous default:

* ``config.async_scheduling``: vLLM's ``AsyncScheduler``
  (vllm/v1/core/sched/async_scheduler.py), driven as the engine core's
  ``step_with_batch_queue`` drives it (vllm/v1/engine/core.py): schedule() for
  step N+1 may come while step N awaits its update; updates come in plan
  order. An entry's ``num_output_placeholders`` is the request's count before
  this step's own (``_update_after_schedule`` adds 1 + the step's drafts to
  every entry that samples), its drafts are vLLM's -1 placeholders, and the
  drafts in a result never reach vLLM (the worker keeps them).
* ``config.num_speculative_tokens`` = k > 0: a ``speculative_config`` of k
  n-gram drafts, built on the CPU without weights as vLLM's own
  tests/v1/core/utils.py (``create_scheduler``) builds one: method ``ngram``
  for the synchronous scheduler, ``ngram_gpu`` with async scheduling (the
  n-gram method vLLM's V1 model runner accepts with async scheduling, with the
  same scheduler-side numbers: no lookahead slots, no extra drafting slots).
  An entry's ``spec_token_ids`` are ``scheduled_spec_decode_tokens``; a result's
  ``sampled`` (accepted drafts, then the bonus token) is the
  ``ModelRunnerOutput``'s ``sampled_token_ids``; in sync mode its
  ``draft_token_ids`` go to ``update_draft_token_ids`` after
  ``update_from_output``, for the plan's entries in plan order, as the engine
  core's ``post_step`` hands over the worker's proposals.

The admission gates, each off unless the config or request turns it on:

* ``watermark`` and ``prefill_schedule_interval`` go into vLLM's
  scheduler_config as they are; ``max_loras`` > 0 makes a ``lora_config``.
* A request's ``lora_id`` becomes a ``LoRARequest`` (lora_int_id = the id, a
  name and path derived from it, which vLLM's block hashes chain in). Block
  keys carry ``RequestSpec.block_identity`` (salt, adapter, encoder inputs).
* ``structured_output``: the request carries a constraint, so vLLM adds it in
  WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR; its grammar is a Future (what the
  structured-output manager's background compile hands over) that
  ``grammar_ready`` resolves with a modelled grammar refusing
  ``grammar_rejects``, or with an error. The manager's backend is a stub that
  only allocates bitmasks; the adapter asks for the grammar bitmask where the
  engine core does (after schedule(), or for an async plan with structured
  tokens in flight after the previous update, with the worker's drafts
  checked first: update_draft_token_ids_in_output).
* ``mm_inputs`` become MultiModalFeatureSpecs (positions, size, identifier,
  no data); the encoder budget and cache size are set on the scheduler as
  vLLM's own scheduler tests do, a text-only model having none.
* ``set_pause_state`` is vLLM's; views report its pause state, the encoder
  cache and the prefill cadence's counters (normalised to their idle values
  without a cadence, where vLLM keeps counting to no effect).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from schedspec.check.capabilities import Capabilities
from schedspec.spec.stats import SchedulerStats
from schedspec.spec.interface import (
    PauseState,
    RequestSpec,
    RequestView,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)
from schedspec.spec.protocol import (
    check_abort,
    check_add,
    check_config,
    check_grammar_ready,
    check_kv_reports,
    check_kv_reset,
    check_mm_lengths,
    check_pause_state,
    check_reset,
    check_resumable,
    check_result,
    check_schedule,
)

from schedspec.spec.kv_events import KVCacheEvent

from schedspec.adapters.vllm_config import build_vllm_config, check_managers
from schedspec.adapters.vllm_events import EventCapture, ReusedMarks, translate
from schedspec.adapters.vllm_kv import blocks_kept_after_reset, kv_connector_output
from schedspec.adapters.vllm_load import VllmAdapterError, into_vllm, load_vllm
from schedspec.adapters.vllm_message import MessageCheck
from schedspec.adapters.vllm_runner import check_runner, resuming, runner_env
from schedspec.adapters.vllm_requests import Grammar, GrammarBackend, Live, vllm_request
from schedspec.adapters.vllm_sessions import SessionsAdapter
from schedspec.adapters.vllm_stats import PreemptionCounter, scheduler_stats_in, stats_of
from schedspec.adapters.vllm_views import (
    BlockKeys,
    BlockTables,
    Statuses,
    encoder_view,
    held_by_finished,
    kv_view,
    plan_of,
    request_view,
)


@dataclass(frozen=True)
class RawStep:
    """One ``VllmScheduler.raw_step``: seconds inside vLLM's schedule() and
    update_from_output() (wall clock and process CPU time), how many requests
    the step scheduled, and whether each got exactly one token (decode)."""

    wall_s: float
    cpu_s: float
    scheduled: int
    decode: bool


def is_async_scheduler_class(cls: type) -> bool:
    """Whether ``cls`` is vLLM's AsyncScheduler or a subclass of it: such a
    class is driven with a step in flight (``async_scheduling``), any other
    vLLM Scheduler class synchronously."""
    load_vllm()
    from schedspec.adapters.vllm_names import AsyncScheduler

    return isinstance(cls, type) and issubclass(cls, AsyncScheduler)


#: What ``vllm`` (vLLM's own Scheduler and AsyncScheduler, picked by the
#: config) supports: everything the spec does, in all four modes, with every
#: admission gate (LoRA, structured outputs, pause states, the watermark, the
#: prefill cadence, the encoder budget), the KV connector (the modelled one,
#: schedspec/adapters/vllm_connector.py), hybrid KV cache groups and every
#: engine feature (sessions, a pipeline, Model Runner V2, drafters).
VLLM_CAPABILITIES = Capabilities(async_scheduling=True, speculative_decoding=True, kv_events=True,
                                 stats=True).with_gates().with_kv().with_engine()


def capabilities_of_class(cls: type) -> Capabilities:
    """What a user's vLLM scheduler class supports through the adapter:
    speculative decoding, every admission gate, the KV connector and hybrid
    KV cache groups always (the adapter drives them through vLLM's own
    Scheduler code); async scheduling for an AsyncScheduler
    subclass (which is driven only with a step in flight: a synchronous
    config is refused when it is built)."""
    is_async = is_async_scheduler_class(cls)
    return Capabilities(async_scheduling=is_async, speculative_decoding=True,
                        sync_scheduling=not is_async, kv_events=True, stats=True).with_gates().with_kv().with_engine()


class VllmScheduler(SessionsAdapter):
    """Implements spec.interface.Scheduler on top of vLLM's real Scheduler.

    ``scheduler_cls`` may name a subclass of vLLM's Scheduler (what vLLM takes
    as ``scheduler_cls``); it is built exactly as vLLM's engine builds one. A
    subclass of AsyncScheduler needs ``config.async_scheduling`` and any
    other class needs it off (``is_async_scheduler_class`` tells which). By
    default the class is vLLM's AsyncScheduler with async scheduling on, its
    Scheduler otherwise.
    """

    CAPABILITIES = VLLM_CAPABILITIES

    def __init__(self, config: SchedulerConfig, scheduler_cls: type | None = None, log_stats: bool = False) -> None:
        config = check_config(config)
        load_vllm()
        from schedspec.adapters import vllm_names as v

        if scheduler_cls is not None and not isinstance(scheduler_cls, type):
            raise TypeError(f"scheduler_cls must be a class, got {scheduler_cls!r}")
        self._config = config
        cls: type
        if scheduler_cls is None:
            cls = v.AsyncScheduler if config.async_scheduling else v.Scheduler
        else:
            cls = scheduler_cls
            if issubclass(cls, v.AsyncScheduler) != config.async_scheduling:
                kind = "a subclass of vLLM's AsyncScheduler" if config.async_scheduling else (
                    "a vLLM Scheduler class that is not an AsyncScheduler")
                raise VllmAdapterError(
                    f"{cls.__qualname__}: async_scheduling={config.async_scheduling} needs {kind} "
                    "(vLLM drives an AsyncScheduler with a step in flight, any other scheduler "
                    "synchronously)"
                )
        self._vllm_config, kv_cache_config = build_vllm_config(config)
        with runner_env(config):  # Scheduler.__init__ reads use_v2_model_runner (vllm_runner.py)
            self.sched: Any = into_vllm(
                cls,
                vllm_config=self._vllm_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=v.StructuredOutputManager(self._vllm_config),
                block_size=config.block_size,
                # as EngineCore.__init__ passes resolve_kv_cache_block_sizes's
                # (vllm_config.py checks it is the config's)
                hash_block_size=config.hash_block_size or config.block_size,
                log_stats=log_stats,
            )
        for attr in ("requests", "waiting", "running", "kv_cache_manager", "finished_req_ids"):
            if not hasattr(self.sched, attr):
                raise VllmAdapterError(
                    f"{cls.__name__} has no attribute {attr!r}: the adapter reads vLLM "
                    "Scheduler internals and needs a subclass of vllm's Scheduler"
                )
        if config.has_encoder:
            self._set_encoder_budget(config)
        self._pin_finish_order()
        # log_stats: vLLM's statistics of the last update, mapped (vllm_stats.py)
        self._preemptions = PreemptionCounter(self.sched) if log_stats else None
        self._last_stats: SchedulerStats | None = None
        # The structured-output manager's backend (a tokenizer-bound compiler
        # in vLLM): only the bitmask allocation is reached, grammars are ours.
        som = self.sched.structured_output_manager
        som.backend = GrammarBackend(v.torch, self._vllm_config.model_config.get_vocab_size())
        som.backend_name = "schedspec"
        managers = self.sched.kv_cache_manager.coordinator.single_type_managers
        check_managers(managers, config)
        check_runner(self.sched, config)
        if self._config.kv_connector:
            from schedspec.adapters.vllm_connector import SchedspecKVConnector

            if not isinstance(self.sched.connector, SchedspecKVConnector):
                raise VllmAdapterError(
                    f"vLLM built the KV connector {type(self.sched.connector).__name__}, not the "
                    "modelled SchedspecKVConnector")
        # every group's block table, as vLLM keeps it and as a model runner sees it
        self._tables = BlockTables(managers)
        # the SchedulerOutput's fields the plan does not carry, held to it
        self._message = MessageCheck(config)
        self._hybrid = config.is_hybrid
        self._connector = config.kv_connector
        self._statuses = Statuses()
        # EngineCore's request_block_hasher hashes in units of the hash block size
        unit = config.hash_block_size or config.block_size
        self._block_hasher = v.block_hasher(unit, config.num_hash_lookahead_tokens)
        self._live: dict[str, Live] = {}
        self._finished: dict[str, RequestView] = {}
        self._keys = BlockKeys(unit, config.num_hash_lookahead_tokens)
        self._step = 0
        # plans awaiting update, oldest first, each with vLLM's SchedulerOutput
        self._in_flight: list[tuple[StepPlan, Any]] = []
        self._async = config.async_scheduling
        self._drafts = config.num_speculative_tokens > 0 and not config.async_scheduling
        self._mm_lengths: dict[str, int] = {}  # every mm identifier seen -> its length
        self._grammars: dict[str, Any] = {}  # request id -> the Future of its grammar
        # request id -> the group-0 blocks its asynchronous load writes, until
        # the worker reports the load (finished_recving)
        self._kv_loading: dict[str, tuple[int, ...]] = {}
        # the KV cache events (vllm_events.py): vLLM's published batches
        # captured, and those translated since the last take_kv_events()
        self._kv_capture: EventCapture | None = None
        self._kv_marks: ReusedMarks | None = None
        self._kv_events: list[KVCacheEvent] = []
        if config.enable_kv_cache_events:
            self._kv_capture = self.sched.kv_event_publisher = EventCapture()
            self._kv_marks = ReusedMarks(self.sched.kv_cache_manager.block_pool)

    def _pin_finish_order(self) -> None:
        """update_from_output finishes the requests of a step's errors (a
        grammar that failed to compile, a failed KV load under the "fail"
        policy) by handing finish_requests a set of request ids, whose
        iteration order (and so the order their blocks are freed in) depends
        on the process's hash seed. The spec takes them in sorted order, one
        of the orders vLLM may take; the adapter has vLLM take it too: a set
        handed to the scheduler's finish_requests (which makes a set of any
        collection it gets) is finished one request at a time, in sorted
        order. Nothing finish_requests does to one request reads another's
        state, so this is the set's walk in that order
        (docs/divergences.md)."""
        finish = self.sched.finish_requests

        def finish_requests(request_ids: Any, finished_status: Any) -> Any:
            if not isinstance(request_ids, (set, frozenset)):
                return finish(request_ids, finished_status)
            done: list[Any] = []
            for rid in sorted(request_ids):
                done.extend(finish(rid, finished_status))
            return done

        self.sched.finish_requests = finish_requests

    def _set_encoder_budget(self, config: SchedulerConfig) -> None:
        """The encoder budget and cache of a multimodal model. vLLM derives both
        from the model's processor (vllm/multimodal/encoder_budget.py,
        MultiModalBudget) when the model supports multimodal inputs; with no
        model the scheduler gets them set as vLLM's own scheduler tests set
        them: its ``max_num_encoder_input_tokens`` and an EncoderCacheManager
        of ``encoder_cache_size`` embeddings (scheduler.py, __init__, builds
        exactly these from the budget)."""
        sched = self.sched
        if sched.max_num_encoder_input_tokens or sched.encoder_cache_manager.cache_size:
            raise VllmAdapterError("vLLM built an encoder budget of its own for a text-only model")
        sched.max_num_encoder_input_tokens = config.max_num_encoder_input_tokens
        from schedspec.adapters.vllm_names import EncoderCacheManager

        sched.encoder_cache_manager = EncoderCacheManager(cache_size=config.encoder_cache_size)

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    # ------------------------------------------------------------------ events

    def add(self, request: RequestSpec) -> None:
        # The spec's boundary: vLLM's own input processor rejects these before
        # the scheduler ever sees them.
        request = check_add(request, self._config, self._live, self._finished)
        check_mm_lengths(request, self._mm_lengths)
        check_resumable(request, self._config)
        rid = request.request_id
        req = self.vllm_request(request)
        live = Live(request, req)
        self._keys.record(live)
        if request.structured_output:
            # What StructuredOutputManager.grammar_init does: the grammar
            # compiles in the background; the scheduler polls the Future.
            future: Future[Any] = Future()
            req.structured_output_request.grammar = future
            self._grammars[rid] = future
        into_vllm(self.sched.add_request, req)
        self._live[rid] = live
        for mm in request.mm_inputs:
            self._mm_lengths.setdefault(mm.identifier, mm.length)

    def set_pause_state(self, state: PauseState) -> None:
        """vLLM's Scheduler.set_pause_state, as the engine core's
        pause_scheduler/resume call it."""
        from schedspec.adapters.vllm_names import VPauseState

        state = check_pause_state(state)
        into_vllm(self.sched.set_pause_state, VPauseState(int(state)))

    def grammar_ready(self, request_id: str, ok: bool = True) -> None:
        """The request's grammar finished compiling (``ok=False``: it failed):
        its Future gets the modelled grammar or the compile error, which the
        waiting loop finds when it next reaches the request
        (scheduler.py, _handle_blocked_waiting_request)."""
        live = self._live.get(request_id) if isinstance(request_id, str) else None
        status = self._statuses.of(live.req) if live is not None else None
        future = self._grammars.get(request_id) if isinstance(request_id, str) else None
        # resolved already, though the waiting loop may not have looked yet
        reported = future is not None and future.done()
        check_grammar_ready(request_id, ok, status, reported)
        assert live is not None and future is not None
        if ok:
            future.set_result(Grammar(live.spec.grammar_rejects))
        else:
            future.set_exception(ValueError(f"grammar of {request_id!r} failed to compile"))

    def vllm_request(self, request: RequestSpec) -> Any:
        """The vLLM Request for ``request``, as the engine would hand it to the
        scheduler (no bookkeeping of this adapter's; the benchmark adds these
        straight to vLLM's scheduler)."""
        return vllm_request(request, self._block_hasher, self._connector)

    # ------------------------------------------------------------------ raw timing

    def raw_add(self, request: RequestSpec) -> None:
        """Add ``request`` straight to vLLM's scheduler, without this adapter's
        bookkeeping (a content key per block hash, for its views), which would
        otherwise dominate a memory measurement. A scheduler fed this way is
        stepped with ``raw_step`` only; ``schedule``/``update``/``view`` do
        not know its requests."""
        self.sched.add_request(self.vllm_request(request))

    def raw_step(self, sample: Callable[[int], int]) -> RawStep:
        """One step of vLLM's own ``schedule()`` + ``update_from_output()``,
        bypassing the translation to StepPlans and views: what vLLM's
        scheduling costs. The model output is fake: a request that reaches
        its known tokens samples ``sample(num_tokens)``. Only the two vLLM
        calls are timed, on the wall clock and on the process's CPU clock."""
        wall, cpu = time.perf_counter, time.process_time
        inner = self.sched
        t0, c0 = wall(), cpu()
        out = inner.schedule()
        t1, c1 = wall(), cpu()
        ids = list(out.num_scheduled_tokens)
        reqs = inner.requests
        sampled: list[list[int]] = []
        for rid in ids:
            r = reqs[rid]
            # vLLM advanced num_computed_tokens in schedule(); a step samples
            # when it reaches the request's known tokens.
            sampled.append([sample(r.num_tokens)] if r.num_computed_tokens >= r.num_tokens else [])
        from schedspec.adapters.vllm_names import ModelRunnerOutput

        runner_output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        t2, c2 = wall(), cpu()
        inner.update_from_output(out, runner_output)
        t3, c3 = wall(), cpu()
        return RawStep(
            wall_s=(t1 - t0) + (t3 - t2),
            cpu_s=(c1 - c0) + (c3 - c2),
            scheduled=len(ids),
            decode=all(n == 1 for n in out.num_scheduled_tokens.values()),
        )

    def abort(self, request_id: str) -> None:
        from schedspec.adapters.vllm_names import VRequestStatus

        check_abort(request_id, self._live)
        into_vllm(self.sched.finish_requests, request_id, VRequestStatus.FINISHED_ABORTED)
        self._collect_finished([request_id])

    def _plans(self) -> list[StepPlan]:
        return [plan for plan, _ in self._in_flight]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        check_reset(self._plans(), self._config)
        if reset_running_requests and (self._connector or self.has_sessions()):
            check_kv_reset(blocks_kept_after_reset(self.sched, self._tables.groups))
        done = into_vllm(self.sched.reset_prefix_cache, reset_running_requests=reset_running_requests)
        if reset_running_requests:
            self._message.reset()
        return bool(done)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan:
        check_schedule(self._plans(), self._config)
        # V2 sends a resumed request as new (vllm_runner.py, resuming)
        preempted = resuming(self.sched) if self._config.model_runner == "v2" else frozenset()
        out = into_vllm(self.sched.schedule)
        self._step += 1
        self._finished = {}
        plan = plan_of(out, self._step, self._live, self._tables, async_scheduling=self._async,
                       hybrid=self._hybrid, resumed_as_new=preempted)
        self._message.check(out, plan, self._live)
        bs = self._config.block_size
        for load in plan.kv_loads:
            if load.asynchronous:
                first, end = load.start // bs, -(-load.end // bs)
                self._kv_loading[load.request_id] = load.block_ids[first:end]
        self._in_flight.append((plan, out))
        if self._grammars and not (self._async and out.pending_structured_output_tokens):
            # What the engine core does before sampling (core.py, step and
            # step_with_batch_queue): the grammar bitmask of the batch. A plan
            # whose structured-output requests still have tokens in flight
            # gets it after the previous step's update.
            into_vllm(self.sched.get_grammar_bitmask, out)
        return plan

    # ------------------------------------------------------------------ update

    def _check_result(self, plan: StepPlan, result: StepResult) -> Any:
        """The spec's protocol checks, so a bad update never reaches vLLM;
        vLLM's SchedulerOutput for ``plan`` (the oldest in flight)."""
        check_result(plan, self._plans(), result, self._live, self._config)
        if self._connector:
            sched = self.sched
            held = {rid for rid, r in sched.requests.items() if r.is_finished()}
            running = {r.request_id for r in sched.running}
            check_kv_reports(plan, result, self._config, self._kv_loading, held, running)
        return self._in_flight[0][1]

    def update(self, plan: StepPlan, result: StepResult) -> None:
        out = self._check_result(plan, result)
        ids = [s.request_id for s in plan.scheduled]
        from schedspec.adapters.vllm_names import DraftTokenIds, ModelRunnerOutput

        runner_output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[list(result.sampled.get(rid, ())) for rid in ids],
            kv_connector_output=kv_connector_output(result),
        )
        self._in_flight.pop(0)
        for rid in result.finished_recving:
            self._kv_loading.pop(rid, None)
        outputs = into_vllm(self.sched.update_from_output, out, runner_output)
        if self._preemptions is not None:
            # Scheduler.make_stats ran at the end of update_from_output
            found = scheduler_stats_in(outputs)
            self._last_stats = None if found is None else stats_of(found, self._preemptions.take())
        if self._async and self._in_flight:
            deferred = self._in_flight[0][1]
            if deferred.pending_structured_output_tokens:
                self._deferred_bitmask(deferred, plan, result)
        if self._drafts and ids:
            # What EngineCore.post_step hands over after a step that ran: the
            # worker's proposals for every request of the batch.
            drafts = result.draft_token_ids
            into_vllm(self.sched.update_draft_token_ids, DraftTokenIds(
                req_ids=list(ids), draft_token_ids=[list(drafts.get(rid, ())) for rid in ids]))
        self.sync_sessions(ids)  # sessions vLLM updated in place (vllm_sessions.py)
        for rid in ids:
            live = self._live.get(rid)
            if live is not None:
                self._keys.record(live)
        if self._connector:
            # a failed load under the "fail" policy finishes requests that
            # were not scheduled (update_from_output, failed_kv_load_req_ids)
            self._collect_finished(list(self._live))
        else:
            self._collect_finished(ids)
        if self._grammars:
            # a grammar that failed to compile finishes its request here
            # (update_from_output, grammar_compile_error_reqs)
            self._collect_finished([rid for rid in self._grammars if rid in self._live])
            self._grammars = {rid: f for rid, f in self._grammars.items() if rid in self._live}
        if self._kv_capture is not None:
            # every hash the step's events name still has its content here
            self._kv_events.extend(translate(self._kv_capture.take(), self._keys, self._kv_marks))
        self._keys.prune_if_large(self.sched.kv_cache_manager.block_pool, self._live.values())

    def take_kv_events(self) -> tuple[KVCacheEvent, ...]:
        """vLLM's KV cache events published since the last take (one batch per
        update_from_output), as the spec's (spec/kv_events.py)."""
        out, self._kv_events = tuple(self._kv_events), []
        return out
    def make_stats(self) -> SchedulerStats | None:
        """The statistics vLLM's update_from_output made at its end
        (Scheduler.make_stats), as ours; None without log_stats."""
        stats, self._last_stats = self._last_stats, None
        return stats

    def _deferred_bitmask(self, deferred: Any, plan: StepPlan, result: StepResult) -> None:
        """The engine core's deferred sampling of an async plan whose
        structured-output requests had tokens in flight (core.py,
        step_with_batch_queue): once the previous step's output is in, the
        worker's drafts for the plan are checked against the grammar
        (update_draft_token_ids_in_output: refused drafts become -1 and count
        in num_invalid_spec_tokens) and the bitmask is computed."""
        if self._config.num_speculative_tokens:
            from schedspec.adapters.vllm_names import DraftTokenIds

            ids = [s.request_id for s in plan.scheduled]
            drafts = result.draft_token_ids
            into_vllm(self.sched.update_draft_token_ids_in_output, DraftTokenIds(
                req_ids=list(ids), draft_token_ids=[list(drafts.get(rid, ())) for rid in ids]),
                deferred)
        into_vllm(self.sched.get_grammar_bitmask, deferred)

    def _collect_finished(self, candidates: list[str]) -> None:
        """Move requests vLLM has finished (and forgotten) into ``finished``."""
        for rid in candidates:
            live = self._live.get(rid)
            if live is None or not live.req.is_finished():
                continue
            del self._live[rid]
            self._tables.sent.pop(rid, None)
            self._finished[rid] = self._request_view(live, finished=True)

    # ------------------------------------------------------------------ view

    def _request_view(self, live: Live, finished: bool = False) -> RequestView:
        return request_view(live, self._statuses.of(live.req), self._tables, self._config, finished)

    def view(self) -> SchedulerView:
        sched = self.sched
        for rid in self._live:
            if rid not in sched.requests:
                raise VllmAdapterError(f"vLLM dropped request {rid!r} without finishing it")
        waiting = tuple(r.request_id for r in sched.kv_holding_waiting) + tuple(
            r.request_id for r in sched.waiting
        )
        encoder_cache, encoder_free = encoder_view(sched, self._config)
        cadence = self._config.prefill_schedule_interval > 1
        return SchedulerView(
            config=self._config,
            step=self._step,
            requests={rid: self._request_view(live) for rid, live in self._live.items()},
            waiting=waiting,
            running=tuple(r.request_id for r in sched.running),
            kv=kv_view(sched, self._keys, self._config),
            finished=dict(self._finished),
            preempted_since_plan=tuple(sorted(sched.reset_preempted_req_ids)),
            pause_state=PauseState(int(sched.pause_state)),
            encoder_cache=encoder_cache,
            encoder_cache_free=encoder_free,
            # vLLM counts executed steps and notes a backed-up queue always,
            # and stamps the last prefill step only with a cadence; without
            # one none of them has any effect
            num_executed_steps=sched.num_executed_steps if cadence else 0,
            last_prefill_step=sched.last_prefill_step if cadence else -1,
            prefill_capacity_bound=bool(sched.prefill_capacity_bound) if cadence else False,
            kv_held_by_finished=held_by_finished(sched, self._tables) if self._connector else {},
            kv_loads_done=tuple(sorted(sched.finished_recving_kv_req_ids)),
            kv_loads_failed=tuple(sorted(sched.failed_recving_kv_req_ids)),
        )
