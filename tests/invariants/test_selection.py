"""Tags and selection: every invariant says what it protects, and the
``--invariants`` selector chooses exactly what it names."""

from __future__ import annotations

import pytest

from schedspec.invariants import BY_ID, CATALOGUE, SelectionError, all_tags, catalogue_text, select
from schedspec.invariants.core import is_valid_tag, state_invariant


def test_every_catalogue_entry_has_a_valid_tag() -> None:
    for inv in CATALOGUE:
        assert inv.tags, f"{inv.id} has no tag"
        for tag in inv.tags:
            assert is_valid_tag(tag), f"{inv.id}: invalid tag {tag!r}"
        # safety and policy do not mix: a mixed invariant is split in two
        assert not (inv.is_safety and inv.policies), f"{inv.id} mixes safety and policy"


def test_requirements_name_known_capabilities() -> None:
    from schedspec.check.capabilities import CAPABILITY_NAMES

    for inv in CATALOGUE:
        assert inv.requires <= CAPABILITY_NAMES, (inv.id, sorted(inv.requires - CAPABILITY_NAMES))


def test_tag_validity() -> None:
    assert is_valid_tag("safety") and is_valid_tag("policy:vllm-victim") and is_valid_tag("policy:fcfs")
    for bad in ("", "Safety", "policy:", "policy:Bad_Name", "policy:a--b", "liveness"):
        assert not is_valid_tag(bad), bad


def test_a_bad_tag_is_refused_at_declaration() -> None:
    with pytest.raises(ValueError, match="neither"):
        state_invariant("x", "s", "vllm/x.py", tags=("policy",))
    with pytest.raises(TypeError, match="not the string"):
        state_invariant("x", "s", "vllm/x.py", tags="safety")


def test_split_invariants_are_on_both_sides() -> None:
    assert BY_ID["block-table-covers-computed"].tags == ("safety",)
    assert BY_ID["block-table-exact"].tags == ("policy:vllm-allocation",)
    assert BY_ID["plan-matches-state"].is_safety and not BY_ID["plan-blocks-exact"].is_safety
    assert BY_ID["plan-entry-kinds"].is_safety and not BY_ID["plan-order"].is_safety
    assert BY_ID["progress"].is_safety and not BY_ID["progress-admits-head"].is_safety


def ids(sel: str | None, mode: str = "lockstep") -> list[str]:
    return [inv.id for inv in select(sel, mode)]  # type: ignore[arg-type]


def test_defaults_per_mode() -> None:
    assert ids(None) == [inv.id for inv in CATALOGUE]
    assert ids(None, "invariants") == [inv.id for inv in CATALOGUE if inv.is_safety]
    assert 20 <= len(ids(None, "invariants")) < len(CATALOGUE)


def test_tags_ids_and_exclusions() -> None:
    assert ids("policy:vllm-victim") == ["fcfs-victim-suffix", "priority-victim-choice"]
    assert ids("safety,free-queue-lru") == [i for i in ids(None) if i in set(ids("safety")) | {"free-queue-lru"}]
    assert "token-budget" not in ids("safety,-token-budget")
    assert ids("-token-budget", "invariants") == [i for i in ids(None, "invariants") if i != "token-budget"]
    assert set(ids("policy")) == {inv.id for inv in CATALOGUE if inv.policies}
    assert ids("all,-safety") == ids("policy")
    # catalogue order, whatever the order of the items
    assert ids("token-budget,max-num-seqs") == ["max-num-seqs", "token-budget"]


@pytest.mark.parametrize(
    "sel,word",
    [
        ("no-such-invariant", "no-such-invariant"),
        ("policy:nobody", "policy:nobody"),
        ("safety,-free-queue-lru", "free-queue-lru"),
        ("token-budget,-token-budget", "nothing to check"),
        ("safety,,token-budget", "empty item"),
        ("", "empty item"),
    ],
)
def test_bad_selectors_name_the_problem(sel: str, word: str) -> None:
    with pytest.raises(SelectionError, match=word):
        select(sel)


def test_catalogue_text_shows_tags_and_filters() -> None:
    text = catalogue_text()
    assert "free-queue-lru  [policy:vllm-free-order;" in text
    assert "token-budget  [safety;" in text
    part = catalogue_text(select("policy:fcfs"))
    assert part.startswith(f"3 of {len(CATALOGUE)} invariants")
    assert "waiting-queue-order" in part and "token-budget" not in part
    assert all_tags()[0] == "safety" and "policy:vllm-allocation" in all_tags()
