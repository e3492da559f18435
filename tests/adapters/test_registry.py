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
