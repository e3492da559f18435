"""Hypothesis strategies for schedulers: configurations, prefixes, requests.

``configs(space)`` draws from a ``schedspec.check.config_space.ConfigSpace``, the
one place that says what small configurations look like (the seeded random
workloads of ``schedspec check`` draw from one too). ``requests`` draws one
arrival rich in shared prefixes, salts, stop and eos tokens. Both take a
``capabilities`` (schedspec.check.capabilities.Capabilities) and draw only
within it.

The admission gates a declaration supports are drawn too: ``configs`` turns
a subset of them on (``gate_plans`` gives the config and the
GateRequests that adds the gates' request fields), with every choice made
through a Hypothesis-controlled random generator, so it shrinks. So are
the KV features it supports (``kv_plans``: a connector with either failure
policy, hybrid KV cache groups, and the KVRequests that adds the connector's
request fields).

``declared_values(cls, name)`` draws any value one field of the interface
accepts on its own, read from the field's declaration (its type and its
bounds, spec/validate.py): the same declaration validation and the trace
schema read.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Sequence, TypeVar

from hypothesis import strategies as st

from schedspec.check.capabilities import FULL, Capabilities
from schedspec.check.config_space import MACHINE_SPACE, ConfigSpace, draw_config
from schedspec.check.gate_requests import GateRequests, draw_gate_subset, with_gates
from schedspec.check.kv_requests import KVRequests, draw_kv_subset, with_kv
from schedspec.spec.interface import Policy, RequestSpec, SchedulerConfig
from schedspec.spec.validate import Declaration, declared

_T = TypeVar("_T")

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
def configs(
    draw: st.DrawFn, space: ConfigSpace = MACHINE_SPACE, capabilities: Capabilities = FULL
) -> SchedulerConfig:
    """A configuration of ``space``: small and tight, every mechanism likely;
    within ``capabilities``."""

    def pick(options: Sequence[_T]) -> _T:
        return draw(st.sampled_from(options))

    config = capabilities.restrict_config(draw_config(space, pick, lambda p: draw(flags(p))))
    if capabilities.gates():
        config = draw(gate_plans(config, capabilities))[0]
    if capabilities.kv():
        config = draw(kv_plans(config, capabilities))[0]
    return config


@st.composite
def kv_plans(
    draw: st.DrawFn, config: SchedulerConfig, capabilities: Capabilities
) -> tuple[SchedulerConfig, KVRequests | None]:
    """``config`` with a subset of the KV features ``capabilities`` supports
    turned on (schedspec.check.kv_requests.with_kv: a connector with either
    load-failure policy, hybrid groups), and the KVRequests that decorates
    requests with the connector's fields (None without a connector)."""
    rng = draw(st.randoms(use_true_random=False), label="kv draws")
    kv = draw_kv_subset(capabilities.kv(), rng)
    out = with_kv(config, kv, rng)
    return out, (KVRequests(out, rng) if out.kv_connector else None)


@st.composite
def gate_plans(
    draw: st.DrawFn, config: SchedulerConfig, capabilities: Capabilities, vocab: int = VOCAB
) -> tuple[SchedulerConfig, GateRequests]:
    """``config`` with a subset of the admission gates ``capabilities``
    supports turned on (schedspec.check.gate_requests.with_gates; one it
    declares ALWAYS in every subset), and the
    GateRequests that decorates requests with the gates' fields (adapters,
    structured outputs, encoder inputs); () gates: ``config`` as it is."""
    rng = draw(st.randoms(use_true_random=False), label="gate draws")
    gates = draw_gate_subset(capabilities.gates(), rng, capabilities.always_gates())
    gated = with_gates(config, gates, rng)
    return gated, GateRequests(gated, rng, vocab, pause="pause" in gates, grammar="grammar" in gates)



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
    capabilities: Capabilities = FULL,
) -> RequestSpec:
    """One arrival: often a shared prefix plus a tail, sometimes long."""
    use_prefix = draw(st.sampled_from([True, True, True, False]), label="shared prefix")
    prefix = draw(st.sampled_from(list(shared))) if use_prefix and shared else ()
    tail = draw(st.lists(st.integers(0, alphabet - 1), min_size=0, max_size=14))
    prompt = (prefix + tuple(tail))[: max_model_len - 1] or (0,)
    return capabilities.restrict_request(RequestSpec(
        request_id=request_id,
        prompt_token_ids=prompt,
        max_tokens=draw(st.sampled_from([1, 3, 5, 8, 30, 30])),
        priority=draw(st.integers(0, 2)),
        arrival=arrival,
        stop_token_ids=tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=1))),
        eos_token_id=draw(st.none() | st.integers(0, vocab - 1)),
        ignore_eos=draw(st.booleans()),
        cache_salt=draw(st.sampled_from([None, None, None, "a"])),
    ))


def declared_values(cls: type, name: str, *, max_items: int = 4) -> st.SearchStrategy[Any]:
    """Any value field ``name`` of dataclass ``cls`` accepts on its own: its
    declared type within its declared bounds (token ids >= 0; a tuple of
    dataclasses empty, as their items obey rules between fields), shrinking
    toward the lower bound. A rule between fields may still refuse it."""
    kind, d = next((k, d) for n, k, d in declared(cls) if n == name)
    return _values(kind, d, max_items)


def _values(kind: Any, d: Declaration, max_items: int) -> st.SearchStrategy[Any]:
    if kind is bool:
        return st.booleans()
    if kind is int:
        return st.integers(_int_or_none(d.minimum), d.maximum)
    if kind is float:
        return st.floats(d.minimum, d.below, exclude_max=d.below is not None, allow_nan=False)
    if kind is str:
        return st.sampled_from(d.choices) if d.choices else st.text(min_size=d.min_length)
    if kind == str | None or kind == int | None:
        return st.none() | _values(typing.get_args(kind)[0], d, max_items)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return st.sampled_from(list(kind))
    if kind == tuple[int, ...]:
        return st.lists(st.integers(0), min_size=d.min_items, max_size=max(d.min_items, max_items)).map(tuple)
    item = typing.get_args(kind)[0]
    if typing.get_origin(kind) is tuple and dataclasses.is_dataclass(item) and not d.min_items:
        return st.just(())
    raise TypeError(f"no strategy for a field of type {kind!r}")


def _int_or_none(bound: int | float | None) -> int | None:
    return None if bound is None else int(bound)
