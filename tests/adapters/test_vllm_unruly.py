"""The unruly environment against vLLM 0.33 (schedspec/check/unruly.py): each
output a real engine may send besides the polite ones, run in lockstep with
the spec on its recipe, reaches the spec's rule with plans and views equal."""

from __future__ import annotations

import importlib.util
import os

import pytest

from schedspec.check.run import count_rules, run_workload
from schedspec.check.unruly import ENVIRONMENT, EnvOutput, recipe
from schedspec.spec import SpecScheduler

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM and os.environ.get("SCHEDSPEC_REQUIRE_VLLM") != "1",
                       reason="vLLM is not installed (scripts/install_vllm.sh VENV)"),
]


@pytest.mark.parametrize("row", ENVIRONMENT, ids=lambda r: r.rule)
def test_vllm_handles_the_output_as_the_spec(row: EnvOutput) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    w = recipe(row)
    runner, failure = run_workload(w, {"spec": SpecScheduler, "vllm": VllmScheduler}, oracle_seed=row.seed)
    assert failure is None, failure.describe()
    count_rules(runner, w, row.seed, 64)
    assert runner.stats.rules.get(row.rule, 0) > 0
