"""The check counts, over the workloads with KV cache events on, the
situations that make the stream interesting (check/event_counts.py); the
default generator reaches each of them within 4,000 steps."""

from __future__ import annotations

from schedspec.adapters.registry import resolve
from schedspec.check.event_counts import REPORTED, SITUATIONS, EventsTally
from schedspec.check.gate import CheckSettings, check_summary, run_check
from schedspec.check.features import MODES
from schedspec.check.stats import Stats
from schedspec.check.workload import ResetPrefixCache, Workload
from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.kv_events import AllBlocksCleared

#: partial prefix-cache entries take a hybrid layout without a connector and a
#: hash block size drawn below the block size: rare in the default mix, reached
#: by a hybrid check (test_a_hybrid_check_reaches_the_partial_entries)
PARTIAL = ("partial entries stored", "blocks removed with partial entries")
DEFAULT_SITUATIONS = tuple(n for n in SITUATIONS if n not in PARTIAL)


def test_the_tally_counts_event_types_rules_and_asked_resets() -> None:
    tally, seen = EventsTally(), []
    sink = tally.sink(lambda step, batch: seen.append(step))
    sink(3, (AllBlocksCleared(),))
    stats = Stats(steps=5)
    stats.rules.update({"kv.evict_cached": 2, "abort.running": 1, "abort.waiting": 1})
    tally.add(stats, Workload(SchedulerConfig(), (ResetPrefixCache(True), ResetPrefixCache(False))))
    assert seen == [3] and tally.types["AllBlocksCleared"] == 1
    assert tally.counts["evictions"] == 2 and tally.counts["aborts"] == 2
    assert tally.counts["resets asked with running requests"] == 1
    assert tally.counts["resets asked without running requests"] == 1
    assert tally.line().startswith("events: 1 workloads (5 steps) with KV cache events on: 0 BlockStored")


def test_the_default_check_reaches_every_situation_with_the_events_on_in_4000_steps() -> None:
    # what `schedspec check --against impl --steps 4000` runs
    spec, impl = resolve("spec"), resolve("impl")
    outcome = run_check({"spec": spec.factory, "impl": impl.factory},
                        CheckSettings(against="impl", total_steps=4000, capabilities=impl.capabilities, modes=MODES,
                                      call_timeout=None))
    assert outcome.ok
    tally = outcome.events
    assert 0 < tally.workloads < outcome.workloads + 1
    missing = [n for n in (*DEFAULT_SITUATIONS, "resets asked with running requests",
                           "resets asked without running requests", "prefix hits in hybrid layouts", REPORTED)
               if tally.counts[n] == 0]
    missing += [t for t in ("BlockStored", "BlockRemoved", "AllBlocksCleared") if tally.types[t] == 0]
    assert missing == [], tally.line()
    summary = check_summary(CheckSettings(total_steps=4000), outcome)
    assert summary["kv_events"]["situations"]["evictions"] == tally.counts["evictions"]


def test_a_hybrid_check_reaches_the_partial_entries() -> None:
    # what `schedspec check --against impl --steps 1500 --kv hybrid --kv-events` runs
    spec, impl = resolve("spec"), resolve("impl")
    outcome = run_check({"spec": spec.factory, "impl": impl.factory},
                        CheckSettings(against="impl", total_steps=1500, capabilities=impl.capabilities,
                                      modes=("sync", "async"), kv=("hybrid",), kv_events=True, call_timeout=None))
    assert outcome.ok
    assert all(outcome.events.counts[n] > 0 for n in PARTIAL), outcome.events.line()
