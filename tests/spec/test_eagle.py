"""The EAGLE drafter (SchedulerConfig.drafter = "eagle", vLLM's
SpeculativeConfig.use_eagle): lookahead slots without a draft slot, block
keys that cover the token after the block (VllmConfig.num_hash_lookahead_tokens),
so a block is cached only once that token is known and a prefix hit needs it
to match, and the parts the spec does not model refused."""

from __future__ import annotations

import json

import pytest

from schedspec.check.trace import TraceError, loads, version_of
from schedspec.spec.interface import BlockStored, ConfigError, KVCacheGroup, RequestError, RequestSpec, SchedulerConfig
from schedspec.spec.kv_events import event_from_dict, event_to_dict
from schedspec.spec.scheduler import SpecScheduler


def _config(drafter: str = "eagle", **kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(block_size=4, num_blocks=33, max_num_batched_tokens=32, max_num_seqs=4,
                                   max_model_len=64, num_speculative_tokens=2, drafter=drafter,
                                   enable_prefix_caching=True)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def test_the_lookaheads() -> None:
    c = _config()
    assert (c.num_lookahead_tokens, c.num_draft_slots) == (2, 0)
    assert (c.num_prefill_lookahead_tokens, c.num_hash_lookahead_tokens) == (1, 1)
    assert _config(enable_prefix_caching=False).num_hash_lookahead_tokens == 0
    assert _config("draft_model").num_hash_lookahead_tokens == 0
    assert SchedulerConfig.from_dict(c.to_dict()) == c


def test_a_kv_connector_is_refused() -> None:
    """With a KV connector vLLM keeps the legacy hashes and drops a hit's
    trailing block instead: not modelled."""
    with pytest.raises(ConfigError) as err:
        _config(kv_connector=True)
    assert err.value.field == "drafter"
    _config("draft_model", kv_connector=True)  # the same config with a draft model is fine
    _config(kv_cache_groups=(KVCacheGroup(), KVCacheGroup(kind="sliding_window", sliding_window=8)))


def test_sessions_are_refused() -> None:
    s = SpecScheduler(_config())
    with pytest.raises(RequestError) as err:
        s.add(RequestSpec("a", (1, 2, 3), 2, resumable=True))
    assert err.value.field == "resumable"


def test_eagle_needs_trace_format_8() -> None:
    ok = {"schedspec_trace": 8, "config": {"num_speculative_tokens": 2, "drafter": "eagle"}}
    assert loads(json.dumps(ok) + "\n", path="t.jsonl").workload.config.drafter == "eagle"
    old = {"schedspec_trace": 7, "config": {"num_speculative_tokens": 2, "drafter": "eagle"}}
    with pytest.raises(TraceError, match="config.drafter: 'eagle' needs trace format version 8"):
        loads(json.dumps(old) + "\n", path="t.jsonl")
    draft = {"schedspec_trace": 7, "config": {"num_speculative_tokens": 2, "drafter": "draft_model"}}
    assert loads(json.dumps(draft) + "\n", path="t.jsonl").workload.config.drafter == "draft_model"
    trace = loads(json.dumps(ok) + "\n", path="t.jsonl")
    assert version_of(trace) == 8


def _prefill(config: SchedulerConfig, request: RequestSpec) -> SpecScheduler:
    from schedspec.spec.interface import StepResult

    s = SpecScheduler(config)
    s.add(request)
    plan = s.schedule()
    s.update(plan, StepResult({request.request_id: (50,)}))
    return s


def test_a_block_waits_for_the_token_after_it() -> None:
    """A prompt of two whole blocks: its prefill keys only block 0 (block
    1's next token is not known yet), and the event names the token after
    each block it stores; the update that brings the sampled token keys
    block 1 (update_from_output's cache_blocks, with drafts on)."""
    from schedspec.spec.interface import StepResult

    s = SpecScheduler(_config(enable_kv_cache_events=True))
    s.add(RequestSpec("a", tuple(range(1, 9)), 5))
    plan = s.schedule()
    assert sorted(len(k[1]) for k in s.view().kv.block_keys.values()) == [5]  # block 0's 4 tokens and token 5
    stored = [e for e in s.take_kv_events() if isinstance(e, BlockStored)]
    assert [e.lookahead_token_ids for e in stored] == [((5,),)]
    assert event_from_dict(event_to_dict(stored[0])) == stored[0]
    s.update(plan, StepResult({"a": (50,)}))
    assert sorted(len(k[1]) for k in s.view().kv.block_keys.values()) == [5, 9]
    stored = [e for e in s.take_kv_events() if isinstance(e, BlockStored)]
    assert [(e.token_ids, e.lookahead_token_ids) for e in stored] == [((5, 6, 7, 8), ((50,),))]


@pytest.mark.parametrize("drafter, hit", [("draft_model", 4), ("eagle", 0)])
def test_a_hit_needs_the_token_after_the_block(drafter: str, hit: int) -> None:
    """b shares a's first block but not the token after it: a draft model's
    keys hit the block, EAGLE's do not."""
    s = _prefill(_config(drafter), RequestSpec("a", (1, 2, 3, 4, 5, 6, 7, 8, 9), 5))
    s.add(RequestSpec("b", (1, 2, 3, 4, 9, 9, 9, 9, 9), 5))
    plan = s.schedule()
    entry = next(e for e in plan.scheduled if e.request_id == "b")
    assert entry.num_computed_tokens == hit
    # with the same next token EAGLE hits too
    s = _prefill(_config(), RequestSpec("a", (1, 2, 3, 4, 5, 6, 7, 8, 9), 5))
    s.add(RequestSpec("c", (1, 2, 3, 4, 5, 9, 9, 9, 9), 5))
    entry = next(e for e in s.schedule().scheduled if e.request_id == "c")
    assert entry.num_computed_tokens == 4


@pytest.mark.parametrize("drafter, inputs", [("ngram", (0,)), ("eagle", (0, 1))])
def test_the_encoder_window_reaches_one_token_further(drafter: str, inputs: tuple[int, ...]) -> None:
    """A chunk of 8 tokens (the budget) ending right before an encoder
    input: EAGLE reads the next token, so that input runs in this step too
    (Scheduler._try_schedule_encoder_inputs, shift_computed_tokens)."""
    from schedspec.spec.interface import MMInput

    config = _config(drafter, max_num_batched_tokens=8, max_num_seqs=2, max_num_encoder_input_tokens=8,
                     encoder_cache_size=8)
    s = SpecScheduler(config)
    s.add(RequestSpec("a", tuple(range(1, 17)), 2, mm_inputs=(MMInput(4, 4, "x"), MMInput(8, 4, "y"))))
    (entry,) = s.schedule().scheduled
    assert entry.num_scheduled_tokens == 8
    assert entry.encoder_inputs == inputs
