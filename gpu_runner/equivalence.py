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

The in-flight variants (``inflight_variants``) run the same workloads with
async scheduling (one plan in flight, its outputs as -1 placeholders the
executor fills) and with speculative decoding (drafts by prompt lookup,
verified greedily): they too must give every baseline token, and in exact
mode bitwise-equal logits; their guards count plans made with outputs in
flight and drafts accepted.
A negative control runs a variant with a deliberately wrong block table and
with wrong positions (``executor.Fault``) and must see a divergence.

Hybrid KV cache groups: with a model whose layers use a sliding window
(``PagedLlama(sliding_window=W)``), every configuration of the matrix, the
baseline's included, carries the model's ``kv_cache_groups`` (a
full-attention group, a sliding-window group); each layer reads its group's
table, the sliding-window layers only their last W positions. Their guards:
sliding-window blocks were freed (the null block appeared in a table) and
prefix hits happened across the groups. With chunked local attention
(``PagedLlama(chunked_local=C)``) the chunked-local layers read, through their
group's table, only the earlier positions of their own chunk of C, and the
guard asks for chunked-local blocks freed (nulled before the current chunk).
A hybrid matrix also checks each workload's baseline against a dense,
non-paged reference (``reference.py``: every request recomputed in one batch
with masks built from the attention rule), which sees a mask that is wrong in
baseline and variants alike; its negative controls are a chunked-local table
with a block of the current chunk nulled (the executor must refuse it) and
a chunk mask off by one (the reference must see it).

A Mamba layer (``PagedLlama(layer_pattern="FM")``, gpu_runner/attention_kinds.py,
``MambaState``) keeps one state per request in its group's state blocks.
vLLM's "align" mode forces prefix caching and chunked prefill, so the
baseline has both (``required_fields``; its chunks and hits are no guard
failure) and the variants the layout refuses (drafts, the connector) are
left out and named; the dense reference runs the recurrence over each whole
sequence, the guard asks that hits restored a state (``state_restored``)
and the ``state_checkpoint`` control restores the checkpoint one block
earlier.

The KV connector (``connector_variants``): the baseline run records every
request's K/V per layer and position (``executor.KVStore``); a connector
variant gives requests ``kv_external_tokens`` (aligned to blocks or not),
loaded synchronously or asynchronously, and asynchronous saves, and its
executor copies the stored K/V into the plan's ``kv_loads`` blocks instead of
computing them, as the check driver's KV worker (``KVWorker``) starts and
reports the loads. A negative control loads K/V shifted by one position and
must see a divergence.

Any object implementing ``spec.interface.Scheduler`` can be driven; pass a
factory ``Callable[[SchedulerConfig], Scheduler]``.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

import torch

from schedspec.spec.errors import ConfigError
from schedspec.spec.interface import (
    KVCacheGroup,
    Policy,
    RequestSpec,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerFactory,
)

from schedspec.check.deadline import Interrupted
from schedspec.check.driver import Runner
from schedspec.check.records import Failure
from schedspec.check.stats import FEATURES, Stats
from schedspec.check.workload import KV_REPORT_BOUND, AddRequest, Event, KVLoadDone, KVSaveDone, Workload, timed_events
from schedspec.gpu_runner.attention_kinds import attention_of, freed_report
from schedspec.gpu_runner.executor import Executor, Fault, FaultKind, KVStore, PlanError, model_kv_cache_groups
from schedspec.gpu_runner.model import PagedLlama, describe_facts, determinism_facts
from schedspec.gpu_runner.reference import reference_divergences

if TYPE_CHECKING:  # pragma: no cover - types only; matplotlib is imported when drawing
    from matplotlib.figure import Figure

    from schedspec.check.capabilities import Capabilities

Progress = Callable[[str], None]


def spec_factory(config: SchedulerConfig) -> Scheduler:
    """The reference scheduler (imported lazily)."""
    from schedspec.spec.scheduler import SpecScheduler

    return SpecScheduler(config)


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------


def workload_dict(workload: Workload) -> dict[str, Any]:
    """A workload as the report's JSON gives it: its requests and timetable."""
    return {
        "name": workload.name,
        "seed": workload.seed,
        "requests": [r.to_dict() for r in workload.requests],
        "arrive_at": workload.arrival_steps(),
        "aborts": [list(a) for a in workload.abort_steps()],
        "features": list(workload.features),
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
    """A seeded workload of 7 to 10 requests, its config the baseline's.

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
        config=baseline_config(max_model_len, block_size),
        events=timed_events(requests, arrive_at, aborts),
        seed=seed,
        name=name or f"w{seed}",
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
    #: the KV connector's requests (``connector_workload``): "" none, "sync",
    #: "async" or "mixed" loads
    kv: str = ""


#: Styles of a connector variant's loads (``connector_workload``).
KV_STYLES = ("sync", "async", "mixed")


def least_pool(config: SchedulerConfig) -> int:
    """The fewest blocks (the null block included) a config validates with:
    one request of max_model_len fits in every KV cache group at once (for
    the plain layout, 1 + its blocks)."""
    for n in range(2, config.num_blocks + 1):
        try:
            replace(config, num_blocks=n)
        except ConfigError:
            continue
        return n
    return config.num_blocks


def required_fields(groups: tuple[KVCacheGroup, ...]) -> dict[str, bool]:
    """The config switches the groups' kinds force on (``AttentionKind.requires``:
    a Mamba group needs prefix caching and chunked prefill)."""
    return {f: True for g in groups for f in attention_of(g.kind).requires}


def baseline_config(max_model_len: int, block_size: int = 16, max_num_seqs: int = 8,
                    groups: tuple[KVCacheGroup, ...] = ()) -> SchedulerConfig:
    """No chunking, no prefix caching (unless a group's kind requires them,
    ``required_fields``), a pool that holds every running request at
    max_model_len in every KV cache group (so no preemption)."""
    blocks_per_seq = -(-max_model_len // block_size)
    need = required_fields(groups)
    return SchedulerConfig(
        block_size=block_size,
        num_blocks=1 + max_num_seqs * blocks_per_seq * max(1, len(groups)),
        max_num_batched_tokens=max(8 * max_model_len, 1024),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=need.get("enable_chunked_prefill", False),
        enable_prefix_caching=need.get("enable_prefix_caching", False),
        kv_cache_groups=groups,
    )


#: The features a baseline may show when its config turns on what causes them
#: (a layout that requires chunked prefill or prefix caching).
BASELINE_SWITCHES = {"chunked": "enable_chunked_prefill", "cache_hit": "enable_prefix_caching"}


Refused = list[tuple[str, str]]


def _fitting(variants: Sequence[tuple[str, Callable[[], SchedulerConfig], frozenset[str], str]],
             groups: tuple[KVCacheGroup, ...], refused: Refused | None) -> tuple[Variant, ...]:
    """The variants whose config validates with ``groups`` (a variant
    refused, e.g. drafts with a Mamba group, is left out and, with
    ``refused``, named there with the config's reason), their expectations
    widened for the groups (``_hybrid_expects``)."""
    out: list[Variant] = []
    for name, build, expects, kv in variants:
        try:
            config = build()
        except ConfigError as exc:
            if refused is not None:
                refused.append((name, f"the layout refuses it: {exc}"))
            continue
        out.append(Variant(name, config, _hybrid_expects(set(expects), groups), kv=kv))
    return tuple(out)


def _tiny(config: SchedulerConfig) -> SchedulerConfig:
    """``config`` with the least pool it validates with (preemption)."""
    return replace(config, num_blocks=least_pool(config))


def _hybrid_expects(expects: set[str], groups: tuple[KVCacheGroup, ...]) -> frozenset[str]:
    """A hybrid variant must also free sliding-window blocks and
    chunked-local blocks (those groups it has), and hit the prefix cache
    across the groups where it must hit it at all."""
    out = set(expects)
    kinds = [attention_of(g.kind) for g in groups]  # gpu_runner/attention_kinds.py
    hits = bool(out & {"cache_hit", "local_hit"})
    # a state group's feature is a restore: only where the variant must hit
    out.update(k.freed_feature for k in kinds if k.freed_feature and (hits or not k.keeps_state))
    if any(k.local for k in kinds) and hits:
        out.add("hybrid_hit")
    return frozenset(out)


def default_variants(max_model_len: int, block_size: int = 16, max_num_seqs: int = 8,
                     groups: tuple[KVCacheGroup, ...] = (), refused: Refused | None = None) -> tuple[Variant, ...]:
    """Chunked prefill (a small budget, a long-prefill threshold), prefix
    caching, a tiny pool (preemption), all of them under FCFS and PRIORITY.
    ``refused``: where the variants the layout refuses are named."""
    base = baseline_config(max_model_len, block_size, max_num_seqs, groups)
    small = max(max_num_seqs, 2 * block_size)
    chunk = frozenset({"chunked"})
    return _fitting((
        ("chunked-budget",
         lambda: replace(base, enable_chunked_prefill=True, max_num_batched_tokens=max(max_num_seqs, block_size)),
         chunk, ""),
        ("chunked-threshold",
         lambda: replace(base, enable_chunked_prefill=True, max_num_batched_tokens=3 * block_size,
                         long_prefill_token_threshold=min(12, max_model_len)),
         chunk, ""),
        ("prefix-cache", lambda: replace(base, enable_prefix_caching=True), frozenset({"cache_hit"}), ""),
        ("tiny-pool", lambda: _tiny(base), frozenset({"preempted"}), ""),
        ("all-fcfs",
         lambda: _tiny(replace(base, enable_chunked_prefill=True, enable_prefix_caching=True,
                               max_num_batched_tokens=small,
                               long_prefill_token_threshold=min(block_size, max_model_len))),
         frozenset(FEATURES), ""),
        ("all-priority",
         lambda: _tiny(replace(base, enable_chunked_prefill=True, enable_prefix_caching=True,
                               max_num_batched_tokens=small,
                               long_prefill_token_threshold=min(block_size, max_model_len), policy=Policy.PRIORITY)),
         frozenset(FEATURES), ""),
    ), groups, refused)


#: What an in-flight variant must exercise: plans made while an output of the
#: request was in flight, drafts accepted.
INFLIGHT_FEATURES = ("in_flight", "drafts_accepted")
#: What a hybrid variant must exercise: entries whose sliding-window table
#: held the null block (freed blocks), the same for a chunked-local table,
#: new entries with a prefix hit in a hybrid layout (a hit valid in every
#: group), entries that restored a Mamba state from a hit.
HYBRID_FEATURES = ("sw_freed", "cl_freed", "hybrid_hit", "state_restored")
#: What a connector variant must exercise: tokens loaded from the store,
#: asynchronous loads reported, asynchronous saves reported, and (where it
#: caches prefixes) admissions with a prefix-cache hit beyond what the
#: connector loaded (Stats' hit tokens count the connector's tokens too).
KV_FEATURES = ("kv_loaded", "kv_async_loaded", "kv_saved", "local_hit")
#: The features the executor and the KV worker count (RunRecord.inflight).
EXECUTOR_FEATURES = INFLIGHT_FEATURES + HYBRID_FEATURES + KV_FEATURES


def inflight_variants(
    max_model_len: int, block_size: int = 16, max_num_seqs: int = 8, num_speculative_tokens: int = 3,
    groups: tuple[KVCacheGroup, ...] = (), refused: Refused | None = None,
) -> tuple[Variant, ...]:
    """Async scheduling, speculative decoding (k drafts by prompt lookup), both,
    and both with chunking, prefix caching and a tiny pool; where the layout
    refuses drafts (a Mamba group), async scheduling with chunking, prefix
    caching and a tiny pool instead of the last."""
    base = baseline_config(max_model_len, block_size, max_num_seqs, groups)
    k = num_speculative_tokens
    everything: dict[str, Any] = dict(enable_chunked_prefill=True, enable_prefix_caching=True,
                      max_num_batched_tokens=max(max_num_seqs, 2 * block_size),
                      long_prefill_token_threshold=min(block_size, max_model_len))
    variants = _fitting((
        ("async", lambda: replace(base, async_scheduling=True), frozenset({"in_flight"}), ""),
        ("spec-decode", lambda: replace(base, num_speculative_tokens=k), frozenset({"drafts_accepted"}), ""),
        ("async-spec", lambda: replace(base, async_scheduling=True, num_speculative_tokens=k),
         frozenset({"in_flight", "drafts_accepted"}), ""),
        ("async-spec-all",
         lambda: _tiny(replace(base, async_scheduling=True, num_speculative_tokens=k, **everything)),
         frozenset({"in_flight", "drafts_accepted", "chunked", "preempted"}), ""),
    ), groups, refused)
    if any(v.name == "async-spec-all" for v in variants):
        return variants
    return variants + _fitting((
        ("async-all", lambda: _tiny(replace(base, async_scheduling=True, **everything)),
         frozenset({"in_flight", "chunked", "preempted"}), ""),
    ), groups, refused)


def connector_variants(
    max_model_len: int, block_size: int = 16, max_num_seqs: int = 8, num_speculative_tokens: int = 3,
    groups: tuple[KVCacheGroup, ...] = (), refused: Refused | None = None,
) -> tuple[Variant, ...]:
    """The KV connector (``config.kv_connector``) on ``connector_workload``s:
    synchronous loads only, asynchronous loads only, both mixed with chunked
    prefill, prefix caching and a tiny pool, and both mixed under async
    scheduling with speculative decoding. Every one has asynchronous saves."""
    plain = baseline_config(max_model_len, block_size, max_num_seqs, groups)
    k = num_speculative_tokens

    def base() -> SchedulerConfig:
        return replace(plain, kv_connector=True)

    return _fitting((
        ("kv-sync", base, frozenset({"kv_loaded", "kv_saved"}), "sync"),
        ("kv-async", base, frozenset({"kv_loaded", "kv_async_loaded", "kv_saved"}), "async"),
        ("kv-all",
         lambda: _tiny(replace(base(), enable_chunked_prefill=True, enable_prefix_caching=True,
                               max_num_batched_tokens=max(max_num_seqs, 2 * block_size),
                               long_prefill_token_threshold=min(block_size, max_model_len))),
         frozenset({"kv_loaded", "kv_async_loaded", "kv_saved", "chunked", "local_hit", "preempted"}), "mixed"),
        ("kv-async-spec", lambda: replace(base(), async_scheduling=True, num_speculative_tokens=k),
         frozenset({"kv_loaded", "kv_async_loaded", "kv_saved", "in_flight"}), "mixed"),
    ), groups, refused)


def connector_workload(workload: Workload, style: str, block_size: int = 16) -> Workload:
    """``workload`` for a connector variant (seeded by the workload's seed and
    ``style``): about three requests in four get ``kv_external_tokens`` (the
    store holds their prompt: the baseline run's K/V), half of them a whole
    number of blocks, the others any count below the prompt's length; loads
    are synchronous (``sync``), asynchronous (``async``) or either
    (``mixed``); about two in five ask for an asynchronous save. Some
    asynchronous loads and saves are reported by a KVLoadDone / KVSaveDone
    posted right after the request's arrival (the worker delivers it in the
    first result where it is meaningful), the others at the bounded wait."""
    if style not in KV_STYLES:
        raise ValueError(f"kv style must be one of {', '.join(KV_STYLES)}, got {style!r}")
    rng = random.Random(f"kv-{workload.seed}-{workload.name}-{style}")
    events: list[Event] = []
    for e in workload.events:
        if not isinstance(e, AddRequest):
            events.append(e)
            continue
        r = e.request
        plen = len(r.prompt_token_ids)
        ext = 0
        if plen >= 2 and rng.random() < 0.75:
            blocks = (plen - 1) // block_size
            if blocks and rng.random() < 0.5:
                ext = rng.randint(1, blocks) * block_size
            else:
                ext = rng.randint(1, plen - 1)
        load_async = ext > 0 and (style == "async" or style == "mixed" and rng.random() < 0.5)
        save = rng.random() < 0.4
        events.append(AddRequest(replace(r, kv_external_tokens=ext, kv_load_async=load_async, kv_save_async=save)))
        if load_async and rng.random() < 0.6:
            events.append(KVLoadDone(r.request_id))
        if save and rng.random() < 0.5:
            events.append(KVSaveDone(r.request_id))
    return replace(workload, events=tuple(events), features=tuple(sorted({*workload.features, f"kv-{style}"})))


def variant_workload(workload: Workload, variant: Variant) -> Workload:
    """The workload a variant runs: the connector's for a connector variant."""
    if not variant.kv:
        return workload
    return connector_workload(workload, variant.kv, variant.config.block_size)


# --------------------------------------------------------------------------
# Driving one scheduler over one workload
# --------------------------------------------------------------------------


@dataclass
class RunRecord:
    workload: str
    variant: str
    outputs: dict[str, tuple[int, ...]]
    status: dict[str, RequestStatus]
    logits: dict[tuple[str, int], torch.Tensor]
    counters: Stats
    fault_fired: list[str] = field(default_factory=list)
    #: the in-flight features it exercised (INFLIGHT_FEATURES)
    inflight: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_generated(self) -> int:
        return sum(len(o) for o in self.outputs.values())

    def digest(self) -> str:
        """sha256 of every request's tokens and status and every sampled
        logits row's bytes: equal digests, identical runs."""
        h = hashlib.sha256()
        for rid in sorted(self.outputs):
            h.update(f"{rid}:{self.status[rid].value}:{','.join(map(str, self.outputs[rid]))};".encode())
        for key in sorted(self.logits):
            h.update(f"{key[0]}@{key[1]}".encode())
            h.update(self.logits[key].contiguous().numpy().tobytes())
        return h.hexdigest()


class StallError(RuntimeError):
    """The scheduler stopped making progress with requests left."""


class HangError(RuntimeError):
    """A call into the scheduler ran past its deadline (check/deadline.py):
    the message names the workload, the variant, the method and the step."""


def raise_run_failure(failure: Failure, where: str) -> NoReturn:
    """Raise what a failed run of the matrix means: a stall (StallError) or a
    hang (HangError) named by ``where``, the scheduler's own exception, or a
    RuntimeError with the failure's description."""
    if failure.kind == "stall":
        raise StallError(f"{where}: {failure.message}")
    if failure.kind == "timeout":
        raise HangError(f"{where}: {failure.describe()}")
    if failure.exception is not None:
        raise failure.exception
    raise RuntimeError(failure.describe())


def drive(
    scheduler: SchedulerFactory,
    executor: Executor,
    workload: Workload,
    *,
    variant: str = "",
    max_steps: int = 20_000,
) -> RunRecord:
    """Build the scheduler for the executor's config and run the workload
    through the check driver (schedule -> execute -> update, arrivals and
    aborts on their steps) until every request has finished."""
    t0 = time.perf_counter()
    runner = Runner(executor.config, {variant or "scheduler": scheduler}, check_invariants=False,
                    compare_views=False, models={variant or "scheduler": executor})
    for worker in runner.workers.values():
        # the KV connector's worker writes loaded KV through its model's
        # load_kv: here the executor's, which copies it from the KV store
        setattr(worker, "model", executor)
    # the driver allows one bounded wait of idle steps with a connector; a
    # save holding the pool's blocks (reported at the bound) and then an
    # asynchronous load of the request it let in (again at the bound) idle
    # for two in a row
    idle = 3 + 2 * (KV_REPORT_BOUND + 1) if runner.workers else 3
    failure = runner.run_to_completion(workload.events, max_steps=max_steps, max_idle_steps=idle)
    if failure is None and runner.workers:
        failure = runner.quiesce()  # the pending saves reported, every block back
    if failure is not None:
        raise_run_failure(failure, f"{workload.name}/{variant}")
    stats = runner.stats
    stats.seconds = time.perf_counter() - t0
    stats.forward_seconds = executor.seconds
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in workload.requests}
    done = runner.finished
    return RunRecord(
        workload=workload.name,
        variant=variant,
        outputs={rid: tuple(rv.output_token_ids) for rid, rv in done.items()},
        status={rid: rv.status for rid, rv in done.items()},
        logits={(rid, pos - prompt_len[rid]): row for (rid, pos), row in executor.logits.items()},
        counters=stats,
        fault_fired=list(executor.fault.fired) if executor.fault else [],
        inflight={"in_flight": executor.in_flight_entries, "drafts_accepted": executor.drafts_accepted,
                  "drafts_verified": executor.drafts_verified,
                  "sw_freed": executor.null_block_entries, "cl_freed": executor.cl_null_entries,
                  "hybrid_hit": executor.hybrid_hit_entries,
                  "state_restored": executor.state_restores,
                  "local_hit": executor.local_hit_entries,
                  "kv_loaded": executor.kv_loaded_tokens, "kv_loads": executor.kv_loads,
                  "kv_async_loaded": stats.kv_loads_async, "kv_saved": stats.kv_saves,
                  "kv_timeouts": stats.kv_timeouts},
    )


def run_one(
    factory: SchedulerFactory,
    model: PagedLlama,
    config: SchedulerConfig,
    workload: Workload,
    *,
    variant: str = "",
    fault: Fault | None = None,
    kv_record: KVStore | None = None,
    kv_source: KVStore | None = None,
) -> RunRecord:
    """One run of ``workload`` under ``config``. ``kv_record``: the KV store
    this run fills (the baseline's, for connector variants); ``kv_source``:
    the store a connector variant loads from."""
    executor = Executor(model, config, fault=fault, kv_record=kv_record, kv_source=kv_source)
    return drive(factory, executor, workload, variant=variant)


# --------------------------------------------------------------------------
# Comparing runs
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    request_id: str
    kind: str  # "tokens", "logits", "status", "missing", "plan", "stall"
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
    counters: Stats = field(default_factory=Stats)
    #: the variant's in-flight counts (RunRecord.inflight)
    inflight: dict[str, int] = field(default_factory=dict)
    #: tokens the variant generated (all requests), and its run's digest (RunRecord.digest)
    tokens_generated: int = 0
    digest: str = ""

    @property
    def ok(self) -> bool:
        return not self.divergences


def compare_runs(base: RunRecord, other: RunRecord, *, mode: str = "exact", atol: float = 1e-3) -> Comparison:
    """Every request of ``base`` against ``other``: the same generated tokens
    and status; where either was aborted, the tokens both produced. Logits of
    each sampled token up to the first token difference: bitwise equal
    (exact mode) or within ``atol`` (fast mode)."""
    cmp = Comparison(base.workload, other.variant, mode, counters=other.counters, inflight=dict(other.inflight),
                     tokens_generated=other.tokens_generated, digest=other.digest())
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


def check_reference(model: PagedLlama, baseline: RunRecord, workload: Workload, *, atol: float = 1e-3) -> Comparison:
    """A run (the baseline's) against the dense, non-paged reference
    (``reference.reference_divergences``): every generated token the
    reference's argmax at its position, every sampled logits row bitwise the
    reference's (exact mode; fast mode: within ``atol``)."""
    prompts = {r.request_id: r.prompt_token_ids for r in workload.requests}
    found, toks, rows, bitwise, worst = reference_divergences(model, prompts, baseline.outputs, baseline.logits,
                                                              atol=atol)
    return Comparison(workload.name, "reference", model.mode, divergences=[Divergence(*d) for d in found],
                      tokens_compared=toks, logits_compared=rows, logits_bitwise=bitwise, max_abs_diff=worst,
                      counters=baseline.counters, tokens_generated=baseline.tokens_generated)


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
    baselines: dict[str, Stats] = field(default_factory=dict)
    guard_failures: list[str] = field(default_factory=list)
    negative: list[NegativeControl] = field(default_factory=list)
    seconds: float = 0.0
    workload_defs: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: workload -> request id -> the baseline's generated tokens
    baseline_outputs: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    #: workload -> the baseline run's digest (RunRecord.digest)
    baseline_digests: dict[str, str] = field(default_factory=dict)
    #: torch, CUDA, the device's name and the determinism settings in force (model.determinism_facts)
    environment: dict[str, Any] = field(default_factory=dict)
    #: how many times the whole matrix ran (merge_repeats), each run's (steps/s, tok/s) per variant
    repeats: int = 1
    repeat_rates: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    #: a repeat whose tokens or logits differ from the first run's, or that failed itself
    repeat_failures: list[str] = field(default_factory=list)
    #: each workload's baseline against the dense, non-paged reference (``check_reference``)
    reference: list[Comparison] = field(default_factory=list)
    #: (variant, why) of the variants the scheduler's capabilities left out (``fit_variants``)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: (variant, why) of the variants the layout's KV cache groups refuse (a Mamba group: drafts, the connector)
    refused: list[tuple[str, str]] = field(default_factory=list)
    #: the baseline and variants run with async scheduling on, for a scheduler
    #: that schedules only asynchronously (``fit_variants``)
    made_async: list[str] = field(default_factory=list)
    #: the signal (SIGINT, SIGTERM) that cut the run short; "" for a whole run.
    #: An interrupted report holds the workloads run whole, no guard or negative control
    interrupted: str = ""

    @property
    def divergent(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.ok]

    @property
    def ok(self) -> bool:
        return (not self.interrupted and not self.divergent and not self.guard_failures
                and all(n.caught for n in self.negative) and not self.repeat_failures
                and all(r.ok for r in self.reference))

    def baseline_tokens(self) -> int:
        return sum(len(t) for outs in self.baseline_outputs.values() for t in outs.values())

    def totals_of(self, variant: str) -> tuple[int, int, float, float]:
        """(steps, tokens generated, seconds, forward seconds) of one variant's
        runs (``baseline`` included) over every workload."""
        if variant == "baseline":
            base = Stats()
            for st in self.baselines.values():
                base.merge(st)
            return base.steps, self.baseline_tokens(), base.seconds, base.forward_seconds
        tot, rows = self.totals(variant)
        return tot.steps, sum(r.tokens_generated for r in rows), tot.seconds, tot.forward_seconds

    def rates(self, variant: str) -> tuple[float, float]:
        """(steps/s, tok/s): generated tokens per wall second of the variant's
        runs; with repeats, the median over them."""
        if self.repeat_rates.get(variant):
            runs = self.repeat_rates[variant]
            return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        steps, toks, sec, _ = self.totals_of(variant)
        return (steps / sec if sec > 0 else 0.0, toks / sec if sec > 0 else 0.0)

    def totals(self, variant: str) -> tuple[Stats, list[Comparison]]:
        rows = [c for c in self.comparisons if c.variant == variant]
        tot = Stats()
        for c in rows:
            tot.merge(c.counters)
        return tot, rows

    def table(self) -> str:
        head = (
            f"{'variant':<18} {'pass':>7} {'tokens':>7} {'logits':>7} {'bitwise':>7} "
            f"{'max|dl|':>8} {'chunks':>6} {'hit tok':>7} {'preempt':>7} {'steps':>6} {'sec':>6} "
            f"{'steps/s':>8} {'tok/s':>8}"
        )
        lines = [
            f"model {self.model} on {self.device}, mode {self.mode}: {len(self.workloads)} workloads x "
            f"{len(self.variants)} variants in {self.seconds:.1f} s"
            + (f" ({self.repeats} repeats; rates are medians)" if self.repeats > 1 else ""),
        ]
        if self.environment:
            lines.append(f"environment: {describe_facts(self.environment)}")
        lines += [head, "-" * len(head)]
        base = Stats()
        for c in self.baselines.values():
            base.merge(c)
        sps, tps = self.rates("baseline")
        lines.append(
            f"{'baseline':<18} {'-':>7} {'-':>7} {'-':>7} {'-':>7} {'-':>8} {base.chunks:>6} "
            f"{base.hit_tokens:>7} {base.preemptions:>7} {base.steps:>6} {base.seconds:>6.1f} {sps:>8.1f} {tps:>8.1f}"
        )
        for v in self.variants:
            tot, rows = self.totals(v.name)
            passed = sum(1 for r in rows if r.ok)
            sps, tps = self.rates(v.name)
            lines.append(
                f"{v.name:<18} {f'{passed}/{len(rows)}':>7} {sum(r.tokens_compared for r in rows):>7} "
                f"{sum(r.logits_compared for r in rows):>7} {sum(r.logits_bitwise for r in rows):>7} "
                f"{max((r.max_abs_diff for r in rows), default=0.0):>8.2g} {tot.chunks:>6} "
                f"{tot.hit_tokens:>7} {tot.preemptions:>7} {tot.steps:>6} {tot.seconds:>6.1f} {sps:>8.1f} {tps:>8.1f}"
            )
        for v in self.variants:
            _, rows = self.totals(v.name)
            counts = {k: sum(r.inflight.get(k, 0) for r in rows) for k in ("in_flight", "drafts_accepted", "drafts_verified")}
            if any(counts.values()):
                lines.append(
                    f"{v.name:<18} {counts['in_flight']} entries planned with an output in flight, "
                    f"{counts['drafts_accepted']} of {counts['drafts_verified']} drafts accepted"
                )
        for v in self.variants:
            _, rows = self.totals(v.name)
            hyb = {k: sum(r.inflight.get(k, 0) for r in rows) for k in HYBRID_FEATURES}
            kinds = {g.kind for g in v.config.groups}
            if v.config.is_hybrid:
                freed = freed_report(kinds, hyb)
                lines.append(f"{v.name:<18} {freed}, {hyb['hybrid_hit']} admissions hit the prefix cache in every group")
        for v in self.variants:
            _, rows = self.totals(v.name)
            kv = {k: sum(r.inflight.get(k, 0) for r in rows)
                  for k in ("kv_loads", "kv_loaded", "kv_async_loaded", "kv_saved", "kv_timeouts")}
            if v.kv:
                lines.append(
                    f"{v.name:<18} {kv['kv_loads']} loads ({kv['kv_async_loaded']} asynchronous) copied "
                    f"{kv['kv_loaded']} tokens' K/V from the store, {kv['kv_saved']} saves reported, "
                    f"{kv['kv_timeouts']} reports at the bounded wait"
                )
        if self.reference:
            ref = self.reference
            lines.append(
                f"{'reference':<18} {sum(r.ok for r in ref)}/{len(ref)} baselines equal the dense, non-paged reference: "
                f"{sum(r.tokens_compared for r in ref)} tokens its argmax, {sum(r.logits_bitwise for r in ref)} of "
                f"{sum(r.logits_compared for r in ref)} logits rows bitwise"
                + (f" (max |diff| {max(r.max_abs_diff for r in ref):.2g})" if self.mode != "exact" else "")
            )
        for bad in self.divergent + [r for r in self.reference if not r.ok]:
            lines.append(f"DIVERGED {bad.workload}/{bad.variant}: " + "; ".join(str(d) for d in bad.divergences[:3]))
        for g in self.guard_failures:
            lines.append(f"GUARD {g}")
        for r in self.repeat_failures:
            lines.append(f"REPEAT {r}")
        for n in self.negative:
            verdict = "caught" if n.caught else "MISSED"
            lines.append(
                f"negative control {n.fault:<11} on {n.workload}/{n.variant}: {verdict} "
                f"({n.divergences} divergences; {n.first or 'none'})"
            )
        if self.made_async:
            lines.append("run with async scheduling on (the scheduler schedules only asynchronously): "
                         + ", ".join(self.made_async))
        if self.skipped:
            lines.append("skipped, unsupported by the scheduler: "
                         + "; ".join(f"{name} ({why})" for name, why in self.skipped))
        if self.refused:
            lines.append("left out, refused with the layout's KV cache groups: " + ", ".join(n for n, _ in self.refused))
        if self.interrupted:
            lines.append(f"INTERRUPTED ({self.interrupted}) after {len(self.baselines)} whole workload(s): "
                         f"{len(self.divergent)} divergent so far; no guard or negative control ran")
        else:
            lines.append("EQUIVALENT" if self.ok else "NOT EQUIVALENT")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "mode": self.mode,
            "ok": self.ok,
            "interrupted": self.interrupted or None,
            "seconds": round(self.seconds, 3),
            "workloads": self.workloads,
            "variants": [{"name": v.name, "config": v.config.to_dict(), "expects": sorted(v.expects), "kv": v.kv}
                         for v in self.variants],
            "skipped": [{"variant": name, "why": why} for name, why in self.skipped],
            "refused": [{"variant": name, "why": why} for name, why in self.refused],
            "made_async": self.made_async,
            "comparisons": [
                {
                    "workload": c.workload,
                    "variant": c.variant,
                    "ok": c.ok,
                    "tokens_compared": c.tokens_compared,
                    "logits_compared": c.logits_compared,
                    "logits_bitwise": c.logits_bitwise,
                    "max_abs_diff": c.max_abs_diff,
                    "chunked": c.counters.chunks,
                    "cache_hit_tokens": c.counters.hit_tokens,
                    "preemptions": c.counters.preemptions,
                    "steps": c.counters.steps,
                    "tokens_generated": c.tokens_generated,
                    "seconds": round(c.counters.seconds, 4),
                    "forward_seconds": round(c.counters.forward_seconds, 4),
                    "digest": c.digest,
                    **c.inflight,
                    "divergences": [str(d) for d in c.divergences],
                }
                for c in self.comparisons
            ],
            "baselines": {
                w: {
                    "steps": st.steps,
                    "tokens_generated": sum(len(t) for t in self.baseline_outputs.get(w, {}).values()),
                    "seconds": round(st.seconds, 4),
                    "forward_seconds": round(st.forward_seconds, 4),
                    "digest": self.baseline_digests.get(w, ""),
                }
                for w, st in self.baselines.items()
            },
            "baseline_outputs": self.baseline_outputs,
            "environment": self.environment,
            "repeats": self.repeats,
            "rates": {
                name: dict(zip(("steps", "tokens_generated", "seconds", "forward_seconds"), self.totals_of(name)))
                | {"steps_per_s": self.rates(name)[0], "tok_per_s": self.rates(name)[1],
                   "per_repeat": [list(r) for r in self.repeat_rates.get(name, [])]}
                for name in ["baseline", *(v.name for v in self.variants)]
            },
            "repeat_failures": self.repeat_failures,
            "reference": [
                {"workload": r.workload, "ok": r.ok, "tokens_compared": r.tokens_compared,
                 "logits_compared": r.logits_compared, "logits_bitwise": r.logits_bitwise,
                 "max_abs_diff": r.max_abs_diff, "divergences": [str(d) for d in r.divergences]}
                for r in self.reference
            ],
            "guard_failures": self.guard_failures,
            "negative_controls": [
                {"fault": n.fault, "workload": n.workload, "variant": n.variant, "caught": n.caught, "fired": n.fired, "divergences": n.divergences}
                for n in self.negative
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def figure(self) -> Figure:
        """The matrix as a matplotlib Figure: see :func:`matrix_figure`."""
        return matrix_figure(self)

    def png(self, path: str | Path) -> Path:
        """Write :meth:`figure` as a PNG. Raises ``PlotUnavailable`` (and
        writes nothing) without matplotlib (the ``plots`` extra)."""
        out = Path(path)
        self.figure().savefig(out, format="png", dpi=110)
        return out


#: Outcome of one cell of the matrix -> (legend label, colour), in colour-scale order.
MATRIX_OUTCOMES: tuple[tuple[str, str], ...] = (
    ("not run", "#dddddd"),
    ("diverged", "#dc463c"),
    ("same tokens, logits within tolerance", "#e6c846"),
    ("same tokens, bitwise-equal logits", "#5ab45a"),
)
#: Feature letters written in a cell: what the variant's run exercised there.
MATRIX_FEATURES: tuple[tuple[str, str, str], ...] = (
    ("chunked", "C", "chunked prefill"),
    ("local_hit", "H", "prefix-cache hit"),
    ("preempted", "P", "preempted"),
    ("sw_freed", "W", "sliding-window blocks freed"),
    ("cl_freed", "K", "chunked-local blocks freed"),
    ("kv_loaded", "L", "KV loaded by the connector"),
)
MATRIX_LEGEND = (
    "a row per workload, a column per variant; green: same tokens, bitwise logits; yellow: same tokens, "
    "logits within --atol; red: diverged; grey: not run; in a cell: tokens compared, then C chunked prefill, "
    "H prefix-cache hit, P preempted, W sliding-window blocks freed, K chunked-local blocks freed, "
    "L KV loaded by the connector"
)


def _cell(c: Comparison | None) -> tuple[int, str]:
    """A cell's outcome (an index into MATRIX_OUTCOMES) and its text."""
    if c is None:
        return 0, "-"
    if not c.ok:
        code, head = 1, f"DIVERGED ({len(c.divergences)})"
    elif c.logits_bitwise == c.logits_compared:
        code, head = 3, f"{c.tokens_compared} tok"
    else:
        code, head = 2, f"{c.tokens_compared} tok, |d|<={c.max_abs_diff:.0e}"
    feats = " ".join(letter for name, letter, _ in MATRIX_FEATURES
                     if (c.inflight.get(name, 0) if name in EXECUTOR_FEATURES else c.counters.feature(name)))
    return code, head + ("\n" + feats if feats else "")


def matrix_figure(report: MatrixReport) -> Figure:
    """The matrix as a labelled heatmap: a row per workload, a column per
    variant, each cell coloured by its outcome (bitwise equal, within
    tolerance, diverged, not run) and labelled with the tokens compared and
    the features its run exercised. matplotlib is imported here, on Agg."""
    from schedspec.check.report import new_figure, require_matplotlib

    require_matplotlib()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    by_key = {(c.workload, c.variant): c for c in report.comparisons}
    rows, cols = max(len(report.workloads), 1), max(len(report.variants), 1)
    cells = [[_cell(by_key.get((w, v.name))) for v in report.variants] for w in report.workloads]
    fig = new_figure(min(max(6.0, 2.2 + 1.45 * cols), 22.0), min(max(3.0, 1.9 + 0.42 * rows), 30.0))
    ax = fig.subplots()
    cmap = ListedColormap([colour for _, colour in MATRIX_OUTCOMES])
    norm = BoundaryNorm([i - 0.5 for i in range(len(MATRIX_OUTCOMES) + 1)], cmap.N)
    values = [[code for code, _ in row] for row in cells] or [[0]]
    ax.pcolormesh(
        [x - 0.5 for x in range(len(values[0]) + 1)], [y - 0.5 for y in range(len(values) + 1)],
        values, cmap=cmap, norm=norm, edgecolors="white", linewidth=1.5,
    )
    for y, row in enumerate(cells):
        for x, (code, text) in enumerate(row):
            ax.text(x, y, text, ha="center", va="center", fontsize=7,
                    color="white" if code == 1 else "#202020", fontweight="bold" if code == 1 else "normal")
    ax.set_ylim(len(values) - 0.5, -0.5)
    ax.set_xticks(range(len(report.variants)), [v.name for v in report.variants], rotation=25, ha="right", fontsize=8)
    ax.set_yticks(range(len(report.workloads)), report.workloads, fontsize=8)
    ax.set_xlabel("variant")
    ax.set_ylabel("workload")
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.tick_params(length=0)
    handles = [Patch(facecolor=colour, edgecolor="#999999", label=label) for label, colour in MATRIX_OUTCOMES]
    handles += [
        Patch(facecolor="none", edgecolor="none", label=f"{letter}: {words}") for _, letter, words in MATRIX_FEATURES
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=7, frameon=False)
    verdict = "EQUIVALENT" if report.ok else "NOT EQUIVALENT"
    fig.suptitle(
        f"equivalence matrix: {report.model} on {report.device}, {report.mode} mode: {verdict}",
        fontsize=10, x=0.01, ha="left",
    )
    return fig


def _fault_target(workload: Workload) -> str | None:
    """A request that is never aborted and generates at least two tokens, so
    that KV written in one step is read in a later one."""
    aborted = {rid for _, rid in workload.abort_steps()}
    best = [r for r in workload.requests if r.request_id not in aborted and r.max_tokens >= 2]
    if not best:
        return None
    return max(best, key=lambda r: (r.max_tokens, len(r.prompt_token_ids))).request_id


def _chunk_size(model: PagedLlama) -> int:
    """The model's chunked-local chunk (0: it has no chunked-local layer)."""
    return next((a.size for a in model.group_attn if a.rule.chunked), 0)


def _chunk_target(workload: Workload, chunk: int) -> str | None:
    """A request that is never aborted and runs past its first chunk of
    ``chunk`` positions (the longest such), so a step reads a later chunk."""
    aborted = {rid for _, rid in workload.abort_steps()}
    best = [r for r in workload.requests
            if r.request_id not in aborted and len(r.prompt_token_ids) + r.max_tokens > chunk + 1]
    if not best:
        return None
    return max(best, key=lambda r: (len(r.prompt_token_ids) + r.max_tokens, r.request_id)).request_id


def _load_target(workload: Workload) -> str | None:
    """A request that is never aborted and has the most tokens to load from
    the connector's store (None: no such request)."""
    aborted = {rid for _, rid in workload.abort_steps()}
    best = [r for r in workload.requests if r.request_id not in aborted and r.kv_external_tokens > 0]
    if not best:
        return None
    return max(best, key=lambda r: (r.kv_external_tokens, r.request_id)).request_id


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
    kv_source: KVStore | None = None,
) -> NegativeControl:
    """Run ``variant`` with one deliberately wrong block table, position,
    connector load (``kv_load``: the stored K/V shifted by one position) or
    chunked-local table (``chunk_null``: a block of the current chunk nulled)
    and count the divergences from ``baseline`` (they must not be zero; a
    plan the executor refuses counts as caught)."""
    wl = variant_workload(workload, variant)
    if kind == "kv_load":
        target = _load_target(wl)
    elif kind == "chunk_null":
        target = _chunk_target(workload, _chunk_size(model))
    elif kind == "state_checkpoint":
        target = None  # the first restore of a request never aborted
    else:
        target = _fault_target(workload)
    aborted = frozenset(rid for _, rid in wl.abort_steps()) if kind == "state_checkpoint" else frozenset()
    fault = Fault(kind, step=0, request_id=target, exclude=aborted)
    try:
        rec = run_one(factory, model, variant.config, wl, variant=variant.name, fault=fault, kv_source=kv_source)
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


def _refused(workload: str, variant: str, mode: str, exc: PlanError | StallError) -> Comparison:
    """A run the executor stopped: its scheduler planned a step no model
    runner could execute (a divergence of kind ``plan``), or stopped
    scheduling with requests left (kind ``stall``)."""
    if isinstance(exc, StallError):
        return Comparison(workload, variant, mode, divergences=[Divergence("-", "stall", -1, str(exc))])
    return Comparison(workload, variant, mode, divergences=[Divergence(exc.request_id, "plan", exc.step, str(exc))])


def mask_control(factory: SchedulerFactory, model: PagedLlama, workload: Workload, baseline: SchedulerConfig,
                 *, atol: float = 1e-3) -> NegativeControl:
    """Run ``workload``'s baseline on the model with every chunk of its
    chunked-local mask starting one position early (each token also attends
    the last position of the chunk before its own), and count its divergences
    from the dense reference of the correct model (they must not be zero:
    the mask is wrong in baseline and variants alike, so only the reference
    can see it)."""
    chunk = _chunk_size(model)
    if not chunk:
        raise ValueError("the chunk mask control needs a model with chunked-local layers")
    rec = run_one(factory, model.with_chunk_start_shift(-1), baseline, workload, variant="baseline")
    cmp = check_reference(model, rec, workload, atol=atol)
    fired = [f"every chunk of {chunk} in the chunked-local layers' mask starts one position early"]
    return NegativeControl("chunk_mask", workload.name, "baseline", fired, len(cmp.divergences),
                           str(cmp.divergences[0]) if cmp.divergences else "")


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
    reference: bool = False,
) -> MatrixReport:
    """Run the baseline and every variant on every workload, compare, check
    the guards, and (``negative``) run the negative controls: a wrong block
    table and wrong positions, with connector variants a shifted load, with
    chunked-local layers a nulled block of the current chunk and (with
    ``reference``) a chunk mask off by one. ``reference``: check every
    baseline against the dense, non-paged reference too."""
    t0 = time.perf_counter()
    report = MatrixReport(
        model=model_name or model.config.name,
        device=str(model.device),
        mode=model.mode,
        workloads=[w.name for w in workloads],
        variants=list(variants),
        workload_defs={w.name: workload_dict(w) for w in workloads},
        environment=determinism_facts(model.device),
    )
    bases: dict[str, RunRecord] = {}
    stores: dict[str, KVStore] = {}
    need_store = any(v.kv for v in variants)
    whole = 0  # the workloads run whole; a signal takes the one in progress out again
    try:
        for i, w in enumerate(workloads):
            whole = i
            store = KVStore() if need_store else None
            if store is not None:
                stores[w.name] = store
            try:
                base = run_one(factory, model, baseline, w, variant="baseline", kv_record=store)
            except (PlanError, StallError) as exc:  # the baseline's own plan could not run: nothing to compare with
                report.comparisons.append(_refused(w.name, "baseline", model.mode, exc))
                if progress:
                    progress(f"[{i + 1}/{len(workloads)}] {w.name}: baseline REFUSED: {exc}")
                continue
            bases[w.name] = base
            report.baselines[w.name] = base.counters
            report.baseline_outputs[w.name] = {rid: list(toks) for rid, toks in sorted(base.outputs.items())}
            report.baseline_digests[w.name] = base.digest()
            line = [f"[{i + 1}/{len(workloads)}] {w.name}: baseline {base.counters.steps} steps"]
            if reference:
                ref = check_reference(model, base, w, atol=atol)
                report.reference.append(ref)
                line.append(f"reference {'ok' if ref.ok else 'DIVERGED'}")
            for v in variants:
                try:
                    rec = run_one(factory, model, v.config, variant_workload(w, v), variant=v.name,
                                  kv_source=stores.get(w.name) if v.kv else None)
                    cmp = compare_runs(base, rec, mode=model.mode, atol=atol)
                except (PlanError, StallError) as exc:
                    cmp = _refused(w.name, v.name, model.mode, exc)
                report.comparisons.append(cmp)
                line.append(f"{v.name} {'ok' if cmp.ok else 'DIVERGED'}")
            if progress:
                progress(", ".join(line) + f" ({time.perf_counter() - t0:.1f} s)")
        whole = len(workloads)
    except (Interrupted, KeyboardInterrupt) as exc:
        if whole < len(workloads):
            _drop_workload(report, workloads[whole].name, bases, stores)
        report.interrupted = exc.name if isinstance(exc, Interrupted) else "SIGINT"
        report.workloads = [w.name for w in workloads[:whole]]
        report.seconds = time.perf_counter() - t0
        return report
    base_tot = Stats()
    for c in report.baselines.values():
        base_tot.merge(c)
    for feat in FEATURES:
        if base_tot.feature(feat) and not getattr(baseline, BASELINE_SWITCHES.get(feat, ""), False):
            report.guard_failures.append(f"the baseline itself {feat} ({base_tot.feature(feat)}): it is not a clean baseline")
    for v in variants:
        tot, rows = report.totals(v.name)
        for feat in sorted(v.expects):
            count = sum(r.inflight.get(feat, 0) for r in rows) if feat in EXECUTOR_FEATURES else tot.feature(feat)
            if not count:
                report.guard_failures.append(f"variant {v.name} never {feat.replace('_', ' ')} in {len(workloads)} workloads")
    workloads = [w for w in workloads if w.name in bases]
    if negative and workloads and variants:
        w = next((w for w in workloads if _fault_target(w) is not None), workloads[0])
        v = next((v for v in variants if "chunked" in v.expects), variants[0])
        kinds: tuple[FaultKind, ...] = ("block_table", "position")
        chunk = _chunk_size(model)
        if chunk:
            kinds += ("chunk_null",)
        for kind in kinds:
            fw = w
            if kind == "chunk_null":
                fw = next((x for x in workloads if _chunk_target(x, chunk) is not None), w)
            nc = negative_control(factory, model, bases[fw.name], fw, v, kind, mode=model.mode, atol=atol,
                                  kv_source=stores.get(fw.name) if v.kv else None)
            report.negative.append(nc)
            if progress:
                progress(f"negative control {kind}: {'caught' if nc.caught else 'MISSED'}")
        if chunk and reference:
            mw = next((x for x in workloads if _chunk_target(x, chunk) is not None), w)
            nc = mask_control(factory, model, mw, baseline, atol=atol)
            report.negative.append(nc)
            if progress:
                progress(f"negative control chunk_mask: {'caught' if nc.caught else 'MISSED'}")
        if any(a.rule.keeps_state for a in model.group_attn):
            _state_control(report, factory, model, bases, workloads, variants, atol, progress)
        kv_variant = next((v for v in variants if v.kv), None)
        if kv_variant is not None:
            kw = next((w for w in workloads if _load_target(variant_workload(w, kv_variant)) is not None), None)
            if kw is None:
                report.guard_failures.append("no workload has a connector load to corrupt: the load control did not run")
            else:
                nc = negative_control(factory, model, bases[kw.name], kw, kv_variant, "kv_load", mode=model.mode,
                                      atol=atol, kv_source=stores[kw.name])
                report.negative.append(nc)
                if progress:
                    progress(f"negative control kv_load: {'caught' if nc.caught else 'MISSED'}")
    report.seconds = time.perf_counter() - t0
    return report


def _state_control(report: MatrixReport, factory: SchedulerFactory, model: PagedLlama, bases: dict[str, RunRecord],
                   workloads: Sequence[Workload], variants: Sequence[Variant], atol: float,
                   progress: Progress | None) -> None:
    """The state negative control (``Fault("state_checkpoint")``): on the
    run of the matrix that restored the most states (a workload and a
    variant), the first restore takes the checkpoint one block earlier; it
    must diverge from the baseline."""
    by_name = {v.name: v for v in variants}
    runs = [c for c in report.comparisons if c.workload in bases and c.variant in by_name and not by_name[c.variant].kv]
    best = max(runs, key=lambda c: c.inflight.get("state_restored", 0), default=None)
    if best is None or not best.inflight.get("state_restored", 0):
        report.guard_failures.append("no run restored a Mamba state: the state_checkpoint control did not run")
        return
    w = next(x for x in workloads if x.name == best.workload)
    nc = negative_control(factory, model, bases[w.name], w, by_name[best.variant], "state_checkpoint",
                          mode=model.mode, atol=atol)
    report.negative.append(nc)
    if progress:
        progress(f"negative control state_checkpoint: {'caught' if nc.caught else 'MISSED'}")


def _drop_workload(report: MatrixReport, name: str, bases: dict[str, RunRecord], stores: dict[str, KVStore]) -> None:
    """Take a workload cut short by a signal out of ``report``: a partial
    workload counts in nothing."""
    report.comparisons = [c for c in report.comparisons if c.workload != name]
    report.reference = [r for r in report.reference if r.workload != name]
    for table in (bases, stores, report.baselines, report.baseline_outputs, report.baseline_digests):
        table.pop(name, None)


def merge_repeats(runs: Sequence[MatrixReport]) -> MatrixReport:
    """One report of N runs of the same matrix: the first run's report, with
    each run's (steps/s, tok/s) per variant (``rates`` gives their medians)
    and, as ``repeat_failures``, every run whose tokens or logits differ from
    the first run's (a nondeterminism) or that failed itself."""
    if not runs:
        raise ValueError("merge_repeats needs at least one report")
    first = runs[0]
    names = ["baseline", *(v.name for v in first.variants)]
    first.repeats = len(runs)
    first.repeat_rates = {name: [r.rates(name) for r in runs] for name in names}
    want = {(c.workload, c.variant): c.digest for c in first.comparisons}
    for i, r in enumerate(runs[1:], start=2):
        for w, d in r.baseline_digests.items():
            if first.baseline_digests.get(w) != d:
                first.repeat_failures.append(f"repeat {i}: {w}/baseline differs from repeat 1 (tokens or logits)")
        for c in r.comparisons:
            if want.get((c.workload, c.variant)) != c.digest:
                first.repeat_failures.append(f"repeat {i}: {c.workload}/{c.variant} differs from repeat 1 (tokens or logits)")
        if not r.ok:
            first.repeat_failures.append(f"repeat {i}: NOT EQUIVALENT itself ({len(r.divergent)} divergent, "
                                         f"{len(r.guard_failures)} guard failures)")
    first.seconds = sum(r.seconds for r in runs)
    return first


def _layout_words(model: PagedLlama) -> str:
    """The model's hybrid layout for the report's title ("" for none)."""
    if not model.is_hybrid:
        return ""
    if model.sliding_window and not model.chunked_local and not model.layer_pattern:
        return f" (sliding window {model.sliding_window} on {model.sw_layers} layers)"
    return f" (layers {model.describe_layout()})"


def fit_variants(capabilities: Capabilities, baseline: SchedulerConfig, variants: Sequence[Variant],
                 ) -> tuple[SchedulerConfig, tuple[Variant, ...], list[tuple[str, str]], list[str]]:
    """The baseline and the variants a scheduler declaring ``capabilities``
    runs, and (name, why) of those it cannot. A scheduler that schedules only
    asynchronously (a vLLM AsyncScheduler subclass) runs the baseline and
    every synchronous variant with async scheduling on: the matrix holds
    their tokens equal either way. A variant needing anything else the
    declaration lacks (async scheduling for a vLLM Scheduler subclass,
    speculative decoding, prefix caching...) is skipped, with why. Returns
    the baseline, the variants kept, (name, why) of those skipped and the
    names of those turned async ("baseline" among them)."""

    def fit(config: SchedulerConfig) -> tuple[SchedulerConfig | None, list[str]]:
        problems = capabilities.config_problems(config)
        if problems == ["async_scheduling=False"]:
            return replace(config, async_scheduling=True), []
        return (None, problems) if problems else (config, [])

    base, problems = fit(baseline)
    if base is None:
        raise ValueError(f"the scheduler cannot run the baseline configuration: it does not support "
                         f"{', '.join(problems)}")
    kept: list[Variant] = []
    skipped: list[tuple[str, str]] = []
    made_async = ["baseline"] if base != baseline else []
    for v in variants:
        config, problems = fit(v.config)
        if config is None:
            skipped.append((v.name, "needs " + ", ".join(problems)))
        else:
            kept.append(replace(v, config=config))
            if config != v.config:
                made_async.append(v.name)
    return base, tuple(kept), skipped, made_async


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
    repeat: int = 1,
    deterministic_algorithms: bool = False,
    sliding_window: int = 0,
    sw_layers: str = "odd",
    connector: bool = True,
    capabilities: Capabilities | None = None,
    chunked_local: int = 0,
    cl_layers: str = "odd",
    layer_pattern: str = "",
    reference: bool | None = None,
    extend: Callable[[MatrixReport, PagedLlama, int], object] | None = None,
    more_variants: Callable[[int, int, tuple[KVCacheGroup, ...]], tuple[Variant, ...]] | None = None,
) -> MatrixReport:
    """Load ``model``, build workloads and variants, run the matrix
    (``repeat`` times: see ``merge_repeats``; the negative controls run once).
    ``sliding_window`` W > 0 makes the model hybrid (``sw_layers`` attend the
    last W positions) and every config carry its KV cache groups;
    ``chunked_local`` C > 0 does the same with chunked local attention
    (``cl_layers``; with both, or ``layer_pattern``, a layout of full,
    sliding-window and chunked-local layers: ``PagedLlama``).
    ``connector`` adds the connector variants. ``reference`` checks every
    baseline against the dense, non-paged reference (None: for a hybrid
    model). ``extend(report, model, max_model_len)``: more rows run after
    the matrix on the same model, into its report (the streaming-input
    sessions: gpu_runner/sessions.py, ``session_extension``). ``more_variants(max_model_len,
    block_size, groups)``: variants added to the matrix (``--pipeline``:
    gpu_runner/pipeline.py, ``pipeline_variants``). ``capabilities``: what the
    scheduler declares (None: the spec, everything): without ``kv_connector``
    the connector variants are left out (a progress line says so), without
    ``hybrid_kv`` a sliding window or chunked local attention is refused
    (ValueError)."""
    from schedspec.gpu_runner.executor import pick_device
    from schedspec.gpu_runner.loaders import load_model

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if capabilities is not None:
        if (sliding_window or chunked_local) and not capabilities.hybrid_kv:
            flag = "--sliding-window" if sliding_window else "--chunked-local"
            raise ValueError(f"{flag} needs a scheduler that declares hybrid_kv (hybrid KV cache groups)")
        if connector and not capabilities.kv_connector:
            connector = False
            if progress:
                progress("the connector variants are left out: the scheduler does not declare kv_connector")
    dev = pick_device(device, deterministic_algorithms=deterministic_algorithms)
    weights = load_model(model, dev)
    mml = max_model_len or min(weights.config.max_position, 128)
    paged = PagedLlama(weights, mode=mode, tile_rows=tile_rows, window=mml,  # type: ignore[arg-type]
                       sliding_window=sliding_window, sw_layers=sw_layers, chunked_local=chunked_local,
                       cl_layers=cl_layers, layer_pattern=layer_pattern)
    groups = model_kv_cache_groups(paged)
    if reference is None:
        reference = paged.is_hybrid
    wls = make_workloads(workloads, seed=seed, vocab_size=weights.config.vocab_size, max_model_len=mml, block_size=block_size)
    refused: list[tuple[str, str]] = []  # the variants the layout's groups refuse
    variants = (default_variants(mml, block_size, groups=groups, refused=refused)
                + inflight_variants(mml, block_size, groups=groups, refused=refused))
    if connector:
        variants += connector_variants(mml, block_size, groups=groups, refused=refused)
    skipped: list[tuple[str, str]] = []
    if more_variants is not None:
        variants += more_variants(mml, block_size, groups)
    baseline = baseline_config(mml, block_size, groups=groups)
    made_async: list[str] = []
    if capabilities is not None:
        baseline, variants, skipped, made_async = fit_variants(capabilities, baseline, variants)
        if progress and skipped:
            progress("skipped, unsupported by the scheduler: " + "; ".join(f"{n} ({why})" for n, why in skipped))
    runs: list[MatrixReport] = []
    interrupted = ""
    for i in range(repeat):
        if progress and repeat > 1:
            progress(f"repeat {i + 1}/{repeat}")
        run = run_matrix(
            factory or spec_factory,
            paged,
            wls,
            variants,
            baseline=baseline,
            atol=atol,
            negative=negative and i == 0,
            progress=progress,
            model_name=model + _layout_words(paged),
            reference=reference,
        )
        if run.interrupted:  # a repeat cut short: the whole ones are the report (the first: what it ran)
            interrupted = run.interrupted
            if not runs:
                runs.append(run)
            break
        runs.append(run)
    merged = merge_repeats(runs)
    merged.interrupted = interrupted
    if extend is not None and not interrupted:
        extend(merged, paged, mml)
    merged.skipped = skipped
    merged.refused = refused
    merged.made_async = made_async
    return merged

