"""The recorder: a ``scheduler_cls`` for vLLM 0.32's engine that writes a
schedspec trace of what the live engine's scheduler did (docs/engine.md,
"The recorder"), and can check the safety invariants while it runs.

:func:`make_recorder` returns a subclass of vLLM's ``Scheduler`` (or, with
``asynchronous``, its ``AsyncScheduler``) that passes every call through
and records, in call order:

- ``add_request``: an ``add`` event (the request's prompt, max_tokens,
  priority, stop ids, eos, salt; ``arrival`` is the add's rank, the order of
  vLLM's arrival_time);
- ``finish_requests`` with FINISHED_ABORTED: an ``abort`` per request it
  finished; ``reset_prefix_cache``: a ``reset_prefix_cache`` event;
- ``schedule``: a ``schedule`` event carrying the plan (schedule()'s
  SchedulerOutput as a StepPlan, schedspec.adapters.vllm_views.plan_of,
  recorded as a RecordedPlan) and, once ``update_from_output`` has run, the
  engine's result: the sampled tokens per request (the ModelRunnerOutput),
  and the drafts the engine core hands over after the step
  (``update_draft_token_ids``); ``update_from_output``: an ``update`` event.

The trace (format 5, schedspec.check.trace) replays against the spec, impl
or vLLM 0.33 with the engine's own tokens (``schedspec replay``), the plans
compared with the recorded ones (schedspec.check.recorded).

The monitor (``check_every`` = N > 0): every N-th plan, the schedule and its
update are observed as invariant transitions on views built from the live
scheduler (:class:`LiveViews`) against the safety invariants; on a violation
the trace so far is written to ``violation_out`` and :class:`MonitorViolation`
is raised out of the engine's step.

Engine side: vLLM is imported by :func:`make_recorder` only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from schedspec.check import trace as tracefile
from schedspec.check.workload import Abort, AddRequest, Event, RecordedPlan, ResetPrefixCache, Schedule, Update, Workload
from schedspec.spec.interface import (
    KVView,
    Policy,
    RequestSpec,
    RequestStatus,
    SchedSpecError,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)

#: the tiny model's vocabulary (schedspec.engine.model): the trace's vocab
VOCAB = 512


class RecorderError(SchedSpecError, RuntimeError):
    """The live engine uses something the trace cannot hold (a KV connector,
    LoRA, multimodal inputs, pooling...)."""


class MonitorViolation(SchedSpecError, RuntimeError):
    """The online monitor found a safety invariant violated."""

    def __init__(self, step: int, violations: list[str], trace_path: str | None) -> None:
        where = f"; trace written to {trace_path}" if trace_path else ""
        super().__init__(f"step {step}: {'; '.join(violations[:3])}{where}")
        self.step = step
        self.violations = violations
        self.trace_path = trace_path


def scheduler_config_of(vllm_config: Any, num_blocks: int) -> SchedulerConfig:
    """The SchedulerConfig of a live scheduler: the inverse of
    schedspec.adapters.vllm_config.build_vllm_config for the options the
    spec models, read from vLLM's config (``num_blocks``: the KV cache
    config's, the null block included). RecorderError for an option outside
    the modelled ones."""
    sc, cc, mc = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    for what, value in (("kv_transfer_config", vllm_config.kv_transfer_config),
                        ("lora_config", vllm_config.lora_config)):
        if value is not None:
            raise RecorderError(f"the engine has a {what}: the recorder models neither a KV connector nor LoRA")
    spec = vllm_config.speculative_config
    k = 0
    if spec is not None:
        if spec.method not in ("ngram", "ngram_gpu"):
            raise RecorderError(f"speculative method {spec.method!r}: the recorder models n-gram drafts only")
        k = int(spec.num_speculative_tokens)
    policy = sc.policy if isinstance(sc.policy, str) else sc.policy.value
    return SchedulerConfig(
        block_size=int(cc.block_size),
        num_blocks=int(num_blocks),
        max_num_batched_tokens=int(sc.max_num_batched_tokens),
        max_num_seqs=int(sc.max_num_seqs),
        max_model_len=int(mc.max_model_len),
        enable_chunked_prefill=bool(sc.enable_chunked_prefill),
        long_prefill_token_threshold=int(sc.long_prefill_token_threshold),
        enable_prefix_caching=bool(cc.enable_prefix_caching),
        policy=Policy(policy),
        scheduler_reserve_full_isl=bool(getattr(sc, "scheduler_reserve_full_isl", True)),
        async_scheduling=bool(sc.async_scheduling),
        num_speculative_tokens=k,
    )


def request_spec_of(req: Any, arrival: int) -> RequestSpec:
    """A vLLM Request (as the engine hands it to add_request) as a RequestSpec."""
    sp = req.sampling_params
    if sp is None or req.prompt_token_ids is None:
        raise RecorderError(f"request {req.request_id!r}: pooling or prompt embeddings are not modelled")
    if req.lora_request is not None or req.mm_features:
        raise RecorderError(f"request {req.request_id!r}: LoRA and multimodal inputs are not recorded")
    ignore_eos = bool(sp.ignore_eos)
    eos = getattr(req, "eos_token_id", None)
    return RequestSpec(
        request_id=req.request_id,
        prompt_token_ids=tuple(int(t) for t in req.prompt_token_ids),
        max_tokens=int(sp.max_tokens),
        priority=int(req.priority),
        arrival=arrival,
        stop_token_ids=tuple(int(t) for t in (sp.stop_token_ids or ())),
        eos_token_id=None if ignore_eos or eos is None else int(eos),
        ignore_eos=ignore_eos,
        cache_salt=req.cache_salt,
    )


class _Entry:
    """A schedule event being recorded: its plan, then its result."""

    __slots__ = ("plan", "sampled", "drafts", "step_plan")

    def __init__(self, plan: RecordedPlan, step_plan: StepPlan) -> None:
        self.plan = plan
        #: the StepPlan, kept while the entry is in flight (the monitor's)
        self.step_plan: StepPlan | None = step_plan
        self.sampled: dict[str, tuple[int, ...]] = {}
        self.drafts: dict[str, tuple[int, ...]] = {}

    def event(self) -> Schedule:
        return Schedule(StepResult(sampled=dict(self.sampled), draft_token_ids=dict(self.drafts)), self.plan)


class Recording:
    """What the recorder holds: the config and the events so far."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.events: list[Event | _Entry] = []
        self.num_adds = 0
        self.steps = 0
        #: schedule entries awaiting their update, oldest first
        self.in_flight: list[_Entry] = []
        #: the entry of the last update (the drafts after it belong to it)
        self.last_updated: _Entry | None = None

    def trace(self, check: dict[str, str] | None = None) -> tracefile.Trace:
        events = tuple(e.event() if isinstance(e, _Entry) else e for e in self.events)
        return tracefile.Trace(Workload(self.config, events), vocab=VOCAB, check=check)

    def write(self, path: str | Path, check: dict[str, str] | None = None) -> None:
        tracefile.write(path, self.trace(check))


# ---------------------------------------------------------------- live views


_STATUS = {s.name: s for s in RequestStatus}


class LiveViews:
    """SchedulerViews of vLLM 0.32's live scheduler, as the vLLM adapter
    builds them of 0.33's (schedspec/adapters/vllm_views.py), with what
    differs on 0.32: its names are imported from vLLM 0.32 here, not from
    schedspec.adapters.vllm_names (which pins 0.33); its request states
    include WAITING_FOR_STREAMING_REQ and FINISHED_REPETITION (refused: not
    modelled); ``preempted_req_ids`` may be None in a SchedulerOutput."""

    def __init__(self, sched: Any, config: SchedulerConfig) -> None:
        from schedspec.adapters.vllm_requests import Live
        from schedspec.adapters.vllm_views import BlockTables

        self.sched = sched
        self.config = config
        self.tables = BlockTables(list(sched.kv_cache_manager.coordinator.single_type_managers))
        self.live: dict[str, Live] = {}
        self.finished: dict[str, Any] = {}
        self._keys: dict[bytes, tuple[str, tuple[int, ...]]] = {}
        self._hashed: dict[str, int] = {}
        self._live_cls = Live

    def add(self, spec: RequestSpec, req: Any) -> None:
        self.live[spec.request_id] = self._live_cls(spec, req)
        self.record_keys(spec.request_id)

    def record_keys(self, rid: str) -> None:
        live = self.live.get(rid)
        if live is None:
            return
        hashes = live.req.block_hashes
        done = self._hashed.get(rid, 0)
        bs = self.config.hash_block_size or self.config.block_size  # vLLM hashes in units of it
        tokens = live.req.all_token_ids
        for i in range(done, len(hashes)):
            end = (i + 1) * bs
            self._keys.setdefault(bytes(hashes[i]), (live.spec.block_identity(end), tuple(tokens[:end])))
        self._hashed[rid] = len(hashes)

    def status(self, req: Any) -> RequestStatus:
        status = _STATUS.get(req.status.name)
        if status is None:
            raise RecorderError(f"request {req.request_id!r} is in vLLM 0.32 state {req.status.name}, not modelled")
        return status

    def plan(self, out: Any, step: int) -> StepPlan:
        from schedspec.adapters.vllm_views import plan_of

        if out.preempted_req_ids is None:
            out.preempted_req_ids = set()
        return plan_of(out, step, self.live, self.tables, async_scheduling=self.config.async_scheduling,
                       hybrid=False)

    def collect_finished(self) -> None:
        """Move the requests vLLM has finished into ``finished`` (until the
        next plan reports them: ``schedule`` empties it, as the adapter's)."""
        from schedspec.adapters.vllm_views import request_view

        for rid, live in list(self.live.items()):
            if live.req.is_finished():
                del self.live[rid]
                self.tables.sent.pop(rid, None)
                self._hashed.pop(rid, None)
                self.finished[rid] = request_view(live, self.status(live.req), self.tables, self.config,
                                                  finished=True)

    def kv(self) -> KVView:
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        pool = self.sched.kv_cache_manager.block_pool

        def key(h: Any) -> Any:
            found = self._keys.get(bytes(h)[:-4])  # BlockHashWithGroupId: the hash, then 4 bytes of group
            if found is None:
                raise RecorderError(f"vLLM holds a block hash {bytes(h).hex()} of no recorded request")
            return found

        bs = self.config.block_size
        # a key whose prefix ends inside a block is a partial entry (vllm_views.kv_view)
        block_keys = {b.block_id: k for b in pool.blocks if b.block_hash is not None
                      for k in (key(b.block_hash),) if len(k[1]) % bs == 0}
        cache_index: dict[Any, tuple[int, ...]] = {}
        partial_index: dict[Any, tuple[int, ...]] = {}
        for h, held in pool.cached_block_hash_to_block._cache.items():
            ids = (held.block_id,) if isinstance(held, KVCacheBlock) else tuple(held)
            if ids:
                k = key(h)
                (cache_index if len(k[1]) % bs == 0 else partial_index)[k] = ids
        return KVView(
            num_blocks=self.config.num_blocks, block_size=self.config.block_size,
            ref_cnt=tuple(0 if b.is_null else b.ref_cnt for b in pool.blocks),
            free_queue=tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
            block_keys=block_keys, cache_index=cache_index, partial_index=partial_index)

    def view(self, step: int) -> SchedulerView:
        from schedspec.adapters.vllm_views import request_view

        sched = self.sched
        return SchedulerView(
            config=self.config,
            step=step,
            requests={rid: request_view(live, self.status(live.req), self.tables, self.config)
                      for rid, live in self.live.items()},
            waiting=tuple(r.request_id for r in sched.kv_holding_waiting) + tuple(r.request_id for r in sched.waiting),
            running=tuple(r.request_id for r in sched.running),
            kv=self.kv(),
            finished=dict(self.finished),
            preempted_since_plan=tuple(sorted(sched.reset_preempted_req_ids)),
        )


def monitor_invariants() -> tuple[Any, ...]:
    """The safety invariants a live engine is held to: those needing no
    feature the recorder does not model."""
    from schedspec.invariants import select

    allowed = {"long_prefill_threshold", "reset_prefix_cache"}
    return tuple(i for i in select("safety", "invariants") if set(i.requires) <= allowed)


# ---------------------------------------------------------------- the class


def make_recorder(asynchronous: bool = False, check_every: int = 0, violation_out: str | None = None,
                  base: Any = None, record: bool = True) -> Any:
    """A recording subclass of vLLM 0.32's Scheduler (``asynchronous``: of
    its AsyncScheduler; ``base``: of that class instead). ``check_every`` N
    > 0 turns the monitor on (every N-th plan); ``violation_out``: where the
    trace goes on a violation. ``record=False`` passes every call through
    untouched (the cost measurement's reference)."""
    if base is None:
        if asynchronous:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
        else:
            from vllm.v1.core.sched.scheduler import Scheduler as base
    from vllm.v1.request import RequestStatus as VStatus

    aborted = VStatus.FINISHED_ABORTED

    parent: Any = base

    class RecordingScheduler(parent):  # type: ignore[misc]
        schedspec_check_every = check_every
        schedspec_violation_out = violation_out

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.schedspec_on = record
            #: seconds spent in the recorder's (and monitor's) own code, not in vLLM's
            self.schedspec_own_s = 0.0
            if not record:
                return
            config = scheduler_config_of(self.vllm_config, self.kv_cache_config.num_blocks)
            if asynchronous != config.async_scheduling:
                raise RecorderError(
                    f"a recorder made with asynchronous={asynchronous} in an engine whose "
                    f"async_scheduling resolved to {config.async_scheduling} (vLLM 0.32's CPU platform "
                    "turns async scheduling off: platforms/cpu.py, check_and_update_config)")
            self.schedspec = Recording(config)
            self.schedspec_views = LiveViews(self, config)
            self.schedspec_monitor: Any = None
            self.schedspec_checked: list[float] = []
            if check_every:
                from schedspec.invariants import Monitor

                self.schedspec_monitor = Monitor(monitor_invariants())
            #: checked step -> its plan, until its update (with async
            #: scheduling the next plan comes first)
            self.schedspec_pending: dict[int, StepPlan] = {}

        # -------------------------------------------------------- events
        def add_request(self, request: Any) -> Any:
            if not self.schedspec_on or request.request_id in self.requests:
                return super().add_request(request)
            rec = self.schedspec
            spec = request_spec_of(request, rec.num_adds)
            rec.num_adds += 1
            super().add_request(request)
            rec.events.append(AddRequest(spec))
            self.schedspec_views.add(spec, request)

        def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
            done = super().finish_requests(request_ids, finished_status)
            if self.schedspec_on and finished_status == aborted:
                for req in done:
                    self.schedspec.events.append(Abort(req.request_id))
                self.schedspec_views.collect_finished()
            return done

        def reset_prefix_cache(self, reset_running_requests: bool = False, *args: Any, **kwargs: Any) -> Any:
            if self.schedspec_on:
                self.schedspec.events.append(ResetPrefixCache(bool(reset_running_requests)))
            return super().reset_prefix_cache(reset_running_requests, *args, **kwargs)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            if not self.schedspec_on:
                return super().schedule(*args, **kwargs)
            rec, views = self.schedspec, self.schedspec_views
            step = rec.steps + 1
            checked = self.schedspec_monitor is not None and step % self.schedspec_check_every == 0
            t0 = time.perf_counter()
            before = views.view(rec.steps) if checked else None
            t1 = time.perf_counter()
            out = super().schedule(*args, **kwargs)
            t2 = time.perf_counter()
            rec.steps = step
            views.finished = {}
            plan = views.plan(out, step)
            entry = _Entry(RecordedPlan.of(plan), plan)
            rec.events.append(entry)
            rec.in_flight.append(entry)
            if checked:
                assert before is not None
                self._schedspec_observe("schedule", before, plan, None, step)
                self.schedspec_pending[step] = plan
                self.schedspec_checked.append(time.perf_counter() - t0)
            self.schedspec_own_s += time.perf_counter() - t0 - (t2 - t1)
            return out

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            if not self.schedspec_on:
                return super().update_from_output(scheduler_output, model_runner_output)
            rec, views = self.schedspec, self.schedspec_views
            entry = rec.in_flight.pop(0)
            entry.step_plan = None
            step = rec.steps - len(rec.in_flight)
            pending = self.schedspec_pending.pop(step, None)
            checked = pending is not None
            t0 = time.perf_counter()
            before = views.view(rec.steps) if checked else None
            ids = model_runner_output.req_ids
            drafts = rec.config.num_speculative_tokens and not rec.config.async_scheduling
            for rid, toks in zip(ids, model_runner_output.sampled_token_ids):
                if len(toks):
                    entry.sampled[rid] = tuple(int(t) for t in toks)
                    if drafts:
                        # no proposal is recorded as none, so the replay's
                        # model does not propose its own
                        entry.drafts[rid] = ()
            t1 = time.perf_counter()
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            t2 = time.perf_counter()
            rec.events.append(Update(step))
            rec.last_updated = entry
            for rid in scheduler_output.num_scheduled_tokens:
                views.record_keys(rid)
            views.collect_finished()
            if checked:
                assert before is not None and pending is not None
                result = StepResult(sampled=dict(entry.sampled))
                self._schedspec_observe("update", before, pending, result, step)
                self.schedspec_checked.append(time.perf_counter() - t0)
            self.schedspec_own_s += time.perf_counter() - t0 - (t2 - t1)
            return outputs

        def update_draft_token_ids(self, draft_token_ids: Any) -> Any:
            if self.schedspec_on and self.schedspec.last_updated is not None:
                entry = self.schedspec.last_updated
                for rid, toks in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
                    if len(toks) or rid in entry.drafts:
                        entry.drafts[rid] = tuple(int(t) for t in toks)
            return super().update_draft_token_ids(draft_token_ids)

        # -------------------------------------------------------- monitor
        def _schedspec_observe(self, kind: str, before: SchedulerView, plan: StepPlan,
                               result: StepResult | None, step: int) -> None:
            from schedspec.invariants import Transition

            rec, views = self.schedspec, self.schedspec_views
            after = views.view(rec.steps)
            in_flight = tuple(e.step_plan for e in rec.in_flight if e.step_plan is not None)
            t = Transition(kind, before, after, plan=plan, result=result, in_flight=in_flight)  # type: ignore[arg-type]
            found = self.schedspec_monitor.observe(t)
            if found:
                path = self.schedspec_violation_out
                if path:  # replayed, it repeats the monitor's check
                    rec.write(path, {"mode": "invariants", "invariants": "safety"})
                raise MonitorViolation(step, [str(v) for v in found], path)

    RecordingScheduler.__qualname__ = f"Recording{base.__name__}"
    RecordingScheduler.__name__ = RecordingScheduler.__qualname__
    return RecordingScheduler
