"""docs/results.md is what tools/results.py writes from data/results/: every
record names its command, machine, date, commit and versions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools import results


def test_results_md_is_written_from_the_records() -> None:
    text = results.render(results.load_records(), results.code_counts())
    assert results.DOC.read_text() == text, "docs/results.md is stale: run python -m tools.results"


def test_every_record_says_where_and_when_it_ran() -> None:
    records = results.load_records()
    assert records
    for rec in records:
        assert rec["command"] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", rec["date"]), rec["id"]
        assert rec["commit"] or "unknown" in rec["commit_note"], rec["id"]


def test_a_record_without_its_versions_is_refused(tmp_path: Path) -> None:
    rec = json.loads((results.RECORDS / "mutation.json").read_text())
    del rec["versions"]["torch"]
    (tmp_path / "mutation.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="versions lack torch"):
        results.load_records(tmp_path)


def test_the_cuda_figures_say_their_commit_and_torch() -> None:
    for rec in results.load_records():
        if rec["machine"] == "h100":
            assert rec["commit"] == "017dcec" and rec["versions"]["torch"].startswith("2.11.0+cu130"), rec["id"]
