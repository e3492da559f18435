"""modelcheck holds a scheduler under test without a clone(): a copy made by clone(), pickle or
deepcopy that fails on some state is no finding of the scheduler's; the path to the state is
replayed on a fresh instance instead, and the verdict is the one a copyable scheduler gets."""

from __future__ import annotations

from typing import Any

import pytest

from examples.batch_bound import BatchBoundScheduler
from schedspec.invariants import select
from schedspec.modelcheck import check_bound
from schedspec.modelcheck.target import Against, copy_method
from schedspec.spec.interface import RequestSpec

SPACE = "fcfs-nochunk-eos-abortstep"  # whole prompts, aborts: within the example's capabilities


class UnpicklableOnceBusy(BatchBoundScheduler):
    """Pickles while empty (so the probe picks pickle), not once it holds a request."""

    def add(self, request: RequestSpec) -> None:
        super().add(request)
        self.hook = lambda: request  # a lambda does not pickle


class CloneRaisesOnceBusy(BatchBoundScheduler):
    """Has a clone() that fails once it holds a request."""

    def clone(self) -> "CloneRaisesOnceBusy":
        if self.engine.seqs:
            raise RuntimeError("cannot clone a busy engine")
        return CloneRaisesOnceBusy(self.config)


class LeaksOnAbortUnpicklable(UnpicklableOnceBusy):
    """Aborts a request without returning its blocks."""

    def abort(self, request_id: str) -> None:
        seq = self.engine.seqs[request_id]
        seq.blocks = []  # BUG: the pool still counts them held
        super().abort(request_id)


def _run(cls: Any, workers: int = 1) -> Any:
    against = Against(cls.__qualname__, cls, "invariants", select(None, "invariants"), resets=False)
    return check_bound("small", use_impl=False, spaces=[SPACE], workers=workers, against=against)


@pytest.mark.parametrize("cls,method", [(UnpicklableOnceBusy, "pickle"), (CloneRaisesOnceBusy, "clone")])
def test_a_copy_that_fails_replays_the_path_instead(cls: Any, method: str) -> None:
    from schedspec.modelcheck import bound

    config = next(s for s in bound("small").spaces if s.name == SPACE).config
    assert copy_method(cls(config)) == method
    result = _run(cls)
    assert result.failure is None, result.failure.describe() if result.failure else ""
    plain = _run(BatchBoundScheduler)
    assert result.states == plain.states and result.transitions == plain.transitions > 0


def test_a_copy_that_fails_in_a_worker_replays_there_too() -> None:
    result = _run(UnpicklableOnceBusy, workers=2)
    assert result.failure is None and result.states == _run(BatchBoundScheduler).states


def test_a_real_bug_is_still_the_schedulers_finding_when_copies_fail() -> None:
    result = _run(LeaksOnAbortUnpicklable)
    assert result.failure is not None and result.failure.kind == "violation", result.failure
    assert "block-conservation" in {v.invariant_id for v in result.failure.violations}, result.failure.describe()
