#!/usr/bin/env python3
"""Summarise `schedspec equivalence --json` reports of CPU and CUDA runs.

    python3 scripts/equivalence_summary.py REPORT.json ... [--out SUMMARY.md]

Matrix reports of the same model and mode are merged (parts split by --seed /
--workloads are put together; a workload seen twice on one device is counted
once) and printed as one markdown table per model/mode: per variant the CPU
and CUDA steps/s and tok/s and their ratio (CUDA / CPU), whether every token
was equal and how many sampled logits rows were bitwise equal, on each device.
A cross-device line compares the baselines' generated tokens (baseline_outputs)
of the CPU and CUDA reports: equal workloads n/m and the first difference.
`--cross-device` and `--max-batch` reports among the inputs get a line each.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Side:
    """One device's merged matrix reports of one model and mode."""

    files: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    comparisons: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    baseline_outputs: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    # variant -> [steps, tokens, implied seconds for steps, implied seconds for tokens]
    rates: dict[str, list[float]] = field(default_factory=dict)
    devices: set[str] = field(default_factory=set)
    environment: dict[str, Any] = field(default_factory=dict)
    ok: bool = True
    repeat_failures: int = 0

    def add(self, path: str, rep: dict[str, Any]) -> None:
        self.files.append(path)
        self.devices.add(str(rep.get("device")))
        self.environment = self.environment or dict(rep.get("environment") or {})
        self.ok = self.ok and bool(rep.get("ok"))
        self.repeat_failures += len(rep.get("repeat_failures") or [])
        for v in rep.get("variants", []):
            if v["name"] not in self.variants:
                self.variants.append(v["name"])
        new = set()
        for c in rep.get("comparisons", []):
            key = (c["workload"], c["variant"])
            if key not in self.comparisons:
                self.comparisons[key] = c
                new.add(c["workload"])
        for w, outs in (rep.get("baseline_outputs") or {}).items():
            self.baseline_outputs.setdefault(w, outs)
        if not new and self.files[:-1]:
            return  # every workload already counted: its rates would count twice
        for name, r in (rep.get("rates") or {}).items():
            acc = self.rates.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            steps, toks = float(r.get("steps", 0)), float(r.get("tokens_generated", 0))
            sps, tps = float(r.get("steps_per_s", 0.0)), float(r.get("tok_per_s", 0.0))
            acc[0] += steps
            acc[1] += toks
            acc[2] += steps / sps if sps > 0 else float(r.get("seconds", 0.0))
            acc[3] += toks / tps if tps > 0 else float(r.get("seconds", 0.0))

    def rate(self, variant: str) -> tuple[float, float] | None:
        acc = self.rates.get(variant)
        if not acc:
            return None
        return (acc[0] / acc[2] if acc[2] > 0 else 0.0, acc[1] / acc[3] if acc[3] > 0 else 0.0)

    def verdict(self, variant: str) -> tuple[str, str]:
        """(all tokens equal yes/no, logits bitwise n/m) of one variant."""
        rows = [c for (_, v), c in self.comparisons.items() if v == variant]
        if not rows:
            return "-", "-"
        tokens_ok = all(not any(" tokens@" in d or " missing@" in d or " status@" in d for d in c.get("divergences", []))
                        for c in rows)
        bitwise = sum(int(c.get("logits_bitwise", 0)) for c in rows)
        compared = sum(int(c.get("logits_compared", 0)) for c in rows)
        return ("yes" if tokens_ok else "NO"), f"{bitwise}/{compared}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None and a > 0 else "-"


def cross_line(cpu: Side, cuda: Side) -> str:
    """The baselines' tokens on the two devices, workload by workload."""
    common = sorted(set(cpu.baseline_outputs) & set(cuda.baseline_outputs), key=lambda w: (len(w), w))
    if not common:
        return "cross-device (baseline tokens, CPU vs CUDA): no workload in both"
    equal = 0
    first = ""
    for w in common:
        a, b = cpu.baseline_outputs[w], cuda.baseline_outputs[w]
        if a == b:
            equal += 1
            continue
        if not first:
            for rid in sorted(set(a) | set(b)):
                ta, tb = a.get(rid, []), b.get(rid, [])
                if ta != tb:
                    k = next((i for i in range(min(len(ta), len(tb))) if ta[i] != tb[i]), min(len(ta), len(tb)))
                    first = (f"; first difference {w}/{rid} token {k}: CPU {ta[k] if k < len(ta) else 'end'}, "
                             f"CUDA {tb[k] if k < len(tb) else 'end'}")
                    break
    return f"cross-device (baseline tokens, CPU vs CUDA): equal workloads {equal}/{len(common)}{first}"


def summarise(paths: list[str]) -> str:
    sides: dict[tuple[str, str], dict[str, Side]] = {}
    extra: list[str] = []
    for p in paths:
        try:
            rep = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"{p}: cannot read a JSON report: {exc}") from None
        if rep.get("kind") == "cross-device":
            ws = rep.get("workloads", [])
            rows = sum(w["rows_compared"] for w in ws)
            bitwise = sum(w["rows_bitwise"] for w in ws)
            worst = max((w["max_abs_diff"] for w in ws), default=0.0)
            diff = next((w for w in ws if not w["equal"]), None)
            where = ""
            if diff:
                d = diff["difference"]
                fc = d.get("first_capture") or {}
                where = (f"; first difference {diff['workload']}/{d['request_id']} token {d['index']} "
                         f"({d['tokens'][0]} vs {d['tokens'][1]}, margins {d['margins'][0]:.3g} / {d['margins'][1]:.3g}), "
                         f"parts at {fc.get('name', '?')} (max |diff| {fc.get('max_abs_diff', 0):.3g})")
            ld = next((w["logit_difference"] for w in ws if w.get("logit_difference")), None)
            if not diff and ld:
                fc = ld.get("first_capture") or {}
                where = (f"; the first logits row not bitwise equal ({ld['request_id']} token {ld['index']}) parts at "
                         f"{fc.get('name', '?')} (max |diff| {fc.get('max_abs_diff', 0):.3g})")
            extra.append(f"- cross-device `{Path(p).name}`: {rep['model']} {rep['mode']}, {' vs '.join(rep['labels'])}: "
                         f"tokens equal in {sum(w['equal'] for w in ws)}/{len(ws)} workloads, {bitwise}/{rows} logits rows "
                         f"bitwise, max |logit diff| {worst:.3g}{where}")
            continue
        if rep.get("kind") == "max-batch":
            extra.append(f"- max batch `{Path(p).name}`: {rep['model']} {rep['mode']} on {rep['device']}: largest "
                         f"{rep['largest_tokens']} tokens per step ({rep['prompt_len']}-token prompts); {rep['stopped']}")
            continue
        if "comparisons" not in rep:
            raise SystemExit(f"{p}: not an equivalence report (no comparisons)")
        dev = "cuda" if str(rep.get("device", "")).startswith("cuda") else "cpu"
        sides.setdefault((str(rep["model"]), str(rep["mode"])), {}).setdefault(dev, Side()).add(p, rep)
    out: list[str] = []
    for (model, mode), by_dev in sorted(sides.items()):
        cpu, cuda = by_dev.get("cpu", Side()), by_dev.get("cuda", Side())
        n_cpu = len({w for w, _ in cpu.comparisons})
        n_cuda = len({w for w, _ in cuda.comparisons})
        out.append(f"### {model}, {mode} mode: {n_cpu} workloads on the CPU, {n_cuda} on CUDA")
        out.append("")
        env = cuda.environment or cpu.environment
        if cuda.environment:
            out.append(f"CUDA: torch {env.get('torch')}, CUDA {env.get('cuda')}, {env.get('device_name')}")
            out.append("")
        out.append("| variant | CPU steps/s | CUDA steps/s | ratio | CPU tok/s | CUDA tok/s | ratio | "
                   "all tokens equal (CPU / CUDA) | logits bitwise CPU | logits bitwise CUDA |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        names = ["baseline", *cpu.variants, *(v for v in cuda.variants if v not in cpu.variants)]
        for name in names:
            a, b = cpu.rate(name), cuda.rate(name)
            ta, ba = cpu.verdict(name)
            tb, bb = cuda.verdict(name)
            out.append(
                f"| {name} | {_fmt(a[0] if a else None)} | {_fmt(b[0] if b else None)} | "
                f"{_ratio(a[0] if a else None, b[0] if b else None)} | {_fmt(a[1] if a else None)} | "
                f"{_fmt(b[1] if b else None)} | {_ratio(a[1] if a else None, b[1] if b else None)} | "
                f"{ta} / {tb} | {ba} | {bb} |"
            )
        out.append("")
        verdicts = []
        for label, side in (("CPU", cpu), ("CUDA", cuda)):
            if side.files:
                verdicts.append(f"{label}: {'EQUIVALENT' if side.ok else 'NOT EQUIVALENT'} "
                                f"({len(side.files)} report(s){', ' + str(side.repeat_failures) + ' repeat failures' if side.repeat_failures else ''})")
        out.append("; ".join(verdicts))
        if cpu.files and cuda.files:
            out.append("")
            out.append(cross_line(cpu, cuda))
        out.append("")
    if extra:
        out.extend(extra)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("reports", nargs="+", help="--json reports of schedspec equivalence")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    text = summarise(args.reports)
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
