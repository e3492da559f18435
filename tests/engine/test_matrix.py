"""The engine matrix: the variant table, the comparison, the report and the
CLI (fast, no engine), and one small matrix on vLLM's engine (``engine``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schedspec.cli.main import main
from schedspec.engine import matrix
from tests.engine.support import engine_or_skip



def _run(name: str, requests: dict[str, tuple[list[int], list[float], int | None]],
         error: str | None = None) -> dict[str, Any]:
    return {"name": name, "error": error, "runs": [{
        "workload": "w", "steps": 3, "wall_s": 0.5,
        "stats": {"preemptions": 1, "prefix_queries": 10, "prefix_hits": 4, "chunks": 2, "scheduled_tokens": 9},
        "requests": {rid: {"tokens": t, "logprobs": lp, "aborted_at": ab} for rid, (t, lp, ab) in requests.items()},
    }]}


BASE = _run("baseline", {"r0": ([5, 6, 7], [-0.1, -0.2, -0.3], None), "r1": ([8, 9, 10, 11], [-1.0] * 4, 2)})


def test_variant_table() -> None:
    names = [v.name for v in matrix.VARIANTS]
    assert names[0] == matrix.BASELINE and names[-1] == matrix.CONTROL
    assert len(set(names)) == len(names)
    assert [v.name for v in matrix.VARIANTS if v.control] == [matrix.CONTROL]
    args = {v.name: v.args for v in matrix.VARIANTS}
    everything = {**args["everything-async"], **args["everything-ngram"]}
    assert "speculative_config" not in args["everything-async"]  # vLLM 0.32 refuses the pair
    for v in matrix.VARIANTS:
        if not v.name.startswith("everything") and v.name not in (matrix.BASELINE, matrix.CONTROL):
            assert v.args and all(everything[k] == val for k, val in v.args.items()), v.name
    chosen = matrix.variants_named([matrix.CONTROL, "small-pool"])
    assert [v.name for v in chosen] == [matrix.BASELINE, "small-pool", matrix.CONTROL]
    with pytest.raises(ValueError, match="unknown variant.*nope"):
        matrix.variants_named(["nope"])


def test_default_workloads_span_blocks() -> None:
    loads = matrix.default_workloads(0)
    assert loads == matrix.default_workloads(0) and loads != matrix.default_workloads(1)
    reqs = [r for w in loads for r in w["requests"]]
    assert all(40 <= len(r["prompt"]) <= 300 and all(0 < t < matrix.VOCAB for t in r["prompt"]) for r in reqs)
    assert any(r["abort_step"] is not None for r in reqs) and any(r["priority"] for r in reqs)
    assert len({r["arrival_step"] for r in reqs}) > 5
    shared = loads[0]["requests"]
    assert all(r["prompt"][:96] == shared[0]["prompt"][:96] for r in shared)


def test_compare_equal_and_within_tolerance() -> None:
    other = _run("v", {"r0": ([5, 6, 7], [-0.1, -0.2 + 5e-5, -0.3], None), "r1": ([8, 9], [-1.0, -1.0], 1)})
    rep = matrix.compare(BASE, other)
    assert rep.verdict == "EQUIVALENT" and rep.ok
    # the aborted request counts the tokens both produced: 2
    assert (rep.requests, rep.tokens) == (2, 5)
    assert rep.max_logprob_diff == pytest.approx(5e-5)
    assert (rep.preemptions, rep.prefix_hits, rep.prefix_queries, rep.chunks) == (1, 4, 10, 2)


@pytest.mark.parametrize("requests, problem", [
    ({"r0": ([5, 6, 8], [-0.1, -0.2, -0.3], None)}, "r0: token 2 is 8, baseline 7"),
    ({"r0": ([5, 6, 7], [-0.1, -0.2, -0.4], None)}, "r0: logprob 2 differs"),
    ({"r0": ([5, 6], [-0.1, -0.2], None)}, "r0: 2 tokens, baseline 3"),
    ({}, "r0: missing"),
])
def test_compare_diverged(requests: dict[str, Any], problem: str) -> None:
    reqs = {"r1": ([8, 9, 10, 11], [-1.0] * 4, 2), **requests}
    rep = matrix.compare(BASE, _run("v", reqs))
    assert rep.verdict == "DIVERGED" and not rep.ok
    assert any(problem in p for p in rep.problems), rep.problems
    assert matrix.compare(BASE, _run("c", reqs), control=True).ok


def test_errors_and_render() -> None:
    err = matrix.compare(BASE, _run("v", {}, error="RuntimeError: boom"))
    assert err.verdict == "ERROR" and not err.ok
    assert not matrix.compare(BASE, _run("c", {}, error="x"), control=True).ok  # a crash is not a catch
    reports = matrix.compare_all({"variants": [BASE, _run("c", {"r0": ([1], [0.0], None)})]}, {"c"})
    text = matrix.render(reports)
    assert "baseline" in text and "c (control)" in text and "DIVERGED" in text
    assert text.splitlines()[-1] == "all variants EQUIVALENT, control caught"
    assert "FAILED: v" in matrix.render([err])
    assert matrix.report_dict(err)["verdict"] == "ERROR"


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                          tmp_path: Path) -> None:
    assert main(["engine-equivalence", "--variants", "nope"]) == 2
    assert "--variants: unknown variant" in capsys.readouterr().err
    assert main(["engine-equivalence", "--workloads", "0"]) == 2
    assert main(["engine-equivalence", "--workloads", "aborts,nope"]) == 2
    assert "--workloads: unknown workload(s) nope" in capsys.readouterr().err
    assert main(["engine-equivalence", "--out", str(tmp_path / "no" / "x.json")]) == 2
    monkeypatch.setenv("SCHEDSPEC_ENGINE_PYTHON", str(tmp_path / "missing" / "python"))
    assert main(["engine-equivalence", "--workloads", "1"]) == 2
    assert "scripts/setup_engine.sh" in capsys.readouterr().err


@pytest.mark.engine
def test_small_matrix_on_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine_or_skip()
    out = tmp_path / "m.json"
    code = main(["engine-equivalence", "--workloads", "shared-prefix,arrivals,aborts",
                 "--variants", f"chunked-prefill,prefix-caching,small-pool,async-scheduling,{matrix.CONTROL}",
                 "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    data = json.loads(out.read_text())
    verdicts = {r["variant"]: r["verdict"] for r in data["reports"]}
    assert verdicts == {"baseline": "EQUIVALENT", "chunked-prefill": "EQUIVALENT", "prefix-caching": "EQUIVALENT",
                        "small-pool": "EQUIVALENT", "async-scheduling": "EQUIVALENT", matrix.CONTROL: "DIVERGED"}
    by = {r["variant"]: r for r in data["reports"]}
    # async scheduling kept on against the CPU platform's default: the engine core's batch queue
    assert by["async-scheduling"]["scheduler"] == "AsyncScheduler" and by["baseline"]["scheduler"] == "Scheduler"
    assert by["chunked-prefill"]["chunks"] > 0 and by["prefix-caching"]["prefix_hits"] > 0
    assert by["small-pool"]["preemptions"] > 0
    assert by["baseline"]["tokens"] > 100


@pytest.mark.parametrize("control_tokens, variant_tokens, code", [
    ([1, 2, 4], [5, 6, 7], 0),   # variant equal, control caught
    ([5, 6, 7], [5, 6, 7], 1),   # control not caught
    ([1, 2, 4], [5, 6, 9], 1),   # a real variant diverged
])
def test_cli_exit_status_and_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 control_tokens: list[int], variant_tokens: list[int], code: int) -> None:
    def fake_worker(job: dict[str, Any], timeout: float = 0.0) -> dict[str, Any]:
        assert [v["name"] for v in job["variants"]] == ["baseline", "priority", matrix.CONTROL]
        lp = [-0.1, -0.2, -0.3]
        return {"variants": [_run("baseline", {"r0": ([5, 6, 7], lp, None)}),
                             _run("priority", {"r0": (variant_tokens, lp, None)}),
                             _run(matrix.CONTROL, {"r0": (control_tokens, lp, None)})]}

    monkeypatch.setattr(matrix, "run_worker", fake_worker)
    out = tmp_path / "m.json"
    assert main(["engine-equivalence", "--variants", f"priority,{matrix.CONTROL}", "--workloads", "1",
                 "--out", str(out)]) == code
    data = json.loads(out.read_text())
    assert data["command"][:2] == ["schedspec", "engine-equivalence"] and data["tolerance"] == matrix.LOGPROB_TOL
    assert [r["ok"] for r in data["reports"]].count(False) == (0 if code == 0 else 1)
    assert data["timings"]["priority"]["runs"]["w"]["preemptions"] == 1
    assert ("FAILED" in capsys.readouterr().out) == bool(code)


def test_every_engine_asks_for_a_small_share_of_free_memory() -> None:
    """vLLM's CPU backend refuses to start unless gpu_memory_utilization of the
    machine's memory is free (0.92 by default): every build asks for 0.1."""
    from schedspec.engine.build import BASE_ARGS

    assert BASE_ARGS["gpu_memory_utilization"] == 0.1
