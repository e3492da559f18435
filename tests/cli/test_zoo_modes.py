"""Invariants mode gives the bug zoo the same verdicts as lockstep: every
mutant that lockstep catches (tests/bugzoo/test_bugzoo.py) is caught by the
invariants alone, without the comparison with the spec, within the same CI
budget; and the spec itself passes in both modes."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from schedspec.cli.main import main
from tests.bugzoo import bugzoo, zoo


def run(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def budget(out: Path) -> list[str]:
    # the zoo's mutants patch impl's synchronous path: sync workloads, as tests/bugzoo runs them
    return ["--modes", "sync", "--generator", "random", "--steps", str(bugzoo.STEPS), "--workload-steps", str(bugzoo.WORKLOAD_STEPS), "--quiet",
            "--out", str(out), "--shrink-time", "2", "--json", str(out / "s.json")]


@pytest.mark.parametrize("cls", zoo.ALL, ids=lambda c: c.__name__)
def test_invariants_mode_catches_every_mutant(cls: type[zoo.Mutant], tmp_path: Path) -> None:
    rc = run(["check", "--against", f"tests.bugzoo.zoo:{cls.__name__}", "--mode", "invariants",
              "--invariants", "all"] + budget(tmp_path))
    failure = json.loads((tmp_path / "s.json").read_text())["failure"]
    assert rc == 1 and failure is not None, f"{cls.__name__} not caught in invariants mode"
    assert failure["kind"] != "divergence"  # nothing was compared


def test_the_spec_passes_in_both_modes(tmp_path: Path) -> None:
    steps = ["--steps", "2000"]
    assert run(["check", "--against", "spec", "--mode", "invariants"] + budget(_mk(tmp_path / "a")) + steps) == 0
    assert run(["check", "--against", "spec", "--mode", "invariants", "--invariants", "all"]
               + budget(_mk(tmp_path / "b")) + steps) == 0
    assert run(["check", "--against", "spec"] + budget(_mk(tmp_path / "c")) + steps) == 0


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
