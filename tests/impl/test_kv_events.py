"""impl's KV cache events equal the spec's, event for event, in every mode
and KV layout; with events off impl keeps no queue and builds no event."""

from __future__ import annotations

import dataclasses

import pytest

from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.impl import ImplScheduler
from schedspec.spec import SpecScheduler
from tests.helpers import cfg, req, step


@pytest.mark.parametrize("modes, kv", [
    (("sync",), ()), (("async",), ()), (("spec",), ()), (("async-spec",), ()),
    (("sync",), ("hybrid",)), (("async",), ("hybrid", "connector")), (("sync",), ("connector",)),
])
def test_impl_streams_equal_the_spec_in_lockstep(modes: tuple[str, ...], kv: tuple[str, ...]) -> None:
    events = 0
    for seed in range(2):
        w = random_workload(seed, 120, modes=modes, kv=kv,
                            gates=("lora", "pause") if "connector" not in kv else ())
        w = dataclasses.replace(w, config=dataclasses.replace(w.config, enable_kv_cache_events=True))
        runner, failure = run_workload(w, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed)
        assert failure is None, failure.describe()
        events += runner.stats.kv_cache_events
    assert events > 0


def test_events_off_build_nothing() -> None:
    s = ImplScheduler(cfg())
    s.add(req("a", 9))
    step(s)
    assert s._px.events is None and s.take_kv_events() == ()


def test_impl_names_the_same_events_as_the_spec() -> None:
    a, b = SpecScheduler(cfg(enable_kv_cache_events=True)), ImplScheduler(cfg(enable_kv_cache_events=True))
    for s in (a, b):
        s.add(req("x", 9, max_tokens=5))
        s.add(req("y", [0, 1, 2, 3, 9, 9, 9, 9, 9], max_tokens=5))
    for _ in range(6):
        step(a)
        step(b)
        assert a.take_kv_events() == b.take_kv_events()
