"""The KV connector's worker as the checker carries it with a state.

The worker is the check engine's own (schedspec/check/oracle.py, KVWorker):
the checker builds one from a state's snapshot (``KVWorld``) for each step,
lets it deliver the reports exactly as the check driver's does, and keeps
its snapshot after the step with the successor. What a state holds of it:
the asynchronous loads in flight (each with the step that started it), the
saves first seen pending (each with that step), the reports queued and not
yet meaningful (always none between the checker's states: a report event is
explored only where the step it comes with delivers it), the prompts it
loads from, and the fake model's KV slots (carried, not fingerprinted: a
load reported done writes KV that the state vouches for only once the
request is promoted; as with async scheduling's Flight, a correct scheduler
reads only slots its state vouches for or a load wrote).

The bounded wait: the checker's worker reports every load and every save at
the latest ``Space.kv_report_bound`` steps after it started (at most
schedspec.check.KV_REPORT_BOUND, the driver's); each forced report is an
explicit event of the step (``forced_reports``), so a counterexample trace
replays through the driver's worker with the same reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schedspec.check.oracle import FakeModel, KVWorker, AsyncLoad
from schedspec.check.workload import KVLoadDone, KVLoadFailed, KVSaveDone
from schedspec.modelcheck.events import KV_OPS, Alphabet
from schedspec.spec.interface import KVLoad, RequestStatus, SchedulerConfig, SchedulerView

#: the statuses in which a request's next admission asks the connector (a
#: synchronous load can come with the step that admits it)
_ADMITTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _order(rid: str) -> tuple[int, str]:
    """The checker's ids ``r{k}`` in arrival order."""
    return (len(rid), rid)


@dataclass(slots=True)
class KVWorld:
    """A snapshot of the worker beside one state (see the module's doc)."""

    #: request id -> (its asynchronous load in flight, the step that started it)
    loads: dict[str, tuple[KVLoad, int]] = field(default_factory=dict)
    #: request id -> the step whose plan first saw its blocks held for a save
    saves: dict[str, int] = field(default_factory=dict)
    #: the worker's events not yet delivered
    queue: tuple[Any, ...] = ()
    #: request id -> its prompt (what the connector's store holds)
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: the last plan's step (ages are counted from it)
    now: int = 0
    #: the fake model's KV slots
    slots: dict[int, int] = field(default_factory=dict)
    #: the invalid blocks awaiting recomputation, as the invariants' History
    #: keeps them (block -> (index in its holders' tables, the requests
    #: excused)): part of the state, since invalid-block-not-computed judges
    #: later transitions by it
    invalid: dict[int, tuple[int, frozenset[str]]] = field(default_factory=dict)

    def worker(self, config: SchedulerConfig, model: FakeModel | None, bound: int) -> KVWorker:
        """A worker in this state (its own copies), writing into ``model``."""
        w = KVWorker(config, model, bound)
        w.loads = {rid: AsyncLoad(load, start) for rid, (load, start) in self.loads.items()}
        w.saves = dict(self.saves)
        w.queue = list(self.queue)
        w.prompts = dict(self.prompts)
        return w

    @staticmethod
    def of(w: KVWorker, now: int, slots: dict[int, int], v: SchedulerView) -> KVWorld:
        """The snapshot of ``w`` after a step (plan ``now``); prompts of
        requests the state no longer knows, that load nothing and hold
        nothing, are dropped."""
        assert not w.unapplied, "a synchronous step applies its reports"
        keep = set(v.requests) | set(v.finished) | set(v.kv_held_by_finished) | set(w.loads)
        keep.update(e.request_id for e in w.queue)
        return KVWorld({rid: (a.load, a.step) for rid, a in w.loads.items()}, dict(w.saves), tuple(w.queue),
                       {rid: p for rid, p in w.prompts.items() if rid in keep}, now, slots)

    def added(self, request_id: str, prompt: tuple[int, ...]) -> KVWorld:
        return KVWorld(self.loads, self.saves, self.queue, {**self.prompts, request_id: prompt}, self.now,
                       self.slots, self.invalid)

    def load_order(self) -> list[str]:
        """The asynchronous loads in flight, by arrival (``load ... #k``)."""
        return sorted(self.loads, key=_order)

    def save_order(self, v: SchedulerView) -> list[str]:
        """The finished requests holding blocks for a save, by arrival
        (``save done #k``): those held and loading nothing."""
        return sorted((rid for rid in v.kv_held_by_finished if rid not in self.loads), key=_order)


def _loaded_blocks(load: KVLoad, block_size: int) -> range:
    """The indices (in the request's group-0 table) of the blocks the load fills."""
    if load.end <= load.start:
        return range(0)
    return range(load.start // block_size, min((load.end - 1) // block_size, len(load.block_ids) - 1) + 1)


def kv_enabled(a: Alphabet, v: SchedulerView, world: KVWorld, block_size: int) -> list[int]:
    """The worker's report codes the state makes meaningful: for each
    asynchronous load in flight, done, failed whole and failed at each block
    it fills; for each pending save, done; for each unfinished request with
    a synchronous external hit waiting to be admitted, failed at each block
    of the hit (explored only where the step loads it)."""
    codes: list[int] = []
    queued = {e.request_id for e in world.queue}
    ops = {op: (kind, block) for op, _, kind, block in KV_OPS if op in a.kv_ops}
    loads = world.load_order()
    saves = world.save_order(v)
    for op, (kind, block) in ops.items():
        if kind == "load":
            for k, rid in enumerate(loads[:a.kv_positions]):
                if rid in queued:
                    continue
                if isinstance(block, int) and block not in _loaded_blocks(world.loads[rid][0], block_size):
                    continue
                codes.append(a.kv_code(op, k))
        elif kind == "save":
            codes += [a.kv_code(op, k) for k, rid in enumerate(saves[:a.kv_positions]) if rid not in queued]
        else:
            for k, (rid, r) in enumerate(v.requests.items()):
                if (k < a.kv_positions and rid not in queued and r.spec.kv_external_tokens and not r.spec.kv_load_async
                        and r.status in _ADMITTABLE and isinstance(block, int)
                        and block * block_size < r.spec.kv_external_tokens):
                    codes.append(a.kv_code(op, k))
    return codes


def report_event(a: Alphabet, code: int, v: SchedulerView, world: KVWorld) -> Any:
    """The workload event (KVLoadDone, KVLoadFailed or KVSaveDone) of a
    report code in the state ``v`` with worker ``world``."""
    op, k = a.kv_event(code)
    _, _, kind, block = next(o for o in KV_OPS if o[0] == op)
    if kind == "load":
        rid = world.load_order()[k]
        return KVLoadDone(rid) if block == "done" else KVLoadFailed(rid, block if isinstance(block, int) else None)
    if kind == "save":
        return KVSaveDone(world.save_order(v)[k])
    return KVLoadFailed(list(v.requests)[k], block if isinstance(block, int) else None)


def forced_reports(w: KVWorker, step: int, bound: int) -> list[Any]:
    """The reports the bounded wait forces in the result of plan ``step``:
    every load started and every save first seen pending ``bound`` or more
    steps before, for which no report is queued (as KVWorker.after times
    them out; written as explicit events, so the driver's worker, whose
    bound may be longer, delivers the same)."""
    queued = {getattr(e, "request_id", "") for e in w.queue}
    out: list[Any] = []
    for rid in sorted(w.loads, key=_order):
        if rid not in queued and step - w.loads[rid].step >= bound:
            out.append(KVLoadDone(rid))
    for rid in sorted(w.saves, key=_order):
        if rid not in queued and step - w.saves[rid] >= bound:
            out.append(KVSaveDone(rid))
    return out
