"""Loading vLLM 0.33.0 once per process, and every call into it.

``load_vllm()`` imports schedspec.adapters.vllm_names, the one module that
imports vLLM's names (and torch), which first pins the environment vLLM must
see and checks the pinned version (schedspec/adapters/vllm_env.py); the
adapter's modules import vllm_names only after it. Importing this module
imports neither vLLM nor torch.

A fidelity collector (schedspec/adapters/fidelity.py) may ask for a trace
function around every call the adapter makes into vLLM's scheduler
(``trace_vllm_calls``; the adapter makes each through ``into_vllm``), so that
only vLLM's own work is traced.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any, Callable

from schedspec.spec.interface import SchedSpecError


class VllmAdapterError(SchedSpecError, RuntimeError):
    """vLLM did something the modelled configuration cannot explain: a state
    outside the modelled ones, an option it silently changed, or a block table
    it sent that is not the one it keeps."""


_LOCK = threading.Lock()


def load_vllm() -> ModuleType:
    """Import vLLM with its environment pinned (vllm_env.prepare); the module
    of vLLM's names the adapter uses (schedspec.adapters.vllm_names). Raises
    vllm_env.VllmUnavailable when vLLM is missing or not VLLM_VERSION."""
    with _LOCK:
        from schedspec.adapters import vllm_names

        return vllm_names


# --------------------------------------------------------------------------
# Tracing the calls into vLLM
# --------------------------------------------------------------------------

_TraceFn = Callable[..., Any]
_CALL_TRACER: _TraceFn | None = None


def trace_vllm_calls(tracer: _TraceFn | None) -> _TraceFn | None:
    """Run every call the adapter makes into vLLM's scheduler (construction,
    add, abort, reset, schedule, update, drafts) with ``tracer`` installed as
    the thread's ``sys.settrace`` function, or stop with None; returns the
    tracer installed before. Nothing else the process runs is traced."""
    global _CALL_TRACER
    previous, _CALL_TRACER = _CALL_TRACER, tracer
    return previous


def into_vllm(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a call into vLLM, traced when a tracer is
    installed (trace_vllm_calls)."""
    tracer = _CALL_TRACER
    if tracer is None:
        return fn(*args, **kwargs)
    outer = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.settrace(outer)
