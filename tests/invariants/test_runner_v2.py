"""Model Runner V2's decode throttle invariant (invariants/runner_v2.py):
it holds on the spec's transitions and fires, under its id, on a scheduler
that decodes a request in consecutive steps with a pipeline of 3."""

from __future__ import annotations

import dataclasses

from schedspec.invariants import BY_ID, Monitor, Transition
from schedspec.spec.interface import SchedulerConfig
from tests.invariants.test_inflight import Recorder

RUNNER_V2_IDS = ("v2-decode-throttle",)


def _config(runner: str, pp: int) -> SchedulerConfig:
    return SchedulerConfig(block_size=4, num_blocks=33, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64,
                           async_scheduling=True, model_runner=runner, pipeline_parallel_size=pp)


def _transitions(cfg: SchedulerConfig, steps: int) -> list[Transition]:
    rec = Recorder(cfg)
    rec.add("r0", 4, 40)
    rec.add("r1", 5, 40)
    plan = rec.schedule()
    for _ in range(steps):
        nxt = rec.schedule()
        rec.update(plan, {e.request_id: (7,) for e in plan.scheduled if e.samples})
        plan = nxt
    return rec.log


def _violations(log: list[Transition], inv_id: str) -> list[str]:
    monitor = Monitor([BY_ID[inv_id]])
    return [v.message for t in log for v in monitor.observe(t)]


def test_throttle_invariant_holds_on_the_spec() -> None:
    log = _transitions(_config("v2", 3), 12)
    monitor = Monitor()
    assert [v for t in log for v in monitor.observe(t)] == []


def test_throttle_invariant_fires_on_a_scheduler_that_ignores_it() -> None:
    # the V1 runner's transitions (a decode every step) shown as V2 with a pipeline of 3
    v2 = _config("v2", 3)
    log = [dataclasses.replace(t, before=dataclasses.replace(t.before, config=v2),
                               after=dataclasses.replace(t.after, config=v2))
           for t in _transitions(_config("v1", 1), 4)]
    found = _violations(log, "v2-decode-throttle")
    assert found and "1 step(s) after it sampled in step 1" in found[0]
    assert _violations(_transitions(_config("v1", 1), 4), "v2-decode-throttle") == []
