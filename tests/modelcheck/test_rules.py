"""Rule coverage of the model checker: the small bound takes every rule of
the spec that sync scheduling can reach (spec/rule_names.py), each space
reaches the rules docs/modelcheck.md says it does, and ``--require-rules``
fails a run that misses one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schedspec.check import trace as tracefile
from schedspec.cli.main import main
from schedspec.modelcheck import BoundResult, Expander, Explorer, bound, check_bound
from schedspec.modelcheck.events import STEP
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.rule_names import reachable_in

ROOT = Path(__file__).resolve().parents[2]


def _small() -> BoundResult:
    res = check_bound("small", use_impl=False, invariants=(), workers=1)
    assert res.failure is None
    return res


def _space_rules(res: BoundResult | None = None) -> dict[str, set[str]]:
    res = res if res is not None else _small()
    return {r.space.name: set(rule_coverage.reached(r.rules)) for r in res.spaces}


@pytest.fixture(scope="module")
def small() -> BoundResult:
    return _small()


@pytest.fixture(scope="module")
def space_rules(small: BoundResult) -> dict[str, set[str]]:
    return _space_rules(small)


def test_the_small_bound_keeps_its_documented_state_count(small: BoundResult) -> None:
    # docs/modelcheck.md, "The bounds": 13 spaces, 59,989 states and 216,584
    # transitions (the admission gates add nothing to a space without them;
    # fcfs-cache-stream-1req: 3,768 and 15,408; priority-nocache-3seqs-giveback:
    # 9,360 and 23,160; the first nine 48,546 and 186,144, the four KV and
    # gate spaces 11,443 and 30,440)
    assert (len(small.spaces), small.states, small.transitions) == (13, 59989, 216584)
    first_nine = small.spaces[:9]
    assert (sum(r.states for r in first_nine), sum(r.transitions for r in first_nine)) == (48546, 186144)


def test_the_small_bound_reaches_every_rule_of_sync_scheduling(space_rules: dict[str, set[str]]) -> None:
    reached = set().union(*space_rules.values())
    missing = [n for n in reachable_in(["sync"]) if n not in reached]
    assert not missing, f"rules the small bound never reaches: {missing} (add or change a space: docs/modelcheck.md)"


def test_each_space_reaches_the_rules_the_docs_give_it(space_rules: dict[str, set[str]]) -> None:
    # docs/modelcheck.md, "Rule coverage": the rules only this space reaches in the small bound.
    doc = (ROOT / "docs" / "modelcheck.md").read_text()
    section = doc.split("## Rule coverage", 1)[1].split("\n## ", 1)[0]
    claimed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] in space_rules:
            claimed[cells[0]] = {c.strip().strip("`") for c in cells[1].split(",") if c.strip() and c.strip() != "-"}
    assert set(claimed) == set(space_rules), "docs/modelcheck.md names every small space once"
    for name, rules in claimed.items():
        others = set().union(*(v for k, v in space_rules.items() if k != name))
        assert rules == space_rules[name] - others, name


def test_require_rules_fails_a_run_that_misses_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mc.json"
    argv = ["modelcheck", "--space", "fcfs-cache-salt-tight", "--no-impl", "--quiet", "--workers", "1",
            "--json", str(out)]
    assert main([*argv, "--require-rules", "stop.eos,kv.hit_full"]) == 1
    text = capsys.readouterr().out
    assert "FAILED: 1 required rule(s) never reached: stop.eos" in text
    data = json.loads(out.read_text())
    assert data["rules_missing"] == ["stop.eos"] and data["rules"]["kv.hit_full"] > 0
    assert main([*argv, "--require-rules", "kv.hit_full", "--rules"]) == 0
    assert "rule coverage:" in capsys.readouterr().out
    assert main([*argv, "--require-rules", "no.such.rule"]) == 2
    assert "--require-rules" in capsys.readouterr().err


def test_an_abort_mid_step_is_explored_and_replays(tmp_path: Path) -> None:
    space = next(s for s in bound("small").spaces if s.name == "fcfs-nochunk-eos-abortstep")
    ex = Expander(space)
    a = ex.alphabet
    codes = [a.add(0), a.step_abort(0), STEP.value]
    assert a.label(codes[1]) == "step, abort #0 mid-step"
    wl = ex.workload(codes)
    assert [type(e).__name__ for e in wl.events] == ["AddRequest", "Schedule", "Abort", "Update", "Step"]
    path = tmp_path / "t.jsonl"
    tracefile.write(path, tracefile.Trace(wl, vocab=space.vocab, oracle_seed=space.oracle_seed))
    assert main(["replay", str(path), "--against", "impl"]) == 0
    r = Explorer(space, max_states=300).run()
    assert r.failure is None and r.rules["update.request_gone"] > 0


def test_rule_counts_do_not_depend_on_the_workers() -> None:
    space = next(s for s in bound("small").spaces if s.name == "fcfs-nochunk-eos-abortstep")
    one = Explorer(space, invariants=(), workers=1).run()
    two = Explorer(space, invariants=(), workers=2).run()
    assert (one.states, one.transitions) == (two.states, two.transitions)
    assert one.rules == two.rules and one.rules["update.request_gone"] > 0


def test_the_small_bound_observes_every_effect_of_sync_scheduling(small: BoundResult) -> None:
    # docs/modelcheck.md, "Rule coverage": every sync effect, the one needing
    # three running requests in priority-nocache-3seqs-giveback alone
    from schedspec.spec.effects import effect_counts, effects_reachable_in

    counts = effect_counts(small.rules)
    sync = effects_reachable_in(("sync",))
    assert len(sync) == 5
    missing = [n for n in sync if counts[n] == 0]
    assert not missing, f"effects the small bound never observes: {missing} (add or change a space: docs/modelcheck.md)"
    assert all(r.as_dict()["effects"] == effect_counts(r.rules) for r in small.spaces)
    by_space = {r.space.name: r.rules["effect.returned_budget_scheduled"] for r in small.spaces}
    assert [n for n, c in by_space.items() if c] == ["priority-nocache-3seqs-giveback"], by_space
