"""The admission gates: what each adds to the base path (spec/scheduler.py).

Each gate is off by default (SchedulerConfig, RequestSpec) and, when off,
leaves the base path's decisions as they are. Where each enters it:

- the pause state (``set_pause_state``; vLLM's Scheduler.set_pause_state):
  PAUSED_ALL gives schedule() a zero token budget ("Do not schedule any
  requests when paused."), PAUSED_NEW admits from the waiting queue only the
  requests holding KV blocks for a connector's load (_schedule_waiting);
- the prefill cadence (``prefill_schedule_interval``; schedule(), "Local
  prefill cadence"): ``_defer_prefills`` decides at the start of schedule()
  whether prefill is held this step (the RUNNING loop skips prefill chunks,
  the WAITING loop stops at an admission with prompt left),
  ``_advance_cadence`` restarts the interval at the end;
- the watermark (``watermark_blocks``; kv_cache_manager.py,
  KVCacheManager.allocate_slots): an admission leaves that many blocks free
  while a request runs (_allocate_admission);
- LoRA (``max_loras``): a waiting request whose adapter would exceed
  max_loras distinct adapters is passed over (_pass_over); the adapter is
  part of its blocks' prefix-cache keys (RequestState.block_key);
- structured outputs (RequestSpec.structured_output): a request waits for its
  grammar (``grammar_ready``) and is passed over until it compiles
  (_pass_over); a failed compile finishes it with FINISHED_ERROR at the next
  update (_finish_errors); a sampled token its grammar refuses ends it the
  same way (_take_output); its drafts are cut at the first token the grammar
  refuses (``_validate_drafts``);
- the multimodal encoder: spec/encoder.py.

vLLM 0.33: vllm/v1/core/sched/scheduler.py (Scheduler) unless said
otherwise; structured outputs in vllm/v1/structured_output/__init__.py
(StructuredOutputManager).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schedspec.spec.coverage import CountsRules
from schedspec.spec.interface import PauseState, SchedulerConfig
from schedspec.spec.protocol import check_grammar_ready, check_pause_state
from schedspec.spec.request_state import GrammarState
from schedspec.spec.step_state import StepState

if TYPE_CHECKING:
    from schedspec.spec.request_state import RequestState as _Request


class GatesMixin(CountsRules):
    """SpecScheduler's admission gates: their state is SpecScheduler's
    (vLLM's Scheduler fields of the same names)."""

    # provided by SpecScheduler
    _config: SchedulerConfig
    requests: dict[str, _Request]
    running: list[str]
    pause_state: PauseState
    num_executed_steps: int
    last_prefill_step: int
    prefill_capacity_bound: bool

    def set_pause_state(self, state: PauseState) -> None:
        """set_pause_state: PAUSED_NEW stops admissions from the waiting queue
        (only requests holding KV blocks for a KV connector's load, in
        kv_holding_waiting, may be admitted), PAUSED_ALL schedules nothing;
        UNPAUSED resumes."""
        self.pause_state = check_pause_state(state)

    def grammar_ready(self, request_id: str, ok: bool = True) -> None:
        """The structured-output manager finished compiling the request's
        grammar (vllm/v1/structured_output/__init__.py, StructuredOutputManager
        grammar_init: ``structured_output_request.grammar`` is set, or an
        Exception for a failed compile). The request stays waiting for its
        grammar until the WAITING loop looks at it
        (_handle_blocked_waiting_request)."""
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        check_grammar_ready(
            request_id, ok, None if req is None else req.status,
            reported=req is not None and req.grammar is not GrammarState.COMPILING,
        )
        assert req is not None
        req.grammar = GrammarState.READY if ok else GrammarState.FAILED

    def _defer_prefills(self) -> bool:
        """The local prefill cadence (schedule(), "Local prefill cadence"):
        with prefill_schedule_interval > 1, hold prefill in this step when
        fewer than the interval executed steps have passed since the last
        prefill-carrying step (counting this one), some running request is
        decoding, and the last release did not leave the waiting queue
        backed up (prefill_capacity_bound)."""
        interval = self._config.prefill_schedule_interval
        hold = (
            interval > 1
            and not self.prefill_capacity_bound
            and (self.num_executed_steps + 1) - self.last_prefill_step < interval
            and any(not self.requests[r].is_prefill_chunk for r in self.running)
        )
        self._rule("cadence.hold", hold)  # pragma: no mutate
        return hold

    def _advance_cadence(self, st: StepState) -> None:
        """The end of schedule(): a step that scheduled tokens counts as
        executed; one that carried prefill (a running chunk or an admission
        with prompt left) restarts the cadence interval."""
        if st.scheduled:
            self.num_executed_steps += 1
        if self._config.prefill_schedule_interval > 1 and (st.prefill_scheduled or st.prefill_admitted):
            self._rule("cadence.restart")  # pragma: no mutate
            self.last_prefill_step = self.num_executed_steps

    def _validate_drafts(self, req: _Request, drafts: list[int]) -> list[int]:
        """StructuredOutputManager.validate_tokens
        (vllm/v1/structured_output/__init__.py): for a request with a grammar,
        the longest prefix of the drafts its grammar accepts; the modelled
        grammar refuses the tokens of ``grammar_rejects`` wherever they come."""
        if not req.spec.structured_output:
            return drafts
        for i, tok in enumerate(drafts):
            if tok in req.spec.grammar_rejects:
                self._rule("grammar.drafts_cut")  # pragma: no mutate
                return drafts[:i]
        return drafts

    def _cadence_view(self) -> dict[str, Any]:
        """The prefill cadence's counters, when the cadence is on."""
        if self._config.prefill_schedule_interval == 1:
            return {}
        return {
            "num_executed_steps": self.num_executed_steps,
            "last_prefill_step": self.last_prefill_step,
            "prefill_capacity_bound": self.prefill_capacity_bound,
        }
