"""The drafter (SchedulerConfig.drafter): a draft model reserves lookahead
slots, takes one batch slot per scheduled request besides its tokens, and
under Model Runner V2 lets the plan skip drafts (spec/runner_v2.py)."""

from __future__ import annotations

import pytest

from schedspec.spec.interface import ConfigError, RequestSpec, SchedulerConfig, StepPlan
from schedspec.spec.runner_v2 import can_skip_drafts, drafts_unused
from schedspec.spec.scheduler import SpecScheduler


def _config(drafter: str = "draft_model", runner: str = "v2", **kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(block_size=4, num_blocks=33, max_num_batched_tokens=32, max_num_seqs=4,
                                   max_model_len=64, num_speculative_tokens=2, drafter=drafter, model_runner=runner)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def _first_plan(config: SchedulerConfig, *requests: RequestSpec) -> StepPlan:
    s = SpecScheduler(config)
    for r in requests:
        s.add(r)
    return s.schedule()


def test_the_drafter_field() -> None:
    assert SchedulerConfig().drafter == "ngram" and "drafter" not in SchedulerConfig().to_dict()
    c = _config()
    assert SchedulerConfig.from_dict(c.to_dict()) == c
    assert (c.num_lookahead_tokens, c.num_draft_slots) == (2, 1)
    assert (_config("ngram").num_lookahead_tokens, _config("ngram").num_draft_slots) == (0, 0)
    assert SchedulerConfig(drafter="draft_model").num_lookahead_tokens == 0  # no drafts, no drafter
    with pytest.raises(ConfigError) as err:
        _config("medusa")
    assert err.value.field == "drafter"


def test_can_skip_drafts_needs_v2_and_lookahead() -> None:
    assert can_skip_drafts(_config())
    assert not can_skip_drafts(_config(runner="v1"))
    assert not can_skip_drafts(_config("ngram"))


@pytest.mark.parametrize("args, unused", [
    ((6, 0, 3, 0, 0, 10), True),   # a non-final prefill chunk
    ((6, 0, 6, 0, 0, 1), True),    # samples the last output token
    ((6, 0, 6, 0, 0, 2), False),
    ((8, 7, 1, 2, 1, 4), True),    # async: one more sampling step in flight
    ((8, 7, 1, 2, 0, 4), False),
])
def test_drafts_unused(args: tuple[int, int, int, int, int, int], unused: bool) -> None:
    assert drafts_unused(*args) is unused


def test_skip_drafts_when_the_only_request_reaches_max_tokens() -> None:
    last = RequestSpec("a", (1, 2, 3, 4, 5, 6), 1)
    plan = _first_plan(_config(), last)
    assert plan.skip_drafts
    # a request that can use drafts after the step keeps them on
    assert not _first_plan(_config(), last, RequestSpec("b", (7, 8), 5)).skip_drafts
    # V1, or the ngram drafter: never
    assert not _first_plan(_config(runner="v1"), last).skip_drafts
    assert not _first_plan(_config("ngram"), last).skip_drafts


def test_skip_drafts_on_a_partial_prefill_chunk() -> None:
    s = SpecScheduler(_config(max_num_batched_tokens=4))
    s.add(RequestSpec("a", tuple(range(1, 11)), 10))
    plan = s.schedule()
    assert plan.scheduled[0].num_scheduled_tokens == 3  # the budget less the draft slot
    assert plan.skip_drafts and s.rules["v2.drafts_skipped"] == 1


def test_lookahead_slots() -> None:
    prompt = RequestSpec("a", tuple(range(1, 8)), 5)  # 7 tokens: 2 blocks, 3 with 2 lookahead slots
    assert len(_first_plan(_config(runner="v1"), prompt).scheduled[0].block_ids) == 3
    assert len(_first_plan(_config("ngram", runner="v1"), prompt).scheduled[0].block_ids) == 2


def test_a_draft_slot_per_scheduled_request() -> None:
    a, b = RequestSpec("a", tuple(range(1, 7)), 5), RequestSpec("b", tuple(range(11, 17)), 5)
    # input budget 10: a takes 6 + 1, b gets min(4, 3 - 1) = 2
    plan = _first_plan(_config(runner="v1", max_num_batched_tokens=10, max_num_seqs=2), a, b)
    assert [e.num_scheduled_tokens for e in plan.scheduled] == [6, 2]
    plan = _first_plan(_config("ngram", runner="v1", max_num_batched_tokens=10, max_num_seqs=2), a, b)
    assert [e.num_scheduled_tokens for e in plan.scheduled] == [6, 4]
    # a budget left only for the draft slot ends the loop
    c = RequestSpec("c", (21,), 5)
    s = SpecScheduler(_config(runner="v1", max_num_batched_tokens=8, max_num_seqs=3))
    for r in (RequestSpec("a", tuple(range(1, 7)), 5), c):
        s.add(r)
    assert [e.request_id for e in s.schedule().scheduled] == ["a"]
    assert s.rules["waiting.stop_draft_slots"] == 1


def test_a_budget_without_room_for_the_draft_slot_is_refused() -> None:
    """A padded decode of 1 + k tokens must fit min(token_budget,
    input_budget - 1): vLLM accepts max_num_batched_tokens = 1 + k with a
    draft model and then never admits a request cached up to its last token
    (found by the impl check, seed 6)."""
    with pytest.raises(ConfigError) as err:
        _config(max_num_batched_tokens=3, max_num_seqs=2)
    assert err.value.field == "max_num_batched_tokens"
    assert _config("ngram", max_num_batched_tokens=3, max_num_seqs=2).max_num_batched_tokens == 3
    assert _config(max_num_batched_tokens=4, max_num_seqs=2).num_draft_slots == 1
