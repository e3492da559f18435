"""The model runner and the pipeline size of a random workload (opt-in:
``schedspec check --runner``): Model Runner V1 or V2 and
``pipeline_parallel_size`` 1..4, drawn on a generator of their own so the
rest of the workload is the one its seed always gave. vLLM's V1 runner
refuses pipeline parallelism with async scheduling, so a V1 async config
keeps a pipeline of 1; V2 with async scheduling and a pipeline of 2..4 is
what turns the decode throttle on (spec/runner_v2.py)."""

from __future__ import annotations

import dataclasses
import random

from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.validate import MODEL_RUNNERS

#: the pipeline sizes drawn (SchedulerConfig.pipeline_parallel_size's range)
PIPELINE_SIZES = (1, 2, 3, 4)


def with_runner(config: SchedulerConfig, seed: int) -> SchedulerConfig:
    """``config`` with a model runner and a pipeline size drawn for ``seed``."""
    rng = random.Random(f"schedspec-runner-{seed}")
    runner = rng.choice(MODEL_RUNNERS)
    pp = rng.choice(PIPELINE_SIZES)
    if runner == "v1" and config.async_scheduling:
        pp = 1  # VllmConfig._get_v1_model_runner_unsupported_features
    return dataclasses.replace(config, model_runner=runner, pipeline_parallel_size=pp)


def runner_feature(config: SchedulerConfig) -> tuple[str, ...]:
    """The workload's feature naming its runner and pipeline: ``runner:v2/pp3``."""
    return (f"runner:{config.model_runner}/pp{config.pipeline_parallel_size}",)
