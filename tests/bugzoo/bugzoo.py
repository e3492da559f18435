"""Run the gate against the zoo's mutants; write the zoo table of docs/bugzoo.md.

From the repository root:

    python -m tests.bugzoo.bugzoo                  # run every mutant, print the table
    python -m tests.bugzoo.bugzoo --write-docs     # ... put it in docs/bugzoo.md, and the
                                                   # counterexamples in vectors/bugzoo/
    python -m tests.bugzoo.bugzoo WrongFcfsVictim  # one mutant

Each run is exactly what CI does (tests/bugzoo/test_bugzoo.py): ``schedspec
check --against tests.bugzoo.zoo:NAME`` with the CI budget below, in lockstep with the spec
and every invariant, shrinking the first failure and writing the
counterexample directory. The table's "caught by" and "counterexample"
columns are deterministic (seeded workloads, deterministic shrinking) and the
test checks them against this file's table; times are as measured when the
table was written.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DOC = ROOT / "docs" / "bugzoo.md"
#: Every mutant's shrunk counterexample, kept in the vector corpus: short
#: traces that reach the corners each bug lives in (tests/vectors/test_vectors.py
#: replays them against spec, impl and vLLM; vectors/README.md).
CORPUS = ROOT / "vectors" / "bugzoo"

from tests.bugzoo import zoo  # noqa: E402

#: The CI budget: at most this many steps per mutant, in workloads of this
#: many steps (short workloads keep shrinking cheap), and at most this long
#: shrinking.
STEPS = 10000
WORKLOAD_STEPS = 40
SHRINK_TIME_S = 30.0

TABLE_START = "<!-- zoo-table:start -->"
TABLE_END = "<!-- zoo-table:end -->"


@dataclass
class Result:
    name: str
    rc: int
    kind: str | None  # violation | divergence | error
    caught_by: tuple[str, ...]  # invariant ids, or ("divergence",) / ("error",)
    detail: str  # first line of the failure message
    seed: int | None
    steps_checked: int
    catch_s: float
    shrink_s: float
    cx_steps: int | None
    cx_events: int | None
    trace: Path | None

    @property
    def label(self) -> str:
        """What the table shows under "caught by"."""
        if self.kind is None:
            return "NOT CAUGHT"
        if self.kind == "violation":
            return ", ".join(f"`{v}`" for v in self.caught_by)
        if self.kind == "divergence":
            what = self.detail.split(" differs", 1)[0]
            return f"divergence: `{what}`"
        return f"error: {self.detail}"


def run_mutant(name: str, out_dir: Path, steps: int = STEPS, workload_steps: int = WORKLOAD_STEPS,
               shrink_time: float = SHRINK_TIME_S) -> Result:
    """``schedspec check --against tests.bugzoo.zoo:NAME`` in this process, timed."""
    import schedspec.check.gate as gate
    import schedspec.cli.main as cli

    marks: dict[str, float] = {}
    real_shrink = gate.shrink  # type: ignore[attr-defined]

    def timed_shrink(*args: Any, **kwargs: Any) -> Any:
        marks["caught"] = time.monotonic()
        try:
            return real_shrink(*args, **kwargs)
        finally:
            marks["shrunk"] = time.monotonic()

    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path = out_dir / "summary.json"
    # The zoo's mutants patch impl's synchronous path, so its workloads run in sync mode, drawn
    # by the seeded random generator its figures were calibrated with (the guided default is
    # held to the zoo by tests/bugzoo/test_bugzoo.py::test_guided_gate_catches_every_mutant).
    argv = ["check", "--against", f"tests.bugzoo.zoo:{name}", "--modes", "sync", "--generator", "random", "--steps", str(steps), "--workload-steps",
            str(workload_steps), "--shrink-time", str(shrink_time), "--quiet", "--out", str(out_dir),
            "--json", str(summary_path)]
    out = io.StringIO()
    setattr(gate, "shrink", timed_shrink)
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = cli.main(argv)
    finally:
        setattr(gate, "shrink", real_shrink)
    end = time.monotonic()
    summary = json.loads(summary_path.read_text())
    failure = summary["failure"]
    if failure is None:
        return Result(name, rc, None, (), "", None, summary["steps"], end - start, 0.0, None, None, None)
    trace = Path(failure["trace"])
    cx = json.loads((trace.parent / "summary.json").read_text())
    ids = tuple(sorted({v["id"] for v in failure["violations"]}))
    kind = failure["kind"]
    caught_by = ids if kind == "violation" else (kind,)
    return Result(
        name=name,
        rc=rc,
        kind=kind,
        caught_by=caught_by,
        detail=failure["message"].splitlines()[0],
        seed=failure["workload_seed"],
        steps_checked=summary["steps"],
        catch_s=marks.get("caught", end) - start,
        shrink_s=marks.get("shrunk", end) - marks.get("caught", end),
        cx_steps=cx["steps"],
        cx_events=cx["events"],
        trace=trace,
    )


# ---------------------------------------------------------------- the table


def _issue_link(url: str) -> str:
    m = re.match(r"https://github.com/([^/]+)/([^/]+)/(issues|pull)/(\d+)", url)
    if not m:
        return url
    owner, repo, _, num = m.groups()
    short = {"vllm-project/vllm": "vLLM", "sgl-project/sglang": "SGLang",
             "GeeeekExplorer/nano-vllm": "nano-vllm"}.get(f"{owner}/{repo}", f"{owner}/{repo}")
    return f"[{short} #{num}]({url})"


def cx_text(r: Result) -> str:
    if r.cx_steps is None:
        return "-"
    return f"{r.cx_steps} step{'' if r.cx_steps == 1 else 's'}, {r.cx_events} events"


HEADER = ("| mutant | bug it models | issue | caught by | counterexample | steps checked | "
          "time to catch | shrink time |\n"
          "|---|---|---|---|---|---|---|---|")


def table_row(cls: type[zoo.Mutant], r: Result) -> str:
    cx = cx_text(r)
    return (f"| `{cls.__name__}` | {cls.BUG} | {_issue_link(cls.ISSUE)} | {r.label} | {cx} | "
            f"{r.steps_checked} (seed {r.seed}) | {r.catch_s:.1f} s | {r.shrink_s:.1f} s |")


def parse_doc_rows(text: str) -> dict[str, list[str]]:
    """mutant name -> the cells of its row in the doc's zoo table."""
    rows: dict[str, list[str]] = {}
    if TABLE_START not in text:
        return rows
    body = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    for line in body.splitlines():
        m = re.match(r"\| `(\w+)` \|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split(" | ")]
    return rows


COL_CAUGHT_BY, COL_CX, COL_STEPS_CHECKED = 3, 4, 5


def write_table(rows: list[str], total_s: float) -> None:
    text = DOC.read_text()
    block = (f"{TABLE_START}\n{HEADER}\n" + "\n".join(rows) + "\n\n"
             f"{len(rows)} mutants, {total_s:.0f} s in all, one after another on one core "
             f"(`--steps {STEPS} --workload-steps {WORKLOAD_STEPS} --shrink-time {SHRINK_TIME_S:g}`).\n"
             f"{TABLE_END}")
    head, rest = text.split(TABLE_START, 1)
    tail = rest.split(TABLE_END, 1)[1]
    DOC.write_text(head + block + tail)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="mutants to run (default: all)")
    p.add_argument("--write-docs", action="store_true", help="write the table into docs/bugzoo.md")
    p.add_argument("--steps", type=int, default=STEPS, help=f"step budget per mutant (default {STEPS})")
    args = p.parse_args(argv)
    classes = [c for c in zoo.ALL if not args.names or c.__name__ in args.names]
    rows = []
    total = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for cls in classes:
            r = run_mutant(cls.__name__, Path(tmp) / cls.__name__, steps=args.steps)
            if args.write_docs and r.trace is not None:
                CORPUS.mkdir(exist_ok=True)
                (CORPUS / f"{cls.__name__}.jsonl").write_text(r.trace.read_text())
            row = table_row(cls, r)
            rows.append(row)
            print(row, flush=True)
    total_s = time.monotonic() - total
    print(f"{len(rows)} mutants in {total_s:.0f} s")
    if args.write_docs:
        if args.names:
            print("--write-docs needs the whole zoo", file=sys.stderr)
            return 2
        write_table(rows, total_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
