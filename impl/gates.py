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
    _prefill_la: int
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

    def _encoder_window(
        self, req: Request, start: int, num_tokens: int, budget: int
    ) -> tuple[list[int], int, int, list[int]]:
        """The encoder inputs overlapping the chunk of ``num_tokens`` tokens
        from ``start``, in order: a second input of an identifier already run
        this step is a duplicate, a cached one is reused, the first that fits
        neither the budget nor the cache cuts the chunk before it (to nothing
        when the chunk starts inside it). Returns (inputs to run, the chunk,
        the budget left, duplicates)."""
        encoder_cache = self._encoder_cache
        assert encoder_cache is not None
        request_id = req.request_id
        run: list[int] = []
        duplicates: list[int] = []
        identifiers: set[str] = set()
        taken = 0
        end = start + num_tokens + self._prefill_la  # EAGLE reads one token past the chunk
        for i, mm_input in enumerate(req.mm_inputs):
            offset = mm_input.offset
            if offset >= end or offset + mm_input.length <= start:
                continue
            identifier = mm_input.identifier
            if identifier in identifiers:
                duplicates.append(i)
                continue
            if encoder_cache.reuse(request_id, i, identifier):
                continue
            size = mm_input.length
            if not encoder_cache.make_room(size, budget, taken):
                num_tokens = min(num_tokens, offset - start) if start < offset else 0
                break
            taken += size
            budget -= size
            identifiers.add(identifier)
            run.append(i)
        return run, num_tokens, budget, duplicates

    def _encoder_commit(self, req: Request, run: list[int], duplicates: list[int]) -> None:
        encoder_cache = self._encoder_cache
        assert encoder_cache is not None
        mm_inputs = req.mm_inputs
        request_id = req.request_id
        for i in run:
            mm_input = mm_inputs[i]
            encoder_cache.store(request_id, i, mm_input.identifier, mm_input.length)
        for i in duplicates:
            encoder_cache.reuse(request_id, i, mm_inputs[i].identifier)

    def _encoder_done(self, req: Request) -> None:
        """After a step ran: the request drops each input that lies wholly in
        its computed tokens past the placeholders."""
        encoder_cache = self._encoder_cache
        assert encoder_cache is not None
        done = req.num_computed_tokens - req.num_output_placeholders
        mm_inputs = req.mm_inputs
        for i in encoder_cache.held_inputs(req.request_id):
            mm_input = mm_inputs[i]
            if mm_input.offset + mm_input.length <= done:
                encoder_cache.release(req.request_id, i, mm_input.identifier)

