"""Write vectors/spec/: one trace per named behaviour of the spec.

    python -m tests.vectors.generate           # (re)write vectors/spec/*.jsonl
    python -m tests.vectors.generate --check   # exit 1 if a file differs from what it would write

Each scenario below is a situation of the spec's scenario tests
(tests/spec/test_scheduler.py) as a workload: a config and events (add, step,
abort, reset_prefix_cache). The generator runs it on the spec with the fake
model and every invariant, asserts the behaviour it is named for on that run
(so a vector that stopped showing its behaviour is not written), and writes it
through the trace writer (schedspec.check.trace) behind a comment block that
says what the behaviour is, which vLLM 0.33 code it captures, and what the
spec plans at every step. Tokens come from the fake model (its ``vocab`` and
``oracle_seed`` are in the header), so a vector replays the same against any
scheduler. tests/vectors/test_vectors.py regenerates every vector and compares
it with the file, so the corpus cannot drift from the spec.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from schedspec.check import trace as tracefile
from schedspec.check.driver import Runner
from schedspec.check.records import StepRecord
from schedspec.check.workload import Abort, AddRequest, Event, ResetPrefixCache, Schedule, Step, Update, Workload
from schedspec.spec import Policy, RequestStatus, ScheduleKind, SchedulerConfig, SpecScheduler, StepPlan
from schedspec.spec.interface import ScheduledRequest

from tests.helpers import cfg, entries, req

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "vectors" / "spec"

Check = Callable[[list[StepRecord]], None]


@dataclass(frozen=True)
class Scenario:
    name: str  # the file stem: the behaviour, as a phrase
    behaviour: str  # one or two sentences
    vllm: str  # the vLLM 0.33 file and function it captures
    config: SchedulerConfig
    events: tuple[Event, ...]
    check: Check
    vocab: int = 64
    oracle_seed: int = 0
    notes: tuple[str, ...] = field(default=())


SCENARIOS: list[Scenario] = []


def scenario(name: str, behaviour: str, vllm: str, config: SchedulerConfig, events: Sequence[Event],
             vocab: int = 64, oracle_seed: int = 0) -> Callable[[Check], Check]:
    def register(check: Check) -> Check:
        SCENARIOS.append(Scenario(name, behaviour, vllm, config, tuple(events), check, vocab, oracle_seed))
        return check

    return register


def add(*args: object, **kw: object) -> AddRequest:
    return AddRequest(req(*args, **kw))  # type: ignore[arg-type]


S = Step()
SCHEDULER = "vllm/v1/core/sched/scheduler.py Scheduler.schedule"
POOL = "vllm/v1/core/block_pool.py"
MANAGER = "vllm/v1/core/kv_cache_manager.py"


# ---------------------------------------------------------------- the KV pool


@scenario("free-queue-starts-in-id-order-without-block-zero",
          "Block 0 is the reserved null block; the free queue starts as blocks 1..n-1 in id order and "
          "allocation pops its head.",
          f"{POOL} BlockPool.__init__, get_new_blocks", cfg(), [add("a", 5), S])
def _(r: list[StepRecord]) -> None:
    assert r[0].plan.scheduled[0].block_ids == (1, 2)


@scenario("freed-blocks-go-tail-first-unkeyed-to-the-front-keyed-to-the-back",
          "A finished request's table is freed tail first; blocks without a prefix-cache key go to the head "
          "of the free queue (reused first), keyed blocks to its tail (evicted last).",
          f"{POOL} BlockPool.free_blocks; {MANAGER} KVCacheManager.free", cfg(), [add("a", 10, max_tokens=1), S, S])
def _(r: list[StepRecord]) -> None:
    assert r[0].plan.scheduled[0].block_ids == (1, 2, 3)
    assert r[0].view_after.kv.free_queue == (3, 4, 5, 6, 7, 8, 2, 1)


@scenario("freed-blocks-all-go-to-the-front-without-prefix-caching",
          "Without prefix caching no block has a key: a freed table goes, tail first, to the head of the "
          "free queue.",
          f"{POOL} BlockPool.free_blocks", cfg(enable_prefix_caching=False), [add("a", 10, max_tokens=1), S])
def _(r: list[StepRecord]) -> None:
    assert r[0].view_after.kv.free_queue == (3, 2, 1, 4, 5, 6, 7, 8)
    assert dict(r[0].view_after.kv.block_keys) == {}


@scenario("prefix-hit-is-capped-below-num-tokens",
          "A prefix hit covers at most num_tokens - 1 tokens: the same 8-token prompt again reuses only its "
          "first block and recomputes the last one, so there is a token to sample from.",
          f"{MANAGER} KVCacheManager.get_computed_blocks",
          cfg(), [add("a", 8, max_tokens=1), S, add("b", 8, max_tokens=1), S])
def _(r: list[StepRecord]) -> None:
    (e,) = r[1].plan.scheduled
    assert (e.kind, e.num_computed_tokens, e.num_scheduled_tokens) == (ScheduleKind.NEW, 4, 4)
    assert e.block_ids[0] == 1 and e.token_ids == (4, 5, 6, 7)


@scenario("prefix-hit-takes-its-blocks-out-of-the-free-queue",
          "Hit blocks sitting in the free queue are touched: taken out of it, their reference count raised.",
          f"{POOL} BlockPool.touch",
          cfg(), [add("a", 9, max_tokens=1), S, add("b", list(range(8)) + [99]), S])
def _(r: list[StepRecord]) -> None:
    assert {1, 2} <= set(r[0].view_after.kv.free_queue)
    assert r[1].plan.scheduled[0].block_ids[:2] == (1, 2)
    kv = r[1].view_after.kv
    assert 1 not in kv.free_queue and 2 not in kv.free_queue and kv.ref_cnt[1] == kv.ref_cnt[2] == 1


@scenario("cache-salt-separates-prefix-cache-entries",
          "Requests with different cache salts never share cached blocks, however equal their prompts.",
          "vllm/v1/core/kv_cache_utils.py hash_block_tokens (extra keys)",
          cfg(), [add("a", 9, max_tokens=1, cache_salt="x"), S, add("b", 9, max_tokens=1), S])
def _(r: list[StepRecord]) -> None:
    assert r[1].plan.scheduled[0].num_computed_tokens == 0


@scenario("blocks-are-cached-at-allocation-so-a-same-step-admission-hits-them",
          "allocate_slots caches the full blocks of the tokens it allocates for before the step runs: a "
          "second identical prompt admitted in the same step hits them.",
          f"{MANAGER} KVCacheManager.allocate_slots", cfg(), [add("a", 9, max_tokens=2), add("b", 9, max_tokens=2), S])
def _(r: list[StepRecord]) -> None:
    assert entries(r[0].plan) == [("a", "new", 0, 9), ("b", "new", 8, 1)]
    assert r[0].plan.scheduled[1].block_ids[:2] == r[0].plan.scheduled[0].block_ids[:2]


@scenario("allocation-evicts-cached-blocks-from-the-head-of-the-free-queue",
          "A request that needs the whole pool takes every free block, evicting the cached ones (their keys "
          "are dropped as they are reused).",
          f"{POOL} BlockPool.get_new_blocks, _maybe_evict_cached_block",
          cfg(), [add("a", 9, max_tokens=1), S, add("big", [50] * 31, max_tokens=1), S])
def _(r: list[StepRecord]) -> None:
    assert set(r[0].view_after.kv.block_keys) == {1, 2}
    assert sorted(r[1].plan.scheduled[0].block_ids) == list(range(1, 9))
    assert len(r[1].view_after.kv.block_keys) == 7  # big's seven full blocks, a's keys gone


# ---------------------------------------------------------------- schedule()


@scenario("running-requests-first-then-waiting-under-the-token-budget",
          "Each step serves the running queue first, then admits waiting requests with what is left of the "
          "token budget; a prompt longer than the budget is chunked.",
          SCHEDULER, cfg(max_num_batched_tokens=8, long_prefill_token_threshold=0), [add("a", 10), add("b", 3), S, S])
def _(r: list[StepRecord]) -> None:
    assert entries(r[0].plan) == [("a", "new", 0, 8)]
    assert entries(r[1].plan) == [("a", "running", 8, 2), ("b", "new", 0, 3)]


@scenario("long-prefill-threshold-cuts-chunks-beside-other-requests",
          "With company, a prefill chunk is cut to long_prefill_token_threshold tokens.",
          SCHEDULER, cfg(long_prefill_token_threshold=3), [add("a", 10), add("b", 10), S])
def _(r: list[StepRecord]) -> None:
    assert entries(r[0].plan) == [("a", "new", 0, 3), ("b", "new", 0, 3)]


@scenario("long-prefill-threshold-spares-a-lone-request",
          "A request alone in the scheduler is not cut by the long-prefill threshold: there is nobody to "
          "protect.",
          SCHEDULER, cfg(long_prefill_token_threshold=3), [add("a", 10), S])
def _(r: list[StepRecord]) -> None:
    assert entries(r[0].plan) == [("a", "new", 0, 10)]


@scenario("chunked-prefill-off-admission-stops-at-a-prompt-over-the-budget",
          "With chunked prefill off, a prompt that does not fit what is left of the budget waits, and the "
          "waiting loop stops there: the requests behind it are not tried.",
          SCHEDULER, cfg(enable_chunked_prefill=False, max_num_batched_tokens=32),
          [add("a", 20), add("b", [5] * 20), add("c", [6] * 2), S])
def _(r: list[StepRecord]) -> None:
    assert entries(r[0].plan) == [("a", "new", 0, 20)]


@scenario("max-num-seqs-limits-admission",
          "No more than max_num_seqs requests run at once.",
          SCHEDULER, cfg(max_num_seqs=2), [add("a", 2), add("b", 2), add("c", 2), S])
def _(r: list[StepRecord]) -> None:
    assert r[0].plan.scheduled_ids == ("a", "b")


@scenario("admission-waits-until-the-whole-sequence-fits-with-reserve-full-isl",
          "With scheduler_reserve_full_isl, a request is admitted only when the pool can hold its whole "
          "prompt, not just its first chunk.",
          SCHEDULER,
          cfg(max_num_batched_tokens=8, long_prefill_token_threshold=4, scheduler_reserve_full_isl=True),
          [add("a", 16, max_tokens=10), add("x", [9] * 4, max_tokens=10), S, add("b", [5] * 28), S])
def _(r: list[StepRecord]) -> None:
    assert "b" not in r[1].plan.scheduled_ids


@scenario("fcfs-preempts-the-last-running-and-puts-it-in-front",
          "FCFS: when a running request needs a block and none is free, the last running request is "
          "preempted (recomputed later), freed, and put at the head of the waiting queue, keeping its outputs.",
          f"{SCHEDULER} (running loop), _preempt_request", cfg(num_blocks=5, max_model_len=16),
          [add("a", 4, max_tokens=10), add("b", [9] * 4, max_tokens=10), add("c", [8] * 3, max_tokens=10), S, S])
def _(r: list[StepRecord]) -> None:
    p, v = r[1].plan, r[1].view_after
    assert p.preempted_ids == ("c",) and p.scheduled_ids == ("a", "b")
    c = v.requests["c"]
    assert v.waiting[0] == "c" and c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.block_ids == () and len(c.output_token_ids) == 1


@scenario("no-admission-in-a-step-that-preempted",
          "A step that preempted a running request admits nobody from the waiting queue.",
          SCHEDULER, cfg(num_blocks=5, max_model_len=16),
          [add("a", 4, max_tokens=10), add("b", [9] * 4, max_tokens=10), add("c", [8] * 3, max_tokens=10), S,
           add("d", 1), S])
def _(r: list[StepRecord]) -> None:
    assert r[1].plan.preempted_ids == ("c",) and "d" not in r[1].plan.scheduled_ids


@scenario("preempted-request-resumes-with-its-outputs-recomputed",
          "A preempted request comes back as resumed: its prompt and every output so far are recomputed "
          "from token 0.",
          SCHEDULER, cfg(num_blocks=5, max_model_len=16),
          [add("a", 4, max_tokens=3), add("b", [9] * 4, max_tokens=10), add("c", [8] * 3, max_tokens=10)]
          + [S] * 6)
def _(r: list[StepRecord]) -> None:
    resumed = [e for rec in r for e in rec.plan.scheduled if e.request_id == "c" and e.kind == ScheduleKind.RESUMED]
    assert resumed
    e = resumed[0]
    assert e.num_computed_tokens == 0 and e.num_scheduled_tokens == e.num_tokens and e.token_ids[:3] == (8, 8, 8)


@scenario("priority-victim-is-the-greatest-priority-then-arrival-and-gives-its-budget-back",
          "PRIORITY: the victim is the running request with the greatest (priority, arrival); a victim "
          "already scheduled in this step leaves the plan and its tokens return to the budget.",
          f"{SCHEDULER} (running loop)", cfg(num_blocks=5, max_model_len=16, policy=Policy.PRIORITY),
          [add("low", [1] * 4, max_tokens=10, priority=5, arrival=0), S,
           add("hi", [2] * 8, max_tokens=10, priority=0, arrival=1), S, S])
def _(r: list[StepRecord]) -> None:
    assert entries(r[1].plan) == [("low", "running", 4, 1), ("hi", "new", 0, 8)]
    assert r[2].plan.preempted_ids == ("low",) and entries(r[2].plan) == [("hi", "running", 8, 1)]
    assert r[2].view_after.running == ("hi",)


@scenario("priority-waiting-order-is-priority-then-arrival-then-id",
          "PRIORITY: the waiting queue is served by (priority, arrival, request id).",
          "vllm/v1/core/sched/request_queue.py PriorityRequestQueue", cfg(policy=Policy.PRIORITY, max_num_seqs=1),
          [add("b", 2, priority=1, arrival=5), add("z", 2, priority=0, arrival=7), add("a", 2, priority=1, arrival=5),
           S])
def _(r: list[StepRecord]) -> None:
    assert r[0].plan.scheduled_ids == ("z",) and r[0].view_after.waiting == ("a", "b")


# ---------------------------------------------------------------- update(): stopping


@scenario("stop-token-stops-a-request-even-with-ignore-eos",
          "A sampled token in stop_token_ids finishes the request as stopped, ignore_eos or not; a request "
          "without stop tokens runs on to max_tokens.",
          "vllm/v1/core/sched/utils.py check_stop", cfg(),
          [add("a", 3, max_tokens=5, stop_token_ids=(0, 1), ignore_eos=True), add("b", 3, max_tokens=3), S, S, S, S],
          vocab=2)
def _(r: list[StepRecord]) -> None:
    a = r[0].view_after.finished["a"]
    assert a.status == RequestStatus.FINISHED_STOPPED and len(a.output_token_ids) == 1
    b = r[2].view_after.finished["b"]
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(b.output_token_ids) == 3


@scenario("eos-stops-a-request-unless-ignore-eos",
          "The eos token finishes a request as stopped; with ignore_eos it is an ordinary token and the "
          "request runs to max_tokens.",
          "vllm/v1/core/sched/utils.py check_stop", cfg(),
          [add("a", 3, max_tokens=6, eos_token_id=1), add("b", 3, max_tokens=6, eos_token_id=1, ignore_eos=True)]
          + [S] * 7, vocab=2, oracle_seed=1)
def _(r: list[StepRecord]) -> None:
    done = {rid: rv for rec in r for rid, rv in rec.view_after.finished.items()}
    assert done["a"].status == RequestStatus.FINISHED_STOPPED and done["a"].output_token_ids[-1] == 1
    assert done["b"].status == RequestStatus.FINISHED_LENGTH_CAPPED and 1 in done["b"].output_token_ids[:-1]
    assert len(done["b"].output_token_ids) == 6


@scenario("max-model-len-caps-the-length-of-a-request",
          "A request stops, length-capped, when prompt and outputs reach max_model_len, whatever its "
          "max_tokens.",
          "vllm/v1/core/sched/utils.py check_stop", cfg(max_model_len=8), [add("a", 6, max_tokens=100), S, S])
def _(r: list[StepRecord]) -> None:
    fin = r[1].view_after.finished["a"]
    assert fin.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(fin.spec.prompt_token_ids + fin.output_token_ids) == 8


@scenario("partial-prefill-chunk-samples-nothing-and-finished-is-reported-once",
          "A chunk that does not reach the end of the prompt samples no token; a finished request is "
          "reported in exactly one plan's finished ids.",
          SCHEDULER, cfg(max_num_batched_tokens=8, max_num_seqs=4), [add("a", 12, max_tokens=1), S, S, S, S])
def _(r: list[StepRecord]) -> None:
    assert r[0].plan.scheduled[0].is_prefill_chunk
    assert [rec.plan.finished_ids for rec in r[1:]] == [(), ("a",), ()]


# ---------------------------------------------------------------- abort, reset_prefix_cache


@scenario("abort-in-every-state-frees-every-block",
          "Aborting a waiting, a preempted and a running request frees every block they held; each is "
          "reported finished as aborted.",
          "vllm/v1/core/sched/scheduler.py Scheduler.finish_requests", cfg(num_blocks=5, max_model_len=16),
          [add("a", 4, max_tokens=10), add("b", [9] * 4, max_tokens=10), add("c", [8] * 3, max_tokens=10),
           add("w", [6] * 15, max_tokens=10), S, S, Abort("c"), Abort("w"), Abort("a"), Abort("b"), S])
def _(r: list[StepRecord]) -> None:
    assert r[1].view_after.requests["c"].status == RequestStatus.PREEMPTED
    assert sorted(r[2].plan.finished_ids) == ["a", "b", "c", "w"]
    assert r[2].view_after.kv.num_free_blocks == 4 and not r[2].view_after.requests


@scenario("reset-prefix-cache-is-refused-while-blocks-are-held",
          "reset_prefix_cache() does nothing while a request holds cached blocks; with "
          "reset_running_requests it preempts every running request first, then drops every key.",
          f"{POOL} BlockPool.reset_prefix_cache; vllm/v1/core/sched/scheduler.py Scheduler.reset_prefix_cache",
          cfg(), [add("a", 9, max_tokens=5), S, ResetPrefixCache(False), S, ResetPrefixCache(True), S])
def _(r: list[StepRecord]) -> None:
    assert r[1].view_after.kv.block_keys and r[1].plan.preempted_ids == ()
    assert r[2].plan.preempted_ids == ("a",)
    assert r[2].plan.scheduled[0].kind == ScheduleKind.RESUMED


@scenario("reset-prefix-cache-drops-every-key-when-nothing-is-held",
          "With no request holding a block, reset_prefix_cache() drops every prefix-cache key: the same "
          "prompt again hits nothing.",
          f"{POOL} BlockPool.reset_prefix_cache",
          cfg(), [add("a", 9, max_tokens=1), S, ResetPrefixCache(False), add("b", 9, max_tokens=1), S])
def _(r: list[StepRecord]) -> None:
    assert r[0].view_after.kv.block_keys
    assert r[1].plan.scheduled[0].num_computed_tokens == 0


# ---------------------------------------------------------------- async scheduling, speculative decoding

ASYNC_SCHEDULER = "vllm/v1/core/sched/async_scheduler.py AsyncScheduler._update_after_schedule"
ENGINE = "vllm/v1/engine/core.py EngineCore.step_with_batch_queue"
UPDATE = "vllm/v1/core/sched/scheduler.py Scheduler.update_from_output"


def _entry_of(rec: StepRecord, rid: str) -> ScheduledRequest:
    entry = rec.plan.get(rid)
    assert entry is not None, (rec.step, rid)
    return entry


@scenario("async-plans-the-next-step-with-the-output-in-flight-as-a-placeholder",
          "With async scheduling the engine schedules step N+1 before it updates step N: a decoding "
          "request's next entry computes a -1 placeholder for the token still in flight, counted in "
          "num_computed_tokens.",
          f"{ENGINE}; {ASYNC_SCHEDULER}", cfg(async_scheduling=True), [add("a", 5, max_tokens=4), S, S, S])
def _(r: list[StepRecord]) -> None:
    assert [rec.in_flight for rec in r] == [(1,), (1, 2), (2, 3)]
    second = _entry_of(r[1], "a")
    assert second.num_output_placeholders == 1 and second.token_ids == (-1,) and second.num_computed_tokens == 5
    assert r[2].view_after.requests["a"].output_token_ids == r[0].result.sampled["a"] + r[1].result.sampled["a"]  # type: ignore[union-attr]


@scenario("async-abort-between-schedule-and-update-drops-the-in-flight-output",
          "An abort that arrives between the schedule of step N+1 and the update of step N (the engine "
          "processes aborts right before update_from_output) finishes the request; the outputs of its "
          "steps still in flight are dropped.",
          f"{ENGINE}; {UPDATE}", cfg(async_scheduling=True),
          [add("a", 5, max_tokens=8), add("b", 3, max_tokens=8), S, Schedule(), Abort("a"), Update(step=1), S, S])
def _(r: list[StepRecord]) -> None:
    assert r[1].in_flight == (1, 2) and r[1].plan.get("a") is not None
    assert r[1].view_after.finished["a"].status == RequestStatus.FINISHED_ABORTED
    assert r[1].view_after.finished["a"].output_token_ids == ()
    assert r[2].plan.finished_ids == ("a",) and r[2].plan.get("a") is None


@scenario("spec-decode-accepted-drafts-then-the-bonus-token",
          "With speculative decoding a decode verifies the drafts proposed after the previous step; "
          "every accepted draft and the bonus token join the output, and num_computed_tokens covers "
          "them all.",
          f"{SCHEDULER}; {UPDATE}", cfg(num_speculative_tokens=2), [add("a", 5, max_tokens=8), S, S, S],
          oracle_seed=0)
def _(r: list[StepRecord]) -> None:
    second = _entry_of(r[1], "a")
    assert len(second.spec_token_ids) == 2 and -1 not in second.spec_token_ids
    assert r[1].result is not None and r[1].result.sampled["a"] == second.spec_token_ids + r[1].result.sampled["a"][2:]
    assert len(r[1].result.sampled["a"]) == 3
    assert _entry_of(r[2], "a").num_computed_tokens == 5 + 3


@scenario("spec-decode-rejected-drafts-roll-back-computed-tokens",
          "Drafts the model rejects do not count as computed: after a step whose drafts were all "
          "rejected, the request computes again from the position after its bonus token.",
          UPDATE, cfg(num_speculative_tokens=2), [add("a", 5, max_tokens=6), S, S, S], oracle_seed=1)
def _(r: list[StepRecord]) -> None:
    second = _entry_of(r[1], "a")
    assert len(second.spec_token_ids) == 2 and second.num_scheduled_tokens == 3
    assert r[1].result is not None and len(r[1].result.sampled["a"]) == 1
    assert _entry_of(r[2], "a").num_computed_tokens == 6


@scenario("async-spec-decode-schedules-placeholder-drafts",
          "With async scheduling and speculative decoding the scheduler never sees the drafts: it "
          "schedules -1 placeholders for them and for the tokens in flight, and the rejected ones roll "
          "back num_computed_tokens and the placeholders at the update.",
          f"{ASYNC_SCHEDULER}; {UPDATE}", cfg(async_scheduling=True, num_speculative_tokens=2),
          [add("a", 5, max_tokens=10), S, S, S, S], oracle_seed=2)
def _(r: list[StepRecord]) -> None:
    second = _entry_of(r[1], "a")
    assert second.spec_token_ids == (-1, -1) and second.num_output_placeholders == 1
    assert set(_entry_of(r[2], "a").token_ids) == {-1} and _entry_of(r[2], "a").num_output_placeholders == 3


@scenario("reset-prefix-cache-with-a-step-in-flight-drops-its-output",
          "reset_prefix_cache(reset_running_requests=True) with a step in flight preempts the running "
          "requests and drops their in-flight output (it would arrive after their recomputation): the "
          "request resumes from the tokens it had, and computes the dropped position again.",
          "vllm/v1/core/sched/scheduler.py Scheduler.reset_prefix_cache, Scheduler._preempt_request",
          cfg(async_scheduling=True), [add("a", 5, max_tokens=6), S, S, ResetPrefixCache(True), S, S])
def _(r: list[StepRecord]) -> None:
    assert r[2].plan.preempted_ids == ("a",)
    resumed = _entry_of(r[2], "a")
    assert resumed.kind == ScheduleKind.RESUMED and resumed.num_output_placeholders == 0
    assert resumed.num_tokens == 6  # the prompt and step 1's token; step 2's was dropped


# ---------------------------------------------------------------- writing


def run_on_spec(s: Scenario) -> list[StepRecord]:
    runner = Runner(s.config, {"spec": SpecScheduler}, vocab=s.vocab, oracle_seed=s.oracle_seed, keep_history=True)
    failure = runner.run(s.events)
    assert failure is None, f"{s.name}: {failure.describe()}"
    assert runner.history is not None
    return runner.history


def _flight(e: ScheduledRequest) -> str:
    """`` ~p`` for p placeholders in flight, `` drafts [..]`` for the drafts verified."""
    text = f" ~{e.num_output_placeholders}" if e.num_output_placeholders else ""
    if e.spec_token_ids:
        text += f" drafts [{' '.join(map(str, e.spec_token_ids))}]"
    return text


def describe_plan(plan: StepPlan) -> str:
    parts = [f"{e.request_id} {e.kind.value} {e.num_computed_tokens}+{e.num_scheduled_tokens}{_flight(e)} "
             f"blocks [{' '.join(map(str, e.block_ids))}]" for e in plan.scheduled]
    text = ", ".join(parts) or "nothing scheduled"
    if plan.preempted_ids:
        text += "; preempted " + " ".join(plan.preempted_ids)
    if plan.finished_ids:
        text += "; finished " + " ".join(plan.finished_ids)
    return text


def render(s: Scenario) -> str:
    """The vector's text: the comment block, then the trace as the trace writer writes it."""
    records = run_on_spec(s)
    try:
        s.check(records)
    except AssertionError as exc:
        raise AssertionError(f"vector {s.name}: the spec no longer shows the behaviour it is named for") from exc
    head = [f"# {s.name}", "#"]
    head += [f"# {line}" for line in _wrap(s.behaviour)]
    head += [f"# vLLM 0.33: {s.vllm}", "#", "# What the spec plans (request kind computed+scheduled blocks [...]):"]
    head += [f"#   step {rec.step}: {describe_plan(rec.plan)}" for rec in records]
    head.append("# Generated by tests/vectors/generate.py; replay: schedspec replay THIS_FILE --against NAME")
    workload = Workload(s.config, s.events, seed=None)
    return "\n".join(head) + "\n" + tracefile.dumps(tracefile.Trace(workload, vocab=s.vocab, oracle_seed=s.oracle_seed))


def _wrap(text: str, width: int = 96) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def expected_files() -> dict[str, str]:
    names = [s.name for s in SCENARIOS]
    assert len(set(names)) == len(names), "two scenarios share a name"
    return {f"{s.name}.jsonl": render(s) for s in SCENARIOS}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with vectors/spec/ instead of writing")
    args = p.parse_args(argv)
    files = expected_files()
    present = {q.name for q in OUT.glob("*.jsonl")} if OUT.exists() else set()
    if args.check:
        stale = sorted(n for n, text in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != text)
        extra = sorted(present - set(files))
        for n in stale:
            print(f"stale: vectors/spec/{n}")
        for n in extra:
            print(f"not generated: vectors/spec/{n}")
        return 1 if stale or extra else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for n in sorted(present - set(files)):
        (OUT / n).unlink()
    for n, text in files.items():
        (OUT / n).write_text(text)
    print(f"wrote {len(files)} vectors to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
