"""A vector is a test: replayed against a bug-zoo mutant (tests/bugzoo/zoo.py)
with the bug the vector is named against, it fails.

Apart from tests/vectors/test_vectors.py because the zoo recompiles impl's
methods from their source, which a mutation run (tools/mutation/) rewrites.
"""

from __future__ import annotations

import pytest

from tests.vectors.test_vectors import VECTORS, replay


@pytest.mark.parametrize(
    ("vector", "mutant"),
    [
        ("fcfs-preempts-the-last-running-and-puts-it-in-front", "WrongFcfsVictim"),
        ("freed-blocks-go-tail-first-unkeyed-to-the-front-keyed-to-the-back", "FreeHeadFirst"),
        ("cache-salt-separates-prefix-cache-entries", "SaltIgnored"),
        ("long-prefill-threshold-spares-a-lone-request", "ThresholdOnLoneRequest"),
        ("stop-token-stops-a-request-even-with-ignore-eos", "StopTokenIgnored"),
    ],
)
def test_a_spec_vector_fails_against_the_bug_it_pins(vector: str, mutant: str) -> None:
    """A vector is a test: replayed against a zoo mutant with the bug the
    vector is named against, it fails (exit 1) and says where."""
    rc, out = replay(VECTORS / "spec" / f"{vector}.jsonl", f"tests.bugzoo.zoo:{mutant}")
    assert rc == 1, out[-3000:]
    assert "FAILED:" in out
