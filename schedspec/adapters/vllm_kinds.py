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

from typing import Any, ClassVar

from schedspec.spec.interface import KVCacheGroup


class VllmKind:
    """Full attention: FullAttentionSpec, FullAttentionManager."""

    #: the class name of the manager vLLM builds for a group of this kind
    manager_name: ClassVar[str] = "FullAttentionManager"

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


#: Every kind the adapter hands vLLM, by its ``KVCacheGroup.kind`` name.
KINDS: dict[str, VllmKind] = {
    "full_attention": FullAttention(),
    "sliding_window": SlidingWindow(),
    "chunked_local": ChunkedLocal(),
}


def vllm_kind(group: KVCacheGroup) -> VllmKind:
    """The adapter's class of a (validated) group's kind."""
    return KINDS[group.kind]
