"""What a run exercised: one statistics type for every driver.

``Stats.absorb(plan)`` counts one step of a plan; the driver adds aborts,
prefix-cache resets and finished requests, the equivalence matrix adds its
wall and forward times. The check command, the Hypothesis state machine's
rates and the equivalence matrix's guards all read the same counters.

``rules`` holds the reference scheduler's rule coverage (spec/coverage.py):
rule name -> times the spec took that branch; ``absorb_rules`` adds the
counts of one scheduler (the spec, or none for a scheduler that keeps none).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable
from dataclasses import dataclass, field

from schedspec.spec import coverage
from schedspec.spec.rule_names import ALL_MODES, RULE_NAMES, reachable_in
from schedspec.spec.interface import ScheduleKind, StepPlan

from schedspec.check.kv_kinds import check_kind

#: The mechanisms a run can be asked to have exercised (see ``Stats.feature``).
FEATURES = ("chunked", "cache_hit", "preempted")

_SUMMED = (
    "steps", "scheduled_tokens", "admissions", "hit_admissions", "hit_tokens", "chunks",
    "preemptions", "resumed", "aborts", "resets", "seconds", "forward_seconds",
    "pauses", "paused_steps", "cache_clears", "grammars_ready", "grammars_failed", "encoder_inputs",
    "encoder_freed", "invalid_spec_tokens", "lora_steps",
    "kv_loads_sync", "kv_loads_async", "kv_load_failures", "kv_saves", "kv_timeouts", "held_block_steps",
    "sliding_window_frees", "chunked_local_frees", "mamba_frees",
    "kv_cache_events",
    "stats_reports", "forks", "refusals",
    "session_workloads", "pipeline_workloads", "runner_v2_workloads", "drafter_workloads",
)

#: The workloads with each engine feature (features.ENGINE_FEATURES) on,
#: counted by the check (reported only when a run has them).
ENGINE_COUNTERS = {"sessions": "session_workloads", "pipeline": "pipeline_workloads",
                   "runner": "runner_v2_workloads", "drafter": "drafter_workloads"}

#: The KV connector and hybrid-group counters (reported only when a run has them).
KV_COUNTERS = ("kv_loads_sync", "kv_loads_async", "kv_load_failures", "kv_saves", "kv_timeouts",
               "held_block_steps", "sliding_window_frees", "chunked_local_frees", "mamba_frees",
               "kv_cache_events")

#: The admission-gate counters (reported only when a run has gates on).
GATE_COUNTERS = ("pauses", "paused_steps", "cache_clears", "grammars_ready", "grammars_failed",
                 "encoder_inputs", "encoder_freed", "invalid_spec_tokens", "lora_steps")


@dataclass
class Stats:
    steps: int = 0
    scheduled_tokens: int = 0
    admissions: int = 0  # entries of kind NEW or RESUMED
    hit_admissions: int = 0  # admissions with computed tokens (a prefix-cache hit)
    hit_tokens: int = 0  # tokens found in the prefix cache at admission
    chunks: int = 0  # partial prefill chunks scheduled
    preemptions: int = 0
    resumed: int = 0  # entries of kind RESUMED
    aborts: int = 0
    resets: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # final status -> count
    seconds: float = 0.0  # wall time, where a driver measures it
    forward_seconds: float = 0.0  # time in the model, where a driver measures it
    rules: Counter[str] = field(default_factory=Counter)  # spec rule name -> times taken
    # the admission gates
    pauses: int = 0  # Pause events applied
    paused_steps: int = 0  # steps scheduled while paused
    cache_clears: int = 0  # prefix-cache clears of completed pauses
    grammars_ready: int = 0  # grammars reported compiled
    grammars_failed: int = 0  # grammars reported failed
    encoder_inputs: int = 0  # encoder inputs scheduled
    encoder_freed: int = 0  # encoder-cache entries freed
    invalid_spec_tokens: int = 0  # the plans' num_invalid_spec_tokens summed: 0 from vLLM's schedule() and every scheduler here
    lora_steps: int = 0  # steps that scheduled a request with an adapter
    # the KV connector and hybrid KV cache groups
    kv_loads_sync: int = 0  # synchronous connector loads started (the plans' kv_loads)
    kv_loads_async: int = 0  # asynchronous connector loads started
    kv_load_failures: int = 0  # loads the worker reported failed (failed_recving + invalid_block_ids)
    kv_saves: int = 0  # asynchronous saves the worker reported finished (finished_sending)
    kv_timeouts: int = 0  # reports the bounded wait forced (loads and saves)
    held_block_steps: int = 0  # blocks held by finished requests, summed over the steps
    # the engine features, per workload (ENGINE_COUNTERS)
    session_workloads: int = 0
    pipeline_workloads: int = 0
    runner_v2_workloads: int = 0
    drafter_workloads: int = 0
    sliding_window_frees: int = 0  # sliding-window table entries that became the null block
    chunked_local_frees: int = 0  # chunked-local table entries that became the null block
    mamba_frees: int = 0  # Mamba state blocks that became the null block
    kv_cache_events: int = 0  # KV cache events taken (config.enable_kv_cache_events; spec/kv_events.py)
    #: make_stats() reports compared (schedulers built with log_stats: spec/stats.py)
    stats_reports: int = 0
    #: schedulers under test replaced by their clone() mid-run (Runner.fork_every)
    forks: int = 0
    #: malformed calls refused, each by each probed scheduler (Runner.rejects: check/rejects.py)
    refusals: int = 0
    #: the kind of each KV cache group (KVCacheGroup.kind), where the driver
    #: tells it: the null entries of a group's table count to its kind's
    #: counter (check/kv_kinds.py, frees_stat: chunked_local_frees for a
    #: chunked-local group), all of them as sliding_window_frees while the
    #: kinds are unknown
    group_kinds: tuple[str, ...] = ()
    #: request id -> null blocks last seen in each of its group tables (for the frees)
    _nulls: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    def absorb(self, plan: StepPlan) -> None:
        """Count one scheduled step."""
        self.steps += 1
        self.preemptions += len(plan.preempted_ids)
        self.encoder_freed += len(plan.freed_encoder_inputs)
        for load in plan.kv_loads:
            if load.asynchronous:
                self.kv_loads_async += 1
            else:
                self.kv_loads_sync += 1
        for s in plan.scheduled:
            self.encoder_inputs += len(s.encoder_inputs)
            self.invalid_spec_tokens += s.num_invalid_spec_tokens
            self.scheduled_tokens += s.num_scheduled_tokens
            if s.kind != ScheduleKind.RUNNING:
                self.admissions += 1
                if s.num_computed_tokens > 0:
                    self.hit_admissions += 1
                    self.hit_tokens += s.num_computed_tokens
            if s.kind == ScheduleKind.RESUMED:
                self.resumed += 1
            if s.is_prefill_chunk:
                self.chunks += 1
            if s.group_block_ids:
                self._count_frees(s.request_id, s.group_block_ids)

    def _count_frees(self, request_id: str, tables: tuple[tuple[int, ...], ...]) -> None:
        """Count the null entries new in each group table of a request since
        its last entry: the null block 0 only stands in a sliding-window or
        chunked-local table, for a block it freed (remove_skipped_blocks) or
        a hit's block it skipped."""
        nulls = tuple(table.count(0) for table in tables)
        before = self._nulls.get(request_id, ())
        for g, n in enumerate(nulls):
            new = n - (before[g] if g < len(before) else 0)
            if new <= 0:
                continue
            stat = check_kind(self.group_kinds[g]).frees_stat if g < len(self.group_kinds) else "sliding_window_frees"
            setattr(self, stat, getattr(self, stat) + new)
        self._nulls[request_id] = nulls

    def merge(self, other: Stats) -> None:
        """Add ``other``'s counts to these."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.finished.update(other.finished)
        coverage.merge(self.rules, other.rules)

    def absorb_rules(self, scheduler: object) -> bool:
        """Add the rule counts ``scheduler`` kept (spec/coverage.py,
        counts_of); False when it keeps none."""
        counts = coverage.counts_of(scheduler)
        if counts is None:
            return False
        coverage.merge(self.rules, counts)
        return True

    def rule_coverage(self, required: tuple[str, ...] = (),
                      modes: tuple[str, ...] = ALL_MODES, gates: tuple[str, ...] = (),
                      reachable: tuple[str, ...] | None = None) -> dict[str, object]:
        """The rule-coverage report (JSON): the modes and admission gates
        (capability names), how many of the rules they can reach were
        reached (``reachable``, the rules of those modes and gates unless given:
        a scheduler's capabilities narrow them; ``total`` counts every catalogued rule), each
        rule's count, the reachable ones never reached, the rules out of
        reach in these modes and gates, and which of ``required`` were never
        reached."""
        names = reachable_in(modes, gates) if reachable is None else reachable
        return {
            "modes": list(modes),
            "gates": list(gates),
            "reached": len(coverage.reached(self.rules)),
            "reachable": len(names),
            "total": len(RULE_NAMES),
            "unreached": coverage.unreached(self.rules, names),
            "out_of_reach": [n for n in RULE_NAMES if n not in names],
            "required_unreached": coverage.unreached(self.rules, required),
            "counts": coverage.as_dict(self.rules),
        }

    def feature(self, name: str) -> int:
        """How much of one of ``FEATURES`` the run exercised (0: never)."""
        if name == "chunked":
            return self.chunks
        if name == "cache_hit":
            return self.hit_tokens
        if name == "preempted":
            return self.preemptions
        raise ValueError(f"feature must be one of {', '.join(FEATURES)}, got {name!r}")

    def as_dict(self) -> dict[str, object]:
        """The counts the check command reports (JSON keys)."""
        return {
            "steps": self.steps,
            "scheduled_tokens": self.scheduled_tokens,
            "admissions": self.admissions,
            "hit_admissions": self.hit_admissions,
            "hit_tokens": self.hit_tokens,
            "prefill_chunks": self.chunks,
            "preemptions": self.preemptions,
            "aborts": self.aborts,
            "prefix_cache_resets": self.resets,
            "finished": dict(self.finished),
            # the gate counters only where a gate was used, so a run without
            # gates reports what it always did
            **{name: getattr(self, name) for name in GATE_COUNTERS if getattr(self, name)},
            **{name: getattr(self, name) for name in KV_COUNTERS if getattr(self, name)},
            **{name: getattr(self, name) for name in ENGINE_COUNTERS.values() if getattr(self, name)},
            # the scheduler statistics compared (schedulers built with log_stats)
            **({"stats_reports": self.stats_reports} if self.stats_reports else {}),
        }

    def _line(self, counters: Iterable[str], none: str) -> str:
        """``counters`` above zero in one line ("N name, ..."), ``none`` when none is."""
        parts = [f"{getattr(self, name)} {name.replace('_', ' ')}" for name in counters if getattr(self, name)]
        return ", ".join(parts) if parts else none

    def gate_line(self) -> str:
        """The gate counters in one line (those above zero)."""
        return self._line(GATE_COUNTERS, "no gate event")

    def count_engine(self, features: tuple[str, ...]) -> None:
        """Count one workload with the engine features ``features`` on (features.engine_of)."""
        for name in features:
            counter = ENGINE_COUNTERS[name]
            setattr(self, counter, getattr(self, counter) + 1)

    def engine_line(self) -> str:
        """The engine-feature workload counters in one line (those above zero)."""
        return self._line(ENGINE_COUNTERS.values(), "no workload with one")

    def kv_line(self) -> str:
        """The KV connector and hybrid-group counters in one line (those above zero)."""
        return self._line(KV_COUNTERS, "no KV load, save or sliding-window or chunked-local free")
