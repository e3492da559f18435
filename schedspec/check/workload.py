"""The workload model: what happens to a scheduler, one event at a time.

A workload is a SchedulerConfig plus a sequence of events. Events are plain
frozen values so a workload can be written to a trace and replayed against any
scheduler. A Step event means: ``plan = schedule()``, run the model,
``update(plan, result)``.

With async scheduling (``config.async_scheduling``) a Step is one step of
vLLM's engine core with a batch queue of two (vllm/v1/engine/core.py,
EngineCore.step_with_batch_queue): schedule a new plan and run the model on
it, then, when two plans are in flight, update the oldest. So after the first
Step one plan is always in flight, and every event between two Steps comes
between schedule(N) and update(N). The finer events Schedule and Update spell
an interleaving out (an abort between schedule(N+1) and update(N), say):
a Step is exactly Schedule() followed, in sync mode or when two plans are then
in flight, by Update().
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeVar, Union

from schedspec.spec.interface import Policy, RequestSpec, SchedSpecError, SchedulerConfig, StepResult
from schedspec.spec.kv_kinds import kind_of

from schedspec.check import kv_kinds

_T = TypeVar("_T")


@dataclass(frozen=True)
class AddRequest:
    request: RequestSpec


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Step:
    pass


@dataclass(frozen=True)
class ResetPrefixCache:
    reset_running_requests: bool = False


#: The pause modes of a Pause event: "new" is vLLM's PAUSED_NEW (the engine
#: core's "abort" and "wait" pause modes: nothing new is admitted, running
#: requests drain), "all" is PAUSED_ALL (its "keep" mode: nothing is scheduled).
PAUSE_MODES: tuple[str, ...] = ("new", "all")


@dataclass(frozen=True)
class Pause:
    """The engine core pauses the scheduler (vllm/v1/engine/core.py,
    EngineCore.pause_scheduler): ``set_pause_state(PAUSED_NEW)`` for mode
    "new", ``set_pause_state(PAUSED_ALL)`` for mode "all". With
    ``clear_cache`` the prefix cache is reset, running requests included,
    once the pause completes: when the engine has no work left
    (EngineCore._finish_pause, called at once or from the idle callback)."""

    mode: str = "new"
    clear_cache: bool = False

    def __post_init__(self) -> None:
        if self.mode not in PAUSE_MODES:
            raise ValueError(f"Pause.mode must be one of {', '.join(PAUSE_MODES)}, got {self.mode!r}")
        if not isinstance(self.clear_cache, bool):
            raise ValueError(f"Pause.clear_cache must be a boolean, got {self.clear_cache!r}")


@dataclass(frozen=True)
class Resume:
    """``set_pause_state(UNPAUSED)`` (EngineCore.resume_scheduler)."""


@dataclass(frozen=True)
class GrammarReady:
    """The structured-output manager finished compiling the grammar of a
    request waiting in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR; ``ok=False``:
    the compile failed."""

    request_id: str
    ok: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"GrammarReady.request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.ok, bool):
            raise ValueError(f"GrammarReady.ok must be a boolean, got {self.ok!r}")


@dataclass(frozen=True)
class Schedule:
    """``plan = schedule()`` and run the model on it; the plan is then in
    flight until an Update. ``result``, when given, is the model's output for
    the requests it names (a recorded output: the fake model takes these
    tokens and drafts instead of its own)."""

    result: StepResult | None = None


@dataclass(frozen=True)
class Update:
    """``update(plan, result)`` of the oldest plan in flight. ``step``, when
    given, names that plan (the n-th plan of the run is step n): an Update
    naming another step is a malformed workload."""

    step: int | None = None


@dataclass(frozen=True)
class KVLoadDone:
    """The KV connector's worker reports the asynchronous load of request
    ``request_id`` finished (StepResult.finished_recving). The driver's
    worker queues it and delivers it in the next StepResult where it is
    meaningful: the request has an asynchronous load in flight (it waits in
    WAITING_FOR_REMOTE_KVS, or was aborted during the load and still holds
    its blocks). While the request is unfinished and no load of it is in
    flight the event waits (the load starts at its admission); once the
    request is finished and holds nothing, it is dropped."""

    request_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"KVLoadDone.request_id must be a non-empty string, got {self.request_id!r}")


@dataclass(frozen=True)
class KVLoadFailed:
    """The worker reports a load of request ``request_id`` failed.
    ``block_index`` None: the whole asynchronous load failed
    (StepResult.failed_recving, with the request in finished_recving);
    ``i``: the block at index ``i`` of the request's group-0 table could not
    be filled (StepResult.invalid_block_ids; for an asynchronous load the
    request is also in finished_recving). ``i`` is taken within the loaded
    blocks (an index before them names the load's first block, one after
    them its last). A synchronous load is reported failed in the result of
    the step that loads it (its sample is discarded, as vLLM's
    update_from_output skips the request); ``None`` there names the load's
    first block. With more than one KV cache group the worker never reports
    invalid_block_ids (vLLM raises there, _handle_invalid_blocks): an
    asynchronous load is reported in failed_recving instead, and the event
    for a synchronous load is dropped (failed_recving only concerns a
    request in WAITING_FOR_REMOTE_KVS). Waits and is dropped as KVLoadDone."""

    request_id: str
    block_index: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"KVLoadFailed.request_id must be a non-empty string, got {self.request_id!r}")
        if self.block_index is not None and (
            not isinstance(self.block_index, int) or isinstance(self.block_index, bool) or self.block_index < 0
        ):
            raise ValueError(f"KVLoadFailed.block_index must be None or an integer >= 0, got {self.block_index!r}")


@dataclass(frozen=True)
class KVSaveDone:
    """The worker reports the asynchronous save of finished request
    ``request_id`` finished (StepResult.finished_sending): its held blocks
    are freed. Meaningful while the request is finished and holds its blocks
    for a save (SchedulerView.kv_held_by_finished); waits while it is
    unfinished, dropped once it is finished and holds nothing."""

    request_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"KVSaveDone.request_id must be a non-empty string, got {self.request_id!r}")


Event = Union[AddRequest, Abort, Step, ResetPrefixCache, Schedule, Update, Pause, Resume, GrammarReady,
              KVLoadDone, KVLoadFailed, KVSaveDone]

#: The KV connector's worker events (a scheduler without the kv_connector
#: capability cannot take them).
KV_EVENTS: tuple[type, ...] = (KVLoadDone, KVLoadFailed, KVSaveDone)
KVEvent = Union[KVLoadDone, KVLoadFailed, KVSaveDone]

#: The bounded wait: the worker reports every asynchronous load (done) and
#: every pending save at the latest this many steps after it started (the
#: load's plan, or the first plan after the request finished holding its
#: blocks), as a connector's timeout does, so no block is held forever.
KV_REPORT_BOUND = 8

#: The event types of the admission gates (a scheduler without the gate's
#: optional method cannot take them).
GATE_EVENTS: tuple[type, ...] = (Pause, Resume, GrammarReady)


class EventError(SchedSpecError, ValueError):
    """A workload event that breaks the in-flight protocol (an Update with
    nothing in flight or for another step, a Schedule while the scheduler
    may not take one). ``index`` is the event's position in the workload."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"event {index}: {message}")
        self.index = index


class InFlight:
    """The plans in flight, counted the way a driver schedules them: the n-th
    schedule() of a run is step n. The trace loader and the driver both walk a
    workload's events through one of these, so a workload that breaks the
    in-flight protocol is refused before any scheduler sees it."""

    def __init__(self, async_scheduling: bool) -> None:
        self.async_scheduling = async_scheduling
        self.scheduled = 0
        self.steps: list[int] = []  # the steps in flight, oldest first

    @property
    def limit(self) -> int:
        """How many plans may be in flight once schedule() returns."""
        return 2 if self.async_scheduling else 1

    def schedule(self) -> str | None:
        """Count a schedule(); the reason it may not happen, or None."""
        if len(self.steps) >= self.limit:
            if self.async_scheduling:
                return (f"schedule with steps {self.steps[0]} and {self.steps[1]} in flight: "
                        f"step {self.steps[0]} must be updated first")
            return (f"schedule with step {self.steps[0]} in flight: without async scheduling "
                    "every plan is updated before the next schedule")
        self.scheduled += 1
        self.steps.append(self.scheduled)
        return None

    def update(self, step: int | None) -> str | None:
        """Count an update() of ``step`` (None: the oldest in flight); the
        reason it may not happen, or None."""
        if step is not None and step > self.scheduled:
            return f"update for step {step}, which was never planned (the last plan is step {self.scheduled})"
        if not self.steps:
            if step is None:
                return "update with no plan in flight"
            return f"update for step {step}, which was already updated"
        if step is not None and step != self.steps[0]:
            if step in self.steps:
                return f"update for step {step} out of order: step {self.steps[0]} is in flight before it"
            return f"update for step {step}, which was already updated"
        self.steps.pop(0)
        return None

    def step(self) -> tuple[bool, str | None]:
        """Count a Step event: (whether it updates, the reason it may not happen)."""
        if (why := self.schedule()) is not None:
            return False, why
        if not self.async_scheduling or len(self.steps) == 2:
            self.steps.pop(0)
            return True, None
        return False, None

    def reset(self) -> str | None:
        """Whether reset_prefix_cache may come now: never between a schedule
        and its update without async scheduling; with it, while at most one
        plan is in flight (vLLM's engine core serves a reset between two
        engine steps)."""
        if len(self.steps) > (1 if self.async_scheduling else 0):
            return f"reset_prefix_cache with step(s) {self.steps} in flight"
        return None


@dataclass(frozen=True)
class Workload:
    """A configuration and the events to feed a scheduler built from it.

    ``name`` and ``features`` (what the workload was built to contain, such as
    "shared-prefix" or "aborts") are for reports; drivers read neither."""

    config: SchedulerConfig
    events: tuple[Event, ...]
    seed: int | None = None
    name: str = ""
    features: tuple[str, ...] = ()

    @property
    def num_steps(self) -> int:
        """The plans the events schedule (Step and Schedule events)."""
        return sum(1 for e in self.events if isinstance(e, (Step, Schedule)))

    @property
    def requests(self) -> tuple[RequestSpec, ...]:
        """The requests the workload adds, in order."""
        return tuple(e.request for e in self.events if isinstance(e, AddRequest))

    def arrival_steps(self) -> dict[str, int]:
        """Request id -> the number of steps before it is added."""
        out: dict[str, int] = {}
        steps = 0
        for e in self.events:
            if isinstance(e, (Step, Schedule)):
                steps += 1
            elif isinstance(e, AddRequest):
                out[e.request.request_id] = steps
        return out

    def abort_steps(self) -> tuple[tuple[int, str], ...]:
        """(the number of steps before it, request id) of every abort, in order."""
        out: list[tuple[int, str]] = []
        steps = 0
        for e in self.events:
            if isinstance(e, (Step, Schedule)):
                steps += 1
            elif isinstance(e, Abort):
                out.append((steps, e.request_id))
        return tuple(out)


def keep_protocol(events: Sequence[Event], async_scheduling: bool) -> list[Event]:
    """``events`` within the in-flight protocol of a mode: a Step, Schedule or
    reset_prefix_cache the mode does not allow at that point, and an Update
    with nothing in flight, are dropped; Updates lose their step numbers (they
    update the oldest plan either way). The identity on events that keep it,
    step numbers aside. The shrinker's candidates and a workload whose mode a
    scheduler cannot run go through it."""
    flight = InFlight(async_scheduling)
    out: list[Event] = []
    for e in events:
        if isinstance(e, Step):
            probe = InFlight(async_scheduling)
            probe.scheduled, probe.steps = flight.scheduled, list(flight.steps)
            if probe.step()[1] is not None:
                continue
            flight.step()
        elif isinstance(e, Schedule):
            if flight.schedule() is not None:
                continue
        elif isinstance(e, Update):
            if flight.update(None) is not None:
                continue
            e = Update()
        elif isinstance(e, ResetPrefixCache) and flight.reset() is not None:
            continue
        out.append(e)
    return out


def describe_event(event: Event) -> str:
    """One event as a line of a script: ``add(RequestSpec(...))``, ``step()``,
    ``abort('r3')``, ``reset_prefix_cache(reset_running_requests=True)``,
    ``schedule()``, ``update(step=3)``."""
    if isinstance(event, AddRequest):
        return f"add({event.request!r})"
    if isinstance(event, Abort):
        return f"abort({event.request_id!r})"
    if isinstance(event, Step):
        return "step()"
    if isinstance(event, Schedule):
        return "schedule()" if event.result is None else f"schedule(result={event.result!r})"
    if isinstance(event, Update):
        return "update()" if event.step is None else f"update(step={event.step})"
    if isinstance(event, Pause):
        return f"pause(mode={event.mode!r}, clear_cache={event.clear_cache})"
    if isinstance(event, Resume):
        return "resume()"
    if isinstance(event, GrammarReady):
        return f"grammar_ready({event.request_id!r}" + (")" if event.ok else ", ok=False)")
    if isinstance(event, KVLoadDone):
        return f"kv_load_done({event.request_id!r})"
    if isinstance(event, KVLoadFailed):
        return f"kv_load_failed({event.request_id!r}" + (
            ")" if event.block_index is None else f", block_index={event.block_index})")
    if isinstance(event, KVSaveDone):
        return f"kv_save_done({event.request_id!r})"
    return f"reset_prefix_cache(reset_running_requests={event.reset_running_requests})"


def timed_events(
    requests: Sequence[RequestSpec], arrive_at: Mapping[str, int], aborts: Sequence[tuple[int, str]] = ()
) -> tuple[Event, ...]:
    """Events from a timetable: a request that arrives at step N (counted
    from 0) is an AddRequest before the (N+1)th Step, an abort at step N an
    Abort after that step's arrivals. No Step follows the last arrival or
    abort: a driver that runs to completion steps on from there."""
    adds = sorted(requests, key=lambda r: (arrive_at[r.request_id], r.arrival))
    kills = sorted(aborts)
    last = max([arrive_at[r.request_id] for r in adds] + [step for step, _ in kills], default=0)
    events: list[Event] = []
    a = k = 0
    for step in range(last + 1):
        if step:
            events.append(Step())
        while a < len(adds) and arrive_at[adds[a].request_id] <= step:
            events.append(AddRequest(adds[a]))
            a += 1
        while k < len(kills) and kills[k][0] <= step:
            events.append(Abort(kills[k][1]))
            k += 1
    return tuple(events)


# ---------------------------------------------------------------------------
# Seeded random workloads (the CLI's `check` and the benchmarks use these; the
# Hypothesis state machine draws its own through strategies).
# ---------------------------------------------------------------------------

#: Token ids of prompts come from a small alphabet and from a few shared
#: prefixes, so prefix hits are common.
ALPHABET = 16

#: The four ways a scheduler runs: synchronous or async scheduling, each
#: without or with speculative decoding.
MODES: tuple[str, ...] = ("sync", "async", "spec", "async-spec")


def mode_of(config: SchedulerConfig) -> str:
    """The mode a config runs in (one of MODES)."""
    spec = config.num_speculative_tokens > 0
    if config.async_scheduling:
        return "async-spec" if spec else "async"
    return "spec" if spec else "sync"


def parse_modes(text: str) -> tuple[str, ...]:
    """``"sync,async-spec"`` -> ("sync", "async-spec"), in MODES order; a
    ValueError names an unknown mode."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"no mode given (choose from {', '.join(MODES)})")
    for name in names:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r} (choose from {', '.join(MODES)})")
    return tuple(m for m in MODES if m in names)


#: The admission gates of vLLM 0.33's waiting loop a workload can turn on:
#: LoRA adapters (max_loras), structured outputs (grammar readiness, grammar-
#: rejected drafts), pause states, the KV watermark, the prefill cadence
#: (prefill_schedule_interval) and the multimodal encoder budget and cache.
GATES: tuple[str, ...] = ("lora", "grammar", "pause", "watermark", "cadence", "encoder")

#: gate -> the capability name (schedspec.check.capabilities) a scheduler
#: declares to take it
GATE_CAPABILITIES: Mapping[str, str] = {
    "lora": "lora",
    "grammar": "structured_output",
    "pause": "pause",
    "watermark": "watermark",
    "cadence": "prefill_cadence",
    "encoder": "encoder",
}


def parse_gates(text: str) -> tuple[str, ...]:
    """``"lora,pause"`` -> ("lora", "pause"), in GATES order; ``"all"`` ->
    GATES, ``"none"`` -> (); a ValueError names an unknown gate."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"no gate given (choose from {', '.join(GATES)}, all or none)")
    if names == ["all"]:
        return GATES
    if names == ["none"]:
        return ()
    for name in names:
        if name not in GATES:
            extra = " (all and none stand alone)" if name in ("all", "none") else ""
            raise ValueError(f"unknown gate {name!r}{extra} (choose from {', '.join(GATES)}, all or none)")
    return tuple(g for g in GATES if g in names)


def gates_of(config: SchedulerConfig, events: Sequence["Event"] = ()) -> tuple[str, ...]:
    """The gates a config and its events use, in GATES order."""
    on: set[str] = set()
    if config.max_loras:
        on.add("lora")
    if config.watermark:
        on.add("watermark")
    if config.prefill_schedule_interval != 1:
        on.add("cadence")
    if config.max_num_encoder_input_tokens or config.encoder_cache_size:
        on.add("encoder")
    for e in events:
        if isinstance(e, (Pause, Resume)):
            on.add("pause")
        elif isinstance(e, GrammarReady):
            on.add("grammar")
        elif isinstance(e, AddRequest):
            r = e.request
            if r.lora_id:
                on.add("lora")
            if r.structured_output:
                on.add("grammar")
            if r.mm_inputs:
                on.add("encoder")
    return tuple(g for g in GATES if g in on)


@dataclass(frozen=True)
class ConfigSpace:
    """What small configurations look like: every choice a generator of
    configurations makes, in one place. The seeded random workloads
    (``random_config``) and the Hypothesis strategies
    (schedspec.testing.strategies.configs) both draw from a ConfigSpace and
    build the config with ``build``."""

    block_sizes: tuple[int, ...]
    max_model_lens: tuple[int, ...]
    extra_blocks: tuple[int, ...]  # blocks beyond the least that holds one request at max_model_len
    max_num_seqs: tuple[int, ...]
    chunked_budgets: tuple[int, ...]  # token budgets with chunked prefill (raised to max_num_seqs)
    unchunked_extra_budgets: tuple[int, ...]  # budget beyond max_model_len without it
    thresholds: tuple[int, ...]  # long_prefill_token_threshold (capped at max_model_len)
    p_chunked: float
    p_prefix_caching: float
    p_reserve_full_isl: float
    #: the modes drawn from (MODES); with one mode nothing is drawn for it
    modes: tuple[str, ...] = ("sync",)
    #: num_speculative_tokens of the modes with speculative decoding
    spec_tokens: tuple[int, ...] = (1, 2, 3, 4)

    def build(
        self,
        *,
        block_size: int,
        max_model_len: int,
        extra_blocks: int,
        chunked: bool,
        max_num_seqs: int,
        budget: int,
        threshold: int,
        prefix_caching: bool,
        policy: Policy,
        reserve_full_isl: bool,
        async_scheduling: bool = False,
        num_speculative_tokens: int = 0,
    ) -> SchedulerConfig:
        """The config of one set of choices; ``budget`` is a chunked budget or
        the extra over max_model_len, as ``chunked`` says."""
        return SchedulerConfig(
            block_size=block_size,
            num_blocks=-(-max_model_len // block_size) + 1 + extra_blocks,
            max_num_batched_tokens=max(budget if chunked else max_model_len + budget, max_num_seqs),
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=min(threshold, max_model_len),
            enable_prefix_caching=prefix_caching,
            policy=policy,
            scheduler_reserve_full_isl=reserve_full_isl,
            async_scheduling=async_scheduling,
            num_speculative_tokens=num_speculative_tokens,
        )


#: The seeded random workloads of ``schedspec check``: chunking, prefix hits
#: and preemption all likely (tight pools and budgets, small blocks).
CHECK_SPACE = ConfigSpace(
    block_sizes=(1, 2, 4, 8),
    max_model_lens=(16, 24, 32, 48),
    extra_blocks=(0, 0, 1, 2, 4, 8, 16),
    max_num_seqs=(1, 2, 3, 4, 8),
    chunked_budgets=(0, 4, 8, 16, 32, 64),  # 0: max_num_seqs
    unchunked_extra_budgets=(0, 8, 32),
    thresholds=(0, 0, 0, 2, 4, 8),
    p_chunked=0.8,
    p_prefix_caching=0.85,
    p_reserve_full_isl=0.9,
    modes=MODES,
)

#: The Hypothesis state machine (schedspec.testing): smaller still.
MACHINE_SPACE = ConfigSpace(
    block_sizes=(1, 2, 4),
    max_model_lens=(8, 12, 16, 24),
    extra_blocks=(0, 0, 1, 1, 2, 3, 6),
    max_num_seqs=(1, 2, 3, 4, 6),
    chunked_budgets=(2, 3, 4, 6, 8, 16, 32),
    unchunked_extra_budgets=(0, 4, 16),
    thresholds=(0, 0, 1, 2, 3, 5),
    p_chunked=0.75,
    p_prefix_caching=0.8,
    p_reserve_full_isl=0.75,
)

#: The spec-versus-impl lockstep test: wider, down to one-token budgets.
LOCKSTEP_SPACE = ConfigSpace(
    block_sizes=(1, 2, 3, 4, 8),
    max_model_lens=tuple(range(3, 41)),
    extra_blocks=(0, 0, 1, 2, 3, 5, 10, 30),
    max_num_seqs=(1, 2, 3, 4, 5, 6),
    chunked_budgets=(1, 2, 3, 4, 6, 8, 16, 64),
    unchunked_extra_budgets=(0, 1, 5, 20),
    thresholds=(0, 0, 1, 2, 3, 5, 9),
    p_chunked=0.5,
    p_prefix_caching=0.75,
    p_reserve_full_isl=0.75,
    modes=MODES,
)


class Pick(Protocol):
    """Chooses one of ``options`` (a seeded ``random.Random``'s choice, or a
    Hypothesis draw)."""

    def __call__(self, options: Sequence[_T]) -> _T: ...


def draw_config(space: ConfigSpace, pick: Pick, coin: Callable[[float], bool]) -> SchedulerConfig:
    """A configuration of ``space``, every choice made by ``pick`` and every
    yes/no by ``coin(p)`` (true with probability ``p``), always in this order:
    the seeded workloads and the Hypothesis strategies share this one draw.
    The mode comes last (``draw_mode``), so a space of one mode draws what it
    always drew."""
    block_size = pick(space.block_sizes)
    max_model_len = pick(space.max_model_lens)
    extra = pick(space.extra_blocks)
    chunked = coin(space.p_chunked)
    max_num_seqs = pick(space.max_num_seqs)
    budget = pick(space.chunked_budgets if chunked else space.unchunked_extra_budgets)
    threshold = pick(space.thresholds)
    config = space.build(
        block_size=block_size,
        max_model_len=max_model_len,
        extra_blocks=extra,
        chunked=chunked,
        max_num_seqs=max_num_seqs,
        budget=budget,
        threshold=threshold,
        prefix_caching=coin(space.p_prefix_caching),
        policy=pick([Policy.FCFS, Policy.PRIORITY]),
        reserve_full_isl=coin(space.p_reserve_full_isl),
    )
    if len(space.modes) == 1 and space.modes[0] == "sync":
        return config
    return with_mode(config, **draw_mode(space.modes, space.spec_tokens, pick))


def with_mode(config: SchedulerConfig, *, async_scheduling: bool, num_speculative_tokens: int) -> SchedulerConfig:
    """``config`` in another mode. k stays below the token budget (one decode
    with its drafts must fit it), and a long-prefill threshold at or below k
    (which vLLM's scheduler cannot run: a padded decode of 1 + k tokens would
    be cut) lowers k below the threshold, or, at threshold 1, turns the
    threshold off."""
    k = min(num_speculative_tokens, config.max_num_batched_tokens - 1)
    threshold = config.long_prefill_token_threshold
    if k > 0 and 0 < threshold <= k:
        if threshold > 1:
            k = threshold - 1
        else:
            threshold = 0
    return dataclasses.replace(
        config, async_scheduling=async_scheduling, num_speculative_tokens=k,
        long_prefill_token_threshold=threshold,
    )


def draw_mode(modes: Sequence[str], spec_tokens: Sequence[int], pick: Pick) -> dict[str, Any]:
    """The mode fields of a config (``async_scheduling``,
    ``num_speculative_tokens``) for a mode picked from ``modes``, and k from
    ``spec_tokens`` for a mode with speculative decoding. One mode: no draw."""
    mode = modes[0] if len(modes) == 1 else pick(tuple(modes))
    k = pick(tuple(spec_tokens)) if mode in ("spec", "async-spec") else 0
    return {"async_scheduling": mode.startswith("async"), "num_speculative_tokens": k}


def random_config(rng: random.Random, space: ConfigSpace = CHECK_SPACE) -> SchedulerConfig:
    """A small configuration drawn from ``space``."""

    def pick(options: Sequence[_T]) -> _T:
        return rng.choice(options)

    return draw_config(space, pick, lambda p: rng.random() < p)


class RequestFactory:
    """Makes requests rich in shared prefixes, stop tokens and priorities."""

    def __init__(self, rng: random.Random, config: SchedulerConfig, vocab: int) -> None:
        self.rng = rng
        self.config = config
        self.vocab = vocab
        self.counter = 0
        bs = config.block_size
        self.prefixes = [
            tuple(rng.randrange(ALPHABET) for _ in range(rng.randint(bs, 3 * bs)))
            for _ in range(3)
        ]

    def make(self) -> RequestSpec:
        rng, cfg = self.rng, self.config
        self.counter += 1
        rid = f"r{self.counter}"
        longest = cfg.max_model_len - 1
        if rng.random() < 0.6:
            prefix = rng.choice(self.prefixes)
        else:
            prefix = ()
        tail_len = rng.choice([1, 2, 3, cfg.block_size, cfg.block_size + 1, rng.randint(1, longest)])
        prompt = (prefix + tuple(rng.randrange(ALPHABET) for _ in range(tail_len)))[:longest]
        stop: tuple[int, ...] = ()
        if rng.random() < 0.3:
            stop = (rng.randrange(self.vocab),)
        eos = rng.randrange(self.vocab) if rng.random() < 0.3 else None
        return RequestSpec(
            request_id=rid,
            prompt_token_ids=prompt,
            max_tokens=rng.choice([1, 2, 4, 8, 16, 64]),
            priority=rng.choice([0, 0, 1, 2]),
            arrival=self.counter,
            stop_token_ids=stop,
            eos_token_id=eos,
            ignore_eos=rng.random() < 0.2,
            cache_salt=rng.choice([None, None, None, "s1"]),
        )


def random_workload(
    seed: int, num_steps: int, vocab: int = 64, modes: Sequence[str] = ("sync",),
    gates: Sequence[str] = (), kv: Sequence[str] = (),
) -> Workload:
    """A seeded workload of ``num_steps`` steps with arrivals in bursts,
    aborts and occasional prefix-cache resets, in one of ``modes`` (MODES;
    ``schedspec check`` passes all four).

    The mode is drawn apart from the rest (its own generator, seeded from
    ``seed``), so a sync workload is the one this seed always gave. With async
    scheduling some Steps are spelled out as Schedule, events, Update, so
    aborts and arrivals also land between schedule(N+1) and update(N).

    ``gates`` (GATES) are the admission gates the workload may use: it turns
    a random subset of them on (``draw_gate_subset``), with their config
    fields, request fields and events drawn from a generator of their own
    (``GateRequests``); with no gate the workload is the one this seed always
    gave. The gates it turned on are its features (``gate:NAME``).

    ``kv`` (KV_FEATURES) are the KV features it may use, drawn the same way
    on a generator of their own (``kv_rng``, ``draw_kv_subset``,
    ``with_kv``, ``KVRequests``; a hybrid layout's chunked-local group on
    ``chunk_rng``'s); they are among its features as ``kv:NAME``."""
    rng = random.Random(seed)
    config = random_config(rng, dataclasses.replace(CHECK_SPACE, modes=("sync",)))
    modes = tuple(modes)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
    mode_rng = random.Random(f"schedspec-mode-{seed}")
    mode_fields = draw_mode(modes, CHECK_SPACE.spec_tokens, lambda options: mode_rng.choice(options))
    config = with_mode(config, **mode_fields)
    for g in gates:
        if g not in GATES:
            raise ValueError(f"unknown gate {g!r} (choose from {', '.join(GATES)})")
    gated: GateRequests | None = None
    chosen: tuple[str, ...] = ()
    if gates:
        grng = gate_rng(seed)
        chosen = draw_gate_subset(gates, grng)
        config = with_gates(config, chosen, grng)
        gated = GateRequests(config, grng, vocab, pause="pause" in chosen, grammar="grammar" in chosen)
    for k in kv:
        if k not in KV_FEATURES:
            raise ValueError(f"unknown KV feature {k!r} (choose from {', '.join(KV_FEATURES)})")
    kv_requests: KVRequests | None = None
    kv_chosen: tuple[str, ...] = ()
    if kv:
        krng = kv_rng(seed)
        kv_chosen = draw_kv_subset(kv, krng)
        config = with_kv(config, kv_chosen, krng, chunk_rng(seed))
        kv_chosen = kv_of(config)
        kv_requests = KVRequests(config, krng) if config.kv_connector else None
    factory = RequestFactory(rng, config, vocab)

    def make() -> RequestSpec:
        req = factory.make()
        req = req if gated is None else gated.decorate(req)
        return req if kv_requests is None else kv_requests.decorate(req)

    events: list[Event] = []
    live: list[str] = []
    steps = 0
    while steps < num_steps:
        r = rng.random()
        if r < 0.25 or not live:
            for _ in range(rng.choice([1, 1, 2, 4])):
                req = make()
                events.append(AddRequest(req))
                live.append(req.request_id)
        elif r < 0.29:
            victim = rng.choice(live)
            events.append(Abort(victim))
            live.remove(victim)
            if gated is not None:
                gated.forget(victim)
        elif r < 0.31:
            events.append(ResetPrefixCache(rng.random() < 0.3))
        else:
            if gated is not None:
                events.extend(gated.before_step())
            if kv_requests is not None:
                events.extend(kv_requests.before_step())
            if config.async_scheduling and mode_rng.random() < 0.15:
                # schedule(N+1), then an abort or an arrival, then update(N)
                events.append(Schedule())
                if mode_rng.random() < 0.6:
                    victim = mode_rng.choice(live)
                    events.append(Abort(victim))
                    if gated is not None:
                        gated.forget(victim)
                else:
                    req = make()
                    events.append(AddRequest(req))
                events.append(Update())
            else:
                events.append(Step())
            steps += 1
            # Requests finish on their own; forget some so aborts stay likely
            # to name live requests (an abort of a finished one is dropped by
            # the driver).
            if len(live) > 16:
                live = live[-16:]
    if gated is not None:
        events.extend(gated.finish())
    if kv_requests is not None:
        events.extend(kv_requests.finish())
        events = keep_failed_sync_loads_alive(events)
    return Workload(config=config, events=tuple(events), seed=seed,
                    features=tuple(f"gate:{g}" for g in chosen) + tuple(f"kv:{k}" for k in kv_chosen))


# ---------------------------------------------------------------------------
# The admission gates in generated workloads. Every draw here comes from a
# generator of its own (seeded from the workload's seed), so a workload with
# no gate is exactly the one its seed always gave.
# ---------------------------------------------------------------------------


def gate_rng(seed: int | str) -> random.Random:
    """The generator of a workload's gate draws."""
    return random.Random(f"schedspec-gates-{seed}")


def draw_gate_subset(gates: Sequence[str], rng: random.Random) -> tuple[str, ...]:
    """The gates one workload turns on: each of ``gates`` with probability
    0.6 (a workload may draw none), in GATES order."""
    return tuple(g for g in GATES if g in gates and rng.random() < 0.6)


def with_gates(config: SchedulerConfig, gates: Sequence[str], rng: random.Random) -> SchedulerConfig:
    """``config`` with the config fields of ``gates`` drawn so each gate
    binds: max_loras 1 or 2 (the requests use 2 to 4 adapters), a watermark
    of 5% to 30% (the pool grown by the blocks it keeps, so a request of
    max_model_len still fits above it), a prefill cadence of 2 to 4 steps, an
    encoder budget of 2 to 16 embeddings a step with a cache 1 to 4 times as
    large (the requests' inputs never exceed either, so every input fits an
    empty cache and budget, as vLLM's MultiModalBudget makes them). A draw
    the config cannot take leaves that gate off."""
    per_gate: list[dict[str, Any]] = []
    if "lora" in gates:
        per_gate.append({"max_loras": rng.choice((1, 1, 2))})
    if "watermark" in gates:
        w = rng.choice((0.05, 0.1, 0.2, 0.3))
        blocks = config.num_blocks
        while blocks - int(w * blocks) < config.num_blocks:
            blocks += 1
        per_gate.append({"watermark": w, "num_blocks": blocks})
    if "cadence" in gates:
        per_gate.append({"prefill_schedule_interval": rng.choice((2, 3, 4))})
    if "encoder" in gates:
        budget = rng.choice((2, 4, 6, 8, 16))
        per_gate.append({"max_num_encoder_input_tokens": budget, "encoder_cache_size": budget * rng.choice((1, 2, 4))})
    out = config
    for changes in per_gate:
        try:
            out = dataclasses.replace(out, **changes)
        except SchedSpecError:
            continue
    return out


class GateRequests:
    """Adds the gate fields to generated requests, and the gate events to a
    workload: adapters among 2 to 4 LoRA ids; structured outputs whose
    grammar refuses a few tokens, ready after 0 to 5 steps (one compile in
    ten fails); encoder inputs of 1 to 3 images per request from a small pool
    of identifiers (each of a fixed length), so the encoder cache is shared;
    pauses of both kinds, some clearing the cache, each resumed 1 to 8 steps
    later."""

    def __init__(self, config: SchedulerConfig, rng: random.Random, vocab: int,
                 pause: bool = False, grammar: bool = True, focus: Sequence[str] = ()) -> None:
        self.config = config
        self.rng = rng
        self.vocab = vocab
        self.adapters = rng.randint(2, 4)
        self.pause = pause
        self.grammar = grammar
        #: a focus on encoder rules: images in most requests, anywhere in the
        #: prompt; on grammar rules: grammars refusing much of the vocabulary
        self.p_images = 0.9 if any(r.startswith("encoder.") for r in focus) else 0.5
        self.wide_grammars = any(r.startswith("grammar.") for r in focus)
        budget = min(config.max_num_encoder_input_tokens, config.encoder_cache_size)
        self.images: dict[str, int] = {
            f"mm{i}": rng.randint(1, max(1, min(budget, config.max_model_len // 2))) for i in range(4)
        } if budget > 0 else {}
        #: request id -> steps until its GrammarReady
        self.grammar_due: dict[str, int] = {}
        #: steps until the Resume of the pause in force (None: not paused)
        self.resume_in: int | None = None

    def decorate(self, request: RequestSpec) -> RequestSpec:
        """``request`` with gate fields drawn for it."""
        rng = self.rng
        changes: dict[str, Any] = {}
        if self.config.max_loras and rng.random() < 0.75:
            changes["lora_id"] = rng.randint(1, self.adapters)
        if self.grammar and rng.random() < 0.35:
            changes["structured_output"] = True
            if rng.random() < 0.8:
                k = rng.choice((max(1, self.vocab // 4), max(1, self.vocab // 2)) if self.wide_grammars
                               else (1, 2, max(1, self.vocab // 4)))
                changes["grammar_rejects"] = tuple(sorted(rng.sample(range(self.vocab), min(k, self.vocab - 1))))
            self.grammar_due[request.request_id] = rng.choice((0, 0, 1, 2, 3, 5))
        if self.images and rng.random() < self.p_images:
            mm = self._mm_inputs(len(request.prompt_token_ids))
            if mm:
                changes["mm_inputs"] = mm
        if not changes:
            return request
        try:
            return dataclasses.replace(request, **changes)
        except SchedSpecError:
            self.grammar_due.pop(request.request_id, None)
            return request

    def _mm_inputs(self, prompt_len: int) -> tuple[Any, ...]:
        from schedspec.spec.interface import MMInput

        rng = self.rng
        out = []
        dense = self.p_images > 0.5  # a focus on encoder rules: images all along the prompt
        pos = rng.randint(0, max(0, prompt_len // 4 if dense else prompt_len // 3))
        for _ in range(rng.choice((2, 3, 4, 6) if dense else (1, 1, 2, 3))):
            ident = rng.choice(sorted(self.images))
            length = self.images[ident]
            if pos + length > prompt_len:
                break
            out.append(MMInput(pos, length, ident))
            pos += length + rng.choice((0, 1, 2) if dense else (0, 1, 2, self.config.block_size))
        return tuple(out)

    def forget(self, request_id: str) -> None:
        """The request was aborted: no GrammarReady for it."""
        self.grammar_due.pop(request_id, None)

    def before_step(self) -> list[Event]:
        """The gate events due before the next step: grammars compiled,
        a pause resumed or begun."""
        rng = self.rng
        out: list[Event] = []
        for rid in list(self.grammar_due):
            if self.grammar_due[rid] <= 0:
                del self.grammar_due[rid]
                out.append(GrammarReady(rid, ok=rng.random() >= 0.1))
            else:
                self.grammar_due[rid] -= 1
        if self.pause:
            if self.resume_in is not None:
                self.resume_in -= 1
                if self.resume_in <= 0:
                    self.resume_in = None
                    out.append(Resume())
            elif rng.random() < 0.04:
                out.append(Pause(rng.choice(PAUSE_MODES), clear_cache=rng.random() < 0.3))
                self.resume_in = rng.randint(1, 8)
        return out

    def finish(self) -> list[Event]:
        """What ends the workload: the grammars still compiling become
        ready and a pause in force is resumed, so a run to completion can
        finish every request."""
        out: list[Event] = [GrammarReady(rid) for rid in self.grammar_due]
        self.grammar_due.clear()
        if self.resume_in is not None:
            self.resume_in = None
            out.append(Resume())
        return out


# ---------------------------------------------------------------------------
# The KV connector and hybrid KV cache groups in generated workloads. As with
# the gates, every draw comes from a generator of its own (seeded from the
# workload's seed), so a workload with neither is exactly the one its seed
# always gave.
# ---------------------------------------------------------------------------

#: The KV features a workload can turn on: the KV connector (external prefix
#: loads, synchronous and asynchronous, asynchronous saves, the worker's
#: reports) and hybrid KV cache groups (full attention beside sliding-window
#: and chunked-local groups, or a lone sliding-window or chunked-local group).
KV_FEATURES: tuple[str, ...] = ("connector", "hybrid")

#: KV feature -> the capability name (schedspec.check.capabilities) a
#: scheduler declares to take it
KV_CAPABILITIES: Mapping[str, str] = {"connector": "kv_connector", "hybrid": "hybrid_kv"}

#: How often a hybrid layout holds a chunked-local group (draw_kv_groups).
CHUNKED_LOCAL_RATE = 0.5


def parse_kv(text: str) -> tuple[str, ...]:
    """``"connector,hybrid"`` -> ("connector", "hybrid"), in KV_FEATURES
    order; ``"all"`` -> KV_FEATURES, ``"none"`` -> (); a ValueError names an
    unknown feature."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"no KV feature given (choose from {', '.join(KV_FEATURES)}, all or none)")
    if names == ["all"]:
        return KV_FEATURES
    if names == ["none"]:
        return ()
    for name in names:
        if name not in KV_FEATURES:
            extra = " (all and none stand alone)" if name in ("all", "none") else ""
            raise ValueError(f"unknown KV feature {name!r}{extra} (choose from {', '.join(KV_FEATURES)}, all or none)")
    return tuple(k for k in KV_FEATURES if k in names)


def kv_of(config: SchedulerConfig, events: Sequence["Event"] = ()) -> tuple[str, ...]:
    """The KV features a config and its events use, in KV_FEATURES order."""
    on: set[str] = set()
    if config.kv_connector:
        on.add("connector")
    if config.is_hybrid:
        on.add("hybrid")
    for e in events:
        if isinstance(e, KV_EVENTS):
            on.add("connector")
        elif isinstance(e, AddRequest):
            r = e.request
            if r.kv_external_tokens or r.kv_load_async or r.kv_save_async:
                on.add("connector")
    return tuple(k for k in KV_FEATURES if k in on)


def kv_rng(seed: int | str) -> random.Random:
    """The generator of a workload's KV draws."""
    return random.Random(f"schedspec-kv-{seed}")


def chunk_rng(seed: int | str) -> random.Random:
    """The generator of a workload's chunked-local draws (draw_kv_groups),
    apart from kv_rng's so that every other KV draw of a seed stays the one
    it gave before chunked-local groups were drawn."""
    return random.Random(f"schedspec-kv-chunk-{seed}")


def draw_kv_subset(kv: Sequence[str], rng: random.Random) -> tuple[str, ...]:
    """The KV features one workload turns on: each of ``kv`` with
    probability 0.6 (a workload may draw none), in KV_FEATURES order."""
    return tuple(k for k in KV_FEATURES if k in kv and rng.random() < 0.6)


def draw_kv_groups(block_size: int, rng: random.Random, chunks: random.Random | None = None,
                   chunked: bool | None = None) -> tuple[Any, ...]:
    """A hybrid layout: full attention beside one or two sliding-window
    groups, or a lone sliding-window group (at most 3 groups), each window
    1 to 4 blocks long (block-aligned or not), drawn from ``rng``; then, with
    probability CHUNKED_LOCAL_RATE drawn from ``chunks`` (``rng`` when None)
    or when ``chunked`` says so, a chunked-local group of 1 to 4 blocks takes
    the place of the last sliding-window group: full + chunked local, full +
    sliding window + chunked local, a lone chunked-local group, full +
    chunked local + full. Short chunks, so that a few hundred steps free
    blocks before the chunk (ChunkedLocalAttentionManager), and whole
    blocks, as vLLM's chunked local attention backend requires
    (spec/validate.py)."""
    from schedspec.spec.interface import KVCacheGroup

    def window() -> KVCacheGroup:
        return kv_kinds.SLIDING_WINDOW.draw(block_size, rng)

    layout = rng.choice(("full+sw", "full+sw", "full+sw+sw", "sw", "full+sw+full"))
    if layout == "sw":
        groups: tuple[KVCacheGroup, ...] = (window(),)
    elif layout == "full+sw":
        groups = (KVCacheGroup(), window())
    elif layout == "full+sw+sw":
        groups = (KVCacheGroup(), window(), window())
    else:
        groups = (KVCacheGroup(), window(), KVCacheGroup())
    crng = rng if chunks is None else chunks
    if chunked is None:
        chunked = crng.random() < CHUNKED_LOCAL_RATE
    if not chunked:
        return groups
    last = max(g for g, group in enumerate(groups) if kind_of(group).skips)  # the last sliding-window group
    chunk = kv_kinds.CHUNKED_LOCAL.draw(block_size, crng)
    return groups[:last] + (chunk,) + groups[last + 1:]


def with_kv(config: SchedulerConfig, kv: Sequence[str], rng: random.Random,
            chunks: random.Random | None = None, chunked: bool | None = None) -> SchedulerConfig:
    """``config`` with the KV features ``kv``: a connector with either load
    failure policy; hybrid groups (draw_kv_groups, with ``chunks`` and
    ``chunked``) with the pool grown so each group holds what the plain
    layout's one group held. A draw the config cannot take leaves that
    feature off."""
    out = config
    if "connector" in kv:
        try:
            out = dataclasses.replace(out, kv_connector=True,
                                      kv_load_failure_policy=rng.choice(("recompute", "fail")))
        except SchedSpecError:
            pass
    if "hybrid" in kv:
        groups = draw_kv_groups(out.block_size, rng, chunks, chunked)
        try:
            out = dataclasses.replace(out, kv_cache_groups=groups,
                                      num_blocks=1 + (out.num_blocks - 1) * len(groups))
        except SchedSpecError:
            pass
    return out


def keep_failed_sync_loads_alive(events: list[Event]) -> list[Event]:
    """``events`` less the aborts of a request after the worker reported its
    synchronous load failed. Under "recompute", vLLM lets a request that
    shares an invalid block count it computed because the first holder will
    recompute it (scheduler.py, _update_requests_with_invalid_blocks,
    marked_invalid_block_ids); if that holder is aborted first, the other
    reads the invalid KV (a vLLM 0.33 defect, docs/divergences.md, which
    invalid-block-not-computed reports). The generator keeps that holder
    alive so the default check stays on what vLLM computes correctly;
    replayed traces may still hold the combination."""
    sync = {e.request.request_id for e in events if isinstance(e, AddRequest) and not e.request.kv_load_async}
    failed: set[str] = set()
    out: list[Event] = []
    for e in events:
        if isinstance(e, KVLoadFailed) and e.request_id in sync:
            failed.add(e.request_id)
        if isinstance(e, Abort) and e.request_id in failed:
            continue
        out.append(e)
    return out


class KVRequests:
    """Adds the connector's request fields to generated requests, and the
    worker's events to a workload: external prefixes of 0 tokens up to the
    whole prompt (block-aligned or not), loaded synchronously or
    asynchronously, asynchronous saves; load reports (done, or failed as a
    whole or at one block) after 0 to 5 steps or left to the bounded wait,
    saves reported after a few steps or left to it, and aborts soon after an
    asynchronous load starts (aborts during loads)."""

    def __init__(self, config: SchedulerConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        #: (steps until due, event) of the events drawn and not yet emitted
        self.due: list[tuple[int, Event]] = []

    def decorate(self, request: RequestSpec) -> RequestSpec:
        """``request`` with connector fields drawn for it (and its events queued)."""
        if not self.config.kv_connector:
            return request
        rng, bs = self.rng, self.config.block_size
        n = len(request.prompt_token_ids)
        changes: dict[str, Any] = {}
        if rng.random() < 0.7:
            ext = rng.choice((n, n, max(0, n - n % bs), rng.randint(0, n), rng.randint(1, n)))
            # a one-token prompt is never loaded asynchronously: its promotion
            # leaves no token computed, so vLLM asks the stateless connector
            # again and loads it after every report, never finishing
            # (docs/divergences.md): the run would only stall
            asynchronous = rng.random() < 0.5 and n > 1 and self._async_load_can_fit(n)
            if not asynchronous:
                # a synchronous load leaves at least one token to compute
                # (vLLM asserts num_new_tokens > 0; the spec refuses it at add)
                ext = min(ext, n - 1)
            if ext:
                changes["kv_external_tokens"] = ext
                changes["kv_load_async"] = asynchronous
        if rng.random() < 0.4:
            changes["kv_save_async"] = True
        if not changes:
            return request
        try:
            out = dataclasses.replace(request, **changes)
        except SchedSpecError:
            return request
        rid = out.request_id
        if out.kv_external_tokens:
            blocks = -(-out.kv_external_tokens // bs)
            r = rng.random()
            delay = rng.choice((0, 0, 1, 1, 2, 3, 5))
            if out.kv_load_async:
                if r < 0.45:
                    self.due.append((delay, KVLoadDone(rid)))
                elif r < 0.7:
                    index = None if rng.random() < 0.5 else rng.randrange(blocks)
                    if self._rewind_reads_freed_window():
                        index = None
                    self.due.append((delay, KVLoadFailed(rid, index)))
                elif r < 0.8:
                    self.due.append((rng.choice((0, 1, 2)), Abort(rid)))
                # else: the bounded wait reports it
            elif r < 0.3 and not self.config.async_scheduling and not out.mm_inputs \
                    and not self._rewind_reads_freed_window():
                # With async scheduling vLLM never gives back the output
                # placeholder of a request whose output it skipped after a
                # failed synchronous load: later plans carry a -1 that no
                # output fills (docs/divergences.md). The generator leaves
                # that combination out so the default check stays on what a
                # model runner can execute; replayed traces may still hold it.
                # Nor does it fail the synchronous load of a request with
                # encoder inputs: the recompute can rewind it before an input
                # it never encoded while its own later input fills the encoder
                # cache, and vLLM never schedules it again (docs/divergences.md).
                self.due.append((0, KVLoadFailed(rid, rng.choice((None, rng.randrange(blocks))))))
        if out.kv_save_async and rng.random() < 0.5:
            self.due.append((rng.randint(1, 12), KVSaveDone(rid)))
        return out

    def _rewind_reads_freed_window(self) -> bool:
        """Whether a load failure that leaves tokens to recompute after the
        load's first block would rewind the request below blocks a sliding
        window or chunk already nulled: under "recompute" with a skipping
        group (a lone one: invalid blocks with several groups are refused),
        vLLM recomputes those tokens through null blocks (docs/divergences.md,
        "Recompute into a freed sliding window", which group-tables-cover
        reports). The generator then fails asynchronous loads only as a whole
        (their blocks are freed and the request starts again) and fails no
        synchronous load."""
        cfg = self.config
        return cfg.kv_load_failure_policy == "recompute" and any(
            kind_of(g).skips for g in cfg.kv_cache_groups
        )

    def _async_load_can_fit(self, n: int) -> bool:
        """Whether an asynchronous load of a prompt of ``n`` tokens can ever
        be admitted. vLLM admits one only if its blocks fit beside
        ``_spec_decode_step_blocks`` (scheduler.py, schedule(): reserved_blocks
        of a load_kv_async admission), a reservation it makes even with
        nothing running: with speculative decoding, a prompt within that
        reservation of the whole pool waits forever (docs/divergences.md), so
        the generator loads such a prompt synchronously (counted per group,
        without a sliding window's cap: on the safe side)."""
        cfg = self.config
        if not cfg.num_speculative_tokens:
            return True
        bs, groups = cfg.block_size, len(cfg.groups)
        step = 1 + cfg.num_speculative_tokens + cfg.num_lookahead_tokens
        need = groups * (-(-min(n, cfg.max_model_len) // bs) + -(-step // bs))
        return need <= cfg.num_blocks - 1

    def before_step(self) -> list[Event]:
        """The worker's events (and aborts during loads) due before the next step."""
        out: list[Event] = []
        left: list[tuple[int, Event]] = []
        for steps, event in self.due:
            if steps <= 0:
                out.append(event)
            else:
                left.append((steps - 1, event))
        self.due = left
        return out

    def finish(self) -> list[Event]:
        """The events still due at the end (they wait in the worker's queue
        until the run to quiescence delivers or drops them)."""
        out = [e for _, e in self.due]
        self.due = []
        return out
