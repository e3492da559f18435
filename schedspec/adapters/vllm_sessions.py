"""Streaming-input sessions through vLLM's own API: a session update is what
the engine hands the scheduler for the session's next chunk (vLLM's
AsyncLLM, the input stream: a resumable Request with the session's id, or the
non-resumable final request for the end), and vLLM's Scheduler.add_request
takes it (queued, applied in place, or the end). The adapter's record of the
session (its RequestSpec, its block hashes' contents) follows vLLM's Request
whenever vLLM updated it in place."""

from __future__ import annotations

import dataclasses
from typing import Any

from schedspec.spec.interface import RequestError, SchedulerConfig, SessionUpdate

from schedspec.adapters.vllm_load import into_vllm
from schedspec.adapters.vllm_requests import Live, vllm_request
from schedspec.adapters.vllm_views import BlockKeys


class SessionsAdapter:
    """VllmScheduler's share of sessions."""

    # provided by VllmScheduler
    sched: Any
    _config: SchedulerConfig
    _live: dict[str, Live]
    _keys: BlockKeys
    _block_hasher: Any
    _connector: bool

    def _collect_finished(self, candidates: list[str]) -> None:
        raise NotImplementedError  # VllmScheduler's

    def session_update(self, update: SessionUpdate) -> None:
        """add_request with the session's id: the chunk as a resumable
        Request (the session's sampling parameters, the chunk's max_tokens),
        or, for the end, the non-resumable final request. The spec's
        boundary first (spec/sessions.py): an unknown or finished id, a
        request not resumable, an update after the end, a session past
        max_model_len raise RequestError and vLLM sees nothing."""
        if not isinstance(update, SessionUpdate):
            raise TypeError(f"update must be a SessionUpdate, got {type(update).__name__}")
        rid = update.request_id
        live = self._live.get(rid)
        if live is None:
            raise RequestError(rid, "request_id", "no unfinished session with this id")
        if not live.spec.resumable:
            raise RequestError(rid, "resumable", "the request is not resumable")
        books = self.__dict__.setdefault("_session_books", {})
        bound, ended = books.get(rid, (len(live.spec.prompt_token_ids) + live.spec.max_tokens, False))
        if ended:
            raise RequestError(rid, "end", "the session's end is already queued")
        if not update.end:
            bound += len(update.prompt_token_ids) + update.max_tokens
            if bound >= self._config.max_model_len:
                raise RequestError(rid, "prompt_token_ids",
                                   f"the session's chunks and max_tokens would exceed max_model_len "
                                   f"{self._config.max_model_len}")
        books[rid] = (bound, update.end)
        if update.end:  # AsyncLLM's final request: prompt [0], not resumable
            spec = dataclasses.replace(live.spec, prompt_token_ids=(0,), resumable=False)
        else:
            spec = dataclasses.replace(live.spec, prompt_token_ids=update.prompt_token_ids,
                                       max_tokens=update.max_tokens)
        into_vllm(self.sched.add_request, vllm_request(spec, self._block_hasher, self._connector))
        self.sync_sessions([rid])
        self._collect_finished([rid])

    def has_sessions(self) -> bool:
        """Whether a session was ever added (the reset's boundary then looks
        for blocks a waiting session holds: vllm_kv.blocks_kept_after_reset)."""
        return any(live.spec.resumable for live in self._live.values())

    def sync_sessions(self, ids: list[str]) -> None:
        """Follow vLLM's in-place updates (_update_request_as_session) of the
        sessions among ``ids``: the spec's prompt and max_tokens become the
        Request's, and the block hashes past the unchanged prefix stand for
        the new tokens."""
        bs = self._config.block_size
        for rid in ids:
            live = self._live.get(rid)
            if live is None or not live.spec.resumable:
                continue
            req = live.req
            prompt = tuple(req.prompt_token_ids)
            if prompt == live.spec.prompt_token_ids and req.max_tokens == live.spec.max_tokens:
                continue
            old = live.spec.prompt_token_ids
            same = next((i for i, (a, b) in enumerate(zip(old, prompt)) if a != b), min(len(old), len(prompt)))
            live.spec = dataclasses.replace(live.spec, prompt_token_ids=prompt, max_tokens=req.max_tokens)
            live.num_hashed = min(live.num_hashed, same // bs, len(req.block_hashes))
            self._keys.record(live)
