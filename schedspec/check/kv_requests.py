"""The KV connector and hybrid KV cache groups in generated workloads: which
KV features a workload turns on, a hybrid layout's groups, the connector's
config fields, and KVRequests, which adds the connector's request fields to
generated requests and the worker's events to a workload. As with the gates,
every draw comes from a generator of its own (seeded from the workload's
seed), so a workload with neither is exactly the one its seed always gave.
The vLLM defects the draws steer around are the table of check/defects.py."""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any, Sequence

from schedspec.spec.interface import RequestSpec, SchedSpecError, SchedulerConfig
from schedspec.spec.kv_kinds import kind_of

from schedspec.check import kv_kinds
from schedspec.check.defects import ASYNC_LOAD, FAIL_ASYNC_LOAD_AT_BLOCK, FAIL_SYNC_LOAD, avoid
from schedspec.check.features import KV_FEATURES
from schedspec.check.workload import Abort, Event, KVLoadDone, KVLoadFailed, KVSaveDone

#: How often a hybrid layout holds a chunked-local group (draw_kv_groups).
CHUNKED_LOCAL_RATE = 0.5


def kv_rng(seed: int | str) -> random.Random:
    """The generator of a workload's KV draws."""
    return random.Random(f"schedspec-kv-{seed}")


def chunk_rng(seed: int | str) -> random.Random:
    """The generator of a workload's chunked-local draws (draw_kv_groups),
    apart from kv_rng's so that every other KV draw of a seed stays the one
    it gave before chunked-local groups were drawn."""
    return random.Random(f"schedspec-kv-chunk-{seed}")


def _mamba_rate(text: str) -> float:
    """SCHEDSPEC_MAMBA_RATE's value: a probability, else a clear error."""
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"SCHEDSPEC_MAMBA_RATE must be a probability between 0 and 1, got {text!r}")
    return rate


#: The probability that a hybrid draw puts a Mamba group ("align" mode) in
#: the place of its last sliding-window group, drawn from mamba_rng apart
#: from every other draw: DEFAULT_MAMBA_RATE, or the environment variable
#: SCHEDSPEC_MAMBA_RATE (e.g. 1 with ``--kv hybrid``; 0 for no Mamba group).
MAMBA_RATE: float | None = None  # None: read SCHEDSPEC_MAMBA_RATE at each draw
DEFAULT_MAMBA_RATE = 0.3


def mamba_rate() -> float:
    """The Mamba draw's probability: MAMBA_RATE when set, else the
    environment's SCHEDSPEC_MAMBA_RATE (DEFAULT_MAMBA_RATE when unset;
    ValueError when not a probability)."""
    if MAMBA_RATE is not None:
        return MAMBA_RATE
    return _mamba_rate(os.environ.get("SCHEDSPEC_MAMBA_RATE", str(DEFAULT_MAMBA_RATE)))


def mamba_rng(seed: int | str) -> random.Random:
    """The generator of a workload's Mamba draws (with_mamba)."""
    return random.Random(f"schedspec-kv-mamba-{seed}")


#: How often a drawn Mamba layout has two Mamba groups: a model with more
#: Mamba layers than one group of the layout's group size holds gets several
#: (vllm/v1/core/kv_cache_utils.py, _get_kv_cache_groups_uniform_page_size),
#: each group its own table and state blocks.
SECOND_STATE_RATE = 0.3

#: How often a drawn Mamba layout puts its Mamba groups first: a model whose
#: first layers are Mamba layers (Jamba, Nemotron-H), as vLLM numbers the
#: groups in the order each spec's first layer comes
#: (vllm/v1/core/kv_cache_planning.py, _get_kv_cache_groups_uniform_page_size).
STATE_FIRST_RATE = 0.3


def with_mamba(config: SchedulerConfig, rng: random.Random, rate: float | None = None) -> SchedulerConfig:
    """``config`` with, at probability ``rate`` (MAMBA_RATE when None), a
    Mamba group in the place of its last sliding-window or chunked-local
    group (full + mamba, full + sliding window + mamba, a lone mamba
    group becomes full + mamba), and at SECOND_STATE_RATE a second Mamba
    group after the last; at STATE_FIRST_RATE the Mamba groups first. The
    config unchanged when the draw misses
    or the config cannot take a Mamba group (spec/validate.py: prefix
    caching and chunked prefill on, no drafts, no KV connector)."""
    from schedspec.spec.interface import KVCacheGroup

    if rate is None:
        rate = mamba_rate()
    if not config.is_hybrid or rng.random() >= rate:
        return config
    groups = config.groups
    last = max(g for g, group in enumerate(groups) if kind_of(group).skips)
    new = groups[:last] + (kv_kinds.MAMBA.draw(config.block_size, rng),) + groups[last + 1:]
    if rng.random() < SECOND_STATE_RATE:
        new += (kv_kinds.MAMBA.draw(config.block_size, rng),)
    if not any(kind_of(g).downward_closed for g in new):
        new = (KVCacheGroup(),) + new
    if rng.random() < STATE_FIRST_RATE:
        new = tuple(g for g in new if kind_of(g).keeps_state) + tuple(g for g in new if not kind_of(g).keeps_state)
    try:
        return dataclasses.replace(config, kv_cache_groups=new,
                                   num_blocks=max(config.num_blocks, 1 + (config.num_blocks - 1) // len(groups) * len(new)))
    except SchedSpecError:
        return config


#: How often a hybrid layout that can take one hashes its blocks in units
#: below the block size (with_hash_block): vLLM's prefix_match_unit, so its
#: full-attention groups register partial prefix-cache entries.
HASH_BLOCK_RATE = 0.75


def hash_rng(seed: int | str) -> random.Random:
    """The generator of a workload's hash block size draw (with_hash_block),
    apart from every other draw, so a seed's other draws stay as they were."""
    return random.Random(f"schedspec-kv-hash-{seed}")


def with_hash_block(config: SchedulerConfig, rng: random.Random, rate: float = HASH_BLOCK_RATE) -> SchedulerConfig:
    """``config`` with, at probability ``rate``, a hash block size below its
    block size (a proper divisor: half, a quarter, ... down to 1 token) when
    it is hybrid with prefix caching on and can take one (spec/validate.py,
    _check_hash_block_size: no KV connector, no Mamba group); else unchanged."""
    if not config.is_hybrid or not config.enable_prefix_caching or rng.random() >= rate:
        return config
    bs = config.block_size
    units = [d for d in range(1, bs) if bs % d == 0]
    if not units:
        return config
    try:
        return dataclasses.replace(config, hash_block_size=rng.choice(units))
    except SchedSpecError:
        return config


def draw_kv_subset(kv: Sequence[str], rng: random.Random) -> tuple[str, ...]:
    """The KV features one workload turns on: each of ``kv`` with
    probability 0.6 (a workload may draw none), in KV_FEATURES order."""
    return tuple(k for k in KV_FEATURES if k in kv and rng.random() < 0.6)


def draw_kv_groups(block_size: int, rng: random.Random, chunks: random.Random | None = None,
                   chunked: bool | None = None) -> tuple[Any, ...]:
    """A hybrid layout: full attention beside one or two sliding-window
    groups, or a lone sliding-window group (at most 3 groups), each window
    1 to 4 blocks long (block-aligned or not), drawn from ``rng``; then, with
    probability CHUNKED_LOCAL_RATE drawn from ``chunks`` (``rng`` when None)
    or when ``chunked`` says so, a chunked-local group of 1 to 4 blocks takes
    the place of the last sliding-window group: full + chunked local, full +
    sliding window + chunked local, a lone chunked-local group, full +
    chunked local + full. Short chunks, so that a few hundred steps free
    blocks before the chunk (ChunkedLocalAttentionManager), and whole
    blocks, as vLLM's chunked local attention backend requires
    (spec/validate.py)."""
    from schedspec.spec.interface import KVCacheGroup

    def window() -> KVCacheGroup:
        return kv_kinds.SLIDING_WINDOW.draw(block_size, rng)

    layout = rng.choice(("full+sw", "full+sw", "full+sw+sw", "sw", "full+sw+full"))
    if layout == "sw":
        groups: tuple[KVCacheGroup, ...] = (window(),)
    elif layout == "full+sw":
        groups = (KVCacheGroup(), window())
    elif layout == "full+sw+sw":
        groups = (KVCacheGroup(), window(), window())
    else:
        groups = (KVCacheGroup(), window(), KVCacheGroup())
    crng = rng if chunks is None else chunks
    if chunked is None:
        chunked = crng.random() < CHUNKED_LOCAL_RATE
    if not chunked:
        return groups
    last = max(g for g, group in enumerate(groups) if kind_of(group).skips)  # the last sliding-window group
    chunk = kv_kinds.CHUNKED_LOCAL.draw(block_size, crng)
    return groups[:last] + (chunk,) + groups[last + 1:]


def with_kv(config: SchedulerConfig, kv: Sequence[str], rng: random.Random,
            chunks: random.Random | None = None, chunked: bool | None = None) -> SchedulerConfig:
    """``config`` with the KV features ``kv``: a connector with either load
    failure policy; hybrid groups (draw_kv_groups, with ``chunks`` and
    ``chunked``) with the pool grown so each group holds what the plain
    layout's one group held. A draw the config cannot take leaves that
    feature off."""
    out = config
    if "connector" in kv:
        try:
            out = dataclasses.replace(out, kv_connector=True,
                                      kv_load_failure_policy=rng.choice(("recompute", "fail")))
        except SchedSpecError:
            pass
    if "hybrid" in kv:
        groups = draw_kv_groups(out.block_size, rng, chunks, chunked)
        try:
            out = dataclasses.replace(out, kv_cache_groups=groups,
                                      num_blocks=1 + (out.num_blocks - 1) * len(groups))
        except SchedSpecError:
            pass
    return out


class KVRequests:
    """Adds the connector's request fields to generated requests, and the
    worker's events to a workload: external prefixes of 0 tokens up to the
    whole prompt (block-aligned or not), loaded synchronously or
    asynchronously, asynchronous saves; load reports (done, or failed as a
    whole or at one block) after 0 to 5 steps or left to the bounded wait,
    saves reported after a few steps or left to it, and aborts soon after an
    asynchronous load starts (aborts during loads)."""

    def __init__(self, config: SchedulerConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        #: (steps until due, event) of the events drawn and not yet emitted
        self.due: list[tuple[int, Event]] = []

    def decorate(self, request: RequestSpec) -> RequestSpec:
        """``request`` with connector fields drawn for it (and its events queued)."""
        if not self.config.kv_connector:
            return request
        rng, bs = self.rng, self.config.block_size
        n = len(request.prompt_token_ids)
        changes: dict[str, Any] = {}
        if rng.random() < 0.7:
            ext = rng.choice((n, n, max(0, n - n % bs), rng.randint(0, n), rng.randint(1, n)))
            # no asynchronous load where vLLM would never finish or admit it
            # (check/defects.py: one-token-async-load, async-load-over-spec-reserve)
            asynchronous = rng.random() < 0.5 and not avoid(ASYNC_LOAD, self.config, request)
            if not asynchronous:
                # a synchronous load leaves at least one token to compute
                # (vLLM asserts num_new_tokens > 0; the spec refuses it at add)
                ext = min(ext, n - 1)
            if ext:
                changes["kv_external_tokens"] = ext
                changes["kv_load_async"] = asynchronous
        if rng.random() < 0.4:
            changes["kv_save_async"] = True
        if not changes:
            return request
        try:
            out = dataclasses.replace(request, **changes)
        except SchedSpecError:
            return request
        rid = out.request_id
        if out.kv_external_tokens:
            blocks = -(-out.kv_external_tokens // bs)
            r = rng.random()
            delay = rng.choice((0, 0, 1, 1, 2, 3, 5))
            if out.kv_load_async:
                if r < 0.45:
                    self.due.append((delay, KVLoadDone(rid)))
                elif r < 0.7:
                    index = None if rng.random() < 0.5 else rng.randrange(blocks)
                    if avoid(FAIL_ASYNC_LOAD_AT_BLOCK, self.config, out):
                        index = None  # fails as a whole (check/defects.py)
                    self.due.append((delay, KVLoadFailed(rid, index)))
                elif r < 0.8:
                    self.due.append((rng.choice((0, 1, 2)), Abort(rid)))
                # else: the bounded wait reports it
            elif r < 0.3 and not avoid(FAIL_SYNC_LOAD, self.config, out):
                # no failed synchronous load where vLLM leaves a stale
                # placeholder, recomputes into a freed window or rewinds
                # before an unencoded input (check/defects.py)
                self.due.append((0, KVLoadFailed(rid, rng.choice((None, rng.randrange(blocks))))))
        if out.kv_save_async and rng.random() < 0.5:
            self.due.append((rng.randint(1, 12), KVSaveDone(rid)))
        return out

    def before_step(self) -> list[Event]:
        """The worker's events (and aborts during loads) due before the next step."""
        out: list[Event] = []
        left: list[tuple[int, Event]] = []
        for steps, event in self.due:
            if steps <= 0:
                out.append(event)
            else:
                left.append((steps - 1, event))
        self.due = left
        return out

    def finish(self) -> list[Event]:
        """The events still due at the end (they wait in the worker's queue
        until the run to quiescence delivers or drops them)."""
        out = [e for _, e in self.due]
        self.due = []
        return out
