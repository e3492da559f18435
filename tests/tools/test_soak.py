"""tools/soak.py: the memory samples, the slope that judges a line flat, and a
short soak end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import soak


def test_slope_is_mb_per_100k_steps() -> None:
    assert soak.slope([(0, 10.0), (100_000, 11.0), (200_000, 12.0)]) == pytest.approx(1.0)
    assert soak.slope([(0, 10.0), (50_000, 10.0)]) == 0.0
    assert soak.slope([(0, 10.0)]) == 0.0


def _mode(points: list[tuple[int, float]]) -> soak.ModeSoak:
    m = soak.ModeSoak("sync", steps=points[-1][0])
    m.samples = [soak.Sample(s, 0.0, mb, 0) for s, mb in points]
    return m


def test_a_leak_in_the_second_half_is_not_flat() -> None:
    steps = [i * 50_000 for i in range(21)]
    # warm-up growth in the first half only: flat
    settled = _mode([(s, 30.0 + min(s, 400_000) / 100_000) for s in steps])
    assert settled.flat(0.5) and settled.growth() == 0.0
    # 8 bytes a step all along: 0.8 MB per 100,000 steps
    leaking = _mode([(s, 30.0 + 8 * s / 1e6) for s in steps])
    assert leaking.slope() == pytest.approx(0.8) and not leaking.flat(0.5)
    # too few samples in the second half to judge: never called flat
    assert not _mode([(0, 30.0), (1000, 30.0)]).flat(0.5)


def test_rss_is_read() -> None:
    assert 1.0 < soak.rss_mb() < 100_000


def test_a_short_soak_samples_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(["--steps", "300", "--modes", "sync", "--samples", "3", "--plans-only", "--json", str(out),
                    "--out", str(tmp_path / "o")])
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    mode = report["modes"][0]
    assert mode["mode"] == "sync" and mode["result"] == "pass" and mode["steps"] >= 300 and mode["findings"] == []
    steps = [s["steps"] for s in mode["samples"]]
    assert len(steps) == 4 and steps[0] == 0 and steps == sorted(steps) and steps[-1] >= 300  # the start, 3 marks
    assert all(s["rss_mb"] > 0 and s["objects"] > 0 for s in mode["samples"])
    assert "| sync |" in table
    assert rc == (0 if mode["flat"] else 1)


def test_bad_flags_name_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        soak.main(["--modes", "sync,turbo"])
    assert e.value.code == 2 and "unknown mode(s) turbo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        soak.main(["--json", "/no/such/folder/x.json"])
    assert "does not exist" in capsys.readouterr().err


def test_a_finding_is_kept_and_the_soak_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(["--against", "tests.support.buggy_schedulers:WrongVictim", "--steps", "600", "--modes", "sync",
                    "--samples", "3", "--json", str(out), "--out", str(tmp_path / "o")])
    mode = json.loads(out.read_text())["modes"][0]
    assert rc == 1 and mode["result"] == "fail"
    assert mode["findings"] and mode["steps"] >= 600, mode["findings"]  # past the first finding, to the goal
    seed, who, what, where = mode["findings"][0]
    assert (Path(where) / "trace.jsonl").exists() and str(tmp_path / "o" / "sync") in where
    assert "workload seed" in capsys.readouterr().out


def test_an_out_folder_that_cannot_be_made_is_refused_first(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    with pytest.raises(SystemExit) as e:
        soak.main(["--steps", "10", "--modes", "sync", "--out", str(blocker / "o")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
