"""ImplScheduler.clone(): an independent scheduler in the same state.

The model checker replays every transition of a state on its own copy of the
impl, so a clone that shares a mutable structure with its original (a block
table, a queue entry, a prefix-index node) would let one transition leak into
another. Each test clones at many points of seeded random workloads (between
operations and between schedule() and update()), then drives the original and
the clone through the same remaining events, and asserts:

- the clone's view equals the original's at the moment of cloning;
- the original running on does not change the clone (its view is unchanged);
- both then make identical plans and views, and equal to the spec's.
"""

from __future__ import annotations

import copy
import pickle

import pytest

from schedspec.check.oracle import FakeModel
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Step, random_workload
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import Policy, RequestSpec, SchedulerConfig, SchedulerView
from schedspec.spec.scheduler import SpecScheduler


class _Run:
    """A scheduler and its fake model (the model's KV slots are state too)."""

    def __init__(self, sched: ImplScheduler | SpecScheduler, model: FakeModel) -> None:
        self.sched = sched
        self.model = model
        self.log: list[object] = []

    def fork(self) -> "_Run":
        assert isinstance(self.sched, ImplScheduler)
        model = copy.copy(self.model)
        model.slots = dict(self.model.slots)
        return _Run(self.sched.clone(), model)

    def event(self, e: Event, fork_mid_step: bool = False) -> "_Run | None":
        """Apply one event; for a step with ``fork_mid_step``, fork between
        schedule() and update() and return the fork (which then updates too)."""
        s = self.sched
        fork = None
        if isinstance(e, AddRequest):
            s.add(e.request)
        elif isinstance(e, Abort):
            if e.request_id in s.view().requests:
                s.abort(e.request_id)
        elif isinstance(e, ResetPrefixCache):
            self.log.append(s.reset_prefix_cache(e.reset_running_requests))
        else:
            plan = s.schedule()
            self.log.append(plan)
            if fork_mid_step:
                fork = self.fork()
            result, _ = self.model.run(plan)
            s.update(plan, result)
            if fork is not None:
                fork.model.run(plan)
                fork.sched.update(plan, result)
                fork.log.append(plan)
        self.log.append(s.view())
        return fork


@pytest.mark.parametrize("seed", range(12))
def test_clone_is_independent_and_equal(seed: int) -> None:
    w = random_workload(seed, 40, vocab=8)
    events = list(w.events)
    orig = _Run(ImplScheduler(w.config), FakeModel(w.config.block_size, 8, seed))
    ref = _Run(SpecScheduler(w.config), FakeModel(w.config.block_size, 8, seed))
    forks: list[tuple[int, _Run, SchedulerView]] = []
    every = max(1, len(events) // 8)
    for i, e in enumerate(events):
        if i % every == 0:
            f = orig.fork()
            assert f.sched.view() == orig.sched.view()
            forks.append((i, f, f.sched.view()))
        mid = orig.event(e, fork_mid_step=i % every == 1 and isinstance(e, Step))
        ref.event(e)
        if mid is not None:
            forks.append((i + 1, mid, mid.sched.view()))
    # The original ran on: every fork still holds the state it was made in.
    for _, f, snap in forks:
        assert f.sched.view() == snap
    # Each fork replays the rest of the workload and ends where the spec did.
    for start, f, _ in forks:
        for e in events[start:]:
            f.event(e)
        assert f.sched.view() == ref.sched.view()


@pytest.mark.parametrize("policy", [Policy.FCFS, Policy.PRIORITY])
def test_clone_matches_pickle_round_trip(policy: Policy) -> None:
    """A clone and a pickle round trip of the same state behave alike under
    pressure (preemptions, prefix hits, aborts of waiting requests)."""
    cfg = SchedulerConfig(block_size=2, num_blocks=6, max_num_batched_tokens=4, max_num_seqs=3,
                          max_model_len=10, policy=policy)
    s = ImplScheduler(cfg)
    model = FakeModel(2, 8, 1)
    for k in range(5):
        s.add(RequestSpec(f"r{k}", (1, 2, 3, k % 2), 4, priority=k % 3, arrival=k))
    for _ in range(3):
        plan = s.schedule()
        s.update(plan, model.run(plan)[0])
    s.abort("r4")
    a, b = s.clone(), pickle.loads(pickle.dumps(s))
    ma, mb = copy.deepcopy(model), copy.deepcopy(model)
    for k in range(5, 8):
        a.add(RequestSpec(f"r{k}", (1, 2, 3), 3, priority=k % 3, arrival=k))
        b.add(RequestSpec(f"r{k}", (1, 2, 3), 3, priority=k % 3, arrival=k))
    for _ in range(12):
        pa, pb = a.schedule(), b.schedule()
        assert pa == pb
        a.update(pa, ma.run(pa)[0])
        b.update(pb, mb.run(pb)[0])
        assert a.view() == b.view()
