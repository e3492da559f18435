"""A request's kv_cache_report_mode (vllm/v1/request.py, Request.__init__):
with "full" and KV cache events on, every prefix lookup that hits
(KVCacheManager.get_computed_blocks) reports the hit blocks as one reused
BlockStored per KV cache group with a hit (BlockPool.emit_cached_block_events),
at lookup time, even when the admission then fails; nothing else changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from schedspec.check import trace as tracefile
from schedspec.check.run import run_workload
from schedspec.impl import ImplScheduler
from schedspec.invariants.kv_mirror import KVMirror
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import KVCacheGroup, RequestError, RequestSpec, SchedulerFactory
from schedspec.spec.kv_events import MEDIUM_GPU, BlockStored, event_from_dict, event_to_dict
from tests.helpers import cfg, req, step

TRACE = Path(__file__).resolve().parents[1] / "check" / "data" / "kv-events-full-report-mode.jsonl"


def _hit(mode: str, events: bool = True, **kw: object) -> tuple[SpecScheduler, tuple[object, ...]]:
    """a's 9 tokens cached (2 full blocks), then b shares its first 8 and looks them up."""
    s = SpecScheduler(cfg(enable_kv_cache_events=events, **kw))
    s.add(req("a", 9, max_tokens=1))
    step(s)
    step(s)
    s.take_kv_events()
    s.add(req("b", list(range(8)) + [40, 41], max_tokens=1, kv_cache_report_mode=mode))
    step(s)
    return s, s.take_kv_events()


def test_a_full_request_reports_its_hit_as_one_reused_block_stored() -> None:
    _, events = _hit("full")
    reported = events[0]
    assert reported == BlockStored(
        block_keys=(("", (0, 1, 2, 3)), ("", tuple(range(8)))), parent_key=None, token_ids=tuple(range(8)),
        block_size=4, lora_id=None, medium=MEDIUM_GPU, group=0, kind="full_attention", reused=True)
    assert not any(isinstance(e, BlockStored) and e.reused for e in events[1:])


def test_an_incremental_request_and_events_off_report_nothing_and_decide_the_same() -> None:
    full, events = _hit("full")
    inc, plain = _hit("incremental")
    assert [e for e in events if not (isinstance(e, BlockStored) and e.reused)] == list(plain)
    assert full.view().kv == inc.view().kv  # no block changes
    off, none = _hit("full", events=False)
    assert none == () and off.kv.events is None


def test_a_hybrid_layout_reports_each_group_with_a_hit_the_keys_the_request_names() -> None:
    _, events = _hit("full", num_blocks=40, max_model_len=32,
                     kv_cache_groups=(KVCacheGroup(), KVCacheGroup("sliding_window", 4)))
    full, window = events[:2]
    assert isinstance(full, BlockStored) and isinstance(window, BlockStored) and full.reused and window.reused
    assert (full.group, full.kind, window.group, window.kind) == (0, "full_attention", 1, "sliding_window")
    # the window's mask cached only block 1; the report names both, as vLLM's request hashes do
    assert window.block_keys == full.block_keys and len(window.block_keys) == 2


def test_the_lora_adapter_travels_with_the_report() -> None:
    s = SpecScheduler(cfg(enable_kv_cache_events=True, max_loras=1))
    s.add(req("a", 9, max_tokens=1, lora_id=2))
    step(s)
    step(s)
    s.take_kv_events()
    s.add(req("b", 9, max_tokens=1, lora_id=2, kv_cache_report_mode="full"))
    step(s)
    reported = s.take_kv_events()[0]
    assert isinstance(reported, BlockStored) and reported.reused and reported.lora_id == 2
    assert reported.block_keys[0][0] == RequestSpec("x", (0,), 1, lora_id=2).block_identity(4)


def replay_reported(name: str, factory: SchedulerFactory) -> list[int]:
    """The crafted trace replayed in lockstep, the spec against ``factory``
    (named ``name``): the steps of each reused BlockStored, the failure
    asserted absent."""
    t = tracefile.read(TRACE)
    reported: list[int] = []
    runner, failure = run_workload(t.workload, {"spec": SpecScheduler, name: factory}, t.vocab,
                                   oracle_seed=t.oracle_seed,
                                   kv_event_sink=lambda n, batch: reported.extend(
                                       n for e in batch if isinstance(e, BlockStored) and e.reused))
    assert failure is None, failure.describe()
    return reported


def test_the_crafted_trace_replays_equal_against_impl() -> None:
    assert tracefile.version_of(tracefile.read(TRACE)) == 8
    reported = replay_reported("impl", ImplScheduler)
    # two groups reported per lookup; b is looked up, and reported, in the steps its admission fails too
    assert len(reported) >= 12 and len(set(reported)) >= 6


def test_the_mirror_and_json_take_a_reused_event() -> None:
    e = BlockStored((("", (1, 2)),), None, (1, 2), 2, None, MEDIUM_GPU, 0, "full_attention", reused=True)
    assert event_from_dict(event_to_dict(e)) == e and event_to_dict(e)["reused"] is True
    assert "reused" not in event_to_dict(BlockStored((), None, (), 2, None, MEDIUM_GPU, 0, "full_attention"))
    mirror = KVMirror()
    assert mirror.apply(e) == [] and mirror.index() == {}


def test_a_report_mode_vllm_does_not_name_is_refused_naming_the_field() -> None:
    with pytest.raises(RequestError, match="kv_cache_report_mode"):
        RequestSpec("r", (1,), 1, kv_cache_report_mode="partial")


def test_a_trace_before_version_8_may_not_name_it(tmp_path: Path) -> None:
    lines = TRACE.read_text().splitlines()
    bad = tmp_path / "t.jsonl"
    bad.write_text("\n".join([lines[0].replace('"schedspec_trace": 8', '"schedspec_trace": 7'), *lines[1:]]))
    with pytest.raises(tracefile.TraceError, match="kv_cache_report_mode: needs trace format version 8"):
        tracefile.read(bad)


def test_the_shrinker_tries_the_request_without_its_full_report() -> None:
    from schedspec.check.shrink import _fit_request, _gate_options
    from schedspec.spec.interface import SchedulerConfig

    r = RequestSpec("r", (1, 2), 1, kv_cache_report_mode="full")
    assert RequestSpec("r", (1, 2), 1) in _gate_options(r)
    assert _fit_request(r, SchedulerConfig()).kv_cache_report_mode == "incremental"
    assert _fit_request(r, SchedulerConfig(enable_kv_cache_events=True)) == r
