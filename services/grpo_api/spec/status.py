"""The observed state of a run, written by the controller only: phase, reasons, conditions and progress."""

from __future__ import annotations

import datetime as dt
import math
from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from grpo_api.spec.api import ApiModel


class Phase(StrEnum):
    PENDING = "Pending"
    INITIALIZING = "Initializing"
    STARTING_SERVER = "StartingServer"
    TRAINING = "Training"
    #: The trainer finished; the export step uploads the result to spec.output.
    EXPORTING = "Exporting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class Reason(StrEnum):
    """Machine-readable reasons, a fixed set (used in status.reason and conditions)."""

    CREATED = "Created"
    FETCHING_SOURCES = "FetchingSources"
    SOURCES_READY = "SourcesReady"
    SOURCE_UNAVAILABLE = "SourceUnavailable"
    WAITING_FOR_OLD_SERVER = "WaitingForOldServer"
    SERVER_STARTING = "ServerStarting"
    SERVER_READY = "HealthCheckPassed"
    SERVER_NOT_READY = "ServerNotReady"
    TRAINER_RUNNING = "TrainerRunning"
    TRAINER_FAILED = "TrainerFailed"
    RETRYING = "Retrying"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    COMPLETED = "Completed"
    INVALID_SPEC = "InvalidSpec"
    #: A child object the run needs was refused by the API server (a value no admission rule caught,
    #: a quota, a webhook of the cluster): no retry fixes it.
    CHILD_REJECTED = "ChildRejected"
    #: A child's name is taken by an object this run does not own (not one of a dying earlier run).
    CHILD_CONFLICT = "ChildConflict"
    #: A child that carries the attempt's state (token Secret, run-config) was deleted mid-attempt.
    CHILD_DELETED = "ChildDeleted"
    #: A child the run needs was deleted mid-attempt and has been created again.
    CHILD_RESTORED = "ChildRestored"
    #: The children of an earlier run of the same name are still being deleted.
    WAITING_FOR_OLD_CHILDREN = "WaitingForOldChildren"
    #: A reconcile failed unexpectedly; it is retried with backoff.
    RECONCILE_ERROR = "ReconcileError"
    RECONCILED = "Reconciled"
    #: The server stopped answering its health check mid-attempt for longer than the grace period.
    SERVER_UNHEALTHY = "ServerUnhealthy"
    #: A trainer pod was preempted or evicted (pod condition DisruptionTarget): the next attempt starts
    #: without counting against backoffLimit.
    PREEMPTED = "Preempted"
    #: The trainer finished and the export step is uploading the result (spec.output).
    EXPORTING = "Exporting"
    #: The export step failed (its words in the message): the run fails, the adapters stay on its volume.
    EXPORT_FAILED = "ExportFailed"
    #: A run Kueue queues (label kueue.x-k8s.io/queue-name) waits, suspended, for Kueue to admit it.
    QUEUED = "Queued"
    #: The LocalQueue its kueue.x-k8s.io/queue-name label names does not exist (yet): the run waits for it.
    QUEUE_NOT_FOUND = "QueueNotFound"
    #: The WorkloadPriorityClass its kueue.x-k8s.io/priority-class label names does not exist (yet): the run waits.
    PRIORITY_CLASS_NOT_FOUND = "PriorityClassNotFound"
    #: Kueue admitted the run: its server and trainer may start.
    ADMITTED = "Admitted"
    #: Kueue took the run's admission back (preempted by a run of higher priority, its queue stopped): the run is
    #: suspended, its checkpoint kept, and resumes when Kueue admits it again; not a failed attempt.
    EVICTED = "Evicted"


class ConditionType(StrEnum):
    SOURCES_READY = "SourcesReady"
    SERVER_READY = "ServerReady"
    TRAINER_RUNNING = "TrainerRunning"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    #: The operator could carry out its last decision (present once a reconcile first failed or waited).
    RECONCILED = "Reconciled"


class Condition(ApiModel):
    """A metav1.Condition."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Condition type, e.g. ServerReady.", max_length=316)
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason of the last transition.", max_length=1024)
    message: str = Field(default="", description="Human-readable detail.", max_length=32768)
    last_transition_time: dt.datetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(default=None, description="Spec generation the condition reflects.")


class ServerStatus(ApiModel):
    """What the operator last saw of the attempt's server."""

    boot_id: str | None = Field(default=None, description="Boot id of the server that passed the health gate.")
    boot_ids: list[str] = Field(
        default_factory=list, max_length=64,
        description="Boot ids of every replica seen in this attempt (the first passed the gate with the "
        "others); a replica whose boot id is not here restarted.",
    )
    ready: bool = Field(
        default=False, description="Every replica of the attempt's server answers its health check."
    )
    ready_replicas: int = Field(default=0, ge=0, description="Replicas that answered their health check last.")
    url: str | None = Field(default=None, description="In-cluster URL of the server.")
    message: str | None = Field(
        default=None,
        description="Trouble with the attempt's server pod, if any (Unschedulable, ImagePullBackOff, "
        "CrashLoopBackOff, a non-zero exit), as the operator last saw it.",
    )
    unhealthy_since: dt.datetime | None = Field(
        default=None,
        description="Since when the server of the running attempt has failed its health check; ready turns "
        "false once that lasts longer than the grace period.",
    )


class SourcesStatus(ApiModel):
    """The sources as the initializer left them: fetched once per run, before the first server."""

    ready: bool = Field(default=False, description="The sources were fetched and checked.")
    progress: str | None = Field(
        default=None, description="The initializer's latest progress line (files and bytes fetched).",
        max_length=1024,
    )
    completed_at: dt.datetime | None = Field(default=None, description="When the initializer succeeded.")


class AdapterStatus(ApiModel):
    """The latest adapter the trainer published."""

    version: int | None = Field(default=None, description="Adapter version N (directory v<N>).")
    path: str | None = Field(default=None, description="Adapter directory on the volume.")
    loaded_at: dt.datetime | None = Field(default=None, description="When the server loaded it.")


#: Significant digits of status.progress.rewardMean.
REWARD_DIGITS = 4


def round_reward(value: float) -> float:
    """value to REWARD_DIGITS significant digits (0.8234567 -> 0.8235, 1234.5678 -> 1235.0)."""
    return float(f"{value:.{REWARD_DIGITS}g}") if math.isfinite(value) else value


class LaggingReplicaStatus(ApiModel):
    """A server replica the trainer gives no work: it does not serve the trainer's current policy version."""

    url: str = Field(description="The replica's address.", max_length=1024)
    since: dt.datetime = Field(description="Since when it has not served the current version.")
    reason: str = Field(default="", description="Why, as the trainer last saw it.", max_length=1024)


class ProgressStatus(ApiModel):
    """Training progress as the trainer reports it."""

    model_config = ConfigDict(allow_inf_nan=True)  # a diverged run's reward is reported as it is

    step: int = Field(default=0, description="Optimizer steps completed.")
    max_steps: int = Field(default=0, description="Optimizer steps to train.")
    reward_mean: float | None = Field(
        default=None,
        description=f"Mean total reward of the latest step, to {REWARD_DIGITS} significant digits (the "
        "Reward column of kubectl get; the trainer's metrics keep every digit).",
    )
    lagging_replicas: list[LaggingReplicaStatus] = Field(
        default_factory=list, max_length=64,
        description="Server replicas that lag (hung, unreachable, restarted, or behind the trainer's current "
        "policy version), with since when: they get no work until they serve the current version and are "
        "caught up in the background (grpo_trainer_server_replica_lagging_since_seconds).",
    )

    @field_validator("reward_mean")
    @classmethod
    def _short(cls, value: float | None) -> float | None:
        """kubectl prints a number column with every digit it has: keep the status short."""
        return None if value is None else round_reward(value)


class OutputStatus(ApiModel):
    """Where the export step put the run's result (spec.output), as it reported it."""

    uri: str | None = Field(
        default=None, max_length=2048,
        description="Where the result went (for oci://, pinned by the manifest's digest; for hf://, the commit).",
    )
    form: str | None = Field(default=None, max_length=16, description="adapter or merged.")
    digest: str | None = Field(
        default=None, max_length=128,
        description="sha256:<hex>: the OCI manifest's digest for oci://, else the digest of the export's "
        "manifest (every file's name, size and sha256).",
    )
    size: int | None = Field(default=None, ge=0, description="Bytes of the files uploaded.")
    files: int | None = Field(default=None, ge=0, description="Files uploaded.")
    source: str | None = Field(default=None, max_length=1024, description="The adapter version exported (its path).")
    completed_at: dt.datetime | None = Field(default=None, description="When the export succeeded.")


class GRPORunStatus(ApiModel):
    """Observed state of a run; written by the controller only."""

    model_config = ConfigDict(extra="ignore")

    phase: Phase = Field(default=Phase.PENDING, description="Pending, Initializing, StartingServer, Training, "
                         "Exporting, Suspended, Succeeded or Failed.")
    reason: str | None = Field(default=None, description="Reason of the latest phase change.")
    message: str | None = Field(default=None, description="Human-readable detail of the phase.")
    observed_generation: int | None = Field(default=None, description="Spec generation last acted on.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Conditions (metav1.Condition), one per type.",
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    attempt: int = Field(default=0, description="Current attempt (1-based); each has a fresh server.")
    failed_attempts: int = Field(
        default=0,
        ge=0,
        description="Attempts that failed so far (counted against runPolicy.backoffLimit); a suspended "
        "or preempted attempt does not count.",
    )
    preemptions: int = Field(
        default=0,
        ge=0,
        description="Attempts that ended because a trainer pod was preempted or evicted (pod condition "
        "DisruptionTarget); each started the next attempt without counting against backoffLimit, up to "
        "runPolicy.preemptionLimit.",
    )
    attempt_started_at: dt.datetime | None = Field(
        default=None, description="When the current attempt began waiting for its server."
    )
    sources: SourcesStatus = Field(
        default_factory=SourcesStatus, description="The initializer's fetch and checks of the sources."
    )
    server: ServerStatus = Field(default_factory=ServerStatus, description="The server of the attempt.")
    adapter: AdapterStatus = Field(default_factory=AdapterStatus, description="The latest adapter.")
    progress: ProgressStatus = Field(default_factory=ProgressStatus, description="Training progress.")
    output: OutputStatus | None = Field(
        default=None, description="Where the export step put the result (spec.output), once it succeeded."
    )
    start_time: dt.datetime | None = Field(default=None, description="When the run started.")
    completion_time: dt.datetime | None = Field(default=None, description="When the run succeeded or failed.")
