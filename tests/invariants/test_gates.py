"""The admission-gate invariants (invariants/gates.py): each holds on the
transitions the spec makes with its gate on, and fires, under its id, on a
crafted transition that breaks it in one place; the whole catalogue stays
silent on the spec over random gated workloads."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from schedspec.invariants import BY_ID, CATALOGUE, Monitor, Transition
from schedspec.spec import RequestSpec, SchedulerConfig, SpecScheduler, StepPlan
from schedspec.spec.interface import MMInput, PauseState, RequestStatus, RequestView, SchedulerView

from tests.invariants.test_catalogue import changed
from tests.invariants.test_inflight import Recorder, fires

GATE_IDS = (
    "max-loras",
    "shared-block-one-adapter",
    "shared-block-one-image-set",
    "grammar-wait-holds-nothing",
    "grammar-wait-not-scheduled",
    "drafts-obey-grammar",
    "paused-admits-nothing",
    "watermark-kept",
    "prefill-cadence",
    "encoder-budget",
    "encoder-cache-within-size",
)


def config(**kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(block_size=4, num_blocks=17, max_num_batched_tokens=32, max_num_seqs=4,
                                max_model_len=32)
    base.update(kw)
    return SchedulerConfig(**base)


def with_request(v: SchedulerView, rid: str, **changes: Any) -> SchedulerView:
    return dataclasses.replace(v, requests={**v.requests, rid: changed(v.requests[rid], **changes)})


def step(r: Recorder, token: int = 9, drafts: dict[str, tuple[int, ...]] | None = None) -> StepPlan:
    plan = r.schedule()
    r.update(plan, {e.request_id: (token,) for e in plan.scheduled if e.samples}, drafts)
    return plan


def clean(r: Recorder) -> None:
    """Every invariant of the catalogue holds on every transition recorded."""
    m = Monitor(CATALOGUE)
    for t in r.log:
        assert m.observe(t) == [], t.kind


def test_every_gate_invariant_is_catalogued_and_requires_its_gate() -> None:
    ids = {inv.id for inv in CATALOGUE}
    assert set(GATE_IDS) <= ids
    gates = {"lora", "structured_output", "pause", "watermark", "prefill_cadence", "encoder"}
    for inv_id in GATE_IDS:
        assert BY_ID[inv_id].requires and BY_ID[inv_id].requires <= gates, inv_id


# ---------------------------------------------------------------- LoRA


def lora_run() -> Recorder:
    r = Recorder(config(max_loras=1))
    r.add("a", 8, lora_id=1)
    r.add("b", 8, lora_id=2)
    r.add("c", 8, lora_id=1)
    step(r)
    return r


def test_max_loras() -> None:
    r = lora_run()
    t = r.last("schedule")
    assert t.plan is not None and t.plan.scheduled_ids == ("a", "c")
    assert fires("max-loras", t) == []
    clean(r)
    # b's adapter in the plan and the running queue: two adapters, one slot
    b = changed(t.after.requests["a"], request_id="b", lora_id=2, status=RequestStatus.RUNNING)
    after = dataclasses.replace(t.after, requests={**t.after.requests, "b": b}, running=t.after.running + ("b",))
    plan = dataclasses.replace(t.plan, scheduled=t.plan.scheduled + (dataclasses.replace(t.plan.scheduled[0], request_id="b"),))
    found = fires("max-loras", dataclasses.replace(t, after=after, plan=plan))
    assert any("more than max_loras 1" in f for f in found)


def test_shared_block_one_adapter() -> None:
    r = Recorder(config(max_loras=2))
    r.add("a", 9, lora_id=1)
    r.add("b", 9, lora_id=1)  # the same prompt and adapter: shares a's first two blocks
    r.add("c", 9, lora_id=2)  # another adapter: shares nothing
    r.schedule()
    t = r.last("schedule")
    a, b, c = (t.after.requests[x] for x in "abc")
    assert a.block_ids[:2] == b.block_ids[:2] and not set(c.block_ids) & set(a.block_ids)
    assert fires("shared-block-one-adapter", t) == []
    clean(r)
    bad = with_request(t.after, "b", lora_id=2)
    assert "different adapters" in fires("shared-block-one-adapter", dataclasses.replace(t, after=bad))[0]


def test_shared_block_one_image_set() -> None:
    enc = dict(max_num_encoder_input_tokens=8, encoder_cache_size=8)
    r = Recorder(config(**enc))
    r.add("a", 9, mm_inputs=(MMInput(1, 2, "x"),))
    r.add("b", 9, mm_inputs=(MMInput(1, 2, "x"),))
    r.add("c", 9, mm_inputs=(MMInput(1, 2, "y"),))
    r.schedule()
    t = r.last("schedule")
    assert t.after.requests["a"].block_ids[:2] == t.after.requests["b"].block_ids[:2]
    assert not set(t.after.requests["c"].block_ids) & set(t.after.requests["a"].block_ids)
    assert fires("shared-block-one-image-set", t) == []
    bad = with_request(t.after, "b", mm_inputs=(MMInput(2, 2, "x"),))  # another position
    assert "different encoder inputs" in fires("shared-block-one-image-set", dataclasses.replace(t, after=bad))[0]


# ---------------------------------------------------------------- structured outputs


def grammar_run() -> Recorder:
    r = Recorder(config(num_speculative_tokens=2))
    r.add("a", 4, structured_output=True, grammar_rejects=(5,))
    r.add("b", 4)
    step(r)  # a waits for its grammar; b runs
    r.s.grammar_ready("a")
    step(r, drafts={"b": (5, 6)})
    step(r, drafts={"a": (3, 5), "b": (5, 6)})
    step(r)
    return r


def test_grammar_wait_holds_nothing() -> None:
    r = grammar_run()
    first = r.log[2]  # the first schedule: a still waits
    assert first.kind == "schedule" and first.after.requests["a"].status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert fires("grammar-wait-holds-nothing", first) == []
    clean(r)
    bad = with_request(first.after, "a", block_ids=(9,))
    assert "waits for its grammar yet holds blocks [9]" in fires("grammar-wait-holds-nothing", dataclasses.replace(first, after=bad))[0]
    gone = dataclasses.replace(first.after, waiting=())
    assert "not in the waiting queue" in fires("grammar-wait-holds-nothing", dataclasses.replace(first, after=gone))[0]


def test_grammar_wait_not_scheduled() -> None:
    r = grammar_run()
    admit = [t for t in r.log if t.kind == "schedule"][1]
    assert admit.plan is not None and "a" in admit.plan.scheduled_ids
    assert admit.before.requests["a"].status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert fires("grammar-wait-not-scheduled", admit) == []
    still = with_request(admit.after, "a", status=RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    assert "while still waiting" in fires("grammar-wait-not-scheduled", dataclasses.replace(admit, after=still))[0]


def test_drafts_obey_grammar() -> None:
    r = grammar_run()
    last = r.last("schedule")
    assert last.plan is not None
    a = last.plan.get("a")
    b = last.plan.get("b")
    assert a is not None and b is not None
    assert a.spec_token_ids == (3,) and b.spec_token_ids == (5, 6)  # b has no grammar
    assert fires("drafts-obey-grammar", last) == []
    entries = tuple(dataclasses.replace(e, spec_token_ids=(3, 5)) if e.request_id == "a" else e
                    for e in last.plan.scheduled)
    bad = dataclasses.replace(last, plan=dataclasses.replace(last.plan, scheduled=entries))
    assert "refused tokens [5]" in fires("drafts-obey-grammar", bad)[0]


# ---------------------------------------------------------------- pause


def pause_run() -> Recorder:
    r = Recorder(config())
    r.add("a", 4)
    step(r)
    r.add("b", 4)
    r.s.set_pause_state(PauseState.PAUSED_NEW)
    step(r)
    r.s.set_pause_state(PauseState.PAUSED_ALL)
    step(r)
    return r


def test_paused_admits_nothing() -> None:
    r = pause_run()
    new, all_ = [t for t in r.log if t.kind == "schedule"][1:]
    assert new.plan is not None and new.plan.scheduled_ids == ("a",)
    assert all_.plan is not None and all_.plan.scheduled == ()
    assert fires("paused-admits-nothing", new) == [] and fires("paused-admits-nothing", all_) == []
    clean(r)
    first = r.log[1]  # the unpaused first step admitted a
    assert first.plan is not None
    paused = dataclasses.replace(first, before=dataclasses.replace(first.before, pause_state=PauseState.PAUSED_NEW))
    assert "PAUSED_NEW, yet admitted as NEW" in fires("paused-admits-nothing", paused)[0]
    stopped = dataclasses.replace(new, before=dataclasses.replace(new.before, pause_state=PauseState.PAUSED_ALL))
    assert "PAUSED_ALL, yet step" in fires("paused-admits-nothing", stopped)[0]


# ---------------------------------------------------------------- watermark


def test_watermark_kept() -> None:
    # watermark_blocks = int(0.25 * 17) = 4 of 16 usable blocks
    r = Recorder(config(watermark=0.25))
    for i, rid in enumerate("abc"):  # prompts that share no block
        spec = RequestSpec(rid, tuple(range(100 * i, 100 * i + 16)), 4)
        r.s.add(spec)
        r.log.append(Transition("add", r.log[-1].after if r.log else SpecScheduler(r.s.config).view(),
                                r.s.view(), request=spec))
    step(r)
    t = r.log[3]
    assert t.plan is not None and t.plan.scheduled_ids == ("a", "b")  # c would leave 4 - 4 = 0 free
    assert t.after.kv.num_free_blocks == 8
    assert fires("watermark-kept", t) == []
    clean(r)
    tight = dataclasses.replace(t.after, kv=dataclasses.replace(t.after.kv, free_queue=t.after.kv.free_queue[:3]))
    assert "below the watermark of 4" in fires("watermark-kept", dataclasses.replace(t, after=tight))[0]


# ---------------------------------------------------------------- prefill cadence


def test_prefill_cadence() -> None:
    r = Recorder(config(prefill_schedule_interval=3))
    r.add("a", 4)
    step(r)
    r.add("b", 4)
    held = step(r)
    assert held.scheduled_ids == ("a",)
    released = [step(r), step(r)][-1]
    assert released.scheduled_ids == ("a", "b")
    scheds = [t for t in r.log if t.kind == "schedule"]
    for t in scheds:
        assert fires("prefill-cadence", t) == []
    clean(r)
    # b admitted in the held step
    h = scheds[1]
    assert h.plan is not None
    b_entry = dataclasses.replace(scheds[3].plan.scheduled[1]) if scheds[3].plan else None
    assert b_entry is not None
    bad = dataclasses.replace(h, plan=dataclasses.replace(h.plan, scheduled=h.plan.scheduled + (b_entry,)))
    found = fires("prefill-cadence", bad)
    assert any("carries prefill for ['b']" in f for f in found)
    # the counters must follow the step
    off = dataclasses.replace(h, after=dataclasses.replace(h.after, num_executed_steps=7))
    assert any("num_executed_steps went" in f for f in fires("prefill-cadence", off))


# ---------------------------------------------------------------- encoder


def encoder_run() -> Recorder:
    r = Recorder(config(max_num_encoder_input_tokens=8, encoder_cache_size=8))
    r.add("a", 16, mm_inputs=(MMInput(2, 4, "x"), MMInput(8, 6, "y")))
    step(r)
    step(r)
    return r


def test_encoder_budget() -> None:
    r = encoder_run()
    first, second = [t for t in r.log if t.kind == "schedule"]
    assert first.plan is not None and first.plan.scheduled[0].encoder_inputs == (0,)
    assert second.plan is not None and second.plan.freed_encoder_inputs == ("x",)
    assert fires("encoder-budget", first) == [] and fires("encoder-budget", second) == []
    clean(r)
    both = dataclasses.replace(first.plan.scheduled[0], encoder_inputs=(0, 1), num_scheduled_tokens=16)
    over = dataclasses.replace(first, plan=dataclasses.replace(first.plan, scheduled=(both,)))
    found = fires("encoder-budget", over)
    assert any("10 encoder embeddings" in f for f in found)
    assert any("not cached after the step" in f for f in found)
    outside = dataclasses.replace(first.plan.scheduled[0], encoder_inputs=(1,))
    assert any("outside its tokens" in f for f in fires(
        "encoder-budget", dataclasses.replace(first, plan=dataclasses.replace(first.plan, scheduled=(outside,)))))
    kept = dataclasses.replace(second, plan=dataclasses.replace(second.plan, freed_encoder_inputs=("y",)))
    assert any("still cached" in f for f in fires("encoder-budget", kept))


def test_encoder_cache_within_size() -> None:
    r = encoder_run()
    second = [t for t in r.log if t.kind == "schedule"][1]
    assert dict(second.after.encoder_cache) == {"y": 6} and second.after.encoder_cache_free == 2
    assert fires("encoder-cache-within-size", second) == []
    leak = dataclasses.replace(second.after, encoder_cache_free=3)
    assert "does not add up" in fires("encoder-cache-within-size", dataclasses.replace(second, after=leak))[0]
    # a is in the middle of y (8..13, 16 computed after the step's 8 + 8? no: 16 >= 14)
    mid = with_request(second.after, "a", num_computed_tokens=10)
    evicted = dataclasses.replace(mid, encoder_cache={}, encoder_cache_free=8)
    assert any("not in the encoder cache" in f for f in fires(
        "encoder-cache-within-size", dataclasses.replace(second, after=evicted)))


# ---------------------------------------------------------------- no false alarms


def random_gated_run(seed: int) -> Recorder:
    rng = random.Random(seed)
    cfg = config(max_loras=2, watermark=0.1, prefill_schedule_interval=rng.choice([1, 2, 3]),
                 max_num_encoder_input_tokens=8, encoder_cache_size=12, num_blocks=33,
                 num_speculative_tokens=rng.choice([0, 2]))
    r = Recorder(cfg)
    n = 0
    for _ in range(60):
        roll = rng.random()
        if roll < 0.3 and len(r.s.requests) < 8:
            n += 1
            rid = f"r{n}"
            length = rng.randint(2, 14)
            kw: dict[str, Any] = {"lora_id": rng.choice([0, 0, 1, 2, 3])}
            if rng.random() < 0.3:
                kw.update(structured_output=True, grammar_rejects=(rng.randint(1, 20),))
            if rng.random() < 0.4 and length >= 4:
                img = rng.randint(0, 3)  # an image's size is fixed: 1 + img % 3 embeddings
                off = rng.randint(0, length - 3)
                kw["mm_inputs"] = (MMInput(off, 1 + img % 3, f"img{img}"),)
            r.add(rid, length, max_tokens=rng.randint(1, 6), **kw)
            continue
        waiting = [rid for rid, q in r.s.requests.items()
                   if q.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and q.grammar is None]
        if roll < 0.45 and waiting:
            r.s.grammar_ready(rng.choice(waiting), ok=rng.random() < 0.85)
            continue
        if roll < 0.5:
            r.s.set_pause_state(rng.choice(list(PauseState)))
            continue
        plan = r.schedule()
        sampled: dict[str, tuple[int, ...]] = {e.request_id: (rng.randint(1, 20),) for e in plan.scheduled if e.samples}
        r.update(plan, sampled)
    return r


@pytest.mark.parametrize("seed", range(12))
def test_no_false_alarms_on_gated_random_runs(seed: int) -> None:
    clean(random_gated_run(seed))
