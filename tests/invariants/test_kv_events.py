"""The KV cache event invariants (invariants/kv_events.py) and the router
mirror they keep (invariants/kv_mirror.py): each shown firing on a crafted
update of a real spec run, silent on the untouched one, and silent on whole
seeded runs of the spec (plain and hybrid layouts, sync and async)."""

from __future__ import annotations

import dataclasses

import pytest

from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.invariants import BY_ID, CATALOGUE, Monitor, Transition
from schedspec.invariants.core import History
from schedspec.invariants.kv_mirror import KVMirror
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import BlockKey, RequestSpec, SchedulerConfig, StepResult
from schedspec.spec.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

KV_EVENT_IDS = (
    "kv-events-mirror-exact",
    "kv-events-parent-stored",
    "kv-events-removed-once-per-store",
    "kv-events-cleared-on-reset",
)

CFG = SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32,
                      enable_kv_cache_events=True)


def _updates(prompts: list[tuple[int, ...]], steps: int) -> tuple[list[Transition], SpecScheduler]:
    """Every update of a spec run with events on, as a driver shows it."""
    s = SpecScheduler(CFG)
    for i, p in enumerate(prompts):
        s.add(RequestSpec(f"r{i}", p, 3, arrival=i))
    out: list[Transition] = []
    for _ in range(steps):
        plan = s.schedule()
        before = s.view()
        result = StepResult({e.request_id: (7,) for e in plan.scheduled if e.samples})
        s.update(plan, result)
        out.append(Transition("update", before, s.view(), plan=plan, result=result, kv_events=s.take_kv_events()))
    return out, s


def _first_update() -> Transition:
    ts, _ = _updates([tuple(range(9))], 1)
    assert any(isinstance(e, BlockStored) for e in ts[0].kv_events)
    return ts[0]


def test_every_kv_event_invariant_is_catalogued_and_requires_kv_events() -> None:
    ids = [inv.id for inv in CATALOGUE if inv.id.startswith("kv-events-")]
    assert tuple(ids) == KV_EVENT_IDS
    for i in ids:
        assert BY_ID[i].requires == frozenset({"kv_events"}) and BY_ID[i].is_safety


def test_the_untouched_update_is_silent() -> None:
    t = _first_update()
    assert Monitor([BY_ID[i] for i in KV_EVENT_IDS]).observe(t) == []


def _fires(inv_id: str, t: Transition, h: History | None = None) -> list[str]:
    found = BY_ID[inv_id].check(t, h)
    assert all(v.invariant_id == inv_id for v in found)
    return [v.message for v in found]


def test_mirror_exact_fires_on_a_stored_block_never_reported() -> None:
    t = _first_update()
    assert _fires("kv-events-mirror-exact", dataclasses.replace(t, kv_events=()))
    assert not _fires("kv-events-mirror-exact", t)


def test_mirror_exact_fires_on_a_block_reported_twice() -> None:
    """The index counts the blocks under each key: a stream reporting one
    block twice describes a cache with two."""
    t = _first_update()
    stored = [e for e in t.kv_events if isinstance(e, BlockStored)]
    assert _fires("kv-events-mirror-exact", dataclasses.replace(t, kv_events=t.kv_events + (stored[0],)))


def test_parent_stored_fires_on_a_parent_never_stored() -> None:
    t = _first_update()
    first = next(e for e in t.kv_events if isinstance(e, BlockStored))
    orphan = dataclasses.replace(first, parent_key=("", (99, 99, 99, 99)))
    assert _fires("kv-events-parent-stored", dataclasses.replace(t, kv_events=(orphan,)))
    # a sliding-window group's parent may be a block its mask never cached
    sw = dataclasses.replace(orphan, kind="sliding_window")
    assert not _fires("kv-events-parent-stored", dataclasses.replace(t, kv_events=(sw,)))


def test_parent_stored_holds_across_steps_and_removal() -> None:
    """A decode step's block names the block before it, stored in an earlier
    update: silent with the history, firing without it."""
    ts, _ = _updates([tuple(range(7))], 6)
    m = Monitor([BY_ID["kv-events-parent-stored"]])
    later = [t for t in ts if any(isinstance(e, BlockStored) and e.parent_key for e in t.kv_events)]
    assert later
    for t in ts:
        assert m.observe(t) == []
    assert _fires("kv-events-parent-stored", later[0])


def test_removed_once_per_store_fires_on_a_second_removal() -> None:
    t = _first_update()
    first = next(e for e in t.kv_events if isinstance(e, BlockStored))
    gone = BlockRemoved((first.block_keys[0],), MEDIUM_GPU, 0)
    assert not _fires("kv-events-removed-once-per-store", dataclasses.replace(t, kv_events=(first, gone)))
    assert _fires("kv-events-removed-once-per-store", dataclasses.replace(t, kv_events=(first, gone, gone)))


def test_cleared_on_reset_fires_without_a_reset_and_when_missing() -> None:
    ts, s = _updates([tuple(range(9))], 6)  # runs to its end: every block free
    h = History()
    for t in ts:
        h.record(t)
    before = s.view()
    assert s.reset_prefix_cache()
    h.record(Transition("reset", before, s.view()))
    assert h.kv_resets == 1
    plan = s.schedule()
    mid = s.view()
    s.update(plan, StepResult({}))
    events = s.take_kv_events()
    assert events == (AllBlocksCleared(),)
    t = Transition("update", mid, s.view(), plan=plan, result=StepResult({}), kv_events=events)
    assert not _fires("kv-events-cleared-on-reset", t, h)
    assert _fires("kv-events-cleared-on-reset", dataclasses.replace(t, kv_events=()), h)
    assert _fires("kv-events-cleared-on-reset", t, History())  # no reset emptied the cache


def test_a_refused_reset_owes_no_event() -> None:
    s = SpecScheduler(CFG)
    s.add(RequestSpec("a", tuple(range(9)), 3))
    plan = s.schedule()
    s.update(plan, StepResult({"a": (7,)}))
    h = History()
    before = s.view()
    assert not s.reset_prefix_cache()  # a request holds blocks
    h.record(Transition("reset", before, s.view()))
    assert h.kv_resets == 0


def test_the_mirror_counts_blocks_per_key_and_clears() -> None:
    k: BlockKey = ("", (1, 2, 3, 4))
    m = KVMirror()
    stored = BlockStored((k,), None, k[1], 4, None, MEDIUM_GPU, 1, "sliding_window")
    assert m.apply_all([stored, stored]) == []
    assert m.index() == {("\x1d1", k[1]): 2}
    assert m.apply(BlockRemoved((k,), MEDIUM_GPU, 1)) == []
    assert m.index() == {("\x1d1", k[1]): 1}
    assert m.index("CPU") == {}
    m.apply(AllBlocksCleared())
    assert m.index() == {} and [p for p, _ in m.apply(BlockRemoved((k,), MEDIUM_GPU, 1))] == ["removed"]


@pytest.mark.parametrize("modes, kv", [(("sync",), ()), (("async",), ()), (("sync",), ("hybrid",)),
                                       (("async-spec",), ("hybrid",)), (("spec",), ("connector",))])
def test_no_false_alarms_on_spec_runs(modes: tuple[str, ...], kv: tuple[str, ...]) -> None:
    events = 0
    for seed in range(3):
        w = random_workload(seed, 120, modes=modes, kv=kv)
        w = dataclasses.replace(w, config=dataclasses.replace(w.config, enable_kv_cache_events=True))
        runner, failure = run_workload(w, {"spec": SpecScheduler}, oracle_seed=seed)
        assert failure is None, failure.describe()
        events += runner.stats.kv_cache_events
    assert events > 0
