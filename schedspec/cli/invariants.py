"""``schedspec invariants``: the invariant catalogue (a table on a terminal
with rich installed, the plain catalogue text otherwise)."""

from __future__ import annotations

import argparse
import sys

from schedspec.cli.common import EXIT_OK, print_table, rich_console


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    from schedspec.invariants import CATALOGUE, catalogue_text

    plain = catalogue_text()
    if rich_console(sys.stdout) is None:
        print(plain)
        return EXIT_OK
    rows = []
    for inv in CATALOGUE:
        kinds = "every operation" if inv.scope == "state" else ", ".join(sorted(inv.kinds))
        rows.append([inv.id, f"{inv.scope}; {kinds}", inv.statement, inv.vllm_behaviour])
    print_table((("id", "<"), ("scope", "<"), ("statement", "<"), ("vLLM 0.33.0", "<")), rows, plain,
                title=plain.splitlines()[0])
    return EXIT_OK
