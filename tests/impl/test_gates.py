"""The admission gates in impl: every crafted scenario of the spec's gate tests
(tests/spec/test_gates.py) run on spec and impl side by side, with equal
outcomes (values, or errors of one type and message) and equal views after
every operation; then scenarios of impl's own: a pause or a grammar moving a
synchronous scheduler off its fast path mid-run, block keys of adapters and
encoder inputs, clones, the declared gates."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest

import tests.spec.test_gates as spec_gates
from schedspec.adapters.registry import resolve
from schedspec.check.features import GATES
from schedspec.impl import ImplScheduler
from schedspec.spec import RequestStatus, SpecScheduler, StepPlan, StepResult
from schedspec.spec.interface import MMInput, PauseState
from schedspec.spec.protocol import gates_of_config

from tests.helpers import cfg, entries, req

GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


class Pair:
    """Looks like a SpecScheduler to a scenario; runs every call on the spec
    and on impl, and checks equal outcomes and views. Attributes it does not
    forward (rule counters, the spec's internals) are the spec's."""

    def __init__(self, config: Any, _pair: tuple[SpecScheduler, ImplScheduler] | None = None) -> None:
        self.spec, self.impl = _pair if _pair is not None else (SpecScheduler(config), ImplScheduler(config))

    def _both(self, op: Callable[[Any], Any]) -> Any:
        outcomes: list[tuple[str, Any]] = []
        raised: BaseException | None = None
        for s in (self.spec, self.impl):
            try:
                outcomes.append(("ok", op(s)))
            except Exception as exc:  # noqa: BLE001 - compared below
                outcomes.append((type(exc).__name__, str(exc)))
                raised = raised or exc
        assert outcomes[0] == outcomes[1], outcomes
        assert self.spec.view() == self.impl.view()
        if raised is not None:
            raise raised
        return outcomes[0][1]

    def add(self, r: Any) -> None:
        self._both(lambda s: s.add(r))

    def abort(self, rid: Any) -> None:
        self._both(lambda s: s.abort(rid))

    def schedule(self) -> StepPlan:
        plan: StepPlan = self._both(lambda s: s.schedule())
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> None:
        self._both(lambda s: s.update(plan, result))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        ok: bool = self._both(lambda s: s.reset_prefix_cache(reset_running_requests))
        return ok

    def set_pause_state(self, state: Any) -> None:
        self._both(lambda s: s.set_pause_state(state))

    def grammar_ready(self, request_id: Any, ok: Any = True) -> None:
        self._both(lambda s: s.grammar_ready(request_id, ok))

    def view(self) -> Any:
        v = self.spec.view()
        assert v == self.impl.view()
        return v

    def clone(self) -> "Pair":
        return Pair(None, (self.spec.clone(), self.impl.clone()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec, name)


SCENARIOS = sorted(
    name for name, fn in vars(spec_gates).items()
    if name.startswith("test_") and inspect.isfunction(fn) and not inspect.signature(fn).parameters
)


def test_the_spec_has_gate_scenarios_to_borrow() -> None:
    assert len(SCENARIOS) >= 25


@pytest.mark.parametrize("name", SCENARIOS)
def test_spec_gate_scenario_runs_alike_on_impl(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec_gates, "SpecScheduler", Pair)
    getattr(spec_gates, name)()


# ---------------------------------------------------------------- impl's own scenarios


def step(p: Pair, token: int = 7) -> StepPlan:
    plan = p.schedule()
    p.update(plan, StepResult({e.request_id: (token,) for e in plan.scheduled if e.samples}))
    return plan


def test_impl_implements_every_gate_a_config_can_turn_on() -> None:
    every = cfg(watermark=0.2, prefill_schedule_interval=3, max_loras=2,
                max_num_encoder_input_tokens=8, encoder_cache_size=8)
    assert set(gates_of_config(every)) <= set(ImplScheduler.GATES)
    ImplScheduler(every)  # not refused
    assert resolve("impl").capabilities.gates() == GATES


def test_a_pause_moves_a_sync_scheduler_off_its_fast_path_mid_prefill() -> None:
    p = Pair(cfg(max_num_batched_tokens=6, max_num_seqs=4))
    p.add(req("a", 9, max_tokens=6))
    p.add(req("b", 3, max_tokens=6))
    step(p)  # a: a partial chunk of 6
    p.set_pause_state(PauseState.PAUSED_NEW)
    plan = step(p)  # a finishes its prompt; b is not admitted
    assert entries(plan) == [("a", "running", 6, 3)]
    p.set_pause_state(PauseState.PAUSED_ALL)
    assert step(p).scheduled == ()
    p.set_pause_state(PauseState.UNPAUSED)
    assert [e[0] for e in entries(step(p))] == ["a", "b"]
    for _ in range(6):
        step(p)


def test_a_grammar_request_moves_a_sync_scheduler_to_the_gated_path() -> None:
    p = Pair(cfg())
    p.add(req("a", 5, max_tokens=8))
    step(p)
    step(p)
    p.add(req("g", 6, max_tokens=3, structured_output=True, grammar_rejects=(7,)))
    assert p.view().requests["g"].status == GRAMMAR
    assert [e[0] for e in entries(step(p, token=3))] == ["a"]
    p.grammar_ready("g")
    assert [e[0] for e in entries(step(p, token=3))] == ["a", "g"]
    plan = p.schedule()
    # a token the grammar refuses finishes g with an error
    p.update(plan, StepResult({e.request_id: (7,) for e in plan.scheduled if e.samples}))
    assert p.view().finished["g"].status == RequestStatus.FINISHED_ERROR


def test_adapters_and_images_key_their_blocks_apart_and_share_equal_ones() -> None:
    p = Pair(cfg(max_loras=2, max_num_encoder_input_tokens=16, encoder_cache_size=16, num_blocks=33))
    img = (MMInput(5, 3, "cat"),)
    p.add(req("a", 12, max_tokens=2, lora_id=1, mm_inputs=img))
    step(p)
    step(p)
    step(p)
    p.add(req("b", 12, max_tokens=2, lora_id=1, mm_inputs=img))  # the same: hits 2 blocks
    p.add(req("c", 12, max_tokens=2, lora_id=2, mm_inputs=img))  # another adapter: no hit
    p.add(req("d", 12, max_tokens=2, lora_id=1, mm_inputs=(MMInput(5, 3, "dog"),)))  # block 0 only
    plan = p.schedule()
    assert entries(plan) == [("b", "new", 8, 4), ("c", "new", 0, 12), ("d", "new", 4, 8)]
    assert plan.get("c").encoder_inputs == () and plan.get("d").encoder_inputs == (0,)


def test_a_clone_of_a_gated_impl_goes_on_alike() -> None:
    p = Pair(cfg(max_num_encoder_input_tokens=8, encoder_cache_size=8, prefill_schedule_interval=2,
                 max_num_batched_tokens=8, max_num_seqs=4))
    p.add(req("a", 12, max_tokens=4, mm_inputs=(MMInput(2, 4, "x"), MMInput(8, 4, "y"))))
    p.add(req("g", 4, max_tokens=2, structured_output=True))
    step(p)
    q = p.clone()
    q.grammar_ready("g")
    for _ in range(5):
        step(q)
    assert p.view().requests["g"].status == GRAMMAR  # the original is untouched
    for _ in range(5):
        step(p)


@pytest.mark.parametrize("extra", [dict(), dict(async_scheduling=True), dict(num_speculative_tokens=2)])
def test_bad_results_on_the_gated_path_raise_the_spec_error_and_change_nothing(extra: dict[str, Any]) -> None:
    p = Pair(cfg(prefill_schedule_interval=2, **extra))
    p.add(req("a", 5, max_tokens=6, structured_output=True, grammar_rejects=(9,)))
    p.add(req("b", 6, max_tokens=6, mm_inputs=()))
    p.grammar_ready("a")
    plan = p.schedule()
    for bad in ({"a": (1, 2), "b": (3,)}, {"a": (1,), "b": (-3,)}, {"a": (1,), "zz": (3,)}, {"a": [1], "b": (3,)}):
        with pytest.raises(Exception):
            p.update(plan, StepResult(bad))  # type: ignore[arg-type]
    p.update(plan, StepResult({"a": (1,), "b": (3,)}))
    with pytest.raises(Exception):
        p.grammar_ready("a")  # resolved already: the same error from both
    for _ in range(6):
        step(p)


def test_marked_key_chains_intern_view_copy_and_evict() -> None:
    from schedspec.impl.prefix_index import PrefixIndex

    px = PrefixIndex(8)
    # block 1's identity changes ("img" starts in it): its parent is (node 0, identity)
    px.register_marked([1, 2, 3], 0, "", [(1, 2), (3, 4), (5, 6)], {1: "id1"})
    node2 = px.block_node[2]
    assert node2 is not None and node2.full_key() == ("id1", (1, 2, 3, 4))
    assert px.block_node[3] is not None and px.block_node[3].full_key() == ("id1", (1, 2, 3, 4, 5, 6))
    assert px.block_node[1] is not None and px.block_node[1].full_key() == ("", (1, 2))
    # the same tokens without the change are another key; with it, the same one
    assert px.lookup(px.block_node[1], (3, 4)) is None
    assert px.lookup((px.block_node[1], "id1"), (3, 4)) is node2
    copy = px.copy()
    assert copy.views() == px.views()
    # evicting the chain tail first, then the rest, empties the intern table
    for b in (3, 2, 1):
        px.evict(b)
    assert not px.intern
    assert len(copy.intern) == 3  # the copy is independent
    for b in (1, 2, 3):
        copy.evict(b)
    assert not copy.intern


@pytest.mark.parametrize("extra", [dict(), dict(async_scheduling=True), dict(num_speculative_tokens=2),
                                   dict(async_scheduling=True, num_speculative_tokens=2)])
def test_pauses_and_grammars_come_and_go_and_impl_keeps_in_step(extra: dict[str, Any]) -> None:
    """The gated path is taken while a pause state or a request with a grammar
    is there and left after; with async scheduling a plan is in flight when
    the path changes."""
    p = Pair(cfg(max_num_batched_tokens=10, max_num_seqs=4, **extra))
    asyn = bool(extra.get("async_scheduling"))
    inflight: list[StepPlan] = []

    def tick() -> None:
        inflight.append(p.schedule())
        if len(inflight) > (1 if asyn else 0):
            plan = inflight.pop(0)
            p.update(plan, StepResult({e.request_id: (5,) for e in plan.scheduled if e.samples}))

    for i in range(6):
        p.add(req(f"r{i}", 7 + i, max_tokens=5))
    for rnd in range(3):
        tick()
        p.set_pause_state(PauseState.PAUSED_NEW if rnd % 2 else PauseState.PAUSED_ALL)
        p.add(req(f"n{rnd}", 4, max_tokens=3))
        tick()
        tick()
        p.set_pause_state(PauseState.UNPAUSED)
        tick()
        p.add(req(f"g{rnd}", 5, max_tokens=2, structured_output=True))
        tick()
        p.grammar_ready(f"g{rnd}", ok=rnd != 1)
        for _ in range(4):
            tick()
    while inflight:
        plan = inflight.pop(0)
        p.update(plan, StepResult({e.request_id: (5,) for e in plan.scheduled if e.samples}))


def test_two_live_grammars_hold_the_gated_path_until_both_finish() -> None:
    """impl counts the unfinished requests with a grammar: the first one to
    finish leaves the other's grammar in force, so a token it refuses still
    finishes it with an error."""
    p = Pair(cfg())
    p.add(req("g1", 6, max_tokens=2, structured_output=True))
    p.add(req("g2", 6, max_tokens=8, structured_output=True, grammar_rejects=(9,)))
    p.grammar_ready("g1")
    p.grammar_ready("g2")
    assert [e[0] for e in entries(step(p, token=3))] == ["g1", "g2"]
    step(p, token=3)  # g1 reaches max_tokens
    assert "g1" in p.view().finished and p.view().requests["g2"].status == RequestStatus.RUNNING
    step(p, token=9)  # refused by g2's grammar
    assert p.view().finished["g2"].status == RequestStatus.FINISHED_ERROR


def test_an_encoder_input_at_the_last_prompt_token_runs_with_it() -> None:
    """A prefill that stops one token short of its prompt, whose last token
    is an encoder input: the next step schedules that token with its input
    (the steady decode takes only requests past their prompt)."""
    p = Pair(cfg(max_num_batched_tokens=8, max_num_encoder_input_tokens=16, encoder_cache_size=16))
    p.add(req("a", 9, max_tokens=2, mm_inputs=(MMInput(8, 1, "cat"),)))
    first = p.schedule()
    assert [(e.request_id, e.num_scheduled_tokens, e.encoder_inputs) for e in first.scheduled] == [("a", 8, ())]
    p.update(first, StepResult({}))
    (e,) = p.schedule().scheduled
    assert (e.num_computed_tokens, e.num_scheduled_tokens, e.encoder_inputs) == (8, 1, (0,))
