"""The check hands the schedulers malformed calls now and then
(check/rejects.py): each must refuse them as the reference does and change
nothing. A refusal that lets a bad input through, names another field or
half-applies the call is a finding of the check itself."""

from __future__ import annotations

from typing import Any

import pytest

from schedspec.check import rejects
from schedspec.check.random_workloads import random_workload
from schedspec.check.records import Failure
from schedspec.check.run import run_workload
from schedspec.check.workload import Workload
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import ProtocolError, RequestError, RequestSpec, StepPlan, StepResult
from schedspec.spec.scheduler import SpecScheduler


class TakesNegativeTokens(ImplScheduler):
    """update() lets a negative token through (as a fast path that checks
    only ``token.__class__ is int`` would)."""

    def update(self, plan: StepPlan, result: StepResult) -> None:
        if any(t < 0 for toks in result.sampled.values() if isinstance(toks, tuple) for t in toks):
            return
        super().update(plan, result)


class NamesAnotherField(ImplScheduler):
    """add() refuses a duplicate id, naming the wrong field."""

    def add(self, request: RequestSpec) -> None:
        try:
            super().add(request)
        except RequestError as exc:
            raise RequestError(request.request_id, "prompt_token_ids", str(exc)) from None


class HalfApplies(ImplScheduler):
    """update() of a result with tokens for an unscheduled request applies
    the rest of the result, then refuses."""

    def update(self, plan: StepPlan, result: StepResult) -> None:
        if rejects.NOBODY in result.sampled:
            sampled = {k: v for k, v in result.sampled.items() if k != rejects.NOBODY}
            super().update(plan, StepResult(sampled=sampled))
            raise ProtocolError("tokens for an unscheduled request", step=plan.step, field="sampled")
        super().update(plan, result)


class NotProbed(TakesNegativeTokens):
    """The same, not opted into the probe."""

    PROTOCOL_ERRORS = False


def _workload(seed: int) -> Workload:
    return random_workload(seed, 60, modes=("sync", "async", "spec", "async-spec"))


def _failure(cls: Any, seeds: range = range(6)) -> Failure:
    for seed in seeds:
        _, failure = run_workload(_workload(seed), {"spec": SpecScheduler, "impl": cls})
        if failure is not None:
            return failure
    raise AssertionError(f"{cls.__name__}: no failure on seeds {seeds}")


def test_spec_and_impl_refuse_every_bad_call_alike() -> None:
    seen: list[str] = []
    probe = rejects.probe

    def spy(runner: Any, bad: list[rejects.Bad]) -> Failure | None:
        seen.extend(b[0] for b in bad)
        return probe(runner, bad)

    refusals = 0
    workloads = [_workload(seed) for seed in range(4)]
    workloads += [random_workload(seed, 60, gates=("encoder",), sessions=True) for seed in range(4, 8)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rejects, "probe", spy)
        for w in workloads:
            runner, failure = run_workload(w, {"spec": SpecScheduler, "impl": ImplScheduler})
            assert failure is None, failure.describe()
            refusals += runner.stats.refusals
    assert refusals > 100
    # every kind of bad call was handed over
    for kind in ("result with tokens for 'schedspec-refused'", "result with drafts for 'schedspec-refused'",
                 "a negative token", "a list, not a tuple", "which verifies", "drafts for '",
                 "a partial prefill chunk", ") again", "add('schedspec-refused') with", "which is not resumable"):
        assert any(kind in what for what in seen), (kind, sorted(set(seen))[:20])


def test_a_bad_token_let_through_is_found() -> None:
    failure = _failure(TakesNegativeTokens)
    assert failure.kind == "divergence" and failure.scheduler == "impl"
    assert "negative token" in failure.message and "accepted it" in failure.message


def test_a_refusal_naming_another_field_is_found() -> None:
    failure = _failure(NamesAnotherField)
    assert failure.kind == "divergence"
    assert "field='prompt_token_ids'" in failure.message and "field='request_id'" in failure.message


def test_a_half_applied_refusal_is_found() -> None:
    failure = _failure(HalfApplies)
    # the plan it applied is no longer in flight: the next bad call of the
    # probe is refused for the plan, and the message names the call before
    assert failure.kind == "divergence" and "field='plan'" in failure.message
    assert "after it refused: update(plan of step" in failure.message


class ChangesOnRefusal(ImplScheduler):
    """update() refuses drafts for an unscheduled request only after
    taking a reference to the null block."""

    def update(self, plan: StepPlan, result: StepResult) -> None:
        if rejects.NOBODY in result.draft_token_ids:
            self._ref[0] += 1
        super().update(plan, result)


def test_a_refusal_that_changes_the_view_is_found() -> None:
    failure = _failure(ChangesOnRefusal, range(12))
    assert failure.kind == "divergence" and "view changed" in failure.message


def test_a_scheduler_not_opted_in_is_not_probed() -> None:
    for seed in range(3):
        runner, failure = run_workload(_workload(seed), {"spec": SpecScheduler, "impl": NotProbed})
        assert failure is None, failure.describe()


def test_the_reference_must_refuse() -> None:
    failure = None
    for seed in range(6):
        _, failure = run_workload(_workload(seed), {"impl": TakesNegativeTokens})
        if failure is not None:
            break
    assert failure is not None and failure.kind == "error" and "accepted it" in failure.message


def test_off_when_every_is_zero() -> None:
    from schedspec.check.driver import Runner

    w = _workload(0)
    runner = Runner(w.config, {"spec": SpecScheduler, "impl": TakesNegativeTokens}, reject_every=0)
    assert runner.run(w.events) is None and runner.stats.refusals == 0


def test_the_docs_give_the_probe_period() -> None:
    from pathlib import Path

    text = " ".join((Path(__file__).parents[2] / "docs" / "adapters.md").read_text().split())
    assert f"Every {rejects.REJECT_EVERY} steps, before the real `update()`" in text
    assert f"Every {rejects.REJECT_EVERY} added requests it calls `add()`" in text
