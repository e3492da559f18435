"""The invariant machinery: what a transition is, what a violation is, how an
invariant is declared, and the history a Monitor keeps between transitions.

An invariant is a named predicate over one observed operation of a scheduler
(a Transition: the view before, the view after, and what the operation was).
Its check function yields ``(request_id, message)`` findings; the Invariant
turns each into a Violation carrying its id. State invariants look at
``t.after`` only and run after every kind of operation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

from schedspec.spec.interface import KVLoad, RequestSpec, RequestStatus, SchedulerView, StepPlan, StepResult
from schedspec.spec.runner_v2 import decode_stagger

from schedspec.invariants.kv_mirror import KVMirror
from schedspec.invariants.transition import ALL_KINDS as ALL_KINDS
from schedspec.invariants.transition import Transition as Transition
from schedspec.invariants.transition import TransitionKind as TransitionKind

#: What a check yields: the request it is about (or None) and what is wrong.
Finding = tuple[str | None, str]


@dataclass(frozen=True)
class Violation:
    invariant_id: str
    message: str  # says what is wrong, with the numbers and request ids
    request_id: str | None = None

    def __str__(self) -> str:
        who = f" [{self.request_id}]" if self.request_id is not None else ""
        return f"{self.invariant_id}{who}: {self.message}"


@dataclass
class History:
    """What the Monitor remembers across transitions, for the invariants that
    compare with the past rather than with ``t.before`` alone."""

    #: request id -> the prompt and output last seen for it (live or finished).
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: ids already reported in some plan's finished_ids (since their last add).
    reported_finished: set[str] = field(default_factory=set)
    #: KV connector: finished request id -> its status when it finished, and
    #: the status it had just before (kept while it holds blocks for the
    #: connector, kv_held_by_finished)
    finished_status: dict[str, tuple[RequestStatus, RequestStatus]] = field(default_factory=dict)
    #: KV connector: request id -> the last load a plan started for it
    loads: dict[str, KVLoad] = field(default_factory=dict)
    #: KV connector: invalid block -> (its index in its holders' tables, the
    #: requests vLLM lets go on counting it computed because another holder
    #: recomputes it), from the update that reported it until it is recomputed
    #: or leaves the cache (invalid-block-not-computed)
    invalid_blocks: dict[int, tuple[int, frozenset[str]]] = field(default_factory=dict)
    #: KV cache events: the router mirror of the stream so far
    #: (invariants/kv_mirror.py), and the resets that emptied the cache
    #: since the last update (each owes one AllBlocksCleared)
    kv_mirror: KVMirror = field(default_factory=KVMirror)
    kv_resets: int = 0
    #: the preemptions seen since the last statistics a scheduler reported
    #: (Transition.stats; stats-preemptions-counted)
    preemptions_since_stats: int = 0
    #: Model Runner V2's decode throttle (invariants/runner_v2.py): request id
    #: -> the step of the last plan in which it sampled
    decoded_at: dict[str, int] = field(default_factory=dict)

    def record(self, t: Transition) -> None:
        """Fold a transition in; called after every invariant has checked it."""
        self._record_preemptions(t)
        if t.kind == "add" and t.request is not None:
            # A request id may be reused once its previous holder is reported.
            rid = t.request.request_id
            self.prompts.pop(rid, None)
            self.outputs.pop(rid, None)
            self.reported_finished.discard(rid)
            self.loads.pop(rid, None)
            self.finished_status.pop(rid, None)
            self.decoded_at.pop(rid, None)
        for views in (t.after.requests, t.after.finished):
            for rid, r in views.items():
                self.prompts[rid] = r.spec.prompt_token_ids
                self.outputs[rid] = r.output_token_ids
        self._record_kv(t)
        if t.kind == "schedule" and t.plan is not None and decode_stagger(t.after.config):
            self.decoded_at.update((s.request_id, t.plan.step) for s in t.plan.scheduled if s.samples)
        if t.after.config.enable_kv_cache_events:
            self._record_kv_events(t)
        if t.kind == "schedule" and t.plan is not None:
            for rid in t.plan.finished_ids:
                self.reported_finished.add(rid)
                # Reported and gone: nothing left to compare its tokens with.
                if rid not in t.after.requests:
                    self.prompts.pop(rid, None)
                    self.outputs.pop(rid, None)


    def _record_kv_events(self, t: Transition) -> None:
        if t.kind == "reset" and reset_emptied(t.after):
            self.kv_resets += 1
        elif t.kind == "update":
            self.kv_mirror.block_size = t.after.config.block_size
            self.kv_mirror.apply_all(t.kv_events)
            self.kv_resets = 0
    def _record_preemptions(self, t: Transition) -> None:
        """Count the transition's preemptions (``preemptions_in``);
        statistics reported start the count afresh."""
        if t.stats is not None:
            self.preemptions_since_stats = 0
            return
        self.preemptions_since_stats += preemptions_in(t)

    def _record_kv(self, t: Transition) -> None:
        if not (t.after.config.kv_connector or t.before.config.kv_connector):
            return
        for rid, r in t.after.finished.items():
            b = t.before.requests.get(rid)
            if b is not None:
                self.finished_status[rid] = (r.status, b.status)
        for rid in list(self.finished_status):
            if rid not in t.after.kv_held_by_finished and rid not in t.after.finished:
                del self.finished_status[rid]
        self.record_loads_and_invalid_blocks(t)

    def record_loads_and_invalid_blocks(self, t: Transition) -> None:
        """Fold in the KV connector's loads a plan starts and the invalid
        blocks awaiting recomputation after ``t`` (what the model checker
        keeps of the History, schedspec/modelcheck/expand.py)."""
        from schedspec.invariants._util import next_invalid_blocks  # no import cycle at load

        if t.kind == "schedule" and t.plan is not None:
            for load in t.plan.kv_loads:
                self.loads[load.request_id] = load
        self.invalid_blocks = next_invalid_blocks(t, self)


def reset_emptied(after: SchedulerView) -> bool:
    """Whether a reset_prefix_cache that left this view succeeded (every
    block but the null block free: BlockPool.reset_prefix_cache), and so
    emitted one AllBlocksCleared."""
    return len(after.kv.free_queue) == after.kv.num_blocks - 1
def preemptions_in(t: Transition) -> int:
    """The preemptions a transition made (History.preemptions_since_stats
    sums them): schedule() reports its own in the plan's preempted_ids, after
    those of reset_prefix_cache since the last plan (preempted_since_plan;
    a request preempted by a reset waits, so schedule() cannot preempt it
    again). Only those two operations preempt."""
    if t.kind == "schedule" and t.plan is not None:
        return len(set(t.plan.preempted_ids) - set(t.before.preempted_since_plan))
    if t.kind == "reset":
        return len(set(t.after.preempted_since_plan) - set(t.before.preempted_since_plan))
    return 0


CheckFn = Callable[[Transition, History], Iterable[Finding]]
Scope = Literal["state", "transition"]

# --------------------------------------------------------------------------
# Tags: what an invariant protects
# --------------------------------------------------------------------------

#: The tag of an invariant that holds for any correct paged-KV scheduler
#: (conservation, no double allocation or use after free, budgets, tables that
#: cover what is computed, cached content equal to its tokens, legal status
#: transitions, finished reported once, quiescence).
SAFETY = "safety"
#: The prefix of the tag of an invariant that states one scheduling policy:
#: ``policy:<name>`` (``policy:fcfs``, ``policy:priority``, ``policy:vllm-victim``,
#: ``policy:vllm-free-order``, ``policy:vllm-allocation``, ...).
POLICY_PREFIX = "policy:"
_POLICY_NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def is_valid_tag(tag: str) -> bool:
    """True for ``"safety"`` and for ``"policy:<kebab-case name>"``."""
    if tag == SAFETY:
        return True
    return tag.startswith(POLICY_PREFIX) and _POLICY_NAME.fullmatch(tag[len(POLICY_PREFIX):]) is not None


def _checked_tags(id: str, tags: Iterable[str]) -> tuple[str, ...]:
    if isinstance(tags, str):
        raise TypeError(f"invariant {id!r}: tags must be a sequence of tags, not the string {tags!r}")
    out = tuple(tags)
    for tag in out:
        if not is_valid_tag(tag):
            raise ValueError(
                f"invariant {id!r}: tag {tag!r} is neither {SAFETY!r} nor {POLICY_PREFIX}<name>"
            )
    return out


@dataclass(frozen=True)
class Invariant:
    """A named invariant.

    ``scope`` is "state" when the check reads ``t.after`` only (it then holds
    of every view a scheduler can show), "transition" when it relates
    before, plan, result and after. ``kinds`` lists the operations it checks.
    """

    id: str  # stable, kebab-case
    statement: str  # one line
    vllm_behaviour: str  # the vLLM 0.33 file/function and behaviour behind it
    scope: Scope
    kinds: frozenset[TransitionKind]
    check_fn: CheckFn = field(repr=False, compare=False)
    #: what it protects: ("safety",) or ("policy:<name>", ...)
    tags: tuple[str, ...] = ()
    #: the capabilities its premise needs (names in
    #: schedspec.check.capabilities); a scheduler that lacks one skips it
    requires: frozenset[str] = frozenset()

    @property
    def is_safety(self) -> bool:
        return SAFETY in self.tags

    @property
    def policies(self) -> tuple[str, ...]:
        """The policy names among the tags (without the ``policy:`` prefix)."""
        return tuple(t[len(POLICY_PREFIX):] for t in self.tags if t.startswith(POLICY_PREFIX))

    def check(self, t: Transition, history: History | None = None) -> list[Violation]:
        """The violations of this invariant in ``t`` (empty if it holds or does
        not apply to this kind of operation)."""
        if t.kind not in self.kinds:
            return []
        h = history if history is not None else History()
        return [Violation(self.id, msg, rid) for rid, msg in self.check_fn(t, h)]


# --------------------------------------------------------------------------
# Declaring invariants
# --------------------------------------------------------------------------

REGISTRY: list[Invariant] = []


def state_invariant(
    id: str,
    statement: str,
    vllm_behaviour: str,
    *,
    tags: Iterable[str] = (),
    requires: Iterable[str] = (),
) -> Callable[[Callable[[SchedulerView], Iterable[Finding]]], Callable[[SchedulerView], Iterable[Finding]]]:
    """Declare an invariant of a single view; it runs on ``t.after`` of every
    transition. ``tags`` says what it protects (``"safety"`` or
    ``"policy:<name>"``); ``requires`` names the capabilities its premise needs."""
    checked = _checked_tags(id, tags)
    needs = frozenset(requires)

    def register(
        fn: Callable[[SchedulerView], Iterable[Finding]],
    ) -> Callable[[SchedulerView], Iterable[Finding]]:
        def check(t: Transition, h: History) -> Iterable[Finding]:
            return fn(t.after)

        REGISTRY.append(
            Invariant(id, statement, vllm_behaviour, "state", ALL_KINDS, check, tags=checked, requires=needs)
        )
        return fn

    return register


def transition_invariant(
    id: str,
    statement: str,
    vllm_behaviour: str,
    kinds: Iterable[TransitionKind] = ALL_KINDS,
    *,
    tags: Iterable[str] = (),
    requires: Iterable[str] = (),
) -> Callable[[CheckFn], CheckFn]:
    """Declare an invariant that relates a transition's before, plan, result
    and after. ``tags`` and ``requires`` as for :func:`state_invariant`."""
    checked = _checked_tags(id, tags)
    needs = frozenset(requires)

    def register(fn: CheckFn) -> CheckFn:
        REGISTRY.append(
            Invariant(
                id, statement, vllm_behaviour, "transition", frozenset(kinds), fn, tags=checked, requires=needs
            )
        )
        return fn

    return register
