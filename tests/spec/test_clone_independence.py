"""SpecScheduler.clone(): an independent scheduler in the same state.

The model checker replays every transition of a state on its own clone, so a
clone may share only immutable values with its original (the config, request
specs, views, plans). Seeded random workloads with every mode, admission gate
and KV feature (the connector's held, loading and deferred-free state, the
encoder cache, hybrid group tables, drafts, grammar errors) are driven event by
event; after each event the scheduler is cloned and:

- every mutable structure of the clone (each list, dict, set and state object,
  at any depth) is a different object from the original's, with equal
  contents, and the clone has exactly the original's fields;
- the clone's view equals the original's, and stays so while the original
  runs on; a clone run on leaves its original's view unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from typing import Any, Callable

from schedspec.check.driver import Runner
from schedspec.check.features import GATES, KV_FEATURES, MODES
from schedspec.check.random_workloads import random_workload
from schedspec.spec.scheduler import SpecScheduler


def _immutable(x: Any) -> bool:
    if x is None or isinstance(x, (bool, int, float, str, bytes, enum.Enum, frozenset)):
        return True
    if isinstance(x, tuple):
        return all(_immutable(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return bool(x.__dataclass_params__.frozen)  # type: ignore[attr-defined]
    return False


def _fields(x: Any) -> dict[str, Any]:
    out = dict(getattr(x, "__dict__", {}))
    for cls in type(x).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(x, name):
                out[name] = getattr(x, name)
    return out


def assert_independent(a: Any, b: Any, path: str = "clone") -> None:
    """``b`` equals ``a`` and shares no mutable structure with it (but the
    rule counters, which every clone adds to: coverage, not state)."""
    if path.endswith(".rules"):
        assert a is b, path
        return
    if _immutable(a):
        assert a == b, path
        return
    if isinstance(a, tuple):  # a named tuple holding a list
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_independent(x, y, f"{path}[{i}]")
        return
    assert a is not b, f"{path} is shared with the original"
    assert type(a) is type(b), path
    if isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_independent(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_independent(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, set):
        assert a == b, path
    else:
        fa, fb = _fields(a), _fields(b)
        assert sorted(fa) == sorted(fb), f"{path}: fields differ"
        for k in fa:
            assert_independent(fa[k], fb[k], f"{path}.{k}")


#: the containers of the connector, the encoder cache and the requests that
#: must be seen non-empty in a clone at least once over the workloads, so the
#: test checks each of them with contents (the loads a schedule() collects
#: are handed over in its plan, so between calls they are always empty: only
#: their identity is checked)
WATCHED: dict[str, Callable[[Any], Any]] = {
    "kv_holding": lambda s: s.kv_holding,
    "held": lambda s: s.held,
    "kv_loads_done": lambda s: s.kv_loads_done,
    "kv_loads_failed": lambda s: s.kv_loads_failed,
    "kv_loading": lambda s: s.kv_loading,
    "inflight_prefills": lambda s: s.inflight_prefills,
    "deferred_frees": lambda s: s.deferred_frees,
    "deferred": lambda s: s.deferred,
    "grammar_errors": lambda s: s.grammar_errors,
    "mm_lengths": lambda s: s.mm_lengths,
    "encoder.cached": lambda s: s.encoder.cached,
    "encoder.request_inputs": lambda s: s.encoder.request_inputs,
    "encoder.freeable": lambda s: s.encoder.freeable,
    "request.spec_token_ids": lambda s: [r for r in s.requests.values() if r.spec_token_ids],
    "request.group_blocks": lambda s: [r for r in s.requests.values() if any(r.group_blocks)],
}

SEEDS = [*range(12), 22, 42]  # 22: a failed KV load, 42: a grammar error


def _clone_after_every_event(seed: int, seen: Counter[str]) -> None:
    w = random_workload(seed, 40, vocab=8, modes=MODES, gates=GATES, kv=KV_FEATURES)
    runner = Runner(w.config, {"spec": SpecScheduler}, vocab=8, check_invariants=False)
    clones: list[tuple[Any, Any]] = []
    for i, e in enumerate(w.events):
        assert runner.apply(e) is None
        s = runner.primary
        assert isinstance(s, SpecScheduler)
        c = s.clone()
        assert_independent(s, c)
        for name, get in WATCHED.items():
            if get(c):
                seen[name] += 1
        if i % 7 == 0:
            clones.append((c, c.view()))
    # the original ran on: every clone still holds the state it was made in
    for c, snap in clones:
        assert c.view() == snap


def test_a_clone_shares_no_mutable_state_with_its_original() -> None:
    seen: Counter[str] = Counter()
    for seed in SEEDS:
        _clone_after_every_event(seed, seen)
    # every watched structure was cloned with contents at least once
    assert {n for n in WATCHED if not seen[n]} == set()


def test_a_clone_run_on_leaves_its_original_unchanged() -> None:
    w = random_workload(3, 30, vocab=8, modes=MODES, gates=GATES, kv=KV_FEATURES)
    runner = Runner(w.config, {"spec": SpecScheduler}, vocab=8, check_invariants=False)
    events = list(w.events)
    for e in events[: len(events) // 2]:
        assert runner.apply(e) is None
    s = runner.primary
    assert isinstance(s, SpecScheduler)
    before = s.view()
    c = s.clone()
    runner.scheds["spec"] = c  # drive the clone instead
    for e in events[len(events) // 2:]:
        assert runner.apply(e) is None
    assert s.view() == before
