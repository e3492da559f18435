"""--kv in check and replay: a bad or unsupported KV feature exits 2 naming
it, the summary records the features drawn, replay skips traces outside --kv."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from schedspec.check import trace as tracefile
from schedspec.check.random_workloads import random_workload
from schedspec.cli.main import main

#: the spec's class named as a user's: it declares nothing, so no KV feature
PLAIN = "schedspec.spec.scheduler:SpecScheduler"


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_a_bad_kv_feature_exits_2_naming_it(tmp_path: Path) -> None:
    rc, out = run(["check", "--kv", "connector,mamba", "--steps", "10", "--quiet", "--out", str(tmp_path)])
    assert rc == 2 and "--kv: unknown KV feature 'mamba'" in out


def test_a_kv_feature_the_scheduler_lacks_exits_2_naming_it(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", PLAIN, "--kv", "hybrid", "--steps", "10", "--quiet",
                   "--out", str(tmp_path)])
    assert rc == 2 and f"--kv: {PLAIN} does not support the KV feature(s) hybrid" in out


def test_check_without_kv_reports_none_and_the_summary_lists_no_feature(tmp_path: Path) -> None:
    rc, out = run(["check", "--kv", "none", "--gates", "none", "--steps", "60", "--quiet", "--out", str(tmp_path),
                   "--json", str(tmp_path / "s.json")])
    assert rc == 0, out
    assert "\nkv: none\n" in out
    assert json.loads((tmp_path / "s.json").read_text())["kv"] == []


def test_a_declaration_without_kv_draws_none_by_default(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", PLAIN, "--steps", "40", "--quiet", "--out", str(tmp_path)])
    assert rc == 0, out
    assert "\nkv: none\n" in out


def test_replay_skips_kv_traces_outside_kv(tmp_path: Path) -> None:
    kv = random_workload(4, 30, kv=("connector", "hybrid"))
    assert kv.config.kv_connector
    tracefile.write(tmp_path / "kv.jsonl", tracefile.Trace(kv))
    tracefile.write(tmp_path / "plain.jsonl", tracefile.Trace(random_workload(4, 30)))
    rc, out = run(["replay", str(tmp_path), "--against", PLAIN])
    assert rc == 0, out
    assert f"SKIPPED {tmp_path / 'kv.jsonl'}: uses the KV feature(s) connector" in out
    assert "OK: replayed 1 traces" in out
    rc, out = run(["replay", str(tmp_path / "kv.jsonl"), "--against", "spec", "--kv", "hybrid"])
    assert rc == 2 and "outside --kv hybrid" in out
    rc, out = run(["replay", str(tmp_path / "kv.jsonl"), "--against", "spec", "--kv", "bogus"])
    assert rc == 2 and "--kv: unknown KV feature 'bogus'" in out
