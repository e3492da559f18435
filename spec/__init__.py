"""schedspec's reference: the interface types and the executable spec of vLLM 0.33's v1 scheduler."""

from schedspec.spec.interface import (
    FINISHED_STATUSES,
    LEGAL_TRANSITIONS,
    BlockKey,
    ConfigError,
    KVView,
    Policy,
    ProtocolError,
    RequestError,
    RequestSpec,
    RequestStatus,
    RequestView,
    ScheduledRequest,
    ScheduleKind,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    SchedSpecError,
    StepPlan,
    StepResult,
    SchedulerFactory,
    is_legal_transition,
)

__all__ = [
    "FINISHED_STATUSES",
    "LEGAL_TRANSITIONS",
    "BlockKey",
    "ConfigError",
    "KVView",
    "Policy",
    "ProtocolError",
    "RequestError",
    "RequestSpec",
    "RequestStatus",
    "RequestView",
    "ScheduledRequest",
    "ScheduleKind",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerView",
    "SchedSpecError",
    "StepPlan",
    "StepResult",
    "SchedulerFactory",
    "is_legal_transition",
]

from schedspec.spec.scheduler import SpecScheduler  # noqa: E402

__all__ += ["SpecScheduler"]
