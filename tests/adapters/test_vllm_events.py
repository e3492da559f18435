"""vLLM's own KV cache events (KVEventsConfig(enable_kv_cache_events=True,
publisher="null"), captured where the scheduler publishes them) equal the
spec's in lockstep, in sync and async scheduling and on hybrid layouts."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest

from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import SchedulerConfig

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM and os.environ.get("SCHEDSPEC_REQUIRE_VLLM") != "1",
                       reason="vLLM is not installed (scripts/install_vllm.sh VENV)"),
]


def _vllm() -> type:
    from schedspec.adapters.vllm_adapter import VllmScheduler

    return VllmScheduler


@pytest.mark.parametrize("modes, kv", [(("sync",), ()), (("async",), ()), (("sync",), ("hybrid",)),
                                       (("async-spec",), ("hybrid", "connector"))])
def test_vllm_streams_equal_the_spec_in_lockstep(modes: tuple[str, ...], kv: tuple[str, ...]) -> None:
    events = 0
    for seed in range(2):
        w = random_workload(seed, 80, modes=modes, kv=kv)
        w = dataclasses.replace(w, config=dataclasses.replace(w.config, enable_kv_cache_events=True))
        runner, failure = run_workload(w, {"spec": SpecScheduler, "vllm": _vllm()}, oracle_seed=seed)
        assert failure is None, failure.describe()
        events += runner.stats.kv_cache_events
    assert events > 0


def test_the_adapter_turns_vllm_events_on_only_when_asked() -> None:
    plain = _vllm()(SchedulerConfig())
    assert plain.sched.kv_cache_manager.enable_kv_cache_events is False and plain.take_kv_events() == ()
    on = _vllm()(SchedulerConfig(enable_kv_cache_events=True))
    assert on.sched.kv_cache_manager.enable_kv_cache_events is True
    assert on._vllm_config.kv_events_config.publisher == "null"


def test_event_hashes_map_to_keys_as_bytes_and_as_ints() -> None:
    from schedspec.adapters.vllm_views import BlockKeys

    keys = BlockKeys(4)
    h = bytes(range(32))
    keys._keys[h] = ("", (1, 2, 3, 4))
    assert keys.event_key(h) == ("", (1, 2, 3, 4))
    assert keys.event_key(int.from_bytes(h, "big") & ((1 << 64) - 1)) == ("", (1, 2, 3, 4))
    from schedspec.adapters.vllm_load import VllmAdapterError

    with pytest.raises(VllmAdapterError, match="no known request"):
        keys.event_key(12345)


def test_a_failed_load_evicts_in_vllms_set_order() -> None:
    """The counterexample that found it: two sync loads fail under the "fail"
    policy; vLLM's evict_blocks walks a set, not the request's table order."""
    from pathlib import Path

    from schedspec.check import trace as tracefile

    path = Path(__file__).resolve().parents[1] / "check" / "data" / "kv-events-evict-blocks-set-order.jsonl"
    t = tracefile.read(path)
    assert t.workload.config.enable_kv_cache_events
    runner, failure = run_workload(t.workload, {"spec": SpecScheduler, "vllm": _vllm()}, t.vocab,
                                   oracle_seed=t.oracle_seed)
    assert failure is None, failure.describe()
    assert runner.stats.kv_cache_events >= 3


def test_a_full_report_mode_request_reports_its_hits_as_vllm_does() -> None:
    """The crafted trace: b (kv_cache_report_mode "full") hits a's prefix on a
    hybrid layout and is looked up, and reported, in every step its admission
    fails; vLLM's emit_cached_block_events events equal the spec's, marked
    reused (vllm_events.ReusedMarks)."""
    from tests.spec.test_kv_report_mode import replay_reported

    reported = replay_reported("vllm", _vllm())
    assert len(reported) >= 12 and len(set(reported)) >= 6


def test_the_adapter_hands_vllm_the_report_mode() -> None:
    from schedspec.adapters.vllm_names import block_hasher
    from schedspec.adapters.vllm_requests import vllm_request
    from schedspec.spec.interface import RequestSpec

    full = vllm_request(RequestSpec("r", (1, 2), 1, kv_cache_report_mode="full"), block_hasher(4), False)
    assert full.kv_cache_report_mode == "full"
    plain = vllm_request(RequestSpec("p", (1, 2), 1), block_hasher(4), False)
    assert plain.kv_cache_report_mode == "incremental"
