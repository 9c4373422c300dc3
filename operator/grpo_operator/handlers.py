"""kopf wiring, and nothing else: settings, child indexes, one reconcile loop per run, probes.

Each GRPORun gets a daemon that reconciles it, sleeps for the delay the decision asked for
(at most the reconcile interval), and wakes early when the run's spec or annotations change.
Children are read from kopf indexes (watch-fed caches), so a quiet reconcile costs no API call.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
import prometheus_client

from grpo_api.health import HealthClient
from grpo_api.models import GROUP, PLURAL, VERSION
from grpo_operator import builders, children, reconcile
from grpo_operator.kube import KubeClient, load_api_client

log = logging.getLogger("grpo_operator")

RunKey = tuple[str, str]
#: kopf's own bookkeeping goes under our domain, not kopf.zalando.org.
KOPF_PREFIX = builders.LABEL_PREFIX


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: reconcile.OperatorConfig = memo.get("config") or reconcile.OperatorConfig()
    settings.persistence.finalizer = f"{KOPF_PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    # Our reconciler posts its own events; kopf's log lines would repeat them.
    settings.posting.enabled = False
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    select_children_server_side(settings)
    memo["runtime"] = reconcile.Runtime(
        config=config,
        kube=KubeClient(load_api_client()),
        health=HealthClient(config.health_timeout),
        executor=ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="reconcile"),
    )
    if config.metrics_port:
        prometheus_client.start_http_server(config.metrics_port)


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_: Any) -> None:
    runtime: reconcile.Runtime | None = memo.get("runtime")
    if runtime is not None:
        runtime.executor.shutdown(wait=False, cancel_futures=True)
        runtime.health.close()


# -------------------------------------------------------------------------------------------- indexes

#: (API group, plural) of the children kinds watched below. kopf filters by labels in-process only; its
#: list and watch requests for these carry `labelSelector=grpo.dev/run` instead (kopf's public
#: `settings.watching.label_selectors`), so the API server sends the operator the run's children and not
#: every Pod, Job or ConfigMap of the namespace.
SELECTED_RESOURCES = frozenset(
    {
        ("", "pods"),
        ("apps", "deployments"),
        ("batch", "jobs"),
        ("", "configmaps"),
        ("", "services"),
        ("", "persistentvolumeclaims"),
        ("networking.k8s.io", "networkpolicies"),
    }
)


def select_children_server_side(settings: kopf.OperatorSettings, selector: str = builders.RUN_LABEL) -> None:
    """kopf's list and watch requests of the children kinds carry `labelSelector=selector`. The key is (group,
    name): the core group is "", so `pods` of another group (metrics.k8s.io) is not selected by mistake."""
    for group, plural in sorted(SELECTED_RESOURCES):
        settings.watching.label_selectors[group, plural] = selector


def _run_key(namespace: str | None, labels: kopf.Labels) -> RunKey:
    return (namespace or "", labels[builders.RUN_LABEL])


@kopf.index("pods", labels={builders.RUN_LABEL: kopf.PRESENT})
def run_pods(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> dict[RunKey, Any]:
    return {_run_key(namespace, labels): children.pod_info(dict(body))}


@kopf.index(
    "apps",
    "v1",
    "deployments",
    labels={builders.RUN_LABEL: kopf.PRESENT, builders.COMPONENT_LABEL: builders.SERVER},
)
def server_deployments(
    body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
) -> dict[RunKey, Any]:
    return {_run_key(namespace, labels): children.deployment_info(dict(body))}


@kopf.index(
    "batch",
    "v1",
    "jobs",
    labels={
        builders.RUN_LABEL: kopf.PRESENT,
        builders.COMPONENT_LABEL: lambda value, **_: value in (builders.TRAINER, builders.INITIALIZER,
                                                                builders.EXPORTER),
    },
)
def trainer_jobs(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> dict[RunKey, Any]:
    return {_run_key(namespace, labels): children.job_info(dict(body))}


def _provisioned(kind: str) -> Any:
    def index(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> dict[RunKey, Any]:
        return {_run_key(namespace, labels): children.object_info(kind, dict(body))}

    return index


_RUN_LABELLED = {builders.RUN_LABEL: kopf.PRESENT}
run_config_maps = kopf.index("configmaps", labels=_RUN_LABELLED, id="run_config_maps")(_provisioned("ConfigMap"))
run_services = kopf.index("services", labels=_RUN_LABELLED, id="run_services")(_provisioned("Service"))
run_claims = kopf.index("persistentvolumeclaims", labels=_RUN_LABELLED, id="run_claims")(
    _provisioned("PersistentVolumeClaim")
)
run_network_policies = kopf.index(
    "networking.k8s.io", "v1", "networkpolicies", labels=_RUN_LABELLED, id="run_network_policies"
)(_provisioned("NetworkPolicy"))


# --------------------------------------------------------------------------------------------- runs


# kopf passes the indexes as extra kwargs, which its DaemonFn protocol cannot express.
@kopf.daemon(  # type: ignore[arg-type]
    GROUP, VERSION, PLURAL, id="reconcile", backoff=5, cancellation_backoff=5, cancellation_timeout=10
)
async def reconcile_run(
    body: kopf.Body,
    meta: kopf.Meta,
    memo: kopf.Memo,
    stopped: kopf.DaemonStopped,
    run_pods: kopf.Index[RunKey, children.PodInfo],
    server_deployments: kopf.Index[RunKey, children.DeploymentInfo],
    trainer_jobs: kopf.Index[RunKey, children.JobInfo],
    run_config_maps: kopf.Index[RunKey, children.ObjectInfo],
    run_services: kopf.Index[RunKey, children.ObjectInfo],
    run_claims: kopf.Index[RunKey, children.ObjectInfo],
    run_network_policies: kopf.Index[RunKey, children.ObjectInfo],
    **_: Any,
) -> None:
    runtime: reconcile.Runtime = memo["runtime"]
    uid, key = str(meta.uid), (meta.namespace or "", meta.name or "")
    wakeup: asyncio.Event = memo.setdefault("wakeup", asyncio.Event())
    loop = asyncio.get_running_loop()
    try:
        while not stopped:
            wakeup.clear()
            objects = [
                *run_config_maps.get(key, []),
                *run_services.get(key, []),
                *run_claims.get(key, []),
                *run_network_policies.get(key, []),
            ]
            snapshot = children.snapshot(
                uid, run_pods.get(key, []), server_deployments.get(key, []), trainer_jobs.get(key, []), objects
            )
            raw = copy.deepcopy(dict(body))
            delay = await loop.run_in_executor(runtime.executor, reconcile.reconcile, runtime, raw, snapshot)
            await _nap(delay, wakeup, stopped)
    finally:
        runtime.forget(uid)


async def _nap(delay: float, wakeup: asyncio.Event, stopped: kopf.DaemonStopped) -> None:
    """Sleep until the delay passes, the run changes, or the daemon is asked to stop."""
    waits = {asyncio.ensure_future(wakeup.wait()), asyncio.ensure_future(stopped.wait(delay))}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def wake_on_change(meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """A changed spec (suspend, deadlines) or server URL is acted on now, not at the next tick."""
    marker = (meta.get("generation"), meta.annotations.get(builders.SERVER_URL_ANNOTATION))
    if memo.get("seen") == marker:
        return
    memo["seen"] = marker
    wakeup: asyncio.Event | None = memo.get("wakeup")
    if wakeup is not None:
        wakeup.set()


# ------------------------------------------------------------------------------------------- probes


@kopf.on.probe(id="secondsSinceLastReconcile")
def seconds_since_last_reconcile(memo: kopf.Memo, **_: Any) -> float:
    runtime: reconcile.Runtime | None = memo.get("runtime")
    if runtime is None:
        return 0.0
    return round(time.monotonic() - runtime.last_reconcile, 1)
