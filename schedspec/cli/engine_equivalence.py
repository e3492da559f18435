"""``schedspec engine-equivalence``: vLLM's own engine on the CPU, each
variant of its arguments against the baseline (docs/engine.md).

    schedspec engine-equivalence [--variants A,B,...] [--workloads N|A,B] [--seed N]
                                 [--tolerance T] [--model DIR] [--out FILE]

Runs in the engine's environment (.venv-engine, scripts/setup_engine.sh) as
one subprocess. Exit 0: every variant EQUIVALENT and the negative control
DIVERGED; 1 otherwise; 2 bad usage or no engine environment.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from schedspec.cli.common import EXIT_FAIL, EXIT_OK, UsageError, positive_int

PROG = "schedspec engine-equivalence"
DESCRIPTION = __doc__.split("\n\n")[0] if __doc__ else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default=None,
                   help="comma-separated variant names (default: all, with the control)")
    p.add_argument("--workloads", default=None,
                   help="the first N default workloads, or NAME,NAME (default: all 5)")
    p.add_argument("--seed", default="0", help="the workloads' seed (default 0)")
    p.add_argument("--tolerance", default=None, help="max logprob difference (default 1e-4)")
    p.add_argument("--model", default=None, help="the model directory (default: the seeded tiny Llama)")
    p.add_argument("--out", default=None, help="write the report and raw timings as JSON here")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return ""


def run(args: argparse.Namespace) -> int:
    from schedspec.engine import matrix
    from schedspec.engine.env import EngineEnvError

    try:
        variants = matrix.variants_named(args.variants.split(",") if args.variants else None)
    except ValueError as exc:
        raise UsageError(f"--variants: {exc}", PROG) from None
    seed = int(args.seed) if args.seed.isdigit() else positive_int("--seed", args.seed)
    workloads = matrix.default_workloads(seed)
    if args.workloads is not None and args.workloads.lstrip("-").isdigit():
        workloads = workloads[:positive_int("--workloads", args.workloads)]
    elif args.workloads is not None:
        by_name = {w["name"]: w for w in workloads}
        names = args.workloads.split(",")
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise UsageError(f"--workloads: unknown workload(s) {', '.join(unknown)}; known: "
                             f"{', '.join(by_name)}", PROG)
        workloads = [by_name[n] for n in names]
    tol = matrix.LOGPROB_TOL
    if args.tolerance is not None:
        try:
            tol = float(args.tolerance)
        except ValueError:
            raise UsageError(f"--tolerance: expected a number, got {args.tolerance!r}", PROG) from None
    if args.out is not None and not Path(args.out).parent.is_dir():
        raise UsageError(f"--out: no directory {Path(args.out).parent}", PROG)
    start = time.perf_counter()
    try:
        reports, result = matrix.run_matrix(variants, workloads, args.model, tol=tol)
    except EngineEnvError as exc:
        raise UsageError(str(exc), PROG) from None
    wall = time.perf_counter() - start
    print(matrix.render(reports))
    print(f"{len(workloads)} workloads, {len(variants)} variants, one engine process: {wall:.1f} s")
    if args.out is not None:
        data = {"command": ["schedspec", *getattr(args, "command_line", ["engine-equivalence"])],
                "commit": _commit(), "tolerance": tol, "wall_s": round(wall, 1),
                "reports": [matrix.report_dict(r) for r in reports],
                "timings": {v["name"]: {"build_s": v.get("build_s"), "total_s": v.get("total_s"),
                                        "runs": {r["workload"]: {"steps": r["steps"], "wall_s": r["wall_s"],
                                                                   **r["stats"]}
                                                 for r in v["runs"]}}
                            for v in result["variants"]}}
        Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return EXIT_OK if all(r.ok for r in reports) else EXIT_FAIL
