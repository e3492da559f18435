"""schedspec.adapters.registry: what ``--against`` names and how it is found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from schedspec.adapters.registry import AdapterError, import_class, resolve

ROOT = Path(__file__).resolve().parents[2]


def test_the_built_in_names_resolve() -> None:
    assert {resolve(n).name for n in ("spec", "impl")} == {"spec", "impl"}


@pytest.mark.parametrize(("name", "message"), [
    ("nocolon", "expected MODULE:CLASS"),
    ("tests.support.buggy_schedulers:Missing", "has no attribute 'Missing'"),
    ("no_such_module_here:Cls", "cannot import module 'no_such_module_here'"),
])
def test_a_bad_name_is_an_error_naming_the_flag(name: str, message: str) -> None:
    with pytest.raises(AdapterError, match="--against") as info:
        import_class(name)
    assert message in str(info.value)


def test_the_schedspec_script_finds_a_module_of_the_current_directory(tmp_path: Path) -> None:
    """The console script does not put the current directory on the path as
    ``python -m`` does; MODULE:CLASS is still looked up there first, so a user
    runs ``schedspec check --against mysched:MyScheduler`` from their project."""
    (tmp_path / "mysched.py").write_text(
        "from schedspec.spec.scheduler import SpecScheduler\n\n"
        "class Mine(SpecScheduler):\n    pass\n"
    )
    script = Path(sys.executable).parent / "schedspec"
    if not script.exists():
        pytest.skip("the schedspec script is not installed beside this interpreter")
    proc = subprocess.run([str(script), "check", "--against", "mysched:Mine", "--steps", "200", "--quiet",
                           "--out", str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    missing = subprocess.run([str(script), "check", "--against", "notthere:Mine", "--steps", "10"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "cannot import module 'notthere'" in missing.stderr


def test_a_class_that_is_no_scheduler_is_refused_with_what_it_misses() -> None:
    from schedspec.adapters.registry import factory_of

    class Half:
        def add(self, request: object) -> None: ...

    with pytest.raises(AdapterError) as info:
        factory_of(Half, "label")
    text = str(info.value)
    assert text.startswith("label: ") and "Half is neither a vLLM Scheduler subclass nor a schedspec Scheduler" in text
    assert "missing abort, schedule, update" in text


def test_a_vllm_scheduler_is_one_that_subclasses_vllms_scheduler_interface() -> None:
    from schedspec.adapters.registry import is_vllm_scheduler_class

    class NameAlike:
        def update_from_output(self) -> None: ...

    assert not is_vllm_scheduler_class(NameAlike)  # a method name proves nothing, and vLLM is not imported
    from vllm.v1.core.sched.scheduler import Scheduler

    class MyFork(Scheduler):  # type: ignore[misc]
        pass

    assert is_vllm_scheduler_class(Scheduler) and is_vllm_scheduler_class(MyFork)
    from vllm.config import VllmConfig

    assert not is_vllm_scheduler_class(VllmConfig)  # from vLLM, but no scheduler


def test_deciding_a_plain_class_imports_no_vllm() -> None:
    code = (
        "import sys\n"
        "from schedspec.adapters.registry import is_vllm_scheduler_class\n"
        "class C:\n    def update_from_output(self): ...\n"
        "assert not is_vllm_scheduler_class(C)\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_class_whose_method_cannot_take_the_drivers_arguments_is_refused() -> None:
    from schedspec.adapters.registry import factory_of
    from tests.support.modes_support import UpdateTakesOne

    with pytest.raises(AdapterError, match=r"UpdateTakesOne.update\(self, plan"):
        factory_of(UpdateTakesOne, "label")


def test_capabilities_travel_with_the_target() -> None:
    from schedspec.check.capabilities import FULL

    target = resolve("tests.support.modes_support:FcfsOnly")
    assert "policy_priority" not in target.capabilities.names()
    assert resolve("spec").capabilities.missing() == ()
    # the default declaration leaves out the two modes, every admission gate, the KV features, the KV
    # events and the engine features
    assert FULL.missing() == tuple(sorted(("async_scheduling", "speculative_decoding", "lora", "structured_output",
                                           "pause", "watermark", "prefill_cadence", "encoder", "kv_connector",
                                           "hybrid_kv", "kv_events", "sessions", "pipeline", "runner_v2",
                                           "drafters")))
