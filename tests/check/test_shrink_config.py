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


def test_shrinking_keeps_session_updates_the_trace_loader_takes() -> None:
    """Dropping a session's add drops its updates, as an abort's: every
    workload the shrinker tries replays from its trace (an update names a
    resumable request added before it, not after the session's end)."""
    from schedspec.check import trace
    from schedspec.check.shrink import _consistent
    from schedspec.check.workload import SessionInput
    from schedspec.spec.interface import SessionUpdate

    config = SchedulerConfig(block_size=4, num_blocks=16, max_model_len=32, max_num_batched_tokens=8, max_num_seqs=2)
    session = RequestSpec("s1", (1, 2, 3), max_tokens=2, resumable=True)
    plain = RequestSpec("r2", (4, 5), max_tokens=2)
    events: list[Event] = [
        SessionInput(SessionUpdate("s9", (7,), 1)),  # s9 never added (its add was dropped)
        AddRequest(session), AddRequest(plain), Step(),
        SessionInput(SessionUpdate("r2", (7,), 1)),  # not resumable
        SessionInput(SessionUpdate("s1", (6,), 1)),
        SessionInput(SessionUpdate("s1", end=True)),
        SessionInput(SessionUpdate("s1", (8,), 1)),  # after the end
        Step(),
    ]
    kept = _consistent(events, config=config)
    updates = [(e.update.request_id, e.update.end) for e in kept if isinstance(e, SessionInput)]
    assert updates == [("s1", False), ("s1", True)]
    loaded = trace.loads(trace.dumps(trace.Trace(Workload(config, tuple(kept)))))
    assert loaded.workload.events == tuple(kept)
