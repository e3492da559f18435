"""The admission gates in generated workloads: which gates a workload turns
on, the config fields that make each one bind, and GateRequests, which adds
the gate fields to generated requests and the gate events (grammars
compiled, pauses and resumes) to a workload. Every draw here comes from a
generator of its own (seeded from the workload's seed), so a workload with
no gate is exactly the one its seed always gave."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

from schedspec.spec.interface import RequestSpec, SchedSpecError, SchedulerConfig

from schedspec.check.features import GATES
from schedspec.check.workload import PAUSE_MODES, Event, GrammarReady, Pause, Resume


def gate_rng(seed: int | str) -> random.Random:
    """The generator of a workload's gate draws."""
    return random.Random(f"schedspec-gates-{seed}")


def draw_gate_subset(gates: Sequence[str], rng: random.Random, always: Sequence[str] = ()) -> tuple[str, ...]:
    """The gates one workload turns on: each of ``gates`` with probability
    0.6 (a workload may draw none), and each of ``always`` (the gates a
    scheduler declares ALWAYS, capabilities.Capabilities.always_gates) that
    ``gates`` holds whatever the draw, in GATES order. ``always`` takes the
    same draws from ``rng``, so the other gates are drawn as without it."""
    return tuple(g for g in GATES if g in gates and (rng.random() < 0.6 or g in always))


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
