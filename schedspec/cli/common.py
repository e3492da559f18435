"""What every subcommand shares: the usage error, flag parsers, scheduler
resolution, the check progress display and table output.

Progress and tables go through rich when the stream is a terminal and rich is
installed (the ``cli`` extra); otherwise they are plain lines, as CI logs and
tests read them. rich is imported only here, and only when it is used.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from schedspec.adapters.registry import Target, resolve
from schedspec.check.deadline import DEFAULT_CALL_TIMEOUT, check_timeout
from schedspec.check.gate import CheckProgress
from schedspec.invariants import Mode
from schedspec.spec.interface import SchedulerFactory

#: The exit statuses of every subcommand: 0 everything held; 1 a violation,
#: divergence or failed check (a counterexample is written); 2 bad input or
#: usage (the message names the flag, file, line or field).
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad usage: the message names the flag or file; the CLI prints it as
    ``PROG: error: MESSAGE`` and exits 2."""

    def __init__(self, message: str, prog: str = "schedspec") -> None:
        super().__init__(message)
        self.prog = prog


def positive_int(flag: str, text: str) -> int:
    """A flag's value as a positive integer; UsageError naming the flag otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{flag}: expected an integer, got {text!r}") from None
    if value <= 0:
        raise UsageError(f"{flag}: must be positive, got {value}")
    return value


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard K/N`` as (K, N) with 1 <= K <= N; UsageError otherwise."""
    k, sep, n = text.partition("/")
    if not sep or not k.isdigit() or not n.isdigit():
        raise UsageError(f"--shard: expected K/N (e.g. 2/4), got {text!r}")
    kk, nn = int(k), int(n)
    if nn < 1 or not 1 <= kk <= nn:
        raise UsageError(f"--shard: need 1 <= K <= N, got {text!r}")
    return kk, nn


def add_call_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """--call-timeout, the same words in every subcommand that runs a scheduler."""
    parser.add_argument("--call-timeout", default=DEFAULT_CALL_TIMEOUT, type=float, metavar="SECONDS",
                        help=f"the deadline of one call into the scheduler under test (default "
                             f"{DEFAULT_CALL_TIMEOUT:g}; 0: none): a call past it is a finding (exit 1)")


def call_timeout_of(args: argparse.Namespace) -> float | None:
    """The --call-timeout given (None: no deadline); UsageError for a bad one."""
    try:
        return check_timeout("--call-timeout", getattr(args, "call_timeout", DEFAULT_CALL_TIMEOUT))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_output_dir(flag: str, path: Path) -> None:
    """``path`` as an output folder: created when missing; UsageError naming
    ``flag`` and the path when it cannot be created or written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the folder is not writable")


def check_output_file(flag: str, path: Path) -> None:
    """``path`` as an output file: its folder created when missing;
    UsageError naming ``flag`` and the path when it is a folder or cannot be
    written. Nothing is written to the file itself yet."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder, expected a file path")
    parent = path.parent if str(path.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create its folder {parent} ({exc.strerror or exc})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: its folder {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: the file exists and is not writable")


MODE_HELP = ("lockstep: plans and views compared with the spec at every step, plus the invariants "
             "(default); invariants: the scheduler alone, no comparison, the chosen invariants only")
INVARIANTS_HELP = ("comma list of invariant tags (safety, policy, policy:NAME, all) and ids; -ID or -TAG "
                   "leaves one out (default: all in lockstep, safety in invariants mode; "
                   "`schedspec invariants` lists them)")


def add_mode_arguments(parser: argparse.ArgumentParser, default_help: str = "") -> None:
    """--mode and --invariants, the same words in every subcommand."""
    parser.add_argument("--mode", choices=("lockstep", "invariants"), default=None,
                        help=MODE_HELP + default_help)
    parser.add_argument("--invariants", default=None, metavar="SELECTOR", help=INVARIANTS_HELP)


def mode_of(args: argparse.Namespace) -> Mode:
    return "invariants" if getattr(args, "mode", None) == "invariants" else "lockstep"


def check_factories(against: str, mode: Mode, reference: str = "spec") -> tuple[Target, dict[str, SchedulerFactory]]:
    """The scheduler named by ``--against`` and the factories a check runs:
    in lockstep the reference and it (once, when they are the same), in
    invariants mode it alone."""
    target = resolve(against)
    if mode == "invariants" or target.name == reference:
        return target, {target.name: target.factory}
    return target, {reference: resolve(reference).factory, target.name: target.factory}


def lockstep_factories(against: str, reference: str = "spec") -> tuple[str, dict[str, SchedulerFactory]]:
    """The reference and the scheduler named by ``--against`` (once, when they
    are the same), resolved through the adapter registry: (target name, factories)."""
    target = resolve(against)
    if target.name == reference:
        return target.name, {target.name: target.factory}
    return target.name, {reference: resolve(reference).factory, target.name: target.factory}


def with_stats_factories(factories: dict[str, Any], target: Any) -> dict[str, Any]:
    """--stats: the factories building their schedulers with log_stats
    (check/scheduler_stats.py); UsageError naming a scheduler that does not
    declare Capabilities.stats."""
    from schedspec.check.scheduler_stats import StatsUnsupported, stats_factories

    caps = {n: (target.capabilities if n == target.name else resolve(n).capabilities) for n in factories}
    try:
        return stats_factories(factories, caps)
    except StatsUnsupported as exc:
        raise UsageError(f"--stats: {exc}") from None


# --------------------------------------------------------------------------
# rich, when there is a terminal to draw on
# --------------------------------------------------------------------------


def rich_console(stream: TextIO) -> Any | None:
    """A rich Console on ``stream`` when it is a terminal and rich is
    installed; None otherwise (the caller writes plain lines)."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return None
    if not tty:
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=stream)


def print_table(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]], plain: str,
                stream: TextIO | None = None, title: str | None = None) -> None:
    """``columns`` as (heading, "<" or ">") and ``rows`` of cell texts as a
    rich table on a terminal; ``plain`` (the same table as fixed-width text)
    everywhere else."""
    out = sys.stdout if stream is None else stream
    console = rich_console(out)
    if console is None:
        out.write(plain if plain.endswith("\n") else plain + "\n")
        return
    from rich.table import Table

    table = Table(title=title)
    for heading, align in columns:
        table.add_column(heading, justify="right" if align == ">" else "left", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


class StatusLine:
    """What a long command is doing now: a rich spinner on a terminal, a
    ``... what`` line otherwise. Call it with each new stage; close() at the end."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self._status: Any | None = None
        console = rich_console(self.stream)
        if console is not None:
            self._status = console.status("")
            self._status.start()

    def __call__(self, what: str) -> None:
        if self._status is not None:
            self._status.update(what)
        else:
            print(f"... {what}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


class Progress:
    """The check progress display: a rich bar on a terminal (or, without
    rich, a live line redrawn in place), a plain line every few seconds in CI
    logs. Call it with each CheckProgress; a ``final`` one ends the display."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.last = 0.0
        self._rich: Any | None = None
        self._task: Any = None
        if enabled and self.tty:
            console = rich_console(self.stream)
            if console is not None:
                self._start_rich(console)

    def _start_rich(self, console: Any) -> None:
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

        self._rich = RichProgress(TextColumn("check"), BarColumn(bar_width=24), TextColumn("{task.fields[head]}"),
                                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
        self._task = self._rich.add_task("check", total=None, head="", info="")
        self._rich.start()

    def line(self, p: CheckProgress, elapsed: float) -> str:
        """The progress as one plain line."""
        rate = p.steps / elapsed if elapsed > 0 else 0.0
        if p.total:
            frac = min(p.steps / p.total, 1.0)
            bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
            head = f"[{bar}] {p.steps}/{p.total} steps"
        else:
            head = f"{p.steps} steps"
        return (f"{head}  {rate:,.0f} steps/s  workloads {p.workloads}  preemptions {p.stats.preemptions}"
                f"  prefix hits {p.stats.hit_admissions}  chunks {p.stats.chunks}  {elapsed:,.1f}s")

    def __call__(self, p: CheckProgress) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        every = 0.2 if self.tty else 10.0
        if not p.final and now - self.last < every:
            return
        self.last = now
        elapsed = p.elapsed
        if self._rich is not None:
            rate = p.steps / elapsed if elapsed > 0 else 0.0
            head = f"{p.steps}/{p.total} steps" if p.total else f"{p.steps} steps"
            info = (f"{rate:,.0f} steps/s  workloads {p.workloads}  preemptions {p.stats.preemptions}"
                    f"  prefix hits {p.stats.hit_admissions}  chunks {p.stats.chunks}")
            self._rich.update(self._task, total=p.total, completed=min(p.steps, p.total or p.steps),
                              head=head, info=info)
            if p.final:
                self._rich.stop()
                self._rich = None
                self.enabled = False
            return
        line = self.line(p, elapsed)
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            if p.final:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a rich display that no final snapshot ended (an exception)."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
