"""The rule-coverage helpers of spec/coverage.py: which rules a run can
reach, the counts it kept, and the summary and one-line reports ``schedspec
check`` prints, exactly."""

from __future__ import annotations

from collections import Counter

from schedspec.spec import SchedulerConfig
from schedspec.spec.coverage import _summary, counts_of, merge, rules_line, unreached
from schedspec.spec.rule_names import ALL_GATES, ALL_KV, ALL_MODES, RULE_NAMES, reachable_in
from schedspec.spec.scheduler import SpecScheduler

SYNC = reachable_in(("sync",))


def test_counts_of_is_the_schedulers_rule_counter_or_none() -> None:
    s = SpecScheduler(SchedulerConfig(block_size=4, num_blocks=16, max_model_len=32))
    assert counts_of(s) is s.rules
    assert counts_of(object()) is None

    class Plain:
        rules = {"a": 1}

    assert counts_of(Plain()) is None


def test_merge_adds_only_positive_counts() -> None:
    into: Counter[str] = Counter({"a": 2})
    merge(into, {"a": 1, "b": 1, "c": 0, "d": -3})
    assert dict(into) == {"a": 3, "b": 1}


def test_unreached_lists_the_names_taken_fewer_times_in_the_order_given() -> None:
    counts = {"x": 1, "y": 2}
    assert unreached(counts, ["z", "y", "x"]) == ["z"]
    assert unreached(counts, ["z", "y", "x"], at_least=2) == ["z", "x"]
    assert unreached({n: 1 for n in RULE_NAMES}) == []
    assert unreached({}) == list(RULE_NAMES)


def test_the_summary_counts_the_reachable_rules_reached() -> None:
    counts = Counter({SYNC[0]: 1, SYNC[1]: 3})
    rest = len(RULE_NAMES) - len(SYNC)
    assert rest > 0
    assert _summary(counts, ("sync",)) == (
        f"rule coverage: 2 of the {len(SYNC)} rules reachable in sync reached ({rest} out of reach there)")
    gated = reachable_in(("sync", "async"), ("pause", "lora"))
    assert len(gated) > len(reachable_in(("sync", "async")))
    assert _summary(Counter({gated[-1]: 1}), ["sync", "async"], ("pause", "lora")) == (
        f"rule coverage: 1 of the {len(gated)} rules reachable in sync, async with gates lora, pause reached "
        f"({len(RULE_NAMES) - len(gated)} out of reach there)")


def test_the_summary_of_a_run_with_every_mode_and_gate_names_the_rules_no_run_reaches() -> None:
    """Rules the fake model never takes (no mode reaches them) stay out of reach."""
    every = (*ALL_GATES, *ALL_KV)
    names = reachable_in(ALL_MODES, every)
    never = [n for n in RULE_NAMES if n not in names]
    assert never == ["waiting.skip_stale_output", "grammar.refused_sample"]
    assert _summary(Counter(), ALL_MODES, every) == (
        f"rule coverage: 0 of the {len(names)} rules reachable in sync, async, spec, async-spec with gates "
        f"{', '.join(sorted(every))} reached (2 out of reach there)")


def test_rules_line_names_the_unreached_or_the_three_rarest() -> None:
    counts = Counter({SYNC[0]: 1, SYNC[1]: 3})
    head = _summary(counts, ("sync",))
    assert rules_line(counts, modes=("sync",)) == f"{head}; never reached: {', '.join(SYNC[2:])}"
    every = Counter({n: 10 + i for i, n in enumerate(SYNC)})
    every[SYNC[5]] = 2
    head = _summary(every, ("sync",))
    assert rules_line(every, modes=("sync",)) == (
        f"{head}; rarest: {SYNC[5]} 2, {SYNC[0]} 10, {SYNC[1]} 11")
    assert rules_line(every, k=1, modes=("sync",)) == f"{head}; rarest: {SYNC[5]} 2"
    gated = reachable_in(("sync",), ("lora",))
    assert rules_line(every, modes=("sync",), gates=("lora",)) == (
        f"{_summary(every, ('sync',), ('lora',))}; never reached: {', '.join(n for n in gated if n not in SYNC)}")


def test_parse_required_reads_names_groups_and_all() -> None:
    from schedspec.spec.coverage import parse_required

    stop = tuple(n for n in RULE_NAMES if n.startswith("stop."))
    assert len(stop) > 1
    assert parse_required("admit.new,stop") == ("admit.new", *stop)
    assert parse_required(" stop.* , admit.new ") == (*stop, "admit.new")
    assert parse_required(" , admit.new,,") == ("admit.new",)
    assert parse_required("all") == reachable_in(ALL_MODES)
    assert parse_required("all, async.stale_output", ("sync",)) == (*SYNC, "async.stale_output")
    # each name once, in the place it first took
    assert parse_required("admit.new, all", ("sync",)) == ("admit.new", *(n for n in SYNC if n != "admit.new"))
    assert parse_required("all", ("sync",), ("lora",)) == reachable_in(("sync",), ("lora",))


def test_parse_required_names_what_it_cannot_read() -> None:
    from schedspec.spec.coverage import parse_required

    for text, bad in [("admit.nope", "admit.nope"), ("st.*", "st.*"), ("admit.new.*", "admit.new.*")]:
        try:
            parse_required(text)
        except ValueError as e:
            assert str(e) == f"unknown rule {bad!r} (see spec/rule_names.py; 'all' names every rule)"
        else:
            raise AssertionError(text)
    try:
        parse_required(" , ")
    except ValueError as e:
        assert str(e) == "no rule named (give 'all' or rule names separated by commas)"
    else:
        raise AssertionError("' , '")
