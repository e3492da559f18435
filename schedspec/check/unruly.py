"""The unruly environment: the outputs the fake worker, drafter, connector
worker and grammar send besides the polite ones, each with what vLLM 0.33's
scheduler does with it and the spec's rule that handles it.

Every output in ENVIRONMENT is one a real engine may send under vLLM's
contract, and every one is produced by the environment of the default check
(check/oracle.py: FakeModel.chunk_drafts, the drafter that stops short, the
"all", "none" and "prefix" acceptance; KVWorker: reports late, failed
whole or at a block, for a request finished meanwhile; check/gate_requests.py:
grammars that refuse drafts or fail to compile; the driver's aborts of
requests in flight). ``recipe`` is a short guided workload that reaches the
row's rule: tests/check/test_unruly.py holds the spec and impl to each,
tests/adapters/test_vllm_unruly.py the spec and vLLM in lockstep, and
docs/adapters.md lists the table (``doc_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

from schedspec.spec.rule_names import RULES

from schedspec.check.coverage_guided import guided_workload
from schedspec.check.workload import Workload


@dataclass(frozen=True)
class EnvOutput:
    """One output of the environment and its handling."""

    output: str  # what the worker, drafter, connector or grammar sends
    handling: str  # what vLLM's scheduler does with it
    rule: str  # the spec's rule for it (spec/rule_names.py, which cites vLLM's function)
    mode: str  # the mode of the recipe (features.MODES)
    gates: tuple[str, ...] = ()
    kv: tuple[str, ...] = ()
    seed: int = 0  # the recipe's seed (the first that reaches the rule)


ENVIRONMENT: tuple[EnvOutput, ...] = (
    EnvOutput("drafts after a partial prefill chunk",
              "dropped", "spec.drafts_after_chunk_dropped", "spec"),
    EnvOutput("fewer than k drafts, or none",
              "verified as proposed", "spec.drafts_set", "spec"),
    EnvOutput("drafts for a request this update finished", "ignored", "spec.drafts_for_finished", "spec"),
    EnvOutput("every draft accepted", "kept", "spec.all_accepted", "spec"),
    EnvOutput("drafts rejected, down to all", "rolled back", "spec.some_rejected",
              "spec", seed=1),
    EnvOutput("a stop token among accepted drafts", "the rest discarded", "spec.stop_inside_run",
              "spec"),
    EnvOutput("the output of a request aborted in flight, or none for it", "discarded", "update.request_gone",
              "async"),
    EnvOutput("a grammar refusing a draft", "drafts cut there", "grammar.drafts_cut", "spec", ("grammar",),
              seed=1),
    EnvOutput("a grammar failing to compile", "request finished with an error",
              "grammar.compile_error", "sync", ("grammar",)),
    EnvOutput("a load done for a request finished meanwhile", "its blocks freed",
              "connector.load_done_after_finish", "sync", kv=("connector",)),
    EnvOutput("a load failed whole (recompute)", "nothing counted computed",
              "connector.failed_recompute", "sync", kv=("connector",), seed=1),
    EnvOutput("a failed load of a request aborted meanwhile", "ignored", "connector.failed_ignored",
              "sync", kv=("connector",), seed=7),
    EnvOutput("a load failed at a block (recompute)", "computed cut there",
              "connector.invalid_recompute", "sync", kv=("connector",), seed=1),
    EnvOutput("a load failed at a block (fail)", "key evicted, readers failed",
              "connector.invalid_fail", "sync", kv=("connector",)),
    EnvOutput("a sample read from a block a load failed", "skipped",
              "connector.output_skipped", "sync", kv=("connector",)),
    EnvOutput("a save done, as late as allowed", "blocks freed",
              "connector.save_done", "sync", kv=("connector",)),
)

#: the steps of a recipe
RECIPE_STEPS = 40


def recipe(row: EnvOutput) -> Workload:
    """The short guided workload (aimed at the row's rule, in its mode, with
    its gates and KV features on) that reaches ``row.rule``."""
    return guided_workload(row.seed, RECIPE_STEPS, focus=[row.rule], modes=(row.mode,), gates=row.gates,
                           kv=row.kv, always_gates=row.gates)


def doc_table() -> str:
    """The Markdown table docs/adapters.md gives (tests/check/test_unruly.py holds it)."""
    lines = ["| the environment sends | vLLM's scheduler | rule (cites vLLM's function) |", "|---|---|---|"]
    for row in ENVIRONMENT:
        assert row.rule in RULES, row.rule
        lines.append(f"| {row.output} | {row.handling} | `{row.rule}` |")
    return "\n".join(lines)
