"""The hybrid KV cache groups' invariants (invariants/groups.py): each fires,
under its id, on a hand-built transition that breaks it in one place, and
holds on the good transition it was made from, where the whole catalogue is
silent; then real runs (the spec and, where installed, vLLM's scheduler
through the adapter) of connector and hybrid workloads keep every invariant
silent, but for the one vLLM behaviour the catalogue reports (see
test_recompute_into_a_freed_window).

Layout: 4-token blocks, group 0 full attention, group 1 a sliding window of
4 tokens (a token attends itself and the 3 before it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import pytest

from schedspec.invariants import BY_ID, CATALOGUE, Monitor, Transition
from schedspec.invariants.core import History
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import (
    BlockKey,
    KVCacheGroup,
    KVView,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    group_block_key,
)

from tests.invariants.kv_runs import kv_config, kv_run, violations
from tests.invariants.test_catalogue import key, req

W, R = RequestStatus.WAITING, RequestStatus.RUNNING

GROUP_IDS = (
    "group-block-conservation",
    "group-tables-cover",
    "groups-prefix-hit-valid",
    "sliding-window-frees",
    "partial-entries-with-their-block",
)

HYB = SchedulerConfig(
    block_size=4, num_blocks=17, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32,
    kv_cache_groups=(KVCacheGroup(), KVCacheGroup("sliding_window", 4)),
)
PROMPT = tuple(range(1, 11))  # 10 tokens


def hreq(rid: str, status: RequestStatus, computed: int, g0: Iterable[int], g1: Iterable[int],
         prompt: tuple[int, ...] = PROMPT, **kw: Any) -> RequestView:
    g0, g1 = tuple(g0), tuple(g1)
    return dataclasses.replace(req(rid, prompt, status=status, computed=computed, blocks=g0, **kw),
                               group_block_ids=(g0, g1) if g0 or g1 else ())


def hview(reqs: Iterable[RequestView], *, step: int = 0, extra_keys: dict[int, BlockKey] | None = None,
          config: SchedulerConfig = HYB) -> SchedulerView:
    """A view whose pool follows from every group's table: ref counts, free
    blocks in id order, and each full computed block keyed with its group's
    key (plus ``extra_keys``: cached blocks nobody holds, still free)."""
    live = list(reqs)
    bs = config.block_size
    ref = [0] * config.num_blocks
    keys: dict[int, BlockKey] = dict(extra_keys or {})
    for r in live:
        for g, table in enumerate(r.group_block_ids or (r.block_ids,)):
            for i, b in enumerate(table):
                if b:
                    ref[b] += 1
                    if r.status == R and (i + 1) * bs <= r.num_computed_tokens:
                        keys.setdefault(b, group_block_key(key(r, i, bs), g))
    index: dict[BlockKey, tuple[int, ...]] = {}
    for b in sorted(keys):
        index[keys[b]] = index.get(keys[b], ()) + (b,)
    return SchedulerView(
        config=config,
        step=step,
        requests={r.request_id: r for r in live},
        waiting=tuple(r.request_id for r in live if r.status == W),
        running=tuple(r.request_id for r in live if r.status == R),
        kv=KVView(config.num_blocks, bs, tuple(ref), tuple(b for b in range(1, config.num_blocks) if ref[b] == 0),
                  keys, index),
        finished={},
    )


def entry(r: RequestView, computed: int, n: int, kind: ScheduleKind) -> ScheduledRequest:
    return ScheduledRequest.of(r.request_id, kind, num_computed_tokens=computed, num_scheduled_tokens=n,
                               all_token_ids=r.all_token_ids, block_ids=r.block_ids,
                               group_block_ids=r.group_block_ids)


def fires(inv_id: str, t: Transition) -> list[str]:
    return [v.message for v in BY_ID[inv_id].check(t)]


def silent(t: Transition, h: History | None = None) -> None:
    found = [str(v) for inv in CATALOGUE for v in inv.check(t, h)]
    assert found == []


# a computed 8 of its 10 tokens; group 1 has freed nothing yet (vLLM frees at
# the next allocate_slots); step 2 schedules its last 2 tokens: processed 8,
# so the block of tokens 0..3 lies wholly before the window of token 8 and
# group 1 frees block 3 into the null block
A_BEFORE = hreq("a", R, 8, (1, 2), (3, 4))
A_AFTER = hreq("a", R, 10, (1, 2, 5), (0, 4, 6))


def step2(after_a: RequestView = A_AFTER) -> Transition:
    before = hview([A_BEFORE], step=1)
    freed_key = {3: group_block_key(key(A_BEFORE, 0, 4), 1)}  # freed, still cached
    after = hview([after_a], step=2, extra_keys=freed_key if 3 not in after_a.group_block_ids[1] else None)
    p = StepPlan(2, (entry(after_a, 8, 2, ScheduleKind.RUNNING),), (), ())
    return Transition("schedule", before, after, plan=p, in_flight=(p,))


def test_every_group_invariant_is_catalogued_and_requires_hybrid_kv() -> None:
    from tests.invariants.test_mamba import MAMBA_IDS  # the Mamba groups' (invariants/mamba.py)

    ids = [inv.id for inv in CATALOGUE if "hybrid_kv" in inv.requires]
    assert tuple(ids) == GROUP_IDS + MAMBA_IDS
    for i in GROUP_IDS:
        assert "single_type_kv_cache_manager.py" in BY_ID[i].vllm_behaviour or "kv_cache_coordinator.py" in BY_ID[i].vllm_behaviour


def test_the_good_step_is_silent() -> None:
    silent(step2())


def test_group_block_conservation() -> None:
    t = step2()
    assert fires("group-block-conservation", t) == []
    # block 6 also sits in another request's group-0 table
    b = hreq("b", R, 4, (6,), (7,), prompt=(9, 9, 9, 9, 9))
    two = dataclasses.replace(t, after=hview([A_AFTER, b], step=2))
    assert any("block 6 is in group 0's table and in group 1's" in m for m in fires("group-block-conservation", two))
    # group 1's block 4 carries group 0's key
    keys = dict(t.after.kv.block_keys)
    keys[4] = key(A_AFTER, 1, 4)
    wrong = dataclasses.replace(t, after=dataclasses.replace(t.after, kv=dataclasses.replace(t.after.kv, block_keys=keys)))
    assert fires("group-block-conservation", wrong) == ["block 4 of group 1 carries a key of group 0"]
    # a hybrid request without group tables, a plain layout with them
    bare = dataclasses.replace(A_AFTER, group_block_ids=())
    assert fires("group-block-conservation", dataclasses.replace(t, plan=StepPlan(2, (), (), ()),
                                                                  after=dataclasses.replace(t.after, requests={"a": bare}))) == [
        "request holds blocks [1, 2, 5] but no group tables in a hybrid layout"
    ]
    plain = dataclasses.replace(t.after, config=dataclasses.replace(HYB, kv_cache_groups=()))
    assert "request carries group tables in a plain layout" in fires(
        "group-block-conservation", dataclasses.replace(t, after=plain))


def test_group_tables_cover() -> None:
    t = step2()
    assert fires("group-tables-cover", t) == []
    short = hreq("a", R, 10, (1, 2, 5), (0, 4))
    assert fires("group-tables-cover", dataclasses.replace(t, after=hview([short], step=2))) == [
        "group 1's table has 2 places, group 0's 3"
    ]
    # the block of tokens 4..7 freed: token 10 attends 7..10
    early = hreq("a", R, 10, (1, 2, 5), (0, 0, 6))
    assert fires("group-tables-cover", dataclasses.replace(t, after=hview([early], step=2))) == [
        "sliding-window group 1 (window 4) freed 2 blocks, but with 10 computed tokens only 1 lie wholly "
        "before the window"
    ]
    holes = hreq("a", R, 10, (1, 2, 5), (3, 0, 6))
    assert "sliding-window group 1's null places [3, 0, 6] are not a prefix" in fires(
        "group-tables-cover", dataclasses.replace(t, after=hview([holes], step=2)))


def test_sliding_window_frees() -> None:
    t = step2()
    assert fires("sliding-window-frees", t) == []
    kept = hreq("a", R, 10, (1, 2, 5), (3, 4, 6))
    assert fires("sliding-window-frees", step2(kept)) == [
        "sliding-window group 1 (window 4) has 0 null places after the step; with 8 processed tokens vLLM "
        "has freed 1"
    ]


def admission(g1: tuple[int, ...]) -> Transition:
    """b (a's first 8 tokens, then 3 more) is admitted on a hit of 8 tokens
    while a runs: group 0 reuses a's blocks 1, 2; group 1 needs only the block
    of tokens 4..7 (token 8 attends 5..8) and pads the skipped block with the
    null block."""
    prompt = PROMPT[:8] + (20, 21, 22)
    a = hreq("a", R, 10, (1, 2, 5), (0, 4, 6))
    wait = hreq("b", W, 0, (), (), prompt=prompt)
    b = hreq("b", R, 11, (1, 2, 7), g1, prompt=prompt)
    before = hview([a, wait], step=2)
    after = hview([a, b], step=3)
    p = StepPlan(3, (entry(b, 8, 3, ScheduleKind.NEW),), (), ())
    return Transition("schedule", before, after, plan=p, in_flight=(p,))


def test_groups_prefix_hit_valid() -> None:
    good = admission((0, 4, 8))
    assert fires("groups-prefix-hit-valid", good) == []
    # group 1's place 1 is a fresh block, not one cached under the group's key
    bad = admission((0, 9, 8))
    assert fires("groups-prefix-hit-valid", bad) == [
        "hit block 9 (index 1, group 1) was not cached under the group's key before the step, nor filled "
        "by another request in it"
    ]
    # and a hit whose group-1 place carries group 0's key for the content
    keys = dict(bad.after.kv.block_keys)
    keys[9] = key(bad.after.requests["b"], 1, 4)
    kv = dataclasses.replace(bad.after.kv, block_keys=keys)
    assert fires("groups-prefix-hit-valid", dataclasses.replace(bad, after=dataclasses.replace(bad.after, kv=kv))) == [
        "hit block 9 (index 1, group 1) does not carry the group's key for the request"
    ]


# --------------------------------------------------------------------------
# Real runs: the spec, and vLLM's scheduler through the adapter
# --------------------------------------------------------------------------

REAL = [
    ("plain", "recompute", False), ("plain", "fail", True), ("full+sw4", "recompute", False),
    ("full+sw4", "fail", True), ("sw8+full+sw5", "recompute", True), ("sw6", "fail", False),
]


def _vllm() -> Any:
    pytest.importorskip("vllm")
    from schedspec.adapters.vllm_adapter import VllmScheduler

    return VllmScheduler


def _silent_runs(make: Any, layout: str, policy: str, async_: bool, seeds: int) -> dict[str, int]:
    seen: dict[str, int] = {}
    for seed in range(seeds):
        run = kv_run(make, kv_config(layout, policy=policy, async_=async_), seed)
        assert [str(v) for v in violations(run)] == [], (layout, policy, async_, seed)
        for k, n in run.counts.items():
            seen[k] = seen.get(k, 0) + n
    return seen


@pytest.mark.parametrize("layout, policy, async_", REAL)
def test_no_false_alarms_on_spec_runs(layout: str, policy: str, async_: bool) -> None:
    seen = _silent_runs(SpecScheduler, layout, policy, async_, 3)
    assert seen.get("async_load", 0) and seen.get("sync_load", 0) and seen.get("finished_sending", 0)


@pytest.mark.vllm
@pytest.mark.parametrize("layout, policy, async_", REAL)
def test_no_false_alarms_on_vllm_runs(layout: str, policy: str, async_: bool) -> None:
    seen = _silent_runs(_vllm(), layout, policy, async_, 3)
    assert seen.get("async_load", 0) and seen.get("sync_load", 0) and seen.get("finished_sending", 0)


def _freed_window_findings(make: Any) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for seed in range(8):
        run = kv_run(make, kv_config("sw6", policy="recompute"), seed)
        m = Monitor()
        for t in run.transitions:
            for v in m.observe(t):
                out.append((seed, str(v)))
                if len(out) == 1:
                    # first found in the update that reports an invalid block
                    assert t.kind == "update" and t.result is not None and t.result.invalid_block_ids
    return out


def _check_freed_window(found: list[tuple[int, str]]) -> None:
    assert found
    for _, msg in found:
        assert msg.startswith("group-tables-cover ") and "lie wholly before the window" in msg, msg


def test_recompute_into_a_freed_window() -> None:
    """vLLM 0.33 under "recompute" with a lone sliding-window group (the
    spec models it so): a synchronous load's request has freed the blocks
    wholly before the window of its loaded tokens (add_local_computed_blocks,
    allocate_slots); an invalid block then truncates its computed tokens to
    that block's start (_update_requests_with_invalid_blocks), and the tokens
    it recomputes attend positions whose blocks are now the null block.
    group-tables-cover reports it, and nothing else fires."""
    _check_freed_window(_freed_window_findings(SpecScheduler))


@pytest.mark.vllm
def test_recompute_into_a_freed_window_on_vllm() -> None:
    spec = _freed_window_findings(SpecScheduler)
    _check_freed_window(spec)
    assert _freed_window_findings(_vllm()) == spec


# --------------------------------------------------------------------------
# Chunked local attention: the same invariants with the chunk's skipped
# tokens, (computed // chunk) * chunk (ChunkedLocalAttentionManager)
# --------------------------------------------------------------------------

CL8 = KVCacheGroup("chunked_local", attention_chunk_size=8)
HYB_CL = dataclasses.replace(HYB, kv_cache_groups=(KVCacheGroup(), CL8))
PROMPT_CL = tuple(range(1, 19))  # 18 tokens


def creq(rid: str, status: RequestStatus, computed: int, g0: Iterable[int], g1: Iterable[int],
         prompt: tuple[int, ...] = PROMPT_CL) -> RequestView:
    return hreq(rid, status, computed, g0, g1, prompt=prompt)


# a computed 12 of its 18 tokens in one step (nothing freed: vLLM frees at the
# next allocate_slots); step 2 schedules its last 6: processed 12, so chunk 1
# (tokens 8 ..) is current and the blocks of tokens 0 .. 7 are freed
C_BEFORE = creq("a", R, 12, (1, 2, 3), (4, 5, 6))
C_AFTER = creq("a", R, 18, (1, 2, 3, 7, 9), (0, 0, 6, 8, 10))


def chunk_step2(after_a: RequestView = C_AFTER) -> Transition:
    before = hview([C_BEFORE], step=1, config=HYB_CL)
    held = set(after_a.group_block_ids[1])
    freed = {b: group_block_key(key(C_BEFORE, i, 4), 1) for i, b in enumerate((4, 5)) if b not in held}
    after = hview([after_a], step=2, extra_keys=freed, config=HYB_CL)
    p = StepPlan(2, (entry(after_a, 12, 6, ScheduleKind.RUNNING),), (), ())
    return Transition("schedule", before, after, plan=p, in_flight=(p,))


def test_the_good_chunked_local_step_is_silent() -> None:
    silent(chunk_step2())


def test_group_block_conservation_with_a_chunked_local_group() -> None:
    t = chunk_step2()
    assert fires("group-block-conservation", t) == []  # its null places are allowed
    nulled = creq("a", R, 18, (1, 0, 3, 7, 9), (0, 0, 6, 8, 10))
    assert "full-attention group 0 holds the null block at index 1" in fires(
        "group-block-conservation", dataclasses.replace(t, after=hview([nulled], step=2, config=HYB_CL)))


def test_group_tables_cover_counts_the_chunk() -> None:
    t = chunk_step2()
    # 10 computed tokens: the next token (10) is in chunk 1, so tokens 0 .. 7
    # (two blocks) are skipped, though a window of 8 would skip only 3 tokens
    ok = creq("a", R, 10, (1, 2, 3), (0, 0, 6))
    assert fires("group-tables-cover", dataclasses.replace(t, after=hview([ok], step=2, config=HYB_CL))) == []
    early = creq("a", R, 10, (1, 2, 3), (0, 0, 0))
    assert fires("group-tables-cover", dataclasses.replace(t, after=hview([early], step=2, config=HYB_CL))) == [
        "chunked-local group 1 (chunk 8) freed 3 blocks, but with 10 computed tokens only 2 lie wholly before "
        "its chunk"
    ]
    # 7 computed: the next token is still in chunk 0, nothing may be freed
    first = creq("a", R, 7, (1, 2), (0, 5))
    assert fires("group-tables-cover", dataclasses.replace(t, after=hview([first], step=2, config=HYB_CL))) == [
        "chunked-local group 1 (chunk 8) freed 1 blocks, but with 7 computed tokens only 0 lie wholly before "
        "its chunk"
    ]
    holes = creq("a", R, 18, (1, 2, 3, 7, 9), (0, 0, 6, 0, 10))
    assert "chunked-local group 1's null places [0, 0, 6, 0, 10] are not a prefix" in fires(
        "group-tables-cover", dataclasses.replace(t, after=hview([holes], step=2, config=HYB_CL)))


def test_chunked_local_frees_exactly_the_blocks_before_the_chunk() -> None:
    assert fires("sliding-window-frees", chunk_step2()) == []
    kept = creq("a", R, 18, (1, 2, 3, 7, 9), (4, 5, 6, 8, 10))
    assert fires("sliding-window-frees", chunk_step2(kept)) == [
        "chunked-local group 1 (chunk 8) has 0 null places after the step; with 12 processed tokens vLLM "
        "has freed 2"
    ]
    # freeing block 6 too would free the current chunk's first block (tokens 8 .. 11)
    over = creq("a", R, 18, (1, 2, 3, 7, 9), (0, 0, 0, 8, 10))
    assert fires("sliding-window-frees", chunk_step2(over)) == [
        "chunked-local group 1 (chunk 8) has 3 null places after the step; with 12 processed tokens vLLM "
        "has freed 2"
    ]


def chunk_admission(g1: tuple[int, ...]) -> Transition:
    """b (a's first 12 tokens, then 3 more) is admitted on a hit of 12 tokens
    while a runs: group 0 reuses a's blocks 1, 2, 3; the chunked-local lookup
    (max_length 14: chunk start 8) nulls blocks 0 and 1 and finds a's block 6
    (tokens 8 .. 11), the block of the current chunk."""
    prompt = PROMPT_CL[:12] + (40, 41, 42)
    a = C_AFTER
    wait = creq("b", W, 0, (), (), prompt=prompt)
    b = creq("b", R, 15, (1, 2, 3, 11), g1, prompt=prompt)
    before = hview([a, wait], step=2, config=HYB_CL)
    after = hview([a, b], step=3, config=HYB_CL)
    p = StepPlan(3, (entry(b, 12, 3, ScheduleKind.NEW),), (), ())
    return Transition("schedule", before, after, plan=p, in_flight=(p,))


def test_groups_prefix_hit_valid_with_a_chunked_local_group() -> None:
    good = chunk_admission((0, 0, 6, 12))
    assert fires("groups-prefix-hit-valid", good) == []
    # the current chunk's block must be a real cached block, not a null place:
    # token 12 attends tokens 8 .. 11
    nulled = chunk_admission((0, 0, 0, 12))
    assert fires("groups-prefix-hit-valid", nulled) == [
        "hit place 2 of chunked-local group 1 (chunk 8) is the null block, but with 12 computed tokens only 2 "
        "blocks lie wholly before its chunk"
    ]
    fresh = chunk_admission((0, 0, 13, 12))
    assert fires("groups-prefix-hit-valid", fresh) == [
        "hit block 13 (index 2, group 1) was not cached under the group's key before the step, nor filled by "
        "another request in it"
    ]


def chunk_abort(freed_front: tuple[int, ...], freed_back: tuple[int, ...]) -> Transition:
    """With a KV connector, a (18 computed, none in flight) is aborted:
    vLLM's _connector_finished first frees the chunked-local blocks before
    the chunk of token 18 that are still held (remove_skipped_blocks: blocks
    3, 2, walking back: 8 then 6, keyed), then each group's table tail first
    (group 0: 9 keyless, then 7, 3, 2, 1 keyed; group 1: 10 keyless)."""
    config = dataclasses.replace(HYB_CL, kv_connector=True)
    a = creq("a", R, 18, (1, 2, 3, 7, 9), (0, 0, 6, 8, 10))
    before = hview([a], step=2, config=config)
    kv = dataclasses.replace(before.kv, ref_cnt=(0,) * config.num_blocks,
                             free_queue=freed_front + before.kv.free_queue + freed_back)
    after = dataclasses.replace(before, requests={}, running=(), kv=kv)
    return Transition("abort", before, after, request_id="a")


def test_free_queue_lru_frees_the_chunk_first_on_an_abort_with_a_connector() -> None:
    good = chunk_abort((10, 9), (8, 6, 7, 3, 2, 1))
    assert fires("free-queue-lru", good) == []
    # the table's blocks freed group after group without the chunk's free first
    # (what a group-by-group free of the tables alone would give)
    plain = chunk_abort((10, 9), (7, 3, 2, 1, 8, 6))
    assert fires("free-queue-lru", plain) == [
        "freed blocks went front [10, 9] / back [7, 3, 2, 1, 8, 6]; table [[1, 2, 3, 7, 9], [0, 0, 6, 8, 10]] "
        "tail first gives front [10, 9] / back [8, 6, 7, 3, 2, 1]"
    ]


# Real runs with chunked-local layouts (chunks a multiple of the block size,
# as vLLM's attention backend requires: see docs/divergences.md). The lone
# chunked-local group runs without a connector: a request whose processed
# tokens end a chunk holds no block at all when it finishes (every place is
# skipped), which vLLM still holds for its save, and finished-holds-only-pending
# (invariants/connector.py) does not expect that yet.
CHUNKED = {
    "full+cl8": (KVCacheGroup(), CL8),
    "cl8": (CL8,),
    "full+sw5+cl4": (KVCacheGroup(), KVCacheGroup("sliding_window", 5), KVCacheGroup("chunked_local", attention_chunk_size=4)),
}
REAL_CL = [("full+cl8", "recompute", False), ("full+cl8", "fail", True), ("cl8", "", False), ("cl8", "", True),
           ("full+sw5+cl4", "fail", False)]


def _silent_chunked_runs(make: Any, layout: str, policy: str, async_: bool, seeds: int) -> dict[str, int]:
    seen: dict[str, int] = {}
    for seed in range(seeds):
        config = kv_config("plain", connector=bool(policy), policy=policy or "recompute", async_=async_,
                           kv_cache_groups=CHUNKED[layout])
        run = kv_run(make, config, seed)
        assert [str(v) for v in violations(run)] == [], (layout, policy, async_, seed)
        for k, n in run.counts.items():
            seen[k] = seen.get(k, 0) + n
        cl = [g for g, grp in enumerate(config.groups) if grp.kind == "chunked_local"]
        seen["chunk_nulls"] = seen.get("chunk_nulls", 0) + sum(
            1 for t in run.transitions for r in t.after.requests.values()
            for g in cl if r.group_block_ids and 0 in r.group_block_ids[g])
    return seen


@pytest.mark.parametrize("layout, policy, async_", REAL_CL)
def test_no_false_alarms_on_chunked_local_spec_runs(layout: str, policy: str, async_: bool) -> None:
    seen = _silent_chunked_runs(SpecScheduler, layout, policy, async_, 3)
    assert not policy or (seen.get("async_load", 0) and seen.get("sync_load", 0))
    assert seen["chunk_nulls"]  # the chunked-local group freed or skipped blocks


@pytest.mark.vllm
@pytest.mark.parametrize("layout, policy, async_", REAL_CL)
def test_no_false_alarms_on_chunked_local_vllm_runs(layout: str, policy: str, async_: bool) -> None:
    seen = _silent_chunked_runs(_vllm(), layout, policy, async_, 3)
    assert not policy or (seen.get("async_load", 0) and seen.get("sync_load", 0))
    assert seen["chunk_nulls"]  # the chunked-local group freed or skipped blocks


def test_a_lone_chunked_local_group_with_a_connector() -> None:
    config = kv_config("plain", policy="recompute", kv_cache_groups=(CL8,))
    found = [str(v) for seed in range(3) for v in violations(kv_run(SpecScheduler, config, seed))]
    assert found == []


def test_full_blocks_cached_holds_a_chunked_local_group_to_every_full_block() -> None:
    """vLLM keys every full block of a chunked-local group (the base
    reachable_block_mask), so full-blocks-cached reads those tables too,
    leaving out only the null places of the blocks before the chunk."""
    config = kv_config("plain", connector=False, kv_cache_groups=(KVCacheGroup(), CL8))
    run = kv_run(SpecScheduler, config, 0)
    inv = BY_ID["full-blocks-cached"]
    checked = 0
    for t in run.transitions:
        v = t.after
        assert list(inv.check(Transition("schedule", v, v))) == []
        for rid in v.running:
            r = v.requests[rid]
            known = min(r.num_computed_tokens - r.num_output_placeholders, r.num_tokens)
            cl = r.group_block_ids[1]
            full = [b for b in cl[: known // config.block_size] if b != 0]
            if not full:
                continue
            keys = {b: k for b, k in v.kv.block_keys.items() if b != full[-1]}
            broken = dataclasses.replace(v, kv=dataclasses.replace(v.kv, block_keys=keys))
            found = [f.message for f in inv.check(Transition("schedule", broken, broken))]
            assert any(f"block {full[-1]} (index" in m and "group 1" in m for m in found), found
            checked += 1
    assert checked


# ---------------------------------------------------------------- partial entries

HYB_HB = dataclasses.replace(HYB, hash_block_size=2)
PARTIAL: BlockKey = ("", PROMPT[:2])  # a prefix ending inside block 1 (tokens 1..4)


def partial_step(partial_index: dict[BlockKey, tuple[int, ...]]) -> Transition:
    """step2 with hash units of 2 tokens, the after view carrying ``partial_index``."""
    t = step2()
    before = dataclasses.replace(t.before, config=HYB_HB)
    after = dataclasses.replace(t.after, config=HYB_HB, kv=dataclasses.replace(t.after.kv, partial_index=partial_index))
    return dataclasses.replace(t, before=before, after=after)


def test_partial_entry_on_its_full_block_is_silent() -> None:
    silent(partial_step({PARTIAL: (1,)}))


def test_partial_entries_with_their_block() -> None:
    # block 7 is free and keyless: its partial entry outlived its key (an
    # eviction that left the partial entry behind)
    assert fires("partial-entries-with-their-block", partial_step({PARTIAL: (7,)}))
    # block 3 keeps group 1's key: another group's content
    assert fires("partial-entries-with-their-block", partial_step({PARTIAL: (3,)}))
    # block 2 holds tokens 5..8: other content
    assert fires("partial-entries-with-their-block", partial_step({PARTIAL: (2,)}))
    # a partial entry without a hash block size below the block size
    t = partial_step({PARTIAL: (1,)})
    plain = dataclasses.replace(t, after=dataclasses.replace(t.after, config=HYB))
    assert fires("partial-entries-with-their-block", plain)
    # a key of whole blocks is no partial entry
    assert fires("partial-entries-with-their-block", partial_step({("", PROMPT[:4]): (1,)}))
