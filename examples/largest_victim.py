"""A scheduler with its own queue order and its own preemption victim.

``ShortestFirstEngine`` is the scheduler as another project might write it:
``enqueue`` a sequence, ``next_step`` to plan, ``feed`` the sampled tokens,
``drop`` a sequence. It allocates blocks as tokens are scheduled (chunked
prefill within the token budget), admits the waiting sequence with the
fewest tokens first (shortest job first, ties by arrival), and when the pool
runs out it preempts the running sequence that holds the most blocks (not
the most recent one, as vLLM's FCFS does) and requeues it for recomputation.
A step that preempts admits nothing.

``LargestVictimScheduler`` is the adapter: schedspec's Scheduler protocol
over the engine. Check it with the safety invariants:

    schedspec check --against examples.largest_victim:LargestVictimScheduler --mode invariants

``StaleVictimPlan`` is the deliberately broken variant: it may pick a victim
that was already scheduled earlier in the same step and leaves that entry in
the plan, so the runner computes tokens into blocks that were just freed
(``preemption-resets``, ``scheduled-are-running``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schedspec.check.capabilities import Capabilities
from schedspec.spec.interface import (
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
    blocks: list[int] = field(default_factory=list)
    phase: str = "waiting"  # waiting | preempted | running | done:<how>
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return list(self.spec.prompt_token_ids) + self.output


@dataclass
class Slot:
    """One sequence's share of a step."""

    sid: str
    start: int
    count: int
    kind: str  # "run" | "new" | "resume"


class ShortestFirstEngine:
    def __init__(self, block_size: int, num_blocks: int, token_budget: int, max_running: int, max_len: int,
                 chunking: bool) -> None:
        self.bs = block_size
        self.max_len = max_len
        self.budget = token_budget
        self.max_running = max_running
        self.chunking = chunking
        self.free: list[int] = list(range(1, num_blocks))
        self.seqs: dict[str, Seq] = {}
        self.waiting: list[str] = []  # kept sorted: fewest tokens first, then arrival
        self.running: list[str] = []
        self.preempted_now: list[str] = []

    def _sort_waiting(self) -> None:
        self.waiting.sort(key=lambda s: (len(self.seqs[s].tokens), self.seqs[s].spec.arrival, s))

    def enqueue(self, spec: RequestSpec) -> None:
        self.seqs[spec.request_id] = Seq(spec)
        self.waiting.append(spec.request_id)
        self._sort_waiting()

    def _grow(self, seq: Seq, upto: int) -> bool:
        need = -(-upto // self.bs) - len(seq.blocks)
        if need > len(self.free):
            return False
        if need > 0:
            seq.blocks += self.free[:need]
            del self.free[:need]
        return True

    def _victim(self, current: str, slots: list[Slot]) -> str | None:
        """The running sequence holding the most blocks, other than ``current``
        and those already in this step."""
        taken = {s.sid for s in slots}
        cands = [s for s in self.running if s != current and s not in taken]
        return max(cands, key=lambda s: (len(self.seqs[s].blocks), s), default=None)

    def _preempt(self, sid: str) -> None:
        seq = self.seqs[sid]
        self.running.remove(sid)
        self.free.extend(seq.blocks)
        seq.blocks, seq.computed, seq.phase = [], 0, "preempted"
        seq.preemptions += 1
        self.waiting.append(sid)
        self.preempted_now.append(sid)

    def next_step(self) -> list[Slot]:
        slots: list[Slot] = []
        budget = self.budget
        preempted = False
        for sid in list(self.running):
            if sid not in self.running or budget <= 0:
                continue
            seq = self.seqs[sid]
            n = min(len(seq.tokens) - seq.computed, budget)
            if not self.chunking and n < len(seq.tokens) - seq.computed:
                continue
            while not self._grow(seq, seq.computed + n):
                victim = self._victim(sid, slots)
                if victim is None:
                    break
                self._preempt(victim)
                preempted = True
            else:
                slots.append(Slot(sid, seq.computed, n, "run"))
                budget -= n
                continue
            self._preempt(sid)  # not even alone: wait for the others to finish
            preempted = True
        if not preempted:
            self._sort_waiting()
            while self.waiting and budget > 0 and len(self.running) < self.max_running:
                seq = self.seqs[self.waiting[0]]
                n = min(len(seq.tokens), budget)
                if (not self.chunking and n < len(seq.tokens)) or not self._grow(seq, n):
                    break
                sid = self.waiting.pop(0)
                slots.append(Slot(sid, 0, n, "resume" if seq.phase == "preempted" else "new"))
                seq.phase = "running"
                self.running.append(sid)
                budget -= n
        self._sort_waiting()
        for s in slots:
            self.seqs[s.sid].computed = s.start + s.count
        return slots

    def feed(self, sid: str, token: int) -> str | None:
        seq = self.seqs[sid]
        seq.output.append(token)
        spec = seq.spec
        if (spec.eos_token_id is not None and not spec.ignore_eos and token == spec.eos_token_id) or (
            token in spec.stop_token_ids
        ):
            return self._end(seq, "stopped")
        if len(seq.output) >= spec.max_tokens or len(seq.tokens) >= self.max_len:
            return self._end(seq, "length")
        return None

    def drop(self, sid: str) -> None:
        self._end(self.seqs[sid], "aborted")

    def _end(self, seq: Seq, how: str) -> str:
        sid = seq.spec.request_id
        for queue in (self.waiting, self.running):
            if sid in queue:
                queue.remove(sid)
        self.free.extend(seq.blocks)
        seq.blocks = []
        seq.phase = "done:" + how
        return how


# ---------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------

_KIND = {"run": ScheduleKind.RUNNING, "new": ScheduleKind.NEW, "resume": ScheduleKind.RESUMED}
_DONE = {
    "stopped": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "aborted": RequestStatus.FINISHED_ABORTED,
}


class LargestVictimScheduler:
    """The Scheduler protocol over ShortestFirstEngine."""

    #: It takes FCFS configs (and ignores the order: it is shortest-first),
    #: chunked prefill on or off, no long-prefill threshold, no prefix cache,
    #: no reset_prefix_cache.
    CAPABILITIES = Capabilities(
        policies=frozenset({Policy.FCFS}),
        long_prefill_threshold=False,
        prefix_caching=False,
        reset_prefix_cache=False,
    )

    engine_cls: type[ShortestFirstEngine] = ShortestFirstEngine

    def __init__(self, config: SchedulerConfig) -> None:
        if config.enable_prefix_caching or config.long_prefill_token_threshold:
            raise ValueError(f"unsupported config: {config}")
        self.config = config
        self.engine = self.engine_cls(config.block_size, config.num_blocks, config.max_num_batched_tokens,
                                      config.max_num_seqs, config.max_model_len, config.enable_chunked_prefill)
        self.step = 0
        self.finished: dict[str, RequestView] = {}

    def add(self, request: RequestSpec) -> None:
        seq = self.engine.seqs.get(request.request_id)
        if seq is not None and not seq.phase.startswith("done"):
            raise RequestError(request.request_id, "request_id", "already an unfinished request")
        self.engine.enqueue(request)

    def abort(self, request_id: str) -> None:
        seq = self.engine.seqs.get(request_id)
        if seq is None or seq.phase.startswith("done"):
            raise RequestError(request_id, "request_id", "not an unfinished request")
        self.engine.drop(request_id)
        self.finished[request_id] = self._view_of(seq)

    def schedule(self) -> StepPlan:
        self.step += 1
        self.engine.preempted_now = []
        entries = []
        for slot in self.engine.next_step():
            seq = self.engine.seqs[slot.sid]
            entries.append(ScheduledRequest.of(
                slot.sid, _KIND[slot.kind], num_computed_tokens=slot.start, num_scheduled_tokens=slot.count,
                all_token_ids=seq.tokens, block_ids=tuple(seq.blocks),
            ))
        finished = tuple(sorted(self.finished))
        self.finished = {}
        return StepPlan(self.step, tuple(entries), tuple(sorted(self.engine.preempted_now)), finished)

    def update(self, plan: StepPlan, result: StepResult) -> None:
        for entry in plan.scheduled:
            tokens = result.sampled.get(entry.request_id, ())
            seq = self.engine.seqs[entry.request_id]
            if tokens and entry.samples and seq.phase == "running":
                if self.engine.feed(entry.request_id, tokens[0]) is not None:
                    self.finished[entry.request_id] = self._view_of(seq)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return not self.engine.running

    def _view_of(self, seq: Seq) -> RequestView:
        if seq.phase.startswith("done"):
            status = _DONE[seq.phase.split(":", 1)[1]]
        else:
            status = {"waiting": RequestStatus.WAITING, "preempted": RequestStatus.PREEMPTED,
                      "running": RequestStatus.RUNNING}[seq.phase]
        return RequestView.of(seq.spec, status=status, output_token_ids=tuple(seq.output),
                              num_computed_tokens=seq.computed, block_ids=tuple(seq.blocks),
                              num_preemptions=seq.preemptions)

    def view(self) -> SchedulerView:
        eng = self.engine
        live = {sid: self._view_of(s) for sid, s in eng.seqs.items() if not s.phase.startswith("done")}
        ref_cnt = [0] * self.config.num_blocks
        for s in eng.seqs.values():
            for b in s.blocks:
                ref_cnt[b] += 1
        kv = KVView(self.config.num_blocks, self.config.block_size, tuple(ref_cnt), tuple(eng.free), {}, {})
        return SchedulerView(self.config, self.step, live, tuple(eng.waiting), tuple(eng.running), kv,
                             dict(self.finished))


# ---------------------------------------------------------------------------
# The deliberately broken variant
# ---------------------------------------------------------------------------


class _StaleVictimEngine(ShortestFirstEngine):
    def _victim(self, current: str, slots: list[Slot]) -> str | None:
        # BUG: forgets that a sequence already scheduled in this step may not be preempted
        cands = [s for s in self.running if s != current]
        return max(cands, key=lambda s: (len(self.seqs[s].blocks), s), default=None)


class StaleVictimPlan(LargestVictimScheduler):
    """Preempts a sequence already scheduled in this step and keeps its entry."""

    engine_cls = _StaleVictimEngine
