"""vLLM 0.33.0's real Scheduler with the modelled KV connector and hybrid KV
cache groups, through schedspec/adapters/vllm_adapter.py and
schedspec/adapters/vllm_connector.py.

Each connector path driven on vLLM directly with exact values (a synchronous
load, a load beyond a local prefix hit, an asynchronous load and its
promotion, a whole-prompt asynchronous load, an abort during a load, an
asynchronous save, failed loads and invalid blocks under both policies, async
scheduling's deferred frees), then the hybrid layouts (the coordinator vLLM
builds for each, sliding-window and chunked-local tables with the null
block, group-suffixed keys, a hit cut by the window, a chunked-local hit)
and the connector with hybrid groups.

Needs vLLM 0.33.0 (scripts/install_vllm.sh); skipped without it unless
SCHEDSPEC_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from schedspec.spec.interface import (
    KVCacheGroup,
    KVLoad,
    RequestSpec,
    RequestStatus,
    ScheduleKind,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
    group_block_key,
)

REQUIRE = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not HAVE_VLLM and not REQUIRE,
        reason="vLLM is not installed (scripts/install_vllm.sh VENV); "
        "set SCHEDSPEC_REQUIRE_VLLM=1 to fail instead of skipping",
    ),
]

S = RequestStatus
SW = KVCacheGroup("sliding_window", 8)
CL = KVCacheGroup("chunked_local", attention_chunk_size=8)
FULL = KVCacheGroup()


@pytest.fixture(scope="module", autouse=True)
def vllm_loaded() -> Any:
    from schedspec.adapters.vllm_load import load_vllm

    return load_vllm()


def make(**kw: Any) -> Any:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    base: dict[str, Any] = dict(block_size=4, num_blocks=32, max_num_batched_tokens=32, max_num_seqs=4,
                                max_model_len=64, kv_connector=True)
    base.update(kw)
    return VllmScheduler(SchedulerConfig(**base))


def req(rid: str, prompt: range | tuple[int, ...], max_tokens: int = 3, **kw: Any) -> RequestSpec:
    return RequestSpec(rid, tuple(prompt), max_tokens, **kw)


def step(s: Any, **reports: Any) -> StepPlan:
    plan: StepPlan = s.schedule()
    s.update(plan, StepResult({x.request_id: (7,) for x in plan.scheduled if x.samples}, **reports))
    return plan


def shape(plan: StepPlan) -> list[tuple[str, str, int, int]]:
    return [(x.request_id, x.kind.name, x.num_computed_tokens, x.num_scheduled_tokens) for x in plan.scheduled]


def states(view: SchedulerView) -> dict[str, tuple[RequestStatus, int, tuple[int, ...]]]:
    return {rid: (r.status, r.num_computed_tokens, r.block_ids) for rid, r in view.requests.items()}


def held_consistent(view: SchedulerView) -> None:
    """Every block's ref count is the number of tables (live or held by a
    finished request) naming it; the free queue is every other block."""
    holders = [0] * view.config.num_blocks
    for r in view.requests.values():
        for table in (r.group_block_ids or (r.block_ids,)):
            for b in table:
                if b:
                    holders[b] += 1
    for blocks in view.kv_held_by_finished.values():
        for b in blocks:
            holders[b] += 1
    assert tuple(holders) == view.kv.ref_cnt
    assert sorted(view.kv.free_queue) == [b for b in range(1, view.config.num_blocks) if not holders[b]]


# ----------------------------------------------------------------------------- the connector


class TestConnector:
    def test_vllm_builds_our_connector_in_the_scheduler_role(self) -> None:
        from schedspec.adapters.vllm_connector import SchedspecKVConnector

        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

        s = make(kv_load_failure_policy="recompute")
        conn = s.sched.connector
        # the plain layout gets a connector without hybrid-allocator support
        # (vLLM calls its request_finished), a hybrid one the SupportsHMA one
        assert type(conn) is SchedspecKVConnector and not isinstance(conn, SupportsHMA)
        hybrid = make(kv_cache_groups=(FULL, SW)).sched.connector
        assert type(hybrid).__name__ == "SchedspecHMAKVConnector" and isinstance(hybrid, SupportsHMA)
        assert conn.role.name == "SCHEDULER"
        assert s.sched.recompute_kv_load_failures is True
        assert make().sched.recompute_kv_load_failures is False  # "fail", vLLM's default
        # the base class's answers, kept: kv_both is a producer
        assert (conn.has_pending_block_frees(), conn.supports_divergent_local_hybrid_hits,
                conn.requires_kv_delivery) == (False, False, True)
        # a synchronous scheduler keeps one batch in flight: no deferred frees
        assert s.sched.defer_block_free is False
        assert make(async_scheduling=True).sched.defer_block_free is True

    def test_the_adapter_declares_the_connector_and_hybrid_groups(self, vllm_loaded: Any) -> None:
        from schedspec.adapters.vllm_adapter import VLLM_CAPABILITIES, capabilities_of_class

        assert VLLM_CAPABILITIES.kv_connector and VLLM_CAPABILITIES.hybrid_kv
        for cls in (vllm_loaded.Scheduler, vllm_loaded.AsyncScheduler):
            caps = capabilities_of_class(cls)
            assert caps.kv_connector and caps.hybrid_kv

    def test_no_connector_without_the_config(self) -> None:
        s = make(kv_connector=False)
        assert s.sched.connector is None
        assert s.schedule().kv_loads == ()

    def test_a_synchronous_load(self) -> None:
        s = make()
        s.add(req("a", range(1, 11), kv_external_tokens=8))
        plan = step(s)
        assert shape(plan) == [("a", "NEW", 8, 2)]
        assert plan.kv_loads == (KVLoad("a", 0, 8, (1, 2, 3), False),)
        assert plan.scheduled[0].token_ids == (9, 10)
        assert step(s).kv_loads == ()  # a load is asked for once
        assert states(s.view())["a"] == (S.RUNNING, 11, (1, 2, 3))

    def test_a_load_beyond_the_local_prefix_hit(self) -> None:
        s = make()
        s.add(req("a", range(1, 14), max_tokens=1))
        step(s)  # a computes 13 tokens and finishes: blocks 1-3 cached
        s.add(req("b", range(1, 21), kv_external_tokens=16))
        plan = step(s)
        # vLLM presents the block-aligned local hit (12) to the connector
        assert shape(plan) == [("b", "NEW", 16, 4)]
        assert plan.kv_loads == (KVLoad("b", 12, 16, (1, 2, 3, 4, 5), False),)

    def test_an_external_prefix_within_the_local_hit_loads_nothing(self) -> None:
        s = make()
        s.add(req("a", range(1, 14), max_tokens=1))
        step(s)
        s.add(req("b", range(1, 21), kv_external_tokens=8, kv_load_async=True))
        plan = step(s)
        assert shape(plan) == [("b", "NEW", 12, 8)] and plan.kv_loads == ()

    def test_an_asynchronous_load_waits_then_is_promoted(self) -> None:
        s = make()
        s.add(req("b", range(1, 11), kv_external_tokens=8, kv_load_async=True))
        plan = step(s)
        assert shape(plan) == [] and plan.kv_loads == (KVLoad("b", 0, 8, (1, 2), True),)
        view = s.view()
        assert states(view) == {"b": (S.WAITING_FOR_REMOTE_KVS, 8, (1, 2))}
        assert view.waiting == ("b",) and view.kv_loads_done == ()
        assert view.kv.block_keys == {}  # not cached until the load is done
        assert shape(step(s)) == []  # nothing scheduled while it loads
        step(s, finished_recving=("b",))
        view = s.view()
        assert view.kv_loads_done == ("b",) and view.requests["b"].status == S.WAITING_FOR_REMOTE_KVS
        plan = step(s)  # the waiting loop promotes it, caches the loaded blocks and admits it
        assert shape(plan) == [("b", "NEW", 8, 2)] and plan.kv_loads == ()
        assert plan.scheduled[0].block_ids == (1, 2, 3)
        view = s.view()
        assert view.kv_loads_done == () and sorted(view.kv.block_keys) == [1, 2]

    def test_a_whole_prompt_load_recomputes_the_last_token(self) -> None:
        s = make()
        s.add(req("b", range(1, 9), kv_external_tokens=8, kv_load_async=True))
        assert step(s).kv_loads == (KVLoad("b", 0, 8, (1, 2), True),)
        step(s, finished_recving=("b",))
        plan = step(s)
        # _update_waiting_for_remote_kv: num_computed == num_tokens -> num_tokens - 1
        assert shape(plan) == [("b", "NEW", 7, 1)] and plan.scheduled[0].samples

    def test_a_one_token_prompt_loaded_asynchronously_loads_again_and_again(self) -> None:
        """vLLM: the promotion leaves num_tokens - 1 = 0 tokens computed, so
        the same waiting-loop pass looks the request up again; the stateless
        connector offers the token again and a new asynchronous load starts
        into the block the request still holds. After every report the same:
        the request never runs (docs/divergences.md)."""
        s = make(block_size=8, num_blocks=9, max_num_batched_tokens=48, max_num_seqs=2, max_model_len=48)
        s.add(req("r", (10,), 1, kv_external_tokens=1, kv_load_async=True))
        assert step(s).kv_loads == (KVLoad("r", 0, 1, (1,), True),)
        for _ in range(3):
            step(s, finished_recving=("r",))
            plan = step(s)
            assert shape(plan) == [] and plan.kv_loads == (KVLoad("r", 0, 1, (1,), True),)
            view = s.view()
            assert states(view) == {"r": (S.WAITING_FOR_REMOTE_KVS, 1, (1,))} and view.kv.ref_cnt[:3] == (0, 1, 0)

    def test_a_synchronous_whole_prompt_load_is_refused_at_add(self) -> None:
        from schedspec.spec.interface import ProtocolError

        s = make()
        with pytest.raises(ProtocolError) as err:
            s.add(req("a", range(1, 9), kv_external_tokens=8))
        assert err.value.field == "kv_external_tokens"
        assert s.view().requests == {}

    def test_an_abort_during_a_load_holds_its_blocks_until_the_report(self) -> None:
        s = make()
        s.add(req("b", range(1, 11), kv_external_tokens=8, kv_load_async=True))
        step(s)
        s.abort("b")
        view = s.view()
        assert view.finished["b"].status == S.FINISHED_ABORTED
        assert view.kv_held_by_finished == {"b": (1, 2)}
        assert view.kv.ref_cnt[1:3] == (1, 1)
        held_consistent(view)
        plan = step(s)
        assert plan.finished_ids == ("b",)
        assert s.view().kv_held_by_finished == {"b": (1, 2)}  # held across steps
        step(s, finished_recving=("b",))
        view = s.view()
        assert view.kv_held_by_finished == {} and view.kv.ref_cnt == (0,) * 32
        assert view.kv.free_queue[:3] == (2, 1, 3)  # freed last block first, to the head
        assert s.sched.requests == {}

    def test_an_abort_after_the_load_report_frees_at_once(self) -> None:
        s = make()
        s.add(req("b", range(1, 11), kv_external_tokens=8, kv_load_async=True))
        step(s)
        step(s, finished_recving=("b",))
        s.abort("b")
        view = s.view()
        assert view.kv_held_by_finished == {} and view.kv_loads_done == ()
        assert view.kv.ref_cnt == (0,) * 32

    def test_an_asynchronous_save_holds_the_blocks_of_a_finished_request(self) -> None:
        s = make()
        s.add(req("a", range(1, 11), max_tokens=2, kv_save_async=True))
        s.add(req("c", range(21, 31), max_tokens=2, kv_save_async=True))
        step(s)
        s.abort("c")  # an abort saves nothing
        step(s)  # a reaches max_tokens: FINISHED_LENGTH_CAPPED, save pending
        view = s.view()
        assert view.finished["a"].status == S.FINISHED_LENGTH_CAPPED
        assert view.kv_held_by_finished == {"a": (1, 2, 3)}
        held_consistent(view)
        for _ in range(3):
            step(s)
            assert s.view().kv_held_by_finished == {"a": (1, 2, 3)}
        step(s, finished_sending=("a",))
        view = s.view()
        assert view.kv_held_by_finished == {} and view.kv.ref_cnt == (0,) * 32

    def test_a_stop_token_finish_saves_too(self) -> None:
        s = make()
        s.add(req("a", range(1, 11), max_tokens=5, stop_token_ids=(7,), kv_save_async=True))
        step(s)
        view = s.view()
        assert view.finished["a"].status == S.FINISHED_STOPPED
        assert view.kv_held_by_finished == {"a": (1, 2, 3)}

    @pytest.mark.parametrize("policy", ["recompute", "fail"])
    def test_a_failed_load(self, policy: str) -> None:
        s = make(kv_load_failure_policy=policy)
        s.add(req("b", range(1, 11), kv_external_tokens=8, kv_load_async=True))
        step(s)
        step(s, finished_recving=("b",), failed_recving=("b",))
        view = s.view()
        if policy == "fail":
            # update_from_output finishes it with FINISHED_ERROR; its blocks,
            # held for the load, are freed by the same result's finished_recving
            assert view.finished["b"].status == S.FINISHED_ERROR
            assert view.kv_held_by_finished == {} and view.kv.ref_cnt == (0,) * 32
            return
        # recompute: nothing of the load counts; the waiting loop frees its
        # blocks and admits it again, asking the connector again
        assert states(view)["b"] == (S.WAITING_FOR_REMOTE_KVS, 0, (1, 2))
        assert (view.kv_loads_done, view.kv_loads_failed) == (("b",), ("b",))
        plan = step(s)
        assert shape(plan) == [] and plan.kv_loads == (KVLoad("b", 0, 8, (2, 1), True),)
        assert s.view().kv_loads_failed == ()

    @pytest.mark.parametrize("policy", ["recompute", "fail"])
    def test_an_invalid_block_of_an_asynchronous_load(self, policy: str) -> None:
        s = make(kv_load_failure_policy=policy)
        s.add(req("b", range(1, 11), kv_external_tokens=8, kv_load_async=True))
        step(s)
        step(s, finished_recving=("b",), invalid_block_ids=(2,))
        view = s.view()
        if policy == "fail":
            assert view.finished["b"].status == S.FINISHED_ERROR and view.kv.ref_cnt == (0,) * 32
            return
        # truncated at the first invalid block (index 1): 4 tokens stay computed
        assert states(view)["b"] == (S.WAITING_FOR_REMOTE_KVS, 4, (1, 2))
        assert view.kv_loads_failed == ("b",)
        plan = step(s)
        assert shape(plan) == [("b", "NEW", 4, 6)]
        # the valid block is cached at promotion; block 2 when this step,
        # which recomputes it, is allocated (caching at allocation)
        assert s.view().kv.block_keys == {1: ("", (1, 2, 3, 4)), 2: ("", tuple(range(1, 9)))}

    @pytest.mark.parametrize("policy", ["recompute", "fail"])
    def test_an_invalid_block_of_a_synchronous_load(self, policy: str) -> None:
        s = make(kv_load_failure_policy=policy)
        s.add(req("a", range(1, 11), kv_external_tokens=8))
        plan = s.schedule()
        assert plan.kv_loads == (KVLoad("a", 0, 8, (1, 2, 3), False),)
        s.update(plan, StepResult({"a": (7,)}, invalid_block_ids=(2,)))
        view = s.view()
        if policy == "fail":
            assert view.finished["a"].status == S.FINISHED_ERROR
            # the invalid block and those after it are evicted, the valid one stays cached
            assert view.kv.ref_cnt == (0,) * 32 and view.kv.block_keys == {1: ("", (1, 2, 3, 4))}
            return
        # the step's output is dropped; the request recomputes from block 1
        assert states(view)["a"] == (S.RUNNING, 4, (1, 2, 3))
        assert view.requests["a"].output_token_ids == ()
        assert shape(step(s)) == [("a", "RUNNING", 4, 6)]

    def test_async_scheduling_defers_frees_until_the_step_in_flight_is_processed(self) -> None:
        s = make(async_scheduling=True)
        s.add(req("a", range(1, 11), max_tokens=2, kv_external_tokens=8))
        p1 = s.schedule()
        assert p1.kv_loads == (KVLoad("a", 0, 8, (1, 2, 3), False),)
        p2 = s.schedule()
        s.update(p1, StepResult({"a": (7,)}))
        s.abort("a")  # its last step (p2) is still in flight: the free is deferred
        view = s.view()
        # the request is gone (nothing holds the blocks in a view) but the
        # blocks keep their reference until p2 is processed
        assert view.requests == {} and view.kv_held_by_finished == {}
        assert view.kv.ref_cnt[:5] == (0, 1, 1, 1, 0) and view.kv.free_queue[:2] == (4, 5)
        assert [fence for fence, _ in s.sched.deferred_frees] == [2]
        s.update(p2, StepResult({}))
        view = s.view()
        # drained in reverse: block 3 (no hash) to the head, 2 and 1 to the tail
        assert not s.sched.deferred_frees and view.kv.ref_cnt == (0,) * 32
        assert view.kv.free_queue[0] == 3 and view.kv.free_queue[-2:] == (2, 1)


# ----------------------------------------------------------------------------- hybrid KV cache groups


class TestHybrid:
    @pytest.mark.parametrize(
        ("groups", "caching", "coordinator", "managers"),
        [
            ((), True, "UnitaryKVCacheCoordinator", ["FullAttentionManager"]),
            ((SW,), True, "UnitaryKVCacheCoordinator", ["SlidingWindowManager"]),
            ((FULL, SW), True, "HybridKVCacheCoordinator", ["FullAttentionManager", "SlidingWindowManager"]),
            ((FULL, SW, KVCacheGroup("sliding_window", 4)), True, "HybridKVCacheCoordinator",
             ["FullAttentionManager", "SlidingWindowManager", "SlidingWindowManager"]),
            ((FULL, SW), False, "KVCacheCoordinatorNoPrefixCache",
             ["FullAttentionManager", "SlidingWindowManager"]),
            ((CL,), True, "UnitaryKVCacheCoordinator", ["ChunkedLocalAttentionManager"]),
            ((FULL, CL), True, "HybridKVCacheCoordinator", ["FullAttentionManager", "ChunkedLocalAttentionManager"]),
            ((FULL, SW, CL), True, "HybridKVCacheCoordinator",
             ["FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager"]),
            ((FULL, CL), False, "KVCacheCoordinatorNoPrefixCache",
             ["FullAttentionManager", "ChunkedLocalAttentionManager"]),
        ],
    )
    def test_vllm_builds_the_coordinator_of_each_layout(self, groups: Any, caching: bool, coordinator: str,
                                                        managers: list[str]) -> None:
        # 40 blocks: one request of max_model_len fits in every group (validate.py, _check_groups_fit)
        s = make(kv_connector=False, kv_cache_groups=groups, enable_prefix_caching=caching, num_blocks=40)
        coord = s.sched.kv_cache_manager.coordinator
        assert type(coord).__name__ == coordinator
        assert [type(m).__name__ for m in coord.single_type_managers] == managers

    def test_a_sliding_window_group_frees_blocks_that_leave_the_window(self) -> None:
        s = make(kv_connector=False, kv_cache_groups=(FULL, SW), max_num_batched_tokens=8)
        s.add(req("a", range(1, 21), max_tokens=6))
        tables = []
        for _ in range(8):
            plan = step(s)
            tables.append(plan.scheduled[0].group_block_ids)
        # a block leaves group 1 once wholly before the window of the tokens
        # processed (remove_skipped_blocks in allocate_slots), replaced by
        # the null block; blocks 3 and 4 were never cached (retention 0 keeps
        # only the replay boundary's tail, blocks 7 and 8), so they go to the
        # free queue's head and come back at once
        assert tables == [
            ((1, 2), (3, 4)),
            ((1, 2, 5, 6), (3, 4, 7, 8)),
            ((1, 2, 5, 6, 4), (0, 0, 7, 8, 3)),
            ((1, 2, 5, 6, 4, 9), (0, 0, 0, 8, 3, 10)),
            ((1, 2, 5, 6, 4, 9), (0, 0, 0, 8, 3, 10)),
            ((1, 2, 5, 6, 4, 9), (0, 0, 0, 8, 3, 10)),
            ((1, 2, 5, 6, 4, 9), (0, 0, 0, 0, 3, 10)),
            ((1, 2, 5, 6, 4, 9, 11), (0, 0, 0, 0, 3, 10, 12)),
        ]
        view = s.view()
        assert view.finished["a"].group_block_ids == () and view.kv.ref_cnt == (0,) * 32

    def test_group_keys_and_a_hit_valid_in_every_group(self) -> None:
        s = make(kv_connector=False, kv_cache_groups=(FULL, SW), max_num_batched_tokens=8)
        s.add(req("a", range(1, 21), max_tokens=6))
        for _ in range(8):
            step(s)
        keys = s.view().kv.block_keys
        # group 1 keeps the replay boundary's tail only (retention 0): the
        # two blocks a hit at 16 tokens needs, keyed with the group suffix
        assert {b: k for b, k in keys.items() if k[0]} == {
            7: group_block_key(("", tuple(range(1, 13))), 1),
            8: group_block_key(("", tuple(range(1, 17))), 1),
        }
        assert keys[7] == ("\x1d1", tuple(range(1, 13)))
        s.add(req("b", range(1, 21), max_tokens=2))
        plan = step(s)
        (b,) = plan.scheduled
        # the full-attention group hits 4 blocks; the window needs the last
        # cdiv(8 - 1, 4) = 2 of them in group 1, found cached; the places
        # before are the null block
        assert (b.num_computed_tokens, b.num_scheduled_tokens) == (16, 4)
        assert b.group_block_ids == ((1, 2, 5, 6, 12), (0, 0, 7, 8, 10))

    def test_a_chunked_local_group_frees_the_blocks_before_the_chunk(self) -> None:
        s = make(kv_connector=False, kv_cache_groups=(FULL, CL), max_num_batched_tokens=8)
        s.add(req("a", range(1, 21), max_tokens=6))
        tables = [step(s).scheduled[0].group_block_ids for _ in range(8)]
        # ChunkedLocalAttentionManager.get_num_skipped_tokens: (n // 8) * 8 of
        # the n tokens processed; remove_skipped_blocks in allocate_slots
        # nulls the two blocks of each chunk the next token no longer sees
        # (at 8, 16 and 24 tokens processed), and the freed ones come back
        assert tables == [
            ((1, 2), (3, 4)),
            ((1, 2, 5, 6), (0, 0, 7, 8)),
            ((1, 2, 5, 6, 9), (0, 0, 0, 0, 10)),
            ((1, 2, 5, 6, 9, 11), (0, 0, 0, 0, 10, 12)),
            ((1, 2, 5, 6, 9, 11), (0, 0, 0, 0, 10, 12)),
            ((1, 2, 5, 6, 9, 11), (0, 0, 0, 0, 10, 12)),
            ((1, 2, 5, 6, 9, 11), (0, 0, 0, 0, 10, 12)),
            ((1, 2, 5, 6, 9, 11, 13), (0, 0, 0, 0, 0, 0, 14)),
        ]
        view = s.view()
        assert view.finished["a"].group_block_ids == () and view.kv.ref_cnt == (0,) * 32
        # every block was cached (no retention for chunked local groups):
        # the chunk's blocks carry group 1's keys
        keys = view.kv.block_keys
        assert keys[7] == group_block_key(("", tuple(range(1, 13))), 1)

    def test_a_hit_in_a_chunked_local_group_needs_only_the_last_chunk(self) -> None:
        s = make(kv_connector=False, kv_cache_groups=(FULL, CL), max_num_batched_tokens=8, num_blocks=24)
        s.add(req("a", range(1, 21), max_tokens=2))
        for _ in range(4):
            step(s)
        s.add(req("b", range(1, 16), max_tokens=2))
        (b,) = step(s).scheduled
        # full attention hits 3 blocks (12 of the 14 tokens a hit may take);
        # ChunkedLocalAttentionManager.find_longest_cache_hit puts nulls
        # before the chunk start 8 and finds block 2 (tokens 8-11) cached
        assert (b.num_computed_tokens, b.num_scheduled_tokens) == (12, 3)
        assert b.group_block_ids[1][:3] == (0, 0, 7)
        # at a chunk boundary no block of the group is needed at all
        s.add(req("c", range(1, 18), max_tokens=1))
        (c,) = [x for x in step(s).scheduled if x.request_id == "c"]
        assert c.num_computed_tokens == 16 and c.group_block_ids[1][:4] == (0, 0, 0, 0)

    def test_a_lone_chunked_local_group_takes_the_tokens_before_the_last_chunk_as_a_hit(self) -> None:
        # with one chunked-local group (UnitaryKVCacheCoordinator) the null
        # blocks before the prompt's last chunk are a hit on an empty cache:
        # vLLM never computes tokens no later token attends to
        s = make(kv_connector=False, kv_cache_groups=(CL,), max_num_batched_tokens=8)
        s.add(req("a", range(1, 21), max_tokens=2))
        (a,) = step(s).scheduled
        assert (a.num_computed_tokens, a.num_scheduled_tokens, a.block_ids) == (16, 4, (0, 0, 0, 0, 1))
        # without prefix caching every token is computed
        s = make(kv_connector=False, kv_cache_groups=(CL,), max_num_batched_tokens=8, enable_prefix_caching=False)
        s.add(req("a", range(1, 21), max_tokens=2))
        (a,) = step(s).scheduled
        assert (a.num_computed_tokens, a.num_scheduled_tokens) == (0, 8)

    def test_a_chunk_vllm_refuses_is_refused_at_the_config(self) -> None:
        # vLLM's scheduler takes any chunk, but its chunked local attention
        # backend asserts a whole number of blocks; with any other chunk the
        # scheduler's hit nulls a block the next token attends (chunk 3,
        # block 2: a hit of 2 tokens with block 0 null, position 2 in the
        # chunk 0-2), so the config refuses it, naming the field
        import inspect

        from vllm.v1.attention.backends.utils import make_local_attention_virtual_batches

        from schedspec.spec.interface import ConfigError

        assert "attn_chunk_size % block_size == 0" in inspect.getsource(make_local_attention_virtual_batches)
        for chunk in (3, 2, 5):
            with pytest.raises(ConfigError, match=r"kv_cache_groups\[1\]\.attention_chunk_size.*multiple of block_size"):
                SchedulerConfig(block_size=4, num_blocks=40, max_model_len=64,
                                kv_cache_groups=(FULL, KVCacheGroup("chunked_local", attention_chunk_size=chunk)))
        assert SchedulerConfig(block_size=4, num_blocks=40, max_model_len=64,
                               kv_cache_groups=(FULL, KVCacheGroup("chunked_local", attention_chunk_size=12)))

    def test_a_plain_layout_carries_no_group_tables(self) -> None:
        s = make(kv_connector=False)
        s.add(req("a", range(1, 11)))
        plan = step(s)
        assert plan.scheduled[0].group_block_ids == ()
        assert s.view().requests["a"].group_block_ids == ()

    def test_the_connector_with_hybrid_groups(self) -> None:
        s = make(kv_cache_groups=(FULL, SW), kv_load_failure_policy="recompute")
        s.add(req("b", range(1, 11), kv_external_tokens=8, kv_load_async=True, kv_save_async=True))
        plan = step(s)
        assert plan.kv_loads == (KVLoad("b", 0, 8, (1, 2), True, ((1, 2), (3, 4))),)
        view = s.view()
        assert view.requests["b"].group_block_ids == ((1, 2), (3, 4))
        step(s, finished_recving=("b",))
        plan = step(s)
        assert shape(plan) == [("b", "NEW", 8, 2)]
        assert plan.scheduled[0].group_block_ids == ((1, 2, 5), (3, 4, 6))
        step(s)
        step(s)  # b finishes (3 tokens): the save holds every group's blocks
        view = s.view()
        assert view.finished["b"].status == S.FINISHED_LENGTH_CAPPED
        # _connector_finished removes the blocks outside the window first
        assert view.kv_held_by_finished == {"b": (1, 2, 5, 4, 6)}
        held_consistent(view)
        step(s, finished_sending=("b",))
        assert s.view().kv.ref_cnt == (0,) * 32

    def test_a_failed_load_with_hybrid_groups(self) -> None:
        s = make(kv_cache_groups=(FULL, SW), kv_load_failure_policy="fail")
        s.add(req("b", range(1, 11), kv_external_tokens=8, kv_load_async=True))
        step(s)
        step(s, finished_recving=("b",), failed_recving=("b",))
        view = s.view()
        assert view.finished["b"].status == S.FINISHED_ERROR and view.kv.ref_cnt == (0,) * 32


# ----------------------------------------------------------------------------- orders vLLM leaves to the hash seed


class TestPinnedOrders:
    """vLLM walks sets of request ids where several requests are freed in one
    update (finished_sending / finished_recving, finish_requests of the
    step's errors): string hashes are seeded per process, so vLLM's free
    order varies from run to run. The spec takes sorted order and the adapter
    pins vLLM to it (docs/divergences.md)."""

    def test_saves_reported_together_free_in_sorted_order(self) -> None:
        from schedspec.spec.scheduler import SpecScheduler

        for sched in (make(), SpecScheduler(SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=32,
                                                            max_num_seqs=4, max_model_len=64, kv_connector=True))):
            for rid, base in (("x", 100), ("y", 200), ("z", 300)):
                sched.add(req(rid, range(base, base + 6), 1, kv_save_async=True))
            step(sched)
            assert sched.view().kv_held_by_finished == {"x": (1, 2), "y": (3, 4), "z": (5, 6)}
            step(sched, finished_sending=("z", "x", "y"))
            # x, y, z each freed last block first: the unhashed ones to the
            # head (LIFO), the hashed ones to the tail
            queue = sched.view().kv.free_queue
            assert queue[:3] == (6, 4, 2) and queue[-3:] == (1, 3, 5)

    def test_requests_failed_together_free_in_sorted_order(self) -> None:
        from schedspec.spec.scheduler import SpecScheduler

        cfg = SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=32, max_num_seqs=4,
                              max_model_len=64, kv_connector=True, async_scheduling=True)
        for sched in (make(async_scheduling=True), SpecScheduler(cfg)):
            prompt = tuple(range(201, 213))
            sched.add(req("r0", prompt, 3, kv_external_tokens=11))
            p1 = sched.schedule()
            sched.add(req("r1", prompt + (213, 214, 215, 216, 217), 5, kv_external_tokens=5))
            p2 = sched.schedule()  # r1 hits r0's blocks 1-3
            # block 2 of r0's synchronous load failed: both requests read it;
            # policy "fail" finishes both, their frees deferred behind p2
            sched.update(p1, StepResult({"r0": (9,)}, invalid_block_ids=(2,)))
            assert {k: v.status for k, v in sched.view().finished.items()} == {
                "r0": S.FINISHED_ERROR, "r1": S.FINISHED_ERROR}
            sched.update(p2, StepResult({"r0": (9,), "r1": (6,)}))
            view = sched.view()
            assert view.kv.free_queue[:4] == (6, 3, 2, 4) and view.kv.free_queue[-2:] == (5, 1)
            assert sorted(view.kv.block_keys) == [1, 5]  # blocks 2 and 3 evicted


# ----------------------------------------------------------------------------- lockstep with the spec


def _kv_events() -> list[Any]:
    from schedspec.check.workload import Abort, AddRequest, KVLoadDone, KVLoadFailed, KVSaveDone, Step

    return [
        AddRequest(req("a", range(1, 11), 3, kv_external_tokens=8)),
        AddRequest(req("b", range(21, 35), 4, kv_external_tokens=12, kv_load_async=True, kv_save_async=True)),
        AddRequest(req("c", range(41, 51), 3, kv_external_tokens=8, kv_load_async=True)),
        AddRequest(req("d", range(61, 71), 3, kv_external_tokens=6, kv_load_async=True)),
        Step(),
        Step(),
        KVLoadDone("b"),
        KVLoadFailed("c", None),
        Step(),
        Abort("d"),
        Step(),
        AddRequest(req("e", range(1, 15), 2, kv_external_tokens=12, kv_save_async=True)),
        Step(),
        KVLoadDone("d"),
        Step(),
        Step(),
        KVSaveDone("b"),
        Step(),
        Step(),
        KVSaveDone("e"),
        Step(),
    ]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("groups", [(), (FULL, SW), (SW,)], ids=["plain", "full+sw", "sw"])
def test_lockstep_with_the_spec_on_connector_events(policy: str, async_scheduling: bool, groups: Any) -> None:
    """Plans (loads included) and views equal after every operation, every
    invariant on, the check's worker delivering the reports and waiting out
    the rest (quiescence: every block free at the end)."""
    from schedspec.check.driver import Runner
    from schedspec.spec.scheduler import SpecScheduler

    def vllm(config: SchedulerConfig) -> Any:
        from schedspec.adapters.vllm_adapter import VllmScheduler

        return VllmScheduler(config)

    config = SchedulerConfig(block_size=4, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=4,
                             max_model_len=48, kv_connector=True, kv_load_failure_policy=policy,
                             kv_cache_groups=groups, async_scheduling=async_scheduling)
    runner = Runner(config, {"spec": SpecScheduler, "vllm": vllm}, check_invariants=True)
    failure = runner.run(tuple(_kv_events()))
    assert failure is None, failure.describe()
