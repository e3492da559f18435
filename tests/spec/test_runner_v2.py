"""The model runner choice (Model Runner V2) and pipeline_parallel_size:
the config fields, what vLLM refuses, and the trace format version 7."""

from __future__ import annotations

import json

import pytest

from schedspec.check.trace import TraceError, loads
from schedspec.spec.interface import ConfigError, SchedulerConfig


def test_defaults_are_the_v1_runner_without_pipeline() -> None:
    c = SchedulerConfig()
    assert c.model_runner == "v1" and c.pipeline_parallel_size == 1
    assert "model_runner" not in c.to_dict() and "pipeline_parallel_size" not in c.to_dict()


def test_round_trip() -> None:
    c = SchedulerConfig(model_runner="v2", pipeline_parallel_size=3, async_scheduling=True)
    assert SchedulerConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("kw, field", [
    ({"model_runner": "v3"}, "model_runner"),
    ({"model_runner": 2}, "model_runner"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ({"pipeline_parallel_size": 5}, "pipeline_parallel_size"),
    # VllmConfig._get_v1_model_runner_unsupported_features
    ({"pipeline_parallel_size": 2, "async_scheduling": True}, "pipeline_parallel_size"),
])
def test_refused_naming_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**kw)  # type: ignore[arg-type]
    assert err.value.field == field


def test_v1_runner_with_pipeline_but_sync_is_accepted() -> None:
    assert SchedulerConfig(pipeline_parallel_size=2).pipeline_parallel_size == 2


def test_version_6_trace_cannot_name_the_runner() -> None:
    header = {"schedspec_trace": 6, "config": {"model_runner": "v2"}}
    with pytest.raises(TraceError, match="config.model_runner: needs trace format version 7"):
        loads(json.dumps(header) + "\n", path="t.jsonl")
