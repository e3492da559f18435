"""The equivalence matrix: scheduling must never change what a model generates.

For each seeded workload (shared prefixes, long prompts, arrivals over time,
priorities, stop tokens, cache salts, aborts) we run a *baseline*
configuration (no chunked prefill, no prefix caching, a pool large enough that
nothing is ever preempted) and a set of *variants* (small token budgets and
long-prefill thresholds, prefix caching, a tiny pool that forces preemption and
recomputation, all of them together under FCFS and PRIORITY), each with a real
model on a paged KV cache, greedy sampling. Every request's generated tokens
must equal the baseline's; in exact mode every sampled logits row must be
bitwise equal as well (fast mode: within a reported tolerance).

Guards count, per variant, that it really chunked a prefill, hit the prefix
cache, or preempted, so a variant cannot pass by never exercising its feature.
A negative control runs a variant with a deliberately wrong block table and
with wrong positions (``executor.Fault``) and must see a divergence.

Any object implementing ``spec.interface.Scheduler`` can be driven; pass a
factory ``Callable[[SchedulerConfig], Scheduler]``.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from schedspec.spec.interface import (
    Policy,
    RequestSpec,
    RequestStatus,
    RequestView,
    ScheduleKind,
    Scheduler,
    SchedulerConfig,
    SchedulerFactory,
)

from schedspec.gpu_runner.executor import Executor, Fault, FaultKind, PlanError
from schedspec.gpu_runner.model import PagedLlama

Progress = Callable[[str], None]

FEATURES = ("chunked", "cache_hit", "preempted")


def spec_factory(config: SchedulerConfig) -> Scheduler:
    """The reference scheduler (imported lazily)."""
    from schedspec.spec.scheduler import SpecScheduler

    return SpecScheduler(config)


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests, when each arrives (a driver step), and aborts (step, id)."""

    name: str
    seed: int
    requests: tuple[RequestSpec, ...]
    arrive_at: Mapping[str, int]
    aborts: tuple[tuple[int, str], ...] = ()
    features: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": self.seed,
            "requests": [r.to_dict() for r in self.requests],
            "arrive_at": dict(self.arrive_at),
            "aborts": [list(a) for a in self.aborts],
            "features": list(self.features),
        }


def make_workload(
    seed: int,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int = 16,
    name: str | None = None,
    first_token: int = 4,
) -> Workload:
    """A seeded workload of 7 to 10 requests.

    Two "pressure" requests arrive first, at step 0, each with a prompt of a
    little under half of a one-request pool and enough tokens to outgrow it
    together: in the smallest pool that holds one request of
    ``max_model_len`` they must preempt. 2 to 4 requests share a prefix of one
    to three blocks (the first two unsalted, so a prefix cache must hit), 1 or
    2 have long prompts, the rest are short; about half of those arrive later.
    Some carry stop tokens, an eos id, a cache salt; some are aborted. Token ids
    are drawn from ``first_token .. vocab_size-1`` (glassllm keeps 0..3 for
    specials)."""
    rng = random.Random(seed)
    lo = min(first_token, vocab_size - 1)

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(lo, vocab_size) for _ in range(n))

    longest = max_model_len - 1
    pre_len = min(rng.choice([block_size, 2 * block_size, 2 * block_size + 5, 3 * block_size]), longest // 2)
    prefix = toks(pre_len)
    n_shared = rng.randint(2, 4)
    n_long = rng.randint(1, 2)
    n_short = rng.randint(1, 3)
    kinds = ["shared"] * n_shared + ["long"] * n_long + ["short"] * n_short
    rng.shuffle(kinds)
    kinds = ["pressure", "pressure"] + kinds
    half = -(-max_model_len // block_size) // 2  # blocks in half the smallest pool
    features: set[str] = {"shared-prefix", "long-prompt", "pressure"}
    specs: list[tuple[int, int, RequestSpec]] = []
    protected: set[str] = set()
    n_shared_seen = 0
    for i, kind in enumerate(kinds):
        rid = f"w{seed}-r{i}"
        max_tokens = rng.choice([1, 2, 4, 8, 12, 16, 24, 32])
        room = max(1, min(longest, max_model_len - max_tokens))
        salt: str | None = "salt-a" if rng.random() < 0.1 else None
        if kind == "pressure":
            plen = max(1, (half - 1) * block_size - rng.randint(1, max(1, block_size // 3)))
            prompt = toks(plen)
            max_tokens = max(1, min(half * block_size - plen + rng.randint(1, max(1, block_size // 2)), longest - plen))
            salt = None
            protected.add(rid)
        elif kind == "shared":
            prompt = (prefix + toks(rng.randint(1, 20)))[:room]
            if n_shared_seen < 2:
                salt = None
            n_shared_seen += 1
        elif kind == "long":
            prompt = toks(rng.randint(max(1, min(room, max_model_len // 2)), room))
        else:
            prompt = toks(rng.randint(1, min(40, room)))
        arrive = 0 if kind in ("pressure", "shared") and n_shared_seen <= 1 or rng.random() < 0.5 else rng.randint(1, 12)
        if arrive:
            features.add("arrivals")
        priority = rng.randint(0, 3)
        stop: tuple[int, ...] = ()
        eos: int | None = None
        if kind != "pressure" and rng.random() < 0.2:
            stop = toks(rng.randint(1, 8))
            features.add("stop-tokens")
        if kind != "pressure" and rng.random() < 0.15:
            eos = rng.randrange(lo, vocab_size)
        if salt:
            features.add("salt")
        specs.append(
            (
                arrive,
                i,
                RequestSpec(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    max_tokens=max_tokens,
                    priority=priority,
                    stop_token_ids=stop,
                    eos_token_id=eos,
                    cache_salt=salt,
                ),
            )
        )
    specs.sort(key=lambda x: (x[0], x[1]))
    requests = tuple(replace(s, arrival=order) for order, (_, _, s) in enumerate(specs))
    arrive_at = {s.request_id: a for a, _, s in specs}
    if len({s.priority for s in requests}) > 1:
        features.add("priorities")
    aborts: list[tuple[int, str]] = []
    if rng.random() < 0.5:
        for s in rng.sample([r for r in requests if r.request_id not in protected], rng.randint(1, 2)):
            aborts.append((arrive_at[s.request_id] + rng.randint(0, 8), s.request_id))
        features.add("aborts")
    return Workload(
        name=name or f"w{seed}",
        seed=seed,
        requests=requests,
        arrive_at=arrive_at,
        aborts=tuple(sorted(aborts)),
        features=tuple(sorted(features)),
    )


def make_workloads(
    n: int, *, seed: int = 0, vocab_size: int, max_model_len: int, block_size: int = 16
) -> list[Workload]:
    return [
        make_workload(seed + i, vocab_size=vocab_size, max_model_len=max_model_len, block_size=block_size)
        for i in range(n)
    ]


# --------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A configuration to compare with the baseline, and which features it
    must exercise (``FEATURES``) for the comparison to mean something."""

    name: str
    config: SchedulerConfig
    expects: frozenset[str] = frozenset()


def baseline_config(max_model_len: int, block_size: int = 16, max_num_seqs: int = 8) -> SchedulerConfig:
    """No chunking, no prefix caching, a pool that holds every running
    request at max_model_len (so no preemption)."""
    blocks_per_seq = -(-max_model_len // block_size)
    return SchedulerConfig(
        block_size=block_size,
        num_blocks=1 + max_num_seqs * blocks_per_seq,
        max_num_batched_tokens=max(8 * max_model_len, 1024),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )


def default_variants(max_model_len: int, block_size: int = 16, max_num_seqs: int = 8) -> tuple[Variant, ...]:
    base = baseline_config(max_model_len, block_size, max_num_seqs)
    tiny = 1 + -(-max_model_len // block_size)  # the least that holds one request at max_model_len
    small = max(max_num_seqs, 2 * block_size)
    chunk = {"chunked"}
    return (
        Variant(
            "chunked-budget",
            replace(base, enable_chunked_prefill=True, max_num_batched_tokens=max(max_num_seqs, block_size)),
            frozenset(chunk),
        ),
        Variant(
            "chunked-threshold",
            replace(
                base,
                enable_chunked_prefill=True,
                max_num_batched_tokens=3 * block_size,
                long_prefill_token_threshold=min(12, max_model_len),
            ),
            frozenset(chunk),
        ),
        Variant("prefix-cache", replace(base, enable_prefix_caching=True), frozenset({"cache_hit"})),
        Variant("tiny-pool", replace(base, num_blocks=tiny), frozenset({"preempted"})),
        Variant(
            "all-fcfs",
            replace(
                base,
                enable_chunked_prefill=True,
                enable_prefix_caching=True,
                num_blocks=tiny,
                max_num_batched_tokens=small,
                long_prefill_token_threshold=min(block_size, max_model_len),
            ),
            frozenset(FEATURES),
        ),
        Variant(
            "all-priority",
            replace(
                base,
                enable_chunked_prefill=True,
                enable_prefix_caching=True,
                num_blocks=tiny,
                max_num_batched_tokens=small,
                long_prefill_token_threshold=min(block_size, max_model_len),
                policy=Policy.PRIORITY,
            ),
            frozenset(FEATURES),
        ),
    )


# --------------------------------------------------------------------------
# Driving one scheduler over one workload
# --------------------------------------------------------------------------


@dataclass
class Counters:
    steps: int = 0
    tokens: int = 0
    chunked: int = 0  # partial prefill chunks scheduled
    cache_hit_tokens: int = 0  # tokens found in the prefix cache at admission
    preemptions: int = 0
    resumed: int = 0
    seconds: float = 0.0  # wall time of the whole run
    forward_seconds: float = 0.0

    def feature(self, name: str) -> int:
        return {"chunked": self.chunked, "cache_hit": self.cache_hit_tokens, "preempted": self.preemptions}[name]

    def add(self, other: Counters) -> None:
        for f in ("steps", "tokens", "chunked", "cache_hit_tokens", "preemptions", "resumed", "seconds", "forward_seconds"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


@dataclass
class RunRecord:
    workload: str
    variant: str
    outputs: dict[str, tuple[int, ...]]
    status: dict[str, RequestStatus]
    logits: dict[tuple[str, int], torch.Tensor]
    counters: Counters
    fault_fired: list[str] = field(default_factory=list)


class StallError(RuntimeError):
    """The scheduler stopped making progress with requests left."""


def drive(
    scheduler: Scheduler,
    executor: Executor,
    workload: Workload,
    *,
    variant: str = "",
    max_steps: int = 20_000,
    check_tokens: bool = True,
) -> RunRecord:
    """Add requests when their step comes, abort on schedule, and run
    schedule -> execute -> update until every request has finished."""
    t0 = time.perf_counter()
    pending = sorted(workload.requests, key=lambda r: (workload.arrive_at[r.request_id], r.arrival))
    aborts = sorted(workload.aborts)
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in workload.requests}
    known: dict[str, list[int]] = {}
    done: dict[str, RequestView] = {}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    c = Counters()
    total = len(workload.requests)
    idle = 0

    def collect() -> None:
        for rid, rv in scheduler.view().finished.items():
            done.setdefault(rid, rv)

    step = 0
    while True:
        while pending and workload.arrive_at[pending[0].request_id] <= step:
            r = pending.pop(0)
            scheduler.add(r)
            known[r.request_id] = list(r.prompt_token_ids)
        while aborts and aborts[0][0] <= step:
            _, rid = aborts.pop(0)
            if rid in scheduler.view().requests:
                scheduler.abort(rid)
        collect()
        if len(done) == total and not pending:
            break
        if step >= max_steps:
            raise StallError(f"{workload.name}/{variant}: not finished after {max_steps} steps")
        plan = scheduler.schedule()
        c.steps += 1
        for s in plan.scheduled:
            if s.is_prefill_chunk:
                c.chunked += 1
            if s.kind != ScheduleKind.RUNNING and s.num_computed_tokens > 0:
                c.cache_hit_tokens += s.num_computed_tokens
            if s.kind == ScheduleKind.RESUMED:
                c.resumed += 1
        c.preemptions += len(plan.preempted_ids)
        out = executor.run(plan, known if check_tokens else None)
        c.tokens += out.num_tokens
        c.forward_seconds += out.seconds
        scheduler.update(plan, out.result)
        for s in plan.scheduled:
            toks = out.result.sampled.get(s.request_id)
            if toks:
                k = s.num_tokens - prompt_len[s.request_id]
                known[s.request_id].append(toks[0])
                if s.request_id in out.logits:
                    logits[(s.request_id, k)] = out.logits[s.request_id]
        collect()
        if plan.scheduled:
            idle = 0
        elif not pending:
            idle += 1
            if idle > 3:
                raise StallError(f"{workload.name}/{variant}: the scheduler schedules nothing with requests left")
        step += 1
    c.seconds = time.perf_counter() - t0
    return RunRecord(
        workload=workload.name,
        variant=variant,
        outputs={rid: tuple(rv.output_token_ids) for rid, rv in done.items()},
        status={rid: rv.status for rid, rv in done.items()},
        logits=logits,
        counters=c,
        fault_fired=list(executor.fault.fired) if executor.fault else [],
    )


def run_one(
    factory: SchedulerFactory,
    model: PagedLlama,
    config: SchedulerConfig,
    workload: Workload,
    *,
    variant: str = "",
    fault: Fault | None = None,
) -> RunRecord:
    executor = Executor(model, config, fault=fault)
    return drive(factory(config), executor, workload, variant=variant)


# --------------------------------------------------------------------------
# Comparing runs
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    request_id: str
    kind: str  # "tokens", "logits", "status", "missing"
    index: int
    detail: str

    def __str__(self) -> str:
        return f"{self.request_id} {self.kind}@{self.index}: {self.detail}"


@dataclass
class Comparison:
    workload: str
    variant: str
    mode: str
    divergences: list[Divergence] = field(default_factory=list)
    tokens_compared: int = 0
    logits_compared: int = 0
    logits_bitwise: int = 0
    max_abs_diff: float = 0.0
    counters: Counters = field(default_factory=Counters)

    @property
    def ok(self) -> bool:
        return not self.divergences


def compare_runs(base: RunRecord, other: RunRecord, *, mode: str = "exact", atol: float = 1e-3) -> Comparison:
    """Every request of ``base`` against ``other``: the same generated tokens
    and status; where either was aborted, the tokens both produced. Logits of
    each sampled token up to the first token difference: bitwise equal
    (exact mode) or within ``atol`` (fast mode)."""
    cmp = Comparison(base.workload, other.variant, mode, counters=other.counters)
    for rid in sorted(base.outputs):
        if rid not in other.outputs:
            cmp.divergences.append(Divergence(rid, "missing", 0, "never finished"))
            continue
        b, o = base.outputs[rid], other.outputs[rid]
        aborted = RequestStatus.FINISHED_ABORTED in (base.status[rid], other.status[rid])
        n = min(len(b), len(o))
        first = next((i for i in range(n) if b[i] != o[i]), None)
        cmp.tokens_compared += n if first is None else first
        if first is not None:
            cmp.divergences.append(Divergence(rid, "tokens", first, f"baseline {b[first]}, variant {o[first]}"))
        elif not aborted and (len(b) != len(o) or base.status[rid] != other.status[rid]):
            cmp.divergences.append(
                Divergence(
                    rid,
                    "status",
                    n,
                    f"baseline {len(b)} tokens {base.status[rid].value}, "
                    f"variant {len(o)} tokens {other.status[rid].value}",
                )
            )
        upto = n if first is None else first + 1
        for k in range(upto):
            lb, lo = base.logits.get((rid, k)), other.logits.get((rid, k))
            if lb is None or lo is None:
                continue
            cmp.logits_compared += 1
            if torch.equal(lb, lo):
                cmp.logits_bitwise += 1
                continue
            diff = float((lb - lo).abs().max())
            cmp.max_abs_diff = max(cmp.max_abs_diff, diff)
            if mode == "exact" or not diff <= atol:
                cmp.divergences.append(Divergence(rid, "logits", k, f"max |diff| {diff:.3g}"))
                break
    return cmp


# --------------------------------------------------------------------------
# The matrix
# --------------------------------------------------------------------------


@dataclass
class NegativeControl:
    fault: str
    workload: str
    variant: str
    fired: list[str]
    divergences: int
    first: str

    @property
    def caught(self) -> bool:
        return bool(self.fired) and self.divergences > 0


@dataclass
class MatrixReport:
    model: str
    device: str
    mode: str
    workloads: list[str]
    variants: list[Variant]
    comparisons: list[Comparison] = field(default_factory=list)
    baselines: dict[str, Counters] = field(default_factory=dict)
    guard_failures: list[str] = field(default_factory=list)
    negative: list[NegativeControl] = field(default_factory=list)
    seconds: float = 0.0
    workload_defs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def divergent(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.divergent and not self.guard_failures and all(n.caught for n in self.negative)

    def totals(self, variant: str) -> tuple[Counters, list[Comparison]]:
        rows = [c for c in self.comparisons if c.variant == variant]
        tot = Counters()
        for c in rows:
            tot.add(c.counters)
        return tot, rows

    def table(self) -> str:
        head = (
            f"{'variant':<18} {'pass':>7} {'tokens':>7} {'logits':>7} {'bitwise':>7} "
            f"{'max|dl|':>8} {'chunks':>6} {'hit tok':>7} {'preempt':>7} {'steps':>6} {'sec':>6}"
        )
        lines = [
            f"model {self.model} on {self.device}, mode {self.mode}: {len(self.workloads)} workloads x "
            f"{len(self.variants)} variants in {self.seconds:.1f} s",
            head,
            "-" * len(head),
        ]
        base = Counters()
        for c in self.baselines.values():
            base.add(c)
        lines.append(
            f"{'baseline':<18} {'-':>7} {'-':>7} {'-':>7} {'-':>7} {'-':>8} {base.chunked:>6} "
            f"{base.cache_hit_tokens:>7} {base.preemptions:>7} {base.steps:>6} {base.seconds:>6.1f}"
        )
        for v in self.variants:
            tot, rows = self.totals(v.name)
            passed = sum(1 for r in rows if r.ok)
            lines.append(
                f"{v.name:<18} {f'{passed}/{len(rows)}':>7} {sum(r.tokens_compared for r in rows):>7} "
                f"{sum(r.logits_compared for r in rows):>7} {sum(r.logits_bitwise for r in rows):>7} "
                f"{max((r.max_abs_diff for r in rows), default=0.0):>8.2g} {tot.chunked:>6} "
                f"{tot.cache_hit_tokens:>7} {tot.preemptions:>7} {tot.steps:>6} {tot.seconds:>6.1f}"
            )
        for bad in self.divergent:
            lines.append(f"DIVERGED {bad.workload}/{bad.variant}: " + "; ".join(str(d) for d in bad.divergences[:3]))
        for g in self.guard_failures:
            lines.append(f"GUARD {g}")
        for n in self.negative:
            verdict = "caught" if n.caught else "MISSED"
            lines.append(
                f"negative control {n.fault:<11} on {n.workload}/{n.variant}: {verdict} "
                f"({n.divergences} divergences; {n.first or 'none'})"
            )
        lines.append("EQUIVALENT" if self.ok else "NOT EQUIVALENT")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "mode": self.mode,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "workloads": self.workloads,
            "variants": [{"name": v.name, "config": v.config.to_dict(), "expects": sorted(v.expects)} for v in self.variants],
            "comparisons": [
                {
                    "workload": c.workload,
                    "variant": c.variant,
                    "ok": c.ok,
                    "tokens_compared": c.tokens_compared,
                    "logits_compared": c.logits_compared,
                    "logits_bitwise": c.logits_bitwise,
                    "max_abs_diff": c.max_abs_diff,
                    "chunked": c.counters.chunked,
                    "cache_hit_tokens": c.counters.cache_hit_tokens,
                    "preemptions": c.counters.preemptions,
                    "steps": c.counters.steps,
                    "divergences": [str(d) for d in c.divergences],
                }
                for c in self.comparisons
            ],
            "guard_failures": self.guard_failures,
            "negative_controls": [
                {"fault": n.fault, "workload": n.workload, "variant": n.variant, "caught": n.caught, "fired": n.fired, "divergences": n.divergences}
                for n in self.negative
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def png(self, path: str | Path, cell_w: int = 150, cell_h: int = 22) -> Path:
        """The matrix as a picture: a row per workload, a column per variant;
        green = the same tokens and bitwise logits, yellow = the same tokens,
        logits within tolerance, red = diverged. Three marks at a cell's
        right say what the run exercised: blue chunked, purple a cache hit,
        orange a preemption."""
        from schedspec.check.report import _png, _text

        label_w, head_h = 64, 28
        width = label_w + cell_w * len(self.variants) + 1
        height = head_h + cell_h * len(self.workloads) + 1
        white = (255, 255, 255)
        pixels = [[white] * width for _ in range(height)]

        def fill(x0: int, y0: int, w: int, h: int, color: tuple[int, int, int]) -> None:
            for y in range(max(y0, 0), min(y0 + h, height)):
                row = pixels[y]
                for x in range(max(x0, 0), min(x0 + w, width)):
                    row[x] = color

        for j, v in enumerate(self.variants):
            _text(pixels, label_w + j * cell_w + 4, 8, v.name[:17])
        by_key = {(c.workload, c.variant): c for c in self.comparisons}
        marks: tuple[tuple[str, tuple[int, int, int]], ...] = (
            ("chunked", (60, 110, 220)),
            ("cache_hit", (150, 70, 190)),
            ("preempted", (240, 140, 20)),
        )
        for i, wname in enumerate(self.workloads):
            y = head_h + i * cell_h
            _text(pixels, 4, y + 6, wname[:7])
            for j, v in enumerate(self.variants):
                x = label_w + j * cell_w
                c = by_key.get((wname, v.name))
                if c is None:
                    color = (220, 220, 220)
                elif not c.ok:
                    color = (220, 70, 60)
                elif c.logits_bitwise == c.logits_compared:
                    color = (90, 180, 90)
                else:
                    color = (230, 200, 70)
                fill(x, y, cell_w, cell_h, (60, 60, 60))
                fill(x + 1, y + 1, cell_w - 1, cell_h - 1, color)
                if c is not None:
                    for k, (feat, mark) in enumerate(marks):
                        if c.counters.feature(feat):
                            fill(x + cell_w - 3 * 9 + k * 9, y + 6, 7, cell_h - 12, mark)
        out = Path(path)
        out.write_bytes(_png(width, height, pixels))
        return out


def _fault_target(workload: Workload) -> str | None:
    """A request that is never aborted and generates at least two tokens, so
    that KV written in one step is read in a later one."""
    aborted = {rid for _, rid in workload.aborts}
    best = [r for r in workload.requests if r.request_id not in aborted and r.max_tokens >= 2]
    if not best:
        return None
    return max(best, key=lambda r: (r.max_tokens, len(r.prompt_token_ids))).request_id


def negative_control(
    factory: SchedulerFactory,
    model: PagedLlama,
    baseline: RunRecord,
    workload: Workload,
    variant: Variant,
    kind: FaultKind,
    *,
    mode: str = "exact",
    atol: float = 1e-3,
) -> NegativeControl:
    """Run ``variant`` with one deliberately wrong block table or position and
    count the divergences from ``baseline`` (they must not be zero)."""
    target = _fault_target(workload)
    fault = Fault(kind, step=0, request_id=target)
    try:
        rec = run_one(factory, model, variant.config, workload, variant=variant.name, fault=fault)
    except PlanError as exc:  # the corrupted table was refused outright: caught too
        return NegativeControl(kind, workload.name, variant.name, list(fault.fired), 1, f"executor refused: {exc}")
    cmp = compare_runs(baseline, rec, mode=mode, atol=atol)
    return NegativeControl(
        kind,
        workload.name,
        variant.name,
        rec.fault_fired,
        len(cmp.divergences),
        str(cmp.divergences[0]) if cmp.divergences else "",
    )


def run_matrix(
    factory: SchedulerFactory,
    model: PagedLlama,
    workloads: Sequence[Workload],
    variants: Sequence[Variant],
    *,
    baseline: SchedulerConfig,
    atol: float = 1e-3,
    negative: bool = True,
    progress: Progress | None = None,
    model_name: str = "",
) -> MatrixReport:
    """Run the baseline and every variant on every workload, compare, check
    the guards, and (``negative``) run the two negative controls."""
    t0 = time.perf_counter()
    report = MatrixReport(
        model=model_name or model.config.name,
        device=str(model.device),
        mode=model.mode,
        workloads=[w.name for w in workloads],
        variants=list(variants),
        workload_defs={w.name: w.to_dict() for w in workloads},
    )
    bases: dict[str, RunRecord] = {}
    for i, w in enumerate(workloads):
        base = run_one(factory, model, baseline, w, variant="baseline")
        bases[w.name] = base
        report.baselines[w.name] = base.counters
        line = [f"[{i + 1}/{len(workloads)}] {w.name}: baseline {base.counters.steps} steps"]
        for v in variants:
            rec = run_one(factory, model, v.config, w, variant=v.name)
            cmp = compare_runs(base, rec, mode=model.mode, atol=atol)
            report.comparisons.append(cmp)
            line.append(f"{v.name} {'ok' if cmp.ok else 'DIVERGED'}")
        if progress:
            progress(", ".join(line) + f" ({time.perf_counter() - t0:.1f} s)")
    base_tot = Counters()
    for c in report.baselines.values():
        base_tot.add(c)
    for feat in FEATURES:
        if base_tot.feature(feat):
            report.guard_failures.append(f"the baseline itself {feat} ({base_tot.feature(feat)}): it is not a clean baseline")
    for v in variants:
        tot, _ = report.totals(v.name)
        for feat in sorted(v.expects):
            if not tot.feature(feat):
                report.guard_failures.append(f"variant {v.name} never {feat.replace('_', ' ')} in {len(workloads)} workloads")
    if negative and workloads and variants:
        w = next((w for w in workloads if _fault_target(w) is not None), workloads[0])
        v = next((v for v in variants if "chunked" in v.expects), variants[0])
        kinds: tuple[FaultKind, ...] = ("block_table", "position")
        for kind in kinds:
            nc = negative_control(factory, model, bases[w.name], w, v, kind, mode=model.mode, atol=atol)
            report.negative.append(nc)
            if progress:
                progress(f"negative control {kind}: {'caught' if nc.caught else 'MISSED'}")
    report.seconds = time.perf_counter() - t0
    return report


def run_equivalence(
    factory: SchedulerFactory | None = None,
    *,
    model: str = "glassllm",
    device: str = "auto",
    mode: str = "exact",
    workloads: int = 16,
    seed: int = 0,
    max_model_len: int | None = None,
    block_size: int = 16,
    negative: bool = True,
    tile_rows: int = 16,
    atol: float = 1e-3,
    progress: Progress | None = None,
) -> MatrixReport:
    """Load ``model``, build workloads and variants, run the matrix."""
    from schedspec.gpu_runner.executor import pick_device
    from schedspec.gpu_runner.loaders import load_model

    dev = pick_device(device)
    weights = load_model(model, dev)
    mml = max_model_len or min(weights.config.max_position, 128)
    paged = PagedLlama(weights, mode=mode, tile_rows=tile_rows, window=mml)  # type: ignore[arg-type]
    wls = make_workloads(workloads, seed=seed, vocab_size=weights.config.vocab_size, max_model_len=mml, block_size=block_size)
    return run_matrix(
        factory or spec_factory,
        paged,
        wls,
        default_variants(mml, block_size),
        baseline=baseline_config(mml, block_size),
        atol=atol,
        negative=negative,
        progress=progress,
        model_name=model,
    )

