"""Waiting queues and the PRIORITY victim heap.

- FCFS waiting (vLLM: FCFSRequestQueue, a deque): an OrderedDict keyed by
  request id, so append, prepend (a preempted request goes back to the front),
  peek/pop at the head and removal from the middle (abort) are all O(1).
- PRIORITY waiting (vLLM: PriorityRequestQueue, a heap on Request.__lt__): a
  binary heap of ``(priority, arrival, request_id, seq, request)`` with lazy
  deletion. Request ids are unique among live entries, so the head is the
  spec's ``min`` on (priority, arrival, request_id); ``seq`` keeps stale
  entries of a reused request id from ever comparing their payloads.
- PRIORITY victims: ``max(running, key=(priority, arrival))``, the first such
  request in running order. Running order is admission order, so a min-heap
  on ``(-priority, -arrival, running_seq)`` with lazy deletion gives the same
  request in O(log n) instead of a scan.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Generic, Iterator, Protocol, TypeVar

from schedspec.spec.interface import Policy


class Runnable(Protocol):
    """What the victim heap reads of a running request."""

    priority: int
    arrival: int
    running_seq: int

    @property
    def is_running(self) -> bool: ...


class Queued(Runnable, Protocol):
    """What the waiting queues read of a request, besides the above."""

    request_id: str
    waiting_seq: int


R = TypeVar("R", bound=Queued)
V = TypeVar("V", bound=Runnable)


class FcfsWaiting(Generic[R]):
    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: OrderedDict[str, R] = OrderedDict()

    def __len__(self) -> int:
        return len(self._q)

    def push_back(self, req: R) -> None:
        self._q[req.request_id] = req

    def push_front(self, req: R) -> None:
        self._q[req.request_id] = req
        self._q.move_to_end(req.request_id, last=False)

    def peek(self) -> R:
        return next(iter(self._q.values()))

    def pop_head(self) -> R:
        return self._q.popitem(last=False)[1]

    def remove(self, req: R) -> None:
        del self._q[req.request_id]

    def order(self) -> Iterator[R]:
        return iter(list(self._q.values()))

    def copy(self, remap: dict[int, R]) -> "FcfsWaiting[R]":
        """This queue over other request objects: ``remap[id(old)]`` is the new one."""
        new: FcfsWaiting[R] = object.__new__(type(self))
        new._q = OrderedDict([(rid, remap[id(r)]) for rid, r in self._q.items()])
        return new


_HeapEntry = tuple[int, int, str, int, R]


class PriorityWaiting(Generic[R]):
    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str, int, R]] = []
        self._live = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._live

    def push_back(self, req: R) -> None:
        self._seq += 1
        req.waiting_seq = self._seq
        heapq.heappush(self._heap, (req.priority, req.arrival, req.request_id, self._seq, req))
        self._live += 1

    # A preempted request is ordered by its key like any other.
    push_front = push_back

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap and heap[0][4].waiting_seq != heap[0][3]:
            heapq.heappop(heap)

    def peek(self) -> R:
        self._drop_stale()
        return self._heap[0][4]

    def pop_head(self) -> R:
        self._drop_stale()
        req = heapq.heappop(self._heap)[4]
        req.waiting_seq = -1
        self._live -= 1
        return req

    def remove(self, req: R) -> None:
        req.waiting_seq = -1
        self._live -= 1
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [e for e in self._heap if e[4].waiting_seq == e[3]]
            heapq.heapify(self._heap)

    def order(self) -> Iterator[R]:
        live = sorted(e for e in self._heap if e[4].waiting_seq == e[3])
        return iter([e[4] for e in live])

    def copy(self, remap: dict[int, R]) -> "PriorityWaiting[R]":
        """This queue over other request objects (``remap[id(old)]``); stale
        entries of requests no longer known are dropped (they can never be
        live again: a request leaves the scheduler only finished)."""
        new: PriorityWaiting[R] = object.__new__(type(self))
        new._heap = [(p, a, rid, seq, remap[id(r)]) for p, a, rid, seq, r in self._heap
                     if id(r) in remap]
        heapq.heapify(new._heap)
        new._live = self._live
        new._seq = self._seq
        return new


class VictimHeap(Generic[V]):
    """PRIORITY preemption victims among the running requests."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, V]] = []

    def push(self, req: V) -> None:
        heapq.heappush(self._heap, (-req.priority, -req.arrival, req.running_seq, req))

    def top(self) -> V:
        """The running request to preempt. The caller guarantees one runs."""
        heap = self._heap
        while True:
            e = heap[0]
            req = e[3]
            if req.is_running and req.running_seq == e[2]:
                return req
            heapq.heappop(heap)

    def copy(self, remap: dict[int, V]) -> "VictimHeap[V]":
        """This heap over other request objects (``remap[id(old)]``); entries
        of requests no longer known are dropped (never running again)."""
        new: VictimHeap[V] = object.__new__(type(self))
        new._heap = [(p, a, seq, remap[id(r)]) for p, a, seq, r in self._heap if id(r) in remap]
        heapq.heapify(new._heap)
        return new

    def compact(self, running: list[V]) -> None:
        if len(self._heap) > 2 * len(running) + 64:
            self._heap = [(-r.priority, -r.arrival, r.running_seq, r) for r in running]
            heapq.heapify(self._heap)


class _Running:
    """A running request reduced to what the victim heap reads."""

    __slots__ = ("priority", "arrival", "running_seq")

    def __init__(self, index: int, priority: int, arrival: int) -> None:
        self.priority = priority
        self.arrival = arrival
        self.running_seq = index

    @property
    def is_running(self) -> bool:
        return True


def choose_victim(policy: Policy, running_keys: list[tuple[int, int]]) -> int:
    """The index, in running order, of the request the scheduler preempts,
    given each running request's ``(priority, arrival)``: FCFS the last one;
    PRIORITY the top of a VictimHeap holding the running requests, pushed in
    running order with their admission sequence numbers, as ImplScheduler
    keeps it. (spec/rules.py states the rule directly; the test suite compares
    the two with ``crosshair diffbehavior``.)"""
    if policy == Policy.FCFS:
        return len(running_keys) - 1
    heap: VictimHeap[_Running] = VictimHeap()
    for i, (priority, arrival) in enumerate(running_keys):
        heap.push(_Running(i, priority, arrival))
    return heap.top().running_seq
