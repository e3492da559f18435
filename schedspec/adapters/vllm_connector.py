"""The MODELLED KV connector as a vLLM 0.33 connector class.

``SchedspecKVConnector`` is the connector the vLLM adapter loads into vLLM's
real Scheduler (vllm/distributed/kv_transfer/kv_connector/factory.py,
KVConnectorFactory.get_connector_class: ``kv_connector`` names this class,
``kv_connector_module_path`` this module). It behaves exactly as the connector
the spec models (spec/interface.py, SchedulerConfig.kv_connector and the
RequestSpec fields ``kv_external_tokens``, ``kv_load_async``,
``kv_save_async``), scheduler role only:

* ``get_num_new_matched_tokens(request, num_computed_tokens)`` ->
  ``(max(0, kv_external_tokens - num_computed_tokens), kv_load_async and that > 0)``,
  stateless: vLLM asks at every admission of a request with no computed
  tokens, passing the block-aligned local prefix-cache hit
  (vllm/v1/core/sched/scheduler.py, schedule(), the waiting loop).
* ``update_state_after_alloc(request, blocks, num_external_tokens)`` records a
  load of tokens ``local hit .. local hit + num_external_tokens`` into the
  request's blocks when ``num_external_tokens > 0``.
* ``build_connector_meta(scheduler_output)`` hands the step's loads over (in
  the order they were recorded: admission order) as ``SchedspecConnectorMetadata``
  and forgets them.
* ``request_finished`` -> ``(kv_save_async and the request finished STOPPED
  or LENGTH_CAPPED, None)``: vLLM keeps such a request's blocks until the
  worker reports the save (``finished_sending``). ``SchedspecKVConnector`` is
  a connector without hybrid-allocator support, as most are: vLLM calls its
  ``request_finished`` with group 0's blocks, and asserts there is one group
  (scheduler.py, _connector_finished). ``SchedspecHMAKVConnector``, the same
  connector declaring ``SupportsHMA``, serves the hybrid layouts: vLLM calls
  its ``request_finished_all_groups`` with every group's blocks.
* Everything else vLLM's scheduler calls keeps the base class's behaviour:
  ``has_pending_block_frees`` False (a running request that cannot get blocks
  preempts, it never waits for a save), ``get_loaded_kv_cache_group_ids`` the
  prefix-cacheable groups, ``supports_divergent_local_hybrid_hits`` False,
  ``requires_kv_delivery`` the producer role's True (kv_role ``kv_both``), no
  stats, no events, ``reset_cache`` None.

The request's three fields travel on the vLLM Request as
``kv_transfer_params`` (what vLLM reads from ``SamplingParams.extra_args``),
under the key ``KV_PARAMS_KEY``.

The worker side is the adapter's: a StepResult's ``finished_recving``,
``finished_sending``, ``failed_recving`` and ``invalid_block_ids`` become the
``ModelRunnerOutput.kv_connector_output`` (vLLM's KVConnectorOutput). The
worker-side methods of this class are never called and raise if they are.

Importing this module imports vLLM: only the adapter (which imports it after
pinning vLLM's environment) and vLLM's connector factory import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

#: The key of the request's ``kv_transfer_params`` holding the modelled fields.
KV_PARAMS_KEY = "schedspec"

#: The class name vLLM's KVTransferConfig.kv_connector names: the plain
#: connector for the one-group layout, the hybrid-allocator one for hybrid
#: layouts.
CONNECTOR_NAME = "SchedspecKVConnector"
HMA_CONNECTOR_NAME = "SchedspecHMAKVConnector"

#: The finishes after which a ``kv_save_async`` request's blocks are kept for
#: its save (the modelled connector's request_finished).
_SAVED_FINISHES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def kv_transfer_params(external_tokens: int, load_async: bool, save_async: bool) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a request with these modelled fields
    (None when all are off: the request then carries nothing)."""
    if not (external_tokens or load_async or save_async):
        return None
    return {KV_PARAMS_KEY: {"external_tokens": external_tokens, "load_async": load_async,
                            "save_async": save_async}}


def _fields(request: Any) -> tuple[int, bool, bool]:
    params = request.kv_transfer_params or {}
    mine = params.get(KV_PARAMS_KEY) or {}
    return (int(mine.get("external_tokens", 0)), bool(mine.get("load_async", False)),
            bool(mine.get("save_async", False)))


@dataclass(frozen=True)
class ConnectorLoad:
    """One load the connector asks the worker for (what the spec's KVLoad
    states): tokens ``start .. end - 1`` into the request's blocks, every
    group's table as vLLM handed it to update_state_after_alloc."""

    request_id: str
    start: int
    end: int
    group_block_ids: tuple[tuple[int, ...], ...]
    asynchronous: bool


@dataclass
class SchedspecConnectorMetadata(KVConnectorMetadata):
    """The step's loads, in admission order (build_connector_meta)."""

    loads: list[ConnectorLoad] = field(default_factory=list)


class SchedspecKVConnector(KVConnectorBase_V1):
    """The modelled connector (module docstring), scheduler role."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._loads: list[ConnectorLoad] = []
        # request id -> (the local hit last presented, whether the load offered is async)
        self._asked: dict[str, tuple[int, bool]] = {}

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        external, load_async, _ = _fields(request)
        num = max(0, external - num_computed_tokens)
        asynchronous = load_async and num > 0
        self._asked[request.request_id] = (num_computed_tokens, asynchronous)
        return num, asynchronous

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        start, asynchronous = self._asked.pop(rid, (0, False))
        if num_external_tokens <= 0:
            return
        tables = tuple(tuple(ids) for ids in blocks.get_block_ids())
        self._loads.append(ConnectorLoad(rid, start, start + num_external_tokens, tables, asynchronous))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = SchedspecConnectorMetadata(loads=self._loads)
        self._loads = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._delay_free(request), None

    def _delay_free(self, request: Any) -> bool:
        self._asked.pop(request.request_id, None)
        _, _, save_async = _fields(request)
        return save_async and request.status in _SAVED_FINISHES

    # ------------------------------------------------------------ worker side (never used)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the adapter plays the worker: no worker-side connector runs")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("the adapter plays the worker: no worker-side connector runs")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the adapter plays the worker: no worker-side connector runs")

    def wait_for_save(self) -> None:
        raise NotImplementedError("the adapter plays the worker: no worker-side connector runs")


class SchedspecHMAKVConnector(SchedspecKVConnector, SupportsHMA):
    """The modelled connector for hybrid layouts: the same answers, through
    vLLM's hybrid-allocator entry point (SupportsHMA)."""

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._delay_free(request), None
