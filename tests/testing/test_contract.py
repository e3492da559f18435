"""The public testing API: subclass SchedulerContract, set `scheduler`."""

from __future__ import annotations

import subprocess
import sys
import unittest

from hypothesis import HealthCheck, Phase, settings

from schedspec.impl import ImplScheduler
from schedspec.testing import SchedulerContract
from tests.support.buggy_schedulers import LeakyAbort

QUICK = settings(max_examples=15, stateful_step_count=30, deadline=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


class TestImplMeetsTheContract(SchedulerContract):
    scheduler = ImplScheduler
    hypothesis_settings = QUICK


def _run(case: type[unittest.TestCase]) -> unittest.TestResult:
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    return result


def test_the_base_class_is_no_test_and_a_subclass_is() -> None:
    assert SchedulerContract.__dict__["__test__"] is False
    assert TestImplMeetsTheContract.__test__ is True


def test_a_leaky_scheduler_breaks_the_contract_and_the_notes_read_as_its_script() -> None:
    class TestLeaky(SchedulerContract):
        scheduler = LeakyAbort
        reference = None  # invariants alone must catch it
        hypothesis_settings = settings(QUICK, max_examples=200)

    result = _run(TestLeaky)
    assert result.testsRun == 1 and len(result.failures) + len(result.errors) == 1
    text = (result.failures + result.errors)[0][1]
    assert "invariant violation" in text
    # The shrunk run, noted event by event: the config, then numbered events.
    lines = [line.strip() for line in text.splitlines()]
    assert any(line.startswith("config = SchedulerConfig(") for line in lines), text
    script = [line for line in lines if line[:1].isdigit() and ": " in line]
    assert script, text
    assert [int(line.split(":", 1)[0]) for line in script] == list(range(len(script)))
    assert script[0].split(": ", 1)[1].startswith("add(RequestSpec(")
    assert any(line.endswith("abort('r1')") or "abort(" in line for line in script)
    assert all(line.split(": ", 1)[1].split("(", 1)[0] in ("add", "abort", "step", "reset_prefix_cache")
               for line in script)


def test_a_contract_without_a_scheduler_says_so() -> None:
    class TestNothing(SchedulerContract):
        pass

    result = _run(TestNothing)
    assert len(result.errors) == 1 and "set the class attribute `scheduler`" in result.errors[0][1]


def test_importing_schedspec_testing_registers_no_profile() -> None:
    code = (
        "from hypothesis import settings\n"
        "from hypothesis.errors import InvalidArgument\n"
        "def known(name):\n"
        "    try:\n"
        "        settings.get_profile(name)\n"
        "    except InvalidArgument:\n"
        "        return False\n"
        "    return True\n"
        "names = ['ci', 'deep', 'dev', 'impl-ci', 'impl-deep']\n"
        "before = [known(n) for n in names]\n"
        "profiles = [repr(settings.get_profile(n)) for n, k in zip(names, before) if k]\n"
        "default = repr(settings())\n"
        "import schedspec.testing, schedspec.testing.stateful, schedspec.testing.strategies\n"
        "assert [known(n) for n in names] == before, before\n"
        "assert before[1:] == [False] * 4, before  # hypothesis itself may know 'ci'\n"
        "assert [repr(settings.get_profile(n)) for n, k in zip(names, before) if k] == profiles\n"
        "assert repr(settings()) == default\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_failure_names_the_class_and_prints_the_restricted_config_that_ran() -> None:
    """The failing class is named (not "candidate"), and the config printed is the one after the
    capability restriction: never one with a feature the class does not declare."""
    from examples.batch_bound import OverfullBatch

    class TestOverfull(SchedulerContract):
        scheduler = OverfullBatch
        mode = "invariants"
        hypothesis_settings = settings(QUICK, max_examples=100, phases=[Phase.generate])  # no shrinking

    result = _run(TestOverfull)
    assert len(result.failures) + len(result.errors) == 1, result
    text = (result.failures + result.errors)[0][1]
    assert "OverfullBatch" in text and "candidate" not in text, text
    configs = [line for line in text.splitlines() if "SchedulerConfig(" in line]
    assert configs, text
    for line in configs:
        assert "enable_chunked_prefill=True" not in line and "policy=<Policy.PRIORITY" not in line, line
