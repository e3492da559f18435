"""The worker side of the KV connector between schedspec and vLLM: a
StepResult's connector reports as vLLM's KVConnectorOutput, the loads of a
step as the plan's KVLoads (read from the modelled connector's metadata,
schedspec/adapters/vllm_connector.py), and why vLLM would keep blocks after
a reset of the prefix cache."""

from __future__ import annotations

from typing import Any, Callable

from schedspec.spec.interface import KVLoad, StepResult


class SortedSet(set):  # type: ignore[type-arg]
    """A set that iterates in sorted order. vLLM frees the requests of a
    result's ``finished_recving`` and ``finished_sending`` in the order it
    iterates those sets (scheduler.py, _update_from_kv_xfer_finished): for
    request-id strings, an order that depends on the process's hash seed.
    The spec frees them in sorted order, one of the orders vLLM may take;
    the adapter hands vLLM sets that take it (docs/divergences.md)."""

    def __iter__(self) -> Any:
        return iter(sorted(set.__iter__(self)))


def kv_connector_output(result: StepResult) -> Any:
    """The worker's connector reports of ``result`` as vLLM's
    KVConnectorOutput (what the model runner puts in
    ModelRunnerOutput.kv_connector_output), None when there are none."""
    if not (result.finished_recving or result.finished_sending or result.failed_recving
            or result.invalid_block_ids):
        return None
    from schedspec.adapters.vllm_names import KVConnectorOutput

    return KVConnectorOutput(
        finished_sending=SortedSet(result.finished_sending) or None,
        finished_recving=SortedSet(result.finished_recving) or None,
        failed_recving=SortedSet(result.failed_recving),
        invalid_block_ids=SortedSet(result.invalid_block_ids),
    )


def kv_loads(out: Any, hybrid: bool) -> tuple[KVLoad, ...]:
    """The connector's loads of a step (the metadata of its SchedulerOutput
    ``out``, built by vLLM's schedule(): _build_kv_connector_meta), in
    admission order; every group's blocks with a ``hybrid`` layout."""
    meta = getattr(out, "kv_connector_metadata", None)
    if meta is None:
        return ()
    return tuple(
        KVLoad(
            request_id=load.request_id,
            start=load.start,
            end=load.end,
            block_ids=load.group_block_ids[0],
            asynchronous=load.asynchronous,
            group_block_ids=load.group_block_ids if hybrid else (),
        )
        for load in meta.loads
    )


def blocks_kept_after_reset(sched: Any, group_tables: Callable[[str], list[list[int]]]) -> str | None:
    """Why blocks would stay held after reset_prefix_cache preempted every
    running request of vLLM's scheduler ``sched``, or None: vLLM then raises
    RuntimeError ("Failed to reset KV cache even when all the running
    requests are preempted"), which the spec's boundary refuses first
    (check_kv_reset). ``group_tables``: a request's tables, every group's."""
    held = sorted(rid for rid, r in sched.requests.items() if r.is_finished())
    if held:
        return f"finished request {held[0]!r} keeps its blocks for the connector"
    for r in sched.kv_holding_waiting:
        if any(group_tables(r.request_id)):
            return f"waiting request {r.request_id!r} holds blocks for a KV load"
    # Scheduler._request_blocks_can_be_freed, read through its public fields
    fenced = sched.defer_block_free and any(r.last_sched_seq > sched.processed_step_seq for r in sched.running)
    if sched.deferred_frees or fenced:
        return "a step in flight still writes blocks whose free is deferred (defer_block_free)"
    return None
