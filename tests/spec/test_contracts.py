"""CrossHair checks the PEP 316 contracts of the spec's pure helpers.

The contracts live in spec/rules.py docstrings (``pre:``/``post:``). A
negative control mutates one helper and shows CrossHair finding the
counterexample, so this test cannot pass by checking nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CROSSHAIR = [sys.executable, "-m", "crosshair", "check", "--analysis_kind=PEP316"]


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(CROSSHAIR + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_spec_rules_contracts_hold() -> None:
    pytest.importorskip("crosshair")
    proc = _run(["--per_condition_timeout=4", "schedspec/spec/rules.py"], ROOT, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_crosshair_finds_a_broken_rule(tmp_path: Path) -> None:
    pytest.importorskip("crosshair")
    source = (ROOT / "spec" / "rules.py").read_text()
    broken = source.replace("return (num_tokens - 1) // block_size", "return num_tokens // block_size")
    assert broken != source
    (tmp_path / "rules_mutant.py").write_text(broken)
    proc = _run(["--per_condition_timeout=4", "rules_mutant.max_hit_blocks"], tmp_path, timeout=300)
    assert proc.returncode != 0
    assert "max_hit_blocks" in proc.stdout
