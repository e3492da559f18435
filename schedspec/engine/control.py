"""The engine matrix's negative control (engine's side): a scheduler that
tells the model runner a wrong position.

:func:`make_shifting_scheduler` returns a subclass of vLLM's ``Scheduler``
whose outputs say one token more was computed for running requests past
their first block: the runner then feeds the token at the wrong index,
one position on, and leaves a hole in the KV cache, so the tokens
change. The matrix must report the variant DIVERGED.
"""

from __future__ import annotations

from typing import Any

#: a running request's num_computed_tokens is shifted from this many tokens on
SHIFT_FROM = 48


def make_shifting_scheduler() -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler

    class ShiftingScheduler(Scheduler):
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = super().schedule(*args, **kwargs)
            cached = out.scheduled_cached_reqs
            for i, done in enumerate(cached.num_computed_tokens):
                if done >= SHIFT_FROM:
                    cached.num_computed_tokens[i] = done + 1
            return out

    return ShiftingScheduler
