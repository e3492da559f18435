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


#: The four ways a scheduler runs (schedspec.check.features.MODES).
ALL_MODES: tuple[str, ...] = ("sync", "async", "spec", "async-spec")

#: The KV dimensions' capabilities, streaming-input sessions ("sessions": RequestSpec.resumable) and
#: Model Runner V2's throttle and the drafter ("runner_v2": model_runner "v2", pipeline, async, drafter), and a
#: drafter with its own forward pass ("drafters": EAGLE's hash lookahead): a rule
#: that needs a KV connector config carries ``gates=("kv_connector",)``, one
#: of hybrid KV cache groups ``("hybrid_kv",)``; reachable_in reaches them
#: only when those names are among its ``gates``.
ALL_KV: tuple[str, ...] = ("kv_connector", "hybrid_kv", "sessions", "runner_v2", "drafters")

#: The admission gates (schedspec.check.capabilities names them alike).
ALL_GATES: tuple[str, ...] = (
    "watermark",
    "prefill_cadence",
    "pause",
    "lora",
    "structured_output",
    "encoder",
)


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    vllm: str  # file and function of vLLM 0.33 whose behaviour the branch captures
    #: the modes in which a run can take the branch (a rule out of reach in
    #: sync mode says why in its description)
    modes: tuple[str, ...] = ALL_MODES
    #: the admission gates a run must have on to take the branch (every one
    #: of them; empty for a rule of the ungated scheduler): the capability
    #: names of schedspec.check.capabilities
    gates: tuple[str, ...] = ()

    @property
    def group(self) -> str:
        """The part before the first dot: schedule, running, preempt, waiting,
        admit, kv, stop, update, abort, reset, and the gates' watermark,
        cadence, pause, lora, grammar, encoder."""
        return self.name.split(".", 1)[0]


_SCHED = "sched/scheduler.py, Scheduler.schedule"
_SPEC_MODES: tuple[str, ...] = ("spec", "async-spec")
_ASYNC_MODES: tuple[str, ...] = ("async", "async-spec")
#: the capability a run needs for the KV connector's rules
_CONN: tuple[str, ...] = ("kv_connector",)
_SESS: tuple[str, ...] = ("sessions",)

_RULES = (
    # -- one step
    Rule("schedule.threshold_active", "the long-prefill threshold is in force this step (set, and more than one request running or waiting)", _SCHED),
    Rule("schedule.waiting_skipped", "a step that preempted someone does not visit the waiting queue", _SCHED + " (if not preempted_reqs)"),
    # -- the RUNNING loop
    Rule("running.scheduled", "a running request gets its next chunk", _SCHED + ", RUNNING loop"),
    Rule("running.prefill_chunk", "a running request's chunk stops short of its known tokens (threshold, budget or max_model_len cut it)", _SCHED + ", RUNNING loop"),
    Rule("running.skip_no_tokens", "a running request with nothing to compute this step is skipped (continue, not break); out of reach without async scheduling, where a running request always has its next token to compute (but for a Mamba group's chunk split to 0 tokens, mamba.chunk_none, whose layouts are drawn only on opt-in)", _SCHED + ", RUNNING loop (num_new_tokens == 0: continue)", ("async", "async-spec")),
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
    Rule("kv.hash_lookahead_wait", "EAGLE's hash lookahead: a full block is not cached yet because the tokens after it its key covers are not all known", "v1/core/kv_cache_utils.py, get_request_block_hasher (request.num_tokens - num_hash_lookahead_tokens); single_type_kv_cache_manager.py, SingleTypeKVCacheManager.cache_blocks", _SPEC_MODES, gates=("drafters",)),
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
    Rule("spec.drafts_after_chunk_dropped", "drafts proposed for a request whose step was a partial prefill chunk are dropped (a drafter with its own forward pass proposes for every request of the batch)", "sched/scheduler.py, Scheduler.update_draft_token_ids (request.is_prefill_chunk: spec_token_ids = [])", ("spec",)),
    Rule("spec.drafts_for_finished", "drafts for a request that finished in this update are ignored", "sched/scheduler.py, Scheduler.update_draft_token_ids (request is None or finished: continue)", ("spec",)),
    # -- async scheduling (one step in flight)
    Rule("async.placeholders_added", "a step that samples counts its output tokens (1 + drafts) as placeholders and gives the request k placeholder drafts", "sched/async_scheduler.py, AsyncScheduler._update_after_schedule", _ASYNC_MODES),
    Rule("running.skip_max_tokens_in_flight", "the steps in flight surely bring the request to max_tokens: it is skipped", _SCHED + ", RUNNING loop (num_computed_tokens + 2 - num_output_placeholders >= ...: continue)", _ASYNC_MODES),
    Rule("waiting.skip_stale_output", "a preempted request whose in-flight output is still to be delivered is passed over; reached with k >= 3 plans in flight (pipeline_parallel_size >= 3, which the catalogue's modes do not name), out of reach with one plan in flight at a schedule: a request is preempted either by the RUNNING loop, whose step skips the WAITING loop, or by reset_prefix_cache, whose stale output is dropped, and its stale output drains at the update before the next schedule", _SCHED + ", WAITING loop (num_stale_output_tokens and not drop_stale_output: skip_request)", ()),
    Rule("async.stale_output", "a step's output arrives for a request preempted after the step was scheduled (stale)", "sched/scheduler.py, Scheduler.update_from_output (num_stale_output_tokens)", _ASYNC_MODES),
    Rule("async.stale_dropped", "stale output of a request preempted by reset_prefix_cache is dropped", "sched/scheduler.py, Scheduler.update_from_output (output_is_stale and drop_stale_output: continue)", _ASYNC_MODES),
    Rule("async.stale_output_stopped", "stale output stops a preempted request, which leaves the waiting queue", "sched/scheduler.py, Scheduler.update_from_output (stopped_preempted_reqs)", _ASYNC_MODES),
    Rule("update.request_gone", "a step's output arrives for a request aborted or finished while it ran: dropped", "sched/scheduler.py, Scheduler.update_from_output (request is None: continue)"),
    # -- the watermark (config.watermark > 0)
    Rule("watermark.admitted", "a waiting request is admitted with watermark_blocks kept free (some request is running)", "kv_cache_manager.py, KVCacheManager.allocate_slots (required_blocks = num_blocks_to_allocate + watermark_blocks)", gates=("watermark",)),
    Rule("watermark.blocked_full_sequence", "scheduler_reserve_full_isl: a whole sequence that fits the free pool is held back by the watermark: head-of-line block", "kv_cache_manager.py, KVCacheManager.allocate_slots (full_sequence_must_fit, + watermark_blocks)", gates=("watermark",)),
    Rule("watermark.blocked", "a waiting request whose blocks fit the free pool is held back by the watermark: head-of-line block", "kv_cache_manager.py, KVCacheManager.allocate_slots (has_scheduled_reqs and WAITING/PREEMPTED: watermark_blocks)", gates=("watermark",)),
    # -- the prefill cadence (prefill_schedule_interval > 1)
    Rule("cadence.hold", "the interval since the last prefill-carrying step has not passed and a request is decoding: prefill is held this step", _SCHED + " (local prefill cadence: defer_prefills)", gates=("prefill_cadence",)),
    Rule("v2.decode_throttled", "V2 runner + pipeline + async: a running request scheduled fewer than pipeline_parallel_size steps ago is passed over (continue)", _SCHED + ", RUNNING loop (current_step < request.next_decode_eligible_step); sched/async_scheduler.py, AsyncScheduler._update_after_schedule", _ASYNC_MODES, gates=("runner_v2",)),
    Rule("v2.drafts_skipped", "V2 runner + a draft-model drafter (lookahead slots): no request scheduled this step, preempted later in it or not, can use the drafts proposed after it (a non-final prefill chunk, or a step sure to reach max_tokens): the plan says skip_drafts", _SCHED + ", Scheduler.__init__ (can_skip_drafts), Scheduler.schedule (drafts_needed; SchedulerOutput skip_drafts=not drafts_needed) and Scheduler._drafts_unused", ("spec", "async-spec"), gates=("runner_v2",)),
    Rule("running.stop_draft_slots", "a draft-model drafter takes a batch slot per scheduled request besides its tokens: the input budget is down to the draft slots, so the RUNNING loop ends (break)", _SCHED + ", Scheduler.schedule, RUNNING loop (input_budget <= draft_slots: break; draft_slots = SpeculativeConfig.max_num_new_slots_for_drafting)", ("spec", "async-spec"), gates=("runner_v2",)),
    Rule("waiting.stop_draft_slots", "a draft-model drafter: the input budget is down to the draft slots, so the WAITING loop ends (break)", _SCHED + ", Scheduler.schedule, WAITING loop (not request_queue or input_budget <= draft_slots: break)", ("spec", "async-spec"), gates=("runner_v2",)),
    Rule("cadence.running_chunk_held", "a running prefill chunk is skipped in a held step (continue)", _SCHED + ", RUNNING loop (defer_prefills and request.is_prefill_chunk)", gates=("prefill_cadence",)),
    Rule("cadence.admission_held", "a waiting request with prompt left to compute stops the WAITING loop in a held step", _SCHED + ", WAITING loop (defer_prefills and num_computed_tokens < num_tokens - 1: break)", gates=("prefill_cadence",)),
    Rule("cadence.restart", "a step carried prefill (a running chunk or an admission with prompt left): the interval restarts from it", _SCHED + " (last_prefill_step = num_executed_steps)", gates=("prefill_cadence",)),
    # -- the pause states (set_pause_state)
    Rule("pause.all_empty_step", "PAUSED_ALL: the token budget is 0, nothing is scheduled", _SCHED + " (PauseState.PAUSED_ALL: token_budget = 0)", gates=("pause",)),
    Rule("pause.new_no_admission", "PAUSED_NEW: the WAITING loop admits nothing (no waiting request holds KV blocks)", _SCHED + ", WAITING loop (kv_holding_waiting only, unless UNPAUSED)", gates=("pause",)),
    # -- LoRA (max_loras >= 1)
    Rule("lora.admitted_adapter", "a waiting request with an adapter passes the max_loras check", _SCHED + ", WAITING loop (max_loras check)", gates=("lora",)),
    Rule("lora.skip_max_loras", "a waiting request whose adapter would exceed max_loras distinct adapters is passed over (skip, not a stop)", _SCHED + ", WAITING loop (len(scheduled_loras) == max_loras: skip_request)", gates=("lora",)),
    # -- structured outputs (a grammar per request)
    Rule("grammar.wait_at_add", "a request with structured output starts waiting for its grammar", "vllm/v1/request.py, Request.__init__ (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR); sched/scheduler.py, _enqueue_waiting_request", gates=("structured_output",)),
    Rule("grammar.skip_compiling", "the WAITING loop passes over a request whose grammar still compiles", "sched/scheduler.py, Scheduler._handle_blocked_waiting_request (grammar is None)", gates=("structured_output",)),
    Rule("grammar.ready", "the WAITING loop finds the grammar compiled: the request becomes WAITING and may be admitted in this step", "sched/scheduler.py, Scheduler._handle_blocked_waiting_request", gates=("structured_output",)),
    Rule("grammar.compile_error", "the WAITING loop finds the grammar failed: the request is passed over and recorded for an error", "sched/scheduler.py, Scheduler._handle_blocked_waiting_request (grammar_compile_error_reqs)", gates=("structured_output",)),
    Rule("grammar.finished_error", "the next update finishes a request whose grammar failed with FINISHED_ERROR", "sched/scheduler.py, Scheduler.update_from_output (finish_requests(..., FINISHED_ERROR))", gates=("structured_output",)),
    Rule("grammar.abort_waiting", "a request waiting for its grammar is aborted", "sched/scheduler.py, Scheduler.finish_requests", gates=("structured_output",)),
    Rule("grammar.drafts_cut", "drafts proposed after a step are cut at the first token the request's grammar refuses", "sched/scheduler.py, Scheduler.update_draft_token_ids (StructuredOutputManager.validate_tokens)", ("spec",), gates=("structured_output",)),
    Rule("grammar.refused_sample", "a sampled token the request's grammar refuses finishes it with FINISHED_ERROR; out of reach with the fake model, which never samples a refused token", "sched/scheduler.py, Scheduler.update_from_output (accept_tokens fails)", (), gates=("structured_output",)),
    # -- the multimodal encoder (encoder budget and cache)
    Rule("encoder.scheduled", "a scheduled request runs encoder inputs this step, spending the encoder budget and taking cache space", "sched/scheduler.py, Scheduler._try_schedule_encoder_inputs, _allocate_encoder_inputs", gates=("encoder",)),
    Rule("encoder.cache_hit", "an encoder input's output is cached (this request or another computed it): reused, not run", "encoder_cache_manager.py, EncoderCacheManager.check_and_update_cache", gates=("encoder",)),
    Rule("encoder.duplicate_input", "an input whose identifier the same request runs earlier in this step shares that run", "sched/scheduler.py, Scheduler._try_schedule_encoder_inputs (item_identifier in mm_hashes_to_schedule)", gates=("encoder",)),
    Rule("encoder.evicted", "making room for an input evicts the oldest unreferenced cache entries", "encoder_cache_manager.py, EncoderCacheManager.can_allocate", gates=("encoder",)),
    Rule("encoder.chunk_cut", "an input beyond the encoder budget or cache cuts the chunk just before it", "sched/scheduler.py, Scheduler._try_schedule_encoder_inputs (num_computed_tokens < start_pos)", gates=("encoder",)),
    Rule("encoder.blocked_inside", "the chunk starts inside an input that does not fit: no token this step", "sched/scheduler.py, Scheduler._try_schedule_encoder_inputs (num_new_tokens = 0)", gates=("encoder",)),
    Rule("encoder.running_no_token", "a running request's chunk starts inside an encoder input that does not fit: it is skipped this step (continue)", _SCHED + ", RUNNING loop (num_new_tokens == 0 after _try_schedule_encoder_inputs)", gates=("encoder",)),
    Rule("encoder.admission_passed_over", "a waiting request left no token by its encoder inputs is passed over (skip, not a stop)", _SCHED + ", WAITING loop (num_new_tokens == 0: skip_request)", gates=("encoder",)),
    Rule("encoder.budget_given_back", "PRIORITY: a victim scheduled this step gives its encoder inputs' embeddings back to the encoder budget", _SCHED + ", RUNNING loop (encoder_compute_budget += num_embeds_to_restore)", gates=("encoder",)),
    Rule("encoder.input_done", "after a step an input wholly inside the computed tokens drops the request's cache reference", "sched/scheduler.py, Scheduler._free_encoder_inputs", gates=("encoder",)),
    # -- abort
    Rule("abort.waiting", "a waiting request (never run) is aborted", "sched/scheduler.py, Scheduler.finish_requests"),
    Rule("abort.preempted", "a preempted request is aborted", "sched/scheduler.py, Scheduler.finish_requests"),
    Rule("abort.running", "a running request is aborted and its blocks freed", "sched/scheduler.py, Scheduler.finish_requests"),
    # -- hybrid KV cache groups (config.kv_cache_groups: spec/kv_groups.py, spec/kv_cache.py)
    Rule("kv_groups.hit_cut_by_group", "a hybrid lookup ends shorter than some group alone would hit (a sliding-window group cut the full-attention hit, or the fixed point over the groups shortened it): the uncached common prefix makes the request's shared-prefix junction", "kv_cache_coordinator.py, HybridKVCacheCoordinator.find_longest_cache_hit; kv_cache_manager.py, KVCacheManager.get_computed_blocks (shared_prefix_boundary)", gates=("hybrid_kv",)),
    Rule("kv_groups.hit_skipped_in_window", "an admission's hit reaches past a sliding window: the hit blocks wholly before it are not touched and stand as the null block in the group's table", "single_type_kv_cache_manager.py, SingleTypeKVCacheManager.add_local_computed_blocks (num_skipped_blocks > 0)", gates=("hybrid_kv",)),
    Rule("kv_groups.window_freed", "blocks wholly outside a sliding window are freed before an allocation (last skipped first, stopping at a null block) and the null block takes their places", "single_type_kv_cache_manager.py, SingleTypeKVCacheManager.remove_skipped_blocks, _remove_blocks_in_range (called by kv_cache_manager.py, KVCacheManager.allocate_slots)", gates=("hybrid_kv",)),
    Rule("kv_groups.cache_masked", "a sliding-window group leaves newly full blocks without a key: with retention interval 0 it caches only the blocks right before the replay boundary (num_prompt_tokens - 1) and a shared-prefix junction", "single_type_kv_cache_manager.py, SlidingWindowManager.reachable_block_mask; BlockPool.cache_full_blocks (block_mask)", gates=("hybrid_kv",)),
    Rule("kv_groups.admission_capped", "the full-sequence gate counts a sliding-window group at its admission cap (window - 1 plus the tokens in flight, one block more), not the whole sequence", "single_type_kv_cache_manager.py, SingleTypeKVCacheManager.get_num_blocks_to_allocate (apply_admission_cap); vllm/v1/kv_cache_interface.py, SlidingWindowSpec.max_admission_blocks_per_request", gates=("hybrid_kv",)),
    # -- chunked local attention (KVCacheGroup kind "chunked_local")
    Rule("kv_groups.hit_skipped_in_chunk", "an admission's hit reaches past the start of a chunked-local group's current chunk: the hit blocks wholly before it ((hit // chunk) * chunk tokens, the lookup's nulls) are not touched and stand as the null block in the group's table", "single_type_kv_cache_manager.py, ChunkedLocalAttentionManager.find_longest_cache_hit (null blocks before local_attention_start_idx), get_num_skipped_tokens; SingleTypeKVCacheManager.add_local_computed_blocks", gates=("hybrid_kv",)),
    Rule("kv_groups.chunk_freed", "blocks wholly before the chunk of the next processed token are freed before an allocation (last skipped first, stopping at a null block) and the null block takes their places", "single_type_kv_cache_manager.py, ChunkedLocalAttentionManager.get_num_skipped_tokens ((n // chunk) * chunk); SingleTypeKVCacheManager.remove_skipped_blocks, _remove_blocks_in_range", gates=("hybrid_kv",)),
    Rule("kv_groups.chunk_admission_capped", "the full-sequence gate counts a chunked-local group at its admission cap (cdiv(min(chunk + the tokens in flight, max_model_len), block_size)), not the whole sequence", "single_type_kv_cache_manager.py, SingleTypeKVCacheManager.get_num_blocks_to_allocate (apply_admission_cap), get_manager_for_kv_cache_spec; vllm/v1/kv_cache_interface.py, ChunkedLocalAttentionSpec.max_admission_blocks_per_request", gates=("hybrid_kv",)),
    # -- Mamba groups in "align" mode (spec/mamba.py)
    Rule("kv_groups.hit_before_state", "an admission's hit in a Mamba group is one state block; the places before it stand as the null block in the group's table", "single_type_kv_cache_manager.py, MambaManager.find_longest_cache_hit (null blocks before the hit), get_num_skipped_tokens (n - 1); SingleTypeKVCacheManager.add_local_computed_blocks", gates=("hybrid_kv",)),
    Rule("kv_groups.state_freed", "a Mamba group frees the unretired blocks before the state of the last processed token and the previous step's state block, the null block taking their places", "single_type_kv_cache_manager.py, MambaManager.remove_skipped_blocks (last_state_block_idx), _remove_blocks_in_range (_num_retired_blocks)", gates=("hybrid_kv",)),
    Rule("kv_groups.state_hit_deferred", "a hit on a Mamba state block another request cached this step is put off to a later step (more blocks than the pool has)", "single_type_kv_cache_manager.py, MambaManager.get_num_blocks_to_allocate (cached_blocks_this_step: num_gpu_blocks + 1)", gates=("hybrid_kv",)),
    Rule("kv_groups.partial_stored", "a full-attention group registers its prompt's last hash boundary inside a block as a partial prefix-cache entry", "block_pool.py, BlockPool.cache_partial_block", gates=("hybrid_kv",)),
    Rule("kv_groups.partial_again", "a block already carries the partial entry cache_blocks would register: nothing changes, no event", "block_pool.py, BlockPool.cache_partial_block", gates=("hybrid_kv",)),
    Rule("kv_groups.partial_removed", "a block's partial entries are removed with it (eviction), after its full key, one BlockRemoved each", "block_pool.py, BlockPool._remove_cached_block_hashes", gates=("hybrid_kv",)),
    Rule("mamba.chunk_aligned", "with a Mamba group in align mode a prefill chunk is cut to end on the state grid: a block boundary, the last cacheable position or the shared-prefix junction", "sched/scheduler.py, Scheduler._mamba_block_aligned_split", gates=("hybrid_kv",)),
    Rule("mamba.chunk_none", "a prefill chunk shorter than a block that cannot reach a block boundary is cut to 0 tokens: the request is skipped (running) or the waiting loop stops", "sched/scheduler.py, Scheduler._mamba_block_aligned_split (max(end - start, 0)); Scheduler.schedule (num_new_tokens == 0)", gates=("hybrid_kv",)),
    # -- the KV connector (spec/connector.py; config.kv_connector)
    Rule("connector.external_hit", "the connector offers external tokens beyond the block-aligned local hit: they count as computed", _SCHED + ", WAITING loop (get_num_new_matched_tokens, num_external_computed_tokens)", gates=_CONN),
    Rule("connector.external_within_local", "the request's external tokens lie within its local prefix hit: the connector offers none", "vllm/distributed/kv_transfer/kv_connector/v1/base.py, KVConnectorBase_V1.get_num_new_matched_tokens (the modelled connector)", gates=_CONN),
    Rule("connector.load_sync", "a synchronous load of the external tokens is planned in the admitting step (KVLoad asynchronous=False); its blocks are cached at allocation", _SCHED + ", WAITING loop (update_state_after_alloc, has_sync_kv_loads); kv_cache_manager.py, allocate_slots", gates=_CONN),
    Rule("connector.load_async", "an asynchronous load starts: blocks for the local hit and the external tokens, the request WAITING_FOR_REMOTE_KVS in kv_holding_waiting, nothing scheduled", _SCHED + ", WAITING loop (load_kv_async: allocate_slots with delay_cache_blocks, WAITING_FOR_REMOTE_KVS, skip_request)", gates=_CONN),
    Rule("connector.load_blocked_reserve", "an asynchronous load would fit the pool but not beside the in-flight prefills' reservation: the WAITING loop stops", _SCHED + ", WAITING loop (reserved_blocks = _inflight_prefill_reserved_blocks + _spec_decode_step_blocks); kv_cache_manager.py, allocate_slots", gates=_CONN),
    Rule("connector.skip_loading", "the WAITING loop passes over a request whose load is not reported yet", "sched/scheduler.py, Scheduler._handle_blocked_waiting_request (not in finished_recving_kv_req_ids)", gates=_CONN),
    Rule("connector.load_done", "the worker reports a load finished: the request is marked for promotion", "sched/scheduler.py, Scheduler._update_from_kv_xfer_finished (finished_recving_kv_req_ids)", gates=_CONN),
    Rule("connector.load_done_after_finish", "the worker reports the load of a request finished meanwhile (aborted or failed): its kept blocks are freed", "sched/scheduler.py, Scheduler._update_from_kv_xfer_finished (_free_blocks)", gates=_CONN),
    Rule("connector.load_promoted", "the WAITING loop promotes a loaded request: its loaded blocks are cached, it becomes WAITING or PREEMPTED", "sched/scheduler.py, Scheduler._update_waiting_for_remote_kv, _handle_blocked_waiting_request", gates=_CONN),
    Rule("connector.load_last_token", "a load covered every token: the last one is left to compute (num_computed_tokens = num_tokens - 1)", "sched/scheduler.py, Scheduler._update_waiting_for_remote_kv", gates=_CONN),
    Rule("connector.reload_held", "a promoted load of a one-token prompt keeps its block with nothing computed (num_tokens - 1 = 0): it is looked up again and the stateless connector offers the token again, loaded into the block it holds", _SCHED + ", WAITING loop (num_computed_tokens == 0 branch after _update_waiting_for_remote_kv); kv_cache_manager.py, allocate_slots (a request with blocks takes no new hit)", gates=_CONN),
    Rule("connector.admit_loaded", "a promoted request is admitted with its loaded tokens computed and its blocks kept (no prefix lookup)", _SCHED + ", WAITING loop (num_computed_tokens > 0 branch)", gates=_CONN),
    Rule("connector.failed_recompute", "recompute policy: a whole load failed; nothing of it counts as computed", "sched/scheduler.py, Scheduler._handle_failed_recving", gates=_CONN),
    Rule("connector.failed_ignored", "a failed load is reported for a request no longer loading (aborted meanwhile): ignored", "sched/scheduler.py, Scheduler._handle_failed_recving", gates=_CONN),
    Rule("connector.invalid_truncated", "a request's computed tokens are truncated at its first invalid block", "sched/scheduler.py, Scheduler._update_requests_with_invalid_blocks", gates=_CONN),
    Rule("connector.invalid_shared", "every invalid block of a request was marked by an earlier request: it keeps its computed tokens (the first one recomputes them)", "sched/scheduler.py, Scheduler._update_requests_with_invalid_blocks (not marked_invalid_block)", gates=_CONN),
    Rule("connector.invalid_fail", "fail policy: invalid blocks lose their prefix-cache keys and the affected requests fail", "sched/scheduler.py, Scheduler._handle_invalid_blocks (evict_blocks, should_fail)", gates=_CONN),
    Rule("connector.invalid_recompute", "recompute policy: loading requests with invalid blocks are marked failed, running ones skip this step's output", "sched/scheduler.py, Scheduler._handle_invalid_blocks (failed_recving_kv_req_ids)", gates=_CONN),
    Rule("connector.failed_load_kept", "a promoted failed load keeps and caches the blocks below its truncation", "sched/scheduler.py, Scheduler._update_waiting_for_remote_kv (load_failed, num_computed_tokens > 0)", gates=_CONN),
    Rule("connector.failed_load_freed", "a promoted failed load with nothing computed frees its blocks at once", "sched/scheduler.py, Scheduler._update_waiting_for_remote_kv (kv_cache_manager.free)", gates=_CONN),
    Rule("connector.output_skipped", "a request affected by a failed load gets nothing from this step's output", "sched/scheduler.py, Scheduler.update_from_output (req_id in failed_kv_load_req_ids: continue)", gates=_CONN),
    Rule("connector.failed_load_error", "fail policy: a request whose load failed finishes with FINISHED_ERROR", "sched/scheduler.py, Scheduler.update_from_output (finish_requests(error_req_ids, FINISHED_ERROR))", gates=_CONN),
    Rule("connector.finish_during_load", "a request loading asynchronously finishes (abort, failure) before its load is reported: it keeps its blocks until the report", "sched/scheduler.py, Scheduler.finish_requests (delay_free_blocks)", gates=_CONN),
    Rule("connector.finish_after_load", "a request whose load was reported but not promoted yet finishes: its blocks are freed at once", "sched/scheduler.py, Scheduler.finish_requests (in finished_recving_kv_req_ids)", gates=_CONN),
    Rule("connector.save_delays_free", "a request that asked for an asynchronous save finishes normally: it keeps its blocks until the worker reports the save", "sched/scheduler.py, Scheduler._free_request, _connector_finished (request_finished -> delay_free_blocks)", gates=_CONN),
    Rule("connector.save_done", "the worker reports a save finished: the request's kept blocks are freed", "sched/scheduler.py, Scheduler._update_from_kv_xfer_finished (finished_sending: _free_blocks)", gates=_CONN),
    Rule("connector.victim_in_flight", "async scheduling: the preemption victim's last step is in flight, so its blocks could not be freed at once: the RUNNING loop stops instead", _SCHED + ", RUNNING loop (_request_blocks_can_be_freed: break)", _ASYNC_MODES, gates=_CONN),
    Rule("connector.free_deferred", "async scheduling: a request's blocks are freed while a step that scheduled it is in flight: the free waits behind a fence", "sched/scheduler.py, Scheduler._free_request_blocks (deferred_frees)", _ASYNC_MODES, gates=_CONN),
    Rule("connector.deferred_drained", "a processed step passes a deferred free's fence: its blocks return to the pool, tail first", "sched/scheduler.py, Scheduler.update_from_output, _drain_deferred_frees", _ASYNC_MODES, gates=_CONN),
    # -- streaming-input sessions (spec/sessions.py; RequestSpec.resumable)
    Rule("sessions.added", "a resumable request is added with an empty streaming queue", "sched/scheduler.py, Scheduler.add_request (request.streaming_queue = deque())", gates=_SESS),
    Rule("sessions.update_queued", "a session update arrives while the session runs, is preempted or waits for a chunk: it is queued for the session's next stop", "sched/scheduler.py, Scheduler.add_request (existing.streaming_queue.append)", gates=_SESS),
    Rule("sessions.update_applied", "a session update arrives while the session waits in WAITING_FOR_STREAMING_REQ: it is applied at once", "sched/scheduler.py, Scheduler.add_request, _update_request_as_session", gates=_SESS),
    Rule("sessions.ended_waiting", "the session's end arrives while it waits for input: it finishes (FINISHED_ABORTED)", "sched/scheduler.py, Scheduler.add_request (finish_requests(FINISHED_ABORTED))", gates=_SESS),
    Rule("sessions.wait_for_input", "a session stops with no chunk queued: it keeps its blocks and waits in WAITING_FOR_STREAMING_REQ, counted in num_waiting_for_streaming_input", "sched/scheduler.py, Scheduler._handle_stopped_request", gates=_SESS),
    Rule("sessions.continued_at_stop", "a session stops with a chunk queued: the chunk updates it in place (the last sampled token dropped, outputs folded into the prompt) and it waits again", "sched/scheduler.py, Scheduler._handle_stopped_request, _update_request_as_session", gates=_SESS),
    Rule("sessions.ended_at_stop", "a session stops with its end queued: it finishes with its stop status", "sched/scheduler.py, Scheduler._handle_stopped_request (update is None)", gates=_SESS),
    Rule("sessions.skip_waiting_for_input", "the WAITING loop passes over a session waiting for input", "sched/scheduler.py, Scheduler._handle_blocked_waiting_request (WAITING_FOR_STREAMING_REQ)", gates=_SESS),
    Rule("sessions.slots_held", "sessions waiting for input hold the model-runner slots left: the WAITING loop stops short of max_num_seqs running", _SCHED + ", WAITING loop (num_running = len(running) + num_waiting_for_streaming_input)", gates=_SESS),
    Rule("sessions.stale_drafts_cleared", "sync speculative decoding: a session admitted with the drafts proposed after its stop gets no proposal for the step: the update clears them", "vllm/v1/engine/core.py, EngineCore.post_step (every request of the batch); sched/scheduler.py, Scheduler.update_draft_token_ids", ("spec",), gates=_SESS),
    Rule("sessions.admit_continued", "a continued session is admitted from its kept computed tokens and blocks (no prefix lookup), as a new request", _SCHED + ", WAITING loop (num_computed_tokens > 0 branch; status WAITING: scheduled_new_reqs)", gates=_SESS),
)

#: name -> Rule, in catalogue order.
RULES: dict[str, Rule] = {r.name: r for r in _RULES}
assert len(RULES) == len(_RULES), "duplicate rule name"

#: every rule name, in catalogue order
RULE_NAMES: tuple[str, ...] = tuple(RULES)


def reachable_in(
    modes: tuple[str, ...] | list[str], gates: tuple[str, ...] | list[str] | frozenset[str] = ()
) -> tuple[str, ...]:
    """The rules a run drawing from ``modes`` with the admission ``gates`` on
    can reach, in catalogue order (a rule of a gate not in ``gates`` is out of
    reach)."""
    on = set(gates)
    return tuple(
        r.name for r in _RULES if set(r.modes) & set(modes) and set(r.gates) <= on
    )


def describe(name: str) -> str:
    """One line: the rule's meaning and its vLLM source."""
    r = RULES[name]
    return f"{r.name}: {r.description} ({r.vllm})"
