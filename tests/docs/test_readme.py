"""The README is a front door: at most 200 lines, the two commands as CI runs
them, a layout table that is the layering tests/test_layers.py enforces, and
example outputs that are what the commands print. The docs stay within their
word budget, say today's truth and cite nothing outside the repository."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from schedspec.cli.main import main
from tests.test_layers import RANK

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: docs written by their own generators, not held to these rules here
OWN_DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in {"impl.md", "bugzoo.md"})


def test_the_readme_is_at_most_200_lines() -> None:
    assert len(README.read_text().splitlines()) <= 200


def test_the_readme_gives_the_test_command_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"\n{ci}\n" in README.read_text()
    assert "\n./scripts/setup.sh && .venv/bin/schedspec check --against impl --steps 20000 && " \
           ".venv/bin/schedspec equivalence\n" in README.read_text()


def test_the_docs_and_the_readme_total_at_most_40000_words() -> None:
    per_doc = {p.name: len(p.read_text().split()) for p in [README, *sorted((ROOT / "docs").glob("*.md"))]}
    assert sum(per_doc.values()) <= 40_000, f"{sum(per_doc.values())} words: {per_doc}"


def test_the_layout_table_is_the_layering() -> None:
    rows = re.findall(r"^\| (\d) \| `schedspec\.(\w+)`", README.read_text(), re.M)
    assert rows and {pkg for _, pkg in rows} == set(RANK) - {"__main__"}
    for layer, pkg in rows:
        assert int(layer) == RANK[pkg], pkg


STALE_WORDS = re.compile(
    r"\bissue \d+|\bissues? #?\d+\b|\bsession\b|closing note|\bLatest\b|[Pp]revious round|[Tt]his round"
    r"|before the KV features|an earlier sync run"
)


@pytest.mark.parametrize("path", [README, *OWN_DOCS], ids=lambda p: p.name)
def test_a_doc_says_todays_truth_and_cites_only_the_repository(path: Path) -> None:
    found = [m.group(0) for m in STALE_WORDS.finditer(path.read_text())]
    assert not found, f"{path.name}: {found}"


def _examples() -> list[tuple[str, list[str]]]:
    """Each `$ schedspec ...` command of the README's example blocks and the
    lines shown under it (``...`` elides lines of the real output; a line ending
    in ``, ...`` shows the start of a longer one)."""
    out: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```\n(.*?)```", README.read_text(), re.S):
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            cmd, *shown = chunk.rstrip("\n").split("\n")
            out.append((cmd, [s for s in shown if s.strip()]))
    return out


def _normalise(line: str) -> str:
    return re.sub(r"\(\d[\d,]* steps/s", "(N steps/s", line.rstrip())


@pytest.mark.parametrize("cmd,shown", _examples(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_readme_example_prints_what_the_readme_shows(cmd: str, shown: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    argv = cmd.split()
    assert argv[0] == "schedspec"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        main(argv[1:])
    real = [_normalise(x) for x in buf.getvalue().splitlines()]
    at = 0
    for line in shown:
        if line.strip() == "...":
            continue
        want = _normalise(line)
        if want.endswith(", ..."):
            hits = [i for i in range(at, len(real)) if real[i].startswith(want[:-3])]
        else:
            hits = [i for i in range(at, len(real)) if real[i] == want]
        assert hits, f"the README shows {line!r}, which `{cmd}` does not print (in this order)"
        at = hits[0] + 1
