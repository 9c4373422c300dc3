"""Sources and pod settings through the real operator and a real API server: the initializer runs
once, before any server; its failure is SourceUnavailable, not a retry storm; every pod the
operator builds from them is accepted by the API server; claims decide where the trainer may go.

The initializer pods are played by `InitializerKubelet` (conftest.py): `grpo prepare` itself is
tested in tests/trainer/test_prepare.py and on a real node in tests/e2e.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.server import RunningServer
from tests.fixtures.waiting import wait_for

from .conftest import InitializerKubelet, Kube, OperatorProcess, run_spec

pytestmark = pytest.mark.controlplane

REWARD = "def share(completions, **kwargs):\n    return [0.0] * len(completions)\n"


def sourced_spec(**overrides: Any) -> dict[str, Any]:
    spec = run_spec(**overrides)
    spec["model"] = {"name": "tiny", "source": "pvc://models/tiny", "dtype": "float32"}
    spec["dataset"] = {"source": "hf://org/prompts@v1", "path": "train.jsonl",
                       "hub": {"tokenSecretRef": {"name": "hub", "key": "token"}, "endpoint": "https://mirror.corp"}}
    spec["rewards"] = [{"function": "target:share"}]
    spec["rewardCode"] = {"inline": {"target.py": REWARD}}
    spec["server"] = {**spec["server"],
                      "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                      "podLabels": {"team": "a"},
                      "volumes": [{"name": "certs", "secret": {"secretName": "ca", "optional": True}}],
                      "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/corp", "readOnly": True}]}
    spec["trainer"] = {**spec["trainer"],
                       "env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}}}]}
    spec["scheduling"] = {"imagePullSecrets": ["registry-creds"]}
    return spec


def make_claim(kube: Kube, name: str, modes: list[str]) -> None:
    kube.core.create_namespaced_persistent_volume_claim(kube.namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": modes, "resources": {"requests": {"storage": "1Gi"}}}})


def pod_spec(obj: Any) -> dict[str, Any]:
    spec: dict[str, Any] = obj.to_dict()["spec"]["template"]["spec"]
    return spec


def test_initializer_runs_once_before_the_server_and_every_pod_carries_the_sources(
    kube: Kube, operator: OperatorProcess, initializers: InitializerKubelet
) -> None:
    make_claim(kube, "models", ["ReadWriteMany"])
    kube.create_run("src", spec=sourced_spec())
    status = kube.wait_phase("src", "StartingServer")
    assert status["reason"] == "SourcesReady", status
    assert status["sources"]["ready"] and status["sources"]["completedAt"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["SourcesReady"]["status"] == "True"

    init = kube.job("src-init")
    assert init is not None and init.spec.pod_failure_policy.rules[0].action == "FailJob"
    assert [p.metadata.name for p in kube.initializer_pods("src")] == initializers.finished[:1]
    env = {e.name: e for e in init.spec.template.spec.containers[0].env}
    assert env["GRPO_HF_TOKEN_DATASET"].value_from.secret_key_ref.name == "hub"

    deployment = wait_for(lambda: kube.deployment("src-server"), what="the server Deployment")
    server = pod_spec(deployment)
    volumes = {v["name"]: v for v in server["volumes"]}
    assert volumes["src-claim-0"]["persistent_volume_claim"] == {"claim_name": "models", "read_only": True}
    assert volumes["src-rewards"]["config_map"]["name"] == "src-rewards"
    assert volumes["certs"]["secret"]["secret_name"] == "ca"
    assert server["image_pull_secrets"] == [{"name": "registry-creds"}]
    assert deployment.spec.template.metadata.labels["team"] == "a"
    (container,) = server["containers"]
    assert {e["name"]: e for e in container["env"]}["POD"]["value_from"]["field_ref"]["field_path"] == "metadata.name"
    assert "GRPO_HF_TOKEN_DATASET" not in {e["name"] for e in container["env"]}

    rewards = kube.core.read_namespaced_config_map("src-rewards", kube.namespace)
    assert rewards.data == {"target.py": REWARD}
    config = kube.core.read_namespaced_config_map("src-config", kube.namespace)
    sources = yaml.safe_load(config.data["run-config.yaml"])["sources"]
    assert sources["modelDir" if "modelDir" in sources else "model_dir"] == "/mnt/grpo/claims/models/tiny"
    kube.wait_event("src", "Normal", "SourcesReady")


def test_a_failed_initializer_fails_the_run_before_any_server_naming_the_problem(
    kube: Kube, operator: OperatorProcess, initializers: InitializerKubelet
) -> None:
    message = "spec.rewards[0]: cannot import module 'target' for reward 'target:share'"
    initializers.fail("bad", 2, message)
    kube.create_run("bad", spec=sourced_spec(runPolicy={"backoffLimit": 5}))
    status = kube.wait_phase("bad", "Failed", reason="SourceUnavailable", timeout=60)
    assert "cannot import module 'target'" in status["message"], status
    assert kube.deployment("bad-server") is None, "no server for a run whose sources fail"
    assert kube.jobs("bad") == []
    assert len(kube.initializer_pods("bad")) == 1, "a permanent failure is not retried"
    kube.wait_event("bad", "Warning", "SourceUnavailable")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["SourcesReady"]["status"] == "False"
    assert conditions["SourcesReady"]["reason"] == "SourceUnavailable"


def test_a_transient_initializer_failure_is_retried_by_the_job_and_the_run_goes_on(
    kube: Kube, operator: OperatorProcess, initializers: InitializerKubelet
) -> None:
    initializers.fail("flaky", 1, "spec.dataset.source hf://org/prompts@v1: connection reset")
    kube.create_run("flaky", spec=run_spec())
    # The Job controller waits ~10 s before its first retry.
    kube.wait_phase("flaky", "StartingServer", timeout=60)
    assert len(kube.initializer_pods("flaky")) == 2


@pytest.mark.parametrize(("modes", "same_node"), [(["ReadWriteOnce"], True), (["ReadWriteMany"], False)])
def test_the_trainer_joins_the_servers_node_only_when_the_claim_needs_it(
    kube: Kube, operator: OperatorProcess, server_factory: Callable[..., RunningServer], tiny_model_dir: Path,
    modes: list[str], same_node: bool
) -> None:
    make_claim(kube, "shared", modes)
    server = server_factory(tiny_model_dir)
    spec = run_spec()
    spec["storage"] = {"existingClaim": "shared"}
    kube.create_run("place", spec=spec, server_url=server.url)
    kube.wait_phase("place", "Training", timeout=120)
    (job,) = kube.jobs("place")
    affinity = pod_spec(job).get("affinity")
    if same_node:
        (term,) = affinity["pod_affinity"]["required_during_scheduling_ignored_during_execution"]
        assert term["topology_key"] == "kubernetes.io/hostname"
        assert term["label_selector"]["match_labels"] == {"grpo.dev/run": "place", "grpo.dev/component": "server"}
    else:
        assert affinity is None


def test_a_read_write_once_pod_claim_is_refused_before_anything_is_created(
    kube: Kube, operator: OperatorProcess
) -> None:
    make_claim(kube, "solo", ["ReadWriteOncePod"])
    spec = run_spec()
    spec["storage"] = {"existingClaim": "solo"}
    kube.create_run("solo", spec=spec)
    status = kube.wait_phase("solo", "Failed", reason="InvalidSpec")
    assert "ReadWriteOncePod" in status["message"]
    assert kube.job("solo-init") is None and kube.deployment("solo-server") is None


def test_image_volume_sources_are_kept_by_the_api_server(kube: Kube, operator: OperatorProcess) -> None:
    spec = run_spec()
    spec["model"] = {"name": "tiny", "source": "oci://registry.corp/models/tiny:1", "path": "models/tiny"}
    kube.create_run("img", spec=spec)
    kube.wait_phase("img", "StartingServer")
    deployment = wait_for(lambda: kube.deployment("img-server"), what="the server Deployment")
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    assert volumes["src-model"]["image"]["reference"] == "registry.corp/models/tiny:1"



def test_a_pod_setting_the_api_server_refuses_fails_the_run_with_its_words(
    kube: Kube, operator: OperatorProcess
) -> None:
    """Extra volumes are kept as written (core/v1 Volume); one the API server refuses in a pod ends the run
    as ChildRejected with the server's message, instead of a reconcile that fails forever."""
    spec = run_spec()
    bad = {"name": "bad-mode", "secret": {"secretName": "s", "defaultMode": 99999}}
    spec["trainer"] = {**spec["trainer"], "volumes": [bad]}
    kube.create_run("refused", spec=spec)
    status = kube.wait_phase("refused", "Failed", reason="ChildRejected")
    assert "refused by the API server" in status["message"] and "defaultMode" in status["message"], status
    assert kube.deployment("refused-server") is None
