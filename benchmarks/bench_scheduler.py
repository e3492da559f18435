"""Scheduler speed, side by side (impl, spec and vLLM when importable).

    python benchmarks/bench_scheduler.py [--against impl,spec,vllm]
        [--running 256,1024,4096] [--steps 200] [--mixed-steps 400] [--json FILE] [--quick]

Same as `schedspec bench`; the code lives in impl/bench.py (run_bench).
"""

from __future__ import annotations

import sys

from impl.bench import main

if __name__ == "__main__":
    sys.exit(main())
