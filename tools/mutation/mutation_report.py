"""Summarise a mutmut run of spec/ and impl/ (run from its work directory).

    .venv/bin/python tools/mutation/mutation_report.py [WORKDIR] [--names FILE]   # default /tmp/schedspec-mutmut

With ``--names FILE`` (one mutant name a line, as tools/mutation/sample.py
writes them) only those mutants count: the score of a sample.

Reads ``mutmut results --all true``, sorts every survivor into documented
equivalent mutants (tools/mutation/equivalent_mutants.py) and the rest, and
prints killed / timeout / crashed / survived / equivalent per file and the
score: (killed + timeout + crashed) / (mutants - equivalent); a mutant that
makes the tests hang (timeout) or kill their process (crashed) is detected.
MUTATION_REPORT_MARKDOWN=1 prints the table as markdown. Exit status 1 when a
survivor is not documented as equivalent, or a mutant has no result.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from tools.mutation.equivalent_mutants import EQUIVALENT, REASONS  # noqa: E402


def main(argv: list[str]) -> int:
    only: set[str] | None = None
    if "--names" in argv:
        at = argv.index("--names")
        if at + 1 >= len(argv):
            print("--names needs a file", file=sys.stderr)
            return 2
        only = {line.strip() for line in Path(argv[at + 1]).read_text().splitlines() if line.strip()}
        argv = argv[:at] + argv[at + 2:]
    work = Path(argv[0] if argv else os.environ.get("MUTMUT_WORKDIR", "/tmp/schedspec-mutmut"))
    mutmut = Path(sys.executable).parent / "mutmut"
    out = subprocess.run([str(mutmut), "results", "--all", "true"], cwd=work, capture_output=True, text=True,
                         check=True).stdout
    status: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, st = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name and (only is None or name in only):
            status[name] = st
    per_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    undocumented: list[str] = []
    by_reason: collections.Counter[str] = collections.Counter()
    for name, st in sorted(status.items()):
        module = name.split(".x")[0]
        if st == "segfault":
            st = "crashed"  # the test process died under the mutant: detected
        elif st not in ("killed", "timeout", "survived", "no tests"):
            undocumented.append(f"{name}: {st}")  # not checked, skipped, suspicious: not a result
        if st in ("survived", "no tests"):
            if name in EQUIVALENT:
                st = "equivalent"
                by_reason[EQUIVALENT[name]] += 1
            else:
                undocumented.append(f"{name}: {st}")
        per_file[module][st] += 1
    cols = ("killed", "timeout", "crashed", "equivalent", "survived", "no tests")
    markdown = os.environ.get("MUTATION_REPORT_MARKDOWN") == "1"
    total: collections.Counter[str] = collections.Counter()
    rows: list[tuple[str, collections.Counter[str]]] = []
    for module, c in sorted(per_file.items()):
        total.update(c)
        rows.append((module, c))
    rows.append(("all", total))
    if markdown:
        print("| module | mutants | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 2) + "|")
        for module, c in rows:
            name = f"**{module}**" if module == "all" else f"`{module}`"
            print(f"| {name} | {sum(c.values()):,} | " + " | ".join(f"{c[k]:,}" for k in cols) + " |")
    else:
        print(f"{'module':30} {'mutants':>8} " + " ".join(f"{c:>10}" for c in cols))
        for module, c in rows:
            print(f"{module:30} {sum(c.values()):>8} " + " ".join(f"{c[k]:>10}" for k in cols))
    n = sum(total.values())
    detected = total["killed"] + total["timeout"] + total["crashed"]
    print(f"score: {detected} / {n - total['equivalent']} non-equivalent mutants killed "
          f"({100 * detected / max(n - total['equivalent'], 1):.1f}%)")
    for reason, count in by_reason.most_common():
        print(f"  equivalent, {reason}: {count}  ({REASONS[reason][:70]}...)")
    documented = set(EQUIVALENT) if only is None else set(EQUIVALENT) & only
    stale = sorted(documented - {k for k, v in status.items() if v in ("survived", "no tests")})
    if stale:
        print(f"{len(stale)} documented equivalent mutants did not survive this run (killed, or renumbered):")
        for name in stale:
            print(f"  {name}: {status.get(name, 'absent')}")
    if undocumented:
        print(f"{len(undocumented)} survivors not documented as equivalent:")
        for line in undocumented:
            print("  " + line)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
