"""The model checker's ``mamba`` bound: a Mamba group in "align" mode beside
full attention, every state explored with every invariant and ImplScheduler
in lockstep, the align-mode rules reached."""

from __future__ import annotations

from schedspec.invariants import CATALOGUE
from schedspec.modelcheck import Explorer, bound

#: as tests/modelcheck/test_kv.py: the catalogue but the two invariants
#: stale with the service-order waiting queue
INVARIANTS = tuple(i for i in CATALOGUE if i.id not in {"waiting-queue-order", "no-starvation"})


def test_the_bound_is_full_attention_beside_a_mamba_group() -> None:
    spaces = bound("hybrid-mamba").spaces
    assert [s.name for s in spaces] == ["mamba-full"]
    assert [g.kind for g in spaces[0].config.kv_cache_groups] == ["full_attention", "mamba"]
    assert spaces[0].kv() == ("hybrid",)


def test_the_mamba_space_explores_clean_with_impl_in_lockstep() -> None:
    from schedspec.impl.scheduler import ImplScheduler

    space = bound("hybrid-mamba").spaces[0]
    r = Explorer(space, invariants=INVARIANTS, impl_cls=ImplScheduler).run()
    assert r.complete and r.failure is None, r.failure and r.failure.describe()
    assert r.impl_transitions == r.transitions > 0 and r.liveness_bound is not None
    assert r.rules["mamba.chunk_aligned"] > 0
