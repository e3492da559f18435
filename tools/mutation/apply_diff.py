"""Apply a mutant's diff (``mutmut show NAME`` on stdin) to a tree, in place.

    mutmut show NAME | python tools/mutation/apply_diff.py TREE

mutmut shows a method's lines as it mutated them, dedented to the function,
with hunk positions relative to the function, so ``patch`` cannot place them.
This finds each hunk's old lines (context and removals) in the file by their
stripped text, keeps the file's own context lines, and writes the added lines
with the indentation the file adds to the hunk (the commonest difference over
its lines: a docstring's continuation lines keep theirs). Exit 3 when a hunk
is not found exactly once.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _parse(diff: str, tree: Path) -> tuple[Path, list[str], list[list[tuple[str, str]]]]:
    """The file a mutant's diff changes, its lines, and the diff's hunks as (kind, line) pairs."""
    lines = diff.splitlines()
    target = next(line[4:].strip() for line in lines if line.startswith("+++ "))
    path = tree / target.removeprefix("schedspec/")  # schedspec/spec is a link to spec/
    text = path.read_text().splitlines()
    hunks: list[list[tuple[str, str]]] = []
    for line in lines:
        if line.startswith("@@"):
            hunks.append([])
        elif hunks and not line.startswith(("---", "+++", "#")):
            hunks[-1].append((line[:1], line[1:]))
    return path, text, hunks


def _place(text: list[str], old: list[str]) -> int:
    """Where the hunk's old lines stand in the file (0-based); exit 3 unless exactly once."""
    key = [o.strip() for o in old]
    found = [at for at in range(len(text) - len(old) + 1) if [t.strip() for t in text[at:at + len(old)]] == key]
    if len(found) != 1:
        raise SystemExit(3)
    return found[0]


def mutated_lines(diff: str, tree: Path) -> tuple[Path, list[int]]:
    """The file a mutant changes and the (1-based) numbers of the lines it
    removes or replaces there, unmutated."""
    path, text, hunks = _parse(diff, tree)
    out: list[int] = []
    for ops in hunks:
        at = _place(text, [body for kind, body in ops if kind != "+"])
        j = at
        for kind, _ in ops:
            if kind == "-":
                out.append(j + 1)
            if kind != "+":
                j += 1
    return path, out


def apply(diff: str, tree: Path) -> None:
    path, text, hunks = _parse(diff, tree)
    for ops in hunks:
        old = [body for kind, body in ops if kind != "+"]
        at = _place(text, old)
        shifts = collections.Counter(_indent(text[at + j]) - _indent(o) for j, o in enumerate(old) if o.strip())
        pad = " " * max(0, shifts.most_common(1)[0][0]) if shifts else ""
        new: list[str] = []
        j = at
        for kind, body in ops:
            if kind == "+":
                new.append(pad + body if body else body)
            elif kind == "-":
                j += 1
            else:
                new.append(text[j])
                j += 1
        text[at:at + len(old)] = new
    path.write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    apply(sys.stdin.read(), Path(sys.argv[1]))
