"""``schedspec modelcheck``: explore every state of a bound (TLC-style) over
``schedspec.modelcheck.check_bound``.

Exit status: 0 everything held over the whole bound; 1 a failure (its
shortest counterexample is written as a trace that ``schedspec replay``
replays); 2 bad usage (the message names the flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from schedspec.adapters.registry import AdapterError, Target, import_class, resolve
from schedspec.check.capabilities import Capabilities, CapabilityError, rules_within
from schedspec.check.gate import missing_rules_message, resolve_selection
from schedspec.check.features import GATE_CAPABILITIES, GATES, MODES
from schedspec.check.features import mode_of as config_mode
from schedspec.check.deadline import DEFAULT_CALL_TIMEOUT, Interrupted, guarded, interruptible
from schedspec.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    UsageError,
    add_call_timeout_argument,
    add_mode_arguments,
    call_timeout_of,
    check_output_dir,
    check_output_file,
    mode_of,
    parse_shard,
    positive_int,
)
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
from schedspec.modelcheck.outputs import stateless
from schedspec.modelcheck.shard import merge_reports, shard_spaces
from schedspec.modelcheck.target import Against
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.effects import effects_line, effects_table
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
    add_call_timeout_argument(p)
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
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="explore only every N-th space of the bound from the K-th (a CI matrix job); "
                        "--merge joins the shards' --json reports")
    p.add_argument("--merge", nargs="+", default=None, metavar="SHARD.json",
                   help="explore nothing: merge the --json reports of every shard of one run into one report "
                        "(printed, and written to --json)")
    add_mode_arguments(p, " (invariants mode needs --against)")
    p.add_argument("--kv-events", action="store_true",
                   help="every space with the KV cache events on, taken after every update and compared")
    p.add_argument("--stats", action="store_true",
                   help="the spec and the scheduler under test built with log_stats, make_stats() compared after "
                        "every update")


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


def rules_line(counts: Counter[str], modes: tuple[str, ...] = EXPLORED_MODES, gates: tuple[str, ...] = (),
               capabilities: Capabilities | None = None) -> str:
    """One line: how many of the rules the explored modes (and admission
    gates) can reach were taken, those never taken (or the rarest), and how
    many rules lie outside them; with the ``capabilities`` of a scheduler
    under test, the rules they put out of reach are outside too."""
    reachable = reachable_in(modes, gates)
    narrowed = "" if capabilities is None else " within the declared capabilities"
    if capabilities is not None:
        narrowed = "" if rules_within(capabilities, reachable) == reachable else narrowed
        reachable = rules_within(capabilities, reachable)
    missing = rule_coverage.unreached(counts, reachable)
    got = len(reachable) - len(missing)
    if missing:
        tail = "never reached: " + ", ".join(missing)
    else:
        rarest = sorted(((n, counts.get(n, 0)) for n in reachable), key=lambda kv: kv[1])[:3]
        tail = "rarest: " + ", ".join(f"{n} {c:,}" for n, c in rarest)
    outside = len(RULE_NAMES) - len(reachable)
    where = f"{'/'.join(modes)} mode" + (f" with the {'/'.join(gates)} gate(s)" if gates else "")
    return (f"rule coverage: {got} of the {len(reachable)} rules reachable in {where}{narrowed} "
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
    if args.merge is not None:
        if args.shard is not None:
            raise UsageError("--merge and --shard exclude each other (--merge joins the shards' reports)")
        return run_merge(args)
    shard = parse_shard(args.shard) if args.shard else None
    scheduler_cls = scheduler_class(args.scheduler)
    workers = default_workers() if args.workers is None else positive_int("--workers", args.workers)
    max_states = None if args.max_states is None else positive_int("--max-states", args.max_states)
    try:
        spaces = select_spaces(bound(args.bound), args.space)
    except ModelCheckError as exc:
        raise UsageError(f"--space: {exc}") from None
    deadline = call_timeout_of(args)
    check_output_dir("--out", Path(args.out))
    if args.json:
        check_output_file("--json", Path(args.json))
    against, selection = against_of(args)
    caps = resolve(args.against).capabilities if args.against is not None else None
    for flag, cap in (("--kv-events", "kv_events"), ("--stats", "stats")):
        if getattr(args, cap, False) and caps is not None and not getattr(caps, cap):
            raise UsageError(f"{flag}: {args.against} does not declare Capabilities.{cap}")
    names, skipped = supported_spaces(spaces, args.against)
    if not names:
        raise UsageError(f"--against {args.against}: supports none of the spaces chosen: {'; '.join(skipped)}"
                         + _bounds_it_supports(args.against))
    # the rules a run can reach are those of the spaces it explores, not of the ones skipped
    explored = [s for s in spaces if s.name in set(names)]
    modes, gates = explored_modes(explored), explored_gates(explored)
    required = required_rules(args.require_rules, modes, gates)
    if caps is not None and args.require_rules == "all":
        required = rules_within(caps, required)
    if shard is not None:
        every = len(names)
        names = shard_spaces(names, *shard)
        print(f"shard {shard[0]}/{shard[1]}: {len(names)} of the {every} space(s): {', '.join(names) or 'none'} "
              "(merge the shards' --json reports with --merge)")
    use_impl = not args.no_impl and against is None
    note = ""
    if use_impl and not impl_available():
        use_impl = False
        note = " (impl.ImplScheduler is not importable: differential skipped)"
    if against is not None:
        under_test = (f"{against.name} taking every transition: " + selection.describe())
    else:
        under_test = ("ImplScheduler replaying every transition" if use_impl else "no impl differential") + note
    n = len(stateless(selection.invariants) if getattr(args, "kv_events", False) else selection.invariants)
    print(f"modelcheck: bound {args.bound}, {len(names)} space(s); {n} invariants on "
          f"every transition, the fake model's KV reads and contents, deadlock and liveness; "
          + under_test + f"; {workers} worker(s)"
          + "".join(f"; {what} compared after every update" for flag, what in
                    (("kv_events", "KV cache events (the kv-events-* invariants, which fold the stream's "
                                   "history, left to schedspec check)"),
                     ("stats", "statistics")) if getattr(args, flag, False))
          + (" (one where the scheduler under test is copied by deepcopy, as vLLM's is)"
             if against is not None and workers > 1 else ""))
    if skipped:
        print("spaces outside the declared capabilities, left out: " + "; ".join(skipped))
    print(table_header())

    def row(r: SpaceResult) -> None:
        print(format_row(r), flush=True)
        if r.note:
            print(f"  ({r.space.name}: {r.note})", flush=True)

    done: list[SpaceResult] = []

    def row_kept(r: SpaceResult) -> None:
        done.append(r)
        row(r)

    try:
        with guarded(deadline), interruptible():
            result = BoundResult(args.bound) if not names else check_bound(
                args.bound, use_impl=use_impl, scheduler_cls=scheduler_cls, max_states=max_states,
                log=None if args.quiet else sys.stderr, spaces=names, workers=workers,
                on_space=row_kept, invariants=selection.invariants, against=against,
                kv_events=getattr(args, "kv_events", False), stats=getattr(args, "stats", False))
    except ImportError as exc:  # vLLM missing, or the wrong version of it
        raise UsageError(f"--against {args.against}: {exc}") from None
    except Interrupted as exc:
        return _interrupted(args, exc, done)
    print(format_row(result.total()))
    extra: dict[str, Any] = {"impl": use_impl, "workers": workers, "invariants": n,
                             "against": args.against, "mode": selection.mode,
                             "invariant_ids": list(selection.ids)}
    if result.failure is not None:
        extra.update(_report_failure(args, result))
    else:
        _report_success(result, use_impl, args.against)
    rules = result.rules
    print(rule_coverage.format_table(rules, modes=modes, gates=gates) if args.rules
          else rules_line(rules, modes, gates, caps))
    print(effects_table(rules, modes, gates) if args.rules else effects_line(rules, modes, gates))
    missing = rule_coverage.unreached(rules, required) if shard is None else []
    if missing:
        print(f"FAILED: {missing_rules_message(missing)}")
    elif shard is not None and required:
        print("--require-rules: checked when the shards are merged")
    extra["rules_required"] = list(required)
    extra["rules_missing"] = missing
    if shard is not None:
        extra["shard"] = {"k": shard[0], "n": shard[1]}
    if args.json:
        write_json(Path(args.json), result, extra)
    return EXIT_OK if result.failure is None and not missing else EXIT_FAIL


def _interrupted(args: argparse.Namespace, exc: Interrupted, done: list[SpaceResult]) -> int:
    """A SIGINT or SIGTERM: the spaces explored whole so far (their rows
    are printed above), a JSON marked interrupted, the signal's exit status."""
    states = sum(r.states for r in done)
    print(f"interrupted ({exc.name}) after {len(done)} space(s) explored whole ({states:,} states): "
          f"no violation so far; the space in progress not counted")
    if args.json:
        payload = {"result": "interrupted", "signal": exc.name, "bound": args.bound,
                   "spaces_done": [r.space.name for r in done], "states": states}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return exc.exit_status


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
    if failure.kind == "timeout" and args.call_timeout != DEFAULT_CALL_TIMEOUT:
        replay += f" --call-timeout {args.call_timeout:g}"
    if getattr(args, "stats", False):
        replay += " --stats"
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


def run_merge(args: argparse.Namespace) -> int:
    """``--merge``: one report from the shards' JSON reports, printed and written to --json."""
    reports: dict[str, dict[str, Any]] = {}
    for path in args.merge:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--merge: cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise UsageError(f"--merge: {path} is not a modelcheck --json report")
        reports[path] = data
    try:
        merged = merge_reports(reports)
    except (ModelCheckError, KeyError, TypeError) as exc:
        raise UsageError(f"--merge: {exc}") from None
    print(f"modelcheck: bound {merged['bound']}, {len(merged['spaces'])} space(s) merged from "
          f"{merged['merged_shards']} shard(s)")
    print(table_header())
    for s in merged["spaces"]:
        status = "FAIL" if s["failure"] else ("ok" if s["complete"] else "partial")
        live = "-" if s["liveness_bound"] is None else str(s["liveness_bound"])
        print(f"{s['space']['name']:34s} {s['states']:>10,} {s['transitions']:>11,} {s['depth']:>6} "
              f"{s['elapsed_s']:>9.1f}s {'':>10} {s['cpu_s']:>8.1f}s {'':>10} {live:>9}  {status}")
    if merged["result"] == "fail":
        failed = next(s for s in merged["spaces"] if s["failure"])
        print(f"FAILED in space {failed['space']['name']}: {failed['failure']['kind']}: {failed['failure']['message']}")
        if "replay" in merged:
            print(f"replay it: {merged['replay']}")
    else:
        complete = all(s["complete"] for s in merged["spaces"])
        print(f"OK: {merged['states']:,} states and {merged['transitions']:,} transitions "
              f"{'completely explored' if complete else 'explored up to --max-states (partial)'} in "
              f"{merged['merged_shards']} shard(s): every invariant held, no deadlock")
    spaces = [sp for sp in bound(merged["bound"]).spaces if sp.name in {s["space"]["name"] for s in merged["spaces"]}]
    print(rules_line(Counter(merged["rules"]), explored_modes(spaces) or EXPLORED_MODES, explored_gates(spaces)))
    print(effects_line(Counter(merged["effects"]), explored_modes(spaces) or EXPLORED_MODES, explored_gates(spaces)))
    if merged["rules_missing"]:
        print(f"FAILED: {missing_rules_message(merged['rules_missing'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(merged, indent=2) + "\n")
    return EXIT_OK if merged["result"] == "pass" and not merged["rules_missing"] else EXIT_FAIL
