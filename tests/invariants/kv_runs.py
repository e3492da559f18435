"""A small seeded driver of KV-connector and hybrid-group workloads for the
invariant tests: it plays the connector's worker (asynchronous loads reported
finished after a few steps, sometimes failed; synchronous loads sometimes
reporting an invalid block; saves reported after a few steps), records every
transition with the plans in flight, and runs until quiescence. It stands
apart from the check engine (schedspec.check) so the invariants are tested
on runs they did not help to make."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from schedspec.invariants import CATALOGUE, Invariant, Monitor, Transition, Violation
from schedspec.spec.interface import (
    KVCacheGroup,
    RequestSpec,
    SchedulerConfig,
    StepPlan,
    StepResult,
)

LAYOUTS: dict[str, tuple[KVCacheGroup, ...]] = {
    "plain": (),
    "full+sw4": (KVCacheGroup(), KVCacheGroup("sliding_window", 4)),
    "sw6": (KVCacheGroup("sliding_window", 6),),
    "sw8+full+sw5": (KVCacheGroup("sliding_window", 8), KVCacheGroup(), KVCacheGroup("sliding_window", 5)),
}


def kv_config(layout: str, *, connector: bool = True, policy: str = "recompute", async_: bool = False,
              **kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(
        block_size=4, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=4, max_model_len=64,
        kv_connector=connector, kv_load_failure_policy=policy, kv_cache_groups=LAYOUTS[layout],
        async_scheduling=async_,
    )
    base.update(kw)
    return SchedulerConfig(**base)


@dataclass
class KVRun:
    """What a run did: every transition, with counts of what it exercised."""

    transitions: list[Transition] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def bump(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


def kv_run(make: Callable[[SchedulerConfig], Any], config: SchedulerConfig, seed: int, *,
           requests: int = 10, max_steps: int = 400) -> KVRun:
    rng = random.Random(seed)
    s = make(config)
    run = KVRun()
    in_flight: list[StepPlan] = []
    bs = config.block_size
    groups = len(config.groups)

    def op(kind: str, fn: Callable[[], Any], **kw: Any) -> Any:
        before = s.view()
        out = fn()
        plan = out if kind == "schedule" else kw.pop("plan", None)
        run.transitions.append(Transition(kind, before, s.view(), plan=plan, in_flight=tuple(in_flight), **kw))  # type: ignore[arg-type]
        return out

    loads: dict[str, int] = {}  # async load in flight -> steps until its report
    ranges: dict[str, tuple[int, ...]] = {}  # async load in flight -> the blocks it fills
    saves: dict[str, int] = {}  # held for a save -> steps until its report
    sync_bad: dict[int, tuple[int, ...]] = {}  # plan step -> invalid blocks to report at its update
    prefixes = [tuple(rng.randrange(1, 50) for _ in range(12)) for _ in range(3)]
    added = 0

    def add() -> None:
        nonlocal added
        base = rng.choice(prefixes)
        n = rng.randrange(3, 20)
        prompt = (base + tuple(rng.randrange(1, 50) for _ in range(n)))[:n]
        ext = rng.choice([0, 0, rng.randrange(0, n + 1), n - 1, 4, 8]) if config.kv_connector else 0
        ext = max(0, min(ext, n))
        load_async = bool(ext) and rng.random() < 0.6
        if not load_async:
            ext = min(ext, n - 1)  # a synchronous load leaves a token to compute
        spec = RequestSpec(
            f"r{added}", prompt, rng.randrange(1, 7), arrival=added,
            kv_external_tokens=ext,
            kv_load_async=load_async,
            kv_save_async=config.kv_connector and rng.random() < 0.4,
        )
        added += 1
        op("add", lambda: s.add(spec), request=spec)
        run.bump("add")

    def update() -> None:
        plan = in_flight[0]
        v = s.view()
        recv: list[str] = []
        failed: list[str] = []
        # a synchronous load's invalid block, while its request is unfinished
        # (the boundary refuses a report for a load whose request is gone)
        loaders = {ld.request_id for ld in plan.kv_loads if not ld.asynchronous}
        held_now = {b for rid, r in v.requests.items() if rid in loaders for b in r.block_ids}
        invalid: set[int] = set(b for b in sync_bad.pop(plan.step, ()) if b in held_now)
        for rid in list(loads):
            loads[rid] -= 1
            if loads[rid] <= 0:
                del loads[rid]
                recv.append(rid)
                r = v.requests.get(rid)
                if r is not None and rng.random() < 0.25:
                    if groups > 1 or rng.random() < 0.5:
                        failed.append(rid)
                        run.bump("failed_recving")
                    else:
                        real = [b for b in ranges.get(rid, ()) if b]
                        if real:
                            invalid.add(rng.choice(real))
                            run.bump("invalid_async")
        sending: list[str] = []
        for rid in list(v.kv_held_by_finished):
            if rid in loads or rid in recv:
                continue
            saves.setdefault(rid, rng.randrange(0, 4))
        for rid in list(saves):
            if rid not in v.kv_held_by_finished:
                del saves[rid]
                continue
            saves[rid] -= 1
            if saves[rid] < 0:
                del saves[rid]
                sending.append(rid)
                run.bump("finished_sending")
        sampled = {e.request_id: (rng.randrange(1, 50),) for e in plan.scheduled if e.samples}
        result = StepResult(
            sampled, finished_recving=tuple(sorted(recv)), finished_sending=tuple(sorted(sending)),
            failed_recving=tuple(sorted(failed)), invalid_block_ids=tuple(sorted(invalid)),
        )
        in_flight.pop(0)
        op("update", lambda: s.update(plan, result), plan=plan, result=result)

    def schedule() -> None:
        plan = op("schedule", s.schedule)
        in_flight.append(plan)
        run.transitions[-1] = Transition(
            "schedule", run.transitions[-1].before, run.transitions[-1].after, plan=plan, in_flight=tuple(in_flight)
        )
        for load in plan.kv_loads:
            if load.asynchronous:
                loads[load.request_id] = rng.randrange(1, 5)
                first, last = load.start // bs, -(-load.end // bs)
                ranges[load.request_id] = load.block_ids[first:last]
                run.bump("async_load")
            else:
                run.bump("sync_load")
                first, last = load.start // bs, -(-load.end // bs)
                cands = [b for b in load.block_ids[first:last] if b]
                if groups == 1 and cands and rng.random() < 0.2:
                    sync_bad[plan.step] = sync_bad.get(plan.step, ()) + (rng.choice(cands),)
                    run.bump("invalid_sync")

    depth = 2 if config.async_scheduling else 1
    for step in range(max_steps):
        v = s.view()
        if added < requests and (rng.random() < 0.5 or not v.requests):
            add()
            continue
        live = list(s.view().requests)
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            op("abort", lambda: s.abort(rid), request_id=rid)
            run.bump("abort")
            continue
        v = s.view()
        busy = bool(v.requests or v.kv_held_by_finished or loads)
        if not busy and added >= requests and not in_flight:
            break
        if len(in_flight) < depth and (v.requests or v.finished or not in_flight):
            schedule()
        if in_flight and (len(in_flight) >= depth or rng.random() < 0.5):
            update()
    while in_flight:
        update()
    return run


def violations(run: KVRun, invariants: tuple[Invariant, ...] = CATALOGUE) -> list[Violation]:
    m = Monitor(invariants)
    out: list[Violation] = []
    for t in run.transitions:
        out.extend(m.observe(t))
    return out
