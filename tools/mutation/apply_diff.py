"""Apply a mutant's diff (``mutmut show NAME`` on stdin) to a tree, in place.

    mutmut show NAME | python tools/mutation/apply_diff.py TREE

mutmut shows a method's lines as it mutated them, dedented to the function,
with hunk positions relative to the function, so ``patch`` cannot place them.
This finds each hunk's old lines (context and removals) in the file by their
text, with any common indentation added, and replaces them with the new ones,
indented alike. Exit 3 when a hunk is not found exactly once.
"""

from __future__ import annotations

import sys
from pathlib import Path


def apply(diff: str, tree: Path) -> None:
    lines = diff.splitlines()
    target = next(line[4:].strip() for line in lines if line.startswith("+++ "))
    target = target.removeprefix("schedspec/")  # schedspec/spec is a link to spec/
    path = tree / target
    text = path.read_text().splitlines()
    hunks: list[tuple[list[str], list[str]]] = []
    for line in lines:
        if line.startswith("@@"):
            hunks.append(([], []))
        elif hunks and not line.startswith(("---", "+++")):
            old, new = hunks[-1]
            body = line[1:]
            if line.startswith("-"):
                old.append(body)
            elif line.startswith("+"):
                new.append(body)
            else:
                old.append(body)
                new.append(body)
    for old, new in hunks:
        found = []
        for indent in range(0, 13, 4):
            pad = " " * indent
            want = [pad + o if o else o for o in old]
            for at in range(len(text) - len(want) + 1):
                if text[at:at + len(want)] == want:
                    found.append((at, pad, len(want)))
        if len(found) != 1:
            raise SystemExit(3)
        at, pad, size = found[0]
        text[at:at + size] = [pad + n if n else n for n in new]
    path.write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    apply(sys.stdin.read(), Path(sys.argv[1]))
