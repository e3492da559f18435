"""Rule coverage: how often a run took each named branch of the spec.

The spec scheduler keeps one ``collections.Counter`` in ``scheduler.rules``
(its KV pool holds the same object as ``kv.rules``); every decision branch
names itself through one call, ``self._rule("NAME")`` (``CountsRules``
below; ``self._rule("NAME", condition)`` for a condition on a line that runs
anyway), and a decision with several named outcomes hands the names its
classifier yields (a small generator function whose name ends in
``_rules``, next to the decision) to ``self._rules``. Counting is always on:
a dict increment per branch taken, lost in the cost of a step. The names and
their meaning are in spec/rule_names.py.

Clones share their original's counter (``SpecScheduler.clone`` copies the
reference), so a search over cloned states counts every transition once, in
one place. To count one transition alone, read ``snapshot`` before and
``delta`` after, or give the clone a counter of its own with ``attach``.

    sched = SpecScheduler(config)
    ...                                  # drive it
    counts = counts_of(sched)            # Counter: rule name -> times taken
    unreached(counts)                    # catalogued rules never taken
    print(format_table(counts))
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

from schedspec.spec.effects import EFFECT_NAMES, EFFECTS
from schedspec.spec.rule_names import ALL_MODES, RULE_NAMES, RULES, reachable_in

RuleCounts = Counter[str]


class CountsRules:
    """The one way the spec counts its named branches (spec/rule_names.py),
    shared by SpecScheduler, its parts and its KV pool. Each call is a whole
    line marked ``# pragma: no mutate``: counting decides nothing, so mutation
    testing leaves it alone (tests/check/test_rule_coverage.py holds every
    call to a catalogued name, each name counted in one place)."""

    rules: RuleCounts

    def _rule(self, name: str, times: int = 1) -> None:  # pragma: no mutate block
        """The branch ``name`` was taken ``times`` times (a condition counts
        1 when it holds, 0 when not)."""
        self.rules[name] += times

    def _rules(self, names: Iterable[str]) -> None:  # pragma: no mutate block
        """Each branch a classifier says a decision took, once."""
        for name in names:
            self.rules[name] += 1


def new_counts() -> RuleCounts:
    """An empty counter, what a scheduler starts with."""
    return Counter()


def counts_of(scheduler: object) -> RuleCounts | None:
    """The rule counter a scheduler keeps (the spec's ``rules``), or None for
    a scheduler that counts no rules."""
    rules = getattr(scheduler, "rules", None)
    return rules if isinstance(rules, Counter) else None


def attach(scheduler: object, counts: RuleCounts) -> None:
    """Make ``scheduler`` (and its KV pool) count into ``counts`` from now on."""
    setattr(scheduler, "rules", counts)
    kv = getattr(scheduler, "kv", None)
    if kv is not None and hasattr(kv, "rules"):
        setattr(kv, "rules", counts)


def snapshot(counts: Mapping[str, int]) -> dict[str, int]:
    """A frozen copy of the positive counts, for ``delta``."""
    return {k: v for k, v in counts.items() if v > 0}


def delta(after: Mapping[str, int], before: Mapping[str, int]) -> RuleCounts:
    """What was counted between two snapshots (positive entries only)."""
    out: RuleCounts = Counter()
    for k, v in after.items():
        d = v - before.get(k, 0)
        if d > 0:
            out[k] = d
    return out


def merge(into: RuleCounts, other: Mapping[str, int]) -> None:
    """Add ``other``'s positive counts to ``into``."""
    for k, v in other.items():
        if v > 0:
            into[k] += v


def reached(counts: Mapping[str, int]) -> list[str]:
    """Catalogued rules taken at least once, in catalogue order."""
    return [n for n in RULE_NAMES if counts.get(n, 0) > 0]


def unreached(counts: Mapping[str, int], names: Iterable[str] = RULE_NAMES, at_least: int = 1) -> list[str]:
    """The names among ``names`` taken fewer than ``at_least`` times, in the order given."""
    return [n for n in names if counts.get(n, 0) < at_least]


Gates = tuple[str, ...] | list[str] | frozenset[str]


def parse_required(
    text: str, modes: tuple[str, ...] | list[str] = ALL_MODES, gates: Gates = ()
) -> tuple[str, ...]:
    """A ``--require-rules`` value: ``all`` (every rule the run's ``modes``
    and admission ``gates`` can reach: spec/rule_names.py, reachable_in), or names and group
    prefixes separated by commas (``kv`` or ``kv.*`` means every kv rule),
    and effects (spec/effects.py: a name, or ``effect`` for every one).
    Raises ValueError naming an unknown name."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "all":
            out.extend(reachable_in(modes, gates))
            continue
        prefix = part[:-2] if part.endswith(".*") else part
        if part in RULES or part in EFFECTS:  # an effect (spec/effects.py) counts like a rule
            out.append(part)
        elif prefix == "effect":
            out.extend(EFFECT_NAMES)
        elif any(n.startswith(prefix + ".") for n in RULE_NAMES):
            out.extend(n for n in RULE_NAMES if n.startswith(prefix + "."))
        else:
            raise ValueError(f"unknown rule {part!r} (see spec/rule_names.py; 'all' names every rule)")
    if not out:
        raise ValueError("no rule named (give 'all' or rule names separated by commas)")
    return tuple(dict.fromkeys(out))


def as_dict(counts: Mapping[str, int]) -> dict[str, int]:
    """Every catalogued rule with its count (0 when never taken), catalogue order."""
    return {n: int(counts.get(n, 0)) for n in RULE_NAMES}


def rarest(counts: Mapping[str, int], k: int = 5) -> list[tuple[str, int]]:
    """The ``k`` least-taken rules (ties in catalogue order)."""
    return sorted(as_dict(counts).items(), key=lambda kv: kv[1])[:k]


def _summary(counts: Mapping[str, int], modes: tuple[str, ...] | list[str], gates: Gates = ()) -> str:
    names = reachable_in(modes, gates)
    got = sum(1 for n in names if counts.get(n, 0) > 0)
    rest = len(RULE_NAMES) - len(names)
    where = ", ".join(modes) + (f" with gates {', '.join(sorted(gates))}" if gates else "")
    return (f"rule coverage: {got} of the {len(names)} rules reachable in {where} reached"
            + (f" ({rest} out of reach there)" if rest else ""))


def format_table(counts: Mapping[str, int], *, modes: tuple[str, ...] | list[str] = ALL_MODES,
                 width: int = 30, gates: Gates = ()) -> str:
    """A text table: each rule, its count, and a mark on the unreached ones
    (``NOT REACHED``, or ``out of reach`` for a rule no mode of ``modes``
    can take, or whose admission gate is not among ``gates``), grouped as in
    the catalogue; a summary line first."""
    names = set(reachable_in(modes, gates))
    lines = [_summary(counts, modes, gates)]
    group = ""
    for name in RULE_NAMES:
        g = RULES[name].group
        if g != group:
            group = g
            lines.append(f"  {g}")
        n = int(counts.get(name, 0))
        mark = "" if n else "   NOT REACHED" if name in names else "   out of reach"
        lines.append(f"    {name:<{width}} {n:>9,}{mark}")
    return "\n".join(lines)


def rules_line(counts: Mapping[str, int], k: int = 3, modes: tuple[str, ...] | list[str] = ALL_MODES,
               gates: Gates = ()) -> str:
    """One line: how many of the rules ``modes`` (with the admission
    ``gates``) can reach were reached, and the unreached ones (or the rarest,
    when every one was reached)."""
    names = reachable_in(modes, gates)
    missing = unreached(counts, names)
    if missing:
        tail = "never reached: " + ", ".join(missing)
    else:
        least = sorted(names, key=lambda n: counts.get(n, 0))[:k]
        tail = "rarest: " + ", ".join(f"{n} {counts.get(n, 0):,}" for n in least)
    return f"{_summary(counts, modes, gates)}; {tail}"
