"""The unruly environment (schedspec/check/unruly.py): each output a real
engine may send besides the polite ones is reached by its recipe, the spec and
impl agreeing on it, and the docs list the table as the code has it."""

from __future__ import annotations

from pathlib import Path

import pytest

from schedspec.check.run import count_rules, run_workload
from schedspec.check.unruly import ENVIRONMENT, EnvOutput, doc_table, recipe
from schedspec.impl import ImplScheduler
from schedspec.spec.rule_names import RULES
from schedspec.spec.scheduler import SpecScheduler

START, END = "<!-- environment-outputs:start -->", "<!-- environment-outputs:end -->"


def test_every_row_names_a_rule_of_its_mode_and_gates() -> None:
    for row in ENVIRONMENT:
        rule = RULES[row.rule]
        assert row.mode in rule.modes, row
    assert len({row.rule for row in ENVIRONMENT}) == len(ENVIRONMENT)


@pytest.mark.parametrize("row", ENVIRONMENT, ids=lambda r: r.rule)
def test_the_recipe_reaches_the_output_with_spec_and_impl_in_lockstep(row: EnvOutput) -> None:
    w = recipe(row)
    runner, failure = run_workload(w, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=row.seed)
    assert failure is None, failure.describe()
    count_rules(runner, w, row.seed, 64)
    assert runner.stats.rules.get(row.rule, 0) > 0


def test_the_docs_give_the_table() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "adapters.md").read_text()
    assert text.split(START, 1)[1].split(END, 1)[0].strip() == doc_table()


def test_a_result_leaves_out_a_request_aborted_in_flight() -> None:
    from schedspec.check import driver
    from schedspec.spec.interface import StepResult

    row = next(r for r in ENVIRONMENT if r.rule == "update.request_gone")
    left_out = 0
    thin = driver.without_aborted

    def spy(result: StepResult, aborted: set[str], step: int) -> StepResult:
        nonlocal left_out
        out = thin(result, aborted, step)
        left_out += len(result.sampled) - len(out.sampled)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "without_aborted", spy)
        for seed in range(row.seed, row.seed + 4):
            w = recipe(EnvOutput(row.output, row.handling, row.rule, row.mode, seed=seed))
            runner, failure = run_workload(w, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed)
            assert failure is None, failure.describe()
    assert left_out > 0
