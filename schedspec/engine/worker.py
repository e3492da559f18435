"""The engine matrix's worker (engine's side): one process runs a whole job.

    python -m schedspec.engine.worker JOBFILE OUTFILE

JOBFILE (JSON): ``{"model_dir": PATH|null, "max_steps": N, "variants": [{"name",
"args": {engine overrides}, "scheduler_cls": "module:Class"|null}], "workloads":
[{"name", "requests": [{"id", "prompt", "max_tokens", "arrival_step",
"priority", "abort_step"|null}]}]}``. Each variant's engine is built once
(build.build_engine) and runs every workload step by step: a request is added
before the step of its arrival, aborted before the step named; greedy, one
logprob, ignore_eos. OUTFILE gets, per variant and workload, each request's
token ids and the chosen tokens' logprobs, the steps, the wall time and the
scheduler's statistics (:func:`record_step_stats`). A variant that fails to
build or run is recorded with its error; the worker goes on.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

STAT_KEYS = ("preemptions", "prefix_queries", "prefix_hits", "chunks", "scheduled_tokens")


def new_stats() -> dict[str, int]:
    return {key: 0 for key in STAT_KEYS}


def record_step_stats(out: Any, scheduler: Any, stats: dict[str, int]) -> None:
    """Add one SchedulerOutput's statistics to ``stats``: preemptions, the
    prefix cache's queried and hit tokens (a new or resumed request's prompt
    and its num_computed_tokens when first scheduled), and the prefill chunks
    (entries scheduling fewer tokens than the prompt has left). The one place
    that reads the scheduler: a recorder may replace it."""
    stats["preemptions"] += len(out.preempted_req_ids or ())
    stats["scheduled_tokens"] += int(out.total_num_scheduled_tokens)
    computed: dict[str, int] = {}
    for new in out.scheduled_new_reqs:
        computed[new.req_id] = new.num_computed_tokens
        prompt_len = len(new.prompt_token_ids or ())
        stats["prefix_queries"] += prompt_len
        stats["prefix_hits"] += new.num_computed_tokens
    cached = out.scheduled_cached_reqs
    for rid, done in zip(cached.req_ids, cached.num_computed_tokens):
        computed[rid] = done
    for rid, n in out.num_scheduled_tokens.items():
        request = scheduler.requests.get(rid)
        if request is None or rid not in computed:
            continue
        if computed[rid] + n < request.num_prompt_tokens:
            stats["chunks"] += 1


def _unfinished(scheduler: Any, rid: str) -> bool:
    """Whether the scheduler holds request ``rid`` unfinished. vLLM 0.32's
    input processor gives each request the internal id ``rid-XXXXXXXX``
    (eight random characters: vllm/v1/engine/input_processor.py,
    assign_request_id), which is what the scheduler keys it by."""
    return any((key == rid or (key.startswith(rid + "-") and len(key) == len(rid) + 9))
               and not req.is_finished() for key, req in scheduler.requests.items())


def _load_class(path: str | None) -> Any:
    if not path:
        return None
    module, _, name = path.partition(":")
    found = getattr(importlib.import_module(module), name)
    return found() if name.startswith("make_") else found  # a factory: vLLM imported late


def run_workload(engine: Any, workload: dict[str, Any], max_steps: int) -> dict[str, Any]:
    """One workload on a built engine, step by step."""
    from vllm import SamplingParams

    from schedspec.engine.build import completion_record, live_scheduler

    scheduler = live_scheduler(engine)
    stats = new_stats()
    original = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        record_step_stats(out, scheduler, stats)
        return out

    scheduler.schedule = schedule
    requests = sorted(workload["requests"], key=lambda r: (r["arrival_step"], r["id"]))
    results: dict[str, dict[str, Any]] = {
        r["id"]: {"tokens": [], "logprobs": [], "aborted_at": None} for r in requests
    }
    pending = list(requests)
    aborts = {r["id"]: r["abort_step"] for r in requests if r.get("abort_step") is not None}
    step = 0
    start = time.perf_counter()
    try:
        while pending or engine.has_unfinished_requests():
            if step >= max_steps:
                raise RuntimeError(f"workload {workload['name']}: not finished after {max_steps} steps")
            while pending and pending[0]["arrival_step"] <= step:
                r = pending.pop(0)
                params = SamplingParams(temperature=0.0, logprobs=1, ignore_eos=True,
                                        max_tokens=r["max_tokens"], seed=0)
                engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, params,
                                   priority=r.get("priority", 0))
            for rid, at in list(aborts.items()):
                if at <= step:
                    del aborts[rid]
                    if _unfinished(scheduler, rid):
                        engine.abort_request([rid])
                        results[rid]["aborted_at"] = step
            for output in engine.step():
                results[output.request_id].update(completion_record(output))
            step += 1
    finally:
        scheduler.schedule = original
    return {"workload": workload["name"], "steps": step,
            "wall_s": round(time.perf_counter() - start, 4), "stats": stats, "requests": results}


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from schedspec.engine.build import build_engine, keep_async_scheduling, live_scheduler
    from schedspec.engine.model import ensure_model

    model_dir = ensure_model(Path(job["model_dir"]) if job.get("model_dir") else None)
    max_steps = int(job.get("max_steps", 5000))
    variants_out = []
    for variant in job["variants"]:
        entry: dict[str, Any] = {"name": variant["name"], "error": None, "runs": []}
        t0 = time.perf_counter()
        engine = None
        try:
            if variant.get("args", {}).get("async_scheduling"):
                # vLLM 0.32's CPU platform would turn it off: kept on, the
                # engine core runs AsyncScheduler with its batch queue of two
                keep_async_scheduling()
            engine = build_engine(model_dir, _load_class(variant.get("scheduler_cls")),
                                  **variant.get("args", {}))
            entry["build_s"] = round(time.perf_counter() - t0, 3)
            entry["scheduler"] = type(live_scheduler(engine)).__name__
            for workload in job["workloads"]:
                entry["runs"].append(run_workload(engine, workload, max_steps))
        except Exception as exc:  # recorded: the driver reports the variant as an error
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-3000:]
        finally:
            entry["total_s"] = round(time.perf_counter() - t0, 3)
            del engine
            import gc

            gc.collect()
        variants_out.append(entry)
        print(f"schedspec.engine.worker: {variant['name']}: {entry['total_s']} s"
              + (f" ERROR {entry['error']}" if entry["error"] else ""), file=sys.stderr, flush=True)
    return {"model_dir": str(model_dir), "variants": variants_out}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m schedspec.engine.worker JOBFILE OUTFILE", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    result = run_job(job)
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
