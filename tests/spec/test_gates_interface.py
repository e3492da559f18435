"""The admission gates in the interface: config fields, request fields, their
validation, serialization at defaults, and the typed errors at the boundary."""

from __future__ import annotations

import pytest

from schedspec.spec.interface import (
    LEGAL_TRANSITIONS,
    ConfigError,
    MMInput,
    PauseState,
    ProtocolError,
    RequestError,
    RequestSpec,
    RequestStatus,
    SchedulerConfig,
    is_legal_transition,
    supports_grammar,
    supports_pause,
)
from schedspec.spec.protocol import (
    check_add,
    check_grammar_ready,
    check_mm_lengths,
    check_pause_state,
)

ENCODER = {"max_num_encoder_input_tokens": 8, "encoder_cache_size": 12}


def req(**kw: object) -> RequestSpec:
    base: dict[str, object] = {"request_id": "r", "prompt_token_ids": tuple(range(10)), "max_tokens": 4}
    base.update(kw)
    return RequestSpec(**base)  # type: ignore[arg-type]


class TestConfig:
    def test_default_to_dict_has_no_gate_fields(self) -> None:
        d = SchedulerConfig().to_dict()
        for name in ("max_loras", "watermark", "prefill_schedule_interval",
                     "max_num_encoder_input_tokens", "encoder_cache_size"):
            assert name not in d

    def test_gate_fields_round_trip(self) -> None:
        c = SchedulerConfig(max_loras=2, watermark=0.25, prefill_schedule_interval=3, **ENCODER)  # type: ignore[arg-type]
        d = c.to_dict()
        assert d["max_loras"] == 2 and d["watermark"] == 0.25 and d["prefill_schedule_interval"] == 3
        assert SchedulerConfig.from_dict(d) == c

    def test_watermark_blocks_counts_the_whole_pool(self) -> None:
        # int(w * num_gpu_blocks), num_gpu_blocks including the null block
        assert SchedulerConfig(num_blocks=65, watermark=0.1).watermark_blocks == 6
        assert SchedulerConfig(num_blocks=65).watermark_blocks == 0

    @pytest.mark.parametrize(
        "kw, field",
        [
            ({"max_loras": -1}, "max_loras"),
            ({"max_loras": True}, "max_loras"),
            ({"watermark": -0.1}, "watermark"),
            ({"watermark": 1.0}, "watermark"),
            ({"watermark": "0.1"}, "watermark"),
            ({"watermark": 0.99}, "watermark"),  # keeps every usable block free
            ({"prefill_schedule_interval": 0}, "prefill_schedule_interval"),
            ({"prefill_schedule_interval": 1.5}, "prefill_schedule_interval"),
            ({"max_num_encoder_input_tokens": 8}, "encoder_cache_size"),
            ({"encoder_cache_size": 8}, "encoder_cache_size"),
            ({"encoder_cache_size": -1}, "encoder_cache_size"),
        ],
    )
    def test_bad_gate_config_names_the_field(self, kw: dict[str, object], field: str) -> None:
        with pytest.raises(ConfigError) as exc:
            SchedulerConfig(**kw)  # type: ignore[arg-type]
        assert exc.value.field == field


class TestRequest:
    def test_default_to_dict_has_no_gate_fields(self) -> None:
        assert set(req().to_dict()) == {
            "request_id", "prompt_token_ids", "max_tokens", "priority", "arrival",
            "stop_token_ids", "eos_token_id", "ignore_eos", "cache_salt",
        }

    def test_gate_fields_round_trip(self) -> None:
        r = req(lora_id=3, structured_output=True, grammar_rejects=(5, 7),
                mm_inputs=(MMInput(1, 3, "img"), MMInput(6, 2, "b")))
        d = r.to_dict()
        assert d["mm_inputs"] == [{"offset": 1, "length": 3, "identifier": "img"},
                                  {"offset": 6, "length": 2, "identifier": "b"}]
        assert RequestSpec.from_dict(d) == r

    def test_from_dict_names_a_bad_mm_input(self) -> None:
        with pytest.raises(RequestError) as exc:
            RequestSpec.from_dict({**req().to_dict(), "mm_inputs": [{"offset": 1}]})
        assert exc.value.field == "mm_inputs[0]"
        with pytest.raises(RequestError) as exc:
            RequestSpec.from_dict({**req().to_dict(), "bogus": 1})
        assert exc.value.field == "bogus"

    @pytest.mark.parametrize(
        "kw, field",
        [
            ({"lora_id": -1}, "lora_id"),
            ({"lora_id": False}, "lora_id"),
            ({"structured_output": 1}, "structured_output"),
            ({"grammar_rejects": (1,)}, "grammar_rejects"),
            ({"structured_output": True, "grammar_rejects": [1]}, "grammar_rejects"),
            ({"structured_output": True, "grammar_rejects": (-1,)}, "grammar_rejects[0]"),
            ({"mm_inputs": [MMInput(0, 1, "a")]}, "mm_inputs"),
            ({"mm_inputs": ((0, 1, "a"),)}, "mm_inputs[0]"),
            ({"mm_inputs": (MMInput(0, 0, "a"),)}, "mm_inputs[0].length"),
            ({"mm_inputs": (MMInput(0, 1, ""),)}, "mm_inputs[0].identifier"),
            ({"mm_inputs": (MMInput(8, 3, "a"),)}, "mm_inputs[0]"),
            ({"mm_inputs": (MMInput(2, 3, "a"), MMInput(4, 1, "b"))}, "mm_inputs[1].offset"),
            ({"mm_inputs": (MMInput(4, 1, "a"), MMInput(2, 1, "b"))}, "mm_inputs[1].offset"),
            ({"mm_inputs": (MMInput(0, 2, "a"), MMInput(4, 1, "a"))}, "mm_inputs[1].length"),
            ({"cache_salt": "\x00x"}, "cache_salt"),
        ],
    )
    def test_bad_gate_request_names_the_field(self, kw: dict[str, object], field: str) -> None:
        with pytest.raises(RequestError) as exc:
            req(**kw)
        assert exc.value.field == field

    def test_block_identity(self) -> None:
        plain = req(cache_salt="s")
        assert plain.block_identity(16) == "s"
        assert req().block_identity(16) == ""
        a1, a2 = req(lora_id=1), req(lora_id=2)
        assert a1.block_identity(4) != a2.block_identity(4) != ""
        assert a1.block_identity(4) == req(lora_id=1, request_id="q").block_identity(4)
        img = req(mm_inputs=(MMInput(4, 2, "x"),))
        # the input counts from the first block whose end lies past its offset
        assert img.block_identity(4) == ""
        assert img.block_identity(5) != ""
        assert img.block_identity(5) != req(mm_inputs=(MMInput(4, 2, "y"),)).block_identity(5)
        assert img.block_identity(5) != req(mm_inputs=(MMInput(3, 2, "x"),)).block_identity(5)
        assert img.block_identity(8) == req(mm_inputs=(MMInput(4, 2, "x"),), request_id="q").block_identity(8)


class TestStatus:
    def test_grammar_statuses(self) -> None:
        g = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        assert not g.is_finished
        assert RequestStatus.FINISHED_ERROR.is_finished
        assert LEGAL_TRANSITIONS[RequestStatus.FINISHED_ERROR] == frozenset()
        for new in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED,
                    RequestStatus.FINISHED_ERROR):
            assert is_legal_transition(g, new)
        assert not is_legal_transition(g, RequestStatus.PREEMPTED)
        assert not is_legal_transition(RequestStatus.WAITING, g)

    def test_pause_state_is_vllms(self) -> None:
        assert [int(p) for p in PauseState] == [0, 1, 2]
        assert [p.name for p in PauseState] == ["UNPAUSED", "PAUSED_NEW", "PAUSED_ALL"]


class TestBoundary:
    def test_lora_request_without_lora_is_refused(self) -> None:
        with pytest.raises(ProtocolError) as exc:
            check_add(req(lora_id=1), SchedulerConfig())
        assert exc.value.field == "lora_id"
        assert check_add(req(lora_id=1), SchedulerConfig(max_loras=1)).lora_id == 1

    def test_mm_request_without_encoder_is_refused(self) -> None:
        r = req(mm_inputs=(MMInput(0, 2, "a"),))
        with pytest.raises(ProtocolError) as exc:
            check_add(r, SchedulerConfig())
        assert exc.value.field == "mm_inputs"
        assert check_add(r, SchedulerConfig(**ENCODER)) is r  # type: ignore[arg-type]

    def test_mm_input_beyond_budget_or_cache_is_refused(self) -> None:
        with pytest.raises(ProtocolError) as exc:
            check_add(req(mm_inputs=(MMInput(0, 9, "a"),)), SchedulerConfig(**ENCODER))  # type: ignore[arg-type]
        assert exc.value.field == "mm_inputs[0]"
        small_cache = SchedulerConfig(max_num_encoder_input_tokens=8, encoder_cache_size=4)
        with pytest.raises(ProtocolError):
            check_add(req(mm_inputs=(MMInput(0, 5, "a"),)), small_cache)

    def test_mm_lengths_agree_across_requests(self) -> None:
        r = req(mm_inputs=(MMInput(0, 2, "a"),))
        check_mm_lengths(r, {"a": 2, "b": 5})
        with pytest.raises(ProtocolError) as exc:
            check_mm_lengths(r, {"a": 3})
        assert exc.value.field == "mm_inputs[0].length"

    def test_pause_state_must_be_a_pause_state(self) -> None:
        assert check_pause_state(PauseState.PAUSED_ALL) is PauseState.PAUSED_ALL
        for bad in (1, "paused_all", None):
            with pytest.raises(ProtocolError) as exc:
                check_pause_state(bad)
            assert exc.value.field == "pause_state"

    def test_grammar_ready(self) -> None:
        check_grammar_ready("r", True, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
        with pytest.raises(ProtocolError, match="no unfinished request"):
            check_grammar_ready("r", True, None)
        with pytest.raises(ProtocolError, match="does not wait"):
            check_grammar_ready("r", True, RequestStatus.WAITING)
        with pytest.raises(ProtocolError) as exc:
            check_grammar_ready("r", 1, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
        assert exc.value.field == "ok"

    def test_optional_methods_are_detected(self) -> None:
        class Plain:
            pass

        class Gated:
            def set_pause_state(self, state: PauseState) -> None: ...

            def grammar_ready(self, request_id: str, ok: bool = True) -> None: ...

        assert not supports_pause(Plain()) and not supports_grammar(Plain())
        assert supports_pause(Gated()) and supports_grammar(Gated())


class TestRuleCatalogue:
    def test_gate_rules_are_reachable_only_with_their_gate(self) -> None:
        from schedspec.spec.coverage import parse_required, rules_line
        from schedspec.spec.rule_names import ALL_GATES, ALL_KV, ALL_MODES, RULES, reachable_in

        gated = [r for r in RULES.values() if r.gates]
        assert gated and all(set(r.gates) <= set(ALL_GATES + ALL_KV) for r in gated)
        plain = set(reachable_in(ALL_MODES))
        assert not plain & {r.name for r in gated}
        with_lora = set(reachable_in(ALL_MODES, ("lora",)))
        assert with_lora - plain == {r.name for r in gated if r.gates == ("lora",) and r.modes}
        everything = set(reachable_in(ALL_MODES, ALL_GATES + ALL_KV))
        assert everything == {r.name for r in RULES.values() if r.modes}
        assert "grammar.drafts_cut" in reachable_in(("spec",), ("structured_output",))
        assert "grammar.drafts_cut" not in reachable_in(("async-spec",), ("structured_output",))
        assert set(parse_required("all", ALL_MODES, ("encoder",))) == set(reachable_in(ALL_MODES, ("encoder",)))
        assert "with gates encoder" in rules_line({}, modes=("sync",), gates=("encoder",))
        assert "with gates" not in rules_line({}, modes=("sync",))


def test_a_scheduler_without_a_gate_can_refuse_its_config() -> None:
    from schedspec.spec.protocol import check_gate_config, gates_of_config

    assert gates_of_config(SchedulerConfig()) == ()
    on = SchedulerConfig(watermark=0.1, prefill_schedule_interval=2, max_loras=1, **ENCODER)  # type: ignore[arg-type]
    assert gates_of_config(on) == ("watermark", "prefill_cadence", "lora", "encoder")
    check_gate_config(SchedulerConfig(), ())
    check_gate_config(on, ("watermark", "prefill_cadence", "lora", "encoder"))
    with pytest.raises(ConfigError) as exc:
        check_gate_config(on, ("watermark", "lora"))
    assert exc.value.field == "prefill_schedule_interval"
