"""``schedspec invariants``: the invariant catalogue with each invariant's tags
(a table on a terminal with rich installed, the plain catalogue text
otherwise); ``--invariants SELECTOR`` shows only what a selector chooses,
``--tags`` the tags and how many invariants carry each."""

from __future__ import annotations

import argparse
import sys

from schedspec.cli.common import EXIT_OK, INVARIANTS_HELP, print_table, rich_console


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--invariants", default=None, metavar="SELECTOR",
                        help="show only these: " + INVARIANTS_HELP.split(" (default")[0])
    parser.add_argument("--tags", action="store_true", help="list the tags and how many invariants carry each")


def run(args: argparse.Namespace) -> int:
    from schedspec.invariants import CATALOGUE, all_tags, catalogue_text, select

    if args.tags:
        for tag in all_tags():
            ids = [inv.id for inv in CATALOGUE if tag in inv.tags]
            print(f"{tag}  ({len(ids)}): {', '.join(ids)}")
        return EXIT_OK
    chosen = CATALOGUE if args.invariants is None else select(args.invariants)
    plain = catalogue_text(None if args.invariants is None else chosen)
    if rich_console(sys.stdout) is None:
        print(plain)
        return EXIT_OK
    rows = []
    for inv in chosen:
        kinds = "every operation" if inv.scope == "state" else ", ".join(sorted(inv.kinds))
        rows.append([inv.id, ", ".join(inv.tags), f"{inv.scope}; {kinds}", inv.statement, inv.vllm_behaviour])
    print_table((("id", "<"), ("tags", "<"), ("scope", "<"), ("statement", "<"), ("vLLM 0.33.0", "<")), rows,
                plain, title=plain.splitlines()[0])
    return EXIT_OK
