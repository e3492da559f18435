"""impl and the spec in lockstep on seeded workloads with the KV connector
(loads sync and async, failures under both policies, aborts during loads,
async saves, the bounded wait), in every mode, to quiescence.

The fake model's context check is set aside: it judges what the spec asks
the model to read (tests/check), not whether impl equals the spec."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pytest

import schedspec.check.oracle as oracle
from schedspec.check.run import run_workload
from schedspec.check.random_workloads import random_workload
from schedspec.impl import ImplScheduler
from schedspec.spec.scheduler import SpecScheduler


def _lenient(monkeypatch: pytest.MonkeyPatch) -> None:
    def execute(self: Any, plan: Any, context: Mapping[str, Sequence[int]] | None = None) -> Any:
        truth = None if context is None else {rid: tuple(t) for rid, t in context.items()}
        return self.run(plan, truth)[0]

    def execute_recorded(self: Any, plan: Any, recorded: Any, context: Mapping[str, Sequence[int]] | None = None) -> Any:
        truth = None if context is None else {rid: tuple(t) for rid, t in context.items()}
        return self.run(plan, truth, recorded)[0]

    monkeypatch.setattr(oracle.FakeModel, "execute", execute)
    monkeypatch.setattr(oracle.FakeModel, "execute_recorded", execute_recorded)


def connector_workload(seed: int, mode: str, gates: tuple[str, ...] = ()) -> Any:
    return random_workload(seed, 60, modes=(mode,), gates=gates, kv=("connector",))


@pytest.mark.parametrize("mode", ["sync", "async", "spec", "async-spec"])
def test_connector_workloads_run_in_lockstep(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _lenient(monkeypatch)
    with_connector = 0
    for seed in range(10):
        w = connector_workload(seed, mode)
        with_connector += w.config.kv_connector  # each workload draws a subset of the KV features
        runner, failure = run_workload(w, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed,
                                       invariants=[])
        assert failure is None, f"seed {seed}: " + failure.describe()
    assert with_connector >= 4


@pytest.mark.parametrize("mode", ["sync", "async-spec"])
def test_connector_with_every_gate_runs_in_lockstep(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _lenient(monkeypatch)
    gates = ("lora", "grammar", "pause", "watermark", "cadence", "encoder")
    for seed in range(100, 104):
        w = connector_workload(seed, mode, gates)
        runner, failure = run_workload(w, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed,
                                       invariants=[])
        assert failure is None, f"seed {seed}: " + failure.describe()
