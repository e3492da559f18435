"""The encoder fields of what vLLM hands its model runner
(schedspec/adapters/vllm_message_encoder.py): scheduled_encoder_input_stats and
encoder_input_updates held to the plan's encoder inputs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from schedspec.adapters.vllm_message_encoder import encoder_problems
from schedspec.adapters.vllm_requests import Live
from schedspec.spec.interface import MMInput, RequestSpec, ScheduledRequest, ScheduleKind, StepPlan

PROMPT = tuple(range(1, 13))


def _plan() -> tuple[StepPlan, dict[str, Live]]:
    """``a`` with two images (3 and 4 embeddings), both encoded in this step; ``b`` with none."""
    mm = (MMInput(0, 3, "h0"), MMInput(4, 4, "h1"))
    live = {"a": Live(RequestSpec("a", PROMPT, max_tokens=4, mm_inputs=mm), SimpleNamespace()),
            "b": Live(RequestSpec("b", PROMPT, max_tokens=4), SimpleNamespace())}
    entries = (ScheduledRequest.of("a", ScheduleKind.NEW, num_computed_tokens=0, num_scheduled_tokens=12,
                                   all_token_ids=PROMPT, block_ids=(1, 2, 3), encoder_inputs=(0, 1)),
               ScheduledRequest.of("b", ScheduleKind.NEW, num_computed_tokens=0, num_scheduled_tokens=4,
                                   all_token_ids=PROMPT, block_ids=(4,)))
    return StepPlan(step=1, scheduled=entries, preempted_ids=(), finished_ids=()), live


def _out(**fields: Any) -> Any:
    return SimpleNamespace(**{"scheduled_encoder_input_stats": None, "encoder_input_updates": {}, **fields})


def test_what_vllm_sends_by_default_and_the_true_counts_hold() -> None:
    plan, live = _plan()
    assert encoder_problems(_out(), plan, live) == []
    stats = SimpleNamespace(num_inputs=2, output_tokens=7)
    assert encoder_problems(_out(scheduled_encoder_input_stats=stats), plan, live) == []
    assert encoder_problems(_out(encoder_input_updates={"a": {0: None, 1: None}}), plan, live) == []
    assert encoder_problems(SimpleNamespace(), plan, live) == []  # an older vLLM without the fields


@pytest.mark.parametrize("fields, words", [
    ({"scheduled_encoder_input_stats": SimpleNamespace(num_inputs=1, output_tokens=3)},
     "counts 1 inputs and 3 embeddings, the plan's encoder inputs 2 and 7"),
    ({"scheduled_encoder_input_stats": SimpleNamespace(num_inputs=2, output_tokens=8)}, "2 and 7"),
    ({"encoder_input_updates": {"c": {0: None}}}, "names 'c', which the plan does not schedule"),
    ({"encoder_input_updates": {"b": {0: None}}}, "of 'b' names inputs [0], the request has 0"),
])
def test_each_wrong_field_is_named(fields: dict[str, Any], words: str) -> None:
    plan, live = _plan()
    problems = encoder_problems(_out(**fields), plan, live)
    assert len(problems) == 1 and words in problems[0], problems
