"""The model checker's parts on their own: the alphabet, the liveness
analysis on hand-built step graphs, the named coverage counters, the library
call under the command and its errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from schedspec.cli.main import main
from schedspec.modelcheck import (
    COVERAGE,
    Alphabet,
    Coverage,
    Deadlock,
    Drained,
    EventCode,
    Expander,
    Explorer,
    ModelCheckError,
    Shape,
    SpaceResult,
    analyse,
    bound,
    check_bound,
    drain_distances,
)
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import SchedSpecError


def test_alphabet_numbers_and_names_every_event() -> None:
    a = Alphabet((Shape("A", (1,), 1), Shape("B", (2,), 1)), max_requests=2)
    assert (EventCode.STEP, EventCode.RESET, EventCode.RESET_RUNNING) == (0, 1, 2)
    assert [a.label(c) for c in range(a.size)] == [
        "step", "reset", "reset+running", "add A", "add B", "abort #0", "abort #1"]
    assert a.is_add(a.add(1)) and not a.is_add(a.abort(0)) and not a.is_add(EventCode.RESET_RUNNING)
    assert a.shape_index(a.add(1)) == 1 and a.abort_index(a.abort(1)) == 1
    # Adds only below the request bound; one abort per unfinished request.
    assert a.enabled(known=1, unfinished=1) == [0, 1, 2, 3, 4, 5]
    assert a.enabled(known=2, unfinished=1) == [0, 1, 2, 5]
    assert a.enabled(known=2, unfinished=0) == [0, 1, 2]


def test_a_shape_bounded_at_once_and_a_space_without_resets() -> None:
    a = Alphabet((Shape("A", (1,), 1, max_at_once=1), Shape("B", (2,), 1)), max_requests=3, resets=False)
    assert a.enabled(known=0, unfinished=0, known_by_shape=[0, 0]) == [0, 3, 4]
    assert a.enabled(known=1, unfinished=1, known_by_shape=[1, 0]) == [0, 4, 5]
    assert a.enabled(known=2, unfinished=2, known_by_shape=[0, 2]) == [0, 3, 4, 5, 6]  # B has no cap
    # the space's shapes and resets as the expander offers them: one Q at a
    # time (finished and not yet reported still counts), no reset
    space = next(s for s in bound("small").spaces if s.name == "priority-nocache-3seqs-giveback")
    ex = Expander(space)
    s = SpecScheduler(space.config)
    assert [ex.alphabet.label(c) for c in ex.enabled(s.view())] == ["step", "add Q", "add P", "add R"]
    s.add(ex.request(0, 1))
    s.add(ex.request(1, 2))
    assert [ex.alphabet.label(c) for c in ex.enabled(s.view())] == ["step", "add R", "abort #0", "abort #1"]
    s.abort("r1")
    assert [ex.alphabet.label(c) for c in ex.enabled(s.view())] == ["step", "add R", "abort #0"]
    assert space.describe()["resets"] is False and "resets" not in bound("small").spaces[0].describe()


def test_drain_distances_and_the_worst_state() -> None:
    # 0 idle; 1 -> 2 -> 0: state 1 drains in 2 steps, state 2 in 1.
    succ, busy = [0, 2, 0], bytearray([0, 1, 1])
    assert drain_distances(succ, busy) == [0, 2, 1]
    assert analyse(succ, busy, [0, 1, 2]) == Drained(worst=1, steps=2)


def test_a_busy_step_cycle_is_a_deadlock_from_its_shallowest_state() -> None:
    # 1 -> 2 -> 3 -> 2 never drains; 4 -> 0 does.
    succ, busy = [0, 2, 3, 2, 0], bytearray([0, 1, 1, 1, 1])
    assert drain_distances(succ, busy) == [0, -3, -3, -3, 1]
    # State 1 is the shallowest stuck one: three steps, then a cycle of two.
    assert analyse(succ, busy, [0, 1, 2, 3, 1]) == Deadlock(start=1, steps=3, cycle=2)
    # Depth decides, not numbering.
    deeper = analyse(succ, busy, [0, 5, 2, 3, 1])
    assert isinstance(deeper, Deadlock) and deeper.start == 2


def test_coverage_is_named_counters_reported_under_their_labels() -> None:
    c = Coverage(preempting_steps=1, running_aborts=2)
    c.merge(Coverage(preempting_steps=3, hit_admissions=1))
    assert (c.preempting_steps, c.hit_admissions, c.running_aborts) == (4, 1, 2)
    d = c.as_dict()
    assert tuple(d) == COVERAGE
    assert d["steps that preempt"] == 4 and d["aborts of running requests"] == 2
    # A real run reports every counter, and one space's transitions show some of them.
    space = next(s for s in bound("small").spaces if s.name == "fcfs-cache-tight")
    r = Explorer(space, max_states=400).run()
    assert tuple(r.coverage) == COVERAGE and sum(r.coverage.values()) > 0


def test_check_bound_reports_each_space_and_names_what_does_not_exist() -> None:
    seen: list[SpaceResult] = []
    out = check_bound("small", spaces=["fcfs-cache-salt-tight", "fcfs-cache-tight"], max_states=50,
                      use_impl=False, on_space=seen.append)
    # The bound's order, not the order asked.
    assert [r.space.name for r in seen] == ["fcfs-cache-tight", "fcfs-cache-salt-tight"]
    assert out.spaces == seen and out.failure is None and not out.total().complete
    assert out.states == sum(r.states for r in seen) >= 100
    with pytest.raises(ModelCheckError, match=r"'nope' is not a space of bound small \(its spaces: fcfs-cache-tight,"):
        check_bound("small", spaces=["nope"])
    with pytest.raises(ModelCheckError, match="unknown bound 'huge'") as info:
        bound("huge")
    assert isinstance(info.value, SchedSpecError) and isinstance(info.value, ValueError)


def test_the_command_names_the_flag_of_a_bad_space(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["modelcheck", "--space", "nope", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--space: 'nope' is not a space of bound small (its spaces: fcfs-cache-tight" in err


def test_the_model_checker_imports_no_command_line() -> None:
    code = ("import sys, schedspec.modelcheck; "
            "print(sorted(m for m in sys.modules if m.startswith('schedspec.cli')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
