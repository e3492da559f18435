"""The counts the docs state are the code's (tests/docs/counts.py), and the
check fails when one goes stale: run on a doctored text it names the number."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.docs import counts


def test_every_count_in_the_docs_is_the_codes() -> None:
    problems = counts.check_all()
    assert not problems, "\n".join(str(p) for p in problems)


@pytest.mark.parametrize("doc,stated,value", [
    ("docs/invariants.md", "{} safety invariants", counts.safety),
    ("docs/invariants.md", "{} invariants", counts.invariants),
    ("docs/coverage.md", "{} named rules", counts.rules),
    ("docs/coverage.md", "{} reachable rules", counts.reach(gates=True, kv=True)),
    ("docs/coverage.md", "{} rules sync scheduling can reach", counts.reach(("sync",))),
    ("README.md", "{} invariants held (safety)", counts.held_by("examples.reserve_upfront:ReserveUpfrontScheduler")),
    ("docs/trace-format.md", "{} spec vectors", counts.vectors("spec")),
    ("docs/modelcheck.md", "small | {} spaces", counts.spaces("small")),
])
def test_a_changed_count_is_caught(doc: str, stated: str, value: Callable[[], int]) -> None:
    text = " ".join((counts.ROOT / doc).read_text().split())  # one line: a count may sit at a line break
    right = stated.format(value())
    assert right in text, f"{doc} no longer says {right!r}: change the case"
    assert not counts.stale(doc, text)
    doctored = text.replace(right, stated.format(value() + 1), 1)
    found = counts.stale(doc, doctored)
    assert len(found) == 1 and f"says {value() + 1} " in found[0].problem, found


def test_a_count_no_claim_holds_is_caught() -> None:
    text = "The spec has 17 frobnicated rules and 3 hidden invariants."
    found = counts.uncounted("x.md", text)
    assert len(found) == 2, found
    assert "17 frobnicated rules" in found[0].text and "3 hidden invariants" in found[1].text, found


def test_numbers_inside_other_numbers_are_not_counts() -> None:
    text = "vLLM 0.33.0 The rule; 2,706 mutants; 400 seeds x 8 modes; 1 invariant violation(s)"
    assert counts.uncounted("x.md", text) == []
    assert counts.stale("x.md", "2,706 mutants")[0].problem.startswith("says 2706 ")
