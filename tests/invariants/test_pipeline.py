"""The invariants of k plans in flight (invariants/pipeline.py), each holding on
the spec's transitions with a pipeline and firing on a crafted one; and the
in-flight invariants of async scheduling holding with k plans in flight."""

from __future__ import annotations

import dataclasses

from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.invariants import BY_ID, CATALOGUE
from schedspec.spec import SpecScheduler
from tests.invariants.test_inflight import Recorder, config, fires, with_entry

IDS = ("in-flight-within-k", "pipeline-no-recompute")


def pipelined(pp: int = 3) -> Recorder:
    """Sync, k = pp: a's prefill goes out in chunks while b's decode waits for its update."""
    r = Recorder(config(async_scheduling=False, k=0, pipeline_parallel_size=pp, max_num_batched_tokens=8,
                        long_prefill_token_threshold=4))
    r.add("a", 10)
    r.add("b", 1, max_tokens=4)
    p1 = r.schedule()
    r.schedule()
    r.schedule()
    r.update(p1, {"b": (7,)})
    r.schedule()
    return r


def test_registered_and_safety() -> None:
    ids = {inv.id for inv in CATALOGUE}
    assert set(IDS) <= ids and all(BY_ID[i].is_safety for i in IDS)


def test_they_hold_on_the_spec_with_k_plans_in_flight() -> None:
    r = pipelined()
    for t in r.log:
        if t.kind in ("schedule", "update"):
            for i in IDS + ("placeholders-match-in-flight", "in-flight-output-delivered-once"):
                assert fires(i, t) == [], (i, t.kind)


def test_in_flight_within_k_fires_past_k() -> None:
    t = pipelined().last("schedule")
    assert len(t.in_flight) == 3
    extra = dataclasses.replace(t.in_flight[-1], step=t.in_flight[-1].step + 1)
    found = fires("in-flight-within-k", dataclasses.replace(t, plan=extra, in_flight=t.in_flight + (extra,)))
    assert any("4 plans in flight" in m for m in found)


def test_in_flight_within_k_fires_on_an_update_that_is_not_the_oldest() -> None:
    r = pipelined()
    u = r.last("update")
    assert fires("in-flight-within-k", u) == []
    newest = r.last("schedule").in_flight[-1]
    out_of_order = dataclasses.replace(u, plan=newest)  # completes the newest while older ones fly
    assert any("oldest plan is updated first" in m for m in fires("in-flight-within-k", out_of_order))
    twice = dataclasses.replace(u, in_flight=(u.plan,) + u.in_flight)  # still in flight after its update
    assert any("oldest plan is updated first" in m for m in fires("in-flight-within-k", twice))


def test_in_flight_within_k_fires_on_plans_out_of_order() -> None:
    t = pipelined().last("schedule")
    found = fires("in-flight-within-k", dataclasses.replace(t, in_flight=tuple(reversed(t.in_flight))))
    assert any("out of step order" in m for m in found)


def test_pipeline_no_recompute_fires_on_a_decode_scheduled_again_while_in_flight() -> None:
    r = pipelined()
    t = r.last("schedule")
    newest = t.in_flight[-1]
    e = newest.get("b")  # b's decode, scheduled after its last update
    assert e is not None and e.samples and all(p.get("b") is None for p in t.in_flight[:-1])
    # a scheduler that had also given b that decode in an older plan still in flight
    older = dataclasses.replace(t.in_flight[0], scheduled=t.in_flight[0].scheduled + (e,))
    crafted = dataclasses.replace(t, in_flight=(older,) + t.in_flight[1:])
    found = fires("pipeline-no-recompute", crafted)
    assert any("sample it" in m for m in found) and any("twice" in m for m in found)


def test_pipeline_no_recompute_fires_on_overlapping_chunks() -> None:
    r = Recorder(config(async_scheduling=False, k=0, pipeline_parallel_size=2, max_num_batched_tokens=8,
                        long_prefill_token_threshold=4))
    r.add("a", 10)
    r.add("b", 1, max_tokens=4)
    r.schedule()
    t = r.last("schedule")
    r.schedule()
    t = r.last("schedule")
    assert fires("pipeline-no-recompute", t) == []
    first, second = t.in_flight
    shifted = with_entry(second, "a", num_computed_tokens=2)  # starts inside the chunk in flight
    found = fires("pipeline-no-recompute", dataclasses.replace(t, plan=shifted, in_flight=(first, shifted)))
    assert any("twice" in m for m in found)


def test_every_invariant_holds_on_generated_pipelines() -> None:
    for seed in range(4):
        w = random_workload(seed, 60, modes=("sync", "spec"), pipeline=True)
        assert Runner(w.config, {"spec": SpecScheduler}).run_to_completion(w.events) is None, seed
