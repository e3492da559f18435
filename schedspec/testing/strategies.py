"""Hypothesis strategies for schedulers: configurations, prefixes, requests.

``configs(space)`` draws from a ``schedspec.check.workload.ConfigSpace``, the
one place that says what small configurations look like (the seeded random
workloads of ``schedspec check`` draw from one too). ``requests`` draws one
arrival rich in shared prefixes, salts, stop and eos tokens.
"""

from __future__ import annotations

from typing import Sequence

from hypothesis import strategies as st

from schedspec.check.workload import MACHINE_SPACE, ConfigSpace
from schedspec.spec.interface import Policy, RequestSpec, SchedulerConfig

#: Sampled token ids of the state machine's fake model.
VOCAB = 24
#: Prompt tokens: a tiny alphabet makes accidental sharing common too.
ALPHABET = 4


def flags(p: float) -> st.SearchStrategy[bool]:
    """True with about probability ``p``; shrinks toward True when p > 1/2."""
    if p == 0.5:
        return st.booleans()
    if p <= 0.0 or p >= 1.0:
        return st.just(p >= 1.0)
    return st.integers(0, 99).map(lambda k: (k < round(p * 100)) if p > 0.5 else (k >= 100 - round(p * 100)))


@st.composite
def configs(draw: st.DrawFn, space: ConfigSpace = MACHINE_SPACE) -> SchedulerConfig:
    """A configuration of ``space``: small and tight, every mechanism likely."""
    block_size = draw(st.sampled_from(space.block_sizes))
    max_model_len = draw(st.sampled_from(space.max_model_lens))
    extra = draw(st.sampled_from(space.extra_blocks))
    chunked = draw(flags(space.p_chunked))
    max_num_seqs = draw(st.sampled_from(space.max_num_seqs))
    budget = draw(st.sampled_from(space.chunked_budgets if chunked else space.unchunked_extra_budgets))
    threshold = draw(st.sampled_from(space.thresholds))
    return space.build(
        block_size=block_size,
        max_model_len=max_model_len,
        extra_blocks=extra,
        chunked=chunked,
        max_num_seqs=max_num_seqs,
        budget=budget,
        threshold=threshold,
        prefix_caching=draw(flags(space.p_prefix_caching)),
        policy=draw(st.sampled_from([Policy.FCFS, Policy.PRIORITY])),
        reserve_full_isl=draw(flags(space.p_reserve_full_isl)),
    )


def prefixes(alphabet: int = ALPHABET) -> st.SearchStrategy[list[tuple[int, ...]]]:
    """One to three shared prompt prefixes of 4 to 12 tokens."""
    return st.lists(
        st.lists(st.integers(0, alphabet - 1), min_size=4, max_size=12).map(tuple), min_size=1, max_size=3
    )


@st.composite
def requests(
    draw: st.DrawFn,
    request_id: str,
    arrival: int,
    max_model_len: int,
    shared: Sequence[tuple[int, ...]],
    *,
    alphabet: int = ALPHABET,
    vocab: int = VOCAB,
) -> RequestSpec:
    """One arrival: often a shared prefix plus a tail, sometimes long."""
    use_prefix = draw(st.sampled_from([True, True, True, False]), label="shared prefix")
    prefix = draw(st.sampled_from(list(shared))) if use_prefix and shared else ()
    tail = draw(st.lists(st.integers(0, alphabet - 1), min_size=0, max_size=14))
    prompt = (prefix + tuple(tail))[: max_model_len - 1] or (0,)
    return RequestSpec(
        request_id=request_id,
        prompt_token_ids=prompt,
        max_tokens=draw(st.sampled_from([1, 3, 5, 8, 30, 30])),
        priority=draw(st.integers(0, 2)),
        arrival=arrival,
        stop_token_ids=tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=1))),
        eos_token_id=draw(st.none() | st.integers(0, vocab - 1)),
        ignore_eos=draw(st.booleans()),
        cache_salt=draw(st.sampled_from([None, None, None, "a"])),
    )
