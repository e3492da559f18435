"""``schedspec modelcheck``: explore every state of a bound (TLC-style) over
``schedspec.modelcheck.check_bound``.

Exit status: 0 everything held over the whole bound; 1 a failure (its
shortest counterexample is written as a trace that ``schedspec replay``
replays); 2 bad usage (the message names the flag).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from schedspec.adapters.registry import import_class
from schedspec.cli.common import EXIT_FAIL, EXIT_OK, UsageError, positive_int
from schedspec.invariants import CATALOGUE
from schedspec.modelcheck import (
    BOUNDS,
    BoundResult,
    ModelCheckError,
    SpaceResult,
    bound,
    check_bound,
    default_workers,
    format_row,
    impl_available,
    select_spaces,
    table_header,
    write_json,
)
from schedspec.spec.scheduler import SpecScheduler

HELP = "explore every state within a bound (TLC-style): invariants, deadlock, liveness, impl differential"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bound", default="small", choices=sorted(BOUNDS),
                   help="which spaces to explore (docs/modelcheck.md; default small)")
    p.add_argument("--json", default=None, help="write a JSON summary here")
    p.add_argument("--no-impl", action="store_true", help="skip the ImplScheduler differential")
    p.add_argument("--out", default="schedspec-out/modelcheck", help="where a counterexample trace goes")
    p.add_argument("--workers", default=None, help="processes expanding states (default: the CPUs available)")
    p.add_argument("--space", action="append", default=None, help="explore only this space (repeatable)")
    p.add_argument("--max-states", default=None, help="stop each space after this many states (partial)")
    p.add_argument("--scheduler", default=None, metavar="MODULE:CLASS",
                   help="explore this SpecScheduler subclass instead of the spec (e.g. a patched spec)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def scheduler_class(text: str | None) -> type[SpecScheduler]:
    """The class ``--scheduler`` names: a SpecScheduler subclass (its clone()
    copies it); the spec itself by default."""
    if text is None:
        return SpecScheduler
    cls = import_class(text, "--scheduler")
    if not issubclass(cls, SpecScheduler):
        raise UsageError(f"--scheduler: {text!r} is not a subclass of spec.scheduler.SpecScheduler "
                         "(the model checker explores the spec and its subclasses, copied by their clone())")
    return cls


def run(args: argparse.Namespace) -> int:
    scheduler_cls = scheduler_class(args.scheduler)
    workers = default_workers() if args.workers is None else positive_int("--workers", args.workers)
    max_states = None if args.max_states is None else positive_int("--max-states", args.max_states)
    try:
        spaces = select_spaces(bound(args.bound), args.space)
    except ModelCheckError as exc:
        raise UsageError(f"--space: {exc}") from None
    use_impl = not args.no_impl
    note = ""
    if use_impl and not impl_available():
        use_impl = False
        note = " (impl.ImplScheduler is not importable: differential skipped)"
    print(f"modelcheck: bound {args.bound}, {len(args.space or spaces)} space(s); {len(CATALOGUE)} invariants on "
          f"every transition, the fake model's KV reads and contents, deadlock and liveness; "
          + ("ImplScheduler replaying every transition" if use_impl else "no impl differential") + note
          + f"; {workers} worker(s)")
    print(table_header())

    def row(r: SpaceResult) -> None:
        print(format_row(r), flush=True)

    result = check_bound(args.bound, use_impl=use_impl, scheduler_cls=scheduler_cls, max_states=max_states,
                         log=None if args.quiet else sys.stderr, spaces=args.space, workers=workers,
                         on_space=row)
    print(format_row(result.total()))
    extra: dict[str, Any] = {"impl": use_impl, "workers": workers, "invariants": len(CATALOGUE)}
    if result.failure is not None:
        extra.update(_report_failure(args, result))
    else:
        _report_success(result, use_impl)
    if args.json:
        write_json(Path(args.json), result, extra)
    return EXIT_OK if result.failure is None else EXIT_FAIL


def _report_failure(args: argparse.Namespace, result: BoundResult) -> dict[str, str]:
    """Write the counterexample trace and say how to replay it."""
    failure = result.failure
    assert failure is not None
    space_name = result.spaces[-1].space.name
    trace_path = failure.write_trace(Path(args.out) / f"{args.bound}-{space_name}.jsonl")
    against = args.scheduler or ("impl" if failure.kind == "divergence" else "spec")
    replay = f"schedspec replay {trace_path} --against {against}"
    print(f"FAILED in space {space_name}: {failure.describe()}")
    print(f"counterexample: {len(failure.labels)} events (the shortest), written to {trace_path}")
    print(f"replay it: {replay}")
    return {"trace": str(trace_path), "replay": replay}


def _report_success(result: BoundResult, use_impl: bool) -> None:
    worst = result.worst_liveness()
    if worst is not None:
        print(f"liveness: with no new arrivals every request finishes within {worst.liveness_bound} steps "
              f"(worst case: space {worst.space.name}, path: {', '.join(worst.liveness_labels)})")
    total = result.total()
    what = "completely explored" if total.complete else "explored up to --max-states (partial)"
    print(f"OK: {result.states:,} states and {result.transitions:,} transitions {what}: every invariant held, "
          "no deadlock" + (", plans and views of ImplScheduler equal to the spec's" if use_impl else ""))
