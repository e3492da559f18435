"""The `schedspec` command line.

Exit status: 0 everything held; 1 a violation or divergence (a counterexample
is written); 2 bad input or usage (the message names the flag, file, line or
field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from xml.sax.saxutils import escape, quoteattr

from schedspec.spec.interface import SchedSpecError
from schedspec.check import report
from schedspec.check import trace as tracefile
from schedspec.adapters.registry import AdapterError, Target, resolve
from schedspec.check.driver import Failure, Runner, Stats
from schedspec.spec.interface import SchedulerFactory
from schedspec.check.shrink import count_steps, shrink
from schedspec.check.workload import Workload, random_workload

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def positive_int(flag: str, text: str) -> int:
    """A flag's value as a positive integer; UsageError naming the flag otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{flag}: expected an integer, got {text!r}") from None
    if value <= 0:
        raise UsageError(f"{flag}: must be positive, got {value}")
    return value


def _parse_shard(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    if not sep or not k.isdigit() or not n.isdigit():
        raise UsageError(f"--shard: expected K/N (e.g. 2/4), got {text!r}")
    kk, nn = int(k), int(n)
    if nn < 1 or not 1 <= kk <= nn:
        raise UsageError(f"--shard: need 1 <= K <= N, got {text!r}")
    return kk, nn


def _factories(target: Target, reference: str = "spec") -> dict[str, SchedulerFactory]:
    if target.name == reference:
        return {target.name: target.factory}
    return {reference: resolve(reference).factory, target.name: target.factory}


class Progress:
    """A live line on a terminal, a plain line every few seconds in CI logs."""

    def __init__(self, enabled: bool = True) -> None:
        self.tty = sys.stderr.isatty()
        self.enabled = enabled
        self.start = time.monotonic()
        self.last = 0.0

    def update(self, steps: int, total: int | None, stats: Stats, workloads: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        every = 0.2 if self.tty else 10.0
        if not force and now - self.last < every:
            return
        self.last = now
        elapsed = now - self.start
        rate = steps / elapsed if elapsed > 0 else 0.0
        if total:
            frac = min(steps / total, 1.0)
            bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
            head = f"[{bar}] {steps}/{total} steps"
        else:
            head = f"{steps} steps"
        line = (f"{head}  {rate:,.0f} steps/s  workloads {workloads}  preemptions {stats.preemptions}"
                f"  prefix hits {stats.hit_admissions}  chunks {stats.chunks}  {elapsed:,.1f}s")
        if self.tty:
            sys.stderr.write("\r" + line + "\x1b[K")
            if force:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


@dataclass
class CheckOutcome:
    steps: int
    workloads: int
    elapsed: float
    stats: Stats
    failure: Failure | None = None
    seed: int | None = None
    out_dir: Path | None = None
    trace_path: Path | None = None
    seeds: list[int] | None = None


def run_workload(workload: Workload, factories: dict[str, SchedulerFactory], vocab: int = 64,
                 oracle_seed: int = 0, keep_history: bool = False,
                 plans_only: bool = False) -> tuple[Runner, Failure | None]:
    """Run one workload. ``plans_only``: compare plans (and model outputs) at
    every step but views only once, at the end, with no invariants: the fast
    lockstep; a failure it finds is re-run with everything on."""
    runner = Runner(workload.config, factories, vocab=vocab, oracle_seed=oracle_seed,
                    keep_history=keep_history, check_invariants=not plans_only,
                    compare_views=not plans_only)
    failure = runner.run(workload.events)
    if failure is None and plans_only and len(factories) > 1:
        failure = runner.compare_final_views()
    return runner, failure


def write_counterexample(out_dir: Path, workload: Workload, failure: Failure,
                         factories: dict[str, SchedulerFactory], against: str, vocab: int, oracle_seed: int) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = out_dir / "trace.jsonl"
    tracefile.write(trace_path, tracefile.Trace(workload, vocab=vocab, oracle_seed=oracle_seed))
    runner, again = run_workload(workload, factories, vocab, oracle_seed, keep_history=True)
    records = runner.history or []
    (out_dir / "steps.txt").write_text(report.step_table(records, again or failure))
    if records:
        try:
            report.timeline_png(records, out_dir / "timeline.png", failure=again or failure)
        except report.PlotUnavailable as exc:
            print(f"timeline.png skipped: {exc}", file=sys.stderr)
    summary = {
        "against": against,
        "kind": failure.kind,
        "scheduler": failure.scheduler,
        "message": failure.message,
        "violations": [{"id": v.invariant_id, "message": v.message} for v in failure.violations],
        "events": len(workload.events),
        "steps": count_steps(workload.events),
        "replay": f"schedspec replay {trace_path} --against {against}",
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return trace_path


def _warm_up(factories: dict[str, SchedulerFactory]) -> None:
    """Build each scheduler once: a class that cannot even be built is a usage
    error (exit 2), and one-time costs (vLLM's import) are not counted as checking."""
    from schedspec.spec.interface import SchedulerConfig

    for name, factory in factories.items():
        try:
            factory(SchedulerConfig())
        except SchedSpecError:
            raise
        except Exception as exc:
            raise UsageError(f"--against {name}: cannot build the scheduler: {type(exc).__name__}: {exc}") from None


def cmd_check(args: argparse.Namespace) -> int:
    target = resolve(args.against)
    if args.steps is not None and args.time is not None:
        raise UsageError("--steps and --time: give one of them")
    total_steps = positive_int("--steps", args.steps) if args.steps is not None else None
    time_budget = float(args.time) if args.time is not None else None
    if time_budget is not None and time_budget <= 0:
        raise UsageError(f"--time: must be positive, got {args.time}")
    if total_steps is None and time_budget is None:
        total_steps = 2000
    shard_k, shard_n = _parse_shard(args.shard) if args.shard else (1, 1)
    wl_steps = positive_int("--workload-steps", str(args.workload_steps))
    factories = _factories(target)
    _warm_up(factories)  # imports and first construction stay out of the steps/s figure
    progress = Progress(enabled=not args.quiet)
    stats = Stats()
    steps = workloads = 0
    start = time.monotonic()
    outcome = CheckOutcome(0, 0, 0.0, stats)
    seeds: list[int] = []
    index = 0
    while True:
        if total_steps is not None and steps >= total_steps:
            break
        if time_budget is not None and time.monotonic() - start >= time_budget:
            break
        seed = args.seed + index * shard_n + (shard_k - 1)
        index += 1
        seeds.append(seed)
        n = wl_steps if total_steps is None else min(wl_steps, total_steps - steps)
        workload = random_workload(seed, n, vocab=args.vocab)
        runner, failure = run_workload(workload, factories, args.vocab, oracle_seed=seed,
                                       plans_only=args.plans_only)
        if failure is not None and args.plans_only:  # the same workload, everything checked
            failure = run_workload(workload, factories, args.vocab, oracle_seed=seed)[1] or failure
        stats.merge(runner.stats)
        steps += runner.stats.steps
        workloads += 1
        progress.update(steps, total_steps, stats, workloads)
        if failure is not None:
            progress.update(steps, total_steps, stats, workloads, force=True)
            print(f"FAILED on workload seed {seed}: {failure.describe()}", file=sys.stderr)
            print("shrinking...", file=sys.stderr)

            def check(w: Workload) -> Failure | None:
                return run_workload(w, factories, args.vocab, oracle_seed=seed)[1]

            small, small_failure = shrink(workload, failure, check, budget_s=args.shrink_time)
            out_dir = Path(args.out) / f"seed-{seed}"
            trace_path = write_counterexample(out_dir, small, small_failure, factories, args.against,
                                              args.vocab, seed)
            outcome = CheckOutcome(steps, workloads, time.monotonic() - start, stats, small_failure, seed,
                                   out_dir, trace_path)
            print((out_dir / "steps.txt").read_text(), end="")
            print(f"counterexample: {count_steps(small.events)} steps, {len(small.events)} events, written to {out_dir}/")
            print(f"replay it: schedspec replay {trace_path} --against {args.against}")
            break
    else:  # pragma: no cover - loop exits by break
        pass
    if outcome.failure is None:
        outcome = CheckOutcome(steps, workloads, time.monotonic() - start, stats)
        progress.update(steps, total_steps, stats, workloads, force=True)
        rate = steps / outcome.elapsed if outcome.elapsed > 0 else 0.0
        held = ("plans equal to the spec at every step, views at the end of each workload"
                if args.plans_only else "all invariants held"
                + ("" if target.name == "spec" else ", plans and views equal to the spec"))
        print(f"OK: {steps} steps in {workloads} workloads against {args.against}: {held}"
              + f" ({rate:,.0f} steps/s; {stats.preemptions} preemptions, {stats.hit_admissions} prefix hits,"
              f" {stats.chunks} prefill chunks)")
    outcome.seeds = seeds
    if args.json:
        _write_json(Path(args.json), args, outcome)
    if args.junit:
        _write_junit(Path(args.junit), args, outcome)
    return EXIT_OK if outcome.failure is None else EXIT_FAIL


def _summary(args: argparse.Namespace, o: CheckOutcome) -> dict[str, Any]:
    return {
        "result": "pass" if o.failure is None else "fail",
        "against": args.against,
        "seed": args.seed,
        "shard": args.shard or "1/1",
        "steps": o.steps,
        "workloads": o.workloads,
        "workload_seeds": o.seeds or [],
        "elapsed_s": round(o.elapsed, 3),
        "steps_per_s": round(o.steps / o.elapsed, 1) if o.elapsed > 0 else None,
        "stats": o.stats.as_dict(),
        "failure": None if o.failure is None else {
            "kind": o.failure.kind,
            "workload_seed": o.seed,
            "message": o.failure.message,
            "violations": [{"id": v.invariant_id, "message": v.message} for v in o.failure.violations],
            "trace": str(o.trace_path),
            "replay": f"schedspec replay {o.trace_path} --against {args.against}",
        },
    }


def _write_json(path: Path, args: argparse.Namespace, o: CheckOutcome) -> None:
    path.write_text(json.dumps(_summary(args, o), indent=2) + "\n")


def _write_junit(path: Path, args: argparse.Namespace, o: CheckOutcome) -> None:
    name = f"schedspec check --against {args.against} (shard {args.shard or '1/1'})"
    case = f'<testcase classname="schedspec.check" name={quoteattr(name)} time="{o.elapsed:.3f}">'
    if o.failure is not None:
        body = escape(o.failure.describe() + f"\nreplay: schedspec replay {o.trace_path} --against {args.against}")
        case += f'<failure message={quoteattr(o.failure.message)} type="{o.failure.kind}">{body}</failure>'
    case += f"<system-out>{escape(json.dumps(_summary(args, o)))}</system-out></testcase>"
    xml = (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="schedspec" tests="1" '
           f'failures="{0 if o.failure is None else 1}" time="{o.elapsed:.3f}">{case}</testsuite>\n')
    path.write_text(xml)


def cmd_replay(args: argparse.Namespace) -> int:
    trace = tracefile.read(args.trace)
    target = resolve(args.against)
    factories = _factories(target)
    runner, failure = run_workload(trace.workload, factories, trace.vocab, trace.oracle_seed, keep_history=True)
    records = runner.history or []
    if args.table or failure is not None:
        print(report.step_table(records, failure), end="")
    if failure is None:
        print(f"OK: replayed {len(trace.events)} events ({runner.stats.steps} steps) against {args.against}: "
              "all invariants held" + ("" if target.name == "spec" else ", plans and views equal to the spec"))
        return EXIT_OK
    print(f"FAILED: {failure.kind} at event {failure.event_index} (step {failure.step})")
    return EXIT_FAIL


def cmd_invariants(args: argparse.Namespace) -> int:
    from schedspec.invariants import catalogue_text

    print(catalogue_text())
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from schedspec.bench.scheduler import main as bench_main
    except ImportError as exc:  # pragma: no cover - impl ships the bench
        raise UsageError(f"bench: the benchmark is not available ({exc})") from None
    argv: list[str] = ["--against", args.against, "--running", args.running]
    if args.json:
        argv += ["--json", args.json]
    if args.quick:
        argv.append("--quick")
    result: int = bench_main(argv)
    return result


def cmd_equivalence(args: argparse.Namespace, extra: Sequence[str]) -> int:
    import importlib

    try:
        eq_cli = importlib.import_module("schedspec.cli.equivalence")
    except ImportError as exc:
        raise UsageError(f"equivalence needs the runner extra (torch): {exc}") from None
    result: int = eq_cli.main(list(extra))
    return result


def cmd_modelcheck(args: argparse.Namespace) -> int:
    from schedspec.modelcheck import run_command

    return run_command(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="schedspec", description="Hold LLM schedulers to the executable spec of vLLM 0.33's v1 scheduler.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="random workloads in lockstep with the spec, every invariant on every step")
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

    r = sub.add_parser("replay", help="replay a trace against a scheduler")
    r.add_argument("trace")
    r.add_argument("--against", default="spec")
    r.add_argument("--table", action="store_true", help="print the step table even when everything held")

    sub.add_parser("invariants", help="print the invariant catalogue")

    b = sub.add_parser("bench", help="decode and mixed-trace speed, side by side")
    b.add_argument("--against", default="impl,spec,vllm")
    b.add_argument("--running", default="256,1024,4096")
    b.add_argument("--json", default=None)
    b.add_argument("--quick", action="store_true")

    sub.add_parser("equivalence", help="token equivalence on a real model (needs torch)", add_help=False)

    from schedspec.modelcheck import add_arguments as modelcheck_arguments

    modelcheck_arguments(sub.add_parser("modelcheck", help="explore every state within a bound (TLC-style): "
                                        "invariants, deadlock, liveness, impl differential"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "equivalence":
        try:
            return cmd_equivalence(argparse.Namespace(), argv[1:])
        except UsageError as exc:
            print(f"schedspec: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    try:
        if args.command == "check":
            return cmd_check(args)
        if args.command == "replay":
            return cmd_replay(args)
        if args.command == "invariants":
            return cmd_invariants(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "modelcheck":
            return cmd_modelcheck(args)
    except (UsageError, AdapterError, tracefile.TraceError) as exc:
        print(f"schedspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SchedSpecError as exc:
        print(f"schedspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `schedspec invariants | head`
        sys.stderr.close()
        return EXIT_OK
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
