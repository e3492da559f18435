"""vLLM 0.33 scheduler plugins as a user writes them: unmodified subclasses
of Scheduler and AsyncScheduler, and a bug-zoo defect written as a subclass
of each (``schedule()`` overridden to break a rule). Imported by name
(``tests.adapters.vllm_subclasses:Plain``) by the routes' tests; importing
it imports vLLM.

    PYTHONPATH=. schedspec equivalence --against tests.adapters.vllm_subclasses:ShortChunk --workloads 2
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


class Plain(Scheduler):  # type: ignore[misc]
    """An unmodified vLLM Scheduler subclass (sync scheduling only)."""


class PlainAsync(AsyncScheduler):  # type: ignore[misc]
    """An unmodified vLLM AsyncScheduler subclass (async scheduling only)."""


def _short_chunk(output: Any, requests: dict[str, Any]) -> Any:
    """The bug: a partial prefill chunk's last token is left out of the
    plan (``num_scheduled_tokens``) although the request counts it computed,
    so one position's K/V is never written and the next chunk attends a
    hole: a chunked prefill that skips a token."""
    for rid, n in list(output.num_scheduled_tokens.items()):
        req = requests.get(rid)
        if req is not None and n > 1 and req.num_computed_tokens < req.num_prompt_tokens:
            output.num_scheduled_tokens[rid] = n - 1
            output.total_num_scheduled_tokens -= 1
    return output


class ShortChunk(Scheduler):  # type: ignore[misc]
    """A vLLM Scheduler subclass whose partial prefill chunks skip their last token."""

    BUG = "a partial prefill chunk's last token is scheduled to nobody"

    def schedule(self) -> Any:
        return _short_chunk(super().schedule(), self.requests)


class ShortChunkAsync(AsyncScheduler):  # type: ignore[misc]
    """The same bug in an AsyncScheduler subclass."""

    BUG = ShortChunk.BUG

    def schedule(self) -> Any:
        return _short_chunk(super().schedule(), self.requests)


class ForgetsHistory(Scheduler):  # type: ignore[misc]
    """A vLLM Scheduler subclass that never sends a request's history
    (``CachedRequestData.all_token_ids``): a request the model runner dropped
    from its batch (unscheduled for a step, or resumed) comes back without
    its tokens. The plan and every state stay right; only the worker's
    message is wrong."""

    BUG = "a request back after a step off the batch is sent without its token history"

    def schedule(self) -> Any:
        out = super().schedule()
        out.scheduled_cached_reqs.all_token_ids.clear()
        return out


class CountsOutputsWrong(AsyncScheduler):  # type: ignore[misc]
    """An AsyncScheduler subclass whose ``num_output_tokens`` leaves out the
    tokens in flight: a runner sizing its output buffers by it is one short."""

    BUG = "num_output_tokens leaves out the output tokens in flight"

    def schedule(self) -> Any:
        out = super().schedule()
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            cached.num_output_tokens[i] = self.requests[rid].num_output_tokens
        return out
