"""Size limits that keep the engine layers and impl readable in one sitting.

- no module of ``schedspec/check`` or ``schedspec/adapters`` over 800 lines
  (one concern per module; the event language, each generator, the run's
  endings and the vLLM adapter's concerns live apart);
- no file of ``impl/`` over 1,000 lines and no function there over 120;
- no function of ``spec/`` over 60 lines (the spec reads in one sitting).

Each walk is a plain function over a folder, shown catching an oversized
file or function on a synthetic tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def long_modules(folder: Path, limit: int) -> list[str]:
    """Every ``*.py`` of ``folder`` (not recursive) longer than ``limit`` lines."""
    out = []
    for path in sorted(folder.glob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(folder.parent)}: {n} lines")
    return out


def long_functions(folder: Path, limit: int) -> list[str]:
    """Every function or method of ``folder``'s modules longer than ``limit`` lines."""
    out = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    out.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_no_module_of_check_or_adapters_over_800_lines() -> None:
    for package in ("check", "adapters"):
        folder = ROOT / "schedspec" / package
        assert (folder / "__init__.py").is_file()
        assert long_modules(folder, 800) == [], package


def test_impl_files_and_functions_stay_short() -> None:
    folder = ROOT / "impl"
    assert (folder / "scheduler.py").is_file()
    assert long_modules(folder, 1000) == []
    assert long_functions(folder, 120) == []


def test_no_function_in_spec_is_over_60_lines() -> None:
    folder = ROOT / "spec"
    assert (folder / "scheduler.py").is_file()
    assert long_functions(folder, 60) == []


def test_the_walks_see_what_is_too_long(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "short.py").write_text("x = 1\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(12))
    (pkg / "long.py").write_text(f"def f():\n{body}\n")
    assert long_modules(pkg, 12) == ["pkg/long.py: 13 lines"]
    assert long_modules(pkg, 13) == []
    assert long_functions(pkg, 12) == ["long.py:1 f (13 lines)"]
    assert long_functions(pkg, 13) == []
    # nested functions are walked too
    inner = "\n".join(f"        x{i} = {i}" for i in range(60))
    (pkg / "nested.py").write_text(f"def outer() -> None:\n    def inner() -> None:\n{inner}\n")
    assert [s.split(" ")[1] for s in long_functions(pkg, 60) if s.startswith("nested.py")] == ["outer", "inner"]
