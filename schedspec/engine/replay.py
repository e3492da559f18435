"""A captured trace replayed on vLLM 0.32's own scheduler (docs/engine.md).

``schedspec replay T.jsonl --against vllm-0.32`` runs, in the engine's
environment (whose vLLM is the 0.32.0 that recorded the trace), the same
replay as ``--against vllm``: the vLLM adapter drives that environment's
``Scheduler`` / ``AsyncScheduler`` in lockstep with the spec, and each of its
plans is held to the plan the engine recorded. The adapter is written for
0.33; what 0.32 lacks (a field of ``SchedulerOutput``, a ``VllmConfig``
attribute) is not compared, which the two places that read such a field say.

The project's side is :func:`replay_in_engine`; the engine's side is
``python -m schedspec.cli.engine_replay ARGS`` (the replay's own arguments,
``--against vllm``).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Sequence

from schedspec.engine.env import engine_environ, engine_python

#: the ``--against`` name of the engine's own scheduler
AGAINST = "vllm-0.32"


def engine_argv(command_line: Sequence[str]) -> list[str]:
    """The replay's command line with ``--against vllm-0.32`` turned into
    ``--against vllm`` (what the engine's side runs)."""
    out: list[str] = []
    items = list(command_line)
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--against" and i + 1 < len(items) and items[i + 1] == AGAINST:
            out += ["--against", "vllm"]
            i += 2
            continue
        out.append("--against=vllm" if item == f"--against={AGAINST}" else item)
        i += 1
    return out


def replay_in_engine(command_line: Sequence[str], timeout: float = 3600.0) -> int:
    """Run ``schedspec replay`` (``command_line``, from ``replay`` on) in
    the engine's environment against its vLLM 0.32 scheduler; its output
    goes to ours, its exit status is returned (EngineEnvError when the
    environment is missing)."""
    argv = engine_argv(command_line)
    if argv and argv[0] == "replay":
        argv = argv[1:]
    sys.stdout.flush()
    proc = subprocess.run([str(engine_python()), "-m", "schedspec.cli.engine_replay", *argv],
                          timeout=timeout, env=engine_environ())
    return proc.returncode
