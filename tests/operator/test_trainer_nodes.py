"""A trainer of several pods (spec.trainer.numNodes > 1): an Indexed Job per attempt, and the headless
Service whose subdomain gives its pods the DNS names of the torch.distributed rendezvous.

Real API server and Job controller, real operator process; the tests play the kubelet (no scheduler
runs: the pods stay Pending until a test marks them terminated).
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from grpo_api.exit_codes import EXIT_INVALID_SPEC
from grpo_api.lifecycle import TrainerState
from grpo_api.models import GRPORun, GRPORunStatus
from grpo_operator import reconcile
from grpo_operator.children import Children, JobInfo, pod_info
from tests.fixtures.server import RunningServer
from tests.fixtures.waiting import wait_for
from tests.operator.conftest import Kube, OperatorProcess

pytestmark = pytest.mark.controlplane


def job_pods(kube: Kube, job: str, count: int) -> list[Any]:
    """The Job's pods, by completion index, once the Job controller created them all."""
    found: list[Any] = wait_for(
        lambda: len(p := kube.core.list_namespaced_pod(kube.namespace, label_selector=f"job-name={job}").items)
        == count and p,
        timeout=30, what=f"the Job controller to create the {count} pods of {job}")
    return sorted(found, key=lambda p: int(p.metadata.annotations["batch.kubernetes.io/job-completion-index"]))


def env_of(job: Any) -> dict[str, str | None]:
    return {e.name: e.value for e in job.spec.template.spec.containers[0].env}


def assert_indexed(kube: Kube, run: str, attempt: int) -> None:
    name = f"{run}-trainer-{attempt}"
    job = wait_for(lambda: kube.job(name), what=f"trainer Job {name}")
    assert job.spec.completion_mode == "Indexed"
    assert job.spec.completions == job.spec.parallelism == 2 and job.spec.backoff_limit == 0
    assert job.spec.template.spec.subdomain == f"{run}-trainer"
    env = env_of(job)
    assert env["GRPO_MASTER_ADDR"] == f"{name}-0.{run}-trainer" and env["GRPO_MASTER_PORT"] == "29500"
    pods = job_pods(kube, name, 2)
    # The Job controller names each pod's host by its index: <job>-0 is the rendezvous host.
    assert [(p.spec.hostname, p.spec.subdomain) for p in pods] == [
        (f"{name}-0", f"{run}-trainer"), (f"{name}-1", f"{run}-trainer")]


def test_two_trainer_pods_get_an_indexed_job_and_their_rendezvous_service_comes_back_when_deleted(
    operator: OperatorProcess, kube: Kube, tiny_server: RunningServer
) -> None:
    run = kube.create_run("nodes", server_url=tiny_server.url, trainer={"numNodes": 2, "numProcPerNode": 2})
    uid = run["metadata"]["uid"]
    kube.wait_phase("nodes", "Training")
    assert_indexed(kube, "nodes", 1)

    service = kube.service("nodes-trainer")
    assert service is not None
    assert [(r.kind, r.uid, r.controller) for r in service.metadata.owner_references] == [("GRPORun", uid, True)]
    assert service.spec.cluster_ip == "None" and service.spec.publish_not_ready_addresses is True
    assert service.spec.selector == {"grpo.dev/run": "nodes", "grpo.dev/component": "trainer"}
    assert [(p.name, p.port, p.protocol) for p in service.spec.ports] == [("rendezvous", 29500, "TCP")]

    again = kube.delete_service_and_see_it_restored("nodes", "nodes-trainer")
    assert again.spec.cluster_ip == "None"
    status = kube.status("nodes")
    assert status["phase"] == "Training" and status["attempt"] == 1, "a missing Service ends no attempt"
    assert [j.metadata.name for j in kube.jobs("nodes")] == ["nodes-trainer-1"]


def test_one_failed_trainer_pod_fails_the_attempt_and_the_next_attempt_is_indexed_too(
    operator: OperatorProcess, kube: Kube
) -> None:
    # Colocate mode: the next attempt needs no fresh server, so its trainer Job follows at once.
    kube.create_run("fail", mode="colocate", server=None, trainer={"numNodes": 2}, runPolicy={"backoffLimit": 1})
    kube.wait_phase("fail", "Training")
    assert_indexed(kube, "fail", 1)
    service = kube.service("fail-trainer")
    assert service is not None

    # Rank 1 dies; rank 0 is still pending: backoffLimit 0 fails the whole Job, hence the attempt.
    first, second = job_pods(kube, "fail-trainer-1", 2)
    kube.terminate_pod(second.metadata.name, "trainer", 1, "rank 1: connection to the rendezvous lost")
    status = wait_for(lambda: (s := kube.status("fail")).get("attempt") == 2 and s,
                      timeout=30, what=f"attempt 2 (now {kube.status('fail')})")
    assert status["failedAttempts"] == 1
    assert_indexed(kube, "fail", 2)
    failed = [c for c in kube.job("fail-trainer-1").status.conditions or [] if c.type == "Failed"]
    assert [c.reason for c in failed] == ["BackoffLimitExceeded"]
    wait_for(lambda: ("Warning", "TrainerFailed") in kube.events("fail"), what="a TrainerFailed event")
    message = next(e.message for e in kube.core.list_namespaced_event(
        kube.namespace, field_selector="involvedObject.name=fail").items if e.reason == "TrainerFailed")
    assert f"pod {second.metadata.name}: exit code 1" in message, message
    # The Job controller stopped the rank still running (pending here) when the Job failed.
    wait_for(lambda: kube._read(kube.core.read_namespaced_pod, first.metadata.name) is None,
             timeout=30, what=f"rank 0's pod {first.metadata.name} deleted")
    again = kube.service("fail-trainer")
    assert again is not None and again.metadata.uid == service.metadata.uid, "one Service for every attempt"


def _pod(name: str, *, code: int | None, terminating: bool, message: str = "", created: str) -> Any:
    status: dict[str, Any] = {"phase": "Pending"}
    if code is not None:
        terminated = {"exitCode": code, "reason": "Error", "message": message}
        status = {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}]}
    meta: dict[str, Any] = {"name": name, "creationTimestamp": created,
                            "labels": {"grpo.dev/component": "trainer", "job-name": "r-trainer-1",
                                       "grpo.dev/attempt": "1"}}
    if terminating:
        meta["deletionTimestamp"] = created
    return pod_info({"metadata": meta, "status": status})


def test_the_pod_that_failed_by_itself_is_named_before_ranks_the_job_controller_stopped() -> None:
    failed = _pod("r-trainer-1-0-aaaaa", code=1, terminating=False, message="oom", created="2030-01-01T00:00:00Z")
    stopped = _pod("r-trainer-1-1-bbbbb", code=143, terminating=True, message="SIGTERM",
                   created="2030-01-01T00:00:01Z")
    children = Children(trainer_pods=(stopped, failed))
    assert children.trainer_problem("r-trainer-1").startswith("pod r-trainer-1-0-aaaaa: exit code 1")


def test_a_trainer_failed_on_the_invalid_spec_code_is_reported_in_the_words_of_the_pod_that_exited_with_it() -> None:
    said = "spec.dataset: line 3: not valid JSON"
    rank0 = _pod("r-trainer-1-0-aaaaa", code=EXIT_INVALID_SPEC, terminating=False, message=said,
                 created="2030-01-01T00:00:00Z")
    rank1 = _pod("r-trainer-1-1-bbbbb", code=1, terminating=False, message="torch.distributed: worker failed",
                 created="2030-01-01T00:00:01Z")
    job = JobInfo(name="r-trainer-1", owner="uid-1", attempt=1, state=TrainerState.FAILED,
                  message="PodFailurePolicy: exit code 2", reason="PodFailurePolicy")
    children = Children(jobs=(job,), trainer_pods=(rank1, rank0))
    run = GRPORun.model_validate({
        "metadata": {"name": "r", "namespace": "team", "uid": "uid-1"},
        "spec": {"model": {"name": "tiny", "path": "/models/tiny"}, "dataset": {"path": "/data/p.jsonl"},
                 "rewards": [{"function": "token_fraction"}], "trainer": {"numNodes": 2}},
    })
    status = GRPORunStatus.model_validate({"phase": "Training", "attempt": 1})
    # The index has the Job: no API call is made (no runtime needed).
    assert reconcile.trainer_state(cast(Any, None), run, status, children) == (TrainerState.FAILED, said, True, False)
