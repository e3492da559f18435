"""The outputs other systems read, per workload of a check: the KV cache
events (spec/kv_events.py: config.enable_kv_cache_events) and the scheduler
statistics (spec/stats.py: every scheduler built with ``log_stats=True``,
check/scheduler_stats.py).

The default check draws each on for a share of the workloads (``SHARE``,
an independent draw per output from the workload's seed) wherever the
scheduler under test declares it (``Capabilities.kv_events`` /
``Capabilities.stats``), so the default run reaches vLLM's event and
statistics code and still checks the schedulers with both off, as vLLM runs
by default. ``True`` (``--kv-events`` / ``--stats``) turns one on in every
workload, ``False`` (``--no-kv-events`` / ``--no-stats``) off in all.

    events, stats = outputs_on(settings.kv_events, settings.stats, caps, seed)
    workload, factories = with_outputs(workload, factories, events, stats)
"""

from __future__ import annotations

import dataclasses
import random

from schedspec.spec.interface import SchedulerFactory

from schedspec.check.capabilities import Capabilities
from schedspec.check.scheduler_stats import with_stats
from schedspec.check.workload import AddRequest, Workload

#: The share of the default check's workloads with each output on (drawn
#: per workload; the cost, measured against impl over 2,000 steps, is about
#: 15% of the steps/s with both on, within the noise against vLLM).
SHARE = 0.75


def outputs_on(kv_events: bool | None, stats: bool | None, capabilities: Capabilities,
               seed: int, sweep: bool = False) -> tuple[bool, bool]:
    """(events on, statistics on) for the workload of ``seed``: a setting of
    True or False as it says, None drawn (SHARE), or on for a ``sweep``
    workload (coverage_guided.SWEEP: the few aimed at the rarest setups, whose
    events and statistics are the most a run sees of them), each only where
    ``capabilities`` declares it."""
    rng = random.Random(f"schedspec-outputs-{seed}")
    drawn_events, drawn_stats = rng.random() < SHARE or sweep, rng.random() < SHARE or sweep
    events = capabilities.kv_events and (drawn_events if kv_events is None else kv_events)
    on_stats = capabilities.stats and (drawn_stats if stats is None else stats)
    return events, on_stats


#: The share of a workload's requests that ask for their prefix hits to be
#: reported (kv_cache_report_mode "full"), drawn where the events are on.
FULL_REPORT_SHARE = 0.25


def with_full_reports(workload: Workload) -> Workload:
    """``workload`` with some of its requests (FULL_REPORT_SHARE, a draw per
    request on a generator seeded from the workload's seed) in
    kv_cache_report_mode "full" (spec/kv_events.py, "reused")."""
    rng = random.Random(f"schedspec-kv-report-{workload.seed}")
    events = tuple(
        AddRequest(dataclasses.replace(e.request, kv_cache_report_mode="full"))
        if isinstance(e, AddRequest) and rng.random() < FULL_REPORT_SHARE else e
        for e in workload.events
    )
    return dataclasses.replace(workload, events=events)


def with_outputs(workload: Workload, factories: dict[str, SchedulerFactory], events: bool,
                 stats: bool) -> tuple[Workload, dict[str, SchedulerFactory]]:
    """``workload`` with the KV cache events on (when ``events``; some
    requests then report their prefix hits: ``with_full_reports``), and the
    factories building their schedulers with ``log_stats`` (when ``stats``)."""
    if events and not workload.config.enable_kv_cache_events:
        workload = dataclasses.replace(workload,
                                       config=dataclasses.replace(workload.config, enable_kv_cache_events=True))
        workload = with_full_reports(workload)
    if stats:
        factories = {name: with_stats(f) for name, f in factories.items()}
    return workload, factories


def outputs_line(kv_events: bool | None, stats: bool | None, capabilities: Capabilities) -> str:
    """What a run did with the outputs, in one line (``check``'s report)."""

    def one(name: str, setting: bool | None, declared: bool, off_flag: str) -> str:
        if not declared:
            return f"{name} off (not declared by the scheduler's capabilities)"
        if setting is None:
            return f"{name} on in a share of the workloads ({SHARE:.0%}; {off_flag} turns them off)"
        return f"{name} {'on in every workload' if setting else 'off'}"

    return "outputs: " + "; ".join((one("KV cache events", kv_events, capabilities.kv_events, "--no-kv-events"),
                                    one("statistics", stats, capabilities.stats, "--no-stats")))
