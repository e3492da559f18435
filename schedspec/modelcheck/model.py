"""The fake model as the checker runs it: memoized, and with the "prefix"
draft acceptance keyed on the tokens rather than on the request id.

The check engine's FakeModel decides how many of a request's drafts are right
("prefix" acceptance) from a hash of the request id and the position. The
checker renames request ids by arrival rank when it merges states, so two
merged states could hold requests whose drafts fare differently: the merge
would be unsound. Here the count is a hash of the context the drafts follow
(the request's tokens, read back through its block table, then the bonus
token), which the state holds, so equal states propose equal drafts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from schedspec.check.oracle import FakeModel
from schedspec.spec.interface import KVCacheGroup


class MemoModel(FakeModel):
    """The fake model with its sampler memoized (the sampled token is a pure
    function of the context read, and the checker asks for the same contexts
    over and over) and the "prefix" acceptance keyed on the context. It
    never says an empty proposal without speculative decoding: a step's
    number is no part of a state, and the check's fake model covers it."""

    silent_every = 0

    def __init__(self, block_size: int, vocab: int, seed: int, num_speculative_tokens: int = 0,
                 acceptance: str | None = None, groups: Sequence[KVCacheGroup] = (), rows: int = 1) -> None:
        # ``groups``: the KV cache groups of a hybrid layout (the model
        # reads every group's table; a sliding-window group its window);
        # ``rows``: the plans whose outputs fill a -1 (k - 1 with k in flight)
        super().__init__(block_size, vocab, seed, num_speculative_tokens=num_speculative_tokens,
                         acceptance=acceptance, groups=groups, rows=rows)
        self._memo: dict[tuple[int | None, ...], int] = {}

    def sample_token(self, context: tuple[int | None, ...]) -> int:
        tok = self._memo.get(context)
        if tok is None:
            tok = self._memo[context] = super().sample_token(context)
        return tok

    def drafts_right(self, request_id: str, position: int, context: tuple[int | None, ...]) -> int:
        """How many of the k drafts after ``context`` are right: a hash of
        the context alone (not of the request id, which merging renames)."""
        h = hashlib.blake2b(digest_size=8, key=self.seed.to_bytes(8, "little"))
        h.update(b"drafts" + repr(context).encode())
        return int.from_bytes(h.digest(), "little") % (self.num_speculative_tokens + 1)
