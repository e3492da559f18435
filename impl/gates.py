"""The admission gates' per-request work in schedule() and update(): the
encoder inputs of a chunk (vLLM's Scheduler._try_schedule_encoder_inputs and
the EncoderCacheManager), and which way a scheduler goes when a pause state
or a grammar comes or goes.

The watermark and LoRA decide admissions only (impl/waiting.py). The prefill
cadence, the encoder, a KV connector and hybrid groups hold a scheduler on
the gated rules for good; a pause state other than UNPAUSED or an unfinished
request with a grammar holds it there while they last (``_choose_path``).
On the gated rules the steady decode takes only requests that need no block
and lie past every encoder input.
"""

from __future__ import annotations

from schedspec.impl.encoder_cache import EncoderCache
from schedspec.impl.request import Request


class GatesMixin:
    """ImplScheduler's gate rules."""

    # provided by ImplScheduler
    _encoder_cache: EncoderCache | None
    _gated: bool
    _general: bool
    _base_general: bool

    def _choose_path(self) -> None:
        """Take the gated rules (a pause state or a grammar came) or leave
        them (none is left, and no config gate needs them). A synchronous
        scheduler switches with no plan in flight; one without drafts keeps
        the general step bookkeeping while gated. An async plan in flight
        scheduled the other way is updated alike: the gate rules of update
        concern requests with encoder inputs (a config gate, never left) or a
        grammar (which holds the gated rules)."""
        if not self._gated:
            self._gated = True
            self._general = True
        else:
            self._gated = False
            self._general = self._base_general

    def _release_encoder(self, req: Request) -> None:
        enc = self._encoder_cache
        if enc is not None:
            enc.release_all(req.request_id, [m.identifier for m in req.mm_inputs])

    def _encoder_window(
        self, req: Request, c: int, n: int, budget: int
    ) -> tuple[list[int], int, int, list[int]]:
        """The encoder inputs overlapping positions c .. c + n - 1, in order:
        a second input of an identifier already run this step is a
        duplicate, a cached one is reused, the first that fits neither the
        budget nor the cache cuts the chunk before it (to nothing when the
        chunk starts inside it). Returns (inputs to run, the chunk, the budget
        left, duplicates)."""
        enc = self._encoder_cache
        assert enc is not None
        rid = req.request_id
        run: list[int] = []
        dups: list[int] = []
        idents: set[str] = set()
        taken = 0
        end = c + n
        for i, m in enumerate(req.mm_inputs):
            off = m.offset
            if off >= end or off + m.length <= c:
                continue
            ident = m.identifier
            if ident in idents:
                dups.append(i)
                continue
            if enc.reuse(rid, i, ident):
                continue
            size = m.length
            if not enc.make_room(size, budget, taken):
                n = min(n, off - c) if c < off else 0
                break
            taken += size
            budget -= size
            idents.add(ident)
            run.append(i)
        return run, n, budget, dups

    def _encoder_commit(self, req: Request, run: list[int], dups: list[int]) -> None:
        enc = self._encoder_cache
        assert enc is not None
        mm = req.mm_inputs
        rid = req.request_id
        for i in run:
            m = mm[i]
            enc.store(rid, i, m.identifier, m.length)
        for i in dups:
            enc.reuse(rid, i, mm[i].identifier)

    def _encoder_done(self, req: Request) -> None:
        """After a step ran: the request drops each input that lies wholly in
        its computed tokens past the placeholders."""
        enc = self._encoder_cache
        assert enc is not None
        done = req.num_computed_tokens - req.num_output_placeholders
        mm = req.mm_inputs
        for i in enc.held_inputs(req.request_id):
            m = mm[i]
            if m.offset + m.length <= done:
                enc.release(req.request_id, i, m.identifier)

