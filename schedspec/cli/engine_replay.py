"""The engine's side of ``schedspec replay --against vllm-0.32``
(schedspec/engine/replay.py): run inside the engine's environment, the
replay against that environment's vLLM (0.32.0, the version that recorded
the trace) instead of the project's 0.33.0."""

from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from schedspec.adapters import vllm_env
    from schedspec.cli.main import main as cli_main
    from schedspec.engine.env import ENGINE_VLLM_VERSION

    vllm_env.accept_version(ENGINE_VLLM_VERSION)
    vllm_env.prepare()
    # an async trace replays on 0.32's AsyncScheduler, which its CPU platform
    # would turn off (as in the engine that recorded it: engine/build.py)
    from schedspec.engine.build import keep_async_scheduling

    keep_async_scheduling()
    print(f"the scheduler: vLLM {ENGINE_VLLM_VERSION}'s, in the engine's environment ({sys.prefix})", flush=True)
    return cli_main(["replay", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
