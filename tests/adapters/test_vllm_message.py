"""What vLLM hands its model runner beyond the plan (schedspec/adapters/vllm_message.py):
each derived field checked on hand-made outputs, two vLLM subclasses whose messages lie
(their plans and states are right) caught by ``check`` with a replayable counterexample,
and docs/divergences.md's field table held to vLLM 0.33's dataclasses."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from schedspec.adapters.vllm_message import MessageCheck, message_problems
from schedspec.adapters.vllm_load import VllmAdapterError
from schedspec.adapters.vllm_requests import Live
from schedspec.spec.interface import KVLoad, RequestSpec, ScheduledRequest, ScheduleKind, SchedulerConfig, StepPlan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "divergences.md"
CONFIG = SchedulerConfig()
PROMPT = (5, 6, 7, 8)


def _live(rid: str, outputs: tuple[int, ...] = (), structured: bool = False) -> Live:
    spec = RequestSpec(rid, PROMPT, max_tokens=8, structured_output=structured)
    req = SimpleNamespace(all_token_ids=list(PROMPT + outputs), num_output_tokens=len(outputs))
    return Live(spec, req)


def _entry(rid: str, kind: ScheduleKind, live: Live, computed: int, n: int, placeholders: int = 0) -> ScheduledRequest:
    return ScheduledRequest.of(rid, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
                               all_token_ids=live.req.all_token_ids, block_ids=(1,),
                               num_output_placeholders=placeholders)


def _new(**changes: Any) -> Any:
    """vLLM's NewRequestData of ``a``."""
    fields: dict[str, Any] = dict(req_id="a", prompt_token_ids=list(PROMPT), lora_request=None, mm_features=[],
                                  sampling_params=SimpleNamespace(max_tokens=8), prefill_token_ids=None,
                                  replay_start=0)
    fields.update(changes)
    return SimpleNamespace(**fields)


def _out(**changes: Any) -> Any:
    """vLLM's SchedulerOutput for a plan with a new request ``a`` (a 4-token
    prompt) and a running request ``b`` (two outputs, one more in flight)."""
    fields: dict[str, Any] = dict(
        scheduled_new_reqs=[_new()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["b"], new_token_ids=[], all_token_ids={},
                                              num_output_tokens=[3]),
        total_num_scheduled_tokens=5, has_structured_output_requests=False, has_sync_kv_loads=False,
        pending_structured_output_tokens=False, kv_connector_block_state=None, ec_manager_metadata=None,
        num_spec_tokens_to_schedule=0, skip_drafts=False, new_block_ids_to_zero=None,
        kv_cache_block_copies=None, num_common_prefix_blocks=[])
    fields.update(changes)
    return SimpleNamespace(**fields)


def _plan(loads: tuple[KVLoad, ...] = (), structured: bool = False) -> tuple[StepPlan, dict[str, Live]]:
    live = {"a": _live("a"), "b": _live("b", (9, 10), structured)}
    plan = StepPlan(step=2, scheduled=(_entry("a", ScheduleKind.NEW, live["a"], 0, 4),
                                       _entry("b", ScheduleKind.RUNNING, live["b"], 7, 1, placeholders=1)),
                    preempted_ids=(), finished_ids=(), kv_loads=loads)
    return plan, live


def test_a_true_message_has_no_problem() -> None:
    plan, live = _plan()
    assert message_problems(_out(), plan, live, CONFIG, frozenset({"b"})) == []


@pytest.mark.parametrize("change, words", [
    ({"total_num_scheduled_tokens": 4}, "total_num_scheduled_tokens is 4, the plan schedules 5"),
    ({"scheduled_new_reqs": [_new(prompt_token_ids=[5, 6, 7])]}, "prompt_token_ids of 'a' is not its prompt"),
    ({"scheduled_new_reqs": [_new(lora_request=SimpleNamespace(adapter_id=3))]},
     "lora_request of 'a' names adapter 3, the request 0"),
    ({"scheduled_new_reqs": [_new(sampling_params=SimpleNamespace(max_tokens=9))]},
     "sampling_params of 'a' are not the request's"),
    ({"scheduled_new_reqs": [_new(replay_start=2)]}, "carries prefill_token_ids or a replay_start"),
    ({"scheduled_new_reqs": [_new(mm_features=[object()])]}, "mm_features of 'a' has 1 inputs, the request 0"),
    ({"pending_structured_output_tokens": True}, "pending_structured_output_tokens is True, the plan implies False"),
    ({"kv_connector_block_state": object()}, "kv_connector_block_state is"),
    ({"scheduled_cached_reqs": SimpleNamespace(req_ids=["b"], new_token_ids=[[9]], all_token_ids={},
                                               num_output_tokens=[3])}, "new_token_ids is [[9]]"),
    ({"scheduled_cached_reqs": SimpleNamespace(req_ids=["b"], new_token_ids=[], all_token_ids={},
                                               num_output_tokens=[2])},
     "num_output_tokens of 'b' is 2, the plan implies 3"),
    ({"scheduled_cached_reqs": SimpleNamespace(req_ids=["b"], new_token_ids=[],
                                               all_token_ids={"b": list(PROMPT) + [9, 10]},
                                               num_output_tokens=[3])},
     "sends 'b''s history though the previous plan scheduled it"),
    ({"scheduled_cached_reqs": SimpleNamespace(req_ids=["c"], new_token_ids=[], all_token_ids={},
                                               num_output_tokens=[0])}, "names 'c', which the plan does not"),
    ({"has_structured_output_requests": True}, "has_structured_output_requests is True, the plan implies False"),
    ({"has_sync_kv_loads": True}, "has_sync_kv_loads is True, the plan's loads imply False"),
    ({"num_spec_tokens_to_schedule": 2}, "num_spec_tokens_to_schedule is 2, expected 0"),
    ({"new_block_ids_to_zero": [4]}, "new_block_ids_to_zero is [4], expected None"),
    ({"kv_cache_block_copies": [(1, 2)]}, "kv_cache_block_copies is [(1, 2)], expected None"),
    ({"num_common_prefix_blocks": [1]}, "num_common_prefix_blocks is [1], expected []"),
])
def test_each_field_that_disagrees_is_named(change: dict[str, Any], words: str) -> None:
    plan, live = _plan()
    problems = message_problems(_out(**change), plan, live, CONFIG, frozenset({"b"}))
    assert len(problems) == 1 and words in problems[0], problems


def test_a_request_back_after_a_step_off_the_batch_gets_its_whole_history() -> None:
    plan, live = _plan()
    # not in the previous plan: the runner may have dropped it
    problems = message_problems(_out(), plan, live, CONFIG, frozenset())
    assert problems == ["CachedRequestData.all_token_ids leaves out 'b', which the previous plan did not schedule "
                        "(the model runner has no history for it)"]
    wrong = SimpleNamespace(req_ids=["b"], new_token_ids=[], all_token_ids={"b": list(PROMPT) + [9]},
                            num_output_tokens=[3])
    assert message_problems(_out(scheduled_cached_reqs=wrong), plan, live, CONFIG, frozenset()) == [
        "CachedRequestData.all_token_ids of 'b' is not its prompt and output"]
    whole = SimpleNamespace(req_ids=["b"], new_token_ids=[], all_token_ids={"b": list(PROMPT) + [9, 10]},
                            num_output_tokens=[3])
    assert message_problems(_out(scheduled_cached_reqs=whole), plan, live, CONFIG, frozenset()) == []


def test_flags_follow_the_plan() -> None:
    # a structured-output request that samples in this step sets the flag
    plan, live = _plan(structured=True)
    assert message_problems(_out(has_structured_output_requests=True), plan, live, CONFIG, frozenset({"b"})) == []
    # a synchronous external load sets has_sync_kv_loads, an asynchronous one does not
    sync = KVLoad("a", 0, 3, (1,), asynchronous=False)
    plan, live = _plan(loads=(sync,))
    assert message_problems(_out(has_sync_kv_loads=True), plan, live, CONFIG, frozenset({"b"})) == []
    plan, live = _plan(loads=(dataclasses.replace(sync, asynchronous=True),))
    assert message_problems(_out(), plan, live, CONFIG, frozenset({"b"})) == []
    # async scheduling: a structured-output request sampling with a token in flight
    plan, live = _plan(structured=True)
    out = _out(has_structured_output_requests=True, pending_structured_output_tokens=True)
    assert message_problems(out, plan, live, dataclasses.replace(CONFIG, async_scheduling=True),
                            frozenset({"b"})) == []


def test_the_check_remembers_the_previous_plan_and_forgets_it_on_a_reset() -> None:
    plan, live = _plan()
    check = MessageCheck(CONFIG)
    with pytest.raises(VllmAdapterError, match=r"step 2: .*all_token_ids leaves out 'b'"):
        check.check(_out(), plan, live)  # nothing scheduled before
    check.check(_out(), plan, live)  # b was in the previous plan now
    check.reset()  # a reset that preempted every running request
    with pytest.raises(VllmAdapterError, match="leaves out 'b'"):
        check.check(_out(), plan, live)


# ---------------------------------------------------------------- the field table

TABLE_START, TABLE_END = "<!-- worker-fields:start -->", "<!-- worker-fields:end -->"


def _doc_rows() -> dict[str, str]:
    text = DOC.read_text()
    table = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `(\w+)\.(\w+)` \| (\w[\w -]*) \|", line)
        if m:
            rows[f"{m.group(1)}.{m.group(2)}"] = m.group(3)
    return rows


def test_the_doc_lists_every_field_vllm_hands_its_model_runner() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    fields = {f"{cls.__name__}.{f.name}" for cls in (SchedulerOutput, NewRequestData, CachedRequestData)
              for f in dataclasses.fields(cls)}
    rows = _doc_rows()
    assert set(rows) == fields, (sorted(fields - set(rows)), sorted(set(rows) - fields))
    assert set(rows.values()) <= {"plan", "checked", "not modelled"}, set(rows.values())


def test_every_field_the_doc_calls_checked_is_read_by_the_check() -> None:
    source = "".join(p.read_text() for p in sorted((ROOT / "schedspec" / "adapters").glob("vllm_message*.py")))
    for name, how in _doc_rows().items():
        if how == "checked":
            assert re.search(rf"\b{name.split('.')[1]}\b", source), name


# ---------------------------------------------------------------- lying subclasses

@pytest.mark.vllm
@pytest.mark.parametrize("cls, words", [
    ("ForgetsHistory", "all_token_ids leaves out"),
    ("CountsOutputsWrong", "num_output_tokens of"),
])
def test_check_catches_a_subclass_whose_worker_message_lies(cls: str, words: str, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from schedspec.cli.main import main

    against = f"tests.adapters.vllm_subclasses:{cls}"
    rc = main(["check", "--against", against, "--steps", "2000", "--shrink-time", "5", "--quiet",
               "--out", str(tmp_path / "out"), "--json", str(tmp_path / "s.json")])
    assert rc == 1
    failure = json.loads((tmp_path / "s.json").read_text())["failure"]
    assert failure["kind"] == "error" and words in failure["message"], failure
    # the counterexample fails again on replay, and vLLM's own scheduler passes it
    assert main(["replay", failure["trace"], "--against", against]) == 1
    assert main(["replay", failure["trace"], "--against", "vllm"]) == 0
