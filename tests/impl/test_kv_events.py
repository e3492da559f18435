"""impl's KV cache events equal the spec's, event for event, in every mode
and KV layout; with events off impl keeps no queue and builds no event."""

from __future__ import annotations

import dataclasses

import pytest

from schedspec.check.random_workloads import random_workload
from schedspec.check.run import run_workload
from schedspec.impl import ImplScheduler
from schedspec.spec import SpecScheduler
from schedspec.spec.interface import BlockStored, MMInput
from tests.helpers import cfg, req, step


@pytest.mark.parametrize("modes, kv", [
    (("sync",), ()), (("async",), ()), (("spec",), ()), (("async-spec",), ()),
    (("sync",), ("hybrid",)), (("async",), ("hybrid", "connector")), (("sync",), ("connector",)),
])
def test_impl_streams_equal_the_spec_in_lockstep(modes: tuple[str, ...], kv: tuple[str, ...]) -> None:
    events = 0
    for seed in range(2):
        w = random_workload(seed, 120, modes=modes, kv=kv,
                            gates=("lora", "pause") if "connector" not in kv else ())
        w = dataclasses.replace(w, config=dataclasses.replace(w.config, enable_kv_cache_events=True))
        runner, failure = run_workload(w, {"spec": SpecScheduler, "impl": ImplScheduler}, oracle_seed=seed)
        assert failure is None, failure.describe()
        events += runner.stats.kv_cache_events
    assert events > 0


def test_events_off_build_nothing() -> None:
    s = ImplScheduler(cfg())
    s.add(req("a", 9))
    step(s)
    assert s._px.events is None and s.take_kv_events() == ()


def test_impl_names_the_same_events_as_the_spec() -> None:
    a, b = SpecScheduler(cfg(enable_kv_cache_events=True)), ImplScheduler(cfg(enable_kv_cache_events=True))
    for s in (a, b):
        s.add(req("x", 9, max_tokens=5))
        s.add(req("y", [0, 1, 2, 3, 9, 9, 9, 9, 9], max_tokens=5))
    for _ in range(6):
        step(a)
        step(b)
        assert a.take_kv_events() == b.take_kv_events()


def test_long_prefix_fast_keys_equal_the_spec_and_removals_read_the_node() -> None:
    """Requests of long prompts sharing a prefix, through a pool small enough
    to evict: impl's keys (built once per stored block and left on the node,
    impl/kv_events.py stored_keyed) name the same events as the spec's, and
    every node a BlockStored registered carries the key its BlockRemoved names."""
    config = cfg(num_blocks=48, max_model_len=180, max_num_batched_tokens=48, enable_kv_cache_events=True,
                 max_loras=2, max_num_encoder_input_tokens=64, encoder_cache_size=64)
    a, b = SpecScheduler(config), ImplScheduler(config)
    shared = list(range(100))
    for s in (a, b):
        for k in range(6):
            s.add(req(f"r{k}", shared + [50 + k] * (4 + 9 * k), max_tokens=12))
        # an adapter's keys (one identity for every block) and an encoder
        # input inside block 5 (the identity changes there: identity marks)
        s.add(req("lora", shared + [7] * 9, max_tokens=8, lora_id=1))
        s.add(req("mm", shared + [8] * 9, max_tokens=8, mm_inputs=(MMInput(22, 6, "img"),)))
    kinds: set[str] = set()
    identities: set[str] = set()
    for _ in range(120):
        step(a)
        step(b)
        ea, eb = a.take_kv_events(), b.take_kv_events()
        assert ea == eb
        kinds |= {type(e).__name__ for e in eb}
        identities |= {k[0] for e in eb if isinstance(e, BlockStored) for k in e.block_keys}
        assert all(node.ekey is not None for node in b._px.intern.values() if node.holders)
    assert {"BlockStored", "BlockRemoved"} <= kinds
    assert any("img" in i for i in identities) and any("img" not in i and i.startswith("\x00") for i in identities)


def test_a_clone_keeps_the_keys_its_removals_name() -> None:
    """ImplScheduler.clone (PrefixIndex.copy) carries each node's event key:
    the clone, driven on, names the same events as the spec driven on."""
    config = cfg(num_blocks=12, enable_kv_cache_events=True)
    a, b = SpecScheduler(config), ImplScheduler(config)
    for s in (a, b):
        s.add(req("x", 13, max_tokens=6))
        s.add(req("y", [5] * 13, max_tokens=6))
    for _ in range(3):
        step(a)
        step(b)
    a.take_kv_events()
    b.take_kv_events()
    c = b.clone()
    assert [n.ekey for n in c._px.intern.values()] == [n.ekey for n in b._px.intern.values()]
    assert any(n.ekey is not None for n in c._px.intern.values())
    for s in (a, c):
        s.add(req("z", [9] * 21, max_tokens=4))
    removed = 0
    for _ in range(10):
        step(a)
        step(c)
        ea, ec = a.take_kv_events(), c.take_kv_events()
        assert ea == ec
        removed += sum(type(e).__name__ == "BlockRemoved" for e in ec)
    assert removed > 0


def test_an_event_built_in_place_equals_the_constructors() -> None:
    """impl/kv_events.py fills fresh events' ``__dict__``: each equals,
    hashes, prints and pickles as the dataclass constructor's."""
    import pickle

    from schedspec.impl.kv_events import _stored
    from schedspec.impl.prefix_index import removed
    from schedspec.spec.interface import MEDIUM_GPU, BlockRemoved

    key = ("salt", (1, 2, 3, 4))
    pairs = [
        (_stored((key,), None, (1, 2, 3, 4), 4, None, 0, "full_attention"),
         BlockStored((key,), None, (1, 2, 3, 4), 4, None, MEDIUM_GPU, 0, "full_attention")),
        (_stored((("s", (1, 2, 3, 4, 5, 6, 7, 8)),), key, (5, 6, 7, 8), 4, 3, 1, "sliding_window"),
         BlockStored((("s", (1, 2, 3, 4, 5, 6, 7, 8)),), key, (5, 6, 7, 8), 4, 3, MEDIUM_GPU, 1, "sliding_window")),
        (removed((key, 2)), BlockRemoved((key,), MEDIUM_GPU, 2)),
    ]
    for mine, theirs in pairs:
        assert type(mine) is type(theirs)
        assert mine == theirs and hash(mine) == hash(theirs) and repr(mine) == repr(theirs)
        assert pickle.loads(pickle.dumps(mine)) == theirs and list(vars(mine)) == list(vars(theirs))


def test_a_decode_run_keys_each_block_from_its_parents_key() -> None:
    """Long decodes past the prompt, with a shared prefix, a LoRA adapter and
    an encoder input (identity marks): each stored key's tokens are its
    parent's and the block's own (stored_run), and the stream equals the
    spec's, event for event."""
    config = cfg(num_blocks=40, max_model_len=120, max_num_batched_tokens=64, enable_kv_cache_events=True,
                 max_loras=2, max_num_encoder_input_tokens=64, encoder_cache_size=64)
    a, b = SpecScheduler(config), ImplScheduler(config)
    for s in (a, b):
        s.add(req("p", list(range(20)), max_tokens=60))
        s.add(req("q", list(range(20)) + [3] * 5, max_tokens=50, lora_id=1))
        s.add(req("m", [4] * 9, max_tokens=40, mm_inputs=(MMInput(5, 3, "img"),)))
    stored = removed = 0
    for _ in range(90):
        step(a)
        step(b)
        ea, eb = a.take_kv_events(), b.take_kv_events()
        assert ea == eb
        removed += sum(type(e).__name__ == "BlockRemoved" for e in eb)
        for e in eb:
            if isinstance(e, BlockStored):
                stored += len(e.block_keys)
                first = e.block_keys[0][1]
                assert first[: len(first) - 4] == (e.parent_key[1] if e.parent_key else ())
                assert sum((k[1][-4:] for k in e.block_keys), ()) == e.token_ids
    assert stored > 30 and removed > 0
