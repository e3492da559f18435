"""A scheduler that reserves every request's blocks up front and never preempts.

``ReservingEngine`` is the scheduler as another project might write it, with
its own vocabulary: ``submit`` a job, ``plan_batch`` the next batch,
``commit`` the sampled tokens, ``cancel`` a job. A job is admitted (FCFS, whole
prompt in one step: no chunked prefill) only when the pool can hold its whole
life, ``min(prompt + max_tokens, max_model_len)`` tokens, so a running job
never needs another block and nothing is ever preempted. Freed blocks go to
the back of the free list. None of this is vLLM's policy: vLLM allocates as
tokens are scheduled, preempts when the pool runs out, and frees blocks to
the front or back of an LRU queue by whether they are cached.

``ReserveUpfrontScheduler`` is the adapter: it implements schedspec's
Scheduler protocol over the engine and reports views in schedspec's terms.
Check it with the safety invariants:

    schedspec check --against examples.reserve_upfront:ReserveUpfrontScheduler --mode invariants

``PromptOnlyReservation`` is the deliberately broken variant: it reserves
the prompt's blocks only, so the first decode after a prompt that ends on a
block boundary computes a token that has no KV slot
(``block-table-covers-computed``).
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
class Job:
    spec: RequestSpec
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is written
    blocks: list[int] = field(default_factory=list)  # the whole reservation
    state: str = "queued"  # queued | running | done:<status>

    @property
    def tokens(self) -> list[int]:
        return list(self.spec.prompt_token_ids) + self.output


class ReservingEngine:
    """FCFS admission of whole prompts into full reservations; decode every running job each step."""

    def __init__(self, block_size: int, num_blocks: int, token_budget: int, max_jobs: int, max_len: int) -> None:
        self.block_size = block_size
        self.max_len = max_len
        self.token_budget = token_budget
        self.max_jobs = max_jobs
        self.free: list[int] = list(range(1, num_blocks))  # block 0 is never used
        self.jobs: dict[str, Job] = {}
        self.queue: list[str] = []  # FCFS
        self.active: list[str] = []  # admission order

    def blocks_for(self, job: Job) -> int:
        """The reservation: every token the job can ever hold."""
        life = min(len(job.spec.prompt_token_ids) + job.spec.max_tokens, self.max_len)
        return -(-life // self.block_size)

    def submit(self, spec: RequestSpec) -> None:
        self.jobs[spec.request_id] = Job(spec)
        self.queue.append(spec.request_id)

    def plan_batch(self) -> tuple[list[tuple[str, int, int, bool]], list[str]]:
        """[(job id, first token, token count, admitted now)] and the ids admitted."""
        batch: list[tuple[str, int, int, bool]] = []
        budget = self.token_budget
        for jid in self.active:  # decode: one token each
            job = self.jobs[jid]
            n = len(job.tokens) - job.computed
            batch.append((jid, job.computed, n, False))
            budget -= n
        admitted: list[str] = []
        while self.queue and len(self.active) < self.max_jobs:
            job = self.jobs[self.queue[0]]
            need = self.blocks_for(job)
            n = len(job.tokens)
            if n > budget or need > len(self.free):
                break  # FCFS: the head waits, and everyone behind it
            self.queue.pop(0)
            job.blocks, self.free = self.free[:need], self.free[need:]
            job.state = "running"
            self.active.append(job.spec.request_id)
            admitted.append(job.spec.request_id)
            batch.append((job.spec.request_id, 0, n, True))
            budget -= n
        for jid, start, n, _ in batch:
            self.jobs[jid].computed = start + n
        return batch, admitted

    def commit(self, jid: str, token: int) -> str | None:
        """Append a sampled token; the final status when the job ends."""
        job = self.jobs[jid]
        job.output.append(token)
        spec = job.spec
        if (spec.eos_token_id is not None and not spec.ignore_eos and token == spec.eos_token_id) or (
            token in spec.stop_token_ids
        ):
            return self._finish(job, "stopped")
        if len(job.output) >= spec.max_tokens or len(job.tokens) >= self.max_len:
            return self._finish(job, "length")
        return None

    def cancel(self, jid: str) -> None:
        self._finish(self.jobs[jid], "aborted")

    def _finish(self, job: Job, how: str) -> str:
        jid = job.spec.request_id
        if jid in self.queue:
            self.queue.remove(jid)
        if jid in self.active:
            self.active.remove(jid)
        self.free.extend(job.blocks)  # freed blocks go to the back
        job.blocks = []
        job.state = "done:" + how
        return how


# ---------------------------------------------------------------------------
# The adapter: schedspec's Scheduler protocol over the engine
# ---------------------------------------------------------------------------

_DONE = {
    "stopped": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "aborted": RequestStatus.FINISHED_ABORTED,
}


class ReserveUpfrontScheduler:
    """The Scheduler protocol over ReservingEngine."""

    #: FCFS only, whole prompts (no chunked prefill, no long-prefill
    #: threshold), no prefix cache, and no reset_prefix_cache (it cannot
    #: preempt running requests to honour reset_running_requests=True).
    CAPABILITIES = Capabilities(
        policies=frozenset({Policy.FCFS}),
        chunked_prefill=False,
        long_prefill_threshold=False,
        prefix_caching=False,
        reset_prefix_cache=False,
    )

    engine_cls: type[ReservingEngine] = ReservingEngine

    def __init__(self, config: SchedulerConfig) -> None:
        if config.enable_chunked_prefill or config.enable_prefix_caching or config.policy != Policy.FCFS:
            raise ValueError(f"unsupported config: {config}")
        self.config = config
        self.engine = self.engine_cls(
            config.block_size, config.num_blocks, config.max_num_batched_tokens, config.max_num_seqs,
            config.max_model_len,
        )
        self.step = 0
        self.finished: dict[str, RequestView] = {}  # since the last plan

    # -- operations --------------------------------------------------------

    def add(self, request: RequestSpec) -> None:
        job = self.engine.jobs.get(request.request_id)
        if job is not None and not job.state.startswith("done"):
            raise RequestError(request.request_id, "request_id", "already an unfinished request")
        self.engine.submit(request)

    def abort(self, request_id: str) -> None:
        job = self.engine.jobs.get(request_id)
        if job is None or job.state.startswith("done"):
            raise RequestError(request_id, "request_id", "not an unfinished request")
        self.engine.cancel(request_id)
        self.finished[request_id] = self._view_of(job)

    def schedule(self) -> StepPlan:
        self.step += 1
        batch, _ = self.engine.plan_batch()
        entries = []
        for jid, start, n, new in batch:
            job = self.engine.jobs[jid]
            entries.append(ScheduledRequest.of(
                jid, ScheduleKind.NEW if new else ScheduleKind.RUNNING, num_computed_tokens=start,
                num_scheduled_tokens=n, all_token_ids=job.tokens, block_ids=tuple(job.blocks),
            ))
        finished = tuple(sorted(self.finished))
        self.finished = {}
        return StepPlan(self.step, tuple(entries), (), finished)

    def update(self, plan: StepPlan, result: StepResult) -> None:
        for entry in plan.scheduled:
            tokens = result.sampled.get(entry.request_id, ())
            job = self.engine.jobs[entry.request_id]
            if tokens and entry.samples and not job.state.startswith("done"):
                if self.engine.commit(entry.request_id, tokens[0]) is not None:
                    self.finished[entry.request_id] = self._view_of(job)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return not any(job.blocks for job in self.engine.jobs.values())  # nothing is ever cached

    # -- what it reports ---------------------------------------------------

    def _view_of(self, job: Job) -> RequestView:
        if job.state == "queued":
            status = RequestStatus.WAITING
        elif job.state == "running":
            status = RequestStatus.RUNNING
        else:
            status = _DONE[job.state.split(":", 1)[1]]
        return RequestView.of(job.spec, status=status, output_token_ids=tuple(job.output),
                              num_computed_tokens=job.computed, block_ids=tuple(job.blocks), num_preemptions=0)

    def view(self) -> SchedulerView:
        eng = self.engine
        live = {jid: self._view_of(j) for jid, j in eng.jobs.items() if not j.state.startswith("done")}
        ref_cnt = [0] * self.config.num_blocks
        for j in eng.jobs.values():
            for b in j.blocks:
                ref_cnt[b] += 1
        kv = KVView(self.config.num_blocks, self.config.block_size, tuple(ref_cnt), tuple(eng.free), {}, {})
        return SchedulerView(self.config, self.step, live, tuple(eng.queue), tuple(eng.active), kv,
                             dict(self.finished))


# ---------------------------------------------------------------------------
# The deliberately broken variant
# ---------------------------------------------------------------------------


class _PromptOnlyEngine(ReservingEngine):
    def blocks_for(self, job: Job) -> int:
        return -(-len(job.spec.prompt_token_ids) // self.block_size)  # BUG: forgets the outputs


class PromptOnlyReservation(ReserveUpfrontScheduler):
    """Reserves the prompt's blocks only: decoding runs past the reservation."""

    engine_cls = _PromptOnlyEngine
