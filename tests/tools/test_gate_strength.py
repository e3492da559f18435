import json
from pathlib import Path

import pytest

from tools import gate_strength as gs
from tools.mutation.equivalent_mutants import EQUIVALENT


def test_parse_shard() -> None:
    assert gs.parse_shard("2/5") == (2, 5)
    for bad in ("0/3", "4/3", "x", "1/2/3"):
        with pytest.raises(ValueError, match="--shard"):
            gs.parse_shard(bad)


def test_shards_partition() -> None:
    names = [f"m{i}" for i in range(11)]
    parts = [gs.shard_of(names, k, 3) for k in (1, 2, 3)]
    assert sorted(sum(parts, [])) == sorted(names)
    assert all(parts[0] != p for p in parts[1:])


def test_impl_sample_skips_spec_and_equivalents() -> None:
    eq = next(iter(EQUIVALENT))
    names = [eq, "schedspec.spec.rules.x_f__mutmut_1"] + [f"schedspec.impl.core.x_g__mutmut_{i}" for i in range(5)]
    got = gs.impl_sample(names, 3, 1)
    assert got and all(n.startswith("schedspec.impl.") and n != eq for n in got)
    assert got == gs.impl_sample(names, 3, 1)


def test_zoo_names() -> None:
    assert "WrongFcfsVictim" in gs.zoo_names()


def _fake(target: str, verdict: str, secs: float) -> dict[str, object]:
    return {"target": target, "rule": "r", "check": {"verdict": verdict, "seconds": secs},
            "modelcheck": {"verdict": "survived", "seconds": 1.0}}


def test_table_from_fake_results() -> None:
    text = gs.table([_fake("a", "killed", 2.0), _fake("b", "killed", 4.0), _fake("c", "survived", 60.0)], "CMD")
    assert text.startswith("`CMD`")
    assert "check: killed 2/3; first failure median 3.0 s" in text
    assert "modelcheck: killed 0/3; no failure" in text
    assert "| c | r | survived (60.0 s) |" in text


def test_resumption_skips_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gs, "all_mutants", lambda w: [])
    monkeypatch.setattr(gs, "zoo_names", lambda: ["A", "B"])
    gs.result_path(tmp_path, "zoo:A").write_text(json.dumps(_fake("zoo:A", "killed", 1.0)))
    ran: list[str] = []

    def fake_run(w: object, t: str, to: float, gates: tuple[str, ...], zoo: str,
                 steps: int | None, *rest: object) -> dict[str, object]:
        assert gates == ("check", "modelcheck") and zoo == "tests.bugzoo.zoo"
        ran.append(t)
        return _fake(t, "killed", 1.0)
    monkeypatch.setattr(gs, "run_target", fake_run)
    assert gs.main(["run", "W", "--zoo", "-1", "--out", str(tmp_path)]) == 0
    assert ran == ["zoo:B"]
    assert gs.main(["table", str(tmp_path)]) == 0


def test_bad_shard_exit_2(tmp_path: Path) -> None:
    assert gs.main(["run", "W", "--shard", "3/2", "--out", str(tmp_path)]) == 2


def test_events_count_the_trace_lines(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"a": 1}\n{"b": 2}\n\n')
    assert gs._events({"failure": {"trace": str(trace)}}) == 2
    assert gs._events({}) is None


def test_zoo_alone_reads_no_workdir_and_runs_the_gates_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_mutants(w: object) -> list[str]:
        raise AssertionError("--sample 0 must not read the mutmut workdir")
    monkeypatch.setattr(gs, "all_mutants", no_mutants)
    monkeypatch.setattr(gs, "zoo_names", lambda: ["A"])
    seen: list[tuple[str, ...]] = []

    def fake_run(w: object, t: str, to: float, gates: tuple[str, ...], zoo: str,
                 steps: int | None, *rest: object) -> dict[str, object]:
        assert zoo == "tests.bugzoo.zoo_full"
        seen.append(gates)
        return {"target": t, "rule": "", "check": {"verdict": "killed", "seconds": 9.0, "found_after_s": 1.234}}
    monkeypatch.setattr(gs, "run_target", fake_run)
    assert gs.main(["run", "-", "--sample", "0", "--zoo", "-1", "--gates", "check", "--zoo-as", "impl",
                    "--out", str(tmp_path)]) == 0
    assert seen == [("check",)]
    text = gs.table([json.loads(f.read_text()) for f in tmp_path.glob("*.json")], "CMD")
    # time to first failure is the check's clock at the failure, not the whole run's
    assert "check: killed 1/1; first failure median 1.2 s" in text
    assert "caught after 1.2 s" in text
    assert "modelcheck:" not in text  # a gate not run has no summary line


def test_unknown_gate_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gs.main(["run", "-", "--sample", "0", "--gates", "check,tlc", "--out", str(tmp_path)]) == 2
    assert "--gates" in capsys.readouterr().err


def test_the_docs_quote_the_zoo_record() -> None:
    """docs/bugzoo.md's figures for the gate alone on the zoo are the record's table."""
    root = Path(gs.ROOT)
    record = root / "data" / "results" / "gate-strength-zoo"
    text = gs.table([json.loads(f.read_text()) for f in sorted(record.glob("*.json"))], "CMD")
    line = next(x for x in text.splitlines() if x.startswith("- check:"))
    killed, timing = line.split("killed ", 1)[1].split("; first failure ")
    doc = " ".join((root / "docs" / "bugzoo.md").read_text().split())
    n = killed.split("/")[1]
    assert killed == f"{n}/{n}"
    assert f"kills all {n} zoo bugs" in doc


def test_a_second_pass_runs_the_model_checker_on_the_checks_survivors_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gs, "zoo_names", lambda: ["Dead", "Alive"])
    verdicts = {"zoo:Dead": "killed", "zoo:Alive": "survived"}
    calls: list[tuple[str, tuple[str, ...]]] = []

    def fake_run(w: object, t: str, to: float, gates: tuple[str, ...], zoo: str,
                 steps: int | None, *rest: object) -> dict[str, object]:
        calls.append((t, gates))
        return {"target": t, "rule": "-", **{g: {"verdict": verdicts[t], "seconds": 1.0} for g in gates}}
    monkeypatch.setattr(gs, "run_target", fake_run)
    args = ["run", "-", "--sample", "0", "--zoo", "-1", "--out", str(tmp_path)]
    assert gs.main([*args, "--gates", "check"]) == 0
    assert gs.main([*args, "--gates", "check,modelcheck"]) == 0
    assert calls == [("zoo:Dead", ("check",)), ("zoo:Alive", ("check",)), ("zoo:Alive", ("modelcheck",))]
    alive = json.loads(gs.result_path(tmp_path, "zoo:Alive").read_text())
    assert set(alive) >= {"check", "modelcheck"}  # the first pass's result kept beside the second's


def test_a_scheduler_that_cannot_be_built_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Proc:
        returncode = 2
        stdout = ""
        stderr = "schedspec: error: --against impl: cannot build the scheduler: TypeError: boom\n"
    monkeypatch.setattr(gs.subprocess, "run", lambda *a, **k: Proc())
    assert gs._run_gate(tmp_path, "check", "impl", 5.0)["verdict"] == "killed (cannot build)"
    Proc.stderr = "schedspec: error: --steps must be positive\n"
    assert gs._run_gate(tmp_path, "check", "impl", 5.0)["verdict"] == "error (exit 2)"


def test_survivors_get_a_reason_from_the_unmutated_gates_line_coverage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    diff = ("--- schedspec/impl/allocation.py\n+++ schedspec/impl/allocation.py\n@@ -1,3 +1,3 @@\n"
            "-        self._free(req.block_ids)\n+        self._free(None)\n"
            "         req.block_ids = []\n         req.cached_block_tuple = ()\n")
    from tools.mutation.apply_diff import mutated_lines
    path, lines = mutated_lines(diff, gs.ROOT)
    text = path.read_text().splitlines()
    assert [text[n - 1].strip() for n in lines] == ["self._free(req.block_ids)"]

    class Shown:
        stdout = diff
    monkeypatch.setattr(gs.subprocess, "run", lambda *a, **k: Shown())
    for name, verdict in (("m1", "survived"), ("m2", "survived"), ("m3", "killed")):
        gs.result_path(tmp_path, name).write_text(json.dumps(
            {"target": name, "rule": "r", "check": {"verdict": verdict, "seconds": 1.0}}))
    for ran, want in ((set(lines), "reached, not observed"), (set(), "not reached")):
        monkeypatch.setattr(gs, "executed_lines", lambda out, steps, ran=ran: {"impl/allocation.py": ran})
        assert gs.reasons(tmp_path, tmp_path, 10) == 0
        results = {r["target"]: r for r in (json.loads(f.read_text()) for f in tmp_path.glob("*.json"))}
        assert results["m1"]["reason"] == results["m2"]["reason"] == want
        assert "reason" not in results["m3"]  # killed: nothing to explain
        assert f"survived every gate run: 2 (2 {want})" in gs.table(list(results.values()), "CMD")


def test_a_step_budget_replaces_the_checks_time() -> None:
    assert gs.gate_command("check")[:3] == ["check", "--time", "60"]
    cmd = gs.gate_command("check", 6000)
    assert cmd[:3] == ["check", "--steps", "6000"] and "--time" not in cmd
    assert gs.gate_command("modelcheck", 6000) == gs.GATES["modelcheck"]


def test_the_docs_quote_the_zoo_record_with_impls_capabilities() -> None:
    """docs/bugzoo.md's time to the first failure declaring impl's
    capabilities is the table of the zoo run of the record it names."""
    root = Path(gs.ROOT)
    named = " ".join((root / "docs" / "bugzoo.md").read_text().split()).split("docs/coverage.md (record `", 1)[1]
    notes = json.loads((root / "data" / "results" / f"{named.split('`')[0]}.json").read_text())["notes"]
    raw = next(n for n in notes if "the zoo's raw results: " in n).split("the zoo's raw results: ")[1].strip("/")
    record = root / raw
    text = gs.table([json.loads(f.read_text()) for f in sorted(record.glob("*.json"))], "CMD")
    line = next(x for x in text.splitlines() if x.startswith("- check:"))
    killed, rest = line.split("killed ", 1)[1].split("; first failure ")
    timing, steps = rest.split("; steps run to it ")
    doc = " ".join((root / "docs" / "bugzoo.md").read_text().split())
    n = killed.split("/")[1]
    assert killed == f"{n}/{n}"
    median, _p90, most = (x.split()[-2] for x in timing.split(", "))
    most_steps = int(steps.split("max ")[1])
    assert f"all {n} declaring impl's capabilities: first failure median {median} s, max {most} s ({most_steps:,} steps)" in doc
    assert "--zoo-as impl" in (record / "command.txt").read_text()


def test_the_shrink_time_and_niceness_are_options() -> None:
    cmd = gs.gate_command("check", None, 10)
    assert cmd[cmd.index("--shrink-time") + 1] == "10"
    assert gs.gate_command("check")[gs.gate_command("check").index("--shrink-time") + 1] == "30"


def test_pack_and_unpack_carry_a_run_over(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, again = tmp_path / "out", tmp_path / "again"
    out.mkdir()
    (out / "command.txt").write_text("tools/gate_strength.py run W\n")
    for t, v in (("a", "killed"), ("zoo:B", "survived")):
        gs.result_path(out, t).write_text(json.dumps(_fake(t, v, 1.0)))
    assert gs.main(["pack", str(out)]) == 0
    packed = tmp_path / "r.jsonl"
    packed.write_text(capsys.readouterr().out)
    assert gs.main(["unpack", str(packed), str(again)]) == 0
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in out.iterdir())
    assert json.loads(gs.result_path(again, "zoo:B").read_text()) == _fake("zoo:B", "survived", 1.0)
    packed.write_text('{"target": "a"}\n{oops\n')
    assert gs.main(["unpack", str(packed), str(tmp_path / "bad")]) == 2
    assert "r.jsonl:2: not JSON" in capsys.readouterr().err


def test_a_wall_clock_timeout_is_undecided_and_run_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(*a: object, **k: object) -> None:
        raise gs.subprocess.TimeoutExpired(cmd="check", timeout=5.0)
    monkeypatch.setattr(gs.subprocess, "run", slow)
    undecided = gs._run_gate(tmp_path, "check", "impl", 5.0)
    assert undecided["verdict"] == gs.UNDECIDED
    result = {"target": "zoo:Slow", "rule": "-", "check": undecided}
    assert not gs.survived_every_gate(result)
    assert "killed 0/1, 1 undecided" in gs.table([result], "cmd")
    # a resumed run asks the gate again
    monkeypatch.setattr(gs, "zoo_names", lambda: ["Slow"])
    gs.result_path(tmp_path, "zoo:Slow").write_text(json.dumps(result))
    calls: list[tuple[str, ...]] = []

    def fake_run(w: object, t: str, to: float, gates: tuple[str, ...], *rest: object) -> dict[str, object]:
        calls.append(gates)
        return {"target": t, "rule": "-", **{g: {"verdict": "killed", "seconds": 1.0} for g in gates}}
    monkeypatch.setattr(gs, "run_target", fake_run)
    assert gs.main(["run", "-", "--sample", "0", "--zoo", "-1", "--out", str(tmp_path), "--gates", "check"]) == 0
    assert calls == [("check",)]


def test_a_registered_survivor_takes_its_reason_from_the_register(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "schedspec.impl.connector.xǁConnectorMixinǁ_free_table__mutmut_13"
    assert gs.GATE_SURVIVORS[name][0] == "equivalent"
    gs.result_path(tmp_path, name).write_text(json.dumps(
        {"target": name, "rule": "r", "check": {"verdict": "survived", "seconds": 1.0}}))
    monkeypatch.setattr(gs, "executed_lines", lambda out, steps: {})

    def no_show(*a: object, **k: object) -> None:
        raise AssertionError("a registered survivor needs no diff")
    monkeypatch.setattr(gs.subprocess, "run", no_show)
    assert gs.reasons(tmp_path, tmp_path, 10) == 0
    reason = json.loads(gs.result_path(tmp_path, name).read_text())["reason"]
    assert reason.startswith("equivalent: num_slots None")
