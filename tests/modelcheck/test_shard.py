"""``schedspec modelcheck --shard K/N`` and ``--merge``: the shards of a bound explore its spaces
between them, each once, and the merged report is the unsharded one."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from schedspec.cli.main import main
from schedspec.modelcheck import bound
from schedspec.modelcheck.shard import shard_spaces

#: what differs between two runs of the same exploration: timings and the shard bookkeeping
_TIMING = {"elapsed_s", "states_per_s", "cpu_s", "states_per_cpu_s", "workers", "shard", "merged_shards"}


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def _untimed(report: Any) -> Any:
    if isinstance(report, dict):
        return {k: _untimed(v) for k, v in report.items() if k not in _TIMING}
    if isinstance(report, list):
        return [_untimed(v) for v in report]
    return report


def test_the_shards_take_every_space_once() -> None:
    names = [s.name for s in bound("medium").spaces]
    for n in (1, 2, 3, 5, len(names) + 2):
        parts = [shard_spaces(names, k, n) for k in range(1, n + 1)]
        assert sorted(x for p in parts for x in p) == sorted(names)


def test_the_merged_report_of_the_small_bound_in_three_shards_is_the_unsharded_one(tmp_path: Path) -> None:
    # the first nine spaces (the sync core, which alone reach all 43 of its rules)
    core = [x for s in bound("small").spaces[:9] for x in ("--space", s.name)]
    common = ["modelcheck", "--bound", "small", *core, "--no-impl", "--quiet", "--workers", "1",
              "--require-rules", "all"]
    rc, out = run([*common, "--json", str(tmp_path / "whole.json")])
    assert rc == 0, out
    shards = []
    for k in (1, 2, 3):
        rc, out = run([*common, "--shard", f"{k}/3", "--json", str(tmp_path / f"shard{k}.json")])
        assert rc == 0 and f"shard {k}/3:" in out and "checked when the shards are merged" in out, out
        shards.append(str(tmp_path / f"shard{k}.json"))
    rc, out = run(["modelcheck", "--merge", *reversed(shards), "--json", str(tmp_path / "merged.json")])
    assert rc == 0 and "in 3 shard(s): every invariant held" in out, out
    assert "43 of the 43 rules reachable in sync mode reached" in out, out
    whole = json.loads((tmp_path / "whole.json").read_text())
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["merged_shards"] == 3
    assert _untimed(merged) == _untimed(whole)


def test_a_shard_past_the_spaces_explores_nothing_and_merges(tmp_path: Path) -> None:
    n = len(bound("small").spaces) + 1
    rc, out = run(["modelcheck", "--bound", "small", "--space", "fcfs-cache-tight", "--no-impl", "--quiet",
                   "--shard", f"2/{n}", "--json", str(tmp_path / "s.json")])
    assert rc == 0 and f"shard 2/{n}: 0 of the 1 space(s): none" in out, out
    assert json.loads((tmp_path / "s.json").read_text())["spaces"] == []


@pytest.mark.parametrize("case", ["missing", "twice", "other-bound", "not-a-shard", "unreadable"])
def test_merging_shards_that_do_not_make_one_run_is_a_usage_error(case: str, tmp_path: Path) -> None:
    base: dict[str, Any] = {"bound": "small", "spaces": [], "result": "pass", "shard": {"k": 1, "n": 2}}
    files = {"a.json": base, "b.json": {**base, "shard": {"k": 2, "n": 2}}}
    want = {"missing": "shards 2/2 missing", "twice": "shard 1/2 again", "other-bound": "bound is 'medium'",
            "not-a-shard": "not a shard's report", "unreadable": "cannot read"}[case]
    if case == "missing":
        del files["b.json"]
    elif case == "twice":
        files["b.json"] = base
    elif case == "other-bound":
        files["b.json"] = {**files["b.json"], "bound": "medium"}
    elif case == "not-a-shard":
        files["b.json"] = {k: v for k, v in base.items() if k != "shard"}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data) if case != "unreadable" or name == "a.json" else "{")
    rc, out = run(["modelcheck", "--merge", *(str(tmp_path / n) for n in files)])
    assert rc == 2 and want in out, out


@pytest.mark.parametrize("argv,want", [
    (["--shard", "0/3"], "need 1 <= K <= N"),
    (["--shard", "3"], "expected K/N"),
    (["--merge", "a.json", "--shard", "1/2"], "--merge and --shard exclude each other"),
])
def test_bad_shard_flags_are_usage_errors(argv: list[str], want: str) -> None:
    rc, out = run(["modelcheck", "--bound", "small", *argv])
    assert rc == 2 and want in out, out
