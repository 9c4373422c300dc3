"""The cluster commands' one door to the API server.

Credentials and the default namespace come from the kubeconfig and its context exactly as `grpo stage`
takes them (`--kubeconfig`, `$KUBECONFIG`, `~/.kube/config`, else in-cluster). Every failure becomes a
`ClusterError` whose words name the run, the namespace and, on 403, the permission that is missing.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from grpo_api.models import GROUP, KIND, PLURAL, VERSION
from grpo_operator.builders import COMPONENT_LABEL, RUN_LABEL
from grpo_stage import kube as stage_kube
from grpo_stage.errors import StageError

REQUEST_TIMEOUT_SECONDS = 30


class ClusterError(Exception):
    """A failure to report to the user in one line, naming the run, namespace or field (no traceback)."""


def api_message(exc: ApiException) -> str:
    """The API server's own message (its Status body) or the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    return f"{exc.status} {message or exc.reason}"


def _crd_missing(exc: ApiException) -> bool:
    """A 404 for the resource type itself (no CRD), not for one object."""
    try:
        details = json.loads(exc.body or "").get("details") or {}
    except (TypeError, ValueError, AttributeError):
        return True
    return not details.get("name")


class ClusterApi:
    """The calls the cluster commands make, in one namespace."""

    def __init__(self, api_client: client.ApiClient, namespace: str) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    @classmethod
    def connect(cls, kubeconfig: str | None, context: str | None, namespace: str | None) -> ClusterApi:
        try:
            api_client, default_namespace = stage_kube.load_client(kubeconfig, context)
        except StageError as exc:
            raise ClusterError(str(exc)) from exc
        return cls(api_client, namespace or default_namespace)

    def where(self, name: str) -> str:
        return f"GRPORun {name} in namespace {self.namespace}"

    @contextlib.contextmanager
    def _calling(self, action: str, what: str, needs: str) -> Iterator[None]:
        """Turn the client's exceptions into a ClusterError: '<action> <what>: <why>'."""
        try:
            yield
        except ApiException as exc:
            if exc.status == 404 and what.startswith("GRPORun") and _crd_missing(exc):
                raise ClusterError(
                    f"cannot {action} {what}: the API server has no GRPORun resource (is the CRD installed? "
                    "kubectl get crd grporuns.grpo.dev)"
                ) from exc
            if exc.status == 404:
                raise ClusterError(f"{what} not found") from exc
            hint = f" (this needs: {needs} in namespace {self.namespace})" if exc.status == 403 else ""
            raise ClusterError(f"cannot {action} {what}: {api_message(exc)}{hint}") from exc
        except urllib3.exceptions.HTTPError as exc:
            host = self.api_client.configuration.host
            raise ClusterError(f"cannot {action} {what}: the API server at {host} did not answer ({exc})") from exc

    def _json(self, response: Any) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(response.data) if response.data else {}
        return body

    # ---------------------------------------------------------------------------------------- runs

    def get_run(self, name: str) -> dict[str, Any]:
        with self._calling("read", self.where(name), "get grporuns"):
            return self._json(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name,
                _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False,
            ))

    def list_runs(self, all_namespaces: bool = False) -> list[dict[str, Any]]:
        what = "GRPORuns in all namespaces" if all_namespaces else f"GRPORuns in namespace {self.namespace}"
        with self._calling("list", what, "list grporuns"):
            if all_namespaces:
                response = self.custom.list_cluster_custom_object(
                    GROUP, VERSION, PLURAL, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False
                )
            else:
                response = self.custom.list_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False,
                )
            items: list[dict[str, Any]] = self._json(response).get("items") or []
            return items

    def watch_run(self, name: str, resource_version: str, timeout_seconds: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event type, object) of the run from resource_version on, for at most timeout_seconds.

        Ends quietly when the server ends the watch; a 410 (the version is too old) ends it too: the
        caller reads the run again and watches from there."""
        stream = watch.Watch()
        try:
            with self._calling("watch", self.where(name), "watch grporuns"):
                for event in stream.stream(
                    self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                    field_selector=f"metadata.name={name}", resource_version=resource_version,
                    timeout_seconds=timeout_seconds, _request_timeout=timeout_seconds + REQUEST_TIMEOUT_SECONDS,
                ):
                    obj = event.get("object")
                    if event.get("type") == "ERROR" or not isinstance(obj, dict):
                        return
                    yield str(event["type"]), obj
        except ClusterError as exc:
            if isinstance(exc.__cause__, ApiException) and exc.__cause__.status == 410:
                return
            raise
        finally:
            stream.stop()

    def patch_run_policy(self, name: str, run_policy: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch spec.runPolicy (the one section that may change mid-run)."""
        with self._calling("patch", self.where(name), "patch grporuns"):
            return self._json(self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, {"spec": {"runPolicy": run_policy}},
                _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False,
            ))

    def delete_run(self, name: str, uid: str) -> None:
        """Delete this run (its uid: a run re-created under the name meanwhile is left alone)."""
        with self._calling("delete", self.where(name), "delete grporuns"):
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name,
                body=client.V1DeleteOptions(propagation_policy="Background", preconditions={"uid": uid}),
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )

    def run_events(self, name: str) -> list[dict[str, Any]]:
        """The Events about the run (the operator's, one per transition and warning)."""
        selector = f"involvedObject.kind={KIND},involvedObject.name={name}"
        with self._calling("list", f"the Events of {self.where(name)}", "list events"):
            items: list[dict[str, Any]] = self._json(self.core.list_namespaced_event(
                self.namespace, field_selector=selector,
                _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False,
            )).get("items") or []
            return items

    # ---------------------------------------------------------------------------------------- pods

    def run_pods(self, name: str, component: str) -> list[dict[str, Any]]:
        """The run's pods of one component, by the labels the operator puts on them."""
        selector = f"{RUN_LABEL}={name},{COMPONENT_LABEL}={component}"
        with self._calling("list", f"the {component} pods of {self.where(name)}", "list pods"):
            items: list[dict[str, Any]] = self._json(self.core.list_namespaced_pod(
                self.namespace, label_selector=selector,
                _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False,
            )).get("items") or []
            return items

    def pod_log(self, pod: str, container: str, follow: bool, tail: int | None) -> Iterator[bytes]:
        """The container's log, in chunks as the API server sends them (until it ends with -f)."""
        kwargs: dict[str, Any] = {"container": container, "follow": follow, "_preload_content": False}
        if tail is not None:
            kwargs["tail_lines"] = tail
        if not follow:
            kwargs["_request_timeout"] = REQUEST_TIMEOUT_SECONDS
        with self._calling("read the log of", f"pod {pod} in namespace {self.namespace}", "get pods/log"):
            response = self.core.read_namespaced_pod_log(pod, self.namespace, **kwargs)
            try:
                yield from response.stream(64 * 1024)
            finally:
                response.release_conn()
