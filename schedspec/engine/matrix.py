"""The engine matrix (project's side): vLLM's own engine on the CPU, one
variant of its arguments against the baseline, token by token.

:func:`run_matrix` writes a job (workloads x variants) for one engine
process (schedspec.engine.worker), reads its results and :func:`compare`
holds each variant to the baseline: every token equal, the chosen tokens'
logprobs within LOGPROB_TOL. An aborted request is compared on the tokens
both runs produced (the shorter prefix: when the abort lands depends on the
schedule, what came before it does not). The negative control (a scheduler
telling the runner a wrong position) must come out DIVERGED.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedspec.engine.env import run_engine_job

#: logprobs of the same token may differ by fp32 noise between batch shapes
#: (the CPU attention is not batch invariant; measured up to ~1e-5 over the
#: default matrix); a real error moves them by 1e-2 or more
LOGPROB_TOL = 1e-4
VOCAB = 512
BASELINE = "baseline"
CONTROL = "control-shifted-position"
_SMALL_POOL = {"num_gpu_blocks_override": 17, "max_model_len": 512}
_ALL = {"enable_chunked_prefill": True, "max_num_batched_tokens": 64, "enable_prefix_caching": True,
        **_SMALL_POOL, "scheduling_policy": "priority"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


@dataclass(frozen=True)
class Variant:
    name: str
    args: dict[str, Any] = field(default_factory=dict)
    scheduler_cls: str | None = None
    control: bool = False

    def job(self) -> dict[str, Any]:
        return {"name": self.name, "args": dict(self.args), "scheduler_cls": self.scheduler_cls}


VARIANTS: tuple[Variant, ...] = (
    Variant(BASELINE),
    Variant("chunked-prefill", {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}),
    Variant("prefix-caching", {"enable_prefix_caching": True}),
    Variant("small-pool", dict(_SMALL_POOL)),
    Variant("priority", {"scheduling_policy": "priority"}),
    Variant("async-scheduling", {"async_scheduling": True}),
    Variant("ngram-spec", {"speculative_config": dict(NGRAM)}),
    # vLLM 0.32 refuses async scheduling with n-gram speculation ("only supported with
    # EAGLE/MTP/Draft Model/NGram GPU/..."): "everything" is split in two
    Variant("everything-async", {**_ALL, "async_scheduling": True}),
    Variant("everything-ngram", {**_ALL, "speculative_config": dict(NGRAM)}),
    Variant(CONTROL, {}, "schedspec.engine.control:make_shifting_scheduler", control=True),
)


def variants_named(names: list[str] | None) -> list[Variant]:
    """The variants by name (the baseline always first, the control last);
    ValueError naming an unknown one."""
    by_name = {v.name: v for v in VARIANTS}
    if names is None:
        return list(VARIANTS)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    chosen = [BASELINE] + [n for n in names if n not in (BASELINE, CONTROL)]
    if CONTROL in names:
        chosen.append(CONTROL)
    return [by_name[n] for n in chosen]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def default_workloads(seed: int = 0) -> list[dict[str, Any]]:
    """Shared prefixes, arrivals between steps, priorities, aborts and long
    prompts: 40-300 tokens, several 32-token blocks each."""
    rng = random.Random(seed)

    def req(rid: str, prompt: list[int], max_tokens: int, arrival: int,
            priority: int = 0, abort: int | None = None) -> dict[str, Any]:
        return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, "arrival_step": arrival,
                "priority": priority, "abort_step": abort}

    prefix = _prompt(rng, 96)
    shared = [req(f"p{i}", prefix + _prompt(rng, rng.randrange(10, 150)), 24, at)
              for i, at in enumerate((0, 0, 2, 5, 5, 9))]
    arrivals = [req(f"a{i}", _prompt(rng, rng.randrange(40, 301)), rng.randrange(16, 41), at)
                for i, at in enumerate((0, 1, 3, 4, 8, 12, 15, 20))]
    priorities = [req(f"q{i}", _prompt(rng, rng.randrange(40, 260)), 20, at, prio)
                  for i, (at, prio) in enumerate(((0, 3), (0, 2), (1, 0), (3, 1), (4, 0), (6, 2)))]
    aborts = [req(f"x{i}", _prompt(rng, rng.randrange(40, 200)), 30, i,
                  abort=(6 if i == 1 else 12 if i == 3 else None)) for i in range(6)]
    long = [req(f"l{i}", _prompt(rng, rng.randrange(250, 301)), 48, 2 * i) for i in range(3)]
    return [{"name": "shared-prefix", "requests": shared},
            {"name": "arrivals", "requests": arrivals},
            {"name": "priorities", "requests": priorities},
            {"name": "aborts", "requests": aborts},
            {"name": "long-prompts", "requests": long}]


@dataclass
class VariantReport:
    name: str
    verdict: str  # EQUIVALENT, DIVERGED or ERROR
    control: bool
    requests: int = 0
    tokens: int = 0
    max_logprob_diff: float = 0.0
    preemptions: int = 0
    prefix_hits: int = 0
    prefix_queries: int = 0
    chunks: int = 0
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    scheduler: str = ""  # the class the engine built (AsyncScheduler with async scheduling)

    @property
    def ok(self) -> bool:
        return self.verdict == ("DIVERGED" if self.control else "EQUIVALENT")


def compare(baseline: dict[str, Any], variant: dict[str, Any], control: bool = False,
            tol: float = LOGPROB_TOL) -> VariantReport:
    """One variant's worker result against the baseline's."""
    report = VariantReport(variant["name"], "EQUIVALENT", control,
                           wall_s=round(sum(r["wall_s"] for r in variant.get("runs", [])), 3),
                           scheduler=str(variant.get("scheduler", "")))
    if variant.get("error"):
        report.verdict = "ERROR"
        report.problems.append(str(variant["error"]))
        return report
    base_runs = {r["workload"]: r for r in baseline["runs"]}
    for run in variant["runs"]:
        stats = run["stats"]
        report.preemptions += stats["preemptions"]
        report.prefix_hits += stats["prefix_hits"]
        report.prefix_queries += stats["prefix_queries"]
        report.chunks += stats["chunks"]
        base = base_runs.get(run["workload"])
        if base is None:
            report.problems.append(f"{run['workload']}: no baseline run")
            continue
        for rid, want in base["requests"].items():
            got = run["requests"].get(rid)
            where = f"{run['workload']}/{rid}"
            if got is None:
                report.problems.append(f"{where}: missing")
                continue
            report.requests += 1
            a_tok, b_tok = want["tokens"], got["tokens"]
            if want["aborted_at"] is not None or got["aborted_at"] is not None:
                n = min(len(a_tok), len(b_tok))
            else:
                n = len(a_tok)
                if len(b_tok) != n:
                    report.problems.append(f"{where}: {len(b_tok)} tokens, baseline {n}")
            report.tokens += n
            for i in range(min(n, len(b_tok))):
                if a_tok[i] != b_tok[i]:
                    report.problems.append(f"{where}: token {i} is {b_tok[i]}, baseline {a_tok[i]}")
                    break
                if i < len(want["logprobs"]) and i < len(got["logprobs"]):
                    diff = abs(want["logprobs"][i] - got["logprobs"][i])
                    report.max_logprob_diff = max(report.max_logprob_diff, diff)
                    if diff > tol:
                        report.problems.append(f"{where}: logprob {i} differs by {diff:.3g} > {tol:g}")
                        break
    if report.problems:
        report.verdict = "DIVERGED"
    return report


def compare_all(result: dict[str, Any], controls: set[str], tol: float = LOGPROB_TOL) -> list[VariantReport]:
    variants = result["variants"]
    base = next(v for v in variants if v["name"] == BASELINE)
    if base.get("error"):
        return [VariantReport(BASELINE, "ERROR", False, problems=[str(base["error"])])]
    return [compare(base, v, v["name"] in controls, tol) for v in variants]


def report_dict(r: VariantReport) -> dict[str, Any]:
    return {"variant": r.name, "verdict": r.verdict, "control": r.control, "ok": r.ok,
            "requests": r.requests, "tokens": r.tokens, "max_logprob_diff": r.max_logprob_diff,
            "preemptions": r.preemptions, "prefix_hits": r.prefix_hits,
            "prefix_queries": r.prefix_queries, "chunks": r.chunks, "wall_s": r.wall_s,
            "scheduler": r.scheduler, "problems": r.problems}


def render(reports: list[VariantReport]) -> str:
    head = (f"{'variant':<34} {'verdict':<11} {'reqs':>5} {'tokens':>7} {'max dlogp':>10} "
            f"{'preempt':>7} {'hits/queried':>13} {'chunks':>6} {'wall s':>7}")
    lines = [head, "-" * len(head)]
    for r in reports:
        name = r.name + (" (control)" if r.control else "")
        lines.append(f"{name:<34} {r.verdict:<11} {r.requests:>5} {r.tokens:>7} "
                     f"{r.max_logprob_diff:>10.2e} {r.preemptions:>7} "
                     f"{f'{r.prefix_hits}/{r.prefix_queries}':>13} {r.chunks:>6} {r.wall_s:>7.2f}")
        for problem in r.problems[:3]:
            lines.append(f"    {problem}")
    failed = [r.name for r in reports if not r.ok]
    lines.append("all variants EQUIVALENT, control caught" if not failed
                 else f"FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def run_worker(job: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    """Run the job in one engine process (env.run_engine_job)."""
    return run_engine_job("schedspec.engine.worker", job, timeout)


def run_matrix(variants: list[Variant], workloads: list[dict[str, Any]],
               model_dir: str | None = None, timeout: float = 3600.0,
               tol: float = LOGPROB_TOL) -> tuple[list[VariantReport], dict[str, Any]]:
    job = {"model_dir": model_dir, "max_steps": 5000,
           "variants": [v.job() for v in variants], "workloads": workloads}
    result = run_worker(job, timeout)
    reports = compare_all(result, {v.name for v in variants if v.control}, tol)
    return reports, result
