"""mypy --strict stays clean; importing the light layers never pulls a heavy library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "transformers", "matplotlib", "rich", "safetensors", "numpy")


def test_mypy_strict_is_clean() -> None:
    """The whole schedspec namespace (pyproject's [tool.mypy] files), strict."""
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("modules", [
    "schedspec.spec, schedspec.spec.scheduler, schedspec.impl, schedspec.invariants",
    "schedspec.check.workload, schedspec.check.driver, schedspec.check.shrink, schedspec.check.trace,"
    " schedspec.check.report",
    "schedspec.adapters.registry, schedspec.testing, schedspec.cli.main",
])
def test_light_layers_do_not_import_heavy_libraries(modules: str) -> None:
    """Run in a fresh interpreter from outside the repository, so only the
    installed ``schedspec`` namespace is importable."""
    code = (
        "import sys\n"
        f"import {modules}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "docs", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_installed_namespace_claims_no_generic_top_level_name() -> None:
    """From outside the checkout, ``spec``, ``impl`` ... are not importable:
    the package installs one top-level name, ``schedspec``."""
    code = (
        "import importlib.util\n"
        "names = ['spec', 'impl', 'invariants', 'gpu_runner', 'harness', 'check', 'adapters', 'cli']\n"
        "print([n for n in names if importlib.util.find_spec(n) is not None])\n"
        "import schedspec.spec, schedspec.impl, schedspec.invariants, schedspec.gpu_runner\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "docs", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_python_dash_m_schedspec_runs_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "schedspec", "invariants"], cwd=ROOT / "docs",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "invariants" in proc.stdout.splitlines()[0]
