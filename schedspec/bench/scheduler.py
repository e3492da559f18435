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
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from schedspec.spec.interface import (
    Policy,
    RequestSpec,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
    SchedulerFactory,
)
from schedspec.adapters.vllm_adapter import VllmScheduler

BLOCK_SIZE = 16
#: Token ids are drawn from this list so prompts share int objects (8 bytes a
#: token in a tuple), as token ids coming off a tokenizer would not: the
#: memory row then measures the schedulers, not a million boxed ints.
_TOKENS = list(range(32000))


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
        }


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------


def decode_config(n: int, prompt_max: int = 64, gen: int = 4096, budget: int = 8192) -> SchedulerConfig:
    max_model_len = prompt_max + gen + 16
    blocks_per_req = -(-max_model_len // BLOCK_SIZE)
    return SchedulerConfig(
        block_size=BLOCK_SIZE,
        num_blocks=n * blocks_per_req + 1,
        max_num_batched_tokens=max(n, budget),
        max_num_seqs=n,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        policy=Policy.FCFS,
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


def _result_for(plan: StepPlan) -> StepResult:
    return StepResult({s.request_id: (_token_for(s.num_tokens),) for s in plan.scheduled if s.samples})


class _Driver:
    """Steps a schedspec Scheduler: times schedule() and update() only."""

    note = ""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    def add(self, req: RequestSpec) -> None:
        self.sched.add(req)

    def step(self) -> tuple[float, float, int, bool]:
        """(wall seconds inside the scheduler, CPU seconds of this process
        inside the scheduler, entries scheduled, all of them one token)."""
        wall, cpu = time.perf_counter, time.process_time
        t0, c0 = wall(), cpu()
        plan = self.sched.schedule()
        t1, c1 = wall(), cpu()
        result = _result_for(plan)
        t2, c2 = wall(), cpu()
        self.sched.update(plan, result)
        t3, c3 = wall(), cpu()
        decode = all(s.num_scheduled_tokens == 1 for s in plan.scheduled)
        return (t1 - t0) + (t3 - t2), (c1 - c0) + (c3 - c2), len(plan.scheduled), decode


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


def _driver(sched: Scheduler) -> _Driver:
    if isinstance(sched, VllmScheduler):
        return _VllmRawDriver(sched)
    return _Driver(sched)


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
    """Add the requests and step until every one has sampled a token."""
    for r in reqs:
        drv.add(r)
    want = len(reqs)
    for _ in range(limit):
        _, _, count, decode = drv.step()
        if count == want and decode:
            return
    raise RuntimeError("the decode workload never reached steady decoding")


def bench_decode(
    factory: SchedulerFactory, n: int, steps: int, max_seconds: float
) -> tuple[list[tuple[float, float]], str]:
    drv = _driver(factory(decode_config(n)))
    _warm_to_decode(drv, decode_requests(n))
    return _timed_steps(drv, steps, max_seconds), drv.note


def mixed_config() -> SchedulerConfig:
    return SchedulerConfig(
        block_size=BLOCK_SIZE,
        num_blocks=6000,  # ~96k tokens: ~150 running, tight enough to preempt
        max_num_batched_tokens=2048,
        max_num_seqs=512,
        max_model_len=4096,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=512,
        enable_prefix_caching=True,
        policy=Policy.FCFS,
    )


def mixed_arrivals(steps: int, seed: int = 1) -> list[list[RequestSpec]]:
    """Per step, the requests that arrive before it."""
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
    return out


def bench_mixed(
    factory: SchedulerFactory, steps: int, max_seconds: float
) -> tuple[list[tuple[float, float]], str]:
    drv = _driver(factory(mixed_config()))
    arrivals = mixed_arrivals(steps)

    def before(k: int) -> None:
        for r in arrivals[k]:
            drv.add(r)

    return _timed_steps(drv, steps, max_seconds, before_step=before, min_steps=steps), drv.note


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


def _row(workload: str, name: str, times: list[tuple[float, float]], note: str = "") -> Row:
    ms = [w * 1000 for w, _ in times]
    cpu_ms = [c * 1000 for _, c in times]
    ms_sorted = sorted(ms)
    return Row(
        workload=workload,
        scheduler=name,
        steps=len(ms),
        median_ms=statistics.median(ms),
        cpu_median_ms=statistics.median(cpu_ms),
        mean_ms=statistics.fmean(ms),
        p90_ms=ms_sorted[min(len(ms_sorted) - 1, int(0.9 * len(ms_sorted)))],
        note=note,
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
) -> list[Row]:
    """Time every scheduler on every workload; return (and optionally write
    as JSON) one row per (workload, scheduler). ``baseline`` defaults to
    "vllm" when present, else "spec", else the first scheduler."""
    names = list(schedulers)
    if baseline is None:
        baseline = "vllm" if "vllm" in names else ("spec" if "spec" in names else names[0])
    say = progress or (lambda _msg: None)
    rows: list[Row] = []
    for n in running:
        for name in names:
            say(f"decode-{n} {name}")
            times, note = bench_decode(schedulers[name], n, steps, max_seconds)
            rows.append(_row(f"decode-{n}", name, times, note))
    if mixed_steps > 0:
        for name in names:
            say(f"mixed {name}")
            times, note = bench_mixed(schedulers[name], mixed_steps, max_seconds * 10)
            rows.append(_row("mixed", name, times, note))
    by_key = {(r.workload, r.scheduler): r for r in rows}
    for r in rows:
        base = by_key.get((r.workload, baseline))
        if base is not None and r.cpu_median_ms > 0:
            r.speedup = base.cpu_median_ms / r.cpu_median_ms
            r.baseline = baseline
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
    ("workload", 20, "<"),
    ("scheduler", 9, "<"),
    ("steps", 5, ">"),
    ("median ms", 10, ">"),
    ("cpu ms", 9, ">"),
    ("mean ms", 9, ">"),
    ("p90 ms", 9, ">"),
    ("speed-up (cpu)", 16, ">"),
    ("peak MB", 8, ">"),
)


def table_cells(rows: Sequence[Row]) -> list[list[str]]:
    """One list of cell texts per row, in TABLE_COLUMNS order (blank where a
    row has no such figure: the memory rows are not timed)."""
    out = []
    for r in rows:
        timed = r.median_ms == r.median_ms  # not NaN
        sp = f"{r.speedup:.1f}x vs {r.baseline}" if r.speedup is not None and r.baseline != r.scheduler else ""
        times = ([f"{r.median_ms:.3f}", f"{r.cpu_median_ms:.3f}", f"{r.mean_ms:.3f}", f"{r.p90_ms:.3f}"]
                 if timed else ["", "", "", ""])
        peak = f"{r.peak_mb:.1f}" if r.peak_mb is not None else ""
        out.append([r.workload, r.scheduler, str(r.steps), *times, sp, peak])
    return out


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a plain fixed-width table (what ``schedspec bench`` prints
    when stdout is not a terminal)."""

    def line(cells: Sequence[str]) -> str:
        return " ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, TABLE_COLUMNS))

    head = line([name for name, _, _ in TABLE_COLUMNS])
    return "\n".join([head, "-" * len(head), *(line(cells) for cells in table_cells(rows))])
