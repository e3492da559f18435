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
"base": "module:factory"|null}]}``. OUTFILE gets per run: the steps, each
step's wall time, the monitor's checked-step times, the trace's path and
an error (a MonitorViolation's message, step and trace) when one stopped it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from schedspec.engine.env import engine_environ, engine_python


def _base_class(path: str | None) -> Any:
    if not path:
        return None
    import importlib

    module, _, name = path.partition(":")
    found = getattr(importlib.import_module(module), name)
    return found() if name.startswith("make_") else found


def record_one(run: dict[str, Any], workloads: list[dict[str, Any]], model_dir: Path,
               max_steps: int) -> dict[str, Any]:
    """Engine side: one engine, every workload, the step times; the trace
    written to ``run["trace"]`` (when recording)."""
    from schedspec.engine.build import build_engine, live_scheduler
    from schedspec.engine.recorder import MonitorViolation, make_recorder
    from schedspec.engine.worker import run_workload

    args = dict(run.get("args", {}))
    cls = None
    if run.get("recorder", True):
        # vLLM 0.32's CPU platform turns async scheduling off whatever the
        # arguments say (platforms/cpu.py, check_and_update_config): the
        # engine drives a synchronous Scheduler
        cls = make_recorder(False, int(run.get("check_every", 0)),
                            run.get("violation_out"), base=_base_class(run.get("base")))
    elif run.get("base"):
        cls = _base_class(run["base"])
    engine = build_engine(model_dir, cls, **args)
    sched = live_scheduler(engine)
    times: list[float] = []
    step = engine.step

    def timed() -> Any:
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            times.append(time.perf_counter() - t0)

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
    """Project side: the job in one engine process; RuntimeError with its
    stderr's tail when the process fails (EngineEnvError: no environment)."""
    python = engine_python()
    with tempfile.TemporaryDirectory(prefix="schedspec-record-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([str(python), "-m", "schedspec.engine.record", str(job_path), str(out_path)],
                              capture_output=True, text=True, timeout=timeout, env=engine_environ())
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"the engine recorder failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result


def median_ms(times: list[float], skip: int = 1) -> float:
    """The median step in milliseconds, the first ``skip`` steps (the
    engine's warm-up) left out."""
    kept = times[skip:] or times
    return 1000.0 * statistics.median(kept) if kept else 0.0


def cost_table(result: dict[str, Any]) -> str:
    """The runs' median step times against the first run's."""
    runs = result["runs"]
    base = median_ms(runs[0]["step_s"]) if runs else 0.0
    lines = [f"{'run':<22} {'steps':>6} {'median step ms':>15} {'vs first':>9} {'checked steps':>14}"]
    for r in runs:
        med = median_ms(r["step_s"])
        rel = f"{(med / base - 1) * 100:+.1f}%" if base else "-"
        checked = r.get("checked_s") or []
        lines.append(f"{r['name']:<22} {len(r['step_s']):>6} {med:>15.3f} {rel:>9} {len(checked) // 2:>14}")
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
