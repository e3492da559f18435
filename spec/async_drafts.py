"""Speculative decoding and async scheduling: what they add to the base path
(spec/scheduler.py).

Speculative decoding (``num_speculative_tokens`` k > 0, the ngram method):
a running request carries drafts (StepResult.draft_token_ids, set after each
update by ``_update_draft_token_ids``); the RUNNING loop schedules as many as
the step reaches (``_take_drafts``), they count in the token budget and in
``num_tokens_with_spec``, and the update takes the rejected ones back
(``_roll_back_rejected``). A new decode is padded to 1 + k tokens
(decode_padding in spec/rules.py, read by the base path's
``_admission_tokens``); preemption drops the drafts.

Async scheduling (``async_scheduling``, vLLM's AsyncScheduler in
vllm/v1/core/sched/async_scheduler.py): one plan may be in flight when the
next is scheduled. Its output tokens are ``num_output_placeholders`` (already
in ``num_computed_tokens``, added by the base path's ``_make_plan``) until
its update; the drafts are placeholders too (the model runner holds the
real ones). A request preempted with a step in flight gets that step's output
as stale output (``num_stale_output_tokens``, drained by
``_drain_in_flight``) and is not resumed before it has drained (the base
path's ``_pass_over``).

vLLM 0.33: vllm/v1/core/sched/scheduler.py (Scheduler.schedule, the RUNNING
loop's "Speculative decode related"; update_from_output;
update_draft_token_ids, which vllm/v1/engine/core.py's EngineCore.post_step
calls after each step) and vllm/v1/core/sched/async_scheduler.py
(AsyncScheduler._update_after_schedule).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from schedspec.spec.coverage import CountsRules
from schedspec.spec.interface import SchedulerConfig, StepResult
from schedspec.spec.rules import num_scheduled_drafts

if TYPE_CHECKING:
    from schedspec.spec.request_state import RequestState as _Request


class AsyncDraftsMixin(CountsRules):
    """SpecScheduler's drafts and async-scheduling part."""

    # provided by SpecScheduler
    _config: SchedulerConfig
    requests: dict[str, _Request]

    def _take_drafts(self, req: _Request, n: int) -> tuple[int, ...]:
        """The drafts a running request verifies in a step of ``n`` tokens: as
        many of its drafts as the step reaches past its known and in-flight
        tokens (``scheduled_spec_decode_tokens``). Scheduling consumes them
        all (``request.spec_token_ids = []``): the next ones come from
        update_draft_token_ids, or, with async scheduling, as placeholders
        after this schedule (scheduler.py, schedule(), the RUNNING loop,
        "Speculative decode related")."""
        if not req.spec_token_ids:
            return ()
        m = num_scheduled_drafts(
            num_new_tokens=n,
            num_computed=req.num_computed_tokens,
            num_tokens=req.num_tokens,
            num_output_placeholders=req.num_output_placeholders,
            num_drafts=len(req.spec_token_ids),
        )
        self._rules(scheduled_draft_rules(m, len(req.spec_token_ids)))  # pragma: no mutate
        drafts = tuple(req.spec_token_ids[:m])
        req.spec_token_ids = []
        return drafts

    def _drain_in_flight(self, req: _Request, n: int) -> bool:
        """This step's tokens are no longer in flight; if the request was
        preempted after the step was scheduled, they are drained from its
        stale share and the output is stale (update_from_output). Returns
        whether it is."""
        req.num_in_flight_tokens -= n
        if req.num_stale_output_tokens > 0:
            self._rule("async.stale_output")  # pragma: no mutate
            req.num_stale_output_tokens -= n
            assert req.num_stale_output_tokens >= 0
            return True
        return False

    def _roll_back_rejected(self, req: _Request, num_rejected: int, stale: bool) -> None:
        """Rejected drafts were counted as computed (and, with async
        scheduling, as placeholders): take them back (update_from_output,
        ``num_computed_tokens -= num_rejected``). A stale rejection count
        predates the preemption's reset and does not apply."""
        # check_result: 0 <= num_rejected <= the drafts verified
        self._rule("spec.all_accepted" if num_rejected == 0 else "spec.some_rejected")  # pragma: no mutate
        if stale:
            return
        if req.num_computed_tokens > 0:
            req.num_computed_tokens -= num_rejected
        if req.num_output_placeholders > 0:
            req.num_output_placeholders -= num_rejected

    def _update_draft_token_ids(self, result: StepResult) -> None:
        """update_draft_token_ids (sync scheduling only: with async
        scheduling the drafts stay in the model runner and the scheduler holds
        placeholders). Drafts for a finished request are ignored; drafts after
        a partial prefill chunk are dropped; otherwise they replace the
        request's drafts."""
        for rid, drafts in result.draft_token_ids.items():
            req = self.requests.get(rid)
            if req is None:
                self._rule("spec.drafts_for_finished")  # pragma: no mutate
                continue
            if req.is_prefill_chunk:
                self._rule("spec.drafts_after_chunk_dropped", len(drafts) > 0)  # pragma: no mutate
                req.spec_token_ids = []
                continue
            self._rule("spec.drafts_set", len(drafts) > 0)  # pragma: no mutate
            req.spec_token_ids = self._validate_drafts(req, list(drafts))

    def _validate_drafts(self, req: _Request, drafts: list[int]) -> list[int]:
        raise NotImplementedError  # GatesMixin._validate_drafts (structured outputs)


def scheduled_draft_rules(num_scheduled: int, num_drafts: int) -> Iterator[str]:  # pragma: no mutate block
    """The named branches of _take_drafts: ``num_scheduled`` of a running
    request's ``num_drafts`` drafts are verified this step."""
    if num_scheduled > 0:
        yield "spec.drafts_scheduled"
    if 0 < num_scheduled < num_drafts:
        yield "spec.drafts_cut"
    if num_scheduled == 0:
        yield "spec.drafts_unscheduled"
