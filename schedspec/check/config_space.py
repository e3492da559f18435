"""The space of small configurations the generators draw from: every choice
a generator of configurations makes, in one place (ConfigSpace), the spaces
of the check, the Hypothesis state machine and the lockstep test, and the
one draw they all share (``draw_config``, ``random_config``), the mode
drawn last (``draw_mode``, ``with_mode``)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, TypeVar

from schedspec.spec.interface import Policy, SchedulerConfig

from schedspec.check.features import MODES

_T = TypeVar("_T")


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
