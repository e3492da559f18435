"""A nano-vllm-like scheduler: max_num_seqs bounds each step's batch, blocks are keyed after the step.

``StepEngine`` is the scheduler as a small serving project writes it, in its
own terms (``Seq``, ``BlockManager``, 0-based block ids). A step is either a
prefill step or a decode step, never both:

- **prefill**: admit from the head of the waiting queue, whole prompts (no
  chunked prefill), while the step holds fewer than ``max_num_seqs`` sequences,
  the whole sequence fits the token budget and its blocks fit the free pool;
- **decode**, when nothing was admitted: take running sequences from the
  front, at most ``max_num_seqs`` of them, one token each; one that needs a
  block and finds none preempts the last running sequence (itself if none is
  left), which goes back to the front of the waiting queue and is recomputed.

So ``max_num_seqs`` bounds the batch, not the running set: after two prefill
steps of ``max_num_seqs`` sequences, twice as many are running, and each
decode step serves ``max_num_seqs`` of them. vLLM reads the knob as a bound on
the running set (``max-num-seqs``, a ``policy:vllm-running-set`` invariant);
the safety invariants ask only that no step schedules more
(``max-num-seqs-per-step``). Prefix caching keys a block in ``update()``,
once the step that filled it has run (vLLM keys it in ``schedule()``); a hit
is looked up by the content key, for whole blocks before the last token.

``BatchBoundScheduler`` is the adapter (schedspec's Scheduler protocol over
the engine; ``schedspec_id = own_id + 1``). Check it with the safety invariants:

    schedspec check --against examples.batch_bound:BatchBoundScheduler --mode invariants

``OverfullBatch`` is the deliberately broken variant: its decode loop lets
one sequence too many into the batch (``max-num-seqs-per-step``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from schedspec.check.capabilities import Capabilities
from schedspec.spec.interface import (
    BlockKey,
    KVView,
    Policy,
    RequestError,
    RequestSpec,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    SchedulerConfig,
    SchedulerView,
    StepPlan,
    StepResult,
)


# ---------------------------------------------------------------------------
# The scheduler, in its own terms
# ---------------------------------------------------------------------------


@dataclass
class Seq:
    spec: RequestSpec
    output: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)  # own ids, 0-based
    state: str = "waiting"  # waiting | preempted | running | done:<how>
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return list(self.spec.prompt_token_ids) + self.output

    def key(self, index: int, block_size: int) -> BlockKey:
        end = (index + 1) * block_size
        return (self.spec.block_identity(end), tuple(self.tokens[:end]))


class BlockManager:
    """Blocks with reference counts; a freed block keeps its key (a cache hit may revive it)
    until it is handed out again."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.block_size = block_size
        self.caching = caching
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.key_of: dict[int, BlockKey] = {}
        self.block_of: dict[BlockKey, int] = {}

    def needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def hits(self, seq: Seq) -> list[int]:
        """The cached blocks of seq's prefix, whole blocks before its last token."""
        found: list[int] = []
        if not self.caching:
            return found
        for i in range((len(seq.tokens) - 1) // self.block_size):
            b = self.block_of.get(seq.key(i, self.block_size))
            if b is None:
                break
            found.append(b)
        return found

    def take_free(self) -> int:
        b = self.free.popleft()
        key = self.key_of.pop(b, None)
        if key is not None:
            del self.block_of[key]  # evicted
        self.ref[b] = 1
        return b

    def allocate(self, seq: Seq) -> None:
        hit = self.hits(seq)
        for b in hit:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        seq.blocks = hit + [self.take_free() for _ in range(self.needed(len(seq.tokens)) - len(hit))]
        seq.computed = len(hit) * self.block_size

    def deallocate(self, seq: Seq) -> None:
        for b in reversed(seq.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        seq.blocks = []
        seq.computed = 0

    def key_full_blocks(self, seq: Seq) -> None:
        """After a step: key every block the step filled with computed tokens."""
        if not self.caching:
            return
        for i in range(seq.computed // self.block_size):
            b = seq.blocks[i]
            if b in self.key_of:
                continue
            key = seq.key(i, self.block_size)
            if key not in self.block_of:
                self.key_of[b] = key
                self.block_of[key] = b


class StepEngine:
    """Prefill steps and decode steps, max_num_seqs sequences per step."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.max_seqs = config.max_num_seqs
        self.max_tokens = config.max_num_batched_tokens
        self.max_len = config.max_model_len
        self.blocks = BlockManager(config.num_blocks - 1, config.block_size, config.enable_prefix_caching)
        self.seqs: dict[str, Seq] = {}
        self.waiting: deque[str] = deque()
        self.running: deque[str] = deque()

    def submit(self, spec: RequestSpec) -> None:
        self.seqs[spec.request_id] = Seq(spec)
        self.waiting.append(spec.request_id)

    def batch_full(self, batch: list[tuple[str, int, int, str]]) -> bool:
        return len(batch) >= self.max_seqs

    def step(self) -> tuple[list[tuple[str, int, int, str]], list[str]]:
        """[(seq id, first token, token count, kind)] and the ids preempted."""
        batch: list[tuple[str, int, int, str]] = []
        used = 0
        while self.waiting and not self.batch_full(batch):
            seq = self.seqs[self.waiting[0]]
            n = len(seq.tokens)
            if used + n > self.max_tokens or self.blocks.needed(n) > len(self.blocks.free):
                break
            self.waiting.popleft()
            kind = "resumed" if seq.state == "preempted" else "new"
            self.blocks.allocate(seq)
            batch.append((seq.spec.request_id, seq.computed, n - seq.computed, kind))
            seq.computed = n
            seq.state = "running"
            self.running.append(seq.spec.request_id)
            used += n
        if batch:
            return batch, []
        preempted: list[str] = []
        served: list[str] = []
        while self.running and not self.batch_full(batch) and used < self.max_tokens:
            sid = self.running.popleft()
            seq = self.seqs[sid]
            while self.blocks.needed(len(seq.tokens)) > len(seq.blocks) and not self.blocks.free:
                victim = self.running.pop() if self.running else sid
                self.preempt(self.seqs[victim])
                preempted.append(victim)
                if victim == sid:
                    break
            else:
                if self.blocks.needed(len(seq.tokens)) > len(seq.blocks):
                    seq.blocks.append(self.blocks.take_free())
                batch.append((sid, seq.computed, len(seq.tokens) - seq.computed, "running"))
                seq.computed = len(seq.tokens)
                served.append(sid)
                used += batch[-1][2]
        self.running.extendleft(reversed(served))
        return batch, preempted

    def preempt(self, seq: Seq) -> None:
        self.blocks.deallocate(seq)
        seq.state = "preempted"
        seq.preemptions += 1
        self.waiting.appendleft(seq.spec.request_id)

    def postprocess(self, sid: str, token: int | None) -> str | None:
        """After the step: key the filled blocks, append the sampled token; the final status."""
        seq = self.seqs[sid]
        self.blocks.key_full_blocks(seq)
        if token is None:
            return None
        seq.output.append(token)
        spec = seq.spec
        if (spec.eos_token_id is not None and not spec.ignore_eos and token == spec.eos_token_id) or (
            token in spec.stop_token_ids
        ):
            return self.finish(seq, "stopped")
        if len(seq.output) >= spec.max_tokens or len(seq.tokens) >= self.max_len:
            return self.finish(seq, "length")
        return None

    def finish(self, seq: Seq, how: str) -> str:
        sid = seq.spec.request_id
        for queue in (self.waiting, self.running):
            if sid in queue:
                queue.remove(sid)
        self.blocks.deallocate(seq)
        seq.state = "done:" + how
        return how


# ---------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------

_STATUS = {
    "waiting": RequestStatus.WAITING,
    "preempted": RequestStatus.PREEMPTED,
    "running": RequestStatus.RUNNING,
    "done:stopped": RequestStatus.FINISHED_STOPPED,
    "done:length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "done:aborted": RequestStatus.FINISHED_ABORTED,
}
_KIND = {"new": ScheduleKind.NEW, "resumed": ScheduleKind.RESUMED, "running": ScheduleKind.RUNNING}


class BatchBoundScheduler:
    """The Scheduler protocol over StepEngine."""

    #: FCFS, whole prompts, prefix caching on or off, no reset_prefix_cache.
    CAPABILITIES = Capabilities(
        policies=frozenset({Policy.FCFS}),
        chunked_prefill=False,
        long_prefill_threshold=False,
        reset_prefix_cache=False,
    )

    engine_cls: type[StepEngine] = StepEngine

    def __init__(self, config: SchedulerConfig) -> None:
        if config.enable_chunked_prefill or config.policy != Policy.FCFS:
            raise ValueError(f"unsupported config: {config}")
        self.config = config
        self.engine = self.engine_cls(config)
        self.step = 0
        self.finished: dict[str, RequestView] = {}

    def _live(self, request_id: str) -> Seq | None:
        seq = self.engine.seqs.get(request_id)
        return seq if seq is not None and not seq.state.startswith("done") else None

    def add(self, request: RequestSpec) -> None:
        if self._live(request.request_id) is not None:
            raise RequestError(request.request_id, "request_id", "already an unfinished request")
        self.engine.submit(request)

    def abort(self, request_id: str) -> None:
        seq = self._live(request_id)
        if seq is None:
            raise RequestError(request_id, "request_id", "not an unfinished request")
        self.engine.finish(seq, "aborted")
        self.finished[request_id] = self._view_of(seq)

    def schedule(self) -> StepPlan:
        self.step += 1
        batch, preempted = self.engine.step()
        entries = tuple(
            ScheduledRequest.of(sid, _KIND[kind], num_computed_tokens=start, num_scheduled_tokens=n,
                                all_token_ids=self.engine.seqs[sid].tokens,
                                block_ids=tuple(b + 1 for b in self.engine.seqs[sid].blocks))
            for sid, start, n, kind in batch
        )
        finished = tuple(sorted(self.finished))
        self.finished = {}
        return StepPlan(self.step, entries, tuple(preempted), finished)

    def update(self, plan: StepPlan, result: StepResult) -> None:
        for entry in plan.scheduled:
            seq = self._live(entry.request_id)
            if seq is None:
                continue
            tokens = result.sampled.get(entry.request_id, ())
            token = tokens[0] if tokens and entry.samples else None
            if self.engine.postprocess(entry.request_id, token) is not None:
                self.finished[entry.request_id] = self._view_of(seq)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return False  # not declared: never called

    def _view_of(self, seq: Seq) -> RequestView:
        return RequestView.of(seq.spec, status=_STATUS[seq.state], output_token_ids=tuple(seq.output),
                              num_computed_tokens=seq.computed, block_ids=tuple(b + 1 for b in seq.blocks),
                              num_preemptions=seq.preemptions)

    def view(self) -> SchedulerView:
        eng, bm = self.engine, self.engine.blocks
        live = {sid: self._view_of(s) for sid, s in eng.seqs.items() if not s.state.startswith("done")}
        kv = KVView(
            self.config.num_blocks, self.config.block_size, (0, *bm.ref), tuple(b + 1 for b in bm.free),
            {b + 1: key for b, key in bm.key_of.items()},
            {key: (b + 1,) for key, b in bm.block_of.items()},
        )
        return SchedulerView(self.config, self.step, live, tuple(eng.waiting), tuple(eng.running), kv,
                             dict(self.finished))


# ---------------------------------------------------------------------------
# The deliberately broken variant
# ---------------------------------------------------------------------------


class _OverfullEngine(StepEngine):
    def batch_full(self, batch: list[tuple[str, int, int, str]]) -> bool:
        return len(batch) > self.max_seqs  # BUG: one sequence too many


class OverfullBatch(BatchBoundScheduler):
    """Lets max_num_seqs + 1 sequences into a step's batch."""

    engine_cls = _OverfullEngine
