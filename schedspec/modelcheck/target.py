"""The scheduler under test: any Scheduler held to the spec on every explored
transition.

The checker explores the spec's reachable states; the scheduler under test
(``--against impl|vllm|MODULE:CLASS``) is carried along with every explored
state and takes every transition the spec takes, from the same state:

- in **lockstep** mode its plans, ``reset_prefix_cache()`` results and views
  must equal the spec's (it is fed the spec's model results, which are its
  own when the plans are equal); the chosen invariants are checked on the
  spec's transitions, which are then its transitions too;
- in **invariants** mode nothing is compared: it runs its own plans through
  its own copy of the fake model (KV memory carried with the state), and the
  chosen invariants, the fake model's reads and the KV contents are checked on
  its own transitions. Its state follows one history per spec state (the path
  the search first took), as in lockstep.

A transition is taken on a copy of the scheduler in the before-state. How a
scheduler is copied is decided once, on a fresh instance, fastest first
(``copy_method``):

- ``clone``: its own ``clone()`` (the spec, impl);
- ``pickle``: a pickle round trip (picklable schedulers without a clone);
- ``deepcopy``: ``copy.deepcopy`` with the objects it only reads (modules,
  classes, functions, configuration objects) shared, not copied: vLLM's
  Scheduler (it does not pickle: its request block hasher is a local
  function). About 0.4 ms a copy on the small bound's states; replaying the
  path from a fresh scheduler costs a fresh build (about 3 ms for vLLM) plus
  about 0.1-0.25 ms per event of the path (12 on average), so a kept state
  copied this way is several times faster. A copy that shared something it
  should have copied would show as a divergence, never as a silent pass;
- ``replay``: a fresh scheduler replays the path to the state, for a
  scheduler that can be copied in none of these ways. The state's own
  instance still takes its last transition, so only the other transitions
  of a state replay.
"""

from __future__ import annotations

import copy
import copyreg
import pickle
import types
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from schedspec.invariants import CATALOGUE, Invariant
from schedspec.spec.interface import Scheduler, SchedulerConfig

Mode = Literal["lockstep", "invariants"]
CopyMethod = Literal["clone", "pickle", "deepcopy", "replay"]
COPY_METHODS: tuple[CopyMethod, ...] = ("clone", "pickle", "deepcopy", "replay")

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


@dataclass(frozen=True)
class Against:
    """The scheduler under test: its name (as ``--against`` spells it), how
    to build one for a config, the mode, the invariants checked (on the
    spec's transitions in lockstep mode, on its own in invariants mode), and
    which admin events it takes."""

    name: str
    factory: Callable[[SchedulerConfig], Scheduler]
    mode: Mode = "lockstep"
    invariants: tuple[Invariant, ...] = CATALOGUE
    #: whether it takes aborts and resets (its declared capabilities): the
    #: spec is then explored without the events it does not take
    aborts: bool = True
    resets: bool = True

    @property
    def lockstep(self) -> bool:
        return self.mode == "lockstep"


#: Modules whose objects a scheduler only reads (vLLM's configuration, its KV
#: cache spec, the structured-output manager, logging and locks): a deepcopy
#: shares them instead of copying them.
SHARED_MODULES: tuple[str, ...] = (
    "vllm.config", "vllm.v1.kv_cache_interface", "vllm.v1.structured_output", "logging", "threading", "_thread",
)


def _is_shared(o: object) -> bool:
    if isinstance(o, types.MethodType):
        # a bound method is shared only where its object is: one bound to
        # the scheduler (an instance attribute wrapping one of its methods,
        # as the vLLM adapter pins finish_requests) is copied with it
        return _is_shared(o.__self__)
    if isinstance(o, types.FunctionType) and o.__closure__:
        # a closure is copied with what it captured (the vLLM adapter wraps
        # the scheduler's finish_requests in one: deep_copy)
        return False
    if isinstance(o, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)):
        return True
    mod = type(o).__module__ or ""
    return mod.startswith(SHARED_MODULES)


def shared_objects(root: object, limit: int = 200_000) -> dict[int, object]:
    """The objects reachable from ``root`` that a deepcopy of it should share
    (see SHARED_MODULES), as a deepcopy memo (id -> the object itself)."""
    shared: dict[int, object] = {}
    seen: set[int] = set()
    stack: list[object] = [root]
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if _is_shared(o):
            shared[id(o)] = o
            continue
        if isinstance(o, types.FunctionType):
            for cell in o.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        else:
            d = getattr(o, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())
            for cls in type(o).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and hasattr(o, slot):
                        stack.append(getattr(o, slot))
    return shared


def _future_copy(f: Future[Any]) -> tuple[Any, ...]:
    """How a deepcopy copies a ``concurrent.futures.Future`` (it holds a lock
    and so has no copy of its own): a new Future in the same state, pending,
    cancelled, failed or done with a copy of its result. vLLM keeps a
    structured-output request's grammar in one while it compiles."""
    if not f.done():
        return (Future, ())
    if f.cancelled():
        return (_cancelled_future, ())
    exc = f.exception()
    if exc is not None:
        return (_failed_future, (exc,))
    return (_done_future, (f.result(),))


def _cancelled_future() -> Future[Any]:
    f: Future[Any] = Future()
    f.cancel()
    return f


def _failed_future(exc: BaseException) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_exception(exc)
    return f


def _done_future(value: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(value)
    return f


def deep_copy(sched: object, shared: dict[int, object]) -> Any:
    """``copy.deepcopy`` with the objects in ``shared`` shared (and each
    Future copied in its state: _future_copy)."""
    if copyreg.dispatch_table.get(Future) is None:
        copyreg.pickle(Future, _future_copy)
    dispatch: Any = getattr(copy, "_deepcopy_dispatch")
    atomic = dispatch[types.FunctionType]
    dispatch[types.FunctionType] = _closure_copy
    try:
        return copy.deepcopy(sched, dict(shared))
    finally:
        dispatch[types.FunctionType] = atomic


def _closure_copy(f: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
    """A function for a deepcopy: a closure gets a new function whose cells
    hold copies of what it captured (a closure over the scheduler copied
    would still call the original's methods), any other function is itself
    (copy's default)."""
    if not f.__closure__:
        return f
    cells = []
    for cell in f.__closure__:
        try:
            cells.append(types.CellType(copy.deepcopy(cell.cell_contents, memo)))
        except ValueError:  # an empty cell
            cells.append(cell)
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, tuple(cells))
    g.__kwdefaults__ = f.__kwdefaults__
    g.__dict__.update(f.__dict__)
    memo[id(f)] = g
    return g


def copy_method(sched: object) -> CopyMethod:
    """How to copy ``sched`` (a fresh instance), fastest first: its clone(), a
    pickle round trip, a deepcopy sharing what it only reads, else replay."""
    if callable(getattr(sched, "clone", None)):
        return "clone"
    try:
        pickle.loads(pickle.dumps(sched, PICKLE_PROTOCOL))
        return "pickle"
    except Exception:
        pass
    try:
        deep_copy(sched, shared_objects(sched))
        return "deepcopy"
    except Exception:
        return "replay"


def travels(method: CopyMethod) -> bool:
    """Whether a scheduler copied this way can travel to a worker process
    (a replayed one travels as its path)."""
    return method != "deepcopy"
