"""Every count the docs state, held to the code.

A *claim* is a pattern of the docs' text with one number in it and the
function that computes that number from the code: ``r"(\\d+) safety
invariants"`` and the number of invariants tagged ``safety``. ``stale`` finds
every place a claim's pattern matches and reports each number that is not
what the code says today. ``uncounted`` finds every number the docs put
before a counted noun (invariants, rules, spaces, vectors, mutants ...) that
no claim covers, so a new count cannot slip in unchecked.

    python -m tests.docs.counts        # print what is stale or unchecked

docs/results.md is left out (tools/results.py writes its counts from the
code, and its figures are those of the commit each names), and so are
docs/impl.md and docs/bugzoo.md, written by their own generators.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The texts held to the code.
DOCS: tuple[str, ...] = (
    "README.md",
    "docs/adapters.md",
    "docs/coverage.md",
    "docs/divergences.md",
    "docs/fidelity.md",
    "docs/gpu_runner.md",
    "docs/invariants.md",
    "docs/modelcheck.md",
    "docs/spec.md",
    "docs/trace-format.md",
)

#: A number before one of these nouns (up to two words between) is a count.
#: A number as the docs write it (1,024), not the tail of another (2,706 or 0.33.0).
NUM = r"(?<![\d,.])(\d+(?:,\d{3})*)"

#: A number before one of these nouns (up to two words between) is a count.
COUNTED = re.compile(
    NUM + r"\s+(?:[A-Za-z-]+\s+){0,2}?"
    r"(invariants?|rules?|spaces?|vectors?|mutants?|counterexamples|gates|modes|tags)\b(?! violation)"
)


@dataclass(frozen=True)
class Claim:
    pattern: str  # a regular expression whose first group is the number
    value: Callable[[], int]
    what: str


# ------------------------------------------------------------------ the code's counts
@cache
def _catalogue() -> tuple[tuple[str, tuple[str, ...]], ...]:
    from schedspec.invariants import CATALOGUE

    return tuple((i.id, tuple(i.tags)) for i in CATALOGUE)


def invariants() -> int:
    return len(_catalogue())


def safety() -> int:
    return sum(1 for _, tags in _catalogue() if "safety" in tags)


def policy() -> int:
    return sum(1 for _, tags in _catalogue() if any(t.startswith("policy:") for t in tags))


def policy_tags() -> int:
    return len({t for _, tags in _catalogue() for t in tags if t.startswith("policy:")})


def rules() -> int:
    from schedspec.spec.rule_names import RULES

    return len(RULES)


def reach(modes: tuple[str, ...] | None = None, gates: bool = False, kv: bool = False) -> Callable[[], int]:
    def count() -> int:
        from schedspec.spec.rule_names import ALL_GATES, ALL_KV, ALL_MODES, reachable_in

        on = (ALL_GATES if gates else ()) + (ALL_KV if kv else ())
        return len(reachable_in(modes or ALL_MODES, on))

    return count


def out_of_reach() -> int:
    """Rules no mode can take (waiting.skip_stale_output: a rule with no mode)."""
    from schedspec.spec.rule_names import RULES

    return sum(1 for r in RULES.values() if not r.modes)


def sync_out_of_reach() -> int:
    """Rules of the ungated scheduler that only async scheduling or drafts reach."""
    from schedspec.spec.rule_names import ALL_MODES, reachable_in

    return len(reachable_in(ALL_MODES)) - len(reachable_in(["sync"]))


def gates() -> int:
    from schedspec.spec.rule_names import ALL_GATES

    return len(ALL_GATES)


def modes() -> int:
    from schedspec.spec.rule_names import ALL_MODES

    return len(ALL_MODES)


def vectors(folder: str) -> Callable[[], int]:
    return lambda: len(list((ROOT / "vectors" / folder).glob("*.jsonl")))


def all_vectors() -> int:
    return len(list((ROOT / "vectors").glob("*/*.jsonl")))


def mutants() -> int:
    from tests.bugzoo import zoo

    return len(zoo.ALL)


def spaces(bound: str) -> Callable[[], int]:
    def count() -> int:
        from schedspec.modelcheck import bound as get_bound

        return len(get_bound(bound).spaces)

    return count


def held_by(target: str) -> Callable[[], int]:
    """The safety invariants an invariants-mode check of ``target`` runs:
    those whose premise the scheduler's declared capabilities hold."""

    def count() -> int:
        from schedspec.adapters.registry import resolve
        from schedspec.check.gate import resolve_selection

        return len(resolve_selection("invariants", None, resolve(target).capabilities).invariants)

    return count


def percent(name: str) -> Callable[[], int]:
    """A rate of check/kv_requests.py, in percent."""

    def value() -> int:
        from schedspec.check import kv_requests

        return round(100 * float(getattr(kv_requests, name)))

    return value


# ------------------------------------------------------------------ the claims
CLAIMS: tuple[Claim, ...] = (
    Claim(NUM + r" invariants\b(?! held)", invariants, "invariants in the catalogue"),
    Claim(NUM + r" invariants\s+held \(safety\)", held_by("examples.reserve_upfront:ReserveUpfrontScheduler"),
          "safety invariants the README's example scheduler declares the premises of"),
    Claim(NUM + r" safety invariants", safety, "invariants tagged safety"),
    Claim(NUM + r" policy invariants", policy, "invariants tagged policy:<name>"),
    Claim(NUM + r" policy tags", policy_tags, "distinct policy:<name> tags"),
    Claim(NUM + r" named rules", rules, "rules of spec/rule_names.py"),
    Claim(NUM + r" rules in all", rules, "rules of spec/rule_names.py"),
    Claim(NUM + r" reachable rules", reach(gates=True, kv=True), "rules reachable with every mode, gate and KV feature"),
    Claim(NUM + r" rules reachable with the four modes and the gates\b", reach(gates=True), "rules reachable with every mode and gate"),
    Claim(NUM + r" rules reachable with the four modes\b(?! and)", reach(), "rules reachable in the four modes, no gate"),
    Claim(NUM + r" rules sync scheduling can reach", reach(("sync",)), "rules reachable in sync mode, no gate"),
    Claim(NUM + r" rules of sync scheduling", reach(("sync",)), "rules reachable in sync mode, no gate"),
    Claim(r"\bsync (\d+) rules", reach(("sync",)), "rules reachable in sync mode, no gate"),
    Claim(NUM + r" rules need async scheduling or drafts", sync_out_of_reach, "rules only async scheduling or drafts reach"),
    Claim(NUM + r" rules? no mode can (?:reach|take)", out_of_reach, "rules with no mode"),
    Claim(NUM + r" admission gates", gates, "the admission gates"),
    Claim(NUM + r" gates\b", gates, "the admission gates"),
    Claim(NUM + r" modes\b", modes, "the scheduling modes"),
    Claim(NUM + r" spec vectors", vectors("spec"), "traces in vectors/spec"),
    Claim(NUM + r" named behaviours", vectors("spec"), "traces in vectors/spec"),
    Claim(NUM + r" bug-zoo counterexamples", vectors("bugzoo"), "traces in vectors/bugzoo"),
    Claim(NUM + r" vLLM defect vectors", vectors("vllm-defects"), "traces in vectors/vllm-defects"),
    Claim(NUM + r" vectors\b", all_vectors, "traces in vectors/"),
    Claim(NUM + r" (?:bug-zoo )?mutants\b", mutants, "mutants of tests/bugzoo/zoo.py"),
    Claim(r"small bound(?:'s|,)? " + NUM + r" spaces", spaces("small"), "spaces of the small bound"),
    Claim(r"(?<![\w-])small \| " + NUM + r" spaces", spaces("small"), "spaces of the small bound"),
    Claim(r"(?<![\w-])medium \| " + NUM + r" spaces", spaces("medium"), "spaces of the medium bound"),
    Claim(r"(?<![\w-])large \| " + NUM + r" spaces", spaces("large"), "spaces of the large bound"),
    Claim(r"(?<![\w-])modes \| " + NUM + r" spaces", spaces("modes"), "spaces of the modes bound"),
    Claim(r"(?<![\w-])modes-large \| " + NUM + r" spaces", spaces("modes-large"), "spaces of the modes-large bound"),
    Claim(r"(?<![\w-])gates \| " + NUM + r" spaces", spaces("gates"), "spaces of the gates bound"),
    Claim(r"(?<![\w-])gates-large \| " + NUM + r" spaces", spaces("gates-large"), "spaces of the gates-large bound"),
    Claim(r"(?<![\w-])connector \| " + NUM + r" spaces", spaces("connector"), "spaces of the connector bound"),
    Claim(r"(?<![\w-])hybrid \| " + NUM + r" spaces", spaces("hybrid"), "spaces of the hybrid bound"),
    Claim(r"(?<![\w-])connector-hybrid \| " + NUM + r" spaces", spaces("connector-hybrid"), "spaces of the connector-hybrid bound"),
    Claim(r"(?<![\w-])kv-livelock \| " + NUM + r" spaces?", spaces("kv-livelock"), "spaces of the kv-livelock bound"),
    Claim(r"(?<![\w-])hybrid-mamba \| " + NUM + r" spaces?", spaces("hybrid-mamba"), "spaces of the hybrid-mamba bound"),
    Claim(r"(?<![\w-])pipeline \| " + NUM + r" spaces?", spaces("pipeline"), "spaces of the pipeline bound"),
    Claim(r"puts a Mamba group in " + NUM + r"%", percent("DEFAULT_MAMBA_RATE"), "% (kv_requests.DEFAULT_MAMBA_RATE)"),
    Claim(r"two Mamba groups in " + NUM + r"%", percent("SECOND_STATE_RATE"), "% (kv_requests.SECOND_STATE_RATE)"),
    Claim(r"the Mamba groups first in " + NUM + r"%", percent("STATE_FIRST_RATE"), "% (kv_requests.STATE_FIRST_RATE)"),
)


@dataclass(frozen=True)
class Finding:
    doc: str
    line: int
    text: str
    problem: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.problem}: {self.text!r}"


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _snippet(text: str, start: int, end: int) -> str:
    return " ".join(text[max(0, start - 30):end + 30].split())


def _regex(pattern: str) -> re.Pattern[str]:
    """A claim's pattern, any run of whitespace (a line break too) matching its spaces."""
    return re.compile(pattern.replace(" ", r"\s+"))


def stale(doc: str, text: str, claims: tuple[Claim, ...] = CLAIMS) -> list[Finding]:
    """Every number a claim's pattern finds in ``text`` that the code contradicts."""
    found = []
    for claim in claims:
        for m in _regex(claim.pattern).finditer(text):
            stated = int(m.group(1).replace(",", ""))
            actual = claim.value()
            if stated != actual:
                found.append(Finding(doc, _line(text, m.start()), _snippet(text, m.start(), m.end()),
                                     f"says {stated} {claim.what}, the code has {actual}"))
    return found


def uncounted(doc: str, text: str, claims: tuple[Claim, ...] = CLAIMS) -> list[Finding]:
    """Every count before a counted noun that no claim covers."""
    covered: list[tuple[int, int]] = []
    for claim in claims:
        covered += [m.span(1) for m in _regex(claim.pattern).finditer(text)]
    found = []
    for m in COUNTED.finditer(text):
        if not any(s <= m.start(1) < e for s, e in covered):
            found.append(Finding(doc, _line(text, m.start()), _snippet(text, m.start(), m.end()),
                                 "a count no claim of tests/docs/counts.py holds to the code"))
    return found


def check_all(docs: tuple[str, ...] = DOCS) -> list[Finding]:
    found = []
    for doc in docs:
        text = (ROOT / doc).read_text()
        found += stale(doc, text) + uncounted(doc, text)
    return found


if __name__ == "__main__":
    problems = check_all()
    for p in problems:
        print(p)
    sys.exit(1 if problems else 0)
