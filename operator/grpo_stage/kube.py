"""The API calls of grpo stage: credentials, the claim, the staging pod and the exec that feeds it,
and the ConfigMap of `--configmap`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.stream import stream
from kubernetes.stream.ws_client import ERROR_CHANNEL, STDERR_CHANNEL, STDIN_CHANNEL, STDOUT_CHANNEL, WSClient
from websocket import WebSocketException

from grpo_stage import configmap
from grpo_stage.errors import StageError
from grpo_stage.manifests import CONTAINER, build_claim, pod_state

REQUEST_TIMEOUT_SECONDS = 30
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
#: What the user needs in the namespace, named when the API says 403.
NEEDED_RBAC = "get/create persistentvolumeclaims, get/create/delete pods and create pods/exec"
#: The same for --configmap.
NEEDED_RBAC_CONFIGMAP = "get/create/update configmaps"
#: Attempts of create-or-replace when the ConfigMap changes in between (409 Conflict).
CONFIGMAP_ATTEMPTS = 5


def load_client(kubeconfig: str | None, context: str | None) -> tuple[client.ApiClient, str]:
    """(API client, default namespace): the kubeconfig ($KUBECONFIG, ~/.kube/config), else in-cluster."""
    configuration = client.Configuration()
    try:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    except (ConfigException, FileNotFoundError) as exc:
        if kubeconfig or context:
            raise StageError(f"cannot load the kubeconfig{f' {kubeconfig}' if kubeconfig else ''}: {exc}") from exc
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException:
            raise StageError(f"no Kubernetes credentials: no kubeconfig ({exc}) and not running in a pod") from exc
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip() if SERVICE_ACCOUNT_NAMESPACE.exists() else "default"
        return client.ApiClient(configuration), namespace
    contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    chosen = next((c for c in contexts if c.get("name") == context), active) if context else active
    namespace = ((chosen or {}).get("context") or {}).get("namespace") or "default"
    return client.ApiClient(configuration), str(namespace)


def api_message(exc: ApiException, needs: str = NEEDED_RBAC) -> str:
    """The API server's own message (its Status body) or the HTTP reason; on 403, the RBAC it `needs`."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    text = f"{exc.status} {message or exc.reason}"
    if exc.status == 403:
        text += f" (grpo stage needs: {needs})"
    return text


@dataclass(frozen=True)
class ClaimRequest:
    """--create: the claim to create when it is absent."""

    size: str
    access_mode: str
    storage_class: str | None


class StageApi:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api_client)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        response = fn(*args, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False, **kwargs)
        body: dict[str, Any] = json.loads(response.data) if response.data else {}
        return body

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call(self.core.read_namespaced_persistent_volume_claim, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise StageError(
                f"cannot read PersistentVolumeClaim {name} in namespace {namespace}: {api_message(exc)}"
            ) from exc

    def create(self, manifest: dict[str, Any]) -> None:
        kind, meta = manifest["kind"], manifest["metadata"]
        creators = {
            "Pod": self.core.create_namespaced_pod,
            "PersistentVolumeClaim": self.core.create_namespaced_persistent_volume_claim,
        }
        try:
            self._call(creators[kind], meta["namespace"], manifest)
        except ApiException as exc:
            raise StageError(
                f"cannot create {kind} {meta['name']} in namespace {meta['namespace']}: {api_message(exc)}"
            ) from exc

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return self._call(self.core.read_namespaced_pod, name, namespace)
        except ApiException as exc:
            raise StageError(f"cannot read pod {name} in namespace {namespace}: {api_message(exc)}") from exc

    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            self._call(self.core.delete_namespaced_pod, name, namespace, grace_period_seconds=1)
        except ApiException as exc:
            if exc.status != 404:
                raise StageError(
                    f"cannot delete pod {name} in namespace {namespace}: {api_message(exc)}; "
                    f"delete it yourself (kubectl -n {namespace} delete pod {name})"
                ) from exc

    def open_exec(self, namespace: str, name: str, command: list[str]) -> WSClient:
        try:
            ws: WSClient = stream(
                self.core.connect_get_namespaced_pod_exec,
                name,
                namespace,
                container=CONTAINER,
                command=command,
                stdin=True,
                stdout=True,
                stderr=True,
                tty=False,
                binary=True,
                _preload_content=False,
            )
        except ApiException as exc:
            raise StageError(
                f"cannot exec into pod {name} in namespace {namespace}: {exc.reason} (grpo stage needs: {NEEDED_RBAC})"
            ) from exc
        return ws

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call(self.core.read_namespaced_config_map, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _configmap_error("read", namespace, name, exc) from exc

    def create_configmap(self, manifest: dict[str, Any]) -> bool:
        """Create it; False when one of that name exists already (409)."""
        meta = manifest["metadata"]
        try:
            self._call(self.core.create_namespaced_config_map, meta["namespace"], manifest)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise _configmap_error("create", meta["namespace"], meta["name"], exc) from exc
        return True

    def replace_configmap(self, manifest: dict[str, Any]) -> bool:
        """Replace it (at manifest's resourceVersion); False when it changed or went meanwhile (409, 404)."""
        meta = manifest["metadata"]
        try:
            self._call(self.core.replace_namespaced_config_map, meta["name"], meta["namespace"], manifest)
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise _configmap_error("replace", meta["namespace"], meta["name"], exc) from exc
        return True


def _configmap_error(action: str, namespace: str, name: str, exc: ApiException) -> StageError:
    where = f"ConfigMap {name} in namespace {namespace}"
    if exc.status == 404:
        return StageError(f"cannot {action} {where}: namespace {namespace} not found")
    if exc.status == 422:
        return StageError(f"the API server refused {where} as invalid: {api_message(exc)}")
    return StageError(f"cannot {action} {where}: {api_message(exc, NEEDED_RBAC_CONFIGMAP)}")


def put_configmap(api: StageApi, manifest: dict[str, Any], force: bool, attempts: int = CONFIGMAP_ATTEMPTS) -> str:
    """Create the ConfigMap, or replace all of an existing one's keys (one grpo stage made, or any
    with force), optimistically: 'created' or 'replaced'; StageError naming it otherwise."""
    meta = manifest["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    where = f"ConfigMap {name} in namespace {namespace}"
    for _ in range(attempts):
        if api.create_configmap(manifest):
            return "created"
        existing = api.read_configmap(namespace, name)
        if existing is None:
            continue  # deleted in between: create it again
        if (existing.get("metadata") or {}).get("deletionTimestamp"):
            raise StageError(f"{where} is being deleted: try again when it is gone")
        if not force and not configmap.is_managed(existing):
            raise StageError(
                f"{where} exists and was not made by grpo stage (no label "
                f"{configmap.MANAGED_BY}={configmap.LABELS[configmap.MANAGED_BY]}): delete it "
                f"(kubectl -n {namespace} delete configmap {name}) or choose another name; "
                "--force replaces it all the same"
            )
        if existing.get("immutable"):
            raise StageError(
                f"{where} is immutable: delete it (kubectl -n {namespace} delete configmap {name}) "
                "or choose another name"
            )
        if api.replace_configmap(configmap.replacement(existing, manifest)):
            return "replaced"
    raise StageError(f"{where} kept changing while grpo stage replaced it ({attempts} attempts): try again")


def ensure_claim(api: StageApi, namespace: str, name: str, create: ClaimRequest | None) -> str:
    """Check that the claim exists (or create it with --create); a line for the user."""
    claim = api.read_claim(namespace, name)
    if claim is not None:
        if (claim.get("metadata") or {}).get("deletionTimestamp"):
            raise StageError(f"PersistentVolumeClaim {name} in namespace {namespace} is being deleted")
        phase = (claim.get("status") or {}).get("phase", "Pending")
        return f"using PersistentVolumeClaim {name} in namespace {namespace} ({phase})"
    if create is None:
        raise StageError(
            f"PersistentVolumeClaim {name} not found in namespace {namespace} (pass --create SIZE to create it)"
        )
    api.create(
        build_claim(
            name=name,
            namespace=namespace,
            size=create.size,
            access_mode=create.access_mode,
            storage_class=create.storage_class,
        )
    )
    details = ", ".join(filter(None, (create.size, create.access_mode, create.storage_class)))
    return f"created PersistentVolumeClaim {name} in namespace {namespace} ({details})"


def wait_running(
    api: StageApi,
    namespace: str,
    name: str,
    timeout: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Poll the pod until it runs; StageError with its waiting reason on a fatal state or the timeout."""
    deadline = clock() + timeout
    while True:
        state = pod_state(api.read_pod(namespace, name))
        if state.running:
            return
        if state.fatal:
            raise StageError(f"staging pod {name} in namespace {namespace} cannot run: {state.reason}")
        if clock() >= deadline:
            raise StageError(
                f"staging pod {name} in namespace {namespace} did not start within {timeout:.0f}s: {state.reason}"
            )
        sleep(1.0)


class ReceiverGone(StageError):
    """The exec ended (or its connection broke) while the stream was still being written."""


class ExecStdin:
    """The exec's stdin as a sink for the tar stream: each write is one websocket frame."""

    def __init__(self, ws: WSClient, deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ws = ws
        self.deadline = deadline
        self.clock = clock
        self.sent = 0

    def write(self, data: bytes) -> int:
        if not self.ws.is_open():
            raise ReceiverGone("the receiver ended before the stream did")
        remaining = self.deadline - self.clock()
        if remaining <= 0:
            raise StageError("--timeout ran out while sending")
        try:
            self.ws.sock.settimeout(remaining)
            self.ws.write_stdin(bytes(data))
            # Take in what the receiver said so far (an early refusal closes the connection).
            self.ws.update(timeout=0)
        except (WebSocketException, OSError) as exc:
            raise ReceiverGone(f"the connection to the receiver broke: {type(exc).__name__}: {exc}") from exc
        self.sent += len(data)
        return len(data)

    def close(self) -> None:
        """Close stdin where the protocol can (v5); the receiver does not need it (the stream ends itself)."""
        with contextlib.suppress(WebSocketException, OSError):
            self.ws.close_channel(STDIN_CHANNEL)


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    error_channel: str


def finish_exec(ws: WSClient, deadline: float, clock: Callable[[], float] = time.monotonic) -> ExecResult:
    """Read until the exec ends (or the deadline: StageError); its stdout, stderr and status."""
    while ws.is_open():
        remaining = deadline - clock()
        if remaining <= 0:
            raise StageError("--timeout ran out while the receiver was writing the files")
        try:
            ws.sock.settimeout(remaining)
            ws.update(timeout=min(remaining, 5.0))
        except (WebSocketException, OSError):
            with contextlib.suppress(WebSocketException, OSError):
                ws.close()  # the connection broke: keep what arrived, stop reading
            break
    channels: dict[int, str] = {}
    for channel in (STDOUT_CHANNEL, STDERR_CHANNEL, ERROR_CHANNEL):
        data = ws.read_channel(channel, timeout=0)  # closed: only what has arrived, no polling
        channels[channel] = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
    return ExecResult(
        stdout=channels[STDOUT_CHANNEL], stderr=channels[STDERR_CHANNEL], error_channel=channels[ERROR_CHANNEL]
    )


def abort_exec(ws: WSClient, grace: float = 5.0) -> None:
    """After a failure on our side: let the receiver see the stream end (it then cleans up), then close."""
    try:
        ws.close_channel(STDIN_CHANNEL)
        finish_exec(ws, time.monotonic() + grace)
    except (StageError, WebSocketException, OSError):
        pass
    finally:
        with contextlib.suppress(WebSocketException, OSError):
            ws.close()
