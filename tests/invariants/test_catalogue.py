"""Every invariant fires, with its id, on a hand-built bad transition, and holds
on hand-built good ones; the whole Monitor stays silent on the reference
scheduler over random workloads (no false positives).

The hand-built scenarios use a pool of 4-token blocks. Their views are made
with ``view()``, which derives ref counts, the free queue and the keys of full
computed blocks from the requests, so each bad case changes one thing.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import subprocess
import sys
from typing import Any, Callable, Iterable

import pytest

from schedspec.invariants import BY_ID, CATALOGUE, Monitor, Transition, Violation, catalogue_markdown, catalogue_text
from schedspec.invariants.core import History
from schedspec.spec.interface import (
    BlockKey,
    KVView,
    Policy,
    RequestSpec,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)

W, R, P = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED
STOPPED, CAPPED, ABORTED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
)
NEW, RESUMED, RUN = ScheduleKind.NEW, ScheduleKind.RESUMED, ScheduleKind.RUNNING

# 8 usable blocks of 4 tokens.
CFG = SchedulerConfig(
    block_size=4, num_blocks=9, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32
)
# 4 usable blocks of 4 tokens: a pool that fills up.
SMALL = SchedulerConfig(
    block_size=4, num_blocks=5, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16
)


# --------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------


def req(
    rid: str,
    prompt: Iterable[int],
    out: Iterable[int] = (),
    status: RequestStatus = W,
    computed: int = 0,
    blocks: Iterable[int] = (),
    **kw: Any,
) -> RequestView:
    fields: dict[str, Any] = dict(priority=0, arrival=0, max_tokens=10, num_preemptions=0)
    fields.update(kw)
    state = {k: fields.pop(k) for k in list(fields) if k not in _SPEC_FIELDS}
    return RequestView(
        spec=RequestSpec(request_id=rid, prompt_token_ids=tuple(prompt), **fields),
        status=status,
        output_token_ids=tuple(out),
        num_computed_tokens=computed,
        block_ids=tuple(blocks),
        **state,
    )


def key(r: RequestView, i: int, bs: int = 4) -> BlockKey:
    return (r.salt, r.all_token_ids[: (i + 1) * bs])


def view(
    reqs: Iterable[RequestView],
    *,
    cfg: SchedulerConfig = CFG,
    step: int = 0,
    finished: Iterable[RequestView] = (),
    waiting: Iterable[str] | None = None,
    running: Iterable[str] | None = None,
    free: Iterable[int] | None = None,
    keys: dict[int, BlockKey] | None = None,
    extra_keys: dict[int, BlockKey] | None = None,
    preempted_since_plan: Iterable[str] = (),
) -> SchedulerView:
    """A view whose KV side follows from the requests: ref counts count the
    holders, free blocks are queued in id order (unless ``free`` says
    otherwise), and (with caching on) every full computed block of a running
    request carries its key, plus ``extra_keys``."""
    live = list(reqs)
    bs = cfg.block_size
    ref = [0] * cfg.num_blocks
    for r in live:
        for b in r.block_ids:
            ref[b] += 1
    if keys is None:
        keys = {}
        if cfg.enable_prefix_caching:
            for r in live:
                if r.status == R:
                    for i in range(r.num_computed_tokens // bs):
                        keys.setdefault(r.block_ids[i], key(r, i, bs))
        keys.update(extra_keys or {})
    index: dict[BlockKey, tuple[int, ...]] = {}
    for b in sorted(keys):
        index[keys[b]] = index.get(keys[b], ()) + (b,)
    return SchedulerView(
        config=cfg,
        step=step,
        requests={r.request_id: r for r in live},
        waiting=tuple(waiting) if waiting is not None else tuple(r.request_id for r in live if r.status in (W, P)),
        running=tuple(running) if running is not None else tuple(r.request_id for r in live if r.status == R),
        kv=KVView(
            num_blocks=cfg.num_blocks,
            block_size=bs,
            ref_cnt=tuple(ref),
            free_queue=tuple(free) if free is not None else tuple(b for b in range(1, cfg.num_blocks) if ref[b] == 0),
            block_keys=keys,
            cache_index=index,
        ),
        finished={r.request_id: r for r in finished},
        preempted_since_plan=tuple(preempted_since_plan),
    )


def entry(
    rid: str, kind: ScheduleKind, computed: int, n: int, num_tokens: int, blocks: Iterable[int], toks: Iterable[int]
) -> ScheduledRequest:
    return ScheduledRequest(rid, kind, computed, n, num_tokens, tuple(blocks), tuple(toks))


def plan(step: int, *entries: ScheduledRequest, preempted: Iterable[str] = (), finished: Iterable[str] = ()) -> StepPlan:
    return StepPlan(step, tuple(entries), tuple(preempted), tuple(finished))


def with_req(v: SchedulerView, rid: str, **changes: Any) -> SchedulerView:
    """``v`` with one request's view changed and nothing else (the KV side is
    left as it was, so it may now disagree)."""
    requests = dict(v.requests)
    requests[rid] = changed(requests[rid], **changes)
    return dataclasses.replace(v, requests=requests)


_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(RequestSpec))


def changed(r: RequestView, **changes: Any) -> RequestView:
    """``r`` with ``changes``, each to the request (``r.spec``) or to its
    state, wherever the field is declared."""
    to_spec = {k: v for k, v in changes.items() if k in _SPEC_FIELDS}
    rest = {k: v for k, v in changes.items() if k not in _SPEC_FIELDS}
    if to_spec:
        rest["spec"] = dataclasses.replace(r.spec, **to_spec)
    return dataclasses.replace(r, **rest)


def with_kv(v: SchedulerView, **changes: Any) -> SchedulerView:
    return dataclasses.replace(v, kv=dataclasses.replace(v.kv, **changes))


def with_entry(p: StepPlan, rid: str, **changes: Any) -> StepPlan:
    return dataclasses.replace(
        p, scheduled=tuple(dataclasses.replace(s, **changes) if s.request_id == rid else s for s in p.scheduled)
    )


def fires(inv_id: str, t: Transition, history: History | None = None) -> list[Violation]:
    return BY_ID[inv_id].check(t, history)


# --------------------------------------------------------------------------
# Good scenarios (each one a transition the spec would make)
# --------------------------------------------------------------------------

# A decodes; B shares A's first block through a prefix hit and is admitted.
A0 = req("A", (1, 2, 3, 4, 5, 6), (7,), R, computed=6, blocks=(1, 2))
B0 = req("B", (1, 2, 3, 4, 9, 9))
S_BEFORE = view([A0, B0], step=1)
S_PLAN = plan(
    2,
    entry("A", RUN, 6, 1, 7, (1, 2), (7,)),
    entry("B", NEW, 4, 2, 6, (1, 3), (9, 9)),
)
A1 = dataclasses.replace(A0, num_computed_tokens=7)
B1 = dataclasses.replace(B0, status=R, num_computed_tokens=6, block_ids=(1, 3))
S_AFTER = view([A1, B1], step=2)
SCHEDULE = Transition("schedule", S_BEFORE, S_AFTER, plan=S_PLAN)

# The model samples 8 for A and 5 for B.
U_RESULT = StepResult({"A": (8,), "B": (5,)})
A2 = dataclasses.replace(A1, output_token_ids=(7, 8))
B2 = dataclasses.replace(B1, output_token_ids=(5,))
U_AFTER = view([A2, B2], step=2)
UPDATE = Transition("update", S_AFTER, U_AFTER, plan=S_PLAN, result=U_RESULT)

# Same, but 8 is A's eos: A finishes; block 2 (keyless) goes to the front.
A0e, A1e = (changed(r, eos_token_id=8) for r in (A0, A1))
S_AFTER_E = view([A1e, B1], step=2)
A2e = dataclasses.replace(A1e, status=STOPPED, output_token_ids=(7, 8), block_ids=())
UE_AFTER = view([B2], step=2, finished=[A2e], free=(2, 4, 5, 6, 7, 8), extra_keys={1: key(A0, 0)})
UPDATE_EOS = Transition("update", S_AFTER_E, UE_AFTER, plan=S_PLAN, result=U_RESULT)

# The next plan reports A finished.
B3 = dataclasses.replace(B2, num_computed_tokens=7, block_ids=(1, 3))
NEXT_PLAN = plan(3, entry("B", RUN, 6, 1, 7, (1, 3), (5,)), finished=("A",))
NEXT_AFTER = view([B3], step=3, free=(2, 4, 5, 6, 7, 8), extra_keys={1: key(A0, 0)})
NEXT = Transition("schedule", UE_AFTER, NEXT_AFTER, plan=NEXT_PLAN)

# Abort B after the update: block 3 (keyless) goes to the front.
B_AB = dataclasses.replace(B2, status=ABORTED, block_ids=())
AB_AFTER = view([A2], step=2, finished=[B_AB], free=(3, 4, 5, 6, 7, 8))
ABORT = Transition("abort", U_AFTER, AB_AFTER, request_id="B")

# Add C.
C0 = req("C", (1, 2))
ADD = Transition("add", U_AFTER, view([A2, B2, C0], step=2), request=RequestSpec("C", (1, 2), 10))

# FCFS preemption in a full pool: A needs a third block, B (last) is preempted,
# its keyed blocks 4, 3 join the back; A takes 4 (evicting its key).
PA0 = req("A", range(1, 9), (9,), R, computed=8, blocks=(1, 2))
PB0 = req("B", range(11, 19), (19,), R, computed=8, blocks=(3, 4))
P_BEFORE = view([PA0, PB0], cfg=SMALL, step=3)
P_PLAN = plan(4, entry("A", RUN, 8, 1, 9, (1, 2, 4), (9,)), preempted=("B",))
PA1 = dataclasses.replace(PA0, num_computed_tokens=9, block_ids=(1, 2, 4))
PB1 = dataclasses.replace(PB0, status=P, num_computed_tokens=0, block_ids=(), num_preemptions=1)
P_AFTER = view([PA1, PB1], cfg=SMALL, step=4, extra_keys={3: key(PB0, 0)})
PREEMPT = Transition("schedule", P_BEFORE, P_AFTER, plan=P_PLAN)

# The same under PRIORITY, B having the lower priority (greater value).
PRIO = dataclasses.replace(SMALL, policy=Policy.PRIORITY)


def _prio(t: Transition, a_prio: int = 0, b_prio: int = 1) -> Transition:
    def fix(v: SchedulerView) -> SchedulerView:
        v = dataclasses.replace(v, config=PRIO)
        v = with_req(v, "A", priority=a_prio)
        return with_req(v, "B", priority=b_prio)

    return dataclasses.replace(t, before=fix(t.before), after=fix(t.after))


PREEMPT_PRIO = _prio(PREEMPT)

# Admission stops because the head does not fit: A holds 3 of 4 blocks and
# B needs 2 for its whole prompt.
WA0 = req("A", range(1, 11), (11,), R, computed=10, blocks=(1, 2, 3))
WB0 = req("B", range(21, 29))
W_BEFORE = view([WA0, WB0], cfg=SMALL, step=5)
W_PLAN = plan(6, entry("A", RUN, 10, 1, 11, (1, 2, 3), (11,)))
W_AFTER = view([dataclasses.replace(WA0, num_computed_tokens=11), WB0], cfg=SMALL, step=6)
BLOCKED = Transition("schedule", W_BEFORE, W_AFTER, plan=W_PLAN)

# reset_prefix_cache on an idle pool with cached free blocks: keys dropped.
IDLE = view([], step=7, keys={5: ("", (1, 2, 3, 4))})
RESET = Transition("reset", IDLE, view([], step=7, keys={}))
# ... and with a block held: it fails, nothing changes.
RESET_HELD = Transition("reset", U_AFTER, U_AFTER)

GOOD: dict[str, Transition] = {
    "schedule": SCHEDULE,
    "update": UPDATE,
    "update-eos": UPDATE_EOS,
    "next-schedule": NEXT,
    "abort": ABORT,
    "add": ADD,
    "preempt-fcfs": PREEMPT,
    "preempt-priority": PREEMPT_PRIO,
    "blocked-admission": BLOCKED,
    "reset": RESET,
    "reset-held": RESET_HELD,
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_scenario_passes_every_invariant(name: str) -> None:
    found = Monitor().observe(GOOD[name])
    assert found == [], "\n".join(map(str, found))


@pytest.mark.parametrize("inv", CATALOGUE, ids=[inv.id for inv in CATALOGUE])
def test_each_invariant_passes_the_good_scenarios(inv: Any) -> None:
    checked = 0
    for t in GOOD.values():
        assert inv.check(t) == []
        checked += t.kind in inv.kinds
    assert checked > 0, f"{inv.id} applies to none of the good scenarios"


# --------------------------------------------------------------------------
# Bad transitions: one per invariant at least
# --------------------------------------------------------------------------

BAD: list[tuple[str, str, Callable[[], Transition]]] = []


def bad(inv_id: str, label: str = "") -> Callable[[Callable[[], Transition]], Callable[[], Transition]]:
    def register(fn: Callable[[], Transition]) -> Callable[[], Transition]:
        BAD.append((inv_id, label or fn.__name__, fn))
        return fn

    return register


def after_is(t: Transition, after: SchedulerView) -> Transition:
    return dataclasses.replace(t, after=after)


# ---- state


@bad("queues-match-status")
def b_request_in_both_queues() -> Transition:
    return after_is(SCHEDULE, dataclasses.replace(S_AFTER, waiting=("B",)))


@bad("queues-match-status")
def b_waiting_request_in_running_queue() -> Transition:
    return after_is(ADD, dataclasses.replace(ADD.after, running=("A", "B", "C"), waiting=()))


@bad("max-num-seqs")
def b_too_many_running() -> Transition:
    one = dataclasses.replace(CFG, max_num_seqs=1)
    return after_is(SCHEDULE, dataclasses.replace(S_AFTER, config=one))


@bad("block-conservation")
def b_ref_cnt_undercounts_sharing() -> Transition:
    ref = list(S_AFTER.kv.ref_cnt)
    ref[1] = 1
    return after_is(SCHEDULE, with_kv(S_AFTER, ref_cnt=tuple(ref)))


@bad("block-conservation")
def b_block_leaked() -> Transition:
    return after_is(SCHEDULE, with_kv(S_AFTER, free_queue=S_AFTER.kv.free_queue[1:]))


@bad("block-conservation")
def b_held_block_in_free_queue() -> Transition:
    return after_is(SCHEDULE, with_kv(S_AFTER, free_queue=(3,) + S_AFTER.kv.free_queue))


@bad("block-table-covers-computed")
def b_table_too_short() -> Transition:
    return after_is(UPDATE, with_req(U_AFTER, "A", num_computed_tokens=9))


@bad("block-table-covers-computed")
def b_preempted_keeps_blocks() -> Transition:
    return after_is(PREEMPT, with_req(P_AFTER, "B", block_ids=(3,)))


@bad("waiting-holds-no-blocks")
def b_waiting_request_reserved_ahead() -> Transition:
    """A scheduler that reserves at add(): vLLM's timing only, no safety matter."""
    t = after_is(ADD, with_req(ADD.after, "C", block_ids=(9,)))
    assert fires("block-table-covers-computed", t) == []
    return t


@bad("block-table-exact")
def b_table_ahead_of_computed() -> Transition:
    return after_is(UPDATE, with_req(U_AFTER, "A", num_computed_tokens=1))


def test_a_table_ahead_of_computed_is_safe() -> None:
    """Holding more blocks than the computed tokens need is vLLM's allocation
    policy broken, not safety: only the policy invariant fires."""
    t = b_table_ahead_of_computed()
    assert fires("block-table-exact", t)
    assert not fires("block-table-covers-computed", t)


@bad("computed-within-known")
def b_computed_past_known() -> Transition:
    return after_is(SCHEDULE, with_req(S_AFTER, "A", num_computed_tokens=8))


@bad("computed-within-known")
def b_entry_past_known() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "B", num_scheduled_tokens=3))


@bad("max-model-len")
def b_unfinished_at_max_model_len() -> Transition:
    tight = dataclasses.replace(CFG, max_model_len=8)
    return after_is(UPDATE, dataclasses.replace(with_req(U_AFTER, "A", output_token_ids=(7, 8, 8)), config=tight))


@bad("max-model-len")
def b_entry_past_max_model_len() -> Transition:
    tight = dataclasses.replace(CFG, max_model_len=6)
    return dataclasses.replace(SCHEDULE, after=dataclasses.replace(S_AFTER, config=tight))


@bad("shared-blocks-identical-prefix")
def b_shared_block_different_tokens() -> Transition:
    return after_is(SCHEDULE, with_req(S_AFTER, "B", prompt_token_ids=(1, 2, 3, 0, 9, 9)))


@bad("shared-blocks-identical-prefix")
def b_shared_block_different_salt() -> Transition:
    return after_is(SCHEDULE, with_req(S_AFTER, "B", cache_salt="s"))


@bad("shared-blocks-identical-prefix")
def b_shared_partial_block() -> Transition:
    # A's partial block 2 handed to B as well.
    v = with_req(S_AFTER, "B", block_ids=(1, 2))
    ref = list(v.kv.ref_cnt)
    ref[2], ref[3] = 2, 0
    return after_is(SCHEDULE, with_kv(v, ref_cnt=tuple(ref), free_queue=(3,) + v.kv.free_queue))


@bad("cache-index-consistent")
def b_key_missing_from_index() -> Transition:
    keys = dict(S_AFTER.kv.block_keys)
    keys[5] = ("", (1, 2, 3, 4))
    return after_is(SCHEDULE, with_kv(S_AFTER, block_keys=keys))


@bad("cache-index-consistent")
def b_malformed_key() -> Transition:
    k: BlockKey = ("", (1, 2, 3))
    keys = dict(IDLE.kv.block_keys)
    keys[6] = k
    return after_is(RESET_HELD, with_kv(IDLE, block_keys=keys, cache_index={**IDLE.kv.cache_index, k: (6,)}))


@bad("cached-block-content")
def b_block_keyed_by_other_content() -> Transition:
    wrong: BlockKey = ("", (1, 2, 3, 5))
    return after_is(SCHEDULE, with_kv(S_AFTER, block_keys={1: wrong}, cache_index={wrong: (1,)}))


@bad("cached-block-content")
def b_partial_block_keyed() -> Transition:
    k = key(A2, 1)  # tokens 1..8, but only 7 are computed
    v = with_kv(U_AFTER, block_keys={**U_AFTER.kv.block_keys, 2: k}, cache_index={**U_AFTER.kv.cache_index, k: (2,)})
    return after_is(UPDATE, v)


@bad("full-blocks-cached")
def b_full_block_without_key() -> Transition:
    return after_is(SCHEDULE, with_kv(S_AFTER, block_keys={}, cache_index={}))


@bad("full-blocks-cached")
def b_key_with_caching_off() -> Transition:
    off = dataclasses.replace(CFG, enable_prefix_caching=False)
    return after_is(RESET_HELD, dataclasses.replace(IDLE, config=off))


@bad("quiescence")
def b_idle_with_held_block() -> Transition:
    ref = [0] * CFG.num_blocks
    ref[5] = 1
    return after_is(RESET, with_kv(RESET.after, ref_cnt=tuple(ref), free_queue=(1, 2, 3, 4, 6, 7, 8)))


# ---- one schedule() call


@bad("token-budget")
def b_over_budget() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "A", num_scheduled_tokens=15))


@bad("token-budget")
def b_zero_token_entry() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "A", num_scheduled_tokens=0))


@bad("max-num-seqs-per-step")
def b_batch_over_max_num_seqs() -> Transition:
    one = dataclasses.replace(CFG, max_num_seqs=1)
    t = dataclasses.replace(SCHEDULE, before=dataclasses.replace(S_BEFORE, config=one))
    assert len(t.plan.scheduled) > 1 if t.plan is not None else False
    return t


def test_max_num_seqs_bounds_the_batch_for_safety_and_the_running_set_for_vllm() -> None:
    """A running set over max_num_seqs with each step's batch within it is vLLM policy, not safety."""
    from schedspec.invariants import BY_ID

    assert BY_ID["max-num-seqs-per-step"].is_safety and not BY_ID["max-num-seqs"].is_safety
    two = dataclasses.replace(CFG, max_num_seqs=len(S_PLAN.scheduled))
    t = dataclasses.replace(SCHEDULE, before=dataclasses.replace(S_BEFORE, config=two))
    assert fires("max-num-seqs-per-step", t) == []


@bad("long-prefill-threshold")
def b_over_threshold() -> Transition:
    thr = dataclasses.replace(CFG, long_prefill_token_threshold=1)
    return dataclasses.replace(SCHEDULE, before=dataclasses.replace(S_BEFORE, config=thr))


@bad("chunked-prefill-disabled")
def b_chunk_without_chunked_prefill() -> Transition:
    off = dataclasses.replace(CFG, enable_chunked_prefill=False, max_model_len=16)
    t = dataclasses.replace(SCHEDULE, before=dataclasses.replace(S_BEFORE, config=off))
    assert fires("chunked-prefill-disabled", t) == []
    return dataclasses.replace(t, plan=with_entry(S_PLAN, "B", num_scheduled_tokens=1))


@bad("scheduled-are-running")
def b_scheduled_not_running() -> Transition:
    return after_is(SCHEDULE, dataclasses.replace(with_req(S_AFTER, "B", status=W), running=("A",), waiting=("B",)))


@bad("scheduled-are-running")
def b_scheduled_twice() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=dataclasses.replace(S_PLAN, scheduled=S_PLAN.scheduled + S_PLAN.scheduled[:1]))


@bad("plan-order")
def b_admission_before_running() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=dataclasses.replace(S_PLAN, scheduled=S_PLAN.scheduled[::-1]))


@bad("plan-entry-kinds")
def b_new_request_called_resumed() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "B", kind=RESUMED))


@bad("plan-matches-state")
def b_step_not_incremented() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=dataclasses.replace(S_PLAN, step=1))


@bad("plan-matches-state")
def b_entry_table_differs() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "B", block_ids=(1, 4)))


@bad("plan-matches-state")
def b_entry_computed_wrong() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "A", num_computed_tokens=5, token_ids=(6,)))


@bad("plan-blocks-exact")
def b_entry_allocates_ahead() -> Transition:
    entry_b = next(e for e in S_PLAN.scheduled if e.request_id == "B")
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "B", block_ids=entry_b.block_ids + (8,)))


@bad("plan-token-ids")
def b_wrong_tokens() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "B", token_ids=(9, 8)))


@bad("cache-hit-identical-prefix")
def b_hit_on_other_prefix() -> Transition:
    other = changed(B0, prompt_token_ids=(1, 2, 3, 0, 9, 9))
    before = view([A0, other], step=1)
    after = view([A1, changed(B1, prompt_token_ids=other.spec.prompt_token_ids)], step=2)
    return Transition("schedule", before, after, plan=S_PLAN)


@bad("cache-hit-identical-prefix")
def b_hit_not_block_aligned() -> Transition:
    return dataclasses.replace(SCHEDULE, plan=with_entry(S_PLAN, "B", num_computed_tokens=3, num_scheduled_tokens=3))


@bad("cache-hit-identical-prefix")
def b_hit_on_block_never_cached() -> Transition:
    # B "hits" block 1, which carried no key before the step.
    return dataclasses.replace(SCHEDULE, before=with_kv(S_BEFORE, block_keys={}, cache_index={}))


@bad("preemption-resets")
def b_preempted_keeps_computed() -> Transition:
    return after_is(PREEMPT, with_req(P_AFTER, "B", num_computed_tokens=8))


@bad("preemption-resets")
def b_preemption_not_reported() -> Transition:
    return dataclasses.replace(PREEMPT, plan=dataclasses.replace(P_PLAN, preempted_ids=()))


@bad("preemption-resets")
def b_preemptions_not_counted() -> Transition:
    return after_is(PREEMPT, with_req(P_AFTER, "B", num_preemptions=0))


@bad("no-admission-with-preemption")
def b_admit_while_preempting() -> Transition:
    c = entry("C", NEW, 0, 1, 1, (3,), (1,))
    return dataclasses.replace(PREEMPT, plan=dataclasses.replace(P_PLAN, scheduled=P_PLAN.scheduled + (c,)))


@bad("full-sequence-reserved")
def b_admitted_without_room_for_whole_sequence() -> Transition:
    # B knows 32 tokens (8 blocks) but holds 2 with 5 left free: it was admitted on its chunk alone.
    assert fires("full-sequence-reserved", SCHEDULE) == []
    b = entry("B", NEW, 4, 2, 32, (1, 3), (9, 9))
    return dataclasses.replace(SCHEDULE, plan=plan(2, S_PLAN.scheduled[0], b))


@bad("full-sequence-reserved", "no check without scheduler_reserve_full_isl")
def b_full_sequence_only_with_reservation() -> Transition:
    t = b_admitted_without_room_for_whole_sequence()
    off = dataclasses.replace(CFG, scheduler_reserve_full_isl=False)
    quiet = dataclasses.replace(t, after=dataclasses.replace(t.after, config=off))
    assert fires("full-sequence-reserved", quiet) == []
    return t


def _two_waiting(cfg: SchedulerConfig, c_prio: int = 0, b_prio: int = 0) -> Transition:
    """S, with C (7 tokens) queued ahead of B and only B admitted."""
    c0 = req("C", (7, 7, 7), priority=c_prio)
    b0 = changed(B0, priority=b_prio)
    b1 = changed(B1, priority=b_prio)
    before = view([A0, c0, b0], cfg=cfg, step=1, waiting=("C", "B"))
    after = view([A1, b1, c0], cfg=cfg, step=2)
    return Transition("schedule", before, after, plan=S_PLAN)


@bad("fcfs-admission-order")
def b_fcfs_skips_head() -> Transition:
    return _two_waiting(CFG)


@bad("priority-admission-order")
def b_priority_skips_better() -> Transition:
    return _two_waiting(dataclasses.replace(CFG, policy=Policy.PRIORITY), c_prio=0, b_prio=1)


@bad("priority-admission-order")
def b_priority_view_out_of_order() -> Transition:
    pcfg = dataclasses.replace(CFG, policy=Policy.PRIORITY)
    t = _two_waiting(pcfg, c_prio=1, b_prio=0)  # B is the better one: admitting it is right
    assert fires("priority-admission-order", t) == []
    v = view([req("C", (7,), priority=1), req("D", (8,), priority=0)], cfg=pcfg)
    return Transition("add", view([req("C", (7,), priority=1)], cfg=pcfg), v, request=RequestSpec("D", (8,), 1))


@bad("fcfs-victim-suffix")
def b_fcfs_victim_not_last() -> Transition:
    c0 = req("C", (5,), (6,), R, computed=1, blocks=())
    # C (last, holding nothing) should have gone before B.
    before = view([PA0, PB0, dataclasses.replace(c0, block_ids=())], cfg=SMALL, step=3)
    after = view([PA1, PB1, dataclasses.replace(c0, num_computed_tokens=1)], cfg=SMALL, step=4, extra_keys={3: key(PB0, 0)})
    return Transition("schedule", before, after, plan=P_PLAN)


@bad("priority-victim-choice")
def b_priority_victim_not_worst() -> Transition:
    return _prio(PREEMPT, a_prio=2, b_prio=1)


@bad("running-served-while-budget")
def b_running_left_out() -> Transition:
    # A runs but is left out while B is admitted, with 14 of 16 budget tokens left
    after = view([A0, B1], step=2)
    return Transition("schedule", S_BEFORE, after, plan=plan(2, entry("B", NEW, 4, 2, 6, (1, 3), (9, 9))))


@bad("progress")
def b_nothing_scheduled() -> Transition:
    return Transition("schedule", S_BEFORE, dataclasses.replace(S_BEFORE, step=2), plan=plan(2))


@bad("progress-admits-head")
def b_idle_head_not_admitted() -> Transition:
    c = req("C", (4, 4), status=W)
    before = view([c, B0], step=1, extra_keys={1: key(B0, 0)})
    after = view([dataclasses.replace(B0, status=R, num_computed_tokens=6, block_ids=(1, 2)), c], step=2, extra_keys={})
    # B admitted although C is at the head and nothing runs
    return Transition("schedule", before, after, plan=plan(2, entry("B", NEW, 4, 2, 6, (1, 2), (9, 9))))


@bad("work-conserving-admission")
def b_admission_stopped_though_head_fits() -> Transition:
    assert fires("work-conserving-admission", BLOCKED) == []
    small_b = req("B", (21, 22, 23))  # one block: it fits the one free block
    before = view([WA0, small_b], cfg=SMALL, step=5)
    after = view([dataclasses.replace(WA0, num_computed_tokens=11), small_b], cfg=SMALL, step=6)
    return Transition("schedule", before, after, plan=W_PLAN)


@bad("no-starvation")
def b_running_head_skipped() -> Transition:
    p = dataclasses.replace(S_PLAN, scheduled=S_PLAN.scheduled[1:])
    return Transition("schedule", S_BEFORE, view([A0, B1], step=2), plan=p)


@bad("no-starvation")
def b_running_head_short_changed() -> Transition:
    # A long prefill at the head gets 2 tokens although 16 fit the budget.
    a0 = req("A", range(20), (), R, computed=4, blocks=(1,))
    a1 = dataclasses.replace(a0, num_computed_tokens=6, block_ids=(1, 2))
    return Transition(
        "schedule", view([a0], step=1), view([a1], step=2), plan=plan(2, entry("A", RUN, 4, 2, 20, (1, 2), range(4, 6)))
    )


# ---- a request's life


@bad("legal-status-transition")
def b_running_back_to_waiting() -> Transition:
    return after_is(UPDATE, with_req(U_AFTER, "B", status=W, num_computed_tokens=0, block_ids=()))


@bad("legal-status-transition")
def b_request_vanishes() -> Transition:
    return after_is(ABORT, dataclasses.replace(AB_AFTER, finished={}))


@bad("status-change-by-operation")
def b_update_preempts() -> Transition:
    after = dataclasses.replace(
        with_req(U_AFTER, "B", status=P, num_computed_tokens=0, block_ids=()), running=("A",), waiting=("B",)
    )
    return after_is(UPDATE, after)


@bad("status-change-by-operation")
def b_abort_finishes_the_wrong_request() -> Transition:
    return dataclasses.replace(ABORT, request_id="A")


@bad("waiting-queue-order")
def b_add_jumps_the_queue() -> Transition:
    c = req("C", (1,))
    before = view([A2, c], step=2)
    d = req("D", (2,))
    return Transition("add", before, view([A2, c, d], step=2, waiting=("D", "C")), request=RequestSpec("D", (2,), 10))


@bad("waiting-queue-order")
def b_preempted_goes_to_back() -> Transition:
    c = req("C", (1,))
    before = view([PA0, PB0, c], cfg=SMALL, step=3)
    after = view([PA1, PB1, c], cfg=SMALL, step=4, extra_keys={3: key(PB0, 0)}, waiting=("C", "B"))
    t = Transition("schedule", before, after, plan=P_PLAN)
    assert fires("waiting-queue-order", after_is(t, dataclasses.replace(after, waiting=("B", "C")))) == []
    return t


@bad("running-queue-update")
def b_running_reordered() -> Transition:
    return after_is(SCHEDULE, dataclasses.replace(S_AFTER, running=("B", "A")))


@bad("blocks-only-grow")
def b_update_changes_table() -> Transition:
    return after_is(UPDATE, with_req(U_AFTER, "A", num_computed_tokens=8))


@bad("blocks-only-grow")
def b_schedule_replaces_table() -> Transition:
    after = with_req(S_AFTER, "A", block_ids=(4, 2))
    return after_is(SCHEDULE, after)


@bad("output-append-only")
def b_output_rewritten() -> Transition:
    return after_is(UPDATE, with_req(U_AFTER, "A", output_token_ids=(6, 8)))


@bad("output-append-only")
def b_output_grows_in_schedule() -> Transition:
    return after_is(SCHEDULE, with_req(S_AFTER, "B", output_token_ids=(1,)))


@bad("output-append-only")
def b_output_lost_across_preemption() -> Transition:
    return after_is(PREEMPT, with_req(P_AFTER, "B", output_token_ids=()))


@bad("update-appends-sampled-token")
def b_sampled_token_dropped() -> Transition:
    return after_is(UPDATE, with_req(U_AFTER, "A", output_token_ids=(7,)))


@bad("update-appends-sampled-token")
def b_partial_chunk_gets_token() -> Transition:
    p = with_entry(S_PLAN, "B", num_scheduled_tokens=1, token_ids=(9,))
    after = with_req(U_AFTER, "B", num_computed_tokens=5)
    return Transition("update", with_req(S_AFTER, "B", num_computed_tokens=5), after, plan=p, result=U_RESULT)


@bad("stop-conditions")
def b_eos_ignored() -> Transition:
    a2 = changed(A2, eos_token_id=8)
    return Transition("update", S_AFTER_E, view([a2, B2], step=2), plan=S_PLAN, result=U_RESULT)


@bad("stop-conditions")
def b_unfinished_at_max_tokens() -> Transition:
    return after_is(UPDATE, with_req(U_AFTER, "A", max_tokens=2))


@bad("stop-conditions")
def b_stopped_without_reason() -> Transition:
    a2 = changed(A2e, eos_token_id=None)
    return Transition("update", S_AFTER, dataclasses.replace(UE_AFTER, finished={"A": a2}), plan=S_PLAN, result=U_RESULT)


@bad("finished-reported-once")
def b_finished_not_reported() -> Transition:
    return dataclasses.replace(NEXT, plan=dataclasses.replace(NEXT_PLAN, finished_ids=()))


@bad("finished-reported-once")
def b_finished_dropped_before_report() -> Transition:
    return Transition("abort", UE_AFTER, dataclasses.replace(AB_AFTER, finished={"B": B_AB}), request_id="B")


@bad("free-queue-lru")
def b_keyless_block_freed_to_back() -> Transition:
    return after_is(ABORT, with_kv(AB_AFTER, free_queue=(4, 5, 6, 7, 8, 3)))


@bad("free-queue-lru")
def b_allocation_not_from_front() -> Transition:
    # B's fresh block should be 3, the head of the free queue, not 8.
    b1 = dataclasses.replace(B1, block_ids=(1, 8))
    p = with_entry(S_PLAN, "B", block_ids=(1, 8))
    return Transition("schedule", S_BEFORE, view([A1, b1], step=2), plan=p)


@bad("reset-prefix-cache")
def b_reset_keeps_keys() -> Transition:
    return after_is(RESET, IDLE)


@bad("reset-prefix-cache")
def b_reset_while_held() -> Transition:
    return after_is(RESET_HELD, with_kv(U_AFTER, block_keys={}, cache_index={}))


@pytest.mark.parametrize("inv_id,label,build", BAD, ids=[f"{i}:{label}" for i, label, _ in BAD])
def test_invariant_fires(inv_id: str, label: str, build: Callable[[], Transition]) -> None:
    t = build()
    found = fires(inv_id, t)
    assert found, f"{inv_id} did not fire on {label}"
    assert all(v.invariant_id == inv_id and v.message for v in found)
    # The Monitor reports it too, under the same id.
    assert inv_id in {v.invariant_id for v in Monitor([BY_ID[inv_id]]).observe(t)}


def test_every_invariant_has_a_firing_test() -> None:
    # the in-flight invariants fire in tests/invariants/test_inflight.py, the
    # admission gates' in tests/invariants/test_gates.py
    # the KV connector's in tests/invariants/test_connector.py, the hybrid
    # KV cache groups' in tests/invariants/test_groups.py
    from tests.invariants.test_connector import CONNECTOR_IDS
    from tests.invariants.test_gates import GATE_IDS
    from tests.invariants.test_groups import GROUP_IDS
    from tests.invariants.test_inflight import INFLIGHT_IDS
    from tests.invariants.test_kv_events import KV_EVENT_IDS  # the KV cache events'
    from tests.invariants.test_stats import STATS_IDS  # the statistics' (log_stats)
    from tests.invariants.test_mamba import MAMBA_IDS  # the Mamba groups'
    from tests.invariants.test_sessions import SESSION_IDS  # the streaming-input sessions'
    from tests.invariants.test_pipeline import IDS as PIPELINE_IDS  # k plans in flight
    from tests.invariants.test_runner_v2 import RUNNER_V2_IDS  # Model Runner V2's

    assert {inv.id for inv in CATALOGUE} == (
        {inv_id for inv_id, _, _ in BAD} | set(INFLIGHT_IDS) | set(GATE_IDS) | set(CONNECTOR_IDS) | set(GROUP_IDS)
        | set(KV_EVENT_IDS) | set(STATS_IDS) | set(MAMBA_IDS) | set(SESSION_IDS) | set(PIPELINE_IDS)
        | set(RUNNER_V2_IDS)
    )


# --------------------------------------------------------------------------
# History-based checks
# --------------------------------------------------------------------------


def test_finished_reported_twice_fires_with_history() -> None:
    m = Monitor([BY_ID["finished-reported-once"]])
    assert m.observe(NEXT) == []
    again = Transition("schedule", UE_AFTER, NEXT_AFTER, plan=NEXT_PLAN)
    found = m.observe(again)
    assert [v.invariant_id for v in found] == ["finished-reported-once"]
    assert "again" in found[0].message and found[0].request_id == "A"


def test_reused_request_id_is_not_a_second_report() -> None:
    m = Monitor()
    assert m.observe(NEXT) == []
    readd = Transition("add", NEXT_AFTER, view([B3, req("A", (3,))], step=3, free=(2, 4, 5, 6, 7, 8), extra_keys={1: key(A0, 0)}), request=RequestSpec("A", (3,), 10))
    assert m.observe(readd) == []


def test_output_loss_seen_only_through_history() -> None:
    """A driver that skipped a transition: before and after agree with each
    other, but not with what the Monitor saw earlier."""
    m = Monitor([BY_ID["output-append-only"]])
    assert m.observe(UPDATE) == []  # A's output seen as (7, 8)
    stale = with_req(U_AFTER, "A", output_token_ids=(7,))
    found = m.observe(Transition("abort", stale, stale, request_id="nobody"))
    assert found and found[0].request_id == "A"


# --------------------------------------------------------------------------
# The catalogue and the Monitor
# --------------------------------------------------------------------------


def test_catalogue_shape() -> None:
    assert len(CATALOGUE) >= 20
    ids = [inv.id for inv in CATALOGUE]
    assert len(set(ids)) == len(ids)
    for inv in CATALOGUE:
        assert inv.id == inv.id.lower() and " " not in inv.id and "_" not in inv.id
        assert inv.statement and "\n" not in inv.statement
        assert "vllm/" in inv.vllm_behaviour and ".py" in inv.vllm_behaviour
        assert inv.kinds


def test_catalogue_text_lists_every_invariant() -> None:
    text = catalogue_text()
    for inv in CATALOGUE:
        assert inv.id in text
    assert "vLLM:" in text


def test_docs_table_lists_every_invariant() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "invariants.md").read_text()
    for inv in CATALOGUE:
        assert f"`{inv.id}`" in doc, inv.id
    assert catalogue_markdown() in doc, "docs/invariants.md is out of date with the catalogue"


def test_monitor_reports_a_malformed_view_instead_of_crashing() -> None:
    broken = dataclasses.replace(S_AFTER, running=("A", "B", "ghost"))
    found = Monitor().observe(after_is(SCHEDULE, broken))
    assert any(v.invariant_id == "queues-match-status" and v.request_id == "ghost" for v in found)


def test_import_pulls_in_neither_torch_nor_vllm() -> None:
    code = "import sys, invariants; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------
# No false positives on the reference scheduler
# --------------------------------------------------------------------------


def _random_config(rng: random.Random) -> SchedulerConfig:
    bs = rng.choice([1, 2, 4, 8])
    mml = rng.choice([16, 32, 64])
    chunked = rng.random() < 0.8
    num_blocks = -(-mml // bs) + 1 + rng.choice([0, 0, 1, 3, 10, 40])
    mns = rng.choice([1, 2, 4, 8])
    mnbt = rng.choice([4, 8, 16, 64]) if chunked else rng.choice([mml, 2 * mml])
    return SchedulerConfig(
        block_size=bs,
        num_blocks=num_blocks,
        max_num_batched_tokens=max(mnbt, mns),
        max_num_seqs=mns,
        max_model_len=mml,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=min(rng.choice([0, 0, 0, 3, 8]), mml),
        enable_prefix_caching=rng.random() < 0.8,
        policy=rng.choice(list(Policy)),
        scheduler_reserve_full_isl=rng.random() < 0.7,
    )


@functools.lru_cache(maxsize=None)
def run_random_workload(seed: int, ops: int = 150) -> dict[str, int]:
    """Drive the reference scheduler with adds (sharing prefixes), steps with a
    fake model that samples one token per completing entry, aborts (also
    between schedule and update) and cache resets; every transition goes
    through a full Monitor, which must stay silent."""
    from schedspec.spec.scheduler import SpecScheduler

    rng = random.Random(seed)
    cfg = _random_config(rng)
    sched = SpecScheduler(cfg)
    monitor = Monitor()
    prefixes = [tuple(rng.randrange(5) for _ in range(rng.randrange(1, cfg.max_model_len))) for _ in range(3)]
    stats = {"preempted": 0, "hits": 0, "finished": 0}

    def observe(kind: Any, before: SchedulerView, **kw: Any) -> None:
        t = Transition(kind=kind, before=before, after=sched.view(), **kw)
        found = monitor.observe(t)
        assert not found, f"seed {seed}, {cfg}, {kind}:\n" + "\n".join(map(str, found[:10]))

    n = 0
    for _ in range(ops):
        x = rng.random()
        before = sched.view()
        if x < 0.3:
            n += 1
            prompt = rng.choice(prefixes)[: rng.randrange(cfg.max_model_len)]
            prompt = (prompt + tuple(rng.randrange(5) for _ in range(rng.randrange(1, 10))))[: cfg.max_model_len - 1]
            spec = RequestSpec(
                f"r{n}",
                prompt,
                max_tokens=rng.randrange(1, 20),
                priority=rng.randrange(3),
                arrival=rng.randrange(5),
                stop_token_ids=(4,) if rng.random() < 0.2 else (),
                eos_token_id=3 if rng.random() < 0.3 else None,
                ignore_eos=rng.random() < 0.3,
                cache_salt=rng.choice([None, None, "", "salt"]),
            )
            sched.add(spec)
            observe("add", before, request=spec)
        elif x < 0.35 and before.requests:
            rid = rng.choice(sorted(before.requests))
            sched.abort(rid)
            observe("abort", before, request_id=rid)
        elif x < 0.37:
            sched.reset_prefix_cache(rng.random() < 0.5)
            observe("reset", before)
        else:
            p = sched.schedule()
            observe("schedule", before, plan=p)
            stats["preempted"] += len(p.preempted_ids)
            stats["hits"] += sum(1 for s in p.scheduled if s.kind != RUN and s.num_computed_tokens > 0)
            stats["finished"] += len(p.finished_ids)
            mid = sched.view()
            if rng.random() < 0.1 and mid.requests:
                rid = rng.choice(sorted(mid.requests))
                sched.abort(rid)
                observe("abort", mid, request_id=rid)
            live = sched.view()
            result = StepResult(
                {s.request_id: (rng.randrange(6),) for s in p.scheduled if s.samples and s.request_id in live.requests}
            )
            sched.update(p, result)
            observe("update", live, plan=p, result=result)
    return stats


@pytest.mark.parametrize("seed", range(40))
def test_no_false_positives_on_the_spec(seed: int) -> None:
    run_random_workload(seed)


def test_random_workloads_exercise_preemption_and_hits() -> None:
    total = {"preempted": 0, "hits": 0, "finished": 0}
    for seed in range(40):
        for k, v in run_random_workload(seed).items():
            total[k] += v
    assert all(v > 0 for v in total.values()), total
