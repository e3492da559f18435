"""The example schedulers of examples/ (docs/adapters.md): each passes the
safety invariants in invariants mode through the CLI, each broken variant is
caught with a short counterexample that replays, and the testing API agrees."""

from __future__ import annotations

import contextlib
import io
import json
import unittest
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from schedspec.cli.main import main
from schedspec.testing import SchedulerContract

EXAMPLES = [
    ("examples.reserve_upfront:ReserveUpfrontScheduler", "examples.reserve_upfront:PromptOnlyReservation",
     {"block-table-covers-computed"}),
    ("examples.largest_victim:LargestVictimScheduler", "examples.largest_victim:StaleVictimPlan",
     {"preemption-resets", "scheduled-are-running"}),
    ("examples.batch_bound:BatchBoundScheduler", "examples.batch_bound:OverfullBatch", {"max-num-seqs-per-step"}),
]


def _case_id(x: object) -> str:
    """A test id that is the same in every process (a set's order depends on string hashing,
    which differs between pytest-xdist's workers)."""
    if isinstance(x, (set, frozenset)):
        return "+".join(sorted(x))
    return str(x).split(":")[-1]


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


@pytest.mark.parametrize("good,bad,caught_by", EXAMPLES, ids=_case_id)
def test_the_example_passes_the_safety_invariants(good: str, bad: str, caught_by: set[str], tmp_path: Path) -> None:
    rc, out = run(["check", "--against", good, "--mode", "invariants", "--steps", "1500", "--quiet",
                   "--out", str(tmp_path), "--json", str(tmp_path / "s.json")])
    assert rc == 0, out
    assert "invariants mode: no comparison with the spec" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["check"]["skipped"], "the example declares capabilities that skip invariants"
    assert summary["stats"]["steps"] >= 1500


@pytest.mark.parametrize("good,bad,caught_by", EXAMPLES, ids=_case_id)
def test_the_broken_variant_is_caught_with_a_short_counterexample(good: str, bad: str, caught_by: set[str],
                                                                  tmp_path: Path) -> None:
    rc, out = run(["check", "--against", bad, "--mode", "invariants", "--steps", "3000", "--quiet",
                   "--out", str(tmp_path), "--shrink-time", "20", "--json", str(tmp_path / "s.json")])
    assert rc == 1, out
    failure = json.loads((tmp_path / "s.json").read_text())["failure"]
    assert {v["id"] for v in failure["violations"]} & caught_by, failure
    trace = Path(failure["trace"])
    cx = json.loads((trace.parent / "summary.json").read_text())
    assert cx["steps"] <= 3, f"counterexample of {cx['steps']} steps"
    assert run(["replay", str(trace), "--against", bad])[0] == 1
    rc, out = run(["replay", str(trace), "--against", good])
    assert rc == 0 and "invariants mode" in out, out


def test_lockstep_with_the_spec_rejects_a_scheduler_of_another_policy(tmp_path: Path) -> None:
    """The default mode holds a scheduler to vLLM's policy too (the policy
    invariants, and the comparison with the spec): these examples do not follow it."""
    from schedspec.invariants import BY_ID

    rc, out = run(["check", "--against", EXAMPLES[1][0], "--steps", "500", "--quiet", "--out", str(tmp_path),
                   "--shrink-time", "5", "--json", str(tmp_path / "s.json")])
    assert rc == 1, out
    failure = json.loads((tmp_path / "s.json").read_text())["failure"]
    ids = {v["id"] for v in failure["violations"]}
    assert failure["kind"] == "divergence" or all(not BY_ID[i].is_safety for i in ids), failure


def test_the_testing_api_holds_an_example_to_the_safety_invariants() -> None:
    from examples.largest_victim import LargestVictimScheduler

    class TestLargestVictim(SchedulerContract):
        scheduler = LargestVictimScheduler
        mode = "invariants"
        hypothesis_settings = settings(max_examples=8, stateful_step_count=25, deadline=None, derandomize=True,
                                       suppress_health_check=list(HealthCheck))

    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(TestLargestVictim).run(result)
    assert result.testsRun == 1 and not result.failures and not result.errors, result.failures + result.errors


def test_a_per_step_batch_bound_and_keys_after_the_step_keep_the_default_safety_selection_silent(
        tmp_path: Path) -> None:
    """The nano-vllm-like example reads max_num_seqs as a bound on each step's batch (more requests
    run than that) and keys blocks in update(): the default selection of invariants mode is silent
    on it for thousands of steps, while vLLM's reading of the knob (max-num-seqs) fires."""
    rc, out = run(["check", "--against", EXAMPLES[2][0], "--mode", "invariants", "--steps", "4000", "--quiet",
                   "--out", str(tmp_path), "--json", str(tmp_path / "s.json")])
    assert rc == 0, out
    stats = json.loads((tmp_path / "s.json").read_text())["stats"]
    assert stats["steps"] >= 4000 and stats["preemptions"] > 0 and stats["hit_admissions"] > 0, stats
    rc, out = run(["check", "--against", EXAMPLES[2][0], "--mode", "invariants", "--invariants", "safety,max-num-seqs",
                   "--steps", "2000", "--quiet", "--out", str(tmp_path / "vllm"), "--shrink-time", "5"])
    assert rc == 1 and "[max-num-seqs]" in out, out


def _reserve_at_add_class() -> type:
    from examples.batch_bound import BatchBoundScheduler, Seq, StepEngine
    from schedspec.spec.interface import RequestSpec

    class Engine(StepEngine):
        """Takes a request's blocks when it arrives, if the pool has them, and holds them while it
        waits (vLLM takes them at admission)."""

        def submit(self, spec: RequestSpec) -> None:
            super().submit(spec)
            self.reserve(self.seqs[spec.request_id])

        def reserve(self, seq: Seq) -> None:
            need = self.blocks.needed(len(seq.tokens))
            if seq.state == "waiting" and not seq.blocks and need <= len(self.blocks.free):
                seq.blocks = [self.blocks.take_free() for _ in range(need)]

        def step(self) -> tuple[list[tuple[str, int, int, str]], list[str]]:
            # the reservations go back to the pool for the step (admission takes what it admits
            # again, the example's logic unchanged), and are renewed after it for those still waiting
            for sid in reversed(self.waiting):
                seq = self.seqs[sid]
                for b in reversed(seq.blocks):
                    self.blocks.ref[b] -= 1
                    if self.blocks.ref[b] == 0:
                        self.blocks.free.appendleft(b)
                seq.blocks = []
            out = super().step()
            for sid in self.waiting:
                self.reserve(self.seqs[sid])
            return out

    class ReserveAtAdd(BatchBoundScheduler):
        engine_cls = Engine

    return ReserveAtAdd


def test_blocks_taken_when_a_request_arrives_keep_the_safety_selection_silent(tmp_path: Path) -> None:
    """When a waiting request's blocks are taken is vLLM's policy (waiting-holds-no-blocks), not
    safety: a scheduler that takes them on arrival passes the default selection."""
    import sys
    import types

    mod = types.ModuleType("reserve_at_add_example")
    mod.ReserveAtAdd = _reserve_at_add_class()  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        rc, out = run(["check", "--against", "reserve_at_add_example:ReserveAtAdd", "--mode", "invariants",
                       "--steps", "2000", "--quiet", "--out", str(tmp_path)])
        assert rc == 0, out
        rc, out = run(["check", "--against", "reserve_at_add_example:ReserveAtAdd", "--mode", "invariants",
                       "--invariants", "safety,waiting-holds-no-blocks", "--steps", "2000", "--quiet",
                       "--shrink-time", "5", "--out", str(tmp_path / "vllm")])
        assert rc == 1 and "[waiting-holds-no-blocks]" in out, out
    finally:
        del sys.modules[mod.__name__]
