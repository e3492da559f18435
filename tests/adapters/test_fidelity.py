"""The fidelity report (schedspec/adapters/fidelity.py): executable lines per
function, the line collector in both scopes, the report's numbers, table and
JSON, and ``schedspec check --against vllm --coverage`` on a short run.

The tests that drive vLLM need vLLM 0.33.0 (skipped without it unless
SCHEDSPEC_REQUIRE_VLLM=1) and stay short: vLLM is slow here."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from schedspec.adapters.fidelity import (
    FILES,
    LineCollector,
    executable_functions,
    fidelity_report,
    file_report,
    report_json,
    report_table,
)

REQUIRE = os.environ.get("SCHEDSPEC_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

SOURCE = textwrap.dedent(
    '''\
    import functools


    def deco(f):
        return f


    @deco
    def outer(x,
              y=1):
        """doc"""
        a = [i for i in range(x)]
        b = (x +
             y)

        def inner():
            return 1

        if a:
            return inner()
        return b


    class C:
        top = 1

        def method(self):
            return [k for k in (1, 2) if k]

        def unused(self):
            z = 1
            return z
    '''
)


def lines_of(source: str) -> dict[str, tuple[int, frozenset[int]]]:
    return {f.qualname: (f.first_line, f.lines) for f in executable_functions(source, "t.py")}


# ----------------------------------------------------------------------------- executable lines


def test_functions_and_their_lines() -> None:
    found = lines_of(SOURCE)
    assert list(found) == ["deco", "outer", "outer.<locals>.inner", "C.method", "C.unused"]
    # the def line (and decorator) is reached at import, not when the function runs;
    # the docstring is no instruction; a comprehension belongs to its function;
    # a continuation line with its own instructions counts; a nested def's body does not.
    assert found["deco"] == (4, frozenset({5}))
    first, outer = found["outer"]
    assert first == 8
    assert outer == frozenset({12, 13, 14, 16, 19, 20, 21})
    assert found["outer.<locals>.inner"][1] == frozenset({17})
    assert found["C.method"][1] == frozenset({28})
    assert found["C.unused"][1] == frozenset({31, 32})


def test_a_name_defined_twice_is_told_apart_by_its_line() -> None:
    source = (
        "class K:\n"
        "    @property\n"
        "    def size(self):\n"
        "        return 1\n"
        "\n"
        "    @size.setter\n"
        "    def size(self, value):\n"
        "        self.x = value\n"
    )
    found = lines_of(source)
    assert found == {"K.size": (2, frozenset({4})), "K.size@6": (6, frozenset({8}))}


def test_one_line_function_keeps_its_only_line() -> None:
    found = lines_of("def f(): return 1\n")
    assert found["f"] == (1, frozenset({1}))


# ----------------------------------------------------------------------------- the collector


def _load(tmp_path: Path) -> tuple[Any, str]:
    path = tmp_path / "fid_sample.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("fid_sample", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(path)


def test_process_scope_records_lines_run_and_restores_the_tracer(tmp_path: Path) -> None:
    module, path = _load(tmp_path)
    before = sys.gettrace()
    collector = LineCollector({path: "sample.py"}, scope="process")
    with collector:
        assert collector.active
        module.outer(2)
        module.C().method()
    assert not collector.active
    assert sys.gettrace() is before
    hits = collector.hits["sample.py"]
    assert {12, 13, 14, 16, 19, 20, 17, 28} <= hits
    assert not hits & {21, 31, 32}  # the branch not taken, the method never called
    module.C().unused()  # after stop: nothing more recorded
    assert not collector.hits["sample.py"] & {31, 32}
    report = file_report("sample.py", SOURCE, hits)
    outer = report.function("outer")
    unused = report.function("C.unused")
    assert outer is not None and unused is not None
    assert (outer.lines, outer.reached, outer.missed) == (7, 6, (21,))
    assert (unused.reached, unused.percent) == (0, 0.0)
    assert report.lines == sum(f.lines for f in report.functions)


def test_collector_refuses_to_start_twice_and_a_bad_scope(tmp_path: Path) -> None:
    collector = LineCollector({str(tmp_path / "x.py"): "x.py"}, scope="process")
    collector.start()
    try:
        with pytest.raises(RuntimeError, match="already collecting"):
            collector.start()
    finally:
        collector.stop()
    with pytest.raises(ValueError, match="scope"):
        LineCollector({}, scope="everywhere")


def test_table_and_json_of_a_report(tmp_path: Path) -> None:
    root = tmp_path / "vllm"
    for rel in FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(
            "class Scheduler:\n"
            "    def schedule(self):\n"
            "        a = 1\n"
            "        if a:\n"
            "            return a\n"
            "        return 0\n"
            "\n"
            "    def update_from_output(self):\n"
            "        return 2\n"
        )
    hits = {FILES[0]: {3, 4, 5}}
    report = fidelity_report(hits, steps=10, root=root)
    data = report_json(report)
    assert data["steps"] == 10
    assert data["headline"] == {"Scheduler.schedule": 75.0, "Scheduler.update_from_output": 0.0}
    sched = data["files"][FILES[0]]
    assert (sched["lines"], sched["reached"]) == (5, 3)
    assert sched["functions"]["Scheduler.schedule"]["missed"] == [6]
    assert data["files"][FILES[1]]["reached"] == 0
    json.dumps(data)  # serialisable as it stands
    table = report_table(report)
    assert "Scheduler.schedule(): 3/4 lines, 75%" in table
    assert "missed 6" in table
    assert "over 10 steps" in table


# ----------------------------------------------------------------------------- against vLLM


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_vllm_calls_scope_sees_the_scheduler_of_each_mode(async_scheduling: bool) -> None:
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.spec.interface import RequestSpec, SchedulerConfig, StepResult

    config = SchedulerConfig(block_size=4, num_blocks=17, max_model_len=64,
                             async_scheduling=async_scheduling)
    with LineCollector() as collector:
        sched = VllmScheduler(config)
        sched.add(RequestSpec("a", (1, 2, 3, 4, 5), max_tokens=3))
        in_flight = []
        for _ in range(4):
            in_flight.append(sched.schedule())
            if async_scheduling and len(in_flight) < 2:
                continue
            plan = in_flight.pop(0)
            sched.update(plan, StepResult({e.request_id: (9,) for e in plan.scheduled if e.samples}))
    sched.view()  # outside the collector
    report = fidelity_report(collector.hits, steps=4)
    schedule = report.headline()[0][1]
    assert schedule.reached > 50
    async_file = report.file("v1/core/sched/async_scheduler.py")
    assert async_file is not None
    assert (async_file.reached > 0) == async_scheduling


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_cli_coverage_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main

    out = tmp_path / "fid.json"
    # the report, not the KV features, is the subject: the workloads leave them out
    code = main(["check", "--against", "vllm", "--steps", "30", "--quiet", "--out", str(tmp_path),
                 "--kv", "none", "--coverage", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(out.read_text())
    assert data["steps"] == 30
    assert set(data["files"]) == set(FILES)
    assert data["headline"]["Scheduler.schedule"] > 0
    assert "Scheduler.schedule():" in printed and "fidelity report written to" in printed


def test_cli_coverage_without_vllm_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main

    code = main(["check", "--against", "spec", "--steps", "5", "--quiet", "--coverage", str(tmp_path / "f.json")])
    assert code == 2
    assert "--coverage" in capsys.readouterr().err
    assert not (tmp_path / "f.json").exists()


def test_compare_markdown_puts_runs_side_by_side(tmp_path: Path) -> None:
    from schedspec.adapters.fidelity import compare_markdown

    root = tmp_path / "vllm"
    for rel in FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(
            "class Scheduler:\n"
            "    def schedule(self):\n"
            "        a = 1\n"
            "        return a\n"
            "\n"
            "    def update_from_output(self):\n"
            "        return 2\n"
        )
    before = report_json(fidelity_report({FILES[0]: {3}}, root=root))
    after = report_json(fidelity_report({FILES[0]: {3, 4, 7}, FILES[2]: {4}}, root=root))
    text = compare_markdown([("before", before), ("after", after)], reached_only=(FILES[1], FILES[2]))
    assert "| **Scheduler.schedule()** | 1/2 (50%) | 2/2 (100%) |" in text
    assert "| `Scheduler.update_from_output` | 1 | 0 (0%) | 1 (100%) |" in text
    # in a reached-only file a function nobody reached is counted, not listed
    assert "1 more functions of this file were reached by none of these runs." in text
    assert text.count("### ") == len(FILES)


def test_unreached_lines_are_grouped_by_the_feature_they_serve() -> None:
    from schedspec.adapters.fidelity import UNCLASSIFIED, classify_lines

    source = textwrap.dedent(
        '''\
        def schedule(self, request):
            if self._pause_state == PAUSED_ALL:
                budget = 0
            if self.connector is not None:
                hits = 1
                more = 2
            else:
                # KVTransfer: a request whose blocks arrived
                blocks = 3
                n = 4
            if self.lora_config:
                for r in self.running:
                    x = r
            while budget:
                if budget > 1:
                    y = 5
                if request.mm_features:
                    z = 6
        '''
    )
    groups = classify_lines(source, [3, 5, 6, 9, 10, 13, 16, 18])
    assert groups == {
        "pause": [3],  # its own block's condition
        "KV / EC connectors, remote and deferred KV": [5, 6, 9, 10],  # the else branch by its comment
        "LoRA": [13],  # two blocks out
        UNCLASSIFIED: [16],  # nothing says; the loop's condition names no feature
        "multimodal encoder": [18],
    }
    report = file_report("f.py", source, {2, 4, 11, 14, 15, 17})
    fn = report.function("schedule")
    assert fn is not None
    assert fn.missed_by_feature["LoRA"] == (12, 13)
    assert sum(len(v) for v in fn.missed_by_feature.values()) == len(fn.missed)


def test_gate_functions_are_reported_after_the_headline(tmp_path: Path) -> None:
    from schedspec.adapters.fidelity import GATE_FUNCTIONS

    root = tmp_path / "vllm"
    bodies: dict[str, list[str]] = {}
    for rel, qualname in GATE_FUNCTIONS:
        bodies.setdefault(rel, []).append(qualname)
    for rel in FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        classes: dict[str, list[str]] = {}
        for qualname in bodies.get(rel, []):
            cls, name = qualname.split(".")
            classes.setdefault(cls, []).append(name)
        text = ""
        for cls, names in classes.items():
            text += f"class {cls}:\n" + "".join(f"    def {n}(self):\n        a = 1\n        return a\n" for n in names)
        (root / rel).write_text(text or "x = 1\n")
    # the first gate function fully reached, the others not at all
    hits = {GATE_FUNCTIONS[0][0]: {3, 4}}
    report = fidelity_report(hits, root=root)
    data = report_json(report)
    gates = data["gate_functions"]
    assert list(gates) == [q for _, q in GATE_FUNCTIONS]
    assert gates[GATE_FUNCTIONS[0][1]] == 100.0
    assert all(gates[q] == 0.0 for _, q in GATE_FUNCTIONS[1:])
    table = report_table(report, all_functions=False)
    assert "admission gates:" in table
    assert f"{GATE_FUNCTIONS[0][1]}" in table and "2/2" in table


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_gates_reach_their_vllm_functions() -> None:
    """A request with an encoder input and a grammar, under LoRA, a watermark,
    a cadence and a pause: vLLM's functions of each gate run."""
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.spec.interface import MMInput, PauseState, RequestSpec, SchedulerConfig, StepResult

    config = SchedulerConfig(block_size=4, num_blocks=17, max_model_len=64, max_loras=1, watermark=0.1,
                             prefill_schedule_interval=2, max_num_encoder_input_tokens=8,
                             encoder_cache_size=8, num_speculative_tokens=2)
    with LineCollector() as collector:
        sched = VllmScheduler(config)
        sched.add(RequestSpec("a", tuple(range(12)), max_tokens=4, lora_id=1, structured_output=True,
                              grammar_rejects=(5,), mm_inputs=(MMInput(2, 4, "img"),)))
        sched.grammar_ready("a")
        sched.set_pause_state(PauseState.PAUSED_NEW)
        sched.set_pause_state(PauseState.UNPAUSED)
        for _ in range(3):
            plan = sched.schedule()
            sched.update(plan, StepResult({e.request_id: (9,) for e in plan.scheduled if e.samples},
                                          {e.request_id: (3, 5) for e in plan.scheduled}))
    report = fidelity_report(collector.hits, steps=3)
    reached = {name: fn.reached for name, fn in report.gate_functions()}
    for name in ("Scheduler._handle_blocked_waiting_request", "Scheduler._try_schedule_encoder_inputs",
                 "Scheduler._allocate_encoder_inputs", "Scheduler._free_encoder_inputs",
                 "Scheduler.get_grammar_bitmask", "Scheduler.update_draft_token_ids",
                 "Scheduler.set_pause_state", "EncoderCacheManager.can_allocate",
                 "StructuredOutputManager.validate_tokens", "StructuredOutputManager.grammar_bitmask"):
        assert reached[name] > 0, name


def test_connector_functions_and_issue_15_targets_are_reported(tmp_path: Path) -> None:
    from schedspec.adapters.fidelity import CONNECTOR_FUNCTIONS, FILE_TARGETS, FUNCTION_TARGETS

    root = tmp_path / "vllm"
    bodies: dict[str, list[str]] = {}
    for rel, qualname in CONNECTOR_FUNCTIONS:
        bodies.setdefault(rel, []).append(qualname)
    for rel, qualname, _ in FUNCTION_TARGETS:  # the events' and statistics' targets too
        if qualname not in bodies.get(rel, []):
            bodies.setdefault(rel, []).append(qualname)
    # one modelled manager and one the spec does not model (Mamba)
    bodies.setdefault("v1/core/single_type_kv_cache_manager.py", []).extend(
        ["FullAttentionManager.cache_blocks", "MambaManager.cache_blocks"])
    for rel in FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        classes: dict[str, list[str]] = {}
        for qualname in bodies.get(rel, []):
            cls, name = qualname.split(".")
            classes.setdefault(cls, []).append(name)
        text = ""
        for cls, names in classes.items():
            text += f"class {cls}:\n" + "".join(f"    def {n}(self):\n        a = 1\n        return a\n" for n in names)
        (root / rel).write_text(text or "def f():\n    a = 1\n    return a\n")
    # the first connector function reached, the coordinator file wholly, the
    # modelled manager wholly, the Mamba one not at all
    hits = {CONNECTOR_FUNCTIONS[0][0]: {3, 4}, "v1/core/kv_cache_coordinator.py": {2, 3},
            "v1/core/single_type_kv_cache_manager.py": {3, 4}}
    report = fidelity_report(hits, root=root)
    data = report_json(report)
    conn = data["connector_functions"]
    assert list(conn) == [q for _, q in CONNECTOR_FUNCTIONS]
    assert conn[CONNECTOR_FUNCTIONS[0][1]] == 100.0
    assert all(conn[q] == 0.0 for _, q in CONNECTOR_FUNCTIONS[1:])
    targets = data["targets"]
    assert list(targets) == [p for p, _ in FILE_TARGETS] + [q for _, q, _ in FUNCTION_TARGETS]
    assert targets["v1/core/kv_cache_coordinator.py"] == {"percent": 100.0, "target": 70.0, "met": True}
    assert targets["v1/core/single_type_kv_cache_manager.py"] == {"percent": 50.0, "target": 70.0, "met": False}
    assert targets[FUNCTION_TARGETS[0][1]]["met"] and not targets[FUNCTION_TARGETS[1][1]]["met"]
    # without the managers the spec does not model, the file is wholly reached
    assert data["modelled_share"]["v1/core/single_type_kv_cache_manager.py"] == {"reached": 2, "lines": 2}
    mamba = data["files"]["v1/core/single_type_kv_cache_manager.py"]["functions"]["MambaManager.cache_blocks"]
    assert mamba["missed_by_feature"] == {"Mamba / hybrid models": [7, 8]}
    table = report_table(report, all_functions=False)
    assert "KV connector:" in table and "targets (issue 15):" in table
    assert "single_type_kv_cache_manager.py  50.0% of >= 70%: NOT met" in table
    assert "without the unmodelled managers: 2/2 (100.0%)" in table


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_the_connector_and_hybrid_groups_reach_their_vllm_functions() -> None:
    """A load that fails, one aborted, a save, on a hybrid layout and on the
    plain one: vLLM's connector functions and its hybrid coordinator run."""
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.spec.interface import KVCacheGroup, RequestSpec, SchedulerConfig, StepResult

    hits: dict[str, set[int]] = {}
    for groups in ((), (KVCacheGroup(), KVCacheGroup("sliding_window", 4))):
        config = SchedulerConfig(block_size=4, num_blocks=40, max_model_len=64, kv_connector=True,
                                 kv_load_failure_policy="recompute", kv_cache_groups=groups)
        with LineCollector() as collector:
            sched = VllmScheduler(config)
            sched.add(RequestSpec("a", tuple(range(12)), max_tokens=2, kv_external_tokens=8, kv_load_async=True))
            sched.add(RequestSpec("b", tuple(range(20, 32)), max_tokens=2, kv_save_async=True))
            sched.add(RequestSpec("c", tuple(range(40, 52)), max_tokens=2, kv_external_tokens=8))
            plan = sched.schedule()
            bad = () if groups else (plan.kv_loads[1].block_ids[1],)
            sched.update(plan, StepResult({e.request_id: (9,) for e in plan.scheduled if e.samples},
                                          finished_recving=("a",), failed_recving=("a",), invalid_block_ids=bad))
            for _ in range(3):
                plan = sched.schedule()
                sched.update(plan, StepResult({e.request_id: (9,) for e in plan.scheduled if e.samples}))
            plan = sched.schedule()
            sched.update(plan, StepResult(finished_sending=("b",)))
        for rel, lines in collector.hits.items():
            hits.setdefault(rel, set()).update(lines)
    report = fidelity_report(hits)
    reached = {name: fn.reached for name, fn in report.connector_functions()}
    assert all(reached.values()), reached
    coordinator = report.file("v1/core/kv_cache_coordinator.py")
    assert coordinator is not None
    for name in ("HybridKVCacheCoordinator.find_longest_cache_hit", "UnitaryKVCacheCoordinator.find_longest_cache_hit"):
        fn = coordinator.function(name)
        assert fn is not None and fn.reached > 0, name


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE, reason="vLLM is not installed")
def test_chunked_local_attention_is_modelled_and_its_manager_reached() -> None:
    """ChunkedLocalAttentionManager is a kind the spec models: its lines
    count in the modelled share of single_type_kv_cache_manager.py, and a
    chunked-local layout (a prompt past two chunks, then a hit on it) runs
    its hit search and its skipped-token rule."""
    from schedspec.adapters.fidelity import UNMODELLED_CLASSES
    from schedspec.adapters.vllm_adapter import VllmScheduler
    from schedspec.spec.interface import KVCacheGroup, RequestSpec, SchedulerConfig, StepResult

    assert "ChunkedLocalAttentionManager" not in UNMODELLED_CLASSES
    assert all("chunked local" not in feature for feature in UNMODELLED_CLASSES.values())
    config = SchedulerConfig(block_size=4, num_blocks=40, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4,
                             kv_cache_groups=(KVCacheGroup(), KVCacheGroup("chunked_local", attention_chunk_size=8)))
    with LineCollector() as collector:
        sched = VllmScheduler(config)
        for rid in ("a", "b"):
            sched.add(RequestSpec(rid, tuple(range(1, 21)), max_tokens=2))
            for _ in range(4):
                plan = sched.schedule()
                sched.update(plan, StepResult({e.request_id: (9,) for e in plan.scheduled if e.samples}))
    report = fidelity_report(collector.hits)
    managers = report.file("v1/core/single_type_kv_cache_manager.py")
    assert managers is not None
    for name in ("ChunkedLocalAttentionManager.find_longest_cache_hit",
                 "ChunkedLocalAttentionManager.get_num_skipped_tokens"):
        fn = managers.function(name)
        assert fn is not None and fn.reached > 0, name
        assert all(not feature.startswith("KV cache kinds not modelled") for feature in fn.missed_by_feature)
    reached, lines = report.modelled_share("v1/core/single_type_kv_cache_manager.py")
    chunked = [fn for fn in managers.functions if fn.qualname.startswith("ChunkedLocalAttentionManager.")]
    assert chunked and sum(fn.lines for fn in chunked) <= lines
    assert sum(fn.reached for fn in chunked) <= reached
