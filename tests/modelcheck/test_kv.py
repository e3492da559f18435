"""The model checker with the KV connector and hybrid KV cache groups (bounds
``connector``, ``hybrid`` and ``connector-hybrid``): the worker's reports as
transitions, the bounded wait, quiescence, view-only fingerprints with the
connector's and the groups' fields, and broken schedulers caught with a
replayable trace."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from schedspec.check import trace as tracefile
from schedspec.check.capabilities import Capabilities
from schedspec.check.workload import KV_REPORT_BOUND, KVLoadDone, KVLoadFailed, KVSaveDone, Step
from schedspec.cli.main import main
from schedspec.invariants import CATALOGUE
from schedspec.modelcheck import Expander, Explorer, bound
from schedspec.modelcheck.coverage import KV_COVERAGE
from schedspec.modelcheck.events import KV_OPS, STEP
from schedspec.modelcheck.kvworld import KVWorld
from schedspec.modelcheck.space import Space
from schedspec.modelcheck.state import Canon, expected_memory
from schedspec.spec.interface import KVCacheGroup, RequestStatus, StepResult
from schedspec.spec.kv_cache import KVPool
from schedspec.spec.kv_cache import CacheHit
from schedspec.spec.kv_groups import find_group_hit, skipped_blocks_to_free
from schedspec.spec.kv_kinds import NULL_BLOCK
from schedspec.spec.scheduler import SpecScheduler

HERE = Path(__file__).resolve().parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

#: the invariants the checks below run: the whole catalogue but
#: no-starvation (it fires where a running request preempts itself while an
#: asynchronous load holds the pool, as vLLM does; reported to INV15) and
#: waiting-queue-order (stale before invariants commit cb1dc65)
STALE = frozenset({"waiting-queue-order", "no-starvation"})
INVARIANTS = tuple(i for i in CATALOGUE if i.id not in STALE)


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


def _space(bound_name: str, name: str) -> Space:
    return next(s for s in bound(bound_name).spaces if s.name == name)


class LeaksAbortedLoad(SpecScheduler):
    """Forgets a request aborted during its asynchronous load when the worker
    reports the load, without freeing its blocks (vLLM #46283: the blocks
    are never reclaimed)."""

    CAPABILITIES = Capabilities().with_kv()

    def _update_from_kv_xfer_finished(self, result: StepResult) -> None:
        gone = {rid for rid in result.finished_recving if rid not in self.requests and rid in self.held
                and self.held[rid].status is RequestStatus.FINISHED_ABORTED}
        for rid in gone:
            self.kv_loading.pop(rid, None)
            del self.held[rid]
        super()._update_from_kv_xfer_finished(dataclasses.replace(
            result, finished_recving=tuple(r for r in result.finished_recving if r not in gone)))


class _WindowBlindPool(KVPool):
    """The hybrid coordinator's hit taken from the full-attention group alone,
    the sliding-window group given null blocks for the whole hit (a hit that
    is not valid in every group: vLLM #43559)."""

    def find_longest_cache_hit(self, key_of, max_length):  # type: ignore[no-untyped-def]
        lay = self.layout
        if lay.coordinator != "hybrid":
            return super().find_longest_cache_hit(key_of, max_length)
        full = next(sp for sp in lay.spec_groups if sp.is_full)
        found, length = find_group_hit(full, self._lookup(key_of, full), max_length, lay.block_size)
        blocks: list[list[int]] = [[] for _ in range(lay.num_groups)]
        for gid, got in zip(full.group_ids, found):
            blocks[gid] = got
        for sp in lay.spec_groups:
            if not sp.is_full:
                for gid in sp.group_ids:
                    blocks[gid] = [NULL_BLOCK] * (length // lay.block_size)
        return CacheHit(blocks, length, 0)


class WindowBlindHit(SpecScheduler):
    """Serves a prefix hit the sliding-window group cannot back."""

    CAPABILITIES = Capabilities().with_kv()

    def __init__(self, config):  # type: ignore[no-untyped-def]
        super().__init__(config)
        self.kv.__class__ = _WindowBlindPool


class _ChunkEagerPool(KVPool):
    """Frees a chunked-local group's blocks up to the end of the next
    token's chunk instead of up to its start: the blocks of the chunk the
    next token attends are gone (the skipped-token formula one chunk ahead)."""

    def remove_skipped_blocks(self, req, processed_computed_tokens):  # type: ignore[no-untyped-def]
        super().remove_skipped_blocks(req, processed_computed_tokens)
        lay = self.layout
        for group, table in zip(lay.groups, self.tables(req)):
            if group.kind == "chunked_local":
                chunk = group.attention_chunk_size
                ahead = (processed_computed_tokens // chunk + 1) * chunk
                freed = skipped_blocks_to_free(table, min(ahead, len(table) * lay.block_size), lay.block_size)
                if freed:
                    self.free_blocks(freed)


class ChunkEagerFree(SpecScheduler):
    """Frees the chunk a chunked-local group still attends."""

    CAPABILITIES = Capabilities().with_kv()

    def __init__(self, config):  # type: ignore[no-untyped-def]
        super().__init__(config)
        self.kv.__class__ = _ChunkEagerPool


def test_bounds_spaces_and_alphabet() -> None:
    conn = bound("connector")
    assert {s.config.kv_load_failure_policy for s in conn.spaces} == {"fail", "recompute"}
    assert all(s.kv() == ("connector",) for s in conn.spaces)
    assert all(s.kv_report_bound <= KV_REPORT_BOUND for s in conn.spaces)
    hyb = bound("hybrid")
    assert all(s.kv() == ("hybrid",) for s in hyb.spaces)
    kinds = {tuple((g.kind, g.sliding_window) for g in s.config.kv_cache_groups) for s in hyb.spaces}
    assert (("sliding_window", 2),) in kinds  # a lone sliding-window group
    assert (("full_attention", 0), ("sliding_window", 2)) in kinds  # a window of 1 block
    assert (("full_attention", 0), ("sliding_window", 4)) in kinds  # of 2 blocks
    chunks = {tuple((g.kind, g.attention_chunk_size) for g in s.config.kv_cache_groups) for s in hyb.spaces}
    assert (("full_attention", 0), ("chunked_local", 2)) in chunks  # a chunk of 1 block beside full attention
    assert (("chunked_local", 2),) in chunks  # a lone chunked-local group
    assert all(s.kv() == ("connector", "hybrid") for s in bound("connector-hybrid").spaces)
    shapes = {sh.name: sh for s in conn.spaces for sh in s.shapes}
    assert shapes["KW"].kv_load_async and shapes["KV"].kv_save_async and shapes["KS"].kv_external_tokens
    # the report events: every op of KV_OPS for each position
    ex = Expander(_space("connector", "conn-async-recompute"))
    a = ex.alphabet
    assert a.kv_ops == ("done", "failed@1", "save")
    assert a.label(a.kv_code("done", 0)) == "step, load done #0"
    assert a.label(a.kv_code("failed@1", 1)) == "step, load failed #1 at block 1"
    assert a.label(a.kv_code("save", 0)) == "step, save done #0"
    assert {op for op, *_ in KV_OPS} >= set(a.kv_ops)
    # more than one group: a failure is the whole load's, no synchronous failure
    hx = Expander(_space("connector-hybrid", "conn-hyb-sync-recompute"))
    assert hx.alphabet.kv_ops == ("done", "failed", "save")
    assert hx.alphabet.abort_in_step is False


def test_fingerprint_holds_the_connector_and_group_fields() -> None:
    space = _space("connector", "conn-async-fail")
    ex = Expander(space)
    root = ex.root()
    s = root.state
    s.add(ex.request(0, 1))
    v = s.view()
    world = KVWorld()
    fp = ex.full_fingerprint(v, None, s, False, world)
    held = dataclasses.replace(v, kv_held_by_finished={"r9": (1,)})
    assert ex.full_fingerprint(held, None, s, False, world) != fp
    done = dataclasses.replace(v, kv_loads_done=("r1",))
    assert ex.full_fingerprint(done, None, s, False, world) != fp
    failed = dataclasses.replace(v, kv_loads_failed=("r1",))
    assert ex.full_fingerprint(failed, None, s, False, world) != fp
    # hybrid: every group's table is in a request's row
    canon = Canon(2, False, hybrid=True)
    r = v.requests["r1"]
    a = dataclasses.replace(v, requests={"r1": dataclasses.replace(r, group_block_ids=((1,), (2,)))})
    b = dataclasses.replace(v, requests={"r1": dataclasses.replace(r, group_block_ids=((1,), (NULL_BLOCK,)))})
    assert canon.fingerprint(a) != canon.fingerprint(b)
    # a request waiting for remote KV vouches for no slot
    waiting = dataclasses.replace(v, requests={"r1": dataclasses.replace(
        r, status=RequestStatus.WAITING_FOR_REMOTE_KVS, num_computed_tokens=2, block_ids=(1, 2))})
    assert expected_memory(waiting) == {}


def test_a_synchronous_failure_shared_in_its_step() -> None:
    """conn-sync-recompute: a synchronous load failing at block 0 under
    "recompute" while another request hits that block in the same step. vLLM
    lets the second holder count the block computed because the first one
    recomputes it; the checker's one finding is the vLLM defect where the
    first one is aborted before it does (docs/divergences.md): the shortest
    path ends at that abort (invalid-block-not-computed), and without that
    invariant the fake model finds the context wrong at the next step. Spec
    and vLLM agree on it (tests/check/test_kv_shared_invalid_defects.py)."""
    r = Explorer(_space("connector", "conn-sync-recompute"), invariants=INVARIANTS).run()
    assert r.failure is not None
    assert {v.invariant_id for v in r.failure.violations} == {"invalid-block-not-computed"}, r.failure.describe()
    assert r.failure.labels[-2:] == ("step, sync load failed #0 at block 0", "abort #0"), r.failure.labels
    rest = tuple(i for i in INVARIANTS if i.id != "invalid-block-not-computed")
    r = Explorer(_space("connector", "conn-sync-recompute"), invariants=rest).run()
    assert r.failure is not None and "kv-context" in r.failure.describe(), r.failure
    assert r.failure.labels[-3:] == ("step, sync load failed #0 at block 0", "abort #0", "step"), r.failure.labels


def test_async_loads_saves_and_the_bounded_wait() -> None:
    r = Explorer(_space("connector", "conn-async-fail"), invariants=INVARIANTS).run()
    assert r.complete and r.failure is None, r.failure and r.failure.describe()
    for label in KV_COVERAGE:
        if label != "synchronous KV loads":
            assert r.coverage[label] > 0, label
    # quiescence as liveness: steps alone (the worker's forced reports
    # included) finish every request and return every block
    assert r.liveness_bound is not None and r.liveness_bound > 0


def test_the_recompute_livelock_of_vllm_is_found(tmp_path: Path) -> None:
    """Under "recompute" a load failing whole frees the request's blocks but
    leaves it in vLLM's _inflight_prefills; the retry's asynchronous
    admission reserves the request's own remaining blocks against itself,
    and in this pool it never fits: steps alone never finish it."""
    space = _space("kv-livelock", "conn-recompute-livelock")
    progress = {"progress", "progress-admits-head"}
    r = Explorer(space, invariants=tuple(i for i in INVARIANTS if i.id not in progress)).run()
    assert r.failure is not None and r.failure.kind == "deadlock", r.failure
    assert "step, load failed #0" in r.failure.labels
    # the deadlock's trace: the path and the steps around the cycle; vLLM
    # (through the adapter) takes it in lockstep with the spec
    trace = r.failure.write_trace(tmp_path / "livelock.jsonl")
    assert sum(1 for e in tracefile.read(trace).workload.events if isinstance(e, Step)) >= 3
    if HAVE_VLLM:
        assert main(["replay", str(trace), "--against", "vllm", "--invariants", "safety"]) == 0


def test_a_path_writes_reports_and_forced_reports_as_events() -> None:
    space = _space("connector", "conn-async-fail")
    ex = Expander(space)
    a = ex.alphabet
    # add KW, step (its load starts), then steps alone: the bounded wait
    # reports the load done, written as an explicit event before its step
    wl = ex.workload([a.add(0), STEP, STEP, STEP, STEP])
    kinds = [type(e).__name__ for e in wl.events]
    assert kinds == ["AddRequest", "Step", "Step", "KVLoadDone", "Step", "Step"]
    wl = ex.workload([a.add(0), STEP, a.kv_code("failed@1", 0)])
    assert isinstance(wl.events[2], KVLoadFailed) and wl.events[2].block_index == 1
    assert isinstance(wl.events[3], Step)
    wl = ex.workload([ex.alphabet.add(1), STEP, STEP, STEP, STEP, STEP])
    assert any(isinstance(e, KVSaveDone) for e in wl.events)  # KV's save, forced by the bounded wait


def test_a_scheduler_that_leaks_a_load_aborted_is_caught(tmp_path: Path) -> None:
    space = _space("connector", "conn-async-fail")
    r = Explorer(space, scheduler_cls=LeaksAbortedLoad, invariants=INVARIANTS).run()
    assert r.failure is not None and r.failure.kind == "violation", r.failure
    labels = r.failure.labels
    assert labels[0] == "add KW" and "abort #0" in labels
    trace = r.failure.write_trace(tmp_path / "leak.jsonl")
    assert tracefile.read(trace).kv == ("connector",)
    assert main(["replay", str(trace), "--against", "test_kv:LeaksAbortedLoad"]) == 1
    assert main(["replay", str(trace), "--against", "spec"]) == 0


def test_a_hit_invalid_in_a_sliding_window_group_is_caught(tmp_path: Path) -> None:
    space = _space("hybrid", "hyb-full-sw4")
    r = Explorer(space, scheduler_cls=WindowBlindHit, invariants=INVARIANTS).run()
    assert r.failure is not None and r.failure.kind == "violation", r.failure
    trace = r.failure.write_trace(tmp_path / "window.jsonl")
    assert tracefile.read(trace).kv == ("hybrid",)
    assert main(["replay", str(trace), "--against", "test_kv:WindowBlindHit"]) == 1
    assert main(["replay", str(trace), "--against", "spec"]) == 0


def test_hybrid_groups_explore_clean() -> None:
    r = Explorer(_space("hybrid", "hyb-sw2-alone"), invariants=INVARIANTS).run()
    assert r.complete and r.failure is None, r.failure and r.failure.describe()
    assert r.liveness_bound is not None
    assert KVCacheGroup().kind == "full_attention"


@pytest.mark.parametrize("name", ["hyb-full-cl2", "hyb-cl2-alone"])
def test_chunked_local_groups_explore_clean_with_impl_in_lockstep(name: str) -> None:
    """Every state of the chunked-local spaces, every invariant, and
    ImplScheduler taking every transition in lockstep (equal plans and
    views); the chunked-local rules all reached: a hit's blocks before the
    chunk nulled, the chunk's blocks freed as it passes, and (the lone group
    with 2 tokens a step) the full-sequence gate counting the group at its
    admission cap."""
    from schedspec.impl.scheduler import ImplScheduler

    r = Explorer(_space("hybrid", name), invariants=INVARIANTS, impl_cls=ImplScheduler).run()
    assert r.complete and r.failure is None, r.failure and r.failure.describe()
    assert r.impl_transitions == r.transitions > 0 and r.liveness_bound is not None
    assert r.rules["kv_groups.hit_skipped_in_chunk"] > 0 and r.rules["kv_groups.chunk_freed"] > 0
    if name == "hyb-cl2-alone":
        assert r.rules["kv_groups.chunk_admission_capped"] > 0


def test_a_chunk_freed_while_attended_is_caught(tmp_path: Path) -> None:
    r = Explorer(_space("hybrid", "hyb-full-cl2"), scheduler_cls=ChunkEagerFree, invariants=INVARIANTS).run()
    assert r.failure is not None, "the eager free went unnoticed"
    trace = r.failure.write_trace(tmp_path / "chunk.jsonl")
    assert tracefile.read(trace).kv == ("hybrid",)
    assert main(["replay", str(trace), "--against", "test_kv:ChunkEagerFree"]) == 1
    assert main(["replay", str(trace), "--against", "spec"]) == 0
    if HAVE_VLLM:
        assert main(["replay", str(trace), "--against", "vllm"]) == 0
