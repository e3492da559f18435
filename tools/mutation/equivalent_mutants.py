"""The mutmut mutants of spec/ and impl/ that no test can kill, and why.

Each was examined by hand (docs/bugzoo.md, "Mutation testing"). Names are
mutmut 3's (``module.xǁClassǁmethod__mutmut_N``, ``module.x_function__mutmut_N``),
where the module is the path mutmut mutated (tools/mutation/run_mutmut.sh
mutates schedspec/spec and schedspec/impl), so ``schedspec.spec.rules``, the
name the tests import. The numbers hold for the source they were examined on
(spec/ and impl/ as of the commit that last changed this file) and move when a
mutated function changes: tools/mutation/mutation_report.py then lists the
survivors it cannot find here as undocumented. Entries for impl's phases
(impl/running.py, waiting.py, update.py, allocation.py, request.py) and the
KV modules come from the seeded samples of docs/bugzoo.md, "Mutation
testing"; the older entries from the last full run.
"""

from __future__ import annotations

REASONS: dict[str, str] = {
    "dead": "code no reachable state executes: the max_model_len cap and the n <= 0 skip of the running "
            "loops (a running request has num_tokens <= max_model_len - 1 and at least one uncomputed token, "
            "so n >= 1 and c + n <= max_model_len - 1), a token budget used up before a later running request "
            "in impl's fast loop, the message of an assert that holds, a Protocol method's body",
    "same-value": "a boundary moved where both sides give the same value (`if n > budget: n = budget` with n == "
                  "budget; a threshold equal to n; the first element compared with itself)",
    "overwritten": "a field set (at creation, preemption, finish or a rejected update) that is always set again "
                   "before anything reads it (admission sets cap, ncached, next_full, edge, blocks, btuple; "
                   "the plan sets num_computed; an accepted update rewrites tail)",
    "performance": "a change of a fast-path gate, cache or compaction threshold: impl takes its slow, exact path "
                   "more often (or compacts at another moment) and decides the same; the tail/edge gates, the "
                   "block-tuple cache (also dropped by a clone), a request copied twice by clone() (every "
                   "table is rebuilt from the last copy), the key memo of views(), the heap compaction thresholds, the fast pass of "
                   "update() sending a valid result through the exact check, one unused slot at the end of the "
                   "free-queue link arrays",
    "indistinguishable": "a value no reader tells apart: None for False or () where only truthiness is read, "
                         "other unique sequence numbers, another 'not queued' marker, the links of the null block, "
                         "a ceiling compared with an integer, max(.., 1) where at least one block is always needed, "
                         "a zero budget that stops a loop as a negative one does, break for continue where the loop "
                         "ends anyway (FCFS self-preemption: the request is the last one, cf. vLLM PR #26765), "
                         "an assert weakened",
}

_EQUIVALENT: dict[str, dict[str, list[int]]] = {
    "dead": {
        # the message of the hit's assert, which holds (a request takes its hit with no blocks)
        "schedspec.spec.kv_cache.xǁKVPoolǁallocate_new_computed_blocks": [9],
        "schedspec.spec.scheduler.xǁSpecSchedulerǁ_schedule_running": [22, 23, 24, 25],  # the n == 0 skip
        "schedspec.spec.kv_cache.xǁKVPoolǁget_new_blocks": [2, 3],  # the assert messages
        "schedspec.spec.kv_cache.xǁKVPoolǁcache_full_blocks": [9, 10],  # the assert messages
        "schedspec.spec.interface.xǁSchedulerǁreset_prefix_cache": [1],
        # num_computed_tokens > 1 for > 0: an entry with drafts that is not stale has computed
        # its prompt (>= 1 token) and its drafts (>= 1)
        "schedspec.spec.async_drafts.xǁAsyncDraftsMixinǁ_roll_back_rejected": [2],
        # `and` to `or`: both callers pass an input the request holds
        "schedspec.spec.kv_cache.xǁEncoderCacheǁfree_encoder_input": [3],
        # continue to break at a null block of a hit: a group's hit past its skipped blocks holds
        # none (the search's nulls are exactly the blocks the window or chunk skips)
        "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_take_hit": [18],
        # the default of `reserved`: its one caller (WaitingPhase._admit) always passes it
        "schedspec.impl.allocation.xǁAllocationMixinǁ_admit_alloc": [2],
        # rest > 0 always: two catalogued rules no mode reaches (waiting.skip_stale_output,
        # grammar.refused_sample; tests/spec/test_coverage_text.py holds them)
        "schedspec.spec.coverage.x__summary": [30, 31],
        # the stale share of a skipped KV output (= for -=): only a connector skips outputs, and
        # with one no request is preempted with tokens in flight (sync: no plan is in flight at a
        # schedule or reset; async: defer_block_free stops the RUNNING loop at a victim whose
        # step is unprocessed, and reset_prefix_cache(reset_running_requests=True) is refused
        # then), so num_stale_output_tokens is 0 there
        "schedspec.impl.update.xǁUpdateMixinǁ_skip_output": [11],
    },
    "same-value": {
        "schedspec.spec.rules.x_running_chunk": [5],
        "schedspec.spec.rules.x_admission_chunk": [5],
        "schedspec.spec.rules.x_choose_victim": [8],
        # since > 2 for since > 1: no RequestSpec field is declared since version 2
        "schedspec.spec.interface.xǁRequestSpecǁto_dict": [11],
        # the input scan run for an empty chunk too: n == 0 only past the prompt (n >= 1 while
        # num_computed < len(prompt) <= max_model_len - 1, as budget and threshold are >= 1),
        # and every input ends inside the prompt, so the scan skips them all: the same plan
        "schedspec.spec.encoder.xǁEncoderMixinǁ_schedule_encoder_inputs": [3],
        # the steady decode under the gate rules at num_prompt_tokens == num_tokens too. Async:
        # steady means computed == num_tokens + k, so the step lies past every encoder input and
        # the general rules give the same entry (blocks, token ids, codes, placeholders). Sync:
        # computed == num_prompt - 1 with no prefill chunk only after a shared invalid block
        # (connector.invalid_shared) undid a step of exactly that token, whose encoder input
        # that step ran or reused and still holds (a skipped output frees none): a cache hit
        "schedspec.impl.running.xǁRunningPhaseǁ_schedule_running": [73],
    },
    "overwritten": {
        "schedspec.spec.scheduler.xǁSpecSchedulerǁ_preempt_request": [4, 5],  # num_cached_blocks
        "schedspec.spec.scheduler.xǁSpecSchedulerǁ_admit": [40],  # num_computed_tokens: the plan sets it
        "schedspec.impl.kv_groups.xǁGroupsMixinǁ_chain": [39],  # KeyNode's holders and refs, set again
        # encoder_left's first value: read only when the encoder window, which sets it, ran
        "schedspec.impl.running.xǁRunningPhaseǁ_schedule_running_request": [9],
        # last_token_ids after a refused update: the accepted update of the same plan sets it again
        # for every entry that samples (its fast pass or _append_slow) before a schedule() reads it
        "schedspec.impl.update.xǁUpdateMixinǁ_rollback": [11, 12, 16, 17],
        # num_slots of a failed load's emptied table: every admission sets it again before the
        # running loop reads it (allocation.py, _admit_alloc and _admit_alloc_groups)
        "schedspec.impl.connector.xǁConnectorMixinǁ_promote": [16],
    },
    "performance": {
        # a new request's block-tuple cache unset (None) for empty: its first read builds ()
        "schedspec.impl.request.xǁRequestǁ__init__": [14],
        # the memo of (-1,) * n missed: an equal tuple built again
        "schedspec.impl.scheduler.xǁImplSchedulerǁ_unknown_tokens": [1],
        "schedspec.impl.prefix_index.xǁPrefixIndexǁviews": [7, 8, 9, 12, 13],
        "schedspec.impl.free_queue.xǁFreeBlockQueueǁ__init__": [20, 35],
        "schedspec.impl.queues.xǁPriorityWaitingǁremove": [7, 8, 11],
        "schedspec.impl.queues.xǁVictimHeapǁcompact": [1, 2, 4, 5],
        # the one-pass sync update sends a valid result (a 0 token, an entry count off) through
        # the protocol's check and applies it the plain way
        "schedspec.impl.update.xǁUpdateMixinǁ_update_sync": [25, 39, 53],
        # an empty extension of a group's table: the block-tuple cache dropped
        "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_grow": [11],
        # the gate rules taken while unpaused, or left while paused: the pause is decided by
        # schedule() and the waiting phase on every path (impl/waiting.py, _schedule_waiting)
        "schedspec.impl.scheduler.xǁImplSchedulerǁschedule": [10],
        # the steady decode's slot gate (end < num_slots): the general rules take the boundary step
        "schedspec.impl.running.xǁRunningPhaseǁ_schedule_running": [68],
    },
    "indistinguishable": {
        # zip(strict=True) of two lists built from one range, and the admission assert, weakened
        "schedspec.spec.kv_cache.xǁKVPoolǁcache_full_blocks": [3, 6, 7],
        "schedspec.spec.scheduler.xǁSpecSchedulerǁ_admit": [2],
        # max(.., 1): an admission always needs a block past its hit (hit < num_tokens <= max_model_len - 1)
        "schedspec.spec.scheduler.xǁSpecSchedulerǁ_allocate_admission": [51],
        # None appended to a list only read for truthiness
        "schedspec.spec.scheduler.xǁSpecSchedulerǁ_allocate_or_preempt": [45],
        # budget >= 0: a zero budget schedules and admits nothing; 36: FCFS self-preemption, continue for break
        "schedspec.spec.scheduler.xǁSpecSchedulerǁ_schedule_running": [6, 36],
        "schedspec.spec.scheduler.xǁSpecSchedulerǁ_schedule_waiting": [2],
        "schedspec.spec.scheduler.xǁSpecSchedulerǁupdate": [14, 16],  # .get(rid, None): only `not toks` reads it
        "schedspec.impl.update.xǁUpdateMixinǁ_append_slow": [6, 8],  # the same in impl: only `not tokens` reads it
        # 51: any_stopped None for False, only read for truthiness; 67: a failed load's in-flight
        # count less a fraction below one (code / base for code // base): every reader compares it
        # with integers or floors it (computed - in_flight against block and skip bounds)
        "schedspec.impl.update.xǁUpdateMixinǁ_update_general": [51, 67],
        # StepState.preempted None for False: only `not state.preempted` reads it
        "schedspec.impl.running.xǁStepStateǁ__init__": [6],
        # the group check's assert weakened (it holds after the integer check); typing.cast(None, g)
        # returns g at run time
        "schedspec.spec.validate.x__check_group": [63, 64, 71],
        # the field name passed to check_field, which no kind reads (the path names the field)
        "schedspec.spec.kv_kinds.xǁGroupKindǁvalidate": [7],
        "schedspec.impl.prefix_index.xǁPrefixIndexǁevict": [13],
        # the requests of a failed asynchronous load returned under "recompute" too: they wait for
        # their load, so no entry of the plan is theirs and skipping their output skips nothing
        "schedspec.spec.connector.xǁConnectorMixinǁ_handle_failed_recving": [20],
        # None for "" as the group before the first: no rule's group is either
        "schedspec.spec.coverage.x_format_table": [15],
        "schedspec.impl.free_queue.xǁFreeBlockQueueǁ__init__": [47, 48],
        "schedspec.impl.queues.xǁFcfsWaitingǁpush_front": [3],
        "schedspec.impl.queues.xǁFcfsWaitingǁpop_head": [1],
        "schedspec.impl.queues.xǁPriorityWaitingǁ__init__": [5],
        "schedspec.impl.queues.xǁPriorityWaitingǁpush_back": [3],
        "schedspec.impl.queues.xǁPriorityWaitingǁpop_head": [4, 5, 6],
        "schedspec.impl.queues.xǁPriorityWaitingǁremove": [1, 3],
        # the null block has no key node: the lookup of block_node[NULL] gives the None skipped
        "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_register_block": [16],
        # the lookup by id for an entry that is not running: a failed load names a request still
        # present (spec/protocol.py, check_kv_reports), so it returns the entry's own record
        "schedspec.impl.update.xǁUpdateMixinǁ_skip_output": [3],
    },
}

#: mutant name -> reason key
EQUIVALENT: dict[str, str] = {
    f"{function}__mutmut_{n}": reason
    for reason, functions in _EQUIVALENT.items()
    for function, numbers in functions.items()
    for n in numbers
}
