"""The async-scheduling and speculative-decoding invariants
(invariants/inflight.py): each holds on transitions the spec makes and fires,
under its id, on a crafted transition that breaks it in one place; and the
whole catalogue stays silent on the spec over random workloads in all four
modes (sync, async, each with and without drafts)."""

from __future__ import annotations

import __future__
import dataclasses
import inspect
import random
import textwrap
from typing import Any, Callable

import pytest

from schedspec.invariants import BY_ID, CATALOGUE, Monitor, Transition
from schedspec.spec import RequestSpec, SchedulerConfig, SpecScheduler, StepPlan, StepResult
from schedspec.spec.interface import Policy, RequestStatus, SchedulerView

INFLIGHT_IDS = (
    "placeholders-match-in-flight",
    "within-max-model-len-with-lookahead",
    "preempted-carries-no-drafts",
    "drafts-bounded",
    "spec-tokens-in-budget",
    "in-flight-output-delivered-once",
    "verified-frontier",
)


def config(async_scheduling: bool = True, k: int = 2, **kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(
        block_size=4, num_blocks=17, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32,
        async_scheduling=async_scheduling, num_speculative_tokens=k,
    )
    base.update(kw)
    return SchedulerConfig(**base)


class Recorder:
    """Drives a SpecScheduler and keeps every transition it made, with the
    plans in flight after each, as the engine's driver builds them."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.s = SpecScheduler(cfg)
        self.log: list[Transition] = []

    def _op(self, kind: str, fn: Callable[[], Any], **kw: Any) -> Any:
        before = self.s.view()
        out = fn()
        plan = out if kind == "schedule" else kw.pop("plan", None)
        self.log.append(
            Transition(kind, before, self.s.view(), plan=plan, in_flight=self.s.in_flight, **kw)  # type: ignore[arg-type]
        )
        return out

    def add(self, rid: str, prompt: int, max_tokens: int = 10, **kw: Any) -> None:
        r = RequestSpec(rid, tuple(range(1, prompt + 1)), max_tokens, **kw)
        self._op("add", lambda: self.s.add(r), request=r)

    def schedule(self) -> StepPlan:
        plan: StepPlan = self._op("schedule", self.s.schedule)
        return plan

    def update(self, plan: StepPlan, sampled: dict[str, tuple[int, ...]],
               drafts: dict[str, tuple[int, ...]] | None = None) -> None:
        result = StepResult(sampled, drafts or {})
        self._op("update", lambda: self.s.update(plan, result), plan=plan, result=result)

    def reset(self, running: bool) -> None:
        self._op("reset", lambda: self.s.reset_prefix_cache(running))

    def last(self, kind: str) -> Transition:
        return next(t for t in reversed(self.log) if t.kind == kind)


def fires(inv_id: str, t: Transition) -> list[str]:
    return [v.message for v in BY_ID[inv_id].check(t)]


def with_request(v: SchedulerView, rid: str, **changes: Any) -> SchedulerView:
    reqs = dict(v.requests)
    reqs[rid] = dataclasses.replace(reqs[rid], **changes)
    return dataclasses.replace(v, requests=reqs)


def with_entry(plan: StepPlan, rid: str, **changes: Any) -> StepPlan:
    entries = tuple(dataclasses.replace(e, **changes) if e.request_id == rid else e for e in plan.scheduled)
    return dataclasses.replace(plan, scheduled=entries)


def async_two_in_flight() -> Recorder:
    """a decodes with two steps in flight (async, k = 2)."""
    r = Recorder(config())
    r.add("a", 5)
    p1 = r.schedule()  # prefill, samples
    r.schedule()  # a decode of 1 + 2 placeholder drafts, scheduled before p1's update
    r.update(p1, {"a": (7,)})
    return r


def test_the_catalogue_holds_every_inflight_invariant() -> None:
    ids = {inv.id for inv in CATALOGUE}
    assert set(INFLIGHT_IDS) <= ids
    for i in INFLIGHT_IDS:
        assert BY_ID[i].is_safety


# ---------------------------------------------------------------- placeholders


def test_placeholders_count_the_steps_in_flight() -> None:
    r = async_two_in_flight()
    t = r.last("schedule")
    a = t.after.requests["a"]
    # the prefill (1 token) and the decode (1 + 2 drafts) are in flight
    assert a.num_output_placeholders == 1 + 3 and a.spec_token_ids == (-1, -1)
    assert fires("placeholders-match-in-flight", t) == []
    u = r.last("update")
    assert u.after.requests["a"].num_output_placeholders == 3
    assert fires("placeholders-match-in-flight", u) == []


@pytest.mark.parametrize("bad", [-1, 2, 5])
def test_placeholders_fire_when_off_the_in_flight_tokens(bad: int) -> None:
    u = async_two_in_flight().last("update")
    t = dataclasses.replace(u, after=with_request(u.after, "a", num_output_placeholders=bad))
    found = fires("placeholders-match-in-flight", t)
    assert found and ("-1" in found[0] or "will produce 3" in found[0])


def test_placeholders_fire_without_async_scheduling() -> None:
    r = Recorder(config(async_scheduling=False))
    r.add("a", 5)
    t = r.last("add")
    bad = dataclasses.replace(t, after=with_request(t.after, "a", num_output_placeholders=1))
    assert fires("placeholders-match-in-flight", bad)


def test_a_preempted_request_with_a_step_in_flight_has_no_placeholders() -> None:
    r = Recorder(config(num_blocks=5, max_model_len=16, max_num_batched_tokens=16))
    r.add("a", 7, max_tokens=8)
    r.add("b", 7, max_tokens=8)
    p1 = r.schedule()  # both prefill and sample
    p2 = r.schedule()  # a's decode needs a block: b, with p1 in flight, is preempted
    assert p2.preempted_ids == ("b",)
    t = r.last("schedule")
    assert t.after.requests["b"].num_output_placeholders == 0
    r.update(p1, {"a": (9,), "b": (11,)})
    u = r.last("update")
    # b's output of p1 is stale: still delivered, its counters left alone
    assert u.after.requests["b"].output_token_ids == (11,)
    assert u.after.requests["b"].num_computed_tokens == 0
    assert all(fires(i, x) == [] for x in r.log for i in INFLIGHT_IDS)
    wrong = dataclasses.replace(t, after=with_request(t.after, "b", num_output_placeholders=1))
    assert "PREEMPTED with 1 output placeholders" in fires("placeholders-match-in-flight", wrong)[0]
    dropped = dataclasses.replace(u, after=with_request(u.after, "b", output_token_ids=(11, 11)))
    assert "stale output [11]" in fires("in-flight-output-delivered-once", dropped)[0]


# ---------------------------------------------------------------- max_model_len


def test_max_model_len_with_drafts_holds_and_fires() -> None:
    r = Recorder(config(async_scheduling=False, max_model_len=13))
    r.add("a", 8, max_tokens=20)
    p = r.schedule()
    r.update(p, {"a": (9,)}, {"a": (5, 6)})
    p = r.schedule()
    e = p.get("a")
    assert e is not None and len(e.spec_token_ids) == 2
    r.update(p, {"a": (5, 6, 7)}, {"a": (1, 2)})
    p = r.schedule()
    e = p.get("a")
    # 12 known tokens, 11 computed: the step ends at max_model_len - 1, so both drafts are cut
    assert e is not None and e.num_computed_tokens + e.num_scheduled_tokens == 12 and e.spec_token_ids == ()
    t = r.last("schedule")
    assert fires("within-max-model-len-with-lookahead", t) == []
    over = dataclasses.replace(t, plan=with_entry(p, "a", num_scheduled_tokens=2))
    assert "no slot for the sampled token" in fires("within-max-model-len-with-lookahead", over)[0]
    past = dataclasses.replace(t, after=with_request(t.after, "a", num_computed_tokens=13))
    assert fires("within-max-model-len-with-lookahead", past)
    blocks = dataclasses.replace(t, after=with_request(t.after, "a", block_ids=tuple(range(1, 6))))
    assert fires("within-max-model-len-with-lookahead", blocks)


# ---------------------------------------------------------------- drafts


def test_preemption_drops_drafts_and_a_preempted_request_with_drafts_fires() -> None:
    r = Recorder(config(async_scheduling=False))
    r.add("a", 5)
    p = r.schedule()
    r.update(p, {"a": (9,)}, {"a": (3, 4)})
    assert r.s.view().requests["a"].spec_token_ids == (3, 4)
    r.reset(True)
    t = r.last("reset")
    assert t.after.requests["a"].status == RequestStatus.PREEMPTED
    assert t.after.requests["a"].spec_token_ids == ()
    assert fires("preempted-carries-no-drafts", t) == []
    bad = dataclasses.replace(t, after=with_request(t.after, "a", spec_token_ids=(3, 4)))
    assert "PREEMPTED with drafts [3, 4]" in fires("preempted-carries-no-drafts", bad)[0]
    p = r.schedule()  # resumed: its drafts are gone, nothing of its past is verified
    assert p.get("a") is not None and p.get("a").spec_token_ids == ()  # type: ignore[union-attr]
    s = r.last("schedule")
    assert fires("preempted-carries-no-drafts", s) == []
    admitted_with_drafts = dataclasses.replace(s, plan=with_entry(p, "a", spec_token_ids=(3, 4)))
    assert fires("preempted-carries-no-drafts", admitted_with_drafts)


def test_drafts_bounded_fires_on_too_many_or_real_ids_under_async() -> None:
    r = async_two_in_flight()
    t = r.last("schedule")
    assert fires("drafts-bounded", t) == []
    too_many = dataclasses.replace(t, after=with_request(t.after, "a", spec_token_ids=(-1, -1, -1)))
    assert "num_speculative_tokens is 2" in fires("drafts-bounded", too_many)[0]
    ids = dataclasses.replace(t, after=with_request(t.after, "a", spec_token_ids=(4, 5)))
    assert "async scheduling" in fires("drafts-bounded", ids)[0]
    e = t.plan.get("a") if t.plan else None
    assert e is not None and e.spec_token_ids == (-1, -1)
    plan3 = dataclasses.replace(t, plan=with_entry(t.plan, "a", spec_token_ids=(-1, -1, -1)))  # type: ignore[arg-type]
    assert fires("drafts-bounded", plan3)


def test_drafts_bounded_fires_when_an_entry_verifies_drafts_the_request_did_not_hold() -> None:
    r = Recorder(config(async_scheduling=False))
    r.add("a", 5)
    p = r.schedule()
    r.update(p, {"a": (9,)}, {"a": (3, 4)})
    p = r.schedule()
    t = r.last("schedule")
    assert p.get("a").spec_token_ids == (3, 4)  # type: ignore[union-attr]
    assert fires("drafts-bounded", t) == []
    other = dataclasses.replace(t, plan=with_entry(p, "a", spec_token_ids=(4, 3)))
    assert "the request held [3, 4]" in fires("drafts-bounded", other)[0]


def test_spec_tokens_count_in_the_budget() -> None:
    r = Recorder(config(async_scheduling=False))
    r.add("a", 5)
    p = r.schedule()
    r.update(p, {"a": (9,)}, {"a": (3, 4)})
    p = r.schedule()
    t = r.last("schedule")
    e = p.get("a")
    assert e is not None and e.num_scheduled_tokens == 3  # the last token and both drafts
    assert fires("spec-tokens-in-budget", t) == []
    # drafts counted outside the scheduled tokens
    cheat = dataclasses.replace(t, plan=with_entry(p, "a", num_scheduled_tokens=1))
    assert "should end at" in fires("spec-tokens-in-budget", cheat)[0]
    small = dataclasses.replace(t, before=dataclasses.replace(
        t.before, config=config(async_scheduling=False, max_num_batched_tokens=4, max_num_seqs=4)))
    assert fires("spec-tokens-in-budget", dataclasses.replace(small, plan=with_entry(p, "a", num_scheduled_tokens=5, num_computed_tokens=3)))


# ---------------------------------------------------------------- tokens


def test_output_delivered_once_holds_and_fires_on_loss_and_duplication() -> None:
    r = async_two_in_flight()
    u = r.last("update")
    assert u.after.requests["a"].output_token_ids == (7,)
    assert fires("in-flight-output-delivered-once", u) == []
    lost = dataclasses.replace(u, after=with_request(u.after, "a", output_token_ids=()))
    assert "want [7]" in fires("in-flight-output-delivered-once", lost)[0]
    doubled = dataclasses.replace(u, after=with_request(u.after, "a", output_token_ids=(7, 7)))
    assert fires("in-flight-output-delivered-once", doubled)


def test_stale_output_of_a_reset_preemption_is_dropped_and_delivering_it_fires() -> None:
    r = Recorder(config())
    r.add("a", 5)
    p1 = r.schedule()
    r.update(p1, {"a": (9,)})
    p2 = r.schedule()  # a decode in flight
    r.reset(True)  # a is preempted, its in-flight output dropped
    p3 = r.schedule()  # and re-admitted at once: it recomputes everything it knows
    assert p3.get("a") is not None and p3.get("a").kind.value == "resumed"  # type: ignore[union-attr]
    r.update(p2, {"a": (11, 12)})
    u = r.last("update")
    assert u.after.requests["a"].output_token_ids == (9,)
    assert all(fires(i, u) == [] for i in INFLIGHT_IDS)
    dup = dataclasses.replace(u, after=with_request(u.after, "a", output_token_ids=(9, 11)))
    assert "re-admitted since" in fires("in-flight-output-delivered-once", dup)[0]


def test_inflight_invariants_fire_in_the_monitor_under_their_ids() -> None:
    u = async_two_in_flight().last("update")
    bad = dataclasses.replace(u, after=with_request(u.after, "a", num_output_placeholders=-2))
    ids = {v.invariant_id for v in Monitor([BY_ID[i] for i in INFLIGHT_IDS]).observe(bad)}
    assert "placeholders-match-in-flight" in ids


def test_verified_frontier_holds_and_fires_when_rejected_drafts_stay_computed() -> None:
    r = Recorder(config(async_scheduling=False))
    r.add("a", 5)
    p = r.schedule()
    r.update(p, {"a": (9,)}, {"a": (3, 4)})
    p = r.schedule()
    r.update(p, {"a": (3, 8)})  # one draft accepted, one rejected
    u = r.last("update")
    a = u.after.requests["a"]
    assert (a.num_computed_tokens, a.num_tokens) == (7, 8)
    assert fires("verified-frontier", u) == []
    kept = dataclasses.replace(u, after=with_request(u.after, "a", num_computed_tokens=8))
    assert "frontier is 8, want 7" in fires("verified-frontier", kept)[0]


def test_verified_frontier_counts_the_placeholders_of_the_next_step() -> None:
    u = async_two_in_flight().last("update")
    a = u.after.requests["a"]
    assert a.num_computed_tokens - a.num_output_placeholders == a.num_tokens - 1
    assert fires("verified-frontier", u) == []
    off = dataclasses.replace(u, after=with_request(u.after, "a", num_output_placeholders=2))
    assert fires("verified-frontier", off)


# ---------------------------------------------------------------- real bug classes


def mutant(*edits: tuple[Callable[..., Any], str, str]) -> type[SpecScheduler]:
    """A SpecScheduler whose methods are recompiled from the spec's own
    source with one textual change each (the text must occur exactly once)."""
    methods: dict[str, Any] = {}
    for func, old, new in edits:
        src = inspect.getsource(func)
        assert src.count(old) == 1, (func.__qualname__, old)
        src = textwrap.dedent(src.replace(old, new))
        namespace: dict[str, Any] = {}
        code = compile(src, f"<mutant of {func.__qualname__}>", "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, func.__globals__, namespace)  # noqa: S102 - the spec's own source, one edit
        methods[func.__name__] = namespace[func.__name__]
    return type("Mutant", (SpecScheduler,), methods)


def violations(cls: type[SpecScheduler], drive: Callable[[Recorder], None], cfg: SchedulerConfig) -> set[str]:
    r = Recorder(cfg)
    r.s = cls(cfg)
    drive(r)
    mon = Monitor()
    return {v.invariant_id for t in r.log for v in mon.observe(t)}


def reset_with_drafts(r: Recorder) -> None:
    r.add("a", 5)
    p = r.schedule()
    r.update(p, {"a": (9,)}, {"a": (3, 4)})
    r.reset(True)
    r.schedule()


def preempt_in_flight(r: Recorder) -> None:
    r.add("a", 7, max_tokens=8)
    r.add("b", 7, max_tokens=8)
    p1 = r.schedule()
    p2 = r.schedule()
    r.update(p1, {"a": (9,), "b": (11,)})
    r.update(p2, {"a": (12,)})


def readmit_after_reset_in_flight(r: Recorder) -> None:
    r.add("a", 5)
    p1 = r.schedule()
    r.update(p1, {"a": (9,)})
    p2 = r.schedule()
    r.reset(True)
    p3 = r.schedule()
    r.update(p2, {"a": (11, 12)})
    r.update(p3, {"a": (13,)})


def rejected_drafts(r: Recorder) -> None:
    r.add("a", 5)
    p = r.schedule()
    r.update(p, {"a": (9,)}, {"a": (3, 4)})
    p = r.schedule()
    r.update(p, {"a": (7,)})


def padded_near_max_model_len(r: Recorder) -> None:
    r.add("a", 9, max_tokens=1)
    r.update(r.schedule(), {"a": (9,)})
    r.add("b", 9, max_tokens=1)  # its first 8 tokens hit: one token to compute
    r.schedule()


S = SpecScheduler
BUGS = [
    # PR #31955: spec tokens kept across preemption
    ("keep-drafts-on-preemption", (S._preempt_request, "        req.spec_token_ids = []\n", ""),
     reset_with_drafts, config(async_scheduling=False), "preempted-carries-no-drafts"),
    # PRs #38624, #47900: placeholders not reset by a preemption with a step in flight
    ("keep-placeholders-on-preemption", (S._preempt_request, "        req.num_output_placeholders = 0\n", ""),
     preempt_in_flight, config(num_blocks=5, max_model_len=16, max_num_batched_tokens=16),
     "placeholders-match-in-flight"),
    # PR #28787 class: stale output delivered to a request that recomputes its positions
    ("deliver-dropped-stale-output", (S.update, "if stale and req.drop_stale_output:", "if False:"),
     readmit_after_reset_in_flight, config(), "in-flight-output-delivered-once"),
    # rejected drafts left counted as computed
    ("no-rollback-of-rejected-drafts", (S._roll_back_rejected, "        if stale:\n", "        if True:\n"),
     rejected_drafts, config(async_scheduling=False), "verified-frontier"),
    # PRs #53812, #53962: padding past max_model_len
    ("pad-past-max-model-len", (S._admission_tokens, "max_model_len=cfg.max_model_len,", "max_model_len=cfg.max_model_len + 8,"),
     padded_near_max_model_len, config(async_scheduling=False, max_model_len=11),
     "within-max-model-len-with-lookahead"),
]


@pytest.mark.parametrize("name,edit,drive,cfg,caught_by", BUGS, ids=[b[0] for b in BUGS])
def test_a_real_bug_class_is_caught(name: str, edit: tuple[Callable[..., Any], str, str],
                                    drive: Callable[[Recorder], None], cfg: SchedulerConfig, caught_by: str) -> None:
    assert caught_by not in violations(SpecScheduler, drive, cfg)
    assert caught_by in violations(mutant(edit), drive, cfg)


# ---------------------------------------------------------------- no false positives


def run_random(seed: int, async_scheduling: bool, k: int, steps: int = 160) -> tuple[list[str], int]:
    rng = random.Random(seed)
    cfg = config(
        async_scheduling=async_scheduling, k=k,
        num_blocks=rng.choice([9, 13, 20]), max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_num_seqs=rng.choice([2, 4]), long_prefill_token_threshold=rng.choice([0, 6]),
        enable_prefix_caching=rng.random() < 0.7, policy=rng.choice(list(Policy)),
    )
    r = Recorder(cfg)
    mon = Monitor()
    tok, n, seen = 100, 0, 0
    queue: list[StepPlan] = []
    for _ in range(steps):
        x = rng.random()
        if x < 0.15:
            n += 1
            r.add(f"r{n}", rng.randint(1, 18), rng.randint(1, 20), eos_token_id=3, stop_token_ids=(2,))
        elif x < 0.18 and r.s.requests:
            rid = rng.choice(sorted(r.s.requests))
            r._op("abort", lambda: r.s.abort(rid), request_id=rid)
        elif x < 0.2 and len(queue) < 2:
            r.reset(rng.random() < 0.5)
        else:
            queue.append(r.schedule())
            if async_scheduling and len(queue) < 2:
                continue
            p = queue.pop(0)
            sampled, drafts = {}, {}
            for e in p.scheduled:
                if e.samples:
                    a = rng.choice([0, len(e.spec_token_ids), rng.randint(0, len(e.spec_token_ids))])
                    toks = []
                    for _ in range(a + 1):
                        tok += 1
                        toks.append(rng.choice([2, 3]) if rng.random() < 0.04 else tok % 40 + 5)
                    sampled[e.request_id] = tuple(toks)
                    if k:
                        drafts[e.request_id] = tuple(rng.randrange(50) for _ in range(rng.randint(0, k)))
            r.update(p, sampled, drafts)
    found = []
    for t in r.log:
        found += [str(v) for v in mon.observe(t)]
        seen += t.kind == "update"
    return found, seen


@pytest.mark.parametrize("async_scheduling,k", [(False, 0), (False, 2), (True, 0), (True, 3)])
@pytest.mark.parametrize("seed", range(6))
def test_no_false_positives_on_the_spec_in_every_mode(seed: int, async_scheduling: bool, k: int) -> None:
    found, updates = run_random(seed, async_scheduling, k)
    assert found == []
    assert updates > 20
