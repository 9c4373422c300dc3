"""One table of the run's reasons (`models.Reason`): what each one means for events and metrics.

Every reason says its severity (the type of the events it is emitted with: a Warning is something going
wrong) and whether it is a failure, and of what: an attempt (the next one may succeed) or the run. The
lifecycle's Warning events, the operator's `grpo_operator_failures_total` and `grpo_operator_run_failures_total`
and the executors' conditions all read this table, so a reason cannot be a Warning in one place and go
uncounted in another; importing this module fails when a reason is missing from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpo_api.models import Reason


@dataclass(frozen=True)
class ReasonInfo:
    #: The type of the events emitted with it.
    severity: Literal["Normal", "Warning"]
    #: What it counts as a failure of (metrics): an attempt, the run, or nothing.
    fails: Literal["attempt", "run"] | None = None


_NORMAL = ReasonInfo("Normal")
_WARNING = ReasonInfo("Warning")

REASONS: dict[Reason, ReasonInfo] = {
    Reason.CREATED: _NORMAL,
    Reason.FETCHING_SOURCES: _NORMAL,
    Reason.SOURCES_READY: _NORMAL,
    Reason.SOURCE_UNAVAILABLE: ReasonInfo("Warning", "run"),
    Reason.WAITING_FOR_OLD_SERVER: _NORMAL,
    Reason.SERVER_STARTING: _NORMAL,
    Reason.SERVER_READY: _NORMAL,
    Reason.SERVER_NOT_READY: ReasonInfo("Warning", "attempt"),
    Reason.TRAINER_RUNNING: _NORMAL,
    Reason.TRAINER_FAILED: ReasonInfo("Warning", "attempt"),
    # The failure it follows was counted under its own reason.
    Reason.RETRYING: _WARNING,
    Reason.BACKOFF_LIMIT_EXCEEDED: ReasonInfo("Warning", "run"),
    Reason.DEADLINE_EXCEEDED: ReasonInfo("Warning", "run"),
    Reason.SUSPENDED: _NORMAL,
    Reason.RESUMED: _NORMAL,
    Reason.COMPLETED: _NORMAL,
    Reason.INVALID_SPEC: ReasonInfo("Warning", "run"),
    Reason.CHILD_REJECTED: ReasonInfo("Warning", "run"),
    Reason.CHILD_CONFLICT: ReasonInfo("Warning", "run"),
    Reason.CHILD_DELETED: ReasonInfo("Warning", "attempt"),
    # Repaired or waited for: trouble worth a Warning, not a failure.
    Reason.CHILD_RESTORED: _WARNING,
    Reason.WAITING_FOR_OLD_CHILDREN: _WARNING,
    Reason.RECONCILE_ERROR: _WARNING,
    Reason.RECONCILED: _NORMAL,
    # The attempt goes on (the kubelet may restart the server); it fails as ServerNotReady or TrainerFailed.
    Reason.SERVER_UNHEALTHY: _WARNING,
    # A disruption from outside, not the run's fault: the next attempt does not count against backoffLimit
    # (one past runPolicy.preemptionLimit is counted as TrainerFailed).
    Reason.PREEMPTED: _WARNING,
    Reason.EXPORTING: _NORMAL,
    Reason.EXPORT_FAILED: ReasonInfo("Warning", "run"),
    Reason.QUEUED: _NORMAL,
    # Waited for: the label names an object that does not exist (yet).
    Reason.QUEUE_NOT_FOUND: _WARNING,
    Reason.PRIORITY_CLASS_NOT_FOUND: _WARNING,
    Reason.ADMITTED: _NORMAL,
    # Not the run's fault: no failed attempt (one past runPolicy.preemptionLimit is counted as TrainerFailed).
    Reason.EVICTED: _WARNING,
}

_missing = set(Reason) - set(REASONS)
if _missing:
    raise RuntimeError(f"grpo_api.reasons.REASONS lacks {sorted(_missing)}: say what each one means")

#: Reasons that describe something going wrong: their events are Warnings.
WARNING_REASONS: frozenset[Reason] = frozenset(r for r, info in REASONS.items() if info.severity == "Warning")
#: Reasons that count as a failed attempt or a failed run (grpo_operator_failures_total).
FAILURE_REASONS: frozenset[Reason] = frozenset(r for r, info in REASONS.items() if info.fails is not None)
