"""schedspec.check.

``KV_REPORT_BOUND``: the KV connector worker's bounded wait (steps), see
schedspec.check.workload.
"""

from schedspec.check.workload import KV_REPORT_BOUND as KV_REPORT_BOUND

__all__ = ["KV_REPORT_BOUND"]
