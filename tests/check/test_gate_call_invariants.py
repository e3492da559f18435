"""The invariants run after the gate calls too: a pause or resume
(set_pause_state) and a grammar report (grammar_ready) are transitions of
their own kinds, so a scheduler whose view goes wrong in one of them is
caught at that event, not at the next step."""

from __future__ import annotations

import dataclasses

from schedspec.check.driver import Runner
from schedspec.check.workload import AddRequest, Event, GrammarReady, Pause, Resume, Step
from schedspec.invariants import BY_ID, Transition, Violation
from schedspec.invariants.core import ALL_KINDS
from schedspec.spec.interface import PauseState, RequestSpec, RequestStatus, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler

CFG = SchedulerConfig(block_size=2, num_blocks=17, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=24)


class RunsOnGrammar(SpecScheduler):
    """Puts a request in the running queue as its grammar is reported (it
    stays in the waiting queue too)."""

    def grammar_ready(self, request_id: str, ok: bool = True) -> None:
        super().grammar_ready(request_id, ok)
        self.running.append(request_id)


class RunsOnPause(SpecScheduler):
    """Puts the head of the waiting queue in the running queue on a pause."""

    def set_pause_state(self, state: PauseState) -> None:
        super().set_pause_state(state)
        if state != PauseState.UNPAUSED and self.waiting:
            self.running.append(self.waiting[0])


def _events() -> list[Event]:
    return [
        AddRequest(RequestSpec("a", (1, 2, 3), max_tokens=2)),
        AddRequest(RequestSpec("g", (4, 5, 6), max_tokens=2, structured_output=True)),
        Step(),
        Pause("new"),
        Resume(),
        GrammarReady("g"),
        Step(),
        Step(),
    ]


def test_the_gate_calls_are_transition_kinds() -> None:
    assert {"pause", "grammar"} <= ALL_KINDS
    assert {"pause", "grammar"} <= BY_ID["queues-match-status"].kinds


def test_a_state_invariant_broken_by_grammar_ready_is_caught_at_that_event() -> None:
    events = _events()
    f = Runner(CFG, {"broken": RunsOnGrammar}).run(events)
    assert f is not None and f.kind == "violation"
    assert f.event_index == events.index(GrammarReady("g"))
    assert f.message.endswith("after grammar")
    assert "queues-match-status" in {v.invariant_id for v in f.violations}


def test_a_state_invariant_broken_by_a_pause_is_caught_at_that_event() -> None:
    events: list[Event] = [AddRequest(RequestSpec("a", (1, 2, 3), max_tokens=2)), Pause("all"), Step()]
    f = Runner(CFG, {"broken": RunsOnPause}).run(events)
    assert f is not None and f.kind == "violation" and f.event_index == 1
    assert f.message.endswith("after pause")
    assert "queues-match-status" in {v.invariant_id for v in f.violations}


def test_the_spec_holds_every_invariant_across_the_gate_calls() -> None:
    seen: list[str] = []
    runner = Runner(CFG, {"spec": SpecScheduler})
    observe = runner.monitors["spec"].observe

    def record(t: Transition) -> list[Violation]:
        seen.append(t.kind)
        return observe(t)

    runner.monitors["spec"].observe = record  # type: ignore[method-assign]
    assert runner.run(_events()) is None
    assert seen.count("pause") == 2 and seen.count("grammar") == 1


def test_a_status_change_in_a_gate_call_is_a_violation() -> None:
    # the spec's views around a grammar report, with the request already
    # running afterwards: grammar_ready changes no status
    runner = Runner(CFG, {"spec": SpecScheduler})
    assert runner.run(_events()[:2]) is None
    before = runner.views["spec"]
    runner.primary.grammar_ready("g")  # type: ignore[attr-defined]
    after = runner.primary.view()
    t = Transition("grammar", before, after, request_id="g")
    assert BY_ID["status-change-by-operation"].check(t) == []
    moved = dataclasses.replace(after.requests["g"], status=RequestStatus.WAITING)
    bad = dataclasses.replace(t, after=dataclasses.replace(after, requests={**after.requests, "g": moved}))
    assert [v.message for v in BY_ID["status-change-by-operation"].check(bad)] == [
        "grammar_ready(g) changed g: WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR -> WAITING"
    ]
