"""Write the fault table of docs/adapters.md from examples/faults.py's FAULTS.

    python -m tools.faults            # rewrite the table between its markers
    python -m tools.faults --check    # exit 1 if the table is stale

tests/examples/test_faults.py runs every row and the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adapters.md"
BEGIN = "<!-- faults: written by python -m tools.faults from examples/faults.py -->"
END = "<!-- faults: end -->"


def table() -> str:
    from examples.faults import FAULTS

    rows = ["| `examples.faults` class | the fault | exit | what schedspec says (part) |", "| --- | --- | --- | --- |"]
    rows += [f"| `{f.cls}` | {f.what}{' (`' + ' '.join(f.flags) + '`)' if f.flags else ''} | {f.exit} | `{f.says}` |"
             for f in FAULTS]
    return "\n".join(rows)


def render(text: str) -> str:
    """``text`` (the doc) with the table between the markers rewritten."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.faults", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the table in docs/adapters.md is stale")
    args = p.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python -m tools.faults", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
