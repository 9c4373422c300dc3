"""The cluster CLI against a real kube-apiserver: get, status, wait, logs, suspend/resume, cancel and pull, through a
kubeconfig file as a user has one. There is no kubelet: pods never run, so `logs` and `pull` are checked up to the
pod that does not start; status is written through the status subresource, as the operator writes it."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner, Result

from grpo_api.models import GROUP, PLURAL, VERSION
from grpo_cli.main import cli
from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.grporun_objects import create
from tests.fixtures.run_specs import valid_run

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

pytestmark = pytest.mark.controlplane


def now(offset: float = 0) -> str:
    return (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=offset)).strftime("%Y-%m-%dT%H:%M:%SZ")


def grpo(cp: ControlPlane, namespace: str | None, *args: str, input: str | None = None) -> Result:
    where = ["-n", namespace] if namespace else []
    return CliRunner().invoke(cli, [*args, *where, "--kubeconfig", str(cp.kubeconfig)], input=input)


def set_status(objects: CustomObjectsApi, namespace: str, name: str, status: dict[str, Any]) -> None:
    objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})


def training(step: int = 12) -> dict[str, Any]:
    return {
        "phase": "Training", "reason": "TrainerRunning", "attempt": 1,
        "progress": {"step": step, "maxSteps": 30, "rewardMean": 0.5},
        "adapter": {"version": step, "path": "/data/adapters/r/v12", "loadedAt": now(-5)},
        "server": {"ready": True, "readyReplicas": 1},
        "conditions": [{"type": "ServerReady", "status": "True", "reason": "HealthCheckPassed",
                        "lastTransitionTime": now(-60), "message": ""}],
    }


def succeeded() -> dict[str, Any]:
    done = {**training(30), "phase": "Succeeded", "reason": "Completed", "completionTime": now()}
    done["conditions"] = [*done["conditions"], {"type": "Succeeded", "status": "True", "reason": "Completed",
                                                "lastTransitionTime": now(), "message": "30 steps"}]
    return done


def test_get_and_status_show_what_the_operator_wrote_and_the_runs_events(
    control_plane: ControlPlane, objects: CustomObjectsApi, namespace: str
) -> None:
    from kubernetes import client

    run = create(objects, namespace, valid_run("r"))
    create(objects, namespace, valid_run("fresh"))
    set_status(objects, namespace, "r", training())
    with control_plane.api_client() as api:
        for i, reason in enumerate(("Created", "ServerStarting", "TrainerRunning")):
            client.CoreV1Api(api).create_namespaced_event(namespace, {
                "metadata": {"name": f"r.{i}"}, "type": "Normal", "reason": reason, "message": f"{reason} now",
                "involvedObject": {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "name": "r",
                                   "namespace": namespace, "uid": run["metadata"]["uid"]},
                "firstTimestamp": now(-30 + i), "lastTimestamp": now(-30 + i), "count": 1,
            })

    listed = grpo(control_plane, namespace, "get")
    assert listed.exit_code == 0, listed.output
    rows = [line.split() for line in listed.output.splitlines()]
    assert rows[0] == ["NAME", "PHASE", "STEP", "REWARD", "ADAPTER", "ATTEMPT", "AGE"]
    assert rows[1][:6] == ["fresh", "Pending", "0", "-", "-", "0"]
    assert rows[2][:6] == ["r", "Training", "12/30", "0.5", "v12", "1"]
    assert grpo(control_plane, None, "get", "-A").output.splitlines()[0].startswith("NAMESPACE")

    shown = grpo(control_plane, namespace, "status", "r")
    assert shown.exit_code == 0, shown.output
    assert f"r in namespace {namespace}" in shown.output
    assert "Training (TrainerRunning)" in shown.output and "12/30" in shown.output
    assert "v12, loaded" in shown.output and "ServerReady" in shown.output
    assert "Events (the last 3 of 3):" in shown.output
    listed_events = shown.output.split("Events (the last 3 of 3):")[1].splitlines()[2:]
    assert [line.split()[2] for line in listed_events] == ["Created", "ServerStarting", "TrainerRunning"]


def test_a_missing_run_is_named_with_its_namespace(control_plane: ControlPlane, objects: CustomObjectsApi,
                                                   namespace: str) -> None:
    for args in (["status", "nope"], ["wait", "nope"], ["logs", "nope"], ["suspend", "nope"],
                 ["cancel", "nope", "--yes"], ["get", "nope"]):
        result = grpo(control_plane, namespace, *args)
        assert result.exit_code == 1, (args, result.output)
        assert f"GRPORun nope in namespace {namespace} not found" in result.output, (args, result.output)
        assert "Traceback" not in result.output


def test_wait_exit_codes_by_outcome(control_plane: ControlPlane, objects: CustomObjectsApi, namespace: str) -> None:
    create(objects, namespace, valid_run("w"))
    set_status(objects, namespace, "w", training())
    started = time.monotonic()
    timed_out = grpo(control_plane, namespace, "wait", "w", "--timeout", "2s")
    assert timed_out.exit_code == 4 and "timed out after 2s" in timed_out.output, timed_out.output
    assert 2 <= time.monotonic() - started < 15
    assert grpo(control_plane, namespace, "wait", "w", "--for", "condition=ServerReady").exit_code == 0
    assert grpo(control_plane, namespace, "wait", "w", "--timeout", "0").exit_code == 4

    set_status(objects, namespace, "w", {"phase": "Failed", "reason": "BackoffLimitExceeded", "message": "3 attempts"})
    failed = grpo(control_plane, namespace, "wait", "w", "--timeout", "30s")
    assert failed.exit_code == 3 and "failed: Failed (BackoffLimitExceeded): 3 attempts" in failed.output
    assert grpo(control_plane, namespace, "wait", "w", "--for", "Failed").exit_code == 0

    set_status(objects, namespace, "w", succeeded())
    assert grpo(control_plane, namespace, "wait", "w").exit_code == 0
    assert grpo(control_plane, namespace, "wait", "w", "--for", "Suspended").exit_code == 5
    bad = grpo(control_plane, namespace, "wait", "w", "--for", "Done")
    assert bad.exit_code == 2 and "unknown phase 'Done'" in bad.output


def test_wait_watches_the_run_to_its_outcome(control_plane: ControlPlane, objects: CustomObjectsApi,
                                             namespace: str) -> None:
    create(objects, namespace, valid_run("later"))
    set_status(objects, namespace, "later", training(3))

    def finish() -> None:
        time.sleep(2)
        set_status(objects, namespace, "later", training(20))
        time.sleep(1)
        set_status(objects, namespace, "later", succeeded())

    writer = threading.Thread(target=finish)
    writer.start()
    started = time.monotonic()
    result = grpo(control_plane, namespace, "wait", "later", "--timeout", "60s")
    writer.join()
    assert result.exit_code == 0, result.output
    assert f"GRPORun later in namespace {namespace} reached phase Succeeded" in result.output
    assert time.monotonic() - started < 10  # a watch answers at once, no long poll

    def delete() -> None:
        time.sleep(1.5)
        objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gone")

    create(objects, namespace, valid_run("gone"))
    deleter = threading.Thread(target=delete)
    deleter.start()
    deleted = grpo(control_plane, namespace, "wait", "gone", "--timeout", "60s")
    deleter.join()
    assert deleted.exit_code == 1 and "was deleted while waiting" in deleted.output, deleted.output


def test_logs_says_there_is_no_pod_yet_then_that_it_has_not_started(
    control_plane: ControlPlane, objects: CustomObjectsApi, namespace: str
) -> None:
    from kubernetes import client

    create(objects, namespace, valid_run("l"))
    none = grpo(control_plane, namespace, "logs", "l")
    assert none.exit_code == 1
    assert f"no trainer pod of GRPORun l in namespace {namespace} yet" in none.output
    with control_plane.api_client() as api:
        client.CoreV1Api(api).create_namespaced_pod(namespace, {
            "metadata": {"name": "l-server-x", "labels": {"grpo.dev/run": "l", "grpo.dev/component": "server",
                                                          "grpo.dev/attempt": "1"}},
            "spec": {"containers": [{"name": "server", "image": "busybox"}]},
        })
    pending = grpo(control_plane, namespace, "logs", "l", "--server")
    assert pending.exit_code == 1
    assert f"server pod l-server-x of GRPORun l in namespace {namespace} has not started yet (Pending" \
        in pending.output
    assert "no trainer pod" in grpo(control_plane, namespace, "logs", "l", "--trainer").output


def test_suspend_and_resume_set_the_run_policy_field(control_plane: ControlPlane, objects: CustomObjectsApi,
                                                     namespace: str) -> None:
    create(objects, namespace, valid_run("s"))
    set_status(objects, namespace, "s", training())

    def suspend_field() -> Any:
        return objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "s")["spec"]["runPolicy"]

    done = grpo(control_plane, namespace, "suspend", "s")
    assert done.exit_code == 0 and "spec.runPolicy.suspend set to true" in done.output, done.output
    assert suspend_field()["suspend"] is True and suspend_field()["backoffLimit"] == 2  # merged, not replaced
    again = grpo(control_plane, namespace, "suspend", "s")
    assert again.exit_code == 0 and "already suspended" in again.output
    assert "the operator has not suspended it yet" in grpo(control_plane, namespace, "status", "s").output
    resumed = grpo(control_plane, namespace, "resume", "s")
    assert resumed.exit_code == 0 and suspend_field()["suspend"] is False, resumed.output

    set_status(objects, namespace, "s", succeeded())
    ended = grpo(control_plane, namespace, "suspend", "s")
    assert ended.exit_code == 1 and "has ended (Succeeded): there is nothing to suspend" in ended.output


def test_cancel_deletes_the_run_only_when_confirmed(control_plane: ControlPlane, objects: CustomObjectsApi,
                                                    namespace: str) -> None:
    from kubernetes.client.exceptions import ApiException

    create(objects, namespace, valid_run("c"))
    declined = grpo(control_plane, namespace, "cancel", "c", input="n\n")
    assert declined.exit_code == 1 and "Delete GRPORun c" in declined.output and "claim c-data" in declined.output
    objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "c")  # still there
    confirmed = grpo(control_plane, namespace, "cancel", "c", input="y\n")
    assert confirmed.exit_code == 0 and f"deleted GRPORun c in namespace {namespace}" in confirmed.output
    with pytest.raises(ApiException) as gone:
        objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "c")
    assert gone.value.status == 404


def test_pull_names_the_pod_that_does_not_start_and_deletes_it(
    control_plane: ControlPlane, objects: CustomObjectsApi, namespace: str, tmp_path: Path
) -> None:
    create(objects, namespace, valid_run("p"))
    dest = tmp_path / "adapter"
    result = grpo(control_plane, namespace, "pull", "p", str(dest), "--start-timeout", "2", "--image", "trainer:x")
    assert result.exit_code == 1
    assert f"namespace {namespace} did not start within 2s" in result.output and "pull pod" in result.output
    assert not dest.exists()
    pods = json.loads(control_plane.kubectl("get", "pods", "-n", namespace, "-o", "json", check=True).stdout)
    assert all(p["metadata"].get("deletionTimestamp") for p in pods["items"]), pods["items"]


def test_the_kubeconfig_context_gives_the_namespace_and_forbidden_is_named(
    control_plane: ControlPlane, objects: CustomObjectsApi, namespace: str, tmp_path: Path
) -> None:
    from kubernetes import client

    create(objects, namespace, valid_run("ctx"))
    config = json.loads(control_plane.kubeconfig.read_text())
    config["contexts"].append({"name": "team", "context": {**config["contexts"][0]["context"], "namespace": namespace}})
    with control_plane.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
        token = core.create_namespaced_service_account_token(
            "nobody", namespace, {"spec": {"expirationSeconds": 600}}
        ).status.token
    config["users"].append({"name": "nobody", "user": {"token": token}})
    config["contexts"].append({"name": "nobody", "context": {"cluster": config["clusters"][0]["name"],
                                                             "user": "nobody", "namespace": namespace}})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps(config))

    def run(*args: str) -> Result:
        return CliRunner().invoke(cli, [*args, "--kubeconfig", str(kubeconfig)])

    mine = run("get", "--context", "team")
    assert mine.exit_code == 0 and "ctx" in mine.output, mine.output
    assert "ctx" not in run("get").output  # the current context's namespace is default
    forbidden = run("status", "ctx", "--context", "nobody")
    assert forbidden.exit_code == 1 and "Traceback" not in forbidden.output
    assert f"cannot read GRPORun ctx in namespace {namespace}: 403" in forbidden.output
    assert f"this needs: get grporuns in namespace {namespace}" in forbidden.output
