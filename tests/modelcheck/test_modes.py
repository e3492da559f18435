"""The spaces with speculative decoding and async scheduling (bound
``modes``): explored clean with ImplScheduler in lockstep, reaching the rules
of those modes; the in-flight part of a state is in its fingerprint."""

from __future__ import annotations

import pytest

from schedspec.check.oracle import ACCEPTANCE_MODES, FakeModel
from schedspec.modelcheck import BoundResult, Expander, bound, check_bound
from schedspec.modelcheck.events import STEP
from schedspec.modelcheck.run import impl_class
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.rule_names import reachable_in

SPEC_RULES = {"spec.drafts_scheduled", "spec.drafts_cut", "spec.drafts_unscheduled", "admit.padded_decode",
              "spec.all_accepted", "spec.some_rejected", "spec.stop_inside_run", "spec.drafts_set",
              "spec.drafts_for_finished", "running.stop_budget"}
ASYNC_RULES = {"async.placeholders_added", "running.skip_max_tokens_in_flight", "async.stale_output",
               "async.stale_dropped"}


@pytest.fixture(scope="module")
def result() -> BoundResult:
    return check_bound("modes", use_impl=True, workers=1)


def test_the_modes_bound_explores_clean_in_lockstep(result: BoundResult) -> None:
    assert result.failure is None
    modes = {(s.space.config.async_scheduling, s.space.config.num_speculative_tokens > 0) for s in result.spaces}
    assert modes == {(False, True), (True, False), (True, True)}
    assert {s.space.acceptance for s in result.spaces if s.space.config.num_speculative_tokens} == {"all", "none"}
    assert {s.space.config.num_speculative_tokens for s in result.spaces} == {1, 2, 0}
    for s in result.spaces:
        assert s.states > 1000 and s.transitions > s.states and s.liveness_bound is not None, s.space.name


def test_the_modes_bound_reaches_the_rules_of_spec_and_async(result: BoundResult) -> None:
    counts: dict[str, int] = {}
    for s in result.spaces:
        for name, n in s.rules.items():
            counts[name] = counts.get(name, 0) + n
    reached = set(rule_coverage.reached(counts))
    assert SPEC_RULES <= reached, SPEC_RULES - reached
    assert ASYNC_RULES <= reached, ASYNC_RULES - reached
    assert SPEC_RULES | ASYNC_RULES <= set(reachable_in(["spec", "async", "async-spec"]))
    spec_only = {s.space.name: set(rule_coverage.reached(s.rules)) for s in result.spaces
                 if not s.space.config.async_scheduling}
    assert not (ASYNC_RULES & set().union(*spec_only.values()))


def test_a_plan_in_flight_is_part_of_the_state() -> None:
    space = next(s for s in bound("modes").spaces if s.name == "async-fcfs-tight-1req")
    ex = Expander(space, impl_cls=impl_class())
    root = ex.root()
    add = ex.alphabet.add(0)
    s1 = ex.apply_async(root.state, add, root.view, root.flight, 0)  # type: ignore[arg-type]
    s2 = ex.apply_async(s1.state, STEP, s1.view, s1.flight, s1.adds)  # type: ignore[arg-type]
    assert s2.flight is not None and len(s2.flight.pairs) == 1
    assert ex.alphabet.update in ex.enabled(s2.view, s2.flight)
    # the same view with nothing in flight is another state
    assert s2.fingerprint != ex.full_fingerprint(s2.view, type(s2.flight)())
    s3 = ex.apply_async(s2.state, STEP, s2.view, s2.flight, s2.adds)
    assert s3.flight is not None and len(s3.flight.pairs) == 2
    enabled = ex.enabled(s3.view, s3.flight)
    assert ex.alphabet.update not in enabled and 1 not in enabled  # two in flight: no reset, step updates
    s4 = ex.apply_async(s3.state, STEP, s3.view, s3.flight, s3.adds)
    assert s4.flight is not None and len(s4.flight.pairs) == 1
    wl = ex.workload([add, STEP, STEP, STEP])
    assert [type(e).__name__ for e in wl.events] == ["AddRequest", "Schedule", "Schedule", "Update"]


def test_a_counterexample_trace_names_the_drafts_of_its_space() -> None:
    # A trace carries the oracle seed, from which a fake model not told its
    # acceptance mode takes it: the spaces' seeds name their modes.
    for space in bound("modes-large").spaces:
        model = FakeModel(space.config.block_size, space.vocab, space.oracle_seed)
        assert model.acceptance == space.acceptance, space.name
        assert ACCEPTANCE_MODES.index(space.acceptance) == space.oracle_seed
