"""impl/queues.py: the waiting queues and the victim heap, unit by unit, and
their lazy deletion and compaction under many aborts and short-lived requests
(spec and impl side by side). Their equivalence with plain models is
property-tested in tests/impl/test_structures.py."""

from __future__ import annotations

import contextlib
from typing import Any

from schedspec.spec import Policy

from tests.helpers import BothRaised, Twin, cfg, req


def test_priority_waiting_queue_compacts_after_many_aborts() -> None:
    t = Twin(cfg(policy=Policy.PRIORITY, max_num_seqs=1, max_num_batched_tokens=8))
    for i in range(200):
        t.add(req(f"r{i:03}", [i % 16, 1], max_tokens=2, priority=i % 3, arrival=200 - i))
    for i in range(200):
        if i % 4:
            t.abort(f"r{i:03}")
    assert len(t.impl._waiting._heap) < 200  # compacted
    for _ in range(8):
        t.step()
    for i in range(0, 200, 8):
        with contextlib.suppress(BothRaised):
            t.abort(f"r{i:03}")
    for _ in range(4):
        t.step()


def test_victim_heap_compacts_and_still_finds_the_victim() -> None:
    # many short requests come and go (stale victim entries), then a preemption
    t = Twin(cfg(policy=Policy.PRIORITY, num_blocks=9, max_model_len=32, max_num_seqs=2))
    for i in range(90):
        t.add(req(f"s{i:02}", [i % 16], max_tokens=1, priority=i % 4, arrival=i))
    for _ in range(60):
        t.step()
    assert not t.impl.view().requests
    assert len(t.impl._victims._heap) <= 2 * 0 + 64 + 2
    t.add(req("a", 13, max_tokens=20, priority=0, arrival=1000))
    t.add(req("b", [9] * 13, max_tokens=20, priority=1, arrival=1001))
    preempted: list[str] = []
    for _ in range(20):
        preempted += t.step().preempted_ids
    assert "b" in preempted


class _Q:
    """A queued request as impl/queues.py sees one."""

    def __init__(self, rid: str, priority: int = 0, arrival: int = 0) -> None:
        self.request_id, self.priority, self.arrival = rid, priority, arrival
        self.waiting_seq = -1
        self.running_seq = -1
        self.is_running = False


def test_priority_waiting_queue_serves_in_key_order_through_removals() -> None:
    from schedspec.impl.queues import PriorityWaiting

    q: Any = PriorityWaiting()
    a, b, c, d = _Q("a", 1, 5), _Q("b", 0, 9), _Q("c", 1, 2), _Q("d", 0, 9)
    for r in (a, b, c, d):
        q.push_back(r)
    assert len(q) == 4 and [r.request_id for r in q.order()] == ["b", "d", "c", "a"]
    q.remove(a)  # a, the first one pushed, leaves from the middle
    assert len(q) == 3 and [r.request_id for r in q.order()] == ["b", "d", "c"]
    assert q.peek() is b and q.pop_head() is b and len(q) == 2
    q.push_front(b)  # preempted: back in key order
    assert q.peek() is b
    for r in (b, d, c):
        q.remove(r)
    assert len(q) == 0 and list(q.order()) == []
    q.push_back(a)
    assert q.peek() is a and q.pop_head() is a and len(q) == 0
    # an id that comes back (a new request object, same key) after being removed
    e1 = _Q("e", 3, 3)
    q.push_back(e1)
    q.remove(e1)
    e2 = _Q("e", 3, 3)
    q.push_back(e2)
    q.push_back(_Q("f", 3, 3))
    assert [r.request_id for r in q.order()] == ["e", "f"]
    assert q.pop_head() is e2 and q.pop_head().request_id == "f" and len(q) == 0


def test_priority_waiting_queue_compaction_keeps_the_live_order() -> None:
    from schedspec.impl.queues import PriorityWaiting

    q: Any = PriorityWaiting()
    reqs = [_Q(f"r{i:03}", i % 3, 100 - i) for i in range(100)]
    for r in reqs:
        q.push_back(r)
    for r in reqs[:90]:
        q.remove(r)
    assert len(q) == 10 and len(q._heap) <= 2 * 10 + 64 + 1
    assert [r.request_id for r in q.order()] == [r.request_id for r in sorted(reqs[90:], key=lambda r: (r.priority, r.arrival))]
    assert q.pop_head().request_id == min(reqs[90:], key=lambda r: (r.priority, r.arrival)).request_id
    for r in list(q.order()):
        q.remove(r)
    assert len(q) == 0


def test_victim_heap_rebuilds_from_the_running_and_skips_stale_entries() -> None:
    from schedspec.impl.queues import VictimHeap

    h: Any = VictimHeap()
    stale = [_Q(f"s{i}", 9, i) for i in range(80)]
    for i, r in enumerate(stale):
        r.running_seq = i
        h.push(r)
    running = [_Q("x", 1, 4), _Q("y", 2, 1), _Q("z", 2, 3), _Q("w", 0, 9)]
    for i, r in enumerate(running):
        r.running_seq, r.is_running = 100 + i, True
    h.compact(running)  # 80 stale entries > 2 * 4 + 64: rebuilt from the running requests
    assert len(h._heap) == 4
    assert h.top() is running[2]  # priority 2, the later arrival
    running[2].is_running = False
    assert h.top() is running[1]
    running[1].running_seq = 7  # re-admitted since: its entry is stale
    running[1].is_running = True
    h.push(running[1])
    assert h.top() is running[1]
    small: Any = VictimHeap()
    small.push(running[0])
    small.compact([running[0]])
    assert len(small._heap) == 1
