"""The admission gates in the checking engine: the gate events and the
generator, capabilities, the driver's calls (pause, resume, a pause's cache
clear, grammar readiness), the fake model under a grammar, trace format 3,
the shrinker and the report."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any, Callable

import pytest

from schedspec.check import report
from schedspec.check import trace as tracefile
from schedspec.check.capabilities import FULL, Capabilities
from schedspec.check.coverage_guided import guided_workload
from schedspec.check.driver import Runner
from schedspec.check.records import Failure
from schedspec.check.oracle import FakeModel
from schedspec.check.shrink import _consistent, shrink
from schedspec.check.trace import TraceError
from schedspec.check.features import GATES, MODES, gates_of, parse_gates
from schedspec.check.gate_requests import gate_rng, with_gates
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import (
    Abort,
    AddRequest,
    Event,
    GrammarReady,
    Pause,
    ResetPrefixCache,
    Resume,
    Step,
    Workload,
    describe_event,
)
from schedspec.spec.interface import (
    MMInput,
    PauseState,
    RequestSpec,
    RequestStatus,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from schedspec.spec.scheduler import SpecScheduler

CFG = SchedulerConfig(block_size=2, num_blocks=17, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=24)
ALL = Capabilities(async_scheduling=True, speculative_decoding=True).with_gates()


def _first_workload(want: Callable[[Workload], bool]) -> Workload:
    """The first gated random workload (seeds 0, 1, ...) with ``want``."""
    for seed in range(100):
        w = random_workload(seed, 60, gates=GATES)
        if want(w):
            return w
    raise AssertionError("no seed gave such a workload")


def _req(rid: str, n: int = 3, max_tokens: int = 4, **kw: Any) -> RequestSpec:
    return RequestSpec(request_id=rid, prompt_token_ids=tuple(range(1, n + 1)), max_tokens=max_tokens, **kw)


# ---------------------------------------------------------------------------
# gates, events, generator
# ---------------------------------------------------------------------------


def test_parse_gates_names_all_none_and_refuses_unknown_ones() -> None:
    assert parse_gates("pause, lora") == ("lora", "pause")
    assert parse_gates("all") == GATES
    assert parse_gates("none") == ()
    with pytest.raises(ValueError, match="unknown gate 'lorax'"):
        parse_gates("lora,lorax")
    with pytest.raises(ValueError, match="all and none stand alone"):
        parse_gates("lora,all")
    with pytest.raises(ValueError, match="no gate given"):
        parse_gates(" , ")


def test_gate_events_read_as_a_script() -> None:
    assert describe_event(Pause("all", True)) == "pause(mode='all', clear_cache=True)"
    assert describe_event(Resume()) == "resume()"
    assert describe_event(GrammarReady("r2")) == "grammar_ready('r2')"
    assert describe_event(GrammarReady("r2", ok=False)) == "grammar_ready('r2', ok=False)"


def test_gated_workloads_use_every_gate_and_keep_the_event_rules() -> None:
    used: Counter[str] = Counter()
    for seed in range(40):
        w = random_workload(seed, 60, modes=MODES, gates=GATES)
        assert set(gates_of(w.config, w.events)) <= {f.split(":")[1] for f in w.features}
        used.update(gates_of(w.config, w.events))
        # grammar_ready only for a structured request added before it, not aborted, once
        added: dict[str, RequestSpec] = {}
        gone: set[str] = set()
        paused = False
        for e in w.events:
            if isinstance(e, AddRequest):
                added[e.request.request_id] = e.request
            elif isinstance(e, Abort):
                gone.add(e.request_id)
            elif isinstance(e, GrammarReady):
                assert e.request_id in added and added[e.request_id].structured_output
                assert e.request_id not in gone
                gone.add(e.request_id)  # never twice
            elif isinstance(e, Pause):
                assert not paused
                paused = True
            elif isinstance(e, Resume):
                assert paused
                paused = False
        assert not paused  # a workload ends unpaused
        # the trace loader takes every generated workload
        assert tracefile.loads(tracefile.dumps(tracefile.Trace(w))).workload.events == w.events
    assert set(used) == set(GATES)


def test_a_gate_free_workload_is_what_its_seed_always_drew() -> None:
    for seed in range(5):
        plain = random_workload(seed, 40, modes=MODES)
        assert random_workload(seed, 40, modes=MODES, gates=()) == plain
        assert not plain.features and not gates_of(plain.config, plain.events)
        assert guided_workload(seed, 30, modes=MODES) == guided_workload(seed, 30, modes=MODES, gates=())


def test_the_watermark_grows_the_pool_by_the_blocks_it_keeps() -> None:
    for seed in range(30):
        cfg = with_gates(CFG, ("watermark",), gate_rng(seed))
        assert cfg.watermark > 0
        assert cfg.num_blocks - cfg.watermark_blocks >= CFG.num_blocks
    enc = with_gates(CFG, ("encoder", "lora", "cadence"), gate_rng(1))
    assert enc.max_num_encoder_input_tokens > 0 and enc.encoder_cache_size >= enc.max_num_encoder_input_tokens
    assert enc.max_loras >= 1 and enc.prefill_schedule_interval >= 2


def test_a_guided_focus_rule_of_a_gate_turns_the_gate_on() -> None:
    from schedspec.spec.rule_names import RULES

    from schedspec.check.features import GATE_CAPABILITIES

    gated = [r for r in RULES.values() if r.gates and set(r.gates) <= set(GATE_CAPABILITIES.values())]
    assert gated, "the catalogue has rules of the admission gates"
    rule = gated[0]
    for seed in range(5):
        w = guided_workload(seed, 10, focus=(rule.name,), gates=GATES)
        caps = Capabilities().with_gates(gates_of(w.config, w.events) + tuple(
            f.split(":")[1] for f in w.features if f.startswith("gate:")))
        assert set(rule.gates) <= caps.names()


# ---------------------------------------------------------------------------
# capabilities
# ---------------------------------------------------------------------------


def test_gates_are_opt_in_and_restricted_out() -> None:
    w = _first_workload(lambda w: len(gates_of(w.config, w.events)) >= 3)
    assert FULL.gates() == () and ALL.gates() == GATES
    assert "lora" in ALL.names() and "lora" not in FULL.names()
    problems = FULL.workload_problems(w)
    assert problems
    stripped = FULL.restrict_workload(w)
    assert gates_of(stripped.config, stripped.events) == ()
    assert not FULL.workload_problems(stripped)
    assert ALL.restrict_workload(w) is w
    assert Capabilities.from_dict(ALL.to_dict()) == ALL
    assert ALL.is_full and Capabilities(lora=True).is_full


def test_a_declaration_of_some_gates_keeps_just_those() -> None:
    caps = Capabilities().with_gates(("pause", "watermark"))
    for seed in range(20):
        w = caps.restrict_workload(random_workload(seed, 50, gates=GATES))
        assert set(gates_of(w.config, w.events)) <= {"pause", "watermark"}
    with pytest.raises(ValueError, match="unknown gate"):
        Capabilities().with_gates(("nope",))


# ---------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------


class Recording(SpecScheduler):
    """The spec, recording the gate calls it gets."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple[Any, ...]] = []

    def set_pause_state(self, state: PauseState) -> None:
        self.calls.append(("pause", state))
        super().set_pause_state(state)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset", reset_running_requests))
        return super().reset_prefix_cache(reset_running_requests)


def test_pause_and_resume_set_the_pause_state() -> None:
    runner = Runner(CFG, {"rec": Recording})
    assert runner.run([AddRequest(_req("a")), Pause("new"), Step(), Pause("all"), Step(), Resume(), Step()]) is None
    sched = runner.primary
    assert isinstance(sched, Recording)
    assert sched.calls == [("pause", PauseState.PAUSED_NEW), ("pause", PauseState.PAUSED_ALL),
                           ("pause", PauseState.UNPAUSED)]
    assert runner.stats.pauses == 2 and runner.stats.paused_steps == 2
    assert runner.views["rec"].pause_state == PauseState.UNPAUSED


def test_a_pause_clears_the_cache_once_the_engine_is_idle() -> None:
    runner = Runner(CFG, {"rec": Recording})
    sched = runner.primary
    assert isinstance(sched, Recording)
    # idle at once: the clear comes with the pause, running requests included
    assert runner.run([Pause("new", clear_cache=True)]) is None
    assert sched.calls == [("pause", PauseState.PAUSED_NEW), ("reset", True)]
    assert runner.run([Resume(), AddRequest(_req("a", max_tokens=2))]) is None
    sched.calls.clear()
    # busy: the clear waits until the running request finished and was reported
    assert runner.run([Step(), Pause("new", clear_cache=True)]) is None
    assert sched.calls == [("pause", PauseState.PAUSED_NEW)]
    assert runner.run([Step()]) is None  # a finishes
    assert ("reset", True) not in sched.calls  # its finish is not reported yet
    assert runner.run([Step()]) is None
    assert sched.calls[-1] == ("reset", True) and runner.stats.cache_clears == 2


def test_paused_all_clears_at_once_and_preempts_the_running() -> None:
    runner = Runner(CFG, {"rec": Recording})
    assert runner.run([AddRequest(_req("a", max_tokens=8)), Step(), Pause("all", clear_cache=True)]) is None
    view = runner.primary.view()
    assert runner.stats.cache_clears == 1 and "a" not in view.running


def test_grammar_ready_admits_the_request_and_a_refusal_is_an_outcome() -> None:
    cfg = CFG
    runner = Runner(cfg, {"spec": SpecScheduler, "twin": SpecScheduler})
    req = _req("g", structured_output=True)
    assert runner.run([AddRequest(req), Step()]) is None
    view = runner.primary.view()
    assert view.requests["g"].status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert runner.last_plan is not None and not runner.last_plan.scheduled
    assert runner.run([GrammarReady("g"), Step()]) is None
    assert runner.last_plan is not None and runner.last_plan.scheduled_ids == ("g",)
    assert runner.stats.grammars_ready == 1
    # a second report, or one for an unknown request: refused alike by both, no failure
    assert runner.run([GrammarReady("g"), GrammarReady("nobody")]) is None


def test_a_failed_grammar_finishes_the_request_with_an_error() -> None:
    runner = Runner(CFG, {"spec": SpecScheduler})
    assert runner.run([AddRequest(_req("g", structured_output=True)), GrammarReady("g", ok=False)]) is None
    assert runner.run_to_completion([]) is None
    assert runner.finished["g"].status == RequestStatus.FINISHED_ERROR
    assert runner.stats.grammars_failed == 1


class NoGates(SpecScheduler):
    set_pause_state = None  # type: ignore[assignment]


def test_a_gate_event_for_a_scheduler_without_the_method_names_it() -> None:
    failure = Runner(CFG, {"plain": NoGates}).run([Pause("new")])
    assert failure is not None and failure.kind == "error"
    assert "NoGates has no set_pause_state()" in failure.message


def test_run_to_completion_waits_for_a_resume_or_a_grammar_ahead() -> None:
    events: list[Event] = [AddRequest(_req("a")), Pause("all")] + [Step()] * 6 + [Resume()]
    runner = Runner(CFG, {"spec": SpecScheduler})
    assert runner.run_to_completion(events) is None and "a" in runner.finished
    events = [AddRequest(_req("g", structured_output=True))] + [Step()] * 6 + [GrammarReady("g")]
    runner = Runner(CFG, {"spec": SpecScheduler})
    assert runner.run_to_completion(events) is None and "g" in runner.finished


def test_gated_workloads_run_clean_on_the_spec_against_itself() -> None:
    for seed in range(6):
        w = random_workload(seed, 60, modes=MODES, gates=GATES)
        runner = Runner(w.config, {"spec": SpecScheduler, "twin": SpecScheduler}, oracle_seed=seed,
                        check_invariants=False)
        assert runner.run(w.events) is None, seed


# ---------------------------------------------------------------------------
# the fake model under a grammar
# ---------------------------------------------------------------------------


def test_the_fake_model_never_samples_a_refused_token() -> None:
    vocab = 8
    refused = (0, 1, 2, 3, 4, 5)
    cfg = dataclasses.replace(CFG, num_speculative_tokens=2)
    req = _req("g", max_tokens=20, structured_output=True, grammar_rejects=refused)
    plain = _req("p", max_tokens=20)
    runner = Runner(cfg, {"spec": SpecScheduler}, vocab=vocab, acceptance="prefix")
    assert runner.run_to_completion([AddRequest(req), AddRequest(plain), GrammarReady("g")]) is None
    out = runner.finished["g"].output_token_ids
    assert len(out) == 20 and not set(out) & set(refused)
    assert set(runner.finished["p"].output_token_ids) & set(refused)
    model = FakeModel(2, vocab)
    model.set_grammar("g", refused)
    assert model.sample_for("g", (1, 2)) not in refused
    assert model.sample_for("x", (1, 2)) == model.sample_token((1, 2))


# ---------------------------------------------------------------------------
# trace format 3
# ---------------------------------------------------------------------------


def _gated_trace() -> tracefile.Trace:
    cfg = dataclasses.replace(CFG, max_loras=1, watermark=0.1, prefill_schedule_interval=2,
                              max_num_encoder_input_tokens=4, encoder_cache_size=8)
    events: tuple[Event, ...] = (
        AddRequest(_req("a", 6, lora_id=2, mm_inputs=(MMInput(1, 2, "img"),))),
        AddRequest(_req("g", structured_output=True, grammar_rejects=(3, 5))),
        Step(), Pause("new", True), Step(), Resume(), GrammarReady("g", ok=True), Step(),
    )
    return tracefile.Trace(Workload(cfg, events, seed=3))


def test_a_gated_trace_round_trips_as_version_3_with_its_gates() -> None:
    trace = _gated_trace()
    text = tracefile.dumps(trace)
    header = json.loads(text.splitlines()[0])
    assert header["schedspec_trace"] == 3 and header["gates"] == list(GATES)
    back = tracefile.loads(text)
    assert back.workload == trace.workload and back.gates == GATES
    plain = tracefile.Trace(random_workload(1, 10))
    assert "gates" not in json.loads(tracefile.dumps(plain).splitlines()[0])
    assert json.loads(tracefile.dumps(plain).splitlines()[0])["schedspec_trace"] in (1, 2)


def _lines() -> list[str]:
    return tracefile.dumps(_gated_trace()).splitlines()


def _load(lines: list[str]) -> None:
    tracefile.loads("\n".join(lines) + "\n", "t.jsonl")


@pytest.mark.parametrize("line, event, message", [
    (7, '{"op": "grammar_ready", "request_id": "zz"}', "t.jsonl:7: request_id: 'zz' was never added"),
    (7, '{"op": "grammar_ready", "request_id": "a"}', "t.jsonl:7: request_id: 'a' has no structured output"),
    (7, '{"op": "pause", "mode": "later"}', "t.jsonl:7: mode:"),
    (7, '{"op": "pause"}', "t.jsonl:7: mode: missing"),
    (7, '{"op": "resume", "now": true}', "t.jsonl:7: now: unknown field for 'resume'"),
])
def test_bad_gate_events_are_refused_naming_file_line_and_field(line: int, event: str, message: str) -> None:
    lines = _lines()
    lines[line - 1] = event
    with pytest.raises(TraceError) as e:
        _load(lines)
    assert str(e.value).startswith(message)


def test_a_grammar_reported_twice_is_refused_and_one_after_an_abort_kept() -> None:
    lines = _lines()
    with pytest.raises(TraceError, match=r"t.jsonl:10: request_id: the grammar of 'g' was already reported on line 8"):
        _load(lines + ['{"op": "grammar_ready", "request_id": "g"}'])
    # a compile that finishes after the abort: the check's generator writes it, and its trace replays
    lines = _lines()
    lines[7] = '{"op": "abort", "request_id": "g"}'
    workload = tracefile.loads("\n".join(lines + ['{"op": "grammar_ready", "request_id": "g"}']) + "\n", "t.jsonl")
    assert workload.events[-1] == GrammarReady("g")


def test_gate_fields_the_config_cannot_take_are_refused() -> None:
    lines = _lines()
    header = json.loads(lines[0])
    del header["config"]["max_loras"]
    header["gates"].remove("lora")
    with pytest.raises(TraceError, match=r"t.jsonl:2: request.lora_id: adapter 2 with LoRA off"):
        _load([json.dumps(header)] + lines[1:])
    header = json.loads(lines[0])
    del header["config"]["max_num_encoder_input_tokens"], header["config"]["encoder_cache_size"]
    header["gates"].remove("encoder")
    with pytest.raises(TraceError, match=r"t.jsonl:2: request.mm_inputs: encoder inputs with no encoder"):
        _load([json.dumps(header)] + lines[1:])
    add = json.loads(lines[1])
    add["request"]["mm_inputs"][0]["offset"] = 5  # past the prompt of 6 tokens
    with pytest.raises(TraceError, match=r"t.jsonl:2: request.mm_inputs\[0\]"):
        _load([lines[0], json.dumps(add)] + lines[2:])


def test_gates_need_version_3_and_the_header_must_list_what_is_used() -> None:
    lines = _lines()
    header = json.loads(lines[0])
    header["schedspec_trace"] = 2
    with pytest.raises(TraceError, match=r"t.jsonl:1: config.max_loras: needs trace format version 3"):
        _load([json.dumps(header)] + lines[1:])
    plain = {"schedspec_trace": 2, "config": CFG.to_dict()}
    with pytest.raises(TraceError, match=r"t.jsonl:2: op: 'pause' needs trace format version 3"):
        _load([json.dumps(plain), '{"op": "pause", "mode": "new"}'])
    with pytest.raises(TraceError, match=r"t.jsonl:2: request.lora_id: needs trace format version 3"):
        _load([json.dumps(plain), json.dumps({"op": "add", "request": _req("a", lora_id=1).to_dict()})])
    header = json.loads(lines[0])
    header["gates"] = ["lora"]
    with pytest.raises(TraceError, match=r"t.jsonl:1: gates: the trace uses the gate\(s\) grammar, pause, "):
        _load([json.dumps(header)] + lines[1:])


# ---------------------------------------------------------------------------
# the shrinker
# ---------------------------------------------------------------------------


def test_consistent_drops_grammar_reports_of_requests_gone_or_without_a_grammar() -> None:
    events: list[Event] = [AddRequest(_req("a")), GrammarReady("a"), GrammarReady("b"),
                           AddRequest(_req("g", structured_output=True)), GrammarReady("g"), GrammarReady("g")]
    assert _consistent(events) == [AddRequest(_req("a")), AddRequest(_req("g", structured_output=True)),
                                   GrammarReady("g")]
    # gate fields the config cannot take go
    lora = AddRequest(_req("l", lora_id=1))
    assert _consistent([lora], False, CFG) == [AddRequest(_req("l"))]


def test_the_shrinker_drops_the_gates_a_failure_does_not_need() -> None:
    w = _first_workload(lambda w: any(isinstance(e, Pause) for e in w.events)
                        and gates_of(w.config, w.events) != ("pause",))

    def check(cand: Workload) -> Failure | None:
        # "fails" at the first pause
        for i, e in enumerate(cand.events):
            if isinstance(e, Pause):
                return Failure("violation", i, 0, "spec", "paused")
        return None

    first = check(w)
    assert first is not None
    small, failure = shrink(w, first, check, budget_s=30)
    assert [type(e) for e in small.events] == [Pause]
    assert gates_of(small.config, small.events) == ("pause",)


# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------


def test_the_step_table_shows_pauses_encoder_inputs_and_grammar_waits() -> None:
    cfg = dataclasses.replace(CFG, max_num_encoder_input_tokens=4, encoder_cache_size=8)
    events: list[Event] = [
        AddRequest(_req("a", 6, max_tokens=2, mm_inputs=(MMInput(1, 2, "img"),))),
        AddRequest(_req("g", structured_output=True)),
        Step(), Pause("new"), Step(), Resume(), Step(), Step(),
    ]
    runner = Runner(cfg, {"spec": SpecScheduler}, keep_history=True)
    assert runner.run(events) is None
    records = runner.history or []
    text = report.step_table(records)
    assert "a:new 0+6 e[0]" in text
    assert "[paused new]" in text
    assert report.paused_columns(records) == [1]
    order, grid, _ = report.cell_states(records)
    assert all(col[order.index("g")] == "grammar" for col in grid)
    assert "grammar" in report.STATES and "grammar" in report.legend()


def test_a_class_declaring_a_gate_without_its_method_does_not_conform() -> None:
    from schedspec.check.conformance import ConformanceError, check_conformance, gate_method_problems

    caps = Capabilities().with_gates(("pause", "grammar"))
    assert gate_method_problems(SpecScheduler, caps) == []
    problems = gate_method_problems(NoGates, caps)
    assert len(problems) == 1 and "NoGates.set_pause_state: missing, yet its capabilities declare pause" in problems[0]
    assert gate_method_problems(NoGates, FULL) == []
    with pytest.raises(ConformanceError, match="set_pause_state: missing"):
        check_conformance("mine", NoGates, CFG, caps)


def test_a_view_difference_names_the_gate_fields_and_the_request_fields() -> None:
    from schedspec.check.records import describe_difference

    runner = Runner(CFG, {"spec": SpecScheduler})
    assert runner.run([AddRequest(_req("a", lora_id=0)), Step()]) is None
    a = runner.primary.view()
    b = dataclasses.replace(a, pause_state=PauseState.PAUSED_ALL, requests={
        "a": dataclasses.replace(a.requests["a"], num_computed_tokens=1)})
    text = describe_difference("view()", "spec", a, "mine", b)
    assert "pause_state: spec=<PauseState.UNPAUSED: 0> mine=<PauseState.PAUSED_ALL: 2>" in text
    assert "request a: num_computed_tokens: spec=3 mine=1" in text


def test_with_async_scheduling_the_clear_comes_once_only_an_empty_plan_is_in_flight() -> None:
    cfg = dataclasses.replace(CFG, async_scheduling=True)
    runner = Runner(cfg, {"rec": Recording, "spec": SpecScheduler})
    sched = runner.primary
    assert isinstance(sched, Recording)
    assert runner.run([AddRequest(_req("a", max_tokens=8)), Step(), Step(), Pause("all", clear_cache=True)]) is None
    assert ("reset", True) not in sched.calls  # a plan that schedules a is in flight
    assert runner.run([Step()]) is None  # the engine drains it (an empty plan goes in flight)
    assert sched.calls[-1] == ("reset", True) and runner.stats.cache_clears == 1
    assert "a" not in runner.primary.view().running  # the reset preempted it
    assert runner.run([Resume()]) is None
    assert runner.run_to_completion([]) is None and "a" in runner.finished


def test_malformed_gate_events_are_refused_when_built() -> None:
    with pytest.raises(ValueError, match="Pause.mode must be one of new, all, got 'later'"):
        Pause("later")
    with pytest.raises(ValueError, match="Pause.clear_cache must be a boolean"):
        Pause("new", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="GrammarReady.request_id must be a non-empty string"):
        GrammarReady("")
    with pytest.raises(ValueError, match="GrammarReady.ok must be a boolean"):
        GrammarReady("g", None)  # type: ignore[arg-type]
