"""The spec's record of one unfinished request (vLLM's Request fields), in a
module of its own so the scheduler and the connector's rules
(spec/connector.py) share it without importing each other."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from schedspec.spec.interface import BlockKey, RequestSpec, RequestStatus, RequestView, is_legal_transition
from schedspec.spec.mamba import StateTrack

_new = object.__new__


class GrammarState(enum.Enum):
    """A structured-output request's grammar (vLLM:
    structured_output_request.grammar: unset while it compiles, then the
    grammar or the Exception of a failed compile)."""

    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


@dataclass
class RequestState:
    """One unfinished request, with vLLM's field names (vllm/v1/request.py,
    Request)."""

    spec: RequestSpec
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # the block table
    num_cached_blocks: int = 0  # blocks of the table already given a key
    num_preemptions: int = 0
    # Speculative decoding: the drafts for the next step (-1 = a placeholder
    # whose id only the model runner knows).
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: output tokens in flight, already in num_computed_tokens.
    num_output_placeholders: int = 0
    # Tokens scheduled in steps not yet updated (every plan in flight).
    num_in_flight_tokens: int = 0
    # Of those, the tokens of steps scheduled before the last preemption:
    # their output is stale (delivered, or dropped if drop_stale_output).
    num_stale_output_tokens: int = 0
    drop_stale_output: bool = False
    # Whether the last step scheduled for it stopped short of its known and
    # in-flight tokens (vLLM's is_prefill_chunk, set after each schedule).
    is_prefill_chunk: bool = False
    # Structured outputs: the grammar's state (read while the request waits
    # for it: WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR).
    grammar: GrammarState = GrammarState.COMPILING
    # defer_block_free: the sched_step_seq of the last step that scheduled it
    last_sched_seq: int = 0
    # Model Runner V2's decode throttle (spec/runner_v2.py): the first step
    # in which it may be scheduled again (Request.next_decode_eligible_step)
    next_decode_eligible_step: int = 0
    # Hybrid KV cache groups (spec/kv_groups.py): the tables of groups 1.. (group
    # 0's is ``blocks``), how many leading blocks of each have a key, whether
    # the layout is hybrid (views carry every table), and the shared-prefix
    # junction of its last prefix lookup (Request.shared_prefix_boundary).
    group_blocks: list[list[int]] = field(default_factory=list)
    group_num_cached: list[int] = field(default_factory=list)
    hybrid: bool = False
    shared_prefix_boundary: int = 0
    # Mamba groups' per-request bookkeeping, by group index (spec/mamba.py)
    state_tracks: dict[int, StateTrack] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.spec.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output_token_ids)

    def block_key(self, block_index: int, block_size: int, lookahead: int = 0) -> BlockKey:
        """The content key of this request's block ``block_index`` (vLLM:
        ``request.block_hashes[block_index]``, a chained hash of the same
        tokens). With ``lookahead`` L (EAGLE's num_hash_lookahead_tokens) it
        covers the L tokens after the block too (kv_cache_utils.py,
        get_request_block_hasher and generate_lookahead_block_hash_extra_keys:
        the extra keys span the block and those tokens)."""
        end = (block_index + 1) * block_size + lookahead
        return (self.spec.block_identity(end), self.all_token_ids[:end])

    def prefix_key(self, num_tokens: int) -> BlockKey:
        """The content key of this request's first ``num_tokens`` tokens (a
        partial entry's: vLLM's ``request.block_hashes[num_tokens // hash
        block size - 1]``, BlockPool._get_partial_block_hash)."""
        return (self.spec.block_identity(num_tokens), self.all_token_ids[:num_tokens])

    def set_status(self, new: RequestStatus) -> None:
        assert is_legal_transition(self.status, new, self.spec.resumable), f"{self.request_id}: {self.status} -> {new}"
        self.status = new

    def copy(self) -> RequestState:
        """An independent copy: the lists are copied, the frozen spec shared."""
        new: RequestState = _new(RequestState)
        d = new.__dict__
        d.update(self.__dict__)
        d["output_token_ids"] = self.output_token_ids[:]
        d["blocks"] = self.blocks[:]
        d["spec_token_ids"] = self.spec_token_ids[:]
        d["group_blocks"] = [t[:] for t in self.group_blocks]
        d["group_num_cached"] = self.group_num_cached[:]
        d["state_tracks"] = {g: t.copy() for g, t in self.state_tracks.items()}
        return new

    def group_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Every group's table in group order for a hybrid layout, () otherwise
        (ScheduledRequest.group_block_ids, RequestView.group_block_ids); a
        finished request has none."""
        if not self.hybrid or self.status.is_finished:
            return ()
        return (tuple(self.blocks), *(tuple(t) for t in self.group_blocks))

    def view(self) -> RequestView:
        return RequestView.of(
            self.spec,
            status=self.status,
            output_token_ids=tuple(self.output_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            block_ids=tuple(self.blocks),
            num_preemptions=self.num_preemptions,
            num_output_placeholders=self.num_output_placeholders,
            spec_token_ids=tuple(self.spec_token_ids),
            group_block_ids=self.group_block_ids(),
        )

    def view_with_cadence(self) -> RequestView:
        """The view, with is_prefill_chunk as the prefill cadence reads it."""
        return dataclasses.replace(self.view(), is_prefill_chunk=self.is_prefill_chunk)
