"""The run lifecycle end to end: real API server, real operator process, real `grpo serve` processes.

The tests play the kubelet (trainer pods are marked Succeeded/Failed; the Job controller does
the rest) and stand in for the server pod with `grpo serve` processes on loopback, reached via
the run's `grpo.dev/server-url` annotation. A new attempt needs a new server process (new boot id).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.server import RunningServer
from tests.fixtures.waiting import consistently, wait_for
from tests.operator.conftest import Kube, OperatorProcess

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

UNREACHABLE = "http://127.0.0.1:9"
ServerFactory = Callable[..., RunningServer]


@pytest.fixture
def start_server(server_factory: ServerFactory, tiny_model_dir: Path) -> Callable[[], RunningServer]:
    """A new `grpo serve` process on the tiny model: a fresh boot id each call."""
    return lambda: server_factory(tiny_model_dir)


def boot_id(server: RunningServer) -> str:
    value: str = server.health()["boot_id"]
    return value


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions", [])}


def pod_attempts(kube: Kube, run: str) -> list[str]:
    return sorted((p.metadata.annotations or {}).get("grpo.dev/attempt", "?") for p in kube.server_pods(run))


def test_failed_trainer_retries_with_a_fresh_server_and_success_stops_the_server(
    operator: OperatorProcess, kube: Kube, start_server: Callable[[], RunningServer]
) -> None:
    first = start_server()
    kube.create_run("r", server_url=first.url, runPolicy={"backoffLimit": 1})
    status = kube.wait_phase("r", "Training")
    assert status["server"]["bootId"] == boot_id(first) and status["server"]["ready"] is True
    assert conditions(status)["ServerReady"]["status"] == "True"
    assert [j.metadata.name for j in kube.jobs("r")] == ["r-trainer-1"]

    kube.finish_trainer("r-trainer-1", succeeded=False)
    status = kube.wait_phase("r", "StartingServer")
    assert status["attempt"] == 2 and status["failedAttempts"] == 1
    # The server template carries the new attempt, so its pod is replaced: the old one goes first.
    wait_for(lambda: pod_attempts(kube, "r") == ["2"], timeout=30,
             what=f"only attempt-2 server pods (now {pod_attempts(kube, 'r')})")
    assert kube.deployment("r-server").spec.template.metadata.annotations["grpo.dev/attempt"] == "2"
    # The old process still answers with the boot id of attempt 1: no trainer for attempt 2.
    consistently(lambda: kube.job("r-trainer-2") is None, 3, what="no trainer Job of attempt 2 (old boot id)")
    assert "earlier attempt" in kube.status("r")["message"]

    second = start_server()
    assert boot_id(second) != boot_id(first)
    kube.set_server_url("r", second.url)
    status = kube.wait_phase("r", "Training")
    assert status["attempt"] == 2 and status["server"]["bootId"] == boot_id(second)
    wait_for(lambda: kube.job("r-trainer-2"), what="trainer Job of attempt 2")

    kube.finish_trainer("r-trainer-2", succeeded=True)
    status = kube.wait_phase("r", "Succeeded", reason="Completed")
    assert status["completionTime"] and conditions(status)["Succeeded"]["status"] == "True"
    wait_for(lambda: kube.deployment("r-server").spec.replicas == 0, what="server scaled to 0")
    assert status["failedAttempts"] == 1
    run = kube.run("r")
    assert run is not None and "grpo.dev/failed-attempts" not in (run["metadata"].get("annotations") or {})
    expected = [("Warning", "TrainerFailed"), ("Warning", "Retrying"), ("Normal", "Completed")]
    # events are posted right after the status they follow: wait for them, do not race them
    wait_for(lambda: all(e in kube.events("r") for e in expected), what=f"events {expected}")
    assert sorted(j.metadata.name for j in kube.jobs("r")) == ["r-trainer-1", "r-trainer-2"]


def test_backoff_limit_exhausted_fails_the_run(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    server = tiny_server
    kube.create_run("r", server_url=server.url, runPolicy={"backoffLimit": 0})
    kube.wait_phase("r", "Training")
    kube.finish_trainer("r-trainer-1", succeeded=False)
    status = kube.wait_phase("r", "Failed", reason="BackoffLimitExceeded")
    assert status["attempt"] == 1 and conditions(status)["Failed"]["status"] == "True"
    assert status["failedAttempts"] == 1
    assert "exit code 1 (Error)" in status["message"], "the trainer pod's exit is surfaced on the run"
    wait_for(lambda: kube.deployment("r-server").spec.replicas == 0, what="server scaled to 0")

    def still_failed_with_one_trainer() -> bool:
        assert kube.status("r")["phase"] == "Failed", "terminal phases stay terminal"
        assert [j.metadata.name for j in kube.jobs("r")] == ["r-trainer-1"]
        return True

    consistently(still_failed_with_one_trainer, 2, what="the failed run")


def test_a_trainer_exiting_with_the_invalid_spec_code_fails_the_run_at_once_without_another_server(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    """Exit code 2 (grpo_api.exit_codes.EXIT_INVALID_SPEC): the Job's podFailurePolicy fails it, and the run
    fails as InvalidSpec in the trainer's words with its backoff budget unspent: no second attempt, no
    restarted server (each would cost a GPU server for a problem no retry fixes)."""
    kube.create_run("r", server_url=tiny_server.url, runPolicy={"backoffLimit": 3})
    kube.wait_phase("r", "Training")
    said = "spec.dataset: /data/prompts.jsonl line 3: not valid JSON: Expecting property name enclosed in double quotes"
    kube.finish_job_pods("r-trainer-1", "trainer", 2, said)

    status = kube.wait_phase("r", "Failed", reason="InvalidSpec")
    assert status["attempt"] == 1 and status["failedAttempts"] == 1, status
    assert said in status["message"] and "no retry fixes" in status["message"], status["message"]
    assert conditions(status)["Failed"]["reason"] == "InvalidSpec"
    failed = [c for c in kube.job("r-trainer-1").status.conditions or [] if c.type == "Failed"]
    assert [c.reason for c in failed] == ["PodFailurePolicy"], "the Job's own podFailurePolicy failed it"
    wait_for(lambda: kube.deployment("r-server").spec.replicas == 0, what="server scaled to 0")
    wait_for(lambda: ("Warning", "InvalidSpec") in kube.events("r"), what="InvalidSpec event")

    def nothing_new() -> bool:
        assert kube.status("r")["phase"] == "Failed"
        assert [j.metadata.name for j in kube.jobs("r")] == ["r-trainer-1"]
        assert kube.deployment("r-server").spec.template.metadata.annotations["grpo.dev/attempt"] == "1"
        assert pod_attempts(kube, "r") in ([], ["1"]), "no server pod of a second attempt"
        reasons = [reason for _, reason in kube.events("r")]
        assert "Retrying" not in reasons and "TrainerFailed" not in reasons, reasons
        return True

    consistently(nothing_new, 3, what="nothing new over several reconciles")


def test_server_that_never_gets_healthy_fails_with_server_not_ready(operator: OperatorProcess, kube: Kube) -> None:
    kube.create_run("r", server_url=UNREACHABLE, runPolicy={"backoffLimit": 0, "serverReadyTimeoutSeconds": 3})
    status = kube.wait_phase("r", "Failed", reason="ServerNotReady", timeout=30)
    assert "serverReadyTimeoutSeconds" in status["message"]
    assert kube.jobs("r") == []
    wait_for(lambda: ("Warning", "ServerNotReady") in kube.events("r"), what="ServerNotReady event")


def test_suspend_stops_trainer_and_server_and_resume_continues_with_a_fresh_server(
    operator: OperatorProcess, kube: Kube, start_server: Callable[[], RunningServer]
) -> None:
    first = start_server()
    kube.create_run("r", server_url=first.url)
    kube.wait_phase("r", "Training")
    wait_for(lambda: kube.job("r-trainer-1"), what="trainer Job")

    kube.patch_run("r", {"spec": {"runPolicy": {"suspend": True}}})
    status = kube.wait_phase("r", "Suspended", timeout=20)
    assert conditions(status)["Suspended"]["status"] == "True"
    wait_for(lambda: kube.job("r-trainer-1") is None, what="trainer Job deleted")
    wait_for(lambda: kube.deployment("r-server").spec.replicas == 0, what="server scaled to 0")
    assert kube.core.read_namespaced_persistent_volume_claim("r-data", kube.namespace).metadata.deletion_timestamp \
        is None

    kube.patch_run("r", {"spec": {"runPolicy": {"suspend": False}}})
    status = kube.wait_phase("r", "StartingServer", timeout=20)
    assert status["attempt"] == 2 and status["reason"] in ("Resumed", "ServerStarting")
    assert conditions(status)["Suspended"]["status"] == "False"
    second = start_server()
    kube.set_server_url("r", second.url)
    status = kube.wait_phase("r", "Training")
    assert status["server"]["bootId"] == boot_id(second)
    wait_for(lambda: kube.job("r-trainer-2"), what="trainer Job of attempt 2")
    assert kube.deployment("r-server").spec.replicas == 1
    assert status["attempt"] == 2 and status["failedAttempts"] == 0, "a suspended attempt is no failure"


def test_active_deadline_fails_the_run_and_removes_its_trainer(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    server = tiny_server
    kube.create_run("r", server_url=server.url)
    started = kube.wait_phase("r", "Training")["startTime"]
    wait_for(lambda: kube.job("r-trainer-1"), what="trainer Job of attempt 1")
    # the deadline, set once the run trains (how long it took to get there depends on the machine): 3 s from now
    elapsed = (dt.datetime.now(dt.UTC) - dt.datetime.fromisoformat(started.replace("Z", "+00:00")))
    kube.patch_run("r", {"spec": {"runPolicy": {"activeDeadlineSeconds": math.ceil(elapsed.total_seconds()) + 3}}})
    status = kube.wait_phase("r", "Failed", reason="DeadlineExceeded", timeout=30)
    assert status["completionTime"]
    wait_for(lambda: kube.job("r-trainer-1") is None, what="trainer Job deleted")
    wait_for(lambda: kube.deployment("r-server").spec.replicas == 0, what="server scaled to 0")


def test_ttl_after_finished_deletes_the_run_and_its_children(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    server = tiny_server
    kube.create_run("r", server_url=server.url, runPolicy={"ttlSecondsAfterFinished": 2})
    kube.wait_phase("r", "Training")
    kube.finish_trainer("r-trainer-1", succeeded=True)
    kube.wait_phase("r", "Succeeded")
    wait_for(lambda: kube.run("r") is None, timeout=30, what="run deleted after its TTL")
    wait_for(lambda: kube.deployment("r-server") is None and kube.jobs("r") == [], timeout=30,
             what="children garbage-collected")


def test_deleting_a_run_garbage_collects_its_children(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    server = tiny_server
    kube.create_run("r", server_url=server.url)
    kube.wait_phase("r", "Training")
    wait_for(lambda: kube.job("r-trainer-1"), what="trainer Job")
    kube.custom.delete_namespaced_custom_object("grpo.dev", "v1alpha1", kube.namespace, "grporuns", "r")
    wait_for(lambda: kube.run("r") is None, timeout=30, what="run deleted (operator releases its finalizer)")

    def gone() -> bool:
        ns = kube.namespace
        selector = "grpo.dev/run=r"
        leftovers = (
            kube.apps.list_namespaced_deployment(ns, label_selector=selector).items
            + kube.batch.list_namespaced_job(ns, label_selector=selector).items
            + kube.core.list_namespaced_service(ns, label_selector=selector).items
            + kube.core.list_namespaced_config_map(ns, label_selector=selector).items
            + kube.core.list_namespaced_secret(ns, label_selector=selector).items
            + kube.networking.list_namespaced_network_policy(ns, label_selector=selector).items
        )
        # No pvc-protection controller runs here, so a claim can only get as far as Terminating.
        claims = kube.core.list_namespaced_persistent_volume_claim(ns, label_selector=selector).items
        return not leftovers and all(c.metadata.deletion_timestamp is not None for c in claims)

    wait_for(gone, timeout=60, what="the garbage collector to delete every child")


def test_operator_restart_mid_run_creates_no_duplicates_and_the_run_continues(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    kube.create_run("r", server_url=UNREACHABLE)
    kube.wait_phase("r", "StartingServer", reason="ServerStarting")
    operator.stop()
    kube.set_server_url("r", tiny_server.url)
    operator.start()
    kube.wait_phase("r", "Training")
    wait_for(lambda: kube.job("r-trainer-1"), what="trainer Job")

    operator.restart()

    def no_duplicates() -> bool:
        assert [j.metadata.name for j in kube.jobs("r")] == ["r-trainer-1"]
        deployments = kube.apps.list_namespaced_deployment(kube.namespace, label_selector="grpo.dev/run=r").items
        assert [d.metadata.name for d in deployments] == ["r-server"]
        assert len(kube.core.list_namespaced_config_map(kube.namespace, label_selector="grpo.dev/run=r").items) == 1
        status = kube.status("r")
        assert status["phase"] == "Training" and status["attempt"] == 1
        return True

    consistently(no_duplicates, 3, what="no duplicate child over several reconciles by the new process")

    operator.stop()
    kube.finish_trainer("r-trainer-1", succeeded=True)
    operator.start()
    kube.wait_phase("r", "Succeeded")
    assert operator.starts == 4
