"""Soak: a long check per mode with the process's memory sampled as it runs.

    python -m tools.soak --steps 1000000 --modes sync,async,spec,async-spec [--plans-only]
                         [--against impl] [--samples 20] [--json PATH]

Each mode runs ``run_check`` (schedspec.check.gate, the loop behind
``schedspec check``) for ``--steps`` steps against ``--against`` (default
impl, in lockstep with the spec), every gate and KV feature drawn as the
default check draws them. A failure is a finding, its counterexample kept
under ``--out`` (a folder per mode), and the mode goes on from the next
workload seed until its steps are run. After each workload the progress callback takes a
sample once the run has passed the next of ``--samples`` evenly spaced step
marks: the resident set (``VmRSS`` of /proc/self/status, or the peak from
``resource.getrusage`` where there is no /proc) and the objects the garbage
collector tracks.

The verdict per mode reads the samples of the run's second half, after the
caches, the interned names and the allocator's arenas have settled: the
least-squares slope of the resident set, in MB per 100,000 steps, and its
growth from the middle sample to the last. The line is flat when the slope is
below ``--max-slope`` (default 0.5 MB per 100,000 steps: a leak of 5 bytes a
step shows). Exit 1 when a mode is not flat or met a finding; the table and
the JSON give every sample either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedspec.check.gate import CheckProgress, CheckSettings, run_check
from schedspec.cli.common import check_factories

MODES = ("sync", "async", "spec", "async-spec")


def rss_mb() -> float:
    """The process's resident set now, in MB (the peak where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass(frozen=True)
class Sample:
    steps: int
    seconds: float
    rss_mb: float
    objects: int


@dataclass
class ModeSoak:
    mode: str
    steps: int = 0
    workloads: int = 0
    seconds: float = 0.0
    result: str = ""
    samples: list[Sample] = field(default_factory=list)
    #: every check failure met on the way: (workload seed, who failed, what, counterexample folder)
    findings: list[tuple[int, str, str, str]] = field(default_factory=list)

    def second_half(self) -> list[Sample]:
        return [s for s in self.samples if s.steps >= self.steps / 2] if self.samples else []

    def slope(self) -> float:
        """Least-squares slope of the resident set over the second half, MB per 100,000 steps."""
        return slope([(s.steps, s.rss_mb) for s in self.second_half()])

    def growth(self) -> float:
        """The resident set's change from the second half's first sample to the last, MB."""
        half = self.second_half()
        return half[-1].rss_mb - half[0].rss_mb if len(half) >= 2 else 0.0

    def flat(self, max_slope: float) -> bool:
        return len(self.second_half()) >= 3 and self.slope() < max_slope


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (steps, MB) points, in MB per 100,000 steps (0 with fewer than 2)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx * 100_000


def soak_mode(mode: str, steps: int, samples: int, against: str, plans_only: bool, seed: int,
              out_dir: Path) -> ModeSoak:
    """One mode's check with the memory sampled at ``samples`` step marks.
    A failure is a finding, its counterexample kept under ``out_dir``: the
    soak goes on from the next workload seed until the steps are run."""
    target, factories = check_factories(against, "lockstep")
    soak = ModeSoak(mode)
    marks = [steps * (i + 1) // samples for i in range(samples)]
    start = time.monotonic()
    soak.samples.append(Sample(0, 0.0, rss_mb(), len(gc.get_objects())))
    done = 0  # the steps of the checks before this one

    def progress(p: CheckProgress) -> None:
        while marks and done + p.steps >= marks[0]:
            marks.pop(0)
            soak.samples.append(Sample(done + p.steps, time.monotonic() - start, rss_mb(), len(gc.get_objects())))
            s = soak.samples[-1]
            print(f"{mode}: {s.steps:,} steps, {s.rss_mb:.1f} MB, {s.objects:,} objects, {s.seconds:.0f} s",
                  file=sys.stderr, flush=True)

    results = []
    while done < steps:
        settings = CheckSettings(against=against, total_steps=steps - done, seed=seed, modes=(mode,),
                                 plans_only=plans_only, out_dir=out_dir / mode, shrink_time=10.0)
        settings = dataclasses.replace(settings, capabilities=target.capabilities)
        outcome = run_check(factories, settings, progress=progress)
        done += outcome.steps
        soak.workloads += outcome.workloads
        results.append(outcome.result)
        if outcome.failure is None or not outcome.seeds:
            break
        f = outcome.failure
        soak.findings.append((outcome.seed if outcome.seed is not None else outcome.seeds[-1], f.scheduler,
                              f"{f.kind}: {f.message}", str(outcome.out_dir or "")))
        seed = outcome.seeds[-1] + 1
    soak.steps, soak.seconds = done, time.monotonic() - start
    soak.result = "fail" if "fail" in results else results[-1] if results else "pass"
    return soak


def table(soaks: list[ModeSoak], max_slope: float) -> str:
    rows = ["| mode | steps | workloads | s | RSS first / middle / last (MB) | slope, 2nd half (MB per 100k steps) "
            "| growth, 2nd half (MB) | GC objects middle / last | findings | flat |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for s in soaks:
        half = s.second_half()
        mid = half[0] if half else s.samples[-1]
        rows.append(
            f"| {s.mode} | {s.steps:,} | {s.workloads:,} | {s.seconds:.0f} | {s.samples[0].rss_mb:.1f} / "
            f"{mid.rss_mb:.1f} / {s.samples[-1].rss_mb:.1f} | {s.slope():.3f} | {s.growth():+.1f} | "
            f"{mid.objects:,} / {s.samples[-1].objects:,} | {len(s.findings)} | {'yes' if s.flat(max_slope) else 'NO'} |")
    for s in soaks:
        for seed, who, what, where in s.findings:
            rows.append(f"\n{s.mode}: workload seed {seed}, in {who}: {what} ({where})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1_000_000, help="steps per mode (default 1,000,000)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default all)")
    p.add_argument("--against", default="impl", help="the scheduler under test (default impl)")
    p.add_argument("--plans-only", action="store_true", help="the check's fast lockstep (plans every step)")
    p.add_argument("--samples", type=int, default=20, help="memory samples per mode (default 20)")
    p.add_argument("--seed", type=int, default=0, help="first workload seed (default 0)")
    p.add_argument("--max-slope", type=float, default=0.5,
                   help="flat below this many MB per 100,000 steps (default 0.5)")
    p.add_argument("--json", type=Path, help="write every sample here")
    p.add_argument("--out", type=Path, default=Path("schedspec-out") / "soak",
                   help="where the counterexamples of findings go, a folder per mode (default schedspec-out/soak)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: unknown mode(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(MODES)}")
    if args.steps < 1 or args.samples < 3:
        p.error("--steps must be at least 1 and --samples at least 3")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json: folder {args.json.parent} does not exist")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"--out {args.out}: cannot create the folder ({exc.strerror or exc})")
    soaks = []
    for mode in modes:
        soaks.append(soak_mode(mode, args.steps, args.samples, args.against, args.plans_only, args.seed, args.out))
        print(f"{mode}: {soaks[-1].steps:,} steps, {len(soaks[-1].findings)} finding(s)", file=sys.stderr)
    print(table(soaks, args.max_slope))
    ok = all(s.flat(args.max_slope) and not s.findings for s in soaks)
    if args.json is not None:
        report: dict[str, Any] = {
            "command": "python -m tools.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
            "against": args.against, "plans_only": args.plans_only, "max_slope_mb_per_100k": args.max_slope,
            "modes": [dict(dataclasses.asdict(s), slope_mb_per_100k=s.slope(), growth_mb=s.growth(),
                           flat=s.flat(args.max_slope)) for s in soaks],
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
