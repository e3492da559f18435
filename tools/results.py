"""Write docs/results.md from the result records of data/results/*.json.

Every measured figure the docs give is a record: what was measured, the
command line, the machine, the date, the commit and the versions (Python,
torch, vLLM) it ran with. Where a commit or a version could not be
established the record says so in its ``commit_note`` or version text rather
than guess. A record with ``superseded_by`` is kept as data and left out of
the page. The counts the page states about the code (rules, invariants,
vectors, mutants) are computed from the code when the page is written.

    python -m tools.results            # write docs/results.md
    python -m tools.results --check    # exit 1 if docs/results.md is stale

tests/docs/test_results.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "data" / "results"
DOC = ROOT / "docs" / "results.md"

#: The page's sections, in order: topic -> heading and the doc that explains it.
TOPICS: dict[str, tuple[str, str]] = {
    "main": ("The main job", "README.md"),
    "vllm": ("The spec against vLLM 0.33.0", "divergences.md"),
    "coverage": ("Rule coverage", "coverage.md"),
    "fidelity": ("Lines of vLLM reached", "fidelity.md"),
    "bench": ("Benchmark", "impl.md"),
    "equivalence": ("Token equivalence on the CPU", "gpu_runner.md"),
    "cuda": ("Token equivalence on CUDA", "gpu_runner.md"),
    "modelcheck": ("Model checking", "modelcheck.md"),
    "bugzoo": ("Mutation testing", "bugzoo.md"),
}

#: The machines the records name.
MACHINES: dict[str, str] = {
    "dev": "the development machine, 2 vCPUs (one core under load), no GPU, shared with other jobs: wall "
    "times are pessimistic, CPU times the cost",
    "h100": "a lent machine with one NVIDIA H100 80GB HBM3 (driver 580.159.04) and 16 CPU cores",
    "h200": "a lent machine with one NVIDIA H200 (driver 580.159.04) and 16 CPU cores",
}
#: ``commit_note`` "recorded" (or starting so): the commit is the one that wrote the figure into the
#: docs (found with ``git log -S`` on its text); the run was made on that tree or just before it.
RECORDED = "recorded"

REQUIRED = ("id", "topic", "title", "result", "command", "machine", "date", "commit", "commit_note", "versions")
VERSIONS = ("python", "torch", "vllm")


def load_records(folder: Path = RECORDS) -> list[dict[str, Any]]:
    """Every record of ``folder``, checked for its fields, in file-name order."""
    records = []
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        if rec["id"] != path.stem:
            raise ValueError(f"{path}: id {rec['id']!r} is not the file's name")
        if rec["machine"] not in MACHINES:
            raise ValueError(f"{path}: unknown machine {rec['machine']!r} (one of {', '.join(MACHINES)})")
        if rec["topic"] not in TOPICS:
            raise ValueError(f"{path}: unknown topic {rec['topic']!r} (one of {', '.join(TOPICS)})")
        lacking = [v for v in VERSIONS if not rec["versions"].get(v)]
        if lacking:
            raise ValueError(f"{path}: versions lack {', '.join(lacking)} (say 'not imported' or 'unknown')")
        records.append(rec)
    ids = {r["id"] for r in records}
    for rec in records:
        if rec.get("superseded_by") and rec["superseded_by"] not in ids:
            raise ValueError(f"{rec['id']}: superseded_by {rec['superseded_by']!r} names no record")
    return records


def code_counts() -> dict[str, int]:
    """The counts the page states, computed from the code."""
    from schedspec.invariants import CATALOGUE
    from schedspec.spec.rule_names import ALL_GATES, ALL_KV, ALL_MODES, RULES, reachable_in

    return {
        "rules": len(RULES),
        "reachable": len(reachable_in(ALL_MODES, ALL_GATES + ALL_KV)),
        "invariants": len(CATALOGUE),
        "safety": sum(1 for i in CATALOGUE if "safety" in i.tags),
        "spec_vectors": len(list((ROOT / "vectors" / "spec").glob("*.jsonl"))),
        "zoo_vectors": len(list((ROOT / "vectors" / "bugzoo").glob("*.jsonl"))),
    }


def _table(table: dict[str, Any]) -> list[str]:
    cols = table["columns"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
    return lines


def _v(version: str) -> str:
    """A version as the page writes it: "-" for a package the run did not import."""
    return "-" if version == "not imported" else version


def _record(rec: dict[str, Any]) -> list[str]:
    v = rec["versions"]
    commit = rec["commit"] or "commit unknown"
    if rec["commit_note"] != RECORDED:
        commit += f" ({rec['commit_note']})"
    machine = rec["machine"] + (f", load {rec['load']}" if rec.get("load") else "")
    lines = [f"### {rec['title']}", "", f"{rec['result']}. (`{rec['id']}`)", ""]
    if "table" in rec:
        lines += _table(rec["table"]) + [""]
    lines += [
        f"`{rec['command']}` · {machine} · {rec['date']} · {commit} · "
        f"Python {v['python']}, torch {_v(v['torch'])}, vLLM {_v(v['vllm'])}" + (" · per-case data" if "detail" in rec else ""),
        "",
    ]
    return lines


def render(records: list[dict[str, Any]], counts: dict[str, int]) -> str:
    """The whole of docs/results.md."""
    shown = [r for r in records if not r.get("superseded_by")]
    machines = "; ".join(f"`{m}` is {text}" for m, text in MACHINES.items() if any(r["machine"] == m for r in shown))
    out = [
        "# Results",
        "",
        "<!-- generated by python -m tools.results from data/results/*.json: edit the records, not this page -->",
        "",
        "Every measured figure of the docs. Counts in a figure are those of its commit (today: "
        f"{counts['invariants']} invariants, {counts['rules']} named rules, {counts['reachable']} reachable "
        f"with every feature, {counts['spec_vectors']} spec vectors, {counts['zoo_vectors']} bug-zoo "
        "counterexamples). Under each: the command · machine · date · commit · versions; its record "
        "(per-case data too) is `data/results/ID.json`, ID given after the result. "
        f"Machines: {machines}. A bare commit wrote the figure into the docs, the run made on that tree "
        "or just before it. Version `-`: not imported. Superseded runs stay as data, unshown.",
        "",
    ]
    for topic, (heading, doc) in TOPICS.items():
        recs = [r for r in shown if r["topic"] == topic]
        if not recs:
            continue
        out += [f"## {heading}", ""]
        if doc != "README.md":
            out += [f"Explained in [{doc}]({doc}).", ""]
        for rec in recs:
            out += _record(rec)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.results", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/results.md differs from the records")
    args = p.parse_args(argv)
    text = render(load_records(), code_counts())
    if args.check:
        if DOC.read_text() != text:
            print("docs/results.md is stale: run python -m tools.results", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
