"""What the engine tests share: the engine environment or a skip (a failure under
SCHEDSPEC_REQUIRE_ENGINE=1, as CI sets it)."""

from __future__ import annotations

import os

import pytest

from schedspec.engine.env import EngineEnvError, engine_python

REQUIRE_ENGINE = os.environ.get("SCHEDSPEC_REQUIRE_ENGINE") == "1"


def engine_or_skip() -> None:
    try:
        engine_python()
    except EngineEnvError as exc:
        if REQUIRE_ENGINE:
            pytest.fail(f"SCHEDSPEC_REQUIRE_ENGINE=1 but {exc}")
        pytest.skip(f"{exc} (set SCHEDSPEC_REQUIRE_ENGINE=1 to fail instead of skipping)")
