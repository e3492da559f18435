"""The errors schedspec raises on purpose. spec/interface.py re-exports them;
import them from there."""

from __future__ import annotations


class SchedSpecError(Exception):
    """Base class of every error schedspec raises on purpose."""


class ConfigError(SchedSpecError, ValueError):
    """A SchedulerConfig field is invalid; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"config.{field_name}: {message}")
        self.field = field_name


class RequestError(SchedSpecError, ValueError):
    """A request cannot be accepted (or named) as given; ``field`` names why."""

    def __init__(self, request_id: str, field_name: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {field_name}: {message}")
        self.request_id = request_id
        self.field = field_name


class ProtocolError(SchedSpecError, RuntimeError):
    """The caller broke the add / schedule / update protocol (e.g. an update
    with a result that does not match the plan). The scheduler is unchanged."""
