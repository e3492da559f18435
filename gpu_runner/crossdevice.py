"""Cross-device equivalence: the same weights on two models, the same tokens?

``cross_device`` runs the BASELINE configuration of each workload (no chunked
prefill, no prefix caching, no preemption) on two ``PagedLlama`` instances
that hold the same weights: for issue 18, exact mode on CUDA against exact
mode on the CPU, but any two models work (two CPU models, one with a weight
perturbed, is how it is tested). Per request it compares the generated
tokens; for the logits rows before the first difference the largest
``|logit diff|`` and how many rows are bitwise equal. Where a token differs it
gives the index, both tokens, both models' top-2 logits and margins, and a
localisation: the step that produced the first differing token is re-run on
both models (the plans before it are replayed on fresh caches) with the
forward's capture hook on, and each capture point (embedding, each layer's
attention output, the stream after it, the MLP output, the stream after the
layer, the final norm, the logits) is compared; the first point whose max
``|diff|`` is above 0 names the op where the two devices part, and the
magnitudes along the way say how the difference grew. Where every token
agrees but logits rows are not bitwise equal, the earliest such row is
localised the same way (``WorkloadCross.logit_difference``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from schedspec.spec.interface import SchedulerConfig, SchedulerFactory, StepPlan, StepResult

from schedspec.check.workload import Workload
from schedspec.gpu_runner.equivalence import (
    Progress,
    RunRecord,
    baseline_config,
    drive,
    make_workloads,
    spec_factory,
)
from schedspec.gpu_runner.executor import Executor
from schedspec.gpu_runner.model import PagedLlama, describe_facts, determinism_facts


class RecordingExecutor(Executor):
    """An Executor that keeps every plan, its context and its result, and for
    each request the step index of each token it sampled."""

    def __init__(self, model: PagedLlama, config: SchedulerConfig) -> None:
        super().__init__(model, config)
        self.record: list[tuple[StepPlan, dict[str, tuple[int, ...]] | None, StepResult]] = []
        self.token_steps: dict[str, list[int]] = {}

    def execute(self, plan: StepPlan, context: Mapping[str, Sequence[int]] | None = None) -> StepResult:
        ctx = None if context is None else {rid: tuple(t) for rid, t in context.items()}
        result = super().execute(plan, context)
        for rid, toks in result.sampled.items():
            self.token_steps.setdefault(rid, []).extend([len(self.record)] * len(toks))
        self.record.append((plan, ctx, result))
        return result


@dataclass
class CapturePoint:
    """One intermediate tensor of the re-run step on both models."""

    name: str
    max_abs_diff: float
    magnitude: float  # max |value| on the first model

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "max_abs_diff": self.max_abs_diff, "magnitude": self.magnitude}


@dataclass
class TokenDifference:
    """The first token where the two models part, and where it comes from."""

    request_id: str
    index: int  # output token index
    step: int  # index of the step (in the run) that sampled it
    token_a: int
    token_b: int
    top2_a: list[tuple[int, float]]
    top2_b: list[tuple[int, float]]
    captures: list[CapturePoint] = field(default_factory=list)
    note: str = ""

    @property
    def margin_a(self) -> float:
        return self.top2_a[0][1] - self.top2_a[1][1] if len(self.top2_a) > 1 else float("inf")

    @property
    def margin_b(self) -> float:
        return self.top2_b[0][1] - self.top2_b[1][1] if len(self.top2_b) > 1 else float("inf")

    @property
    def first_capture(self) -> CapturePoint | None:
        return next((c for c in self.captures if c.max_abs_diff > 0), None)

    def explain(self, labels: tuple[str, str]) -> str:
        a, b = labels
        lines = [
            f"{self.request_id} token {self.index} (step {self.step}): {a} {self.token_a}, {b} {self.token_b}; "
            f"{a} top-2 {_top2(self.top2_a)} margin {self.margin_a:.3g}; "
            f"{b} top-2 {_top2(self.top2_b)} margin {self.margin_b:.3g}"
        ]
        first = self.first_capture
        if first is None:
            lines.append("  every capture point of the step is bitwise equal" + (f" ({self.note})" if self.note else ""))
        else:
            lines.append(f"  first difference at {first.name}: max |diff| {first.max_abs_diff:.3g} "
                         f"(max |value| {first.magnitude:.3g})")
            shown = [c for c in self.captures if c.max_abs_diff > 0]
            lines.append("  along the way: " + ", ".join(f"{c.name} {c.max_abs_diff:.2g}" for c in _thin(shown)))
        if self.note and first is not None:
            lines.append(f"  {self.note}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        first = self.first_capture
        return {
            "request_id": self.request_id, "index": self.index, "step": self.step,
            "tokens": [self.token_a, self.token_b],
            "top2": [[list(t) for t in self.top2_a], [list(t) for t in self.top2_b]],
            "margins": [self.margin_a, self.margin_b],
            "first_capture": first.to_json() if first else None,
            "captures": [c.to_json() for c in self.captures],
            "note": self.note,
        }


def _top2(top: list[tuple[int, float]]) -> str:
    return ", ".join(f"{t}:{v:.6g}" for t, v in top)


def _thin(points: list[CapturePoint], keep: int = 12) -> list[CapturePoint]:
    """At most ``keep`` points, evenly spread, the first and last included."""
    if len(points) <= keep:
        return points
    idx = sorted({round(i * (len(points) - 1) / (keep - 1)) for i in range(keep)})
    return [points[i] for i in idx]


@dataclass
class WorkloadCross:
    workload: str
    requests: int
    tokens_compared: int = 0
    rows_compared: int = 0
    rows_bitwise: int = 0
    max_abs_diff: float = 0.0
    difference: TokenDifference | None = None
    #: where all tokens agree but a logits row does not: the earliest such row,
    #: localised like a token difference (its tokens are the same)
    logit_difference: TokenDifference | None = None
    tokens_a: int = 0
    tokens_b: int = 0
    seconds_a: float = 0.0
    seconds_b: float = 0.0

    @property
    def equal(self) -> bool:
        return self.difference is None


@dataclass
class CrossDeviceReport:
    model: str
    mode: str
    labels: tuple[str, str]
    environment: tuple[dict[str, Any], dict[str, Any]]
    workloads: list[WorkloadCross] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(w.equal for w in self.workloads)

    def table(self) -> str:
        a, b = self.labels
        head = (f"{'workload':<10} {'requests':>8} {'tokens':>7} {'equal':>6} {'rows':>6} {'bitwise':>7} "
                f"{'max|dl|':>9} {a + ' s':>8} {b + ' s':>8}")
        lines = [
            f"cross-device: model {self.model}, mode {self.mode}, baseline config, {a} against {b}: "
            f"{len(self.workloads)} workloads in {self.seconds:.1f} s",
            f"{a}: {describe_facts(self.environment[0])}",
            f"{b}: {describe_facts(self.environment[1])}",
            head,
            "-" * len(head),
        ]
        for w in self.workloads:
            lines.append(
                f"{w.workload:<10} {w.requests:>8} {w.tokens_compared:>7} {'yes' if w.equal else 'NO':>6} "
                f"{w.rows_compared:>6} {w.rows_bitwise:>7} {w.max_abs_diff:>9.3g} {w.seconds_a:>8.2f} {w.seconds_b:>8.2f}"
            )
        rows = sum(w.rows_compared for w in self.workloads)
        bitwise = sum(w.rows_bitwise for w in self.workloads)
        worst = max((w.max_abs_diff for w in self.workloads), default=0.0)
        equal = sum(w.equal for w in self.workloads)
        lines.append(f"all: {equal}/{len(self.workloads)} workloads with equal tokens; {bitwise}/{rows} logits rows "
                     f"bitwise equal; max |logit diff| {worst:.3g}")
        for w in self.workloads:
            if w.difference is not None:
                lines.append(f"DIFFERS {w.workload}: " + w.difference.explain(self.labels))
        logit_only = next((w for w in self.workloads if w.logit_difference is not None), None)
        if logit_only is not None and logit_only.logit_difference is not None:
            lines.append(f"first logits row not bitwise equal ({logit_only.workload}): "
                         + logit_only.logit_difference.explain(self.labels))
        lines.append("TOKENS EQUAL" if self.ok else "TOKENS DIFFER")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "cross-device",
            "model": self.model,
            "mode": self.mode,
            "labels": list(self.labels),
            "environment": list(self.environment),
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "workloads": [
                {
                    "workload": w.workload, "requests": w.requests, "equal": w.equal,
                    "tokens_compared": w.tokens_compared, "rows_compared": w.rows_compared,
                    "rows_bitwise": w.rows_bitwise, "max_abs_diff": w.max_abs_diff,
                    "tokens_generated": [w.tokens_a, w.tokens_b], "seconds": [round(w.seconds_a, 4), round(w.seconds_b, 4)],
                    "difference": w.difference.to_json() if w.difference else None,
                    "logit_difference": w.logit_difference.to_json() if w.logit_difference else None,
                }
                for w in self.workloads
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _top(row: torch.Tensor | None) -> list[tuple[int, float]]:
    if row is None:
        return []
    vals, idx = torch.topk(row.float(), min(2, int(row.shape[-1])))
    return [(int(i), float(v)) for v, i in zip(vals.tolist(), idx.tolist())]


def capture_step(model: PagedLlama, config: SchedulerConfig, record: Sequence[tuple[StepPlan, Any, StepResult]],
                 step: int) -> list[tuple[str, torch.Tensor]]:
    """Replay ``record``'s plans before ``step`` on a fresh executor of
    ``model`` and run the forward of plan ``step`` with the capture hook on:
    every capture point's tensor, on the CPU, in order."""
    ex = Executor(model, config, keep_logits=False)
    for plan, ctx, _ in record[:step]:
        ex.run(plan, ctx)
    plan, ctx, _ = record[step]
    batch = ex.build_batch(plan, ctx)
    points: list[tuple[str, torch.Tensor]] = []

    def hook(name: str, t: torch.Tensor) -> None:
        points.append((name, t.detach().to("cpu", copy=True)))

    model.forward(batch, ex.cache, capture=hook)
    return points


def localise(model_a: PagedLlama, model_b: PagedLlama, config: SchedulerConfig,
             rec_a: Sequence[tuple[StepPlan, Any, StepResult]], rec_b: Sequence[tuple[StepPlan, Any, StepResult]],
             step: int) -> tuple[list[CapturePoint], str]:
    """Capture step ``step`` on both models and compare point by point."""
    if step >= len(rec_a) or step >= len(rec_b):
        return [], f"step {step} is past one run's end"
    if rec_a[step][0] != rec_b[step][0]:
        return [], f"the plans of step {step} differ: the runs parted before it"
    pa = capture_step(model_a, config, rec_a, step)
    pb = capture_step(model_b, config, rec_b, step)
    out: list[CapturePoint] = []
    for (na, ta), (nb, tb) in zip(pa, pb):
        if na != nb or ta.shape != tb.shape:
            return out, f"capture points differ at {na} / {nb}"
        diff = float((ta - tb).abs().max()) if ta.numel() else 0.0
        out.append(CapturePoint(na, diff, float(ta.abs().max()) if ta.numel() else 0.0))
    return out, ""


def compare_pair(model_a: PagedLlama, model_b: PagedLlama, config: SchedulerConfig, workload: Workload,
                 factory: SchedulerFactory, labels: tuple[str, str]) -> WorkloadCross:
    """One workload's baseline run on both models, compared."""
    ex_a, ex_b = RecordingExecutor(model_a, config), RecordingExecutor(model_b, config)
    ra: RunRecord = drive(factory, ex_a, workload, variant=labels[0])
    rb: RunRecord = drive(factory, ex_b, workload, variant=labels[1])
    wc = WorkloadCross(workload.name, len(ra.outputs), tokens_a=ra.tokens_generated, tokens_b=rb.tokens_generated,
                       seconds_a=ra.counters.seconds, seconds_b=rb.counters.seconds)
    firsts: list[tuple[int, str, int]] = []  # (step, request, index)
    first_rows: list[tuple[int, str, int]] = []  # (step, request, index) of logits rows not bitwise equal
    for rid in sorted(ra.outputs):
        a, b = ra.outputs[rid], rb.outputs.get(rid, ())
        n = min(len(a), len(b))
        first = next((i for i in range(n) if a[i] != b[i]), None)
        if first is None and len(a) != len(b):
            first = n  # one stopped earlier: the token after the shorter run's end differs in effect
        upto = n if first is None else min(first, n)
        wc.tokens_compared += upto
        for k in range(upto):
            la, lb = ra.logits.get((rid, k)), rb.logits.get((rid, k))
            if la is None or lb is None:
                continue
            wc.rows_compared += 1
            if torch.equal(la, lb):
                wc.rows_bitwise += 1
            else:
                wc.max_abs_diff = max(wc.max_abs_diff, float((la - lb).abs().max()))
                steps_of = ex_a.token_steps.get(rid, [])
                if k < len(steps_of):
                    first_rows.append((steps_of[k], rid, k))
        if first is not None:
            steps_a = ex_a.token_steps.get(rid, [])
            steps_b = ex_b.token_steps.get(rid, [])
            step = min(steps_a[first] if first < len(steps_a) else 1 << 30,
                       steps_b[first] if first < len(steps_b) else 1 << 30)
            firsts.append((step, rid, first))
    if firsts:
        step, rid, k = min(firsts)
        a, b = ra.outputs[rid], rb.outputs.get(rid, ())
        diff = TokenDifference(
            rid, k, step,
            a[k] if k < len(a) else -1, b[k] if k < len(b) else -1,
            _top(ra.logits.get((rid, k))), _top(rb.logits.get((rid, k))),
        )
        diff.captures, diff.note = localise(model_a, model_b, config, ex_a.record, ex_b.record, step)
        wc.difference = diff
    elif first_rows:
        step, rid, k = min(first_rows)
        tok = ra.outputs[rid][k]
        diff = TokenDifference(rid, k, step, tok, tok, _top(ra.logits.get((rid, k))), _top(rb.logits.get((rid, k))),
                               note="the same token; its logits row differs")
        diff.captures, note = localise(model_a, model_b, config, ex_a.record, ex_b.record, step)
        diff.note = "; ".join(filter(None, [diff.note, note]))
        wc.logit_difference = diff
    return wc


def cross_device(
    factory: SchedulerFactory,
    model_a: PagedLlama,
    model_b: PagedLlama,
    workloads: Sequence[Workload],
    *,
    baseline: SchedulerConfig,
    labels: tuple[str, str] | None = None,
    model_name: str = "",
    progress: Progress | None = None,
) -> CrossDeviceReport:
    """Run ``baseline`` on every workload with both models and compare."""
    t0 = time.perf_counter()
    lab = labels or (str(model_a.device), str(model_b.device))
    if lab[0] == lab[1]:
        lab = (lab[0] + "#a", lab[1] + "#b")
    report = CrossDeviceReport(model_name or model_a.config.name, model_a.mode, lab,
                               (determinism_facts(model_a.device), determinism_facts(model_b.device)))
    for i, w in enumerate(workloads):
        wc = compare_pair(model_a, model_b, baseline, w, factory, lab)
        report.workloads.append(wc)
        if progress:
            progress(f"[{i + 1}/{len(workloads)}] {w.name}: {'equal' if wc.equal else 'DIFFERS'} "
                     f"({wc.rows_bitwise}/{wc.rows_compared} rows bitwise, max |dl| {wc.max_abs_diff:.3g}; "
                     f"{time.perf_counter() - t0:.1f} s)")
    report.seconds = time.perf_counter() - t0
    return report


def run_cross_device(
    factory: SchedulerFactory | None = None,
    *,
    model: str = "glassllm",
    device: str = "auto",
    other_device: str = "cpu",
    mode: str = "exact",
    workloads: int = 16,
    seed: int = 0,
    max_model_len: int | None = None,
    block_size: int = 16,
    tile_rows: int = 16,
    deterministic_algorithms: bool = False,
    progress: Progress | None = None,
) -> CrossDeviceReport:
    """Load ``model`` once, put the same weights on ``device`` and
    ``other_device``, and compare their baseline runs."""
    from schedspec.gpu_runner.executor import pick_device
    from schedspec.gpu_runner.loaders import load_model

    dev_a = pick_device(device, deterministic_algorithms=deterministic_algorithms)
    dev_b = pick_device(other_device, deterministic_algorithms=deterministic_algorithms)
    weights = load_model(model, "cpu")
    mml = max_model_len or min(weights.config.max_position, 128)
    models = [PagedLlama(weights.to(d), mode=mode, tile_rows=tile_rows, window=mml)  # type: ignore[arg-type]
              for d in (dev_a, dev_b)]
    wls = make_workloads(workloads, seed=seed, vocab_size=weights.config.vocab_size, max_model_len=mml,
                         block_size=block_size)
    return cross_device(factory or spec_factory, models[0], models[1], wls, baseline=baseline_config(mml, block_size),
                        model_name=model, progress=progress)
