"""``schedspec modelcheck``: explore every state of a bound (TLC-style) over
``schedspec.modelcheck.check_bound``.

Exit status: 0 everything held over the whole bound; 1 a failure (its
shortest counterexample is written as a trace that ``schedspec replay``
replays); 2 bad usage (the message names the flag).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from schedspec.adapters.registry import AdapterError, Target, import_class, resolve
from schedspec.check.capabilities import CapabilityError
from schedspec.check.gate import missing_rules_message, resolve_selection
from schedspec.check.features import GATE_CAPABILITIES, GATES, MODES
from schedspec.check.features import mode_of as config_mode
from schedspec.cli.common import EXIT_FAIL, EXIT_OK, UsageError, add_mode_arguments, mode_of, positive_int
from schedspec.invariants import Selection
from schedspec.invariants.selection import SelectionError
from schedspec.modelcheck import (
    BOUNDS,
    BoundResult,
    ModelCheckError,
    Space,
    SpaceResult,
    bound,
    check_bound,
    default_workers,
    format_row,
    impl_available,
    select_spaces,
    space_problems,
    table_header,
    write_json,
)
from schedspec.modelcheck.target import Against
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.rule_names import RULE_NAMES, reachable_in
from schedspec.spec.scheduler import SpecScheduler

HELP = ("explore every state within a bound (TLC-style): invariants, deadlock, liveness, and a scheduler under "
        "test (impl by default, --against vllm|MODULE:CLASS) taking every transition")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bound", default="small", choices=sorted(BOUNDS),
                   help="which spaces to explore (docs/modelcheck.md; default small)")
    p.add_argument("--json", default=None, help="write a JSON summary here")
    p.add_argument("--no-impl", action="store_true", help="skip the ImplScheduler differential (no --against)")
    p.add_argument("--against", default=None, metavar="impl|vllm|MODULE:CLASS",
                   help="the scheduler under test: takes every explored transition from the same state "
                        "(default: impl, in lockstep)")
    p.add_argument("--out", default="schedspec-out/modelcheck", help="where a counterexample trace goes")
    p.add_argument("--workers", default=None, help="processes expanding states (default: the CPUs available)")
    p.add_argument("--space", action="append", default=None, help="explore only this space (repeatable)")
    p.add_argument("--max-states", default=None, help="stop each space after this many states (partial)")
    p.add_argument("--scheduler", default=None, metavar="MODULE:CLASS",
                   help="explore this SpecScheduler subclass instead of the spec (e.g. a patched spec)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--rules", action="store_true", help="print the rule-coverage table (every rule, its count)")
    p.add_argument("--require-rules", default=None, metavar="all|NAME,...",
                   help="fail (exit 1) when one of these rules of the spec (spec/rule_names.py; 'all': every rule "
                        "the explored modes can reach, kv or kv.* a group) was never taken")
    add_mode_arguments(p, " (invariants mode needs --against)")


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


def against_of(args: argparse.Namespace) -> tuple[Against | None, Selection]:
    """The scheduler under test and the invariants checked, from --against,
    --mode and --invariants (UsageError naming the flag otherwise)."""
    mode = mode_of(args)
    target: Target | None = None
    if args.against is not None:
        if args.no_impl:
            raise UsageError("--no-impl and --against exclude each other (--against names the scheduler under test)")
        try:
            target = resolve(args.against)
        except AdapterError as exc:
            raise UsageError(str(exc)) from None
        if target.name == "spec":
            raise UsageError("--against spec: the spec is what is explored; name another scheduler "
                             "(impl, vllm or MODULE:CLASS)")
    elif mode == "invariants":
        raise UsageError("--mode invariants needs --against (the scheduler held to the invariants)")
    try:
        selection = resolve_selection(mode, args.invariants, target.capabilities if target else
                                      resolve("spec").capabilities)
    except (SelectionError, CapabilityError) as exc:
        raise UsageError(f"--invariants: {exc}") from None
    if target is None:
        return None, selection
    caps = target.capabilities
    return Against(args.against, target.factory, mode, selection.invariants, aborts=caps.abort,
                   resets=caps.reset_prefix_cache), selection


def _bounds_it_supports(target_name: str | None) -> str:
    """``; the bounds with spaces it supports: NAME (N), ...`` (what to run
    instead, e.g. the async spaces of ``modes`` for a vLLM AsyncScheduler
    subclass), or "" when none has any."""
    counts = [(b, len(supported_spaces(select_spaces(bound(b), None), target_name)[0])) for b in BOUNDS]
    have = [f"--bound {b} ({n} space{'s' if n != 1 else ''})" for b, n in counts if n]
    return f"; the bounds with spaces it supports: {', '.join(have)}" if have else ""


def supported_spaces(spaces: tuple[Space, ...], target_name: str | None) -> tuple[list[str], list[str]]:
    """The names of the spaces the scheduler under test supports (its
    declared capabilities) and, apart, one line per space left out and why."""
    if target_name is None:
        return [s.name for s in spaces], []
    caps = resolve(target_name).capabilities
    kept: list[str] = []
    skipped: list[str] = []
    for s in spaces:
        problems = space_problems(s, caps)
        if problems:
            skipped.append(f"{s.name} ({', '.join(problems)})")
        else:
            kept.append(s.name)
    return kept, skipped


#: the modes of scheduling the small, medium and large bounds run in (spec/rule_names.py ALL_MODES)
EXPLORED_MODES: tuple[str, ...] = ("sync",)


def explored_modes(spaces: Sequence[Space]) -> tuple[str, ...]:
    """The modes (sync, async, spec, async-spec) the spaces run in, in MODES order."""
    found = {config_mode(s.config) for s in spaces}
    return tuple(m for m in MODES if m in found)


def explored_gates(spaces: Sequence[Space]) -> tuple[str, ...]:
    """The admission gates the spaces exercise, in GATES order, by their
    capability names (what spec/rule_names.py's rules list)."""
    found = {g for s in spaces for g in s.gates()}
    return tuple(GATE_CAPABILITIES[g] for g in GATES if g in found)


def rules_line(counts: Counter[str], modes: tuple[str, ...] = EXPLORED_MODES, gates: tuple[str, ...] = ()) -> str:
    """One line: how many of the rules the explored modes (and admission
    gates) can reach were taken, those never taken (or the rarest), and how
    many rules lie outside them."""
    reachable = reachable_in(modes, gates)
    missing = rule_coverage.unreached(counts, reachable)
    got = len(reachable) - len(missing)
    if missing:
        tail = "never reached: " + ", ".join(missing)
    else:
        rarest = sorted(((n, counts.get(n, 0)) for n in reachable), key=lambda kv: kv[1])[:3]
        tail = "rarest: " + ", ".join(f"{n} {c:,}" for n, c in rarest)
    outside = len(RULE_NAMES) - len(reachable)
    where = f"{'/'.join(modes)} mode" + (f" with the {'/'.join(gates)} gate(s)" if gates else "")
    return (f"rule coverage: {got} of the {len(reachable)} rules reachable in {where} "
            f"reached; {tail} ({outside} more need other modes or gates, or are out of reach)")


def required_rules(text: str | None, modes: tuple[str, ...] = EXPLORED_MODES,
                   gates: tuple[str, ...] = ()) -> tuple[str, ...]:
    if text is None:
        return ()
    try:
        return rule_coverage.parse_required(text, modes, gates)
    except ValueError as exc:
        raise UsageError(f"--require-rules: {exc}") from None


def run(args: argparse.Namespace) -> int:
    scheduler_cls = scheduler_class(args.scheduler)
    workers = default_workers() if args.workers is None else positive_int("--workers", args.workers)
    max_states = None if args.max_states is None else positive_int("--max-states", args.max_states)
    try:
        spaces = select_spaces(bound(args.bound), args.space)
    except ModelCheckError as exc:
        raise UsageError(f"--space: {exc}") from None
    modes = explored_modes(spaces)
    gates = explored_gates(spaces)
    required = required_rules(args.require_rules, modes, gates)
    against, selection = against_of(args)
    names, skipped = supported_spaces(spaces, args.against)
    if not names:
        raise UsageError(f"--against {args.against}: supports none of the spaces chosen: {'; '.join(skipped)}"
                         + _bounds_it_supports(args.against))
    use_impl = not args.no_impl and against is None
    note = ""
    if use_impl and not impl_available():
        use_impl = False
        note = " (impl.ImplScheduler is not importable: differential skipped)"
    if against is not None:
        under_test = (f"{against.name} taking every transition: " + selection.describe())
    else:
        under_test = ("ImplScheduler replaying every transition" if use_impl else "no impl differential") + note
    n = len(selection.invariants)
    print(f"modelcheck: bound {args.bound}, {len(names)} space(s); {n} invariants on "
          f"every transition, the fake model's KV reads and contents, deadlock and liveness; "
          + under_test + f"; {workers} worker(s)"
          + (" (one, for a scheduler that is copied by deepcopy, as vLLM's is)" if against is not None else ""))
    if skipped:
        print("spaces outside the declared capabilities, left out: " + "; ".join(skipped))
    print(table_header())

    def row(r: SpaceResult) -> None:
        print(format_row(r), flush=True)
        if r.note:
            print(f"  ({r.space.name}: {r.note})", flush=True)

    try:
        result = check_bound(args.bound, use_impl=use_impl, scheduler_cls=scheduler_cls, max_states=max_states,
                             log=None if args.quiet else sys.stderr, spaces=names, workers=workers,
                             on_space=row, invariants=selection.invariants, against=against)
    except ImportError as exc:  # vLLM missing, or the wrong version of it
        raise UsageError(f"--against {args.against}: {exc}") from None
    print(format_row(result.total()))
    extra: dict[str, Any] = {"impl": use_impl, "workers": workers, "invariants": n,
                             "against": args.against, "mode": selection.mode,
                             "invariant_ids": list(selection.ids)}
    if result.failure is not None:
        extra.update(_report_failure(args, result))
    else:
        _report_success(result, use_impl, args.against)
    rules = result.rules
    print(rule_coverage.format_table(rules, modes=modes, gates=gates) if args.rules else rules_line(rules, modes, gates))
    missing = rule_coverage.unreached(rules, required)
    if missing:
        print(f"FAILED: {missing_rules_message(missing)}")
    extra["rules_required"] = list(required)
    extra["rules_missing"] = missing
    if args.json:
        write_json(Path(args.json), result, extra)
    return EXIT_OK if result.failure is None and not missing else EXIT_FAIL


def _report_failure(args: argparse.Namespace, result: BoundResult) -> dict[str, str]:
    """Write the counterexample trace and say how to replay it."""
    failure = result.failure
    assert failure is not None
    space_name = result.spaces[-1].space.name
    trace_path = failure.write_trace(Path(args.out) / f"{args.bound}-{space_name}.jsonl")
    against = args.against or args.scheduler or ("impl" if failure.kind == "divergence" else "spec")
    replay = f"schedspec replay {trace_path} --against {against}"
    if mode_of(args) == "invariants":
        replay += " --mode invariants"
    if args.invariants is not None:
        replay += f" --invariants {args.invariants}"
    print(f"FAILED in space {space_name}: {failure.describe()}")
    print(f"counterexample: {len(failure.labels)} events (the shortest), written to {trace_path}")
    print(f"replay it: {replay}")
    return {"trace": str(trace_path), "replay": replay}


def _report_success(result: BoundResult, use_impl: bool, against: str | None) -> None:
    worst = result.worst_liveness()
    if worst is not None:
        print(f"liveness: with no new arrivals every request finishes within {worst.liveness_bound} steps "
              f"(worst case: space {worst.space.name}, path: {', '.join(worst.liveness_labels)})")
    total = result.total()
    what = "completely explored" if total.complete else "explored up to --max-states (partial)"
    print(f"OK: {result.states:,} states and {result.transitions:,} transitions {what}: every invariant held, "
          "no deadlock" + (", plans and views of ImplScheduler equal to the spec's" if use_impl else "")
          + (" (in the spaces it supports)" if use_impl and any(r.note for r in result.spaces) else "")
          + (f"; {against} took all {result.transitions:,} transitions" if against else ""))
