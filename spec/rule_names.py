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


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    vllm: str  # file and function of vLLM 0.33 whose behaviour the branch captures

    @property
    def group(self) -> str:
        """The part before the first dot: schedule, running, preempt, waiting,
        admit, kv, stop, update, abort, reset."""
        return self.name.split(".", 1)[0]


_SCHED = "sched/scheduler.py, Scheduler.schedule"

_RULES = (
    # -- one step
    Rule("schedule.threshold_active", "the long-prefill threshold is in force this step (set, and more than one request running or waiting)", _SCHED),
    Rule("schedule.waiting_skipped", "a step that preempted someone does not visit the waiting queue", _SCHED + " (if not preempted_reqs)"),
    # -- the RUNNING loop
    Rule("running.scheduled", "a running request gets its next chunk", _SCHED + ", RUNNING loop"),
    Rule("running.prefill_chunk", "a running request's chunk stops short of its known tokens (threshold, budget or max_model_len cut it)", _SCHED + ", RUNNING loop"),
    Rule("running.skip_no_tokens", "a running request with nothing to compute this step is skipped (continue, not break)", _SCHED + ", RUNNING loop (num_new_tokens == 0: continue)"),
    Rule("running.stop_budget", "the token budget runs out with running requests not yet visited", _SCHED + ", RUNNING loop (while token_budget > 0)"),
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


def describe(name: str) -> str:
    """One line: the rule's meaning and its vLLM source."""
    r = RULES[name]
    return f"{r.name}: {r.description} ({r.vllm})"
