"""vLLM defects reproduced on vLLM 0.32's whole engine (docs/engine.md).

``python -m schedspec.engine.defects stale-kv [--json FILE]`` (project side)
runs the engine side in .venv-engine and prints a table of the resumed
request's tokens and logprobs with and without the triggering step.

stale-kv: docs/divergences.md, "A victim preempted in the step that scheduled
it leaves prefix-cache keys on blocks whose KV is never written". The
four-step reproduction of tests/check/test_preempted_victim_cache.py scaled to
block size 32: PRIORITY, prefix caching, 13 usable blocks, chunks of at most
96 tokens. ``a`` (11 blocks, low priority) is admitted first; ``b`` (2 blocks,
high priority) arrives; in step 3 the RUNNING loop schedules ``a``'s last
chunk (keying its blocks), then ``b``'s decode finds the pool empty and
preempts ``a`` in the same step. ``a``'s resume hits 10 cached blocks, the
tenth never written; ``c`` (``a``'s prompt, after ``a``) hits the same. The
control run has a pool of 64 blocks: no preemption, the same schedule
otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from schedspec.engine.env import engine_environ, engine_python

BLOCK = 32
PROMPT_A = [1 + (i * 7) % 500 for i in range(11 * BLOCK)]
PROMPT_B = [3 + (i * 11) % 500 for i in range(2 * BLOCK)]
#: the scaled configuration; num_gpu_blocks_override counts the null block
STALE_KV_ARGS: dict[str, Any] = {
    "block_size": BLOCK,
    "num_gpu_blocks_override": 14,
    "max_num_batched_tokens": 6 * BLOCK,
    "max_num_seqs": 4,
    "max_model_len": 12 * BLOCK,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 3 * BLOCK,
    "enable_prefix_caching": True,
    "scheduling_policy": "priority",
}
CONTROL_BLOCKS = 64
#: fp32 noise between two schedules of the same request on the CPU
FP32_TOLERANCE = 1e-4


def _run_stale_kv(num_blocks: int) -> dict[str, Any]:
    """Engine side: the scenario on a pool of ``num_blocks`` (null included)."""
    from vllm import SamplingParams

    from schedspec.engine.build import build_engine, completion_record, live_scheduler
    from schedspec.engine.model import ensure_model

    engine = build_engine(ensure_model(), **{**STALE_KV_ARGS, "num_gpu_blocks_override": num_blocks})
    sched = live_scheduler(engine)

    def params(n: int) -> Any:
        return SamplingParams(temperature=0, max_tokens=n, logprobs=1, ignore_eos=True)

    out: dict[str, Any] = {}
    preempted: list[int] = []

    def step(k: int) -> None:
        for o in engine.step():
            if o.finished:
                out[o.request_id] = completion_record(o)
        if any(r.num_preemptions for r in sched.requests.values()):
            preempted.append(k)

    engine.add_request("a", {"prompt_token_ids": PROMPT_A}, params(4), priority=1)
    step(1)
    engine.add_request("b", {"prompt_token_ids": PROMPT_B}, params(2), priority=0)
    k = 2
    while "a" not in out and k < 40:
        step(k)
        k += 1
    engine.add_request("c", {"prompt_token_ids": PROMPT_A}, params(4), priority=1)
    while "c" not in out and k < 80:
        step(k)
        k += 1
    return {"num_blocks": num_blocks, "outputs": out, "preempted_at_step": preempted[:1]}


def stale_kv_engine_side() -> dict[str, Any]:
    trigger = _run_stale_kv(int(STALE_KV_ARGS["num_gpu_blocks_override"]))
    control = _run_stale_kv(CONTROL_BLOCKS)
    diffs: dict[str, Any] = {}
    for rid in ("a", "c"):
        t, c = trigger["outputs"].get(rid), control["outputs"].get(rid)
        if t and c:
            diffs[rid] = {
                "max_logprob_diff": max(abs(x - y) for x, y in zip(t["logprobs"], c["logprobs"])),
                "tokens_equal": t["tokens"] == c["tokens"],
            }
    ca, cc = control["outputs"].get("a"), control["outputs"].get("c")
    # without the trigger, c's prefix hit on a's (written) blocks changes nothing
    control_a_vs_c = (max(abs(x - y) for x, y in zip(ca["logprobs"], cc["logprobs"]))
                      if ca and cc and ca["tokens"] == cc["tokens"] else None)
    return {"defect": "stale-kv", "trigger": trigger, "control": control, "diff": diffs,
            "control_a_vs_c": control_a_vs_c,
            "fp32_tolerance": FP32_TOLERANCE}


def run_stale_kv(timeout: float = 600.0) -> dict[str, Any]:
    """Project side: the engine side in .venv-engine; its JSON result."""
    proc = subprocess.run(
        [str(engine_python()), "-m", "schedspec.engine.defects", "stale-kv", "--engine-side"],
        env=engine_environ(), capture_output=True, text=True, timeout=timeout, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine side failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def table(result: dict[str, Any]) -> str:
    rows = ["request  run      preempted  tokens                logprobs"]
    for rid in ("a", "c"):
        for run in ("trigger", "control"):
            o = result[run]["outputs"].get(rid, {"tokens": [], "logprobs": []})
            pre = result[run]["preempted_at_step"]
            lps = " ".join(f"{x:.5f}" for x in o["logprobs"])
            rows.append(f"{rid:<8} {run:<8} {str(pre[0]) if pre else '-':<10} {str(o['tokens']):<21} {lps}")
    for rid, d in result["diff"].items():
        rows.append(f"{rid}: max |logprob diff| {d['max_logprob_diff']:.3g}, tokens equal: {d['tokens_equal']}")
    rows.append(f"control, a vs c (prefix hit on written KV): {result['control_a_vs_c']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m schedspec.engine.defects")
    ap.add_argument("defect", choices=["stale-kv"])
    ap.add_argument("--engine-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="write the evidence as JSON to this file")
    args = ap.parse_args(argv)
    if args.engine_side:
        print(json.dumps(stale_kv_engine_side()))
        return 0
    result = run_stale_kv()
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
