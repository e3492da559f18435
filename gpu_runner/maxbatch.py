"""The largest batch the runner handles: single prefill steps of R requests x L
prompt tokens, R doubling from 1.

Each step is one forward over R new requests of L tokens each (every request
samples, so R logits rows), on a KV pool sized for the batch (1 + R * ceil(L /
block_size) blocks). The forward is timed after a warm-up: the median of
``repeats`` runs (``torch.cuda.synchronize`` around each on CUDA). The probe
stops at the first ``torch.cuda.OutOfMemoryError`` (caught, the cache
emptied), before a step over ``max_batch_tokens`` tokens, or after a step
whose median took longer than ``max_step_seconds``.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from schedspec.spec.interface import ScheduledRequest, ScheduleKind, SchedulerConfig, StepPlan

from schedspec.gpu_runner.equivalence import Progress
from schedspec.gpu_runner.executor import Executor
from schedspec.gpu_runner.model import PagedLlama, describe_facts, determinism_facts


@dataclass
class ProbeRow:
    requests: int
    tokens: int
    ms: float = 0.0
    peak_mb: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.ms / 1000.0) if self.ms > 0 else 0.0


@dataclass
class ProbeReport:
    model: str
    device: str
    mode: str
    prompt_len: int
    max_batch_tokens: int
    environment: dict[str, Any]
    rows: list[ProbeRow] = field(default_factory=list)
    stopped: str = ""

    @property
    def largest(self) -> ProbeRow | None:
        done = [r for r in self.rows if r.ok]
        return done[-1] if done else None

    def table(self) -> str:
        head = f"{'requests':>8} {'tokens':>8} {'ms':>10} {'tokens/s':>12} {'peak MB':>9}"
        lines = [
            f"largest batch: model {self.model} on {self.device}, mode {self.mode}, prompts of {self.prompt_len} "
            f"tokens, cap {self.max_batch_tokens} tokens",
            f"environment: {describe_facts(self.environment)}",
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            if r.ok:
                lines.append(f"{r.requests:>8} {r.tokens:>8} {r.ms:>10.2f} {r.tokens_per_s:>12.0f} {r.peak_mb:>9.0f}")
            else:
                lines.append(f"{r.requests:>8} {r.tokens:>8} {'-':>10} {'-':>12} {'-':>9}  {r.error}")
        big = self.largest
        lines.append(f"stopped: {self.stopped}")
        lines.append(f"largest batch handled: {big.requests} x {self.prompt_len} = {big.tokens} tokens per step"
                     if big else "largest batch handled: none")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        big = self.largest
        return {
            "kind": "max-batch",
            "model": self.model, "device": self.device, "mode": self.mode, "prompt_len": self.prompt_len,
            "max_batch_tokens": self.max_batch_tokens, "environment": self.environment, "stopped": self.stopped,
            "largest_tokens": big.tokens if big else 0,
            "rows": [{"requests": r.requests, "tokens": r.tokens, "ms": r.ms, "tokens_per_s": r.tokens_per_s,
                      "peak_mb": r.peak_mb, "error": r.error} for r in self.rows],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def prefill_plan(requests: int, prompt_len: int, block_size: int, vocab_size: int) -> tuple[SchedulerConfig, StepPlan]:
    """A config whose pool holds ``requests`` prompts of ``prompt_len`` and the
    plan that prefills them all in one step."""
    per = -(-prompt_len // block_size)
    config = SchedulerConfig(block_size=block_size, num_blocks=1 + requests * per,
                             max_num_batched_tokens=max(requests * prompt_len, 1), max_num_seqs=max(requests, 1),
                             max_model_len=prompt_len)
    entries = []
    for r in range(requests):
        toks = tuple(4 + (r * 7919 + j * 104729) % max(vocab_size - 4, 1) for j in range(prompt_len))
        blocks = tuple(range(1 + r * per, 1 + (r + 1) * per))
        entries.append(ScheduledRequest(f"p{r}", ScheduleKind.NEW, 0, prompt_len, prompt_len, blocks, toks))
    return config, StepPlan(1, tuple(entries), (), ())


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def probe_max_batch(
    model: PagedLlama,
    *,
    prompt_len: int = 512,
    max_batch_tokens: int = 262_144,
    max_step_seconds: float = 30.0,
    repeats: int = 3,
    block_size: int = 16,
    model_name: str = "",
    progress: Progress | None = None,
) -> ProbeReport:
    """Prefill steps of R x ``prompt_len`` tokens, R = 1, 2, 4, ..., until one
    runs out of memory, would pass ``max_batch_tokens``, or takes longer than
    ``max_step_seconds`` (median); ``model.window`` must cover ``prompt_len``."""
    if prompt_len < 1 or prompt_len > model.window:
        raise ValueError(f"prompt length {prompt_len} must be between 1 and the model's window {model.window}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dev = model.device
    report = ProbeReport(model_name or model.config.name, str(dev), model.mode, prompt_len, max_batch_tokens,
                         determinism_facts(dev))
    r = 1
    oom = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    while True:
        tokens = r * prompt_len
        if tokens > max_batch_tokens:
            report.stopped = f"the next step ({r} x {prompt_len} = {tokens} tokens) is over the cap of {max_batch_tokens}"
            break
        row = ProbeRow(r, tokens)
        try:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            config, plan = prefill_plan(r, prompt_len, block_size, model.config.vocab_size)
            ex = Executor(model, config, keep_logits=False)
            batch = ex.build_batch(plan)
            model.forward(batch, ex.cache)  # warm-up
            _sync(dev)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                model.forward(batch, ex.cache)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            row.ms = statistics.median(times) * 1000.0
            if dev.type == "cuda":
                row.peak_mb = torch.cuda.max_memory_allocated(dev) / 2**20
            del ex, batch
        except (oom, MemoryError) as exc:
            row.error = f"out of memory: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}"
        finally:
            _free(dev)
        report.rows.append(row)
        if progress:
            progress(f"{r} x {prompt_len} = {tokens} tokens: " + (row.error or f"{row.ms:.1f} ms"))
        if not row.ok:
            report.stopped = f"{r} x {prompt_len} ran out of memory"
            break
        if row.ms / 1000.0 > max_step_seconds:
            report.stopped = f"{r} x {prompt_len} took {row.ms / 1000:.1f} s, over the per-step cap of {max_step_seconds} s"
            break
        r *= 2
    return report


def run_max_batch(
    *,
    model: str = "glassllm",
    device: str = "auto",
    mode: str = "fast",
    prompt_len: int = 512,
    max_batch_tokens: int = 262_144,
    max_step_seconds: float = 30.0,
    repeats: int = 3,
    tile_rows: int = 16,
    deterministic_algorithms: bool = False,
    progress: Progress | None = None,
) -> ProbeReport:
    """Load ``model`` on ``device`` with a window of ``prompt_len`` and probe."""
    from schedspec.gpu_runner.executor import pick_device
    from schedspec.gpu_runner.loaders import load_model
    from schedspec.gpu_runner.model import ModelError

    dev = pick_device(device, deterministic_algorithms=deterministic_algorithms)
    weights = load_model(model, dev)
    if prompt_len > weights.config.max_position:
        raise ModelError(f"prompt length {prompt_len} is past the model's {weights.config.max_position} positions")
    paged = PagedLlama(weights, mode=mode, tile_rows=tile_rows, window=prompt_len)  # type: ignore[arg-type]
    return probe_max_batch(paged, prompt_len=prompt_len, max_batch_tokens=max_batch_tokens,
                           max_step_seconds=max_step_seconds, repeats=repeats, model_name=model, progress=progress)
