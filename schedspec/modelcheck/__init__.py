"""An explicit-state model checker over the executable spec, in the manner of TLC.

Breadth-first exploration of every state the reference scheduler can reach from
the empty scheduler under a finite alphabet of events:

- ``add S``: a request of shape S (a fixed, id-free description: prompt, max
  tokens, priority, stop / eos tokens, salt); its id and arrival are assigned
  in arrival order, so an id enters the canonical state only through order;
- ``abort #k``: abort the k-th unfinished request (in arrival order);
- ``step``: ``schedule()``, the deterministic fake model (schedspec/check/oracle.py,
  FakeModel, small vocabulary) reading the context back through the plan's
  block tables, ``update()``;
- ``reset`` / ``reset+running``: ``reset_prefix_cache()`` without and with
  ``reset_running_requests``;
- with async scheduling, ``update`` of the plan in flight; with the admission
  gates (the ``gates`` bound), the pause events (pause new / all, with and
  without the cache clear that follows once the engine is idle, resume) and
  grammar reports (compiled or failed) for requests waiting for a grammar.

Equal states are explored once: a canonical fingerprint covers the scheduler's
whole observable state, read through its view (every request's shape,
status, output, computed tokens and block table; the queues; the requests finished
or preempted since the last plan; the KV ref counts, free-queue order, keys
and index order) up to these reductions: request ids are replaced by their
arrival rank, the step counter is dropped, ``num_preemptions`` is kept only as
zero / non-zero, and the PRIORITY waiting list (unordered in the spec) is a
set. docs/modelcheck.md says why these are sound and why renaming block ids
is not.

Checked on every explored transition: every invariant of the catalogue
(evaluated statelessly, see checks.py), the fake model's reads (the context
read through the block tables is the request's tokens) and the KV contents
(every computed slot and every keyed block holds what the state says), and,
unless turned off, ImplScheduler replaying the same transition from the same
state with an equal StepPlan and equal views. Over the whole graph: deadlock
freedom (no state with unfinished requests whose step-only run never drains)
and a liveness bound: with no new arrivals every request finishes within L
steps, where L is the worst case over the reachable graph, reported with its
path.

Nothing here imports torch or vLLM, nor the command line (schedspec/cli/modelcheck.py
is the `schedspec modelcheck` command over ``check_bound``).

The modules, in the manner of TLC's:

- space.py: Shape, Space, Bound, the small / medium / large, modes /
  modes-large and gates bounds;
- model.py: the fake model as the checker runs it (MemoModel);
- events.py: the alphabet (EventCode, Alphabet);
- state.py: the canonical fingerprint of a view, the KV contents it implies;
- checks.py: the invariant catalogue, one transition at a time;
- expand.py: the Expander (one state: every enabled event, every check);
- explore.py: the Explorer (breadth-first levels, the seen set, workers);
- liveness.py: deadlock freedom and the liveness bound;
- coverage.py: what the transitions exercised, as named counters;
- result.py: SpaceResult, BoundResult, Counterexample, the table and JSON;
- run.py: check_bound, over every space of a bound.
"""

from __future__ import annotations

from schedspec.modelcheck.checks import StatelessChecker
from schedspec.modelcheck.coverage import COVERAGE, Coverage
from schedspec.modelcheck.events import RESET, RESET_RUNNING, STEP, Alphabet, EventCode
from schedspec.modelcheck.expand import Entry, Expander, Expansion, Successor, engine_idle
from schedspec.modelcheck.explore import Explorer, StateGraph, cpu_time
from schedspec.modelcheck.liveness import Deadlock, Drained, analyse, drain_distances
from schedspec.modelcheck.result import (
    BoundResult,
    Counterexample,
    Finding,
    SpaceResult,
    format_row,
    table_header,
    write_json,
)
from schedspec.modelcheck.model import MemoModel
from schedspec.modelcheck.run import (
    check_bound,
    default_workers,
    impl_available,
    impl_class,
    impl_problems,
    progress_printer,
)
from schedspec.modelcheck.space import (
    BOUNDS,
    Bound,
    ModelCheckError,
    Shape,
    Space,
    bound,
    generated_tokens,
    select_spaces,
    space_problems,
)
from schedspec.modelcheck.state import Canon, Fingerprint, expected_memory, hidden_gate_state

__all__ = [
    "BOUNDS", "COVERAGE", "RESET", "RESET_RUNNING", "STEP",
    "Alphabet", "Bound", "BoundResult", "Canon", "Counterexample", "Coverage", "Deadlock", "Drained", "Entry",
    "EventCode", "Expander", "Expansion", "Explorer", "Finding", "Fingerprint", "MemoModel", "ModelCheckError",
    "Shape", "Space", "SpaceResult", "StateGraph", "StatelessChecker", "Successor",
    "analyse", "bound", "check_bound", "cpu_time", "default_workers", "drain_distances", "engine_idle",
    "expected_memory", "format_row", "generated_tokens", "hidden_gate_state", "impl_available", "impl_class",
    "impl_problems", "progress_printer", "select_spaces", "space_problems", "table_header", "write_json",
]
