"""Invariants of the KV cache events (spec/kv_events.py): the stream a
KV-aware router rebuilds an instance's prefix cache from must describe that
cache exactly. Each folds the update's events into a copy of the History's
router mirror (invariants/kv_mirror.py) and checks one property; each
requires the ``kv_events`` capability and checks only runs with
``config.enable_kv_cache_events`` on, on the update after which vLLM takes
and publishes the step's events (Scheduler.update_from_output:
``kv_cache_manager.take_events()``, one KVEventBatch).

The upstream bugs behind them: blocks reused or cached and never reported,
a BlockRemoved sent while the key is not held (or twice), an AllBlocksCleared
where the cache was not emptied, events naming parents never reported."""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.kv_events import AllBlocksCleared

from schedspec.invariants.core import Finding, History, Transition, transition_invariant
from schedspec.invariants.kv_mirror import KVMirror

_NEEDS = ("kv_events",)


def _replayed(t: Transition, h: History) -> tuple[KVMirror, list[tuple[str, str]]] | None:
    """The mirror after this update's events and the problems met folding
    them in; None when the transition carries no stream to check."""
    if t.kind != "update" or not t.after.config.enable_kv_cache_events:
        return None
    mirror = h.kv_mirror.copy()
    mirror.block_size = t.after.config.block_size
    return mirror, mirror.apply_all(t.kv_events)


@transition_invariant(
    "kv-events-mirror-exact",
    "After each update the stream's mirror equals the prefix-cache index, blocks per key counted.",
    "vllm/v1/core/block_pool.py emits them; update_from_output takes them once a step.",
    ("update",),
    tags=("safety",),
    requires=_NEEDS,
)
def mirror_exact(t: Transition, h: History) -> Iterator[Finding]:
    replayed = _replayed(t, h)
    if replayed is None:
        return
    mirror = replayed[0].index()
    kv = t.after.kv
    index = {key: len(blocks) for key, blocks in (*kv.cache_index.items(), *kv.partial_index.items())}
    if mirror == index:
        return
    missing = sorted(k for k in index if mirror.get(k, 0) < index[k])
    extra = sorted(k for k in mirror if index.get(k, 0) < mirror[k])
    yield None, (f"the event stream describes another cache: {len(missing)} key(s) cached but not (or too few "
                 f"times) reported, first {missing[:1]}; {len(extra)} reported but not cached, first {extra[:1]}")


@transition_invariant(
    "kv-events-parent-stored",
    "A full-attention BlockStored of full blocks names only a parent stored since the last clear.",
    "vllm/v1/core/block_pool.py, cache_full_blocks.",
    ("update",),
    tags=("safety",),
    requires=_NEEDS,
)
def parent_stored(t: Transition, h: History) -> Iterator[Finding]:
    replayed = _replayed(t, h)
    if replayed is None:
        return
    for kind, message in replayed[1]:
        if kind == "parent":
            yield None, message


@transition_invariant(
    "kv-events-removed-once-per-store",
    "A key is removed at most once per block stored under it.",
    "vllm/v1/core/block_pool.py, _remove_cached_block_hashes.",
    ("update",),
    tags=("safety",),
    requires=_NEEDS,
)
def removed_once(t: Transition, h: History) -> Iterator[Finding]:
    replayed = _replayed(t, h)
    if replayed is None:
        return
    for kind, message in replayed[1]:
        if kind == "removed":
            yield None, message


@transition_invariant(
    "kv-events-cleared-on-reset",
    "One AllBlocksCleared per reset that emptied the cache since the last update.",
    "vllm/v1/core/block_pool.py, reset_prefix_cache.",
    ("update",),
    tags=("safety",),
    requires=_NEEDS,
)
def cleared_on_reset(t: Transition, h: History) -> Iterator[Finding]:
    if t.kind != "update" or not t.after.config.enable_kv_cache_events:
        return
    cleared = sum(1 for e in t.kv_events if isinstance(e, AllBlocksCleared))
    if cleared != h.kv_resets:
        yield None, f"{cleared} AllBlocksCleared event(s), but {h.kv_resets} reset(s) emptied the cache since the last update"
