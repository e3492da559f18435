"""Streaming-input sessions in the checking engine: impl in lockstep with the
spec, the trace format (version 6) and its refusals at load, the generator,
and, when vLLM is installed, vLLM's own scheduler in lockstep."""

from __future__ import annotations

import pytest

from schedspec.check import trace as tracefile
from schedspec.check.driver import Runner
from schedspec.check.random_workloads import random_workload
from schedspec.check.session_events import SessionInput
from schedspec.check.trace import TraceError
from schedspec.check.workload import AddRequest, Step
from schedspec.impl import ImplScheduler
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import RequestError, RequestSpec, SchedulerConfig, SessionUpdate

MODES = ("sync", "async", "spec", "async-spec")


def _run(factories: dict[str, object], modes: tuple[str, ...], seeds: range, steps: int = 100) -> tuple[int, int]:
    total = updates = 0
    for seed in seeds:
        w = random_workload(seed, steps, modes=modes, sessions=True)
        updates += sum(isinstance(e, SessionInput) for e in w.events)
        r = Runner(w.config, factories, oracle_seed=seed, check_invariants=False)  # type: ignore[arg-type]
        for e in w.events:
            f = r.apply(e)
            assert f is None, f"seed {seed}: {f.message}"
        total += r.stats.steps
    return total, updates


@pytest.mark.parametrize("mode", MODES)
def test_impl_keeps_the_specs_plans_and_views_with_sessions(mode: str) -> None:
    steps, updates = _run({"spec": SpecScheduler, "impl": ImplScheduler}, (mode,), range(8))
    assert steps >= 700 and updates > 50


def test_impl_refuses_bad_session_updates_as_the_spec_does() -> None:
    cfg = SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    for cls in (SpecScheduler, ImplScheduler):
        s = cls(cfg)
        s.add(RequestSpec("s", (1, 2, 3), max_tokens=2, resumable=True))
        s.add(RequestSpec("p", (1, 2, 3), max_tokens=2))
        before = s.view()
        for update, field in ((SessionUpdate("x", (1,)), "request_id"), (SessionUpdate("p", (1,)), "resumable"),
                              (SessionUpdate("s", (1,) * 60), "prompt_token_ids")):
            with pytest.raises(RequestError) as err:
                s.session_update(update)
            assert err.value.field == field and s.view() == before


def test_a_scheduler_with_no_sessions_stays_off_the_session_paths() -> None:
    cfg = SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    s = ImplScheduler(cfg)
    s.add(RequestSpec("r", (1, 2, 3), max_tokens=4))
    s.update(plan := s.schedule(), __import__("schedspec.spec", fromlist=["StepResult"]).StepResult(sampled={"r": (5,)}))
    assert plan.scheduled and s._live_sessions == 0 and not s._general and not s._streaming_queues


def test_generated_sessions_round_trip_through_trace_format_6() -> None:
    w = random_workload(3, 60, modes=("async",), sessions=True)
    assert any(isinstance(e, SessionInput) for e in w.events) and "sessions" in w.features
    text = tracefile.dumps(tracefile.Trace(w, oracle_seed=3))
    assert '"schedspec_trace": 6' in text.splitlines()[0]
    assert tracefile.loads(text).events == w.events
    plain = random_workload(3, 60, modes=("async",))
    assert not any(isinstance(e, SessionInput) for e in plain.events)
    assert '"schedspec_trace": 6' not in tracefile.dumps(tracefile.Trace(plain)).splitlines()[0]


HEADER6 = '{"schedspec_trace": 6, "config": {"block_size": 4, "num_blocks": 16, "max_model_len": 32}}'
ADD_S = '{"op": "add", "request": {"request_id": "s", "prompt_token_ids": [1, 2], "max_tokens": 2, "resumable": true}}'
ADD_P = '{"op": "add", "request": {"request_id": "p", "prompt_token_ids": [1, 2], "max_tokens": 2}}'


@pytest.mark.parametrize(
    "lines, line, field",
    [
        ([HEADER6, '{"op": "session_update", "request_id": "s", "prompt_token_ids": [3], "max_tokens": 1}'],
         2, "request_id"),
        ([HEADER6, ADD_P, '{"op": "session_update", "request_id": "p", "prompt_token_ids": [3]}'], 3, "request_id"),
        ([HEADER6, ADD_S, '{"op": "session_update", "request_id": "s", "prompt_token_ids": []}'], 3,
         "prompt_token_ids"),
        ([HEADER6, ADD_S, '{"op": "session_update", "request_id": "s", "end": true}',
          '{"op": "session_update", "request_id": "s", "prompt_token_ids": [4]}'], 4, "request_id"),
        ([HEADER6.replace(": 6", ": 5"), ADD_S], 2, "request.resumable"),
        ([HEADER6.replace(": 6", ": 5"), ADD_P, '{"op": "session_update", "request_id": "p", "end": true}'], 3, "op"),
    ],
)
def test_a_bad_session_line_is_refused_at_load_naming_file_line_and_field(lines: list[str], line: int, field: str) -> None:
    with pytest.raises(TraceError) as err:
        tracefile.loads("\n".join(lines) + "\n", "t.jsonl")
    assert (err.value.path, err.value.line, err.value.field) == ("t.jsonl", line, field)


def test_a_session_trace_replays_with_updates_at_any_time() -> None:
    text = "\n".join([HEADER6, ADD_S, '{"op": "step"}',
                      '{"op": "session_update", "request_id": "s", "prompt_token_ids": [7, 7], "max_tokens": 1}',
                      '{"op": "step"}', '{"op": "step"}', '{"op": "session_update", "request_id": "s", "end": true}',
                      '{"op": "step"}']) + "\n"
    t = tracefile.loads(text)
    assert isinstance(t.events[0], AddRequest) and isinstance(t.events[1], Step)
    r = Runner(t.config, {"spec": SpecScheduler, "impl": ImplScheduler})
    for e in t.events:
        assert r.apply(e) is None
    assert r.primary.view().finished == {} and not r.primary.view().requests  # ended, reported


def test_vllm_keeps_the_specs_plans_and_views_with_sessions() -> None:
    pytest.importorskip("vllm")
    from schedspec.adapters.vllm_adapter import VllmScheduler

    steps, updates = _run({"spec": SpecScheduler, "vllm": VllmScheduler}, ("sync", "async"), range(3), 80)
    assert steps >= 200 and updates > 10


def test_check_sessions_runs_impl_in_lockstep_and_a_class_without_them_fails_naming_it(
        tmp_path: "pytest.TempPathFactory", capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main

    out = str(tmp_path)
    rc = main(["check", "--against", "impl", "--sessions", "--invariants", "safety", "--steps", "300",
               "--quiet", "--out", out])
    assert rc == 0, capsys.readouterr().out
    rc = main(["check", "--against", "tests.check.test_sessions_engine:NoSessions", "--sessions", "--steps", "300",
               "--quiet", "--out", out])
    assert rc == 1 and "has no session_update()" in capsys.readouterr().out


class NoSessions(SpecScheduler):
    """The spec without the optional session_update."""

    session_update = None  # type: ignore[assignment]


# -- a stale output stops a preempted session (k plans in flight): it leaves
# the deferred set, as update_from_output's stopped_preempted_reqs does

STALE_STOP_TRACES = ("stale-stop-of-a-preempted-session-leaves-deferred.jsonl", "sync-pipeline-session-stats.jsonl")


@pytest.mark.parametrize("name", STALE_STOP_TRACES)
def test_a_session_stopped_while_preempted_is_counted_waiting_not_skipped(name: str) -> None:
    """Shrunk from `check --against vllm --sessions --pipeline --runner`: the
    spec counted the session in num_skipped_waiting_reqs after a stale
    output stopped it while preempted; vLLM (deferred_waiting.
    difference_update(stopped_preempted_reqs)) counts it waiting."""
    from pathlib import Path

    from schedspec.cli.main import main

    path = Path(__file__).resolve().parent / "data" / name
    assert main(["replay", str(path), "--against", "impl", "--stats"]) == 0
    pytest.importorskip("vllm")
    assert main(["replay", str(path), "--against", "vllm", "--stats"]) == 0
