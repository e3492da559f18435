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
        self.message = message


class RequestError(SchedSpecError, ValueError):
    """A request cannot be accepted (or named) as given; ``field`` names why."""

    def __init__(self, request_id: str, field_name: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {field_name}: {message}")
        self.request_id = request_id
        self.field = field_name


class ProtocolError(SchedSpecError, RuntimeError):
    """The caller broke the add / schedule / update protocol (e.g. an update
    with a result that does not match the plan). The scheduler is unchanged.

    ``step`` is the plan's step number where the error concerns one plan, and
    ``field`` names the offending part of the call (e.g. ``"sampled"``,
    ``"draft_token_ids"``, ``"plan"``); both are None when not applicable."""

    def __init__(self, message: str, *, step: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.field = field
