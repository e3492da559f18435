"""``schedspec equivalence``: the token-equivalence matrix on a real model.

    schedspec equivalence [--against spec|impl|vllm|MODULE:CLASS] [--model NAME|PATH]
                          [--device auto|cpu|cuda] [--mode exact|fast] [--workloads N]
                          [--seed N] [--json FILE] [--png FILE] [--out DIR] [--threads N] [--quiet]

Exit status: 0 every variant generated the baseline's tokens (and, in exact
mode, bitwise the same logits), every guard held and both negative controls
were caught; 1 otherwise (the failing workloads are written to ``--out``);
2 bad input or usage. Needs the runner extra (torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from schedspec.cli.common import EXIT_FAIL, EXIT_OK, UsageError

PROG = "schedspec equivalence"
DESCRIPTION = ("Run every workload under a baseline configuration and under chunked prefill, "
               "prefix caching and preemption variants with a real model; the generated tokens must not change.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--against", default="spec", help="spec | impl | vllm | MODULE:CLASS (default spec)")
    p.add_argument("--model", default="glassllm", help="glassllm[:pt] | random[:k=v,...] | smollm2 | DIR | FILE.gguf")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto: CUDA when present)")
    p.add_argument("--mode", default="exact", choices=["exact", "fast"], help="exact: batch-invariant, bitwise logits")
    p.add_argument("--workloads", default=16, type=int, help="number of seeded workloads (default 16)")
    p.add_argument("--seed", default=0, type=int, help="first workload seed (default 0)")
    p.add_argument("--max-model-len", default=None, type=int, help="default: min(model context, 128)")
    p.add_argument("--atol", default=1e-3, type=float, help="fast mode: largest tolerated logit difference")
    p.add_argument("--threads", default=None, type=int, help="torch CPU threads (default 1 on the CPU)")
    p.add_argument("--json", default=None, help="write the full report as JSON here")
    p.add_argument("--png", default=None, help="draw the matrix (workloads x variants) as a PNG here")
    p.add_argument("--out", default="schedspec-out", help="where failing workloads go (default schedspec-out/)")
    p.add_argument("--no-negative", action="store_true", help="skip the negative controls")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    if args.workloads < 1:
        raise UsageError("--workloads must be >= 1", PROG)
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1", PROG)
    try:
        import torch
    except ImportError as exc:
        raise UsageError(f"equivalence needs the runner extra (torch): {exc}", PROG) from None

    from schedspec.adapters.registry import resolve
    from schedspec.gpu_runner.equivalence import run_equivalence, spec_factory
    from schedspec.gpu_runner.model import ModelError
    from schedspec.spec.interface import SchedSpecError, SchedulerFactory

    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        # Exact mode runs tiles of 16 rows: too small to gain from intra-op
        # threads, and on a busy machine spinning OpenMP workers cost 5x.
        torch.set_num_threads(1)
    factory: SchedulerFactory = spec_factory
    if args.against != "spec":
        try:
            factory = resolve(args.against).factory
        except (SchedSpecError, ImportError) as exc:
            raise UsageError(str(exc), PROG) from None

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    try:
        report = run_equivalence(
            factory,
            model=args.model,
            device=args.device,
            mode=args.mode,
            workloads=args.workloads,
            seed=args.seed,
            max_model_len=args.max_model_len,
            atol=args.atol,
            negative=not args.no_negative,
            progress=progress,
        )
    except (ModelError, ValueError, SchedSpecError, ImportError) as exc:
        raise UsageError(str(exc), PROG) from None
    print(report.table())
    if args.json:
        Path(args.json).write_text(report.dumps())
    if args.png:
        from schedspec.check.report import PlotUnavailable
        from schedspec.gpu_runner.equivalence import MATRIX_LEGEND

        try:
            report.png(args.png)
            print(f"picture: {args.png} ({MATRIX_LEGEND})")
        except PlotUnavailable as exc:
            print(f"picture {args.png} skipped: {exc}", file=sys.stderr)
    if report.ok:
        return EXIT_OK
    bad = sorted({c.workload for c in report.divergent})
    if bad:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"equivalence-seed{args.seed}.json"
        payload = {
            "command": ["schedspec", *getattr(args, "command_line", ["equivalence"])],
            "report": report.to_json(),
            "failing_workloads": [report.workload_defs[name] for name in bad],
        }
        path.write_text(json.dumps(payload, indent=2))
        seeds = ", ".join(str(report.workload_defs[b]["seed"]) for b in bad)
        print(f"failing workloads {', '.join(bad)} (seeds {seeds}) written to {path}")
    return EXIT_FAIL
