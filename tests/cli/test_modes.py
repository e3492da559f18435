"""--mode and --invariants in check and replay: the output says exactly what
ran, bad selections exit 2 naming the problem, the trace records the check
and replay repeats it; declared capabilities; conformance at start-up."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from schedspec.check import trace as tracefile
from schedspec.adapters.registry import resolve
from schedspec.cli.main import main
from schedspec.invariants import CATALOGUE

SAFETY = sum(1 for inv in CATALOGUE if inv.is_safety)
#: impl's share of the catalogue: the invariants of an admission gate it does not declare are skipped
IMPL_KEPT, IMPL_SKIPPED = resolve("impl").capabilities.split(CATALOGUE)
IMPL_SAFETY = sum(1 for inv in IMPL_KEPT if inv.is_safety)


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_invariants_mode_says_no_comparison_ran(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "impl", "--mode", "invariants", "--steps", "200", "--kv", "none", "--quiet",
                   "--out", str(tmp_path), "--json", str(tmp_path / "s.json")])
    assert rc == 0, out
    assert f"{IMPL_SAFETY} invariants held (safety); invariants mode: no comparison with the spec" in out
    assert "equal to the spec" not in out
    check = json.loads((tmp_path / "s.json").read_text())["check"]
    assert check["mode"] == "invariants" and check["compared_with_reference"] is False
    assert len(check["checked"]) == IMPL_SAFETY
    assert len(check["checked"]) + len(check["skipped"]) == SAFETY


def test_lockstep_says_what_it_compared(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "impl", "--steps", "100", "--kv", "none", "--quiet", "--out", str(tmp_path)])
    assert rc == 0 and f"{len(IMPL_KEPT)} invariants held (all), plans and views equal to the spec" in out
    rc, out = run(["check", "--steps", "100", "--kv", "none", "--quiet", "--out", str(tmp_path)])
    assert rc == 0 and "the spec against itself: no comparison" in out
    rc, out = run(["check", "--against", "impl", "--plans-only", "--steps", "100", "--kv", "none", "--quiet",
                   "--out", str(tmp_path)])
    assert rc == 0 and "(no invariants)" in out


@pytest.mark.parametrize(
    "flags,word",
    [
        (["--invariants", "no-such-thing"], "unknown invariant id or tag 'no-such-thing'"),
        (["--invariants", "policy:nobody"], "unknown invariant tag 'policy:nobody'"),
        (["--invariants", "token-budget,-token-budget"], "leaves nothing to check"),
        (["--mode", "invariants", "--invariants=-free-queue-lru"], "'-free-queue-lru' leaves out nothing"),
        (["--mode", "invariants", "--plans-only"], "--plans-only"),
        (["--invariants", "safety", "--plans-only"], "--plans-only"),
    ],
)
def test_bad_selections_exit_2_naming_them(flags: list[str], word: str, tmp_path: Path) -> None:
    rc, out = run(["check", "--steps", "10", "--quiet", "--out", str(tmp_path)] + flags)
    assert rc == 2 and word in out, out


def test_an_invariants_mode_counterexample_records_its_check_and_replays_it(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "tests.support.buggy_schedulers:LeakyAbort", "--mode", "invariants",
                   "--invariants", "safety,-quiescence", "--steps", "3000", "--quiet", "--out", str(tmp_path),
                   "--shrink-time", "10"])
    assert rc == 1, out
    trace_path = next(tmp_path.rglob("trace.jsonl"))
    trace = tracefile.read(trace_path)
    assert trace.check == {"mode": "invariants", "invariants": "safety,-quiescence"}
    summary = json.loads((trace_path.parent / "summary.json").read_text())
    assert summary["check"]["mode"] == "invariants" and "quiescence" not in summary["check"]["checked"]
    rc, out = run(["replay", str(trace_path), "--against", "tests.support.buggy_schedulers:LeakyAbort"])
    assert rc == 1, out
    # the fixed scheduler passes the same check, and says which check it was
    rc, out = run(["replay", str(trace_path), "--against", "spec"])
    assert rc == 0 and "(safety,-quiescence); invariants mode: no comparison with the spec" in out


def test_replay_flags_override_the_recorded_check(tmp_path: Path) -> None:
    src = next(Path(__file__).resolve().parents[2].glob("vectors/spec/*.jsonl"))
    rc, out = run(["replay", str(src), "--against", "impl", "--mode", "invariants", "--invariants", "policy:fcfs"])
    assert rc == 0 and "(policy:fcfs); invariants mode" in out


# ---------------------------------------------------------------- capabilities


def test_capabilities_keep_the_workloads_within_them_and_list_what_is_skipped(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "tests.support.modes_support:FcfsOnly", "--mode", "invariants",
                   "--invariants", "all", "--steps", "300", "--quiet", "--out", str(tmp_path)])
    assert rc == 0, out
    assert "skipped, unsupported: long-prefill-threshold (needs long_prefill_threshold)" in out
    assert "priority-admission-order (needs policy_priority)" in out
    assert "reset-prefix-cache (needs reset_prefix_cache)" in out


def test_an_invariant_named_by_id_that_the_scheduler_cannot_take_exits_2(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "tests.support.modes_support:FcfsOnly", "--mode", "invariants",
                   "--invariants", "safety,priority-admission-order", "--steps", "10", "--out", str(tmp_path)])
    assert rc == 2 and "priority-admission-order: cannot be checked on this scheduler" in out


def test_replaying_a_trace_outside_the_capabilities_exits_2(tmp_path: Path) -> None:
    corpus = Path(__file__).resolve().parents[2] / "vectors" / "spec"
    prio = [p for p in sorted(corpus.glob("*.jsonl")) if tracefile.read(p).config.policy.name == "PRIORITY"]
    assert prio
    rc, out = run(["replay", str(prio[0]), "--against", "tests.support.modes_support:FcfsOnly"])
    assert rc == 2 and "does not support what the trace uses: policy PRIORITY" in out


# ---------------------------------------------------------------- conformance


def test_a_wrong_return_type_is_refused_at_start_up_naming_it(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "tests.support.buggy_schedulers:WrongTypeSchedule", "--mode",
                   "invariants", "--steps", "10", "--out", str(tmp_path)])
    assert rc == 2, out
    assert "WrongTypeSchedule.schedule() returned a list, expected schedspec.spec.interface.StepPlan" in out
    assert "tests.support.buggy_schedulers:WrongTypeSchedule" in out


def test_a_bad_view_field_is_named(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "tests.support.modes_support:ListQueues", "--steps", "10",
                   "--out", str(tmp_path)])
    assert rc == 2 and "ListQueues.view() returned at start a view whose .waiting is a list, expected tuple" in out


def test_a_wrong_signature_is_refused(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "tests.support.modes_support:UpdateTakesOne", "--steps", "10",
                   "--out", str(tmp_path)])
    assert rc == 2 and "UpdateTakesOne.update(self, plan" in out and "cannot be called as update(plan, result)" in out


def test_a_method_named_like_vllms_does_not_make_a_vllm_scheduler() -> None:
    from schedspec.adapters.registry import is_vllm_scheduler_class, resolve
    from tests.support.modes_support import HasUpdateFromOutput

    assert not is_vllm_scheduler_class(HasUpdateFromOutput)
    sched = resolve("tests.support.modes_support:HasUpdateFromOutput").factory
    from schedspec.spec.interface import SchedulerConfig

    assert type(sched(SchedulerConfig())) is HasUpdateFromOutput  # built as is, not wrapped


def test_a_crash_is_reported_with_the_scheduler_and_its_frames(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", "tests.support.buggy_schedulers:RaisingSchedule", "--mode", "invariants",
                   "--steps", "200", "--quiet", "--out", str(tmp_path), "--shrink-time", "5"])
    assert rc == 1
    assert "in tests.support.buggy_schedulers:RaisingSchedule" in out
    assert "RaisingSchedule.schedule() raised RuntimeError" in out and "buggy_schedulers.py:" in out


def test_the_invariants_command_shows_tags_and_filters() -> None:
    rc, out = run(["invariants", "--invariants", "policy:vllm-victim"])
    assert rc == 0 and out.startswith(f"2 of {len(CATALOGUE)} invariants")
    assert "fcfs-victim-suffix  [policy:fcfs, policy:vllm-victim;" in out and "token-budget" not in out
    rc, out = run(["invariants", "--tags"])
    assert rc == 0 and out.splitlines()[0].startswith(f"safety  ({SAFETY}): ")
    rc, out = run(["invariants", "--invariants", "nope"])
    assert rc == 2 and "'nope'" in out


def test_plans_only_claims_no_invariant_and_junit_names_the_mode(tmp_path: Path) -> None:
    rc, _ = run(["check", "--against", "impl", "--plans-only", "--steps", "100", "--kv", "none", "--quiet",
                 "--out", str(tmp_path),
                 "--json", str(tmp_path / "s.json"), "--junit", str(tmp_path / "j.xml")])
    assert rc == 0
    check = json.loads((tmp_path / "s.json").read_text())["check"]
    assert check["checked"] == [] and check["invariants"] == "none (--plans-only)"
    assert "--mode lockstep" in (tmp_path / "j.xml").read_text()
