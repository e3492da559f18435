"""mypy --strict stays clean; importing the light layers never pulls a heavy library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "transformers", "matplotlib", "rich", "safetensors", "numpy")


def test_mypy_strict_is_clean() -> None:
    """The whole schedspec namespace (pyproject's [tool.mypy] files), strict."""
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("modules", [
    "schedspec.spec, schedspec.spec.scheduler, schedspec.impl, schedspec.invariants",
    "schedspec.check.workload, schedspec.check.driver, schedspec.check.shrink, schedspec.check.trace,"
    " schedspec.check.report",
    "schedspec.adapters.registry, schedspec.testing, schedspec.cli.main",
    "schedspec.check.features, schedspec.check.config_space, schedspec.check.random_workloads,"
    " schedspec.check.gate_requests, schedspec.check.kv_requests, schedspec.check.defects,"
    " schedspec.check.records, schedspec.check.run, schedspec.check.gate",
    # the vLLM adapter's modules import vLLM only when a scheduler is built (vllm_names)
    "schedspec.adapters.vllm_adapter, schedspec.adapters.vllm_load, schedspec.adapters.vllm_env,"
    " schedspec.adapters.vllm_config, schedspec.adapters.vllm_requests, schedspec.adapters.vllm_views,"
    " schedspec.adapters.vllm_kv",
])
def test_light_layers_do_not_import_heavy_libraries(modules: str) -> None:
    """Run in a fresh interpreter from outside the repository, so only the
    installed ``schedspec`` namespace is importable."""
    code = (
        "import sys\n"
        f"import {modules}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "docs", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_installed_namespace_claims_no_generic_top_level_name() -> None:
    """From outside the checkout, ``spec``, ``impl`` ... are not importable:
    the package installs one top-level name, ``schedspec``."""
    code = (
        "import importlib.util\n"
        "names = ['spec', 'impl', 'invariants', 'gpu_runner', 'harness', 'check', 'adapters', 'cli']\n"
        "print([n for n in names if importlib.util.find_spec(n) is not None])\n"
        "import schedspec.spec, schedspec.impl, schedspec.invariants, schedspec.gpu_runner\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "docs", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_python_dash_m_schedspec_runs_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "schedspec", "invariants"], cwd=ROOT / "docs",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "invariants" in proc.stdout.splitlines()[0]


def test_a_built_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    """Not only the editable install: the wheel itself holds ``schedspec/`` alone
    (spec, impl, invariants and gpu_runner inside it), and imports from a bare
    target directory with the repository out of reach."""
    pytest.importorskip("setuptools")
    import shutil

    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "schedspec-out"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True,
                           timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    import zipfile

    (wheel,) = (tmp_path / "wheel").glob("schedspec-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"schedspec"}
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("spec/scheduler.py", "impl/scheduler.py", "invariants/monitor.py", "gpu_runner/model.py",
                   "check/trace.schema.json", "cli/main.py"):
        assert f"schedspec/{module}" in names, module
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    code = ("import schedspec.spec.scheduler as s, schedspec.impl, schedspec.check.trace\n"
            "print(s.__file__)\n")
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith(str(target))
