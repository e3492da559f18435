"""``schedspec modelcheck --kv-events --stats``: the KV cache events and the
statistics taken after every update and compared with the scheduler under
test's (modelcheck/outputs.py, Expander._take_outputs)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path
from typing import Any

from schedspec.cli.main import main
from schedspec.invariants import CATALOGUE
from schedspec.modelcheck import check_bound
from schedspec.modelcheck.outputs import LoggedSpec, stateless
from schedspec.modelcheck.target import Against
from schedspec.spec.kv_events import BlockRemoved, KVCacheEvent
from schedspec.spec.scheduler import SpecScheduler


class DropsRemovals(SpecScheduler):
    """Reports no BlockRemoved (vllm#45261's kind: a stream that drifts)."""

    def take_kv_events(self) -> tuple[KVCacheEvent, ...]:
        return tuple(e for e in super().take_kv_events() if not isinstance(e, BlockRemoved))


class MiscountsQueries(LoggedSpec):
    """Reports one prefix-cache query too many whenever it reports any."""

    def make_stats(self) -> Any:
        stats = super().make_stats()
        if stats is not None and stats.prefix_cache_stats.queries:
            pcs = dataclasses.replace(stats.prefix_cache_stats, queries=stats.prefix_cache_stats.queries + 1)
            stats = dataclasses.replace(stats, prefix_cache_stats=pcs)
        return stats


def test_the_small_space_runs_clean_with_events_and_statistics_against_impl() -> None:
    r = check_bound("small", spaces=["fcfs-cache-tight"], kv_events=True, stats=True)
    assert r.failure is None and r.spaces[0].complete


def test_a_stream_that_drops_removals_is_a_divergence_of_take_kv_events() -> None:
    r = check_bound("small", spaces=["fcfs-cache-tight"], kv_events=True,
                    against=Against("drops", DropsRemovals))
    assert r.failure is not None and r.failure.kind == "divergence"
    assert "take_kv_events()" in r.failure.message
    # without the events the same scheduler is the spec
    assert check_bound("small", spaces=["fcfs-cache-tight"], against=Against("drops", DropsRemovals)).failure is None


def test_miscounted_statistics_are_a_divergence_of_make_stats() -> None:
    r = check_bound("small", spaces=["fcfs-cache-tight"], stats=True, against=Against("bad", MiscountsQueries))
    assert r.failure is not None and r.failure.kind == "divergence" and "make_stats()" in r.failure.message


def test_the_events_invariants_are_left_to_the_check() -> None:
    kept = stateless(CATALOGUE)
    assert kept and all(not i.id.startswith("kv-events-") for i in kept)
    assert len(kept) < len(CATALOGUE)


def test_the_cli_says_what_it_compares_and_refuses_an_undeclared_output(tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["modelcheck", "--space", "fcfs-cache-salt-tight", "--kv-events", "--stats", "--quiet",
                   "--workers", "1", "--out", str(tmp_path)])
    assert rc == 0, out.getvalue()
    assert "KV cache events" in out.getvalue() and "statistics compared after every update" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["modelcheck", "--space", "fcfs-cache-salt-tight", "--stats", "--against",
                   "schedspec.spec.scheduler:SpecScheduler", "--quiet", "--out", str(tmp_path)])
    assert rc == 2 and "--stats: schedspec.spec.scheduler:SpecScheduler does not declare Capabilities.stats" \
        in out.getvalue()
