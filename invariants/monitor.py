"""The catalogue, the Monitor that runs it over a scheduler's transitions,
and the text `schedspec invariants` prints."""

from __future__ import annotations

import textwrap
from typing import Iterable

# Importing the checker modules registers their invariants, in this order.
from schedspec.invariants import connector, gates, groups, inflight, kv_events, lifecycle, mamba, state, stats, step  # noqa: F401
from schedspec.invariants import sessions  # noqa: F401
from schedspec.invariants import pipeline  # noqa: F401
from schedspec.invariants import runner_v2  # noqa: F401
from schedspec.invariants.core import ALL_KINDS, REGISTRY, History, Invariant, Transition, Violation

_ORDER = (
    # the state of one view
    "queues-match-status",
    "max-num-seqs",
    "block-conservation",
    "block-table-covers-computed",
    "block-table-exact",
    "waiting-holds-no-blocks",
    "computed-within-known",
    "max-model-len",
    "shared-blocks-identical-prefix",
    "cache-index-consistent",
    "cached-block-content",
    "full-blocks-cached",
    "quiescence",
    # one schedule() call
    "token-budget",
    "max-num-seqs-per-step",
    "long-prefill-threshold",
    "chunked-prefill-disabled",
    "scheduled-are-running",
    "plan-entry-kinds",
    "plan-order",
    "plan-matches-state",
    "plan-blocks-exact",
    "plan-token-ids",
    "cache-hit-identical-prefix",
    "preemption-resets",
    "no-admission-with-preemption",
    "full-sequence-reserved",
    "fcfs-admission-order",
    "priority-admission-order",
    "fcfs-victim-suffix",
    "priority-victim-choice",
    "progress",
    "progress-admits-head",
    "work-conserving-admission",
    "running-served-while-budget",
    "no-starvation",
    # a request's life across operations
    "legal-status-transition",
    "status-change-by-operation",
    "waiting-queue-order",
    "running-queue-update",
    "blocks-only-grow",
    "output-append-only",
    "update-appends-sampled-token",
    "stop-conditions",
    "finished-reported-once",
    "free-queue-lru",
    "reset-prefix-cache",
    # steps in flight and drafts (async scheduling, speculative decoding)
    "placeholders-match-in-flight",
    "within-max-model-len-with-lookahead",
    "preempted-carries-no-drafts",
    "drafts-bounded",
    "spec-tokens-in-budget",
    "in-flight-output-delivered-once",
    "in-flight-within-k",
    "pipeline-no-recompute",
    "verified-frontier",
    # the admission gates (LoRA, structured outputs, pause, watermark,
    # prefill cadence, encoder)
    "max-loras",
    "shared-block-one-adapter",
    "shared-block-one-image-set",
    "grammar-wait-holds-nothing",
    "grammar-wait-not-scheduled",
    "drafts-obey-grammar",
    "paused-admits-nothing",
    "watermark-kept",
    "prefill-cadence",
    "encoder-budget",
    "encoder-cache-within-size",
    # the KV connector (kv_connector)
    "remote-kv-not-scheduled",
    "remote-kv-leaves-after-report",
    "kv-loads-consistent",
    "kv-load-follows-request",
    "kv-load-failure-policy",
    "invalid-block-not-computed",
    "finished-holds-only-pending",
    "kv-save-delays-free",
    "kv-quiescence",
    # hybrid KV cache groups (hybrid_kv)
    "group-block-conservation",
    "group-tables-cover",
    "groups-prefix-hit-valid",
    "sliding-window-frees",
    "partial-entries-with-their-block",
    "mamba-hit-at-checkpoint",
    "mamba-chunk-on-grid",
    "mamba-state-blocks-bounded",
    "mamba-progress-bound",
    # the KV cache events (kv_events)
    "kv-events-mirror-exact",
    "kv-events-parent-stored",
    "kv-events-removed-once-per-store",
    "kv-events-cleared-on-reset",
    # the scheduler statistics (a scheduler built with log_stats: spec/stats.py)
    "stats-kv-usage",
    "stats-hits-within-queries",
    "stats-queue-counts",
    "stats-preemptions-counted",
    "stats-drafts-within-proposed",
    # streaming-input sessions (resumable requests: invariants/sessions.py)
    "request-in-one-queue",
    "stream-input-not-early",
    "dropped-token-not-computed",
    "stream-liveness",
    # Model Runner V2 (invariants/runner_v2.py)
    "v2-decode-throttle",
)


def _catalogue() -> tuple[Invariant, ...]:
    by_id = {inv.id: inv for inv in REGISTRY}
    assert len(by_id) == len(REGISTRY), "duplicate invariant id"
    assert set(by_id) == set(_ORDER), sorted(set(by_id) ^ set(_ORDER))
    return tuple(by_id[i] for i in _ORDER)


CATALOGUE: tuple[Invariant, ...] = _catalogue()
BY_ID: dict[str, Invariant] = {inv.id: inv for inv in CATALOGUE}


class Monitor:
    """Checks every transition a driver shows it against a set of invariants,
    keeping the history the transition invariants need. A checker that cannot
    read a malformed view reports that as a violation of its invariant."""

    def __init__(self, invariants: Iterable[Invariant] = CATALOGUE) -> None:
        self.invariants: tuple[Invariant, ...] = tuple(invariants)
        self.history = History()
        self.transitions_seen = 0
        #: transition kind -> the invariants that apply to it, in order
        self._by_kind: dict[str, tuple[Invariant, ...]] = {}

    def check(self, t: Transition) -> list[Violation]:
        """The violations in ``t`` against the history so far (not folded in)."""
        chosen = self._by_kind.get(t.kind)
        if chosen is None:
            chosen = self._by_kind[t.kind] = tuple(inv for inv in self.invariants if t.kind in inv.kinds)
        out: list[Violation] = []
        history = self.history
        for inv in chosen:
            try:
                out.extend(inv.check(t, history))
            except Exception as exc:  # a malformed view must not crash the driver
                out.append(
                    Violation(inv.id, f"could not check the {t.kind} transition: {type(exc).__name__}: {exc}")
                )
        return out

    def record(self, t: Transition) -> None:
        """Fold ``t`` into the history, as after a check."""
        self.history.record(t)
        self.transitions_seen += 1

    def observe(self, t: Transition) -> list[Violation]:
        """Check ``t``, then fold it into the history."""
        out = self.check(t)
        self.record(t)
        return out


def catalogue_text(invariants: Iterable[Invariant] | None = None) -> str:
    """What `schedspec invariants` prints: id, tags, scope, statement, vLLM
    behaviour (of ``invariants``, the whole catalogue by default)."""
    chosen = CATALOGUE if invariants is None else tuple(invariants)
    head = f"{len(chosen)} invariants (vLLM 0.33.0 v1 scheduler)"
    if invariants is not None:
        head = f"{len(chosen)} of {len(CATALOGUE)} invariants (vLLM 0.33.0 v1 scheduler)"
    lines = [head, ""]
    for inv in chosen:
        kinds = "every operation" if inv.scope == "state" else ", ".join(sorted(inv.kinds))
        lines.append(f"{inv.id}  [{', '.join(inv.tags)}; {inv.scope}; {kinds}]")
        lines.extend(textwrap.wrap(inv.statement, 96, initial_indent="    ", subsequent_indent="    "))
        lines.extend(
            textwrap.wrap("vLLM: " + inv.vllm_behaviour, 96, initial_indent="    ", subsequent_indent="      ")
        )
        if inv.requires:
            lines.append("    requires: " + ", ".join(sorted(inv.requires)))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def catalogue_markdown() -> str:
    """The catalogue as the markdown table in docs/invariants.md."""
    rows = [
        "| id | tags | scope | statement | vLLM 0.33 behaviour |",
        "|----|------|-------|-----------|---------------------|",
    ]
    for inv in CATALOGUE:
        if inv.scope == "state":
            scope = "state (every op)"
        elif inv.kinds == ALL_KINDS:
            scope = "transition (every op)"
        else:
            scope = "transition: " + ", ".join(sorted(inv.kinds))
        tags = ", ".join(f"`{t}`" for t in inv.tags)
        cells = (f"`{inv.id}`", tags, scope, inv.statement, inv.vllm_behaviour)
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows) + "\n"
