"""Pipeline parallelism in the generated workloads: k plans in flight.

``SchedulerConfig.pipeline_parallel_size`` sets k, the plans vLLM's engine
core keeps in flight through its batch queue (spec/validate.py,
max_concurrent_batches; vllm/v1/engine/core.py,
EngineCore.step_with_batch_queue). The driver's Step is one call of
step_with_batch_queue: it schedules a plan, and updates the oldest one once k
are in flight (check/workload.py, InFlight). A workload drawn with
``pipeline`` gets a pipeline size from 1 to 4 on a generator of its own (so a
workload drawn without it is the one its seed always gave), among the sizes
its config allows: every size without async scheduling, only 1 with it under
the V1 model runner (vLLM refuses async scheduling with pipeline parallelism
there), so the draw follows whatever spec/validate.py accepts.
"""

from __future__ import annotations

import dataclasses
import random

from schedspec.spec.interface import SchedSpecError, SchedulerConfig

#: The pipeline sizes a workload may draw (the field's declared range).
PIPELINE_SIZES: tuple[int, ...] = (1, 2, 3, 4)


def pipeline_rng(seed: int | str) -> random.Random:
    """The generator of a workload's pipeline draw (its own)."""
    return random.Random(f"schedspec-pipeline-{seed}")


def allowed_sizes(config: SchedulerConfig) -> tuple[int, ...]:
    """The pipeline sizes ``config`` takes (a size the config's validation
    refuses is left out)."""
    out = []
    for k in PIPELINE_SIZES:
        try:
            dataclasses.replace(config, pipeline_parallel_size=k)
        except SchedSpecError:
            continue
        out.append(k)
    return tuple(out)


def with_pipeline(config: SchedulerConfig, rng: random.Random) -> SchedulerConfig:
    """``config`` with a pipeline size drawn from those it allows."""
    sizes = allowed_sizes(config) or (config.pipeline_parallel_size,)
    size = rng.choice(sizes)
    if size == config.pipeline_parallel_size:
        return config
    return dataclasses.replace(config, pipeline_parallel_size=size)


def describe(config: SchedulerConfig) -> str:
    """How a report names the in-flight depth: ``k=3 (pipeline_parallel_size
    3)``; empty for one plan in flight or async scheduling's two."""
    if config.pipeline_parallel_size == 1:
        return ""
    return f"k={config.max_concurrent_batches} (pipeline_parallel_size {config.pipeline_parallel_size})"

