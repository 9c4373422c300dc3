"""Preemption against the real control plane: a trainer pod evicted through the Eviction API (the API server
adds its DisruptionTarget condition) fails its Job by the Job's own podFailurePolicy, and the operator starts
the next attempt with a fresh server without counting it against backoffLimit; a plain failure still counts.

No kubelet runs here: the test plays it, ending the evicted pod's container as SIGTERM would (exit code 143).
The servers are `grpo serve` processes on loopback (a new one, with a new boot id, per attempt).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.server import RunningServer
from tests.fixtures.waiting import consistently, wait_for
from tests.operator.conftest import Kube, OperatorProcess

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

#: A container ended by SIGTERM, as the kubelet ends an evicted pod's.
SIGTERM_EXIT = 143


@pytest.fixture
def start_server(server_factory: Callable[..., RunningServer], tiny_model_dir: Path) -> Callable[[], RunningServer]:
    """A new `grpo serve` process on the tiny model: a fresh boot id each call."""
    return lambda: server_factory(tiny_model_dir)


def trainer_pod(kube: Kube, job: str) -> Any:
    pods = wait_for(lambda: kube.core.list_namespaced_pod(kube.namespace, label_selector=f"job-name={job}").items,
                    timeout=30, what=f"the Job controller to create the pod of {job}")
    return pods[0]


def evict(kube: Kube, pod: str) -> None:
    """POST the pod's eviction subresource (policy/v1), as `kubectl drain` and the cluster autoscaler do."""
    kube.core.create_namespaced_pod_eviction(pod, kube.namespace, kube.client.V1Eviction(
        metadata=kube.client.V1ObjectMeta(name=pod, namespace=kube.namespace)))


def evict_trainer(kube: Kube, job: str) -> None:
    """Evict the Job's pod, then play the kubelet: its container ends as SIGTERM ends it. The pod may be gone
    already (the pod garbage collector fails and deletes an unscheduled pod being deleted)."""
    pod = trainer_pod(kube, job).metadata.name
    evict(kube, pod)
    evicted = kube._read(kube.core.read_namespaced_pod, pod)  # the Job's tracking finalizer holds it until counted
    if evicted is not None:
        disruption = [c for c in evicted.status.conditions or [] if c.type == "DisruptionTarget"]
        assert [c.status for c in disruption] == ["True"], "the API server marks an evicted pod DisruptionTarget"
    with contextlib.suppress(kube.client.ApiException):
        kube.terminate_pod(pod, "trainer", SIGTERM_EXIT)


def job_failed(kube: Kube, name: str) -> Any:
    def failed() -> Any:
        job = kube.job(name)
        conds = [c for c in (job.status.conditions or []) if c.type == "Failed" and c.status == "True"] if job else []
        return conds[0] if conds else None

    return wait_for(failed, timeout=60, what=f"Job {name} to fail")


def test_an_evicted_trainer_starts_the_next_attempt_uncounted_and_a_plain_failure_still_counts(
    operator: OperatorProcess, kube: Kube, start_server: Callable[[], RunningServer]
) -> None:
    first = start_server()
    kube.create_run("r", server_url=first.url, runPolicy={"backoffLimit": 0})
    kube.wait_phase("r", "Training")
    evict_trainer(kube, "r-trainer-1")

    failed = job_failed(kube, "r-trainer-1")
    assert failed.reason == "PodFailurePolicy" and "has condition DisruptionTarget" in failed.message, (
        "the Job's own podFailurePolicy names the disruption")
    status = wait_for(lambda: (s := kube.status("r")).get("attempt") == 2 and s, timeout=30,
                      what=f"attempt 2 (now {kube.status('r')})")
    assert status["phase"] == "StartingServer" and status.get("failedAttempts", 0) == 0, status
    assert status["preemptions"] == 1, status
    kube.wait_event("r", "Warning", "Preempted")
    found = kube.core.list_namespaced_event(kube.namespace, field_selector="involvedObject.name=r").items
    (said,) = [e.message for e in found if e.reason == "Preempted"]
    assert "DisruptionTarget" in said and "not counted against backoffLimit (preemptions: 1)" in said, said
    assert ("Warning", "TrainerFailed") not in kube.events("r")
    # The next attempt gets a fresh server, as after any failure: not the one attempt 1 trained against.
    consistently(lambda: kube.job("r-trainer-2") is None, 3, what="no trainer of attempt 2 on the old server")

    second = start_server()
    kube.set_server_url("r", second.url)
    kube.wait_phase("r", "Training")
    wait_for(lambda: kube.job("r-trainer-2"), what="trainer Job of attempt 2")

    kube.finish_trainer("r-trainer-2", succeeded=False)
    status = kube.wait_phase("r", "Failed", reason="BackoffLimitExceeded")
    assert (status["attempt"], status["failedAttempts"], status["preemptions"]) == (2, 1, 1), status
    wait_for(lambda: ("Warning", "TrainerFailed") in kube.events("r"), what="TrainerFailed event")


def test_preemptions_past_the_preemption_limit_count_against_backoff_limit(
    operator: OperatorProcess, kube: Kube, start_server: Callable[[], RunningServer]
) -> None:
    first = start_server()
    kube.create_run("r", server_url=first.url, runPolicy={"backoffLimit": 0, "preemptionLimit": 0})
    kube.wait_phase("r", "Training")
    evict_trainer(kube, "r-trainer-1")

    status = kube.wait_phase("r", "Failed", reason="BackoffLimitExceeded")
    assert (status["attempt"], status["failedAttempts"], status["preemptions"]) == (1, 1, 1), status
    assert "past runPolicy.preemptionLimit 0" in status["message"], status["message"]
    assert [j.metadata.name for j in kube.jobs("r")] == ["r-trainer-1"]
