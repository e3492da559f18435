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


#: the trees and the torch the CUDA runs had (data/cuda-*/env.txt, README.md); the CPU pin is torch 2.13.0
CUDA_RUNS = {"h100": {"017dcec"}, "h200": {"ca87ebb", "ae3eb98"}}


def test_the_cuda_figures_say_their_commit_and_torch() -> None:
    for rec in results.load_records():
        if rec["machine"] in CUDA_RUNS:
            assert rec["commit"] in CUDA_RUNS[rec["machine"]], rec["id"]
            assert rec["versions"]["torch"].startswith("2.11.0+cu130"), rec["id"]


def test_the_second_h200_run_names_its_tree_and_what_env_printed() -> None:
    """The machine's copy carried ae3eb98's working tree over its parent's
    git history, so env.txt prints the parent: the README says both."""
    run = results.ROOT / "data" / "cuda-h200-2"
    env = (run / "env.txt").read_text()
    assert re.search(r"^7c8b4b3[0-9a-f]{33}$", env, re.M) and "torch 2.11.0+cu130 cuda 13.0" in env
    readme = (run / "README.md").read_text()
    assert "ae3eb98" in readme and "7c8b4b3" in readme
    assert "pipeline-2-async-v2" in (run / "cuda-glass16-exact.txt").read_text()


def test_the_h200_commit_is_the_one_its_env_printed() -> None:
    env = (results.ROOT / "data" / "cuda-h200" / "env.txt").read_text()
    assert re.search(r"^ca87ebb[0-9a-f]{33}$", env, re.M)
    assert "torch 2.11.0+cu130 cuda 13.0" in env and "Driver Version: 580.159.04" in env


def test_the_cuda_page_shows_the_h200_run_and_only_the_h100_figures_it_did_not_remeasure() -> None:
    records = results.load_records()
    shown = {r["id"]: r for r in records if not r.get("superseded_by")}
    assert {i for i in shown if i.startswith("cuda-h200-")} == {
        "cuda-h200-equivalence", "cuda-h200-cross-device", "cuda-h200-maxbatch", "cuda-h200-speed",
        "cuda-h200-equivalence-pipeline-streaming"}
    assert [i for i in shown if i.startswith("cuda-h100-")] == ["cuda-h100-glass64-smollm2"]
    for rec in records:
        if rec["id"].startswith("cuda-h100-") and rec.get("superseded_by"):
            assert rec["superseded_by"].startswith("cuda-h200-"), rec["id"]
    assert "speed claim" in shown["cuda-h200-speed"]["result"]


def test_a_record_superseded_by_no_record_is_refused(tmp_path: Path) -> None:
    rec = json.loads((results.RECORDS / "mutation.json").read_text())
    rec["superseded_by"] = "no-such-record"
    (tmp_path / "mutation.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="names no record"):
        results.load_records(tmp_path)


def test_the_page_names_only_the_machines_its_figures_ran_on() -> None:
    records = results.load_records()
    text = results.render([r for r in records if r["machine"] == "dev"], results.code_counts())
    assert "`dev` is" in text and "`h100` is" not in text
    assert "`h200` is" in results.DOC.read_text()
