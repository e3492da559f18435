"""The shrinker also simplifies the config when that lets it drop steps: a
failure found under a small token budget comes back with a larger one and a
few steps."""

from __future__ import annotations

from schedspec.check.records import Failure
from schedspec.check.run import run_workload
from schedspec.check.shrink import count_steps, shrink
from schedspec.check.workload import Abort, AddRequest, Event, Step, Workload
from schedspec.spec.interface import RequestSpec, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler


class ForgetsLastBlockOnAbort(SpecScheduler):
    """Leaks the last block of an aborted request that holds five or more."""

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and len(req.blocks) >= 5:
            req.blocks = req.blocks[:-1]
        super().abort(request_id)


def test_a_small_budget_is_raised_so_the_counterexample_needs_few_steps() -> None:
    config = SchedulerConfig(block_size=4, num_blocks=14, max_model_len=48, max_num_batched_tokens=4, max_num_seqs=2,
                             long_prefill_token_threshold=4)
    events: list[Event] = [AddRequest(RequestSpec("r1", tuple(i % 7 for i in range(40)), max_tokens=1))]
    events += [Step()] * 9 + [Abort("r1")]
    workload = Workload(config, tuple(events))
    factories = {"spec": SpecScheduler, "mine": ForgetsLastBlockOnAbort}

    def check(w: Workload) -> Failure | None:
        return run_workload(w, factories)[1]  # type: ignore[arg-type]

    failure = check(workload)
    assert failure is not None and failure.kind == "violation"
    small, small_failure = shrink(workload, failure, check, budget_s=30)
    assert small_failure.kind == "violation"
    assert {v.invariant_id for v in small_failure.violations} == {v.invariant_id for v in failure.violations}
    assert count_steps(small.events) <= 2, small.events  # five chunks of 4 tokens without the config change
    assert small.config.max_num_batched_tokens > 4 and small.config.long_prefill_token_threshold == 0
    assert check(small) is not None  # the shrunk workload, with its config, still fails
