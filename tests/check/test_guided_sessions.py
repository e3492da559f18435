"""The guided generator aims at the streaming-input rules as at others: a
focus on a sessions.* rule (spec/rule_names.py, gates "sessions") makes some
requests sessions and sends their chunks and ends (check/coverage_guided.py)."""

from __future__ import annotations

from schedspec.check.coverage_guided import guided_workload
from schedspec.check.driver import Runner
from schedspec.check.workload import AddRequest, SessionInput
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.interface import Policy
from schedspec.spec.scheduler import SpecScheduler


def test_a_focus_on_a_session_rule_sends_sessions_and_reaches_it() -> None:
    w = guided_workload(1, 300, focus=("sessions.continued_at_stop",), engine=("sessions",))
    assert w.config.policy == Policy.FCFS and not w.config.kv_connector
    assert any(isinstance(e, AddRequest) and e.request.resumable for e in w.events)
    assert any(isinstance(e, SessionInput) and e.update.end for e in w.events)
    runner = Runner(w.config, {"spec": SpecScheduler}, check_invariants=True)
    counts = rule_coverage.new_counts()
    rule_coverage.attach(runner.primary, counts)
    assert runner.run_to_completion(w.events) is None
    assert {"sessions.continued_at_stop", "sessions.update_queued", "sessions.wait_for_input"} <= set(counts)


def test_any_other_focus_gives_the_workload_its_seed_always_gave() -> None:
    for seed in range(3):
        w = guided_workload(seed, 120, focus=("preempt.fcfs_tail",))
        assert not any(isinstance(e, SessionInput) for e in w.events)
        assert not any(isinstance(e, AddRequest) and e.request.resumable for e in w.events)
