"""Scheduler speed, side by side: decode steps and a mixed trace.

``run_bench({"impl": factory, "spec": factory, ...})`` builds each scheduler
from the same configuration, drives it through the same workload and times
only ``schedule()`` + ``update()`` (the fake model's work and the result
construction are outside the clock), on two clocks: wall time and the CPU
time of the process (what the step cost, undisturbed by other processes on a
shared machine; the two agree on an idle one). Rows report medians of both,
the mean and 90th percentile of wall time, the speed-up against the baseline
(vLLM when present, else the spec) on CPU time, and, in a separate pass under
``tracemalloc``, peak memory.

Workloads:

- ``decode-N``: N requests, all admitted and past their prefill, decoding one
  token per step. Prompt lengths are staggered so block-boundary crossings
  (allocation, new prefix-cache keys) are spread evenly over the steps, as in
  a real server. Nothing finishes during the timed steps.
- ``mixed``: arrivals in bursts, long prompts split by chunked prefill, shared
  system prompts (prefix hits), a pool small enough to force preemptions,
  requests finishing by max_tokens and by stop tokens.
- ``memory``: 4,096 running + 10,000 waiting requests of about 512 prompt
  tokens each (peak traced bytes over building the requests, adding them,
  prefill, and a few decode steps).

Modes (``modes=``): each decode and mixed workload runs in every mode asked
for, sync or async scheduling, each with or without speculative decoding
(``sync``, ``async``, ``sync+spec3``, ``async+spec3``; a row's workload names
its mode unless it is plain sync). In async mode the driver keeps one step in
flight, as vLLM's engine core does with its batch queue: schedule() for step
N+1, then update() for step N; a timed step is that schedule() plus that
update(). With speculative decoding the fake model verifies the scheduled
drafts greedily and accepts a deterministic, position-dependent number of them
(0 to all, uniform), then the bonus token; in sync mode it proposes k drafts
for the next step in ``StepResult.draft_token_ids`` (vLLM:
update_draft_token_ids, timed with the step), in async mode the scheduler
plans -1 placeholder drafts. Every token is a function of its position only,
so every scheduler sees the same tokens and makes the same decisions.

A library: it takes scheduler factories (``schedspec bench`` resolves names
through schedspec.adapters.registry) and returns rows; ``format_table`` and
``table_cells`` lay them out.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
import tracemalloc
import re
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from schedspec.spec.interface import (
    KVCacheGroup,
    Policy,
    RequestSpec,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
    SchedulerFactory,
)
from schedspec.adapters.vllm_adapter import VllmScheduler
from schedspec.adapters.vllm_load import load_vllm

BLOCK_SIZE = 16
#: Token ids are drawn from this list so prompts share int objects (8 bytes a
#: token in a tuple), as token ids coming off a tokenizer would not: the
#: memory row then measures the schedulers, not a million boxed ints.
_TOKENS = list(range(32000))


@dataclass(frozen=True)
class Mode:
    """How the schedulers run a workload: async scheduling (one step in
    flight) and the number of speculative tokens per step (0 = off)."""

    async_scheduling: bool = False
    num_speculative_tokens: int = 0
    #: k plans in flight without async scheduling (``sync+ppK``; docs/spec.md, In flight)
    pipeline_parallel_size: int = 1

    @property
    def label(self) -> str:
        base = "async" if self.async_scheduling else "sync"
        if self.pipeline_parallel_size > 1:
            base += f"+pp{self.pipeline_parallel_size}"
        k = self.num_speculative_tokens
        return f"{base}+spec{k}" if k else base

    @property
    def suffix(self) -> str:
        """What a row's workload name gains: nothing in plain sync mode."""
        return "" if self == SYNC else f" {self.label}"

    def apply(self, config: SchedulerConfig) -> SchedulerConfig:
        if self == SYNC:
            return config
        return replace(
            config,
            async_scheduling=self.async_scheduling,
            num_speculative_tokens=self.num_speculative_tokens,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )


SYNC = Mode()
#: The modes ``schedspec bench`` runs by default.
DEFAULT_MODES: tuple[Mode, ...] = (SYNC, Mode(True, 0), Mode(False, 3), Mode(True, 3))

_MODE_RE = re.compile(r"^(sync|async)(?:\+pp([2-4]))?(?:\+spec(\d*))?$")


def parse_modes(text: str) -> tuple[Mode, ...]:
    """``sync,async,sync+spec3,async+spec3`` (``+spec`` alone means 3 drafts)
    to modes; ValueError naming the part that is not one."""
    out: list[Mode] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = _MODE_RE.match(part)
        if m is None:
            raise ValueError(f"{part!r} is not a mode (sync, async, sync+specK, async+specK, sync+ppK)")
        k = 0 if m.group(3) is None else int(m.group(3) or 3)
        if not 1 <= k <= 8 and m.group(3) is not None:
            raise ValueError(f"{part!r}: the number of speculative tokens must be 1 to 8")
        pp = int(m.group(2) or 1)
        if pp > 1 and (m.group(1) == "async" or k):
            raise ValueError(f"{part!r}: a pipeline (+ppK) runs synchronously without drafts")
        mode = Mode(m.group(1) == "async", k, pp)
        if mode not in out:
            out.append(mode)
    if not out:
        raise ValueError("no mode given")
    return tuple(out)


#: The sliding window and the attention chunk of the hybrid layouts, in tokens.
HYBRID_WINDOW = 128
HYBRID_CHUNK = 256
#: The most state blocks a request holds in a Mamba group (three with async
#: scheduling: invariants/mamba.py, mamba-state-blocks-bounded).
MAMBA_STATE_BLOCKS = 3


@dataclass(frozen=True)
class KvLayout:
    """The KV cache layout a workload runs under: ``plain`` (one
    full-attention group, no connector: what the bench always ran),
    ``connector`` (the same pool with a KV connector: vLLM's kv_both
    connector, modelled; every third request finds the first half of its
    prompt in the connector's store and loads it within the step that
    admits it (``requests``), nothing is saved),
    ``hybrid`` (a full-attention group and a sliding-window group of
    HYBRID_WINDOW tokens, one pool), ``chunked`` (a full-attention group
    and a chunked-local group of HYBRID_CHUNK tokens) and ``mamba`` (a
    full-attention group and a Mamba group in "align" mode: spec/mamba.py;
    no drafts beside it, so the spec modes' cells are n/a)."""

    name: str = "plain"

    @property
    def suffix(self) -> str:
        """What a row's workload name gains: nothing for the plain layout."""
        return "" if self.name == "plain" else f" {self.name}"

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        if self.name == "hybrid":
            return (KVCacheGroup(), KVCacheGroup("sliding_window", sliding_window=HYBRID_WINDOW))
        if self.name == "chunked":
            return (KVCacheGroup(), KVCacheGroup("chunked_local", attention_chunk_size=HYBRID_CHUNK))
        if self.name == "hybrid-mamba":
            return (KVCacheGroup(), KVCacheGroup("mamba"))
        return ()

    def extra_blocks_per_request(self, block_size: int) -> int:
        """The most blocks a decoding request holds in its groups past the
        first: a window's (or a chunk's) worth and the partial blocks at
        both ends."""
        if self.name == "hybrid-mamba":
            return MAMBA_STATE_BLOCKS
        span = {"hybrid": HYBRID_WINDOW, "chunked": HYBRID_CHUNK}.get(self.name, 0)
        return -(-span // block_size) + 2 if span else 0

    def requests(self, reqs: Sequence[RequestSpec]) -> list[RequestSpec]:
        """The workload's requests under this layout: with the connector,
        every third one (by position) offers the first half of its prompt
        as external tokens, loaded synchronously."""
        if self.name != "connector":
            return list(reqs)
        return [replace(r, kv_external_tokens=(len(r.prompt_token_ids) - 1) // 2) if i % 3 == 2 else r
                for i, r in enumerate(reqs)]

    def apply(self, config: SchedulerConfig, requests: int = 0) -> SchedulerConfig:
        """``config`` under this layout; ``requests`` decoding requests get
        pool room for their extra groups' blocks."""
        if self.name == "plain":
            return config
        if self.name == "connector":
            return replace(config, kv_connector=True)
        extra = requests * self.extra_blocks_per_request(config.block_size)
        return replace(config, kv_cache_groups=self.groups, num_blocks=config.num_blocks + extra)


PLAIN = KvLayout()
#: Every layout ``--kv`` knows, in table order.
KV_LAYOUTS: tuple[str, ...] = ("plain", "connector", "hybrid", "chunked", "hybrid-mamba")


def parse_kv_layouts(text: str) -> tuple[KvLayout, ...]:
    """``plain,connector,hybrid,chunked,mamba`` (``all``: every one) to layouts;
    ValueError naming the part that is not one."""
    if text.strip() == "all":
        return tuple(KvLayout(n) for n in KV_LAYOUTS)
    out: list[KvLayout] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part not in KV_LAYOUTS:
            raise ValueError(f"{part!r} is not a KV layout ({', '.join(KV_LAYOUTS)}, all)")
        if KvLayout(part) not in out:
            out.append(KvLayout(part))
    if not out:
        raise ValueError("no KV layout given")
    return tuple(out)


@dataclass
class Row:
    workload: str
    scheduler: str
    steps: int
    median_ms: float  # wall clock
    cpu_median_ms: float  # CPU time of the process (robust on a shared machine)
    mean_ms: float
    p90_ms: float
    speedup: float | None = None  # baseline CPU median / this CPU median
    baseline: str | None = None
    peak_mb: float | None = None
    note: str = ""
    mode: str = "sync"
    layout: str = "plain"
    runs: int = 1  # interleaved runs behind the medians (the median of their medians)
    #: on the first scheduler's row (impl's, when it runs): its CPU median
    #: over each other scheduler's, by name ("spec": impl/spec)
    ratios: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "scheduler": self.scheduler,
            "steps": self.steps,
            "median_ms": round(self.median_ms, 4),
            "cpu_median_ms": round(self.cpu_median_ms, 4),
            "mean_ms": round(self.mean_ms, 4),
            "p90_ms": round(self.p90_ms, 4),
            "speedup_vs_baseline": None if self.speedup is None else round(self.speedup, 2),
            "baseline": self.baseline,
            "peak_mb": None if self.peak_mb is None else round(self.peak_mb, 1),
            "note": self.note,
            "mode": self.mode,
            "layout": self.layout,
            "runs": self.runs,
            "ratios": {f"{self.scheduler}/{k}": round(v, 4) for k, v in self.ratios.items()},
        }


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------


def decode_config(
    n: int, prompt_max: int = 64, gen: int = 4096, budget: int = 8192, mode: Mode = SYNC
) -> SchedulerConfig:
    """Room for every request at full length, and a budget that schedules
    every running request each step (1 + k tokens each)."""
    max_model_len = prompt_max + gen + 16
    blocks_per_req = -(-max_model_len // BLOCK_SIZE)
    return mode.apply(
        SchedulerConfig(
            block_size=BLOCK_SIZE,
            num_blocks=n * blocks_per_req + 1,
            max_num_batched_tokens=max(n * (1 + mode.num_speculative_tokens), budget),
            max_num_seqs=n,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            policy=Policy.FCFS,
        )
    )


def _prompt(rng: random.Random, length: int, prefix: tuple[int, ...] = ()) -> tuple[int, ...]:
    toks = _TOKENS
    return prefix + tuple(toks[rng.randrange(1000, 32000)] for _ in range(length - len(prefix)))


def decode_requests(
    n: int, seed: int = 0, max_tokens: int = 4000, prompt_len: int = 48, prefix: str = "d"
) -> list[RequestSpec]:
    rng = random.Random(seed)
    system = _prompt(rng, 16)
    out = []
    for i in range(n):
        # Lengths prompt_len - 15 .. prompt_len: the first decode token of
        # request i lands at a different offset in its block, so crossings
        # are spread out.
        length = prompt_len - BLOCK_SIZE + 1 + i % BLOCK_SIZE
        out.append(
            RequestSpec(
                request_id=f"{prefix}{i}",
                prompt_token_ids=_prompt(rng, length, system if i % 2 else ()),
                max_tokens=max_tokens,
                arrival=i,
            )
        )
    return out


def _token_for(num_tokens: int) -> int:
    """The fake model's token for a request that knows ``num_tokens`` tokens:
    a function of the position only, so every scheduler sees the same tokens
    and makes the same decisions."""
    return _TOKENS[(num_tokens * 7919) % 31000 + 1000]


def accepted_drafts(position: int, drafts: int) -> int:
    """How many of ``drafts`` scheduled drafts the fake model accepts when the
    first token it samples is at ``position``: 0 .. drafts, spread uniformly
    and fixed by the position, so every scheduler sees the same acceptance."""
    if drafts <= 0:
        return 0
    return ((position * 2654435761) >> 13) % (drafts + 1)


def sampled_tokens(first: int, drafts: int) -> tuple[int, ...]:
    """The tokens a step samples when its first sampled position is
    ``first`` and it verifies ``drafts`` drafts: the accepted drafts (equal to
    the model's own tokens, as greedy verification accepts), then the bonus."""
    if drafts <= 0:
        return (_token_for(first),)
    return tuple(_token_for(first + j) for j in range(accepted_drafts(first, drafts) + 1))


def proposed_drafts(next_position: int, k: int) -> tuple[int, ...]:
    """The k drafts proposed for the positions from ``next_position`` on."""
    return tuple(_token_for(next_position + j) for j in range(k))


def fake_result(plan: StepPlan, k: int = 0, propose: bool = False) -> StepResult:
    """The fake model's output for ``plan``: per sampling entry, the tokens
    from the position after its known, in-flight and draft-free positions on
    (``sampled_tokens``); with ``propose`` (sync speculative decoding) also k
    drafts for the request's next step."""
    if k == 0:
        return StepResult({s.request_id: (_token_for(s.num_tokens),) for s in plan.scheduled if s.samples})
    sampled: dict[str, tuple[int, ...]] = {}
    drafts: dict[str, tuple[int, ...]] = {}
    for s in plan.scheduled:
        if not s.samples:
            continue
        ks = len(s.spec_token_ids)
        first = s.num_computed_tokens + s.num_scheduled_tokens - ks
        toks = sampled[s.request_id] = sampled_tokens(first, ks)
        if propose:
            drafts[s.request_id] = proposed_drafts(first + len(toks), k)
    return StepResult(sampled, drafts)


class _Driver:
    """Steps a schedspec Scheduler: times schedule() and update() only. In
    async mode one plan stays in flight: a step is schedule() of the next plan
    and then update() of the oldest."""

    note = ""

    def __init__(self, sched: Scheduler, mode: Mode = SYNC) -> None:
        self.sched = sched
        self.k = mode.num_speculative_tokens
        self.propose = self.k > 0 and not mode.async_scheduling
        self.depth = 2 if mode.async_scheduling else mode.pipeline_parallel_size  # max_concurrent_batches
        self.pipeline = mode.pipeline_parallel_size
        self.in_flight: deque[StepPlan] = deque()
        #: every plan scheduled, when a list (``workload_plans``); None while timing
        self.plans: list[StepPlan] | None = None

    def add(self, req: RequestSpec) -> None:
        self.sched.add(req)

    def step(self) -> tuple[float, float, int, bool]:
        """(wall seconds inside the scheduler, CPU seconds of this process
        inside the scheduler, entries the new plan scheduled, whether every
        one of them is a decode: it samples, with at most 1 + k tokens)."""
        wall, cpu = time.perf_counter, time.process_time
        sched = self.sched
        t0, c0 = wall(), cpu()
        plan = sched.schedule()
        t1, c1 = wall(), cpu()
        in_flight = self.in_flight
        in_flight.append(plan)
        if self.plans is not None:
            self.plans.append(plan)
        w = t1 - t0
        c = c1 - c0
        if len(in_flight) >= self.depth:
            old = in_flight.popleft()
            result = fake_result(old, self.k, self.propose)
            t2, c2 = wall(), cpu()
            sched.update(old, result)
            t3, c3 = wall(), cpu()
            w += t3 - t2
            c += c3 - c2
        most = 1 + self.k
        decode = all(s.samples and s.num_scheduled_tokens <= most for s in plan.scheduled)
        return w, c, len(plan.scheduled), decode


class _VllmRawDriver(_Driver):
    """vLLM behind the adapter, timed on vLLM's own ``schedule()`` +
    ``update_from_output()`` (``VllmScheduler.raw_step``): the adapter builds
    vLLM's Scheduler; its translation to StepPlans and views is bypassed."""

    note = "vLLM schedule()+update_from_output()"

    def __init__(self, sched: VllmScheduler) -> None:
        super().__init__(sched)
        self.vllm = sched

    def add(self, req: RequestSpec) -> None:
        self.vllm.raw_add(req)

    def step(self) -> tuple[float, float, int, bool]:
        raw = self.vllm.raw_step(_token_for)
        return raw.wall_s, raw.cpu_s, raw.scheduled, raw.decode


class _VllmModeDriver(_Driver):
    """vLLM's scheduler behind the adapter (``VllmScheduler.sched``: its
    AsyncScheduler with async scheduling, a speculative config with drafts),
    driven as its engine core drives it, with the fake model of this module:
    timed on ``schedule()``, ``update_from_output()`` and, in sync speculative
    decoding, ``update_draft_token_ids()``; in async mode one step stays in
    flight (schedule step N+1, then update step N)."""

    note = "vLLM schedule()+update_from_output()"

    def __init__(self, sched: VllmScheduler, mode: Mode) -> None:
        super().__init__(sched, mode)
        self.vllm = sched
        self.v = load_vllm()
        if self.propose:
            self.note += "+update_draft_token_ids()"
        self.pending: deque[tuple[Any, list[tuple[str, int, int, bool]]]] = deque()

    def add(self, req: RequestSpec) -> None:
        self.vllm.raw_add(req)

    def step(self) -> tuple[float, float, int, bool]:
        wall, cpu = time.perf_counter, time.process_time
        inner = self.vllm.sched
        t0, c0 = wall(), cpu()
        out = inner.schedule()
        t1, c1 = wall(), cpu()
        w = t1 - t0
        c = c1 - c0
        reqs = inner.requests
        spec = out.scheduled_spec_decode_tokens
        # What the model runner knows of each request once schedule() is done:
        # the first position it samples and whether it samples at all.
        seen: list[tuple[str, int, int, bool]] = []
        most = 1 + self.k
        decode = True
        for rid, n in out.num_scheduled_tokens.items():
            r = reqs[rid]
            ks = len(spec.get(rid, ()))
            samples = not _is_prefill(r)
            seen.append((rid, r.num_computed_tokens - ks, ks, samples))
            decode = decode and samples and n <= most
        self.pending.append((out, seen))
        if len(self.pending) >= self.depth:
            old, old_seen = self.pending.popleft()
            ids = [rid for rid, _, _, _ in old_seen]
            sampled = [list(sampled_tokens(first, ks)) if samples else []
                       for _, first, ks, samples in old_seen]
            runner_output = self.v.ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={rid: i for i, rid in enumerate(ids)},
                sampled_token_ids=sampled,
            )
            drafts = None
            if self.propose:
                d_ids = [rid for (rid, _, _, samples) in old_seen if samples]
                d_toks = [list(proposed_drafts(first + len(toks), self.k))
                          for (_, first, _, samples), toks in zip(old_seen, sampled) if samples]
                drafts = self.v.DraftTokenIds(d_ids, d_toks)
            t2, c2 = wall(), cpu()
            inner.update_from_output(old, runner_output)
            if drafts is not None:
                inner.update_draft_token_ids(drafts)
            t3, c3 = wall(), cpu()
            w += t3 - t2
            c += c3 - c2
        return w, c, len(out.num_scheduled_tokens), decode


def _is_prefill(r: Any) -> bool:
    """vLLM's own verdict, set by schedule() (Scheduler._update_after_schedule)."""
    return bool(r.is_prefill_chunk)


def _driver(sched: Scheduler, mode: Mode = SYNC) -> _Driver:
    if isinstance(sched, VllmScheduler):
        if mode == SYNC:
            return _VllmRawDriver(sched)
        return _VllmModeDriver(sched, mode)
    return _Driver(sched, mode)


def _timed_steps(
    drv: _Driver,
    steps: int,
    max_seconds: float,
    before_step: Callable[[int], None] | None = None,
    min_steps: int = 5,
) -> list[tuple[float, float]]:
    times: list[tuple[float, float]] = []
    clock = time.perf_counter
    started = clock()
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()  # a cyclic GC pass landing in one step is noise, not cost
    try:
        for k in range(steps):
            if before_step is not None:
                before_step(k)
            w, c, _, _ = drv.step()
            times.append((w, c))
            if k + 1 >= min_steps and clock() - started > max_seconds:
                break
    finally:
        if gc_was:
            gc.enable()
    return times


def _warm_to_decode(drv: _Driver, reqs: Sequence[RequestSpec], limit: int = 10_000) -> None:
    """Add the requests and step until every one has sampled a token (with
    k plans in flight, a pipeline's, the last k plans decode them all)."""
    for r in reqs:
        drv.add(r)
    want = len(reqs)
    last: deque[tuple[int, bool]] = deque(maxlen=drv.pipeline)
    for _ in range(limit):
        _, _, count, decode = drv.step()
        last.append((count, decode))
        if sum(c for c, _ in last) == want and all(d for _, d in last):
            return
    raise RuntimeError("the decode workload never reached steady decoding")


def bench_decode(
    factory: SchedulerFactory, n: int, steps: int, max_seconds: float, mode: Mode = SYNC,
    layout: KvLayout = PLAIN,
) -> tuple[list[tuple[float, float]], str]:
    drv = _driver(factory(layout.apply(decode_config(n, mode=mode), n)), mode)
    _warm_to_decode(drv, layout.requests(decode_requests(n)))
    return _timed_steps(drv, steps, max_seconds), drv.note


def mixed_config(mode: Mode = SYNC) -> SchedulerConfig:
    return mode.apply(SchedulerConfig(
        block_size=BLOCK_SIZE,
        num_blocks=6000,  # ~96k tokens: ~150 running, tight enough to preempt
        max_num_batched_tokens=2048,
        max_num_seqs=512,
        max_model_len=4096,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=512,
        enable_prefix_caching=True,
        policy=Policy.FCFS,
    ))


def mixed_arrivals(steps: int, seed: int = 1, layout: KvLayout | None = None) -> list[list[RequestSpec]]:
    """Per step, the requests that arrive before it (under ``layout``: its
    ``KvLayout.requests`` of them all, in arrival order)."""
    rng = random.Random(seed)
    systems = [_prompt(rng, rng.choice([64, 256, 512])) for _ in range(4)]
    out: list[list[RequestSpec]] = []
    counter = 0
    for step in range(steps):
        batch: list[RequestSpec] = []
        burst = rng.random() < 0.15
        k = rng.randint(4, 24) if burst else (1 if rng.random() < 0.5 else 0)
        for _ in range(k):
            counter += 1
            if rng.random() < 0.6:
                prefix = rng.choice(systems)
                length = len(prefix) + rng.randint(8, 400)
            else:
                prefix = ()
                length = rng.choice([rng.randint(16, 200), rng.randint(200, 2500)])
            prompt = _prompt(rng, length, prefix)
            batch.append(
                RequestSpec(
                    request_id=f"m{counter}",
                    prompt_token_ids=prompt,
                    max_tokens=rng.choice([16, 64, 128, 256, 512]),
                    priority=rng.randint(0, 2),
                    arrival=counter,
                    stop_token_ids=(_TOKENS[rng.randrange(1000, 32000)],) if rng.random() < 0.3 else (),
                )
            )
        out.append(batch)
    if layout is not None:
        flat = iter(layout.requests([r for b in out for r in b]))
        out = [[next(flat) for _ in b] for b in out]
    return out


def bench_mixed(
    factory: SchedulerFactory, steps: int, max_seconds: float, mode: Mode = SYNC,
    layout: KvLayout = PLAIN,
) -> tuple[list[tuple[float, float]], str]:
    drv = _driver(factory(layout.apply(mixed_config(mode))), mode)
    arrivals = mixed_arrivals(steps, layout=layout)

    def before(k: int) -> None:
        for r in arrivals[k]:
            drv.add(r)

    return _timed_steps(drv, steps, max_seconds, before_step=before, min_steps=steps), drv.note


def workload_plans(
    factory: SchedulerFactory, workload: str, steps: int, mode: Mode = SYNC, layout: KvLayout = PLAIN,
    running: int = 8,
) -> list[StepPlan]:
    """The plans a scheduler makes on a bench workload ("decode": ``running``
    requests from their prefill on; "mixed": the mixed trace), driven
    through the Scheduler protocol (vLLM through its adapter, not the raw
    calls), ``steps`` steps: what lets a test hold the schedulers of a row
    to the same decisions."""
    if workload == "decode":
        config = layout.apply(decode_config(running, mode=mode), running)
        arrivals: list[list[RequestSpec]] = [layout.requests(decode_requests(running))]
        arrivals += [[] for _ in range(steps - 1)]
    else:
        config = layout.apply(mixed_config(mode))
        arrivals = mixed_arrivals(steps, layout=layout)
    drv = _Driver(factory(config), mode)
    drv.plans = []
    for batch in arrivals:
        for r in batch:
            drv.add(r)
        drv.step()
    return drv.plans


def memory_peak_mb(
    factory: SchedulerFactory,
    running: int = 4096,
    waiting: int = 10_000,
    steps: int = 3,
    prompt_len: int = 512,
) -> float:
    """Peak traced memory: build and add ``running`` requests of about
    ``prompt_len`` tokens, run them into decode (every full prompt block gets
    a prefix-cache key), add ``waiting`` more of the same size, and decode a
    few steps. Requests, scheduler and plans all count."""
    cfg = decode_config(running, prompt_max=prompt_len, gen=512, budget=32768)
    gc.collect()
    tracemalloc.start()
    try:
        drv = _driver(factory(cfg))
        _warm_to_decode(drv, decode_requests(running, seed=2, max_tokens=500, prompt_len=prompt_len))
        for r in decode_requests(waiting, seed=3, max_tokens=500, prompt_len=prompt_len, prefix="w"):
            drv.add(r)
        for _ in range(steps):
            drv.step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / 2**20


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def _row(workload: str, name: str, runs: Sequence[list[tuple[float, float]]], note: str = "") -> Row:
    """One row from one or more runs of a cell: the medians are the median
    of the runs' medians (a run that a loaded moment slowed moves it
    little), the mean and 90th percentile are over every step."""
    ms = [w * 1000 for times in runs for w, _ in times]
    ms_sorted = sorted(ms)
    return Row(
        workload=workload,
        scheduler=name,
        steps=len(ms),
        median_ms=statistics.median([statistics.median([w * 1000 for w, _ in t]) for t in runs]),
        cpu_median_ms=statistics.median([statistics.median([c * 1000 for _, c in t]) for t in runs]),
        mean_ms=statistics.fmean(ms),
        p90_ms=ms_sorted[min(len(ms_sorted) - 1, int(0.9 * len(ms_sorted)))],
        note=note,
        runs=len(runs),
    )


def run_bench(
    schedulers: Mapping[str, SchedulerFactory],
    running: Sequence[int] = (256, 1024, 4096),
    steps: int = 200,
    json_path: str | None = None,
    *,
    mixed_steps: int = 400,
    max_seconds: float = 20.0,
    memory: bool = True,
    memory_running: int = 4096,
    memory_waiting: int = 10_000,
    baseline: str | None = None,
    progress: Callable[[str], None] | None = None,
    modes: Sequence[Mode] = (SYNC,),
    layouts: Sequence[KvLayout] = (PLAIN,),
    repeat: int = 1,
) -> list[Row]:
    """Time every scheduler on every workload in every mode and KV layout;
    return (and optionally write as JSON) one row per (workload, mode,
    layout, scheduler). ``baseline`` defaults to "vllm" when present, else
    "spec", else the first scheduler. A scheduler that cannot run a cell
    (it refuses the config or breaks on the way) gets a row with no times
    and the reason as its note. ``repeat`` runs every cell that many times,
    the schedulers of a cell back to back in each round, and reports the
    median of the runs' medians. The first scheduler's rows (impl's, when it
    runs) carry its CPU median over each other scheduler's (``ratios``)."""
    names = list(schedulers)
    if baseline is None:
        baseline = "vllm" if "vllm" in names else ("spec" if "spec" in names else names[0])
    say = progress or (lambda _msg: None)
    cells: dict[tuple[str, str], tuple[Mode, KvLayout, list[list[tuple[float, float]]], str]] = {}
    failed: dict[tuple[str, str], str] = {}

    def cell(workload: str, mode: Mode, layout: KvLayout, name: str,
             run: Callable[[], tuple[list[tuple[float, float]], str]], rnd: int) -> None:
        label = workload + mode.suffix + layout.suffix
        key = (label, name)
        if key in failed:
            return
        say(f"{label} {name}" + (f" (run {rnd + 1}/{repeat})" if repeat > 1 else ""))
        try:
            times, note = run()
        except Exception as exc:  # noqa: BLE001 - reported in the table, the others still run
            if mode == SYNC and layout == PLAIN:
                raise
            failed[key] = f"n/a: {type(exc).__name__}: {exc}".splitlines()[0][:160]
            cells[key] = (mode, layout, [], "")
            return
        got = cells.setdefault(key, (mode, layout, [], note))
        got[2].append(times)

    for rnd in range(max(1, repeat)):
        for mode in modes:
            for layout in layouts:
                for n in running:
                    for name in names:
                        cell(f"decode-{n}", mode, layout, name,
                             lambda: bench_decode(schedulers[name], n, steps, max_seconds, mode, layout), rnd)
                if mixed_steps > 0:
                    for name in names:
                        cell("mixed", mode, layout, name,
                             lambda: bench_mixed(schedulers[name], mixed_steps, max_seconds * 10, mode, layout),
                             rnd)
    rows: list[Row] = []
    nan = float("nan")
    for (label, name), (mode, layout, runs, note) in cells.items():
        reason = failed.get((label, name))
        row = (Row(label, name, 0, nan, nan, nan, nan, note=reason) if reason is not None
               else _row(label, name, runs, note))
        row.mode = mode.label
        row.layout = layout.name
        rows.append(row)
    by_key = {(r.workload, r.scheduler): r for r in rows}
    for r in rows:
        base = by_key.get((r.workload, baseline))
        if base is not None and base.steps and r.steps and r.cpu_median_ms > 0:
            r.speedup = base.cpu_median_ms / r.cpu_median_ms
            r.baseline = baseline
        if r.scheduler == names[0] and r.steps:
            for other in names[1:]:
                o = by_key.get((r.workload, other))
                if o is not None and o.steps and o.cpu_median_ms > 0:
                    r.ratios[other] = r.cpu_median_ms / o.cpu_median_ms
    if memory:
        label = f"memory {memory_running}+{memory_waiting}w"
        for name in names:
            say(f"{label} {name}")
            peak = memory_peak_mb(schedulers[name], memory_running, memory_waiting)
            nan = float("nan")
            rows.append(Row(label, name, 3, nan, nan, nan, nan, peak_mb=peak))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"rows": [r.as_dict() for r in rows], "machine": _machine()}, fh, indent=2)
    return rows


def _machine() -> dict[str, Any]:
    import os
    import platform

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


#: The table's columns: heading, width, alignment (``<`` left, ``>`` right).
TABLE_COLUMNS: tuple[tuple[str, int, str], ...] = (
    ("workload", 23, "<"),
    ("scheduler", 9, "<"),
    ("steps", 5, ">"),
    ("median ms", 10, ">"),
    ("cpu ms", 9, ">"),
    ("mean ms", 9, ">"),
    ("p90 ms", 9, ">"),
    ("speed-up (cpu)", 16, ">"),
    ("peak MB", 8, ">"),
)


#: The ratio columns (``table_cells(..., ratios=...)``): the first
#: scheduler's CPU median over the named one's (below 1: the first is faster).
def ratio_columns(others: Sequence[str], first: str = "impl") -> tuple[tuple[str, int, str], ...]:
    return tuple((f"{first}/{o}", max(9, len(first) + len(o) + 1), ">") for o in others)


def table_cells(rows: Sequence[Row], ratios: Sequence[str] = ()) -> list[list[str]]:
    """One list of cell texts per row, in TABLE_COLUMNS order (blank where a
    row has no such figure: the memory rows are not timed), then one cell
    per name in ``ratios`` (the row's CPU-median ratio against it, blank
    on rows that carry none)."""
    out = []
    for r in rows:
        timed = r.median_ms == r.median_ms  # not NaN
        sp = f"{r.speedup:.1f}x vs {r.baseline}" if r.speedup is not None and r.baseline != r.scheduler else ""
        times = ([f"{r.median_ms:.3f}", f"{r.cpu_median_ms:.3f}", f"{r.mean_ms:.3f}", f"{r.p90_ms:.3f}"]
                 if timed else ["", "", "", ""])
        peak = f"{r.peak_mb:.1f}" if r.peak_mb is not None else ""
        if not r.steps and r.note:  # not run: the reason is in not_run_notes()
            times = ["n/a", "", "", ""]
        extra = [f"{r.ratios[o]:.3f}" if o in r.ratios else "" for o in ratios]
        out.append([r.workload, r.scheduler, str(r.steps), *times, sp, peak, *extra])
    return out


def ratio_names(rows: Sequence[Row]) -> tuple[str, list[str]]:
    """The scheduler whose rows carry ratios and the names they are against,
    in first-seen order."""
    first = ""
    others: list[str] = []
    for r in rows:
        if r.ratios:
            first = r.scheduler
            for o in r.ratios:
                if o not in others:
                    others.append(o)
    return first, others


def not_run_notes(rows: Sequence[Row]) -> list[str]:
    """One line per cell that could not run: workload, scheduler, reason."""
    return [f"{r.workload} {r.scheduler}: {r.note}" for r in rows if not r.steps and r.note]


def format_table(rows: Sequence[Row], ratios: bool = False) -> str:
    """The rows as a plain fixed-width table (what ``schedspec bench`` prints
    when stdout is not a terminal); with ``ratios``, the ratio columns too
    (``ratio_columns``). A column widens to its longest cell."""
    columns = TABLE_COLUMNS
    others: list[str] = []
    if ratios:
        first, others = ratio_names(rows)
        columns = columns + ratio_columns(others, first)
    cells = table_cells(rows, others)
    widths = [max([width, *(len(c[i]) for c in cells)]) for i, (_, width, _) in enumerate(columns)]

    def line(row: Sequence[str]) -> str:
        return " ".join(f"{cell:{align}{w}}" for cell, (_, _, align), w in zip(row, columns, widths))

    head = line([name for name, _, _ in columns])
    return "\n".join([head, "-" * len(head), *(line(c) for c in cells)])
