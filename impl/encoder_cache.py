"""The multimodal encoder cache, sized in embeddings.

Behaves as vLLM 0.33's EncoderCacheManager (vllm/v1/core/encoder_cache_manager.py)
and as the spec's model of it: an entry is keyed by its mm identifier and
remembers which requests reference it; an entry nobody references is
*freeable* (still cached, reusable) until its space is needed, and then the
oldest freeable entries are evicted first and their identifiers reported once
in the next plan. Written apart from the spec's model, with the same
observable state: ``entries`` (identifier -> embeddings, in the order the
entries were made), ``free`` (space left) and the freed identifiers.

Per request it keeps the input indices it holds a reference for and, per
identifier, how many of its inputs hold one, so a request with two inputs of
one image keeps its reference until both are done.
"""

from __future__ import annotations


class EncoderCache:
    __slots__ = ("free", "freeable_space", "entries", "holders", "held", "counts", "freeable", "evicted")

    def __init__(self, size: int) -> None:
        self.free = size  # vLLM's num_free_slots
        self.freeable_space = size  # num_freeable_slots: free + freeable entries
        self.entries: dict[str, int] = {}  # identifier -> embeddings
        self.holders: dict[str, set[str]] = {}  # identifier -> referencing request ids
        self.held: dict[str, set[int]] = {}  # request id -> its input indices holding a reference
        self.counts: dict[str, dict[str, int]] = {}  # request id -> identifier -> inputs
        self.freeable: dict[str, int] = {}  # unreferenced entries, oldest first
        self.evicted: list[str] = []  # since the last plan

    def copy(self) -> "EncoderCache":
        new: EncoderCache = object.__new__(EncoderCache)
        new.free = self.free
        new.freeable_space = self.freeable_space
        new.entries = dict(self.entries)
        new.holders = {h: set(s) for h, s in self.holders.items()}
        new.held = {r: set(s) for r, s in self.held.items()}
        new.counts = {r: dict(c) for r, c in self.counts.items()}
        new.freeable = dict(self.freeable)
        new.evicted = self.evicted[:]
        return new

    def _hold(self, rid: str, index: int, ident: str) -> None:
        held = self.held.get(rid)
        if held is None:
            held = self.held[rid] = set()
        elif index in held:
            return
        held.add(index)
        counts = self.counts.setdefault(rid, {})
        counts[ident] = counts.get(ident, 0) + 1

    def reuse(self, rid: str, index: int, ident: str) -> bool:
        """If ``ident`` is cached, the request references it (a freeable entry
        is taken back) and True; else False."""
        holders = self.holders.get(ident)
        if holders is None:
            return False
        if not holders:
            self.freeable_space -= self.freeable.pop(ident)
        holders.add(rid)
        self._hold(rid, index, ident)
        return True

    def make_room(self, size: int, budget: int, taken: int) -> bool:
        """Whether an input of ``size`` embeddings fits the compute ``budget``
        and, beside the ``taken`` ones this request already runs this step,
        the cache; evicts the oldest freeable entries as needed (even when the
        request is not scheduled after all)."""
        if size > budget:
            return False
        need = size + taken
        if need <= self.free:
            return True
        if need > self.freeable_space:
            return False
        freeable = self.freeable
        while need > self.free:
            ident = next(iter(freeable))
            self.free += freeable.pop(ident)
            del self.holders[ident]
            del self.entries[ident]
            self.evicted.append(ident)
        return True

    def store(self, rid: str, index: int, ident: str, size: int) -> None:
        """The encoder runs this input this step: its space is taken."""
        holders = self.holders.get(ident)
        if holders is None:
            holders = self.holders[ident] = set()
            self.entries[ident] = size
        holders.add(rid)
        self._hold(rid, index, ident)
        self.free -= size
        self.freeable_space -= size

    def release(self, rid: str, index: int, ident: str) -> None:
        """The request drops input ``index``'s reference; an entry no request
        references any more becomes freeable."""
        held = self.held.get(rid)
        if held is not None and index in held:
            held.discard(index)
            counts = self.counts[rid]
            left = counts[ident] - 1
            if left:
                counts[ident] = left
            else:
                del counts[ident]
            if not held:
                del self.held[rid]
                del self.counts[rid]
        holders = self.holders.get(ident)
        if not holders:
            return
        counts_now = self.counts.get(rid)
        if counts_now is not None and ident in counts_now:
            return
        holders.discard(rid)
        if not holders:
            size = self.entries[ident]
            self.freeable[ident] = size
            self.freeable_space += size

    def held_inputs(self, rid: str) -> list[int]:
        held = self.held.get(rid)
        return sorted(held) if held else []

    def release_all(self, rid: str, idents: list[str]) -> None:
        """Every reference of the request goes (finish, preemption, a failed
        admission); ``idents[i]`` is its input i's identifier."""
        for index in self.held_inputs(rid):
            self.release(rid, index, idents[index])

    def take_freed(self) -> tuple[str, ...]:
        """The identifiers evicted since the last call and not cached again."""
        if not self.evicted:
            return ()
        entries = self.entries
        out = tuple(h for h in self.evicted if h not in entries)
        self.evicted = []
        return out
