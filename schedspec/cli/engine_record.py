"""``schedspec engine-record``: capture a trace from vLLM 0.32's engine on the
CPU, with the recorder as its scheduler (docs/engine.md, "The recorder").

    schedspec engine-record --out TRACE [--variant NAME] [--workloads N|A,B] [--seed N]
                            [--check-every N] [--keep-async] [--cost]

Runs the engine matrix's workloads (schedspec.engine.matrix) one after the
other on one engine built with the variant's arguments, the recorder
recording, and writes the trace (format 5: the requests, aborts, plans and
the engine's tokens); ``schedspec replay TRACE --against spec|impl|vllm``
replays it. ``--check-every N``: the online monitor checks the safety
invariants every N-th step; on a violation the trace goes to TRACE and the
exit status is 1. ``--cost``: also run the same workloads without the
recorder and with the monitor at N = 10 and 1, two rounds alternating, and
print each run's median engine step, time in the scheduler and the
recorder's own time per step. Exit 2: bad usage or no engine environment.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from schedspec.cli.common import EXIT_FAIL, EXIT_OK, UsageError, positive_int

PROG = "schedspec engine-record"
DESCRIPTION = __doc__.split("\n\n")[0] if __doc__ else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the trace to write (.jsonl)")
    p.add_argument("--variant", default="baseline", help="the engine matrix's variant (default baseline)")
    p.add_argument("--workloads", default=None, help="the first N default workloads, or NAME,NAME (default all 5)")
    p.add_argument("--seed", default="0", help="the workloads' seed (default 0)")
    p.add_argument("--check-every", default="0", help="the monitor: check the safety invariants every N steps")
    p.add_argument("--keep-async", action="store_true",
                   help="keep the variant's async scheduling on (vLLM 0.32's CPU platform turns it off): "
                        "the engine runs vLLM's AsyncScheduler with a batch queue of two")
    p.add_argument("--cost", action="store_true",
                   help="also time the workloads without the recorder and with the monitor at N = 10 and 1 "
                        "(two rounds)")
    p.add_argument("--json", default=None, help="write the runs' step times as JSON here")


def _workloads(args: argparse.Namespace) -> list[dict[str, Any]]:
    from schedspec.engine import matrix

    seed = int(args.seed) if args.seed.isdigit() else positive_int("--seed", args.seed)
    workloads = matrix.default_workloads(seed)
    if args.workloads is None:
        return workloads
    if args.workloads.lstrip("-").isdigit():
        return workloads[:positive_int("--workloads", args.workloads)]
    by_name = {w["name"]: w for w in workloads}
    unknown = [n for n in args.workloads.split(",") if n not in by_name]
    if unknown:
        raise UsageError(f"--workloads: unknown workload(s) {', '.join(unknown)}; known: {', '.join(by_name)}", PROG)
    return [by_name[n] for n in args.workloads.split(",")]


def run(args: argparse.Namespace) -> int:
    from schedspec.engine import matrix
    from schedspec.engine.env import EngineEnvError
    from schedspec.engine.record import cost_table, run_record_job

    variants = {v.name: v for v in matrix.VARIANTS if not v.control}
    if args.variant not in variants:
        raise UsageError(f"--variant: unknown variant {args.variant!r}; known: {', '.join(variants)}", PROG)
    every = 0 if args.check_every == "0" else positive_int("--check-every", args.check_every)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out: no directory {out.parent}", PROG)
    workloads = _workloads(args)
    variant = variants[args.variant]
    record = {"name": "recorder" + (f", monitor N={every}" if every else ""), "args": variant.args,
              "recorder": True, "check_every": every, "trace": str(out), "violation_out": str(out),
              "keep_async": args.keep_async}
    runs = [record]
    if args.cost:  # two rounds, alternating, so that the machine's load shows as spread
        others = [{"name": "no recorder", "args": variant.args, "recorder": False, "keep_async": args.keep_async}]
        others += [{"name": f"recorder, monitor N={n}", "args": variant.args, "recorder": True, "check_every": n,
                    "keep_async": args.keep_async} for n in (10, 1) if n != every]
        runs = [others[0], record, *others[1:]]
        runs += [{**r, "name": str(r["name"]) + " (2)", "trace": None, "violation_out": None} for r in runs]
    try:
        result = run_record_job({"workloads": workloads, "runs": runs})
    except EngineEnvError as exc:
        raise UsageError(str(exc), PROG) from None
    status = EXIT_OK
    for r in result["runs"]:
        if r["error"]:
            print(f"{r['name']}: ERROR {r['error']}")
            status = EXIT_FAIL
        if r["violation"]:
            v = r["violation"]
            print(f"{r['name']}: VIOLATION at step {v['step']}: {'; '.join(v['violations'][:3])}")
            if v["trace"]:
                print(f"the trace up to it: {v['trace']} (schedspec replay {v['trace']})")
            status = EXIT_FAIL
    rec = next(r for r in result["runs"] if r["name"] == record["name"])
    if rec.get("trace"):
        print(f"wrote {rec['trace']}: {rec['events']} events, {len(rec['step_s'])} engine steps "
              f"({args.variant}, {len(workloads)} workloads)")
    if args.cost:
        print(cost_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return status
