"""The model runner and the pipeline size of a random workload (opt-in:
``schedspec check --runner``): Model Runner V1 or V2 and
``pipeline_parallel_size`` 1..4, drawn on a generator of their own so the
rest of the workload is the one its seed always gave. The size is drawn among
those spec/validate.py accepts with the drawn runner (check/pipeline.py,
allowed_sizes): vLLM's V1 runner refuses pipeline parallelism with async
scheduling, so a V1 async config keeps a pipeline of 1, and a synchronous
pipeline with drafts is not modelled; V2 with async scheduling and a pipeline
of 2..4 is what turns the decode throttle on (spec/runner_v2.py). With
drafts the drafter is drawn too: a draft model or EAGLE reserves lookahead
slots, and under V2 lets the plan skip drafts (spec/runner_v2.py); EAGLE
also hashes each block with the token after it."""

from __future__ import annotations

import dataclasses
import random

from schedspec.check.pipeline import allowed_sizes
from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.validate import DRAFTERS, MODEL_RUNNERS


def with_runner(config: SchedulerConfig, seed: int) -> SchedulerConfig:
    """``config`` with a model runner and a pipeline size drawn for ``seed``,
    among the sizes the config accepts with that runner, and with drafts the
    drafter (drawn last, so the runner and size are those the seed gave
    before drafters were drawn)."""
    rng = random.Random(f"schedspec-runner-{seed}")
    runner = rng.choice(MODEL_RUNNERS)
    base = dataclasses.replace(config, model_runner=runner, pipeline_parallel_size=1)
    pp = rng.choice(allowed_sizes(base) or (1,))
    drafter = modelled_drafter(config, rng.choice(DRAFTERS) if config.num_speculative_tokens else "ngram")
    return dataclasses.replace(base, pipeline_parallel_size=pp, drafter=drafter)


def modelled_drafter(config: SchedulerConfig, drafter: str, sessions: bool = False) -> str:
    """``drafter`` as far as the spec models it in ``config``: n-gram without
    drafts or without room for a padded decode and the draft model's slot
    (spec/validate.py); a draft model for EAGLE beside a KV connector, partial
    prefix-cache entries or (``sessions``) streaming-input sessions
    (spec/validate.py, spec/protocol.py)."""
    if not config.num_speculative_tokens or config.max_num_batched_tokens < 2 + config.num_speculative_tokens:
        return "ngram"
    if drafter == "eagle" and (config.kv_connector or sessions
                               or config.hash_block_size not in (0, config.block_size)):
        return "draft_model"
    return drafter


def runner_feature(config: SchedulerConfig) -> tuple[str, ...]:
    """The workload's feature naming its runner, pipeline and drafter:
    ``runner:v2/pp3``, ``runner:v2/pp1/draft_model``, ``runner:v1/pp1/eagle``."""
    drafter = f"/{config.drafter}" if config.drafter != "ngram" else ""
    return (f"runner:{config.model_runner}/pp{config.pipeline_parallel_size}{drafter}",)
