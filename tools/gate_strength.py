"""Gate strength: how many impl/ mutants and zoo bugs the gate kills, and how fast.

    .venv/bin/python tools/gate_strength.py run WORKDIR --sample 400 --seed 1 --shard 1/8 --out DIR
    .venv/bin/python tools/gate_strength.py run - --sample 0 --zoo -1 --gates check --out DIR
    .venv/bin/python tools/gate_strength.py table DIR > table.md
    .venv/bin/python tools/gate_strength.py pack DIR > results.jsonl      # to commit
    .venv/bin/python tools/gate_strength.py unpack results.jsonl DIR     # to resume

``run`` draws the sample as tools/mutation/sample.py does (impl/ mutants only,
tools/mutation/equivalent_mutants.py's equivalents left out), keeps this shard's
share, adds the bug zoo (tests/bugzoo/zoo.py), and runs each against
``schedspec check --against impl --time 60`` and ``schedspec modelcheck --bound
small --against impl`` in a scratch copy of the tree with the mutant applied.
One JSON file per target in DIR (resumable): a gate already run for a target is
not run again, nor any gate once one killed it, so ``--gates check`` over the
whole sample and then ``--gates check,modelcheck`` runs the model checker on the
check's survivors only. A scheduler that cannot even be built is killed.
``--sample 0`` runs the zoo alone (WORKDIR is then not read); ``--gates``
picks the gates; ``--zoo-as impl`` gives the zoo's bugs everything impl declares
(tests/bugzoo/zoo_full.py), so the gate draws for them what it draws for impl. Time to first failure is the check's own clock at the failure
(``found_after_s`` of its JSON summary: warm-up and shrinking left out); for
the model checker, whose summary has no such clock, the whole run's seconds.
Not part of CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.mutation.equivalent_mutants import EQUIVALENT  # noqa: E402
from tools.mutation.gate_survivors import GATE_SURVIVORS  # noqa: E402
from tools.mutation.sample import all_mutants, sample  # noqa: E402

GATES: dict[str, list[str]] = {
    "check": ["check", "--time", "60", "--quiet", "--shrink-time", "30"],
    "modelcheck": ["modelcheck", "--bound", "small", "--quiet"],
}


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N`` -> (K, N), 1 <= K <= N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be K/N with integers, got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def shard_of(names: list[str], k: int, n: int) -> list[str]:
    """Every N-th name from the K-th: the shards partition the list."""
    return names[k - 1::n]


def impl_sample(names: list[str], size: int, seed: int) -> list[str]:
    impl = [m for m in names if m.startswith("schedspec.impl.") and m not in EQUIVALENT]
    return sample(impl, size, seed) if impl else []


def zoo_names() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from tests.bugzoo import zoo
    return sorted(cls.__name__ for cls in zoo.ALL)


def result_path(out: Path, target: str) -> Path:
    return out / (target.replace("/", "_").replace(":", "_") + ".json")


def gate_command(gate: str, check_steps: int | None = None, shrink_time: float | None = None) -> list[str]:
    """The gate's command line; ``check_steps`` replaces the check's 60 s by a
    step budget, which a loaded machine does not shrink; ``shrink_time`` the
    check's 30 s of shrinking."""
    cmd = list(GATES[gate])
    if gate == "check" and check_steps is not None:
        i = cmd.index("--time")
        cmd[i:i + 2] = ["--steps", str(check_steps)]
    if gate == "check" and shrink_time is not None:
        cmd[cmd.index("--shrink-time") + 1] = f"{shrink_time:g}"
    return cmd


#: a gate's verdict when its run outlived ``--timeout`` (neither killed nor survived)
UNDECIDED = "undecided (wall-clock timeout)"


def _run_gate(tree: Path, gate: str, against: str, timeout: float,
              check_steps: int | None = None, shrink_time: float | None = None, nice: int = 10) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "schedspec", *gate_command(gate, check_steps, shrink_time), "--against", against,
           "--json", str(tree / f"{gate}.json"), "--out", str(tree / f"{gate}-out")]
    start = time.monotonic()
    try:
        proc = subprocess.run(["nice", "-n", str(nice), *cmd], cwd=tree, capture_output=True, text=True,
                              timeout=timeout, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        # the wall clock measures the machine's load, not the gate: a mutant
        # that hangs a call is killed by the check's own call deadline, so
        # an outer timeout is undecided (run again on resume)
        return {"verdict": UNDECIDED, "seconds": round(time.monotonic() - start, 1)}
    seconds = round(time.monotonic() - start, 1)
    summary: dict[str, Any] = {}
    try:
        summary = json.loads((tree / f"{gate}.json").read_text())
    except (OSError, ValueError):
        pass
    verdict = {0: "survived", 1: "killed"}.get(proc.returncode, f"error (exit {proc.returncode})")
    if proc.returncode == 2 and "cannot build the scheduler" in proc.stderr:
        # the scheduler raises when built: the gate refuses it, as CI would
        verdict = "killed (cannot build)"
    found_after = (summary.get("failure") or {}).get("found_after_s")
    text = proc.stdout + proc.stderr
    found = re.search(r"violation at event (\d+)", text)
    unreached = re.search(r"never reached: ([^(\n]*)", text)
    return {"verdict": verdict, "seconds": seconds, "found_after_s": found_after, "steps": summary.get("steps"),
            "events": _events(summary),
            "event_of_failure": int(found.group(1)) if found else None,
            "unreached": (summary.get("rule_coverage") or {}).get("unreached"),
            "never_reached": [x.strip() for x in unreached.group(1).split(",") if x.strip()] if unreached else [],
            "tail": (proc.stdout + proc.stderr)[-600:]}


def _events(summary: dict[str, Any]) -> int | None:
    """Events in the shrunk counterexample: the lines of the failure's trace file."""
    trace = (summary.get("failure") or {}).get("trace")
    try:
        return sum(1 for line in Path(trace).read_text().splitlines() if line.strip()) if trace else None
    except OSError:
        return None


def _copy_tree(tree: Path) -> Path:
    """The repository's files (tracked and untracked, not ignored) copied into ``tree``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout
    subprocess.run(["tar", "--null", "-T", "-", "-cf", str(tree / "t.tar")], cwd=ROOT, input=files, check=True)
    subprocess.run(["tar", "-xf", "t.tar"], cwd=tree, check=True)
    (tree / "t.tar").unlink()
    return tree


def run_target(workdir: Path | None, target: str, timeout: float,
               gates: tuple[str, ...] = tuple(GATES), zoo_module: str = "tests.bugzoo.zoo",
               check_steps: int | None = None, shrink_time: float | None = None,
               nice: int = 10) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gate-strength.") as tmp:
        tree = _copy_tree(Path(tmp))
        against = "impl"
        if target.startswith("zoo:"):
            against = f"{zoo_module}:{target[4:]}"
        else:
            assert workdir is not None
            diff = subprocess.run([str(Path(sys.executable).parent / "mutmut"), "show", target], cwd=workdir,
                                  capture_output=True, text=True, check=True).stdout
            applied = subprocess.run([sys.executable, str(ROOT / "tools/mutation/apply_diff.py"), str(tree)],
                                     input=diff, capture_output=True, text=True)
            if applied.returncode:
                return {"target": target, "error": "diff does not apply"}
        rule = "-" if target.startswith("zoo:") else target.split(".x", 1)[-1].split("__mutmut_")[0]
        result: dict[str, Any] = {"target": target, "rule": rule}
        for gate in gates:
            result[gate] = _run_gate(tree, gate, against, timeout, check_steps, shrink_time, nice)
        return result


def survived_every_gate(result: dict[str, Any]) -> bool:
    gates = [result[g] for g in GATES if g in result]
    return bool(gates) and not any(g["verdict"].startswith("killed") or g["verdict"] == UNDECIDED for g in gates)


def executed_lines(out: Path, steps: int) -> dict[str, set[int]]:
    """impl/'s lines the unmutated gate executes: ``schedspec check --against
    impl --steps STEPS`` (seed 0, so the workloads the mutants' runs start
    with) under coverage.py, in a scratch copy; kept in OUT/coverage.json and
    read from there next time."""
    record = out / "coverage.json"
    if not record.exists():
        with tempfile.TemporaryDirectory(prefix="gate-strength-cov.") as tmp:
            tree = _copy_tree(Path(tmp))
            run = [sys.executable, "-m", "coverage", "run", "--data-file", str(tree / ".cov"),
                   f"--include={tree}/impl/*", "-m", "schedspec", "check", "--against", "impl", "--steps",
                   str(steps), "--quiet", "--out", str(tree / "out")]
            env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
            subprocess.run(run, cwd=tree, env=env, capture_output=True, check=False)
            subprocess.run([sys.executable, "-m", "coverage", "json", "--data-file", str(tree / ".cov"), "-o",
                            str(tree / "cov.json")], cwd=tree, env=env, capture_output=True, check=True)
            data = json.loads((tree / "cov.json").read_text())
            files = {str((tree / name).resolve().relative_to(tree.resolve())): sorted(f["executed_lines"])
                     for name, f in data["files"].items()}  # names relative to the tree, or absolute
            record.write_text(json.dumps({"command": f"schedspec check --against impl --steps {steps}",
                                          "executed_lines": files}, indent=1) + "\n")
    files = json.loads(record.read_text())["executed_lines"]
    return {name: set(lines) for name, lines in files.items()}


def reasons(workdir: Path, out: Path, steps: int) -> int:
    """Give every target that survived all its gates a ``reason``: "not
    reached" when the unmutated gate never executes a line the mutant
    changes (executed_lines), else "reached, not observed"."""
    from tools.mutation.apply_diff import mutated_lines

    executed: dict[str, set[int]] | None = None  # the unmutated gate's lines, run once when needed
    for path in sorted(out.glob("*.json")):
        if path.name == "coverage.json":
            continue
        result = json.loads(path.read_text())
        if not survived_every_gate(result) or str(result["target"]).startswith("zoo:"):
            continue
        if result["target"] in GATE_SURVIVORS:
            kind, why = GATE_SURVIVORS[result["target"]]
            result["reason"] = f"{kind}: {why}"
            path.write_text(json.dumps(result, indent=1) + "\n")
            continue
        diff = subprocess.run([str(Path(sys.executable).parent / "mutmut"), "show", result["target"]],
                              cwd=workdir, capture_output=True, text=True, check=True).stdout
        try:
            file, lines = mutated_lines(diff, ROOT)
        except SystemExit:
            result["reason"] = "diff does not apply"
        else:
            if executed is None:
                executed = executed_lines(out, steps)
            ran = executed.get(str(file.resolve().relative_to(ROOT.resolve())), set())
            result["reason"] = "reached, not observed" if ran & set(lines) else "not reached"
            result["lines"] = lines
        path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def table(results: list[dict[str, Any]], command: str) -> str:
    lines = [f"`{command}`", "", f"{len(results)} targets", ""]
    for gate in GATES:
        rows = [r[gate] for r in results if gate in r]
        if not rows:
            continue
        killed = [r for r in rows if r["verdict"].startswith("killed")]
        secs = sorted(first_failure_s(r) for r in killed)
        if secs:
            p90 = secs[min(len(secs) - 1, int(0.9 * len(secs)))]
            timing = f"first failure median {round(float(statistics.median(secs)), 2)} s, p90 {p90} s, max {secs[-1]} s"
            counts = sorted(int(r["steps"]) for r in killed if r.get("steps") is not None)
            if gate == "check" and len(counts) == len(killed):
                q90 = counts[min(len(counts) - 1, int(0.9 * len(counts)))]
                timing += f"; steps run to it median {statistics.median(counts):g}, p90 {q90}, max {counts[-1]}"
        else:
            timing = "no failure"
        undecided = sum(r["verdict"] == UNDECIDED for r in rows)
        lines.append(f"- {gate}: killed {len(killed)}/{len(rows)}" + (f", {undecided} undecided" if undecided else "")
                     + f"; {timing}")
    survivors = [r for r in results if survived_every_gate(r)]
    if survivors:
        why = collections.Counter(str(r.get("reason", "not yet explained")).split(":")[0] for r in survivors)
        lines.append(f"- survived every gate run: {len(survivors)} ("
                     + ", ".join(f"{n} {k}" for k, n in sorted(why.items())) + ")")
    lines += ["", "| target | rule | check | modelcheck | survivor's reason |", "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: str(r["target"])):
        cells = [_cell(r[g]) if g in r else str(r.get("error", "-")) for g in GATES]
        reason = r.get("reason", "") if survived_every_gate(r) else ""
        lines.append(f"| {r['target']} | {r.get('rule', '')} | {cells[0]} | {cells[1]} | {reason} |")
    return "\n".join(lines) + "\n"


def first_failure_s(gate: dict[str, Any]) -> float:
    """Seconds to the first failure: the check's own clock where its summary
    has it, else the whole run's."""
    found = gate.get("found_after_s")
    return round(float(found), 1) if found is not None else float(gate["seconds"])


def _cell(gate: dict[str, Any]) -> str:
    events = f", {gate['events']} events" if gate.get("events") else ""
    caught = f", caught after {first_failure_s(gate)} s" if gate.get("found_after_s") is not None else ""
    return f"{gate['verdict']} ({gate['seconds']} s{caught}{events})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("workdir", type=Path)
    r.add_argument("--sample", type=int, default=400)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--shard", default="1/1")
    r.add_argument("--zoo", type=int, default=3, help="zoo bugs to add (default 3; -1: all)")
    r.add_argument("--timeout", type=float, default=300)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--gates", default=",".join(GATES), help="comma-separated, of: " + ", ".join(GATES))
    r.add_argument("--check-steps", type=int, default=None,
                   help="the check's budget in steps instead of 60 s (a loaded machine runs fewer steps in 60 s)")
    r.add_argument("--shrink-time", type=float, default=None,
                   help="the check's seconds of shrinking a failure (default 30)")
    r.add_argument("--nice", type=int, default=10, help="the gates' niceness (default 10)")
    r.add_argument("--zoo-as", choices=("core", "impl"), default="core",
                   help="the zoo's classes as they are (core features only: tests.bugzoo.zoo) or declaring "
                        "everything impl declares (tests.bugzoo.zoo_full)")
    t = sub.add_parser("table")
    t.add_argument("out", type=Path)
    pk = sub.add_parser("pack", help="every result of OUT as JSON lines on stdout (a record to commit)")
    pk.add_argument("out", type=Path)
    un = sub.add_parser("unpack", help="results packed by `pack` into OUT, so that `run` resumes from them")
    un.add_argument("packed", type=Path)
    un.add_argument("out", type=Path)
    why = sub.add_parser("reasons", help="explain the survivors: reached by the unmutated gate or not")
    why.add_argument("workdir", type=Path)
    why.add_argument("out", type=Path)
    why.add_argument("--steps", type=int, default=6000)
    args = parser.parse_args(argv)
    if args.cmd == "reasons":
        return reasons(args.workdir, args.out, args.steps)
    if args.cmd == "pack":
        meta = args.out / "command.txt"
        if meta.exists():
            print(json.dumps({"command": meta.read_text().strip()}))
        for f in sorted(f for f in args.out.glob("*.json") if f.name != "coverage.json"):
            print(json.dumps(json.loads(f.read_text()), sort_keys=True))
        return 0
    if args.cmd == "unpack":
        args.out.mkdir(parents=True, exist_ok=True)
        for number, line in enumerate(args.packed.read_text().splitlines(), 1):
            try:
                obj = json.loads(line)
            except ValueError as exc:
                print(f"{args.packed}:{number}: not JSON: {exc}", file=sys.stderr)
                return 2
            if "command" in obj and "target" not in obj:
                (args.out / "command.txt").write_text(obj["command"] + "\n")
            elif isinstance(obj.get("target"), str):
                result_path(args.out, obj["target"]).write_text(json.dumps(obj, indent=1) + "\n")
            else:
                print(f"{args.packed}:{number}: target: missing", file=sys.stderr)
                return 2
        return 0
    if args.cmd == "table":
        files = sorted(f for f in args.out.glob("*.json") if f.name != "coverage.json")
        if not files:
            print(f"no result files in {args.out}", file=sys.stderr)
            return 2
        meta = args.out / "command.txt"
        command = meta.read_text().strip() if meta.exists() else "(command not recorded)"
        sys.stdout.write(table([json.loads(f.read_text()) for f in files], command))
        return 0
    try:
        k, n = parse_shard(args.shard)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    gates = tuple(g for g in args.gates.split(",") if g)
    if not gates or set(gates) - set(GATES):
        print(f"--gates: expected a comma-separated list of {', '.join(GATES)}, got {args.gates!r}", file=sys.stderr)
        return 2
    zoo = zoo_names()
    targets = impl_sample(all_mutants(args.workdir), args.sample, args.seed) if args.sample > 0 else []
    targets += ["zoo:" + z for z in (zoo if args.zoo < 0 else zoo[:args.zoo])]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "command.txt").write_text("tools/gate_strength.py " + " ".join(argv) + "\n")
    for target in shard_of(targets, k, n):
        path = result_path(args.out, target)
        done: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        todo = tuple(g for g in gates if g not in done or done[g]["verdict"] == UNDECIDED)
        if not todo or any(done[g]["verdict"].startswith("killed") for g in GATES if g in done):
            continue  # every gate asked for ran, or one already killed it
        zoo_module = "tests.bugzoo.zoo_full" if args.zoo_as == "impl" else "tests.bugzoo.zoo"
        res = {**done, **run_target(args.workdir, target, args.timeout, todo, zoo_module, args.check_steps,
                                         args.shrink_time, args.nice)}
        path.write_text(json.dumps(res, indent=1) + "\n")
        print(target, {g: res[g]["verdict"] for g in GATES if g in res}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
