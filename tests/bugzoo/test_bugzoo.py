"""The gate against the bug zoo: every mutant is caught, by what docs/bugzoo.md says,
with a short counterexample that replays.

Each test runs ``schedspec check --against tests.bugzoo.zoo:NAME`` with the CI budget of
tests/bugzoo/bugzoo.py (seeded, deterministic), then checks:

- exit status 1, and the failure is one of the mutant's ``CAUGHT_BY``;
- the shrunk counterexample has at most ``MAX_STEPS`` steps, fails again on
  replay against the mutant, and passes against impl (and the spec); the copy
  kept in vectors/bugzoo/ still fails against the mutant;
- the row of docs/bugzoo.md's zoo table says the same (caught by, counterexample
  length, steps checked), so the table stays true.
"""

from __future__ import annotations

import inspect
import io
import contextlib
import re
from pathlib import Path

import pytest

from tests.bugzoo import bugzoo, zoo
from schedspec.cli.main import main as cli_main
from schedspec.impl import ImplScheduler


def _quiet(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli_main(argv)


@pytest.mark.parametrize("cls", zoo.ALL, ids=lambda c: c.__name__)
def test_gate_catches_mutant(cls: type[zoo.Mutant], tmp_path: Path) -> None:
    name = cls.__name__
    r = bugzoo.run_mutant(name, tmp_path / "out")
    print(f"{name}: {r.label}; counterexample {r.cx_steps} steps / {r.cx_events} events; "
          f"caught after {r.steps_checked} steps (seed {r.seed}) in {r.catch_s:.1f} s, shrunk in {r.shrink_s:.1f} s")
    assert r.rc == 1, f"{name} was not caught in {bugzoo.STEPS} steps"
    assert set(r.caught_by) & cls.CAUGHT_BY, f"{name} caught by {r.caught_by}, expected one of {set(cls.CAUGHT_BY)}"
    assert r.cx_steps is not None and r.cx_steps <= cls.MAX_STEPS, f"counterexample of {r.cx_steps} steps"
    assert r.trace is not None
    assert _quiet(["replay", str(r.trace), "--against", f"tests.bugzoo.zoo:{name}"]) == 1
    assert _quiet(["replay", str(r.trace), "--against", "impl"]) == 0
    assert _quiet(["replay", str(r.trace), "--against", "spec"]) == 0

    corpus = bugzoo.CORPUS / f"{name}.jsonl"
    assert corpus.exists(), f"no corpus trace for {name}: run python -m tests.bugzoo.bugzoo --write-docs"
    assert _quiet(["replay", str(corpus), "--against", f"tests.bugzoo.zoo:{name}"]) == 1

    rows = bugzoo.parse_doc_rows(bugzoo.DOC.read_text())
    assert name in rows, f"docs/bugzoo.md has no row for {name}: run python -m tests.bugzoo.bugzoo --write-docs"
    row = rows[name]
    # a crash's label names the file:line of impl it ran through; an edit of
    # impl above that line moves it without making the row wrong
    assert _no_line_numbers(row[bugzoo.COL_CAUGHT_BY]) == _no_line_numbers(r.label), (
        "docs/bugzoo.md is stale (caught by)"
    )
    assert row[bugzoo.COL_STEPS_CHECKED] == f"{r.steps_checked} (seed {r.seed})", "docs/bugzoo.md is stale (steps)"
    if r.shrink_s < 0.8 * bugzoo.SHRINK_TIME_S:  # shrinking is deterministic unless cut short by its clock
        assert row[bugzoo.COL_CX] == bugzoo.cx_text(r), "docs/bugzoo.md is stale (length)"


def test_doc_table_lists_exactly_the_zoo() -> None:
    rows = bugzoo.parse_doc_rows(bugzoo.DOC.read_text())
    assert sorted(rows) == sorted(c.__name__ for c in zoo.ALL)
    assert len(zoo.ALL) >= 20


@pytest.mark.parametrize("cls", zoo.ALL, ids=lambda c: c.__name__)
def test_mutant_is_an_impl_subclass_that_cites_its_bug(cls: type[zoo.Mutant]) -> None:
    assert issubclass(cls, ImplScheduler)
    assert cls.BUG and cls.CAUGHT_BY
    assert cls.ISSUE.startswith("https://github.com/") and ("/issues/" in cls.ISSUE or "/pull/" in cls.ISSUE)
    # it changes something of impl's: a method of its own
    own = {k for k, v in vars(cls).items() if inspect.isfunction(v)}
    assert own, f"{cls.__name__} overrides nothing"


def test_patched_refuses_text_that_is_not_there_once() -> None:
    with pytest.raises(AssertionError, match="occur once"):
        zoo.patched(ImplScheduler._free, ("no such text", ""))
    with pytest.raises(AssertionError, match="found 2"):
        zoo.patched(ImplScheduler._preempt_for, ("return False, i", ""))


def test_patched_without_edits_is_impl() -> None:
    """A patched method with no edit behaves as impl's own (same plans on a workload)."""
    from schedspec.check.run import run_workload
    from schedspec.adapters.registry import resolve
    from schedspec.check.random_workloads import random_workload

    class Same(ImplScheduler):
        _schedule_running = zoo.patched(ImplScheduler._schedule_running)
        _preempt_for = zoo.patched(ImplScheduler._preempt_for)

    factories = {"spec": resolve("spec").factory, "same": Same}
    for seed in range(3):
        _, failure = run_workload(random_workload(seed, 60), factories, oracle_seed=seed)  # type: ignore[arg-type]
        assert failure is None, failure.describe()


@pytest.mark.parametrize("cls", zoo.ALL, ids=lambda c: c.__name__)
def test_guided_gate_catches_every_mutant(cls: type[zoo.Mutant], tmp_path: Path) -> None:
    """The default generator (guided workloads) catches every mutant too, within the same step
    budget, in sync mode (the mode whose code the mutants patch); the counterexample is still
    shrunk, but its length is not held to the table, which the random generator's runs fill."""
    rc = _quiet(["check", "--against", f"tests.bugzoo.zoo:{cls.__name__}", "--modes", "sync",
                 "--steps", str(bugzoo.STEPS), "--workload-steps", str(bugzoo.WORKLOAD_STEPS),
                 "--shrink-time", "2", "--quiet", "--out", str(tmp_path / "out")])
    assert rc == 1, f"{cls.__name__} was not caught by the guided generator in {bugzoo.STEPS} steps"


def _no_line_numbers(label: str) -> str:
    return re.sub(r"\.py:\d+", ".py", label)
