"""mypy --strict stays clean; importing the light packages never pulls torch or vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_strict_is_clean() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_light_packages_do_not_import_torch_or_vllm() -> None:
    code = (
        "import sys\n"
        "import schedspec.spec, schedspec.spec.scheduler, schedspec.impl, schedspec.invariants, schedspec.cli.main, schedspec.check.driver,"
        " schedspec.testing.stateful, schedspec.adapters.registry, schedspec.check.trace\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers'))\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
