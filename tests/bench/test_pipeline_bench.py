"""The bench's pipeline mode (``sync+ppK``: k plans in flight without async scheduling)."""

from __future__ import annotations

import importlib.util

import pytest

from schedspec.bench.scheduler import KvLayout, Mode, parse_modes, run_bench, workload_plans
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import SchedulerConfig, SchedulerFactory
from schedspec.spec.scheduler import SpecScheduler


def test_pipeline_modes_parse_label_and_shape_the_config() -> None:
    assert parse_modes("sync+pp2,sync+pp4") == (Mode(False, 0, 2), Mode(False, 0, 4))
    assert Mode(False, 0, 3).label == "sync+pp3" and Mode(False, 0, 3).suffix == " sync+pp3"
    cfg = Mode(False, 0, 2).apply(SchedulerConfig())
    assert cfg.pipeline_parallel_size == 2 and cfg.max_concurrent_batches == 2
    for bad in ("async+pp2", "sync+pp2+spec3", "sync+pp5"):
        with pytest.raises(ValueError):
            parse_modes(bad)


def test_a_pipeline_row_keeps_k_plans_in_flight_and_its_schedulers_agree() -> None:
    mode = Mode(False, 0, 2)
    factories: dict[str, SchedulerFactory] = {"spec": SpecScheduler, "impl": ImplScheduler}
    if importlib.util.find_spec("vllm") is not None:
        from schedspec.adapters.registry import resolve

        factories["vllm"] = resolve("vllm").factory
    plans = {name: workload_plans(f, "decode", 12, mode, KvLayout("plain"), running=8) for name, f in factories.items()}
    for name in factories:
        assert plans[name] == plans["spec"], name
    # every request decodes in every other plan: its step is in flight in between
    assert [bool(p.scheduled) for p in plans["spec"][-4:]] in ([True, False, True, False], [False, True, False, True])
    rows = run_bench({"impl": ImplScheduler}, running=(8,), steps=3, mixed_steps=10, max_seconds=1.0,
                     memory=False, modes=(mode,))
    assert [r.mode for r in rows] == ["sync+pp2", "sync+pp2"] and all(r.steps >= 3 for r in rows)
