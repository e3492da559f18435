"""Deadlock freedom and the liveness bound, over the whole explored graph.

Only the step event matters here: from every state, the step-only run is a
path in the functional graph ``state -> its step successor``. A state without
unfinished requests has drained (distance 0); any other state drains in
1 + its successor's distance. A step-only run that cycles through states with
unfinished requests never finishes them: a deadlock (or livelock). Otherwise
the greatest distance is the liveness bound: with no new arrivals every
request finishes within that many steps.
"""

from __future__ import annotations

from dataclasses import dataclass

_UNKNOWN, _ON_PATH, _NEVER = -1, -2, -3


@dataclass(frozen=True)
class Deadlock:
    """The shallowest state that cannot drain, and its step-only run: ``steps``
    steps reach a state already on the run, closing a cycle of ``cycle`` states."""

    start: int
    steps: int
    cycle: int


@dataclass(frozen=True)
class Drained:
    """Every state drains; ``worst`` takes the most steps, ``steps`` of them."""

    worst: int
    steps: int


def drain_distances(step_succ: list[int], busy: bytearray) -> list[int]:
    """Steps to drain from every state; -3 for a state whose step-only run
    never drains."""
    n = len(step_succ)
    dist = [0 if not busy[i] else _UNKNOWN for i in range(n)]
    for i in range(n):
        if dist[i] != _UNKNOWN:
            continue
        path: list[int] = []
        j = i
        while dist[j] == _UNKNOWN:
            dist[j] = _ON_PATH
            path.append(j)
            j = step_succ[j]
        d = dist[j]
        if d == _ON_PATH or d == _NEVER:  # a cycle of busy states, or the way into one
            for k in path:
                dist[k] = _NEVER
            continue
        for k in reversed(path):
            d += 1
            dist[k] = d
    return dist


def analyse(step_succ: list[int], busy: bytearray, depth: list[int]) -> Deadlock | Drained:
    """The deadlock with the shallowest start (ties: the first found), or the
    worst drain (ties: the first state)."""
    dist = drain_distances(step_succ, busy)
    stuck = [i for i in range(len(dist)) if dist[i] == _NEVER]
    if stuck:
        start = min(stuck, key=lambda i: (depth[i], i))
        on_run: list[int] = []
        j = start
        while j not in on_run:
            on_run.append(j)
            j = step_succ[j]
        return Deadlock(start, len(on_run), len(on_run) - on_run.index(j))
    worst = max(range(len(dist)), key=lambda i: (dist[i], -i))
    return Drained(worst, dist[worst])
