"""The fast scheduler: spec.interface.Scheduler with the spec's exact
observable behaviour, built on its own data structures (see docs/impl.md)."""

from schedspec.impl.scheduler import ImplScheduler

__all__ = ["ImplScheduler"]
