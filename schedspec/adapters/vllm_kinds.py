"""The vLLM adapter's KV cache group kinds: one class per kind, found through
``KINDS`` by the group's ``kind`` name (spec/kv_kinds.py's registry).

What the adapter knows of a kind: the KVCacheSpec it hands vLLM for a group
(vllm/v1/kv_cache_interface.py) and the single-type manager vLLM must build
for it (vllm/v1/core/single_type_kv_cache_manager.py, spec_manager_map). A
new kind is one class here and its entry in ``KINDS``. Importing this module
imports no vLLM: the spec classes come from ``v``, the adapter's module of vLLM's names
(adapters/vllm_names.py).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from schedspec.spec.interface import KVCacheGroup


class VllmKind:
    """Full attention: FullAttentionSpec, FullAttentionManager."""

    #: the class name of the manager vLLM builds for a group of this kind
    manager_name: ClassVar[str] = "FullAttentionManager"
    #: the CacheConfig.mamba_cache_mode a layout with this kind needs (None: any)
    cache_mode: ClassVar[str | None] = None

    def kv_cache_spec(self, v: Any, group: KVCacheGroup, common: dict[str, Any]) -> Any:
        """vLLM's KVCacheSpec of ``group`` (``common``: block size, heads,
        head size, dtype)."""
        return v.FullAttentionSpec(**common)


class FullAttention(VllmKind):
    """FullAttentionSpec, FullAttentionManager."""


class SlidingWindow(VllmKind):
    """SlidingWindowSpec of the group's window, SlidingWindowManager."""

    manager_name = "SlidingWindowManager"

    def kv_cache_spec(self, v: Any, group: KVCacheGroup, common: dict[str, Any]) -> Any:
        return v.SlidingWindowSpec(sliding_window=group.sliding_window, **common)


class ChunkedLocal(VllmKind):
    """ChunkedLocalAttentionSpec of the group's attention chunk,
    ChunkedLocalAttentionManager."""

    manager_name = "ChunkedLocalAttentionManager"

    def kv_cache_spec(self, v: Any, group: KVCacheGroup, common: dict[str, Any]) -> Any:
        return v.ChunkedLocalAttentionSpec(attention_chunk_size=group.attention_chunk_size, **common)


class Mamba(VllmKind):
    """MambaSpec in "align" mode of the config's block size (one float32
    state of one element: the scheduler reads no shape), MambaManager. The
    config's CacheConfig gets mamba_cache_mode "align" (adapters/vllm_config.py,
    as MambaModelConfig.verify_and_update_config sets it with prefix caching)."""

    manager_name = "MambaManager"
    #: the CacheConfig.mamba_cache_mode a layout with this kind runs in
    cache_mode: ClassVar[str | None] = "align"

    def kv_cache_spec(self, v: Any, group: KVCacheGroup, common: dict[str, Any]) -> Any:
        return v.MambaSpec(block_size=common["block_size"], shapes=((1,),), dtypes=(common["dtype"],),
                           mamba_cache_mode="align")


#: Every kind the adapter hands vLLM, by its ``KVCacheGroup.kind`` name.
KINDS: dict[str, VllmKind] = {
    "full_attention": FullAttention(),
    "sliding_window": SlidingWindow(),
    "chunked_local": ChunkedLocal(),
    "mamba": Mamba(),
}


def vllm_kind(group: KVCacheGroup) -> VllmKind:
    """The adapter's class of a (validated) group's kind."""
    return KINDS[group.kind]


def mamba_cache_mode(groups: tuple[KVCacheGroup, ...]) -> Literal["align", "none"]:
    """CacheConfig.mamba_cache_mode for a layout: "align" when a group's kind
    needs it, else vLLM's default "none"."""
    return "align" if any(KINDS[g.kind].cache_mode == "align" for g in groups) else "none"
