"""Effect coverage (spec/effects.py): each effect is counted on a crafted
workload where the producing rule's quantity is used by the later decision,
and not counted where the producer fires but nothing uses what it gave."""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import pytest

from schedspec.spec import SpecScheduler, StepResult
from schedspec.spec.coverage import parse_required
from schedspec.spec.effects import EFFECT_NAMES, EFFECTS, effect_counts, effects_reachable_in, effects_table, enable
from schedspec.spec.interface import Policy
from schedspec.spec.rule_names import RULES
from tests.helpers import cfg, req, step


def spec(**kw: object) -> SpecScheduler:
    s = SpecScheduler(cfg(**kw))
    assert enable(s)
    return s


def steps(s: SpecScheduler, n: int) -> None:
    for _ in range(n):
        step(s)


def test_the_catalogue_names_rules_that_exist() -> None:
    for e in EFFECTS.values():
        assert e.name.startswith("effect.") and e.description and "vllm" not in e.vllm.lower()[:0]
        assert e.producers and e.consumers and ".py" in e.vllm
        assert set(e.producers + e.consumers) <= set(RULES), e.name
        # an effect is reachable only where its producers are
        assert set(e.modes) <= {m for p in e.producers for m in RULES[p].modes}
    assert effects_reachable_in(("sync",)) == EFFECT_NAMES[:5]


def test_off_by_default_and_no_counts() -> None:
    s = SpecScheduler(cfg(num_blocks=4, block_size=4, max_model_len=12))
    assert s.effects is None
    s.add(req("a", 4, 8))
    s.add(req("b", [9] * 8, 8))
    steps(s, 3)
    assert s.rules["preempt.fcfs_tail"] and not any(k.startswith("effect.") for k in s.rules)


def test_preempted_blocks_reallocated() -> None:
    # a (1 block) needs a second block; the tail b is preempted and a takes one of its blocks
    s = spec(num_blocks=4, block_size=4, max_model_len=12)
    s.add(req("a", 4, 8))
    s.add(req("b", [9] * 8, 8))
    steps(s, 2)
    assert s.rules["preempt.fcfs_tail"] == 1 and s.rules["effect.preempted_blocks_reallocated"] == 1
    assert s.clone().effects is not s.effects  # a clone tracks on its own


def test_a_self_preemption_or_a_reset_whose_victim_alone_takes_its_blocks_back_is_not_counted() -> None:
    s = spec(num_blocks=4, block_size=4, max_model_len=12)
    s.add(req("a", 4, 8))
    s.add(req("b", 8, 8))  # shares a's block; preempts itself when a takes the last free one
    steps(s, 3)
    assert s.rules["preempt.self"] == 1 and s.rules["effect.preempted_blocks_reallocated"] == 0
    s = spec()
    s.add(req("a", 8, 8))
    step(s)
    assert s.reset_prefix_cache(reset_running_requests=True)
    steps(s, 2)
    assert s.rules["preempt.reset_running"] == 1 and s.rules["admit.resumed"] == 1
    assert s.rules["effect.preempted_blocks_reallocated"] == 0


def _three_running(q: int, r: int) -> SpecScheduler:
    s = spec(block_size=4, num_blocks=8, max_num_batched_tokens=8, policy=Policy.PRIORITY, max_model_len=28,
             long_prefill_token_threshold=4, scheduler_reserve_full_isl=False)
    s.add(req("q", q, 2, priority=1))
    step(s)
    s.add(req("p", 3, 12, priority=0))
    s.add(req("r", r, 2, priority=0))
    steps(s, 3)
    return s


def test_returned_budget_scheduled() -> None:
    # q (priority 1) is scheduled 4 tokens, then preempted by p's decode: r's chunk of 4 needs them
    s = _three_running(20, 20)
    assert s.rules["preempt.budget_give_back"] == 1 and s.rules["effect.returned_budget_scheduled"] == 1


def test_a_give_back_the_step_does_not_need_is_not_counted() -> None:
    # q's last chunk is short: the step fits without the victim's tokens
    s = _three_running(12, 21)
    assert s.rules["preempt.budget_give_back"] == 1 and s.rules["effect.returned_budget_scheduled"] == 0


def test_preempted_resume_hit_and_not_without_caching() -> None:
    for caching in (True, False):
        s = spec(num_blocks=4, block_size=4, max_model_len=12, enable_prefix_caching=caching,
                 scheduler_reserve_full_isl=False)
        s.add(req("a", 4, 2))
        s.add(req("b", [9] * 8, 2))  # b is preempted, a finishes, b resumes
        steps(s, 6)
        assert s.rules["preempt.fcfs_tail"] == 1 and s.rules["admit.resumed"] == 1
        assert s.rules["effect.preempted_resume_hit"] == (1 if caching else 0)


def test_finished_blocks_hit_within_the_next_step_only() -> None:
    for idle in (0, 1):
        s = spec()
        s.add(req("a", 9, 1))  # two full blocks cached, finished after its first step
        step(s)
        steps(s, idle)
        s.add(req("b", 9, 1))
        step(s)
        assert s.rules["stop.max_tokens"] >= 1 and s.rules["kv.touch_free"] >= 1
        assert s.rules["effect.finished_blocks_hit"] == (1 - idle)


def test_finished_blocks_reallocated_only_from_a_short_pool() -> None:
    for blocks, want in ((4, 1), (17, 0)):  # a large pool hands out blocks never used first
        s = spec(num_blocks=blocks, block_size=4, max_model_len=12)
        s.add(req("a", 8, 1))
        step(s)
        s.add(req("b", [9] * 8, 1))
        step(s)
        assert s.rules["stop.max_tokens"] >= 1 and s.rules["effect.finished_blocks_reallocated"] == want


def test_rollback_rescheduled_and_not_when_the_request_stops() -> None:
    for max_tokens, want in ((8, 1), (2, 0)):
        s = spec(num_speculative_tokens=2)
        s.add(req("a", 4, max_tokens))
        plan = s.schedule()
        s.update(plan, StepResult({"a": (7,)}, draft_token_ids={"a": (1, 2)}))
        plan = s.schedule()
        assert plan.scheduled[0].spec_token_ids == (1, 2)
        s.update(plan, StepResult({"a": (5,)}))  # both drafts rejected
        step(s)
        assert s.rules["spec.some_rejected"] == 1 and s.rules["effect.rollback_rescheduled"] == want


def test_placeholders_skip_and_not_when_far_from_max_tokens() -> None:
    for max_tokens, want in ((2, 1), (10, 0)):
        s = spec(async_scheduling=True)
        s.add(req("a", 4, max_tokens))
        first = s.schedule()
        second = s.schedule()
        s.update(first, StepResult({"a": (7,)}))
        s.schedule()
        assert s.rules["async.placeholders_added"] >= 1 and second.get("a") is not None
        assert s.rules["effect.placeholders_skip"] == want


def test_effects_count_like_rules_in_reports_and_requirements() -> None:
    assert parse_required("effect.finished_blocks_hit") == ("effect.finished_blocks_hit",)
    assert parse_required("effect") == EFFECT_NAMES == parse_required("effect.*")
    with pytest.raises(ValueError, match="unknown rule 'effect.nope'"):
        parse_required("effect.nope")
    counts = Counter({"effect.finished_blocks_hit": 3})
    table = effects_table(counts, ("sync",))
    assert "effect coverage: 1 of the 5 effects reachable observed" in table
    assert "effect.rollback_rescheduled" in table and "out of reach" in table and "NOT REACHED" in table
    assert effect_counts(counts)["effect.finished_blocks_hit"] == 3


def test_the_check_reports_and_requires_effects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from schedspec.cli.main import main

    out = tmp_path / "c.json"
    code = main(["check", "--against", "spec", "--steps", "300", "--plans-only", "--rules", "--json", str(out),
                 "--gates", "none", "--kv", "none", "--require-rules", "effect.returned_budget_scheduled,stop.eos",
                 "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert "effect coverage:" in text and "effect.finished_blocks_hit" in text
    report = json.loads(out.read_text())["effect_coverage"]
    assert report["reachable"] >= 5 and set(report["counts"]) == set(EFFECT_NAMES)
    assert report["counts"]["effect.finished_blocks_reallocated"] > 0
    assert code == 1 and "effect.returned_budget_scheduled" in text  # required, not observed in 300 steps


def test_the_guided_generator_aims_at_unobserved_effects() -> None:
    from schedspec.check.coverage_guided import RULE_HINTS, effect_focus, pick_mode
    from schedspec.check.gate import CheckSettings, make_workload

    assert set(EFFECT_NAMES) <= set(RULE_HINTS)
    counts = Counter({n: 60 for n in EFFECT_NAMES})
    assert effect_focus(counts, 0, ("sync",)) == ()
    counts["effect.preempted_resume_hit"] = 0
    counts["effect.rollback_rescheduled"] = 0  # out of reach in sync mode
    assert effect_focus(counts, 0, ("sync",)) == ("effect.preempted_resume_hit",)
    picks = Counter(effect_focus(Counter(), seed, ("sync",))[0] for seed in range(200))
    assert set(picks) == set(EFFECT_NAMES[:5])
    w = make_workload(CheckSettings(), 3, 50, counts)  # the check's workload names the effect it aims at
    assert "focus:effect.preempted_resume_hit" in w.features
    for seed in range(10):  # an effect of drafts draws a mode with drafts
        assert pick_mode(("sync", "spec"), ("effect.rollback_rescheduled",), random.Random(seed))[0] == "spec"


def test_the_docs_table_lists_every_effect() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "coverage.md").read_text()
    section = text[text.index("## Effect coverage"):text.index("## Shrinking")]
    rows = re.findall(r"^\| `(effect\.[a-z_]+)` \|", section, re.M)
    assert tuple(rows) == EFFECT_NAMES
    assert f"names {len(EFFECT_NAMES)} effects" in section and f"all {len(EFFECT_NAMES)} within" in section
    for name in EFFECT_NAMES:  # a rule the table names is one of the effect's
        row = next(line for line in section.splitlines() if line.startswith(f"| `{name}`"))
        named = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", row)) - {name}
        assert named <= set(EFFECTS[name].producers + EFFECTS[name].consumers), row
