"""The fault catalogue (examples/faults.py): every scheduler there gets the exit status and the
message its row says, and the table in docs/adapters.md is the one written from the rows."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from examples.faults import FAULTS, Fault
from schedspec.cli.main import main
from tools import faults as tool


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.cls)
def test_each_fault_gets_its_message(fault: Fault, tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["check", "--against", f"examples.faults:{fault.cls}", "--mode", "invariants", "--steps", "300",
                   "--quiet", "--shrink-time", "3", "--out", str(tmp_path), *fault.flags])
    text = out.getvalue()
    assert rc == fault.exit, text
    assert fault.says in text, text
    if fault.exit == 1:
        assert f"in examples.faults:{fault.cls}" in text and "replay it: schedspec replay" in text, text


def test_every_fault_class_has_a_row() -> None:
    import examples.faults as mod

    classes = {name for name, obj in vars(mod).items()
               if isinstance(obj, type) and obj.__module__ == mod.__name__ and not name.startswith("_")
               and name != "Fault"}
    assert classes == {f.cls for f in FAULTS}


def test_the_docs_table_is_written_from_the_catalogue() -> None:
    text = tool.DOC.read_text()
    assert tool.render(text) == text, "docs/adapters.md's fault table is stale: run python -m tools.faults"
    assert tool.main(["--check"]) == 0
