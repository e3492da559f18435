"""spec/rules.py: each pure rule at the edges of its documented contract, with
exact values (the rules' CrossHair contracts are checked in tests/spec/test_contracts.py)."""

from __future__ import annotations

from schedspec.spec import Policy
from schedspec.spec import rules


def test_cdiv_and_blocks_for_tokens_round_up() -> None:
    assert [rules.cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [rules.blocks_for_tokens(n, 4) for n in (0, 3, 4, 9)] == [0, 1, 1, 3]


def test_running_chunk_is_cut_by_threshold_budget_and_max_model_len() -> None:
    rc = rules.running_chunk
    assert rc(10, 0, 1, 64, 32) == 1  # a threshold of 1 applies
    assert rc(10, 0, 10, 64, 32) == 10  # threshold equal to what is left
    assert rc(10, 0, 0, 4, 32) == 4  # budget
    assert rc(20, 10, 0, 64, 16) == 5  # max_model_len keeps a slot: 16 - 10 - 1
    assert rc(5, 5, 0, 8, 32) == 0  # nothing left
    assert rc(20, 16, 0, 64, 16) == 0  # already at max_model_len: 0, never negative


def test_admission_chunk_is_cut_by_threshold_and_budget_or_refused_unchunked() -> None:
    ac = rules.admission_chunk
    assert ac(10, 0, 1, 64, True) == 1
    assert ac(10, 4, 0, 64, True) == 6
    assert ac(10, 0, 0, 4, True) == 4
    assert ac(8, 0, 0, 8, False) == 8  # fits the budget exactly
    assert ac(10, 0, 0, 8, False) == 0  # does not fit, chunked prefill off: 0 (stop)
    assert ac(10, 0, 3, 8, False) == 3  # the threshold cut fits


def test_threshold_applies_only_beside_others_and_a_hit_leaves_one_token() -> None:
    assert rules.effective_threshold(4, 1, 0) == 0
    assert rules.effective_threshold(4, 0, 1) == 0
    assert rules.effective_threshold(4, 1, 1) == 4
    assert rules.effective_threshold(4, 0, 2) == 4
    assert [rules.max_hit_blocks(n, 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_admission_needs_the_blocks_past_the_hit_and_the_free_hit_blocks() -> None:
    abn = rules.admission_blocks_needed
    assert abn(9, 4, 0, 0) == 3
    assert abn(9, 4, 2, 1) == 2  # one new block, one free hit block
    assert abn(8, 4, 2, 0) == 0  # target within the hit: nothing new
    assert abn(8, 4, 2, 2) == 2


def test_victim_is_the_last_under_fcfs_and_the_first_greatest_key_under_priority() -> None:
    assert rules.priority_key(1, 2, "r") == (1, 2, "r")
    cv = rules.choose_victim
    assert cv(Policy.FCFS, [(5, 1), (0, 2)]) == 1
    assert cv(Policy.PRIORITY, [(0, 1), (2, 0), (1, 9)]) == 1
    assert cv(Policy.PRIORITY, [(0, 1), (0, 3), (0, 2)]) == 1
    assert cv(Policy.PRIORITY, [(1, 1), (1, 1)]) == 0  # ties: the first in running order
    assert cv(Policy.PRIORITY, [(1, 5)]) == 0


def test_freed_blocks_split_tail_first_into_front_and_back() -> None:
    sfb = rules.split_freed_blocks
    # tail first; block 2 is still held; keyed blocks to the back
    assert sfb([3, 2, 1], [True, False, True], [False, False, True], True) == ([3], [1])
    assert sfb([3, 2, 1], [True, True, True], [True, False, True], True) == ([2], [3, 1])
    assert sfb([3, 2, 1], [True, True, True], [True, False, True], False) == ([3, 2, 1], [])
    assert sfb([], [], [], True) == ([], [])


def test_stop_reason_says_stop_or_length_or_nothing() -> None:
    sr = rules.stop_reason
    assert sr(7, 1, 5, 4, 32, 7, False, ()) == "stop"
    assert sr(7, 1, 5, 4, 32, 7, True, ()) is None
    assert sr(7, 1, 5, 4, 32, None, False, (7,)) == "stop"
    assert sr(7, 1, 5, 4, 32, 7, True, (7,)) == "stop"  # a stop token stops even with ignore_eos
    assert sr(3, 4, 8, 4, 32, None, False, ()) == "length"
    assert sr(3, 1, 32, 4, 32, None, False, ()) == "length"
    assert sr(3, 3, 31, 4, 32, None, False, ()) is None


def test_the_connector_offers_and_the_partial_tail_rules_are_read_by_name() -> None:
    """spec/connector.py's pure rules (they run here, in the fast selection
    that mutation testing uses, as well as in tests/spec/test_connector.py):
    the offer beyond the local hit, and the partial-tail split of a hit."""
    from schedspec.spec.connector import ExternalHit, MatchedTokens, external_hit, get_num_new_matched_tokens

    assert get_num_new_matched_tokens(10, True, 4) == MatchedTokens(num_external_tokens=6, load_async=True)
    assert get_num_new_matched_tokens(4, True, 8) == MatchedTokens(num_external_tokens=0, load_async=False)
    assert external_hit(8, 4, 6, True) == ExternalHit(num_local_tokens=8, num_external_tokens=6, load_async=True)
    # a local hit ending inside a block: a longer remote hit drops the tail ...
    assert external_hit(10, 4, 5, True) == ExternalHit(num_local_tokens=8, num_external_tokens=5, load_async=True)
    # ... one no longer loads nothing
    assert external_hit(10, 4, 2, True) == ExternalHit(num_local_tokens=10, num_external_tokens=0, load_async=False)
    assert external_hit(10, 4, 2, False).load_async is False
