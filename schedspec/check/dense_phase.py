"""The dense phase: what a check run does first, before the core phase and
the swarm of check/gate.py (``core_first``, ``is_core``).

A bug of the core (queues, budgets, the pool, preemption, the prefix cache)
is met by the core workloads; the swarm spreads the rest of a run over modes,
gates and KV layouts, so one core workload in three reaches it. The dense
phase runs DENSE_FIRST short core workloads (DENSE_STEPS steps each: plain
requests, chunked prefill, preemption, prefix hits, stops, in as many
configurations per second as the core has) before anything else; the run
then goes on exactly as without it, the core phase first. A run with a step
goal spends at most a quarter of it here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

S = TypeVar("S", bound=Any)  # CheckSettings (check/gate.py imports this module)

#: how many short core workloads a run starts with (dense_first: fewer in a short run)
DENSE_FIRST = 48
#: the steps of each (at most the run's workload_steps)
DENSE_STEPS = 40


def dense_first(total_steps: int | None, workload_steps: int) -> int:
    """How many workloads the dense phase takes: DENSE_FIRST, or as many as
    fit in a quarter of a run with a step goal; none when the run's
    workloads are no longer than the phase's, or it plans fewer than four."""
    if workload_steps <= DENSE_STEPS or (total_steps is not None and total_steps < 4 * workload_steps):
        return 0
    if total_steps is None:
        return DENSE_FIRST
    return min(DENSE_FIRST, total_steps // 4 // DENSE_STEPS)


def core_first_after(first: int, dense: int) -> int:
    """The core phase's first stretch (gate.core_first) after a dense phase:
    one long core workload, then one in CORE_EVERY as before, so the swarm
    starts right after it (a bug of a gate or a KV layout is not kept
    waiting behind both phases); ``first`` when there was no dense phase."""
    return min(first, 1) if dense else first


def in_phase(index: int, dense: int) -> bool:
    """Whether the run's workload number ``index`` (0, 1, ...) is one of the
    dense phase's ``dense``."""
    return index < dense


def after_phase(index: int, dense: int) -> int:
    """The index the core phase and the swarm count from (is_core's)."""
    return index - dense


#: the fake model's vocabulary in the dense phase: a request's eos and stop
#: tokens are sampled four times as often as with the default 64, so a stop
#: handled wrong (eos despite ignore_eos, a stop token missed) shows in a few
#: short workloads. The counterexample records it (the trace's ``vocab``).
DENSE_VOCAB = 16


def phase_settings(settings: S, dense: bool) -> S:
    """``settings`` for one workload: the dense phase's vocabulary in it
    (never larger than the run's own)."""
    if not dense or settings.vocab <= DENSE_VOCAB:
        return settings
    return dataclasses.replace(settings, vocab=DENSE_VOCAB)
