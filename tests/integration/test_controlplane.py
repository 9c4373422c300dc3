"""The test control plane is the real thing: the right version, and its controllers run."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from tests.fixtures.controlplane import K8S_VERSION, ControlPlane
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.controlplane

LABELS = {"app": "probe"}


def _pod_template() -> dict[str, Any]:
    return {
        "metadata": {"labels": LABELS},
        "spec": {"containers": [{"name": "c", "image": "busybox:1", "command": ["true"]}]},
    }


def test_api_server_reports_the_built_version(control_plane: ControlPlane) -> None:
    result = control_plane.kubectl("get", "--raw", "/version", check=True)
    assert json.loads(result.stdout)["gitVersion"] == K8S_VERSION
    client_version = control_plane.kubectl("version", "--client", "-o", "json", check=True)
    assert json.loads(client_version.stdout)["clientVersion"]["gitVersion"] == K8S_VERSION


def test_kubeconfig_is_exported_and_the_token_is_cluster_admin(control_plane: ControlPlane) -> None:
    assert os.environ["KUBECONFIG"] == str(control_plane.kubeconfig)
    who = control_plane.kubectl("auth", "whoami", "-o", "json", check=True)
    groups = json.loads(who.stdout)["status"]["userInfo"]["groups"]
    assert "system:masters" in groups
    assert control_plane.kubectl("auth", "can-i", "*", "*", "--all-namespaces").stdout.strip() == "yes"


def test_startup_is_fast_with_cached_binaries(control_plane: ControlPlane) -> None:
    assert control_plane.startup_seconds < 30, control_plane.stage_seconds


def test_deployment_gets_a_replicaset_and_pods_and_is_garbage_collected(
    control_plane: ControlPlane, namespace: str
) -> None:
    from kubernetes import client

    with control_plane.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        apps.create_namespaced_deployment(namespace, {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "probe"},
            "spec": {"replicas": 2, "selector": {"matchLabels": LABELS}, "template": _pod_template()},
        })
        selector = "app=probe"
        rs = wait_for(lambda: apps.list_namespaced_replica_set(namespace, label_selector=selector).items,
                      what="the deployment controller to create a ReplicaSet")
        assert rs[0].metadata.owner_references[0].kind == "Deployment"
        pods = wait_for(
            lambda: [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
                     if p.metadata.owner_references],
            what="the replicaset controller to create Pods",
        )
        wait_for(lambda: len(core.list_namespaced_pod(namespace, label_selector=selector).items) == 2,
                 what="two pods")
        assert pods[0].metadata.owner_references[0].kind == "ReplicaSet"

        apps.delete_namespaced_deployment("probe", namespace, propagation_policy="Background")
        wait_for(lambda: not apps.list_namespaced_replica_set(namespace, label_selector=selector).items,
                 what="the garbage collector to delete the ReplicaSet")
        wait_for(lambda: not core.list_namespaced_pod(namespace, label_selector=selector).items,
                 what="the garbage collector to delete the Pods")


def test_deleting_an_owner_garbage_collects_its_dependent(
    control_plane: ControlPlane, namespace: str
) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    with control_plane.api_client() as api:
        core = client.CoreV1Api(api)
        owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
        core.create_namespaced_config_map(namespace, {"metadata": {"name": "child", "ownerReferences": [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid},
        ]}})
        core.delete_namespaced_config_map("owner", namespace)

        def child_gone() -> bool:
            try:
                core.read_namespaced_config_map("child", namespace)
            except ApiException as exc:
                return exc.status == 404
            return False

        wait_for(child_gone, what="the garbage collector to delete the owned ConfigMap")


def test_job_gets_a_pod_completes_and_is_removed_after_its_ttl(
    control_plane: ControlPlane, namespace: str
) -> None:
    """Without a kubelet the test plays it: it marks the Job's pod Succeeded, as the operator tests will."""
    from kubernetes import client, watch

    with control_plane.api_client() as api:
        batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
        template = _pod_template()
        template["spec"]["restartPolicy"] = "Never"
        created = batch.create_namespaced_job(namespace, {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "probe"},
            "spec": {"template": template, "backoffLimit": 0, "ttlSecondsAfterFinished": 1},
        })
        (pod,) = wait_for(lambda: core.list_namespaced_pod(namespace, label_selector="job-name=probe").items,
                          what="the job controller to create a Pod")
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        terminated = {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}
        core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": {
            "phase": "Succeeded",
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted"}],
            "containerStatuses": [{"name": "c", "image": "busybox:1", "imageID": "", "ready": False,
                                   "restartCount": 0, "state": {"terminated": terminated}}],
        }})

        # A watch from the Job's creation sees every change, however soon the TTL removes the Job
        # (polling can miss the short while it is Complete on a busy machine).
        complete, deleted = False, False
        for event in watch.Watch().stream(batch.list_namespaced_job, namespace, field_selector="metadata.name=probe",
                                          resource_version=created.metadata.resource_version, timeout_seconds=60):
            job = event["object"]
            complete = complete or any(c.type == "Complete" and c.status == "True"
                                       for c in (job.status.conditions or []))
            if event["type"] == "DELETED":
                deleted = True
                break
        assert complete, "the job controller did not mark the Job Complete"
        assert deleted, "the ttl-after-finished controller did not delete the Job within 60 s"


def test_new_namespace_gets_a_default_service_account(control_plane: ControlPlane, namespace: str) -> None:
    from kubernetes import client

    with control_plane.api_client() as api:
        core = client.CoreV1Api(api)
        wait_for(lambda: [sa for sa in core.list_namespaced_service_account(namespace).items
                          if sa.metadata.name == "default"],
                 what="the serviceaccount controller to create the default ServiceAccount")


def test_deleting_a_namespace_removes_it_with_its_contents(control_plane: ControlPlane) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    with control_plane.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": "doomed"}})
        core.create_namespaced_config_map("doomed", {"metadata": {"name": "cm"}})
        core.delete_namespace("doomed")

        def gone() -> bool:
            try:
                core.read_namespace("doomed")
            except ApiException as exc:
                return exc.status == 404
            return False

        wait_for(gone, timeout=60, what="the namespace controller to finish deleting the namespace")
