"""A planted defect for the online monitor's test: the engine matrix's
negative control (schedspec.engine.control: a scheduler that tells the
runner one token more was computed for running requests past their first
48 tokens), as a class either side can name.

- Engine side (vLLM 0.32): ``make_shifting_scheduler`` (the recorder's
  ``base``: ``schedspec.engine.planted:make_shifting_scheduler``).
- Project side (vLLM 0.33, through the vLLM adapter):
  ``schedspec.engine.planted:ShiftingScheduler``, built on first access
  after the adapter has loaded vLLM 0.33, so that ``schedspec replay TRACE
  --against schedspec.engine.planted:ShiftingScheduler`` replays the trace
  the monitor wrote against the same defect.
"""

from __future__ import annotations

from typing import Any

from schedspec.engine.control import make_shifting_scheduler

__all__ = ["make_shifting_scheduler"]

_made: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name != "ShiftingScheduler":
        raise AttributeError(name)
    if name not in _made:
        from schedspec.adapters.vllm_load import load_vllm

        load_vllm()
        _made[name] = make_shifting_scheduler()
    return _made[name]
