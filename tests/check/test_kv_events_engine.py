"""The checking engine with KV cache events on: the driver takes every
scheduler's stream once per update and compares them; the capability gates
the config; ``check --kv-events`` / ``--events FILE`` on the CLI; a recorded
stream read back with every line checked."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from schedspec.check.capabilities import FULL, Capabilities
from schedspec.check.kv_events_file import read_events, stream_problems
from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.cli.main import main
from schedspec.spec import SpecScheduler
from schedspec.spec.kv_events import BlockRemoved, KVCacheEvent, KVEventError
from tests.helpers import cfg


class ForgetsRemovals(SpecScheduler):
    """Publishes no BlockRemoved: a router would keep evicted blocks."""

    def take_kv_events(self) -> tuple[KVCacheEvent, ...]:
        return tuple(e for e in super().take_kv_events() if not isinstance(e, BlockRemoved))


def _events_workload():  # type: ignore[no-untyped-def]
    """A seeded workload with events on whose stream holds a removal."""
    for seed in range(20):
        w = random_workload(seed, 150)
        w = dataclasses.replace(w, config=dataclasses.replace(w.config, enable_kv_cache_events=True))
        seen: list[KVCacheEvent] = []
        runner, failure = run_workload(w, {"spec": SpecScheduler}, kv_event_sink=lambda _s, ev: seen.extend(ev))
        assert failure is None
        if any(isinstance(e, BlockRemoved) for e in seen):
            return w
    raise AssertionError("no seed evicts a cached block")


def test_a_stream_that_drops_removals_diverges_and_breaks_the_mirror() -> None:
    w = _events_workload()
    _, failure = run_workload(w, {"spec": SpecScheduler, "bad": ForgetsRemovals})
    assert failure is not None and failure.scheduler == "bad"
    assert "take_kv_events() differs" in failure.message or any(
        v.invariant_id == "kv-events-mirror-exact" for v in failure.violations)
    _, alone = run_workload(w, {"bad": ForgetsRemovals})
    assert alone is not None and {v.invariant_id for v in alone.violations} == {"kv-events-mirror-exact"}


def test_the_capability_keeps_events_out_of_a_scheduler_without_it() -> None:
    c = cfg(enable_kv_cache_events=True)
    assert FULL.config_problems(c) == ["enable_kv_cache_events=True"]
    assert FULL.restrict_config(c).enable_kv_cache_events is False
    assert Capabilities(kv_events=True).restrict_config(c) is c
    assert "kv_events" in FULL.missing() and "kv_events" in Capabilities(kv_events=True).names()


def _cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_check_kv_events_against_a_scheduler_without_the_capability_exits_2(tmp_path: Path) -> None:
    plain = "schedspec.spec.scheduler:SpecScheduler"  # named as a user's class: declares nothing
    for flag in (["--kv-events"], ["--events", str(tmp_path / "e.jsonl")]):
        rc, out = _cli(["check", "--against", plain, *flag, "--steps", "10", "--quiet", "--out", str(tmp_path)])
        assert rc == 2 and f"{flag[0]}: {plain} does not take KV cache events" in out


def test_check_events_writes_a_stream_a_consumer_reads_back_clean(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    rc, out = _cli(["check", "--against", "impl", "--events", str(path), "--steps", "150", "--quiet",
                    "--gates", "none", "--kv", "none", "--out", str(tmp_path)])
    assert rc == 0, out
    lines = path.read_text().splitlines()
    assert lines and f"KV cache events: {len(lines)} written to {path}" in out
    assert len(list(read_events(path))) == len(lines)
    assert stream_problems(path) == []
    # a removal of a key no block holds: the consumer check names it
    first = json.loads(lines[-1])
    bad = {"workload": first["workload"], "step": first["step"],
           "event": {"type": "BlockRemoved", "block_keys": [["", [99]]], "medium": "GPU", "group": 0}}
    path.write_text("\n".join([*lines, json.dumps(bad)]) + "\n")
    (problem,) = stream_problems(path)
    assert f"{path}: workload {first['workload']}" in problem and "no stored block holds" in problem


@pytest.mark.parametrize("line, why", [
    ("{", "line 1: not valid JSON"),
    ("[]", "line 1: a line is a JSON object"),
    ('{"workload": 0, "step": "x", "event": {}}', "line 1: step: must be an int"),
    ('{"workload": 0, "step": 1, "event": {"type": "Evicted"}}', "line 1: event.type: not one of vLLM's event types"),
])
def test_a_malformed_recorded_stream_is_refused_naming_file_line_and_field(tmp_path: Path, line: str,
                                                                           why: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(KVEventError, match=why):
        list(read_events(path))
