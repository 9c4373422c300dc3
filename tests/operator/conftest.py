"""Fixtures for operator tests against the real control plane.

The operator runs for real: `grpo operator` as a subprocess, under a ServiceAccount bound to
exactly the rules in `grpo_operator.rbac` (so a missing permission fails a test). No kubelet
exists, so tests play it: they mark trainer pods Succeeded/Failed (the real Job controller then
completes or fails the Job); server health comes from real `grpo serve` processes reached
through the run's `grpo.dev/server-url` annotation (`--allow-server-url-override`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.server import free_port
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.controlplane

OPERATOR_SA_NAMESPACE = "grpo-system"
OPERATOR_SA = "grpo-operator"
RECONCILE_INTERVAL = 1.0


# ------------------------------------------------------------------------------------------ identity


@pytest.fixture(scope="session")
def operator_kubeconfig(control_plane: ControlPlane, grporun_crd: dict[str, Any], tmp_path_factory: Any) -> Path:
    """A kubeconfig for a ServiceAccount that has exactly the operator's RBAC rules."""
    return operator_identity(control_plane, tmp_path_factory, OPERATOR_SA, "grpo-operator-test")


def operator_identity(cp: ControlPlane, tmp_path_factory: Any, service_account: str, role: str, *,
                      kueue: bool = False) -> Path:
    """A kubeconfig for a ServiceAccount bound to exactly the operator's RBAC rules (with Kueue's, with `kueue`)."""
    from grpo_operator.rbac import render_rbac

    cp.kubectl("create", "namespace", OPERATOR_SA_NAMESPACE)
    cp.kubectl("create", "serviceaccount", service_account, "-n", OPERATOR_SA_NAMESPACE)
    manifests = render_rbac(role, service_account, OPERATOR_SA_NAMESPACE, kueue=kueue)
    applied = cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                "items": manifests}))
    assert applied.returncode == 0, applied.stderr
    token = cp.kubectl("create", "token", service_account, "-n", OPERATOR_SA_NAMESPACE, "--duration=24h",
                       check=True)
    path = Path(tmp_path_factory.mktemp("operator-identity")) / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "t", "cluster": {"server": cp.server, "certificate-authority": str(cp.ca_file)}}],
        "users": [{"name": "operator", "user": {"token": token.stdout.strip()}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "operator"}}],
        "current-context": "t",
    }))
    path.chmod(0o600)
    return path


# ------------------------------------------------------------------------------------------ operator


@dataclass
class OperatorProcess:
    """One `grpo operator` subprocess watching one namespace (or all of them when namespace is None)."""

    namespace: str | None
    kubeconfig: Path
    log_path: Path
    metrics_port: int = field(default_factory=free_port)
    liveness_port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start {self.starts + 1} =====\n".encode())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "grpo_cli.main", "operator",
                 *(["--namespace", self.namespace] if self.namespace else ["--all-namespaces"]),
                 "--allow-server-url-override", "--reconcile-interval", str(RECONCILE_INTERVAL),
                 "--metrics-port", str(self.metrics_port), "--liveness-port", str(self.liveness_port),
                 "--verbose", *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        self.starts += 1
        wait_for(self._metrics_up, timeout=60, what=f"operator /metrics to answer\n{self.log_tail()}")

    def _metrics_up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"operator exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def metrics_text(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def sample(self, name: str, **labels: str) -> float | None:
        """The value of one series on /metrics (None when the operator exports no such series)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None

    def metric_sum(self, name: str) -> float:
        """Sum of every sample of one metric (all label sets)."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if re.match(rf"^{re.escape(name)}(\{{|\s)", line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def forbidden_lines(self) -> list[str]:
        return [line for line in self.log_tail(10**7).splitlines() if "403" in line and "orbidden" in line]


@pytest.fixture
def operator(
    control_plane: ControlPlane, operator_kubeconfig: Path, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """The operator watching the test's namespace; on teardown the test's runs are deleted while it
    still runs (so kopf releases its finalizer and the namespace can go)."""
    yield from running_operator(control_plane, OperatorProcess(namespace=namespace, kubeconfig=operator_kubeconfig,
                                                               log_path=tmp_path / "operator.log"))


def running_operator(control_plane: ControlPlane, op: OperatorProcess) -> Iterator[OperatorProcess]:
    """Start the operator, yield it, delete the namespace's runs while it still runs, stop it, and fail the test if
    it lacked a permission."""
    namespace = op.namespace or ""
    op.start()
    try:
        yield op
    finally:
        if op.proc is None:
            op.start()
        control_plane.kubectl("delete", "grporuns", "--all", "-n", namespace, "--wait=true", "--timeout=60s")
        op.stop()
        if os.environ.get("GRPO_SHOW_OPERATOR_LOG"):
            print(op.log_tail(20000))
    forbidden = op.forbidden_lines()
    assert not forbidden, "the operator lacked a permission (grpo_operator.rbac):\n" + "\n".join(forbidden[:5])


# ---------------------------------------------------------------------------------------------- kube


@dataclass
class Kube:
    """Test-side access to the control plane: create runs, read children, play the kubelet."""

    api: Any
    namespace: str

    def __post_init__(self) -> None:
        from kubernetes import client

        self.client = client
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.networking = client.NetworkingV1Api(self.api)

    # -- runs

    def create_run(self, name: str, spec: dict[str, Any] | None = None, server_url: str | None = None,
                   labels: dict[str, str] | None = None, **spec_fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "apiVersion": "grpo.dev/v1alpha1",
            "kind": "GRPORun",
            "metadata": {"name": name, **({"labels": labels} if labels else {})},
            "spec": spec or run_spec(**spec_fields),
        }
        if server_url is not None:
            body["metadata"]["annotations"] = {"grpo.dev/server-url": server_url}
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(
            "grpo.dev", "v1alpha1", self.namespace, "grporuns", body)
        return created

    def run(self, name: str) -> dict[str, Any] | None:
        try:
            got: dict[str, Any] = self.custom.get_namespaced_custom_object(
                "grpo.dev", "v1alpha1", self.namespace, "grporuns", name)
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return got

    def status(self, name: str) -> dict[str, Any]:
        run = self.run(name)
        return (run or {}).get("status") or {}

    def patch_run(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            "grpo.dev", "v1alpha1", self.namespace, "grporuns", name, patch,
            _content_type="application/merge-patch+json")

    def set_server_url(self, name: str, url: str) -> None:
        self.patch_run(name, {"metadata": {"annotations": {"grpo.dev/server-url": url}}})

    def wait_phase(self, name: str, phase: str, timeout: float = 60, reason: str | None = None) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            status = self.status(name)
            if status.get("phase") == phase and (reason is None or status.get("reason") == reason):
                return status
            return None

        result: dict[str, Any] = wait_for(
            reached, timeout=timeout,
            what=f"run {name} to reach {phase}/{reason or '*'} (now {json.dumps(self.status(name))[:800]})")
        return result

    # -- children

    def _read(self, read: Callable[[str, str], Any], name: str) -> Any:
        """The object, or None if there is none of that name."""
        try:
            return read(name, self.namespace)
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def deployment(self, name: str) -> Any:
        return self._read(self.apps.read_namespaced_deployment, name)

    def config_map(self, name: str) -> Any:
        return self._read(self.core.read_namespaced_config_map, name)

    def service(self, name: str) -> Any:
        return self._read(self.core.read_namespaced_service, name)

    def delete_service_and_see_it_restored(self, run: str, name: str) -> Any:
        """Delete a run's Service; the one the operator creates again (a new uid), once its ChildRestored
        event names it."""
        before = self.service(name)
        assert before is not None, f"Service {name} does not exist"
        self.core.delete_namespaced_service(name, self.namespace)
        again = wait_for(lambda: (svc := self.service(name)) is not None and svc.metadata.uid != before.metadata.uid
                         and svc, timeout=30, what=f"Service {name} to be created again")

        def restored() -> bool:
            found = self.core.list_namespaced_event(self.namespace, field_selector=f"involvedObject.name={run}")
            return any(e.reason == "ChildRestored" and f"Service {name}" in e.message for e in found.items)

        wait_for(restored, what=f"a ChildRestored event naming Service {name}")
        return again

    def jobs(self, run: str) -> list[Any]:
        """The run's trainer Jobs (its initializer Job is `job(f"{run}-init")`)."""
        return list(self.batch.list_namespaced_job(
            self.namespace, label_selector=f"grpo.dev/run={run},grpo.dev/component=trainer").items)

    def job(self, name: str) -> Any:
        return self._read(self.batch.read_namespaced_job, name)

    def server_pods(self, run: str) -> list[Any]:
        return list(self.core.list_namespaced_pod(
            self.namespace, label_selector=f"grpo.dev/run={run},grpo.dev/component=server").items)

    def events(self, run: str) -> list[tuple[str, str]]:
        found = self.core.list_namespaced_event(self.namespace, field_selector=f"involvedObject.name={run}")
        return [(e.type, e.reason) for e in sorted(found.items, key=lambda e: e.metadata.creation_timestamp)]

    def wait_event(self, run: str, type_: str, reason: str, timeout: float = 30) -> None:
        """Wait for an event of the run: the operator posts them after the status of the reconcile that
        decided them is recorded, so they may trail what a test saw change."""
        wait_for(lambda: (type_, reason) in self.events(run), timeout=timeout, what=f"a {type_} {reason} event")

    # -- playing the kubelet

    def finish_trainer(self, job_name: str, succeeded: bool) -> None:
        """Mark the Job's pod terminated; the real Job controller then completes or fails the Job."""
        self.finish_job_pods(job_name, "trainer", 0 if succeeded else 1)

    def finish_job_pods(self, job_name: str, container: str, code: int, message: str = "") -> None:
        pods = wait_for(
            lambda: self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={job_name}").items,
            timeout=30, what=f"the Job controller to create the pod of {job_name}")
        for pod in pods:
            self.terminate_pod(pod.metadata.name, container, code, message)

    def terminate_pod(self, pod: str, container: str, code: int, message: str = "") -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": now, "finishedAt": now}
        if message:
            terminated["message"] = message
        self.core.patch_namespaced_pod_status(pod, self.namespace, {"status": {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [{
                "name": container, "ready": False, "restartCount": 0, "image": container, "imageID": "",
                "state": {"terminated": terminated},
            }],
        }})

    def initializer_pods(self, run: str | None = None) -> list[Any]:
        selector = "grpo.dev/component=initializer" + (f",grpo.dev/run={run}" if run else "")
        return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)


class InitializerKubelet:
    """Plays the kubelet for initializer pods: each one succeeds, as `grpo prepare` does when the
    sources are fine, unless the test set an exit code (and termination message) for its run, or a
    container that runs in the pod's stead (`run_container`)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        #: Per run, the exit codes and termination messages of its next initializer pods, in order;
        #: once used up, pods succeed.
        self.outcomes: dict[str, list[tuple[int, str]]] = {}
        #: Per run, what runs in its initializer pods' stead: called with the pod, it returns the exit code and
        #: termination message.
        self.containers: dict[str, Callable[[Any], tuple[int, str]]] = {}
        self.finished: list[str] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="initializer-kubelet", daemon=True)

    def fail(self, run: str, code: int, message: str, times: int = 1) -> None:
        self.outcomes.setdefault(run, []).extend([(code, message)] * times)

    def _loop(self) -> None:
        while not self.stopped.wait(0.2):
            with contextlib.suppress(Exception):
                for pod in self.kube.initializer_pods():
                    name = pod.metadata.name
                    if name in self.finished or pod.status.phase in ("Succeeded", "Failed"):
                        continue
                    run = pod.metadata.labels.get("grpo.dev/run", "")
                    queue = self.outcomes.get(run, [])
                    code, message = (self.containers[run](pod) if run in self.containers
                                     else queue[0] if queue else (0, ""))
                    self.kube.terminate_pod(name, "initializer", code, message)
                    self.finished.append(name)
                    if queue:
                        queue.pop(0)

    def __enter__(self) -> InitializerKubelet:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)


def run_spec(**overrides: Any) -> dict[str, Any]:
    """A small valid spec (server mode, transformers engine, CPU resources); overrides are merged."""
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "path": "/models/tiny"},
        "dataset": {"path": "/data/prompts.jsonl"},
        "rewards": [{"function": "token_fraction"}],
        "server": {"engine": "transformers", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}},
                   "maxLoraRank": 64},
        "trainer": {"resources": {"limits": {"cpu": "1", "memory": "1Gi"}}, "lora": {"r": 8}, "maxSteps": 4},
        "storage": {"size": "1Gi"},
        "runPolicy": {"serverReadyTimeoutSeconds": 300},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        elif value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return spec


@pytest.fixture
def kube(control_plane: ControlPlane, namespace: str) -> Iterator[Kube]:
    with control_plane.api_client() as api:
        yield Kube(api, namespace)


@pytest.fixture(autouse=True)
def initializers(request: pytest.FixtureRequest) -> Iterator[InitializerKubelet | None]:
    """Initializer pods of the test's namespace succeed by themselves (tests that use `kube`)."""
    if "kube" not in request.fixturenames:
        yield None
        return
    kube: Kube = request.getfixturevalue("kube")
    with InitializerKubelet(kube) as kubelet:
        yield kubelet

