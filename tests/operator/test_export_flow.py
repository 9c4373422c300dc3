"""The export step on a real API server with the real operator: after the trainer Job succeeded the run
exports through its own Job (credentials from the Secret, only there), records status.output from the pod's
termination message, and fails as ExportFailed when the export Job fails (no other attempt, no deletion)."""

from __future__ import annotations

from typing import Any

import pytest

from grpo_api.export_protocol import ExportResult
from tests.fixtures.server import RunningServer
from tests.fixtures.waiting import wait_for
from tests.operator.conftest import Kube, OperatorProcess

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

OUTPUT = {"destination": "oci://registry.example.com/team/tiny:v1", "credentialsSecret": "registry-push"}
RESULT = ExportResult(uri="oci://registry.example.com/team/tiny@sha256:" + "b" * 64, form="adapter",
                      digest="sha256:" + "b" * 64, size=4321, files=3, source="/data/adapters/r/v4")


def container_env(job: Any) -> dict[str, Any]:
    return {e.name: e for e in job.spec.template.spec.containers[0].env or []}


def trained(kube: Kube, server: RunningServer) -> None:
    kube.create_run("r", server_url=server.url, output=OUTPUT)
    kube.wait_phase("r", "Training")
    kube.finish_trainer("r-trainer-1", succeeded=True)
    kube.wait_phase("r", "Exporting", reason="Exporting")


def test_a_run_with_output_exports_through_its_own_job_and_records_where_it_went(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    trained(kube, tiny_server)
    job = wait_for(lambda: kube.job("r-export"), what="the export Job")
    env = container_env(job)
    assert env["GRPO_EXPORT_PASSWORD"].value_from.secret_key_ref.name == "registry-push"
    assert env["GRPO_EXPORT_PASSWORD"].value is None
    assert "GRPO_EXPORT_PASSWORD" not in container_env(kube.job("r-trainer-1"))
    wait_for(lambda: kube.deployment("r-server").spec.replicas == 0, what="server scaled to 0 while exporting")

    kube.finish_job_pods("r-export", "export", 0, RESULT.line())
    status = kube.wait_phase("r", "Succeeded", reason="Completed")
    output = status["output"]
    assert (output["uri"], output["digest"], output["size"], output["files"]) == (RESULT.uri, RESULT.digest,
                                                                                  4321, 3)
    assert output["completedAt"] and RESULT.uri in status["message"]
    assert [j.metadata.name for j in kube.jobs("r")] == ["r-trainer-1"] and kube.job("r-export") is not None


def test_a_failed_export_fails_the_run_as_export_failed_without_another_attempt(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    trained(kube, tiny_server)
    kube.finish_job_pods("r-export", "export", 2, "export failed: the registry refused the push: Unauthorized")
    status = kube.wait_phase("r", "Failed", reason="ExportFailed")
    assert "Unauthorized" in status["message"] and "adapters stay" in status["message"]
    assert status["attempt"] == 1 and status["failedAttempts"] == 0 and "output" not in status
    kube.wait_event("r", "Warning", "ExportFailed")
    assert [j.metadata.name for j in kube.jobs("r")] == ["r-trainer-1"]  # no other attempt


