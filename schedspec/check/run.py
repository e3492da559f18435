"""Running one workload: the driver over its events, the run to quiescence
of a workload with a KV connector or hybrid groups, the fast plans-only
lockstep, and the spec's rule counts of a run. The check loop
(check/gate.py), the shrinker (through ``failure_of``) and ``schedspec
replay`` run workloads through these."""

from __future__ import annotations

from typing import Callable, Sequence

from schedspec.invariants import Invariant
from schedspec.spec.interface import SchedulerConfig, SchedulerFactory
from schedspec.spec.kv_events import KVCacheEvent
from schedspec.spec.scheduler import SpecScheduler
from schedspec.spec.effects import enable as enable_effects

from schedspec.check.driver import Runner
from schedspec.check.records import Failure
from schedspec.check.workload import Workload


def needs_quiescence(config: SchedulerConfig) -> bool:
    """Whether a workload of ``config`` ends with the run to quiescence (a
    KV connector or hybrid KV cache groups: Runner.quiesce)."""
    return config.kv_connector or config.is_hybrid


def run_workload(workload: Workload, factories: dict[str, SchedulerFactory], vocab: int = 64,
                 oracle_seed: int = 0, keep_history: bool = False,
                 plans_only: bool = False,
                 invariants: Sequence[Invariant] | None = None,
                 stop_at: float | None = None,
                 kv_event_sink: Callable[[int, tuple[KVCacheEvent, ...]], None] | None = None,
                 ) -> tuple[Runner, Failure | None]:
    """Run one workload. ``plans_only``: compare plans (and model outputs) at
    every step but views only once, at the end, with no invariants: the fast
    lockstep; a failure it finds is re-run with everything on. ``invariants``:
    the ones to check (None: the whole catalogue). With one factory nothing is
    compared: the invariants alone judge it. A workload with a KV connector
    or hybrid groups then runs to quiescence (``needs_quiescence``): every
    request finished, every worker report delivered, every block free.
    ``stop_at`` (time.monotonic()): stop between two events once it has
    passed (``runner.stopped``; no quiescence then). A call into a scheduler
    past its deadline (check/deadline.py) is a Failure of kind "timeout"."""
    runner = Runner(workload.config, factories, vocab=vocab, oracle_seed=oracle_seed,
                    keep_history=keep_history, check_invariants=not plans_only,
                    compare_views=not plans_only, invariants=invariants)
    runner.kv_event_sink = kv_event_sink  # the KV cache events of each update (Runner.kv_event_sink)
    enable_effects(runner.scheds.get(runner.names[0]))  # effect coverage: the reference's (spec/effects.py)
    failure = runner.run(workload.events, stop_at=stop_at)
    if runner.stopped:
        return runner, failure
    if failure is None and needs_quiescence(workload.config):
        failure = runner.quiesce()
    if failure is None and plans_only and len(factories) > 1:
        failure = runner.compare_final_views()
    return runner, failure


def failure_of(workload: Workload, factories: dict[str, SchedulerFactory], vocab: int = 64,
               oracle_seed: int = 0, invariants: Sequence[Invariant] | None = None) -> Failure | None:
    """What ``run_workload`` finds on ``workload`` with everything checked
    (the shrinker's check of a candidate), None when it holds."""
    return run_workload(workload, factories, vocab, oracle_seed=oracle_seed, invariants=invariants)[1]


def count_rules(runner: Runner, workload: Workload, seed: int, vocab: int) -> None:
    """Add the spec's rule counts for ``workload`` to ``runner.stats``: the
    reference's (the first scheduler), or, when it keeps none (invariants
    mode against another scheduler), a run of the spec alone on the same events."""
    primary = runner.scheds.get(runner.names[0])  # None: it could not be built (the run's failure)
    if primary is not None and runner.stats.absorb_rules(primary):
        return
    spec = Runner(workload.config, {"spec": SpecScheduler}, vocab=vocab, oracle_seed=seed,
                  check_invariants=False, compare_views=False)
    enable_effects(spec.primary)
    spec.run(workload.events)
    runner.stats.absorb_rules(spec.primary)
