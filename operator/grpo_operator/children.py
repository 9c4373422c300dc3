"""What the operator knows of a run's children: small summaries built from watch events.

kopf indexes keep one summary per child, keyed by the owning run's uid, so a reconcile
reads the children without an API call. Pure functions of a raw object.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from grpo_api.exit_codes import EXIT_INVALID_SPEC
from grpo_api.lifecycle import TrainerState
from grpo_api.models import KIND
from grpo_operator.builders import (
    ATTEMPT_ANNOTATION,
    ATTEMPT_LABEL,
    COMPONENT_LABEL,
    EXPORTER,
    INITIALIZER,
    SERVER,
    TRAINER,
)

#: The reason of a Job's Failed condition when a FailJob rule of its podFailurePolicy matched.
POD_FAILURE_POLICY = "PodFailurePolicy"
#: The pod condition of a pod preempted, evicted or deleted by a controller (Kubernetes' PodDisruptionConditions).
DISRUPTION_TARGET = "DisruptionTarget"
#: How the Job controller's Failed message names a FailJob rule that matched a pod condition ("Pod NS/NAME has
#: condition DisruptionTarget matching FailJob rule at index 1"): the trainer Job's rule for a disrupted pod.
_DISRUPTION_RULE_MATCHED = f"has condition {DISRUPTION_TARGET} matching"


@dataclass(frozen=True)
class PodInfo:
    name: str
    component: str
    attempt: int | None
    ready: bool
    terminating: bool
    created: dt.datetime | None
    #: The Job a trainer pod belongs to.
    job_name: str | None = None
    #: Why it is not running well (unschedulable, image pull, crash, non-zero exit), for status messages.
    problem: str = ""
    #: The termination message of its (first) container that terminated, as written.
    termination_message: str = ""
    #: The exit code of its (first) container that terminated; None while none has.
    exit_code: int | None = None
    #: A container of it has started (running or terminated): it has a log.
    started: bool = False
    #: A container of it is running now.
    running: bool = False
    #: Its IP (status.podIP); "" until it has one.
    ip: str = ""
    #: Why it was preempted, evicted or deleted from outside (its DisruptionTarget condition's reason and
    #: message), "" when it was not.
    disruption: str = ""
    #: It ended (phase Succeeded or Failed): it holds no resources any more.
    done: bool = False


@dataclass(frozen=True)
class DeploymentInfo:
    name: str
    owner: str | None
    attempt: int | None
    replicas: int
    #: Why it cannot make its pod (quota, admission), for status messages.
    problem: str = ""
    terminating: bool = False


@dataclass(frozen=True)
class JobInfo:
    name: str
    owner: str | None
    attempt: int | None
    state: TrainerState
    message: str
    #: The reason of its Complete or Failed condition.
    reason: str = ""
    terminating: bool = False

    @property
    def failed_by_policy(self) -> bool:
        """The FailJob rule of its podFailurePolicy on an exit code failed it (the trainer's: EXIT_INVALID_SPEC)."""
        return self.state == TrainerState.FAILED and self.reason == POD_FAILURE_POLICY and not self.failed_by_disruption

    @property
    def failed_by_disruption(self) -> bool:
        """The FailJob rule of its podFailurePolicy on the DisruptionTarget condition failed it: a pod of it was
        preempted or evicted. The Job keeps saying so after that pod is gone."""
        return (self.state == TrainerState.FAILED and self.reason == POD_FAILURE_POLICY
                and _DISRUPTION_RULE_MATCHED in self.message)


@dataclass(frozen=True)
class ObjectInfo:
    """A child the run provisions once (ConfigMap, claim, Service, NetworkPolicy): enough to tell that
    it exists, whose it is and whether it is going away."""

    kind: str
    name: str
    owner: str | None
    terminating: bool = False


@dataclass(frozen=True)
class Children:
    """A snapshot of one run's server pods, server Deployment, trainer Jobs and their pods, and the
    objects provisioned for it."""

    pods: tuple[PodInfo, ...] = ()
    deployment: DeploymentInfo | None = None
    jobs: tuple[JobInfo, ...] = ()
    trainer_pods: tuple[PodInfo, ...] = ()
    initializer_pods: tuple[PodInfo, ...] = ()
    #: Provisioned objects this run owns; None when the executor does not watch them (then nothing
    #: counts as missing).
    objects: tuple[ObjectInfo, ...] | None = None
    #: Objects under the run's name that an earlier run of that name left (owned by another GRPORun, or
    #: being deleted and not this run's), described for a status message.
    left_by_earlier_run: tuple[str, ...] = ()

    def has(self, kind: str, name: str) -> bool:
        """The run owns this object and it is not being deleted (True when objects are not watched)."""
        if self.objects is None:
            return True
        return any(o.kind == kind and o.name == name and not o.terminating for o in self.objects)

    def job(self, name: str) -> JobInfo | None:
        return next((j for j in self.jobs if j.name == name), None)

    def older_server_pods(self, attempt: int) -> list[PodInfo]:
        """Server pods not of this attempt (unmarked ones count as older): they must be gone first."""
        return [p for p in self.pods if p.attempt != attempt]

    def ready_pod(self, attempt: int) -> PodInfo | None:
        return next((p for p in self.pods if p.attempt == attempt and p.ready and not p.terminating), None)

    def pod_of(self, attempt: int) -> PodInfo | None:
        return next((p for p in self.pods if p.attempt == attempt and not p.terminating), None)

    def pods_of(self, attempt: int) -> list[PodInfo]:
        """The attempt's server pods that are not going away (its replicas), by name."""
        return sorted((p for p in self.pods if p.attempt == attempt and not p.terminating), key=lambda p: p.name)

    def server_said_invalid_spec(self, attempt: int) -> str | None:
        """What a server pod of the attempt that exited with EXIT_INVALID_SPEC said (its termination message: its
        engine cannot run there), or None when none did."""
        for pod in self.pods_of(attempt):
            if pod.exit_code == EXIT_INVALID_SPEC:
                return pod.termination_message.strip() or f"pod {pod.name} exited with code {EXIT_INVALID_SPEC}"
        return None

    def failed_by_exit_code(self, job_name: str, code: int) -> bool:
        """A pod of the Job ended with this exit code."""
        return any(p.exit_code == code for p in self.job_pods(job_name))

    def trainer_problem(self, job_name: str) -> str:
        """What went wrong in the Job's pod (exit code, reason, termination message), if anything. Of
        several pods (an Indexed Job), one that failed by itself comes before those the Job controller
        is deleting because the Job failed (their exit is the stop, not the cause)."""
        pods = sorted(self.job_pods(job_name), key=lambda p: p.terminating)
        return next((f"pod {p.name}: {p.problem}" for p in pods if p.problem), "")

    def disruption(self, job_name: str) -> str:
        """Which pod of the Job was preempted or evicted and why ("" when none was)."""
        return next((f"pod {p.name}: {DISRUPTION_TARGET} {p.disruption}" for p in self.job_pods(job_name)
                     if p.disruption), "")

    def stray_pods(self) -> list[str]:
        """Pods under the run's name that none of this run's Jobs or its Deployment made, described: before
        the run made any (Pending), those of an earlier run of the same name (pods are matched by label; a
        server pod's ReplicaSet is not watched, so any server pod counts as this run's once it has a
        Deployment)."""
        ours = {j.name for j in self.jobs}
        strays = list(self.pods) if self.deployment is None else []
        strays += [p for p in (*self.trainer_pods, *self.initializer_pods) if p.job_name not in ours]
        return [describe_leftover("Pod", p.name, None, p.terminating) for p in strays]

    def pods_gone(self, initializer: str) -> bool:
        """None of the server's or the trainer's pods is left or running, nor is any Job but the initializer
        (an Ended one's pods may stay): what a queue admitted the run for is free again."""
        if self.deployment is not None and self.deployment.replicas > 0:
            return False
        if any(not p.done for p in (*self.pods, *self.trainer_pods)):
            return False
        return not any(j.state == TrainerState.ACTIVE for j in self.jobs if j.name != initializer)

    def job_pods(self, job_name: str) -> list[PodInfo]:
        """The pods of a trainer or initializer Job, newest first."""
        pods = [p for p in (*self.trainer_pods, *self.initializer_pods) if p.job_name == job_name]
        epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
        return sorted(pods, key=lambda p: p.created or epoch, reverse=True)


def snapshot(
    run_uid: str,
    pods: Iterable[PodInfo],
    deployments: Iterable[DeploymentInfo],
    jobs: Iterable[JobInfo],
    objects: Iterable[ObjectInfo] | None = None,
) -> Children:
    """One run's children from the index entries under its (namespace, name).

    Pods belong to the run's ReplicaSet, so they count by label (a pod left by an earlier run of
    the same name must go away before a fresh server may start); Deployments and Jobs count only
    when this run owns them (one of an earlier run of the same name is being garbage-collected).
    """
    deployments, jobs = list(deployments), list(jobs)
    objects = None if objects is None else list(objects)
    owned_deployments = [d for d in deployments if d.owner == run_uid]
    pods = list(pods)
    left = [
        describe_leftover(kind, o.name, o.owner, o.terminating)
        for kind, found in (("Deployment", deployments), ("Job", jobs))
        for o in found
        if _left_by_earlier_run(o.owner, o.terminating, run_uid)
    ]
    left += [
        describe_leftover(o.kind, o.name, o.owner, o.terminating)
        for o in objects or ()
        if _left_by_earlier_run(o.owner, o.terminating, run_uid)
    ]
    return Children(
        pods=tuple(p for p in pods if p.component == SERVER),
        trainer_pods=tuple(p for p in pods if p.component == TRAINER),
        # The pods of the run's one-off Jobs: the initializer's and the export step's.
        initializer_pods=tuple(p for p in pods if p.component in (INITIALIZER, EXPORTER)),
        deployment=owned_deployments[0] if owned_deployments else None,
        jobs=tuple(j for j in jobs if j.owner == run_uid),
        objects=None if objects is None else tuple(o for o in objects if o.owner == run_uid),
        left_by_earlier_run=tuple(left),
    )


def _left_by_earlier_run(owner: str | None, terminating: bool, run_uid: str) -> bool:
    """Another GRPORun's (one of this name, deleted: its children are being collected), or going away and
    not this run's. An object no GRPORun owns is not this; creating over it fails the run (ChildConflict)."""
    if owner == run_uid:
        return False
    return owner is not None or terminating


def describe_leftover(kind: str, name: str, owner: str | None, terminating: bool) -> str:
    """One object an earlier run of the same name left, for status messages and events."""
    details = ([f"of GRPORun uid {owner}"] if owner else []) + (["being deleted"] if terminating else [])
    return f"{kind} {name} ({', '.join(details)})" if details else f"{kind} {name}"


def object_info(kind: str, body: dict[str, Any]) -> ObjectInfo:
    meta = body.get("metadata") or {}
    return ObjectInfo(
        kind=kind,
        name=str(meta.get("name", "")),
        owner=owner_uid(meta),
        terminating=bool(meta.get("deletionTimestamp")),
    )


def owner_of(meta: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, uid) of the controller that owns this object, if any."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("kind", "")), str(ref.get("uid", ""))
    return None


def owner_uid(meta: dict[str, Any]) -> str | None:
    """The uid of the GRPORun controlling this object, if any."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("controller"):
            uid = ref.get("uid")
            return str(uid) if uid else None
    return None


def _attempt(*sources: dict[str, Any] | None) -> int | None:
    for source in sources:
        value = (source or {}).get(ATTEMPT_ANNOTATION) or (source or {}).get(ATTEMPT_LABEL)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _time(value: Any) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def pod_info(body: dict[str, Any]) -> PodInfo:
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = body.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return PodInfo(
        name=meta.get("name", ""),
        component=labels.get(COMPONENT_LABEL, ""),
        attempt=_attempt(meta.get("annotations"), labels),
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        created=_time(meta.get("creationTimestamp")),
        job_name=labels.get("batch.kubernetes.io/job-name") or labels.get("job-name"),
        problem=pod_problem(status),
        termination_message=termination_message(status),
        exit_code=exit_code(status),
        started=any(
            "running" in (c.get("state") or {}) or "terminated" in (c.get("state") or {})
            for c in status.get("containerStatuses") or []
        ),
        running=any("running" in (c.get("state") or {}) for c in status.get("containerStatuses") or []),
        ip=str(status.get("podIP") or ""),
        disruption=disruption(conditions),
        done=status.get("phase") in ("Succeeded", "Failed"),
    )


def disruption(conditions: list[dict[str, Any]]) -> str:
    """The reason and message of a true DisruptionTarget condition (EvictionByEvictionAPI, PreemptionByScheduler,
    DeletionByTaintManager, TerminationByKubelet, DeletionByPodGC), "" when there is none."""
    for cond in conditions:
        if cond.get("type") == DISRUPTION_TARGET and cond.get("status") == "True":
            return _short(": ".join(str(v) for v in (cond.get("reason") or "disrupted", cond.get("message")) if v))
    return ""


def _terminations(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Each container's termination: the current state's, else the last one's (a restarted container, such
    as a server in CrashLoopBackOff, is waiting now and keeps its exit in lastState)."""
    found = []
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or (container.get("lastState") or {}).get(
            "terminated") or {}
        if terminated:
            found.append(terminated)
    return found


def termination_message(status: dict[str, Any]) -> str:
    return next((str(t["message"]) for t in _terminations(status) if t.get("message")), "")


def exit_code(status: dict[str, Any]) -> int | None:
    return next((int(t["exitCode"]) for t in _terminations(status) if "exitCode" in t), None)


#: Waiting reasons that are normal on the way up.
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})
MAX_PROBLEM_CHARS = 300


def pod_problem(status: dict[str, Any]) -> str:
    """The first sign of trouble in a pod's status, as one short line ("" when there is none)."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason"):
            return _short(f"{cond['reason']}: {cond.get('message', '')}")
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        if waiting.get("reason") and waiting["reason"] not in _STARTING:
            return _short(f"{waiting['reason']}: {waiting.get('message', '')}")
        if terminated and terminated.get("exitCode", 0) != 0:
            return _short(f"exit code {terminated.get('exitCode')} ({terminated.get('reason', '')}): "
                          f"{terminated.get('message', '')}")
    return ""


def _short(text: str) -> str:
    text = " ".join(text.split()).rstrip(": ")
    return text if len(text) <= MAX_PROBLEM_CHARS else text[: MAX_PROBLEM_CHARS - 1] + "…"


def deployment_info(body: dict[str, Any]) -> DeploymentInfo:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    template_meta = (spec.get("template") or {}).get("metadata") or {}
    return DeploymentInfo(
        name=meta.get("name", ""),
        owner=owner_uid(meta),
        attempt=_attempt(template_meta.get("annotations")),
        replicas=int(spec.get("replicas", 1)),
        problem=deployment_problem(body.get("status") or {}),
        terminating=bool(meta.get("deletionTimestamp")),
    )


def deployment_problem(status: dict[str, Any]) -> str:
    """A Deployment that cannot create its pod (ResourceQuota, Pod Security admission) says so in
    its ReplicaFailure condition; its pod never exists to tell."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return _short(f"{cond.get('reason', 'ReplicaFailure')}: {cond.get('message', '')}")
    return ""


def job_info(body: dict[str, Any]) -> JobInfo:
    """Complete/Failed only once the Job controller says so (its pods are gone by then)."""
    meta = body.get("metadata") or {}
    conditions = (body.get("status") or {}).get("conditions") or []
    state, message, reason = TrainerState.ACTIVE, "", ""
    for cond in conditions:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            state, message = TrainerState.SUCCEEDED, str(cond.get("message") or "")
            reason = str(cond.get("reason") or "")
        elif cond.get("type") == "Failed":
            detail = ": ".join(str(v) for v in (cond.get("reason"), cond.get("message")) if v)
            state, message, reason = TrainerState.FAILED, detail, str(cond.get("reason") or "")
    return JobInfo(
        name=meta.get("name", ""),
        owner=owner_uid(meta),
        attempt=_attempt(meta.get("annotations"), meta.get("labels")),
        state=state,
        message=message,
        reason=reason,
        terminating=bool(meta.get("deletionTimestamp")),
    )
