"""Fixtures of the end-to-end suite: a real node, the project's images, the chart, staged data.

`hack/images.sh build` builds the images from the project's Dockerfiles (cached by a hash of their
inputs), `hack/cluster.sh up` starts a real single-node cluster (kubelet, containerd, CNI,
kube-proxy, CoreDNS and an OCI registry, the CNCF distribution registry) and `hack/cluster.sh images`
pushes the images to that registry, from which the node pulls them as it would from ghcr.io. Then
the tests do what a user does: package the chart and push it to the registry as an OCI artifact,
`helm install oci://…` it with image overrides only (the operator's and the runs'), `grpo stage` the
model onto a claim and the prompts and reward module into ConfigMaps, and `kubectl apply` the CPU
example.
Everything is checked through the cluster's API (kubectl), never by reaching into the node's files.

The cluster is stopped at the end of the session (`hack/cluster.sh down`) unless GRPO_E2E_KEEP=1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.controlplane import wait_for

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "grpo-e2e"
RELEASE, RELEASE_NAMESPACE = "grpo", "grpo-system"
#: What examples/cpu-run.yaml reads: the model's claim and the ConfigMaps of its prompts and reward module.
MODELS_CLAIM, PROMPTS_CONFIGMAP, REWARDS_CONFIGMAP = "grpo-models", "tiny-prompts", "tiny-rewards"
IMAGE_BUILD_TIMEOUT_S = 45 * 60
CLUSTER_UP_TIMEOUT_S = 15 * 60
#: The node's registry (hack/cluster.sh: plain HTTP on loopback) and where the project's images are in it.
REGISTRY = f"localhost:{os.environ.get('GRPO_NODE_REGISTRY_PORT', '5001')}"
IMAGE_REPOSITORY = f"{REGISTRY}/grpo-dev"


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None, input: str | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env, input=input,
                          check=False)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(argv[:4])} ... exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@dataclass(frozen=True)
class Node:
    """The running cluster, used through its own clients."""

    kubeconfig: Path
    bin_dir: Path
    images: dict[str, str]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}:{os.environ['PATH']}"}

    def kubectl(self, *args: str, timeout: float = 60, input: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([str(self.bin_dir / "kubectl"), *args], timeout, env=self.env, input=input, check=check)

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return _run([str(self.bin_dir / "helm"), *args], timeout, env=self.env)

    def get(self, kind: str, name: str, namespace: str | None = NAMESPACE) -> dict[str, Any] | None:
        where = ["-n", namespace] if namespace else []
        proc = self.kubectl("get", kind, name, *where, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            pytest.fail(f"kubectl get {kind} {name}: {proc.stderr}")
        found: dict[str, Any] = json.loads(proc.stdout)
        return found

    def list(self, kind: str, selector: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
        proc = self.kubectl("get", kind, "-n", namespace, "-l", selector, "-o", "json")
        items: list[dict[str, Any]] = json.loads(proc.stdout)["items"]
        return items

    def apply(self, obj: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


def _images() -> dict[str, str]:
    """Name -> the reference the node pulls: `localhost:5001/grpo-dev/grpo-server:<input hash>`."""
    out = _run(["bash", "hack/images.sh", "build"], IMAGE_BUILD_TIMEOUT_S).stdout
    refs = dict(line.split()[0].rsplit(":", 1) for line in out.splitlines() if line.startswith("localhost/"))
    names = {repo.removeprefix("localhost/"): tag for repo, tag in refs.items()}
    return {name: f"{IMAGE_REPOSITORY}/{name}:{tag}" for name, tag in names.items()
            if name in ("grpo-operator", "grpo-server", "grpo-trainer")}


def node_ip(node: Node) -> str:
    """The node's address, where its pods reach services that run on the host (a hub mirror, an S3 service)."""
    return node.kubectl("get", "node", "-o", "jsonpath={.items[0].status.addresses[?(@.type=='InternalIP')]"
                        ".address}").stdout.strip()


def node_images(node: Node) -> set[str]:
    """The image names the kubelet reports for the node (what containerd holds, by tag and digest)."""
    status = node.get("node", "grpo-node", None)
    assert status is not None, "no node grpo-node"
    return {name for image in status["status"].get("images", []) for name in image.get("names", [])}


@pytest.fixture(scope="session")
def node() -> Iterator[Node]:
    if os.geteuid() != 0:
        pytest.fail("the end-to-end suite runs a kubelet and containerd: it needs root")
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:   # each worker would bring up the one node
        pytest.fail("the end-to-end suite brings up this machine's one node: run it in one pytest process "
                    "(hack/test.sh does), not under pytest-xdist's -n")
    testbin = os.environ.get("GRPO_TESTBIN_DIR") or _run(
        ["bash", "hack/build-testbin.sh"], IMAGE_BUILD_TIMEOUT_S).stdout.strip().splitlines()[-1]
    env = {**os.environ, "GRPO_TESTBIN_DIR": testbin}
    images = _images()
    started = time.monotonic()
    up = _run(["bash", "hack/cluster.sh", "up"], CLUSTER_UP_TIMEOUT_S, env=env, check=False)
    if up.returncode != 0:
        _run(["bash", "hack/cluster.sh", "down"], 300, env=env, check=False)
        pytest.fail(f"hack/cluster.sh up failed:\n{up.stderr[-4000:]}")
    _run(["bash", "hack/cluster.sh", "images"], CLUSTER_UP_TIMEOUT_S, env=env)
    print(f"\n[e2e] cluster up and images imported in {time.monotonic() - started:.0f}s", file=sys.stderr)
    kubeconfig = Path(os.environ.get("GRPO_NODE_DIR", "/var/lib/grpo-node")) / "admin.kubeconfig"
    node = Node(kubeconfig=kubeconfig, bin_dir=Path(testbin), images=images)
    _clean_slate(node, env)
    try:
        yield node
    finally:
        if os.environ.get("GRPO_E2E_KEEP") != "1":   # the next session starts from an empty etcd
            _run(["bash", "hack/cluster.sh", "down", "--purge"], 300, env=env, check=False)


def _clean_slate(node: Node, env: dict[str, str]) -> None:
    """A cluster kept from an earlier session (GRPO_E2E_KEEP=1) starts over: no runs, release or claims.

    Runs go before their namespace: deleting a watched namespace also deletes the operator's Role in it
    (namespaced watch mode), after which nothing can release the runs' finalizers (docs/limits.md).
    """
    if node.kubectl("get", "namespace", NAMESPACE, check=False).returncode == 0:
        node.kubectl("delete", "grporuns", "--all", "-n", NAMESPACE, "--wait=false", check=False)
        deadline = time.monotonic() + 60
        while node.list("grporun", "", NAMESPACE) and time.monotonic() < deadline:
            time.sleep(1)
        for run in node.list("grporun", "", NAMESPACE):   # left by a session whose operator was gone
            node.kubectl("patch", "grporun", run["metadata"]["name"], "-n", NAMESPACE, "--type=merge",
                         "-p", '{"metadata": {"finalizers": null}}', check=False)
        node.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=300)
    if node.kubectl("get", "namespace", RELEASE_NAMESPACE, check=False).returncode == 0:
        _run([str(node.bin_dir / "helm"), "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait"], 300,
             env=node.env, check=False)
    _run(["bash", "hack/cluster.sh", "volumes"], 300, env=env)


def chart_version() -> str:
    return str(yaml.safe_load((REPO / "charts" / "grpo-operator" / "Chart.yaml").read_text())["version"])


@pytest.fixture(scope="session")
def chart_ref(node: Node, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The chart packaged and pushed to the node's registry as an OCI artifact, as the release does."""
    out = tmp_path_factory.mktemp("chart")
    node.helm("package", str(REPO / "charts" / "grpo-operator"), "-d", str(out))
    (package,) = out.glob("grpo-operator-*.tgz")
    node.helm("push", str(package), f"oci://{IMAGE_REPOSITORY}/charts", "--plain-http")
    return f"oci://{IMAGE_REPOSITORY}/charts/grpo-operator"


@pytest.fixture(scope="session")
def operator_release(node: Node, chart_ref: str) -> str:
    """The chart, installed from the registry as the README says, with the locally built operator image, and Kueue
    on (`kueue.enabled`: `grpo operator --kueue` and its RBAC), as a shared cluster runs it: runs without the queue
    label are not affected (every test but test_platform_run.py's queued run), and Kueue itself runs only while
    that test does."""
    node.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    repository, tag = node.images["grpo-operator"].rsplit(":", 1)
    node.helm("upgrade", "--install", RELEASE, chart_ref, "--version", chart_version(), "--plain-http",
              "-n", RELEASE_NAMESPACE,
              "--create-namespace", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
              "--set", f"watch.namespaces={{{NAMESPACE}}}",
              "--set", f"runImages.server={node.images['grpo-server']}",
              "--set", f"runImages.trainer={node.images['grpo-trainer']}", "--set", "kueue.enabled=true",
              "--wait", "--timeout", "180s")
    return RELEASE


@dataclass(frozen=True)
class TinyFiles:
    """What the example run trains on, as files: the tiny model's folder and its prompts."""

    model: Path
    prompts: Path


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> TinyFiles:
    from grpo_testmodels import make_dataset, make_model

    work = tmp_path_factory.mktemp("tiny")
    model = make_model(work / "tiny-model", preset="tiny", seed=0)
    return TinyFiles(model=model, prompts=make_dataset(work / "prompts.jsonl", model))


@pytest.fixture(scope="session")
def staged(node: Node, operator_release: str, tiny_files: TinyFiles) -> str:
    """The tiny model, its prompts and the example's reward module on the claim grpo-data, by `grpo stage`."""
    model, prompts = tiny_files.model, tiny_files.prompts
    grpo = str(Path(sys.executable).parent / "grpo")
    _run([grpo, "stage", "-n", NAMESPACE, "--claim", MODELS_CLAIM, "--create", "2Gi",
          "--access-mode", "ReadWriteMany", "--image", node.images["grpo-trainer"],
          "--image-pull-policy", "IfNotPresent", f"{model}:tiny"], 600, env=node.env)
    _run([grpo, "stage", "-n", NAMESPACE, "--configmap", PROMPTS_CONFIGMAP, str(prompts)], 120, env=node.env)
    _run([grpo, "stage", "-n", NAMESPACE, "--configmap", REWARDS_CONFIGMAP,
          str(REPO / "examples" / "rewards" / "target_tokens.py")], 120, env=node.env)
    return MODELS_CLAIM


def grpo(node: Node, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The `grpo` CLI of this environment against the node, as a user runs it (its kubeconfig in $KUBECONFIG)."""
    return _run([str(Path(sys.executable).parent / "grpo"), *args], timeout, env=node.env, check=check)


def example_run(node: Node, name: str, **trainer: Any) -> dict[str, Any]:
    """examples/cpu-run.yaml as a user applies it, in the suite's namespace; its images come from the
    chart's runImages (the release is installed with the images built here)."""
    run: dict[str, Any] = yaml.safe_load((REPO / "examples" / "cpu-run.yaml").read_text())
    run["metadata"] = {"name": name, "namespace": NAMESPACE}
    run["spec"]["trainer"].update(**trainer)
    return run


def pods(node: Node, run: str, component: str) -> list[dict[str, Any]]:
    """The run's pods of one component that are not being deleted."""
    return [p for p in node.list("pod", f"grpo.dev/run={run},grpo.dev/component={component}")
            if not p["metadata"].get("deletionTimestamp")]


def pod_spec(node: Node, run: str, component: str) -> dict[str, Any]:
    """The pod spec a component of a finished run ran with. Job pods stay after the Job ends; the server
    is scaled to zero when the run ends, so its pod may already be gone: its Deployment's template is
    what that pod ran with."""
    if component == "server":
        deployment = node.get("deployment", f"{run}-server")
        assert deployment is not None, f"{run}: no server Deployment"
        spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
        return spec
    (pod,) = node.list("pod", f"grpo.dev/run={run},grpo.dev/component={component}")
    found: dict[str, Any] = pod["spec"]
    return found


def run_status(node: Node, name: str) -> dict[str, Any]:
    run = node.get("grporun", name)
    assert run is not None, f"GRPORun {name} is gone"
    status: dict[str, Any] = run.get("status") or {}
    return status


def wait_phase(node: Node, name: str, phase: str, timeout: float) -> dict[str, Any]:
    """Wait for a phase; a run that fails on the way fails the test with its reason and message."""

    def reached() -> dict[str, Any] | None:
        status = run_status(node, name)
        if status.get("phase") == "Failed" and phase != "Failed":
            pytest.fail(f"run {name} failed: {status.get('reason')}: {status.get('message')}\n"
                        f"{describe(node, name)}")
        return status if status.get("phase") == phase else None

    result: dict[str, Any] = wait_for(reached, timeout, what=f"run {name} to reach {phase}", interval=2.0)
    return result


def wait_step(node: Node, name: str, step: int, timeout: float) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        status = run_status(node, name)
        if status.get("phase") in ("Failed", "Succeeded"):
            pytest.fail(f"run {name} ended ({status.get('phase')}) before step {step}: {status.get('message')}")
        return status if (status.get("progress") or {}).get("step", 0) >= step else None

    result: dict[str, Any] = wait_for(reached, timeout, what=f"run {name} to pass step {step}", interval=1.0)
    return result


def describe(node: Node, name: str) -> str:
    """What a person would look at when a run goes wrong: its children, events and pod logs."""
    parts = [node.kubectl("get", "grporun,deploy,job,pod,svc,pvc", "-n", NAMESPACE, "-o", "wide", check=False).stdout,
             node.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False).stdout[-4000:]]
    for component in ("server", "trainer"):
        parts.append(node.kubectl("logs", "-n", NAMESPACE, "-l", f"grpo.dev/run={name},grpo.dev/component={component}",
                                  "--tail=40", "--all-containers", check=False).stdout)
    parts.append(node.kubectl("logs", "-n", RELEASE_NAMESPACE, "deploy/grpo-grpo-operator", "--tail=40",
                              check=False).stdout)
    return "\n".join(parts)


class VolumeReader:
    """Pods that mount a run's claim read-only, to read what the run wrote there (as a user would)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.pods: dict[str, str] = {}

    def _pod(self, claim: str) -> str:
        if claim in self.pods:
            return self.pods[claim]
        name = f"reader-{claim}"[:63]
        self.node.apply({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "restartPolicy": "Never", "automountServiceAccountToken": False,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "reader", "image": self.node.images["grpo-trainer"], "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", "import time; time.sleep(7200)"],
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                }],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            },
        })
        self.node.kubectl("wait", "-n", NAMESPACE, "--for=condition=Ready", f"pod/{name}", "--timeout=180s",
                          timeout=200)
        self.pods[claim] = name
        return name

    def read(self, run: str, path: str) -> str:
        """A file of the run's volume (the claim it made, `<run>-data`, mounted at /data)."""
        return self.node.kubectl("exec", "-n", NAMESPACE, self._pod(f"{run}-data"), "--", "cat", path).stdout

    def listdir(self, run: str, path: str) -> list[str]:
        proc = self.node.kubectl("exec", "-n", NAMESPACE, self._pod(f"{run}-data"), "--", "ls", "-1", path,
                                 check=False)
        return proc.stdout.split() if proc.returncode == 0 else []

    def history(self, run: str) -> list[dict[str, Any]]:
        text = self.read(run, f"/data/progress/{run}.history.jsonl")
        return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="session")
def volume(node: Node, staged: str) -> VolumeReader:
    return VolumeReader(node)


class LogFollower:
    """`kubectl logs -f` of a run's pods of one component, kept after the pods are gone."""

    def __init__(self, node: Node, run: str, component: str) -> None:
        self.node, self.selector = node, f"grpo.dev/run={run},grpo.dev/component={component}"
        self.procs: list[subprocess.Popen[str]] = []
        self.seen: set[str] = set()

    def poll(self) -> None:
        """Follow every pod of the component not followed yet (a restarted server is a new pod)."""
        for pod in self.node.list("pod", self.selector):
            name = pod["metadata"]["name"]
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            started = any("running" in (s.get("state") or {}) or "terminated" in (s.get("state") or {})
                          for s in statuses)
            if name in self.seen or not started:
                continue
            self.seen.add(name)
            self.procs.append(subprocess.Popen(
                [str(self.node.bin_dir / "kubectl"), "logs", "-f", "-n", NAMESPACE, name],
                env=self.node.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    def text(self) -> str:
        out = []
        for proc in self.procs:
            try:
                out.append(proc.communicate(timeout=30)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                out.append(proc.communicate()[0])
        return "\n".join(out)


# ------------------------------------------------------------------------------------------ Prometheus


def _scrape_job(job: str, namespace: str, selector: dict[str, str], port: str) -> dict[str, Any]:
    """What the chart's PodMonitor/ServiceMonitor ask of prometheus-operator, as a plain scrape config:
    pods found through the Kubernetes API, `job` fixed, the run's name as `grporun`, the pod's
    namespace as `namespace` unless the series carries its own (honorLabels, as the chart sets)."""
    keep = [{"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{re.sub(r'[^A-Za-z0-9]', '_', k)}"],
             "regex": v} for k, v in selector.items()]
    return {
        "job_name": job,
        "honor_labels": True,
        "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": "KUBECONFIG",
                                   "namespaces": {"names": [namespace]}}],
        "relabel_configs": [
            *keep,
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port},
            {"action": "replace", "source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"action": "replace", "source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"action": "replace", "source_labels": ["__meta_kubernetes_pod_label_grpo_dev_run"],
             "target_label": "grporun"},
        ],
    }


class Prometheus:
    """A real Prometheus server (built from the Go module proxy) scraping the node's pods through
    Kubernetes service discovery, with the chart's alert rules loaded."""

    def __init__(self, url: str, proc: subprocess.Popen[bytes]) -> None:
        self.url, self.proc = url, proc
        self.windows: dict[str, tuple[float, float]] = {}

    def api(self, path: str, **params: Any) -> Any:
        import httpx

        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float = 2.0) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query_range", query=expr, start=start, end=end, step=step)["result"]
        return result


@pytest.fixture(scope="session")
def prometheus(node: Node, operator_release: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    work = tmp_path_factory.mktemp("prometheus")
    rendered = node.helm("template", RELEASE, str(REPO / "charts" / "grpo-operator"), "-n", RELEASE_NAMESPACE,
                         "--set", "prometheusRule.enabled=true").stdout
    (rule,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "PrometheusRule"]
    (work / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    managed = {"app.kubernetes.io/managed-by": "grpo-operator"}
    jobs = [
        _scrape_job("grpo-operator", RELEASE_NAMESPACE, {"app.kubernetes.io/name": "grpo-operator"}, "metrics"),
        _scrape_job("grpo-server", NAMESPACE, {**managed, "grpo.dev/component": "server"}, "http"),
        _scrape_job("grpo-trainer", NAMESPACE, {**managed, "grpo.dev/component": "trainer"}, "metrics"),
    ]
    for job in jobs:
        job["kubernetes_sd_configs"][0]["kubeconfig_file"] = str(node.kubeconfig)
    config = {"global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"},
              "rule_files": [str(work / "rules.yaml")], "scrape_configs": jobs}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = _free_port()
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen([str(node.bin_dir / "prometheus"), f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}", proc)
    try:
        import httpx

        def ready() -> bool:
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            try:
                return httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 60, what="Prometheus to be ready", interval=0.5)
        # Monitoring in a steady state before any run: the operator found and scraped, its rules evaluated
        # (until then `absent(up{job="grpo-operator"})` holds, as it does for any Prometheus just started).
        wait_for(lambda: server.api("query", query='up{job="grpo-operator"} == 1')["result"], 60,
                 what="Prometheus to scrape the operator", interval=1)
        time.sleep(5)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
