"""impl with update()'s result check (``_result_ok``) skipped: unsafe on bad
input, decides the same on good input. Bounds what folding the check into
the apply pass could save (docs/impl.md, "Where the time goes in the draft
modes"):

    PYTHONPATH=.:tools/probes schedspec bench \\
      --against impl,no_result_check:NoResultCheck,vllm --no-memory \\
      --modes sync+spec3,async+spec3 --running 256,1024,4096 --mixed-steps 0 --repeat 2
"""

from __future__ import annotations

from schedspec.impl.request import Request
from schedspec.impl.scheduler import ImplScheduler
from schedspec.spec.interface import StepResult


class NoResultCheck(ImplScheduler):
    """ImplScheduler that trusts every result."""

    def _result_ok(self, result: StepResult, scheduled: list[Request], codes: list[int]) -> bool:
        return True
