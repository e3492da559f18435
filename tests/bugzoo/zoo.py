"""The bug zoo: mutants of impl.ImplScheduler, each one a real bug class.

Every mutant is a subclass of ``impl.ImplScheduler``; impl's source is never
edited. A mutant either overrides a small method (calling the real one around
its fault), or replaces one method by impl's own source with one textual
change (``patched``), so the fault sits exactly where the real bug sat and the
rest of the method stays impl's. ``patched`` insists that the text it replaces
occurs exactly once, so a mutant cannot silently become impl again when impl
is edited: it fails to import instead.

Each class carries:

- ``BUG``: the bug, in one line;
- ``ISSUE``: the public issue or pull request whose bug class it models;
- ``CAUGHT_BY``: what the gate must report (an invariant id, ``kv-context``,
  ``divergence`` or ``error``); the zoo test asserts the gate reports one of
  these;
- ``MAX_STEPS``: the longest shrunk counterexample the test accepts.

Run one by hand, from the repository root:

    PYTHONPATH=. schedspec check --against tests.bugzoo.zoo:WrongFcfsVictim --steps 3000
"""

from __future__ import annotations

import __future__
import inspect
import textwrap
from typing import Any, Callable

from schedspec.check.capabilities import Capabilities
from schedspec.impl import ImplScheduler
from schedspec.impl.queues import PriorityWaiting
from schedspec.spec.interface import RequestSpec, RequestStatus, StepPlan

_ANNOTATIONS = __future__.annotations.compiler_flag


def patched(func: Callable[..., Any], *edits: tuple[str, str]) -> Callable[..., Any]:
    """``func`` recompiled from its own source with each ``(old, new)`` edit
    applied; ``old`` must occur exactly once. The result runs in ``func``'s
    module globals, so it sees exactly what impl's method sees."""
    src = inspect.getsource(func)  # edits are written with the file's indentation
    for old, new in edits:
        count = src.count(old)
        if count != 1:
            raise AssertionError(
                f"mutant of {func.__qualname__}: expected the text to occur once, found {count}:\n{old}"
            )
        src = src.replace(old, new)
    src = textwrap.dedent(src)
    namespace: dict[str, Any] = {}
    code = compile(src, f"<mutant of {func.__qualname__}>", "exec", flags=_ANNOTATIONS, dont_inherit=True)
    exec(code, func.__globals__, namespace)  # noqa: S102 - impl's own source, one edit
    new_func: Callable[..., Any] = namespace[func.__name__]
    new_func.__qualname__ = func.__qualname__
    return new_func


_preempt_for = ImplScheduler._preempt_for
_give_back = ImplScheduler._give_back
_start_step = ImplScheduler._start_step
_schedule_waiting = ImplScheduler._schedule_waiting
_admission_chunk = ImplScheduler._admission_chunk
_find_hit = ImplScheduler._find_hit
_admit_alloc = ImplScheduler._admit_alloc
_free = ImplScheduler._free
_allocate = ImplScheduler._allocate


class Mutant(ImplScheduler):
    BUG = ""
    ISSUE = ""
    CAUGHT_BY: frozenset[str] = frozenset()
    MAX_STEPS = 12


# ---------------------------------------------------------------- preemption


class PrioritySkipAfterPreempt(Mutant):
    BUG = ("PRIORITY: preempting a victim that sits before the current request in the running "
           "queue does not step the loop index back, so the next running request is skipped for a step")
    ISSUE = "https://github.com/vllm-project/vllm/issues/49097"
    CAUGHT_BY = frozenset({"divergence", "running-served-while-budget"})
    _preempt_for = patched(_preempt_for, ("""\
            if v < i:
                i -= 1
""", """\
            if v < i:
"""))


class PreemptedStaysScheduled(Mutant):
    BUG = ("PRIORITY: a victim already scheduled earlier in the step is preempted but keeps its "
           "plan entry and its tokens stay charged to the budget")
    ISSUE = "https://github.com/vllm-project/vllm/issues/23347"
    CAUGHT_BY = frozenset({"scheduled-are-running"})
    _give_back = patched(_give_back, ("""\
        if j < len(scheduled) and scheduled[j] is victim:
""", """\
        if False:
"""))


class WrongFcfsVictim(Mutant):
    BUG = "FCFS: preemption takes the head of the running queue instead of its tail"
    ISSUE = "https://github.com/inference-sim/inference-sim/issues/1169"
    CAUGHT_BY = frozenset({"fcfs-victim-suffix", "no-starvation"})
    _preempt_for = patched(_preempt_for, ("""\
                v = len(running) - 1
""", """\
                v = 0
"""))


class AdmitAfterPreempt(Mutant):
    BUG = "admits waiting requests in a step that preempted running ones (the freed blocks go to newcomers)"
    ISSUE = "https://github.com/inference-sim/inference-sim/issues/571"
    CAUGHT_BY = frozenset({"no-admission-with-preemption"})
    MAX_STEPS = 16

    def _schedule_running(self, state: Any) -> None:
        super()._schedule_running(state)
        state.preempted = False


class KeepComputedOnPreempt(Mutant):
    BUG = "recompute preemption frees the blocks but keeps num_computed_tokens"
    ISSUE = "https://github.com/vllm-project/vllm/pull/5349"
    CAUGHT_BY = frozenset({"preemption-resets", "block-table-covers-computed"})

    def _preempt(self, req: Any, *args: Any) -> None:
        computed = req.num_computed_tokens
        super()._preempt(req, *args)
        req.num_computed_tokens = computed


class DropOutputOnPreempt(Mutant):
    BUG = "a preempted request is resumed from its prompt alone: the tokens it generated are lost"
    ISSUE = "https://github.com/PaddlePaddle/FastDeploy/pull/3080"
    CAUGHT_BY = frozenset({"output-append-only"})

    def _preempt(self, req: Any, *args: Any) -> None:
        super()._preempt(req, *args)
        req.output.clear()
        req.num_tokens = req.num_prompt_tokens
        req.last_token_ids = req.prompt_token_ids[-1:]


class ResumeThrash(Mutant):
    BUG = ("admission ignores scheduler_reserve_full_isl and allocates only this chunk, so a long "
           "prefill is admitted, then preempted again and again")
    ISSUE = "https://github.com/vllm-project/vllm/issues/25538"
    CAUGHT_BY = frozenset({"full-sequence-reserved", "divergence"})
    _admit_alloc = patched(_admit_alloc, ("if self._config.scheduler_reserve_full_isl:", "if False:"))


class PreemptedJumpsPriorityQueue(Mutant):
    BUG = "PRIORITY: a preempted request is put at the head of the waiting queue instead of in key order"
    ISSUE = "https://github.com/vllm-project/vllm/issues/41951"
    CAUGHT_BY = frozenset({"priority-admission-order", "waiting-queue-order"})

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if self._priority:
            self._waiting = _JumpingPriorityWaiting()


class _JumpingPriorityWaiting(PriorityWaiting[Any]):
    def push_front(self, req: Any) -> None:  # type: ignore[override]
        import heapq

        self._seq += 1
        req.waiting_seq = self._seq
        heapq.heappush(self._heap, (-(1 << 60), req.arrival, req.request_id, self._seq, req))
        self._live += 1


# ---------------------------------------------------------------- KV pool


class DoubleFree(Mutant):
    BUG = ("a request's block list names its last block twice, and freeing decrements it twice "
           "(the same physical block freed twice)")
    ISSUE = "https://github.com/vllm-project/vllm/issues/42571"
    CAUGHT_BY = frozenset({"block-conservation"})

    def _free(self, table: list[int]) -> None:
        super()._free(table + table[-1:] if len(table) >= 2 else table)


class LeakOnFinish(Mutant):
    BUG = "a request that finishes by stop or length returns every block but its first (a pool leak)"
    ISSUE = "https://github.com/sgl-project/sglang/issues/6888"
    CAUGHT_BY = frozenset({"block-conservation"})

    def _finish(self, req: Any, status: RequestStatus, delay: bool = False) -> None:
        if status is not RequestStatus.FINISHED_ABORTED and req.block_ids:
            req.block_ids = req.block_ids[1:]
        super()._finish(req, status, delay)


class FreeHeadFirst(Mutant):
    BUG = "a finished request's blocks are freed head first, so eviction takes a prefix's first block before its tail"
    ISSUE = "https://github.com/llm-d/llm-d-inference-sim/issues/704"
    CAUGHT_BY = frozenset({"free-queue-lru"})
    _free = patched(_free, ("for block in reversed(table):", "for block in table:"))


class UnkeyedToBack(Mutant):
    BUG = "freed blocks without a key go to the tail of the free queue instead of its head, reordering LRU eviction"
    ISSUE = "https://github.com/inference-sim/inference-sim/issues/354"
    CAUGHT_BY = frozenset({"free-queue-lru"})
    _free = patched(_free, ("self._fq.prepend(front)", "self._fq.append(front)"))


class StaleKeyOnReuse(Mutant):
    BUG = "a cached free block taken for new content keeps its old prefix-cache key (not evicted on reuse)"
    ISSUE = "https://github.com/vllm-project/vllm/pull/4761"
    CAUGHT_BY = frozenset({"cache-index-consistent", "cached-block-content"})
    _allocate = patched(_allocate, ("""\
            if node_of[block] is not None:
                prefix_index.evict(block)
""", ""))


class EvictableHitsNotCounted(Mutant):
    BUG = ("the admission check does not count free prefix-hit blocks, which touching takes out of the "
           "free queue, so allocation runs out of blocks")
    ISSUE = "https://github.com/vllm-project/vllm/pull/11565"
    CAUGHT_BY = frozenset({"error"})
    _admit_alloc = patched(
        _admit_alloc,
        ("if max(-(-full // block_size) - num_hit - held, 0) + evictable > free:",
         "if max(-(-full // block_size) - num_hit - held, 0) > free:"),
        ("if need + evictable + reserved > free:", "if need + reserved > free:"),
    )


class OversizedBlocksQueue(Mutant):
    BUG = ("the full-sequence reservation counts prompt + max_tokens without the max_model_len cap: a "
           "request that can never fit stays at the head of the waiting queue and blocks it forever")
    ISSUE = "https://github.com/vllm-project/vllm/issues/39734"
    CAUGHT_BY = frozenset({"progress", "work-conserving-admission"})
    _admit_alloc = patched(_admit_alloc, ("full = min(req.num_tokens, self._max_model_len)",
                                          "full = req.num_prompt_tokens + req.spec.max_tokens"))


class ResetWhileHeld(Mutant):
    BUG = "reset_prefix_cache drops every key even while requests hold cached blocks"
    ISSUE = "https://github.com/vllm-project/vllm/pull/12284"
    CAUGHT_BY = frozenset({"reset-prefix-cache", "divergence"})

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        super().reset_prefix_cache(reset_running_requests)
        self._px.clear()
        return True


# ---------------------------------------------------------------- prefix cache


class FullPromptHit(Mutant):
    BUG = "a prefix hit may cover the whole prompt, leaving no token to compute (no logits to sample from)"
    ISSUE = "https://github.com/GeeeekExplorer/nano-vllm/issues/144"
    CAUGHT_BY = frozenset({"token-budget", "cache-hit-identical-prefix", "computed-within-known"})
    _find_hit = patched(_find_hit, ("range(max_hit_blocks(req.num_tokens, block_size))", "range(req.num_tokens // block_size)"))


class HitBoundaryOffByOne(Mutant):
    BUG = "the hit limit subtracts one twice, so a prompt one token past a block boundary misses its last cached block"
    ISSUE = "https://github.com/vllm-project/vllm/pull/40684"
    CAUGHT_BY = frozenset({"divergence"})
    _find_hit = patched(_find_hit, ("range(max_hit_blocks(req.num_tokens, block_size))", "range((req.num_tokens - 2) // block_size)"))


class UncomputedBlockHit(Mutant):
    BUG = ("every block full of known tokens gets its key at allocation, also one that this chunk does not "
           "compute, so another request can hit a block whose KV was never written")
    ISSUE = "https://github.com/GeeeekExplorer/nano-vllm/issues/208"
    CAUGHT_BY = frozenset({"cached-block-content", "full-blocks-cached", "kv-context"})

    def _register(self, req: Any, upto: int) -> None:
        super()._register(req, max(upto, min(len(req.block_ids) * self._bs, req.num_tokens)))


class SaltIgnored(Mutant):
    BUG = "prefix-cache keys ignore the cache salt (the LoRA / tenant identity), so different salts share blocks"
    ISSUE = "https://github.com/vllm-project/vllm/pull/27211"
    CAUGHT_BY = frozenset({"cached-block-content", "cache-hit-identical-prefix", "shared-blocks-identical-prefix"})

    def add(self, request: RequestSpec) -> None:
        super().add(request)
        self._requests[request.request_id].key_root = ""


class LoraIgnoredInBlockKeys(Mutant):
    BUG = ("prefix-cache keys leave out the LoRA adapter, so requests of different adapters "
           "(or of an adapter and the base model) share KV blocks computed under another adapter")
    ISSUE = "https://github.com/vllm-project/vllm/issues/3264"
    CAUGHT_BY = frozenset({"shared-block-one-adapter", "cached-block-content", "cache-hit-identical-prefix",
                           "shared-blocks-identical-prefix"})
    # it takes requests with adapters: the LoRA gate
    CAPABILITIES = Capabilities(lora=True)

    def add(self, request: RequestSpec) -> None:
        super().add(request)
        if not request.mm_inputs:
            self._requests[request.request_id].key_root = request.salt


# ---------------------------------------------------------------- budgets


class MaxNumSeqsOffByOne(Mutant):
    BUG = "admission compares the running count to max_num_seqs with > instead of >=: one request too many runs"
    ISSUE = "https://github.com/vllm-project/vllm/pull/1034"
    CAUGHT_BY = frozenset({"max-num-seqs"})
    _schedule_waiting = patched(_schedule_waiting, ("if len(running) + self._num_waiting_for_streaming >= max_seqs:",
                                                             "if len(running) + self._num_waiting_for_streaming > max_seqs:"))


class BudgetOverrun(Mutant):
    BUG = "an admission's chunk is not cut to the remaining token budget: the step schedules more than max_num_batched_tokens"
    ISSUE = "https://github.com/vllm-project/vllm/pull/7391"
    CAUGHT_BY = frozenset({"token-budget"})
    _admission_chunk = patched(_admission_chunk, ("""\
        if n > state.budget:
            if not self._config.enable_chunked_prefill:
                return -1, NO_TOKENS
            n = state.budget
""", """\
        if n > state.budget:
            if not self._config.enable_chunked_prefill:
                return -1, NO_TOKENS
"""))


class ThresholdOnLoneRequest(Mutant):
    BUG = "the long-prefill threshold is applied to a request that is alone in the scheduler (nobody to protect)"
    ISSUE = "https://github.com/vllm-project/vllm/pull/57951"
    CAUGHT_BY = frozenset({"divergence"})
    _start_step = patched(_start_step, ("""\
        if len(self._running) + len(self._waiting) + len(self._kv_holding_waiting) <= 1:
            threshold = 0
""", ""))


# ---------------------------------------------------------------- stop and finish


class StopTokenIgnored(Mutant):
    BUG = "the stop check looks at eos only: the stop tokens a request asked for never stop it"
    ISSUE = "https://github.com/vllm-project/vllm/issues/4188"
    CAUGHT_BY = frozenset({"stop-conditions"})

    def add(self, request: RequestSpec) -> None:
        super().add(request)
        eos = request.eos_token_id
        stop = {eos} if eos is not None and not request.ignore_eos else set()
        self._requests[request.request_id].stop_token_ids = frozenset(stop)


class EosDespiteIgnoreEos(Mutant):
    BUG = "eos is treated as a stop token even with ignore_eos"
    ISSUE = "https://github.com/vllm-project/vllm/issues/4589"
    CAUGHT_BY = frozenset({"stop-conditions"})

    def add(self, request: RequestSpec) -> None:
        super().add(request)
        if request.eos_token_id is not None:
            req = self._requests[request.request_id]
            req.stop_token_ids = req.stop_token_ids | {request.eos_token_id}


class FinishedNeverReported(Mutant):
    BUG = "an aborted request is freed but its id never reaches the next plan's finished ids"
    ISSUE = "https://github.com/vllm-project/vllm/pull/6266"
    CAUGHT_BY = frozenset({"finished-reported-once", "legal-status-transition"})

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._finished.pop(request_id, None)


class FinishedReportedTwice(Mutant):
    BUG = "finished ids are reported by two consecutive plans (the completion path runs twice)"
    ISSUE = "https://github.com/casys-kaist/LLMServingSim/pull/64"
    CAUGHT_BY = frozenset({"finished-reported-once"})

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._seen: set[str] = set()

    def schedule(self) -> StepPlan:
        pending = dict(self._finished)
        plan = super().schedule()
        self._finished = {rid: r for rid, r in pending.items() if rid not in self._seen}
        self._seen.update(pending)
        return plan


ALL: tuple[type[Mutant], ...] = tuple(
    cls for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Mutant) and cls is not Mutant
)
