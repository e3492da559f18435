"""Pure helpers of the spec: each one a rule of vLLM 0.33's scheduler.

Every function is total on its documented domain and carries PEP 316
contracts (``pre:`` / ``post:`` lines in the docstring) that CrossHair checks
symbolically in the test suite (tests/spec/test_contracts.py).
"""

from __future__ import annotations

from schedspec.spec.interface import Policy


def cdiv(a: int, b: int) -> int:
    """Ceiling division (vllm/utils/math_utils.py, cdiv).

    pre: a >= 0
    pre: b > 0
    post: __return__ * b >= a
    post: (__return__ - 1) * b < a or __return__ == 0
    """
    return -(-a // b)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks a request needs to hold ``num_tokens`` KV slots
    (single_type_kv_cache_manager.py, get_num_blocks_to_allocate:
    ``cdiv(num_tokens, block_size)``).

    pre: num_tokens >= 0
    pre: block_size > 0
    post: __return__ * block_size >= num_tokens
    post: __return__ * block_size < num_tokens + block_size
    """
    return cdiv(num_tokens, block_size)


def running_chunk(
    num_tokens: int,
    num_computed: int,
    threshold: int,
    token_budget: int,
    max_model_len: int,
    num_spec_tokens: int = 0,
    num_output_placeholders: int = 0,
) -> int:
    """Tokens a running request gets this step (scheduler.py, schedule(), the
    RUNNING loop): everything it has not computed, cut to the long-prefill
    threshold (0 = off), the remaining token budget, and so that the input
    position stays below max_model_len (one slot is kept for the sampled
    token: ``num_sampled_tokens_per_step``). 0 means the request is skipped,
    not that scheduling stops.

    "Everything" is vLLM's ``num_tokens_with_spec + num_output_placeholders -
    num_computed_tokens``: the known tokens, the request's ``num_spec_tokens``
    drafts, and (async scheduling) its in-flight output placeholders, which
    ``num_computed`` already counts.

    pre: 0 <= num_spec_tokens and 0 <= num_output_placeholders
    pre: 0 <= num_computed <= num_tokens + num_output_placeholders
    pre: threshold >= 0
    pre: token_budget >= 0
    pre: max_model_len > 0
    post: 0 <= __return__ <= num_tokens + num_spec_tokens + num_output_placeholders - num_computed
    post: __return__ <= token_budget
    post: threshold == 0 or __return__ <= threshold
    post: __return__ == 0 or num_computed + __return__ <= max_model_len - 1
    """
    n = num_tokens + num_spec_tokens + num_output_placeholders - num_computed
    if 0 < threshold < n:
        n = threshold
    n = min(n, token_budget)
    n = min(n, max_model_len - num_computed - 1)
    return max(n, 0)


def admission_chunk(
    num_tokens: int,
    num_hit_tokens: int,
    threshold: int,
    token_budget: int,
    chunked_prefill: bool,
) -> int:
    """Tokens a waiting request gets when it is admitted (scheduler.py,
    schedule(), the WAITING loop). Returns 0 when chunked prefill is off and
    the rest of the prompt does not fit the budget: the loop then stops
    (``break``), it does not skip to the next request.

    pre: 0 <= num_hit_tokens < num_tokens
    pre: threshold >= 0
    pre: token_budget > 0
    post: 0 <= __return__ <= num_tokens - num_hit_tokens
    post: __return__ <= token_budget
    post: threshold == 0 or __return__ <= threshold
    post: chunked_prefill == (__return__ > 0) or not chunked_prefill
    """
    n = num_tokens - num_hit_tokens
    if 0 < threshold < n:
        n = threshold
    if not chunked_prefill and n > token_budget:
        return 0
    return min(n, token_budget)


def num_scheduled_drafts(
    num_new_tokens: int, num_computed: int, num_tokens: int, num_output_placeholders: int, num_drafts: int
) -> int:
    """How many of a running request's drafts this step verifies
    (scheduler.py, schedule(), the RUNNING loop, "Speculative decode
    related"): the scheduled tokens that reach past the known tokens and the
    in-flight placeholders, at most the drafts it holds. Fewer than all when
    the budget, the threshold or max_model_len cut the chunk.

    pre: num_new_tokens >= 0 and num_drafts >= 0 and num_output_placeholders >= 0
    pre: 0 <= num_computed <= num_tokens + num_output_placeholders
    pre: num_computed + num_new_tokens <= num_tokens + num_output_placeholders + num_drafts
    post: 0 <= __return__ <= num_drafts
    post: __return__ <= num_new_tokens
    """
    n = num_new_tokens + num_computed - num_tokens - num_output_placeholders
    return min(max(n, 0), num_drafts)


def surely_reaches_max_tokens(
    num_computed: int, num_output_placeholders: int, num_prompt_tokens: int, max_tokens: int
) -> bool:
    """Async scheduling: the steps in flight are sure to bring the request to
    max_tokens even if every draft in them is rejected, so the RUNNING loop
    skips it rather than schedule a step that could only be dropped
    (scheduler.py, schedule(), the RUNNING loop: ``num_computed_tokens + 2 -
    num_output_placeholders >= num_prompt_tokens + max_tokens``; the in-flight
    placeholders, less all but one of them, count the one token each sampling
    step surely yields).

    pre: num_computed >= 0 and num_output_placeholders >= 0
    pre: num_prompt_tokens >= 1 and max_tokens >= 1
    post: not __return__ or num_output_placeholders > 0
    """
    return (
        num_output_placeholders > 0
        and num_computed + 2 - num_output_placeholders >= num_prompt_tokens + max_tokens
    )


def decode_padding(
    num_new_tokens: int,
    num_computed: int,
    num_spec_tokens: int,
    prefill_scheduled: bool,
    running_scheduled: bool,
    max_model_len: int,
    token_budget: int,
) -> int | None:
    """Speculative decoding: a newly admitted request with one token left to
    compute is padded to a uniform decode of ``1 + num_spec_tokens`` tokens
    (k placeholder drafts, -1), so the step keeps one shape (scheduler.py,
    schedule(), the WAITING loop, "Pad new decode requests"). Only when no
    running request of this step continues a prefill, some running request
    was scheduled or the request has a prefix hit, and the padded step leaves
    room for the sampled token within max_model_len. Returns the tokens to
    schedule, or None when padding is due but the budget cannot hold it (vLLM
    then stops the WAITING loop rather than schedule it unpadded).

    pre: num_new_tokens >= 1 and num_computed >= 0 and num_spec_tokens >= 0
    pre: max_model_len > 0 and token_budget > 0
    post: __return__ is None or __return__ in (num_new_tokens, 1 + num_spec_tokens)
    post: __return__ is None or __return__ == num_new_tokens or num_computed + __return__ + 1 <= max_model_len
    post: __return__ is not None or 1 + num_spec_tokens > token_budget
    """
    if (
        num_spec_tokens > 0
        and num_new_tokens == 1
        and not prefill_scheduled
        and (running_scheduled or num_computed > 0)
    ):
        padded = 1 + num_spec_tokens
        if num_computed + padded + 1 <= max_model_len:
            if padded > token_budget:
                return None
            return padded
    return num_new_tokens


def effective_threshold(threshold: int, num_running: int, num_waiting: int) -> int:
    """The long-prefill threshold in force for a step: none when at most one
    request is running or waiting, since nobody can be starved (scheduler.py,
    schedule(), ``num_eligible_reqs > 1``).

    pre: threshold >= 0
    pre: num_running >= 0 and num_waiting >= 0
    post: __return__ in (0, threshold)
    post: num_running + num_waiting > 1 or __return__ == 0
    """
    return threshold if num_running + num_waiting > 1 else 0


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """The most full blocks a prefix-cache hit may cover: hits are capped at
    ``num_tokens - 1`` tokens so the last token is always computed and yields
    logits (kv_cache_manager.py, get_computed_blocks; FullAttentionManager.
    find_longest_cache_hit iterates ``max_length // block_size`` blocks).

    pre: num_tokens >= 1
    pre: block_size > 0
    post: __return__ >= 0
    post: __return__ * block_size <= num_tokens - 1
    post: (__return__ + 1) * block_size > num_tokens - 1
    """
    return (num_tokens - 1) // block_size


def admission_blocks_needed(
    target_tokens: int, block_size: int, num_hit_blocks: int, num_evictable_hits: int
) -> int:
    """Free blocks an admission consumes to reach ``target_tokens`` slots when
    its first ``num_hit_blocks`` come from the prefix cache: new blocks past
    the hit, plus each hit block that is currently free (ref_cnt 0), since
    touching it takes it out of the free queue (single_type_kv_cache_manager.py,
    get_num_blocks_to_allocate).

    pre: target_tokens >= 0
    pre: block_size > 0
    pre: 0 <= num_evictable_hits <= num_hit_blocks
    post: __return__ >= num_evictable_hits
    post: __return__ >= blocks_for_tokens(target_tokens, block_size) - num_hit_blocks
    """
    new_blocks = max(blocks_for_tokens(target_tokens, block_size) - num_hit_blocks, 0)
    return new_blocks + num_evictable_hits


def priority_key(priority: int, arrival: int, request_id: str) -> tuple[int, int, str]:
    """Order of the PRIORITY waiting queue: lower priority value first, then
    earlier arrival, then request id (vllm/v1/request.py, Request.__lt__).

    post: __return__[0] == priority
    """
    return (priority, arrival, request_id)


def choose_victim(policy: Policy, running_keys: list[tuple[int, int]]) -> int:
    """Index in the running queue of the request to preempt (scheduler.py,
    schedule(): FCFS ``self.running[-1]``; PRIORITY ``max(self.running,
    key=lambda r: (r.priority, r.arrival_time))``, the first maximal element
    in running order on ties).

    pre: len(running_keys) > 0
    post: 0 <= __return__ < len(running_keys)
    post: policy != Policy.FCFS or __return__ == len(running_keys) - 1
    post: policy != Policy.PRIORITY or all(k <= running_keys[__return__] for k in running_keys)
    post: policy != Policy.PRIORITY or all(k < running_keys[__return__] for k in running_keys[:__return__])
    """
    if policy == Policy.FCFS:
        return len(running_keys) - 1
    best = 0
    for i in range(1, len(running_keys)):
        if running_keys[i] > running_keys[best]:
            best = i
    return best


def split_freed_blocks(
    blocks_tail_first: list[int], newly_free: list[bool], has_key: list[bool], caching: bool
) -> tuple[list[int], list[int]]:
    """Where blocks whose reference count reached 0 go in the free queue
    (block_pool.py, BlockPool.free_blocks). ``blocks_tail_first`` is a
    request's table reversed (kv_cache_manager.py, free: tail blocks are
    evicted first). Blocks without a prefix-cache key (or all blocks when
    caching is off) are reused first: they go to the FRONT, in this order;
    keyed blocks go to the BACK (LRU), in this order.

    pre: len(blocks_tail_first) == len(newly_free) == len(has_key)
    post: len(__return__[0]) + len(__return__[1]) == sum(1 for f in newly_free if f)
    post: all(b in blocks_tail_first for b in __return__[0] + __return__[1])
    """
    front: list[int] = []
    back: list[int] = []
    for block, free, keyed in zip(blocks_tail_first, newly_free, has_key):
        if not free:
            continue
        if keyed and caching:
            back.append(block)
        else:
            front.append(block)
    return front, back


def stop_reason(
    token: int,
    num_output_tokens: int,
    num_tokens: int,
    max_tokens: int,
    max_model_len: int,
    eos_token_id: int | None,
    ignore_eos: bool,
    stop_token_ids: tuple[int, ...],
) -> str | None:
    """Whether a request stops after emitting ``token`` (its
    ``num_output_tokens``-th output; ``num_tokens`` counts prompt and output).
    vllm/v1/core/sched/utils.py, check_stop: eos first (ignored with
    ignore_eos, for which vLLM never sets the eos id), then stop tokens, then
    the length caps. Returns "stop", "length" or None.

    pre: num_output_tokens >= 1
    pre: num_tokens > num_output_tokens
    post: __return__ in (None, "stop", "length")
    post: __return__ is not None or (num_output_tokens < max_tokens and num_tokens < max_model_len)
    post: __return__ != "stop" or token in stop_token_ids or token == eos_token_id
    """
    if eos_token_id is not None and not ignore_eos and token == eos_token_id:
        return "stop"
    if token in stop_token_ids:
        return "stop"
    if num_tokens >= max_model_len or num_output_tokens >= max_tokens:
        return "length"
    return None
