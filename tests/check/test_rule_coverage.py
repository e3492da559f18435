"""Rule coverage: the catalogue matches the spec's markers, and the counts a
run reports are the branches it took."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from schedspec.spec import coverage
from schedspec.spec.interface import Policy, RequestSpec, SchedulerConfig, StepResult
from schedspec.spec.rule_names import RULE_NAMES, RULES, describe
from schedspec.spec.scheduler import SpecScheduler

SPEC = Path(__file__).resolve().parents[2] / "spec"
MARKED_FILES = ("scheduler.py", "kv_cache.py", "connector.py", "gates.py", "encoder.py", "async_drafts.py", "sessions.py")
NO_MUTATE_BLOCK = "# pragma: no mutate block"


def _functions(tree: ast.AST) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _markers(path: Path) -> list[tuple[str, int]]:
    """(name, line) of every rule a file counts (spec/coverage.py,
    CountsRules): each string in the arguments of a ``self._rule(...)`` call,
    each string a ``*_rules`` classifier yields, and the older
    ``self.rules["NAME"] += ...``."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_rule":
            names = [c for a in node.args for c in ast.walk(a) if isinstance(c, ast.Constant)
                     and isinstance(c.value, str)]
            assert names, f"{path.name}:{node.lineno}: a marker names its rule with a string literal"
            found.extend((c.value, c.lineno) for c in names)
        if not isinstance(node, ast.AugAssign) or not isinstance(node.target, ast.Subscript):
            continue
        t = node.target
        if isinstance(t.value, ast.Attribute) and t.value.attr == "rules":
            assert isinstance(node.op, ast.Add), f"{path.name}:{node.lineno}: a marker adds"
            assert isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str), (
                f"{path.name}:{node.lineno}: a marker names its rule with a string literal")
            found.append((t.slice.value, node.lineno))
    for fn in _functions(tree):
        if not fn.name.endswith("_rules"):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Yield, ast.YieldFrom)):
                assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str), (
                    f"{path.name}:{node.lineno}: a classifier yields rule names as string literals")
                found.append((node.value.value, node.lineno))
    return sorted(found, key=lambda m: m[1])


def _unmutated_lines(path: Path) -> set[int]:
    """The lines mutmut leaves alone: those marked ``# pragma: no mutate``,
    and every line of a function whose header says ``# pragma: no mutate
    block``."""
    lines = path.read_text().splitlines()
    out = {i for i, line in enumerate(lines, 1) if "# pragma: no mutate" in line}
    for fn in _functions(ast.parse(path.read_text())):
        header = fn.body[0].lineno - 1  # the line before the body (a docstring or the first statement)
        if any(NO_MUTATE_BLOCK in lines[i - 1] for i in range(fn.lineno, header + 1)):
            out.update(range(fn.lineno, (fn.end_lineno or fn.lineno) + 1))
    return out


def _all_markers() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for fname in MARKED_FILES:
        for name, line in _markers(SPEC / fname):
            out.setdefault(name, []).append(f"{fname}:{line}")
    return out


def test_every_marker_is_catalogued() -> None:
    unknown = {n: w for n, w in _all_markers().items() if n not in RULES}
    assert not unknown, f"markers without a catalogue entry in spec/rule_names.py: {unknown}"


def test_every_catalogued_rule_has_a_marker() -> None:
    marked = _all_markers()
    missing = [n for n in RULE_NAMES if n not in marked]
    assert not missing, f"catalogued rules with no marker in spec/{{{','.join(MARKED_FILES)}}}: {missing}"


def test_each_marker_appears_once() -> None:
    twice = {n: w for n, w in _all_markers().items() if len(w) > 1}
    assert not twice, f"a rule is marked in one place only: {twice}"


def test_markers_are_left_alone_by_mutation_testing() -> None:
    """A marker counts, it decides nothing: mutmut skips its line, and every
    line that hands a classifier's names to the counter."""
    for fname in MARKED_FILES:
        path = SPEC / fname
        skipped = _unmutated_lines(path)
        bare = [f"{fname}:{line}" for _, line in _markers(path) if line not in skipped]
        assert not bare, f"marker lines without '# pragma: no mutate': {bare}"
        counting = [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute) and n.func.attr in ("_rule", "_rules")]
        bare = [f"{fname}:{line}" for line in counting if line not in skipped]
        assert not bare, f"counting calls without '# pragma: no mutate': {bare}"


def test_classifiers_are_left_alone_by_mutation_testing() -> None:
    """A ``*_rules`` classifier computes rule names only: mutmut skips it whole."""
    for fname in MARKED_FILES:
        path = SPEC / fname
        skipped = _unmutated_lines(path)
        for fn in _functions(ast.parse(path.read_text())):
            if fn.name.endswith("_rules"):
                assert fn.lineno in skipped, f"{fname}:{fn.lineno}: {fn.name} without '{NO_MUTATE_BLOCK}'"


def test_catalogue_entries_say_what_and_where() -> None:
    for name in RULE_NAMES:
        r = RULES[name]
        assert r.description and r.vllm.split(",")[0].endswith(".py"), describe(name)
        assert "." in name and name == name.lower()


def test_the_scan_sees_a_marker_it_is_given(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text('class A:\n    def f(self):\n        self.rules["x.y"] += 1\n        self.rules["x.z"] += 2 > 1\n'
                   '        self._rule("x.a")\n        self._rule("x.b" if 1 else "x.c", 2 > 1)\n'
                   '        self._rules(f_rules())\n'
                   'def f_rules():  # pragma: no mutate block\n    yield "x.d"\n')
    assert _markers(src) == [("x.y", 3), ("x.z", 4), ("x.a", 5), ("x.b", 6), ("x.c", 6), ("x.d", 9)]
    assert _unmutated_lines(src) == {8, 9}


# ---------------------------------------------------------------- counting


def _cfg(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(num_blocks=9, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                                   max_model_len=16, enable_prefix_caching=True)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def _req(rid: str, n: int, **kw: object) -> RequestSpec:
    kw.setdefault("max_tokens", 8)
    return RequestSpec(request_id=rid, prompt_token_ids=tuple(range(1, n + 1)), **kw)  # type: ignore[arg-type]


def _step(s: SpecScheduler, token: int = 7) -> None:
    plan = s.schedule()
    s.update(plan, StepResult({e.request_id: (token,) for e in plan.scheduled if e.samples}))


def test_counts_follow_the_branches_taken() -> None:
    s = SpecScheduler(_cfg(max_num_batched_tokens=6))
    s.add(_req("a", 10, max_tokens=2))
    _step(s)  # a: chunk of 6 of 10
    c = coverage.counts_of(s)
    assert c is not None
    assert c["admit.new"] == 1 and c["admit.prefill_chunk"] == 1 and c["kv.miss"] == 1
    assert c["update.no_token"] == 1 and c["running.scheduled"] == 0
    _step(s)  # a: the last 4 tokens, samples
    _step(s)  # a: decode, then max_tokens
    assert c["running.scheduled"] == 2 and c["stop.max_tokens"] == 1
    assert c["kv.free_back"] == 2 and c["kv.free_front"] == 1  # two full keyed blocks, one partial
    s.add(_req("b", 10))
    _step(s)
    assert c["kv.hit_full"] == 1 and c["kv.touch_free"] == 2 and c["kv.hit_capped"] == 0
    s.abort("b")
    assert c["abort.running"] == 1 and c["abort.waiting"] == 0
    assert s.reset_prefix_cache() is True and c["kv.reset_ok"] == 1


def test_preemption_rules_by_policy() -> None:
    for policy, rule in ((Policy.FCFS, "preempt.fcfs_tail"), (Policy.PRIORITY, "preempt.priority_victim")):
        s = SpecScheduler(_cfg(num_blocks=5, policy=policy))
        s.add(_req("a", 7, priority=0))
        s.add(_req("b", 7, priority=1))
        for _ in range(4):
            _step(s)
        c = s.rules
        assert c[rule] >= 1 and c["preempt.fcfs_tail" if rule != "preempt.fcfs_tail" else "preempt.priority_victim"] == 0
        assert c["schedule.waiting_skipped"] >= 1


def test_clones_share_the_counter_and_attach_separates() -> None:
    s = SpecScheduler(_cfg())
    s.add(_req("a", 5))
    c = s.clone()
    assert c.rules is s.rules and c.kv.rules is s.rules
    before = coverage.snapshot(s.rules)
    _step(c)
    d = coverage.delta(s.rules, before)
    assert d["admit.new"] == 1 and "abort.running" not in d
    own = coverage.new_counts()
    coverage.attach(c, own)
    c.abort("a")
    assert coverage.snapshot(own) == {"abort.running": 1, "kv.free_front": 1, "kv.free_back": 1}
    assert s.rules["abort.running"] == 0


def test_unreached_and_required_names() -> None:
    counts = Counter({"admit.new": 3, "kv.miss": 1})
    assert coverage.reached(counts) == ["admit.new", "kv.miss"]
    assert "admit.resumed" in coverage.unreached(counts) and "admit.new" not in coverage.unreached(counts)
    assert coverage.unreached(counts, ["admit.new"], at_least=4) == ["admit.new"]
    from schedspec.spec.rule_names import ALL_MODES, reachable_in

    assert coverage.parse_required("all") == reachable_in(ALL_MODES)
    assert "admit.new" in coverage.parse_required("all", ("sync",))
    assert "async.stale_output" not in coverage.parse_required("all", ("sync",))
    assert "async.stale_output" in coverage.parse_required("all", ("sync", "async"))
    assert coverage.parse_required("admit.new, stop") == ("admit.new",) + tuple(
        n for n in RULE_NAMES if n.startswith("stop."))
    assert coverage.parse_required("kv.*") == tuple(n for n in RULE_NAMES if n.startswith("kv."))
    with pytest.raises(ValueError, match="unknown rule 'admit.nope'"):
        coverage.parse_required("admit.nope")
    with pytest.raises(ValueError, match="no rule named"):
        coverage.parse_required(" , ")
    table = coverage.format_table(counts, modes=("sync",))
    sync = reachable_in(("sync",))
    assert table.splitlines()[0] == (f"rule coverage: 2 of the {len(sync)} rules reachable in sync reached "
                                     f"({len(RULE_NAMES) - len(sync)} out of reach there)")
    rows = {line.split()[0]: line.split(None, 2)[2] for line in table.splitlines()[1:] if len(line.split()) > 2}
    assert rows["admit.resumed"] == "NOT REACHED" and rows["async.stale_output"] == "out of reach"
    assert "admit.new" not in rows
    assert coverage.as_dict(counts)["admit.new"] == 3
    line = coverage.rules_line(counts, modes=("sync",))
    assert "never reached: schedule.threshold_active" in line and "async." not in line
    every = Counter({n: 5 for n in sync})
    every["kv.miss"] = 1
    assert coverage.rules_line(every, k=1, modes=("sync",)).endswith("; rarest: kv.miss 1")
    assert coverage.rarest(counts, 1)[0][1] == 0


# ---------------------------------------------------------------- reporting


def test_the_gate_counts_the_reference_and_fails_on_required_rules(tmp_path: Path) -> None:
    from schedspec.check.gate import CheckSettings, check_summary, junit_xml, run_check
    from schedspec.impl.scheduler import ImplScheduler

    factories = {"spec": SpecScheduler, "impl": ImplScheduler}
    settings = CheckSettings(against="impl", total_steps=200, out_dir=tmp_path,
                             require_rules=("admit.new", "abort.preempted"))
    o = run_check(factories, settings)  # type: ignore[arg-type]
    assert o.failure is None and o.stats.rules["admit.new"] > 0
    # only the reference counts: the impl keeps no rule counter
    assert o.stats.rules["admit.new"] == o.stats.admissions - o.stats.rules["admit.resumed"]
    missing = tuple(coverage.unreached(o.stats.rules, settings.require_rules))
    assert o.missing_rules == missing and o.ok == (not missing)
    summary = check_summary(settings, o)
    assert summary["rule_coverage"]["counts"]["admit.new"] == o.stats.rules["admit.new"]
    assert summary["rule_coverage"]["required_unreached"] == list(missing)
    assert summary["result"] == ("pass" if not missing else "fail")
    xml = junit_xml(settings, o)
    assert f'<property name="rule.admit.new" value="{o.stats.rules["admit.new"]}"/>' in xml
    assert f'<property name="rules.total" value="{len(RULE_NAMES)}"/>' in xml


def test_check_cli_require_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main

    out = tmp_path / "s.json"
    rc = main(["check", "--steps", "100", "--kv", "none", "--quiet", "--require-rules", "admit.new,stop", "--json", str(out),
               "--out", str(tmp_path)])
    text = capsys.readouterr().out
    import json
    summary = json.loads(out.read_text())
    required_unreached = summary["rule_coverage"]["required_unreached"]
    assert rc == (1 if required_unreached else 0)
    assert "rule coverage:" in text
    if required_unreached:
        assert f"never reached: {', '.join(required_unreached)}" in text
    rc = main(["check", "--steps", "1", "--quiet", "--require-rules", "all"])
    assert rc == 1 and "required rule(s) never reached" in capsys.readouterr().out
    assert main(["check", "--steps", "10", "--quiet", "--require-rules", "admit.nope"]) == 2
    assert "--require-rules: unknown rule 'admit.nope'" in capsys.readouterr().err
    assert main(["check", "--steps", "10", "--quiet", "--modes", "sync,warp"]) == 2
    assert "--modes: unknown mode 'warp'" in capsys.readouterr().err
    out2 = tmp_path / "r.json"
    assert main(["check", "--steps", "200", "--workload-steps", "200", "--quiet", "--generator", "random",
                 "--modes", "sync", "--gates", "none", "--kv", "none", "--json", str(out2)]) == 0
    from schedspec.check.driver import Runner
    from schedspec.check.random_workloads import random_workload

    alone = Runner(random_workload(0, 200).config, {"spec": SpecScheduler}, oracle_seed=0)
    assert alone.run(random_workload(0, 200).events) is None
    assert json.loads(out2.read_text())["rule_coverage"]["counts"] == coverage.as_dict(alone.primary.rules)  # type: ignore[attr-defined]


def test_the_state_machine_tallies_rule_coverage() -> None:
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from schedspec.testing.stateful import RunTally, make_machine

    tally = RunTally()
    machine = make_machine({"spec": SpecScheduler}, tally=tally, name="RuleMachine")
    run_state_machine_as_test(machine, settings=settings(max_examples=15, stateful_step_count=20, deadline=None,
                                                         derandomize=True, database=None))
    assert tally.all_runs >= 15
    assert tally.rules["admit.new"] > 0 and tally.rules["running.scheduled"] > 0
    assert tally.unreached_rules() == coverage.unreached(tally.rules)


# ---------------------------------------------------------------- guided generation


def test_guided_workloads_are_a_function_of_seed_and_focus() -> None:
    from schedspec.check.coverage_guided import guided_workload

    a = guided_workload(5, 60, focus=("abort.preempted",))
    assert a == guided_workload(5, 60, focus=("abort.preempted",))
    assert a.num_steps == 60 and "focus:abort.preempted" in a.features
    assert {"aborts", "tight_pool", "long_prompts"} <= set(a.features)
    b = guided_workload(5, 60, focus=("kv.hit_full",))
    assert "no_caching" not in b.features and b.config.enable_prefix_caching


def test_focus_prefers_the_rules_reached_least() -> None:
    from schedspec.check.coverage_guided import choose_focus

    counts = Counter({n: 60 for n in RULE_NAMES})
    assert choose_focus(counts, 0) == ()
    counts["abort.preempted"] = 0
    counts["stop.eos"] = 3
    picks = [choose_focus(counts, seed, k=1) for seed in range(200)]
    assert picks == [choose_focus(counts, seed, k=1) for seed in range(200)]  # seeded
    assert {p[0] for p in picks} == {"abort.preempted", "stop.eos"}
    assert sum(p == ("abort.preempted",) for p in picks) > sum(p == ("stop.eos",) for p in picks)
    assert set(choose_focus(counts, 0, k=3)) == {"abort.preempted", "stop.eos"}


def test_a_focus_rule_of_async_scheduling_draws_an_async_mode() -> None:
    import random

    from schedspec.check.coverage_guided import pick_mode

    modes = ("sync", "async", "spec", "async-spec")
    for seed in range(20):
        mode, k = pick_mode(modes, ("async.stale_output",), random.Random(seed))
        assert mode.startswith("async") and (k > 0) == (mode == "async-spec")
        assert pick_mode(("sync",), ("async.stale_output",), random.Random(seed)) == ("sync", 0)


def test_the_default_check_reaches_every_rule_of_its_mode() -> None:
    from schedspec.check.gate import CheckSettings, run_check
    from schedspec.spec.rule_names import reachable_in

    settings = CheckSettings(plans_only=True, require_rules=reachable_in(("sync",)))
    o = run_check({"spec": SpecScheduler}, settings)
    assert o.steps == 2000 and o.failure is None
    assert o.missing_rules == (), coverage.rules_line(o.stats.rules)
    again = run_check({"spec": SpecScheduler}, settings)
    assert again.stats.rules == o.stats.rules  # reproducible by seed


def test_guided_workloads_in_every_mode_reach_every_rule_they_can() -> None:
    from schedspec.check.coverage_guided import choose_focus, guided_workload
    from schedspec.check.driver import Runner
    from schedspec.spec.rule_names import reachable_in

    modes = ("sync", "async", "spec", "async-spec")
    names = reachable_in(modes)
    total: Counter[str] = Counter()
    steps = 0
    for seed in range(10):
        w = guided_workload(seed, 200, focus=choose_focus(total, seed, names=names), modes=modes)
        r = Runner(w.config, {"spec": SpecScheduler}, oracle_seed=seed, check_invariants=False,
                   compare_views=False)
        assert r.run(w.events) is None
        counts = coverage.counts_of(r.primary)
        assert counts is not None
        coverage.merge(total, counts)
        steps += r.stats.steps
    assert steps == 2000
    assert coverage.unreached(total, names) == []


def test_require_all_means_every_rule_the_supported_modes_can_reach() -> None:
    from schedspec.check.gate import CheckSettings, run_check
    from schedspec.check.rule_reach import required_rules
    from schedspec.spec.rule_names import ALL_MODES, reachable_in

    sync_only = CheckSettings(total_steps=1, plans_only=True, require_all=True)
    assert required_rules(sync_only) == reachable_in(("sync",))
    o = run_check({"spec": SpecScheduler}, sync_only)
    assert o.missing_rules and set(o.missing_rules) <= set(reachable_in(("sync",)))
    named = CheckSettings(require_rules=("async.stale_output",), require_all=True, modes=ALL_MODES)
    assert required_rules(named)[0] == "async.stale_output"
    assert set(required_rules(named)) <= set(reachable_in(ALL_MODES))


def test_a_failing_guided_workload_is_named_by_its_features_and_focus() -> None:
    from schedspec.check.coverage_guided import guided_workload
    from schedspec.check.gate import workload_label
    from schedspec.check.workload import Workload

    w = guided_workload(3, 20, focus=("stop.eos",))
    label = workload_label(w)
    assert label.startswith(" (guided: ") and label.endswith("focus:stop.eos)") and "eos" in label
    assert workload_label(Workload(w.config, w.events)) == ""
