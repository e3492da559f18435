"""Workloads that reach every rule of the spec: swarm testing, aimed by the
rule counts of the run so far.

``guided_workload(seed, steps, focus=...)`` builds one seeded workload:

- swarm testing: each workload turns on a random subset of FEATURES (aborts,
  resets, priorities, a tight pool, no chunking, shared prefixes, duplicate
  prompts, stop tokens...), so no feature crowds out the branches another one
  hides: a tight pool with priorities and better-priority late arrivals makes
  the rare preemption paths common, a run without chunking makes the
  head-of-line block by budget reachable;
- focus: the rules (spec/rule_names.py) the workload should aim at; their
  hints (RULE_HINTS) turn the features they need on and the ones that would
  hide them off;
- state-aware events: the generator runs the spec as it writes the events,
  so an abort can name a request that is waiting, running or preempted right
  then, and a reset can come when the pool is idle. The workload is still a
  plain list of events, replayable against any scheduler.

``choose_focus(counts, seed)`` picks the focus from a run's counts: rules never
reached first, then the rarest (fewer than ``goal``), the choice seeded, never
two that one workload cannot hold together (``focus_conflict``). The
gate (gate.py) calls it before each workload, so the run's workloads depend
only on its first seed, its shard and its step goal: the same run gives the
same counts.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Mapping, Sequence

from schedspec.check.driver import Runner
from schedspec.check.config_space import CHECK_SPACE
from schedspec.check.defects import keep_failed_sync_loads_alive
from schedspec.check.engine_draw import draw_sessions, engine_features, engine_rng, needs, with_engine
from schedspec.check.features import GATE_CAPABILITIES, GATES, KV_CAPABILITIES, KV_FEATURES, kv_of
from schedspec.check.gate_requests import GateRequests, draw_gate_subset, gate_rng, with_gates
from schedspec.check.kv_requests import (
    HASH_BLOCK_RATE, KVRequests, chunk_rng, draw_kv_subset, hash_rng, kv_rng, mamba_rng, with_hash_block, with_kv,
    with_mamba,
)
from schedspec.check.random_workloads import ALPHABET
from schedspec.check.session_events import SessionRequests, session_config, session_rng
from schedspec.check.workload import (
    Abort,
    AddRequest,
    Event,
    ResetPrefixCache,
    Schedule,
    Step,
    Update,
    Workload,
)
from schedspec.spec.interface import Policy, RequestSpec, RequestStatus, SchedulerConfig
from schedspec.spec.errors import ConfigError
from schedspec.spec.effects import EFFECTS, effects_reachable_in
from schedspec.spec.rule_names import RULE_NAMES, RULES
from schedspec.spec.request_state import RequestState
from schedspec.spec.scheduler import SpecScheduler

#: The swarm's switches. Each workload turns each one on with probability 1/2
#: (then the focus's hints add and remove some).
FEATURES: tuple[str, ...] = (
    "priority",          # PRIORITY policy (else FCFS)
    "rising_priority",   # later arrivals get better (lower) priority values
    "no_chunking",       # chunked prefill off
    "no_caching",        # prefix caching off
    "reserve_full_isl",  # scheduler_reserve_full_isl
    "tight_pool",        # at most one block beyond one max_model_len request
    "small_budget",      # a token budget of a few tokens
    "threshold",         # a long-prefill threshold
    "few_seqs",          # max_num_seqs 1 or 2
    "long_prompts",      # prompts of half max_model_len and more
    "shared_prefixes",   # prompts that start with one of a few block-aligned prefixes
    "duplicates",        # a prompt repeated exactly, often in the same burst
    "block_aligned",     # prompt lengths that are multiples of the block size
    "stops",             # several stop token ids per request
    "eos",               # an eos token id per request
    "short_outputs",     # max_tokens 1 or 2
    "long_outputs",      # max_tokens far past max_model_len
    "aborts",            # aborts of waiting, running and preempted requests
    "resets",            # prefix-cache resets, some on an idle pool
    "reset_running",     # resets that preempt the running requests
    "bursts",            # arrivals in bursts of up to eight
    "salts",             # cache salts
    "big_blocks",        # blocks of 4 or 8 tokens (a decode then rarely needs a new block)
    "split_steps",       # steps spelled out as schedule, an abort or arrival, update
    "tiny_blocks",       # blocks of 1 or 2 tokens (a full prefix hit then leaves one token to compute)
)

#: rule -> (features that make it likely, features that would hide it)
RULE_HINTS: Mapping[str, tuple[frozenset[str], frozenset[str]]] = {
    name: (frozenset(wants.split()), frozenset(avoids.split()))
    for name, wants, avoids in (
        ("schedule.threshold_active", "threshold bursts", ""),
        ("schedule.waiting_skipped", "tight_pool bursts", ""),
        ("running.scheduled", "", ""),
        ("running.prefill_chunk", "small_budget long_prompts", "no_chunking"),
        ("running.skip_no_tokens", "long_outputs long_prompts", ""),
        ("running.stop_budget", "small_budget long_prompts threshold bursts", "no_chunking"),
        ("running.self_preempted_break", "tight_pool long_prompts", "priority"),
        ("running.self_preempted_continue", "tight_pool priority long_prompts", ""),
        ("preempt.fcfs_tail", "tight_pool long_prompts", "priority"),
        ("preempt.priority_victim", "tight_pool priority long_prompts", ""),
        ("preempt.self", "tight_pool long_prompts", ""),
        ("preempt.victim_ahead", "tight_pool priority rising_priority long_outputs big_blocks long_prompts", "few_seqs bursts short_outputs stops eos"),
        ("preempt.budget_give_back", "tight_pool priority rising_priority long_outputs big_blocks long_prompts",
         "few_seqs bursts short_outputs stops eos"),
        ("preempt.reset_running", "resets reset_running", ""),
        ("waiting.stop_max_num_seqs", "few_seqs bursts", ""),
        ("waiting.stop_budget", "small_budget bursts", ""),
        ("admit.new", "", ""),
        ("admit.resumed", "tight_pool long_prompts", ""),
        ("admit.prefill_chunk", "small_budget long_prompts", "no_chunking"),
        ("admit.blocked_chunking_off", "no_chunking long_prompts bursts", "few_seqs"),
        ("admit.blocked_full_sequence", "reserve_full_isl tight_pool long_prompts", ""),
        ("admit.blocked_blocks", "tight_pool bursts long_prompts", "reserve_full_isl"),
        ("kv.miss", "", "no_caching"),
        ("kv.hit_partial", "shared_prefixes", "no_caching"),
        ("kv.hit_full", "duplicates", "no_caching"),
        ("kv.hit_capped", "duplicates block_aligned", "no_caching"),
        ("kv.touch_free", "shared_prefixes", "no_caching"),
        ("kv.touch_shared", "shared_prefixes bursts", "no_caching"),
        ("kv.evict_cached", "shared_prefixes tight_pool", "no_caching"),
        ("kv.evict_keeps_duplicate", "duplicates bursts tight_pool", "no_caching"),
        ("kv.cache_duplicate_key", "duplicates bursts", "no_caching"),
        ("kv.free_front", "", ""),
        ("kv.free_back", "shared_prefixes", "no_caching"),
        ("kv.free_shared", "shared_prefixes bursts", "no_caching"),
        ("kv.reset_ok", "resets", ""),
        ("kv.hash_lookahead_wait", "shared_prefixes", "no_caching small_budget"),
        ("kv.reset_refused", "resets", "reset_running"),
        ("update.no_token", "small_budget long_prompts", "no_chunking"),
        ("update.request_gone", "split_steps aborts", ""),
        ("stop.eos", "eos", "short_outputs"),
        ("stop.stop_token", "stops", "short_outputs"),
        ("stop.max_tokens", "short_outputs", ""),
        ("stop.max_model_len", "long_outputs long_prompts", ""),
        ("abort.waiting", "aborts bursts", ""),
        ("abort.preempted", "aborts tight_pool long_prompts", ""),
        ("abort.running", "aborts", ""),
        ("spec.drafts_cut", "small_budget threshold", "no_chunking"),
        ("spec.drafts_unscheduled", "small_budget bursts", "no_chunking"),
        ("admit.padded_decode", "duplicates tiny_blocks", "no_caching big_blocks"),
        ("admit.blocked_padding", "duplicates tiny_blocks small_budget bursts", "no_caching big_blocks no_chunking"),
        ("spec.stop_inside_run", "stops eos", "short_outputs"),
        ("spec.drafts_for_finished", "short_outputs", ""),
        ("running.skip_max_tokens_in_flight", "short_outputs", ""),
        ("async.stale_output", "tight_pool long_prompts", "priority"),
        ("async.stale_dropped", "resets reset_running", ""),
        ("async.stale_output_stopped", "tight_pool bursts", ""),
        # the admission gates (pick_gates turns each rule's gate on)
        ("watermark.admitted", "bursts", ""),
        ("watermark.blocked", "tight_pool bursts long_prompts", "reserve_full_isl"),
        ("watermark.blocked_full_sequence", "reserve_full_isl tight_pool bursts long_prompts", ""),
        ("cadence.hold", "bursts long_outputs", ""),
        ("cadence.running_chunk_held", "small_budget long_prompts long_outputs bursts", "no_chunking"),
        ("cadence.admission_held", "bursts long_outputs", ""),
        ("lora.skip_max_loras", "bursts", "few_seqs"),
        ("grammar.skip_compiling", "bursts", ""),
        ("grammar.abort_waiting", "aborts", ""),
        ("grammar.drafts_cut", "long_outputs", "short_outputs stops eos"),
        ("encoder.cache_hit", "bursts", ""),
        ("encoder.evicted", "bursts long_prompts", ""),
        ("encoder.chunk_cut", "long_prompts", ""),
        ("encoder.blocked_inside", "duplicates shared_prefixes long_prompts", "no_caching"),
        ("encoder.running_no_token", "small_budget long_prompts bursts", "no_chunking"),
        ("encoder.admission_passed_over", "duplicates shared_prefixes long_prompts bursts", "no_caching"),
        ("encoder.budget_given_back", "tight_pool priority rising_priority long_outputs long_prompts small_budget",
         "few_seqs short_outputs stops eos no_chunking"),
        # the effects (spec/effects.py): a producing rule's outcome used later
        ("effect.preempted_blocks_reallocated", "tight_pool long_prompts bursts", ""),
        ("effect.returned_budget_scheduled", "tight_pool priority rising_priority long_prompts threshold",
         "few_seqs short_outputs no_chunking big_blocks"),
        ("effect.preempted_resume_hit", "tight_pool long_prompts", "no_caching reset_running"),
        ("effect.finished_blocks_hit", "shared_prefixes duplicates short_outputs bursts", "no_caching"),
        ("effect.finished_blocks_reallocated", "tight_pool short_outputs bursts", ""),
        ("effect.rollback_rescheduled", "long_outputs", "short_outputs"),
        ("effect.placeholders_skip", "short_outputs", ""),
    )
}


@dataclass(frozen=True)
class Plan:
    """What one guided workload turns on: its features and its focus."""

    features: frozenset[str]
    focus: tuple[str, ...] = ()

    def labels(self) -> tuple[str, ...]:
        """The workload's ``features`` field: the switches, then ``focus:RULE``."""
        return tuple(sorted(self.features)) + tuple(f"focus:{r}" for r in self.focus)


def choose_focus(counts: Mapping[str, int], seed: int, *, k: int = 3, goal: int = 50,
                 names: Sequence[str] = RULE_NAMES, lead: Sequence[str] = ()) -> tuple[str, ...]:
    """Up to ``k`` rules to aim the next workload at, among those reached
    fewer than ``goal`` times, drawn under ``seed`` with weight
    1 / (1 + count) (a rule never reached is the likeliest); () when every
    rule of ``names`` has reached ``goal``. ``names``: the rules the run's
    modes can reach (spec/rule_names.py, reachable_in). ``lead``: rules the
    focus starts with (sweep_lead), the rest drawn beside them."""
    chosen = list(lead)
    pool = [n for n in names if counts.get(n, 0) < goal and n not in chosen
            and not any(focus_conflict(c, n) for c in chosen)]
    rng = random.Random(f"schedspec-focus-{seed}")
    weights = [1.0 / (1 + counts.get(n, 0)) for n in pool]
    while pool and len(chosen) < k:
        i = rng.choices(range(len(pool)), weights=weights)[0]
        chosen.append(pool.pop(i))
        weights.pop(i)
        # the rest must be reachable in one workload with it (focus_conflict)
        keep = [j for j, n in enumerate(pool) if not focus_conflict(chosen[-1], n)]
        pool, weights = [pool[j] for j in keep], [weights[j] for j in keep]
    return tuple(chosen)


#: The setups a run visits first, one per swarm workload after the dense
#: phase, each named by a rule that needs it (its focus turns the setup on):
#: EAGLE's hash lookahead, the connector's invalid blocks and failed loads,
#: sessions, a Mamba group, partial entries, Model Runner V2 with a pipeline,
#: chunked-local and sliding-window groups. A feature drawn at a few percent
#: of the swarm would otherwise wait tens of seconds for its first workload.
SWEEP: tuple[str, ...] = (
    "kv.hash_lookahead_wait", "connector.invalid_recompute", "sessions.update_applied", "mamba.chunk_aligned",
    "kv_groups.partial_stored", "v2.decode_throttled", "connector.failed_load_kept", "kv_groups.chunk_freed",
    "sessions.stale_drafts_cleared", "kv_groups.window_freed",
)


def sweep_lead(index: int, names: Sequence[str]) -> tuple[str, ...]:
    """The rule the run's ``index``-th swarm workload (0, 1, ...) leads its
    focus with: SWEEP's rules among ``names`` (those the run can reach), in
    order, one each; () after them."""
    sweep = [rule for rule in SWEEP if rule in names]
    return (sweep[index],) if 0 <= index < len(sweep) else ()


def _setups(rule: str) -> frozenset[str]:
    """What a workload aimed at ``rule`` is built with, among those that
    exclude one another (FOCUS_CONFLICTS)."""
    gates = RULES[rule].gates if rule in RULES else ()
    out = {tag for cap, tag in (("kv_connector", "connector"), ("sessions", "sessions"), ("drafters", "eagle"),
                                ("runner_v2", "v2")) if cap in gates}
    for rules, tag in ((MAMBA_RULES, "state"), (PARTIAL_RULES, "partial"), (CHUNKED_LOCAL_RULES, "chunked"),
                       (SLIDING_WINDOW_RULES, "window")):
        if rule in rules:
            out.add(tag)
    return frozenset(out)


#: Setups one guided workload cannot hold together (guided_workload): sessions,
#: EAGLE, Mamba groups ("state") and partial entries go without a KV connector; EAGLE
#: without sessions, Model Runner V2's draft model, Mamba (no drafts) or
#: partial entries; a Mamba group in place of neither the window nor the chunk
#: a focus on their rules needs, which exclude each other.
FOCUS_CONFLICTS: frozenset[frozenset[str]] = frozenset(frozenset(p) for p in (
    ("connector", "sessions"), ("connector", "eagle"), ("connector", "state"), ("connector", "partial"),
    ("sessions", "eagle"), ("eagle", "v2"), ("eagle", "state"), ("eagle", "partial"), ("state", "v2"),
    ("state", "partial"), ("state", "chunked"), ("state", "window"), ("chunked", "window"),
))


def focus_conflict(a: str, b: str) -> bool:
    """Whether no guided workload can aim at both rules ``a`` and ``b``: a
    focus on both would build one and leave the other out of reach (a
    session focus drops the connector a connector focus needs), so
    choose_focus never picks them together."""
    return any(frozenset((x, y)) in FOCUS_CONFLICTS for x in _setups(a) for y in _setups(b))


def effect_focus(counts: Mapping[str, int], seed: int, modes: Sequence[str], gates: Sequence[str] = (),
                 goal: int = 50) -> tuple[str, ...]:
    """One effect (spec/effects.py) a run in ``modes`` with ``gates`` can
    observe, observed fewer than ``goal`` times, to aim the next workload at
    beside the rules choose_focus picks (so the rules' aim is what it was),
    drawn as choose_focus draws; () when every one has reached ``goal``."""
    names = effects_reachable_in(tuple(modes), tuple(gates))
    return choose_focus(counts, seed + 7919, k=1, goal=goal, names=names)


def draw_plan(rng: random.Random, focus: Sequence[str] = ()) -> Plan:
    """The swarm's draw (each feature on with probability 1/2), then the
    focus's hints: wanted features on, features that hide a focus rule off."""
    on = {f for f in FEATURES if rng.random() < 0.5}
    for rule in focus:
        wants, _ = RULE_HINTS.get(rule, (frozenset(), frozenset()))
        on |= wants
    for rule in focus:
        _, avoids = RULE_HINTS.get(rule, (frozenset(), frozenset()))
        on -= avoids
    return Plan(frozenset(on), tuple(focus))


def plan_config(rng: random.Random, plan: Plan) -> SchedulerConfig:
    """A valid configuration of the check's space, bent by the plan's features."""
    f = plan.features
    space = CHECK_SPACE
    if "tiny_blocks" in f:
        block_size = rng.choice((1, 2))
    elif "big_blocks" in f:
        block_size = rng.choice((4, 8))
    else:
        block_size = rng.choice(space.block_sizes)
    max_model_len = rng.choice(space.max_model_lens)
    extra = rng.choice((0, 1)) if "tight_pool" in f else rng.choice(space.extra_blocks)
    chunked = "no_chunking" not in f
    max_num_seqs = rng.choice((1, 2)) if "few_seqs" in f else rng.choice((2, 3, 4, 8))
    if chunked:
        budget = rng.choice((0, 2, 4, 6, 8)) if "small_budget" in f else rng.choice(space.chunked_budgets)
    else:
        budget = rng.choice(space.unchunked_extra_budgets)
    threshold = rng.choice((2, 3, 4, 8)) if "threshold" in f else 0
    return space.build(
        block_size=block_size,
        max_model_len=max_model_len,
        extra_blocks=extra,
        chunked=chunked,
        max_num_seqs=max_num_seqs,
        budget=budget,
        threshold=threshold,
        prefix_caching="no_caching" not in f,
        policy=Policy.PRIORITY if "priority" in f else Policy.FCFS,
        reserve_full_isl="reserve_full_isl" in f,
    )


class _Requests:
    """Makes the requests of one guided workload, as its features say."""

    def __init__(self, rng: random.Random, config: SchedulerConfig, plan: Plan, vocab: int) -> None:
        self.rng, self.config, self.f, self.vocab = rng, config, plan.features, vocab
        self.counter = 0
        bs = config.block_size
        longest = config.max_model_len - 1
        self.prefixes = [
            tuple(rng.randrange(ALPHABET) for _ in range(min(bs * rng.randint(1, 3), longest)))
            for _ in range(3)
        ]
        self.sent: list[RequestSpec] = []

    def make(self) -> RequestSpec:
        rng, cfg, f = self.rng, self.config, self.f
        self.counter += 1
        rid = f"r{self.counter}"
        bs, longest = cfg.block_size, cfg.max_model_len - 1
        if "duplicates" in f and self.sent and rng.random() < 0.35:
            prompt = rng.choice(self.sent[-6:]).prompt_token_ids
            salt = None
        else:
            if "long_prompts" in f and rng.random() < 0.6:
                n = rng.randint(max(1, longest // 2), longest)
            else:
                n = rng.choice([1, 2, 3, bs, bs + 1, rng.randint(1, longest)])
            if "block_aligned" in f and rng.random() < 0.6:
                n = max(bs, n - n % bs)
            prefix: tuple[int, ...] = ()
            if "shared_prefixes" in f and rng.random() < 0.7:
                prefix = rng.choice(self.prefixes)
            elif rng.random() < 0.3:
                prefix = rng.choice(self.prefixes)
            prompt = (prefix + tuple(rng.randrange(ALPHABET) for _ in range(max(n - len(prefix), 1))))[:longest]
            salt = rng.choice([None, None, "s1", "s2"]) if "salts" in f else None
        stop: tuple[int, ...] = ()
        if "stops" in f:
            stop = tuple(rng.sample(range(self.vocab), min(6, self.vocab - 1)))
        elif rng.random() < 0.2:
            stop = (rng.randrange(self.vocab),)
        eos = rng.randrange(self.vocab) if "eos" in f or rng.random() < 0.2 else None
        if "short_outputs" in f:
            max_tokens = rng.choice([1, 2])
        elif "long_outputs" in f:
            max_tokens = rng.choice([64, 128])
        else:
            max_tokens = rng.choice([1, 2, 4, 8, 16, 64])
        if "rising_priority" in f:
            priority = 1000 - self.counter + rng.choice([0, 0, 0, 2])
        else:
            priority = rng.choice([0, 0, 1, 2])
        req = RequestSpec(
            request_id=rid,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            priority=priority,
            arrival=self.counter,
            stop_token_ids=stop,
            eos_token_id=eos,
            ignore_eos="eos" not in f and rng.random() < 0.2,
            cache_salt=salt,
        )
        self.sent.append(req)
        return req


def pick_mode(modes: Sequence[str], focus: Sequence[str], rng: random.Random) -> tuple[str, int]:
    """(mode, k): a mode of ``modes`` in which every focus rule can be
    reached where there is one (a focus rule of async scheduling draws an
    async mode), and k drafts for a mode with speculative decoding."""
    allowed = list(modes)
    for rule in focus:
        modes_of = RULES[rule].modes if rule in RULES else EFFECTS[rule].modes if rule in EFFECTS else None
        narrowed = [m for m in allowed if m in modes_of] if modes_of is not None else allowed
        allowed = narrowed or allowed
    mode = allowed[0] if len(allowed) == 1 else rng.choice(allowed)
    k = rng.choice(CHECK_SPACE.spec_tokens) if mode in ("spec", "async-spec") else 0
    return mode, k


def with_mode(config: SchedulerConfig, mode_k: tuple[str, int]) -> SchedulerConfig:
    """``config`` in the mode (and with the k) of ``pick_mode``: a
    long-prefill threshold that would cut a padded decode of 1 + k tokens is
    raised past it, and the token budget raised to hold one such decode."""
    mode, k = mode_k
    if mode == "sync":
        return config
    threshold = config.long_prefill_token_threshold
    if k and 0 < threshold <= k:
        threshold = min(k + 1, config.max_model_len)
    fields = dict(async_scheduling=mode.startswith("async"), num_speculative_tokens=k,
                  long_prefill_token_threshold=threshold,
                  max_num_batched_tokens=max(config.max_num_batched_tokens, 1 + k))
    try:
        return dataclasses.replace(config, **fields)  # type: ignore[arg-type]
    except ConfigError:  # the mode does not fit this config: keep it in sync mode
        return config


def pick_gates(gates: Sequence[str], focus: Sequence[str], rng: random.Random,
               always: Sequence[str] = ()) -> tuple[str, ...]:
    """The admission gates a guided workload turns on: a random subset of
    ``gates`` with every one of ``always`` it holds (gate_requests.draw_gate_subset),
    plus every gate a focus rule needs (spec/rule_names.py, Rule.gates) that
    ``gates`` holds."""
    chosen = set(draw_gate_subset(gates, rng, always))
    by_capability = {cap: g for g, cap in GATE_CAPABILITIES.items()}
    for rule in focus:
        for cap in RULES[rule].gates if rule in RULES else ():
            g = by_capability.get(cap)
            if g is not None and g in gates:
                chosen.add(g)
    return tuple(g for g in GATES if g in chosen)


#: The rules only a chunked-local group reaches: a focus on one of them
#: draws a hybrid layout with one (kv_requests.draw_kv_groups, chunked).
CHUNKED_LOCAL_RULES = frozenset(("kv_groups.hit_skipped_in_chunk", "kv_groups.chunk_freed",
                                 "kv_groups.chunk_admission_capped"))
#: The rules only a sliding-window group reaches: a focus on one of them
#: (and none of CHUNKED_LOCAL_RULES) keeps every window of the layout.
SLIDING_WINDOW_RULES = frozenset(("kv_groups.hit_skipped_in_window", "kv_groups.window_freed",
                                  "kv_groups.cache_masked", "kv_groups.admission_capped"))

#: The rules only a Mamba group reaches: a focus on one of them draws one
#: (with_mamba), so no KV connector or drafts, prefix caching and chunked
#: prefill on.
MAMBA_RULES = frozenset(("kv_groups.hit_before_state", "kv_groups.state_freed", "kv_groups.state_hit_deferred",
                         "mamba.chunk_aligned", "mamba.chunk_none"))
#: The rules only partial prefix-cache entries reach: a focus on one of them
#: draws a hash block size below the block size (with_hash_block), so no
#: KV connector and prefix caching on.
PARTIAL_RULES = frozenset(("kv_groups.partial_stored", "kv_groups.partial_again", "kv_groups.partial_removed"))


def pick_chunked(focus: Sequence[str]) -> bool | None:
    """Whether a guided workload's hybrid layout holds a chunked-local group
    (kv_requests.draw_kv_groups): yes for a focus on a chunked-local rule, no
    for one on a sliding-window rule, else None (the generator draws it)."""
    if any(rule in CHUNKED_LOCAL_RULES for rule in focus):
        return True
    if any(rule in SLIDING_WINDOW_RULES for rule in focus):
        return False
    return None


def pick_kv(kv: Sequence[str], focus: Sequence[str], rng: random.Random) -> tuple[str, ...]:
    """The KV features a guided workload turns on: a random subset of
    ``kv`` (kv_requests.draw_kv_subset), plus every feature a focus rule needs
    (its Rule.gates naming kv_connector or hybrid_kv) that ``kv`` holds."""
    chosen = set(draw_kv_subset(kv, rng))
    by_capability = {cap: k for k, cap in KV_CAPABILITIES.items()}
    for rule in focus:
        for cap in RULES[rule].gates if rule in RULES else ():
            k = by_capability.get(cap)
            if k is not None and k in kv:
                chosen.add(k)
    return tuple(k for k in KV_FEATURES if k in chosen)


def _streams(config: SchedulerConfig, engine: Sequence[str], focus: Sequence[str], seed: int,
             vocab: int) -> SessionRequests | None:
    """Streaming-input sessions where the engine draw makes them (always for
    a focus on one of their rules: Rule.gates naming "sessions",
    spec/rule_names.py): some requests resumable, their chunks and ends sent
    between steps (session_events.SessionRequests), in the config sessions
    are modelled in (FCFS, no KV connector); None otherwise."""
    if not draw_sessions(engine, focus, engine_rng(f"sessions-{seed}")):
        return None
    return SessionRequests(session_config(config), session_rng(f"guided-{seed}"), vocab)


def _decodes_left(req: RequestState, config: SchedulerConfig) -> int:
    """The output tokens ``req`` may still sample: its max_tokens, within max_model_len."""
    return max(0, min(req.spec.max_tokens - len(req.output_token_ids), config.max_model_len - req.num_tokens))


def _left(req: RequestState, config: SchedulerConfig) -> int:
    """Tokens ``req`` has still to compute, its output allowance included."""
    return max(0, len(req.spec.prompt_token_ids) - req.num_computed_tokens) + _decodes_left(req, config)


def drain_estimate(requests: Sequence[RequestState], config: SchedulerConfig) -> int:
    """About how many steps ``requests`` take to finish, on the long side:
    the most work one request has left taken a token a step, or all of it at
    the token budget, or their decodes max_num_seqs at a time, whichever is
    longest."""
    if not requests:
        return 0
    left = [_left(r, config) for r in requests]
    decodes = sum(_decodes_left(r, config) for r in requests)
    return max(max(left), -(-sum(left) // max(1, config.max_num_batched_tokens)),
               -(-decodes // max(1, config.max_num_seqs)))


#: the drain's bound, in steps, however short the workload (a dense-phase
#: one): a request that ignores eos still decodes long enough to meet it
DRAIN_FLOOR = 300


def drain_victims(spec: SpecScheduler, config: SchedulerConfig, bound: int) -> list[str]:
    """The requests a guided workload aborts at its end so that its run to
    quiescence takes about ``bound`` steps at most (drain_estimate): the
    most work left first. A drain far longer than the workload (long prompts
    at a budget of a few tokens) reaches little the workload did not, and
    would spend a timed run's seconds on it."""
    live = sorted(spec.requests.values(), key=lambda r: (-_left(r, config), r.request_id))
    out: list[str] = []
    while live and drain_estimate(live, config) > bound:
        out.append(live.pop(0).request_id)
    return out


def guided_workload(seed: int, num_steps: int, vocab: int = 64, focus: Sequence[str] = (),
                    modes: Sequence[str] = ("sync",), oracle_seed: int | None = None,
                    gates: Sequence[str] = (), kv: Sequence[str] = (),
                    always_gates: Sequence[str] = (), engine: Sequence[str] = ()) -> Workload:
    """A seeded workload of ``num_steps`` steps with a swarm of features,
    aimed at ``focus`` (rule names). The spec runs beside the generator (the
    fake model seeded with ``oracle_seed``, default ``seed``, as the gate
    runs it) so aborts and resets land in the states that reach rare
    branches. ``gates`` (features.GATES): the admission gates it may turn
    on, drawn on a generator of their own (``pick_gates``; a focus rule of a
    gate turns that gate on, one of ``always_gates`` is always on), so a
    workload with none is the one its seed always gave; they are among its
    features as ``gate:NAME``. ``kv``
    (features.KV_FEATURES): the KV features it may turn on, the same way
    (``pick_kv``, ``with_kv``, ``KVRequests``; ``kv:NAME`` features).
    ``engine`` (features.ENGINE_FEATURES): the engine features it may turn
    on, in a share of the workloads (check/engine_draw.py; ``sessions``,
    ``pipeline:k=K`` and ``runner:...`` features)."""
    rng = random.Random(f"schedspec-guided-{seed}")
    plan = draw_plan(rng, focus)
    config = with_mode(plan_config(rng, plan), pick_mode(modes, focus, random.Random(f"schedspec-mode-{seed}")))
    gated: GateRequests | None = None
    chosen: tuple[str, ...] = ()
    if gates:
        grng = gate_rng(f"guided-{seed}")
        chosen = pick_gates(gates, focus, grng, always_gates)
        config = with_gates(config, chosen, grng)
        gated = GateRequests(config, grng, vocab, pause="pause" in chosen, grammar="grammar" in chosen,
                             focus=tuple(focus))
    kv_requests: KVRequests | None = None
    kv_chosen: tuple[str, ...] = ()
    eagle = "drafter" in engine and needs(focus, "drafters")  # EAGLE (check/engine_draw.py): what it is modelled with
    if kv:
        krng = kv_rng(f"guided-{seed}")
        picked = pick_kv(kv, focus, krng)
        partial = any(rule in PARTIAL_RULES for rule in focus) and "hybrid" in picked
        mamba = any(rule in MAMBA_RULES for rule in focus) and "hybrid" in picked
        if partial or mamba or eagle:  # partial entries, Mamba groups, EAGLE: no connector, prefix caching on
            picked = tuple(k for k in picked if k != "connector")
            config = dataclasses.replace(config, enable_prefix_caching=True)
        if eagle and not needs(focus, "hybrid_kv"):  # EAGLE's keys in the plain layout, unless paired with a group rule
            picked = tuple(k for k in picked if k != "hybrid")
        if mamba:  # (and chunked prefill on, no drafts: spec/validate.py)
            config = dataclasses.replace(config, enable_chunked_prefill=True, num_speculative_tokens=0)
        chunked = pick_chunked(focus)
        config = with_kv(config, picked, krng, chunk_rng(f"guided-{seed}"), chunked)
        # partial prefix-cache entries, always for a focus on their rules (none for one on Mamba's)
        config = with_hash_block(config, hash_rng(f"guided-{seed}"),
                                 1.0 if partial else 0.0 if mamba or eagle else HASH_BLOCK_RATE)
        # a Mamba group where the layout takes one (kv_requests.MAMBA_RATE), always for a focus on
        # its rules, never in the place of the window or chunk a focus on their rules needs
        config = with_mamba(config, mamba_rng(f"guided-{seed}"),
                            1.0 if mamba else 0.0 if chunked is not None else None)
        kv_chosen = kv_of(config)
        kv_requests = KVRequests(config, krng) if config.kv_connector else None
    streams = None if eagle else _streams(config, engine, focus, seed, vocab)  # sessions (always for a focus on theirs)
    if streams is not None:
        config, kv_requests = streams.config, None
    if engine:  # the runner, pipeline and drafter (check/engine_draw.py)
        config = with_engine(config, engine, focus, engine_rng(f"guided-{seed}"), sessions=streams is not None)
        if streams is not None:
            streams.config = config
    f = plan.features
    requests = _Requests(rng, config, plan, vocab)

    class _Make:
        def make(self) -> RequestSpec:
            req = requests.make()
            req = req if gated is None else gated.decorate(req)
            req = req if kv_requests is None else kv_requests.decorate(req)
            if streams is None or req.structured_output or req.mm_inputs or config.num_hash_lookahead_tokens:
                return req  # (sessions with EAGLE's hash lookahead are not modelled: spec/protocol.py)
            return streams.decorate(req)

    make = _Make()
    sim = Runner(config, {"spec": SpecScheduler}, vocab=vocab,
                 oracle_seed=seed if oracle_seed is None else oracle_seed,
                 check_invariants=False, compare_views=False)
    spec = sim.primary
    assert isinstance(spec, SpecScheduler)
    events: list[Event] = []
    p_add = 0.3 if "bursts" in f else 0.22
    p_abort = 0.08 if "aborts" in f else 0.01
    p_reset = 0.04 if "resets" in f else 0.005
    draining = 0  # steps left without arrivals (so a reset may find the pool idle)
    # at most this many unfinished requests: a deeper queue reaches no more
    # rules, and every check of a view costs in proportion to it
    cap = 64 if "rising_priority" in f else 32 if "bursts" in f else 16
    steps = 0

    stopped = False

    def emit(event: Event) -> None:
        # the simulation found a failure (the spec alone, no invariants: a
        # crash or the fake model's kv-context): the workload ends with the
        # event that shows it, so the check reports it (events after it could
        # break the in-flight protocol the failed step left)
        nonlocal stopped
        if stopped:
            return
        events.append(event)
        if sim.apply(event) is not None:
            stopped = True

    def abort(victim: str) -> None:
        emit(Abort(victim))  # and the gates' and sessions' draws forget it
        if gated is not None:
            gated.forget(victim)
        if streams is not None:
            streams.forget(victim)

    while steps < num_steps and not stopped:
        r = rng.random()
        if draining == 0 and (r < p_add or not spec.requests) and len(spec.requests) < cap:
            for _ in range(rng.choice([1, 2, 4, 8] if "bursts" in f else [1, 1, 2, 3])):
                emit(AddRequest(make.make()))
        elif r < p_add + p_abort and spec.requests:
            by_state: dict[RequestStatus, list[str]] = {}
            for rid, req in spec.requests.items():
                by_state.setdefault(req.status, []).append(rid)
            state = rng.choice(sorted(by_state, key=lambda s: s.value))
            victim = rng.choice(by_state[state])
            abort(victim)
        elif r < p_add + p_abort + p_reset:
            if "resets" in f and draining == 0 and rng.random() < 0.3:
                draining = rng.randint(4, 24)
            else:
                emit(ResetPrefixCache("reset_running" in f and rng.random() < 0.5))
        else:
            if gated is not None:
                for event in gated.before_step():
                    emit(event)
            if kv_requests is not None:
                for event in kv_requests.before_step():
                    emit(event)
            if streams is not None:
                waiting = {rid for rid, req in spec.requests.items()
                           if req.status == RequestStatus.WAITING_FOR_STREAMING_REQ}
                for event in streams.before_step(waiting):
                    emit(event)
            if "split_steps" in f and spec.requests and rng.random() < 0.25:
                emit(Schedule())  # schedule(N), an abort or an arrival, then update(N)
                if rng.random() < 0.6:
                    victim = rng.choice(sorted(spec.requests))
                    abort(victim)
                else:
                    emit(AddRequest(make.make()))
                emit(Update())
            else:
                emit(Step())
            steps += 1
            if draining:
                draining -= 1
                if draining == 0 or not spec.running:
                    draining = 0
                    emit(ResetPrefixCache(False))
    # a bounded drain: the requests whose remaining work would keep the run
    # to quiescence going past twice the workload's length are aborted
    for victim in drain_victims(spec, config, max(DRAIN_FLOOR, 2 * num_steps)):
        abort(victim)
    if gated is not None:
        for event in gated.finish():
            emit(event)
    if streams is not None:
        for event in streams.finish():
            emit(event)
    if kv_requests is not None:
        for event in kv_requests.finish():
            emit(event)
        events = keep_failed_sync_loads_alive(events, config)
    return Workload(config=config, events=tuple(events), seed=seed, name="guided",
                    features=plan.labels() + tuple(f"gate:{g}" for g in chosen)
                    + tuple(f"kv:{k}" for k in kv_chosen)
                    + (("sessions",) if streams is not None else ()) + engine_features(config))
