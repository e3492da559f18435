"""Each optimization of impl/ against a plain model of what it replaces.

- FreeBlockQueue (linked list over arrays) vs a Python list.
- FcfsWaiting / PriorityWaiting vs a list kept in the spec's service order.
- VictimHeap vs the spec's rule (first maximal (priority, arrival) in running order).
- PrefixIndex (interned chained keys) vs a dict keyed by the spec's BlockKey.
- Plan entries built by filling __dict__ vs ScheduledRequest(...).
- The one-pass update with rollback vs the spec's errors: covered by the
  lockstep machine's bad_update rule; here a direct check that a rejected
  update leaves the scheduler exactly as it was.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from schedspec.impl import ImplScheduler
from schedspec.impl.free_queue import FreeBlockQueue
from schedspec.impl.prefix_index import PrefixIndex
from schedspec.impl.queues import FcfsWaiting, PriorityWaiting, VictimHeap
from schedspec.spec import rules
from schedspec.spec.interface import (
    BlockKey,
    Policy,
    ProtocolError,
    RequestError,
    RequestSpec,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    StepResult,
)

from tests.helpers import cfg, message, req, step


# --------------------------------------------------------------------------
# Free queue
# --------------------------------------------------------------------------


class FreeQueueVsList(RuleBasedStateMachine):
    @initialize(n=st.integers(2, 40))
    def setup(self, n: int) -> None:
        self.q = FreeBlockQueue(n)
        self.model = list(range(1, n))
        self.out: list[int] = []  # blocks not in the queue

    @rule(k=st.integers(0, 6))
    def popleft(self, k: int) -> None:
        k = min(k, len(self.model))
        got = self.q.popleft_n(k)
        assert got == self.model[:k]
        del self.model[:k]
        self.out += got

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.model))
        self.q.remove(b)
        self.model.remove(b)
        self.out.append(b)

    @precondition(lambda self: bool(self.out))
    @rule(data=st.data(), front=st.booleans())
    def give_back(self, data: st.DataObject, front: bool) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.out), unique=True, max_size=5))
        for b in chosen:
            self.out.remove(b)
        if front:
            self.q.prepend(chosen)
            self.model = chosen + self.model
        else:
            self.q.append(chosen)
            self.model = self.model + chosen

    @invariant()
    def same(self) -> None:
        assert self.q.to_list() == self.model
        assert len(self.q) == len(self.model)


TestFreeQueueVsList = FreeQueueVsList.TestCase
TestFreeQueueVsList.settings = settings(max_examples=200, stateful_step_count=40, deadline=None, derandomize=True)


def test_free_queue_popleft_too_many() -> None:
    q = FreeBlockQueue(3)
    with pytest.raises(IndexError):
        q.popleft_n(3)
    assert q.to_list() == [1, 2]


# --------------------------------------------------------------------------
# Waiting queues and victims
# --------------------------------------------------------------------------


class _Q:
    def __init__(self, rid: str, priority: int, arrival: int) -> None:
        self.request_id = rid
        self.priority = priority
        self.arrival = arrival
        self.waiting_seq = -1
        self.running_seq = -1
        self.running = False

    @property
    def is_running(self) -> bool:
        return self.running


ops = st.lists(
    st.tuples(st.sampled_from(["back", "front", "pop", "remove", "peek"]), st.integers(0, 3), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ops)
def test_fcfs_waiting_vs_list(script: list[tuple[str, int, int]]) -> None:
    q: FcfsWaiting[_Q] = FcfsWaiting()
    model: list[_Q] = []
    n = 0
    for op, p, a in script:
        if op in ("back", "front"):
            n += 1
            r = _Q(f"r{n}", p, a)
            if op == "back":
                q.push_back(r)
                model.append(r)
            else:
                q.push_front(r)
                model.insert(0, r)
        elif op == "pop" and model:
            assert q.pop_head() is model.pop(0)
        elif op == "remove" and model:
            r = model.pop(p % len(model))
            q.remove(r)
        elif op == "peek" and model:
            assert q.peek() is model[0]
        assert [r.request_id for r in q.order()] == [r.request_id for r in model]
        assert len(q) == len(model)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ops, st.booleans())
def test_priority_waiting_vs_sorted(script: list[tuple[str, int, int]], reuse_ids: bool) -> None:
    """The heap head is always the spec's min on (priority, arrival, id),
    also when a request id comes back after its request left the queue."""
    q: PriorityWaiting[_Q] = PriorityWaiting()
    model: list[_Q] = []
    n = 0

    def key(r: _Q) -> tuple[int, int, str]:
        return (r.priority, r.arrival, r.request_id)

    for op, p, a in script:
        if op in ("back", "front"):
            n += 1
            rid = f"r{n % 3 if reuse_ids else n}"
            if any(r.request_id == rid for r in model):
                continue  # ids are unique among live requests
            r = _Q(rid, p, a)
            (q.push_back if op == "back" else q.push_front)(r)
            model.append(r)
        elif op == "pop" and model:
            head = min(model, key=key)
            assert q.pop_head() is head
            model.remove(head)
        elif op == "remove" and model:
            r = model.pop(p % len(model))
            q.remove(r)
        elif op == "peek" and model:
            assert q.peek() is min(model, key=key)
        assert [r.request_id for r in q.order()] == [r.request_id for r in sorted(model, key=key)]
        assert len(q) == len(model)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["admit", "finish", "victim"]), st.integers(0, 2), st.integers(0, 2)), max_size=60))
def test_victim_heap_vs_scan(script: list[tuple[str, int, int]]) -> None:
    """spec.rules.choose_victim for PRIORITY: the first request in running
    order with the largest (priority, arrival)."""
    heap: VictimHeap[_Q] = VictimHeap()
    running: list[_Q] = []
    seq = 0
    for op, p, a in script:
        if op == "admit":
            seq += 1
            r = _Q(f"r{seq}", p, a)
            r.running_seq = seq
            r.running = True
            running.append(r)
            heap.push(r)
        elif op == "finish" and running:
            r = running.pop(p % len(running))
            r.running = False
        elif op == "victim" and running:
            best = 0
            for i in range(1, len(running)):
                if (running[i].priority, running[i].arrival) > (running[best].priority, running[best].arrival):
                    best = i
            assert heap.top() is running[best]
            # preempt it, as the scheduler does
            running.pop(best).running = False
        heap.compact(running)


# --------------------------------------------------------------------------
# Prefix index: interned chained keys vs the spec's content keys
# --------------------------------------------------------------------------


class PrefixIndexVsSpecKeys(RuleBasedStateMachine):
    """Register chains of blocks, evict blocks, look up prefixes: the interned
    index answers like a dict on (salt, full token prefix)."""

    BS = 2

    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks: int) -> None:
        self.px = PrefixIndex(num_blocks)
        self.free_blocks = list(range(1, num_blocks))
        self.model_key: dict[int, BlockKey] = {}
        self.model_index: dict[BlockKey, list[int]] = {}

    @precondition(lambda self: bool(self.free_blocks))
    @rule(salt=st.sampled_from(["", "s"]), tokens=st.lists(st.integers(0, 1), min_size=2, max_size=8))
    def register_chain(self, salt: str, tokens: list[int]) -> None:
        """A request computes its blocks: each full block gets a fresh block id
        and the key (parent node, its tokens)."""
        parent: object = salt
        for i in range(len(tokens) // self.BS):
            if not self.free_blocks:
                break
            b = self.free_blocks.pop(0)
            chunk = tuple(tokens[i * self.BS : (i + 1) * self.BS])
            self.px.register(b, parent, chunk)  # type: ignore[arg-type]
            key: BlockKey = (salt, tuple(tokens[: (i + 1) * self.BS]))
            self.model_key[b] = key
            self.model_index.setdefault(key, []).append(b)
            parent = self.px.block_node[b]

    @precondition(lambda self: bool(self.model_key))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(sorted(self.model_key)))
        self.px.evict(b)
        key = self.model_key.pop(b)
        self.model_index[key].remove(b)
        if not self.model_index[key]:
            del self.model_index[key]
        self.free_blocks.append(b)

    @rule(salt=st.sampled_from(["", "s"]), tokens=st.lists(st.integers(0, 1), min_size=2, max_size=8))
    def lookup(self, salt: str, tokens: list[int]) -> None:
        parent: object = salt
        for i in range(len(tokens) // self.BS):
            node = self.px.lookup(parent, tuple(tokens[i * self.BS : (i + 1) * self.BS]))  # type: ignore[arg-type]
            holders = self.model_index.get((salt, tuple(tokens[: (i + 1) * self.BS])))
            if node is None:
                assert not holders
                break
            assert holders and next(iter(node.holders)) == holders[0]
            parent = node

    @rule()
    def clear_if_empty(self) -> None:
        if not self.model_key:
            self.px.clear()

    @invariant()
    def same(self) -> None:
        block_keys, index = self.px.views()
        assert block_keys == self.model_key
        assert index == {k: tuple(v) for k, v in self.model_index.items()}

    @invariant()
    def no_leak(self) -> None:
        """Every interned node is a key some block holds, or an ancestor of one."""
        live = set()
        for node in self.px.block_node:
            while node is not None and not isinstance(node, str):
                live.add(id(node))
                node = node.parent if not isinstance(node.parent, str) else None
        assert {id(n) for n in self.px.intern.values()} == live


TestPrefixIndexVsSpecKeys = PrefixIndexVsSpecKeys.TestCase
TestPrefixIndexVsSpecKeys.settings = settings(max_examples=200, stateful_step_count=40, deadline=None, derandomize=True)


# --------------------------------------------------------------------------
# Plan entries and update
# --------------------------------------------------------------------------


def _small() -> ImplScheduler:
    s = ImplScheduler(SchedulerConfig(block_size=2, num_blocks=20, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16))
    for i in range(3):
        s.add(RequestSpec(f"r{i}", (1, 2, 3, 4, 5), max_tokens=5))
    return s


def test_fast_plan_entries_equal_constructed_ones() -> None:
    s = _small()
    for _ in range(4):
        plan = s.schedule()
        for e in plan.scheduled:
            built = ScheduledRequest(
                request_id=e.request_id,
                kind=e.kind,
                num_computed_tokens=e.num_computed_tokens,
                num_scheduled_tokens=e.num_scheduled_tokens,
                num_tokens=e.num_tokens,
                block_ids=e.block_ids,
                token_ids=e.token_ids,
            )
            assert e == built and hash(e) == hash(built) and repr(e) == repr(built)
            assert list(vars(e)) == list(vars(built))
            assert pickle.loads(pickle.dumps(e)) == built
            assert type(e.block_ids) is tuple and type(e.token_ids) is tuple
        s.update(plan, StepResult({e.request_id: (7,) for e in plan.scheduled if e.samples}))
    assert any(e.kind == ScheduleKind.RUNNING for e in plan.scheduled)


@pytest.mark.parametrize("policy", [Policy.FCFS, Policy.PRIORITY])
def test_rejected_update_changes_nothing(policy: Policy) -> None:
    s = ImplScheduler(SchedulerConfig(block_size=2, num_blocks=20, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16, policy=policy))
    for i in range(3):
        s.add(RequestSpec(f"r{i}", (1, 2, 3), max_tokens=5))
    plan = s.schedule()
    s.update(plan, StepResult({e.request_id: (7,) for e in plan.scheduled if e.samples}))
    plan = s.schedule()
    before = s.view()
    good = {e.request_id: (7,) for e in plan.scheduled if e.samples}
    last = plan.scheduled[-1].request_id
    for bad in (
        {**good, last: (-1,)},  # the last entry is bad: every earlier token must be undone
        {**good, "zz": (1,)},
        {k: v for k, v in good.items() if k != last},
        {**good, last: (1, 2)},
    ):
        with pytest.raises(ProtocolError):
            s.update(plan, StepResult(bad))
        assert s.view() == before
    s.update(plan, StepResult(good))
    assert s.view() != before


def test_int_subclass_tokens_take_the_plain_path() -> None:
    """The spec accepts any int that is not a bool; so must the fast path."""
    import enum

    class Tok(enum.IntEnum):
        A = 7

    s = _small()
    plan = s.schedule()
    s.update(plan, StepResult({e.request_id: (Tok.A,) for e in plan.scheduled if e.samples}))
    assert s.view().requests["r0"].output_token_ids == (7,)


def test_impl_imports_only_the_interface() -> None:
    """impl/ is written independently of the spec's logic: its modules import
    from the spec only the interface types (and the protocol boundary every
    scheduler shares), never the spec's scheduling logic."""
    import ast
    from pathlib import Path

    import schedspec.impl

    # spec.stats holds only the statistics' types every scheduler reports (the spec's counting
    # of them is spec/stats_record.py, which impl does not import)
    allowed = {"schedspec.spec.interface", "schedspec.spec.protocol", "schedspec.spec.stats"}
    root = Path(schedspec.impl.__file__).parent
    seen: set[str] = set()
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] if node.level == 0 else []
                if node.module == "schedspec":
                    names = [f"schedspec.{a.name}" for a in node.names]
            for name in names:
                if name.split(".")[0] in ("spec", "schedspec") and name.split(".")[:2] != ["schedspec", "impl"]:
                    assert name in allowed, f"{path.name} imports {name}"
                    seen.add(name)
    assert "schedspec.spec.interface" in seen  # the walk sees impl's imports at all


# --------------------------------------------------------------------------
# Counts, the free queue, the prefix index, the rules' counterparts
# --------------------------------------------------------------------------


def test_impl_stats_count_its_structures() -> None:
    s = ImplScheduler(cfg(max_num_seqs=1))
    assert s.stats() == {"requests": 0, "waiting": 0, "running": 0, "free_blocks": 8, "interned_keys": 0}
    s.add(req("a", 9, max_tokens=3))
    s.add(req("b", 2))
    step(s)
    assert s.stats() == {"requests": 2, "waiting": 1, "running": 1, "free_blocks": 5, "interned_keys": 2}


def test_free_queue_keeps_its_order_through_every_operation() -> None:
    from schedspec.impl.free_queue import FreeBlockQueue

    q = FreeBlockQueue(6)
    assert (len(q), q.to_list(), list(q)) == (5, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    q.remove(3)  # a block never allocated, from the middle
    assert (len(q), q.to_list()) == (4, [1, 2, 4, 5])
    q.remove(1)
    q.remove(5)
    assert q.to_list() == [2, 4]
    q.prepend([5, 1])
    q.append([3])
    assert q.to_list() == [5, 1, 2, 4, 3]
    assert q.popleft_n(2) == [5, 1] and q.to_list() == [2, 4, 3] and len(q) == 3
    assert message(lambda: q.popleft_n(4), IndexError) == "popleft_n(4) from a queue of 3"
    assert q.popleft_n(3) == [2, 4, 3] and q.to_list() == [] and len(q) == 0
    q.append([4, 2])
    q.prepend([])
    q.append([])
    assert q.to_list() == [4, 2]
    one = FreeBlockQueue(2)
    assert one.to_list() == [1] and one.popleft_n(1) == [1] and one.to_list() == []


def test_iterating_a_free_queue_yields_each_free_block_once_and_stops() -> None:
    """A new queue, and one whose blocks were all taken and given back, lists
    exactly its free blocks (a bounded read, so a queue linked into a cycle
    fails here instead of hanging)."""
    import itertools

    for n in (2, 3, 6):
        q = FreeBlockQueue(n)
        assert list(itertools.islice(q, n + 2)) == list(range(1, n))
        taken = q.popleft_n(n - 1)
        assert list(itertools.islice(q, n + 2)) == []
        q.append(taken[::-1])
        assert list(itertools.islice(q, n + 2)) == list(range(n - 1, 0, -1))


def _drive(make: Callable[[SchedulerConfig], Any], seed: int, check: Callable[[Any], None]) -> None:
    """Run a seeded random workload on one scheduler with the fake model, calling
    ``check`` after every operation."""
    from schedspec.check.oracle import FakeModel
    from schedspec.check.random_workloads import random_workload
    from schedspec.check.workload import Abort, AddRequest, ResetPrefixCache

    w = random_workload(seed, 60)
    s = make(w.config)
    model = FakeModel(w.config.block_size, 64, seed)
    for e in w.events:
        if isinstance(e, AddRequest):
            s.add(e.request)
        elif isinstance(e, Abort):
            with contextlib.suppress(RequestError):
                s.abort(e.request_id)
        elif isinstance(e, ResetPrefixCache):
            s.reset_prefix_cache(e.reset_running_requests)
        else:
            plan = s.schedule()
            result, _ = model.run(plan)
            s.update(plan, result)
        check(s)


@pytest.mark.parametrize("seed", range(6))
def test_prefix_index_interns_exactly_the_live_keys(seed: int) -> None:
    """A key node lives exactly while it, or a node below it, holds a block: no
    leaked node, none dropped early (impl/prefix_index.py)."""
    from schedspec.impl.prefix_index import KeyNode

    def check(s: Any) -> None:
        px = s._px
        live: set[int] = set()
        for node in px.block_node:
            while isinstance(node, KeyNode) and id(node) not in live:
                live.add(id(node))
                node = node.ikey[0]
        assert {id(n) for n in px.intern.values()} == live
        for n in px.intern.values():
            children = sum(1 for m in px.intern.values() if m.ikey[0] is n)
            assert n.refs == len(n.holders) + children

    _drive(ImplScheduler, seed, check)


def test_impl_counterparts_of_the_rules_agree_on_a_small_domain() -> None:
    """impl's module-level counterparts of spec/rules.py helpers (compared
    symbolically by tests/modelcheck/test_modelcheck.py) agree on an exhaustive small
    domain too, ties included."""
    import itertools

    from schedspec.impl.queues import choose_victim
    from schedspec.impl.scheduler import max_hit_blocks

    for n in range(1, 20):
        for bs in range(1, 6):
            assert max_hit_blocks(n, bs) == rules.max_hit_blocks(n, bs), (n, bs)
    keys = [(p, a) for p in (0, 1, 2) for a in (0, 1)]
    for size in range(1, 4):
        for running in itertools.product(keys, repeat=size):
            for policy in (Policy.FCFS, Policy.PRIORITY):
                got = choose_victim(policy, list(running))
                assert got == rules.choose_victim(policy, list(running)), (policy, running)
