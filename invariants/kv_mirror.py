"""A reference consumer of the KV cache events: what a KV-aware router keeps
of one instance's prefix cache, rebuilt from the instance's stream alone
(spec/kv_events.py states the stream).

``KVMirror.apply`` folds one event in and says what in it no consumer can
make sense of: a BlockStored that names a parent never stored (since the
last AllBlocksCleared) in a full-attention group, a BlockRemoved of a key the
mirror does not hold (a key is removed once per store). A BlockStored of
fewer tokens a block than ``block_size`` (when known) is a partial entry
(BlockPool.cache_partial_block): its parent is the prefix one hash unit
shorter, which no event need have stored, so it is not checked. A ``reused``
BlockStored (a prefix hit reported again) changes nothing. ``index`` is the
cache the mirror believes in, as the scheduler's view spells it
(``KVView.cache_index``: key -> the blocks registered under it), counted."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from schedspec.spec.interface import BlockKey, group_block_key
from schedspec.spec.kv_kinds import BY_VLLM_KIND
from schedspec.spec.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

#: (medium, group, key as group 0 spells it)
Entry = tuple[str, int, BlockKey]


class KVMirror:
    """The cached blocks per medium, group and key, from the events."""

    __slots__ = ("held", "stored", "block_size")

    def __init__(self, block_size: int = 0) -> None:
        #: the config's block size (0: unknown, every parent checked)
        self.block_size = block_size
        #: entry -> how many blocks hold it (stores less removals)
        self.held: Counter[Entry] = Counter()
        #: every entry stored since the last AllBlocksCleared
        self.stored: set[Entry] = set()

    def copy(self) -> KVMirror:
        new = KVMirror(self.block_size)
        new.held = self.held.copy()
        new.stored = set(self.stored)
        return new

    def apply(self, event: KVCacheEvent) -> list[tuple[str, str]]:
        """Fold ``event`` in; the problems found, each ("parent" | "removed", message)."""
        out: list[tuple[str, str]] = []
        if isinstance(event, BlockStored) and event.reused:
            # a prefix hit reported again (kv_cache_report_mode "full"): the
            # blocks were cached already, nothing changes
            return out
        if isinstance(event, BlockStored):
            kind = BY_VLLM_KIND.get(event.kind)  # None: a kind no modelled layout has
            partial = event.block_size < self.block_size
            if event.parent_key is not None and kind is not None and kind.parent_stored and not partial:
                parent = (event.medium, event.group, event.parent_key)
                if parent not in self.stored:
                    out.append(("parent", f"BlockStored in group {event.group} names the parent "
                                          f"{_short(event.parent_key)}, never stored"))
            for key in event.block_keys:
                entry = (event.medium, event.group, key)
                self.held[entry] += 1
                self.stored.add(entry)
        elif isinstance(event, BlockRemoved):
            for key in event.block_keys:
                entry = (event.medium, event.group, key)
                if self.held[entry] <= 0:
                    del self.held[entry]
                    out.append(("removed", f"BlockRemoved in group {event.group} of {_short(key)}, "
                                           "which no stored block holds (removed more often than stored)"))
                    continue
                self.held[entry] -= 1
                if not self.held[entry]:
                    del self.held[entry]
        elif isinstance(event, AllBlocksCleared):
            self.held.clear()
            self.stored.clear()
        return out

    def apply_all(self, events: Iterable[KVCacheEvent]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for e in events:
            out.extend(self.apply(e))
        return out

    def index(self, medium: str = MEDIUM_GPU) -> dict[BlockKey, int]:
        """The cache of ``medium`` the stream describes: the scheduler's key
        (group_block_key) -> how many blocks hold it."""
        return {group_block_key(key, g): n for (m, g, key), n in self.held.items() if m == medium}


def _short(key: BlockKey) -> str:
    """A key for a message: its identity and its last tokens."""
    tokens = key[1]
    tail = ", ".join(map(str, tokens[-4:]))
    return f"({key[0]!r}, {len(tokens)} tokens ...{tail})"
