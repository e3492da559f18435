"""The reference's own defects are never the candidate's failure: a workload
turned to the mode a scheduler supports is steered around the documented
vLLM defects again (check/defects.py, ``steer``); a run whose reference meets
one anyway names it, counts it apart and goes on (``--strict-defects``: it
fails), and a failure first seen in the reference is reported as the
reference's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from schedspec.check import gate
from schedspec.check.capabilities import Capabilities
from schedspec.check.defects import (
    DEFECTS,
    describe,
    draws,
    failure_reports,
    known_defect,
    steer,
)
from schedspec.check.gate import CheckSettings, check_summary, junit_xml, run_check
from schedspec.check.random_workloads import random_workload
from schedspec.check.run import failure_of
from schedspec.check.workload import Abort, AddRequest, Event, KVLoadDone, KVLoadFailed, Step, Workload
from schedspec.impl import ImplScheduler
from schedspec.spec.interface import RequestSpec, SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler

#: vLLM 0.33's AsyncScheduler and Scheduler as declarations (what the
#: adapter gives a subclass of each: vllm_adapter.vllm_capabilities)
ASYNC_ONLY = Capabilities(async_scheduling=True, speculative_decoding=True,
                          sync_scheduling=False).with_gates().with_kv()
SYNC_ONLY = Capabilities(speculative_decoding=True).with_gates().with_kv()

#: the shrunk counterexample ``check --against`` an unmodified AsyncScheduler
#: subclass reported "in spec" from --seed 14 (workload seed 25): a
#: synchronous load reported failed under async scheduling leaves a -1
#: placeholder that no output fills ("stale-placeholder-after-failed-sync-load")
STALE = SchedulerConfig(async_scheduling=True, block_size=1, enable_prefix_caching=True, kv_connector=True,
                        kv_load_failure_policy="recompute", max_model_len=16, max_num_batched_tokens=16,
                        max_num_seqs=1, num_blocks=18, num_speculative_tokens=2)
R56 = RequestSpec("r56", (4, 14), 1, arrival=56, kv_external_tokens=1)
STALE_EVENTS: tuple[Event, ...] = (AddRequest(R56), KVLoadFailed("r56"), Step(), Step(), Step())


def test_the_shrunk_counterexample_fails_on_the_spec_with_the_stale_placeholder() -> None:
    failure = failure_of(Workload(STALE, STALE_EVENTS), {"spec": SpecScheduler})
    assert failure is not None and [v.invariant_id for v in failure.violations] == ["kv-context"]
    defect = known_defect(STALE, STALE_EVENTS, failure_reports(failure.kind, ["kv-context"]))
    assert defect is not None and defect.name == "stale-placeholder-after-failed-sync-load"
    assert describe(defect).startswith("known vLLM 0.33 defect: A stale output placeholder after a failed "
                                       "synchronous load, docs/divergences.md")
    # the same events in sync mode hold no defect; another report is not it
    sync = dataclasses.replace(STALE, async_scheduling=False)
    assert known_defect(sync, STALE_EVENTS, {"kv-context"}) is None
    assert known_defect(STALE, STALE_EVENTS, {"progress"}) is None
    assert failure_reports("stall", ()) == {"stall"}


def test_every_defect_is_matched_by_what_reports_it() -> None:
    for d in DEFECTS:
        assert d.reports, d.name
        assert d.reported_by.split(" ")[0] in d.reports | {"a"}, d.name


def test_an_async_only_declaration_draws_async_modes_only() -> None:
    assert ASYNC_ONLY.drawable_modes(("sync", "async", "spec", "async-spec")) == ("async", "async-spec")
    assert ASYNC_ONLY.drawable_modes(("sync",)) == ("async",)
    assert SYNC_ONLY.drawable_modes(("sync", "async", "spec", "async-spec")) == ("sync", "spec")
    assert gate.CheckSettings(capabilities=ASYNC_ONLY, modes=("sync", "spec")).drawn_modes == ("async",)


def test_a_sync_workload_turned_async_is_steered_around_the_defect() -> None:
    sync = Workload(dataclasses.replace(STALE, async_scheduling=False), STALE_EVENTS)
    turned = ASYNC_ONLY.restrict_workload(sync)
    assert turned.config.async_scheduling
    assert not any(isinstance(e, KVLoadFailed) for e in turned.events)
    assert failure_of(turned, {"spec": SpecScheduler}) is None


def test_steer_takes_out_each_avoided_draw() -> None:
    cfg = SchedulerConfig(block_size=2, num_blocks=40, max_model_len=32, max_num_batched_tokens=32,
                          kv_connector=True, kv_load_failure_policy="fail")
    one = RequestSpec("one", (5,), 1, kv_external_tokens=1, kv_load_async=True)  # one-token-async-load
    sync = RequestSpec("s", (1, 2, 3), 1, kv_external_tokens=2)  # shared-invalid-block-holder-aborted
    events: list[Event] = [AddRequest(one), KVLoadDone("one"), AddRequest(sync), KVLoadFailed("s", 0), Step(),
                           Abort("s"), Step()]
    out = steer(events, cfg)
    assert out[0] == AddRequest(dataclasses.replace(one, kv_external_tokens=0, kv_load_async=False))
    assert KVLoadDone("one") not in out and Abort("s") not in out and KVLoadFailed("s", 0) in out
    for d in DEFECTS:
        # every steered draw gone (a witnessed-only record is named when met, never steered)
        assert not d.knobs or not draws(d, cfg, out), d.name
    # a failure at a block under recompute with a sliding window fails the load as a whole
    from schedspec.spec.interface import KVCacheGroup
    window = dataclasses.replace(cfg, kv_load_failure_policy="recompute",
                                 kv_cache_groups=(KVCacheGroup("sliding_window", sliding_window=4),))
    a = RequestSpec("a", tuple(range(1, 9)), 1, kv_external_tokens=4, kv_load_async=True)
    assert steer([AddRequest(a), KVLoadFailed("a", 1)], window) == (AddRequest(a), KVLoadFailed("a", None))


@pytest.mark.parametrize("seed", range(8))
def test_steer_is_the_identity_on_what_the_generators_drew(seed: int) -> None:
    from schedspec.check.coverage_guided import guided_workload
    from schedspec.check.features import GATES, KV_FEATURES, MODES

    for w in (random_workload(seed, 120, modes=MODES, kv=KV_FEATURES),
              guided_workload(seed, 120, modes=MODES, gates=GATES, kv=KV_FEATURES)):
        assert steer(w.events, w.config) == w.events


def _settings(tmp_path: Path, **kw: Any) -> CheckSettings:
    every = Capabilities(async_scheduling=True, speculative_decoding=True).with_gates().with_kv()
    return CheckSettings(against="impl", total_steps=30, workload_steps=30, out_dir=tmp_path,
                         shrink_time=5.0, capabilities=every, **kw)


def _defect_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's first workload: the stale placeholder, as it was drawn
    (the generator is not asked again); the next ones as usual."""
    real = gate.make_workload
    calls: list[int] = []

    def make(settings: CheckSettings, seed: int, n: int, counts: Any, core: bool = False, swarm: int = -1) -> Workload:
        calls.append(seed)
        return Workload(STALE, STALE_EVENTS, seed=seed) if len(calls) == 1 else real(settings, seed, n, counts, core, swarm)

    monkeypatch.setattr(gate, "make_workload", make)


def test_a_known_defect_met_by_the_reference_is_counted_apart_and_the_run_goes_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _defect_first(monkeypatch)
    settings = _settings(tmp_path)
    lines: list[str] = []
    outcome = run_check({"spec": SpecScheduler, "impl": ImplScheduler}, settings, notice=lines.append)
    assert outcome.ok and outcome.workloads >= 2 and outcome.steps >= 30
    assert [h.defect.name for h in outcome.known_defects] == ["stale-placeholder-after-failed-sync-load"]
    assert any("known vLLM 0.33 defect: A stale output placeholder" in line and "going on" in line
               for line in lines)
    summary = check_summary(settings, outcome)
    assert summary["result"] == "pass"
    assert summary["known_defects"][0]["defect"] == "stale-placeholder-after-failed-sync-load"
    assert "known vLLM 0.33 defects met" in gate.known_defect_line(outcome.known_defects)


def test_strict_defects_makes_the_hit_fatal_and_names_it_as_the_references(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _defect_first(monkeypatch)
    settings = _settings(tmp_path, strict_defects=True)
    outcome = run_check({"spec": SpecScheduler, "impl": ImplScheduler}, settings)
    assert outcome.failure is not None and outcome.reference_failed
    assert outcome.defect is not None and outcome.defect.name == "stale-placeholder-after-failed-sync-load"
    line = gate.reference_line(outcome, "impl")
    assert "not a failure of impl" in line and "known vLLM 0.33 defect" in line
    failure = check_summary(settings, outcome)["failure"]
    assert failure["culprit"] == "reference" and failure["known_defect"] == "stale-placeholder-after-failed-sync-load"
    assert "not a failure of impl" in junit_xml(settings, outcome)


class _BrokenReference(SpecScheduler):
    """A scheduler that raises at its 6th schedule(): what a bug of ours in
    the spec looks like to a check when it is the reference."""

    calls = 0

    def schedule(self) -> Any:
        self.calls += 1
        if self.calls == 6:
            raise AssertionError("the reference's own bug")
        return super().schedule()


def test_a_failure_first_seen_in_the_reference_is_never_the_candidates(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    outcome = run_check({"spec": _BrokenReference, "impl": ImplScheduler}, settings)
    assert outcome.failure is not None and outcome.failure.scheduler == "spec"
    assert outcome.reference_failed and outcome.defect is None and not outcome.known_defects
    assert "a bug of schedspec" in gate.reference_line(outcome, "impl")
    assert check_summary(settings, outcome)["failure"]["culprit"] == "reference"
    # a failure of the candidate stays the candidate's
    outcome = run_check({"spec": SpecScheduler, "impl": _BrokenReference}, settings)
    assert outcome.failure is not None and not outcome.reference_failed
    assert check_summary(settings, outcome)["failure"]["culprit"] == "candidate"
    json.dumps(check_summary(settings, outcome))


def test_the_command_line_counts_a_known_defect_apart_and_strict_defects_fails_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main

    argv = ["check", "--against", "impl", "--steps", "30", "--workload-steps", "30", "--quiet",
            "--out", str(tmp_path), "--json", str(tmp_path / "s.json")]
    _defect_first(monkeypatch)
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "known vLLM 0.33 defects met (counted apart, docs/divergences.md): 1 workload(s): " \
           "stale-placeholder-after-failed-sync-load x1" in out.out
    assert "known vLLM 0.33 defect: A stale output placeholder" in out.err
    assert json.loads((tmp_path / "s.json").read_text())["known_defects"][0]["workload_seed"] == 0
    _defect_first(monkeypatch)
    assert main([*argv, "--strict-defects"]) == 1
    out = capsys.readouterr()
    assert "the reference (the spec) failed first, on a known vLLM 0.33 defect" in out.out
    assert "not a failure of impl" in out.out
