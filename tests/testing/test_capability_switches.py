"""A capability switch says on, off or either: True draws the feature on and off, False never on,
ALWAYS never off (a scheduler that always caches can say so, and is never built without it)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from examples.batch_bound import BatchBoundScheduler
from schedspec.check.capabilities import ALWAYS, Capabilities, CapabilityError
from schedspec.cli.main import main
from schedspec.modelcheck import bound, space_problems
from schedspec.spec.interface import SchedulerConfig

CFG = SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32,
                      enable_prefix_caching=False, enable_chunked_prefill=False)


class AlwaysCaching(BatchBoundScheduler):
    """The nano-vllm-like example with a cache it cannot turn off."""

    CAPABILITIES = dataclasses.replace(BatchBoundScheduler.CAPABILITIES, prefix_caching=ALWAYS)

    def __init__(self, config: SchedulerConfig) -> None:
        if not config.enable_prefix_caching:
            raise ValueError("this scheduler always caches")
        super().__init__(config)


@pytest.mark.parametrize("switch,field,off,on", [
    ("prefix_caching", "enable_prefix_caching", False, True),
    ("chunked_prefill", "enable_chunked_prefill", False, True),
    ("long_prefill_threshold", "long_prefill_token_threshold", 0, 16),
])
def test_always_draws_the_switch_on_only(switch: str, field: str, off: object, on: object) -> None:
    caps = Capabilities(**{switch: ALWAYS})
    assert caps.config_problems(dataclasses.replace(CFG, **{field: on})) == []
    assert caps.config_problems(dataclasses.replace(CFG, **{field: off})) == [f"{field}={off}"]
    restricted = caps.restrict_config(dataclasses.replace(CFG, **{field: off}))
    assert getattr(restricted, field) and not caps.config_problems(restricted)
    assert switch in caps.names(), "the invariants needing the switch still run"
    either = Capabilities(**{switch: True})
    assert either.config_problems(dataclasses.replace(CFG, **{field: off})) == []


def test_a_switch_is_true_false_or_always() -> None:
    with pytest.raises(CapabilityError, match="prefix_caching must be True .* got 'on'"):
        Capabilities(prefix_caching="on")  # type: ignore[arg-type]


def test_a_scheduler_that_always_caches_passes_the_check_and_modelcheck_leaves_out_the_spaces_without(
        tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["check", "--against", f"{__name__}:AlwaysCaching", "--mode", "invariants", "--steps", "600",
                   "--quiet", "--out", str(tmp_path), "--json", str(tmp_path / "s.json")])
    assert rc == 0, out.getvalue()
    assert json.loads((tmp_path / "s.json").read_text())["stats"]["hit_admissions"] > 0
    caps = AlwaysCaching.CAPABILITIES
    problems = {s.name: space_problems(s, caps) for s in bound("small").spaces}
    assert any("enable_prefix_caching=False" in p for ps in problems.values() for p in ps), problems


def test_the_failure_header_and_the_rule_coverage_line_count_only_what_the_capabilities_allow(tmp_path: Path) -> None:
    """The FCFS-only example without chunked prefill: no workload feature it cannot be given
    (priority, a threshold, resets) in a failure's header, no rule it cannot take (PRIORITY's
    victims, prefill chunks, resets) counted or listed as never reached."""
    from schedspec.check.capabilities import rules_within
    from schedspec.spec.rule_names import reachable_in

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["check", "--against", "examples.batch_bound:OverfullBatch", "--mode", "invariants", "--steps",
                   "3000", "--out", str(tmp_path), "--shrink-time", "5", "--json", str(tmp_path / "s.json")])
    text = out.getvalue()
    assert rc == 1, text
    header = next(line for line in text.splitlines() if line.startswith("FAILED on workload seed"))
    features = header.split("(guided: ", 1)[1].split(")", 1)[0].split(", ")
    assert not {"priority", "rising_priority", "threshold", "resets", "reset_running"} & set(features), header
    caps = BatchBoundScheduler.CAPABILITIES
    names = rules_within(caps, reachable_in(("sync",)))
    assert not {"preempt.priority_victim", "running.prefill_chunk", "kv.reset_ok"} & set(names)
    line = next(line for line in text.splitlines() if line.startswith("rule coverage:"))
    assert f"of the {len(names)} rules reachable in sync within the declared capabilities" in line, line
    for rule in ("preempt.priority_victim", "running.prefill_chunk", "kv.reset_ok", "schedule.threshold_active"):
        assert rule not in line, line
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["rule_coverage"]["reachable"] == len(names)
    assert not {"priority", "threshold"} & set(summary["failure"]["workload_features"])


def test_modelcheck_counts_only_the_rules_the_capabilities_allow(tmp_path: Path) -> None:
    from schedspec.check.capabilities import rules_within
    from schedspec.spec.rule_names import reachable_in

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["modelcheck", "--against", "examples.batch_bound:BatchBoundScheduler", "--mode", "invariants",
                   "--quiet", "--workers", "1", "--out", str(tmp_path)])
    text = out.getvalue()
    assert rc == 0, text
    n = len(rules_within(BatchBoundScheduler.CAPABILITIES, reachable_in(("sync",))))
    line = next(line for line in text.splitlines() if line.startswith("rule coverage:"))
    assert f"of the {n} rules reachable in sync mode within the declared capabilities reached" in line, line
    assert "preempt.priority_victim" not in line and "kv.reset_ok" not in line, line
    assert "copied by deepcopy" not in text, "one worker was asked for: no reason to give"
