"""How a run proceeds: its initializer, retries, deadlines, suspension and cleanup (Kubernetes Jobs' meanings)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from grpo_api.spec.api import ApiModel
from grpo_api.spec.resources import Resources


def _initializer_resources() -> Resources:
    return Resources(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "8Gi"})


class InitializerSpec(ApiModel):
    """The run's initializer: one pod, before the first server, that fetches hf:// sources onto the run's
    volume (resumable) and checks that the model, the dataset and every reward function can be loaded."""

    resources: Resources = Field(
        default_factory=_initializer_resources, description="Initializer container resources."
    )
    backoff_limit: int = Field(
        default=3, ge=0, le=20,
        description="Retries of a fetch that failed for a reason that may pass (network, hub); a missing "
        "file, module or function is not retried.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=60, description="Fail the run (SourceUnavailable) when the initializer takes longer."
    )
    start_timeout_seconds: int = Field(
        default=600, ge=10,
        description="Fail the run (SourceUnavailable) when the initializer's pod has not started this long "
        "after the run began and says why (a missing claim, an image that cannot be pulled, unschedulable).",
    )


class CleanupPolicy(StrEnum):
    STOP_SERVER = "StopServer"
    KEEP_SERVER = "KeepServer"
    DELETE_SERVER = "DeleteServer"


class RunPolicy(ApiModel):
    """Retries, deadlines and cleanup, with the meanings Kubernetes Jobs give them."""

    backoff_limit: int = Field(
        default=2, ge=0, le=100, description="Retries after a failed attempt; each starts a fresh server."
    )
    preemption_limit: int | None = Field(
        default=None, ge=0,
        description="Attempts whose trainer pod was preempted or evicted (pod condition DisruptionTarget) that "
        "start the next one without counting against backoffLimit; a preemption past this counts as a failed "
        "attempt. Unset: no limit, as a Job's podFailurePolicy Ignore rule (activeDeadlineSeconds still holds).",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Fail the run (DeadlineExceeded) after this long since it started."
    )
    server_ready_timeout_seconds: int = Field(
        # The server Deployment's progressDeadlineSeconds is this plus 60, an int32.
        default=1200, ge=1, le=2**31 - 1 - 60,
        description="Fail the attempt (ServerNotReady) if the server is not healthy by then.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the run this long after it succeeded or failed."
    )
    suspend: bool = Field(
        default=False, description="Stop the trainer and scale the server to 0; resuming continues from the "
        "last checkpoint.",
    )
    cleanup_policy: CleanupPolicy = Field(
        default=CleanupPolicy.STOP_SERVER,
        description="On finish: StopServer scales it to 0, KeepServer leaves it serving the final adapter, "
        "DeleteServer removes its Deployment and Service.",
    )
