"""Our requests as vLLM's: the vLLM Request of a RequestSpec (sampling
parameters, eos, the modelled connector's kv_transfer_params, the LoRA
adapter, the encoder inputs), the adapter's record of a live request, and
the modelled grammar of a structured-output request with the one backend
method the scheduler's path reaches.

* A request's ``lora_id`` becomes a ``LoRARequest`` (lora_int_id = the id, a
  name and path derived from it, which vLLM's block hashes chain in).
* ``structured_output``: the request carries a constraint, so vLLM adds it in
  WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR; its grammar (a Future the adapter
  resolves) is a ``Grammar`` refusing ``grammar_rejects``.
* ``mm_inputs`` become MultiModalFeatureSpecs (positions, size, identifier,
  no data).
* ``kv_cache_report_mode`` "full" goes in ``SamplingParams.extra_args``.

vLLM is imported by the first call (schedspec/adapters/vllm_load.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schedspec.spec.interface import MMInput, RequestSpec

from schedspec.adapters.vllm_load import load_vllm


@dataclass
class Live:
    """A request the adapter handed to vLLM and vLLM has not finished."""

    spec: RequestSpec
    req: Any  # vllm.v1.request.Request
    num_hashed: int = 0  # block hashes already translated to content keys


def vllm_request(request: RequestSpec, block_hasher: Any, connector: bool) -> Any:
    """The vLLM Request for ``request``, as the engine would hand it to the
    scheduler, hashing its blocks with ``block_hasher`` (vllm_names.block_hasher)
    and, with a ``connector``, carrying the modelled connector's fields."""
    load_vllm()
    from schedspec.adapters import vllm_names as v

    params = v.SamplingParams(
        max_tokens=request.max_tokens,
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        # any constraint makes a structured-output request; the grammar
        # itself is the modelled one (grammar_ready)
        structured_outputs=(
            v.StructuredOutputsParams(regex=".*") if request.structured_output else None
        ),
    )
    # What the engine's input processor does with the tokenizer's eos id:
    # with ignore_eos the id is not set, so check_stop never matches it.
    params.update_from_generation_config({}, request.eos_token_id)
    extra: dict[str, Any] = {}
    transfer = kv_transfer_params(request) if connector else None
    if transfer is not None:
        # what vLLM's Request reads its kv_transfer_params from
        extra["kv_transfer_params"] = transfer
    if request.kv_cache_report_mode != "incremental":
        # Request.__init__ reads kv_cache_report_mode from the same place
        extra["kv_cache_report_mode"] = request.kv_cache_report_mode
    if extra:
        params.extra_args = extra
    return v.Request(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        arrival_time=float(request.arrival),
        priority=request.priority,
        cache_salt=request.cache_salt,
        block_hasher=block_hasher,
        lora_request=lora_request(request.lora_id),
        mm_features=[mm_feature(mm) for mm in request.mm_inputs] or None,
        resumable=request.resumable,
    )


def kv_transfer_params(request: RequestSpec) -> dict[str, Any] | None:
    """The modelled connector's fields of ``request``, as the request's
    kv_transfer_params (vllm_connector.kv_transfer_params)."""
    from schedspec.adapters import vllm_connector

    return vllm_connector.kv_transfer_params(request.kv_external_tokens, request.kv_load_async,
                                             request.kv_save_async)


def lora_request(lora_id: int) -> Any:
    """Adapter ``lora_id`` as the engine names it: lora_int_id is the id,
    and the name and path (what vLLM's block hashes chain in:
    kv_cache_utils.py, _gen_lora_extra_hash_keys) derive from it, so equal
    ids share blocks and different ones never do."""
    if not lora_id:
        return None
    from schedspec.adapters.vllm_names import LoRARequest

    return LoRARequest(
        lora_name=f"schedspec-lora-{lora_id}", lora_int_id=lora_id,
        lora_path=f"/schedspec/lora/{lora_id}",
    )


def mm_feature(mm: MMInput) -> Any:
    """An encoder input as vLLM's input processor hands it over (positions,
    size and identifier; no data: the model runner is not ours)."""
    from schedspec.adapters.vllm_names import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=mm.identifier,
        mm_position=PlaceholderRange(offset=mm.offset, length=mm.length),
    )

# ------------------------------------------------------------------ raw timing


class Grammar:
    """The modelled grammar of a structured-output request, in the place of a
    compiled xgrammar/guidance matcher (vllm/v1/structured_output/
    backend_types.py, StructuredOutputGrammar): stateless, it refuses the
    token ids in ``rejects`` and accepts every other one. What the scheduler
    and the structured-output manager call on a grammar: ``validate_tokens``
    (the longest prefix of drafts with no refused token), ``accept_tokens``,
    ``rollback``, ``fill_bitmask``, ``is_terminated`` and ``reset``."""

    def __init__(self, rejects: tuple[int, ...]) -> None:
        self.rejects = frozenset(rejects)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return not any(t in self.rejects for t in tokens)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.rejects:
                return tokens[:i]
        return list(tokens)

    def rollback(self, num_tokens: int) -> None:
        pass  # stateless: nothing advanced

    def fill_bitmask(self, bitmask: Any, batch_index: int) -> None:
        row = bitmask[batch_index]
        row.fill_(-1)
        if self.rejects:
            bits = row.numpy().view("uint32")
            for t in self.rejects:
                if 0 <= t >> 5 < len(bits):  # an id past the vocabulary is never sampled anyway
                    bits[t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


class GrammarBackend:
    """The one method of a structured-output backend the scheduler's path
    reaches without a tokenizer (StructuredOutputManager.grammar_bitmask,
    ``allocate_token_bitmask``): one row of vocab bits per mask."""

    def __init__(self, torch: Any, vocab_size: int) -> None:
        self._torch = torch
        self._words = (vocab_size + 31) // 32

    def allocate_token_bitmask(self, max_num_seqs: int) -> Any:
        return self._torch.full((max_num_seqs, self._words), -1, dtype=self._torch.int32)

    def destroy(self) -> None:
        pass
