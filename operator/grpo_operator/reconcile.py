"""One reconcile of one run: observe the world, let the shared lifecycle decide, act, record.

Level-based and idempotent: it compares the spec and the recorded status with what exists
(children from kopf's indexes, the trainer Job, the server's health) and never relies on
having seen an event. The decision is `grpo_api.lifecycle.decide` (the same one `grpo run`
uses); this module only turns its actions into Kubernetes requests. The status is written
once per reconcile, and only when it changed; events are posted after it is recorded.

Runs in a worker thread (the Kubernetes client and the health check block).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, assert_never

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from grpo_api.exit_codes import EXIT_INVALID_SPEC
from grpo_api.export_protocol import ExportResult, parse_result
from grpo_api.health import DEFAULT_TIMEOUT_SECONDS, HealthClient
from grpo_api.lifecycle import (
    AdmissionState,
    CreateExporter,
    CreateInitializer,
    CreateTrainer,
    Decision,
    DeleteExporter,
    DeleteRun,
    DeleteServer,
    DeleteTrainer,
    Emit,
    EnsureServer,
    HealthCheck,
    Observation,
    Provision,
    QueueAdmission,
    RequeueAfter,
    StopServer,
    TrainerState,
    decide,
    held_by_earlier_run,
    reject,
    troubled,
    wants_health,
)
from grpo_api.models import KIND, TERMINAL_PHASES, GRPORun, GRPORunStatus, Mode, Phase, Reason
from grpo_api.prepare_protocol import latest_progress
from grpo_api.runconfig import format_validation_error
from grpo_api.sources import SourceError
from grpo_operator import builders, kueue, metrics
from grpo_operator.children import Children, JobInfo, describe_leftover, job_info, owner_of
from grpo_operator.kube import KubeClient, NotServedError

log = logging.getLogger("grpo_operator")

MIN_REQUEUE_SECONDS = 0.2
#: A reconcile that keeps failing is retried after the interval, doubling up to this.
MAX_BACKOFF_SECONDS = 300.0
#: The token Secret is read by name (never watched: the operator may not list Secrets), this often.
TOKEN_CHECK_SECONDS = 30.0


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of one operator process (from `grpo operator` flags)."""

    reconcile_interval: float = 10.0
    allow_server_url_override: bool = False
    health_timeout: float = DEFAULT_TIMEOUT_SECONDS
    workers: int = 16
    metrics_port: int = 9090
    #: Who may reach a run's server besides its trainer (a NetworkPolicy per run); None: no policy.
    server_ingress: builders.ServerIngress | None = field(default_factory=builders.ServerIngress)
    #: Images of runs whose spec names none (the chart's runImages.server and runImages.trainer).
    images: builders.Images = field(default_factory=builders.Images)
    #: Runs labelled kueue.x-k8s.io/queue-name wait for Kueue to admit them (the chart's kueue.enabled, which also
    #: grants the RBAC); without it such a run is refused, naming the label, rather than run outside the quotas.
    kueue: bool = False


@dataclass
class Runtime:
    """What reconciles share in one operator process: clients, config and a little memory."""

    config: OperatorConfig
    kube: KubeClient
    health: HealthClient
    executor: ThreadPoolExecutor
    #: The resourceVersion of each run as this process last wrote or read it: a kopf body older
    #: than our own write is refreshed with a GET instead of being decided on.
    known_versions: dict[str, str] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)
    #: (namespace, name) of each run by uid: whose per-run metric series are whose.
    names: dict[str, tuple[str, str]] = field(default_factory=dict)
    last_errors: dict[str, str] = field(default_factory=dict)
    #: Reconciles of each run that failed in a row (their backoff).
    failures: dict[str, int] = field(default_factory=dict)
    #: When each run's token Secret was last seen.
    token_seen: dict[str, float] = field(default_factory=dict)
    last_reconcile: float = field(default_factory=time.monotonic)

    def forget(self, uid: str) -> None:
        """The run is gone (or no longer watched): drop what is kept of it, its metric series too."""
        self.known_versions.pop(uid, None)
        self.phases.pop(uid, None)
        self.last_errors.pop(uid, None)
        self.failures.pop(uid, None)
        self.token_seen.pop(uid, None)
        metrics.set_runs_by_phase(self.phases)
        key = self.names.pop(uid, None)
        # A new run of the same name may already own the series: leave them to it.
        if key is not None and key not in self.names.values():
            metrics.forget_run(*key)


def reconcile(rt: Runtime, body: dict[str, Any], children: Children) -> float:
    """Reconcile one run; returns the seconds until it should be reconciled again."""
    meta = body.get("metadata") or {}
    uid = str(meta.get("uid", ""))
    started = time.monotonic()
    try:
        delay = _reconcile(rt, body, children)
        rt.last_errors.pop(uid, None)
        rt.failures.pop(uid, None)
    except ApiException as exc:
        delay = _trouble(rt, body, f"API {exc.status} {exc.reason}: {_api_message(exc)[:300]}", f"api_{exc.status}")
    except Urllib3HTTPError as exc:
        delay = _trouble(rt, body, f"API unreachable: {exc}", "api_unreachable")
    except Exception as exc:  # one run's bug must not crash its daemon in a loop with nothing said
        log.exception("unexpected error in the reconcile of %s/%s", meta.get("namespace"), meta.get("name"))
        delay = _trouble(rt, body, f"unexpected {type(exc).__name__}: {str(exc)[:300]}", "unexpected")
    finally:
        metrics.RECONCILE_DURATION.observe(time.monotonic() - started)
        rt.last_reconcile = time.monotonic()
        metrics.LAST_RECONCILE.set(time.time())
    return delay


def _api_message(exc: ApiException) -> str:
    """The API server's own message (a Status body), else its reason."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return str(message or f"{exc.status} {exc.reason}")


def _trouble(rt: Runtime, body: dict[str, Any], message: str, error: str) -> float:
    """A reconcile failed: count it, post one event per distinct error, say so in the Reconciled
    condition (where the API lets us), and retry with backoff. Returns the delay."""
    meta = body.get("metadata") or {}
    uid = str(meta.get("uid", ""))
    _failed(rt, meta, message, error)
    failures = rt.failures.get(uid, 0) + 1
    rt.failures[uid] = failures
    try:
        raw_status: dict[str, Any] = body.get("status") or {}
        status = GRPORunStatus.model_validate(raw_status)
        try:
            spec: Any = GRPORun.model_validate({"metadata": meta, "spec": body.get("spec")}).spec
        except ValidationError:
            spec = None
        decision = troubled(spec, status, Reason.RECONCILE_ERROR, message, dt.datetime.now(dt.UTC),
                            generation=meta.get("generation"))
        _record(rt, meta, raw_status, status, decision)
    except Exception as exc:  # the API may be what failed: the event and the log have it
        log.warning("could not record the failed reconcile of %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)
    return min(rt.config.reconcile_interval * 2 ** (failures - 1), MAX_BACKOFF_SECONDS)


def _failed(rt: Runtime, meta: dict[str, Any], message: str, error: str) -> None:
    """Count and log a failed reconcile; post one Warning per distinct error (not one per retry)."""
    metrics.RECONCILE_ERRORS.labels(error=error).inc()
    name, namespace, uid = meta.get("name", ""), meta.get("namespace", ""), str(meta.get("uid", ""))
    log.warning("reconcile of %s/%s failed: %s", namespace, name, message)
    if rt.last_errors.get(uid) == message:
        return
    rt.last_errors[uid] = message
    try:
        rt.kube.create_event(namespace, name, uid, "Warning", "ReconcileError", message)
    except (ApiException, Urllib3HTTPError) as exc:
        log.warning("could not post the ReconcileError event of %s/%s: %s", namespace, name, exc)


def _reconcile(rt: Runtime, body: dict[str, Any], children: Children) -> float:
    meta = body["metadata"]
    uid, namespace, name = str(meta["uid"]), str(meta["namespace"]), str(meta["name"])
    if meta.get("deletionTimestamp"):
        return rt.config.reconcile_interval
    known = rt.known_versions.get(uid)
    if known is not None and known != meta.get("resourceVersion"):
        fresh = rt.kube.read_run(namespace, name)
        if fresh is None or fresh["metadata"]["uid"] != uid:
            return rt.config.reconcile_interval
        body, meta = fresh, fresh["metadata"]
    rt.known_versions[uid] = str(meta.get("resourceVersion"))

    raw_status: dict[str, Any] = body.get("status") or {}
    status = GRPORunStatus.model_validate(raw_status)
    now = dt.datetime.now(dt.UTC)
    generation = meta.get("generation")

    try:
        run = GRPORun.model_validate({"metadata": meta, "spec": body.get("spec")})
        builders.check_run(run)
        builders.source_layout(run)
        # Every child is built (pure) before any is created: one that cannot be is refused with nothing made.
        builders.check_children(run)
        if status.phase == Phase.PENDING:
            check_claims(rt, run)
        request = kueue.queue_request(run)
        if request is not None and not rt.config.kueue:
            raise builders.InvalidRunError(
                f"metadata.labels[{kueue.QUEUE_LABEL}] asks Kueue to admit the run, but this operator runs without "
                "Kueue (`grpo operator --kueue`, the chart's kueue.enabled): remove the label, or enable Kueue")
        queue = observe_queue(rt, run, status, request) if request is not None else None
    except NotServedError as exc:
        decision = reject(status, f"metadata.labels[{kueue.QUEUE_LABEL}] asks Kueue to admit the run, but the cluster "
                          f"serves no {exc} (is Kueue v0.17 or later installed?)", now, generation=generation)
        _record(rt, meta, raw_status, status, decision)
        _count_failures(namespace, name, decision)
        return rt.config.reconcile_interval
    except (ValidationError, builders.InvalidRunError, SourceError) as exc:
        message = (
            format_validation_error(f"GRPORun {namespace}/{name}", exc)
            if isinstance(exc, ValidationError)
            else str(exc)
        )
        decision = reject(status, message, now, generation=generation)
        _record(rt, meta, raw_status, status, decision)
        _count_failures(namespace, name, decision)
        return rt.config.reconcile_interval

    observed = observe(rt, run, status, children, now, queue.admission if queue is not None else None)
    decision = decide(run.spec, status, observed, generation=generation)
    try:
        deleted = execute(rt, run, children, decision, queue_placements(rt, queue))
        if queue is not None and not deleted:
            sync_workload(rt, run, queue, decision.status, children, now)
    except ChildConflictError as exc:
        if exc.of_earlier_run:
            # Re-created under a dying run's name: its children go first (GC), never adopted. The index had
            # not shown this one (or it is not watched, as the token Secret): the status says so all the same.
            decision = held_by_earlier_run(run.spec, status, observed, exc.leftover, generation=generation)
            _record(rt, meta, raw_status, status, decision)
            if decision.status.phase != Phase.PENDING and any(
                e.reason == Reason.WAITING_FOR_OLD_CHILDREN for e in decision.of_type(Emit)
            ):
                # Mid-run the phase and reason stay, so _record logs no transition: the wait gets its own line.
                log.info("%s/%s: waiting for what an earlier run of this name left to go: %s",
                         namespace, name, exc.leftover)
            return decision.requeue_after or rt.config.reconcile_interval
        decision = reject(status, str(exc), now, generation=generation, reason=Reason.CHILD_CONFLICT)
        _record(rt, meta, raw_status, status, decision)
        _count_failures(namespace, name, decision)
        return rt.config.reconcile_interval
    except (builders.InvalidRunError, SourceError) as exc:
        # A child the spec cannot make (check_children builds each before the first is created): no retry
        # fixes it, so the run fails naming the field instead of a reconcile that fails forever.
        decision = reject(status, str(exc), now, generation=generation)
        _record(rt, meta, raw_status, status, decision)
        _count_failures(namespace, name, decision)
        return rt.config.reconcile_interval
    except ApiException as exc:
        if not refused_for_good(exc):
            raise
        # The API server refuses a child built from the spec (a value no admission rule caught, a quota,
        # a webhook of the cluster): no retry can fix it, so the run fails with the server's words
        # instead of looping.
        decision = reject(status, f"a child of the run was refused by the API server: {_api_message(exc)}",
                          now, generation=generation, reason=Reason.CHILD_REJECTED)
        _record(rt, meta, raw_status, status, decision)
        _count_failures(namespace, name, decision)
        return rt.config.reconcile_interval
    if not deleted:
        _record(rt, meta, raw_status, status, decision)
        _count(run, status, decision, children, now)
    delay = decision.requeue_after
    interval = rt.config.reconcile_interval
    return max(MIN_REQUEUE_SECONDS, min(delay, interval) if delay is not None else interval)


def refused_for_good(exc: ApiException) -> bool:
    """A refusal of a child that no retry fixes: invalid (422), bad request (400), or forbidden (403) by
    admission or quota. The operator's own missing RBAC (also 403) is retried: an admin fixes it."""
    if exc.status in (400, 422):
        return True
    return exc.status == 403 and "cannot " not in _api_message(exc)


class ChildConflictError(Exception):
    """A child's name is taken by an object this run does not own."""

    def __init__(self, kind: str, name: str, owner: tuple[str, str] | None, terminating: bool) -> None:
        self.kind, self.name, self.owner, self.terminating = kind, name, owner, terminating
        #: Owned by another GRPORun (an earlier run of this name, being garbage-collected), or going away.
        self.of_earlier_run = terminating or (owner is not None and owner[0] == KIND)
        #: The object, described as the wait for it is reported.
        self.leftover = describe_leftover(kind, name, owner[1] if owner is not None and owner[0] == KIND else None,
                                          terminating)
        if self.of_earlier_run:
            detail = "was left by an earlier run of this name; waiting for it to go"
        elif owner is not None:
            detail = f"exists and is controlled by a {owner[0]} (uid {owner[1]}), not by this run"
        else:
            detail = "exists and is not owned by this run; delete it or give the run another name"
        super().__init__(f"{kind} {name} {detail}")


def create_owned(rt: Runtime, run: GRPORun, obj: dict[str, Any]) -> None:
    """Create a child; one that already exists is fine only when this run owns it (matched by uid)."""
    if rt.kube.create_if_absent(obj):
        return
    kind, namespace, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
    existing = rt.kube.read(kind, namespace, name)
    if existing is None:
        return  # gone since: created on the next reconcile
    meta = existing.get("metadata") or {}
    owner = owner_of(meta)
    if owner is not None and owner == (KIND, run.metadata.uid or ""):
        return
    raise ChildConflictError(kind, name, owner, bool(meta.get("deletionTimestamp")))


# -------------------------------------------------------------------------------------------- observe


def observe(
    rt: Runtime, run: GRPORun, status: GRPORunStatus, children: Children, now: dt.datetime,
    admission: QueueAdmission | None = None,
) -> Observation:
    """The lifecycle's view of the world: older servers, the trainer of this attempt, the server's health
    (with several replicas, each replica's), and Kueue's admission of a run it queues."""
    attempt = status.attempt
    server_mode = run.spec.mode == Mode.SERVER
    older = len(children.older_server_pods(attempt)) if server_mode and attempt > 0 else 0
    trainer = trainer_state(rt, run, status, children)
    service_url = builders.server_url(run)
    override = _server_url_override(rt, run)
    health: HealthCheck | None = None
    replica_health: tuple[HealthCheck, ...] = ()
    server_message = server_trouble(children, attempt) if server_mode and attempt > 0 else ""
    server_said = children.server_said_invalid_spec(attempt) if server_mode and attempt > 0 else None
    waiting_for_old = status.phase == Phase.STARTING_SERVER and older > 0
    if wants_health(run.spec, status) and not waiting_for_old:
        path = run.spec.effective_server.health_path
        if run.spec.effective_server.replicas > 1:
            replica_health = replica_checks(rt, run, children, attempt, override)
        if replica_health:
            # Older readers of `health` see the first replica's.
            health = replica_health[0]
        elif override is not None:
            health = rt.health.check(override, path)
        elif children.ready_pod(attempt) is not None:
            health = rt.health.check(service_url, path)
        else:
            # Without a Ready pod the Service has no endpoint: skip the HTTP call.
            trouble = f" ({server_message})" if server_message else ""
            health = HealthCheck(reachable=False, error=f"no ready server pod of attempt {attempt} yet{trouble}")
    initializer, initializer_message, progress = (
        initializer_state(rt, run, children) if status.phase == Phase.INITIALIZING else (TrainerState.ABSENT, "", None)
    )
    exporter, exporter_message, export_result = (
        exporter_state(rt, run, children) if status.phase == Phase.EXPORTING else (TrainerState.ABSENT, "", None)
    )
    attempt_running = status.phase in (Phase.STARTING_SERVER, Phase.TRAINING) and not run.spec.run_policy.suspend
    missing, lost = child_losses(rt, run, children) if attempt_running else ((), ())
    # Before the run made anything, whatever is under its name is an earlier run's (a later phase would
    # count its own finished pods as strays).
    earlier = (*children.left_by_earlier_run, *children.stray_pods()) if status.phase == Phase.PENDING else ()
    return Observation(
        now=now,
        older_servers_alive=older,
        health=health,
        replica_health=replica_health,
        trainer=trainer.state,
        trainer_message=trainer.message,
        trainer_failed_permanently=trainer.failed_permanently,
        trainer_preempted=trainer.preempted,
        server_url=(override or service_url) if server_mode else None,
        server_message=server_said or server_message,
        server_failed_permanently=server_said is not None,
        initializer=initializer,
        initializer_message=initializer_message,
        initializer_progress=progress,
        exporter=exporter,
        exporter_message=exporter_message,
        export_result=export_result,
        missing_children=missing,
        lost_children=lost,
        earlier_run_children=earlier,
        admission=admission,
    )


# ------------------------------------------------------------------------------------------------ Kueue


@dataclass(frozen=True)
class QueueView:
    """A run Kueue admits, as this reconcile found it: what its labels ask, Kueue's answer, its Workload."""

    request: kueue.QueueRequest
    admission: QueueAdmission
    #: The Workload as read (None: not created yet).
    workload: dict[str, Any] | None = None
    #: The priority a Workload created now gets (its WorkloadPriorityClass was found).
    priority: kueue.Priority | None = None


def observe_queue(rt: Runtime, run: GRPORun, status: GRPORunStatus, request: kueue.QueueRequest) -> QueueView:
    """The run's Workload and Kueue's answer. While it waits the labels' objects are looked up too, so a
    LocalQueue or WorkloadPriorityClass that does not exist is named in this reconcile's status (Kueue would say
    so of the LocalQueue only once its own controller got to the Workload)."""
    namespace = run.metadata.namespace or "default"
    name = kueue.workload_name(run)
    workload = rt.kube.read_kueue(kueue.WORKLOADS, name, namespace)
    if workload is not None:
        admission = kueue.admission_of(workload, request)
    else:
        admission = QueueAdmission(AdmissionState.WAITING, f"creating its Workload {name} in LocalQueue "
                                                           f"{request.local_queue}")
    if status.phase in TERMINAL_PHASES or admission.state != AdmissionState.WAITING:
        return QueueView(request, admission, workload)
    priority = None
    if workload is None and request.priority_class is not None:
        found = rt.kube.read_kueue(kueue.PRIORITY_CLASSES, request.priority_class)
        if found is None:
            return QueueView(request, kueue.priority_class_not_found(request))
        priority = kueue.Priority(request.priority_class, int(found.get("value", 0)))
    if rt.kube.read_kueue(kueue.LOCAL_QUEUES, request.local_queue, namespace) is None:
        admission = kueue.queue_not_found(request, namespace)
    return QueueView(request, admission, workload, priority)


def queue_placements(rt: Runtime, queue: QueueView | None) -> Callable[[str], builders.Admitted | None]:
    """Where Kueue admitted each pod set (its flavors read once, when a pod is first built), or nothing."""
    if queue is None or queue.workload is None or queue.admission.state != AdmissionState.ADMITTED:
        return lambda _: None
    workload = queue.workload
    found: dict[str, dict[str, builders.Admitted]] = {}

    def admitted(pod_set: str) -> builders.Admitted | None:
        if not found:
            flavors = {}
            for flavor in kueue.assigned_flavors(workload):
                read = rt.kube.read_kueue(kueue.FLAVORS, flavor)
                if read is None:
                    raise RuntimeError(f"ResourceFlavor {flavor}, which Kueue assigned to the run, does not exist")
                flavors[flavor] = read
            found["placements"] = kueue.admitted_placements(workload, flavors)
        return found["placements"].get(pod_set)

    return admitted


def sync_workload(
    rt: Runtime, run: GRPORun, queue: QueueView, status: GRPORunStatus, children: Children, now: dt.datetime
) -> None:
    """The run's Workload follows the run: created while it waits (unless its WorkloadPriorityClass is missing),
    deactivated while it is suspended, its eviction acknowledged and at the end finished, each once none of the
    run's pods is left (Kueue's quota stays reserved until then)."""
    namespace = run.metadata.namespace or "default"
    workload = queue.workload
    terminal = status.phase in TERMINAL_PHASES
    if workload is None:
        if not terminal and queue.admission.waiting_reason != Reason.PRIORITY_CLASS_NOT_FOUND:
            create_owned(rt, run, kueue.build_workload(run, queue.request, queue.priority, rt.config.images))
        return
    name = workload["metadata"]["name"]
    activity = kueue.activity_patch(workload, run) if not terminal else None
    if activity is not None:
        rt.kube.patch_workload(namespace, name, activity)
        return  # the status patch below would carry the old resourceVersion
    outcome = "Succeeded" if status.phase == Phase.SUCCEEDED else "Failed"
    finished = (outcome, status.message or "") if terminal else None
    patch = kueue.status_patch(workload, finished=finished, now=now,
                               pods_gone=children.pods_gone(builders.child_names(run).initializer))
    if patch is None:
        return
    try:
        rt.kube.patch_workload(namespace, name, patch, status=True)
    except ApiException as exc:
        if exc.status != 409:
            raise
        log.info("%s/%s: Workload %s changed meanwhile; written again next time", namespace, run.metadata.name, name)


def replica_checks(
    rt: Runtime, run: GRPORun, children: Children, attempt: int, override: str | None
) -> tuple[HealthCheck, ...]:
    """One health check per server replica of the attempt: each pod that is not going away, at its own
    IP (the Service would answer from any one of them); one that is not Ready is not called. With the
    server-url override (tests, out-of-cluster servers), each of its comma-separated URLs instead."""
    server = run.spec.effective_server
    if override is not None:
        urls = [url.strip() for url in override.split(",") if url.strip()]
        return tuple(rt.health.check(url, server.health_path) for url in urls)
    checks: list[HealthCheck] = []
    for pod in children.pods_of(attempt):
        if pod.ready and pod.ip:
            checks.append(rt.health.check(pod_url(pod.ip, server.port), server.health_path))
        else:
            checks.append(HealthCheck(reachable=False, error=f"pod {pod.name} not ready"))
    return tuple(checks)


def pod_url(ip: str, port: int) -> str:
    """The base URL of a pod's port (an IPv6 address in brackets)."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def child_losses(rt: Runtime, run: GRPORun, children: Children) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The provisioned children of a running attempt that are gone: (re-creatable ones, ones whose loss
    ends the attempt). The index says what exists; a GET confirms an absence (the index may lag behind a
    child created moments ago). The token Secret is read by name, every TOKEN_CHECK_SECONDS."""
    namespace = run.metadata.namespace or "default"
    uid = run.metadata.uid or ""
    names = builders.child_names(run)

    def gone(kind: str, name: str) -> bool:
        return not children.has(kind, name) and rt.kube.read(kind, namespace, name) is None

    lost: list[str] = []
    missing: list[str] = []
    if gone("ConfigMap", names.config):
        lost.append(f"run-config ConfigMap {names.config}")
    if builders.build_rewards_config_map(run) is not None and gone("ConfigMap", names.rewards):
        missing.append(f"ConfigMap {names.rewards}")
    if run.spec.storage.existing_claim is None and gone("PersistentVolumeClaim", names.data):
        missing.append(f"PersistentVolumeClaim {names.data}")
    if run.spec.trainer.num_nodes > 1 and gone("Service", names.trainer_rendezvous):
        missing.append(f"Service {names.trainer_rendezvous}")
    if run.spec.mode == Mode.SERVER:
        if gone("Service", names.server):
            missing.append(f"Service {names.server}")
        if gone("Service", names.replicas):
            missing.append(f"Service {names.replicas}")
        if rt.config.server_ingress is not None and gone("NetworkPolicy", names.server_network_policy):
            missing.append(f"NetworkPolicy {names.server_network_policy}")
        last = rt.token_seen.get(uid)
        if last is None or time.monotonic() - last >= TOKEN_CHECK_SECONDS:
            if rt.kube.read("Secret", namespace, names.token) is None:
                lost.append(f"token Secret {names.token}")
            else:
                rt.token_seen[uid] = time.monotonic()
    return tuple(missing), tuple(lost)


def step_job(rt: Runtime, namespace: str, name: str, children: Children) -> JobInfo | None:
    """A one-off step's Job (the initializer's, the export's): from the watched children, else read."""
    job = children.job(name)
    if job is None:
        raw = rt.kube.read_job(namespace, name)
        job = job_info(raw) if raw is not None else None
    return job


def initializer_state(rt: Runtime, run: GRPORun, children: Children) -> tuple[TrainerState, str, str | None]:
    """The initializer Job's state, its trouble (or why it failed) and its latest progress line."""
    namespace = run.metadata.namespace or "default"
    name = builders.child_names(run).initializer
    job = step_job(rt, namespace, name, children)
    if job is None:
        return TrainerState.ABSENT, "", None
    pods = children.job_pods(name)
    # Its own last words (its termination message is a protocol line) say more than the pod's exit.
    said = next((latest_progress(p.termination_message) or p.termination_message
                 for p in pods if p.termination_message), "")
    # The log is read while its pod runs, and once when the Job ends without last words to read.
    progress: str | None = None
    if job.state != TrainerState.ACTIVE:
        if said:
            progress = said
        elif pods and pods[0].started:
            progress = latest_progress(rt.kube.pod_log_tail(namespace, pods[0].name))
    elif pods and pods[0].running:
        progress = latest_progress(rt.kube.pod_log_tail(namespace, pods[0].name))
    problem = next((f"pod {p.name}: {p.problem}" for p in pods if p.problem and not p.termination_message), "")
    if job.state == TrainerState.FAILED:
        return job.state, said or progress or problem or job.message, progress
    if job.state == TrainerState.ACTIVE:
        # A pod that failed and is being retried: its words, as trouble, beside the progress.
        return job.state, problem or (f"retrying after: {said}" if said else ""), progress
    return job.state, "", progress


def exporter_state(rt: Runtime, run: GRPORun, children: Children) -> tuple[TrainerState, str, ExportResult | None]:
    """The export Job's state, its trouble (or why it failed) and its result line once it succeeded."""
    namespace = run.metadata.namespace or "default"
    name = builders.child_names(run).exporter
    job = step_job(rt, namespace, name, children)
    if job is None:
        return TrainerState.ABSENT, "", None
    pods = children.job_pods(name)
    said = next((p.termination_message for p in pods if p.termination_message), "")
    if job.state == TrainerState.SUCCEEDED:
        return job.state, "", parse_result(said)
    problem = next((f"pod {p.name}: {p.problem}" for p in pods if p.problem and not p.termination_message), "")
    if job.state == TrainerState.FAILED:
        return job.state, said.strip() or problem or job.message, None
    return job.state, problem or (f"retrying after: {said.strip()}" if said else ""), None


def check_claims(rt: Runtime, run: GRPORun) -> None:
    """Refuse, before anything is created, an existing claim that server mode cannot share."""
    if run.spec.mode != Mode.SERVER:
        return
    namespace = run.metadata.namespace or "default"
    for claim in builders.claims_of(run):
        if claim == builders.child_names(run).data:
            continue  # made by us, from storage.accessModes (checked at admission)
        modes = claim_access_modes(rt, namespace, claim)
        if modes == ["ReadWriteOncePod"]:
            raise builders.InvalidRunError(
                f"claim {claim} is ReadWriteOncePod: one pod may mount it, but server mode runs a server and "
                "a trainer on it; use a ReadWriteOnce (same node) or ReadWriteMany claim"
            )


def claim_access_modes(rt: Runtime, namespace: str, claim: str) -> list[str] | None:
    """A claim's access modes (its bound volume's once bound), None when it does not exist yet."""
    raw = rt.kube.read_claim(namespace, claim)
    if raw is None:
        return None
    modes = (raw.get("status") or {}).get("accessModes") or (raw.get("spec") or {}).get("accessModes")
    return [str(m) for m in modes] if modes else None


def placement(rt: Runtime, run: GRPORun) -> builders.Placement:
    """Where the trainer may go: on the server's node when a claim both mount cannot span nodes."""
    if run.spec.mode != Mode.SERVER:
        return builders.Placement()
    namespace = run.metadata.namespace or "default"
    data = builders.volume_claim_name(run)
    modes: dict[str, list[str] | None] = {}
    for claim in builders.claims_of(run):
        if claim == builders.child_names(run).data and run.spec.storage.existing_claim is None:
            modes[claim] = list(run.spec.storage.access_modes)
        else:
            modes[claim] = claim_access_modes(rt, namespace, claim)
    return builders.Placement(same_node=builders.needs_same_node(modes, data))


def server_trouble(children: Children, attempt: int) -> str:
    """What keeps the attempt's server from running (its pod's trouble, or its Deployment's), or ""."""
    pod = children.pod_of(attempt)
    if pod is not None and pod.problem:
        return f"pod {pod.name}: {pod.problem}"
    deployment = children.deployment
    if deployment is not None and deployment.problem:
        return f"deployment {deployment.name}: {deployment.problem}"
    return ""


class TrainerSeen(NamedTuple):
    """The attempt's trainer Job as the lifecycle sees it."""

    state: TrainerState
    #: What it said (the Job's condition, its pod's trouble, its termination message).
    message: str = ""
    #: It failed on a configuration problem (its podFailurePolicy's exit-code rule, or a pod's EXIT_INVALID_SPEC).
    failed_permanently: bool = False
    #: It failed because a pod of it was preempted or evicted (DisruptionTarget).
    preempted: bool = False


def trainer_state(rt: Runtime, run: GRPORun, status: GRPORunStatus, children: Children) -> TrainerSeen:
    """The attempt's trainer Job: its state, what it said, whether it failed permanently (its
    podFailurePolicy failed it, or its pod exited with EXIT_INVALID_SPEC: a configuration problem), and
    whether it failed because a pod of it was preempted or evicted: the pod's DisruptionTarget condition
    while the pod is there, the Job's own Failed condition (its podFailurePolicy's DisruptionTarget rule)
    once it is gone."""
    if status.attempt < 1:
        return TrainerSeen(TrainerState.ABSENT)
    name = builders.child_names(run).trainer(status.attempt)
    job = children.job(name)
    if job is None and status.phase == Phase.TRAINING:
        # The index may lag behind a Job created moments ago: ask before calling it gone.
        raw = rt.kube.read_job(run.metadata.namespace or "default", name)
        job = job_info(raw) if raw is not None else None
    if job is None:
        return TrainerSeen(TrainerState.ABSENT)
    problem = children.trainer_problem(name) if job.state == TrainerState.FAILED else ""
    message = "; ".join(part for part in (job.message, problem) if part)
    permanent = job.state == TrainerState.FAILED and (
        job.failed_by_policy or children.failed_by_exit_code(name, EXIT_INVALID_SPEC)
    )
    if permanent:
        # The trainer's own words (its termination log) name the field and the file; the Job's say "exit code 2".
        # With several pods, the one that exited with the code speaks, not a rank the Job controller stopped.
        pods = sorted(children.job_pods(name), key=lambda p: p.exit_code != EXIT_INVALID_SPEC)
        said = next((p.termination_message.strip() for p in pods if p.termination_message), "")
        message = said or message
        return TrainerSeen(job.state, message, failed_permanently=True)
    if job.state == TrainerState.FAILED:
        disruption = children.disruption(name)
        if disruption or job.failed_by_disruption:
            return TrainerSeen(job.state, disruption or job.message, preempted=True)
    return TrainerSeen(job.state, message)


def _server_url_override(rt: Runtime, run: GRPORun) -> str | None:
    if not rt.config.allow_server_url_override:
        return None
    return run.metadata.annotations.get(builders.SERVER_URL_ANNOTATION) or None


# -------------------------------------------------------------------------------------------- execute


def execute(
    rt: Runtime,
    run: GRPORun,
    children: Children,
    decision: Decision,
    admitted: Callable[[str], builders.Admitted | None] = lambda _: None,
) -> bool:
    """Carry out the decision's actions, the pods where Kueue admitted them (`admitted`, by pod set); True when the
    run itself was deleted."""
    namespace = run.metadata.namespace or "default"
    names = builders.child_names(run)
    deployment = children.deployment
    for action in decision.actions:
        match action:
            case Provision():
                provision(rt, run)
            case CreateInitializer():
                if children.job(names.initializer) is None:
                    create_owned(rt, run, builders.build_initializer_job(run, rt.config.images,
                                                                         admitted(kueue.TRAINER_POD_SET)))
            case CreateExporter():
                if run.spec.output is not None and children.job(names.exporter) is None:
                    exporter_job = builders.build_exporter_job(run, rt.config.images, admitted(kueue.TRAINER_POD_SET))
                    if exporter_job is not None:
                        create_owned(rt, run, exporter_job)
            case EnsureServer(attempt=attempt, replicas=replicas):
                if deployment is not None and deployment.attempt == attempt and deployment.replicas == replicas:
                    continue
                # Several replicas sharing a claim that cannot span nodes must share a node.
                where = placement(rt, run) if run.spec.effective_server.replicas > 1 else builders.Placement()
                where = replace(where, admitted=admitted(kueue.SERVER_POD_SET))
                desired = builders.build_server_deployment(run, attempt, replicas, rt.config.images, where)
                if deployment is None:
                    create_owned(rt, run, desired)
                else:
                    rt.kube.patch_deployment(
                        namespace,
                        names.server,
                        {
                            "metadata": {"annotations": desired["metadata"]["annotations"]},
                            "spec": desired["spec"],
                        },
                    )
            case StopServer():
                if deployment is not None and deployment.replicas != 0:
                    rt.kube.patch_deployment(namespace, names.server, {"spec": {"replicas": 0}})
            case DeleteServer():
                if deployment is not None:
                    rt.kube.delete_if_present("Service", namespace, names.server)
                    rt.kube.delete_if_present("Service", namespace, names.replicas)
                    rt.kube.delete_if_present("Deployment", namespace, names.server)
            case CreateTrainer(attempt=attempt):
                if children.job(names.trainer(attempt)) is None:
                    where = replace(placement(rt, run), admitted=admitted(kueue.TRAINER_POD_SET))
                    job = builders.build_trainer_job(run, attempt, rt.config.images, where)
                    create_owned(rt, run, job)
            case DeleteTrainer(attempt=attempt):
                rt.kube.delete_if_present("Job", namespace, names.trainer(attempt))
            case DeleteExporter():
                rt.kube.delete_if_present("Job", namespace, names.exporter)
            case DeleteRun():
                log.info("deleting %s/%s: ttlSecondsAfterFinished passed", namespace, run.metadata.name)
                rt.kube.delete_run(namespace, run.metadata.name, run.metadata.uid or "")
                return True
            case Emit() | RequeueAfter():
                pass  # events are posted once the status is recorded; requeues are returned
            case _:
                assert_never(action)
    return False


def provision(rt: Runtime, run: GRPORun) -> None:
    """Run-config, volume claim, token and the Services (the trainer's too, with several trainer pods):
    created once, kept as they are if they exist."""
    objects = [
        builders.build_config_map(run),
        builders.build_volume_claim(run),
        builders.build_rewards_config_map(run),
    ]
    if run.spec.mode == Mode.SERVER:
        objects += [
            builders.build_token_secret(run, secrets.token_urlsafe(32)),
            builders.build_service(run),
            builders.build_replica_service(run),
        ]
        if rt.config.server_ingress is not None:
            objects.append(builders.build_network_policy(run, rt.config.server_ingress))
    if run.spec.trainer.num_nodes > 1:
        # The trainer pods' subdomain, where the ranks find each other; kept until the run goes.
        objects.append(builders.build_trainer_service(run))
    for obj in objects:
        if obj is not None:
            create_owned(rt, run, obj)


# --------------------------------------------------------------------------------------------- record


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns old into new."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif value != before or key not in old:
            patch[key] = value
    return patch


def _record(
    rt: Runtime,
    meta: dict[str, Any],
    raw_status: dict[str, Any],
    status: GRPORunStatus,
    decision: Decision,
) -> None:
    """The status (only if changed; the failed-attempt count is part of it), then the transition's events."""
    namespace, name, uid = str(meta["namespace"]), str(meta["name"]), str(meta["uid"])
    new_wire = decision.status.to_wire()
    if new_wire != status.to_wire():
        rt.known_versions[uid] = rt.kube.patch_run_status(namespace, name, merge_patch(raw_status, new_wire))
    for emit in decision.of_type(Emit):
        try:
            rt.kube.create_event(namespace, name, uid, emit.type, emit.reason, emit.message)
        except ApiException as exc:
            log.warning("could not post event %s on %s/%s: %s", emit.reason, namespace, name, exc.reason)
    if (decision.status.phase, decision.status.reason) != (status.phase, status.reason):
        log.info("%s/%s: %s -> %s (%s): %s", namespace, name, status.phase, decision.status.phase,
                 decision.status.reason, decision.status.message)
    rt.phases[uid] = decision.status.phase
    rt.names[uid] = (namespace, name)
    metrics.set_runs_by_phase(rt.phases)
    metrics.set_run(namespace, name, decision.status.phase, decision.status.attempt)


def _count_failures(namespace: str, name: str, decision: Decision) -> None:
    for emit in decision.of_type(Emit):
        if emit.type == "Warning" and emit.reason in metrics.FAILURE_REASONS:
            metrics.count_run_failure(namespace, name, emit.reason)


def _count(run: GRPORun, before: GRPORunStatus, decision: Decision, children: Children, now: dt.datetime) -> None:
    after = decision.status
    if after.attempt > before.attempt:
        metrics.ATTEMPTS.inc(after.attempt - before.attempt)
    _count_failures(run.metadata.namespace or "default", run.metadata.name, decision)
    passed_gate = (
        before.phase == Phase.STARTING_SERVER and after.server.ready and run.spec.mode == Mode.SERVER
    )
    if passed_gate:
        pod = children.pod_of(after.attempt)
        if pod is not None and pod.created is not None:
            metrics.SERVER_READY_LATENCY.observe(max(0.0, (now - pod.created).total_seconds()))
