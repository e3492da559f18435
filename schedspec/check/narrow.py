"""The narrow workloads of a guided check: one family at a time.

A guided workload draws from everything the scheduler under test declares:
modes, gates, KV features and engine features at once, aimed at the rules
reached least. A path that needs one feature under pressure (an asynchronous
load waiting for blocks, a session preempted with a step in flight, a hybrid
layout's preemption with no hit) then waits behind every other draw. After
the first phase (check/gate.py, ``core_first``), one workload in
``CORE_EVERY`` that is not a core one is narrow instead of guided: a plain
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
random throughout and has no narrow turn.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import Workload

if TYPE_CHECKING:
    from schedspec.check.gate import CheckSettings

#: the engine families a narrow workload turns on alone (random_workload's flags)
ENGINE_FAMILIES: tuple[str, ...] = ("sessions", "pipeline", "runner")

#: the offset, within CORE_EVERY, of the narrow workloads after the first
#: phase (a core one is at offset 0)
NARROW_OFFSET = 1


def families(settings: "CheckSettings") -> tuple[str, ...]:
    """The rotation of a run's narrow workloads: plain, each KV feature the
    run draws, then each engine family it draws."""
    engine = settings.drawn_engine
    return (("plain",) + tuple(f"kv:{k}" for k in settings.drawn_kv)
            + tuple(e for e in ENGINE_FAMILIES if e in engine))


def has_narrow(settings: "CheckSettings") -> bool:
    """Whether the run interleaves narrow workloads (a guided run that is
    not random throughout)."""
    return settings.generator == "guided" and not (settings.sessions or settings.pipeline or settings.runner)


def is_narrow(index: int, first: int, every: int) -> bool:
    """Whether the workload number ``index`` after the dense phase is a
    narrow one: past the first ``first`` (the core phase), at NARROW_OFFSET
    of each ``every`` (check/gate.py's CORE_EVERY, whose offset 0 is core)."""
    return index >= first and index % every == NARROW_OFFSET


def narrow_workload(settings: "CheckSettings", seed: int, num_steps: int, turn: int) -> Workload:
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
