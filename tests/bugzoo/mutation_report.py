"""Summarise a mutmut run of spec/ and impl/ (run from its work directory).

    python tests/bugzoo/mutation_report.py [WORKDIR]   # default /tmp/schedspec-mutmut

Reads ``mutmut results --all true``, sorts every survivor into documented
equivalent mutants (tests/bugzoo/equivalent_mutants.py) and the rest, and
prints killed / timeout / survived / equivalent per file and the score:
(killed + timeout) / (mutants - equivalent). Exit status 1 when a survivor is
not documented as equivalent.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from equivalent_mutants import EQUIVALENT, REASONS  # noqa: E402


def main(argv: list[str]) -> int:
    work = Path(argv[0] if argv else os.environ.get("MUTMUT_WORKDIR", "/tmp/schedspec-mutmut"))
    mutmut = Path(sys.executable).parent / "mutmut"
    out = subprocess.run([str(mutmut), "results", "--all", "true"], cwd=work, capture_output=True, text=True,
                         check=True).stdout
    status: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, st = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            status[name] = st
    per_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    undocumented: list[str] = []
    by_reason: collections.Counter[str] = collections.Counter()
    for name, st in sorted(status.items()):
        module = name.split(".x")[0]
        if st in ("survived", "no tests"):
            if name in EQUIVALENT:
                st = "equivalent"
                by_reason[EQUIVALENT[name]] += 1
            else:
                undocumented.append(f"{name}: {st}")
        per_file[module][st] += 1
    cols = ("killed", "timeout", "equivalent", "survived", "no tests")
    print(f"{'module':24} {'mutants':>8} " + " ".join(f"{c:>10}" for c in cols))
    total: collections.Counter[str] = collections.Counter()
    for module, c in sorted(per_file.items()):
        total.update(c)
        print(f"{module:24} {sum(c.values()):>8} " + " ".join(f"{c[k]:>10}" for k in cols))
    n = sum(total.values())
    print(f"{'all':24} {n:>8} " + " ".join(f"{total[k]:>10}" for k in cols))
    detected = total["killed"] + total["timeout"]
    print(f"score: {detected} / {n - total['equivalent']} non-equivalent mutants killed "
          f"({100 * detected / max(n - total['equivalent'], 1):.1f}%)")
    for reason, count in by_reason.most_common():
        print(f"  equivalent, {reason}: {count}  ({REASONS[reason][:70]}...)")
    stale = sorted(set(EQUIVALENT) - {k for k, v in status.items() if v in ("survived", "no tests")})
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
