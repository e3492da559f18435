"""Invariants relaxed to behaviour vLLM 0.33 and the spec share: the shrunk
reproductions (docs/divergences.md, "Findings for the invariants") now hold
on the spec under the whole catalogue, and the relaxation goes no further:
the same transitions with the premise of the relaxation taken away fire."""

from __future__ import annotations

import dataclasses

from schedspec.check.driver import Runner
from schedspec.check.workload import AddRequest, Event, Schedule, Step, Update
from schedspec.invariants import BY_ID, Monitor, Transition, Violation
from schedspec.spec.interface import MMInput, Policy, RequestSpec, SchedulerConfig, StepResult
from schedspec.spec.scheduler import SpecScheduler
from tests.invariants.test_catalogue import changed


class Recording(Monitor):
    """A Monitor that keeps every transition it checks."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Transition] = []

    def observe(self, t: Transition) -> list[Violation]:
        self.seen.append(t)
        return super().observe(t)


def _run(config: SchedulerConfig, events: list[Event]) -> list[Transition]:
    runner = Runner(config, {"spec": SpecScheduler})
    rec = Recording()
    runner.monitors["spec"] = rec
    assert runner.run(events) is None
    return rec.seen


def _nth_schedule(seen: list[Transition], step: int) -> Transition:
    return next(t for t in seen if t.kind == "schedule" and t.plan is not None and t.plan.step == step)


def _fires(inv: str, t: Transition) -> list[str]:
    return [v.message for v in BY_ID[inv].check(t)]


# A hit on a block whose last token became known after a step in flight:
# async scheduling with k = 4 drafts, block size 2, chunked prefill off.
HIT_CFG = SchedulerConfig(
    block_size=2, num_blocks=25, max_num_batched_tokens=56, max_num_seqs=3, max_model_len=48,
    enable_chunked_prefill=False, async_scheduling=True, num_speculative_tokens=4,
)
R10 = (0, 12, 12, 6, 15) + tuple(range(20, 48))
HIT_EVENTS: list[Event] = [
    AddRequest(RequestSpec("r7", (0,), max_tokens=4)),
    AddRequest(RequestSpec("r8", tuple(range(30, 39)), max_tokens=1)),
    Schedule(StepResult({"r7": (12,), "r8": (5,)})),  # step 1: r7 samples 12
    AddRequest(RequestSpec("r10", R10, max_tokens=1)),
    Schedule(),  # step 2, with step 1 in flight: r7 computes position 1
    Update(),  # step 1's update: r7's token 12 is known
    Schedule(),  # step 3: r7 keys block (0, 12), r10 hits it
]


def test_hit_on_a_block_keyed_after_a_step_in_flight_holds() -> None:
    t = _nth_schedule(_run(HIT_CFG, HIT_EVENTS), 3)
    assert t.plan is not None
    r7, r10 = t.plan.get("r7"), t.plan.get("r10")
    assert r7 is not None and r10 is not None
    block = r7.block_ids[0]
    # r10 is admitted with a hit on r7's first block, which was keyed in this
    # step, and whose last position (1) step 2, still in flight, computes
    assert r10.num_computed_tokens == 2 and r10.block_ids[0] == block
    assert block not in t.before.kv.block_keys and t.after.kv.block_keys[block] == ("", (0, 12))
    assert r7.num_computed_tokens == 6  # this step computes positions 6.., not 1
    assert _fires("cache-hit-identical-prefix", t) == []


def test_hit_on_a_block_keyed_in_the_step_without_the_step_in_flight_fires() -> None:
    t = _nth_schedule(_run(HIT_CFG, HIT_EVENTS), 3)
    assert t.plan is not None
    # no earlier step computing r7's position 1 is in flight: nothing fills
    # the block before this step runs
    alone = dataclasses.replace(t, in_flight=(t.plan,))
    assert _fires("cache-hit-identical-prefix", alone) == [
        "hit block 1 (index 0) was not cached under the request's key before the step, nor filled "
        "by another request in it"
    ]
    # the in-flight entry of another request does not count either
    step2 = next(p for p in t.in_flight if p.step == 2)
    foreign = dataclasses.replace(
        step2, scheduled=tuple(dataclasses.replace(e, request_id="r8") for e in step2.scheduled if e.request_id == "r7")
    )
    assert _fires("cache-hit-identical-prefix", dataclasses.replace(t, in_flight=(foreign, t.plan))) != []


# A partial chunk with chunked prefill off: the encoder cuts "b" before its
# input in step 1; in step 2 "a" takes 14 of the budget of 24 and the RUNNING
# loop gives "b" 9 of its 11 remaining tokens.
CHUNK_CFG = SchedulerConfig(
    block_size=4, num_blocks=40, max_num_batched_tokens=24, max_num_seqs=4, max_model_len=24,
    enable_chunked_prefill=False, max_num_encoder_input_tokens=6, encoder_cache_size=6,
)
CHUNK_EVENTS: list[Event] = [
    AddRequest(RequestSpec("z", tuple(range(1, 6)), max_tokens=8, mm_inputs=(MMInput(0, 4, "z"),))),
    AddRequest(RequestSpec("a", tuple(range(10, 26)), max_tokens=2, mm_inputs=(MMInput(2, 3, "a"),))),
    AddRequest(RequestSpec("b", tuple(range(30, 44)), max_tokens=2, mm_inputs=(MMInput(3, 3, "b"),))),
    Step(),
    Step(),
    Step(),
]


def _chunks(t: Transition) -> list[tuple[str, int, int]]:
    assert t.plan is not None
    return [(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in t.plan.scheduled]


def test_budget_cut_after_an_encoder_cut_with_chunked_prefill_off_holds() -> None:
    seen = _run(CHUNK_CFG, CHUNK_EVENTS)
    assert _chunks(_nth_schedule(seen, 1)) == [("z", 0, 5), ("a", 0, 2), ("b", 0, 3)]
    t = _nth_schedule(seen, 2)
    assert _chunks(t) == [("z", 5, 1), ("a", 2, 14), ("b", 3, 9)]
    assert _fires("chunked-prefill-disabled", t) == []


def test_budget_cut_of_a_request_no_encoder_cut_explains_fires() -> None:
    t = _nth_schedule(_run(CHUNK_CFG, CHUNK_EVENTS), 2)
    b = t.after.requests["b"]
    # the same chunk for a request whose only encoder input lies beyond its
    # computed tokens: nothing but the budget cut it
    later = changed(b, mm_inputs=(MMInput(4, 3, "b"),))
    moved = dataclasses.replace(t, after=dataclasses.replace(t.after, requests={**t.after.requests, "b": later}))
    assert _fires("chunked-prefill-disabled", moved) == [
        "given a partial chunk (3 + 9 of 14 tokens) with chunked prefill disabled"
    ]
    none = changed(b, mm_inputs=())
    bare = dataclasses.replace(t, after=dataclasses.replace(t.after, requests={**t.after.requests, "b": none}))
    assert _fires("chunked-prefill-disabled", bare) != []


# A step whose only progress is a preemption, with the encoder on: under
# PRIORITY, r202 (priority 0) is passed over because its next chunk starts at
# an encoder input (mm3) the cache of 2 cannot hold while r201 still
# references mm1; r201 then needs a block, the pool has none, and it preempts
# itself, which releases mm1 for the next step. vLLM plans the same.
ENC_CFG = SchedulerConfig(
    block_size=8, num_blocks=3, max_num_batched_tokens=6, max_num_seqs=2, max_model_len=16,
    enable_prefix_caching=False, policy=Policy.PRIORITY, scheduler_reserve_full_isl=False,
    max_num_encoder_input_tokens=2, encoder_cache_size=2,
)
ENC_EVENTS: list[Event] = [
    AddRequest(RequestSpec("r201", (5, 5, 13, 15, 9, 15, 6, 0, 8), max_tokens=1, priority=799,
                           arrival=201, mm_inputs=(MMInput(2, 2, "mm1"),))),
    AddRequest(RequestSpec("r202", (1, 9, 8, 13, 10, 3, 7, 9, 3), max_tokens=1, arrival=202,
                           mm_inputs=(MMInput(0, 1, "mm2"), MMInput(2, 2, "mm1"),
                                      MMInput(4, 2, "mm1"), MMInput(7, 2, "mm3")))),
    Step(),
    Step(),
    Step(),
]


def test_a_step_that_only_preempts_for_the_encoder_makes_progress() -> None:
    seen = _run(ENC_CFG, ENC_EVENTS)
    t = _nth_schedule(seen, 3)
    assert t.plan is not None and not t.plan.scheduled and t.plan.preempted_ids == ("r201",)
    assert _fires("progress", t) == []
    # the same empty step without the preemption is still no progress
    bare = dataclasses.replace(t, plan=dataclasses.replace(t.plan, preempted_ids=()))
    assert _fires("progress", bare)


# A hit on a block whose place a step in flight computes only after a
# rollback rewound it (async scheduling, 3 drafts, block size 1): r17's step
# 2 drafts positions 3-5, one draft is accepted, so step 3 (planned at 6-9)
# computes 4-7; in step 4 r17 keys its block 4 and the resumed r16 hits it.
REWOUND_CFG = SchedulerConfig(
    block_size=1, num_blocks=18, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=16,
    async_scheduling=True, num_speculative_tokens=3, policy=Policy.PRIORITY,
    enable_kv_cache_events=True, long_prefill_token_threshold=0,
)
REWOUND_EVENTS: list[Event] = [
    AddRequest(RequestSpec("r16", (10, 0), max_tokens=8, priority=984, arrival=16)),
    AddRequest(RequestSpec("r17", (10, 0), max_tokens=8, priority=0, arrival=17)),
    Schedule(), Step(), Step(), Step(),
]


def test_hit_on_a_block_an_inflight_step_fills_after_a_rollback_holds() -> None:
    runner = Runner(REWOUND_CFG, {"spec": SpecScheduler}, vocab=16, oracle_seed=47)
    rec = Recording()
    runner.monitors["spec"] = rec
    assert runner.run(REWOUND_EVENTS) is None
    t = _nth_schedule(rec.seen, 4)
    assert t.plan is not None
    r16, r17 = t.plan.get("r16"), t.plan.get("r17")
    assert r16 is not None and r17 is not None and r16.num_computed_tokens == 5
    block = r16.block_ids[4]
    assert block == r17.block_ids[4] and block not in t.before.kv.block_keys
    step3 = next(p for p in t.in_flight if p.step == 3).get("r17")
    assert step3 is not None and (step3.num_computed_tokens, t.before.requests["r17"].num_computed_tokens) == (6, 8)
    assert _fires("cache-hit-identical-prefix", t) == []
    # without the rollback (r17 still at step 3's planned end) nothing fills block 4
    before = dataclasses.replace(t.before, requests={
        **t.before.requests, "r17": dataclasses.replace(t.before.requests["r17"], num_computed_tokens=10)})
    assert _fires("cache-hit-identical-prefix", dataclasses.replace(t, before=before)) == [
        "hit block 9 (index 4) was not cached under the request's key before the step, nor filled "
        "by another request in it"
    ]
