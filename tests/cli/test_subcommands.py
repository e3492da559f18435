"""The CLI package: replay of a corpus, every subcommand's --help, the
equivalence subcommand's usage errors through the main parser, rich only on a
terminal (plain lines otherwise, and without rich), and no library module that
imports the CLI."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schedspec.invariants import CATALOGUE

from schedspec.check.stats import Stats
from schedspec.check.gate import CheckProgress
from schedspec.cli.common import Progress, print_table
from schedspec.cli.main import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"

HEADER = {"schedspec_trace": 1, "config": {"block_size": 4, "num_blocks": 9, "max_model_len": 32,
                                            "max_num_batched_tokens": 32, "max_num_seqs": 4}}
ADD = {"op": "add", "request": {"request_id": "a", "prompt_token_ids": [1, 2, 3, 4, 5, 6], "max_tokens": 8}}


def _trace(path: Path, *events: dict[str, object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(x) for x in (HEADER, *events)) + "\n")
    return path


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    """Two traces a scheduler that leaks an aborted request's last block
    passes (no abort) and one it fails (an abort while the request holds two
    blocks), one of them in a subfolder."""
    root = tmp_path / "vectors"
    _trace(root / "a-clean.jsonl", ADD, {"op": "step"}, {"op": "step"})
    _trace(root / "sub" / "b-clean.jsonl", ADD, {"op": "step"})
    _trace(root / "c-abort.jsonl", ADD, {"op": "step"}, {"op": "abort", "request_id": "a"}, {"op": "step"})
    (root / "notes.txt").write_text("not a trace\n")
    return root


@pytest.fixture(autouse=True)
def _support_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SUPPORT))


def test_replay_of_a_directory_replays_every_trace_and_passes(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(corpus)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["OK", "OK", "OK", "OK:"]
    assert str(corpus / "sub" / "b-clean.jsonl") in out[2]  # recursive, sorted
    n = len(CATALOGUE)
    assert out[-1] == f"OK: replayed 3 traces against spec: {n} invariants held (all) (the spec against itself: no comparison)"


def test_replay_of_a_directory_with_one_failing_trace_exits_1(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(corpus), "--against", "buggy_schedulers:LeakyAbort"]) == 1
    out = capsys.readouterr().out.splitlines()
    by_trace = {line.split()[1].rstrip(":"): line.split()[0] for line in out[:-1]}
    assert by_trace == {str(corpus / "a-clean.jsonl"): "OK", str(corpus / "c-abort.jsonl"): "FAILED",
                        str(corpus / "sub" / "b-clean.jsonl"): "OK"}
    assert out[-1] == "FAILED: 1 of 3 traces against buggy_schedulers:LeakyAbort"


def test_replay_of_several_files_one_line_each(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = [str(corpus / "c-abort.jsonl"), str(corpus / "a-clean.jsonl")]
    assert main(["replay", *files, "--against", "buggy_schedulers:LeakyAbort"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"FAILED  {files[0]}: ") and out[1].startswith(f"OK      {files[1]}: ")
    assert main(["replay", *files]) == 0


def test_replay_of_a_corpus_with_a_malformed_trace_replays_nothing(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = corpus / "z-bad.jsonl"
    bad.write_text(json.dumps(HEADER) + "\n" + '{"op": "launch"}\n')
    assert main(["replay", str(corpus)]) == 2
    captured = capsys.readouterr()
    assert f"{bad}:2: op" in captured.err
    assert captured.out == ""


def test_replay_of_an_empty_directory_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path)]) == 2
    assert f"{tmp_path}: the directory holds no .jsonl traces" in capsys.readouterr().err


def test_python_dash_m_schedspec_help_lists_every_subcommand() -> None:
    done = subprocess.run([sys.executable, "-m", "schedspec", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    for name, _, _ in SUBCOMMANDS:
        assert name in done.stdout


@pytest.mark.parametrize("name", [name for name, _, _ in SUBCOMMANDS])
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--help"]) == 0
    assert f"usage: schedspec {name}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["equivalence", "--workloads", "0"], "schedspec equivalence: error: --workloads must be >= 1"),
        (["equivalence", "--threads", "0"], "schedspec equivalence: error: --threads must be >= 1"),
        (["equivalence", "--bogus"], "unrecognized arguments: --bogus"),
        (["equivalence", "--mode", "sloppy"], "--mode"),
    ],
)
def test_equivalence_usage_errors_through_the_main_cli(argv: list[str], needle: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_no_library_module_imports_the_cli() -> None:
    """Every module under schedspec/ but the CLI package and ``__main__``,
    the symlinked spec/, impl/, invariants/ and gpu_runner/ included, and
    imports inside function bodies included."""
    package = ROOT / "schedspec"
    offenders = []
    seen = 0
    for folder, _dirs, files in os.walk(package, followlinks=True):
        rel = Path(folder).relative_to(package)
        if rel.parts[:1] == ("cli",):
            continue
        for file in files:
            if not file.endswith(".py") or (not rel.parts and file == "__main__.py"):
                continue
            path = Path(folder) / file
            seen += 1
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                if any(n == "schedspec.cli" or n.startswith("schedspec.cli.") for n in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert seen > 30  # the walk reached the symlinked packages too
    assert not offenders, offenders


# --------------------------------------------------------------------------
# rich on a terminal, plain lines everywhere else
# --------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _snapshots() -> list[CheckProgress]:
    stats = Stats()
    stats.preemptions, stats.hit_admissions, stats.chunks = 3, 2, 1
    return [CheckProgress(100, 400, 1, stats, elapsed=0.5), CheckProgress(400, 400, 4, stats, final=True, elapsed=2.0)]


def test_progress_reports_the_rate_on_the_check_s_own_clock() -> None:
    """The display's steps/s is the summary's: the gate's clock, which starts
    after the warm-up (imports, first builds), not when the display is made."""
    stream = io.StringIO()
    show = Progress(stream=stream)
    for p in _snapshots():
        show(p)
    assert "  200 steps/s  " in stream.getvalue().splitlines()[-1]
    assert stream.getvalue().splitlines()[-1].endswith("  2.0s")


def test_progress_is_plain_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    show = Progress(stream=stream)
    for p in _snapshots():
        show(p)
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 2  # the first, then the forced final one
    assert lines[-1].startswith("[" + "#" * 24 + "] 400/400 steps")
    assert "workloads 4  preemptions 3  prefix hits 2  chunks 1" in lines[-1]


def test_progress_without_rich_on_a_terminal_redraws_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich.console", None)  # rich not installed
    stream = _Terminal()
    show = Progress(stream=stream)
    for p in _snapshots():
        show(p)
    text = stream.getvalue()
    assert text.startswith("\r[") and text.endswith("\n") and "400/400 steps" in text


def test_progress_with_rich_on_a_terminal_draws_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: nothing elided
    stream = _Terminal()
    show = Progress(stream=stream)
    for p in _snapshots():
        show(p)
    show.close()
    text = stream.getvalue()
    assert "400/400 steps" in text and "preemptions 3" in text
    assert "\x1b[" in text  # drawn by rich: terminal control sequences
    assert "[" + "#" * 24 + "]" not in text  # not the plain line


def test_quiet_progress_writes_nothing() -> None:
    stream = _Terminal()
    show = Progress(enabled=False, stream=stream)
    for p in _snapshots():
        show(p)
    assert stream.getvalue() == ""


COLUMNS = (("name", "<"), ("value", ">"))
ROWS = [["alpha", "1.5"], ["beta", "22.0"]]
PLAIN = "name   value\nalpha    1.5\nbeta    22.0"


def test_table_is_the_plain_text_when_not_a_terminal() -> None:
    stream = io.StringIO()
    print_table(COLUMNS, ROWS, PLAIN, stream=stream)
    assert stream.getvalue() == PLAIN + "\n"


def test_table_is_the_plain_text_on_a_terminal_without_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich.console", None)
    stream = _Terminal()
    print_table(COLUMNS, ROWS, PLAIN, stream=stream)
    assert stream.getvalue() == PLAIN + "\n"


def test_table_is_drawn_by_rich_on_a_terminal() -> None:
    pytest.importorskip("rich")
    stream = _Terminal()
    print_table(COLUMNS, ROWS, PLAIN, stream=stream)
    text = stream.getvalue()
    assert text != PLAIN + "\n"
    assert all(cell in text for row in ROWS for cell in row) and "name" in text and "value" in text


def test_rich_is_not_imported_by_the_libraries() -> None:
    code = ("import sys, schedspec.spec.scheduler, schedspec.impl, schedspec.invariants, schedspec.check.gate, "
            "schedspec.check.report; print(any(m == 'rich' or m.startswith('rich.') for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
