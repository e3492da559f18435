"""``schedspec equivalence``: the token-equivalence matrix on a real model.

    schedspec equivalence [--against spec|impl|vllm|MODULE:CLASS] [--model NAME|PATH]
                          [--device auto|cpu|cuda] [--mode exact|fast] [--workloads N]
                          [--seed N] [--json FILE] [--png FILE] [--out DIR] [--threads N] [--quiet]
                          [--repeat N] [--deterministic-algorithms]
                          [--sliding-window W [--sw-layers odd|even|all]]
                          [--chunked-local C [--cl-layers odd|even|all]] [--layer-pattern FSCM]
                          [--no-reference] [--no-connector] [--sessions] [--pipeline]
    schedspec equivalence --cross-device DEV [--device D] [--mode M] [--model M] [--workloads N] [--seed N] [--json F]
    schedspec equivalence --max-batch [--prompt-len L] [--max-batch-tokens N] [--max-step-seconds S] [--json F]

Exit status: 0 every variant generated the baseline's tokens (and, in exact
mode, bitwise the same logits), every guard held and every negative control
(wrong block table, wrong positions, a connector load shifted by one; with
chunked local attention a nulled block of the current chunk and a chunk mask
off by one) was caught, and a hybrid model's baselines equal the dense,
non-paged reference; 1 otherwise (the failing workloads are written to ``--out``);
2 bad input or usage. ``--cross-device``: 0 every token equal on both devices,
1 a token differs (explained). ``--max-batch``: 0 when at least one batch ran.
Needs the runner extra (torch).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from schedspec.check.deadline import Interrupted, guarded, interruptible
from schedspec.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    UsageError,
    add_call_timeout_argument,
    call_timeout_of,
    check_output_dir,
    check_output_file,
)

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
    add_call_timeout_argument(p)
    p.add_argument("--no-negative", action="store_true", help="skip the negative controls")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--repeat", default=1, type=int,
                   help="run the whole matrix N times: median steps/s and tok/s; a repeat whose tokens or logits differ fails")
    p.add_argument("--deterministic-algorithms", action="store_true",
                   help="also torch.use_deterministic_algorithms(True) (CUDA: cuBLAS workspace, no TF32 and "
                   "deterministic cuDNN are always set)")
    p.add_argument("--cross-device", default=None, metavar="DEV",
                   help="only compare the baseline's tokens and logits on --device against DEV (e.g. cpu); "
                   "exit 1 if a token differs, with the op where the devices part")
    p.add_argument("--max-batch", action="store_true",
                   help="only probe the largest prefill batch: R requests x --prompt-len tokens, R doubling")
    p.add_argument("--prompt-len", default=512, type=int, help="--max-batch: tokens per request (default 512)")
    p.add_argument("--max-batch-tokens", default=262144, type=int, help="--max-batch: cap on tokens per step (default 262144)")
    p.add_argument("--max-step-seconds", default=30.0, type=float, help="--max-batch: stop after a step this slow (default 30)")
    p.add_argument("--sliding-window", default=0, type=int, metavar="W",
                   help="hybrid KV cache groups: the --sw-layers attend only their last W positions, through "
                        "their own sliding-window KV cache group; every config carries the groups (default 0: off)")
    p.add_argument("--sw-layers", default="odd", choices=["odd", "even", "all"],
                   help="--sliding-window: which layers use it (default odd)")
    p.add_argument("--chunked-local", default=0, type=int, metavar="C",
                   help="hybrid KV cache groups: the --cl-layers attend only the earlier positions of their own "
                        "chunk of C positions, through their own chunked-local KV cache group (default 0: off)")
    p.add_argument("--cl-layers", default="odd", choices=["odd", "even", "all"],
                   help="--chunked-local alone: which layers use it (default odd)")
    p.add_argument("--layer-pattern", default="", metavar="LETTERS",
                   help="each layer's attention, F full, S sliding window, C chunked local, M a Mamba state "
                        "layer, repeated over the layers (default with both --sliding-window and --chunked-local: FSC)")
    p.add_argument("--no-reference", action="store_true",
                   help="a hybrid model: skip the check of each baseline against the dense, non-paged reference")
    p.add_argument("--no-connector", action="store_true",
                   help="skip the KV connector variants (kv-sync, kv-async, kv-all, kv-async-spec) and their control")
    p.add_argument("--sessions", action="store_true",
                   help="add the streaming-input session variants (session, stream-chunked, stream-prefix, "
                        "stream-tiny, stream-async, stream-all) and their controls")
    p.add_argument("--pipeline", action="store_true",
                   help="add the k-plans-in-flight variants (pipeline-2, -3, -4, pipeline-3-tiny, "
                        "pipeline-2-async-v2)")


def run(args: argparse.Namespace) -> int:
    if args.workloads < 1:
        raise UsageError("--workloads must be >= 1", PROG)
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1", PROG)
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1", PROG)
    if args.sliding_window < 0:
        raise UsageError("--sliding-window must be >= 0", PROG)
    if args.chunked_local < 0:
        raise UsageError("--chunked-local must be >= 0", PROG)
    if args.layer_pattern and not (args.sliding_window or args.chunked_local or "M" in args.layer_pattern):
        raise UsageError("--layer-pattern needs --sliding-window, --chunked-local or a Mamba layer (M)", PROG)
    if args.cross_device is not None and args.max_batch:
        raise UsageError("--cross-device and --max-batch are separate runs: give one", PROG)
    if args.max_batch and (args.prompt_len < 1 or args.max_batch_tokens < 1 or not args.max_step_seconds > 0):
        raise UsageError("--prompt-len, --max-batch-tokens and --max-step-seconds must be positive", PROG)
    try:
        import torch
    except ImportError as exc:
        raise UsageError(f"equivalence needs the runner extra (torch): {exc}", PROG) from None

    from schedspec.adapters.registry import resolve
    from schedspec.gpu_runner.equivalence import HangError, spec_factory
    from schedspec.spec.interface import SchedSpecError, SchedulerFactory

    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        # Exact mode runs tiles of 16 rows: too small to gain from intra-op
        # threads, and on a busy machine spinning OpenMP workers cost 5x.
        torch.set_num_threads(1)
    factory: SchedulerFactory = spec_factory
    capabilities = None
    if args.against != "spec":
        try:
            target = resolve(args.against)
        except (SchedSpecError, ImportError) as exc:
            raise UsageError(str(exc), PROG) from None
        factory, capabilities = target.factory, target.capabilities

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    deadline = call_timeout_of(args)
    check_outputs(args)
    if args.cross_device is not None:
        return _cross_device(args, factory, progress)
    if args.max_batch:
        return _max_batch(args, progress)
    try:
        with guarded(deadline), interruptible():
            report = _run_equivalence(args, factory, capabilities, progress)
    except HangError as exc:
        print(f"FAILED: {exc}")
        return EXIT_FAIL
    except Interrupted as exc:  # between workloads' bookkeeping, or while loading: nothing run whole
        print(f"interrupted ({exc.name}) before any workload ran whole: no report")
        return exc.exit_status
    return _report(args, report)


def check_outputs(args: argparse.Namespace) -> None:
    """--json, --png and --out checked (folders created) before the run."""
    check_output_dir("--out", Path(args.out))
    for flag, value in (("--json", args.json), ("--png", args.png)):
        if value:
            check_output_file(flag, Path(value))


def _run_equivalence(args: argparse.Namespace, factory: Any, capabilities: Any,
                     progress: Callable[[str], None]) -> Any:
    from schedspec.gpu_runner.equivalence import run_equivalence
    from schedspec.gpu_runner.model import ModelError
    from schedspec.spec.interface import SchedSpecError

    try:
        return run_equivalence(
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
            repeat=args.repeat,
            deterministic_algorithms=args.deterministic_algorithms,
            sliding_window=args.sliding_window,
            sw_layers=args.sw_layers,
            connector=not args.no_connector,
            capabilities=capabilities,
            chunked_local=args.chunked_local,
            cl_layers=args.cl_layers,
            layer_pattern=args.layer_pattern,
            reference=False if args.no_reference else None,
            extend=_sessions(args, factory, progress),
            more_variants=_pipeline(args),
        )
    except (ModelError, ValueError, SchedSpecError, ImportError) as exc:
        raise UsageError(str(exc), PROG) from None


def _pipeline(args: argparse.Namespace) -> Any:
    """``--pipeline``: the k-plans-in-flight variants (gpu_runner/pipeline.py)."""
    if not args.pipeline:
        return None
    from schedspec.gpu_runner.pipeline import pipeline_variants

    return lambda mml, block_size, groups: pipeline_variants(mml, block_size, groups=groups)


def _sessions(args: argparse.Namespace, factory: Any, progress: Any) -> Any:
    """``--sessions``: the session matrix run after the matrix (gpu_runner/sessions.py)."""
    if not args.sessions:
        return None
    from schedspec.gpu_runner.sessions import session_extension

    return session_extension(factory, workloads=args.workloads, seed=args.seed, atol=args.atol,
                             negative=not args.no_negative, progress=progress,
                             hybrid=bool(args.sliding_window or args.chunked_local or args.layer_pattern))


def _report(args: argparse.Namespace, report: Any) -> int:
    """The table, the JSON and the picture; an interrupted run's (the
    workloads run whole, marked interrupted) exits with the signal's status."""
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
    if report.interrupted:
        return 128 + int(signal.Signals[report.interrupted])
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


def _cross_device(args: argparse.Namespace, factory: Any, progress: Callable[[str], None]) -> int:
    from schedspec.gpu_runner.crossdevice import run_cross_device
    from schedspec.gpu_runner.model import ModelError
    from schedspec.spec.interface import SchedSpecError

    try:
        report = run_cross_device(
            factory, model=args.model, device=args.device, other_device=args.cross_device, mode=args.mode,
            workloads=args.workloads, seed=args.seed, max_model_len=args.max_model_len,
            deterministic_algorithms=args.deterministic_algorithms, progress=progress,
        )
    except (ModelError, ValueError, SchedSpecError, ImportError) as exc:
        raise UsageError(str(exc), PROG) from None
    print(report.table())
    if args.json:
        Path(args.json).write_text(report.dumps())
    return EXIT_OK if report.ok else EXIT_FAIL


def _max_batch(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from schedspec.gpu_runner.maxbatch import run_max_batch
    from schedspec.gpu_runner.model import ModelError

    try:
        report = run_max_batch(
            model=args.model, device=args.device, mode=args.mode, prompt_len=args.prompt_len,
            max_batch_tokens=args.max_batch_tokens, max_step_seconds=args.max_step_seconds,
            deterministic_algorithms=args.deterministic_algorithms, progress=progress,
        )
    except (ModelError, ValueError, ImportError) as exc:
        raise UsageError(str(exc), PROG) from None
    print(report.table())
    if args.json:
        Path(args.json).write_text(report.dumps())
    return EXIT_OK if report.largest is not None else EXIT_FAIL
