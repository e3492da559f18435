"""What is explored: request shapes, spaces (one scheduler config each) and
the bounds (small, medium, large) that group them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

from schedspec.check.capabilities import Capabilities
from schedspec.check.oracle import ACCEPTANCE_MODES, FakeModel
from schedspec.check.features import GATES
from schedspec.modelcheck.model import MemoModel
from schedspec.spec.interface import KVCacheGroup, MMInput, Policy, RequestSpec, SchedSpecError, SchedulerConfig


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
    #: the admission gates' request fields (RequestSpec's of these names)
    lora_id: int = 0
    structured_output: bool = False
    grammar_rejects: tuple[int, ...] = ()
    mm_inputs: tuple[MMInput, ...] = ()
    #: the KV connector's request fields (RequestSpec's of these names)
    kv_external_tokens: int = 0
    kv_load_async: bool = False
    kv_save_async: bool = False
    #: a streaming-input session (RequestSpec.resumable), whose ``chunk #k``
    #: events send ``chunk`` with ``chunk_max_tokens`` (modelcheck/sessions.py)
    resumable: bool = False
    chunk: tuple[int, ...] = (1,)
    chunk_max_tokens: int = 1
    #: at most this many requests of this shape known at a time (0: only
    #: the space's ``max_requests`` bounds them)
    max_at_once: int = 0

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
            lora_id=self.lora_id,
            structured_output=self.structured_output,
            grammar_rejects=self.grammar_rejects,
            mm_inputs=self.mm_inputs,
            kv_external_tokens=self.kv_external_tokens,
            kv_load_async=self.kv_load_async,
            kv_save_async=self.kv_save_async,
            resumable=self.resumable,
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
        if self.lora_id:
            parts.append(f"adapter {self.lora_id}")
        if self.structured_output:
            parts.append("grammar" + (f" refusing {list(self.grammar_rejects)}" if self.grammar_rejects else ""))
        for m in self.mm_inputs:
            parts.append(f"encoder input {m.identifier!r} at {m.offset}..{m.offset + m.length - 1}")
        if self.kv_external_tokens:
            parts.append(f"{self.kv_external_tokens} external tokens"
                         + (" loaded asynchronously" if self.kv_load_async else " loaded synchronously"))
        if self.kv_save_async:
            parts.append("saved asynchronously")
        if self.resumable:
            parts.append(f"streaming, chunks {list(self.chunk)} ({self.chunk_max_tokens})")
        if self.max_at_once:
            parts.append(f"at most {self.max_at_once} at a time")
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
    #: also explore the pause events (Pause new / all, with and without a
    #: cache clear, and Resume; the pause gate)
    pauses: bool = False
    #: the KV connector's worker reports at the latest this many steps after
    #: a load starts or a save is first seen pending (the bounded wait; at
    #: most schedspec.check.KV_REPORT_BOUND, so that a counterexample, which
    #: writes each forced report as an explicit event, replays the same)
    kv_report_bound: int = 3
    #: the worker's report events explored with a connector (KV_OPS names;
    #: all of them by default)
    kv_ops: tuple[str, ...] = ()
    #: also explore the prefix-cache resets (reset, reset+running)
    resets: bool = True

    def kv(self) -> tuple[str, ...]:
        """The KV features (check/features.py KV_FEATURES: "connector",
        "hybrid") this space exercises."""
        out = []
        if self.config.kv_connector:
            out.append("connector")
        if self.config.is_hybrid:
            out.append("hybrid")
        return tuple(out)

    def gates(self) -> tuple[str, ...]:
        """The admission gates (check/features.py GATES) this space exercises:
        from its config, its shapes and its events."""
        c = self.config
        on = {
            "lora": c.max_loras > 0,
            "grammar": any(s.structured_output for s in self.shapes),
            "pause": self.pauses,
            "watermark": c.watermark > 0,
            "cadence": c.prefill_schedule_interval > 1,
            "encoder": c.max_num_encoder_input_tokens > 0 or c.encoder_cache_size > 0,
        }
        return tuple(g for g in GATES if on[g])

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
        """A fresh fake model for this space (drafts as the config and
        ``acceptance`` say; "prefix" acceptance keyed on the tokens, see
        model.py)."""
        c = self.config
        return MemoModel(c.block_size, self.vocab, self.oracle_seed, c.num_speculative_tokens, self.acceptance,
                         c.groups if c.is_hybrid else (), rows=c.max_concurrent_batches - 1)

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
            "pauses": self.pauses,
            **({} if self.resets else {"resets": False}),
            "gates": list(self.gates()),
            "kv": list(self.kv()),
            **({"kv_report_bound": self.kv_report_bound} if self.config.kv_connector else {}),
        }


def space_problems(space: Space, caps: Capabilities) -> list[str]:
    """What of ``space`` lies outside a scheduler's declared capabilities:
    its config, its request shapes, and the gate events it explores (pause
    events need the pause capability, grammar reports the structured-output
    one); empty when the scheduler supports all of it."""
    problems = caps.config_problems(space.config)
    for shape in space.resolved_shapes():
        problems += caps.request_problems(shape.request(shape.name, 0))
    if space.pauses and not caps.pause:
        problems.append("pause events (set_pause_state)")
    return problems


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
# S: a streaming-input session sharing A's first block; one chunk [3] (1)
# fits its bound under max_model_len 6, then its end; its prompt then is A1's
_S = Shape("S", (1, 2), 1, resumable=True, chunk=(3,), chunk_max_tokens=1)
_A1 = Shape("A1", (1, 2, 3), 1)
_D = Shape("D", (3,), 3, stop_after=2)
_Dlow = Shape("D", (3,), 3, priority=1, stop_after=2)
_E = Shape("E", (2, 1), 2, eos_token_id=0)
_L = Shape("L", (1, 2, 3, 0, 1), 2, priority=2)
_P = Shape("P", (1, 2), 3)
_Q = Shape("Q", (3,), 3, priority=1)
_Eos = Shape("E", (2, 1), 2, eos_after=1)
_Ps = Shape("P", (1, 2), 2)
_Ds = Shape("D", (3,), 2, stop_after=1)
# Three running requests, one of each shape at a time (no caching: the
# prompts only set lengths): Q, of low priority, runs first; P's decode
# needs a block the full pool lacks a step after R was admitted with one
# token of its four, so P preempts Q, already scheduled, and R's chunk takes
# the budget Q gave back.
_Qg = dataclasses.replace(_Q, max_at_once=1)
_Pg = dataclasses.replace(_Ps, max_at_once=1)
_Rg = Shape("R", (1, 2, 0, 3), 1, max_at_once=1)

#: The common config: blocks of 2 tokens, 4 usable blocks (one request of
#: max_model_len 8 fits), 4 tokens per step, 2 running requests.
_BASE: dict[str, Any] = dict(block_size=2, num_blocks=5, max_num_batched_tokens=4, max_num_seqs=2, max_model_len=8)


def _space(name: str, shapes: tuple[Shape, ...], max_requests: int, abort_in_step: bool = False,
           acceptance: str = "all", pauses: bool = False, kv_report_bound: int = 3, kv_ops: tuple[str, ...] = (),
           resets: bool = True, **overrides: Any) -> Space:
    # The oracle seed also names the acceptance mode in a trace (the fake
    # model takes ACCEPTANCE_MODES[seed % 3] when it is not told), so a
    # counterexample replays with the space's drafts.
    return Space(name, SchedulerConfig(**{**_BASE, **overrides}), shapes, max_requests,
                 oracle_seed=ACCEPTANCE_MODES.index(acceptance), abort_in_step=abort_in_step, acceptance=acceptance,
                 pauses=pauses, kv_report_bound=kv_report_bound, kv_ops=kv_ops, resets=resets)


def _small() -> Bound:
    # A pool of 3 usable blocks (6 tokens) and 3 tokens per step: two requests
    # preempt each other, chunk their prefills and hit each other's prefix.
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    conn: dict[str, Any] = dict(tight, kv_connector=True, kv_report_bound=2)
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
        # a streaming-input session: its chunk and end at any time (while it
        # waits, runs or waits for input), with resets and aborts
        _space("fcfs-cache-stream-1req", (_S, _A1), 1, max_model_len=6),
        # a victim's budget given back and used by a later running request
        # (effect.returned_budget_scheduled): without caching a reset only
        # preempts everything, which the spaces above explore, so none here
        _space("priority-nocache-3seqs-giveback", (_Qg, _Pg, _Rg), 3, policy=Policy.PRIORITY, resets=False,
               enable_prefix_caching=False, scheduler_reserve_full_isl=False, max_num_seqs=3, max_model_len=6),
        # One space per KV and gate path where one situation decides, each
        # at its least (one request of a shape at a time, no resets; a
        # few thousand states): two asynchronous loads of one prompt, the
        # second waiting for the blocks the first's in-flight prefill
        # reserves (_async_load_reserve); a loaded request in
        # kv_holding_waiting passed over by the encoder budget another
        # request's image took; a synchronous load failing under policy
        # "fail" in the step a grammar fails; a Mamba group first (Jamba,
        # Nemotron-H) whose state blocks retire as one request decodes.
        _space("conn-async-2loads", (_KW,), 2, kv_load_failure_policy="fail", kv_ops=("done",), **conn),
        _space("conn-encoder-passed-over", (_X1, _XK), 2, max_num_encoder_input_tokens=2, encoder_cache_size=4,
               kv_load_failure_policy="fail", kv_ops=("done",), resets=False, **conn),
        _space("conn-grammar-syncfail", (_G1, _KS1), 2, kv_load_failure_policy="fail", kv_ops=("sync-failed@0",),
               resets=False, **conn),
        _space("mamba-first-1req", (_A,), 1, kv_cache_groups=(KVCacheGroup("mamba"), KVCacheGroup()), resets=False,
               **dict(tight, num_blocks=8)),
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
        # a session beside another request (the admission count of sessions
        # waiting for input); each needs at most 2 of the 4 usable blocks, so
        # a session waiting for input never holds what the other needs
        # (stream-liveness, docs/divergences.md)
        _space("fcfs-nocache-stream", (_S, _A1), 2, max_model_len=6, enable_prefix_caching=False),
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
        # "prefix" acceptance (0 .. k drafts right, a hash of the tokens the
        # drafts follow: model.py), sync and async; and a request whose
        # max_tokens outruns max_model_len, so that with its output in
        # flight at position max_model_len - 1 a step has no token for it
        # (the RUNNING loop's skip of a request with nothing to compute).
        _space("spec2-prefix-fcfs-tight", (_A2, _D), 2, acceptance="prefix", num_speculative_tokens=2, **tight),
        _space("async-spec2-prefix-fcfs-1req", (_A, _D), 1, acceptance="prefix", async_scheduling=True,
               num_speculative_tokens=2, **tight),
        _space("async-long-1req", (_Z,), 1, async_scheduling=True, **tight),
    ))


# Shapes of the admission gates (block size 2, vocabulary 4): LA and LB are
# one prompt under two LoRA adapters (never sharing a block; two LA share);
# G waits for its grammar, which refuses token 0; Gs refuses 3, which a
# draft made wrong on purpose often is (and the sampler never is); M and X
# carry encoder inputs: M one image twice, at prompt positions 1 and 2 (the
# second a duplicate of the first in one step), X two images at
# 0-1 and 2-3, so that a budget of 2 embeddings cuts X's chunk before its
# second one and a request ahead in the running queue can take the budget
# from X's next chunk (two M, or two X, share their cache entries and
# blocks; an M and an X share neither); Z asks for more tokens than
# max_model_len leaves it, so an async step in flight can leave it no token
# to schedule; K is a prompt no other shape shares a block with, long
# enough to be chunked while E decodes (so the cadence holds a running chunk).
_LA = Shape("LA", (1, 2, 3), 2, lora_id=1)
_LB = Shape("LB", (1, 2, 3), 2, lora_id=2)
_G = Shape("G", (1, 2), 2, structured_output=True, grammar_rejects=(0,))
_Gs = Shape("G", (1, 2), 3, structured_output=True, grammar_rejects=(3,))
_M = Shape("M", (1, 2, 3, 0), 2, mm_inputs=(MMInput(1, 1, "img-m"), MMInput(2, 1, "img-m")))
_X = Shape("X", (1, 2, 3, 0), 1, mm_inputs=(MMInput(0, 2, "img-a"), MMInput(2, 2, "img-b")))
_Z = Shape("Z", (1, 2, 3), 4)
_K = Shape("K", (0, 1, 3, 2), 2)


def _gates() -> Bound:
    # One space per gate (two for the watermark: with and without the
    # full-sequence reserve; two for pause: sync and async; two for
    # structured outputs: grammar reports, and refused drafts), each in the
    # tight pool where the gate binds: the watermark keeps 1 of 4 blocks; the
    # prefill cadence of 2 holds prompts while a request decodes; pause and
    # resume (new / all, with and without the cache clear) come at any
    # point; one adapter per step for two; grammars compile or fail at any
    # point; the encoder budget and cache hold one image of 2 embeddings.
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    return Bound("gates", (
        _space("fcfs-watermark-tight", (_A2, _E), 2, watermark=0.25, **tight),
        _space("fcfs-watermark-noreserve", (_A, _B), 2, watermark=0.25, scheduler_reserve_full_isl=False, **tight),
        _space("fcfs-cadence2-tight", (_E, _K), 2, prefill_schedule_interval=2, **tight),
        _space("fcfs-pause-tight", (_A2,), 2, pauses=True, **tight),
        _space("async-pause-1req", (_Ps,), 1, pauses=True, async_scheduling=True, **tight),
        _space("lora1-2adapters-tight", (_LA, _LB), 2, max_loras=1, **tight),
        _space("fcfs-grammar-tight", (_G, _A2), 2, **tight),
        _space("spec2-grammar-prefix", (_Gs, _D), 2, acceptance="prefix", num_speculative_tokens=2, **tight),
        _space("fcfs-encoder-tight", (_X, _M), 2, max_num_encoder_input_tokens=2, encoder_cache_size=2, **tight),
    ))


# GL is G's prompt under adapter 1 with a grammar: one request through the
# LoRA, grammar and watermark gates at once.
_GL = Shape("GL", (1, 2), 2, lora_id=1, structured_output=True, grammar_rejects=(0,))


def _gates_large() -> Bound:
    # The gates together, as users run them: every config gate on with two
    # requests (no pause events), every gate with pause events and one
    # request, and every gate but the encoder with two (about a minute).
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    every: dict[str, Any] = dict(max_loras=1, watermark=0.25, prefill_schedule_interval=2,
                                 max_num_encoder_input_tokens=2, encoder_cache_size=2, **tight)
    return Bound("gates-large", (
        *_gates().spaces,
        _space("gates-all-nopause", (_GL, _X), 2, **every),
        _space("gates-all-1req", (_LA, _GL, _X), 1, pauses=True, **every),
        _space("gates-noencoder", (_LA, _GL), 2, pauses=True, max_loras=1, watermark=0.25,
               prefill_schedule_interval=2, **tight),
    ))


# Shapes of the KV connector (block size 2): KS's first block is in the
# connector's store and loads synchronously in the step that admits it; KW
# has 3 external tokens (blocks 0 and 1) loaded asynchronously (the request
# waits in WAITING_FOR_REMOTE_KVS); KV is saved asynchronously (its blocks
# stay held after it finishes until the worker reports the save); KB loads
# A's first block asynchronously and is saved too.
_KS = Shape("KS", (1, 2, 3), 2, kv_external_tokens=2)
_KW = Shape("KW", (1, 2, 0, 3), 2, kv_external_tokens=3, kv_load_async=True)
_KV = Shape("KV", (2, 1), 2, kv_save_async=True)
_KB = Shape("KB", (1, 2, 3), 2, kv_external_tokens=2, kv_load_async=True, kv_save_async=True)
_KWh = Shape("KW", (1, 2, 0), 1, kv_external_tokens=2, kv_load_async=True, kv_save_async=True)
_KSh = Shape("KS", (1, 2, 3), 1, kv_external_tokens=2)
# The small bound's one-at-a-time shapes: XK loads its first block
# asynchronously and has an image at prompt positions 2-3, behind X's two.
_XK = Shape("XK", (1, 2, 3, 0), 1, mm_inputs=(MMInput(2, 2, "img-c"),), kv_external_tokens=2, kv_load_async=True,
            max_at_once=1)
_X1 = dataclasses.replace(_X, max_at_once=1)
_G1 = dataclasses.replace(_G, max_at_once=1)
_KS1 = dataclasses.replace(_KS, max_at_once=1)


def _full_sw(window: int) -> tuple[KVCacheGroup, ...]:
    return (KVCacheGroup(), KVCacheGroup("sliding_window", window))


def _full_cl(chunk: int) -> tuple[KVCacheGroup, ...]:
    return (KVCacheGroup(), KVCacheGroup("chunked_local", attention_chunk_size=chunk))


def _connector() -> Bound:
    # The KV connector (sync scheduling), both failure policies: loads
    # synchronous and asynchronous, done, failed whole or at a block, aborts
    # during a load and a save, saves done, and the bounded wait's forced
    # reports (2 steps), in the tight pool (3 usable blocks, max_model_len
    # 6, 3 tokens a step). Each space explores some of the worker's reports.
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3, kv_connector=True,
                                 kv_report_bound=2)
    return Bound("connector", (
        _space("conn-async-fail", (_KW, _KV), 2, kv_load_failure_policy="fail",
               kv_ops=("done", "failed", "failed@1", "save"), **tight),
        # under "recompute" a load failing from its first block frees the
        # request's blocks yet leaves it in _inflight_prefills, whose
        # reservation then counts against its own retry: in this pool it is
        # never admitted again (vLLM 0.33, docs/modelcheck.md, "A livelock");
        # so this space fails loads only from block 1 (bound kv-livelock
        # holds the livelock)
        _space("conn-async-recompute", (_KW, _KV), 2, kv_load_failure_policy="recompute",
               kv_ops=("done", "failed@1", "save"), **tight),
        _space("conn-sync-recompute", (_KS, _A2), 2, kv_load_failure_policy="recompute",
               kv_ops=("sync-failed@0",), **tight),
        _space("conn-sync-fail", (_KS, _KB), 2, kv_load_failure_policy="fail",
               kv_ops=("done", "failed", "save", "sync-failed@0"), **tight),
    ))


def _kv_livelock() -> Bound:
    # vLLM 0.33's livelock under "recompute" (see _connector): one request,
    # its asynchronous load failing whole; the step-only run never admits it
    # again (a deadlock finding, by design).
    return Bound("kv-livelock", (
        _space("conn-recompute-livelock", (_KW,), 1, kv_load_failure_policy="recompute", kv_ops=("failed",),
               num_blocks=4, max_model_len=6, max_num_batched_tokens=3, kv_connector=True, kv_report_bound=2),
    ))


def _hybrid() -> Bound:
    # Hybrid KV cache groups: full attention beside a sliding window of 1
    # block (2 tokens) or 2 blocks (4 tokens), and a lone sliding-window
    # group, with prefix caching, in the least pool vLLM's start-up check
    # accepts (one request of max_model_len in every group at once): hits
    # valid in every group, blocks out of the window freed
    # (remove_skipped_blocks), the null block in tables, preemption. Two
    # groups double the blocks, so max_model_len is 4 there (A2 is then
    # capped by it).
    #
    # Chunked-local groups (chunks of 1 block, the least vLLM's backend
    # takes): beside full attention in the least pool (2 blocks a request in
    # each group), a hit's blocks before the chunk null, the chunk's blocks
    # freed as it passes; a lone chunked-local group, whose hit on an empty
    # cache already skips to the prompt's last chunk, with 2 tokens a step so
    # that the full-sequence gate counts it at its admission cap (3 blocks
    # for a sequence, 2 for one chunk and a step in flight).
    short: dict[str, Any] = dict(max_model_len=4, max_num_batched_tokens=3)
    return Bound("hybrid", (
        _space("hyb-full-sw2", (_A2, _Ps), 2, kv_cache_groups=_full_sw(2), num_blocks=6, **short),
        _space("hyb-full-sw4", (_A2, _Ps), 2, kv_cache_groups=_full_sw(4), num_blocks=6, **short),
        _space("hyb-sw2-alone", (_A2, _B), 2, kv_cache_groups=(KVCacheGroup("sliding_window", 2),), num_blocks=4,
               max_model_len=6, max_num_batched_tokens=3),
        _space("hyb-full-cl2", (_A2, _Ps), 2, kv_cache_groups=_full_cl(2), num_blocks=5, **short),
        _space("hyb-cl2-alone", (_A2, _B), 2, kv_cache_groups=(KVCacheGroup("chunked_local", attention_chunk_size=2),),
               num_blocks=4, max_model_len=6, max_num_batched_tokens=2),
    ))


def _connector_hybrid() -> Bound:
    # The connector with hybrid groups (full + sliding window of 1 block):
    # loads write every group's blocks; a failure is the whole load's (vLLM
    # raises on invalid_block_ids with more than one group). One request at
    # a time: KWh and KSh fit max_model_len 4.
    short: dict[str, Any] = dict(max_model_len=4, max_num_batched_tokens=3, kv_connector=True, kv_report_bound=2)
    return Bound("connector-hybrid", (
        _space("conn-hyb-async-fail", (_KWh, _KV), 1, kv_load_failure_policy="fail",
               kv_cache_groups=_full_sw(2), num_blocks=6, **short),
        _space("conn-hyb-sync-recompute", (_KSh, _KV), 1, kv_load_failure_policy="recompute",
               kv_cache_groups=_full_sw(2), num_blocks=6, **short),
    ))


def _mamba() -> Bound:
    # A Mamba group in "align" mode (spec/mamba.py) beside full attention,
    # in the least pool vLLM's start-up check accepts: state blocks
    # checkpointed at block boundaries, the prefill chunk split on the state
    # grid (Scheduler._mamba_block_aligned_split), hits only at a
    # checkpointed length, aborts; one request at a time (two
    # together exceed a short run: over 39,000 states at depth 17, as does a
    # sliding window beside).
    short: dict[str, Any] = dict(max_model_len=4, max_num_batched_tokens=3)
    return Bound("hybrid-mamba", (
        _space("mamba-full", (_A2, _Ps), 1, kv_cache_groups=(KVCacheGroup(), KVCacheGroup("mamba")), num_blocks=6,
               **short),
    ))


def _pipeline() -> Bound:
    # k plans in flight (config.max_concurrent_batches; check/pipeline.py),
    # in the tight pool: the plain Scheduler pipelined (k = 2: a decode
    # waits for its token in flight while a prefill chunk runs on); async
    # scheduling under the V2 runner with a pipeline of 2 (k = 3: the decode
    # throttle, and a preempted request's output still in flight passed over
    # by the WAITING loop, out of reach with k = 2); V2 with a draft model
    # (k = 2: the plan's skip_drafts). Two requests only of the shortest
    # shapes, else a space outgrows a minute.
    tight: dict[str, Any] = dict(num_blocks=4, max_model_len=6, max_num_batched_tokens=3)
    v2: dict[str, Any] = dict(async_scheduling=True, model_runner="v2", **tight)
    return Bound("pipeline", (
        _space("pp2-fcfs-tight-1req", (_A2, _E), 1, pipeline_parallel_size=2, **tight),
        _space("pp2-fcfs-stop-2req", (_Ds,), 2, pipeline_parallel_size=2, **tight),
        _space("v2-pp2-async-1req", (_Ps, _E), 1, pipeline_parallel_size=2, **v2),
        # 2 usable blocks: the second P preempts the first, whose output is in flight
        _space("v2-pp2-async-small-2req", (_Ps,), 2, pipeline_parallel_size=2, resets=False, async_scheduling=True,
               model_runner="v2", num_blocks=3, max_model_len=4, max_num_batched_tokens=3),
        _space("v2-async-draft-spec1-1req", (_Ps, _E), 1, drafter="draft_model", num_speculative_tokens=1, **v2),
    ))


BOUNDS: dict[str, Callable[[], Bound]] = {"small": _small, "medium": _medium, "large": _large, "modes": _modes,
                                          "modes-large": _modes_large, "gates": _gates, "gates-large": _gates_large,
                                          "connector": _connector, "hybrid": _hybrid,
                                          "connector-hybrid": _connector_hybrid, "kv-livelock": _kv_livelock,
                                          "hybrid-mamba": _mamba, "pipeline": _pipeline}


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
