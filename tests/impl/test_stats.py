"""impl's scheduler statistics (impl/stats.py) equal the spec's in lockstep
in every mode and KV layout; off by default."""

from __future__ import annotations

import pytest

from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.impl import ImplScheduler
from schedspec.spec import RequestSpec, SchedulerConfig, SpecScheduler, StepResult
from schedspec.spec.interface import SchedulerConfig as Config


def factories() -> dict[str, object]:
    return {"spec": lambda c: SpecScheduler(c, log_stats=True), "impl": lambda c: ImplScheduler(c, log_stats=True)}


@pytest.mark.parametrize("modes,kv", [(("sync",), ()), (("async",), ()), (("spec",), ()), (("async-spec",), ()),
                                      (("sync", "async", "spec", "async-spec"), ("connector", "hybrid"))])
def test_impl_reports_the_specs_statistics(modes: tuple[str, ...], kv: tuple[str, ...]) -> None:
    reports = hits = preemptions = 0
    for seed in range(3):
        w = random_workload(seed, 120, modes=modes, kv=kv)
        runner, failure = run_workload(w, factories(), oracle_seed=seed)  # type: ignore[arg-type]
        assert failure is None, failure.describe()
        reports += runner.stats.stats_reports
        hits += runner.stats.hit_admissions
        preemptions += runner.stats.preemptions
    assert reports > 200 and (hits or preemptions)


def test_off_by_default_and_a_clone_shares_nothing() -> None:
    cfg: Config = SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=32, max_model_len=32)
    assert ImplScheduler(cfg).make_stats() is None
    s = ImplScheduler(cfg, log_stats=True)
    s.add(RequestSpec("a", tuple(range(1, 10)), 4))
    plan = s.schedule()
    c = s.clone()
    s.update(plan, StepResult({"a": (5,)}, {}))
    mine = s.make_stats()
    assert mine is not None and mine.prefix_cache_stats.queries == 9
    c.update(plan, StepResult({"a": (5,)}, {}))
    theirs = c.make_stats()
    assert theirs == mine  # the clone counted the same lookup, on its own
    assert s.make_stats() is not None and s.make_stats().prefix_cache_stats.queries == 0  # type: ignore[union-attr]


def test_a_record_built_in_place_equals_the_constructors() -> None:
    """make_stats fills fresh instances' ``__dict__``: each record equals,
    hashes, prints and pickles as the dataclass constructor's."""
    import dataclasses
    import pickle

    cfg: Config = SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=32, max_model_len=32,
                                  enable_prefix_caching=True)
    s = ImplScheduler(cfg, log_stats=True)
    s.add(RequestSpec("a", tuple(range(1, 10)), 4))
    plan = s.schedule()
    s.update(plan, StepResult({"a": (5,)}, {}))
    mine = s.make_stats()
    assert mine is not None
    prefix = mine.prefix_cache_stats
    built = dataclasses.replace(mine, prefix_cache_stats=dataclasses.replace(prefix))
    for a, b in ((mine, built), (prefix, built.prefix_cache_stats)):
        assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
        assert pickle.loads(pickle.dumps(a)) == b and list(vars(a)) == list(vars(b))
    assert mine.num_running_reqs == 1 and prefix.requests == 1 and prefix.queries == 9
