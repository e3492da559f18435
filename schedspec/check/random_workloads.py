"""Seeded random workloads: the CLI's ``check --generator random`` and the
benchmarks draw these (the Hypothesis state machine draws its own through
schedspec.testing.strategies, the guided check through
schedspec.check.coverage_guided).

``random_workload(seed, steps, modes=..., gates=..., kv=...)``: a config
drawn from CHECK_SPACE (check/config_space.py), requests rich in shared
prefixes (RequestFactory), arrivals in bursts, aborts and prefix-cache
resets; the mode, the gates (check/gate_requests.py) and the KV features
(check/kv_requests.py) each drawn on a generator of their own, so a
workload without them is the one its seed always gave."""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from schedspec.spec.interface import RequestSpec, SchedulerConfig

from schedspec.check.pipeline import pipeline_rng, with_pipeline
from schedspec.check.config_space import CHECK_SPACE, draw_mode, random_config, with_mode
from schedspec.check.defects import keep_failed_sync_loads_alive
from schedspec.check.features import GATES, KV_FEATURES, MODES, kv_of
from schedspec.check.gate_requests import GateRequests, draw_gate_subset, gate_rng, with_gates
from schedspec.check.kv_requests import (
    KVRequests, chunk_rng, draw_kv_subset, hash_rng, kv_rng, mamba_rng, with_hash_block, with_kv, with_mamba,
)
from schedspec.check.runner_draw import runner_feature, with_runner
from schedspec.check.session_events import SessionRequests, session_config, session_rng
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Schedule, Step, Update, Workload

#: Token ids of prompts come from a small alphabet and from a few shared
#: prefixes, so prefix hits are common.
ALPHABET = 16


class RequestFactory:
    """Makes requests rich in shared prefixes, stop tokens and priorities."""

    def __init__(self, rng: random.Random, config: SchedulerConfig, vocab: int) -> None:
        self.rng = rng
        self.config = config
        self.vocab = vocab
        self.counter = 0
        bs = config.block_size
        self.prefixes = [
            tuple(rng.randrange(ALPHABET) for _ in range(rng.randint(bs, 3 * bs)))
            for _ in range(3)
        ]

    def make(self) -> RequestSpec:
        rng, cfg = self.rng, self.config
        self.counter += 1
        rid = f"r{self.counter}"
        longest = cfg.max_model_len - 1
        if rng.random() < 0.6:
            prefix = rng.choice(self.prefixes)
        else:
            prefix = ()
        tail_len = rng.choice([1, 2, 3, cfg.block_size, cfg.block_size + 1, rng.randint(1, longest)])
        prompt = (prefix + tuple(rng.randrange(ALPHABET) for _ in range(tail_len)))[:longest]
        stop: tuple[int, ...] = ()
        if rng.random() < 0.3:
            stop = (rng.randrange(self.vocab),)
        eos = rng.randrange(self.vocab) if rng.random() < 0.3 else None
        return RequestSpec(
            request_id=rid,
            prompt_token_ids=prompt,
            max_tokens=rng.choice([1, 2, 4, 8, 16, 64]),
            priority=rng.choice([0, 0, 1, 2]),
            arrival=self.counter,
            stop_token_ids=stop,
            eos_token_id=eos,
            ignore_eos=rng.random() < 0.2,
            cache_salt=rng.choice([None, None, None, "s1"]),
        )


def random_workload(
    seed: int, num_steps: int, vocab: int = 64, modes: Sequence[str] = ("sync",),
    gates: Sequence[str] = (), kv: Sequence[str] = (), always_gates: Sequence[str] = (),
    sessions: bool = False, pipeline: bool = False, runner: bool = False,
) -> Workload:
    """A seeded workload of ``num_steps`` steps with arrivals in bursts,
    aborts and occasional prefix-cache resets, in one of ``modes`` (MODES;
    ``schedspec check`` passes all four).

    The mode is drawn apart from the rest (its own generator, seeded from
    ``seed``), so a sync workload is the one this seed always gave. With async
    scheduling some Steps are spelled out as Schedule, events, Update, so
    aborts and arrivals also land between schedule(N+1) and update(N).

    ``gates`` (GATES) are the admission gates the workload may use: it turns
    a random subset of them on (``draw_gate_subset``), with their config
    fields, request fields and events drawn from a generator of their own
    (``GateRequests``); with no gate the workload is the one this seed always
    gave. The gates it turned on are its features (``gate:NAME``); those of
    ``gates`` in ``always_gates`` (declared ALWAYS) are on in every workload.

    ``kv`` (KV_FEATURES) are the KV features it may use, drawn the same way
    on a generator of their own (``kv_rng``, ``draw_kv_subset``,
    ``with_kv``, ``KVRequests``; a hybrid layout's chunked-local group on
    ``chunk_rng``'s); they are among its features as ``kv:NAME``.

    ``sessions``: some requests are streaming-input sessions, sent chunks and
    ends between steps (check/session_events.py, on a generator of their
    own; the config FCFS without a KV connector); feature ``sessions``.

    ``pipeline``: the config's pipeline_parallel_size is drawn from 1 to 4
    where it allows one (check/pipeline.py), so up to k plans are in flight;
    a workload with pipeline_parallel_size > 1 has feature ``pipeline:k=K``,
    which the reports print with its seed.

    ``runner``: the model runner and the pipeline size drawn
    (check/runner_draw.py); feature ``runner:v2/pp3``."""
    rng = random.Random(seed)
    config = random_config(rng, dataclasses.replace(CHECK_SPACE, modes=("sync",)))
    modes = tuple(modes)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
    mode_rng = random.Random(f"schedspec-mode-{seed}")
    mode_fields = draw_mode(modes, CHECK_SPACE.spec_tokens, lambda options: mode_rng.choice(options))
    config = with_mode(config, **mode_fields)
    for g in gates:
        if g not in GATES:
            raise ValueError(f"unknown gate {g!r} (choose from {', '.join(GATES)})")
    gated: GateRequests | None = None
    chosen: tuple[str, ...] = ()
    if gates:
        grng = gate_rng(seed)
        chosen = draw_gate_subset(gates, grng, always_gates)
        config = with_gates(config, chosen, grng)
        gated = GateRequests(config, grng, vocab, pause="pause" in chosen, grammar="grammar" in chosen)
    for k in kv:
        if k not in KV_FEATURES:
            raise ValueError(f"unknown KV feature {k!r} (choose from {', '.join(KV_FEATURES)})")
    kv_requests: KVRequests | None = None
    kv_chosen: tuple[str, ...] = ()
    if kv:
        krng = kv_rng(seed)
        kv_chosen = draw_kv_subset(kv, krng)
        config = with_kv(config, kv_chosen, krng, chunk_rng(seed))
        config = with_hash_block(config, hash_rng(seed))  # partial prefix-cache entries
        config = with_mamba(config, mamba_rng(seed))  # spec/mamba.py's groups (MAMBA_RATE), where it takes one
        kv_chosen = kv_of(config)
        kv_requests = KVRequests(config, krng) if config.kv_connector else None
    streams: SessionRequests | None = None
    if sessions:
        config = session_config(config)
        kv_requests, kv_chosen = None, kv_of(config)
        streams = SessionRequests(config, session_rng(seed), vocab)
    if pipeline:
        config = with_pipeline(config, pipeline_rng(seed))
    if runner:
        config = with_runner(config, seed)
    factory = RequestFactory(rng, config, vocab)

    def make() -> RequestSpec:
        req = factory.make()
        req = req if gated is None else gated.decorate(req)
        req = req if kv_requests is None else kv_requests.decorate(req)
        if streams is None or req.structured_output or req.mm_inputs or config.num_hash_lookahead_tokens:
            return req  # (sessions with EAGLE's hash lookahead are not modelled: spec/protocol.py)
        return streams.decorate(req)

    events: list[Event] = []
    live: list[str] = []
    steps = 0
    while steps < num_steps:
        r = rng.random()
        if r < 0.25 or not live:
            for _ in range(rng.choice([1, 1, 2, 4])):
                req = make()
                events.append(AddRequest(req))
                live.append(req.request_id)
        elif r < 0.29:
            victim = rng.choice(live)
            events.append(Abort(victim))
            live.remove(victim)
            if gated is not None:
                gated.forget(victim)
            if streams is not None:
                streams.forget(victim)
        elif r < 0.31:
            events.append(ResetPrefixCache(rng.random() < 0.3))
        else:
            if gated is not None:
                events.extend(gated.before_step())
            if kv_requests is not None:
                events.extend(kv_requests.before_step())
            if streams is not None:
                events.extend(streams.before_step())
            if config.max_concurrent_batches > 1 and mode_rng.random() < 0.15:
                # schedule(N+1), then an abort or an arrival, then update(N)
                events.append(Schedule())
                if mode_rng.random() < 0.6:
                    victim = mode_rng.choice(live)
                    events.append(Abort(victim))
                    if gated is not None:
                        gated.forget(victim)
                    if streams is not None:
                        streams.forget(victim)
                else:
                    req = make()
                    events.append(AddRequest(req))
                events.append(Update())
            else:
                events.append(Step())
            steps += 1
            # Requests finish on their own; forget some so aborts stay likely
            # to name live requests (an abort of a finished one is dropped by
            # the driver).
            if len(live) > 16:
                live = live[-16:]
    if gated is not None:
        events.extend(gated.finish())
    if kv_requests is not None:
        events.extend(kv_requests.finish())
        events = keep_failed_sync_loads_alive(events, config)
    if streams is not None:
        events.extend(streams.finish())
    return Workload(config=config, events=tuple(events), seed=seed,
                    features=tuple(f"gate:{g}" for g in chosen) + tuple(f"kv:{k}" for k in kv_chosen)
                    + (("sessions",) if streams is not None else ())
                    + ((f"pipeline:k={config.max_concurrent_batches}",) if config.pipeline_parallel_size > 1 else ())
                    + (runner_feature(config) if runner else ()))
