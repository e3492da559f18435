"""The multimodal encoder: what it adds to the base path (spec/scheduler.py).

A request with encoder inputs (RequestSpec.mm_inputs, e.g. an image's
embeddings at token positions ``offset .. offset + length - 1``) can be
scheduled over those positions only in a step that runs the input through
the encoder, or finds its output in the encoder cache. In the base path this
is one call in each loop: after the RUNNING loop and the WAITING loop have
chosen a chunk, ``_schedule_encoder_inputs`` picks the inputs to run and may
cut the chunk (to nothing: the running request is skipped, the waiting one
passed over); once the request is scheduled, ``_commit_encoder_inputs``
spends the budget and the cache space; after the step has run,
``_free_encoder_inputs`` drops the inputs it is done with; finishing or
preempting a request drops all its references (``_free_encoder_refs``).

vLLM 0.33: vllm/v1/core/sched/scheduler.py (Scheduler._try_schedule_encoder_inputs,
_allocate_encoder_inputs, _free_encoder_inputs; the budget
``max_num_encoder_input_tokens``) and vllm/v1/core/encoder_cache_manager.py
(EncoderCacheManager, the spec's EncoderCache in spec/kv_cache.py, sized by
``encoder_cache_size``). Modelled: chunked multimodal inputs allowed
(disable_chunked_mm_input off), every encoder placeholder an embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from schedspec.spec.coverage import CountsRules
from schedspec.spec.kv_cache import EncoderCache
from schedspec.spec.step_state import StepState

if TYPE_CHECKING:
    from schedspec.spec.interface import SchedulerConfig
    from schedspec.spec.request_state import RequestState as _Request


@dataclass(frozen=True)
class EncoderPlan:
    """What _schedule_encoder_inputs decided for one request's chunk."""

    inputs: list[int]  # the indices of the encoder inputs to run this step
    num_tokens: int  # the chunk, cut before an input that does not fit
    budget_left: int  # the encoder compute budget after those inputs
    duplicates: list[int]  # inputs whose identifier an input run this step shares


class EncoderMixin(CountsRules):
    """SpecScheduler's encoder part (its EncoderCache is ``encoder``)."""

    encoder: EncoderCache
    _config: SchedulerConfig

    def _free_encoder_refs(self, req: _Request) -> None:
        """encoder_cache_manager.free(request): drop every encoder-cache
        reference the request holds."""
        if req.spec.mm_inputs:
            self.encoder.free(req.request_id, [m.identifier for m in req.spec.mm_inputs])

    def _schedule_encoder_inputs(self, req: _Request, num_computed: int, n: int, budget: int) -> EncoderPlan:
        """_try_schedule_encoder_inputs: of the request's encoder inputs that
        overlap this step's tokens ``num_computed .. num_computed + n - 1``
        (get_mm_features_in_window), in order: one whose identifier this step
        already runs for the request is a duplicate; a cached one is reused
        (the request takes a reference); the first that does not fit the
        encoder budget or the cache (can_allocate, which evicts freeable
        entries to make room) stops the scan and cuts the chunk just before
        it, or to nothing when the chunk starts inside it. EAGLE reads one
        token past the chunk, so the window reaches
        num_prefill_lookahead_tokens further (``shift_computed_tokens``)."""
        mm = req.spec.mm_inputs if n > 0 else ()  # no tokens: no input runs
        rid = req.request_id
        to_run: list[int] = []
        duplicates: list[int] = []
        running_now: set[str] = set()
        num_embeds = 0
        end = num_computed + n + self._config.num_prefill_lookahead_tokens
        for i, m in enumerate(mm):
            if m.end <= num_computed or m.offset >= end:
                continue  # outside the window
            if m.identifier in running_now:
                self._rule("encoder.duplicate_input")  # pragma: no mutate
                duplicates.append(i)
                continue
            if self.encoder.check_and_update_cache(rid, i, m.identifier):
                self._rule("encoder.cache_hit")  # pragma: no mutate
                continue
            num_freed = len(self.encoder.freed)
            fits = self.encoder.can_allocate(m.length, budget, num_embeds)
            self._rule("encoder.evicted", len(self.encoder.freed) > num_freed)  # pragma: no mutate
            if not fits:
                if num_computed < m.offset:
                    self._rule("encoder.chunk_cut")  # pragma: no mutate
                    n = min(n, m.offset - num_computed)
                else:
                    self._rule("encoder.blocked_inside")  # pragma: no mutate
                    n = 0
                break
            num_embeds += m.length
            budget -= m.length
            running_now.add(m.identifier)
            to_run.append(i)
        return EncoderPlan(to_run, n, budget, duplicates)

    def _commit_encoder_inputs(self, st: StepState, req: _Request, plan: EncoderPlan) -> None:
        """A scheduled request's encoder inputs run: the budget is spent and
        each takes its cache space (_allocate_encoder_inputs); a duplicate
        takes a reference to the entry its twin allocates."""
        if not plan.inputs:
            return
        self._rule("encoder.scheduled")  # pragma: no mutate
        st.encoder_inputs[req.request_id] = plan.inputs
        st.encoder_budget = plan.budget_left
        mm = req.spec.mm_inputs
        for i in plan.inputs:
            self.encoder.allocate(req.request_id, i, mm[i].identifier, mm[i].length)
        for i in plan.duplicates:
            self.encoder.check_and_update_cache(req.request_id, i, mm[i].identifier)

    def _free_encoder_inputs(self, req: _Request) -> None:
        """update_from_output, _free_encoder_inputs: after a step has run, the
        request drops its reference to every input wholly inside its computed
        tokens past the placeholders (no rejection can roll back into it)."""
        done = req.num_computed_tokens - req.num_output_placeholders
        mm = req.spec.mm_inputs
        for i in self.encoder.cached_input_ids(req.request_id):
            if mm[i].end <= done:
                self._rule("encoder.input_done")  # pragma: no mutate
                self.encoder.free_encoder_input(req.request_id, i, mm[i].identifier)
