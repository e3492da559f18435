"""ALWAYS beyond the three config switches: speculative decoding (drafts in every config) and the
admission gates whose switch is a config value (LoRA, the watermark, the prefill cadence, the
encoder budget). Each is never off in what the check, the Hypothesis strategies and the model
checker draw; the restriction turns it on deterministically and is the identity on a config that
fits; a value or a run that cannot honour it is refused naming the field."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import unittest
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from schedspec.adapters.registry import impl_capabilities
from schedspec.check.capabilities import ALWAYS, CONFIG_GATES, Capabilities, CapabilityError
from schedspec.check.features import GATE_CAPABILITIES, GATES, MODES, gates_of, mode_of
from schedspec.check.gate import CheckSettings, make_workload
from schedspec.check.gate_requests import draw_gate_subset, gate_rng
from schedspec.check.workload import AddRequest
from schedspec.cli.main import main
from schedspec.cli.modelcheck import supported_spaces
from schedspec.impl import ImplScheduler
from schedspec.modelcheck import bound, select_spaces, space_problems
from schedspec.spec.interface import SchedulerConfig
from schedspec.testing import SchedulerContract
from schedspec.testing.strategies import configs, gate_plans

CFG = SchedulerConfig(block_size=4, num_blocks=9, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32,
                      enable_prefix_caching=False, enable_chunked_prefill=False)
EVERY = impl_capabilities()


def _off(config: SchedulerConfig, drafts: bool, gates: bool) -> list[str]:
    """What of the always-on features ``config`` lacks, read straight off its fields."""
    out = []
    if drafts and config.num_speculative_tokens == 0:
        out.append("drafts")
    if gates:
        out += [name for name, on in (("max_loras", config.max_loras > 0), ("watermark", config.watermark > 0),
                                      ("cadence", config.prefill_schedule_interval > 1),
                                      ("encoder", config.encoder_cache_size > 0)) if not on]
    return out


class AlwaysDrafting(ImplScheduler):
    """A scheduler that always has drafts: it cannot be built without them."""

    CAPABILITIES = dataclasses.replace(EVERY, speculative_decoding=ALWAYS)

    def __init__(self, config: SchedulerConfig, log_stats: bool = False) -> None:
        if _off(config, drafts=True, gates=False):
            raise ValueError(f"this scheduler always drafts: {config!r}")
        super().__init__(config, log_stats)


class AlwaysGated(ImplScheduler):
    """A scheduler whose LoRA, watermark, prefill cadence and encoder budget are always on."""

    CAPABILITIES = dataclasses.replace(EVERY, lora=ALWAYS, watermark=ALWAYS, prefill_cadence=ALWAYS,
                                       encoder=ALWAYS)

    def __init__(self, config: SchedulerConfig, log_stats: bool = False) -> None:
        if _off(config, drafts=False, gates=True):
            raise ValueError(f"this scheduler always gates: {_off(config, False, True)} off in {config!r}")
        super().__init__(config, log_stats)


#: (capability, the problem config_problems names on CFG, whether the gate is on in a config)
CASES = [
    ("speculative_decoding", "num_speculative_tokens=0", lambda c: c.num_speculative_tokens > 0),
    ("lora", "max_loras=0", lambda c: "lora" in gates_of(c)),
    ("watermark", "watermark=0.0", lambda c: "watermark" in gates_of(c)),
    ("prefill_cadence", "prefill_schedule_interval=1", lambda c: "cadence" in gates_of(c)),
    ("encoder", "no encoder budget (max_num_encoder_input_tokens=0, encoder_cache_size=0)",
     lambda c: "encoder" in gates_of(c)),
]


@pytest.mark.parametrize("field,problem,on", CASES)
def test_always_names_the_feature_off_and_the_restriction_turns_it_on(field: str, problem: str, on: object) -> None:
    caps = dataclasses.replace(EVERY, **{field: ALWAYS})
    assert caps.config_problems(CFG) == [problem]
    restricted = caps.restrict_config(CFG)
    assert on(restricted) and caps.config_problems(restricted) == []  # type: ignore[operator]
    assert caps.restrict_config(CFG) == restricted, "a fixed generator: the same config every time"
    assert caps.restrict_config(restricted) is restricted, "the identity on a config that fits"
    assert dataclasses.replace(EVERY, **{field: True}).config_problems(CFG) == []
    assert field in caps.names(), "the invariants needing it still run"
    assert f"always {field}" in caps.describe() and not caps.is_full
    assert dataclasses.replace(caps, **{field: True}).with_gates() == EVERY.with_gates()


def test_the_drafts_fit_a_threshold_and_a_budget() -> None:
    caps = Capabilities(speculative_decoding=ALWAYS, long_prefill_threshold=ALWAYS)
    out = caps.restrict_config(dataclasses.replace(CFG, max_num_batched_tokens=4, max_num_seqs=2,
                                                   enable_chunked_prefill=True))
    assert (out.num_speculative_tokens, out.long_prefill_token_threshold) == (1, 2)  # threshold 4 // 2 = 2 > k
    assert Capabilities(speculative_decoding=ALWAYS).restrict_config(
        dataclasses.replace(CFG, long_prefill_token_threshold=1)).long_prefill_token_threshold == 2
    tiny = dataclasses.replace(CFG, max_num_batched_tokens=2, max_num_seqs=1, enable_chunked_prefill=True)
    assert Capabilities(speculative_decoding=ALWAYS).restrict_config(tiny).max_num_batched_tokens == 3


def test_always_drafting_draws_only_the_spec_modes() -> None:
    caps = Capabilities(async_scheduling=True, speculative_decoding=ALWAYS)
    assert caps.drawable_modes(MODES) == ("spec", "async-spec")
    assert caps.drawable_modes(("sync", "async")) == ("spec",), "the plainest mode it runs: with drafts"
    async_only = dataclasses.replace(caps, sync_scheduling=False)
    assert async_only.drawable_modes(MODES) == ("async-spec",) == async_only.drawable_modes(("sync",))


def test_bad_values_are_refused_naming_the_field() -> None:
    for field in ("speculative_decoding", "lora", "watermark", "prefill_cadence", "encoder"):
        with pytest.raises(CapabilityError, match=f"Capabilities.{field} must be True .* got 'on'"):
            Capabilities(**{field: "on"})  # type: ignore[arg-type]
    for field in ("structured_output", "pause"):
        with pytest.raises(CapabilityError, match=f"Capabilities.{field} must be True or False, got 'always' "
                                                  f".*{field} is about requests and events, not the config"):
            Capabilities(**{field: ALWAYS})  # type: ignore[arg-type]
    with pytest.raises(CapabilityError, match="Capabilities.async_scheduling must be True or False, got 1"):
        Capabilities(async_scheduling=1)  # type: ignore[arg-type]
    assert set(CONFIG_GATES) == set(GATES) - {"grammar", "pause"}


def test_an_always_gate_is_in_every_draw_and_the_others_are_drawn_as_before() -> None:
    for seed in range(40):
        plain = draw_gate_subset(GATES, gate_rng(seed))
        lora = draw_gate_subset(GATES, gate_rng(seed), ("lora",))
        assert "lora" in lora and set(lora) - {"lora"} == set(plain) - {"lora"}
    assert draw_gate_subset(("pause",), gate_rng(0), ("lora",)) in ((), ("pause",)), "only gates it may draw"


@pytest.mark.parametrize("generator", ["guided", "random"])
def test_the_checks_workloads_never_turn_an_always_feature_off(generator: str) -> None:
    seen_lora_requests = 0
    for caps, drafts, gates in ((AlwaysDrafting.CAPABILITIES, True, False), (AlwaysGated.CAPABILITIES, False, True)):
        s = CheckSettings(capabilities=caps, modes=MODES, generator=generator)
        for seed in range(25):
            w = caps.restrict_workload(make_workload(s, seed, 40, {}))
            assert _off(w.config, drafts, gates) == [], (seed, w.config)
            if drafts:
                assert mode_of(w.config) in ("spec", "async-spec")
            if gates:
                # drawn on (its requests decorated), not only switched on by the restriction
                assert {f"gate:{g}" for g in CONFIG_GATES} <= set(w.features), w.features
                seen_lora_requests += any(isinstance(e, AddRequest) and e.request.lora_id for e in w.events)
    assert seen_lora_requests > 10


def test_a_gates_list_that_leaves_out_an_always_gate_is_a_contradiction(tmp_path: Path) -> None:
    with pytest.raises(CapabilityError, match=r"Capabilities.lora='always'.* the gates to draw \(pause\) leave"):
        CheckSettings(capabilities=Capabilities(lora=ALWAYS, pause=True), gates=("pause",)).drawn_gates
    for gates in ("none", "lora,grammar"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = main(["check", "--against", f"{__name__}:AlwaysGated", "--gates", gates, "--steps", "10",
                       "--quiet", "--out", str(tmp_path)])
        assert rc == 2, out.getvalue()
        assert "--gates: " in out.getvalue() and "Capabilities.watermark='always'" in out.getvalue()
        assert "leave them out" in out.getvalue()


@pytest.mark.parametrize("cls", [AlwaysDrafting, AlwaysGated])
def test_the_check_runs_a_scheduler_that_cannot_turn_them_off(cls: type, tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["check", "--against", f"{__name__}:{cls.__name__}", "--mode", "invariants", "--steps", "500",
                   "--quiet", "--out", str(tmp_path), "--json", str(tmp_path / "s.json")])
    text = out.getvalue()
    assert rc == 0, text
    summary = json.loads((tmp_path / "s.json").read_text())
    if cls is AlwaysGated:
        assert "lora, watermark, cadence, encoder in every one" in text, text
        assert summary["stats"]["lora_steps"] > 0
    else:
        assert summary["rule_coverage"]["modes"] == ["spec", "async-spec"], summary["rule_coverage"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(configs(capabilities=AlwaysGated.CAPABILITIES), configs(capabilities=AlwaysDrafting.CAPABILITIES))
def test_the_config_strategy_never_turns_them_off(gated: SchedulerConfig, drafting: SchedulerConfig) -> None:
    assert _off(gated, drafts=False, gates=True) == []
    assert _off(drafting, drafts=True, gates=False) == []


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(gate_plans(CFG, AlwaysGated.CAPABILITIES))
def test_the_gate_strategy_draws_an_always_gate_whatever_the_config(plan: tuple[SchedulerConfig, object]) -> None:
    assert _off(plan[0], drafts=False, gates=True) == []


@pytest.mark.parametrize("cls", [AlwaysDrafting, AlwaysGated])
def test_the_state_machine_builds_them_only_with_the_feature_on(cls: type) -> None:
    case = type("TestAlways", (SchedulerContract,), {
        "scheduler": cls, "hypothesis_settings": settings(max_examples=8, stateful_step_count=15, deadline=None,
                                                          derandomize=True, suppress_health_check=list(HealthCheck))})
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    assert result.testsRun == 1 and not result.failures and not result.errors, result.failures + result.errors


def test_the_model_checker_leaves_out_the_spaces_without_them() -> None:
    kept, skipped = supported_spaces(select_spaces(bound("modes"), None), f"{__name__}:AlwaysDrafting")
    spaces = {s.name: s for s in bound("modes").spaces}
    assert kept and all(spaces[n].config.num_speculative_tokens > 0 for n in kept)
    assert any("num_speculative_tokens=0" in line for line in skipped), skipped
    for g in CONFIG_GATES:
        caps = dataclasses.replace(EVERY, **{GATE_CAPABILITIES[g]: ALWAYS})
        with_it = [s for s in bound("gates").spaces if g in s.gates()]
        assert with_it and len(with_it) < len(bound("gates").spaces), g
        for s in bound("gates").spaces:
            assert not space_problems(s, EVERY)
            assert (not space_problems(s, caps)) == (s in with_it), (g, s.name, space_problems(s, caps))


def test_a_fixed_trace_or_bound_without_them_is_refused_naming_the_field(tmp_path: Path) -> None:
    from schedspec.check import trace as tracefile
    from schedspec.check.workload import Step, Workload

    path = tmp_path / "plain.jsonl"
    tracefile.write(path, tracefile.Trace(Workload(CFG, (Step(),)), vocab=64))
    for argv, field in ((["replay", str(path), "--against", f"{__name__}:AlwaysDrafting"], "num_speculative_tokens=0"),
                        (["replay", str(path), "--against", f"{__name__}:AlwaysGated"], "max_loras=0"),
                        (["modelcheck", "--against", f"{__name__}:AlwaysGated", "--bound", "small"], "max_loras=0")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = main(argv)
        assert rc == 2 and field in out.getvalue(), (argv, out.getvalue())
