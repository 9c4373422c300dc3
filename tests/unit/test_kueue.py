"""Kueue's admission of a run, the pure part (grpo_operator.kueue): the labels read, the Workload built (one pod set
for the server, one for the trainer), Kueue's answer read from its conditions, where the admission puts the pods,
and what the operator writes back (an eviction acknowledged, the run's end)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from grpo_api.lifecycle import AdmissionState
from grpo_api.models import GRPORun, Reason
from grpo_operator import builders as b
from grpo_operator import kueue
from tests.fixtures.child_manifests import make_run

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
GPU = {"limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}}


def labelled(queue: str | None = "team-a", priority: str | None = None, **spec: Any) -> GRPORun:
    run = make_run(**spec)
    labels = {kueue.QUEUE_LABEL: queue} if queue is not None else {}
    if priority is not None:
        labels[kueue.PRIORITY_CLASS_LABEL] = priority
    run.metadata.labels = labels
    return run


def condition(type_: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T11:00:00Z"}


def workload(*conditions: dict[str, Any], admission: dict[str, Any] | None = None, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "grporun-r1-abcde", "resourceVersion": "7", "generation": 1},
        "spec": {"queueName": "team-a", "active": True},
        "status": {"conditions": list(conditions), **({"admission": admission} if admission else {}), **status},
    }


ADMISSION = {"clusterQueue": "gpus", "podSetAssignments": [
    {"name": "server", "flavors": {"nvidia.com/gpu": "a100", "cpu": "a100"}, "count": 1},
    {"name": "trainer", "flavors": {"nvidia.com/gpu": "h100"}, "count": 2},
]}
ADMITTED = (condition("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue gpus"),
            condition("Admitted", "True", "Admitted", "The workload is admitted"))
PREEMPTED = condition("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: u2)")


# -------------------------------------------------------------------------------------------- the labels


def test_without_the_queue_label_kueue_has_no_say() -> None:
    assert kueue.queue_request(labelled(queue=None, priority="high")) is None


def test_the_labels_name_the_local_queue_and_the_priority_class() -> None:
    assert kueue.queue_request(labelled("team-a", "high")) == kueue.QueueRequest("team-a", "high")


@pytest.mark.parametrize(("queue", "priority", "named"), [
    ("Team_A", None, kueue.QUEUE_LABEL), ("team-a", "High", kueue.PRIORITY_CLASS_LABEL),
    ("-a", None, kueue.QUEUE_LABEL)])
def test_a_label_value_no_kueue_object_can_have_is_refused_naming_the_label(
    queue: str, priority: str | None, named: str
) -> None:
    with pytest.raises(b.InvalidRunError, match=rf"metadata.labels\[{named}\]"):
        kueue.queue_request(labelled(queue, priority))


def test_the_workload_is_named_as_jobframework_names_one() -> None:
    name = kueue.workload_name(make_run("r" * 48))
    assert name.startswith("grporun-" + "r" * 48 + "-") and len(name) == 62
    assert kueue.workload_name(make_run("r1")) != kueue.workload_name(make_run("r2"))


# ------------------------------------------------------------------------------------------ the Workload


def test_the_workload_admits_server_and_trainer_together_as_two_pod_sets() -> None:
    run = labelled(server={"replicas": 2, "resources": GPU},
                   trainer={"numNodes": 2, "resources": {"requests": {"cpu": "2"}, "limits": GPU["limits"]}},
                   scheduling={"nodeSelector": {"pool": "gpu"},
                               "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    wl = kueue.build_workload(run, kueue.QueueRequest("team-a"), kueue.Priority("high", 1000), b.Images())
    assert (wl["apiVersion"], wl["kind"], wl["metadata"]["name"]) == (
        "kueue.x-k8s.io/v1beta2", "Workload", kueue.workload_name(run))
    assert wl["metadata"]["ownerReferences"] == [b.owner_reference(run)]
    assert wl["metadata"]["labels"][kueue.JOB_UID_LABEL] == "uid-1" and wl["metadata"]["labels"][b.RUN_LABEL] == "r1"
    spec = wl["spec"]
    assert (spec["queueName"], spec["active"], spec["priority"]) == ("team-a", True, 1000)
    assert spec["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}
    server, trainer = spec["podSets"]
    assert (server["name"], server["count"], trainer["name"], trainer["count"]) == ("server", 2, "trainer", 2)
    (container,) = server["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == GPU["limits"], "a limit without a request is the request"
    (container,) = trainer["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {**GPU["limits"], "cpu": "2"}, "a request stays as it is"
    for pod_set in (server, trainer):
        pod = pod_set["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "gpu"}
        assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert "volumes" not in pod and "env" not in pod["containers"][0], "Kueue reads resources and placement only"


def test_a_colocate_run_is_one_pod_set_and_a_suspended_one_an_inactive_workload() -> None:
    run = labelled(mode="colocate", runPolicy={"suspend": True})
    wl = kueue.build_workload(run, kueue.QueueRequest("team-a"), None, b.Images())
    assert [ps["name"] for ps in wl["spec"]["podSets"]] == ["trainer"]
    assert wl["spec"]["active"] is False and "priority" not in wl["spec"]


# ---------------------------------------------------------------------------------------- Kueue's answer


REQUEST = kueue.QueueRequest("team-a")


def test_kueues_answer_is_read_from_the_workloads_conditions() -> None:
    waiting = kueue.admission_of(workload(condition("QuotaReserved", "False", "Pending",
                                                    "couldn't assign flavors to pod set trainer")), REQUEST)
    assert waiting.state == AdmissionState.WAITING and "couldn't assign flavors" in waiting.message
    assert kueue.admission_of(workload(), REQUEST).message == "Workload grporun-r1-abcde queued in LocalQueue team-a"
    admitted = kueue.admission_of(workload(*ADMITTED, admission=ADMISSION), REQUEST)
    assert (admitted.state, admitted.message) == (
        AdmissionState.ADMITTED, "Workload grporun-r1-abcde in ClusterQueue gpus")
    evicted = kueue.admission_of(workload(*ADMITTED, PREEMPTED, admission=ADMISSION), REQUEST)
    assert evicted.state == AdmissionState.EVICTED and evicted.message.startswith("Preempted: Preempted to accommodate")


def test_missing_objects_the_labels_name_are_said_with_the_label() -> None:
    queue = kueue.queue_not_found(REQUEST, "ns")
    assert queue.waiting_reason == Reason.QUEUE_NOT_FOUND and kueue.QUEUE_LABEL in queue.message
    priority = kueue.priority_class_not_found(kueue.QueueRequest("team-a", "high"))
    assert priority.waiting_reason == Reason.PRIORITY_CLASS_NOT_FOUND and kueue.PRIORITY_CLASS_LABEL in priority.message


FLAVORS = {
    "a100": {"spec": {"nodeLabels": {"gpu": "a100"},
                      "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
    "h100": {"spec": {"nodeLabels": {"gpu": "h100", "zone": "b"}}},
}


def test_the_admission_places_each_pod_set_on_its_flavors_nodes_with_the_checks_updates() -> None:
    wl = workload(*ADMITTED, admission=ADMISSION, admissionChecks=[
        {"name": "prov", "state": "Ready", "message": "", "podSetUpdates": [
            {"name": "trainer", "labels": {"team": "a"}, "annotations": {"note": "x"},
             "tolerations": [{"key": "spot", "operator": "Exists"}]}]}])
    assert kueue.assigned_flavors(wl) == ["a100", "h100"]
    placements = kueue.admitted_placements(wl, FLAVORS)
    server, trainer = placements["server"], placements["trainer"]
    assert server.node_selector == {"gpu": "a100"}
    assert server.tolerations == (FLAVORS["a100"]["spec"]["tolerations"][0],)
    assert trainer.node_selector == {"gpu": "h100", "zone": "b"}
    assert trainer.tolerations == ({"key": "spot", "operator": "Exists"},)
    assert (trainer.labels, trainer.annotations) == ({"team": "a"}, {"note": "x"})

    run = labelled(scheduling={"nodeSelector": {"pool": "gpu"}})
    job = b.build_trainer_job(run, 1, placement=b.Placement(admitted=trainer))
    pod = job["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu", "gpu": "h100", "zone": "b"}
    assert pod["spec"]["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert pod["metadata"]["labels"]["team"] == "a" and pod["metadata"]["annotations"]["note"] == "x"
    deployment = b.build_server_deployment(run, 1, 1, placement=b.Placement(admitted=server))
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu", "gpu": "a100"}
    init = b.build_initializer_job(run, admitted=trainer)
    assert init["spec"]["template"]["spec"]["nodeSelector"]["gpu"] == "h100"


def test_a_flavor_that_contradicts_the_runs_node_selector_is_refused_naming_the_field() -> None:
    run = labelled(scheduling={"nodeSelector": {"gpu": "t4"}})
    with pytest.raises(b.InvalidRunError, match=r"spec.scheduling.nodeSelector has gpu=t4"):
        b.build_trainer_job(run, 1, placement=b.Placement(admitted=b.Admitted(node_selector={"gpu": "h100"})))


# ------------------------------------------------------------------------------------ what goes back


def test_an_eviction_is_acknowledged_only_once_the_runs_pods_are_gone() -> None:
    evicted = workload(*ADMITTED, PREEMPTED, admission=ADMISSION)
    assert kueue.status_patch(evicted, finished=None, pods_gone=False, now=NOW) is None
    patch = kueue.status_patch(evicted, finished=None, pods_gone=True, now=NOW)
    assert patch is not None and patch["metadata"] == {"resourceVersion": "7"}
    status = patch["status"]
    assert status["admission"] is None, "the quota goes back"
    conds = {c["type"]: c for c in status["conditions"]}
    assert (conds["QuotaReserved"]["status"], conds["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert (conds["Admitted"]["status"], conds["Admitted"]["reason"]) == ("False", "NoReservation")
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Preempted"), "Kueue queues it again"
    assert conds["Evicted"]["status"] == "True", "Kueue resets it when it admits the Workload again"

    acknowledged = workload(*(c for c in status["conditions"]))
    assert kueue.status_patch(acknowledged, finished=None, pods_gone=True, now=NOW) is None, "once"


def test_a_deactivated_workload_is_not_requeued_by_its_acknowledgement() -> None:
    deactivated = workload(*ADMITTED, condition("Evicted", "True", "Deactivated", "The workload is deactivated"),
                           admission=ADMISSION)
    patch = kueue.status_patch(deactivated, finished=None, pods_gone=True, now=NOW)
    assert patch is not None
    requeued = next(c for c in patch["status"]["conditions"] if c["type"] == "Requeued")
    assert (requeued["status"], requeued["reason"]) == ("False", "Deactivated")


def test_the_runs_end_finishes_the_workload_once() -> None:
    running = workload(*ADMITTED, admission=ADMISSION)
    assert kueue.status_patch(running, finished=("Succeeded", "done"), pods_gone=False, now=NOW) is None
    patch = kueue.status_patch(running, finished=("Succeeded", "done"), pods_gone=True, now=NOW)
    assert patch is not None
    finished = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"], finished["message"]) == ("True", "Succeeded", "done")
    again = workload(*patch["status"]["conditions"])
    assert kueue.status_patch(again, finished=("Succeeded", "done"), pods_gone=True, now=NOW) is None


def test_the_runs_suspend_deactivates_its_workload_and_a_resume_activates_it() -> None:
    assert kueue.activity_patch(workload(), labelled()) is None
    patch = kueue.activity_patch(workload(), labelled(runPolicy={"suspend": True}))
    assert patch == {"metadata": {"resourceVersion": "7"}, "spec": {"active": False}}
