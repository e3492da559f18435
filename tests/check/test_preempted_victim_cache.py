"""A victim preempted in the step that scheduled it leaves stale prefix-cache keys.

vLLM 0.33 behaves this way and the spec captures it (docs/divergences.md,
"vLLM behaviours found"): under the PRIORITY policy a running request that the
RUNNING loop has already scheduled (and whose ``allocate_slots`` already gave
keys to the blocks its chunk was about to fill) can be chosen as the victim
of a later request's allocation in the same ``schedule()``. The preemption
frees its blocks with their keys, but the step never computes their KV; when
the request resumes, its prefix hit reaches those blocks and reads KV that is
not its own. The fake model reads the context back through the block table,
so the ``kv-context`` invariant fires: these tests pin that the finding
stays a finding (on the spec, the fast scheduler and vLLM alike) and that the
schedulers agree step by step up to it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

import pytest

from schedspec.check.driver import Runner
from schedspec.check.records import Failure
from schedspec.check.random_workloads import random_workload
from schedspec.check.workload import AddRequest, Event, Step
from schedspec.impl.scheduler import ImplScheduler
from schedspec.spec.interface import Policy, RequestSpec, RequestStatus, Scheduler, SchedulerConfig, StepResult
from schedspec.spec.scheduler import SpecScheduler

REQUIRE_VLLM = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

#: block size 1, 13 usable blocks, budget 6, chunks of at most 3, PRIORITY,
#: prefix caching, no speculative decoding: the shortest reproduction found
CONFIG = SchedulerConfig(
    block_size=1,
    num_blocks=14,
    max_num_batched_tokens=6,
    max_num_seqs=4,
    max_model_len=12,
    enable_chunked_prefill=True,
    long_prefill_token_threshold=3,
    enable_prefix_caching=True,
    policy=Policy.PRIORITY,
)
PROMPT_A = tuple(range(1, 12))  # 11 tokens, low priority, admitted first
A = RequestSpec(request_id="a", prompt_token_ids=PROMPT_A, max_tokens=1, priority=1, arrival=0)
B = RequestSpec(request_id="b", prompt_token_ids=(40, 41), max_tokens=2, priority=0, arrival=1)
EVENTS: tuple[Event, ...] = (AddRequest(A), Step(), AddRequest(B), Step(), Step(), Step())

SCHEDULERS: dict[str, Callable[[SchedulerConfig], Scheduler]] = {"spec": SpecScheduler, "impl": ImplScheduler}


def _keyed_prefixes(s: Scheduler) -> dict[int, tuple[int, ...]]:
    """Block id -> the token prefix its prefix-cache key stands for."""
    return {b: tuple(k[1]) for b, k in s.view().kv.block_keys.items()}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_the_victim_keeps_keys_on_blocks_its_step_never_computes(name: str) -> None:
    s = SCHEDULERS[name](CONFIG)
    s.add(A)
    p1 = s.schedule()  # a: positions 0..5
    s.update(p1, StepResult(sampled={}))
    s.add(B)
    p2 = s.schedule()  # a: positions 6..8; b: its whole prompt
    assert [(e.request_id, e.num_computed_tokens, e.num_scheduled_tokens) for e in p2.scheduled] == [
        ("a", 6, 3), ("b", 0, 2)]
    s.update(p2, StepResult(sampled={"b": (7,)}))
    p3 = s.schedule()
    # a got blocks for positions 9 and 10 (and keys on them), then b's decode
    # found the pool empty and preempted a, the lowest priority, in the same step
    assert p3.scheduled_ids == ("b",)
    assert "a" in p3.preempted_ids
    a = s.view().requests["a"]
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    prefixes = set(_keyed_prefixes(s).values())
    # position 9 was never computed (a's KV stops at position 8), yet its block is keyed
    assert PROMPT_A[:10] in prefixes
    s.update(p3, StepResult(sampled={"b": (8,)}))  # b reaches max_tokens
    p4 = s.schedule()
    (entry,) = p4.scheduled
    # the resume hits through position 9: only position 10 is computed
    assert (entry.request_id, entry.num_computed_tokens, entry.num_scheduled_tokens) == ("a", 10, 1)


def _assert_stale_read(f: Failure | None, scheduler: str) -> None:
    assert f is not None
    assert (f.kind, f.scheduler, f.step, f.event_index) == ("violation", scheduler, 4, 5)
    (v,) = f.violations
    assert (v.invariant_id, v.request_id) == ("kv-context", "a")
    assert "position 9 holds None, the request's token there is 10" in v.message


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_kv_context_fires_on_the_stale_prefix_hit(name: str) -> None:
    _assert_stale_read(Runner(CONFIG, {name: SCHEDULERS[name]}).run(EVENTS), name)


def test_spec_and_impl_agree_up_to_the_stale_read() -> None:
    # a divergence would be reported before the violation; none comes
    _assert_stale_read(Runner(CONFIG, dict(SCHEDULERS)).run(EVENTS), "spec")


@pytest.mark.parametrize("seed, modes, step, event_index, request_id", [
    (100658, ("spec",), 139, 248, "r15"),  # the seed that found it (k = 2)
    (1095, ("sync",), 66, 138, "r19"),  # the default mode reaches it too
])
def test_random_workloads_that_reach_it(
    seed: int, modes: tuple[str, ...], step: int, event_index: int, request_id: str
) -> None:
    w = random_workload(seed, 200, modes=modes)
    f = Runner(w.config, {"spec": SpecScheduler}, oracle_seed=seed).run(w.events)
    assert f is not None and f.kind == "violation" and (f.step, f.event_index) == (step, event_index)
    (v,) = f.violations
    assert (v.invariant_id, v.request_id) == ("kv-context", request_id)


@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE_VLLM, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_vllm_does_the_same() -> None:
    from schedspec.adapters.registry import resolve

    vllm = resolve("vllm").factory
    _assert_stale_read(Runner(CONFIG, {"vllm": vllm}).run(EVENTS), "vllm")
    # in lockstep with the spec: identical plans and views up to the read
    _assert_stale_read(Runner(CONFIG, {"spec": SpecScheduler, "vllm": vllm}).run(EVENTS), "spec")
