"""impl's hybrid KV cache groups (impl/kv_groups.py): every group's table,
the sliding window's freed blocks, group keys and the hit valid in every
group, with exact values, spec and impl side by side (tests.helpers.Twin)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import dataclasses

import pytest

import schedspec.check.oracle as oracle
from schedspec.check.run import run_workload
from schedspec.check.random_workloads import random_workload
from schedspec.impl import ImplScheduler
from schedspec.spec import SchedulerConfig
from schedspec.spec.interface import KVCacheGroup, StepResult, group_block_key
from schedspec.spec.errors import SchedSpecError
from schedspec.spec.scheduler import SpecScheduler

from tests.helpers import Tok, Twin, req

FULL = KVCacheGroup()
SW4 = KVCacheGroup(kind="sliding_window", sliding_window=4)
CL4 = KVCacheGroup(kind="chunked_local", attention_chunk_size=4)


def config(groups: tuple[KVCacheGroup, ...] = (FULL, SW4), **kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(block_size=2, num_blocks=41, max_num_batched_tokens=16, max_num_seqs=4,
                                   max_model_len=32, kv_cache_groups=groups)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def test_every_group_has_its_table_in_plans_and_views() -> None:
    t = Twin(config())
    t.add(req("a", 6, max_tokens=8))
    (e,) = t.schedule().scheduled
    assert e.group_block_ids == ((1, 2, 3), (4, 5, 6))
    assert e.block_ids == (1, 2, 3)
    assert t.impl.view().requests["a"].group_block_ids == ((1, 2, 3), (4, 5, 6))


def test_a_sliding_window_frees_the_blocks_out_of_its_window() -> None:
    t = Twin(config())
    t.add(req("a", 6, max_tokens=8))
    t.step()  # the prompt: 6 tokens
    # 6 computed: the window of the next token skips 3 tokens, so block 0 of the window group goes
    (e,) = t.step().scheduled
    assert e.group_block_ids == ((1, 2, 3, 7), (0, 5, 6, 8))
    assert t.impl.view().kv.ref_cnt[4] == 0
    (e,) = t.step().scheduled  # 7 computed: 4 skipped, block 1 goes too
    assert e.group_block_ids == ((1, 2, 3, 7), (0, 0, 6, 8))
    v = t.impl.view()
    assert v.requests["a"].group_block_ids[1][:2] == (0, 0)
    assert v.kv.ref_cnt[5] == 0


def test_group_keys_carry_the_group() -> None:
    t = Twin(config())
    t.add(req("a", 6, max_tokens=1))
    t.step()
    keys = t.impl.view().kv.block_keys
    toks = tuple(range(6))
    assert keys[1] == ("", toks[:2]) and keys[2] == ("", toks[:4])
    # the window group caches only the blocks a hit can reach: the 2 before the replay boundary 5
    assert {b: k for b, k in keys.items() if b >= 4} == {
        4: group_block_key(("", toks[:2]), 1), 5: group_block_key(("", toks[:4]), 1)}
    assert 3 in keys and 6 not in keys


def test_a_hit_is_valid_in_every_group() -> None:
    t = Twin(config())
    t.add(req("a", 6, max_tokens=1))
    t.step()
    t.add(req("b", 7, max_tokens=1))
    (e,) = t.schedule().scheduled
    # full attention hits blocks 0, 1 (the hit leaves the last token); the window group hits its
    # two blocks (the window of 4 reaches both)
    assert (e.num_computed_tokens, e.group_block_ids) == (4, ((1, 2, 6, 7), (4, 5, 8, 9)))


def test_a_lone_sliding_window_group() -> None:
    t = Twin(config(groups=(SW4,)))
    t.add(req("a", 9, max_tokens=3))
    t.step()
    plan = t.step()
    assert plan.scheduled[0].group_block_ids[0][:3] == (0, 0, 0)


def test_a_chunked_local_group_frees_each_chunk_as_it_passes() -> None:
    t = Twin(config(groups=(FULL, CL4)))
    t.add(req("a", 6, max_tokens=8))
    t.step()  # the prompt: 6 tokens; the next token's chunk starts at 4
    (e,) = t.step().scheduled
    assert e.group_block_ids == ((1, 2, 3, 7), (0, 0, 6, 8))
    assert t.impl.view().kv.ref_cnt[4] == t.impl.view().kv.ref_cnt[5] == 0
    (e,) = t.step().scheduled  # 7 computed: still in the chunk 4..7, nothing more goes
    assert e.group_block_ids == ((1, 2, 3, 7), (0, 0, 6, 8))
    t.step()
    (e,) = t.step().scheduled  # 9 computed: the chunk 8..11, blocks 2 and 3 go
    assert e.group_block_ids[1][:4] == (0, 0, 0, 0)


def test_a_chunked_local_hit_starts_at_the_chunk_of_the_next_token() -> None:
    t = Twin(config(groups=(FULL, CL4)))
    t.add(req("a", 9, max_tokens=1))
    t.step()
    t.add(req("b", 10, max_tokens=1))
    (e,) = t.schedule().scheduled
    # max_length 9: the chunk start is 8, so block 4 of the chunked group would be looked up
    # (not cached: a's 9th token never filled it); the full group's 4 blocks cap the hit at 8
    assert e.num_computed_tokens == 8
    assert e.group_block_ids[1][:2] == (0, 0)


def test_a_lone_chunked_local_group() -> None:
    t = Twin(config(groups=(CL4,)))
    t.add(req("a", 9, max_tokens=3))
    t.step()
    plan = t.step()
    assert plan.scheduled[0].group_block_ids[0][:2] == (0, 0)


def test_full_plus_window_with_a_connector_load() -> None:
    t = Twin(config(kv_connector=True))
    t.add(req("a", 9, kv_external_tokens=8, kv_load_async=True))
    plan = t.schedule()
    (load,) = plan.kv_loads
    assert load.group_block_ids == ((1, 2, 3, 4), (0, 0, 5, 6))
    t.update(plan, StepResult({}, finished_recving=("a",)))
    (e,) = t.schedule().scheduled
    assert (e.num_computed_tokens, e.num_scheduled_tokens) == (8, 1)


def test_a_load_ending_on_a_chunk_boundary_still_gives_later_groups_their_blocks() -> None:
    """A load whose tokens end on a chunk boundary leaves the chunked-local
    group nothing to hold (its chunk starts at the next token); the groups
    after it still get blocks for the external tokens, before the blocks of
    the step's own token."""
    for load_async in (True, False):
        t = Twin(config(groups=(FULL, CL4, FULL), kv_connector=True, num_blocks=61))
        t.add(req("a", 9, kv_external_tokens=8, kv_load_async=load_async))
        plan = t.schedule()
        (load,) = plan.kv_loads
        if load_async:
            assert load.group_block_ids == ((1, 2, 3, 4), (0, 0, 0, 0), (5, 6, 7, 8))
        else:
            (e,) = plan.scheduled
            assert e.group_block_ids == ((1, 2, 3, 4, 9), (0, 0, 0, 0, 10), (5, 6, 7, 8, 11))


def _lenient(monkeypatch: pytest.MonkeyPatch) -> None:
    def execute(self: Any, plan: Any, context: Mapping[str, Sequence[int]] | None = None) -> Any:
        truth = None if context is None else {rid: tuple(t) for rid, t in context.items()}
        return self.run(plan, truth)[0]

    monkeypatch.setattr(oracle.FakeModel, "execute", execute)


@pytest.mark.parametrize("mode", ["sync", "async", "spec", "async-spec"])
def test_hybrid_and_connector_workloads_run_in_lockstep(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded workloads with hybrid groups and the connector (each draws a
    subset), to quiescence; the model's context check is set aside as in
    tests/impl/test_connector_lockstep.py."""
    _lenient(monkeypatch)
    hybrid = 0
    for seed in range(8):
        w = random_workload(seed, 60, modes=(mode,), kv=("connector", "hybrid"))
        hybrid += w.config.is_hybrid
        _, failure = run_workload(w, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed,
                                  invariants=[])
        assert failure is None, f"seed {seed}: " + failure.describe()
    assert hybrid >= 3


#: Layouts with a chunked-local group (and the sliding-window ones), run in
#: lockstep on the check engine's random workloads.
LAYOUTS: tuple[tuple[KVCacheGroup, ...], ...] = (
    (FULL, KVCacheGroup(kind="chunked_local", attention_chunk_size=4)),
    (FULL, KVCacheGroup(kind="chunked_local", attention_chunk_size=3)),
    (KVCacheGroup(kind="chunked_local", attention_chunk_size=6),),
    (FULL, KVCacheGroup(kind="sliding_window", sliding_window=5), KVCacheGroup(kind="chunked_local",
                                                                                attention_chunk_size=8)),
    (FULL, KVCacheGroup(kind="chunked_local", attention_chunk_size=4), FULL),
    (FULL, KVCacheGroup(kind="sliding_window", sliding_window=3)),
)


@pytest.mark.parametrize("mode", ["sync", "async", "spec", "async-spec"])
def test_chunked_local_layouts_run_in_lockstep(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layout of LAYOUTS in place of a random workload's groups (the
    pool grown as the generator grows it), with and without the connector:
    spec and impl make the same plans and views at every event."""
    _lenient(monkeypatch)
    ran = 0
    for seed in range(12):
        layout = LAYOUTS[seed % len(LAYOUTS)]
        w = random_workload(seed, 60, modes=(mode,), kv=("connector",) if seed % 2 else ())
        cfg = w.config
        if cfg.block_size > 4:  # short chunks relative to the blocks, so chunks pass
            continue
        try:
            cfg = dataclasses.replace(cfg, kv_cache_groups=layout, num_blocks=1 + (cfg.num_blocks - 1) * len(layout))
        except SchedSpecError:
            continue  # a layout this config cannot take
        _, failure = run_workload(dataclasses.replace(w, config=cfg), {"spec": SpecScheduler, "impl": ImplScheduler},
                                  oracle_seed=seed, invariants=[])
        assert failure is None, f"seed {seed}, layout {layout}: " + failure.describe()
        ran += 1
    assert ran >= 6


@pytest.mark.parametrize("asyn", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("local", [KVCacheGroup(kind="sliding_window", sliding_window=8),
                                   KVCacheGroup(kind="chunked_local", attention_chunk_size=8),
                                   KVCacheGroup("mamba")],
                         ids=["window", "chunk", "mamba"])
def test_a_steady_hybrid_decode_asks_the_coordinator_only_at_boundaries(
    asyn: bool, local: KVCacheGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hybrid steady path (cap, next_full, gskip): a decoding request
    calls the coordinator (_grow_running_groups) only at a step that needs a
    block, fills one to key, passes a window or chunk boundary or retires
    a Mamba state, here one step in four to three in four with blocks of 4
    (every step before); the
    plans and views stay the spec's at every call, frees and keys included."""
    calls: list[str] = []
    grow = ImplScheduler._grow_running_groups

    def counted(self: ImplScheduler, req: Any, end: int) -> bool:
        calls.append(req.request_id)
        return grow(self, req, end)

    monkeypatch.setattr(ImplScheduler, "_grow_running_groups", counted)
    t = Twin(config(groups=(FULL, local), block_size=4, num_blocks=81, max_model_len=96,
                    max_num_batched_tokens=64, async_scheduling=asyn))
    for rid, n in (("a", 9), ("b", 14)):
        t.add(req(rid, n, max_tokens=60))
    in_flight: list[Any] = []
    entries = 0
    for step in range(50):
        plan = t.schedule()
        if step >= 2:  # past the prefills
            entries += len(plan.scheduled)
        in_flight.append(plan)
        if len(in_flight) >= (2 if asyn else 1):
            old = in_flight.pop(0)
            t.update(old, StepResult({e.request_id: (7,) for e in old.scheduled if e.samples}))
        if step == 2:
            calls.clear()
    tables = t.impl.view().requests["a"].group_block_ids
    assert tables[1][:4] == (0, 0, 0, 0) and tables[0][0] != 0  # the local group freed, full attention kept
    # sync: 47 (window), 47 (chunk) and 71 (Mamba: a state block, a key and
    # a retired state in every four steps) calls in 96 entries; async: 24, 36
    # and 49 (every step asked before)
    most = 0.75 if local.kind == "mamba" else 0.6
    assert entries >= 90 and 0.15 * entries <= len(calls) <= most * entries, (len(calls), entries)


def test_a_window_hit_past_its_null_blocks_takes_the_blocks_behind_them() -> None:
    """A hit longer than the window: the window group's hit starts with null
    blocks (out of the window) and takes its cached blocks after them from the
    free queue, with a reference each (kv_cache_manager.py, allocate_slots ->
    touch)."""
    t = Twin(config(max_num_batched_tokens=32))
    t.add(req("a", 12, max_tokens=1))
    t.step()  # a: 12 tokens, finished; its blocks free and cached
    t.add(req("b", 13, max_tokens=1))
    (e,) = t.schedule().scheduled
    window = e.group_block_ids[1]
    # the window group cached only a's blocks a hit can reach: the hit stops at 10 tokens, its
    # window (tokens 7..9) in blocks 3 and 4, blocks 0..2 null
    assert e.num_computed_tokens == 10
    assert window[:3] == (0, 0, 0) and 0 not in window[3:5]
    ref = t.impl.view().kv.ref_cnt
    assert all(ref[b] == 1 for b in window[3:5])
    assert t.impl.view() == t.spec.view()


def test_encoder_identities_key_every_group_of_a_hybrid_layout() -> None:
    """Encoder inputs change a request's identity at the block they start in:
    each group's keys carry it from that block on, and a second request with
    the same tokens but another image hits only the blocks before it, in
    every group (block_hasher's extra keys, per group)."""
    from schedspec.spec.interface import MMInput

    t = Twin(config(max_num_batched_tokens=32, max_num_encoder_input_tokens=16, encoder_cache_size=16))
    t.add(req("a", 12, max_tokens=1, mm_inputs=(MMInput(6, 2, "cat"),)))
    t.step()
    t.add(req("b", 12, max_tokens=1, mm_inputs=(MMInput(6, 2, "dog"),)))
    t.add(req("c", 13, max_tokens=1, mm_inputs=(MMInput(6, 2, "cat"),)))
    hit = {e.request_id: e.num_computed_tokens for e in t.schedule().scheduled}
    # c: a's tokens and image, the hit a plain request gets (the window group's cached blocks
    # stop it at 10); b: another image from block 3 on, so no window-group block matches
    assert hit == {"b": 0, "c": 10}


def test_each_kinds_skip_and_mask_flags_say_what_its_rules_do() -> None:
    """The coordinator reads ``skips`` (remove_skipped_blocks visits only such
    groups) and ``masks`` (only such groups build a cache mask): each kind's
    flags agree with the spec's kind and with its own rules."""
    from schedspec.impl import kv_kinds as impl_kinds
    from schedspec.spec import kv_kinds as spec_kinds

    for name, cls in impl_kinds.KINDS.items():
        fields = {f: 8 for f in spec_kinds.KINDS[name].fields}
        rules = impl_kinds.rules_of(KVCacheGroup(name, **fields))  # type: ignore[arg-type]
        assert cls.skips == spec_kinds.KINDS[name].skips, name
        assert cls.skips == any(rules.skipped_tokens(n) for n in range(64)), name
        assert cls.masks == (rules.cache_mask(0, 8, 4, [17]) is not None), name


@pytest.mark.parametrize("local", [SW4, KVCacheGroup("mamba")], ids=["window", "mamba"])
def test_a_sync_hybrid_update_matches_the_spec_on_good_and_bad_results(local: KVCacheGroup) -> None:
    """Synchronous hybrid groups with no other gate: prefill chunks, a stop,
    a length cap and an abort while the step ran; results the update must
    refuse (two tokens for one entry, tokens for an unscheduled request) give
    the spec's error, and an int subclass as a token is taken as the spec
    takes it. The views equal the spec's after every event (Twin)."""
    t = Twin(config(groups=(FULL, local), block_size=4, num_blocks=81, max_model_len=96,
                    max_num_batched_tokens=8))
    t.add(req("a", 12, max_tokens=30, stop_token_ids=(3,)))
    t.add(req("b", 5, max_tokens=6))
    t.add(req("c", 6, max_tokens=30))
    for _ in range(6):
        t.step()
    plan = t.schedule()
    t.abort("c")  # while the step ran: its tokens are ignored
    t.update(plan, StepResult({e.request_id: (9,) for e in plan.scheduled if e.samples}))
    plan = t.schedule()
    sampling = [e.request_id for e in plan.scheduled if e.samples]
    assert sampling
    bad: list[dict[str, tuple[int, ...]]] = [
        {rid: (1, 2) if rid == sampling[-1] else (1,) for rid in sampling},
        {**{rid: (1,) for rid in sampling}, "zz": (1,)},
    ]
    for sampled in bad:
        t.expect_error(lambda s: s.update(plan, StepResult(sampled)))
    t.update(plan, StepResult({rid: (Tok(1),) for rid in sampling}))  # valid after all
    for _ in range(40):
        t.step(lambda rid: 3 if rid == "a" else 5)  # "a" stops, "b" reaches its length cap
    assert not t.impl.view().requests
