"""Capturing traces from vLLM 0.32's engine, and the recorder's cost.

Project side: :func:`run_record_job` starts the engine side in .venv-engine
(``python -m schedspec.engine.record JOBFILE OUTFILE``) and reads its JSON
result; ``schedspec engine-record`` (schedspec/cli/engine_record.py) is the
command. Engine side: :func:`record_job` builds one engine per run, with the
recorder (schedspec.engine.recorder) as its ``scheduler_cls`` (or none, the
cost's reference), drives the matrix's workloads through it step by step
(schedspec.engine.worker.run_workload) and writes the trace.

JOBFILE: ``{"model_dir": PATH|null, "max_steps": N, "workloads": [...as the
matrix's...], "runs": [{"name", "args": {engine overrides}, "recorder": bool,
"check_every": N, "trace": PATH|null, "violation_out": PATH|null,
"base": "module:factory"|null, "workloads": [NAME]|null, "keep_async": bool}]}``
(``keep_async``: the variant's async scheduling kept on, :func:`keep_async_scheduling`). OUTFILE gets per run: the steps, each
step's wall time, the monitor's checked-step times, the trace's path and
an error (a MonitorViolation's message, step and trace) when one stopped it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from schedspec.engine.build import keep_async_scheduling
from schedspec.engine.env import run_engine_job


def _base_class(path: str | None) -> Any:
    if not path:
        return None
    import importlib

    module, _, name = path.partition(":")
    found = getattr(importlib.import_module(module), name)
    return found() if name.startswith("make_") else found


def record_one(run: dict[str, Any], workloads: list[dict[str, Any]], model_dir: Path,
               max_steps: int) -> dict[str, Any]:
    """Engine side: one engine, the workloads (those ``run["workloads"]``
    names, else all), the step times; the trace written to ``run["trace"]``
    (when recording)."""
    from schedspec.engine.build import build_engine, live_scheduler
    from schedspec.engine.recorder import MonitorViolation, make_recorder
    from schedspec.engine.worker import run_workload

    args = dict(run.get("args", {}))
    if run.get("workloads"):
        workloads = [w for w in workloads if w["name"] in run["workloads"]]
    asynchronous = bool(run.get("keep_async")) and bool(args.get("async_scheduling"))
    if asynchronous:
        keep_async_scheduling()
    cls = None
    if run.get("recorder", True):
        # without keep_async the CPU platform turns async scheduling off: the
        # engine drives a synchronous Scheduler
        cls = make_recorder(asynchronous, int(run.get("check_every", 0)),
                            run.get("violation_out"), base=_base_class(run.get("base")))
    elif run.get("base"):
        cls = _base_class(run["base"])
    engine = build_engine(model_dir, cls, **args)
    sched = live_scheduler(engine)
    times: list[float] = []
    in_sched: list[float] = []
    own: list[float] = []
    step = engine.step
    sched_s = [0.0]

    def timing(fn: Any) -> Any:
        def timed_call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sched_s[0] += time.perf_counter() - t0
        return timed_call

    # the scheduler's two calls per step, the recorder's hooks included
    sched.schedule = timing(sched.schedule)
    sched.update_from_output = timing(sched.update_from_output)

    def timed() -> Any:
        t0 = time.perf_counter()
        sched_s[0] = 0.0
        if hasattr(sched, "schedspec_own_s"):
            sched.schedspec_own_s = 0.0
        try:
            return step()
        finally:
            times.append(time.perf_counter() - t0)
            in_sched.append(sched_s[0])
            own.append(float(getattr(sched, "schedspec_own_s", 0.0)))

    engine.step = timed
    out: dict[str, Any] = {"name": run["name"], "error": None, "violation": None, "runs": []}
    try:
        for workload in workloads:
            out["runs"].append({k: v for k, v in run_workload(engine, workload, max_steps).items()
                                if k != "requests"})
    except MonitorViolation as exc:
        out["violation"] = {"step": exc.step, "violations": exc.violations, "trace": exc.trace_path}
    except Exception as exc:  # recorded: the project side reports it
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-3000:]
    out["step_s"] = times
    out["sched_s"] = in_sched
    out["own_s"] = own
    out["checked_s"] = list(getattr(sched, "schedspec_checked", []))
    recording = getattr(sched, "schedspec", None)
    if recording is not None and run.get("trace") and out["violation"] is None:
        recording.write(run["trace"])
        out["trace"] = run["trace"]
        out["events"] = len(recording.events)
    del engine
    import gc

    gc.collect()
    return out


def record_job(job: dict[str, Any]) -> dict[str, Any]:
    from schedspec.engine.model import ensure_model

    model_dir = ensure_model(Path(job["model_dir"]) if job.get("model_dir") else None)
    results = []
    for run in job["runs"]:
        t0 = time.perf_counter()
        results.append(record_one(run, job["workloads"], model_dir, int(job.get("max_steps", 5000))))
        print(f"schedspec.engine.record: {run['name']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
    return {"runs": results}


def run_record_job(job: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    """Project side: the job in one engine process (env.run_engine_job)."""
    return run_engine_job("schedspec.engine.record", job, timeout)


def median_ms(times: list[float], skip: int = 1) -> float:
    """The median step in milliseconds, the first ``skip`` steps (the
    engine's warm-up) left out."""
    kept = times[skip:] or times
    return 1000.0 * statistics.median(kept) if kept else 0.0


def mean_ms(times: list[float], skip: int = 1) -> float:
    kept = times[skip:] or times
    return 1000.0 * statistics.fmean(kept) if kept else 0.0


def cost_table(result: dict[str, Any]) -> str:
    """Per run: the median engine step (wall clock), the median time in the
    scheduler's schedule() and update_from_output() (the recorder's hooks
    included), and the recorder's own time per step (median and mean: the
    monitor at N > 1 costs on one step in N), its mean as a share of the
    mean step. The machine's load moves the step times; the recorder's own
    time is measured inside the step, apart from the model's."""
    lines = [f"{'run':<28} {'steps':>6} {'step ms':>8} {'scheduler ms':>13} {'recorder ms':>12} "
             f"{'mean':>7} {'share':>6} {'checked':>8}"]
    for r in result["runs"]:
        step, sched = median_ms(r["step_s"]), median_ms(r.get("sched_s", []))
        own, mean_own = median_ms(r.get("own_s", [])), mean_ms(r.get("own_s", []))
        mean_step = mean_ms(r["step_s"])
        share = f"{100 * mean_own / mean_step:.1f}%" if mean_step else "-"
        checked = r.get("checked_s") or []
        lines.append(f"{r['name']:<28} {len(r['step_s']):>6} {step:>8.2f} {sched:>13.2f} {own:>12.2f} "
                     f"{mean_own:>7.2f} {share:>6} {len(checked) // 2:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m schedspec.engine.record JOBFILE OUTFILE", file=sys.stderr)
        return 2
    result = record_job(json.loads(Path(args[0]).read_text()))
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
