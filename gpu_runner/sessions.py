"""Streaming-input sessions in the equivalence matrix: a session's
continuation must generate what the whole input sent at once generates.

A session (``RequestSpec.resumable``) sends its input in chunks. After each
chunk it generates until it stops (its chunk's max_tokens); the next chunk
updates it in place (vLLM 0.33, vllm/v1/core/sched/scheduler.py,
``_update_request_as_session``: the last sampled token is dropped, the kept
outputs join the prompt, the blocks are kept). So chunk j+1 is, as vLLM
defines it, a continuation of the request whose prompt is

    P(j+1) = P(j) + outputs(j) but the last + chunk(j+1)

and must generate, greedily, what a fresh request with that whole prompt
generates. The baseline runs those fresh requests, round by round (round j
needs round j-1's outputs), in the matrix's baseline configuration; each
session variant runs the sessions with their updates arriving at seeded
steps (so queued while the session runs, or applied while it waits for
input) and must give, for every chunk, the fresh request's tokens, the
dropped token included (the argmax of its logits row), and in exact mode
bitwise-equal logits. The session's final prompt must be the baseline's.

Guard ``continued``: entries that resume a session at its dropped token's
position with the block table it held before (continued in place, nothing
recomputed). Negative controls: the spec with the dropped token's position
counted as computed after an update (``dropped_kv``: the chunk's first token
is never written), and the continuation's positions shifted by one
(``stream_position``, ``executor.Fault``). Both must be caught.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from schedspec.spec.interface import (
    RequestSpec,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerFactory,
    SessionUpdate,
    StepPlan,
    StepResult,
    supports_sessions,
)

from schedspec.check.driver import Runner
from schedspec.check.stats import Stats
from schedspec.check.workload import AddRequest, Event, SessionInput, Step, Workload
from schedspec.gpu_runner.equivalence import (
    Comparison,
    Divergence,
    MatrixReport,
    NegativeControl,
    Progress,
    RunRecord,
    StallError,
    Variant,
    baseline_config,
    compare_runs,
    least_pool,
    raise_run_failure,
    spec_factory,
)
from schedspec.gpu_runner.executor import Executor, Fault, PlanError
from schedspec.gpu_runner.model import PagedLlama, determinism_facts

if TYPE_CHECKING:  # pragma: no cover
    from schedspec.spec.request_state import RequestState

__all__ = [
    "SessionWorkload",
    "make_session_workload",
    "session_variants",
    "run_session_matrix",
    "merge_session_report",
    "SESSION_CONTROLS",
]

#: Sessions per workload, and plain requests that together outgrow the
#: session variants' least pool (``session_pool``).
SESSIONS = 2
PRESSURE = 4

#: The negative controls of the session matrix.
SESSION_CONTROLS = ("dropped_kv", "stream_position")


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionWorkload:
    """A check workload whose sessions send further chunks, and each
    session's chunks after its prompt: (tokens, max_tokens)."""

    workload: Workload
    chunks: Mapping[str, tuple[tuple[tuple[int, ...], int], ...]]

    @property
    def name(self) -> str:
        return self.workload.name


def make_session_workload(
    seed: int, *, vocab_size: int, max_model_len: int, block_size: int = 16, first_token: int = 4,
) -> SessionWorkload:
    """``PRESSURE`` plain requests of a third to a half of max_model_len,
    each growing to almost max_model_len (together they outgrow
    ``session_pool``), ``SESSIONS`` sessions of 2 to 4 chunks (sharing a
    first block, so a prefix cache hits; chunks of 1, 2, 5 or a block and
    3 tokens, each chunk 2 to 8 tokens of output) and a short plain request.
    Each session's chunks and its end arrive at seeded steps, in order."""
    rng = random.Random(f"sessions-{seed}")
    lo = min(first_token, vocab_size - 1)

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(lo, vocab_size) for _ in range(n))

    at: dict[int, list[Event]] = {}
    requests: list[RequestSpec] = []
    chunks: dict[str, tuple[tuple[tuple[int, ...], int], ...]] = {}

    def add(step: int, request: RequestSpec) -> None:
        request = replace(request, arrival=len(requests))
        requests.append(request)
        at.setdefault(step, []).append(AddRequest(request))

    for i in range(PRESSURE):
        plen = rng.randint(max(1, max_model_len // 3), max(1, max_model_len // 2))
        add(0, RequestSpec(f"s{seed}-p{i}", toks(plen), max(1, max_model_len - 1 - plen - rng.randint(0, 3))))
    prefix = toks(min(block_size, max_model_len // 4))
    for i in range(SESSIONS):
        rid = f"s{seed}-s{i}"
        own = toks(rng.randint(1, max(1, min(24, max_model_len // 4))))
        prompt = prefix + own
        m1 = rng.randint(2, 8)
        used = len(prompt) + m1
        more: list[tuple[tuple[int, ...], int]] = []
        for _ in range(rng.randint(1, 3)):
            c, m = rng.choice([1, 2, 5, block_size + 3]), rng.randint(2, 8)
            if used + c + m >= max_model_len:  # spec/sessions.py: the session's bound
                c, m = 1, 2
                if used + c + m >= max_model_len:
                    break
            more.append((toks(c), m))
            used += c + m
        if not more:
            raise ValueError(f"max_model_len {max_model_len} leaves no room for a session's second chunk")
        step = rng.randint(0, 4)
        add(step, RequestSpec(rid, prompt, m1, resumable=True))
        for tokens, m in more:
            step += rng.randint(0, 12)
            at.setdefault(step, []).append(SessionInput(SessionUpdate(rid, tokens, m)))
        step += rng.randint(0, 12)
        at.setdefault(step, []).append(SessionInput(SessionUpdate(rid, end=True)))
        chunks[rid] = tuple(more)
    add(rng.randint(0, 8), RequestSpec(f"s{seed}-q", toks(rng.randint(1, 12)), rng.randint(1, 8)))
    events: list[Event] = []
    for step in range(max(at) + 1):
        if step:
            events.append(Step())
        events.extend(at.get(step, ()))
    wl = Workload(config=baseline_config(max_model_len, block_size), events=tuple(events), seed=seed,
                  name=f"s{seed}", features=("sessions", "pressure", "shared-prefix"))
    return SessionWorkload(wl, chunks)


def session_pool(config: SchedulerConfig) -> SchedulerConfig:
    """The least pool for sessions: the least pool the config validates
    with, plus room for every session's whole sequence. A session waiting
    for input keeps its blocks and nothing preempts it (vLLM 0.33 alike, the
    ``stream-liveness`` defect, docs/divergences.md), so in the bare least
    pool two sessions waiting can hold what the request ahead of them needs
    for ever; with this room one request of max_model_len always fits beside
    the sessions, and the plain requests still preempt one another."""
    per = -(-config.max_model_len // config.block_size) * max(1, len(config.kv_cache_groups))
    return replace(config, num_blocks=least_pool(config) + SESSIONS * per)


def session_variants(max_model_len: int, block_size: int = 16, max_num_seqs: int = 8) -> tuple[Variant, ...]:
    """The session runs: the baseline's config, and with chunked prefill,
    prefix caching, the least pool for sessions (``session_pool``: preemption), async scheduling, and all of
    them. Each must continue sessions in place (``continued``)."""
    base = baseline_config(max_model_len, block_size, max_num_seqs)
    chunked = dict(enable_chunked_prefill=True, max_num_batched_tokens=max(max_num_seqs, block_size))
    return (
        Variant("stream", base, frozenset({"continued"})),
        Variant("stream-chunked", replace(base, **chunked),  # type: ignore[arg-type]
                frozenset({"continued", "chunked"})),
        Variant("stream-prefix", replace(base, enable_prefix_caching=True), frozenset({"continued", "cache_hit"})),
        Variant("stream-tiny", session_pool(base), frozenset({"continued", "preempted"})),
        Variant("stream-async", replace(base, async_scheduling=True), frozenset({"continued", "in_flight"})),
        Variant("stream-all", session_pool(replace(base, async_scheduling=True, enable_prefix_caching=True,
                                             **chunked)),  # type: ignore[arg-type]
                frozenset({"continued", "chunked", "cache_hit", "preempted", "in_flight"})),
    )


# --------------------------------------------------------------------------
# The expected prompts, and runs
# --------------------------------------------------------------------------


def _rid(session: str, j: int) -> str:
    """The fresh request of chunk ``j`` (0: the prompt) of a session."""
    return f"{session}#{j}"


@dataclass
class _Baseline:
    record: RunRecord  # outputs / logits of the plain requests and of every fresh request
    prompts: dict[str, list[tuple[int, ...]]]  # session -> P(j) per chunk
    stats: Stats


class SessionExecutor(Executor):
    """The executor, counting session entries continued in place: an entry
    of a session that starts at one of its dropped tokens' positions with the
    block table it held before (``continued``), and the step of each
    session's first such entry."""

    def __init__(self, model: PagedLlama, config: SchedulerConfig, drops: Mapping[str, set[int]],
                 fault: Fault | None = None) -> None:
        super().__init__(model, config, fault=fault)
        self.drops = drops
        self.tables: dict[str, tuple[int, ...]] = {}
        self.continued = 0
        self.seen: set[tuple[str, int]] = set()
        self.first_step: dict[str, int] = {}

    def execute(self, plan: StepPlan, context: Mapping[str, Sequence[int]] | None = None) -> StepResult:
        bs = self.config.block_size
        for s in plan.scheduled:
            rid, c = s.request_id, s.num_computed_tokens
            if c in self.drops.get(rid, ()) and (rid, c) not in self.seen:
                held = -(-c // bs)
                if self.tables.get(rid, ())[:held] == tuple(s.block_ids[:held]) and len(s.block_ids) >= held:
                    self.seen.add((rid, c))
                    self.continued += 1
                    self.first_step.setdefault(rid, plan.step)
            self.tables[rid] = tuple(s.block_ids)
        return super().execute(plan, context)


def _drive(factory: SchedulerFactory, executor: Executor, workload: Workload, variant: str
           ) -> tuple[RunRecord, dict[str, tuple[int, ...]]]:
    """Run ``workload`` to completion through the check driver; the record
    (logits keyed by each request's first prompt) and every finished
    request's tokens (prompt as it ended, and outputs)."""
    t0 = time.perf_counter()
    runner = Runner(executor.config, {variant: factory}, check_invariants=False, compare_views=False,
                    models={variant: executor})
    failure = runner.run_to_completion(workload.events, max_steps=20_000, max_idle_steps=3)
    if failure is not None:
        raise_run_failure(failure, f"{workload.name}/{variant}")
    stats = runner.stats
    stats.seconds = time.perf_counter() - t0
    stats.forward_seconds = executor.seconds
    first = {r.request_id: len(r.prompt_token_ids) for r in workload.requests}
    done = runner.finished
    rec = RunRecord(
        workload=workload.name, variant=variant,
        outputs={rid: tuple(rv.output_token_ids) for rid, rv in done.items()},
        status={rid: rv.status for rid, rv in done.items()},
        logits={(rid, pos - first[rid]): row for (rid, pos), row in executor.logits.items()},
        counters=stats,
        fault_fired=list(executor.fault.fired) if executor.fault else [],
        inflight={"in_flight": executor.in_flight_entries},
    )
    return rec, {rid: tuple(rv.spec.prompt_token_ids) + tuple(rv.output_token_ids) for rid, rv in done.items()}


def run_baseline(factory: SchedulerFactory, model: PagedLlama, sw: SessionWorkload,
                 config: SchedulerConfig) -> _Baseline:
    """The whole input sent at once: round 0 runs the plain requests and each
    session's prompt as a fresh request; round j each session's P(j) (its
    P(j-1), round j-1's outputs but the last, chunk j) as a fresh request."""
    plain = [r for r in sw.workload.requests if r.request_id not in sw.chunks]
    sessions = {r.request_id: r for r in sw.workload.requests if r.request_id in sw.chunks}
    prompts = {sid: [tuple(r.prompt_token_ids)] for sid, r in sessions.items()}
    outputs: dict[str, tuple[int, ...]] = {}
    status: dict[str, RequestStatus] = {}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    stats = Stats()
    rounds = 1 + max(len(c) for c in sw.chunks.values())
    for j in range(rounds):
        reqs = list(plain) if j == 0 else []
        for sid, r in sessions.items():
            if j == 0:
                reqs.append(replace(r, request_id=_rid(sid, 0), resumable=False))
            elif j <= len(sw.chunks[sid]):
                tokens, m = sw.chunks[sid][j - 1]
                p = prompts[sid][j - 1] + outputs[_rid(sid, j - 1)][:-1] + tokens
                prompts[sid].append(p)
                reqs.append(replace(r, request_id=_rid(sid, j), prompt_token_ids=p, max_tokens=m, resumable=False))
        reqs = [replace(r, arrival=i) for i, r in enumerate(reqs)]
        wl = Workload(config=config, events=tuple(AddRequest(r) for r in reqs), name=sw.name)
        rec, _ = _drive(factory, Executor(model, config), wl, "baseline")
        outputs.update(rec.outputs)
        status.update(rec.status)
        logits.update(rec.logits)
        stats.merge(rec.counters)
    record = RunRecord(sw.name, "baseline", outputs, status, logits, stats)
    return _Baseline(record, prompts, stats)


def _chunk_view(base: _Baseline, sw: SessionWorkload, rec: RunRecord, tokens: Mapping[str, tuple[int, ...]],
                ) -> tuple[RunRecord, list[Divergence]]:
    """The session run as fresh requests: chunk j of a session is the tokens
    it generated after P(j) (the dropped one: the argmax of its logits row),
    with their logits rows; and the divergences of each session's final
    prompt from the baseline's."""
    outputs = {rid: o for rid, o in rec.outputs.items() if rid not in sw.chunks}
    status = {rid: s for rid, s in rec.status.items() if rid not in sw.chunks}
    logits = {k: v for k, v in rec.logits.items() if k[0] not in sw.chunks}
    found: list[Divergence] = []
    for sid, prompts in base.prompts.items():
        got = tokens.get(sid)
        if got is None:
            found.append(Divergence(sid, "missing", 0, "the session never finished"))
            continue
        first = len(prompts[0])
        want = prompts[-1]
        bad = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), None)
        if bad is not None or len(got) < len(want):
            at = bad if bad is not None else len(got)
            found.append(Divergence(sid, "tokens", at, f"the session's prompt after its updates differs from "
                                                       f"the whole input at position {at}"))
        last = len(prompts) - 1
        for j, p in enumerate(prompts):
            m = base.record.outputs.get(_rid(sid, j))
            n = len(m) if m is not None else 0
            toks: list[int] = []
            for k in range(n):
                key = (sid, len(p) + k - first)
                if j < last and k == n - 1:  # the dropped token: sampled, then dropped by the update
                    row = rec.logits.get(key)
                    if row is not None:
                        toks.append(int(torch.argmax(row)))
                elif len(p) + k < len(got):
                    toks.append(got[len(p) + k])
                if key in rec.logits:
                    logits[(_rid(sid, j), k)] = rec.logits[key]
            outputs[_rid(sid, j)] = tuple(toks)
            full = len(toks) == n
            status[_rid(sid, j)] = base.record.status[_rid(sid, j)] if full else RequestStatus.FINISHED_STOPPED
    view = RunRecord(rec.workload, rec.variant, outputs, status, logits, rec.counters, rec.fault_fired,
                     dict(rec.inflight))
    return view, found


def _drops(base: _Baseline) -> dict[str, set[int]]:
    """Each session's dropped tokens' positions: where its continuations start."""
    out: dict[str, set[int]] = {}
    for sid, prompts in base.prompts.items():
        out[sid] = {len(p) + len(base.record.outputs[_rid(sid, j)]) - 1 for j, p in enumerate(prompts[:-1])}
    return out


def run_session_variant(factory: SchedulerFactory, model: PagedLlama, sw: SessionWorkload, variant: Variant,
                        base: _Baseline, *, atol: float = 1e-3, fault: Fault | None = None,
                        ) -> tuple[Comparison, SessionExecutor]:
    """One session variant on one workload, compared chunk by chunk with the
    baseline's fresh requests."""
    ex = SessionExecutor(model, variant.config, _drops(base), fault=fault)
    try:
        rec, tokens = _drive(factory, ex, sw.workload, variant.name)
    except (PlanError, StallError) as exc:
        rid = exc.request_id if isinstance(exc, PlanError) else "-"
        kind = "plan" if isinstance(exc, PlanError) else "stall"
        return Comparison(sw.name, variant.name, model.mode, divergences=[Divergence(rid, kind, -1, str(exc))]), ex
    rec.inflight["continued"] = ex.continued
    view, found = _chunk_view(base, sw, rec, tokens)
    cmp = compare_runs(base.record, view, mode=model.mode, atol=atol)
    cmp.divergences[:0] = found
    return cmp, ex


# --------------------------------------------------------------------------
# Negative controls
# --------------------------------------------------------------------------


def dropped_kv_factory(fired: list[str]) -> SchedulerFactory:
    """The spec, wrong: after a session's in-place update the dropped token's
    position counts as computed (as if its KV had been written), so the
    chunk's first token is never computed. ``fired`` gets a line per wrong
    update (chunks of one token are left alone: nothing would be left to
    schedule)."""
    from schedspec.spec.scheduler import SpecScheduler

    class DroppedKVKept(SpecScheduler):
        def _update_request_as_session(self, req: RequestState, update: SessionUpdate) -> None:
            super()._update_request_as_session(req, update)
            if len(update.prompt_token_ids) > 1:
                req.num_computed_tokens += 1
                fired.append(f"{req.request_id}: the dropped token's position counted as computed")

    def make(config: SchedulerConfig) -> Scheduler:
        return DroppedKVKept(config)

    return make


def session_control(kind: str, factory: SchedulerFactory, model: PagedLlama, sw: SessionWorkload,
                    variant: Variant, base: _Baseline, *, atol: float = 1e-3) -> NegativeControl:
    """Run a negative control (``SESSION_CONTROLS``) on ``variant``."""
    if kind == "dropped_kv":
        fired: list[str] = []
        cmp, _ = run_session_variant(dropped_kv_factory(fired), model, sw, variant, base, atol=atol)
        first = str(cmp.divergences[0]) if cmp.divergences else ""
        return NegativeControl(kind, sw.name, variant.name, fired, len(cmp.divergences), first)
    if kind != "stream_position":
        raise ValueError(f"session control must be one of {', '.join(SESSION_CONTROLS)}, got {kind!r}")
    _, ex = run_session_variant(factory, model, sw, variant, base, atol=atol)
    if not ex.first_step:
        return NegativeControl(kind, sw.name, variant.name, [], 0, "no session was continued in place")
    sid, step = min(ex.first_step.items(), key=lambda kv: (kv[1], kv[0]))
    fault = Fault("position", step=step, request_id=sid)
    cmp, _ = run_session_variant(factory, model, sw, variant, base, atol=atol, fault=fault)
    return NegativeControl(kind, sw.name, variant.name, list(fault.fired), len(cmp.divergences),
                           str(cmp.divergences[0]) if cmp.divergences else "")


# --------------------------------------------------------------------------
# The matrix
# --------------------------------------------------------------------------


def run_session_matrix(
    factory: SchedulerFactory | None,
    model: PagedLlama,
    workloads: Sequence[SessionWorkload],
    variants: Sequence[Variant],
    *,
    baseline: SchedulerConfig,
    atol: float = 1e-3,
    negative: bool = True,
    progress: Progress | None = None,
    model_name: str = "",
) -> MatrixReport:
    """The baseline's fresh requests and every session variant on every
    workload, compared; the guards (each variant's features, ``continued``
    summed over the workloads); the negative controls on the first variant."""
    factory = factory or spec_factory
    t0 = time.perf_counter()
    report = MatrixReport(model=model_name or model.config.name, device=str(model.device), mode=model.mode,
                          workloads=[w.name for w in workloads], variants=list(variants),
                          environment=determinism_facts(model.device))
    bases: dict[str, _Baseline] = {}
    for i, sw in enumerate(workloads):
        base = run_baseline(factory, model, sw, baseline)
        bases[sw.name] = base
        report.baselines[sw.name] = base.stats
        report.baseline_outputs[sw.name] = {rid: list(t) for rid, t in sorted(base.record.outputs.items())}
        report.baseline_digests[sw.name] = base.record.digest()
        line = [f"[{i + 1}/{len(workloads)}] {sw.name}: baseline {base.stats.steps} steps"]
        for v in variants:
            cmp, _ = run_session_variant(factory, model, sw, v, base, atol=atol)
            report.comparisons.append(cmp)
            line.append(f"{v.name} {'ok' if cmp.ok else 'DIVERGED'}")
        if progress:
            progress(", ".join(line) + f" ({time.perf_counter() - t0:.1f} s)")
    for v in variants:
        tot, rows = report.totals(v.name)
        for feat in sorted(v.expects):
            count = sum(r.inflight.get(feat, 0) for r in rows) if feat in ("continued", "in_flight") \
                else tot.feature(feat)
            if not count:
                report.guard_failures.append(f"variant {v.name} never {feat.replace('_', ' ')} "
                                             f"in {len(workloads)} workloads")
    if negative and workloads and variants:
        sw = workloads[0]
        for kind in SESSION_CONTROLS:
            nc = session_control(kind, factory, model, sw, variants[0], bases[sw.name], atol=atol)
            report.negative.append(nc)
            if progress:
                progress(f"negative control {kind}: {'caught' if nc.caught else 'MISSED'}")
    report.seconds = time.perf_counter() - t0
    return report


def make_session_workloads(n: int, *, seed: int = 0, vocab_size: int, max_model_len: int,
                           block_size: int = 16) -> list[SessionWorkload]:
    return [make_session_workload(seed + i, vocab_size=vocab_size, max_model_len=max_model_len,
                                  block_size=block_size) for i in range(n)]


def merge_session_report(report: MatrixReport, sessions: MatrixReport) -> MatrixReport:
    """The session matrix's rows, guards and controls added to ``report``."""
    report.workloads += sessions.workloads
    report.variants += sessions.variants
    report.comparisons += sessions.comparisons
    report.baselines.update(sessions.baselines)
    report.baseline_outputs.update(sessions.baseline_outputs)
    report.baseline_digests.update(sessions.baseline_digests)
    report.guard_failures += sessions.guard_failures
    report.negative += sessions.negative
    report.seconds += sessions.seconds
    return report


__all__ += ["make_session_workloads", "session_extension", "run_baseline", "run_session_variant", "session_control",
            "dropped_kv_factory", "SessionExecutor"]



def session_extension(factory: SchedulerFactory | None, *, workloads: int, seed: int = 0, block_size: int = 16,
                      atol: float = 1e-3, negative: bool = True, hybrid: bool = False,
                      progress: Progress | None = None) -> Callable[[MatrixReport, PagedLlama, int], MatrixReport]:
    """``run_equivalence(extend=...)`` for ``--sessions``: the session matrix
    on ``workloads`` session workloads, merged into the report. Refused at
    once (ValueError naming the flag) for a hybrid model (the session matrix
    runs one KV cache group) or a scheduler without ``session_update``."""
    fac = factory or spec_factory
    if hybrid:
        raise ValueError("--sessions needs a model without sliding-window or chunked-local layers")
    if not supports_sessions(fac(baseline_config(64, block_size))):
        raise ValueError("--sessions needs a scheduler with session_update() (streaming-input sessions)")

    def extend(report: MatrixReport, model: PagedLlama, mml: int) -> MatrixReport:
        base = baseline_config(mml, block_size)
        wls = make_session_workloads(workloads, seed=seed, vocab_size=model.config.vocab_size, max_model_len=mml,
                                     block_size=block_size)
        sess = run_session_matrix(fac, model, wls, session_variants(mml, block_size), baseline=base, atol=atol,
                                  negative=negative, progress=progress)
        return merge_session_report(report, sess)

    return extend
