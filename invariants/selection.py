"""Choosing invariants: the ``--invariants SELECTOR`` words shared by every
command and by the testing API.

A selector is a comma list of items, each one of

- ``all``: every invariant of the catalogue;
- ``safety``: the invariants that hold for any correct paged-KV scheduler;
- ``policy``: every policy invariant; ``policy:<name>``: those of one policy;
- an invariant id;
- any of those prefixed with ``-``: left out.

The chosen set is the union of the positive items (or the mode's default,
``all`` in lockstep and ``safety`` in invariants mode, when there is none)
less the excluded ones, in catalogue order. An unknown item, an exclusion of
something the set does not hold, or an empty result is a
:class:`SelectionError` naming it: a selection never silently widens or
narrows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

from schedspec.spec.interface import SchedSpecError

from schedspec.invariants.core import POLICY_PREFIX, SAFETY, Invariant
from schedspec.invariants.monitor import CATALOGUE

Mode = Literal["lockstep", "invariants"]
MODES: tuple[Mode, ...] = ("lockstep", "invariants")

#: What each mode checks when no selector is given.
DEFAULT_SELECTOR: dict[Mode, str] = {"lockstep": "all", "invariants": SAFETY}


class SelectionError(SchedSpecError, ValueError):
    """A selector names an unknown id or tag, or leaves nothing to check."""


def all_tags(catalogue: Iterable[Invariant] = CATALOGUE) -> tuple[str, ...]:
    """Every tag the catalogue uses, ``safety`` first, then the policies sorted."""
    tags = {t for inv in catalogue for t in inv.tags}
    return tuple(sorted(tags, key=lambda t: (t != SAFETY, t)))


def _matches(item: str, catalogue: tuple[Invariant, ...]) -> tuple[Invariant, ...]:
    if item == "all":
        return catalogue
    if item == "policy":
        return tuple(inv for inv in catalogue if inv.policies)
    if item == SAFETY or item.startswith(POLICY_PREFIX):
        found = tuple(inv for inv in catalogue if item in inv.tags)
        if not found:
            raise SelectionError(
                f"unknown invariant tag {item!r}; tags are: {', '.join(all_tags(catalogue))}, policy, all"
            )
        return found
    found = tuple(inv for inv in catalogue if inv.id == item)
    if not found:
        raise SelectionError(
            f"unknown invariant id or tag {item!r} (`schedspec invariants` lists them; tags are "
            f"{', '.join(all_tags(catalogue))}, policy, all)"
        )
    return found


def parse_items(selector: str) -> list[str]:
    items = [part.strip() for part in selector.split(",")]
    if not selector.strip() or any(not item or item == "-" for item in items):
        raise SelectionError(f"invariant selector {selector!r} has an empty item")
    return items


def select(
    selector: str | None,
    mode: Mode = "lockstep",
    catalogue: Iterable[Invariant] = CATALOGUE,
) -> tuple[Invariant, ...]:
    """The invariants ``selector`` chooses in ``mode`` (see the module doc)."""
    if mode not in MODES:
        raise SelectionError(f"unknown mode {mode!r}; modes are: {', '.join(MODES)}")
    cat = tuple(catalogue)
    items = parse_items(selector) if selector is not None else [DEFAULT_SELECTOR[mode]]
    positive = [i for i in items if not i.startswith("-")]
    negative = [i[1:] for i in items if i.startswith("-")]
    if not positive:
        positive = [DEFAULT_SELECTOR[mode]]
    chosen: set[str] = set()
    for item in positive:
        chosen.update(inv.id for inv in _matches(item, cat))
    for item in negative:
        out = {inv.id for inv in _matches(item, cat)}
        if not out & chosen:
            raise SelectionError(
                f"'-{item}' leaves out nothing: the selection {','.join(positive)!r} does not hold it"
            )
        chosen -= out
    result = tuple(inv for inv in cat if inv.id in chosen)
    if not result:
        raise SelectionError(f"invariant selector {selector!r} leaves nothing to check")
    return result


@dataclass(frozen=True)
class Selection:
    """What a check runs: the mode, the selector as given (None: the mode's
    default), the chosen invariants, and those skipped with the reason."""

    mode: Mode
    selector: str | None
    invariants: tuple[Invariant, ...]
    skipped: tuple[tuple[str, str], ...] = ()  # (invariant id, why)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(inv.id for inv in self.invariants)

    @property
    def effective_selector(self) -> str:
        return self.selector if self.selector is not None else DEFAULT_SELECTOR[self.mode]

    @property
    def compares(self) -> bool:
        """True when the run compares plans and views with the reference."""
        return self.mode == "lockstep"

    def describe(self) -> str:
        """One line saying exactly what ran."""
        what = "plans and views compared with the reference; " if self.compares else "no comparison with the reference; "
        n = len(self.invariants)
        line = f"{self.mode} mode: {what}{n} invariant{'s' if n != 1 else ''} ({self.effective_selector})"
        if self.skipped:
            line += f"; skipped {len(self.skipped)}: " + ", ".join(f"{i} ({why})" for i, why in self.skipped)
        return line


def make_selection(selector: str | None, mode: Mode = "lockstep") -> Selection:
    return Selection(mode, selector, select(selector, mode))


def named_ids(selector: str | None) -> tuple[str, ...]:
    """The invariant ids a selector names one by one (not through a tag)."""
    if selector is None:
        return ()
    ids = {inv.id for inv in CATALOGUE}
    return tuple(item for item in parse_items(selector) if item in ids)
