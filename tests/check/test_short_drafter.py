"""The check's fake drafter stops short at times under the "prefix" acceptance, as vLLM's
n-gram proposer does when its match runs out: fewer than k drafts, every one right, or an
empty proposal, said as such in the result; "all" and "none" always propose k."""

from __future__ import annotations

from schedspec.check.oracle import FakeModel
from schedspec.spec.interface import ScheduledRequest, ScheduleKind, StepPlan


def _lengths(acceptance: str) -> tuple[set[int], int, int]:
    model = FakeModel(4, 64, 7, num_speculative_tokens=3, acceptance=acceptance)
    lengths: set[int] = set()
    said_empty = short_and_right = 0
    for i in range(60):
        rid = f"r{i}"
        entry = ScheduledRequest.of(rid, ScheduleKind.NEW, num_computed_tokens=0, num_scheduled_tokens=4,
                                    all_token_ids=(1 + i % 5, 2, 3, 4), block_ids=(1,))
        result, _ = model.run(StepPlan(step=1, scheduled=(entry,), preempted_ids=(), finished_ids=()))
        drafts = result.draft_token_ids[rid]
        lengths.add(len(drafts))
        said_empty += drafts == ()
        if 0 < len(drafts) < 3:
            # every draft of a short proposal is the model's own continuation
            ctx = model._ctx(entry, 4) + tuple(result.sampled[rid])
            for d in drafts:
                assert d == model.sample_for(rid, ctx)
                ctx += (d,)
            short_and_right += 1
    return lengths, said_empty, short_and_right


def test_prefix_acceptance_proposes_every_length_from_none_to_k() -> None:
    lengths, said_empty, short = _lengths("prefix")
    assert lengths == {0, 1, 2, 3}
    assert said_empty > 0 and short > 0


def test_all_and_none_propose_k() -> None:
    for acceptance in ("all", "none"):
        assert _lengths(acceptance)[0] == {3}
