"""The export step's Job (spec.output): the trainer image's `grpo export` with the run's volume, the
destination's credentials from its Secret (never literal, and only here), a pvc:// claim mounted, and a
permanent failure (exit 2) failing the Job at once."""

from __future__ import annotations

from typing import Any

import pytest

from grpo_api.export_protocol import ENV_EXPORT_CLAIM_ROOT
from grpo_operator import builders as b
from tests.fixtures.child_manifests import container, make_run, mounts_of, volumes_of


def env_of(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(obj)["env"]}


def test_no_output_no_export_job() -> None:
    assert b.build_exporter_job(make_run()) is None


@pytest.mark.parametrize(("destination", "extra", "secret_env"), [
    ("hf://team/model", {"credentialsSecret": "hub"}, {"GRPO_EXPORT_TOKEN": ("token", False)}),
    ("oci://registry.example.com/team/model:v1", {"credentialsSecret": "reg"},
     {"GRPO_EXPORT_USERNAME": ("username", False), "GRPO_EXPORT_PASSWORD": ("password", False)}),
    ("s3://results/run", {"credentialsSecret": "s3", "endpoint": "http://minio:9000"},
     {"AWS_ACCESS_KEY_ID": ("accessKeyId", False), "AWS_SECRET_ACCESS_KEY": ("secretAccessKey", False),
      "AWS_SESSION_TOKEN": ("sessionToken", True)}),
])
def test_credentials_come_from_the_secret_to_the_export_step_only(
    destination: str, extra: dict[str, Any], secret_env: dict[str, tuple[str, bool]]
) -> None:
    run = make_run(output={"destination": destination, **extra})
    job = b.build_exporter_job(run)
    assert job is not None
    env = env_of(job)
    for name, (key, optional) in secret_env.items():
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == extra["credentialsSecret"] and ref["key"] == key
        assert ref.get("optional", False) is optional
        assert "value" not in env[name]
    trainer_env = env_of(b.build_trainer_job(run, 1))
    assert not set(secret_env) & set(trainer_env)


def test_export_job_runs_grpo_export_in_the_trainer_image_and_fails_at_once_on_exit_2() -> None:
    run = make_run(output={"destination": "pvc://results/team/run-1", "form": "merged"})
    job = b.build_exporter_job(run)
    assert job is not None
    assert job["metadata"]["name"] == "r1-export"
    assert job["metadata"]["labels"][b.COMPONENT_LABEL] == b.EXPORTER
    c = container(job)
    assert c["command"] == ["grpo", "export"] and c["image"] == b.build_trainer_job(run, 1)["spec"]["template"][
        "spec"]["containers"][0]["image"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "FailJob",
                        "onExitCodes": {"containerName": b.EXPORTER, "operator": "In", "values": [2]}}
    assert job["spec"]["backoffLimit"] == b.EXPORT_BACKOFF_LIMIT
    assert volumes_of(job)["export-claim"]["persistentVolumeClaim"] == {"claimName": "results"}
    assert mounts_of(job)["export-claim"]["mountPath"] == b.EXPORT_CLAIM_DIR
    assert env_of(job)[ENV_EXPORT_CLAIM_ROOT]["value"] == b.EXPORT_CLAIM_DIR
    assert "data" in mounts_of(job)  # the run's volume, where the adapters are
