"""Kueue's admission of a run, as pure functions: the run's Workload, what its status says, what the operator writes
back. No API calls (reconcile does them), no clock (`now` is passed in).

A run labelled `kueue.x-k8s.io/queue-name` is one Kueue Workload (kueue.x-k8s.io/v1beta2, the version Kueue
v0.17 stores) that the operator creates and owns, with a pod set for the server (its replicas) and one for the
trainer (its pods), so Kueue admits both or neither. This is the part of Kueue's jobframework that a custom job
controller plays (the GenericJob reconciler of KubeRay's, Kubeflow's and AppWrapper's integrations), done in the
operator instead of through the Go library:

- the Workload is named as jobframework names one (`grporun-<run>-<hash>`), owned by the run, in the run's
  LocalQueue, with the WorkloadPriorityClass of `kueue.x-k8s.io/priority-class` and its value as the priority;
- nothing of the run exists until the Workload is Admitted; then its pods get the node labels and tolerations of
  the ResourceFlavors Kueue assigned to their pod set, and what its admission checks ask (`podSetUpdates`);
- Evicted (preempted, its queue stopped, deactivated): the run suspends, and once none of its pods is left the
  operator gives the quota back (QuotaReserved False, the admission cleared, Requeued), as jobframework does after
  it stopped a job; Kueue then queues the Workload again;
- `runPolicy.suspend` deactivates the Workload (`spec.active: false`, Kueue's own stop), a resume activates it;
- the run's end finishes the Workload (Finished True) once its server and trainer pods are gone.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from grpo_api.lifecycle import AdmissionState, QueueAdmission, get_condition, set_condition
from grpo_api.models import DNS_SUBDOMAIN_PATTERN, KIND, Condition, GRPORun, Mode, Reason
from grpo_api.models import GROUP as RUN_GROUP
from grpo_operator import builders

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS = "workloads"
LOCAL_QUEUES = "localqueues"
PRIORITY_CLASSES = "workloadpriorityclasses"
FLAVORS = "resourceflavors"

QUEUE_LABEL = f"{GROUP}/queue-name"
PRIORITY_CLASS_LABEL = f"{GROUP}/priority-class"
#: On the Workload: the uid of the object it admits (jobframework's controllerconsts.JobUIDLabel).
JOB_UID_LABEL = f"{GROUP}/job-uid"
#: Our label on the Workload (grpo.dev/component).
WORKLOAD = "workload"
SERVER_POD_SET = builders.SERVER
TRAINER_POD_SET = builders.TRAINER
#: Kueue's evictions after which it queues the Workload again by itself (jobframework sets Requeued True for them).
_REQUEUED_BY_KUEUE = frozenset({"Preempted", "NodeFailures"})
_NAME = re.compile(DNS_SUBDOMAIN_PATTERN)


@dataclass(frozen=True)
class QueueRequest:
    """What the run's labels ask of Kueue."""

    local_queue: str
    priority_class: str | None = None


@dataclass(frozen=True)
class Priority:
    """A WorkloadPriorityClass and its value, as the Workload carries them."""

    name: str
    value: int


def queue_request(run: GRPORun) -> QueueRequest | None:
    """The LocalQueue (and WorkloadPriorityClass) the run's labels name; None without a queue label (Kueue does not
    admit the run: nothing changes). A name Kueue could not hold is refused naming the label."""
    labels = run.metadata.labels
    if QUEUE_LABEL not in labels:
        return None
    names = {QUEUE_LABEL: labels[QUEUE_LABEL], PRIORITY_CLASS_LABEL: labels.get(PRIORITY_CLASS_LABEL)}
    for label, value in names.items():
        if value is not None and not _NAME.match(value):
            raise builders.InvalidRunError(
                f"metadata.labels[{label}] is {value!r}: it must name a Kueue object, a lowercase RFC 1123 name "
                "(letters, digits, '-' and '.', starting and ending with a letter or digit)"
            )
    return QueueRequest(labels[QUEUE_LABEL], labels.get(PRIORITY_CLASS_LABEL))


def workload_name(run: GRPORun) -> str:
    """The Workload's name as jobframework gives it (GetWorkloadNameForOwnerWithGVK): `grporun-<run>-` and five hex
    digits of a hash of the kind, group, name and uid, so `kubectl get workloads` reads as for Kueue's own kinds and a
    re-created run of the same name gets another one."""
    name, uid = run.metadata.name, run.metadata.uid or ""
    digest = hashlib.sha1("\n".join((KIND, RUN_GROUP, name, uid)).encode()).hexdigest()
    return f"{KIND.lower()}-{name}-{digest[:5]}"


# ------------------------------------------------------------------------------------------- the Workload


def _requests(resources: dict[str, Any]) -> dict[str, Any]:
    """A container's resources as Kueue counts them: a limit without a request is the request (as the API server
    defaults a pod's; Kueue reads the Workload's template, which nothing defaults)."""
    requests = {**resources.get("limits", {}), **resources.get("requests", {})}
    return {**resources, "requests": requests} if requests else dict(resources)


def _pod_set(name: str, template: dict[str, Any], count: int) -> dict[str, Any]:
    """A pod set of the Workload: what Kueue reads of the pod template (the containers' resources, where the pods
    may run, their priority and runtime class), not its volumes, environment or probes."""
    pod = template["spec"]
    kept = ("nodeSelector", "tolerations", "affinity", "priorityClassName", "runtimeClassName", "restartPolicy")
    spec: dict[str, Any] = {key: pod[key] for key in kept if key in pod}
    spec["containers"] = [
        {"name": c["name"], "image": c["image"], "resources": _requests(c.get("resources", {}))}
        for c in pod["containers"]
    ]
    meta = {key: value for key, value in template.get("metadata", {}).items() if key in ("labels", "annotations")}
    return {"name": name, "count": count, "template": {"metadata": meta, "spec": spec}}


def pod_sets(run: GRPORun, images: builders.Images) -> list[dict[str, Any]]:
    """The server's pod set (server mode: its replicas) and the trainer's (its pods), from the pods the builders
    make: what Kueue admits is what the run creates."""
    sets = []
    if run.spec.mode == Mode.SERVER:
        replicas = run.spec.effective_server.replicas
        server = builders.build_server_deployment(run, 1, replicas, images)
        sets.append(_pod_set(SERVER_POD_SET, server["spec"]["template"], replicas))
    trainer = builders.build_trainer_job(run, 1, images)
    sets.append(_pod_set(TRAINER_POD_SET, trainer["spec"]["template"], run.spec.trainer.num_nodes))
    return sets


def build_workload(run: GRPORun, request: QueueRequest, priority: Priority | None,
                   images: builders.Images) -> dict[str, Any]:
    """The run's Workload: owned by the run, in its LocalQueue, one pod set per part, active unless the run is
    suspended."""
    spec: dict[str, Any] = {
        "queueName": request.local_queue,
        "podSets": pod_sets(run, images),
        "active": not run.spec.run_policy.suspend,
    }
    if priority is not None:
        spec["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": priority.name}
        spec["priority"] = priority.value
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(run),
            "namespace": run.metadata.namespace or "default",
            "labels": {**builders.labels(run, WORKLOAD), JOB_UID_LABEL: run.metadata.uid or ""},
            "ownerReferences": [builders.owner_reference(run)],
        },
        "spec": spec,
    }


# ----------------------------------------------------------------------------------- what Kueue says


def _conditions(workload: dict[str, Any]) -> list[Condition]:
    return [Condition.model_validate(c) for c in (workload.get("status") or {}).get("conditions") or []]


def _true(conditions: list[Condition], type_: str) -> Condition | None:
    cond = get_condition(conditions, type_)
    return cond if cond is not None and cond.status == "True" else None


def _said(cond: Condition) -> str:
    return f"{cond.reason}: {cond.message}" if cond.message else cond.reason


def admission_of(workload: dict[str, Any], request: QueueRequest) -> QueueAdmission:
    """Kueue's answer, from the Workload's conditions: Evicted (its admission taken back, acknowledged or not) over
    Admitted over waiting, with Kueue's own words for why it waits (QuotaReserved False: no quota, no such queue)."""
    conditions = _conditions(workload)
    name = workload["metadata"]["name"]
    if (cond := _true(conditions, "Finished")) is not None:
        return QueueAdmission(AdmissionState.EVICTED, f"its Workload {name} was finished by Kueue ({_said(cond)})")
    if (cond := _true(conditions, "Evicted")) is not None:
        return QueueAdmission(AdmissionState.EVICTED, _said(cond))
    if _true(conditions, "Admitted") is not None:
        queue = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue", "")
        return QueueAdmission(AdmissionState.ADMITTED, f"Workload {name} in ClusterQueue {queue}")
    reserved = get_condition(conditions, "QuotaReserved")
    if reserved is not None and reserved.status == "False" and reserved.message:
        return QueueAdmission(AdmissionState.WAITING, f"Workload {name}: {reserved.message}")
    return QueueAdmission(AdmissionState.WAITING, f"Workload {name} queued in LocalQueue {request.local_queue}")


def queue_not_found(request: QueueRequest, namespace: str) -> QueueAdmission:
    return QueueAdmission(
        AdmissionState.WAITING,
        f"LocalQueue {request.local_queue} (label {QUEUE_LABEL}) does not exist in namespace {namespace}; the run "
        "waits for it",
        Reason.QUEUE_NOT_FOUND,
    )


def priority_class_not_found(request: QueueRequest) -> QueueAdmission:
    return QueueAdmission(
        AdmissionState.WAITING,
        f"WorkloadPriorityClass {request.priority_class} (label {PRIORITY_CLASS_LABEL}) does not exist; the run "
        "waits for it, with no Workload yet",
        Reason.PRIORITY_CLASS_NOT_FOUND,
    )


def assigned_flavors(workload: dict[str, Any]) -> list[str]:
    """The ResourceFlavors Kueue assigned to any pod set, each once."""
    admission = (workload.get("status") or {}).get("admission") or {}
    names = {str(f) for psa in admission.get("podSetAssignments") or [] for f in (psa.get("flavors") or {}).values()}
    return sorted(names)


def admitted_placements(
    workload: dict[str, Any], flavors: Mapping[str, dict[str, Any]]
) -> dict[str, builders.Admitted]:
    """Per pod set, what the admission adds to its pods (jobframework's podset.FromAssignment and the admission
    checks' podSetUpdates): the assigned flavors' node labels and tolerations, then each check's updates. Two that
    set one key to different values cannot both hold: Kueue refuses to start such a job, so the run is refused."""
    status = workload.get("status") or {}
    placements: dict[str, builders.Admitted] = {}
    for psa in (status.get("admission") or {}).get("podSetAssignments") or []:
        node_selector: dict[str, str] = {}
        tolerations: list[dict[str, Any]] = []
        for flavor in sorted({str(f) for f in (psa.get("flavors") or {}).values()}):
            spec = flavors[flavor].get("spec") or {}
            node_selector = _merge(node_selector, spec.get("nodeLabels") or {}, f"ResourceFlavor {flavor}")
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        placements[str(psa.get("name"))] = builders.Admitted(node_selector=node_selector,
                                                             tolerations=tuple(tolerations))
    for check in status.get("admissionChecks") or []:
        for update in check.get("podSetUpdates") or []:
            name = str(update.get("name"))
            was = placements.get(name, builders.Admitted())
            where = f"admission check {check.get('name')}"
            placements[name] = builders.Admitted(
                node_selector=_merge(was.node_selector, update.get("nodeSelector") or {}, where),
                tolerations=(*was.tolerations,
                             *(t for t in update.get("tolerations") or [] if t not in was.tolerations)),
                labels=_merge(was.labels, update.get("labels") or {}, where),
                annotations=_merge(was.annotations, update.get("annotations") or {}, where),
            )
    return placements


def _merge(ours: dict[str, str], theirs: dict[str, Any], where: str) -> dict[str, str]:
    for key, value in theirs.items():
        if ours.get(key, value) != value:
            raise builders.InvalidRunError(
                f"Kueue's admission sets {key} to both {ours[key]} and {value} ({where}): the run's pods cannot be "
                "placed"
            )
    return {**ours, **{k: str(v) for k, v in theirs.items()}}


# -------------------------------------------------------------------------------- what the operator writes


def activity_patch(workload: dict[str, Any], run: GRPORun) -> dict[str, Any] | None:
    """runPolicy.suspend deactivates the Workload (Kueue evicts it and holds no quota for it); a resume activates it."""
    active = not run.spec.run_policy.suspend
    if ((workload.get("spec") or {}).get("active", True)) == active:
        return None
    return {"metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]}, "spec": {"active": active}}


def status_patch(
    workload: dict[str, Any], *, finished: tuple[str, str] | None, pods_gone: bool, now: dt.datetime
) -> dict[str, Any] | None:
    """The Workload's status once none of the run's pods is left, or None when nothing is to be written.

    `finished` is (Succeeded or Failed, the run's message) once the run ended: the Workload finishes and its quota
    is free. An eviction is acknowledged as jobframework acknowledges it after stopping a job: QuotaReserved False
    (Pending), the admission cleared, Admitted False, and Requeued (True after a preemption or node failures, after
    which Kueue queues it again; False otherwise, e.g. deactivated). The patch carries the resourceVersion it was
    computed from, so a write that crosses one of Kueue's fails and is made again from the newer status."""
    if not pods_gone:
        return None
    conditions = _conditions(workload)
    generation = workload["metadata"].get("generation")
    status: dict[str, Any] = {}
    if finished is not None:
        if _true(conditions, "Finished") is not None:
            return None
        reason, message = finished
        conditions = set_condition(conditions, "Finished", "True", reason, message, now, generation)
    else:
        evicted = _true(conditions, "Evicted")
        if evicted is None or _true(conditions, "QuotaReserved") is None:
            return None
        requeued: Literal["True", "False"] = "True" if evicted.reason in _REQUEUED_BY_KUEUE else "False"
        conditions = set_condition(conditions, "Requeued", requeued, evicted.reason, evicted.message, now, generation)
        conditions = set_condition(conditions, "QuotaReserved", "False", "Pending", evicted.message, now, generation)
        if _true(conditions, "Admitted") is not None:
            conditions = set_condition(conditions, "Admitted", "False", "NoReservation",
                                       "The workload has no reservation", now, generation)
        status["admission"] = None
    status["conditions"] = [c.to_wire() for c in conditions]
    return {"metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]}, "status": status}
