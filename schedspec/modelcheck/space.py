"""What is explored: request shapes, spaces (one scheduler config each) and
the bounds (small, medium, large) that group them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

from schedspec.check.oracle import ACCEPTANCE_MODES, FakeModel
from schedspec.spec.interface import Policy, RequestSpec, SchedSpecError, SchedulerConfig


class ModelCheckError(SchedSpecError, ValueError):
    """The model checker was asked for something that does not exist (an
    unknown bound or space); the message names it and what does exist."""


@dataclass(frozen=True)
class Shape:
    """A request without an id: what a client sends. ``stop_after`` k > 0 makes
    the k-th token the fake model generates for this prompt a stop token, and
    ``eos_after`` k > 0 makes it the eos token (both resolved per space, since
    they depend on the model's seed and vocab)."""

    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_after: int = 0
    eos_after: int = 0

    def request(self, request_id: str, arrival: int) -> RequestSpec:
        return RequestSpec(
            request_id=request_id,
            prompt_token_ids=self.prompt,
            max_tokens=self.max_tokens,
            priority=self.priority,
            arrival=arrival,
            stop_token_ids=self.stop_token_ids,
            eos_token_id=self.eos_token_id,
            ignore_eos=self.ignore_eos,
            cache_salt=self.cache_salt,
        )

    def describe(self) -> str:
        parts = [f"prompt {list(self.prompt)}", f"max_tokens {self.max_tokens}"]
        if self.priority:
            parts.append(f"priority {self.priority}")
        if self.stop_token_ids:
            parts.append(f"stop {list(self.stop_token_ids)}")
        if self.eos_token_id is not None:
            parts.append(f"eos {self.eos_token_id}" + (" (ignored)" if self.ignore_eos else ""))
        if self.cache_salt:
            parts.append(f"salt {self.cache_salt!r}")
        return f"{self.name}: " + ", ".join(parts)


@dataclass(frozen=True)
class Space:
    """One configuration explored completely: the scheduler config, the
    request shapes, and at most ``max_requests`` requests known to the
    scheduler at a time (unfinished, or finished and not yet reported)."""

    name: str
    config: SchedulerConfig
    shapes: tuple[Shape, ...]
    max_requests: int
    vocab: int = 4
    oracle_seed: int = 0
    #: also explore aborts while a step's plan is in flight ("step, abort #k mid-step")
    abort_in_step: bool = False
    #: how the fake model's drafts fare with speculative decoding on: "all"
    #: or "none" (check/oracle.py; "prefix" hashes the request id, which the
    #: fingerprint renames, so the checker does not offer it)
    acceptance: str = "all"

    def resolved_shapes(self) -> tuple[Shape, ...]:
        """The shapes with ``stop_after`` turned into a concrete stop token."""
        out = []
        for s in self.shapes:
            if s.stop_after > 0:
                toks = generated_tokens(s.prompt, s.stop_after, self.vocab, self.oracle_seed, self.config.block_size)
                s = dataclasses.replace(s, stop_token_ids=s.stop_token_ids + (toks[-1],), stop_after=0)
            if s.eos_after > 0:
                toks = generated_tokens(s.prompt, s.eos_after, self.vocab, self.oracle_seed, self.config.block_size)
                s = dataclasses.replace(s, eos_token_id=toks[-1], eos_after=0)
            out.append(s)
        return tuple(out)

    def model(self) -> FakeModel:
        """A fresh fake model for this space (drafts as the config and ``acceptance`` say)."""
        return FakeModel(self.config.block_size, self.vocab, self.oracle_seed,
                         num_speculative_tokens=self.config.num_speculative_tokens, acceptance=self.acceptance)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config": self.config.to_dict(),
            "shapes": [s.describe() for s in self.resolved_shapes()],
            "max_requests": self.max_requests,
            "vocab": self.vocab,
            "oracle_seed": self.oracle_seed,
            "abort_in_step": self.abort_in_step,
            "acceptance": self.acceptance,
        }


@dataclass(frozen=True)
class Bound:
    name: str
    spaces: tuple[Space, ...]


def generated_tokens(prompt: tuple[int, ...], n: int, vocab: int, seed: int, block_size: int) -> tuple[int, ...]:
    """The first ``n`` tokens the fake model generates for ``prompt`` when the
    scheduler is right (the model then reads back exactly the request's tokens)."""
    model = FakeModel(block_size, vocab, seed)
    toks = list(prompt)
    for _ in range(n):
        toks.append(model.sample_token(tuple(toks)))
    return tuple(toks[len(prompt):])


# Shapes for block size 2 (prompt token ids from a vocabulary of 4):
# A and B share their first block, so one can hit the other's cached block; C
# is A's prompt under a salt (same tokens, another prefix); D is distinct and
# stops on a stop token (its 2nd generated token); E fills exactly one block
# and stops on eos if the model says 0; L is long and of low priority; P is a
# short prompt of high priority (PRIORITY serves the lowest value first and
# preempts the greatest). Generation lengths are small, so requests finish
# within a few steps, yet two requests of A and B outgrow a pool of 4 blocks
# and preempt each other.
_A = Shape("A", (1, 2, 3), 3)
_A2 = Shape("A", (1, 2, 3), 2)
_B = Shape("B", (1, 2, 0, 3), 2, priority=1)
_C = Shape("C", (1, 2, 3), 2, cache_salt="s")
_D = Shape("D", (3,), 3, stop_after=2)
_Dlow = Shape("D", (3,), 3, priority=1, stop_after=2)
_E = Shape("E", (2, 1), 2, eos_token_id=0)
_L = Shape("L", (1, 2, 3, 0, 1), 2, priority=2)
_P = Shape("P", (1, 2), 3)
_Q = Shape("Q", (3,), 3, priority=1)
_Eos = Shape("E", (2, 1), 2, eos_after=1)
_Ps = Shape("P", (1, 2), 2)
_Ds = Shape("D", (3,), 2, stop_after=1)

#: The common config: blocks of 2 tokens, 4 usable blocks (one request of
#: max_model_len 8 fits), 4 tokens per step, 2 running requests.
_BASE: dict[str, Any] = dict(block_size=2, num_blocks=5, max_num_batched_tokens=4, max_num_seqs=2, max_model_len=8)


def _space(name: str, shapes: tuple[Shape, ...], max_requests: int, abort_in_step: bool = False,
           acceptance: str = "all", **overrides: Any) -> Space:
    # The oracle seed also names the acceptance mode in a trace (the fake
    # model takes ACCEPTANCE_MODES[seed % 3] when it is not told), so a
    # counterexample replays with the space's drafts.
    return Space(name, SchedulerConfig(**{**_BASE, **overrides}), shapes, max_requests,
                 oracle_seed=ACCEPTANCE_MODES.index(acceptance), abort_in_step=abort_in_step, acceptance=acceptance)


def _small() -> Bound:
    # A pool of 3 usable blocks (6 tokens) and 3 tokens per step: two requests
    # preempt each other, chunk their prefills and hit each other's prefix.
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    return Bound("small", (
        _space("fcfs-cache-tight", (_A, _B), 2, **tight),
        _space("priority-cache-tight", (_A, _B), 2, policy=Policy.PRIORITY, **tight),
        _space("priority-nocache-threshold", (_A, _Dlow), 2, policy=Policy.PRIORITY,
               enable_prefix_caching=False, long_prefill_token_threshold=2),
        _space("fcfs-cache-salt-tight", (_A2, _C), 2, **tight),
        # The rules the four above leave out (docs/modelcheck.md, "Rule
        # coverage"): a PRIORITY victim ahead of the request that needs a
        # block, already scheduled this step (Q runs ahead of P, P grows into
        # a full pool), and blocks that do not fit without the full-ISL
        # reserve; a head-of-line block with chunked prefill off, eos, and an
        # abort while a step is in flight; a full running queue.
        _space("priority-cache-tight-victim", (_Q, _P), 2, policy=Policy.PRIORITY, scheduler_reserve_full_isl=False,
               **tight),
        _space("fcfs-nochunk-eos-abortstep", (_B, _Eos), 2, abort_in_step=True, enable_chunked_prefill=False,
               num_blocks=4, max_model_len=5, max_num_batched_tokens=5),
        _space("fcfs-seqs1-eos-abortstep", (_A2, _Eos), 2, abort_in_step=True, max_num_seqs=1, **tight),
    ))


def _medium() -> Bound:
    return Bound("medium", (
        *_small().spaces,
        _space("fcfs-cache", (_A, _B), 2),
        _space("fcfs-cache-stop", (_A, _B, _D), 2),
        _space("priority-cache", (_B, _P), 2, policy=Policy.PRIORITY),
        _space("priority-cache-long", (_A, _L), 2, policy=Policy.PRIORITY),
        _space("fcfs-cache-nochunk", (_A, _B), 2, enable_chunked_prefill=False, max_num_batched_tokens=8),
        _space("fcfs-cache-threshold-noreserve", (_A, _B), 2, long_prefill_token_threshold=2,
               scheduler_reserve_full_isl=False),
        _space("fcfs-cache-eos", (_A2, _E), 2),
    ))


def _large() -> Bound:
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    return Bound("large", (
        *_medium().spaces,
        _space("fcfs-cache-3req", (_A, _B), 3),
        _space("priority-cache-3req", (_B, _P), 3, policy=Policy.PRIORITY),
        _space("fcfs-cache-tight-3seqs", (_A, _B), 3, max_num_seqs=3, **tight),
        _space("priority-nocache-threshold-3req", (_A, _Dlow), 3, policy=Policy.PRIORITY,
               enable_prefix_caching=False, long_prefill_token_threshold=2),
    ))


def _modes() -> Bound:
    # Speculative decoding (k drafts per step, every one right or the first
    # one wrong) in the tight pool, where drafts are cut by the budget and
    # by max_model_len and preemption drops them.
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    return Bound("modes", (
        _space("spec1-all-fcfs-tight", (_A, _B), 2, num_speculative_tokens=1, **tight),
        _space("spec1-none-fcfs-tight", (_A, _B), 2, acceptance="none", num_speculative_tokens=1, **tight),
        _space("spec2-all-fcfs-stop", (_A2, _D), 2, abort_in_step=True, num_speculative_tokens=2, **tight),
        _space("spec2-none-priority", (_Q, _P), 2, acceptance="none", num_speculative_tokens=2,
               policy=Policy.PRIORITY, **tight),
        # Async scheduling (one plan in flight while the next is scheduled),
        # without and with drafts: short requests, or the state space of
        # the interleavings grows past a minute.
        _space("async-fcfs-tight-1req", (_A2, _E), 1, async_scheduling=True, **tight),
        _space("async-spec1-all-fcfs-1req", (_Ps, _E), 1, async_scheduling=True, num_speculative_tokens=1, **tight),
        _space("async-spec2-none-fcfs-1req", (_Ps, _Ds), 1, acceptance="none", async_scheduling=True,
               num_speculative_tokens=2, **tight),
    ))


def _modes_large() -> Bound:
    # The async spaces with two requests at a time (about two minutes each).
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    return Bound("modes-large", (
        *_modes().spaces,
        _space("async-fcfs-tight", (_A2, _E), 2, async_scheduling=True, **tight),
        _space("async-spec1-all-fcfs", (_Ps, _E), 2, async_scheduling=True, num_speculative_tokens=1, **tight),
        _space("async-spec2-none-fcfs", (_Ps, _Ds), 2, acceptance="none", async_scheduling=True,
               num_speculative_tokens=2, **tight),
    ))


BOUNDS: dict[str, Callable[[], Bound]] = {"small": _small, "medium": _medium, "large": _large, "modes": _modes,
                                          "modes-large": _modes_large}


def bound(name: str) -> Bound:
    """The bound called ``name``; ModelCheckError naming the known ones otherwise."""
    try:
        return BOUNDS[name]()
    except KeyError:
        raise ModelCheckError(f"unknown bound {name!r} (expected one of {', '.join(BOUNDS)})") from None


def select_spaces(b: Bound, names: Sequence[str] | None) -> tuple[Space, ...]:
    """The spaces of ``b`` named in ``names`` (all of them for None), in the
    bound's order; ModelCheckError on the first name that is not a space of it."""
    if names is None:
        return b.spaces
    known = [s.name for s in b.spaces]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ModelCheckError(f"{unknown[0]!r} is not a space of bound {b.name} (its spaces: {', '.join(known)})")
    return tuple(s for s in b.spaces if s.name in names)
