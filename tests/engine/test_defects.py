"""The stale-KV defect reproduced on vLLM 0.32's engine (schedspec.engine.defects)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from schedspec.engine import defects

REQUIRE_ENGINE = os.environ.get("SCHEDSPEC_REQUIRE_ENGINE") == "1"
ENGINE_VENV = Path(__file__).resolve().parents[2] / ".venv-engine"


@pytest.fixture(scope="module")
def stale_kv() -> dict[str, object]:
    if not ENGINE_VENV.exists():
        if REQUIRE_ENGINE:
            pytest.fail("SCHEDSPEC_REQUIRE_ENGINE=1 but .venv-engine is missing (scripts/setup_engine.sh)")
        pytest.skip(".venv-engine is missing (scripts/setup_engine.sh makes it)")
    return defects.run_stale_kv()


@pytest.mark.engine
def test_the_preempted_victim_reads_a_never_written_block(stale_kv: dict[str, object]) -> None:
    r = stale_kv
    assert r["trigger"]["preempted_at_step"] == [3]  # type: ignore[index]
    assert r["control"]["preempted_at_step"] == []  # type: ignore[index]
    for rid in ("a", "c"):  # the resumed request, and a later one with its prompt
        assert r["diff"][rid]["max_logprob_diff"] > defects.FP32_TOLERANCE  # type: ignore[index]
    # c hits the same stale block: the same wrong logprobs as a
    t = r["trigger"]["outputs"]  # type: ignore[index]
    assert t["a"] == t["c"]


@pytest.mark.engine
def test_without_the_trigger_a_prefix_hit_changes_nothing(stale_kv: dict[str, object]) -> None:
    d = stale_kv["control_a_vs_c"]
    assert d is not None and d <= defects.FP32_TOLERANCE  # type: ignore[operator]


def test_the_table_names_both_runs() -> None:
    out = {"a": {"tokens": [1], "logprobs": [-0.5]}, "c": {"tokens": [1], "logprobs": [-0.5]}}
    r = {"trigger": {"outputs": out, "preempted_at_step": [3]}, "control": {"outputs": out, "preempted_at_step": []},
         "diff": {"a": {"max_logprob_diff": 0.05, "tokens_equal": True}}, "control_a_vs_c": 0.0}
    text = defects.table(r)
    assert "trigger  3" in text and "control  -" in text and "max |logprob diff| 0.05" in text
