"""The testing API speaks the same modes as the CLI, draws within a
scheduler's capabilities, and takes the user's Hypothesis settings."""

from __future__ import annotations

import os
import subprocess
import sys
import unittest
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from schedspec.check import trace as tracefile
from schedspec.testing import ContractError, SchedulerContract, hypothesis_settings_in_force
from tests.support.buggy_schedulers import LeakyAbort
from tests.support.modes_support import FcfsOnly

QUICK = settings(max_examples=10, stateful_step_count=25, deadline=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))
ROOT = Path(__file__).resolve().parents[2]


def _run(case: type[unittest.TestCase]) -> unittest.TestResult:
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    return result


def test_invariants_mode_within_declared_capabilities() -> None:
    """FcfsOnly asserts on a PRIORITY config, a threshold, and a reset: none is drawn."""

    class TestFcfsOnly(SchedulerContract):
        scheduler = FcfsOnly
        mode = "invariants"
        hypothesis_settings = QUICK

    result = _run(TestFcfsOnly)
    assert result.testsRun == 1 and not result.failures and not result.errors, result.failures + result.errors


def test_a_leak_is_caught_by_the_safety_invariants_and_the_trace_records_the_check(tmp_path: Path) -> None:
    sink = tmp_path / "fail.jsonl"

    class TestLeaky(SchedulerContract):
        scheduler = LeakyAbort
        reference = None
        invariants = "safety,-quiescence"
        hypothesis_settings = settings(QUICK, max_examples=200)
        trace_sink = sink

    result = _run(TestLeaky)
    assert len(result.failures) + len(result.errors) == 1
    text = (result.failures + result.errors)[0][1]
    assert "block-conservation" in text
    assert tracefile.read(sink).check == {"mode": "invariants", "invariants": "safety,-quiescence"}


def test_lockstep_without_a_reference_is_refused() -> None:
    class TestNoRef(SchedulerContract):
        scheduler = FcfsOnly
        reference = None
        mode = "lockstep"

    result = _run(TestNoRef)
    assert "set `reference`" in (result.failures + result.errors)[0][1]


def test_settings_explicit_then_env_profile_then_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hypothesis_settings_in_force(QUICK) is QUICK
    settings.register_profile("schedspec-test-user", max_examples=7)
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "schedspec-test-user")
    got = hypothesis_settings_in_force()
    assert got is not None and got.max_examples == 7
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "no-such-profile-here")
    with pytest.raises(ContractError, match="no-such-profile-here"):
        hypothesis_settings_in_force()


def test_the_users_profiles_are_honoured_and_never_overwritten() -> None:
    code = (
        "from hypothesis import settings\n"
        "settings.register_profile('ci', max_examples=3, stateful_step_count=5)\n"
        "settings.load_profile('ci')\n"
        "import schedspec.testing as t\n"
        "from schedspec.testing import contract, stateful, strategies\n"
        "s = t.hypothesis_settings_in_force()\n"
        "assert s is not None and s.max_examples == 3 and s.stateful_step_count == 5, s\n"
        "assert settings.get_profile('ci').max_examples == 3\n"
        "assert settings().max_examples == 3\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
