"""The engine features of a guided workload (``schedspec check --engine``,
default all: features.ENGINE_FEATURES, within the scheduler's declared
capabilities).

A share of the guided workloads (ENGINE_RATE) draws, on a generator of its
own, what of the way vLLM's engine drives the scheduler it turns on: Model
Runner V1 or V2 and a pipeline size among those the config accepts with that
runner (check/pipeline.py, allowed_sizes; k plans in flight); a share of
those with drafts (DRAFTER_RATE) a drafter with its own forward pass (a
draft model's lookahead slots, EAGLE's hash lookahead) instead of n-gram; a
share (SESSION_RATE) makes some requests streaming-input sessions. A focus on a rule that needs Model Runner V2 (Rule.gates naming
runner_v2) turns V2 on, with a pipeline where the mode is async and a draft
model where it drafts; a focus on a rule that needs a drafter (Rule.gates
naming drafters: EAGLE's hash lookahead) draws EAGLE; a focus on a session
rule turns sessions on. A
workload that draws nothing is the one its seed gave before engine features
were drawn (every draw comes after the rest of the workload's).

What the spec does not model is left out as check/runner_draw.py leaves it:
EAGLE beside a KV connector, partial prefix-cache entries or sessions; a
draft model's slot where the budget has no room for it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from schedspec.spec.interface import SchedSpecError, SchedulerConfig
from schedspec.spec.rule_names import RULES
from schedspec.spec.validate import DRAFTERS

from schedspec.check.pipeline import allowed_sizes
from schedspec.check.runner_draw import modelled_drafter, runner_feature

#: The share of guided workloads (not the core ones) that draw a runner,
#: pipeline and drafter.
ENGINE_RATE = 0.35
#: The share of guided workloads with drafts whose drafter is a draft model
#: or EAGLE (the others: n-gram).
DRAFTER_RATE = 0.5
#: The share of guided workloads that make some requests sessions (besides
#: those whose focus is a session rule).
SESSION_RATE = 0.12


def engine_rng(seed: int | str) -> random.Random:
    """The generator of a workload's engine draws (its own)."""
    return random.Random(f"schedspec-engine-{seed}")


def needs(focus: Sequence[str], capability: str) -> bool:
    """Whether a focus rule needs ``capability`` (Rule.gates)."""
    return any(capability in RULES[rule].gates for rule in focus if rule in RULES)


def draw_sessions(engine: Sequence[str], focus: Sequence[str], rng: random.Random) -> bool:
    """Whether the workload makes some requests sessions."""
    if "sessions" not in engine:
        return False
    return rng.random() < SESSION_RATE or needs(focus, "sessions")


def _drafter(config: SchedulerConfig, rng: random.Random, v2: bool, sessions: bool, eagle_focus: bool) -> str:
    if eagle_focus:
        drafter = "eagle"
    elif v2:
        drafter = "draft_model"
    elif rng.random() < DRAFTER_RATE:
        drafter = rng.choice([d for d in DRAFTERS if d != "ngram"])
    else:
        drafter = "ngram"
    return modelled_drafter(config, drafter, sessions)


def with_engine(config: SchedulerConfig, engine: Sequence[str], focus: Sequence[str], rng: random.Random,
                sessions: bool = False) -> SchedulerConfig:
    """``config`` with the runner and pipeline size drawn among ``engine``
    (at ENGINE_RATE, always for a focus that needs Model Runner V2), and the
    drafter (at DRAFTER_RATE; a draft model for that focus, EAGLE for a
    focus on a rule that needs a drafter, where it is modelled); unchanged when
    the draws miss or the config takes none of them."""
    forced = "runner" in engine and needs(focus, "runner_v2")
    base, pp = config, config.pipeline_parallel_size
    if forced or rng.random() < ENGINE_RATE:
        runner = "v2" if forced else rng.choice(("v1", "v2")) if "runner" in engine else "v1"
        try:
            base = dataclasses.replace(config, model_runner=runner, pipeline_parallel_size=1)
        except SchedSpecError:
            return config
        sizes = allowed_sizes(base) if "pipeline" in engine else (1,)
        if forced and len(sizes) > 1:
            sizes = sizes[1:]  # V2's throttle needs a pipeline
        pp = rng.choice(sizes or (1,))
    eagle = needs(focus, "drafters") and not forced  # a focus on EAGLE's rule (kv.hash_lookahead_wait)
    drafter = _drafter(base, rng, forced, sessions, eagle) if "drafter" in engine else "ngram"
    if base is config and drafter == config.drafter:
        return config
    try:
        return dataclasses.replace(base, pipeline_parallel_size=pp, drafter=drafter)
    except SchedSpecError:
        return base


def engine_features(config: SchedulerConfig) -> tuple[str, ...]:
    """The workload features naming what was drawn: ``pipeline:k=K`` and
    check/runner_draw.py's ``runner:v2/pp3/eagle``."""
    out: tuple[str, ...] = ()
    if config.pipeline_parallel_size > 1:
        out += (f"pipeline:k={config.max_concurrent_batches}",)
    if config.model_runner != "v1" or config.drafter != "ngram" or config.pipeline_parallel_size > 1:
        out += runner_feature(config)
    return out
