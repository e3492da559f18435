"""The workload model: what happens to a scheduler, one event at a time.

A workload is a SchedulerConfig plus a sequence of events. Events are plain
frozen values so a workload can be written to a trace and replayed against any
scheduler. A Step event means: ``plan = schedule()``, run the model,
``update(plan, result)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence, TypeVar, Union

from schedspec.spec.interface import Policy, RequestSpec, SchedulerConfig

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


Event = Union[AddRequest, Abort, Step, ResetPrefixCache]


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
        return sum(1 for e in self.events if isinstance(e, Step))

    @property
    def requests(self) -> tuple[RequestSpec, ...]:
        """The requests the workload adds, in order."""
        return tuple(e.request for e in self.events if isinstance(e, AddRequest))

    def arrival_steps(self) -> dict[str, int]:
        """Request id -> the number of steps before it is added."""
        out: dict[str, int] = {}
        steps = 0
        for e in self.events:
            if isinstance(e, Step):
                steps += 1
            elif isinstance(e, AddRequest):
                out[e.request.request_id] = steps
        return out

    def abort_steps(self) -> tuple[tuple[int, str], ...]:
        """(the number of steps before it, request id) of every abort, in order."""
        out: list[tuple[int, str]] = []
        steps = 0
        for e in self.events:
            if isinstance(e, Step):
                steps += 1
            elif isinstance(e, Abort):
                out.append((steps, e.request_id))
        return tuple(out)


def describe_event(event: Event) -> str:
    """One event as a line of a script: ``add(RequestSpec(...))``, ``step()``,
    ``abort('r3')``, ``reset_prefix_cache(reset_running_requests=True)``."""
    if isinstance(event, AddRequest):
        return f"add({event.request!r})"
    if isinstance(event, Abort):
        return f"abort({event.request_id!r})"
    if isinstance(event, Step):
        return "step()"
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
)


class Pick(Protocol):
    """Chooses one of ``options`` (a seeded ``random.Random``'s choice, or a
    Hypothesis draw)."""

    def __call__(self, options: Sequence[_T]) -> _T: ...


def draw_config(space: ConfigSpace, pick: Pick, coin: Callable[[float], bool]) -> SchedulerConfig:
    """A configuration of ``space``, every choice made by ``pick`` and every
    yes/no by ``coin(p)`` (true with probability ``p``), always in this order:
    the seeded workloads and the Hypothesis strategies share this one draw."""
    block_size = pick(space.block_sizes)
    max_model_len = pick(space.max_model_lens)
    extra = pick(space.extra_blocks)
    chunked = coin(space.p_chunked)
    max_num_seqs = pick(space.max_num_seqs)
    budget = pick(space.chunked_budgets if chunked else space.unchunked_extra_budgets)
    threshold = pick(space.thresholds)
    return space.build(
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


def random_workload(seed: int, num_steps: int, vocab: int = 64) -> Workload:
    """A seeded workload of ``num_steps`` steps with arrivals in bursts,
    aborts and occasional prefix-cache resets."""
    rng = random.Random(seed)
    config = random_config(rng)
    factory = RequestFactory(rng, config, vocab)
    events: list[Event] = []
    live: list[str] = []
    steps = 0
    while steps < num_steps:
        r = rng.random()
        if r < 0.25 or not live:
            for _ in range(rng.choice([1, 1, 2, 4])):
                req = factory.make()
                events.append(AddRequest(req))
                live.append(req.request_id)
        elif r < 0.29:
            victim = rng.choice(live)
            events.append(Abort(victim))
            live.remove(victim)
        elif r < 0.31:
            events.append(ResetPrefixCache(rng.random() < 0.3))
        else:
            events.append(Step())
            steps += 1
            # Requests finish on their own; forget some so aborts stay likely
            # to name live requests (an abort of a finished one is dropped by
            # the driver).
            if len(live) > 16:
                live = live[-16:]
    return Workload(config=config, events=tuple(events), seed=seed)
