"""The spec's rules a check run can reach and must reach: its modes, gates,
KV and engine features (CheckSettings.drawn_capabilities), less what the
scheduler's declared capabilities put out of reach."""

from __future__ import annotations

from typing import Mapping, Protocol

from schedspec.check.capabilities import Capabilities, rules_within
from schedspec.spec import coverage
from schedspec.spec.rule_names import RULE_NAMES, reachable_in


class CheckSettings(Protocol):
    """What these read of check/gate.py's CheckSettings."""

    @property
    def capabilities(self) -> Capabilities: ...
    @property
    def require_rules(self) -> tuple[str, ...]: ...
    @property
    def require_all(self) -> bool: ...
    @property
    def drawn_modes(self) -> tuple[str, ...]: ...
    @property
    def drawn_capabilities(self) -> tuple[str, ...]: ...


def reachable_rules(settings: CheckSettings) -> tuple[str, ...]:
    """The spec's rules a run can reach: those of the modes and gates it draws, less those the
    scheduler's declared capabilities put out of reach (capabilities.RULE_NEEDS)."""
    return rules_within(settings.capabilities, reachable_in(settings.drawn_modes, settings.drawn_capabilities))


def rules_line(settings: CheckSettings, counts: Mapping[str, int], k: int = 3) -> str:
    """spec.coverage.rules_line over the rules the run can reach (reachable_rules): the rules
    the scheduler's capabilities put out of reach are neither counted nor listed as missed."""
    names = reachable_rules(settings)
    line = coverage.rules_line(counts, k, settings.drawn_modes, settings.drawn_capabilities)
    if names == reachable_in(settings.drawn_modes, settings.drawn_capabilities):
        return line
    got = sum(1 for n in names if counts.get(n, 0) > 0)
    missing = coverage.unreached(counts, names)
    tail = ("never reached: " + ", ".join(missing) if missing else
            "rarest: " + ", ".join(f"{n} {counts.get(n, 0):,}" for n in sorted(names, key=lambda n: counts.get(n, 0))[:k]))
    where = ", ".join(settings.drawn_modes) + (f" with gates {', '.join(sorted(settings.drawn_capabilities))}"
                                               if settings.drawn_capabilities else "")
    return (f"rule coverage: {got} of the {len(names)} rules reachable in {where} within the declared capabilities "
            f"reached ({len(RULE_NAMES) - len(names)} out of reach there); {tail}")


def required_rules(settings: CheckSettings) -> tuple[str, ...]:
    """The rules the run must reach: those named, and with ``require_all``
    every rule the modes the scheduler under test supports can reach."""
    reachable = reachable_rules(settings)
    names = settings.require_rules + (reachable if settings.require_all else ())
    return tuple(dict.fromkeys(names))
