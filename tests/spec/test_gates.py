"""Scenario tests of the admission gates in the spec scheduler: each pins one
vLLM 0.33 rule with exact plans (the block size is 4, the pool 8 usable
blocks, the budget 64 tokens unless a test says otherwise)."""

from __future__ import annotations

import pytest

from schedspec.spec import (
    ProtocolError,
    RequestStatus,
    SpecScheduler,
    StepResult,
)
from schedspec.spec.interface import MMInput, PauseState
from schedspec.spec.request_state import GrammarState

from tests.helpers import cfg, entries, req, step

GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


def toks(start: int, n: int) -> list[int]:
    """A prompt sharing no block with ``range(n)``."""
    return list(range(start, start + n))


# ---------------------------------------------------------------- watermark


def test_watermark_holds_back_an_admission_that_fits_the_free_pool() -> None:
    # kv_cache_manager.py, allocate_slots: required = blocks + watermark_blocks,
    # watermark_blocks = int(0.25 * 9) = 2, applied once a request is running.
    s = SpecScheduler(cfg(watermark=0.25))
    s.add(req("a", 8))
    s.add(req("b", toks(100, 16)))
    s.add(req("c", toks(200, 4)))
    plan = s.schedule()
    # a: nothing running, no watermark; b: 4 + 2 <= 6 free; c: 1 + 2 > 2 free
    assert entries(plan) == [("a", "new", 0, 8), ("b", "new", 0, 16)]
    assert s.view().waiting == ("c",) and s.view().kv.num_free_blocks == 2
    assert s.rules["watermark.blocked_full_sequence"] == 1


def test_without_watermark_the_same_admission_goes_through() -> None:
    s = SpecScheduler(cfg())
    for r in (req("a", 8), req("b", toks(100, 16)), req("c", toks(200, 4))):
        s.add(r)
    assert [e[0] for e in entries(s.schedule())] == ["a", "b", "c"]


def test_watermark_does_not_apply_with_nothing_running() -> None:
    # watermark_blocks = int(0.5 * 9) = 4, but has_scheduled_reqs is False
    s = SpecScheduler(cfg(watermark=0.5))
    s.add(req("a", 28))
    assert entries(s.schedule()) == [("a", "new", 0, 28)]
    assert s.view().kv.num_free_blocks == 1


def test_running_requests_allocate_into_the_watermark() -> None:
    s = SpecScheduler(cfg(watermark=0.25))
    s.add(req("a", 24, max_tokens=8))
    step(s)  # 6 blocks, 2 free
    plan = step(s)  # the decode at position 24 needs a seventh block
    assert entries(plan) == [("a", "running", 24, 1)]
    assert s.view().kv.num_free_blocks == 1  # below the 2-block watermark


# ---------------------------------------------------------------- prefill cadence


def test_cadence_holds_admissions_until_the_interval_has_passed() -> None:
    # schedule(), local prefill cadence: held while
    # (num_executed_steps + 1) - last_prefill_step < interval and a request decodes
    s = SpecScheduler(cfg(prefill_schedule_interval=3))
    v = s.view()
    assert (v.num_executed_steps, v.last_prefill_step) == (0, -3)
    s.add(req("a", 4, max_tokens=10))
    assert entries(step(s)) == [("a", "new", 0, 4)]  # nothing decodes yet: not held
    s.add(req("b", 4))
    assert entries(step(s)) == [("a", "running", 4, 1)]  # (1 + 1) - 1 < 3: held
    v = s.view()
    assert (v.num_executed_steps, v.last_prefill_step, v.prefill_capacity_bound) == (2, 1, False)
    assert entries(step(s)) == [("a", "running", 5, 1)]  # (2 + 1) - 1 < 3: held
    assert entries(step(s)) == [("a", "running", 6, 1), ("b", "new", 0, 4)]  # released
    assert (s.view().num_executed_steps, s.view().last_prefill_step) == (4, 4)
    assert s.rules["cadence.admission_held"] == 2


def test_cadence_holds_a_running_prefill_chunk() -> None:
    s = SpecScheduler(cfg(prefill_schedule_interval=3, max_num_batched_tokens=8, max_num_seqs=2))
    s.add(req("a", 4, max_tokens=10))
    s.add(req("b", toks(100, 20)))
    assert entries(step(s)) == [("a", "new", 0, 4), ("b", "new", 0, 4)]
    # b is a prefill chunk; a decodes: the chunk waits for a cadence-aligned step
    assert entries(step(s)) == [("a", "running", 4, 1)]
    assert s.rules["cadence.running_chunk_held"] == 1


def test_cadence_escape_when_a_release_leaves_the_queue_backed_up() -> None:
    s = SpecScheduler(cfg(prefill_schedule_interval=3, max_num_seqs=2))
    s.add(req("a", 4, max_tokens=10))
    step(s)
    s.add(req("b", 4, max_tokens=10))
    s.add(req("c", 4))
    step(s)
    step(s)
    plan = step(s)  # released: b admitted, c stopped by max_num_seqs
    assert entries(plan) == [("a", "running", 6, 1), ("b", "new", 0, 4)]
    assert s.view().prefill_capacity_bound is True
    # the next step is not held although the interval has not passed
    assert s.rules["cadence.hold"] == 2
    step(s)
    assert s.rules["cadence.hold"] == 2


def test_cadence_counters_are_not_shown_with_interval_one() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 4))
    step(s)
    v = s.view()
    assert (v.num_executed_steps, v.last_prefill_step, v.prefill_capacity_bound) == (0, -1, False)


# ---------------------------------------------------------------- pause


def test_paused_new_runs_the_running_and_admits_nothing() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 4, max_tokens=10))
    step(s)
    s.add(req("b", 4))
    s.set_pause_state(PauseState.PAUSED_NEW)
    assert s.view().pause_state is PauseState.PAUSED_NEW
    assert entries(step(s)) == [("a", "running", 4, 1)]
    s.set_pause_state(PauseState.UNPAUSED)
    assert entries(step(s)) == [("a", "running", 5, 1), ("b", "new", 0, 4)]


def test_paused_all_schedules_nothing_but_reports_the_finished() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 4, max_tokens=10))
    s.add(req("x", 4))
    step(s)
    s.abort("x")
    s.set_pause_state(PauseState.PAUSED_ALL)
    plan = s.schedule()
    assert plan.scheduled == () and plan.finished_ids == ("x",)
    s.update(plan, StepResult())
    s.set_pause_state(PauseState.UNPAUSED)
    assert entries(step(s)) == [("a", "running", 4, 1)]


def test_pause_state_must_be_a_pause_state() -> None:
    s = SpecScheduler(cfg())
    with pytest.raises(ProtocolError) as exc:
        s.set_pause_state(2)  # type: ignore[arg-type]
    assert str(exc.value) == "pause state must be a PauseState, got 2"
    assert exc.value.field == "pause_state"
    assert s.view().pause_state is PauseState.UNPAUSED


# ---------------------------------------------------------------- LoRA


def test_max_loras_passes_over_a_new_adapter_without_blocking_the_queue() -> None:
    # schedule(), WAITING loop: len(scheduled_loras) == max_loras and the
    # adapter is not among them: skip_request (the request keeps its place)
    s = SpecScheduler(cfg(max_loras=1))
    s.add(req("a", 4, max_tokens=1, lora_id=1))
    s.add(req("b", 4, lora_id=2))
    s.add(req("c", 4, max_tokens=1, lora_id=1))
    s.add(req("d", 4))
    plan = step(s)
    assert entries(plan) == [("a", "new", 0, 4), ("c", "new", 0, 4), ("d", "new", 0, 4)]
    assert s.view().waiting == ("b",)
    # a and c finished: no adapter runs, b is admitted
    assert entries(step(s)) == [("d", "running", 4, 1), ("b", "new", 0, 4)]


def test_adapters_never_share_prefix_blocks() -> None:
    # kv_cache_utils.py: the LoRA name is an extra key of every block hash
    s = SpecScheduler(cfg(max_loras=2))
    s.add(req("a", 8, max_tokens=1, lora_id=1))
    step(s)
    s.add(req("b", list(range(8)) + [99], max_tokens=1, lora_id=2))
    assert entries(step(s)) == [("b", "new", 0, 9)]
    s.add(req("c", list(range(8)) + [99], max_tokens=1, lora_id=1))
    assert entries(step(s)) == [("c", "new", 8, 1)]
    s.add(req("d", list(range(8)) + [98], max_tokens=1))
    assert entries(step(s)) == [("d", "new", 0, 9)]  # the base model shares with nobody


def test_a_lora_request_without_lora_is_refused_and_changes_nothing() -> None:
    s = SpecScheduler(cfg())
    with pytest.raises(ProtocolError) as exc:
        s.add(req("a", 4, lora_id=1))
    assert exc.value.field == "lora_id"
    assert s.view().requests == {}


# ---------------------------------------------------------------- structured outputs


def test_a_request_waiting_for_its_grammar_is_passed_over() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 4, structured_output=True))
    s.add(req("b", 4))
    assert s.view().requests["a"].status is GRAMMAR
    assert entries(step(s)) == [("b", "new", 0, 4)]
    assert s.view().waiting == ("a",)
    s.grammar_ready("a")
    assert s.view().requests["a"].status is GRAMMAR  # until the WAITING loop looks
    assert entries(step(s)) == [("b", "running", 4, 1), ("a", "new", 0, 4)]
    assert s.view().requests["a"].status is RequestStatus.RUNNING


def test_a_failed_grammar_finishes_the_request_at_the_next_update() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 4, structured_output=True))
    s.grammar_ready("a", ok=False)
    plan = s.schedule()
    assert plan.scheduled == ()
    assert s.view().requests["a"].status is GRAMMAR  # recorded, not yet finished
    s.update(plan, StepResult())
    assert s.view().finished["a"].status is RequestStatus.FINISHED_ERROR
    assert s.schedule().finished_ids == ("a",)


def test_grammar_ready_refuses_bad_calls_and_changes_nothing() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 4, structured_output=True))
    s.add(req("b", 4))
    for rid in ("zz", "b", ["a"]):  # a list is no id (and unhashable): the same error, not a TypeError
        with pytest.raises(ProtocolError) as exc:
            s.grammar_ready(rid)  # type: ignore[arg-type]
        assert exc.value.field == "request_id"
    s.grammar_ready("a")
    with pytest.raises(ProtocolError, match="already reported"):
        s.grammar_ready("a", ok=False)
    step(s)
    with pytest.raises(ProtocolError, match="does not wait"):
        s.grammar_ready("a")


def test_aborting_a_request_waiting_for_its_grammar() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 4, structured_output=True))
    s.abort("a")
    assert s.view().finished["a"].status is RequestStatus.FINISHED_ABORTED
    assert s.view().waiting == ()


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses() -> None:
    # update_draft_token_ids -> StructuredOutputManager.validate_tokens (sync)
    s = SpecScheduler(cfg(num_speculative_tokens=3))
    s.add(req("a", 4, max_tokens=10, structured_output=True, grammar_rejects=(5,)))
    s.add(req("b", 4, max_tokens=10))
    s.grammar_ready("a")
    plan = s.schedule()
    s.update(plan, StepResult({"a": (7,), "b": (7,)}, {"a": (3, 5, 6), "b": (3, 5, 6)}))
    plan = s.schedule()
    a, b = plan.get("a"), plan.get("b")
    assert a is not None and b is not None
    assert a.spec_token_ids == (3,) and a.num_scheduled_tokens == 2
    assert b.spec_token_ids == (3, 5, 6) and b.num_scheduled_tokens == 4
    assert a.num_invalid_spec_tokens == 0  # vLLM counts them only on the async path


def test_a_sampled_token_the_grammar_refuses_is_an_error() -> None:
    s = SpecScheduler(cfg())
    s.add(req("a", 4, max_tokens=10, structured_output=True, grammar_rejects=(5,)))
    s.grammar_ready("a")
    plan = s.schedule()
    s.update(plan, StepResult({"a": (5,)}))
    assert s.view().finished["a"].status is RequestStatus.FINISHED_ERROR


# ---------------------------------------------------------------- encoder


ENC = {"max_num_encoder_input_tokens": 8, "encoder_cache_size": 8}


def enc_cfg(**kw: object) -> object:
    return cfg(**{**ENC, **kw})


def test_an_encoder_input_runs_once_and_is_then_reused_from_the_cache() -> None:
    s = SpecScheduler(enc_cfg())  # type: ignore[arg-type]
    s.add(req("a", 16, max_tokens=1, mm_inputs=(MMInput(4, 4, "x"),)))
    plan = step(s)
    assert plan.scheduled[0].encoder_inputs == (0,)
    assert dict(s.view().encoder_cache) == {"x": 4} and s.view().encoder_cache_free == 4
    s.add(req("b", 8, max_tokens=1, mm_inputs=(MMInput(0, 4, "x"),)))
    plan = step(s)
    assert entries(plan) == [("b", "new", 0, 8)] and plan.scheduled[0].encoder_inputs == ()
    assert s.rules["encoder.cache_hit"] == 1


def test_an_input_beyond_the_budget_cuts_the_chunk_and_evicts_later() -> None:
    s = SpecScheduler(enc_cfg())  # type: ignore[arg-type]
    s.add(req("a", 16, max_tokens=1, mm_inputs=(MMInput(2, 4, "x"), MMInput(8, 6, "y"))))
    plan = step(s)
    # x (4) runs; y (6) exceeds the 4 embeddings left: the chunk stops before it
    assert entries(plan) == [("a", "new", 0, 8)] and plan.scheduled[0].encoder_inputs == (0,)
    # after the step x lies inside the computed tokens: unreferenced, still cached
    assert dict(s.view().encoder_cache) == {"x": 4} and s.view().encoder_cache_free == 4
    plan = step(s)
    # y needs 6 slots: x, the oldest freeable entry, is evicted and reported
    assert entries(plan) == [("a", "running", 8, 8)] and plan.scheduled[0].encoder_inputs == (1,)
    assert plan.freed_encoder_inputs == ("x",)
    assert dict(s.view().encoder_cache) == {"y": 6} and s.view().encoder_cache_free == 2


def test_a_waiting_request_left_no_token_is_passed_over() -> None:
    s = SpecScheduler(enc_cfg())  # type: ignore[arg-type]
    s.add(req("a", 8, mm_inputs=(MMInput(0, 6, "x"),)))
    s.add(req("b", 8, mm_inputs=(MMInput(0, 6, "y"),)))
    s.add(req("c", 4))
    plan = s.schedule()
    # b's input starts at its first token and 6 > the 2 embeddings left: skip, not stop
    assert entries(plan) == [("a", "new", 0, 8), ("c", "new", 0, 4)]
    assert s.view().waiting == ("b",)
    assert s.rules["encoder.blocked_inside"] == 1


def test_a_repeated_input_in_one_request_runs_once() -> None:
    s = SpecScheduler(enc_cfg())  # type: ignore[arg-type]
    s.add(req("a", 8, mm_inputs=(MMInput(0, 2, "x"), MMInput(4, 2, "x"))))
    plan = s.schedule()
    assert plan.scheduled[0].encoder_inputs == (0,)
    assert dict(s.view().encoder_cache) == {"x": 2}


def test_mm_inputs_need_an_encoder_and_consistent_lengths() -> None:
    s = SpecScheduler(cfg())
    with pytest.raises(ProtocolError):
        s.add(req("a", 8, mm_inputs=(MMInput(0, 2, "x"),)))
    e = SpecScheduler(enc_cfg())  # type: ignore[arg-type]
    e.add(req("a", 8, mm_inputs=(MMInput(0, 2, "x"),)))
    with pytest.raises(ProtocolError) as exc:
        e.add(req("b", 8, mm_inputs=(MMInput(0, 3, "x"),)))
    assert exc.value.field == "mm_inputs[0].length"
    assert set(e.view().requests) == {"a"}


def test_encoder_inputs_enter_block_keys() -> None:
    s = SpecScheduler(enc_cfg())  # type: ignore[arg-type]
    s.add(req("a", 9, max_tokens=1, mm_inputs=(MMInput(0, 2, "x"),)))
    step(s)
    s.add(req("b", 9, max_tokens=1, mm_inputs=(MMInput(0, 2, "y"),)))
    assert entries(step(s)) == [("b", "new", 0, 9)]  # another image: no hit
    s.add(req("c", 9, max_tokens=1, mm_inputs=(MMInput(0, 2, "x"),)))
    assert entries(step(s)) == [("c", "new", 8, 1)]  # the same image: both blocks hit


def test_a_clone_copies_the_gate_state() -> None:
    # the model checker expands every transition on a clone
    s = SpecScheduler(enc_cfg(prefill_schedule_interval=2, max_loras=1))  # type: ignore[arg-type]
    s.add(req("a", 16, max_tokens=4, mm_inputs=(MMInput(2, 4, "x"), MMInput(8, 6, "y")), lora_id=1))
    s.add(req("g", toks(100, 4), structured_output=True))
    step(s)
    c = s.clone()
    before = s.view()
    c.grammar_ready("g", ok=False)
    c.set_pause_state(PauseState.PAUSED_NEW)
    step(c)
    step(c)
    assert s.view() == before
    assert c.view() != before
    assert s.requests["g"].grammar is GrammarState.COMPILING and not s.grammar_errors


def test_a_running_request_at_an_input_that_does_not_fit_is_skipped() -> None:
    s = SpecScheduler(enc_cfg(long_prefill_token_threshold=8))  # type: ignore[arg-type]
    s.add(req("a", 16, mm_inputs=(MMInput(8, 6, "y"),)))
    s.add(req("b", toks(100, 16), mm_inputs=(MMInput(4, 8, "z"),)))
    plan = step(s)
    assert entries(plan) == [("a", "new", 0, 8), ("b", "new", 0, 8)]
    assert [e.encoder_inputs for e in plan.scheduled] == [(), (0,)]  # z takes the whole budget
    plan = step(s)
    # a's chunk starts at y, and the cache is full of z, which b is still inside
    assert entries(plan) == [("b", "running", 8, 8)]
    assert s.rules["encoder.running_no_token"] == 1
