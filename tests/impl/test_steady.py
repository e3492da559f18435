"""The steady-decode cases of impl's general path, in lockstep with the spec.

The benchmark's decode workload is where impl's RUNNING loop takes its
steady-decode cases (async scheduling with its placeholders, sync speculative
decoding with the drafts proposed after each step) and leaves them at block
boundaries, at the max_tokens skip and when requests finish; its mixed trace
adds chunked prefill, prefix hits and preemptions around them. Spec and impl
run the same steps: equal plans at every step, equal views every few steps
and at the end. Each decode run also checks that most of its entries had the
steady shape, so the cases are surely taken.
"""

from __future__ import annotations

from typing import Any

import pytest

from schedspec.bench import scheduler as bench
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import StepPlan
from schedspec.spec.scheduler import SpecScheduler

MODES = ("async", "async+spec2", "async+spec3", "sync+spec1", "sync+spec3")


def _drive(mode_text: str, cfg: Any, arrivals: list[list[Any]]) -> list[StepPlan]:
    mode = bench.parse_modes(mode_text)[0]
    drivers = [bench._driver(cls(cfg), mode) for cls in (SpecScheduler, ImplScheduler)]
    plans: list[list[StepPlan]] = [[], []]
    for d, out in zip(drivers, plans):
        schedule = d.sched.schedule

        def recording(schedule: Any = schedule, out: list[StepPlan] = out) -> StepPlan:
            plan: StepPlan = schedule()
            out.append(plan)
            return plan

        d.sched.schedule = recording  # type: ignore[method-assign]
    for k, batch in enumerate(arrivals):
        for d in drivers:
            for r in batch:
                d.add(r)
            d.step()
        assert plans[0][-1] == plans[1][-1], f"{mode_text}: plans differ at step {k + 1}"
        if k % 8 == 0:
            assert drivers[0].sched.view() == drivers[1].sched.view(), f"{mode_text}: views differ at step {k + 1}"
    assert drivers[0].sched.view() == drivers[1].sched.view()
    return plans[1]


@pytest.mark.parametrize("mode_text", MODES)
def test_steady_decode_equals_spec(mode_text: str) -> None:
    mode = bench.parse_modes(mode_text)[0]
    k = mode.num_speculative_tokens
    cfg = bench.decode_config(24, gen=160, mode=mode)
    # max_tokens 120: every request reaches it inside the run (the max_tokens
    # skip with steps in flight, finishing by length)
    arrivals = [bench.decode_requests(24, max_tokens=120)] + [[] for _ in range(200)]
    plans = _drive(mode_text, cfg, arrivals)
    entries = [s for p in plans for s in p.scheduled]
    if mode.async_scheduling:
        steady = [
            s for s in entries
            if s.num_output_placeholders == 1 + k and s.num_scheduled_tokens == 1 + k and set(s.token_ids) == {-1}
        ]
    else:
        steady = [
            s for s in entries
            if s.spec_token_ids and s.num_computed_tokens == s.num_tokens - 1
            and s.token_ids[1:] == s.spec_token_ids
        ]
    assert len(steady) > len(entries) // 2
    assert not plans[-1].scheduled  # every request finished


@pytest.mark.parametrize("mode_text", ("async", "sync+spec3", "async+spec3"))
def test_mixed_trace_equals_spec(mode_text: str) -> None:
    mode = bench.parse_modes(mode_text)[0]
    plans = _drive(mode_text, bench.mixed_config(mode), bench.mixed_arrivals(120))
    assert any(p.preempted_ids for p in plans) or any(p.finished_ids for p in plans)
