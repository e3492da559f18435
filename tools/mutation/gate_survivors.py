"""The sampled impl/ mutants the gate alone (``schedspec check --against
impl``, 20,000 steps) lets through, each with the reason found by reading
it: ``tools/gate_strength.py reasons`` takes a reason from here before it
falls back to the unmutated gate's line coverage.

Names are mutmut 3's for impl/ as of e981998 (the tree the sample in
data/gate-strength/impl-sample-seed1-e981998.jsonl ran on) and as of ddb6a16
(impl/ of data/gate-strength/impl-sample-seed1-865e1fb.jsonl); they move when
a mutated function changes. Kinds: "equivalent" (no scheduler tells it apart
through the protocol: plans, views, events, statistics), "not reached" (the
default check never draws what makes it differ) and "reached, not observed"
(drawn, but rarely enough that 20,000 steps did not line it up).
"""

from __future__ import annotations

GATE_SURVIVORS: dict[str, tuple[str, str]] = {
    "schedspec.impl.allocation.xǁAllocationMixinǁ_register__mutmut_33": (
        "equivalent", "end == num_prompt takes the mixed branch, whose token_range slices equal the prompt's"),
    "schedspec.impl.connector.xǁConnectorMixinǁ_free_table__mutmut_13": (
        "equivalent", "num_slots None for 0 on a freed table: admission sets it again before any read"),
    "schedspec.impl.allocation.xǁAllocationMixinǁ_grow_running_groups__mutmut_8": (
        "not reached", "end - lookahead differs only with lookahead slots (a draft model or EAGLE), which "
        "the check draws only with --runner"),
    "schedspec.impl.allocation.xǁAllocationMixinǁ_admit_alloc_groups__mutmut_41": (
        "reached, not observed", "max(1, ...) frees a skipped block only for a one-token window or chunk "
        "(block size 1) admitted with a hit and tokens still in flight"),
    "schedspec.impl.connector.xǁConnectorMixinǁ_after_schedule_kv__mutmut_9": (
        "reached, not observed", "a request stays in _inflight_prefills past its prefill: the reserve only "
        "binds with an asynchronous load waiting under block pressure (killed at 140 s in an earlier sample)"),
    "schedspec.impl.connector.xǁConnectorMixinǁ_clone_connector__mutmut_26": (
        "reached, not observed", "the clone shares _deferred_frees: the fork (every 16 steps) must land on "
        "a step with deferred frees pending (async scheduling with a connector)"),
    # impl/ as of ddb6a16
    "schedspec.impl.allocation.xǁAllocationMixinǁ_find_hit__mutmut_18": (
        "equivalent", "inside `lookahead > 1 and ...`: the hash lookahead is 0 or 1 (EAGLE's one token, "
        "SchedulerConfig.num_prefill_lookahead_tokens), so the branch never runs"),
    "schedspec.impl.allocation.xǁAllocationMixinǁ_find_hit__mutmut_20": (
        "equivalent", "inside `lookahead > 1 and ...`: the hash lookahead is 0 or 1, so the branch never runs"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_slots__mutmut_2": (
        "equivalent", "`len(t) <= n`: a table as long as the shortest so far gives the same minimum"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_need__mutmut_33": (
        "equivalent", "`k <= 1`: for k == 1 both branches add 1"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_need__mutmut_48": (
        "equivalent", "skipped_tokens is 0 for every kind whose `skips` is False (impl/kv_kinds.py), and "
        "the state kinds leave before it"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_remove_skipped__mutmut_32": (
        "equivalent", "`skipped >= 0`: skipped_tokens is never negative, and 0 // bs is the else branch's 0"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_chain__mutmut_40": (
        "equivalent", "KeyNode(ikey, 1): the next two lines set the node's holders and refs anew"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_find_hit__mutmut_5": (
        "equivalent", "with caching off the hit length only feeds the 'reused' events, and an empty hit emits "
        "none; the admission counts hit[0]"),
    "schedspec.impl.encoder_cache.xǁEncoderCacheǁstore__mutmut_2": (
        "equivalent", "store runs only for an input reuse() just found absent, before any other request's "
        "gate: holders.get(ident) is None either way"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_clear_groups__mutmut_9": (
        "equivalent", "group_skip_from None on a cleared table: the only way back to running is an admission, "
        "whose _g_remove_skipped sets it before _state_grow, _grow_running_groups or the running loop reads it"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_clear_groups__mutmut_3": (
        "reached, not observed", "num_cached_blocks 1 on a cleared table only shows when the request comes "
        "back with no prefix hit and a full-attention group 0 keys past block 0 (a window group 0 masks it)"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_g_pop_for_free__mutmut_6": (
        "reached, not observed", "`i <= len(t)` raises only on a table all null at a preemption: a request "
        "that preempts itself right after its chunk boundary nulled every block of a chunked-local group"),
    "schedspec.impl.connector.xǁConnectorMixinǁ_finish_keeps_blocks__mutmut_10": (
        "reached, not observed", "max(1, ...) frees a block only for a one-token window at block size 1, "
        "with a connector, on a request that finishes with all its computed tokens in flight"),
    "schedspec.impl.connector.xǁConnectorMixinǁ_async_load_reserve__mutmut_54": (
        "reached, not observed", "max(..., 1) adds a block only for an in-flight prefill whose table already "
        "covers its sequence, and binds only with an asynchronous load at the pool's exact edge; killed since the small bound's conn-async-2loads space (data/gate-strength/survivors-modelcheck-small-9ecebe4.txt)"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_state_grow__mutmut_35": (
        "equivalent", "track[0] None after the append: it is read only in `track[0] or prev`, and the table "
        "then holds the block just appended (prev > 0) until _clear_groups drops the track"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_group_tuples__mutmut_3": (
        "equivalent", "the cached tuple rebuilt from block_ids on every call: the same values, only slower"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_state_next__mutmut_12": (
        "equivalent", "a lower mark only calls remove_skipped_blocks earlier, where the call changes nothing"),
    "schedspec.impl.kv_groups.xǁLayoutǁ__init____mutmut_48": (
        "reached, not observed", "`simple` for layouts of 1 or 3+ distinct group specs: one pass of the hit "
        "loop differs only where a third kind shortens the hit after the second (full + window + Mamba)"),
    "schedspec.impl.kv_events.x_reused__mutmut_26": (
        "reached, not observed", "block_identity(None) names a 'reused' event's key only for a hit of a "
        "request in full report mode with a LoRA adapter or encoder inputs and no identity marks"),
    "schedspec.impl.connector.xǁConnectorMixinǁ_handle_invalid_blocks__mutmut_22": (
        "reached, not observed", "node_of None raises only when the 'fail' policy evicts a synchronous "
        "load's invalid block with prefix caching on"),
    "schedspec.impl.kv_groups.xǁLayoutǁsplit__mutmut_52": (
        "equivalent", "`stop >= start`: stop == start gives 0 in both branches"),
    "schedspec.impl.kv_groups.xǁLayoutǁ__init____mutmut_37": (
        "equivalent", "the merge key's block size set to 1 instead of 0: any one constant merges the same specs"),
    "schedspec.impl.kv_groups.xǁLayoutǁhit__mutmut_16": (
        "equivalent", "a group's length is read only once its blocks are set, which sets the length too"),
    "schedspec.impl.kv_groups.xǁGroupsMixinǁ_state_retire__mutmut_43": (
        "reached, not observed", "'' for None only for a Mamba group 0 (drawn since e1597d0; the check reaches it, no failure in 60 s); killed since the small bound's mamba-first-1req space (one request decoding past two blocks)"),
    "schedspec.impl.queues.x_choose_victim__mutmut_4": (
        "not reached", "choose_victim is the reference the crosshair comparison runs against spec/rules.py; "
        "ImplScheduler keeps its own VictimHeap and never calls it"),
    "schedspec.impl.request.xǁRequestǁblock_tuple__mutmut_1": (
        "equivalent", "the cached tuple rebuilt from block_ids on every call: the same values, only slower"),
    "schedspec.impl.running.xǁRunningPhaseǁ_schedule_running_request__mutmut_22": (
        "equivalent", "encoder_left is read only when inputs run, and then _encoder_window has set it"),
    "schedspec.impl.kv_kinds.xǁSlidingWindowǁcap__mutmut_12": (
        "reached, not observed", "window - 2: the admission cap one block lower only where window - 1 + the "
        "tokens in flight is one past a block boundary, and it binds only at the pool's exact edge"),
    "schedspec.impl.running.xǁRunningPhaseǁ_schedule_running_request__mutmut_51": (
        "equivalent", "`end <= num_tokens`: at end == num_tokens both branches give num_tokens"),
    "schedspec.impl.running.xǁStepStateǁ__init____mutmut_10": (
        "equivalent", "prefill_admitted None for False: it is only read for its truth"),
    "schedspec.impl.running.xǁStepStateǁ__init____mutmut_8": (
        "equivalent", "prefill_scheduled None for False: it is only read for its truth"),
    "schedspec.impl.scheduler.xǁImplSchedulerǁ_init_gates__mutmut_24": (
        "reached, not observed", "a prefill cadence of 2 takes the ungated path, which differs only when a "
        "running prefill chunk is due to be held"),
    "schedspec.impl.scheduler.xǁImplSchedulerǁ_preempt__mutmut_8": (
        "reached, not observed", "keeps drop_stale_output for a request preempted again with no stale "
        "tokens, seen only if it is preempted twice with a plan in flight and then resumes"),
    "schedspec.impl.connector.xǁConnectorMixinǁ_clone_connector__mutmut_10": (
        "reached, not observed", "a clone sharing _loads_done shows only if a fork lands while loads are "
        "reported done; since fce7fc5 the check forks on the plan after such a report (killed at 39.7 s)"),
    "schedspec.impl.allocation.xǁAllocationMixinǁ_admit_alloc__mutmut_31": (
        "reached, not observed", "max(..., 1) in the full-sequence gate counts a block only for a promoted "
        "load whose table already covers the prompt, at a pool with exactly the watermark free "
        "(killed at 51 s in one rerun)"),
    # impl/ as of ddb6a16, the rest of the sample at dbbb9c9 (read with the unmutated code)
    "schedspec.impl.kv_groups.xǁLayoutǁsplit__mutmut_9": (
        "equivalent", "start == prefill_end leaves n <= 1 (a Mamba group allows no drafts nor connector, a running step samples one token past its placeholders), and a cut needs n >= 2"),
    "schedspec.impl.request.xǁRequestǁstep_token_ids__mutmut_9": (
        "equivalent", "token_range(start, num_tokens) with start >= num_tokens is () on every branch"),
    "schedspec.impl.running.xǁRunningPhaseǁ_schedule_running__mutmut_140": (
        "equivalent", "_group_tuples returns req.group_block_tuples when it is set and builds it only when it is None: the cache read, not bypassed"),
    "schedspec.impl.running.xǁRunningPhaseǁ_schedule_running__mutmut_89": (
        "equivalent", "the new case (an async steady decode at num_tokens == num_prompt) gets from the inline grow the entry the general path gives; _grow_running_groups guards each part itself"),
    "schedspec.impl.running.xǁRunningPhaseǁ_schedule_running_request__mutmut_48": (
        "equivalent", "at end + lookahead == num_slots the extra _grow_running allocates nothing and returns True"),
    "schedspec.impl.running.xǁStepStateǁ__init____mutmut_18": (
        "equivalent", "the one StepState() in schedule() is followed at once by state.drafts_needed = not self._can_skip_drafts"),
    "schedspec.impl.scheduler.xǁImplSchedulerǁ_init_gates__mutmut_21": (
        "equivalent", "inline growth for a hybrid config with only an encoder or only a connector: a steady decode past its prompt has no encoder input and meets the connector only after a failed grow, as on the general path"),
    "schedspec.impl.scheduler.xǁImplSchedulerǁadd__mutmut_41": (
        "equivalent", "group_skip_from is overwritten by _g_remove_skipped at the admission, before any read (all reads are of running requests)"),
    "schedspec.impl.scheduler.xǁImplSchedulerǁclone__mutmut_51": (
        "equivalent", "_cached_now is cleared at the start of every schedule() and read only inside it: a shared set holds only the running call's entries"),
    "schedspec.impl.scheduler.xǁImplSchedulerǁclone__mutmut_76": (
        "equivalent", "without a connector _kv_holding_waiting holds only live sessions, so _streaming_queues is non-empty and _clone_sessions copies the list"),
    "schedspec.impl.scheduler.xǁImplSchedulerǁstats__mutmut_1": (
        "equivalent", "stats() is a sizes helper for tests and benchmarks, not a protocol method: no scheduler output reads it"),
    "schedspec.impl.queues.x_choose_victim__mutmut_4": (
        "equivalent", "choose_victim is the victim rule's reference for the crosshair and unit tests; ImplScheduler never calls it (impl/running.py keeps its own VictimHeap)"),
    "schedspec.impl.queues.x_choose_victim__mutmut_7": (
        "equivalent", "choose_victim is never called by ImplScheduler (a reference for the tests)"),
    "schedspec.impl.stats.xǁStatsMixinǁ_stats_drafts__mutmut_5": (
        "equivalent", "_st_invalid is always a dict: {}.get(step) is None, as the else branch"),
    "schedspec.impl.stats.xǁStatsMixinǁ_stats_drafts__mutmut_14": (
        "equivalent", "accepted_at[k + 1] is never written (a <= drafts <= k) nor read (reads are [i + 1], i < k)"),
    "schedspec.impl.stats.xǁStatsMixinǁmake_stats__mutmut_13": (
        "equivalent", "usable = num_blocks - 1 >= 1: SchedulerConfig.num_blocks has minimum 2"),
    "schedspec.impl.update.xǁUpdateMixinǁ_apply_output__mutmut_20": (
        "equivalent", "a WAITING session with stale output returns _FINISHED for _UNFINISHED: the caller differs only in applying drafts (none: async, or a pipeline without drafts) and a running filter it is not in"),
    "schedspec.impl.update.xǁUpdateMixinǁ_update_general__mutmut_91": (
        "equivalent", "isdisjoint(tokens) of a one-token tuple is tokens[0] not in the set"),
    "schedspec.impl.update.xǁUpdateMixinǁ_result_ok__mutmut_34": (
        "equivalent", "present = 1 only turns a True into False ('not sure'), whose slow path (check_sampled) decides the same"),
    "schedspec.impl.update.xǁUpdateMixinǁ_result_ok__mutmut_47": (
        "equivalent", "token < 1 sends a 0 token to the slow path, which accepts it as before"),
    "schedspec.impl.update.xǁUpdateMixinǁ_result_ok__mutmut_59": (
        "equivalent", "for a partial chunk's empty tuple it answers False ('not sure') for True: the slow path accepts it"),
    "schedspec.impl.update.xǁUpdateMixinǁ_result_ok__mutmut_66": (
        "equivalent", "no draft counted: with_drafts != len(drafts) answers False ('not sure') whenever drafts come, and the slow path decides"),
    "schedspec.impl.update.xǁUpdateMixinǁ_result_ok__mutmut_68": (
        "equivalent", "with drafts present it answers False ('not sure') always, and the slow path decides"),
    "schedspec.impl.update.xǁUpdateMixinǁ_result_ok__mutmut_69": (
        "equivalent", "with_drafts = 1 can only turn True into False ('not sure'): it equals len(drafts) only when the count was right"),
    "schedspec.impl.update.xǁUpdateMixinǁ_result_ok__mutmut_70": (
        "equivalent", "a negative count never equals len(drafts): False ('not sure'), and the slow path decides"),
    "schedspec.impl.update.xǁUpdateMixinǁ_update_sync__mutmut_40": (
        "equivalent", "token < 1 sends a 0 token to the rollback and _append_slow, which append it as the fast pass would"),
    "schedspec.impl.sessions.xǁSessionsMixinǁsession_update__mutmut_3": (
        "equivalent", "the words of a TypeError's message: the protocol fixes an error's class and field, which check/rejects.py compares"),
    "schedspec.impl.sessions.xǁSessionsMixinǁsession_update__mutmut_41": (
        "equivalent", "the words of a RequestError's message: the protocol fixes its class, field and request id"),
    "schedspec.impl.sessions.xǁSessionsMixinǁ_clone_sessions__mutmut_8": (
        "reached, not observed", "a clone sharing _continuing shows only when both copies take an update; the fork probe dropped the original after its schedule()"),
    "schedspec.impl.sessions.xǁSessionsMixinǁ_enqueue_continuing__mutmut_6": (
        "reached, not observed", "a session preempted with a step in flight whose stale token stops it (computed 0 when it continues): sessions x async or a pipeline x preemption x a stop"),
    "schedspec.impl.stats.xǁStatsMixinǁ_stats_drafts__mutmut_26": (
        "reached, not observed", "a result that leaves out the tokens of a drafted request aborted meanwhile (oracle.without_aborted, odd steps since c09a4dd), then another drafted entry in the same plan, with speculative decoding and statistics on"),
    "schedspec.impl.update.xǁUpdateMixinǁ_append_slow__mutmut_20": (
        "not reached", "_append_slow runs only for a valid result the fast pass doubts: an int or tuple subclass, or empty drafts with speculative decoding off; killed since e1c068b, whose fake model says empty proposals now and then (oracle.SILENT_EVERY)"),
    "schedspec.impl.update.xǁUpdateMixinǁ_apply_stale__mutmut_27": (
        "not reached", "a stale sampled token the request's grammar refuses: the fake model samples within the grammar (rule grammar.refused_sample, out of reach)"),
    "schedspec.impl.update.xǁUpdateMixinǁ_finish_grammar_errors__mutmut_2": (
        "reached, not observed", "a failed load (policy fail) in the same update as a grammar failure found by the waiting loop: the error finishes one update later; killed since the small bound's conn-grammar-syncfail space"),
    "schedspec.impl.update.xǁUpdateMixinǁ_set_drafts__mutmut_10": (
        "reached, not observed", "cut -= 1 walks the drafts from the end; it differs only when the grammar refuses two drafts, the first not first; killed since a90d732, whose drafter under a grammar goes astray after its first wrong draft"),
    "schedspec.impl.waiting.xǁWaitingPhaseǁ_admit__mutmut_91": (
        "reached, not observed", "end <= num_tokens keeps a connector request whose admission finishes its prefill among the in-flight prefills: it binds only through the async-load reserve under block pressure; killed since e1597d0 by a narrow connector workload (check/narrow.py)"),
    "schedspec.impl.waiting.xǁWaitingPhaseǁ_schedule_waiting__mutmut_85": (
        "reached, not observed", "crashes only when a request from kv_holding_waiting is passed over by a gate in the waiting loop; killed since the small bound's conn-encoder-passed-over space (a loaded request passed over by the encoder budget)"),
    "schedspec.impl.update.xǁUpdateMixinǁ_update_sync__mutmut_19": (
        "equivalent", "req's first value is read only in the except clause, which nothing reaches before the loop assigns req"),
}
