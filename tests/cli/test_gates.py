"""--gates in check and replay: the default draws every gate the scheduler
under test supports (none for a scheduler that declares none), a bad or
unsupported gate exits 2 naming it, the summary and the counterexample trace
record the gates, replay skips traces outside --gates."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

from schedspec.check import trace as tracefile
from schedspec.check.features import GATES
from schedspec.check.workload import GrammarReady, Pause, Step, Workload, AddRequest
from schedspec.cli.main import main
from schedspec.spec.interface import RequestSpec, SchedulerConfig

#: a scheduler that declares no capabilities: the spec's class named as a user's (no gate, no async)
PLAIN = "schedspec.spec.scheduler:SpecScheduler"

CFG = SchedulerConfig(block_size=2, num_blocks=17, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=24)


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_a_bad_gate_exits_2_naming_it(tmp_path: Path) -> None:
    rc, out = run(["check", "--gates", "lora,wormhole", "--steps", "10", "--quiet", "--out", str(tmp_path)])
    assert rc == 2 and "--gates: unknown gate 'wormhole'" in out


def test_a_gate_the_scheduler_lacks_exits_2_naming_it(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", PLAIN, "--gates", "lora,pause", "--steps", "10", "--quiet",
                   "--out", str(tmp_path)])
    assert rc == 2 and f"--gates: {PLAIN} does not support the gate(s) lora, pause" in out


def test_a_scheduler_without_gates_checks_as_before(tmp_path: Path) -> None:
    rc, out = run(["check", "--against", PLAIN, "--steps", "100", "--quiet", "--out", str(tmp_path),
                   "--json", str(tmp_path / "s.json")])
    assert rc == 0, out
    assert "gates: none" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["gates"] == [] and summary["rule_coverage"]["gates"] == []


def test_the_spec_draws_every_gate_by_default_and_the_summary_says_so(tmp_path: Path) -> None:
    # (whatever the run finds: this is about what the summary records)
    _, out = run(["check", "--against", "spec", "--generator", "random", "--steps", "400", "--workload-steps",
                  "50", "--quiet", "--out", str(tmp_path), "--json", str(tmp_path / "s.json"),
                  "--shrink-time", "1"])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["gates"] == list(GATES)
    assert summary["kv"] == ["connector", "hybrid"]  # and every KV feature too
    assert f"gates: {', '.join(GATES)} (each workload a subset;" in out
    rc_none, out_none = run(["check", "--against", "spec", "--gates", "none", "--steps", "50", "--quiet",
                             "--out", str(tmp_path / "none"), "--json", str(tmp_path / "n.json")])
    assert rc_none == 0 and json.loads((tmp_path / "n.json").read_text())["gates"] == []


def _gated_trace(path: Path) -> Path:
    events = (AddRequest(RequestSpec("g", (1, 2, 3), 2, structured_output=True)), Step(), Pause("new"),
              GrammarReady("g"), Step())
    tracefile.write(path, tracefile.Trace(Workload(CFG, events)))
    return path


def test_replay_skips_traces_outside_the_gates(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _gated_trace(corpus / "gated.jsonl")
    shutil.copy(next(Path("vectors/spec").glob("*.jsonl")), corpus / "plain.jsonl")
    rc, out = run(["replay", str(corpus), "--gates", "pause"])
    assert rc == 0, out
    assert "SKIPPED" in out and "gated.jsonl: uses the gate(s) grammar, outside --gates pause" in out
    assert "OK: replayed 1 traces" in out
    rc, out = run(["replay", str(corpus / "gated.jsonl"), "--gates", "none"])
    assert rc == 2 and "uses the gate(s) grammar, pause, outside --gates none" in out
    rc, out = run(["replay", str(corpus / "gated.jsonl")])
    assert rc == 0, out
    rc, out = run(["replay", str(corpus), "--gates", "bogus"])
    assert rc == 2 and "--gates: unknown gate 'bogus'" in out


def test_replay_against_a_scheduler_without_gates_skips_the_gated_traces(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _gated_trace(corpus / "gated.jsonl")
    shutil.copy(next(Path("vectors/spec").glob("*.jsonl")), corpus / "plain.jsonl")
    rc, out = run(["replay", str(corpus), "--against", PLAIN])
    assert rc == 0, out
    assert "SKIPPED" in out and f"outside --gates all of {PLAIN}'s: none" in out and "OK: replayed 1 traces" in out
    # one gated trace named alone: refused, naming what the scheduler lacks
    rc, out = run(["replay", str(corpus / "gated.jsonl"), "--against", PLAIN])
    assert rc == 2 and "does not support what the trace uses" in out
    rc, out = run(["replay", str(corpus), "--against", PLAIN, "--gates", "pause"])
    assert rc == 2 and f"--gates: {PLAIN} does not support the gate(s) pause" in out


def _reachable(gates: tuple[str, ...], engine: bool = True) -> int:
    """The rules reachable with ``gates`` and (drawn by default) every engine feature."""
    from schedspec.check.features import ENGINE_FEATURES, GATE_CAPABILITIES, engine_capabilities
    from schedspec.spec.rule_names import ALL_MODES, reachable_in

    return len(reachable_in(ALL_MODES, tuple(GATE_CAPABILITIES[g] for g in gates)
                            + (engine_capabilities(ENGINE_FEATURES) if engine else ())))


def test_rule_coverage_counts_the_rules_of_the_gates_the_run_drew(tmp_path: Path) -> None:
    # by default every gate is on: their rules are reachable, not out of reach
    rc, out = run(["check", "--steps", "150", "--kv", "none", "--quiet", "--out", str(tmp_path), "--rules",
                   "--json", str(tmp_path / "s.json")])
    assert rc == 0, out
    n = _reachable(GATES)
    assert n > _reachable(()) and f" of the {n} rules reachable in sync, async, spec, async-spec with gates " in out
    table = {line.split()[0]: line for line in out.splitlines() if line.startswith("    ")}
    for rule in ("encoder.evicted", "watermark.blocked", "pause.all_empty_step", "cadence.hold"):
        assert "out of reach" not in table[rule], table[rule]
    assert json.loads((tmp_path / "s.json").read_text())["rule_coverage"]["reachable"] == n


def test_rule_coverage_leaves_out_the_gates_the_run_did_not_draw(tmp_path: Path) -> None:
    rc, out = run(["check", "--gates", "encoder", "--kv", "none", "--engine", "none", "--steps", "100", "--quiet",
                   "--out", str(tmp_path)])
    assert rc == 0, out
    assert f" of the {_reachable(('encoder',), False)} rules reachable in sync, async, spec, async-spec with gates encoder " in out
    rc, out = run(["check", "--gates", "none", "--kv", "none", "--engine", "none", "--steps", "100", "--quiet",
                   "--out", str(tmp_path), "--rules"])
    assert rc == 0, out
    assert f" of the {_reachable((), False)} rules reachable in sync, async, spec, async-spec reached" in out
    table = {line.split()[0]: line for line in out.splitlines() if line.startswith("    ")}
    assert table["encoder.evicted"].endswith("out of reach")
