"""Named invariants that every scheduler must keep, checked over read-only views.

A driver calls ``Monitor.observe(Transition(...))`` after every operation of a
scheduler (add, abort, schedule, update, reset_prefix_cache, and the optional
set_pause_state and grammar_ready) and gets back the
violations. ``CATALOGUE`` lists the invariants; ``catalogue_text()`` is what
``schedspec invariants`` prints. Importing this package imports neither torch
nor vLLM.
"""

from schedspec.invariants.core import History, Invariant, Transition, TransitionKind, Violation
from schedspec.invariants.monitor import BY_ID, CATALOGUE, Monitor, catalogue_markdown, catalogue_text
from schedspec.invariants.selection import (
    DEFAULT_SELECTOR,
    MODES,
    Mode,
    Selection,
    SelectionError,
    all_tags,
    make_selection,
    select,
)

__all__ = [
    "BY_ID",
    "CATALOGUE",
    "DEFAULT_SELECTOR",
    "MODES",
    "Mode",
    "Selection",
    "SelectionError",
    "all_tags",
    "make_selection",
    "select",
    "History",
    "Invariant",
    "Monitor",
    "Transition",
    "TransitionKind",
    "Violation",
    "catalogue_markdown",
    "catalogue_text",
]
