"""The invariants of a lockstep run, checked once per identical transition
(check/deferral.py): the same verdicts, the same failures, one check."""

from __future__ import annotations

from schedspec.check.deferral import Deferral
from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.check.records import Failure
from schedspec.check.workload import Abort, AddRequest, Step
from schedspec.impl.scheduler import ImplScheduler
from schedspec.invariants import Monitor, Transition, Violation
from schedspec.spec.interface import RequestSpec, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler
from tests.support.buggy_schedulers import LeakyAbort

CFG = SchedulerConfig(block_size=2, num_blocks=17, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=24)


class Counting(Monitor):
    """A Monitor that counts its full checks."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def check(self, t: Transition) -> list[Violation]:
        self.checks += 1
        return super().check(t)


def _runner(second: type, config: SchedulerConfig = CFG) -> tuple[Runner, Counting, Counting]:
    runner = Runner(config, {"spec": SpecScheduler, "mine": second})
    a, b = Counting(), Counting()
    runner.monitors["spec"], runner.monitors["mine"] = a, b
    return runner, a, b


def test_an_equal_transition_is_checked_once_and_recorded_by_both() -> None:
    workload = random_workload(3, 80)
    runner, spec, mine = _runner(ImplScheduler, workload.config)
    assert runner.run(workload.events) is None
    assert spec.checks == spec.transitions_seen > 50
    assert mine.checks == 0 and mine.transitions_seen == spec.transitions_seen
    # the histories the transition invariants read are the same
    assert mine.history.outputs == spec.history.outputs and mine.history.prompts == spec.history.prompts


def test_a_violation_is_still_reported_before_the_divergence_it_causes() -> None:
    # LeakyAbort keeps a block of an aborted request: its view differs from
    # the spec's, and its transition breaks block conservation; the finding
    # names the invariant and the scheduler, as when each call was checked at once
    runner, _, mine = _runner(LeakyAbort)
    req = RequestSpec(request_id="a", prompt_token_ids=(1, 2, 3, 4, 5), max_tokens=6)
    failure = runner.run([AddRequest(req), Step(), Step(), Abort("a")])
    assert failure is not None and failure.kind == "violation" and failure.scheduler == "mine", failure
    assert mine.checks >= 1
    assert any(v.invariant_id == "block-conservation" for v in failure.violations), failure.violations


class _FakeRunner:
    names = ["ref", "other"]
    compare_views = True

    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []

    def fail(self, kind: str, name: str, message: str, violations: tuple[Violation, ...] = (),
             exception: BaseException | None = None) -> Failure:
        self.failures.append((kind, name))
        return Failure(kind, 0, 0, name, message, violations)


def _transitions() -> tuple[Transition, Transition]:
    runner = Runner(CFG, {"spec": SpecScheduler})
    before = runner.views["spec"]
    runner.run([AddRequest(RequestSpec(request_id="a", prompt_token_ids=(1, 2, 3), max_tokens=2))])
    after = runner.views["spec"]
    t = Transition(kind="add", before=before, after=after,
                   request=RequestSpec(request_id="a", prompt_token_ids=(1, 2, 3), max_tokens=2))
    # the same views, another request: a field no comparison of views covers
    u = Transition(kind="add", before=before, after=after,
                   request=RequestSpec(request_id="b", prompt_token_ids=(1, 2, 3), max_tokens=2))
    return t, u


def test_a_transition_that_differs_from_the_reference_is_checked_in_full() -> None:
    t, u = _transitions()
    fake = _FakeRunner()
    deferral = Deferral(fake)
    ref, other = Counting(), Counting()
    assert deferral.observe("ref", ref, t) is None and ref.checks == 1
    assert deferral.observe("other", other, u) is None and other.checks == 0  # waits
    deferral.settle()
    assert other.checks == 1 and other.transitions_seen == 1 and not deferral.waiting
    # an equal one is only recorded
    assert deferral.observe("ref", ref, t) is None
    assert deferral.observe("other", other, t) is None
    assert deferral.settle() is None
    assert other.checks == 1 and other.transitions_seen == 2


def test_a_failure_checks_what_waits_first() -> None:
    t, _ = _transitions()
    fake = _FakeRunner()
    deferral = Deferral(fake)
    other = Counting()
    deferral.observe("other", other, t)
    assert deferral.flush() is None  # the add breaks nothing
    assert other.checks == 1 and not deferral.waiting


def test_one_scheduler_alone_is_checked_at_once() -> None:
    t, _ = _transitions()
    fake = _FakeRunner()
    fake.names = ["other"]
    deferral = Deferral(fake)
    m = Counting()
    deferral.observe("other", m, t)
    assert m.checks == 1 and not deferral.waiting
