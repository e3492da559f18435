"""The named decision branches of the spec: its rule-coverage catalogue.

Every branch of spec/scheduler.py and spec/kv_cache.py that decides something
carries a one-line marker ``self.rules["NAME"] += <1 or a condition>``; this
catalogue says what each NAME means and which vLLM 0.33 code it captures.
tests/check/test_rule_coverage.py scans the two files and fails when a marker
is missing from the catalogue or a catalogued name has no marker.

A run's counts (spec/coverage.py) tell how often each branch was taken, so a
gate can say which rules it never reached and be told to fail on them.
Paths are under vllm/v1/core/ unless they start with ``vllm/``.
"""

from __future__ import annotations

from dataclasses import dataclass


#: The four ways a scheduler runs (schedspec.check.workload.MODES).
ALL_MODES: tuple[str, ...] = ("sync", "async", "spec", "async-spec")


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    vllm: str  # file and function of vLLM 0.33 whose behaviour the branch captures
    #: the modes in which a run can take the branch (a rule out of reach in
    #: sync mode says why in its description)
    modes: tuple[str, ...] = ALL_MODES

    @property
    def group(self) -> str:
        """The part before the first dot: schedule, running, preempt, waiting,
        admit, kv, stop, update, abort, reset."""
        return self.name.split(".", 1)[0]


_SCHED = "sched/scheduler.py, Scheduler.schedule"
_SPEC_MODES: tuple[str, ...] = ("spec", "async-spec")
_ASYNC_MODES: tuple[str, ...] = ("async", "async-spec")

_RULES = (
    # -- one step
    Rule("schedule.threshold_active", "the long-prefill threshold is in force this step (set, and more than one request running or waiting)", _SCHED),
    Rule("schedule.waiting_skipped", "a step that preempted someone does not visit the waiting queue", _SCHED + " (if not preempted_reqs)"),
    # -- the RUNNING loop
    Rule("running.scheduled", "a running request gets its next chunk", _SCHED + ", RUNNING loop"),
    Rule("running.prefill_chunk", "a running request's chunk stops short of its known tokens (threshold, budget or max_model_len cut it)", _SCHED + ", RUNNING loop"),
    Rule("running.skip_no_tokens", "a running request with nothing to compute this step is skipped (continue, not break); out of reach without async scheduling, where a running request always has its next token to compute", _SCHED + ", RUNNING loop (num_new_tokens == 0: continue)", ("async", "async-spec")),
    Rule("running.stop_budget", "the token budget runs out with running requests not yet visited; out of reach without drafts, where only the tail of the running queue can be short of budget (each earlier request asks no more than it got the step before)", _SCHED + ", RUNNING loop (while token_budget > 0)", ("spec", "async-spec")),
    Rule("running.self_preempted_break", "FCFS: the request preempted itself; the RUNNING loop stops", _SCHED + ", RUNNING loop (preempted_req == request: break)"),
    Rule("running.self_preempted_continue", "PRIORITY: the request preempted itself; later running requests are still tried", _SCHED + ", RUNNING loop (continue after self-preemption)"),
    # -- preemption
    Rule("preempt.fcfs_tail", "FCFS: the pool is short and the tail of the running queue is preempted", _SCHED + " (self.running.pop()), _preempt_request"),
    Rule("preempt.priority_victim", "PRIORITY: the pool is short and the running request with the largest (priority, arrival) is preempted", _SCHED + " (max(self.running, key=...)), _preempt_request"),
    Rule("preempt.self", "the victim is the request being scheduled (it preempts itself)", _SCHED + " (preempted_req == request)"),
    Rule("preempt.victim_ahead", "PRIORITY: the victim sits before the current request in the running queue, whose index moves back", _SCHED + " (victim_index < req_index)"),
    Rule("preempt.budget_give_back", "a victim already scheduled this step gives its tokens back to the budget", _SCHED + " (preempted_req in scheduled_running_reqs)"),
    Rule("preempt.reset_running", "reset_prefix_cache(reset_running_requests=True) preempts a running request", "sched/scheduler.py, Scheduler.reset_prefix_cache"),
    # -- the WAITING loop
    Rule("waiting.stop_max_num_seqs", "the running queue is full (max_num_seqs); admission stops", _SCHED + ", WAITING loop (len(self.running) == self.max_num_running_reqs: break)"),
    Rule("waiting.stop_budget", "the token budget runs out with requests still waiting", _SCHED + ", WAITING loop (while token_budget > 0)"),
    Rule("admit.new", "a waiting request is admitted for the first time (NEW)", _SCHED + ", WAITING loop"),
    Rule("admit.resumed", "a preempted request is admitted again (RESUMED)", _SCHED + ", WAITING loop"),
    Rule("admit.prefill_chunk", "an admitted request's first chunk stops short of its tokens (chunked prefill)", _SCHED + ", WAITING loop"),
    Rule("admit.blocked_chunking_off", "chunked prefill is off and the rest of the prompt exceeds the budget: head-of-line block", _SCHED + ", WAITING loop (not enable_chunked_prefill and num_new_tokens > token_budget: break)"),
    Rule("admit.blocked_full_sequence", "scheduler_reserve_full_isl: the whole sequence does not fit the free blocks: head-of-line block", "kv_cache_manager.py, KVCacheManager.allocate_slots (full_sequence_must_fit)"),
    Rule("admit.blocked_blocks", "this step's blocks for the head of the queue do not fit: head-of-line block", _SCHED + ", WAITING loop (new_blocks is None: break)"),
    # -- the KV pool and the prefix cache
    Rule("kv.miss", "a prefix lookup finds no cached block", "kv_cache_manager.py, KVCacheManager.get_computed_blocks"),
    Rule("kv.hit_partial", "a prefix lookup hits some but not all of the blocks it may reuse", "single_type_kv_cache_manager.py, FullAttentionManager.find_longest_cache_hit"),
    Rule("kv.hit_full", "a prefix lookup hits every block it may reuse", "single_type_kv_cache_manager.py, FullAttentionManager.find_longest_cache_hit"),
    Rule("kv.hit_capped", "a full hit on tokens that fill whole blocks: the last block is recomputed for its logits", "kv_cache_manager.py, KVCacheManager.get_computed_blocks (max_cache_hit_length = num_tokens - 1)"),
    Rule("kv.touch_free", "a hit takes a free cached block (ref_cnt 0) out of the free queue", "block_pool.py, BlockPool.touch"),
    Rule("kv.touch_shared", "a hit shares a block another request holds", "block_pool.py, BlockPool.touch"),
    Rule("kv.evict_cached", "a block taken from the free queue still has a key: it is evicted from the prefix cache", "block_pool.py, BlockPool._maybe_evict_cached_block"),
    Rule("kv.evict_keeps_duplicate", "an evicted block's key stays cached under another block with the same tokens", "block_pool.py, BlockPool._maybe_evict_cached_block (BlockHashToBlockMap.pop)"),
    Rule("kv.cache_duplicate_key", "a newly full block gets a key already cached under another block", "block_pool.py, BlockPool.cache_full_blocks (BlockHashToBlockMap.insert)"),
    Rule("kv.free_front", "a freed block without a key (or caching off) goes to the front of the free queue", "block_pool.py, BlockPool.free_blocks"),
    Rule("kv.free_back", "a freed block with a key goes to the back of the free queue (LRU)", "block_pool.py, BlockPool.free_blocks"),
    Rule("kv.free_shared", "a freed table's block is still held by another request and stays out of the free queue", "block_pool.py, BlockPool.free_blocks (ref_cnt > 0)"),
    Rule("kv.reset_ok", "reset_prefix_cache drops every key (no block held)", "block_pool.py, BlockPool.reset_prefix_cache"),
    Rule("kv.reset_refused", "reset_prefix_cache is refused because blocks are held", "block_pool.py, BlockPool.reset_prefix_cache (num_used_blocks != 1: return False)"),
    # -- update and stop
    Rule("update.no_token", "a scheduled entry samples nothing (a prefill chunk)", "sched/scheduler.py, Scheduler.update_from_output"),
    Rule("stop.eos", "the request stops on its eos token", "sched/utils.py, check_stop"),
    Rule("stop.stop_token", "the request stops on one of its stop token ids", "sched/utils.py, check_stop"),
    Rule("stop.max_tokens", "the request reaches max_tokens outputs", "sched/utils.py, check_stop"),
    Rule("stop.max_model_len", "the request reaches max_model_len tokens", "sched/utils.py, check_stop"),
    # -- speculative decoding (num_speculative_tokens > 0)
    Rule("spec.drafts_scheduled", "a running request's step verifies drafts (they reach past its known and in-flight tokens)", _SCHED + ", RUNNING loop (scheduled_spec_decode_tokens)", _SPEC_MODES),
    Rule("spec.drafts_cut", "the budget, threshold or max_model_len cut a step short of some of the request's drafts", _SCHED + ", RUNNING loop (spec_token_ids[:num_scheduled_spec_tokens])", _SPEC_MODES),
    Rule("spec.drafts_unscheduled", "a request holding drafts is scheduled short of all of them; they are dropped", _SCHED + ", RUNNING loop (request.spec_token_ids = [])", _SPEC_MODES),
    Rule("admit.padded_decode", "a newly admitted request with one token to compute is padded to 1 + k tokens with k placeholder drafts", _SCHED + ", WAITING loop (pad_spec_decode)", _SPEC_MODES),
    Rule("admit.blocked_padding", "a due padding of 1 + k tokens does not fit the budget: the WAITING loop stops", _SCHED + ", WAITING loop (padded_num_tokens > request_token_budget: break)", _SPEC_MODES),
    Rule("spec.all_accepted", "every draft of a step is accepted", "sched/scheduler.py, Scheduler.update_from_output (num_rejected == 0)", _SPEC_MODES),
    Rule("spec.some_rejected", "drafts are rejected and num_computed_tokens (and the placeholders) roll back", "sched/scheduler.py, Scheduler.update_from_output (num_computed_tokens -= num_rejected)", _SPEC_MODES),
    Rule("spec.stop_inside_run", "the request stops inside an accepted run; the tokens after the stop are dropped", "sched/scheduler.py, Scheduler._update_request_with_output (del new_token_ids[num_new:])", _SPEC_MODES),
    Rule("spec.drafts_set", "drafts proposed after a step become the request's drafts for its next step", "sched/scheduler.py, Scheduler.update_draft_token_ids", ("spec",)),
    Rule("spec.drafts_for_finished", "drafts for a request that finished in this update are ignored", "sched/scheduler.py, Scheduler.update_draft_token_ids (request is None or finished: continue)", ("spec",)),
    # -- async scheduling (one step in flight)
    Rule("async.placeholders_added", "a step that samples counts its output tokens (1 + drafts) as placeholders and gives the request k placeholder drafts", "sched/async_scheduler.py, AsyncScheduler._update_after_schedule", _ASYNC_MODES),
    Rule("running.skip_max_tokens_in_flight", "the steps in flight surely bring the request to max_tokens: it is skipped", _SCHED + ", RUNNING loop (num_computed_tokens + 2 - num_output_placeholders >= ...: continue)", _ASYNC_MODES),
    Rule("waiting.skip_stale_output", "a preempted request whose in-flight output is still to be delivered is passed over; out of reach in the modelled engine (one plan in flight at a schedule): a request is preempted either by the RUNNING loop, whose step skips the WAITING loop, or by reset_prefix_cache, whose stale output is dropped, and its stale output drains at the update before the next schedule", _SCHED + ", WAITING loop (num_stale_output_tokens and not drop_stale_output: skip_request)", ()),
    Rule("async.stale_output", "a step's output arrives for a request preempted after the step was scheduled (stale)", "sched/scheduler.py, Scheduler.update_from_output (num_stale_output_tokens)", _ASYNC_MODES),
    Rule("async.stale_dropped", "stale output of a request preempted by reset_prefix_cache is dropped", "sched/scheduler.py, Scheduler.update_from_output (output_is_stale and drop_stale_output: continue)", _ASYNC_MODES),
    Rule("async.stale_output_stopped", "stale output stops a preempted request, which leaves the waiting queue", "sched/scheduler.py, Scheduler.update_from_output (stopped_preempted_reqs)", _ASYNC_MODES),
    Rule("update.request_gone", "a step's output arrives for a request aborted or finished while it ran: dropped", "sched/scheduler.py, Scheduler.update_from_output (request is None: continue)"),
    # -- abort
    Rule("abort.waiting", "a waiting request (never run) is aborted", "sched/scheduler.py, Scheduler.finish_requests"),
    Rule("abort.preempted", "a preempted request is aborted", "sched/scheduler.py, Scheduler.finish_requests"),
    Rule("abort.running", "a running request is aborted and its blocks freed", "sched/scheduler.py, Scheduler.finish_requests"),
)

#: name -> Rule, in catalogue order.
RULES: dict[str, Rule] = {r.name: r for r in _RULES}
assert len(RULES) == len(_RULES), "duplicate rule name"

#: every rule name, in catalogue order
RULE_NAMES: tuple[str, ...] = tuple(RULES)


def reachable_in(modes: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The rules a run drawing from ``modes`` can reach, in catalogue order."""
    return tuple(r.name for r in _RULES if set(r.modes) & set(modes))


def describe(name: str) -> str:
    """One line: the rule's meaning and its vLLM source."""
    r = RULES[name]
    return f"{r.name}: {r.description} ({r.vllm})"
