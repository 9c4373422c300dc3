"""The Kubernetes API as the reconciler uses it: create-if-absent, delete-if-present, patch, status.

A thin layer over the official client: "already exists" on create and "not found" on
delete are success (names are deterministic, so a repeated action is harmless), every
request is counted in `grpo_operator_api_requests_total`, and objects go in and come
out as plain dicts (the builders' output).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from grpo_api.models import API_VERSION, GROUP, KIND, PLURAL, VERSION
from grpo_operator import kueue, metrics

MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "grpo-operator"
#: Requests that hang must not stall a reconcile thread for long.
REQUEST_TIMEOUT_SECONDS = 15


class NotServedError(Exception):
    """The API server serves no such resource (its CRD is not installed)."""


def load_api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class KubeClient:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.networking = client.NetworkingV1Api(api_client)

    def _call(self, verb: str, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One request; the answer as a plain dict (the client's model classes cost CPU and are not needed)."""
        metrics.API_REQUESTS.labels(verb=verb, kind=kind).inc()
        response = fn(*args, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False, **kwargs)
        body: dict[str, Any] = json.loads(response.data) if response.data else {}
        return body

    # -- children --------------------------------------------------------------------------------

    def _creator(self, kind: str) -> Callable[..., Any]:
        creators: dict[str, Callable[..., Any]] = {
            "ConfigMap": self.core.create_namespaced_config_map,
            "Secret": self.core.create_namespaced_secret,
            "PersistentVolumeClaim": self.core.create_namespaced_persistent_volume_claim,
            "Service": self.core.create_namespaced_service,
            "Deployment": self.apps.create_namespaced_deployment,
            "Job": self.batch.create_namespaced_job,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
            "Workload": self._create_workload,
        }
        return creators[kind]

    def _create_workload(self, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        return self.custom.create_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, body, **kwargs)

    def create_if_absent(self, obj: dict[str, Any]) -> bool:
        """Create the object; False when it already existed (which is fine: names are deterministic)."""
        kind, namespace = obj["kind"], obj["metadata"]["namespace"]
        try:
            self._call("create", kind, self._creator(kind), namespace, obj, field_manager=FIELD_MANAGER)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def patch_deployment(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self._call(
            "patch",
            "Deployment",
            self.apps.patch_namespaced_deployment,
            name,
            namespace,
            patch,
            field_manager=FIELD_MANAGER,
            _content_type=MERGE_PATCH,
        )

    def delete_if_present(self, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background (dependents go with it); False when it was not there."""
        deleters: dict[str, Callable[..., Any]] = {
            "Service": self.core.delete_namespaced_service,
            "Deployment": self.apps.delete_namespaced_deployment,
            "Job": self.batch.delete_namespaced_job,
        }
        try:
            self._call("delete", kind, deleters[kind], name, namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One child by name, None when it does not exist."""
        readers: dict[str, Callable[..., Any]] = {
            "ConfigMap": self.core.read_namespaced_config_map,
            "Secret": self.core.read_namespaced_secret,
            "PersistentVolumeClaim": self.core.read_namespaced_persistent_volume_claim,
            "Service": self.core.read_namespaced_service,
            "Deployment": self.apps.read_namespaced_deployment,
            "Job": self.batch.read_namespaced_job,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
        }
        if kind == "Workload":
            return self.read_kueue(kueue.WORKLOADS, name, namespace)
        try:
            return self._call("get", kind, readers[kind], name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("get", "Job", self.batch.read_namespaced_job, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call(
                "get", "PersistentVolumeClaim", self.core.read_namespaced_persistent_volume_claim, name, namespace
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- Kueue ------------------------------------------------------------------------------------

    def read_kueue(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """A Kueue object (namespaced, or cluster-scoped without a namespace), None when it does not exist;
        NotServedError when the API server serves no such resource (Kueue is not installed)."""
        try:
            if namespace is None:
                return self._call("get", plural, self.custom.get_cluster_custom_object,
                                  kueue.GROUP, kueue.VERSION, plural, name)
            return self._call("get", plural, self.custom.get_namespaced_custom_object,
                              kueue.GROUP, kueue.VERSION, namespace, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                details = (json.loads(exc.body or "{}") or {}).get("details") or {}
            except (TypeError, ValueError):
                details = {}
            if details.get("name"):  # the object is missing, not its kind
                return None
            raise NotServedError(f"{plural}.{kueue.GROUP}/{kueue.VERSION}") from exc

    def patch_workload(self, namespace: str, name: str, patch: dict[str, Any], *, status: bool = False) -> None:
        """Merge-patch a Workload (or its status); a resourceVersion in the patch makes it conditional."""
        patcher = (self.custom.patch_namespaced_custom_object_status if status
                   else self.custom.patch_namespaced_custom_object)
        self._call("patch", "Workload/status" if status else "Workload", patcher, kueue.GROUP, kueue.VERSION,
                   namespace, kueue.WORKLOADS, name, patch, field_manager=FIELD_MANAGER, _content_type=MERGE_PATCH)

    def pod_log_tail(self, namespace: str, name: str, lines: int = 20, limit_bytes: int = 16384) -> str:
        """The last lines of a pod's log ("" when the pod or its log is gone)."""
        metrics.API_REQUESTS.labels(verb="get", kind="Pod/log").inc()
        try:
            response = self.core.read_namespaced_pod_log(
                name,
                namespace,
                tail_lines=lines,
                limit_bytes=limit_bytes,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status in (400, 404):  # not started yet, or gone
                return ""
            raise
        return bytes(response.data or b"").decode("utf-8", errors="replace")

    # -- the run itself --------------------------------------------------------------------------

    def read_run(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call(
                "get", KIND, self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_run_status(self, namespace: str, name: str, status: dict[str, Any]) -> str:
        """Merge-patch the status subresource; returns the new resourceVersion."""
        body = self._call(
            "patch",
            f"{KIND}/status",
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": status},
            field_manager=FIELD_MANAGER,
            _content_type=MERGE_PATCH,
        )
        return str(body["metadata"]["resourceVersion"])

    def delete_run(self, namespace: str, name: str, uid: str) -> bool:
        try:
            self._call(
                "delete",
                KIND,
                self.custom.delete_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                propagation_policy="Background",
                body=client.V1DeleteOptions(preconditions={"uid": uid}),
            )
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    def create_event(
        self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str
    ) -> None:
        now = dt.datetime.now(dt.UTC)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": name,
                "namespace": namespace,
                "uid": uid,
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": FIELD_MANAGER,
            "firstTimestamp": now.isoformat(),
            "lastTimestamp": now.isoformat(),
            "count": 1,
        }
        self._call("create", "Event", self.core.create_namespaced_event, namespace, event)
