"""``schedspec check``: random workloads in lockstep with the spec, every
invariant on every step (the loop is schedspec.check.gate.run_check)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from schedspec.check.gate import CheckSettings, check_summary, junit_xml, missing_rules_message, run_check
from schedspec.check.shrink import count_steps
from schedspec.spec.coverage import format_table, parse_required, rules_line
from schedspec.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    Progress,
    UsageError,
    lockstep_factories,
    parse_shard,
    positive_int,
)


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--against", default="spec", help="spec | impl | vllm | MODULE:CLASS (default spec)")
    c.add_argument("--steps", default=None, help="total steps to check (default 2000)")
    c.add_argument("--time", default=None, type=float, help="check for this many seconds instead")
    c.add_argument("--seed", default=0, type=int, help="first workload seed (default 0)")
    c.add_argument("--shard", default=None, help="K/N: this job takes seeds seed+K-1, seed+K-1+N, ...")
    c.add_argument("--out", default="schedspec-out", help="where counterexamples go (default schedspec-out/)")
    c.add_argument("--json", default=None, help="write a JSON summary here")
    c.add_argument("--junit", default=None, help="write JUnit XML here")
    c.add_argument("--workload-steps", default=200, type=int, help="steps per generated workload (default 200)")
    c.add_argument("--vocab", default=64, type=int, help="fake model vocabulary (default 64)")
    c.add_argument("--shrink-time", default=60.0, type=float, help="seconds to spend shrinking (default 60)")
    c.add_argument("--quiet", action="store_true", help="no progress line")
    c.add_argument("--plans-only", action="store_true",
                   help="fast lockstep: plans every step, views once per workload, no invariants")
    c.add_argument("--require-rules", default=None, metavar="all|NAME,...",
                   help="fail (exit 1) when one of these spec rules (spec/rule_names.py; a group such as "
                        "'kv' names all its rules) was never reached")
    c.add_argument("--rules", action="store_true", help="print the rule-coverage table (every rule, its count)")


def settings_from(args: argparse.Namespace) -> CheckSettings:
    """The flags as CheckSettings; UsageError naming the flag on bad values."""
    if args.steps is not None and args.time is not None:
        raise UsageError("--steps and --time: give one of them")
    total_steps = positive_int("--steps", args.steps) if args.steps is not None else None
    time_budget = float(args.time) if args.time is not None else None
    if time_budget is not None and time_budget <= 0:
        raise UsageError(f"--time: must be positive, got {args.time}")
    return CheckSettings(
        against=args.against,
        total_steps=total_steps,
        time_budget=time_budget,
        seed=args.seed,
        shard=parse_shard(args.shard) if args.shard else (1, 1),
        workload_steps=positive_int("--workload-steps", str(args.workload_steps)),
        vocab=args.vocab,
        shrink_time=args.shrink_time,
        plans_only=args.plans_only,
        out_dir=Path(args.out),
        require_rules=_required_rules(args.require_rules),
    )


def _required_rules(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    try:
        return parse_required(text)
    except ValueError as exc:
        raise UsageError(f"--require-rules: {exc}") from None


def run(args: argparse.Namespace) -> int:
    name, factories = lockstep_factories(args.against)
    settings = settings_from(args)
    progress = Progress(enabled=not args.quiet)
    try:
        outcome = run_check(factories, settings, progress=progress,
                            notice=lambda line: print(line, file=sys.stderr))
    finally:
        progress.close()
    if outcome.failure is not None:
        assert outcome.out_dir is not None and outcome.trace_path is not None
        print((outcome.out_dir / "steps.txt").read_text(), end="")
        events = outcome.counterexample.events if outcome.counterexample is not None else ()
        print(f"counterexample: {count_steps(events)} steps, {len(events)} events, written to {outcome.out_dir}/")
        print(f"replay it: schedspec replay {outcome.trace_path} --against {args.against}")
    else:
        stats = outcome.stats
        held = ("plans equal to the spec at every step, views at the end of each workload"
                if args.plans_only else "all invariants held"
                + ("" if name == "spec" else ", plans and views equal to the spec"))
        print(f"OK: {outcome.steps} steps in {outcome.workloads} workloads against {args.against}: {held}"
              + f" ({outcome.steps_per_s:,.0f} steps/s; {stats.preemptions} preemptions, {stats.hit_admissions}"
              f" prefix hits, {stats.chunks} prefill chunks)")
    if outcome.stats.rules:
        print(format_table(outcome.stats.rules) if args.rules else rules_line(outcome.stats.rules))
    if outcome.missing_rules:
        print(f"FAILED: {missing_rules_message(outcome.missing_rules)}")
    if args.json:
        Path(args.json).write_text(json.dumps(check_summary(settings, outcome), indent=2) + "\n")
    if args.junit:
        Path(args.junit).write_text(junit_xml(settings, outcome))
    return EXIT_OK if outcome.ok else EXIT_FAIL

