"""Invariants of a request's life across operations: statuses, queues, tokens,
stopping, finishing; and how the KV pool may change between steps."""

from __future__ import annotations

from typing import Iterator

from schedspec.spec.interface import Policy, RequestStatus, RequestView, is_legal_transition
from schedspec.spec.kv_kinds import kind_of

from schedspec.invariants._util import (
    admitted,
    holds_kv_blocks,
    is_prefix,
    kv_holding_prefix,
    kv_load_failed,
    lookup,
    session_went_on,
    skipped_blocks,
    skipping_groups,
    status_of,
    step_victims,
    tables,
    tables_extend,
)
from schedspec.invariants.core import Finding, History, Transition, transition_invariant

_S = RequestStatus


@transition_invariant(
    "legal-status-transition",
    "Every status change of a request is in LEGAL_TRANSITIONS; no request vanishes without being "
    "reported finished, and none appears except by add (as WAITING).",
    "vllm/v1/request.py, RequestStatus and the scheduler's assignments to request.status "
    "(scheduler.py: add_request WAITING; schedule() RUNNING; _preempt_request PREEMPTED; "
    "utils.py, check_stop FINISHED_STOPPED / FINISHED_LENGTH_CAPPED; finish_requests "
    "FINISHED_ABORTED).",
    tags=("safety",),
)
def legal_status_transition(t: Transition, h: History) -> Iterator[Finding]:
    for rid, b in t.before.requests.items():
        a = lookup(t.after, rid)
        if a is None:
            yield rid, f"was {b.status.name} and vanished (neither unfinished nor finished)"
        elif a.status != b.status and not is_legal_transition(b.status, a.status, a.spec.resumable):
            yield rid, f"illegal status change {b.status.name} -> {a.status.name}"
    for rid, a in t.after.requests.items():
        if rid not in t.before.requests and a.status != _initial_status(a):
            yield rid, (
                f"appeared with status {a.status.name} (a new request is "
                f"{_initial_status(a).name})"
            )
    for rid, a in t.after.finished.items():
        if rid in t.before.finished:
            if t.before.finished[rid].status != a.status:
                yield rid, (
                    f"finished status changed from {t.before.finished[rid].status.name} to "
                    f"{a.status.name}"
                )
        elif rid not in t.before.requests:
            yield rid, f"appeared as finished ({a.status.name}) without having been unfinished"


def _initial_status(r: RequestView) -> RequestStatus:
    """A request's status when added: WAITING, or waiting for its grammar
    (vllm/v1/request.py, Request.__init__ with structured output)."""
    return _S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR if r.spec.structured_output else _S.WAITING


@transition_invariant(
    "status-change-by-operation",
    "Each operation changes only its own statuses: add adds one WAITING request; abort finishes "
    "its target as FINISHED_ABORTED; schedule only admits (WAITING/PREEMPTED -> RUNNING, exactly "
    "the admitted entries) and preempts (RUNNING -> PREEMPTED); update only finishes running "
    "requests (STOPPED or LENGTH_CAPPED); reset only preempts all running requests, or nothing; "
    "a pause (set_pause_state) and a grammar report (grammar_ready) change no status.",
    "vllm/v1/core/sched/scheduler.py: add_request, finish_requests(FINISHED_ABORTED), schedule() "
    "(admission, _preempt_request), update_from_output (check_stop, _free_request), "
    "reset_prefix_cache(reset_running_requests) preempting every running request; set_pause_state "
    "only sets self.pause_state; a compiled grammar is read by the WAITING loop "
    "(_handle_blocked_waiting_request), a failed one by update_from_output. With a KV connector "
    "schedule() also starts asynchronous loads (-> WAITING_FOR_REMOTE_KVS) and promotes finished "
    "ones, and update finishes failed loads' requests (FINISHED_ERROR, policy \"fail\").",
    tags=("safety",),
)
def status_change_by_operation(t: Transition, h: History) -> Iterator[Finding]:
    changes: dict[str, tuple[RequestStatus | None, RequestStatus | None]] = {}
    for rid in set(t.before.requests) | set(t.after.requests):
        old = status_of(t.before, rid) if rid in t.before.requests else None
        new = status_of(t.after, rid)
        if old != new:
            changes[rid] = (old, new)

    def name(s: RequestStatus | None) -> str:
        return "absent" if s is None else s.name

    if t.kind == "add":
        new_id = t.request.request_id if t.request is not None else None
        for cid, (old, new) in changes.items():
            want = _initial_status(t.after.requests[cid]) if cid in t.after.requests else _S.WAITING
            if cid != new_id or old is not None or new != want:
                yield cid, f"add({new_id}) changed {cid}: {name(old)} -> {name(new)}"
        if new_id is not None and new_id not in changes:
            yield new_id, f"add({new_id}) did not add a WAITING request"
    elif t.kind == "abort":
        target = t.request_id
        for cid, (old, new) in changes.items():
            if cid != target or new != _S.FINISHED_ABORTED:
                yield cid, f"abort({target}) changed {cid}: {name(old)} -> {name(new)}"
        if target is not None and changes.get(target, (None, None))[1] != _S.FINISHED_ABORTED:
            yield target, f"abort({target}) did not finish it as FINISHED_ABORTED"
    elif t.kind == "schedule":
        assert t.plan is not None
        adm = {s.request_id for s in admitted(t.plan)}
        victims = set(step_victims(t))
        for cid, (old, new) in changes.items():
            grammar = _S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            remote = _S.WAITING_FOR_REMOTE_KVS
            loaded = old == remote and cid in t.before.kv_loads_done
            ok = (cid in adm and (old in (_S.WAITING, _S.PREEMPTED, grammar) or loaded) and new == _S.RUNNING) or (
                cid in victims and old == _S.RUNNING and new == _S.PREEMPTED
            ) or (
                # the WAITING loop found the grammar compiled, and did not admit it
                cid not in adm and old == grammar and new == _S.WAITING
            ) or (
                # the WAITING loop promoted a finished KV load, and did not admit it
                cid not in adm and loaded and new in (_S.WAITING, _S.PREEMPTED)
            ) or (
                # the connector started an asynchronous load (schedule(), load_kv_async)
                # (a request waiting for its grammar: found compiled first)
                cid not in adm
                and old in (_S.WAITING, _S.PREEMPTED, grammar)
                and new == remote
                and cid in {ld.request_id for ld in t.plan.kv_loads if ld.asynchronous}
            )
            if not ok:
                yield cid, f"schedule() changed {cid}: {name(old)} -> {name(new)}"
        for cid in sorted(adm - set(changes)):
            yield cid, "admitted but its status did not become RUNNING"
    elif t.kind == "update":
        # several steps in flight (async scheduling, a pipeline): the stale
        # output of a step in flight at a preemption may stop the preempted
        # request (update_from_output, stopped_preempted_reqs)
        stoppable = (_S.RUNNING, _S.PREEMPTED) if t.after.config.max_concurrent_batches > 1 else (_S.RUNNING,)
        for cid, (old, new) in changes.items():
            if old == _S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and new == _S.FINISHED_ERROR:
                continue  # its grammar failed to compile (grammar_compile_error_reqs)
            if old in stoppable and session_went_on(lookup(t.before, cid), lookup(t.after, cid)):
                continue  # a session stopped and goes on (_handle_stopped_request; sessions.py)
            if (
                new == _S.FINISHED_ERROR
                and old in (_S.RUNNING, _S.WAITING_FOR_REMOTE_KVS)
                and t.after.config.kv_connector
                and t.after.config.kv_load_failure_policy == "fail"
            ):
                continue  # a failed KV load under the "fail" policy (kv-load-failure-policy)
            if old not in stoppable or new not in (
                _S.FINISHED_STOPPED, _S.FINISHED_LENGTH_CAPPED, _S.FINISHED_ERROR
            ):
                yield cid, f"update() changed {cid}: {name(old)} -> {name(new)}"
    elif t.kind in ("pause", "grammar"):
        call = "set_pause_state" if t.kind == "pause" else f"grammar_ready({t.request_id})"
        for cid, (old, new) in changes.items():
            yield cid, f"{call} changed {cid}: {name(old)} -> {name(new)}"
    elif t.kind == "reset":
        bad = {cid: ch for cid, ch in changes.items() if ch != (_S.RUNNING, _S.PREEMPTED)}
        for cid, (old, new) in bad.items():
            yield cid, f"reset_prefix_cache changed {cid}: {name(old)} -> {name(new)}"
        if changes and not bad:
            kept = [rid for rid in t.before.running if rid not in changes]
            if kept:
                yield None, f"reset_prefix_cache preempted {sorted(changes)} but not {kept}"


@transition_invariant(
    "waiting-queue-order",
    "FCFS: the waiting queue is a queue: add appends, admission takes from the front, preempted "
    "requests return to the front in their running-queue order, and nothing else reorders it.",
    "vllm/v1/core/sched/request_queue.py, FCFSRequestQueue (a deque): add_request -> "
    "add_request (append), schedule() -> pop_request (popleft), _preempt_request -> "
    "prepend_request (appendleft) on self.running.pop() victims, finish_requests -> remove_requests.",
    tags=("policy:fcfs",),
    requires=("policy_fcfs",),
)
def waiting_queue_order(t: Transition, h: History) -> Iterator[Finding]:
    if t.after.config.policy != Policy.FCFS:
        return
    if t.after.config.kv_connector or any(r.spec.resumable for r in t.before.requests.values()):
        yield from _two_queue_order(t, h)  # (sessions that went on wait in kv_holding_waiting too)
        return
    now = set(t.after.waiting)
    returned = [rid for rid in t.before.running if rid in now]
    stayed = [rid for rid in t.before.waiting if rid in now]
    new = [rid for rid in t.after.waiting if rid not in t.before.requests]
    want = returned + stayed + new
    if list(t.after.waiting) != want:
        yield None, f"waiting queue is {list(t.after.waiting)}, FCFS order gives {want}"


def _two_queue_order(t: Transition, h: History) -> Iterator[Finding]:
    """waiting-queue-order with a KV connector: the view lists vLLM's
    kv_holding_waiting, then its waiting queue, each a FCFS queue. A request
    that starts an asynchronous load moves from waiting to the back of
    kv_holding_waiting (skip_request, step_skipped_kv_holding); one promoted
    from a failed load without computed tokens either stays in
    kv_holding_waiting or, skipped, moves to the front of waiting: its place
    is not checked."""
    before, after = t.before, t.after
    held_before = set(kv_holding_prefix(before, h))
    now = list(after.waiting)
    hold = [rid for rid in now if holds_kv_blocks(after, rid)]
    plain = [rid for rid in now if not holds_kv_blocks(after, rid) and rid not in held_before]
    hs, ps = set(hold), set(plain)
    want_hold = [r for r in before.waiting if r in hs and r in held_before]
    want_hold += [r for r in before.waiting if r in hs and r not in held_before]
    # a session that stopped and went on joins its back (update_from_output, continuing_reqs)
    want_hold += [r for r in before.running if r in hs]
    went_on = [r for r in (*before.running, *before.waiting)
               if r in ps and session_went_on(lookup(before, r), lookup(after, r))]
    want_plain = [r for r in (*before.running, *before.waiting) if r in ps and r not in went_on]
    want_plain += went_on + [r for r in plain if r not in before.requests]  # (went on: enqueued at the back)
    if hold != want_hold:
        yield None, f"kv_holding_waiting is {hold}, FCFS order gives {want_hold}"
    if plain != want_plain:
        yield None, f"waiting queue is {plain}, FCFS order gives {want_plain}"
    if hold and plain and now.index(hold[-1]) > now.index(plain[0]):
        yield None, f"waiting view {now} lists {hold[-1]} (holding KV blocks) after {plain[0]}"


@transition_invariant(
    "running-queue-update",
    "The running queue keeps its order: after an operation it is the requests of the old running "
    "queue that still run, in order, followed by this step's admissions in admission order.",
    "vllm/v1/core/sched/scheduler.py: schedule() appends admitted requests to self.running and "
    "removes victims (pop / del by index); update_from_output and finish_requests remove finished "
    "requests (remove_all), keeping the order of the rest.",
    tags=("policy:vllm-step",),
)
def running_queue_update(t: Transition, h: History) -> Iterator[Finding]:
    kept = [rid for rid in t.before.running if status_of(t.after, rid) == _S.RUNNING]
    adm = [s.request_id for s in admitted(t.plan)] if t.kind == "schedule" and t.plan is not None else []
    want = kept + adm
    if list(t.after.running) != want:
        yield None, f"running queue is {list(t.after.running)}, want {want}"


@transition_invariant(
    "blocks-only-grow",
    "Outside schedule(), a request that stays unfinished keeps its computed-token count and its "
    "block table; in schedule() a request that stays RUNNING only appends blocks.",
    "vllm/v1/core/kv_cache_manager.py, allocate_slots appends new blocks to req_to_blocks; only "
    "free() (finish, preemption) releases them; num_computed_tokens moves only in "
    "_update_after_schedule and _preempt_request (no spec decode in the modelled configuration).",
    tags=("safety",),
)
def blocks_only_grow(t: Transition, h: History) -> Iterator[Finding]:
    for rid, b in t.before.requests.items():
        a = t.after.requests.get(rid)
        if a is None:
            continue
        if t.kind == "schedule" or (t.kind == "reset" and a.status == _S.PREEMPTED):
            if b.status == a.status == _S.RUNNING and not tables_extend(t.after.config, b, a):
                yield rid, f"block tables {_fmt(b)} became {_fmt(a)}"
            continue
        # speculative decoding: update() rolls rejected drafts, and the tokens
        # trimmed after a stop, out of num_computed_tokens (update_from_output,
        # _update_request_with_output); it never adds any
        # a KV connector's failed load truncates the computed tokens
        # (scheduler.py, _handle_failed_recving, _update_requests_with_invalid_blocks)
        cfg = t.after.config
        failed = t.result is not None and bool(t.result.failed_recving or t.result.invalid_block_ids)
        rolled_back = (
            t.kind == "update"
            and (cfg.num_speculative_tokens > 0 or (cfg.kv_connector and failed) or session_went_on(b, a))
            and a.num_computed_tokens <= b.num_computed_tokens
        )  # (a session that goes on resumes from its materialized frontier: _handle_stopped_request)
        if tables(a) != tables(b) or (a.num_computed_tokens != b.num_computed_tokens and not rolled_back):
            yield rid, (
                f"{t.kind} changed computed tokens/blocks from {b.num_computed_tokens}/"
                f"{_fmt(b)} to {a.num_computed_tokens}/{_fmt(a)}"
            )


def _fmt(r: RequestView) -> str:
    """A request's block table, or every group's for a hybrid layout."""
    return str(list(r.block_ids)) if not r.group_block_ids else str([list(x) for x in r.group_block_ids])


@transition_invariant(
    "output-append-only",
    "Generated tokens are never lost or changed: a request's prompt never changes and its output "
    "only grows, by appending, and only in update(), across preemption and resumption too.",
    "vllm/v1/request.py, Request.append_output_token_ids is the only writer of _output_token_ids; "
    "scheduler.py, _preempt_request keeps them (recompute preemption: num_computed_tokens = 0 only).",
    tags=("safety",),
)
def output_append_only(t: Transition, h: History) -> Iterator[Finding]:
    added = t.request.request_id if t.kind == "add" and t.request is not None else None
    for views in (t.after.requests, t.after.finished):
        for rid, r in views.items():
            if rid == added:
                continue
            # Compare with the view before the operation and with what the
            # Monitor saw last (which catches a loss across operations a
            # driver did not show it).
            refs: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
            b = lookup(t.before, rid)
            if b is not None:
                refs.append(("before", b.spec.prompt_token_ids, b.output_token_ids))
            if rid in h.outputs:
                refs.append(("last seen", h.prompts.get(rid, r.spec.prompt_token_ids), h.outputs[rid]))
            for when, prompt, out in refs:
                if r.spec.resumable and r.spec.prompt_token_ids != prompt:
                    # a session went on: its outputs but the last sampled one joined the prompt
                    # (_update_request_as_session; session-continuation checks the rest)
                    if not is_prefix(prompt + out[:-1], r.spec.prompt_token_ids) or r.output_token_ids:
                        yield rid, f"session prompt {list(prompt)} + output {list(out)} ({when}) is now " \
                                   f"{list(r.spec.prompt_token_ids)} + {list(r.output_token_ids)}"
                    break
                if r.spec.prompt_token_ids != prompt:
                    yield rid, f"prompt {list(prompt)} ({when}) is now {list(r.spec.prompt_token_ids)}"
                    break
                if not is_prefix(out, r.output_token_ids):
                    yield rid, f"output {list(out)} ({when}) is now {list(r.output_token_ids)}: tokens lost or changed"
                    break
            else:
                if b is not None and len(r.output_token_ids) > len(b.output_token_ids) and t.kind != "update":
                    yield rid, f"output grew from {len(b.output_token_ids)} to {len(r.output_token_ids)} tokens in {t.kind}"


@transition_invariant(
    "update-appends-sampled-token",
    "update() appends to each running request whose step completes its known tokens exactly the "
    "one token sampled for it, and nothing to partial prefill chunks or unscheduled requests.",
    "vllm/v1/core/sched/scheduler.py, update_from_output: for each scheduled request, "
    "generated_token_ids from the runner (empty for a partial prefill, scheduler.py "
    "_update_request_with_output appends them one by one); max one token per step without spec decode.",
    ("update",),
    tags=("safety",),
)
def update_appends_sampled_token(t: Transition, h: History) -> Iterator[Finding]:
    assert t.plan is not None
    sampled = t.result.sampled if t.result is not None else {}
    planned = {s.request_id: s for s in t.plan.scheduled}
    mml = t.before.config.max_model_len
    failed = kv_load_failed(t)
    for rid, b in t.before.requests.items():
        a = lookup(t.after, rid)
        if a is None or rid in failed or session_went_on(b, a):
            continue  # a failed KV load's request gets no output; a session that went on: sessions.py
        s = planned.get(rid)
        toks = sampled.get(rid, ())
        is_async = t.before.config.max_concurrent_batches > 1  # steps in flight at an update
        stale = b.status == _S.PREEMPTED and is_async
        if s is not None and s.samples and (b.status == _S.RUNNING or stale) and toks:
            # the accepted drafts then the bonus token, up to the first that
            # stops the request (utils.py, check_stop after each)
            kept = _kept_tokens(b, toks, mml)
            want = b.output_token_ids + kept
            what = f"the sampled tokens {list(kept)} appended"
            if is_async and (b.num_preemptions > 0 or b.spec.resumable) and a.output_token_ids == b.output_token_ids:
                continue  # stale output of a reset_prefix_cache preemption, or of a session's stop: dropped
        else:
            want = b.output_token_ids
            what = "unchanged (" + ("not scheduled" if s is None else "partial prefill chunk") + ")"
            if s is not None and s.samples:
                what = "unchanged (no sampled token)"
        if a.output_token_ids != want:
            yield rid, f"output {list(b.output_token_ids)} became {list(a.output_token_ids)}, want {what}"


def _kept_tokens(b: RequestView, toks: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
    """The tokens of a result that update() appends to ``b``: all of them, or
    up to and including the first after which check_stop stops it."""
    for i, tok in enumerate(toks, 1):
        outputs = len(b.output_token_ids) + i
        if _stop_token(b, tok) or outputs >= b.spec.max_tokens or b.num_tokens + i >= max_model_len:
            return tuple(toks[:i])
    return tuple(toks)


def _stop_token(r: RequestView, token: int) -> bool:
    eos = r.spec.eos_token_id is not None and not r.spec.ignore_eos and token == r.spec.eos_token_id
    return eos or token in r.spec.stop_token_ids


@transition_invariant(
    "stop-conditions",
    "An unfinished request has fewer than max_tokens outputs; after update() a request is "
    "FINISHED_STOPPED iff its new token is eos (without ignore_eos) or a stop token, else "
    "FINISHED_LENGTH_CAPPED iff it reached max_tokens outputs or max_model_len tokens, else unfinished.",
    "vllm/v1/core/sched/utils.py, check_stop: eos_token_id (None under ignore_eos), then "
    "stop_token_ids, then num_tokens >= max_model_len or num_output_tokens >= max_tokens; "
    "called by scheduler.py, _update_request_with_output after each appended token.",
    tags=("safety",),
)
def stop_conditions(t: Transition, h: History) -> Iterator[Finding]:
    for rid, r in t.after.requests.items():
        if len(r.output_token_ids) >= r.spec.max_tokens and r.status != _S.WAITING_FOR_STREAMING_REQ:
            yield rid, f"unfinished with {len(r.output_token_ids)} outputs, max_tokens is {r.spec.max_tokens}"
    if t.kind != "update" or t.plan is None:
        return
    mml = t.after.config.max_model_len
    failed = kv_load_failed(t)
    for rid, b in t.before.requests.items():
        a = lookup(t.after, rid)
        if a is None or b.status != _S.RUNNING:
            continue
        grew = len(a.output_token_ids) > len(b.output_token_ids)
        if not grew:
            if a.status.is_finished and not (rid in failed and a.status == _S.FINISHED_ERROR):
                # (a failed KV load under "fail" finishes it without one: kv-load-failure-policy)
                yield rid, f"finished as {a.status.name} in update() without a new token"
            continue
        tok = a.output_token_ids[-1]
        if set(a.output_token_ids[len(b.output_token_ids):]) & set(a.spec.grammar_rejects):
            # the request's grammar refuses a sampled token: accept_tokens
            # fails and update_from_output finishes it with FINISHED_ERROR
            want = _S.FINISHED_ERROR
        elif _stop_token(a, tok):
            want = _S.FINISHED_STOPPED
        elif len(a.output_token_ids) >= a.spec.max_tokens or a.num_tokens >= mml:
            want = _S.FINISHED_LENGTH_CAPPED
        else:
            want = _S.RUNNING
        if a.status != want and not (want != _S.RUNNING and session_went_on(b, a)):
            yield rid, (
                f"token {tok} (output {len(a.output_token_ids)}/{a.spec.max_tokens}, {a.num_tokens}/{mml} "
                f"tokens, eos {a.spec.eos_token_id}, ignore_eos {a.spec.ignore_eos}, stop {list(a.spec.stop_token_ids)}) "
                f"left it {a.status.name}, want {want.name}"
            )


@transition_invariant(
    "finished-reported-once",
    "Every finished request is reported exactly once: the next plan's finished_ids are exactly "
    "(sorted) the requests finished since the previous plan, whose views stay in view.finished "
    "until then and leave it after.",
    "vllm/v1/core/sched/scheduler.py, _free_request adds the id to self.finished_req_ids; "
    "schedule() hands the set to SchedulerOutput.finished_req_ids and _update_after_schedule "
    "replaces it with an empty set.",
    tags=("safety",),
)
def finished_reported_once(t: Transition, h: History) -> Iterator[Finding]:
    if t.kind != "schedule":
        for rid in sorted(set(t.before.finished) - set(t.after.finished)):
            yield rid, f"dropped from view.finished by {t.kind} before any plan reported it"
        return
    assert t.plan is not None
    want = tuple(sorted(t.before.finished))
    if t.plan.finished_ids != want:
        yield None, f"plan {t.plan.step} reports finished_ids {list(t.plan.finished_ids)}, want {list(want)}"
    for rid in t.plan.finished_ids:
        if rid in h.reported_finished:
            yield rid, f"reported finished again in plan {t.plan.step}"
    if t.after.finished:
        yield None, f"view.finished still holds {sorted(t.after.finished)} after plan {t.plan.step}"


@transition_invariant(
    "free-queue-lru",
    "The free queue is an LRU list: freeing puts a request's newly free blocks, tail first, at the "
    "front if keyless and at the back if keyed; allocation takes from the front and a prefix hit "
    "removes its block; nothing else moves it (add, a pause and a grammar report leave it as it is).",
    "vllm/v1/core/block_pool.py, free_blocks (prepend_n keyless, append_n keyed, fed "
    "reversed(table) by single_type_kv_cache_manager.py, free, one call per KV cache group: "
    "kv_cache_coordinator.py, free), get_new_blocks (popleft_n), touch "
    "(remove); kv_cache_utils.py, FreeKVCacheBlockQueue. With a sliding-window or chunked-local "
    "group or a KV connector, schedule() also frees (remove_skipped_blocks, a failed load's promotion), and "
    "the schedule() check is left out.",
    tags=("policy:vllm-free-order",),
)
def free_queue_lru(t: Transition, h: History) -> Iterator[Finding]:
    before, after = list(t.before.kv.free_queue), list(t.after.kv.free_queue)
    keyed = t.after.kv.keyed_blocks()
    if t.kind in ("add", "pause", "grammar") or (t.kind == "reset" and not _reset_preempted(t)):
        if after != before:
            yield None, f"{t.kind} reordered the free queue: {before} -> {after}"
        return
    if t.kind in ("abort", "update"):
        # Frees only: after = front + before + back.
        extra = len(after) - len(before)
        if before:
            pos = [i for i in range(extra + 1) if after[i : i + len(before)] == before]
            if not pos:
                yield None, f"{t.kind} did not keep the free queue {before} in one piece: now {after}"
                return
            i = pos[0]
        else:
            i = 0
            while i < len(after) and after[i] not in keyed:
                i += 1
        front, back = after[:i], after[i + len(before) :]
        for b in front:
            if b in keyed:
                yield None, f"keyed block {b} was freed to the front of the free queue"
        for b in back:
            if b not in keyed:
                yield None, f"keyless block {b} was freed to the back of the free queue"
        if t.kind == "abort" and t.request_id is not None:
            r = t.before.requests.get(t.request_id)
            if r is not None:
                # each group's table is freed tail first, group after group, in
                # one free_blocks call per group (kv_cache_coordinator.py, free)
                gone = set(front) | set(back)
                calls = _abort_free_calls(t, r)
                want_front = [b for call in reversed(calls) for b in call if b in gone and b not in keyed]
                want_back = [b for call in calls for b in call if b in gone and b in keyed]
                if front != want_front or back != want_back:
                    yield t.request_id, (
                        f"freed blocks went front {front} / back {back}; table {_fmt(r)} "
                        f"tail first gives front {want_front} / back {want_back}"
                    )
        return
    cfg = t.before.config
    # a sliding-window or chunked-local group frees skipped blocks in schedule() and a failed KV
    # load's blocks are freed when the waiting loop promotes its request
    # (remove_skipped_blocks, _update_waiting_for_remote_kv): the check below
    # models allocation only
    frees_in_schedule = bool(skipping_groups(cfg)) or cfg.kv_connector
    if t.kind == "schedule" and t.plan is not None and not step_victims(t) and not frees_in_schedule:
        bs = t.before.config.block_size
        hits = {
            s.block_ids[i]
            for s in admitted(t.plan)
            for i in range(min(s.num_computed_tokens // bs, len(s.block_ids)))
        }
        rest = [b for b in before if b not in hits]
        if after != rest[len(rest) - len(after) :]:
            yield None, (
                f"free queue {after} after the step is not what allocating from the front of "
                f"{rest} leaves"
            )


def _abort_free_calls(t: Transition, r: RequestView) -> list[list[int]]:
    """The blocks an abort frees, one list per BlockPool.free_blocks call in
    vLLM's order: with a KV connector, first each sliding-window (or
    chunked-local) group's blocks newly outside the window (or before the
    chunk) of its processed tokens, backward
    (scheduler.py, _connector_finished -> remove_skipped_blocks,
    _remove_blocks_in_range); then each group's table tail first
    (kv_cache_coordinator.py, free, one call per group)."""
    cfg = t.before.config
    tabs = [list(tb) for tb in tables(r)]
    calls: list[list[int]] = []
    if cfg.kv_connector:
        inflight = sum(e.num_scheduled_tokens for p in t.in_flight for e in p.scheduled if e.request_id == r.request_id)
        processed = max(0, r.num_computed_tokens - inflight)
        for g, grp in enumerate(cfg.groups):
            if not kind_of(grp).skips or g >= len(tabs):
                continue
            k = min(skipped_blocks(grp, processed, cfg.block_size), len(tabs[g]))
            freed = []
            for i in range(k - 1, -1, -1):
                if tabs[g][i] == 0:
                    break
                freed.append(tabs[g][i])
                tabs[g][i] = 0
            calls.append(freed)
    calls.extend([b for b in reversed(tb) if b != 0] for tb in tabs)
    return calls


def _reset_preempted(t: Transition) -> bool:
    return any(
        status_of(t.after, rid) == _S.PREEMPTED
        for rid, r in t.before.requests.items()
        if r.status == _S.RUNNING
    )


@transition_invariant(
    "reset-prefix-cache",
    "reset_prefix_cache succeeds exactly when no block is held (after any requested preemption): "
    "then every key is dropped; otherwise the cache is unchanged.",
    "vllm/v1/core/block_pool.py, reset_prefix_cache: returns False unless every block but the "
    "null block is free; on success clears cached_block_hash_to_block and every block's hash.",
    ("reset",),
    tags=("safety",),
    requires=("reset_prefix_cache",),
)
def reset_prefix_cache(t: Transition, h: History) -> Iterator[Finding]:
    kv_b, kv_a = t.before.kv, t.after.kv
    held = [b for b, c in enumerate(kv_a.ref_cnt) if c > 0]
    if held:
        if (dict(kv_a.block_keys) != dict(kv_b.block_keys) or dict(kv_a.cache_index) != dict(kv_b.cache_index)
                or dict(kv_a.partial_index) != dict(kv_b.partial_index)):
            yield None, f"cache changed though blocks {held} are held"
    elif kv_a.block_keys or kv_a.cache_index or kv_a.partial_index:
        yield None, (
            f"no block is held, yet {len(kv_a.block_keys)} blocks keep keys after reset_prefix_cache"
        )
