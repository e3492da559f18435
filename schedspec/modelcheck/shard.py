"""Sharding a bound across the jobs of a CI matrix, and merging the shards' JSON reports.

``shard_spaces(names, k, n)`` is the spaces job ``k`` of ``n`` explores: every
``n``-th of the bound's spaces (those the scheduler under test supports, in the
bound's order), starting at the ``k``-th. Every space is explored whole by one
job, so the union of the shards is the unsharded run: ``merge_reports`` puts
the shards' spaces back in the bound's order and recomputes what the
unsharded report derives from them (totals, rule counts, the unreached and
missing rules). A space's frontier is not split: a bound scales out as far as
it has spaces.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from schedspec.modelcheck.space import ModelCheckError, bound
from schedspec.spec import coverage as rule_coverage
from schedspec.spec.effects import effect_counts

#: The report fields every shard of one run must agree on.
SAME_IN_EVERY_SHARD = ("bound", "impl", "invariants", "against", "mode", "invariant_ids", "rules_required")


def shard_spaces(names: Sequence[str], k: int, n: int) -> list[str]:
    """The spaces job ``k`` (1-based) of ``n`` explores."""
    if not 1 <= k <= n:
        raise ModelCheckError(f"shard {k}/{n}: need 1 <= K <= N")
    return list(names[k - 1 :: n])


def _shard_of(label: str, report: Mapping[str, Any]) -> tuple[int, int]:
    shard = report.get("shard")
    if not isinstance(shard, Mapping) or not isinstance(shard.get("k"), int) or not isinstance(shard.get("n"), int):
        raise ModelCheckError(f"{label}: not a shard's report (no 'shard': {{'k': K, 'n': N}}; run with --shard K/N)")
    return int(shard["k"]), int(shard["n"])


def merge_reports(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One report from the shards' JSON reports (label -> report): every shard
    of one run, each once. ModelCheckError naming the label that does not fit."""
    if not reports:
        raise ModelCheckError("no shard reports to merge")
    labels = list(reports)
    first = reports[labels[0]]
    seen: dict[int, str] = {}
    n0 = _shard_of(labels[0], first)[1]
    for label in labels:
        r = reports[label]
        k, n = _shard_of(label, r)
        if n != n0:
            raise ModelCheckError(f"{label}: shard {k}/{n}, but {labels[0]} is a shard of {n0}")
        if k in seen:
            raise ModelCheckError(f"{label}: shard {k}/{n} again (also {seen[k]})")
        seen[k] = label
        for key in SAME_IN_EVERY_SHARD:
            if r.get(key) != first.get(key):
                raise ModelCheckError(f"{label}: {key} is {r.get(key)!r}, {labels[0]} has {first.get(key)!r}")
    missing = sorted(set(range(1, n0 + 1)) - set(seen))
    if missing:
        raise ModelCheckError(f"shards {', '.join(f'{k}/{n0}' for k in missing)} missing")
    order = {s.name: i for i, s in enumerate(bound(str(first["bound"])).spaces)}
    spaces = sorted((s for r in reports.values() for s in r["spaces"]),
                    key=lambda s: order.get(s["space"]["name"], len(order)))
    rules: Counter[str] = Counter()
    for s in spaces:
        rules.update(s["rules"])
        rules.update(s.get("effects", {}))  # counted with the rules (spec/effects.py)
    states = sum(int(s["states"]) for s in spaces)
    elapsed = sum(float(s["elapsed_s"]) for s in spaces)
    cpu = sum(float(s["cpu_s"]) for s in spaces)
    bounds = [s["liveness_bound"] for s in spaces if s["liveness_bound"] is not None]
    failed = [r for r in reports.values() if r.get("result") == "fail"]
    merged: dict[str, Any] = dict(first)
    merged.update({
        "result": "fail" if failed else "pass",
        "states": states,
        "transitions": sum(int(s["transitions"]) for s in spaces),
        "depth": max((int(s["depth"]) for s in spaces), default=0),
        "elapsed_s": round(elapsed, 3),
        "states_per_s": round(states / elapsed, 1) if elapsed > 0 else None,
        "cpu_s": round(cpu, 3),
        "states_per_cpu_s": round(states / cpu, 1) if cpu > 0 else None,
        "liveness_bound": max(bounds) if bounds else None,
        "rules": rule_coverage.as_dict(rules),
        "rules_unreached": rule_coverage.unreached(rules),
        "effects": effect_counts(rules),
        "spaces": spaces,
        "workers": max(int(r.get("workers", 1)) for r in reports.values()),
        "rules_missing": rule_coverage.unreached(rules, first.get("rules_required") or ()),
        "merged_shards": n0,
    })
    merged.pop("shard", None)
    for key in ("trace", "replay"):
        merged.pop(key, None)
        if failed and key in failed[0]:
            merged[key] = failed[0][key]
    return merged
