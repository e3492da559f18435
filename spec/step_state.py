"""What one schedule() call decides, step by step, and the named results its
decisions hand each other (spec/scheduler.py and its parts: spec/gates.py,
spec/encoder.py, spec/async_drafts.py, spec/connector.py).

vLLM keeps these as locals of Scheduler.schedule
(vllm/v1/core/sched/scheduler.py); the spec names each field, and each
decision returns a named outcome instead of a flag with a third value or a
tuple read by position.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from schedspec.spec.interface import ScheduleKind


class Scheduled(NamedTuple):
    """One request scheduled this step, as the plan will list it."""

    kind: ScheduleKind
    num_computed_tokens: int  # before the step
    num_scheduled_tokens: int
    spec_token_ids: tuple[int, ...]  # the drafts it verifies


class Admission(enum.Enum):
    """What the WAITING loop does after looking at its head request
    (schedule(), the WAITING loop: ``break``, ``skip_request`` or a request
    moved to the running queue)."""

    ADMITTED = "admitted"  # scheduled this step, now running
    PASSED_OVER = "passed over"  # skip_request: out of its queue for this step; the loop goes on
    STOPS_LOOP = "stops the loop"  # head-of-line: nothing behind it is tried (break)


@dataclass
class StepState:
    """What one schedule() call has decided so far (vLLM's locals of
    Scheduler.schedule: ``token_budget``, ``num_scheduled_tokens``,
    ``preempted_reqs``)."""

    token_budget: int
    # vLLM's input_budget: max_num_batched_tokens, charged each scheduled
    # request's tokens plus its draft slots (SchedulerConfig.num_draft_slots);
    # the same as token_budget when a request takes no draft slot
    input_budget: int
    threshold: int  # the long-prefill threshold in force this step (0 = off)
    # request id -> what it runs this step; dict order = scheduling order
    scheduled: dict[str, Scheduled] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    # vLLM's prefill_scheduled: a running request scheduled this step was
    # continuing a prefill (its is_prefill_chunk from the previous schedule).
    prefill_scheduled: bool = False
    # The prefill cadence: hold prefill this step (defer_prefills); whether a
    # waiting request was admitted with prompt left to compute.
    defer_prefills: bool = False
    prefill_admitted: bool = False
    # LoRA: the adapters of the running queue and this step's admissions.
    loras: set[int] = field(default_factory=set)
    # The encoder: its compute budget left, and the inputs each scheduled
    # request runs this step.
    encoder_budget: int = 0
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # vLLM's drafts_needed: a request scheduled this step (even one preempted
    # later in it) can use the drafts proposed after it (spec/runner_v2.py).
    drafts_needed: bool = True

    def request_token_budget(self, draft_slots: int) -> int:
        """The most tokens the next request may schedule: vLLM's
        ``min(token_budget, input_budget - draft_slots)``
        (vllm/v1/core/sched/scheduler.py, Scheduler.schedule: the RUNNING
        loop's num_new_tokens, the WAITING loop's request_token_budget)."""
        return min(self.token_budget, self.input_budget - draft_slots)

    def running_scheduled(self) -> bool:
        """Whether a running request (not an admission) is scheduled yet."""
        return any(e.kind == ScheduleKind.RUNNING for e in self.scheduled.values())


@dataclass(frozen=True)
class RunningAllocation:
    """What the RUNNING loop's allocation did for one running request
    (SpecScheduler._allocate_or_preempt)."""

    allocated: bool  # it got its blocks (False: it preempted itself, or a victim's free is deferred)
    index: int  # its index in the running queue once the victims left it


@dataclass(frozen=True)
class PrefixHit:
    """The WAITING loop's prefix lookup for a request (the local prefix-cache
    hit, then a KV connector's external tokens): SpecScheduler._prefix_lookup."""

    blocks: list[list[int]]  # the hit blocks, one list per KV cache group
    num_computed_tokens: int  # the tokens counted computed: the local hit plus the external ones
    num_external_tokens: int = 0  # of those, the connector's (loaded into new blocks)
    load_async: bool = False  # the external tokens load asynchronously (the request waits for them)


@dataclass(frozen=True)
class AdmissionChunk:
    """The tokens an admission schedules past its prefix hit, and its drafts
    (SpecScheduler._admission_tokens); 0 tokens: the WAITING loop stops."""

    num_tokens: int
    spec_token_ids: tuple[int, ...] = ()  # a padded decode's placeholder drafts (-1)
