"""A GRPORun's children, as the operator creates them in a real API server, and the health gate."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.waiting import consistently, wait_for
from tests.operator.conftest import Kube, OperatorProcess

pytestmark = pytest.mark.controlplane

UNREACHABLE = "http://127.0.0.1:9"  # discard port: nothing answers


def test_new_run_gets_every_child_with_expected_fields_and_no_job_while_server_unhealthy(
    operator: OperatorProcess, kube: Kube
) -> None:
    run = kube.create_run(
        "r1",
        server_url=UNREACHABLE,
        server={"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "2Gi"}}, "shmSize": "2Gi",
                "healthPath": "/health/"},
        storage={"size": "3Gi", "modelCache": {"existingClaim": "hf", "mountPath": "/cache"}},
        scheduling={"nodeSelector": {"gpu": "yes"}},
    )
    uid = run["metadata"]["uid"]
    status = kube.wait_phase("r1", "StartingServer", reason="ServerStarting")
    assert status["attempt"] == 1

    deployment = wait_for(lambda: kube.deployment("r1-server"), what="server Deployment")
    spec = deployment.spec
    assert spec.strategy.type == "Recreate" and spec.replicas == 1
    assert spec.template.metadata.annotations["grpo.dev/attempt"] == "1"
    pod = spec.template.spec
    server = pod.containers[0]
    assert server.resources.limits == {"nvidia.com/gpu": "1", "memory": "2Gi"}
    for probe in (server.startup_probe, server.readiness_probe, server.liveness_probe):
        assert probe.http_get.path == "/health/"
    volumes = {v.name: v for v in pod.volumes}
    assert volumes["dshm"].empty_dir.medium == "Memory" and volumes["dshm"].empty_dir.size_limit == "2Gi"
    assert volumes["token"].secret.secret_name == "r1-token"
    assert volumes["data"].persistent_volume_claim.claim_name == "r1-data"
    assert volumes["model-cache"].persistent_volume_claim.claim_name == "hf"
    env = {e.name: e.value for e in server.env}
    assert env["GRPO_RUN_CONFIG"] == "/etc/grpo/run-config.yaml" and env["GRPO_TOKEN_FILE"].endswith("/token")
    assert env["GRPO_ATTEMPT"] == "1"
    assert {m.mount_path for m in server.volume_mounts} >= {"/dev/shm", "/data", "/cache", "/etc/grpo"}
    assert pod.node_selector == {"gpu": "yes"} and pod.security_context.run_as_non_root is True

    policy = kube.networking.read_namespaced_network_policy("r1-server", kube.namespace)
    owned = [
        deployment,
        kube.core.read_namespaced_service("r1-server", kube.namespace),
        kube.core.read_namespaced_config_map("r1-config", kube.namespace),
        kube.core.read_namespaced_secret("r1-token", kube.namespace),
        kube.core.read_namespaced_persistent_volume_claim("r1-data", kube.namespace),
        policy,
    ]
    for obj in owned:
        refs = obj.metadata.owner_references
        assert [(r.kind, r.uid, r.controller) for r in refs] == [("GRPORun", uid, True)], obj.kind
        assert obj.metadata.labels["grpo.dev/run"] == "r1"
    assert "run-config.yaml" in owned[2].data
    # The server's NetworkPolicy: its pods, on the server port, from the run's trainers and the operator.
    assert policy.spec.policy_types == ["Ingress"]
    assert policy.spec.pod_selector.match_labels == spec.selector.match_labels
    assert spec.template.metadata.labels.items() >= policy.spec.pod_selector.match_labels.items()
    (rule,) = policy.spec.ingress
    assert [(p.protocol, p.port) for p in rule.ports] == [("TCP", 8000)]
    trainers, operator_peer = rule._from
    assert trainers.namespace_selector is None
    assert trainers.pod_selector.match_labels == {"grpo.dev/run": "r1", "grpo.dev/component": "trainer"}
    assert operator_peer.namespace_selector is not None, "an empty namespaceSelector: any namespace"
    assert not operator_peer.namespace_selector.match_labels
    assert operator_peer.pod_selector.match_labels == {"app.kubernetes.io/name": "grpo-operator",
                                                       "app.kubernetes.io/component": "operator"}
    assert owned[4].spec.resources.requests["storage"] == "3Gi"

    # The server never answers: several reconciles later there is still no trainer Job.
    consistently(lambda: kube.jobs("r1") == [], 4, what="no trainer Job while the server never answers")
    status = kube.status("r1")
    assert status["phase"] == "StartingServer" and "unreachable" in status["message"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["ServerReady"]["status"] == "False"
    wait_for(lambda: ("Normal", "Created") in kube.events("r1"), what="Created event")
    assert operator.forbidden_lines() == []


def test_server_pod_trouble_is_shown_on_the_run_and_cleared_when_it_passes(
    operator: OperatorProcess, kube: Kube
) -> None:
    kube.create_run("stuck")  # no server-url override: the operator waits for a Ready pod
    kube.wait_phase("stuck", "StartingServer", reason="ServerStarting")
    (pod,) = wait_for(lambda: kube.server_pods("stuck"), what="the ReplicaSet controller to create the server pod")
    unschedulable = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    # Play the scheduler: no node has a free GPU.
    kube.core.patch_namespaced_pod_status(pod.metadata.name, kube.namespace, {"status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}]}})
    server = wait_for(lambda: (s := kube.status("stuck").get("server", {})).get("message") and s,
                      what="status.server.message to show the pod's trouble")
    assert server["message"] == f"pod {pod.metadata.name}: Unschedulable: {unschedulable}"
    status = kube.status("stuck")
    assert status["phase"] == "StartingServer" and "Unschedulable" in status["message"]
    kube.core.patch_namespaced_pod_status(pod.metadata.name, kube.namespace, {"status": {"conditions": [
        {"type": "PodScheduled", "status": "True"}]}})
    wait_for(lambda: "message" not in kube.status("stuck").get("server", {}),
             what="status.server.message to clear once the pod is scheduled")


def test_operator_without_network_policy_creates_none(
    control_plane: ControlPlane, operator_kubeconfig: Path, kube: Kube, tmp_path: Path
) -> None:
    plain = OperatorProcess(namespace=kube.namespace, kubeconfig=operator_kubeconfig, log_path=tmp_path / "op.log",
                            extra_args=("--no-network-policy",))
    plain.start()
    try:
        kube.create_run("open", server_url=UNREACHABLE)
        kube.wait_phase("open", "StartingServer", reason="ServerStarting")
        assert kube.core.read_namespaced_service("open-server", kube.namespace) is not None
        assert kube.networking.list_namespaced_network_policy(kube.namespace).items == []
    finally:
        control_plane.kubectl("delete", "grporuns", "--all", "-n", kube.namespace, "--wait=true", "--timeout=60s")
        plain.stop()


def test_colocate_run_gets_only_the_trainer_job(operator: OperatorProcess, kube: Kube) -> None:
    kube.create_run("co", mode="colocate", server=None)
    kube.wait_phase("co", "Training")
    jobs = wait_for(lambda: kube.jobs("co"), what="trainer Job")
    assert [j.metadata.name for j in jobs] == ["co-trainer-1"]
    assert jobs[0].spec.backoff_limit == 0
    assert kube.deployment("co-server") is None
    services = kube.core.list_namespaced_service(kube.namespace, label_selector="grpo.dev/run=co").items
    assert services == []
    assert kube.networking.list_namespaced_network_policy(kube.namespace).items == [], "no server to guard"


def test_run_name_that_cannot_name_children_is_refused_at_admission(operator: OperatorProcess, kube: Kube) -> None:
    with pytest.raises(kube.client.ApiException) as refused:
        kube.create_run("9-starts-with-a-digit", server_url=UNREACHABLE)
    assert refused.value.status == 422 and "metadata.name" in str(refused.value.body)
    assert kube.run("9-starts-with-a-digit") is None


def test_cluster_wide_operator_reconciles_runs_in_any_namespace(
    control_plane: ControlPlane, operator_kubeconfig: Path, kube: Kube, tmp_path: Path
) -> None:
    cluster_wide = OperatorProcess(namespace=None, kubeconfig=operator_kubeconfig, log_path=tmp_path / "op.log")
    cluster_wide.start()
    try:
        kube.create_run("anywhere", server_url=UNREACHABLE)
        kube.wait_phase("anywhere", "StartingServer", reason="ServerStarting")
        assert kube.deployment("anywhere-server") is not None
    finally:
        control_plane.kubectl("delete", "grporuns", "--all", "-n", kube.namespace, "--wait=true", "--timeout=60s")
        cluster_wide.stop()
    assert cluster_wide.forbidden_lines() == []
