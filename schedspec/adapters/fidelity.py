"""The fidelity report: which lines of vLLM's scheduler a run reached.

The spec claims to capture vLLM 0.33's v1 scheduler; a lockstep run shows that
the two agree on everything the run did, and this report shows how much of
vLLM that was. ``LineCollector`` records, while it is active, every line
executed in vLLM's scheduling files (``FILES``); ``fidelity_report`` turns
that into reached / executable lines per file and per function, and
``report_table`` / ``report_json`` print and serialise it.

    with LineCollector() as lines:
        ...                                  # drive vLLM (schedspec check --against vllm)
    report = fidelity_report(lines.hits, steps=20000)
    print(report_table(report))

The collector is a ``sys.settrace`` hook that asks for line events only in
frames whose code lives in those files. By default it is installed only
around the calls the vLLM adapter makes into vLLM's scheduler
(``vllm_load.trace_vllm_calls``), so the spec, the invariants and the
driver of a lockstep run pay nothing; ``scope="process"`` installs it for the
whole process and every thread started meanwhile (``threading.settrace``),
for vLLM driven some other way. (coverage.py's C tracer fails while vLLM
imports here; this one starts after the import and needs nothing but the
interpreter.)

Executable lines come from the compiled code objects (``co_lines``), the lines
the interpreter can report: a function's lines are those of its own code
object and of the comprehensions, generator expressions and lambdas inside
it, less the ``def`` line (reached at import, not when the function runs).
Module and class bodies are left out: they run at import, before any
collector starts. A nested ``def`` is a function of its own, named by its
qualified name.
"""

from __future__ import annotations

import os

import ast
import inspect
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Callable, Iterable, Iterator

#: vLLM's scheduling files, relative to the vllm package folder.
FILES: tuple[str, ...] = (
    "v1/core/sched/scheduler.py",
    "v1/core/sched/async_scheduler.py",
    "v1/core/kv_cache_manager.py",
    "v1/core/block_pool.py",
    "v1/core/single_type_kv_cache_manager.py",
    "v1/core/encoder_cache_manager.py",
    "v1/structured_output/__init__.py",
    "v1/core/kv_cache_coordinator.py",
)

#: The functions whose share the report states first (file, qualified name).
HEADLINE: tuple[tuple[str, str], ...] = (
    ("v1/core/sched/scheduler.py", "Scheduler.schedule"),
    ("v1/core/sched/scheduler.py", "Scheduler.update_from_output"),
)

#: The functions of the admission gates (structured outputs, LoRA, pause
#: states, watermark, prefill cadence, encoder budget and cache), whose
#: shares the report states after the headline (file, qualified name).
GATE_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("v1/core/sched/scheduler.py", "Scheduler._handle_blocked_waiting_request"),
    ("v1/core/sched/scheduler.py", "Scheduler._try_schedule_encoder_inputs"),
    ("v1/core/sched/scheduler.py", "Scheduler._allocate_encoder_inputs"),
    ("v1/core/sched/scheduler.py", "Scheduler._free_encoder_inputs"),
    ("v1/core/sched/scheduler.py", "Scheduler._free_encoder_input"),
    ("v1/core/sched/scheduler.py", "Scheduler.get_grammar_bitmask"),
    ("v1/core/sched/scheduler.py", "Scheduler.update_draft_token_ids"),
    ("v1/core/sched/scheduler.py", "Scheduler.update_draft_token_ids_in_output"),
    ("v1/core/sched/scheduler.py", "Scheduler.set_pause_state"),
    ("v1/core/kv_cache_manager.py", "KVCacheManager.allocate_slots"),
    ("v1/core/encoder_cache_manager.py", "EncoderCacheManager.check_and_update_cache"),
    ("v1/core/encoder_cache_manager.py", "EncoderCacheManager.can_allocate"),
    ("v1/core/encoder_cache_manager.py", "EncoderCacheManager.allocate"),
    ("v1/core/encoder_cache_manager.py", "EncoderCacheManager.free_encoder_input"),
    ("v1/core/encoder_cache_manager.py", "EncoderCacheManager.free"),
    ("v1/core/encoder_cache_manager.py", "EncoderCacheManager.get_freed_mm_hashes"),
    ("v1/structured_output/__init__.py", "StructuredOutputManager.validate_tokens"),
    ("v1/structured_output/__init__.py", "StructuredOutputManager.accept_tokens"),
    ("v1/structured_output/__init__.py", "StructuredOutputManager.grammar_bitmask"),
)

#: The KV connector's functions of vLLM's scheduler (issue 15): what it does
#: with a connector's answers and the worker's reports, stated after the
#: admission gates (file, qualified name).
CONNECTOR_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("v1/core/sched/scheduler.py", "Scheduler._update_waiting_for_remote_kv"),
    ("v1/core/sched/scheduler.py", "Scheduler._update_from_kv_xfer_finished"),
    ("v1/core/sched/scheduler.py", "Scheduler._handle_invalid_blocks"),
    ("v1/core/sched/scheduler.py", "Scheduler._connector_finished"),
    ("v1/core/sched/scheduler.py", "Scheduler._handle_failed_recving"),
    ("v1/core/sched/scheduler.py", "Scheduler._update_requests_with_invalid_blocks"),
)

#: The targets issue 15 sets for a run of the default check plus the
#: connector and hybrid modes, percent of executable lines reached: whole
#: files (the KV cache coordinator and the single-type managers) and the four
#: connector functions it names (the other two of CONNECTOR_FUNCTIONS are
#: reported without a target).
#: Then the KV cache events' and the statistics' targets (docs/kv-events.md,
#: docs/scheduler-stats.md): the block pool, the event functions of the
#: modelled layouts, the takes and the statistics.
FILE_TARGETS: tuple[tuple[str, float], ...] = (
    ("v1/core/kv_cache_coordinator.py", 70.0),
    ("v1/core/single_type_kv_cache_manager.py", 70.0),
    ("v1/core/block_pool.py", 85.0),
)
FUNCTION_TARGETS: tuple[tuple[str, str, float], ...] = (
    ("v1/core/sched/scheduler.py", "Scheduler._update_waiting_for_remote_kv", 80.0),
    ("v1/core/sched/scheduler.py", "Scheduler._update_from_kv_xfer_finished", 80.0),
    ("v1/core/sched/scheduler.py", "Scheduler._handle_invalid_blocks", 80.0),
    ("v1/core/sched/scheduler.py", "Scheduler._connector_finished", 80.0),
    ("v1/core/block_pool.py", "BlockPool._build_block_stored_event", 90.0),
    ("v1/core/block_pool.py", "BlockPool.emit_cached_block_events", 90.0),
    ("v1/core/block_pool.py", "BlockPool._generate_event_extra_keys", 90.0),
    ("v1/core/block_pool.py", "BlockPool._emit_block_removed_events", 90.0),
    ("v1/core/block_pool.py", "BlockPool.take_events", 100.0),
    ("v1/core/kv_cache_manager.py", "KVCacheManager.take_events", 100.0),
    ("v1/core/sched/scheduler.py", "Scheduler.make_stats", 90.0),
    ("v1/core/kv_cache_manager.py", "KVCacheManager.make_prefix_cache_stats", 90.0),
)

#: The KV cache managers of kinds the spec does not model (vLLM 0.33's
#: single_type_kv_cache_manager.py beyond full attention, sliding window and
#: chunked local attention), each with the feature its unreached lines are
#: put under: a function of one of these classes is about that feature as a
#: whole, whatever its words say.
_OTHER_KINDS = "KV cache kinds not modelled (RSWA, circular buffer, sink, cross attention)"
UNMODELLED_CLASSES: dict[str, str] = {
    "RSWAManager": _OTHER_KINDS,
    "CircularBufferManager": _OTHER_KINDS,
    "CrossAttentionManager": _OTHER_KINDS,
    "SinkFullAttentionManager": _OTHER_KINDS,
    "MambaManager": "Mamba / hybrid models",
    "HiSparseSourceManager": "HiSparse",
    "_HiSparseAuxiliaryManager": "HiSparse",
    "HiSparseHotManager": "HiSparse",
    "HiSparseResidentManager": "HiSparse",
}

_TraceFn = Callable[[FrameType, str, Any], Any]


def vllm_root() -> Path:
    """The folder of the installed vllm package (imports vLLM the way the
    adapter does, with its environment pinned)."""
    from schedspec.adapters.vllm_load import load_vllm

    load_vllm()
    import vllm

    assert vllm.__file__ is not None
    # not resolved: the tracer matches code objects' co_filename, which keeps
    # the path vllm was imported by (a symlinked virtualenv stays unresolved)
    return Path(os.path.abspath(vllm.__file__)).parent


def target_paths(root: Path | None = None) -> dict[str, str]:
    """Absolute path (as code objects name it) -> the path relative to the
    vllm folder, for each of ``FILES``."""
    base = root if root is not None else vllm_root()
    return {str(base / rel): rel for rel in FILES}


#: Where a collector is installed: around the vLLM adapter's calls into vLLM,
#: or for the whole process.
SCOPES = ("vllm-calls", "process")


class LineCollector:
    """Records the lines executed in ``files`` (absolute paths; default:
    vLLM's ``FILES``) while active. ``hits`` maps each file's path relative
    to the vllm folder to the set of line numbers reached. ``scope`` is one
    of ``SCOPES``. Whatever tracer was installed before (a debugger, say) is
    put back on stop."""

    def __init__(self, files: dict[str, str] | None = None, scope: str = "vllm-calls") -> None:
        if scope not in SCOPES:
            raise ValueError(f"LineCollector scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        self._files = files if files is not None else target_paths()
        self.scope = scope
        self.hits: dict[str, set[int]] = {rel: set() for rel in self._files.values()}
        local = {path: _line_tracer(self.hits[rel].add) for path, rel in self._files.items()}
        get = local.get

        def global_trace(frame: FrameType, event: str, arg: Any) -> _TraceFn | None:
            return get(frame.f_code.co_filename)

        self.trace_function: _TraceFn = global_trace
        self._saved: tuple[Any, Any] | None = None

    @property
    def active(self) -> bool:
        return self._saved is not None

    def start(self) -> None:
        if self._saved is not None:
            raise RuntimeError("LineCollector is already collecting")
        if self.scope == "process":
            self._saved = (sys.gettrace(), threading.gettrace())
            threading.settrace(self.trace_function)
            sys.settrace(self.trace_function)
        else:
            from schedspec.adapters.vllm_load import trace_vllm_calls

            self._saved = (trace_vllm_calls(self.trace_function), None)

    def stop(self) -> None:
        if self._saved is None:
            return
        previous, previous_threads = self._saved
        self._saved = None
        if self.scope == "process":
            sys.settrace(previous)
            threading.settrace(previous_threads)
        else:
            from schedspec.adapters.vllm_load import trace_vllm_calls

            trace_vllm_calls(previous)

    def __enter__(self) -> LineCollector:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _line_tracer(add: Callable[[int], None]) -> _TraceFn:
    def local(frame: FrameType, event: str, arg: Any) -> _TraceFn:
        if event == "line":
            add(frame.f_lineno)
        return local

    return local


# --------------------------------------------------------------------------
# Executable lines
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class FunctionLines:
    """One function of a file: its qualified name, ``def`` line, and the
    lines the interpreter can report while it runs."""

    qualname: str
    first_line: int
    lines: frozenset[int]


def _code_lines(code: CodeType) -> set[int]:
    return {line for _, _, line in code.co_lines() if line is not None}


def _is_function(code: CodeType) -> bool:
    return bool(code.co_flags & inspect.CO_OPTIMIZED) and not code.co_name.startswith("<")


def _children(code: CodeType) -> Iterator[CodeType]:
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield const


def _inline_lines(code: CodeType) -> set[int]:
    """The lines of a comprehension, generator expression or lambda, with
    those nested inside it (they belong to the enclosing function)."""
    lines = _code_lines(code)
    for child in _children(code):
        if not _is_function(child):
            lines |= _inline_lines(child)
    return lines


def executable_functions(source: str, filename: str) -> list[FunctionLines]:
    """Every function of ``source`` (methods and nested functions too), in
    the order of their ``def`` lines; a qualified name that comes again (a
    property's setter) is suffixed with ``@`` and its def line."""
    found: list[FunctionLines] = []

    def visit(code: CodeType) -> None:
        for child in _children(code):
            if _is_function(child):
                lines = _code_lines(child)
                for inner in _children(child):
                    if not _is_function(inner):
                        lines |= _inline_lines(inner)
                if len(lines) > 1:
                    lines.discard(child.co_firstlineno)
                found.append(FunctionLines(child.co_qualname, child.co_firstlineno, frozenset(lines)))
            visit(child)

    visit(compile(source, filename, "exec", dont_inherit=True))
    found.sort(key=lambda f: (f.first_line, f.qualname))
    # a name defined twice (a property's getter and setter, a function
    # redefined under a condition): the later ones carry their def line
    seen: set[str] = set()
    for i, f in enumerate(found):
        if f.qualname in seen:
            found[i] = FunctionLines(f"{f.qualname}@{f.first_line}", f.first_line, f.lines)
        seen.add(f.qualname)
    return found


# --------------------------------------------------------------------------
# What an unreached line is about
# --------------------------------------------------------------------------

#: vLLM features, each with the words that give its code away (a regular
#: expression), in the order they are tried: first those the spec does not
#: model, last speculative decoding and async scheduling, which it does (an
#: unreached line there is a behaviour a check could still reach); those two,
#: marked " (last)", are tried only when no other feature matches anywhere,
#: so a draft-handling line inside a Mamba-only block counts for Mamba. A line
#: unreached by a run is put under the first feature named by the line
#: itself, or else by the statement it belongs to and the comment just above
#: that (or above the first statement of its block), or else by the
#: conditions of the blocks around it, innermost first (a line in an ``else``
#: branch skips its ``if``'s condition); "unclassified" when none is. A
#: feature whose label ends in " (near)" is matched only against the line,
#: its statement and the condition of the block right around it (the label
#: is shown without that suffix).
FEATURES: tuple[tuple[str, str], ...] = (
    ("KV / EC connectors, remote and deferred KV",
     r"connector|kv_transfer|KVTransfer|remote|ext_tokens|external|load_kv|failed_kv|invalid_block|kv_xfer"
     r"|_ec_|ec_transfer"
     r"|deferred_load|defer_load|sync_kv_loads|kv_fetch|KV_FETCH|routed_experts|block_state"
     r"|defer_block_free|step_seq|deferred_frees|cow_retained|block_frees|blocks_can_be_freed"
     r"|partial_tail|block_aligned_local|hit_diverged|max_cache_hit_length|shared_prefix_boundary"),
    ("multimodal encoder", r"encoder|mm_|embeds|mrope"),
    ("LoRA", r"lora"),
    ("Mamba / hybrid models", r"mamba|Mamba"),
    ("prefill throttling (DP balancing, prefill interval)",
     r"defer_prefills|throttle|prefill_capacity|prefill_interval|last_prefill_step|adaptive_long_prefill"),
    ("draft-model methods (drafting slots)", r"draft_slots"),
    ("V2 model runner, pipeline parallelism, more than one step in flight",
     r"next_decode_eligible|pp_size|decode_stagger|use_v2|is_xpu|can_skip_drafts|_drafts_unused"
     r"|num_stale_output_tokens and not"),
    ("waiting requests blocked (remote KV, grammar compilation, streaming input)",
     r"_handle_blocked_waiting_request|ready_to_schedule|step_skipped_"),
    ("dynamic speculative decoding", r"dynamic_sd_lookup\[|dynamic_sd_lookup is not None"),
    ("structured output", r"structured|grammar"),
    ("pooling models", r"pool(er|ing)_|pooler|pooling"),
    ("streaming sessions (resumable requests)", r"resumable|streaming|session|continuing_reqs"),
    ("prefix replay, lookahead hashes", r"replay|num_hash_lookahead|block_hashes\.clear|update_block_hashes|prefill_lookahead"),
    ("logprobs, sampling masks, NaN counts", r"logprobs|sampling_mask|nans"),
    ("stats, metrics and events (timings, connector and data-parallel stats, kv_cache_report_mode)",
     r"log_stats|record_event|_stats\b|stats\.|perf_metrics|spec_decode_metrics|observability|kv_event"
     r"|take_events|KVEventBatch|EngineCoreOutputs\(|scheduler_stats"),
    ("finished sets per front-end client (data parallelism)",
     r"finished_req_ids_dict|finished_set|finished_req_ids\.clear"),
    ("errors (engine-side failures)", r"FINISHED_ERROR|error_req|request_errors|logger\.error|RuntimeError"),
    ("pause (near)", r"PAUSED|pause_state"),
    ("speculative decoding (last)",
     r"spec_token|num_spec_tokens|spec_decode|draft|num_rejected|num_accepted|pad_spec_decode|padded_num_tokens"),
    ("async scheduling (output placeholders, stale output) (last)", r"placeholder|stale_output|num_stale|in_flight"),
)

UNCLASSIFIED = "unclassified"


def _headers(node: ast.AST, text: list[str]) -> str:
    """The text that says what a statement's branch is about: the lines of a
    compound statement's condition or iterable, of any other statement all
    its lines. (Whole lines: ast.get_source_segment would split the source
    anew on every call.)"""
    def lines_of(n: ast.AST) -> str:
        first = getattr(n, "lineno", 0)
        last = getattr(n, "end_lineno", None) or first
        return "\n".join(text[first - 1:last]) if first else ""

    if isinstance(node, (ast.If, ast.While)):
        return lines_of(node.test)
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return lines_of(node.iter)
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return "\n".join(lines_of(i.context_expr) for i in node.items)
    if isinstance(node, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
        return ""
    return lines_of(node)


def classify_lines(source: str, lines: Iterable[int],
                   features: tuple[tuple[str, str], ...] = FEATURES) -> dict[str, list[int]]:
    """Group ``lines`` of ``source`` by the feature (``FEATURES``) their code
    is about: a quick answer to "what does the spec not cover yet?" read off
    the words in the code, so a heuristic; each group lists its lines."""
    tree = ast.parse(source)
    text = source.splitlines()
    parent: dict[ast.AST, ast.AST] = {}
    stmts: list[ast.stmt] = []
    for walked in ast.walk(tree):
        for child in ast.iter_child_nodes(walked):
            parent[child] = walked
        if isinstance(walked, ast.stmt):
            stmts.append(walked)
    # the innermost statement of every line: wider statements first, narrower overwrite
    inner: dict[int, ast.stmt] = {}
    for stmt in sorted(stmts, key=lambda n: (n.end_lineno or n.lineno) - n.lineno, reverse=True):
        for number in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1):
            inner[number] = stmt
    headers: dict[int, str] = {}

    def header(n: ast.AST) -> str:
        text_of = headers.get(id(n))
        if text_of is None:
            text_of = headers[id(n)] = _headers(n, text)
        return text_of

    near_suffix, last_suffix = " (near)", " (last)"
    compiled = [(label.removesuffix(near_suffix), re.compile(pattern), label.endswith(near_suffix))
                for label, pattern in features if not label.endswith(last_suffix)]
    fallback = [(label.removesuffix(last_suffix), re.compile(pattern))
                for label, pattern in features if label.endswith(last_suffix)]
    out: dict[str, list[int]] = {}
    for line in sorted(set(lines)):
        own = text[line - 1] if 0 < line <= len(text) else ""
        context: list[str] = []
        innermost = inner.get(line)
        node: ast.AST | None = innermost
        if innermost is not None:
            context.append(header(innermost))
            context.append(_comment_above(text, innermost.lineno))
            block = _block_of(parent.get(innermost), innermost)
            if block:
                context.append(_comment_above(text, block[0].lineno))
        near = len(context) + 1
        while node is not None:
            up = parent.get(node)
            if up is not None and not (isinstance(up, ast.If) and node in up.orelse):
                context.append(header(up))
            node = up
        candidates = [own] + context
        label = next((name for i, t in enumerate(candidates) for name, rx, near_only in compiled
                      if (i <= near or not near_only) and rx.search(t)), None)
        if label is None:
            label = next((name for t in candidates for name, rx in fallback if rx.search(t)), UNCLASSIFIED)
        out.setdefault(label, []).append(line)
    return out


def _block_of(up: ast.AST | None, node: ast.AST) -> list[ast.stmt]:
    """The statement list of ``up`` (body, orelse, ...) that holds ``node``."""
    if up is None:
        return []
    for name in ("body", "orelse", "finalbody"):
        block = getattr(up, name, None)
        if isinstance(block, list) and node in block:
            return block
    return []


def _comment_above(text: list[str], lineno: int) -> str:
    """The comment lines right above line ``lineno`` (1-based)."""
    found: list[str] = []
    i = lineno - 2
    while i >= 0 and text[i].strip().startswith("#"):
        found.append(text[i])
        i -= 1
    return "\n".join(reversed(found))


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class FunctionReport:
    qualname: str
    first_line: int
    lines: int
    reached: int
    missed: tuple[int, ...]
    #: the missed lines grouped by the vLLM feature they belong to (FEATURES)
    missed_by_feature: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def percent(self) -> float:
        return 100.0 * self.reached / self.lines if self.lines else 100.0


@dataclass(frozen=True)
class FileReport:
    path: str  # relative to the vllm folder
    functions: tuple[FunctionReport, ...]

    @property
    def lines(self) -> int:
        return sum(f.lines for f in self.functions)

    @property
    def reached(self) -> int:
        return sum(f.reached for f in self.functions)

    @property
    def percent(self) -> float:
        return 100.0 * self.reached / self.lines if self.lines else 100.0

    def function(self, qualname: str) -> FunctionReport | None:
        for f in self.functions:
            if f.qualname == qualname:
                return f
        return None


@dataclass(frozen=True)
class FidelityReport:
    vllm_version: str
    files: tuple[FileReport, ...]
    steps: int | None = None
    modes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def file(self, path: str) -> FileReport | None:
        for f in self.files:
            if f.path == path:
                return f
        return None

    def headline(self) -> list[tuple[str, FunctionReport]]:
        return self._functions(HEADLINE)

    def gate_functions(self) -> list[tuple[str, FunctionReport]]:
        """The admission gates' functions (GATE_FUNCTIONS) with their reports."""
        return self._functions(GATE_FUNCTIONS)

    def connector_functions(self) -> list[tuple[str, FunctionReport]]:
        """The KV connector's functions (CONNECTOR_FUNCTIONS) with their reports."""
        return self._functions(CONNECTOR_FUNCTIONS)

    def modelled_share(self, path: str) -> tuple[int, int]:
        """(reached, executable) lines of ``path`` outside the functions of
        UNMODELLED_CLASSES: the part of the file the spec models."""
        f = self.file(path)
        if f is None:
            return 0, 0
        kept = [fn for fn in f.functions if fn.qualname.split(".")[0] not in UNMODELLED_CLASSES]
        return sum(fn.reached for fn in kept), sum(fn.lines for fn in kept)

    def targets(self) -> list[tuple[str, float, float]]:
        """Each of issue 15's targets (FILE_TARGETS, FUNCTION_TARGETS) as
        (what, percent reached, target percent)."""
        out: list[tuple[str, float, float]] = []
        for path, target in FILE_TARGETS:
            f = self.file(path)
            if f is not None:
                out.append((path, f.percent, target))
        for path, qualname, target in FUNCTION_TARGETS:
            f = self.file(path)
            fn = f.function(qualname) if f is not None else None
            if fn is not None:
                out.append((qualname, fn.percent, target))
        return out

    def _functions(self, names: tuple[tuple[str, str], ...]) -> list[tuple[str, FunctionReport]]:
        out = []
        for path, qualname in names:
            f = self.file(path)
            fn = f.function(qualname) if f is not None else None
            if fn is not None:
                out.append((qualname, fn))
        return out


def file_report(rel: str, source: str, hits: set[int], filename: str = "<vllm>") -> FileReport:
    functions = []
    all_missed: set[int] = set()
    found = executable_functions(source, filename)
    for fn in found:
        all_missed |= fn.lines - hits
    feature_of = {line: label for label, group in classify_lines(source, all_missed).items() for line in group}
    for fn in found:
        reached = fn.lines & hits
        missed = tuple(sorted(fn.lines - reached))
        by_feature: dict[str, list[int]] = {}
        whole = UNMODELLED_CLASSES.get(fn.qualname.split(".")[0])
        for line in missed:
            by_feature.setdefault(whole or feature_of.get(line, UNCLASSIFIED), []).append(line)
        functions.append(FunctionReport(fn.qualname, fn.first_line, len(fn.lines), len(reached), missed,
                                        {k: tuple(v) for k, v in by_feature.items()}))
    return FileReport(rel, tuple(functions))


def fidelity_report(hits: dict[str, set[int]], steps: int | None = None, modes: tuple[str, ...] = (),
                    root: Path | None = None, extra: dict[str, Any] | None = None) -> FidelityReport:
    """The report for ``hits`` (a LineCollector's), reading the sources of
    ``FILES`` under ``root`` (default: the installed vllm)."""
    base = root if root is not None else vllm_root()
    files = []
    for rel in FILES:
        path = base / rel
        files.append(file_report(rel, path.read_text(), hits.get(rel, set()), str(path)))
    try:
        import vllm

        version = str(getattr(vllm, "__version__", "?"))
    except ImportError:  # pragma: no cover - a root given without vllm installed
        version = "?"
    return FidelityReport(version, tuple(files), steps, modes, dict(extra or {}))


def report_json(report: FidelityReport) -> dict[str, Any]:
    """The report as JSON data: per file and per function, executable lines,
    reached lines, percentage and the line numbers missed."""
    return {
        "vllm_version": report.vllm_version,
        "steps": report.steps,
        "modes": list(report.modes),
        **report.extra,
        "headline": {name: round(fn.percent, 1) for name, fn in report.headline()},
        "gate_functions": {name: round(fn.percent, 1) for name, fn in report.gate_functions()},
        "connector_functions": {name: round(fn.percent, 1) for name, fn in report.connector_functions()},
        "targets": {
            what: {"percent": round(percent, 1), "target": target, "met": percent >= target}
            for what, percent, target in report.targets()
        },
        "modelled_share": {
            path: dict(zip(("reached", "lines"), report.modelled_share(path))) for path, _ in FILE_TARGETS
        },
        "files": {
            f.path: {
                "lines": f.lines,
                "reached": f.reached,
                "percent": round(f.percent, 1),
                "functions": {
                    fn.qualname: {
                        "first_line": fn.first_line,
                        "lines": fn.lines,
                        "reached": fn.reached,
                        "percent": round(fn.percent, 1),
                        "missed": list(fn.missed),
                        "missed_by_feature": {k: list(v) for k, v in fn.missed_by_feature.items()},
                    }
                    for fn in f.functions
                },
            }
            for f in report.files
        },
    }


def _ranges(lines: tuple[int, ...], limit: int = 6) -> str:
    parts: list[str] = []
    start = prev = None
    for n in lines:
        if start is None:
            start = prev = n
        elif prev is not None and n == prev + 1:
            prev = n
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = n
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    more = len(parts) - limit
    return ", ".join(parts[:limit]) + (f", ... (+{more})" if more > 0 else "")


def report_table(report: FidelityReport, all_functions: bool = True) -> str:
    """The report as text: the headline functions, one line per file, then
    (``all_functions``) a row per function with the lines it missed."""
    out = [f"vLLM {report.vllm_version} lines reached"
           + (f" over {report.steps:,} steps" if report.steps is not None else "")
           + (f" ({', '.join(report.modes)})" if report.modes else "") + ":"]
    for name, fn in report.headline():
        out.append(f"  {name}(): {fn.reached}/{fn.lines} lines, {fn.percent:.0f}%")
        for label, group in sorted(fn.missed_by_feature.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            out.append(f"      {len(group):4d} unreached: {label}")
    gates = report.gate_functions()
    if gates:
        out.append("  admission gates:")
        width = max(len(name) for name, _ in gates)
        for name, fn in gates:
            out.append(f"    {name:<{width}} {fn.reached:>4}/{fn.lines:<4} {fn.percent:5.1f}%")
    connector = report.connector_functions()
    if connector:
        out.append("  KV connector:")
        width = max(len(name) for name, _ in connector)
        for name, fn in connector:
            out.append(f"    {name:<{width}} {fn.reached:>4}/{fn.lines:<4} {fn.percent:5.1f}%")
    targets = report.targets()
    if targets:
        out.append("  targets (issue 15):")
        width = max(len(what) for what, _, _ in targets)
        for what, percent, target in targets:
            verdict = "met" if percent >= target else "NOT met"
            out.append(f"    {what:<{width}} {percent:5.1f}% of >= {target:.0f}%: {verdict}")
        for path, _ in FILE_TARGETS:
            reached, lines = report.modelled_share(path)
            if lines:
                out.append(f"    {path} without the unmodelled managers: {reached}/{lines} "
                           f"({100.0 * reached / lines:.1f}%)")
    for f in report.files:
        out.append(f"  {f.path}: {f.reached}/{f.lines} lines, {f.percent:.0f}%")
    if all_functions:
        width = max((len(fn.qualname) for f in report.files for fn in f.functions), default=10)
        for f in report.files:
            out.append("")
            out.append(f"{f.path}  {f.reached}/{f.lines} ({f.percent:.0f}%)")
            for fn in f.functions:
                missed = f"  missed {_ranges(fn.missed)}" if fn.missed else ""
                out.append(f"  {fn.qualname:<{width}} {fn.reached:>4}/{fn.lines:<4} {fn.percent:5.1f}%{missed}")
    return "\n".join(out) + "\n"


def compare_markdown(columns: list[tuple[str, dict[str, Any]]], reached_only: tuple[str, ...] = ()) -> str:
    """A Markdown table per file comparing reports given as JSON data
    (``report_json``, e.g. read back from ``--coverage`` files): one column
    of reached/lines per report, a row per function. In the files named in
    ``reached_only`` a function no report reached is left out and counted."""
    if not columns:
        return ""
    labels = [label for label, _ in columns]
    out: list[str] = []
    first = columns[0][1]
    out.append("| function | " + " | ".join(labels) + " |")
    out.append("| --- |" + " --- |" * len(labels))
    for name in first.get("headline", {}):
        cells = []
        for _, data in columns:
            path, fn = _find_function(data, name)
            cells.append(_cell(fn))
        out.append(f"| **{name}()** | " + " | ".join(cells) + " |")
    for path in first["files"]:
        cells = [_cell(data["files"].get(path)) for _, data in columns]
        out.append(f"| **{path}** (all functions) | " + " | ".join(cells) + " |")
    for path, info in first["files"].items():
        out.append("")
        out.append(f"### {path}")
        out.append("")
        out.append("| function | lines | " + " | ".join(labels) + " |")
        out.append("| --- | ---: |" + " ---: |" * len(labels))
        hidden = 0
        for name, fn in info["functions"].items():
            row = [data["files"].get(path, {}).get("functions", {}).get(name) for _, data in columns]
            if path in reached_only and not any(r and r["reached"] for r in row):
                hidden += 1
                continue
            cells = [f"{r['reached']} ({r['percent']:.0f}%)" if r else "-" for r in row]
            out.append(f"| `{name}` | {fn['lines']} | " + " | ".join(cells) + " |")
        if hidden:
            out.append("")
            out.append(f"{hidden} more functions of this file were reached by none of these runs.")
    return "\n".join(out) + "\n"


def _find_function(data: dict[str, Any], qualname: str) -> tuple[str | None, dict[str, Any] | None]:
    for path, info in data["files"].items():
        fn = info["functions"].get(qualname)
        if fn is not None:
            return path, fn
    return None, None


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    return f"{entry['reached']}/{entry['lines']} ({entry['percent']:.0f}%)"
