"""The layering of schedspec, walked import by import.

Layers, imports running down only (the README's "Layout" section):

    spec < {invariants, impl} < check < adapters < {testing, modelcheck, gpu_runner, bench, engine} < cli

Every ``import`` and ``from ... import`` in every module of the ``schedspec``
namespace is read with ``ast``, function bodies included, and so is every
``importlib.import_module("...")`` with a literal name. The walk fails on

- an import of a higher layer, or of a peer package in the same layer (unless
  the pair is listed in ``PEERS``);
- a cycle among modules (however deep, however hidden in function bodies);
- a module reading another module's private (``_underscore``) name, by
  ``from m import _x`` or by ``m._x`` on an imported module;
- a module importing a private module (``_x``) of another package, or any
  name from one, public or not;
- a generic top-level name (``spec``, ``impl``, ``harness`` ...): installed,
  everything lives under ``schedspec``.

The checker is a plain function over a folder, so the tests at the bottom run
it on small synthetic trees that rebuild each cycle the project once had, and
show that each one is reported.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package (second component of the module name) -> rank; lower may not import higher.
RANK: dict[str, int] = {
    "spec": 0,
    "invariants": 1,
    "impl": 1,
    "check": 2,
    "adapters": 3,
    "testing": 4,
    "modelcheck": 4,
    "gpu_runner": 4,
    "bench": 4,
    "engine": 4,
    "cli": 5,
    "__main__": 6,
}
#: the root package's own __init__ imports nothing of the project.
ROOT_RANK = -1
#: same-rank imports that are allowed: (importer package, imported package).
PEERS: frozenset[tuple[str, str]] = frozenset({("bench", "modelcheck")})
#: impl is written apart from the spec's logic (N-version): of spec it may use
#: only the interface types and the shared protocol boundary.
IMPL_MAY_USE = frozenset({"schedspec.spec.interface", "schedspec.spec.errors", "schedspec.spec.protocol",
                          "schedspec.spec.validate", "schedspec.spec.stats"})
#: private attributes of a third party's objects that a module must read, with why.
FOREIGN_PRIVATE: dict[tuple[str, str], str] = {
    ("schedspec.adapters.vllm_views", "_cache"):
        "vLLM 0.33's BlockPool keeps its prefix-cache index (BlockHashToBlockMap) in a private dict;"
        " the adapter reads it to report the KV view",
    ("schedspec.engine.recorder", "_cache"):
        "vLLM 0.32's BlockPool keeps the same index the same way; the online monitor reads it for its KV view",
}
#: names that must never be imported at top level from project code.
GENERIC = frozenset({"spec", "impl", "invariants", "harness", "gpu_runner", "check", "adapters",
                     "testing", "modelcheck", "bench", "cli", "benchmarks"})


@dataclass
class Walk:
    modules: dict[str, Path] = field(default_factory=dict)
    packages: set[str] = field(default_factory=set)
    #: (importer, imported module, line)
    edges: list[tuple[str, str, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def module_files(top: Path, name: str = "schedspec") -> dict[str, Path]:
    """Every module of the package at ``top`` (symlinked subpackages followed)."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        rel = Path(dirpath).relative_to(top)
        if not (Path(dirpath) / "__init__.py").exists():
            dirnames[:] = []
            continue
        prefix = ".".join((name, *rel.parts))
        for f in sorted(filenames):
            if f.endswith(".py"):
                out[prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"] = Path(dirpath) / f
    return out


def _resolve(modules: dict[str, Path], importer: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not modules[importer].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def walk(top: Path, name: str = "schedspec") -> Walk:
    """Read every import of every module of the package at ``top``."""
    w = Walk(modules=module_files(top, name))
    w.packages = {m for m, p in w.modules.items() if p.name == "__init__.py"}
    for mod, path in w.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        module_aliases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    _note(w, mod, alias.name, node.lineno)
                    if alias.name.split(".")[0] == name:
                        module_aliases.add(alias.asname or alias.name.split(".")[0])
                    if _foreign_private_module(mod, alias.name, name):
                        w.problems.append(f"{mod}:{node.lineno} imports the private module {alias.name}")
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(w.modules, mod, node)
                if target == "__future__":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in w.modules:  # ``from pkg import submodule``
                        _note(w, mod, sub, node.lineno)
                        module_aliases.add(alias.asname or alias.name)
                        if _foreign_private_module(mod, sub, name):
                            w.problems.append(f"{mod}:{node.lineno} imports the private module {sub}")
                    else:
                        _note(w, mod, target, node.lineno)
                        if _private(alias.name) and target.split(".")[0] == name and target != mod:
                            w.problems.append(f"{mod}:{node.lineno} reads the private name {alias.name} of {target}")
                        elif _foreign_private_module(mod, target, name):
                            w.problems.append(f"{mod}:{node.lineno} imports {alias.name} from the private module"
                                              f" {target}")
            elif isinstance(node, ast.Call) and _is_import_module(node):
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    _note(w, mod, arg.value, node.lineno)
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in module_aliases:
                w.problems.append(f"{mod}:{node.lineno} reads the private name {node.attr} of {node.value.id}")
            elif (node.attr not in own and (mod, node.attr) not in FOREIGN_PRIVATE
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                w.problems.append(f"{mod}:{node.lineno} reads the private attribute {node.attr} of an object"
                                  " another module defines")
    return w


def _own_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines itself (its functions, classes,
    globals and the attributes it assigns): reading those is its own business."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            own.add(node.value)  # __slots__ entries
    return {n for n in own if _private(n)}


def _foreign_private_module(importer: str, target: str, name: str = "schedspec") -> bool:
    """Whether ``target`` is a private module (a ``_x`` part below the root)
    of a package other than ``importer``'s: its names, public or not, are
    that package's own business (a name another package needs is made public
    in a public module)."""
    parts = target.split(".")
    if parts[0] != name or len(parts) < 3 or not any(_private(p) for p in parts[1:]):
        return False
    return layer(target)[0] != layer(importer)[0]


def _private(attr: str) -> bool:
    """``_x`` and ``__x``; not dunders, nor sunders (``_value_``: enum's public API)."""
    return attr.startswith("_") and not attr.endswith("_")


def _is_import_module(node: ast.Call) -> bool:
    f = node.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module")
    return named and len(node.args) >= 1


def _note(w: Walk, importer: str, target: str, line: int) -> None:
    top = target.split(".")[0]
    if top in GENERIC:
        w.problems.append(f"{importer}:{line} imports the generic top-level name {target!r}")
        return
    if not target.startswith(importer.split(".")[0] + "."):
        return
    # the module itself, or the package whose __init__ defines the name
    while target not in w.modules and "." in target:
        target = target.rsplit(".", 1)[0]
    if target in w.modules and target != importer:
        w.edges.append((importer, target, line))


def layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    if len(parts) == 1:
        return ("", ROOT_RANK)
    return (parts[1], RANK.get(parts[1], ROOT_RANK))


def upward_imports(w: Walk) -> list[str]:
    out = []
    for importer, target, line in w.edges:
        (pa, ra), (pb, rb) = layer(importer), layer(target)
        if pa == pb:
            continue
        if pa == "impl" and pb == "spec" and target not in IMPL_MAY_USE:
            out.append(f"{importer}:{line} imports {target} (impl uses the spec's types and boundary only)")
            continue
        if rb > ra or (rb == ra and (pa, pb) not in PEERS):
            out.append(f"{importer}:{line} imports {target} ({pa or 'root'} may not use {pb or 'root'})")
    return out


def cycles(w: Walk) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in w.modules}
    for a, b, _ in w.edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for nxt in sorted(graph[v]):
            if nxt not in index:
                strong(nxt)
                low[v] = min(low[v], low[nxt])
            elif nxt in on:
                low[v] = min(low[v], index[nxt])
        if low[v] == index[v]:
            comp = []
            while True:
                x = stack.pop()
                on.discard(x)
                comp.append(x)
                if x == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def report(w: Walk) -> list[str]:
    return upward_imports(w) + [f"import cycle: {' <-> '.join(c)}" for c in cycles(w)] + w.problems


# ------------------------------------------------------------------ the project itself


def test_the_namespace_has_every_layer() -> None:
    w = walk(ROOT / "schedspec")
    packages = {m.split(".")[1] for m in w.modules if m.count(".") >= 1}
    assert {"spec", "impl", "invariants", "check", "adapters", "testing", "modelcheck", "gpu_runner",
            "bench", "cli"} <= packages
    assert len(w.edges) > 100  # the walk really reads the imports


def test_imports_run_down_the_layers_with_no_cycle_and_no_private_reach() -> None:
    problems = report(walk(ROOT / "schedspec"))
    assert not problems, "\n".join(problems)


def test_project_code_never_imports_a_generic_top_level_name() -> None:
    """Tests and tools too: ``import spec`` from the repository root would load a
    second copy of the spec beside ``schedspec.spec``."""
    problems = []
    for folder in ("tests", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                         else [])
                for n in names:
                    if n.split(".")[0] in GENERIC - {"tests", "tools"}:
                        problems.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {n}")
    assert not problems, "\n".join(problems)


def test_light_layers_name_no_heavy_library_at_module_level() -> None:
    """spec, impl, invariants and check import torch, vLLM, matplotlib or rich
    only inside functions (behind optional extras)."""
    heavy = {"torch", "vllm", "matplotlib", "rich", "transformers", "safetensors", "numpy"}
    w = walk(ROOT / "schedspec")
    problems = []
    for mod, path in w.modules.items():
        if layer(mod)[0] not in ("spec", "impl", "invariants", "check"):
            continue
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            problems += [f"{mod}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in heavy]
    assert not problems, problems


# ------------------------------------------------------------------ the checker fails where it must

# Each case rebuilds, in a tiny tree, an import the project once had
# (REVIEW-architecture.md, "Dependency direction"), and names what must be reported.
HISTORY = {
    "the benchmark inside impl imported the adapters": (
        {"impl/bench.py": "def main():\n    from schedspec.adapters.registry import resolve\n",
         "adapters/registry.py": "def resolve(): pass\n"},
        "schedspec.impl.bench:2 imports schedspec.adapters.registry (impl may not use adapters)"),
    "the benchmark inside impl imported the spec's scheduler": (
        {"impl/bench.py": "def f():\n    from schedspec.spec.scheduler import SpecScheduler\n",
         "spec/scheduler.py": "class SpecScheduler: pass\n"},
        "schedspec.impl.bench:2 imports schedspec.spec.scheduler (impl uses the spec's types and boundary"),
    "the CLI and the model checker imported each other": (
        {"cli/main.py": "def run():\n    from schedspec.modelcheck import run_command\n",
         "modelcheck/__init__.py": "def run_command():\n    from schedspec.cli.main import UsageError\n"},
        "schedspec.modelcheck:2 imports schedspec.cli.main (modelcheck may not use cli)"),
    "the CLI/model-checker file cycle": (
        {"cli/main.py": "def run():\n    from schedspec.modelcheck import run_command\n",
         "modelcheck/__init__.py": "def run_command():\n    from schedspec.cli.main import UsageError\n"},
        "import cycle: schedspec.cli.main <-> schedspec.modelcheck"),
    "the engine imported the runner's CLI by name": (
        {"check/driver.py": "import importlib\ndef f():\n    importlib.import_module('schedspec.cli.equivalence')\n",
         "cli/equivalence.py": ""},
        "schedspec.check.driver:3 imports schedspec.cli.equivalence (check may not use cli)"),
    "the runner read the report's private PNG writer": (
        {"gpu_runner/equivalence.py": "from schedspec.check.report import _png, _text\n",
         "check/report.py": "def _png(): pass\ndef _text(): pass\n"},
        "schedspec.gpu_runner.equivalence:1 reads the private name _png of schedspec.check.report"),
    "the model checker read the spec's private request class": (
        {"modelcheck/state.py": "from schedspec.spec.scheduler import SpecScheduler, _Request\n",
         "spec/scheduler.py": "class SpecScheduler: pass\nclass _Request: pass\n"},
        "schedspec.modelcheck.state:1 reads the private name _Request of schedspec.spec.scheduler"),
    "the benchmark read the adapter's private fields through a module": (
        {"bench/scheduler.py": "from schedspec.adapters import vllm_adapter\nx = vllm_adapter._block_hasher\n",
         "adapters/vllm_adapter.py": "_block_hasher = 1\n"},
        "schedspec.bench.scheduler:2 reads the private name _block_hasher of vllm_adapter"),
    "the benchmark read the adapter's private fields on its object": (
        {"bench/scheduler.py": "def time_vllm(adapter):\n    return adapter._v, adapter.sched\n",
         "adapters/vllm_adapter.py": "class VllmScheduler:\n    def __init__(self):\n        self._v = 1\n"},
        "schedspec.bench.scheduler:2 reads the private attribute _v of an object another module defines"),
    "the model checker imported a public name from the invariants' private module": (
        {"modelcheck/expand.py": "from schedspec.invariants._util import next_invalid_blocks\n",
         "invariants/_util.py": "def next_invalid_blocks(): pass\n"},
        "schedspec.modelcheck.expand:1 imports next_invalid_blocks from the private module schedspec.invariants._util"),
    "a module imported another package's private module": (
        {"modelcheck/expand.py": "def f():\n    from schedspec.invariants import _util\n    return _util.x\n",
         "invariants/_util.py": "x = 1\n"},
        "schedspec.modelcheck.expand:2 imports the private module schedspec.invariants._util"),
    "a module imported another package's private module by name": (
        {"check/driver.py": "import schedspec.invariants._util\n", "invariants/_util.py": ""},
        "schedspec.check.driver:1 imports the private module schedspec.invariants._util"),
    "a module imported a generic top-level name": (
        {"check/driver.py": "from spec.interface import StepPlan\n"},
        "schedspec.check.driver:1 imports the generic top-level name 'spec.interface'"),
    "impl and harness imported each other (package cycle)": (
        {"impl/scheduler.py": "def f():\n    from schedspec.check import driver\n",
         "check/driver.py": "from schedspec.impl import scheduler\n"},
        "schedspec.impl.scheduler:2 imports schedspec.check.driver (impl may not use check)"),
    "two peers of one layer": (
        {"impl/scheduler.py": "from schedspec.invariants import core\n", "invariants/core.py": ""},
        "schedspec.impl.scheduler:1 imports schedspec.invariants.core (impl may not use invariants)"),
}


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    top = tmp / "schedspec"
    for rel, text in {"__init__.py": "", **files}.items():
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(top).parents:
            (top / parent / "__init__.py").touch()
        path.write_text(text)
    return top


@pytest.mark.parametrize("case", sorted(HISTORY))
def test_the_checker_reports_each_import_the_project_once_had(tmp_path: Path, case: str) -> None:
    files, expected = HISTORY[case]
    problems = report(walk(_tree(tmp_path, files)))
    assert any(p.startswith(expected) for p in problems), problems


def test_the_checker_accepts_downward_imports_and_allowed_peers(tmp_path: Path) -> None:
    top = _tree(tmp_path, {
        "spec/interface.py": "",
        "spec/scheduler.py": "from schedspec.spec.interface import *\n",
        "impl/scheduler.py": "from schedspec.spec import interface\n",
        "check/driver.py": "def f():\n    from schedspec.impl import scheduler\n",
        "cli/main.py": "import schedspec.check.driver as d\nd.public\n",
        "bench/costs.py": "from schedspec.modelcheck import explore\n",
        "modelcheck/explore.py": "",
        # a package's own private module is its own business
        "invariants/_util.py": "def helper(): pass\n",
        "invariants/core.py": "from schedspec.invariants._util import helper\n",
    })
    assert report(walk(top)) == []


def test_a_cycle_inside_one_package_is_reported(tmp_path: Path) -> None:
    top = _tree(tmp_path, {
        "check/a.py": "def f():\n    from schedspec.check import b\n",
        "check/b.py": "from schedspec.check.c import x\n",
        "check/c.py": "import schedspec.check.a\nx = 1\n",
    })
    assert report(walk(top)) == ["import cycle: schedspec.check.a <-> schedspec.check.b <-> schedspec.check.c"]
