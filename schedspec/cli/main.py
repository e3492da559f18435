"""The `schedspec` command line: one parser, one subcommand module each
(``add_arguments(parser)`` + ``run(args) -> int``), one set of exit codes.

Exit status: 0 everything held; 1 a violation or divergence (a counterexample
is written); 2 bad input or usage (the message names the flag, file, line or
field).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

from schedspec.adapters.registry import AdapterError
from schedspec.check import trace as tracefile
from schedspec.cli.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError
from schedspec.spec.interface import SchedSpecError

__all__ = ["EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "SUBCOMMANDS", "build_parser", "main"]

DESCRIPTION = "Hold LLM schedulers to the executable spec of vLLM 0.33's v1 scheduler."

#: The subcommands, in --help order: name, module, one-line help. Each module
#: has ``add_arguments(parser)`` and ``run(args) -> int``; all are imported when
#: the parser is built, and none imports anything heavy at import time.
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("check", "schedspec.cli.check",
     "random workloads in lockstep with the spec, every invariant on every step"),
    ("replay", "schedspec.cli.replay",
     "replay traces (files, or directories of .jsonl traces) against a scheduler"),
    ("invariants", "schedspec.cli.invariants", "print the invariant catalogue"),
    ("bench", "schedspec.cli.bench", "decode and mixed-trace speed, side by side"),
    ("equivalence", "schedspec.cli.equivalence", "token equivalence on a real model (needs torch)"),
    ("engine-equivalence", "schedspec.cli.engine_equivalence",
     "vLLM's own engine on the CPU: each engine variant's tokens against the baseline"),
    ("engine-record", "schedspec.cli.engine_record",
     "capture a replayable trace from vLLM's own engine on the CPU (and its monitor)"),
    ("modelcheck", "schedspec.cli.modelcheck",
     "explore every state within a bound (TLC-style): invariants, deadlock, liveness, impl differential"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="schedspec", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    for name, module_name, help_text in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        description = getattr(module, "DESCRIPTION", None) or help_text
        parser = sub.add_parser(name, help=help_text, description=description)
        module.add_arguments(parser)
        run: Callable[[argparse.Namespace], int] = module.run
        parser.set_defaults(run=run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    args.command_line = argv
    try:
        result: int = args.run(args)
        return result
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (AdapterError, tracefile.TraceError, SchedSpecError) as exc:
        print(f"schedspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C outside a run that reports itself (while importing, say)
        print("schedspec: interrupted (SIGINT)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `schedspec invariants | head`
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
