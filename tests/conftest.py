"""The project's own Hypothesis profiles (schedspec.testing registers none).

``ci`` (quick, derandomized), ``deep`` (long runs), ``dev`` (short, local) for
the state machine; ``impl-ci`` / ``impl-deep`` for the spec-versus-impl
lockstep test. HYPOTHESIS_PROFILE picks ci or deep (test modules load it).

Hypothesis also draws constants found in the project's modules that are loaded
when a test runs (its "local constants"), so a derandomized test would draw
differently after another test in the same process imported more of the
project (a CLI test before a state machine on one xdist worker). The pool is
pinned here to its content when pytest loads this file, so a derandomized test draws the same
whatever ran before it.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def _pin_local_constants() -> None:
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a Hypothesis without the pool
        return
    if not callable(getattr(providers, "_get_local_constants", None)):  # pragma: no cover
        return
    pool = providers._get_local_constants()
    providers._get_local_constants = lambda: pool


_pin_local_constants()

settings.register_profile(
    "ci",
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "deep",
    max_examples=1_000_000,
    stateful_step_count=400,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "impl-ci",
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
settings.register_profile(
    "impl-deep",
    max_examples=1_000_000,
    stateful_step_count=400,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
