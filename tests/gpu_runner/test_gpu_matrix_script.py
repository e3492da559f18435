"""scripts/gpu_matrix.sh's stages as they call Python: a stub interpreter
records each call, so the stages are checked without a GPU or a model run."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_matrix.sh"


def _run(tmp_path: Path, stages: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = tmp_path / "calls.log"
    stub = tmp_path / "python"
    stub.write_text('#!/usr/bin/env bash\necho "$*" >> "$STUB_LOG"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        env={**os.environ, "PYTHON": str(stub), "STUB_LOG": str(log), "STAGES": stages, **env},
        capture_output=True, text=True, timeout=60,
    )
    return proc, log.read_text().splitlines() if log.exists() else []


def _maxbatch_runs(calls: list[str]) -> list[tuple[str, str, str]]:
    """(model, mode, prompt length) of each --max-batch call."""
    runs = []
    for call in calls:
        if "--max-batch " in call:
            flags = dict(re.findall(r"--(model|mode|prompt-len) (\S+)", call))
            runs.append((flags["model"], flags["mode"], flags["prompt-len"]))
    return runs


def test_the_maxbatch_stage_runs_only_the_smollm2_shape_by_default(tmp_path: Path) -> None:
    proc, calls = _run(tmp_path, "maxbatch")
    assert proc.returncode == 0, proc.stderr
    assert _maxbatch_runs(calls) == [("random:like=smollm2", "fast", "512"), ("random:like=smollm2", "exact", "512")]


def test_glassllm_gets_prompts_its_128_positions_take(tmp_path: Path) -> None:
    proc, calls = _run(tmp_path, "maxbatch", MAXBATCH_MODELS="smol glass", MAXBATCH_MODES="fast")
    assert proc.returncode == 0, proc.stderr
    assert _maxbatch_runs(calls) == [("random:like=smollm2", "fast", "512"), ("glassllm", "fast", "128")]
    _, calls = _run(tmp_path, "maxbatch", MAXBATCH_MODELS="glass", MAXBATCH_MODES="fast", PROMPT_LEN="64")
    assert _maxbatch_runs(calls)[-1] == ("glassllm", "fast", "64")


def test_an_unknown_maxbatch_model_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc, calls = _run(tmp_path, "maxbatch", MAXBATCH_MODELS="smol llama")
    assert proc.returncode == 2 and "MAXBATCH_MODELS: unknown model 'llama'" in proc.stderr
    assert calls == []


def test_the_summary_takes_the_hybrid_matrices_too(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "cuda-hyb16-exact-s0-n8.json").write_text("{}")
    proc, calls = _run(tmp_path, "summary")
    assert proc.returncode == 0, proc.stderr
    assert any("equivalence_summary.py" in c and "cuda-hyb16-exact-s0-n8.json" in c for c in calls), calls


def test_the_scripts_positions_are_the_models() -> None:
    pytest.importorskip("torch")
    from schedspec.gpu_runner.loaders import LIKE_SHAPES, load_model

    text = SCRIPT.read_text()
    found = re.search(r"positions_of\(\) \{ .*?glass\*\|hyb\*\) echo (\d+) ;; smol\*\) echo (\d+)", text)
    assert found, "positions_of() not found in scripts/gpu_matrix.sh"
    glass, smol = found.groups()
    assert int(glass) == load_model("glassllm").config.max_position
    assert int(smol) == LIKE_SHAPES["smollm2"]["max_position"]
