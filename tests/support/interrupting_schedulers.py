"""A scheduler whose N-th construction raises the Interrupted a SIGTERM raises
under ``deadline.interruptible`` (for the equivalence matrix's interruption
tests: the matrix builds one scheduler per run of a workload and variant)."""

from __future__ import annotations

import os
import signal

from schedspec.check.deadline import Interrupted
from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler


class TermAtBuild(SpecScheduler):
    """The spec; its ``SCHEDSPEC_TEST_TERM_AT``-th construction (default 20) is interrupted."""

    built = 0

    def __init__(self, config: SchedulerConfig) -> None:
        TermAtBuild.built += 1
        if TermAtBuild.built == int(os.environ.get("SCHEDSPEC_TEST_TERM_AT", "20")):
            raise Interrupted(signal.SIGTERM)
        super().__init__(config)
