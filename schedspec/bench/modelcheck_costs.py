"""Where the model checker's time goes, measured side by side in one process.

    python -m schedspec.bench.modelcheck_costs [--bound small] [--rounds 5] [--space NAME ...]

Explores the bound's spaces (one process, no workers) in four modes, interleaved
round by round so that a noisy machine disturbs them alike, and prints the median
CPU seconds, states per CPU-second and microseconds per transition of each:

1. search only: copy the spec (its clone()), apply the event, take its view and
   fingerprint it, the fake model and the KV contents check (``invariants=()``,
   no impl);
2. + the invariant catalogue (what ``--no-impl`` runs);
3. + ImplScheduler replaying every transition on a pickle round-trip copy;
4. + ImplScheduler replaying every transition on its own ``clone()`` (the CLI).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from typing import Any, Sequence

from schedspec import modelcheck as mc
from schedspec.impl import ImplScheduler
from schedspec.invariants import CATALOGUE


class _PickledImpl(ImplScheduler):
    """ImplScheduler without clone(): the checker copies it by pickling."""

    clone = None  # type: ignore[assignment]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


MODES: list[tuple[str, Any, Sequence[Any]]] = [
    ("search only (spec clone, event, view, fingerprint, KV model)", None, ()),
    ("+ every invariant (--no-impl)", None, CATALOGUE),
    ("+ impl differential, pickle copies", _PickledImpl, CATALOGUE),
    ("+ impl differential, clone() (the default)", ImplScheduler, CATALOGUE),
]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bound", default="small", choices=sorted(mc.BOUNDS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--space", action="append", default=None)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    spaces = [s for s in mc.bound(args.bound).spaces if args.space is None or s.name in args.space]
    if not spaces:
        p.error(f"no space of bound {args.bound} is named {args.space}")
    cpu: dict[str, list[float]] = {m[0]: [] for m in MODES}
    counts: dict[str, tuple[int, int]] = {}
    for _ in range(args.rounds):
        for name, impl, invs in MODES:
            start = _cpu()
            states = transitions = 0
            for space in spaces:
                r = mc.Explorer(space, impl_cls=impl, invariants=invs, workers=1).run()
                if r.failure is not None:
                    print(r.failure.describe(), file=sys.stderr)
                    return 1
                states += r.states
                transitions += r.transitions
            cpu[name].append(_cpu() - start)
            counts[name] = (states, transitions)
    width = max(len(m[0]) for m in MODES)
    print(f"bound {args.bound}, {len(spaces)} space(s), {args.rounds} round(s), one process")
    print(f"{'mode':{width}}  {'states':>8} {'transitions':>11} {'CPU s (median)':>14} "
          f"{'states/CPU-s':>12} {'us/transition':>13}  rounds (CPU s)")
    for name, runs in cpu.items():
        c = statistics.median(runs)
        states, transitions = counts[name]
        print(f"{name:{width}}  {states:8,d} {transitions:11,d} {c:14.2f} {states / c:12,.0f} "
              f"{1e6 * c / transitions:13.0f}  {', '.join(f'{x:.2f}' for x in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
