"""The narrow workloads of a guided check: one family at a time.

A guided workload draws from everything the scheduler under test declares:
modes, gates, KV features and engine features at once, aimed at the rules
reached least. A path that needs one feature under pressure (an asynchronous
load waiting for blocks, a session preempted with a step in flight, a hybrid
layout's preemption with no hit) then waits behind every other draw. After
the first phase (check/gate.py, ``core_first``), one workload in
NARROW_EVERY is narrow, inserted between the core and guided ones: a plain
random workload (random_workloads.random_workload: arrivals in bursts,
aborts, resets, tight pools) with the family of its turn, in rotation:

- ``plain``: the gates alone, no KV or engine feature;
- ``kv:connector``, ``kv:hybrid``: that KV feature (drawn as any KV feature
  is, so some workloads of the turn go without it), and the gates;
- ``sessions``, ``pipeline``, ``runner``: that engine feature (sessions
  without a connector; a pipeline of k plans in flight; the model runner,
  its pipeline and drafter), and the gates.

Only the families the scheduler under test supports are in the rotation
(CheckSettings.drawn_kv, drawn_engine). The mode is drawn per workload among
``CheckSettings.drawn_modes``, as the random generator draws it. A run with
``--generator random``, ``--sessions``, ``--pipeline`` or ``--runner`` is
random throughout and has no narrow turn. A narrow workload has a seed of
its own (narrow_seed) and its rule counts stay out of the guided focus, so
the core and guided workloads of a run are those of a run without them.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from schedspec.check.capabilities import Capabilities
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import Workload


class NarrowSettings(Protocol):
    """What a narrow workload reads of a check's settings (check/gate.py's CheckSettings)."""

    @property
    def generator(self) -> str: ...

    @property
    def vocab(self) -> int: ...

    @property
    def sessions(self) -> bool: ...

    @property
    def pipeline(self) -> bool: ...

    @property
    def runner(self) -> bool: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def drawn_modes(self) -> tuple[str, ...]: ...

    @property
    def drawn_gates(self) -> tuple[str, ...]: ...

    @property
    def drawn_kv(self) -> tuple[str, ...]: ...

    @property
    def drawn_engine(self) -> tuple[str, ...]: ...


#: the engine families a narrow workload turns on alone (random_workload's flags)
ENGINE_FAMILIES: tuple[str, ...] = ("sessions", "pipeline", "runner")

#: after the first phase, one workload in NARROW_EVERY is narrow
NARROW_EVERY = 3

#: where the seeds of a run's narrow workloads start (narrow_seed): apart from
#: the others', which stay those of a run without narrow workloads
NARROW_SEEDS = 1_000_000


def narrow_seed(first: int, turn: int, shard_k: int, shard_n: int) -> int:
    """The seed of a run's ``turn``-th narrow workload (0, 1, ...): the
    run's first seed plus NARROW_SEEDS, then taken as shard K of N takes
    its other seeds."""
    return first + NARROW_SEEDS + turn * shard_n + (shard_k - 1)


def families(settings: NarrowSettings) -> tuple[str, ...]:
    """The rotation of a run's narrow workloads: plain, each KV feature the
    run draws, then each engine family it draws."""
    engine = settings.drawn_engine
    return (("plain",) + tuple(f"kv:{k}" for k in settings.drawn_kv)
            + tuple(e for e in ENGINE_FAMILIES if e in engine))


def has_narrow(settings: NarrowSettings) -> bool:
    """Whether the run interleaves narrow workloads (a guided run that is
    not random throughout)."""
    return settings.generator == "guided" and not (settings.sessions or settings.pipeline or settings.runner)


def is_narrow(base: int, first_phase: int, turns: int) -> bool:
    """Whether the next workload of a run is a narrow one, after ``base``
    others and ``turns`` narrow ones: once the others are past the first
    ``first_phase`` (the dense and the first core phase), one narrow
    workload, then one after every NARROW_EVERY - 1 others."""
    return base >= first_phase + turns * (NARROW_EVERY - 1)


def narrow_workload(settings: NarrowSettings, seed: int, num_steps: int, turn: int) -> Workload:
    """The ``turn``-th narrow workload of a run (0, 1, ...): a random
    workload of ``seed`` with the family ``families(settings)[turn % n]``,
    named ``narrow``, its first feature ``family:FAMILY``."""
    family = families(settings)[turn % len(families(settings))]
    kv = (family[3:],) if family.startswith("kv:") else ()
    workload = random_workload(
        seed, num_steps, vocab=settings.vocab, modes=settings.drawn_modes, gates=settings.drawn_gates, kv=kv,
        always_gates=settings.capabilities.always_gates(), sessions=family == "sessions",
        pipeline=family == "pipeline", runner=family == "runner")
    return dataclasses.replace(workload, name="narrow", features=(f"family:{family}",) + workload.features)
