"""SchedulerContract under a deadline: a scheduler whose call hangs fails
the test (not the suite's job timeout), once, unshrunk, naming the method
and the step; the trace up to the call is written when trace_sink is set."""

from __future__ import annotations

import time
import unittest
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from schedspec.check import trace as tracefile
from schedspec.check.deadline import guard_available
from schedspec.testing import SchedulerContract
from tests.support.hanging_schedulers import HangBuilding, HangInUpdate, HangLoop

pytestmark = pytest.mark.skipif(guard_available() is not None, reason=str(guard_available()))

QUICK = settings(max_examples=20, stateful_step_count=30, deadline=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


def _run(case: type[unittest.TestCase]) -> tuple[unittest.TestResult, float]:
    result = unittest.TestResult()
    t0 = time.monotonic()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    return result, time.monotonic() - t0


@pytest.mark.parametrize("cls, method", [(HangLoop, "schedule"), (HangInUpdate, "update")])
def test_a_hanging_scheduler_fails_the_contract_once(cls: type, method: str, tmp_path: Path) -> None:
    sink = tmp_path / "hang.jsonl"

    class TestHangs(SchedulerContract):
        scheduler = cls
        hypothesis_settings = QUICK
        call_timeout = 0.5
        trace_sink = sink

    result, elapsed = _run(TestHangs)
    assert result.testsRun == 1 and len(result.failures) == 1, result.errors
    text = result.failures[0][1]
    assert f"{cls.__qualname__}.{method}() did not return" in text and "(step " in text, text
    assert f"trace written to {sink}" in text
    assert elapsed < 20  # one hang, not one per shrinking attempt
    assert tracefile.read(sink).events  # the events up to the call that hung


def test_a_scheduler_that_hangs_while_being_built_fails_the_contract() -> None:
    class TestBuilds(SchedulerContract):
        scheduler = HangBuilding
        hypothesis_settings = QUICK
        call_timeout = 0.3

    result, elapsed = _run(TestBuilds)
    assert len(result.failures) == 1, result.errors
    assert "construction (while probing it) did not return" in result.failures[0][1]
    assert elapsed < 10
