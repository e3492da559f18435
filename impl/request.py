"""impl's request record and its plan entry.

``Request`` is one unfinished (or just finished) request: the spec's request
state (spec/request_state.py) in vLLM's names, plus the few marks that let a
decode step skip the block-table work (``num_slots``, ``next_full_at``,
``group_skip_from``). ``plan_entry`` builds a plan entry; it is the one place
that knows a ``ScheduledRequest``'s fields besides the steady-decode loop of
impl/running.py, which inlines it once (measured there).
"""

from __future__ import annotations

from typing import Any, Callable

from schedspec.spec.interface import (
    RequestSpec,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
)

#: a token count no request reaches ("no next full block" when prefix caching is off)
NEVER = 1 << 62
NO_TOKENS: tuple[int, ...] = ()
NO_GROUPS: tuple[tuple[int, ...], ...] = ()
_NO_MARKS: dict[int, str] = {}  # never written to
_NO_REJECTS: frozenset[int] = frozenset()
_new = object.__new__
# impl's names for the statuses (a module global reads faster than an enum
# attribute in the per-request loops)
WAITING = RequestStatus.WAITING
RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED
STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
ABORTED = RequestStatus.FINISHED_ABORTED
ERROR = RequestStatus.FINISHED_ERROR
WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


def plan_entry(
    request_id: str,
    kind: ScheduleKind,
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    num_tokens: int,
    block_ids: tuple[int, ...],
    token_ids: tuple[int, ...],
    spec_token_ids: tuple[int, ...] = NO_TOKENS,
    num_output_placeholders: int = 0,
    encoder_inputs: tuple[int, ...] = NO_TOKENS,
    group_block_ids: tuple[tuple[int, ...], ...] = NO_GROUPS,
) -> ScheduledRequest:
    """A plan entry, built by filling a fresh instance's ``__dict__`` in field
    order: equal (``==``, ``hash``, ``repr``, pickle) to one built through the
    frozen dataclass's constructor (``object.__setattr__`` per field), at a
    quarter of its cost (400 ns against 1,600 ns)."""
    entry = _new(ScheduledRequest)
    fields = entry.__dict__
    fields["request_id"] = request_id
    fields["kind"] = kind
    fields["num_computed_tokens"] = num_computed_tokens
    fields["num_scheduled_tokens"] = num_scheduled_tokens
    fields["num_tokens"] = num_tokens
    fields["block_ids"] = block_ids
    fields["token_ids"] = token_ids
    fields["spec_token_ids"] = spec_token_ids
    fields["num_output_placeholders"] = num_output_placeholders
    fields["encoder_inputs"] = encoder_inputs
    fields["num_invalid_spec_tokens"] = 0
    fields["group_block_ids"] = group_block_ids
    return entry


class Request:
    """One unfinished (or just finished) request."""

    # Slot order is memory order: the fields a decode step reads (the
    # steady-decode loop, then update) come first, so they share two or three
    # cache lines; at thousands of running requests a step is bound by memory
    # traffic, not by instructions.
    __slots__ = (
        # a decode step: schedule's steady loop, then update
        "num_computed_tokens",
        "num_tokens",
        "num_slots",
        "next_full_at",
        "last_token_ids",
        "cached_block_tuple",
        "group_block_tuples",
        "request_id",
        "status",
        "output",
        "length_cap_at",
        "stop_token_ids",
        # async scheduling and speculative decoding
        "num_output_placeholders",
        "spec_token_ids",
        "num_in_flight_tokens",
        "is_prefill_chunk",
        "was_prefill_chunk",
        "next_decode_eligible_step",  # Model Runner V2's decode throttle
        "num_stale_output_tokens",
        "max_tokens_end",
        "num_prompt_tokens",
        # the rest
        "spec",
        "prompt_token_ids",
        "block_ids",
        "num_cached_blocks",
        "num_preemptions",
        "key_root",
        "priority",
        "arrival",
        "waiting_seq",
        "running_seq",
        "drop_stale_output",
        # the admission gates
        "lora_id",
        "grammar_ok",
        "grammar_rejects",
        "mm_inputs",
        "identity_marks",
        # the KV connector: the sched_step_seq of the last step that
        # scheduled it (defer_block_free)
        "last_scheduled_seq",
        # hybrid KV cache groups: the tables of groups 1.. (group 0's is
        # ``block_ids``), how many leading blocks of each have a key, the
        # shared-prefix junction of its last prefix lookup, and the
        # processed-token count from which a step may free blocks out of a
        # window or chunk (NEVER for the plain layout)
        "group_block_ids",
        "group_num_cached_blocks",
        "shared_prefix_end",
        "group_skip_from",
        # Mamba groups: [allocated, last state index (-1: none), retired] by group
        "state_tracks",
    )

    def __init__(
        self,
        spec: RequestSpec,
        max_model_len: int,
        block_size: int,
        caching: bool,
        stop_sets: dict[frozenset[int], frozenset[int]],
        hash_lookahead: int = 0,
    ) -> None:
        self.request_id = spec.request_id
        self.spec = spec
        self.status = WAITING
        self.prompt_token_ids = spec.prompt_token_ids
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output: list[int] = []
        # (last token,): a decode step's token_ids. update() stores the
        # result's own 1-tuple here, so a decode step allocates no tuple.
        self.last_token_ids: tuple[int, ...] = self.prompt_token_ids[-1:]
        self.num_tokens = self.num_prompt_tokens
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.cached_block_tuple: tuple[int, ...] | None = ()
        # the slots of the block table, and the token count at which its next
        # block becomes full and gets a prefix-cache key: a step below both
        # needs no block work
        self.num_slots = 0
        self.num_cached_blocks = 0
        self.next_full_at = block_size if caching else NEVER
        self.num_preemptions = 0
        # the root of the block keys' chain: the salt, or the identity with
        # the LoRA adapter and the encoder inputs of block 0 (and, with hash
        # lookahead L, of the L tokens after it)
        self.key_root = spec.block_identity(block_size + hash_lookahead)
        self.priority = spec.priority
        self.arrival = spec.arrival
        stop = set(spec.stop_token_ids)
        if spec.eos_token_id is not None and not spec.ignore_eos:
            stop.add(spec.eos_token_id)
        # Shared among requests with equal stop sets (most have the same
        # one), so the per-token stop check reads a set that stays in cache.
        frozen = frozenset(stop)
        self.stop_token_ids = stop_sets.setdefault(frozen, frozen)
        # A request is length-capped once it has max_tokens outputs or
        # max_model_len tokens in all.
        self.length_cap_at = self.num_prompt_tokens + min(spec.max_tokens, max_model_len - self.num_prompt_tokens)
        self.waiting_seq = -1
        self.running_seq = -1
        # vLLM's num_output_placeholders (output tokens in flight, counted in
        # num_computed_tokens), spec_token_ids (drafts for the next step; -1 =
        # a placeholder), num_in_flight_tokens (tokens scheduled in plans not
        # yet updated), num_stale_output_tokens and drop_stale_output (the
        # in-flight share of a preempted request), is_prefill_chunk.
        self.num_output_placeholders = 0
        self.spec_token_ids: tuple[int, ...] = NO_TOKENS
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        self.is_prefill_chunk = False
        self.was_prefill_chunk = False  # is_prefill_chunk before this step's plan
        self.next_decode_eligible_step = 0  # V2's throttle: the first step it may decode again
        # prompt + max_tokens (not capped by max_model_len): the max_tokens
        # skip of a request whose steps in flight surely finish it
        self.max_tokens_end = self.num_prompt_tokens + spec.max_tokens
        # The admission gates: the LoRA adapter (0: none); the grammar (None
        # while it compiles, then whether it compiled) and the tokens it
        # refuses; the encoder inputs and, for the block keys, the block
        # indices (>= 1) where the identity changes, with the new identity.
        self.lora_id = spec.lora_id
        self.grammar_ok: bool | None = None
        self.grammar_rejects = frozenset(spec.grammar_rejects) if spec.grammar_rejects else _NO_REJECTS
        self.mm_inputs = spec.mm_inputs
        marks = _NO_MARKS  # shared while empty: one allocation less per request
        for m in spec.mm_inputs:
            # the first block whose key (its tokens and L after) reaches the input
            i = (m.offset - hash_lookahead) // block_size
            if i > 0:
                if marks is _NO_MARKS:
                    marks = {}
                marks[i] = spec.block_identity((i + 1) * block_size + hash_lookahead)
        self.identity_marks = marks
        self.last_scheduled_seq = 0
        self.group_block_ids: list[list[int]] = []
        self.group_num_cached_blocks: list[int] = []
        self.shared_prefix_end = 0
        self.group_skip_from = NEVER
        self.state_tracks: dict[int, list[int]] = {}
        self.group_block_tuples: tuple[tuple[int, ...], ...] | None = NO_GROUPS

    def copy(self) -> "Request":
        """An independent copy (the lists copied, immutable values shared)."""
        new: Request = _new(Request)
        for name in _SLOTS:
            setattr(new, name, getattr(self, name))
        new.output = self.output[:]
        new.block_ids = self.block_ids[:]
        new.group_block_ids = [t[:] for t in self.group_block_ids]
        new.group_num_cached_blocks = self.group_num_cached_blocks[:]
        new.state_tracks = {g: t[:] for g, t in self.state_tracks.items()}
        return new

    @property
    def is_running(self) -> bool:
        return self.status is RUNNING

    def token_range(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens at positions start .. end - 1 (prompt then output)."""
        num_prompt = self.num_prompt_tokens
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return tuple(self.output[start - num_prompt : end - num_prompt])
        return self.prompt_token_ids[start:] + tuple(self.output[: end - num_prompt])

    def step_token_ids(self, start: int, end: int, spec_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Positions start .. end - 1 of a step's sequence: the known tokens,
        then -1 for each output placeholder, then the step's drafts."""
        num_tokens = self.num_tokens
        if end <= num_tokens:
            return self.token_range(start, end)
        head = self.token_range(start, num_tokens) if start < num_tokens else ()
        tail = (-1,) * self.num_output_placeholders + spec_token_ids
        return head + tail[max(start - num_tokens, 0) : end - num_tokens]

    def block_tuple(self) -> tuple[int, ...]:
        """The block table as the plan's tuple, cached until it changes."""
        table = self.cached_block_tuple
        if table is None:
            table = self.cached_block_tuple = tuple(self.block_ids)
        return table

    def view(self, cadence: bool = False, groups: bool = False) -> RequestView:
        return RequestView.of(
            self.spec,
            status=self.status,
            output_token_ids=tuple(self.output),
            num_computed_tokens=self.num_computed_tokens,
            block_ids=tuple(self.block_ids),
            num_preemptions=self.num_preemptions,
            num_output_placeholders=self.num_output_placeholders,
            spec_token_ids=self.spec_token_ids,
            is_prefill_chunk=cadence and self.is_prefill_chunk,
            group_block_ids=(
                (tuple(self.block_ids), *(tuple(t) for t in self.group_block_ids))
                if groups and not self.status.is_finished else NO_GROUPS
            ),
        )


_SLOTS = Request.__slots__


def running_seq_of(request: Request) -> int:
    """The key that orders the running queue (admission order)."""
    return request.running_seq
