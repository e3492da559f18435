"""Effect coverage: a rule's outcome observed by a later decision.

Rule coverage (spec/rule_names.py) says a branch was taken; a branch that
gives something back (blocks, budget, cached KV, computed tokens) matters
only when a later decision of the same step or the next one uses what it
gave. Each ``Effect`` below names such a pair: the producing rule(s), the
consuming rule(s), and the quantity that must pass from one to the other.

``EffectTracker`` detects them in the spec's run, tracking the quantity
itself (the block id freed is the one allocated, the budget given back is
needed for the step to fit, the rolled-back position is the one scheduled
again), so a producer that fires while the consumer uses something else is
not counted. It counts into the spec's rule counter under the effect's name
(``effect.*``), so every report, merge and aim of the rule counts carries
them. It is off unless ``enable`` attaches it (the check and the model checker
do): off, the spec pays an ``is not None`` test or two per schedule() and update().

    enable(sched)                      # before driving it
    ...
    effect_counts(counts_of(sched))    # effect name -> times observed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from schedspec.spec.interface import RequestStatus, ScheduleKind, StepPlan
from schedspec.spec.rule_names import ALL_MODES

#: the spec scheduler the tracker reads (spec/scheduler.py imports this module, not the reverse)
SpecScheduler = Any


@dataclass(frozen=True)
class Effect:
    name: str
    producers: tuple[str, ...]  # the rules whose outcome is the quantity
    consumers: tuple[str, ...]  # the rules of the later decision that uses it
    description: str
    vllm: str  # the vLLM 0.33 functions that pass the quantity on
    modes: tuple[str, ...] = ALL_MODES  # as Rule.modes
    gates: tuple[str, ...] = ()  # as Rule.gates


_PREEMPT = ("preempt.fcfs_tail", "preempt.priority_victim")
_STOP = ("stop.eos", "stop.stop_token", "stop.max_tokens", "stop.max_model_len")
_SCHED = "sched/scheduler.py, Scheduler.schedule"
_STOPPED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)

_EFFECTS = (
    Effect("effect.preempted_blocks_reallocated", _PREEMPT + ("preempt.reset_running",),
           ("running.scheduled", "admit.new", "admit.resumed"),
           "a block a preemption freed is allocated to another request in the same step or the next",
           "sched/scheduler.py, Scheduler._preempt_request (kv_cache_manager.free); block_pool.py, BlockPool.get_new_blocks"),
    Effect("effect.returned_budget_scheduled", ("preempt.budget_give_back",), ("running.scheduled",),
           "a victim's tokens given back to the budget are scheduled to a later running request "
           "(the step uses the whole budget, more than it had without them); needs three running requests",
           _SCHED + " (token_budget += num_scheduled_tokens.pop(preempted_req.request_id))"),
    Effect("effect.preempted_resume_hit", _PREEMPT, ("admit.resumed", "kv.touch_free"),
           "a victim resumed in the next step hits the cached blocks its preemption freed, at the same positions",
           "kv_cache_manager.py, KVCacheManager.free, get_computed_blocks; block_pool.py, BlockPool.touch"),
    Effect("effect.finished_blocks_hit", _STOP, ("admit.new", "kv.touch_free"),
           "a block cached by a request that finished in an update gives a request admitted in the next step a hit",
           "sched/scheduler.py, Scheduler._free_request; block_pool.py, BlockPool.free_blocks, touch"),
    Effect("effect.finished_blocks_reallocated", _STOP, ("running.scheduled", "admit.new", "admit.resumed"),
           "a block freed by a request that finished in an update is allocated anew in the next step",
           "sched/scheduler.py, Scheduler._free_request; block_pool.py, BlockPool.get_new_blocks"),
    Effect("effect.rollback_rescheduled", ("spec.some_rejected",), ("running.scheduled",),
           "a request whose rejected drafts rolled its computed tokens back is scheduled again from that position",
           "sched/scheduler.py, Scheduler.update_from_output (num_computed_tokens -= num_rejected), schedule",
           ("spec", "async-spec")),
    Effect("effect.placeholders_skip", ("async.placeholders_added",), ("running.skip_max_tokens_in_flight",),
           "a running request whose placeholders surely reach max_tokens is left out of the next step",
           _SCHED + ", RUNNING loop (num_output_placeholders); sched/async_scheduler.py, _update_after_schedule",
           ("async", "async-spec")),
)

#: name -> Effect, in catalogue order
EFFECTS: dict[str, Effect] = {e.name: e for e in _EFFECTS}
EFFECT_NAMES: tuple[str, ...] = tuple(EFFECTS)


def effects_reachable_in(modes: tuple[str, ...] | list[str],
                         gates: tuple[str, ...] | list[str] | frozenset[str] = ()) -> tuple[str, ...]:
    """The effects a run with ``modes`` and ``gates`` can observe (as rule_names.reachable_in)."""
    return tuple(e.name for e in _EFFECTS if set(e.modes) & set(modes) and set(e.gates) <= set(gates))


def effect_counts(counts: Mapping[str, int] | None) -> dict[str, int]:
    """Every effect with its count in a rule counter (0 when never observed)."""
    return {n: int((counts or {}).get(n, 0)) for n in EFFECT_NAMES}


def describe(name: str) -> str:
    e = EFFECTS[name]
    return f"{e.name}: {e.description} ({', '.join(e.producers)} -> {', '.join(e.consumers)}; {e.vllm})"


def _hit_len(e_kind: ScheduleKind, num_computed: int, block_size: int) -> int:
    """How many leading blocks of an admission's table its prefix hit gave it."""
    return num_computed // block_size if e_kind != ScheduleKind.RUNNING else 0


@dataclass
class EffectTracker:
    """What the spec gave back and has not been used yet, and a snapshot of
    the requests' tables and computed tokens as the last schedule() or
    update() left them (an update reads the finished requests' tables there;
    a request added since cannot finish in it)."""

    tables: dict[str, tuple[int, ...]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    placeholders: dict[str, int] = field(default_factory=dict)
    given_back: int = 0  # the tokens victims scheduled earlier gave back in this schedule()
    skips: int = 0  # running.skip_max_tokens_in_flight's count before this schedule()
    freed_by_preemption: set[int] = field(default_factory=set)  # next schedule
    victims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # next schedule
    finished_free: set[int] = field(default_factory=set)  # freed by a stop, for the next schedule
    finished_keyed: set[int] = field(default_factory=set)
    rolled_back: dict[str, int] = field(default_factory=dict)
    reset_victims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # preempted by a reset

    def copy(self) -> EffectTracker:
        return EffectTracker(dict(self.tables), dict(self.computed), dict(self.placeholders), self.given_back,
                             self.skips, set(self.freed_by_preemption), dict(self.victims), set(self.finished_free),
                             set(self.finished_keyed), dict(self.rolled_back), dict(self.reset_victims))

    def _snap(self, sched: SpecScheduler) -> None:
        reqs = sched.requests
        self.tables = {rid: tuple(r.blocks) for rid, r in reqs.items()}
        self.computed = {rid: r.num_computed_tokens for rid, r in reqs.items()}
        self.placeholders = {rid: r.num_output_placeholders for rid, r in reqs.items()}

    def before_schedule(self, sched: SpecScheduler) -> None:
        prior = self.tables  # as the last schedule() or update() left them: before any reset since
        self._snap(sched)
        self.reset_victims = {rid: prior[rid] for rid in sched.preempted if rid in prior}
        self.given_back = 0
        self.skips = sched.rules["running.skip_max_tokens_in_flight"]

    def after_schedule(self, sched: SpecScheduler, plan: StepPlan) -> None:
        rules, bs = sched.rules, sched.config.block_size
        fresh: set[int] = set()  # blocks newly allocated (not hit) this step, by anyone
        by_others: set[int] = set()  # of those, by requests not preempted in this step or the last
        hits: dict[str, tuple[int, ...]] = {}
        victims = dict(self.reset_victims)
        victims.update((rid, self.tables[rid]) for rid in plan.preempted_ids
                       if rid not in victims and rid in self.tables)
        for e in plan.scheduled:
            h = _hit_len(e.kind, e.num_computed_tokens, bs)
            hits[e.request_id] = e.block_ids[:h]
            new = set(e.block_ids[h:]) - set(self.tables.get(e.request_id, ()))
            fresh |= new
            if e.request_id not in victims and e.request_id not in self.victims:
                by_others |= new
        # a victim's resume hits its own freed blocks at the same positions
        for rid, old in self.victims.items():
            got = hits.get(rid, ())
            if any(i < len(old) and b == old[i] for i, b in enumerate(got)):
                rules["effect.preempted_resume_hit"] += 1
        if any(set(hits.get(e.request_id, ())) & self.finished_keyed for e in plan.scheduled):
            rules["effect.finished_blocks_hit"] += 1
        if fresh & self.finished_free:
            rules["effect.finished_blocks_reallocated"] += 1
        # this plan's victims: their blocks no one else held are freed
        others = {b for rid, t in self.tables.items() if rid not in victims for b in t}
        freed = {b for t in victims.values() for b in t} - others
        pending = self.freed_by_preemption | freed
        if by_others & pending:
            rules["effect.preempted_blocks_reallocated"] += 1
        # the tokens given back were used when the step schedules more than it could have without them
        if self.given_back and plan.total_num_scheduled_tokens + self.given_back > sched.config.max_num_batched_tokens:
            rules["effect.returned_budget_scheduled"] += 1
        if rules["running.skip_max_tokens_in_flight"] > self.skips and any(
                self.placeholders.get(rid, 0) > 0 and plan.get(rid) is None for rid in sched.running):
            rules["effect.placeholders_skip"] += 1
        for rid, pos in self.rolled_back.items():
            again = plan.get(rid)
            if again is not None and again.num_computed_tokens == pos:
                rules["effect.rollback_rescheduled"] += 1
        self.freed_by_preemption = freed - fresh
        self.victims = victims
        self.finished_free, self.finished_keyed, self.rolled_back = set(), set(), {}
        self._snap(sched)

    def after_update(self, sched: SpecScheduler, plan: StepPlan) -> None:
        kv = sched.kv
        for rid, table in self.tables.items():
            req = sched.requests.get(rid)
            if req is None and rid in sched.finished and sched.finished[rid].status in _STOPPED:
                free = {b for b in table if kv.ref_cnt[b] == 0}
                self.finished_free |= free
                self.finished_keyed |= {b for b in free if b in kv.block_key}
        for e in plan.scheduled:
            req = sched.requests.get(e.request_id)
            if e.spec_token_ids and req is not None and req.num_computed_tokens < self.computed.get(e.request_id, 0):
                self.rolled_back[e.request_id] = req.num_computed_tokens
        self._snap(sched)


def enable(sched: object) -> bool:
    """Attach a tracker to a spec scheduler (anything with an ``effects``
    attribute); False for another scheduler."""
    if not hasattr(sched, "effects"):
        return False
    if getattr(sched, "effects") is None:
        setattr(sched, "effects", EffectTracker())
    return True


Gates = tuple[str, ...] | list[str] | frozenset[str]


def effects_line(counts: Mapping[str, int], modes: tuple[str, ...] | list[str] = ALL_MODES,
                 gates: Gates = ()) -> str:
    """One line: how many of the effects ``modes`` (with ``gates``) can show
    were observed, and those never observed (or the rarest)."""
    names = effects_reachable_in(modes, gates)
    missing = [n for n in names if counts.get(n, 0) <= 0]
    if missing:
        tail = "never observed: " + ", ".join(missing)
    else:
        least = sorted(names, key=lambda n: counts.get(n, 0))[:3]
        tail = "rarest: " + ", ".join(f"{n} {counts.get(n, 0):,}" for n in least)
    return f"effect coverage: {len(names) - len(missing)} of the {len(names)} effects reachable observed; {tail}"


def effects_table(counts: Mapping[str, int], modes: tuple[str, ...] | list[str] = ALL_MODES,
                  gates: Gates = (), width: int = 36) -> str:
    """The effects as coverage.format_table shows the rules: the summary
    line, then each effect, its count, ``NOT REACHED`` or ``out of reach``."""
    names = set(effects_reachable_in(modes, gates))
    lines = [effects_line(counts, modes, gates), "  effect"]
    for name in EFFECT_NAMES:
        n = int(counts.get(name, 0))
        mark = "" if n else "   NOT REACHED" if name in names else "   out of reach"
        lines.append(f"    {name:<{width}} {n:>9,}{mark}")
    return "\n".join(lines)


def effects_report(counts: Mapping[str, int], modes: tuple[str, ...] | list[str] = ALL_MODES,
                   gates: Gates = ()) -> dict[str, object]:
    """The JSON report: counts, the reachable ones never observed, those out of reach."""
    names = effects_reachable_in(modes, gates)
    return {
        "reached": sum(1 for n in names if counts.get(n, 0) > 0),
        "reachable": len(names),
        "total": len(EFFECT_NAMES),
        "unreached": [n for n in names if counts.get(n, 0) <= 0],
        "out_of_reach": [n for n in EFFECT_NAMES if n not in names],
        "counts": effect_counts(counts),
    }
