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
``CheckSettings.drawn_modes``, as the random generator draws it. A run that
is random throughout (CheckSettings.random_throughout) has no narrow turn.
A narrow workload has a seed of its own (narrow_seed) and its rule counts
stay out of the guided focus, so the core and guided workloads of a run are
those of a run without them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import Workload


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


def families(kv: Sequence[str], engine: Sequence[str]) -> tuple[str, ...]:
    """The rotation of a run's narrow workloads: plain, each KV feature of
    ``kv``, then each engine family of ``engine`` (what the run draws:
    CheckSettings.drawn_kv, drawn_engine)."""
    return ("plain",) + tuple(f"kv:{k}" for k in kv) + tuple(e for e in ENGINE_FAMILIES if e in engine)


def is_narrow(base: int, first_phase: int, turns: int) -> bool:
    """Whether the next workload of a run is a narrow one, after ``base``
    others and ``turns`` narrow ones: once the others are past the first
    ``first_phase`` (the dense and the first core phase), one narrow
    workload, then one after every NARROW_EVERY - 1 others."""
    return base >= first_phase + turns * (NARROW_EVERY - 1)


def narrow_workload(seed: int, num_steps: int, family: str, vocab: int, modes: Sequence[str],
                    gates: Sequence[str], always_gates: Sequence[str]) -> Workload:
    """The narrow workload of ``seed`` with ``family`` (one of families()):
    a random workload in ``modes`` with ``gates`` (a subset drawn, those of
    ``always_gates`` in every one) and that family, named ``narrow``, its
    first feature ``family:FAMILY``."""
    kv = (family[3:],) if family.startswith("kv:") else ()
    workload = random_workload(seed, num_steps, vocab=vocab, modes=modes, gates=gates, kv=kv,
                               always_gates=always_gates, sessions=family == "sessions",
                               pipeline=family == "pipeline", runner=family == "runner")
    return dataclasses.replace(workload, name="narrow", features=(f"family:{family}",) + workload.features)
