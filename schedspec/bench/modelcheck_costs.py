"""Where the model checker's time goes, measured side by side in one run.

    python -m schedspec.bench.modelcheck_costs [--bound small] [--rounds 5] [--space NAME ...]
                                               [--mode NAME ...] [--baseline DIR]

Explores the bound's spaces (one process, no workers) in these modes,
interleaved round by round so that a noisy machine disturbs them alike, and
prints the median CPU seconds, states per CPU-second and microseconds per
transition of each:

1. search only: copy the spec (its clone()), apply the event, take its view and
   fingerprint it, the fake model and the KV contents check (``invariants=()``,
   no impl);
2. + the invariant catalogue (what ``--no-impl`` runs);
3. + ImplScheduler replaying every transition on a pickle round-trip copy;
4. + ImplScheduler replaying every transition on its own ``clone()`` (the CLI);
5. the same, with the middle of every step checked in full (``incremental``
   off: how the checker checked before it checked each distinct middle once).

``--baseline DIR`` also runs modes 1, 2 and 4 with the checker of another
checkout (DIR, e.g. ``git worktree add /tmp/mc_base <commit>``) in a
subprocess, in the same rounds, and prints its rows beside these (its spaces:
those of the bound both checkouts have).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
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


#: (name, short name, impl class, invariants, incremental)
MODES: list[tuple[str, str, Any, Sequence[Any], bool]] = [
    ("search only (spec clone, event, view, fingerprint, KV model)", "search", None, (), True),
    ("+ every invariant (--no-impl)", "no-impl", None, CATALOGUE, True),
    ("+ impl differential, pickle copies", "pickle", _PickledImpl, CATALOGUE, True),
    ("+ impl differential, clone() (the default)", "default", ImplScheduler, CATALOGUE, True),
    ("  the same, every middle of a step checked in full", "full-middles", ImplScheduler, CATALOGUE, False),
]

#: The baseline's modes (what any version of the checker can run).
BASELINE_MODES = ("search", "no-impl", "default")

#: Run in the baseline checkout: explore the named spaces in one mode and print {states, transitions, cpu}.
_BASELINE_SCRIPT = """
import json, resource, sys
from schedspec import modelcheck as mc
from schedspec.impl import ImplScheduler
from schedspec.invariants import CATALOGUE
bound, mode, names = sys.argv[1], sys.argv[2], sys.argv[3:]
spaces = [s for s in mc.bound(bound).spaces if s.name in names] if names else list(mc.bound(bound).spaces)
if not names:
    print(json.dumps({"spaces": [s.name for s in spaces]})); sys.exit(0)
impl = ImplScheduler if mode == "default" else None
invs = () if mode == "search" else CATALOGUE
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c = cpu(); states = transitions = 0
for s in spaces:
    r = mc.Explorer(s, impl_cls=impl, invariants=invs, workers=1).run()
    assert r.failure is None, r.failure.describe()
    states += r.states; transitions += r.transitions
print(json.dumps({"states": states, "transitions": transitions, "cpu": cpu() - c}))
"""


def _baseline(directory: str, bound: str, mode: str, names: Sequence[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=directory)
    proc = subprocess.run([sys.executable, "-c", _BASELINE_SCRIPT, bound, mode, *names], cwd=directory, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the baseline in {directory} failed:\n{proc.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def _explore(spaces: Sequence[mc.Space], impl: Any, invs: Sequence[Any], incremental: bool) -> tuple[int, int, float]:
    start = _cpu()
    states = transitions = 0
    for space in spaces:
        e = mc.Explorer(space, impl_cls=impl, invariants=invs, workers=1)
        e.expander.incremental = incremental and not e.expander.blind
        r = e.run()
        if r.failure is not None:
            raise RuntimeError(r.failure.describe())
        states += r.states
        transitions += r.transitions
    return states, transitions, _cpu() - start


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--bound", default="small", choices=sorted(mc.BOUNDS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--space", action="append", default=None)
    p.add_argument("--mode", action="append", default=None, choices=[m[1] for m in MODES],
                   help="run only these modes (repeatable; default all)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="also run the checker of this checkout, side by side")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    spaces = [s for s in mc.bound(args.bound).spaces if args.space is None or s.name in args.space]
    if not spaces:
        p.error(f"no space of bound {args.bound} is named {args.space}")
    modes = [m for m in MODES if args.mode is None or m[1] in args.mode]
    base_modes: list[str] = []
    if args.baseline is not None:
        theirs = set(_baseline(args.baseline, args.bound, "", [])["spaces"])
        spaces = [s for s in spaces if s.name in theirs]
        if not spaces:
            p.error(f"the baseline's bound {args.bound} has none of these spaces")
        base_modes = [m for m in BASELINE_MODES if args.mode is None or m in args.mode]
    names = [s.name for s in spaces]
    rows: dict[str, list[float]] = {}
    counts: dict[str, tuple[int, int]] = {}
    for _ in range(args.rounds):
        for name, short, impl, invs, incremental in modes:
            states, transitions, cpu = _explore(spaces, impl, invs, incremental)
            rows.setdefault(name, []).append(cpu)
            counts[name] = (states, transitions)
        for short in base_modes:
            label = f"baseline: {dict((m[1], m[0]) for m in MODES)[short].strip()}"
            got = _baseline(args.baseline, args.bound, short, names)
            rows.setdefault(label, []).append(float(got["cpu"]))
            counts[label] = (int(got["states"]), int(got["transitions"]))
    width = max(len(n) for n in rows)
    print(f"bound {args.bound}, {len(spaces)} space(s) ({', '.join(names)}), {args.rounds} round(s), one process"
          + (f"; baseline: {args.baseline}" if args.baseline else ""))
    print(f"{'mode':{width}}  {'states':>8} {'transitions':>11} {'CPU s (median)':>14} "
          f"{'states/CPU-s':>12} {'us/transition':>13}  rounds (CPU s)")
    for name, runs in rows.items():
        c = statistics.median(runs)
        states, transitions = counts[name]
        print(f"{name:{width}}  {states:8,d} {transitions:11,d} {c:14.2f} {states / c:12,.0f} "
              f"{1e6 * c / transitions:13.0f}  {', '.join(f'{x:.2f}' for x in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
