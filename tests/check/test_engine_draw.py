"""The engine features in the default check: sessions, a pipeline, Model
Runner V2 and drafters drawn in a share of the guided workloads, within the
declared capabilities (check/engine_draw.py)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from schedspec.check.capabilities import FULL, Capabilities
from schedspec.check.coverage_guided import guided_workload
from schedspec.check.engine_draw import with_engine
from schedspec.check.features import ENGINE_FEATURES, engine_of, parse_engine
from schedspec.check.gate import CheckSettings, make_workload
from schedspec.check.workload import AddRequest, SessionInput
from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler
from schedspec.cli.main import main

ALL_MODES = ("sync", "async", "spec", "async-spec")


def test_parse_engine_names_what_is_wrong() -> None:
    assert parse_engine("all") == ENGINE_FEATURES
    assert parse_engine("none") == ()
    assert parse_engine("runner, sessions") == ("sessions", "runner")
    with pytest.raises(ValueError, match="unknown engine feature 'pp'"):
        parse_engine("pp")


def test_a_share_of_guided_workloads_draws_each_feature_and_names_it() -> None:
    seen = {k: 0 for k in ENGINE_FEATURES}
    for seed in range(240):
        w = guided_workload(seed, 60, engine=ENGINE_FEATURES, modes=ALL_MODES)
        on = engine_of(w.config, w.events)
        for k in on:
            seen[k] += 1
        # the features name the draw: sessions, pipeline:k=K, runner:...
        assert ("sessions" in w.features) == ("sessions" in on), (seed, w.features)
        assert any(f.startswith("pipeline:k=") for f in w.features) == ("pipeline" in on)
        if "runner" in on or "drafter" in on:
            assert any(f.startswith("runner:") for f in w.features), (seed, w.features)
    assert all(n >= 5 for n in seen.values()), seen
    assert sum(seen.values()) < 240 * 2  # a share, not every workload


def test_a_workload_that_draws_nothing_is_the_one_its_seed_gave() -> None:
    same = 0
    for seed in range(40):
        drawn = guided_workload(seed, 60, engine=ENGINE_FEATURES, modes=ALL_MODES)
        if engine_of(drawn.config, drawn.events):
            continue
        plain = guided_workload(seed, 60, modes=ALL_MODES)
        assert (drawn.config, drawn.events) == (plain.config, plain.events), seed
        same += 1
    assert same > 10


def test_a_focus_on_a_v2_rule_turns_v2_on_with_a_pipeline_where_async() -> None:
    config = SchedulerConfig(async_scheduling=True)
    for seed in range(10):
        out = with_engine(config, ENGINE_FEATURES, ("v2.decode_throttled",), random.Random(seed))
        assert out.model_runner == "v2" and out.pipeline_parallel_size > 1, out
        # without the runner among the features, no focus turns it on
        rest = with_engine(config, ("pipeline",), ("v2.decode_throttled",), random.Random(seed))
        assert rest.model_runner == "v1"


def test_eagle_is_not_drawn_where_it_is_not_modelled() -> None:
    config = SchedulerConfig(num_speculative_tokens=2, kv_connector=True)
    drafters = {with_engine(config, ("drafter",), ("v2.decode_throttled",), random.Random(s)).drafter
                for s in range(200)}
    assert "eagle" not in drafters and "draft_model" in drafters
    plain = dataclasses.replace(config, kv_connector=False)
    assert "eagle" in {with_engine(plain, ("drafter",), (), random.Random(s)).drafter for s in range(200)}
    with_sessions = {with_engine(plain, ("drafter",), (), random.Random(s), sessions=True).drafter for s in range(200)}
    assert "eagle" not in with_sessions


def test_a_scheduler_without_the_capabilities_gets_none_of_them() -> None:
    caps = dataclasses.replace(FULL, async_scheduling=True, speculative_decoding=True)
    settings = CheckSettings(capabilities=caps, modes=ALL_MODES)
    assert settings.drawn_engine == ()
    assert "sessions" not in settings.drawn_capabilities and "runner_v2" not in settings.drawn_capabilities
    full = dataclasses.replace(settings, capabilities=caps.with_engine())
    assert full.drawn_engine == ENGINE_FEATURES
    assert {"sessions", "runner_v2", "pipeline", "drafters"} <= set(full.drawn_capabilities)
    for seed in range(60):
        w = caps.restrict_workload(make_workload(settings, seed, 60, {}))
        assert engine_of(w.config, w.events) == (), seed
    # a workload with all of them, restricted: the config and events within the declaration
    drawn = [full_w for seed in range(200)
             if len(engine_of((full_w := make_workload(full, seed, 60, {})).config, full_w.events)) >= 2]
    assert drawn
    for w in drawn:
        assert caps.workload_problems(w)
        r = caps.restrict_workload(w)
        assert caps.workload_problems(r) == [] and engine_of(r.config, r.events) == ()
        assert not any(isinstance(e, SessionInput) for e in r.events)
        assert not any(isinstance(e, AddRequest) and e.request.resumable for e in r.events)


def test_config_problems_name_the_engine_fields() -> None:
    config = SchedulerConfig(async_scheduling=True, model_runner="v2", pipeline_parallel_size=2,
                             num_speculative_tokens=2, drafter="draft_model")
    problems = Capabilities(async_scheduling=True, speculative_decoding=True).config_problems(config)
    assert problems == ["pipeline_parallel_size=2", "model_runner='v2'", "drafter='draft_model'"]
    assert Capabilities(async_scheduling=True, speculative_decoding=True).with_engine().config_problems(config) == []


class _NoEngine(SpecScheduler):
    """A user's scheduler class declaring no engine feature (the spec's rules)."""

    CAPABILITIES = Capabilities(async_scheduling=True, speculative_decoding=True)


def test_the_cli_refuses_an_engine_feature_the_scheduler_lacks(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{__name__}:_NoEngine"
    rc = main(["check", "--against", target, "--steps", "20", "--quiet", "--out", str(tmp_path), "--engine", "sessions"])
    assert rc == 2
    assert f"--engine: {target} does not support the engine feature(s) sessions" in capsys.readouterr().err
    # --sessions asks for them in every workload: the scheduler is held to them (the spec takes them)
    rc = main(["check", "--against", target, "--steps", "60", "--quiet", "--out", str(tmp_path), "--sessions"])
    assert rc == 0 and "1 session workloads" in capsys.readouterr().out


def test_the_default_check_reports_the_engine_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--against", "impl", "--steps", "120", "--quiet", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "engine: sessions, pipeline, runner, drafter (in a share of the guided workloads and the narrow ones" in out
    rc = main(["check", "--against", "impl", "--steps", "120", "--quiet", "--out", str(tmp_path), "--engine", "none"])
    assert "engine: none" in capsys.readouterr().out
