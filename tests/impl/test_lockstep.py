"""Lockstep: ImplScheduler must be observably identical to SpecScheduler.

A Hypothesis state machine drives both schedulers with the same events and
asserts, after every operation, equal StepPlans (block ids included), equal
views (free-queue order, ref counts, prefix-cache keys and index order,
waiting order, every request) and equal exceptions (type and message) on bad
input, with the state unchanged by the failed operation.

Profiles: ``ci`` (quick, derandomized; the default) and ``deep`` (long runs);
pick one with HYPOTHESIS_PROFILE=deep (this machine runs impl-ci / impl-deep,
registered in tests/conftest.py); IMPL_LOCKSTEP_EXAMPLES=N bounds a run.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from schedspec.impl import ImplScheduler
from schedspec.spec.interface import (
    RequestSpec,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from schedspec.spec.scheduler import SpecScheduler
from schedspec.check.config_space import LOCKSTEP_SPACE
from schedspec.testing.strategies import configs

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "deep"):
    PROFILE = "ci"

VOCAB = 12
ALPHABET = 4

#: Steps taken over all runs in this process (the deep run reports it).
STEP_COUNT = [0]


def fake_token(tokens: list[int]) -> int:
    """A deterministic 'model': a hash of the request's tokens so far."""
    return hash(tuple(tokens)) % VOCAB


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the point is to compare them
        return ("raise", (type(exc), str(exc)))


class Lockstep(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.spec: SpecScheduler | None = None
        self.impl: ImplScheduler | None = None
        self.cfg: SchedulerConfig | None = None
        self.prefixes: list[tuple[int, ...]] = []
        self.tokens: dict[str, list[int]] = {}  # request id -> prompt + outputs
        self.plan: StepPlan | None = None  # outstanding
        self.impl_plan: StepPlan | None = None
        self.counter = 0
        self.used_ids: list[str] = []

    # -------------------------------------------------------------- helpers

    def both(self, op: Callable[[Any], Any]) -> tuple[str, Any]:
        """Run ``op`` on both; equal outcomes; a raising op changes nothing."""
        assert self.spec is not None and self.impl is not None
        before = self.spec.view()
        a = outcome(lambda: op(self.spec))
        b = outcome(lambda: op(self.impl))
        assert a[0] == b[0], f"spec {a} impl {b}"
        if a[0] == "raise":
            assert a[1] == b[1], f"spec raised {a[1]}, impl raised {b[1]}"
            assert self.spec.view() == before
            assert self.impl.view() == before
        else:
            assert a[1] == b[1], f"spec returned {a[1]!r}, impl returned {b[1]!r}"
        self.compare()
        return a

    def compare(self) -> None:
        assert self.spec is not None and self.impl is not None
        va, vb = self.spec.view(), self.impl.view()
        if va != vb:
            from schedspec.check.records import describe_difference

            raise AssertionError(describe_difference("view()", "spec", va, "impl", vb))

    def live(self) -> list[str]:
        assert self.spec is not None
        return sorted(self.spec.requests)

    # -------------------------------------------------------------- setup

    @initialize(
        # synchronous, no drafts: tests/impl/test_modes.py runs the other modes
        cfg=configs(dataclasses.replace(LOCKSTEP_SPACE, modes=("sync",))),
        prefixes=st.lists(
            st.lists(st.integers(0, ALPHABET - 1), min_size=2, max_size=16), min_size=1, max_size=3
        ),
    )
    def setup(self, cfg: SchedulerConfig, prefixes: list[list[int]]) -> None:
        self.cfg = cfg
        self.spec = SpecScheduler(cfg)
        self.impl = ImplScheduler(cfg)
        self.prefixes = [tuple(p) for p in prefixes]
        self.compare()

    # -------------------------------------------------------------- requests

    @rule(
        data=st.data(),
        use_prefix=st.booleans(),
        tail=st.lists(st.integers(0, ALPHABET - 1), max_size=20) | st.lists(st.integers(0, 1), max_size=3),
        max_tokens=st.sampled_from([1, 1, 2, 3, 5, 8, 30]),
        priority=st.integers(0, 2),
        arrival_tie=st.booleans(),
        stop=st.lists(st.integers(0, VOCAB - 1), max_size=2),
        eos=st.none() | st.integers(0, VOCAB - 1),
        ignore_eos=st.booleans(),
        salt=st.sampled_from([None, None, None, "", "a", "b"]),
        reuse_id=st.booleans(),
    )
    def add(
        self,
        data: st.DataObject,
        use_prefix: bool,
        tail: list[int],
        max_tokens: int,
        priority: int,
        arrival_tie: bool,
        stop: list[int],
        eos: int | None,
        ignore_eos: bool,
        salt: str | None,
        reuse_id: bool,
    ) -> None:
        assert self.cfg is not None
        prefix = data.draw(st.sampled_from(self.prefixes)) if use_prefix else ()
        prompt = prefix + tuple(tail)
        if len(prompt) >= self.cfg.max_model_len and data.draw(st.integers(0, 9)) > 0:
            prompt = prompt[: self.cfg.max_model_len - 1]  # mostly valid, sometimes too long
        if not prompt:
            prompt = (0,)
        self.counter += 1
        if reuse_id and self.used_ids:
            rid = data.draw(st.sampled_from(self.used_ids))  # maybe live, maybe finished
        else:
            rid = f"r{self.counter}"
            self.used_ids.append(rid)
        req = RequestSpec(
            request_id=rid,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            priority=priority,
            arrival=(self.counter // 3) if arrival_tie else self.counter,
            stop_token_ids=tuple(stop),
            eos_token_id=eos,
            ignore_eos=ignore_eos,
            cache_salt=salt,
        )
        kind, _ = self.both(lambda s: s.add(req))
        if kind == "ok":
            self.tokens[rid] = list(prompt)

    @rule(
        data=st.data(),
        k=st.integers(2, 4),
        max_tokens=st.sampled_from([1, 4, 12, 30]),
        salt=st.sampled_from([None, "a"]),
    )
    def add_burst(self, data: st.DataObject, k: int, max_tokens: int, salt: str | None) -> None:
        """Several requests on one shared prefix: prefix hits, shared blocks."""
        assert self.cfg is not None
        prefix = data.draw(st.sampled_from(self.prefixes))
        for _ in range(k):
            tail = tuple(data.draw(st.lists(st.integers(0, ALPHABET - 1), max_size=4)))
            prompt = (prefix + tail)[: self.cfg.max_model_len - 1]
            self.counter += 1
            rid = f"r{self.counter}"
            self.used_ids.append(rid)
            req = RequestSpec(
                request_id=rid,
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                priority=data.draw(st.integers(0, 2)),
                arrival=self.counter,
                cache_salt=salt,
            )
            kind, _ = self.both(lambda s: s.add(req))
            if kind == "ok":
                self.tokens[rid] = list(prompt)

    @rule(what=st.sampled_from(["not a request", None, 3]))
    def add_bad_type(self, what: object) -> None:
        self.both(lambda s: s.add(what))

    @precondition(lambda self: self.spec is not None and bool(self.spec.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live()))
        self.both(lambda s: s.abort(rid))

    @rule(rid=st.sampled_from(["nope", "r1", "r2", ""]))
    def abort_maybe_unknown(self, rid: str) -> None:
        self.both(lambda s: s.abort(rid))

    @rule(reset_running=st.booleans())
    def reset_prefix_cache(self, reset_running: bool) -> None:
        self.both(lambda s: s.reset_prefix_cache(reset_running))

    # -------------------------------------------------------------- steps

    def _schedule(self) -> None:
        assert self.spec is not None and self.impl is not None
        if self.plan is not None:
            self.both(lambda s: s.schedule())  # both raise ProtocolError
            return
        pa = self.spec.schedule()
        pb = self.impl.schedule()
        assert pa == pb, f"plans differ:\nspec {pa}\nimpl {pb}"
        self.plan, self.impl_plan = pa, pb
        self.compare()

    def _result(self, plan: StepPlan) -> StepResult:
        assert self.spec is not None
        sampled: dict[str, tuple[int, ...]] = {}
        for s in plan.scheduled:
            if s.samples and s.request_id in self.spec.requests:
                sampled[s.request_id] = (fake_token(self.tokens[s.request_id]),)
        return StepResult(sampled)

    def _update(self) -> None:
        assert self.spec is not None and self.impl is not None
        if self.plan is None or self.impl_plan is None:
            self.both(lambda s: s.update(StepPlan(0, (), (), ()), StepResult({})))
            return
        result = self._result(self.plan)
        self.spec.update(self.plan, result)
        self.impl.update(self.impl_plan, result)
        for rid, toks in result.sampled.items():
            self.tokens[rid].extend(toks)
        self.plan = self.impl_plan = None
        STEP_COUNT[0] += 1
        self.compare()

    @rule(n=st.integers(1, 8) if PROFILE == "ci" else st.integers(1, 48))
    def step(self, n: int) -> None:
        for _ in range(n):
            self._schedule()
            self._update()

    @rule()
    def schedule_only(self) -> None:
        self._schedule()

    @rule()
    def update_only(self) -> None:
        self._update()

    @precondition(lambda self: self.plan is not None)
    @rule(data=st.data(), how=st.sampled_from(
        ["drop", "extra", "unplanned", "negative", "list", "bool", "two", "wrong_plan", "not_result", "none"]
    ))
    def bad_update(self, data: st.DataObject, how: str) -> None:
        assert self.plan is not None and self.impl_plan is not None
        good = dict(self._result(self.plan).sampled)
        plan_a, plan_b = self.plan, self.impl_plan
        result: Any
        planned = [s.request_id for s in plan_a.scheduled]
        if how == "drop" and good:
            good.pop(data.draw(st.sampled_from(sorted(good))))
        elif how == "extra" and planned:
            rid = data.draw(st.sampled_from(planned))
            good[rid] = good.get(rid, ()) + (1,)
        elif how == "unplanned":
            good["zz-unplanned"] = (1,)
        elif how == "negative" and good:
            good[data.draw(st.sampled_from(sorted(good)))] = (-1,)
        elif how == "list" and good:
            rid = data.draw(st.sampled_from(sorted(good)))
            good[rid] = list(good[rid])  # type: ignore[assignment]
        elif how == "bool" and good:
            good[data.draw(st.sampled_from(sorted(good)))] = (True,)
        elif how == "two" and planned:
            good[data.draw(st.sampled_from(planned))] = (1, 2)
        elif how == "none" and planned:
            good[data.draw(st.sampled_from(planned))] = None  # type: ignore[assignment]
        if how == "wrong_plan":
            other = StepPlan(plan_a.step + 1, plan_a.scheduled, plan_a.preempted_ids, plan_a.finished_ids)
            self.both(lambda s: s.update(other, StepResult(good)))
            return
        result = {"x": 1} if how == "not_result" else StepResult(good)
        kind, _ = self.both(lambda s: s.update(plan_a if s is self.spec else plan_b, result))
        if kind == "ok":  # the mutation happened to leave a valid result
            for rid, toks in good.items():
                if rid in self.tokens and toks:
                    self.tokens[rid].extend(toks)
            self.plan = self.impl_plan = None
            STEP_COUNT[0] += 1


LockstepTest = Lockstep.TestCase
LockstepTest.settings = settings.get_profile(f"impl-{PROFILE}")
if os.environ.get("IMPL_LOCKSTEP_EXAMPLES"):  # e.g. to bound a deep run
    LockstepTest.settings = settings(
        LockstepTest.settings, max_examples=int(os.environ["IMPL_LOCKSTEP_EXAMPLES"])
    )


@pytest.fixture(scope="module", autouse=True)
def _report_steps() -> Any:
    yield
    if PROFILE == "deep":
        print(f"\nlockstep: {STEP_COUNT[0]} steps compared (profile {PROFILE})")


def test_profiles_registered() -> None:
    assert settings.get_profile("impl-ci").derandomize
    assert settings.get_profile("impl-deep").max_examples >= 100_000
    settings.get_profile("ci")  # tests/conftest.py registers them all
    settings.get_profile("deep")


def test_testing_state_machine_spec_vs_impl() -> None:
    """schedspec.testing's reusable machine, run with spec and impl in lockstep."""
    from schedspec.adapters.registry import resolve
    from schedspec.testing.stateful import make_machine

    machine = make_machine({"spec": resolve("spec").factory, "impl": resolve("impl").factory}, name="SpecVsImpl")
    test = machine.TestCase
    base = settings.get_profile(f"impl-{PROFILE}")
    test.settings = settings(base, max_examples=min(base.max_examples, 100))
    test().runTest()
