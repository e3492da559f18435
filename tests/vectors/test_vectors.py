"""vectors/: every vector replays with ``schedspec replay`` against spec and impl
(and vLLM, when installed), and vectors/spec/ is exactly what
tests/vectors/generate.py writes (that a vector fails against a scheduler with
the bug it pins: tests/vectors/test_vectors_catch_bugs.py).

A vector passes when the replay exits 0: every invariant held at every step
and, against any scheduler other than the spec, every plan and view equalled
the spec's (vectors/README.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path

import pytest

from schedspec.check import trace as tracefile
from schedspec.cli.main import main as cli_main

from tests.helpers import lockstep
from tests.vectors import generate

VECTORS = Path(__file__).resolve().parents[2] / "vectors"
BUGZOO = sorted((VECTORS / "bugzoo").glob("*.jsonl"))
SPEC = sorted((VECTORS / "spec").glob("*.jsonl"))
ALL = BUGZOO + SPEC
IDS = [f"{p.parent.name}/{p.stem}" for p in ALL]

REQUIRE_VLLM = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def replay(path: Path, against: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli_main(["replay", str(path), "--against", against])
    return rc, out.getvalue()


def test_the_corpus_holds_the_zoo_and_the_spec_scenarios() -> None:
    assert len(BUGZOO) >= 20
    assert 15 <= len(SPEC) <= 40
    assert {p.name for p in SPEC} == {f"{s.name}.jsonl" for s in generate.SCENARIOS}


def test_spec_vectors_are_what_the_generator_writes() -> None:
    """Staleness: regenerating every spec vector gives the files as they are
    (run ``python -m tests.vectors.generate`` after a change of the spec or the
    scenarios)."""
    expected = generate.expected_files()
    on_disk = {p.name: p.read_text() for p in SPEC}
    assert sorted(on_disk) == sorted(expected)
    stale = [name for name, text in expected.items() if on_disk[name] != text]
    assert not stale, f"stale vectors (python -m tests.vectors.generate): {stale}"


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_vector_replays_against_the_spec(path: Path) -> None:
    rc, out = replay(path, "spec")
    assert rc == 0, out[-3000:]
    assert out.startswith("OK: replayed")


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_vector_replays_against_impl_in_lockstep_with_the_spec(path: Path) -> None:
    """Each vector is a short trace into a corner (a zoo bug's counterexample, or
    a named behaviour of the spec): spec and impl agree on it, plan by plan and
    view by view, with every invariant held."""
    t = tracefile.read(path)
    _, failure = lockstep(t.workload, vocab=t.vocab, oracle_seed=t.oracle_seed)
    assert failure is None, failure.describe()
    rc, out = replay(path, "impl")
    assert rc == 0, out[-3000:]


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE_VLLM, reason="vLLM is not installed (scripts/install_vllm.sh); "
                    "set SCHEDSPEC_REQUIRE_VLLM=1 to fail instead of skipping")
@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_vector_replays_against_vllm(path: Path) -> None:
    rc, out = replay(path, "vllm")
    assert rc == 0, out[-3000:]
