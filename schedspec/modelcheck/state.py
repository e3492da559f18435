"""The state as the checker sees it: a canonical fingerprint of a scheduler's
view, and the KV contents that view implies.

Both read only the public SchedulerView (``Scheduler.view()``), never the
spec's own fields: whatever the spec calls its fields, the checker explores
the state every scheduler reports.
"""

from __future__ import annotations

from typing import Any

from schedspec.spec.request_state import GrammarState
from schedspec.spec.interface import RequestStatus, SchedulerView

#: A canonical fingerprint: a nested tuple of ints, strings and None.
Fingerprint = tuple[Any, ...]


class Canon:
    """Computes canonical fingerprints of views. Request ids are replaced by
    their arrival rank among the requests the state knows (unfinished, and
    finished since the last plan). The checker gives the k-th request of a
    path, of shape i, the id ``r{k}`` and the arrival ``k * len(shapes) + i``,
    so the arrival orders requests as their ids do and also names the shape.

    A request's row is its shape, status, output, computed tokens, block
    table, whether it was ever preempted, and its in-flight output
    placeholders and draft tokens (with async scheduling the plans in flight
    and the fake model's memory are appended by expand.Flight.key). The spec's count of keyed
    blocks of a table is not in the view and need not be: between steps it
    is ``num_computed_tokens // block_size`` with prefix caching on and 0
    with it off (docs/modelcheck.md, "Fingerprints")."""

    def __init__(self, num_shapes: int, priority: bool, gated: bool = False, interval: int = 1,
                 hybrid: bool = False) -> None:
        self.num_shapes = num_shapes
        self.priority = priority
        #: a hybrid layout: each request's row adds every group's table
        #: (RequestView.group_block_ids; group 0's is ``block_ids``)
        self.hybrid = hybrid
        #: a space with an admission gate: the view's gate state is part of
        #: the fingerprint (the pause state, the encoder cache, the prefill
        #: cadence's counters); without one it is constant and left out
        self.gated = gated
        self.interval = interval

    def fingerprint(self, v: SchedulerView) -> Fingerprint:
        reqs = v.requests
        fin = v.finished
        if fin:
            known: list[tuple[int, str]] = [(r.spec.arrival, rid) for rid, r in reqs.items()]
            known += [(r.spec.arrival, rid) for rid, r in fin.items()]
            known.sort()
            ids = [rid for _, rid in known]
        else:
            ids = list(reqs)  # insertion order is arrival order
        rank = {rid: i for i, rid in enumerate(ids)}
        ns = self.num_shapes
        rows = []
        for rid in ids:
            r = reqs.get(rid) or fin[rid]
            row = (r.spec.arrival % ns, r.status._value_, r.output_token_ids, r.num_computed_tokens,
                   r.block_ids, r.num_preemptions > 0, r.num_output_placeholders, r.spec_token_ids)
            rows.append(row + (r.group_block_ids,) if self.hybrid else row)
        if self.priority:
            # The PRIORITY waiting list is unordered (the head is the least
            # key); only the service order is observable.
            waiting = tuple(sorted([rank[r] for r in v.waiting]))
        else:
            waiting = tuple([rank[r] for r in v.waiting])
        kv = v.kv
        keys = kv.block_keys
        if keys:
            key_part: Any = tuple(sorted(keys.items()))
            multi: Any = tuple(sorted([b for b in kv.cache_index.values() if len(b) > 1]))
        else:
            key_part = multi = ()
        preempted = v.preempted_since_plan
        fp: Fingerprint = (
            tuple(rows),
            waiting,
            tuple([rank[r] for r in v.running]),
            tuple(sorted([rank[r] for r in preempted])) if preempted else (),
            kv.ref_cnt,
            kv.free_queue,
            key_part,
            multi,
        )
        if kv.partial_index:  # partial entries (a hash block size below the block size)
            fp += (tuple(sorted(kv.partial_index.items())),)
        if not self.gated:
            return fp
        return fp + (self.gate_part(v),)

    def gate_part(self, v: SchedulerView) -> Fingerprint:
        """The admission gates' state in the view: the pause state, the
        encoder cache (identifier -> embeddings, and the space left), and the
        prefill cadence's counters as the cadence reads them: the executed
        steps since the last prefill step, capped at the interval (the step
        number itself is dropped, as the plan's is: every distance from the
        interval on holds nothing back), and the capacity escape."""
        since = 0
        if self.interval > 1:
            since = min(v.num_executed_steps - v.last_prefill_step, self.interval)
        return (int(v.pause_state), tuple(sorted(v.encoder_cache.items())), v.encoder_cache_free, since,
                v.prefill_capacity_bound)


def _ranks(ids: set[str]) -> dict[str, int]:
    """The checker's ids ``r{k}`` by arrival order."""
    return {rid: i for i, rid in enumerate(sorted(ids, key=lambda r: (len(r), r)))}


def hidden_gate_state(s: object, v: SchedulerView) -> Fingerprint:
    """What the reference scheduler keeps of the admission gates that its
    view does not show, read from its public fields (empty parts for a
    scheduler without them), ids renamed by arrival rank: per request
    whether its grammar compiled (nothing while it compiles), the requests
    deferred by the WAITING loop and those whose grammar failed, and the
    encoder cache's bookkeeping (which requests reference each entry and
    which of their inputs, the freeable entries in eviction order, the
    entries freed since the last plan). Two states that differ here can
    behave differently (a grammar reported or not; which entry is evicted
    first), so a space with a gate keeps it in the fingerprint
    (docs/modelcheck.md, "Admission gates")."""
    requests: Any = getattr(s, "requests", {})
    deferred: Any = getattr(s, "deferred", set())
    errors: Any = getattr(s, "grammar_errors", set())
    enc: Any = getattr(s, "encoder", None)
    cached: dict[str, set[str]] = getattr(enc, "cached", {}) if enc is not None else {}
    inputs: dict[str, set[int]] = getattr(enc, "request_inputs", {}) if enc is not None else {}
    ids: set[str] = set(v.requests) | set(v.finished) | set(deferred) | set(errors) | set(inputs)
    for refs in cached.values():
        ids |= refs
    rank = _ranks(ids)
    reported = {rid: g for rid, r in requests.items()
                if (g := getattr(r, "grammar", None)) in (GrammarState.READY, GrammarState.FAILED)}
    grammar = tuple(sorted((rank[rid], g is GrammarState.READY, g is GrammarState.FAILED) for rid, g in reported.items()))
    enc_part: Any = ()
    if enc is not None:
        enc_part = (
            tuple(sorted((h, tuple(sorted(rank[r] for r in refs))) for h, refs in cached.items())),
            tuple(sorted((rank[r], tuple(sorted(ix))) for r, ix in inputs.items())),
            tuple(getattr(enc, "freeable", {})),
            tuple(getattr(enc, "freed", ())),
            getattr(enc, "num_freeable_slots", 0),
        )
    return (grammar, tuple(sorted(rank[r] for r in deferred)), tuple(sorted(rank[r] for r in errors)), enc_part)


def kv_key(v: SchedulerView, loads: Any, saves: Any, queue: Any, now: int, bound: int,
           invalid: Any = None) -> Fingerprint:
    """The KV connector's part of a fingerprint: the view's connector state
    (the blocks finished requests hold, the loads reported done or failed
    and not yet promoted) and the worker's (each asynchronous load in flight:
    its range and blocks and its age in steps, capped at the report bound,
    which forces its report; each save first seen pending and its age; the
    reports queued and not yet meaningful), ids renamed by arrival rank (the
    checker's ids ``r{k}`` sort by arrival), with the ranks of the requests
    the view knows (tying it to the view's part). ``loads``: request id ->
    (KVLoad, start step); ``saves``: request id -> first step; ``queue``:
    the worker's events; ``now``: the last plan's step; ``invalid``: the
    invalid blocks awaiting recomputation, as the invariants' History keeps
    them (block -> (index, the requests excused)): what
    invalid-block-not-computed judges a later transition by."""
    ids: set[str] = set(v.requests) | set(v.finished) | set(v.kv_held_by_finished)
    ids |= set(loads) | set(saves)
    ids.update(e.request_id for e in queue)
    for _, excused in (invalid or {}).values():
        ids |= excused
    rank = _ranks(ids)
    known = sorted(set(v.requests) | set(v.finished), key=lambda r: (len(r), r))
    return (
        tuple(rank[x] for x in known),
        tuple(sorted((rank[x], b) for x, b in v.kv_held_by_finished.items())),
        tuple(rank[x] for x in v.kv_loads_done),
        tuple(rank[x] for x in v.kv_loads_failed),
        tuple(sorted((rank[x], ld.start, ld.end, ld.block_ids, ld.group_block_ids, ld.asynchronous,
                      min(now - start, bound)) for x, (ld, start) in loads.items())),
        tuple(sorted((rank[x], min(now - start, bound)) for x, start in saves.items())),
        tuple((type(e).__name__, rank[e.request_id], getattr(e, "block_index", None)) for e in queue),
        tuple(sorted((b, i, tuple(sorted(rank[x] for x in ex))) for b, (i, ex) in (invalid or {}).items())),
    )


def expected_memory(v: SchedulerView) -> dict[int, int]:
    """What the KV slots hold if the state tells the truth: every computed
    position of an unfinished request holds its token (in every KV cache
    group's table of a hybrid layout, but where a sliding-window group holds
    the null block 0), every keyed block holds the last block of its key's
    tokens. A request waiting for remote KV vouches for nothing: its
    computed tokens are those its load will write (the worker writes them
    when it reports the load)."""
    bs = v.kv.block_size
    mem: dict[int, int] = {}
    for b, (_, toks) in v.kv.block_keys.items():
        base = b * bs
        tail = toks[len(toks) - bs:]
        for off in range(len(tail)):
            mem[base + off] = tail[off]
    for r in v.requests.values():
        n = r.num_computed_tokens
        if not n or r.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        toks = r.spec.prompt_token_ids + r.output_token_ids
        if r.group_block_ids:
            for blocks in r.group_block_ids:
                for pos in range(min(n, len(blocks) * bs, len(toks))):
                    b = blocks[pos // bs]
                    if b:
                        mem[b * bs + pos % bs] = toks[pos]
            continue
        blocks = r.block_ids
        for pos in range(min(n, len(blocks) * bs, len(toks))):
            mem[blocks[pos // bs] * bs + pos % bs] = toks[pos]
    return mem
