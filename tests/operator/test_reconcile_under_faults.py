"""Operator hardening against a real control plane: names re-used by a new run, objects the run does not
own, children deleted mid-attempt, children the API server refuses, a crash between two writes, and
reconciles that fail unexpectedly.

The first tests run the real operator process; the last ones call `reconcile.reconcile` in-process
against the same API server, to reproduce a state (a crash between two writes, a bug) exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from grpo_api.health import HealthClient
from grpo_api.models import GRPORun
from grpo_operator import builders, children, reconcile
from grpo_operator.kube import KubeClient
from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.server import RunningServer
from tests.fixtures.waiting import consistently, wait_for
from tests.operator.conftest import Kube, OperatorProcess

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

HOLD = "test.grpo.dev/hold"


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions", [])}


def owner_uid(obj: Any) -> str | None:
    refs = obj.metadata.owner_references or []
    return next((r.uid for r in refs if r.kind == "GRPORun" and r.controller), None)


def delete_run(kube: Kube, name: str) -> None:
    kube.custom.delete_namespaced_custom_object("grpo.dev", "v1alpha1", kube.namespace, "grporuns", name,
                                                propagation_policy="Background")
    wait_for(lambda: kube.run(name) is None, timeout=30, what=f"run {name} to be deleted")


# ------------------------------------------------------------------------------------- names re-used


def test_a_run_recreated_under_a_dying_runs_name_waits_for_its_children_and_never_adopts_them(
    operator: OperatorProcess, kube: Kube
) -> None:
    old = kube.create_run("again")
    wait_for(lambda: kube.config_map("again-config"), what="the first run's run-config")
    # A finalizer keeps the old run-config terminating after the garbage collector deletes it.
    kube.core.patch_namespaced_config_map("again-config", kube.namespace, {"metadata": {"finalizers": [HOLD]}})
    delete_run(kube, "again")
    wait_for(lambda: kube.config_map("again-config").metadata.deletion_timestamp, timeout=90,
             what="the garbage collector to delete the old run-config")

    new = kube.create_run("again")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]

    def waiting() -> dict[str, Any] | None:
        cond = conditions(kube.status("again")).get("Reconciled")
        return cond if cond and cond["status"] == "False" and cond["reason"] == "WaitingForOldChildren" else None

    cond = wait_for(waiting, timeout=30, what=f"a WaitingForOldChildren condition (now {kube.status('again')})")
    assert "ConfigMap again-config" in cond["message"] and old["metadata"]["uid"] in cond["message"]
    assert owner_uid(kube.config_map("again-config")) == old["metadata"]["uid"]
    assert kube.deployment("again-server") is None, "nothing of the new run may start on the old run's objects"

    kube.core.patch_namespaced_config_map("again-config", kube.namespace, {"metadata": {"finalizers": None}})
    # No pvc-protection controller runs here: play it for the old claim once the collector deleted it.
    def old_claim_released() -> bool:
        try:
            claim = kube.core.read_namespaced_persistent_volume_claim("again-data", kube.namespace)
        except kube.client.ApiException as exc:
            return exc.status == 404
        if owner_uid(claim) == new["metadata"]["uid"]:
            return True
        if claim.metadata.deletion_timestamp:
            kube.core.patch_namespaced_persistent_volume_claim("again-data", kube.namespace,
                                                               {"metadata": {"finalizers": None}})
        return False

    wait_for(old_claim_released, timeout=90, what="the old run's claim to go")
    wait_for(lambda: (cm := kube.config_map("again-config")) is not None and owner_uid(cm) == new["metadata"]["uid"],
             timeout=30, what="the new run's own run-config")
    wait_for(lambda: conditions(kube.status("again")).get("Reconciled", {}).get("status") == "True", timeout=30,
             what="Reconciled to turn True once the old children are gone")
    wait_for(lambda: kube.deployment("again-server"), timeout=30, what="the new run's server Deployment")
    assert owner_uid(kube.deployment("again-server")) == new["metadata"]["uid"]


def test_an_object_the_run_does_not_own_under_a_childs_name_fails_the_run_naming_it(
    operator: OperatorProcess, kube: Kube
) -> None:
    kube.core.create_namespaced_config_map(kube.namespace, {"metadata": {"name": "taken-config"},
                                                            "data": {"mine": "yes"}})
    kube.create_run("taken")
    status = kube.wait_phase("taken", "Failed", reason="ChildConflict")
    assert "ConfigMap taken-config" in status["message"] and "not owned by this run" in status["message"]
    assert kube.config_map("taken-config").data == {"mine": "yes"}, "a foreign object is never changed"
    assert kube.job("taken-init") is None and kube.deployment("taken-server") is None
    kube.wait_event("taken", "Warning", "ChildConflict")


def test_a_limit_the_namespace_sets_that_refuses_a_child_fails_the_run_at_once_with_the_api_servers_words(
    operator: OperatorProcess, kube: Kube
) -> None:
    # LimitRanger admission answers 403 Forbidden, as a quota or a policy webhook of the cluster does.
    kube.core.create_namespaced_limit_range(kube.namespace, {
        "metadata": {"name": "small-claims"},
        "spec": {"limits": [{"type": "PersistentVolumeClaim", "max": {"storage": "500Mi"}}]}})
    kube.create_run("quota")
    status = kube.wait_phase("quota", "Failed", reason="ChildRejected", timeout=30)
    assert "refused by the API server" in status["message"] and "500Mi" in status["message"], status
    assert conditions(status)["Failed"]["reason"] == "ChildRejected"
    # One refusal, one event: no retry storm (a storm would add more within a few reconcile intervals).
    kube.wait_event("quota", "Warning", "ChildRejected")
    consistently(lambda: len([e for e in kube.events("quota") if e[1] == "ChildRejected"]) == 1, 3,
                 what="one ChildRejected event")


# ----------------------------------------------------------------------------- children mid-attempt


@pytest.fixture
def start_server(server_factory: Callable[..., RunningServer], tiny_model_dir: Path) -> Callable[[], RunningServer]:
    return lambda: server_factory(tiny_model_dir)


def test_children_deleted_mid_attempt_are_restored_and_a_deleted_token_ends_the_attempt(
    operator: OperatorProcess, kube: Kube, start_server: Callable[[], RunningServer]
) -> None:
    server = start_server()
    run = kube.create_run("mid", server_url=server.url, runPolicy={"backoffLimit": 2})
    uid = run["metadata"]["uid"]
    kube.wait_phase("mid", "Training")

    kube.core.delete_namespaced_service("mid-server", kube.namespace)
    kube.networking.delete_namespaced_network_policy("mid-server", kube.namespace)

    def restored() -> bool:
        try:
            service = kube.core.read_namespaced_service("mid-server", kube.namespace)
            policy = kube.networking.read_namespaced_network_policy("mid-server", kube.namespace)
        except kube.client.ApiException:
            return False
        return owner_uid(service) == uid and owner_uid(policy) == uid and not service.metadata.deletion_timestamp

    wait_for(restored, timeout=30, what="the Service and NetworkPolicy to be created again")
    kube.wait_event("mid", "Warning", "ChildRestored")
    assert kube.status("mid")["phase"] == "Training" and kube.status("mid")["attempt"] == 1

    old_token = kube.core.read_namespaced_secret("mid-token", kube.namespace).metadata.uid
    kube.core.delete_namespaced_secret("mid-token", kube.namespace)
    status = kube.wait_phase("mid", "StartingServer", timeout=60)
    assert status["attempt"] == 2 and status["failedAttempts"] == 1
    kube.wait_event("mid", "Warning", "ChildDeleted")
    wait_for(lambda: kube.job("mid-trainer-1") is None or kube.job("mid-trainer-1").metadata.deletion_timestamp,
             timeout=30, what="the trainer of the ended attempt to be deleted")
    new_token = wait_for(lambda: kube.core.read_namespaced_secret("mid-token", kube.namespace), timeout=30,
                         what="a new token Secret")
    assert new_token.metadata.uid != old_token and owner_uid(new_token) == uid


# ------------------------------------------------------------------------------------ in-process


@pytest.fixture
def runtime(control_plane: ControlPlane) -> Iterator[reconcile.Runtime]:
    with control_plane.api_client() as api:
        rt = reconcile.Runtime(
            config=reconcile.OperatorConfig(reconcile_interval=1.0, metrics_port=0),
            kube=KubeClient(api),
            health=HealthClient(1.0),
            executor=ThreadPoolExecutor(max_workers=1),
        )
        yield rt
        rt.health.close()
        rt.executor.shutdown()


def snapshot(kube: Kube, run: dict[str, Any]) -> children.Children:
    """What the operator's indexes would hold for the run, read from the API server."""
    selector = f"{builders.RUN_LABEL}={run['metadata']['name']}"
    ns = kube.namespace
    pods = [children.pod_info(kube.api.sanitize_for_serialization(p))
            for p in kube.core.list_namespaced_pod(ns, label_selector=selector).items]
    deployments = [children.deployment_info(kube.api.sanitize_for_serialization(d))
                   for d in kube.apps.list_namespaced_deployment(ns, label_selector=selector).items]
    jobs = [children.job_info(kube.api.sanitize_for_serialization(j))
            for j in kube.batch.list_namespaced_job(ns, label_selector=selector).items]
    objects = [children.object_info("ConfigMap", kube.api.sanitize_for_serialization(c))
               for c in kube.core.list_namespaced_config_map(ns, label_selector=selector).items]
    return children.snapshot(run["metadata"]["uid"], pods, deployments, jobs, objects)


def template_attempts(kube: Kube, name: str, seen: list[str], stop: threading.Event) -> None:
    """Record the attempt of every version of the Deployment's template, as a watch delivers them."""
    from kubernetes import watch

    w = watch.Watch()
    for event in w.stream(kube.apps.list_namespaced_deployment, kube.namespace,
                          field_selector=f"metadata.name={name}", timeout_seconds=30):
        seen.append((event["object"].spec.template.metadata.annotations or {}).get(builders.ATTEMPT_ANNOTATION, "?"))
        if stop.is_set():
            w.stop()


def training_run_with_a_failed_trainer(
    runtime: reconcile.Runtime, kube: Kube, name: str, deployment_attempt: int
) -> dict[str, Any]:
    """A run recorded at attempt 1 (Training), its trainer failed, its Deployment at `deployment_attempt`
    (2: the state a crash between patching the Deployment and writing the status leaves)."""
    created = kube.create_run(name, runPolicy={"backoffLimit": 3})
    kube.custom.patch_namespaced_custom_object_status("grpo.dev", "v1alpha1", kube.namespace, "grporuns", name, {
        "status": {"phase": "Training", "attempt": 1, "sources": {"ready": True},
                   "server": {"ready": True, "bootId": "b1"}}},
        _content_type="application/merge-patch+json")
    run = GRPORun.model_validate({"metadata": created["metadata"], "spec": created["spec"]})
    reconcile.provision(runtime, run)
    kube.apps.create_namespaced_deployment(kube.namespace, builders.build_server_deployment(run, deployment_attempt, 1))
    kube.batch.create_namespaced_job(kube.namespace, builders.build_trainer_job(run, 1))
    kube.finish_trainer(f"{name}-trainer-1", succeeded=False)
    wait_for(lambda: (j := kube.job(f"{name}-trainer-1")) and j.status.failed, timeout=30,
             what="the trainer Job to fail")
    run_now = kube.run(name)
    assert run_now is not None
    return run_now


@pytest.mark.parametrize("deployment_attempt", [1, 2], ids=["before-the-patch", "after-the-patch"])
def test_one_reconcile_makes_at_most_one_change_to_the_server_deployment(
    runtime: reconcile.Runtime, kube: Kube, deployment_attempt: int
) -> None:
    name = f"crash-{deployment_attempt}"
    body = training_run_with_a_failed_trainer(runtime, kube, name, deployment_attempt)
    before = kube.deployment(f"{name}-server").metadata.generation
    seen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=template_attempts, args=(kube, f"{name}-server", seen, stop), daemon=True)
    watcher.start()
    wait_for(lambda: seen, what="the watch to deliver the Deployment")

    reconcile.reconcile(runtime, body, snapshot(kube, body))

    status = kube.status(name)
    assert status["phase"] == "StartingServer" and status["attempt"] == 2 and status["failedAttempts"] == 1
    after = kube.deployment(f"{name}-server")
    assert after.spec.template.metadata.annotations[builders.ATTEMPT_ANNOTATION] == "2"
    # Before the patch: exactly one change (1 -> 2). After it (the crash state): none, never back to 1.
    assert after.metadata.generation - before == (1 if deployment_attempt == 1 else 0)
    stop.set()
    kube.patch_run(name, {"metadata": {"annotations": {"poke": "1"}}})
    kube.apps.patch_namespaced_deployment(f"{name}-server", kube.namespace, {"metadata": {"labels": {"poke": "1"}}})
    watcher.join(timeout=35)
    assert seen[0] == str(deployment_attempt) and set(seen[1:]) <= {"2"}, seen


def test_an_unexpected_error_is_reported_in_a_condition_and_an_event_and_retried_with_backoff(
    runtime: reconcile.Runtime, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = kube.create_run("buggy")

    def boom(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug in observe")

    monkeypatch.setattr(reconcile, "observe", boom)
    delays = [reconcile.reconcile(runtime, kube.run("buggy") or body, children.Children()) for _ in range(3)]
    assert delays == [1.0, 2.0, 4.0], "retried with backoff, doubling"
    status = kube.status("buggy")
    assert status["phase"] == "Pending", "never left without a status"
    cond = conditions(status)["Reconciled"]
    assert cond["status"] == "False" and cond["reason"] == "ReconcileError"
    assert "RuntimeError" in cond["message"] and "a bug in observe" in cond["message"]
    assert [e for e in kube.events("buggy") if e[1] == "ReconcileError"] == [("Warning", "ReconcileError")], \
        "one event per distinct error, not one per retry"

    monkeypatch.undo()
    assert reconcile.reconcile(runtime, kube.run("buggy") or body, children.Children()) < 4.0
    status = kube.status("buggy")
    assert status["phase"] == "Initializing"
    assert conditions(status)["Reconciled"]["status"] == "True"


def test_a_failing_reconcile_still_applies_the_active_deadline(
    runtime: reconcile.Runtime, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube.create_run("late", runPolicy={"activeDeadlineSeconds": 1})
    kube.custom.patch_namespaced_custom_object_status("grpo.dev", "v1alpha1", kube.namespace, "grporuns", "late", {
        "status": {"phase": "StartingServer", "attempt": 1, "startTime": "2020-01-01T00:00:00Z",
                   "sources": {"ready": True}}}, _content_type="application/merge-patch+json")

    def boom(*_: Any, **__: Any) -> Any:
        raise RuntimeError("still broken")

    monkeypatch.setattr(reconcile, "observe", boom)
    reconcile.reconcile(runtime, kube.run("late") or {}, children.Children())
    status = kube.status("late")
    assert status["phase"] == "Failed" and status["reason"] == "DeadlineExceeded", status
    assert "still broken" in status["message"]
