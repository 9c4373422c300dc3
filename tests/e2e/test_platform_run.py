"""A run as a shared platform runs it, on the real node, in as few runs as cover it (issues 30 and 31):

- `platform` is queued through a real Kueue (v0.17's manager, a host process beside the node's control plane, as
  the tests' control plane runs it: tests/fixtures/kueue.py) and waits, suspended and with no pod, until its quota
  admits its server and trainer as one Workload, placed on the flavor's node; it fetches its model, prompts and
  reward module from S3 (the Versity S3 gateway on the node's address, a credentials Secret, an endpoint), reports
  its settings and every step's metrics to an MLflow tracking server running in the cluster (a pod and a Service),
  and exports its adapter to S3 when training ends;
- `warm-start` starts from that export (spec.model.adapter, s3://), which its server serves from step 0; its base
  model is an oci:// image volume.

The MLflow server is `mlflow server` from the trainer image, which has MLflow's client (mlflow-skinny) and the
`mlflow` command; the few packages the server needs beyond the client (flask, sqlalchemy, alembic, ...) come as an
image volume of 6 MB (`hack/images.sh mlflow`), so no image of its own is built or pulled.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from grpo_api.adapters import file_digest
from tests.e2e.conftest import (
    NAMESPACE,
    REGISTRY,
    REPO,
    Node,
    TinyFiles,
    describe,
    example_run,
    node_images,
    node_ip,
    pod_spec,
    pods,
    run_status,
    wait_for,
    wait_phase,
)
from tests.fixtures.hub import repo_files
from tests.fixtures.kueue import GROUP, KueueManager, Queues, running_kueue
from tests.fixtures.mlflow_server import metric_history, runs_of
from tests.fixtures.object_stores import S3_ACCESS_KEY, S3_SECRET_KEY, running_s3, s3_admin, s3_put

RUN, WARM = "platform", "warm-start"
STEPS = 3
RUN_TIMEOUT_S = 10 * 60
BUCKET = "grpo-e2e"
EXPORT_PREFIX = f"exports/{RUN}"
EXPERIMENT = "grpo-e2e"
#: Every step's measures MLflow must get: TRL's reward and loss, and the session's own (as tests/local's tracking test).
PER_STEP = ("reward", "loss", "timing/step_seconds", "staleness/steps")
#: The MLflow server in the cluster: its Service, as the trainer names it, and the port.
MLFLOW_HOST, MLFLOW_PORT = f"mlflow.{NAMESPACE}.svc", 5000
#: The node's one node carries this label: the ResourceFlavor's placement must reach the run's pods.
HOSTNAME_LABEL = {"kubernetes.io/hostname": "grpo-node"}


@dataclass(frozen=True)
class NodeApi:
    """The node's API server as tests/fixtures/kueue.py uses one (ApiServer): a kubectl that does not fail the test."""

    node: Node

    @property
    def kubeconfig(self) -> Path:
        return self.node.kubeconfig

    def kubectl(self, *args: str, input: str | None = None, check: bool = False,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.node.kubectl(*args, input=input, check=check, timeout=timeout)

    def wait_established(self, crd: str, timeout: float = 60) -> str | None:
        established = 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
        deadline = time.monotonic() + timeout
        while self.kubectl("get", f"crd/{crd}", "-o", established).stdout.strip() != "True":
            if time.monotonic() > deadline:
                return self.kubectl("get", f"crd/{crd}", "-o", "jsonpath={.status.conditions}").stdout
            time.sleep(0.2)
        return None


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def s3_endpoint(node: Node, staged: str, tiny_files: TinyFiles,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The S3 gateway on the node's address (pods reach it there, as they reach a hub mirror in test_sources.py),
    holding the example's model, prompts and reward module; the credentials Secret `s3-keys` in the namespace."""
    with running_s3(tmp_path_factory.mktemp("s3"), host=node_ip(node)) as endpoint:
        s3_put(endpoint, BUCKET, {
            **{f"models/tiny/{name}": data for name, data in repo_files(tiny_files.model).items()},
            "data/prompts.jsonl": tiny_files.prompts.read_bytes(),
            "rewards/target_tokens.py": (REPO / "examples" / "rewards" / "target_tokens.py").read_bytes(),
        })
        node.kubectl("create", "secret", "generic", "s3-keys", "-n", NAMESPACE,
                     f"--from-literal=accessKeyId={S3_ACCESS_KEY}", f"--from-literal=secretAccessKey={S3_SECRET_KEY}")
        yield endpoint


@pytest.fixture(scope="module")
def kueue_manager(node: Node, operator_release: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[KueueManager]:
    with running_kueue(NodeApi(node), tmp_path_factory.mktemp("kueue")) as manager:
        yield manager


@pytest.fixture(scope="module")
def mlflow_url(node: Node, staged: str) -> Iterator[str]:
    """`mlflow server` in a pod of the trainer image with the server's packages mounted from their image, behind the
    Service `mlflow`; yields the URL the host reaches it at (the Service's cluster IP). Not waited for here: the
    queued run's checks overlap its start (`wait_mlflow`)."""
    ref, archive = subprocess.run(["bash", "hack/images.sh", "mlflow"], cwd=REPO, check=True, capture_output=True,
                                  text=True, timeout=600).stdout.split()
    pushed = f"{REGISTRY}/grpo-e2e/mlflow-server-packages:{ref.rsplit(':', 1)[1]}"
    subprocess.run(["bash", "hack/cluster.sh", "push", archive, pushed], cwd=REPO, check=True, timeout=300,
                   env=node.env, capture_output=True)
    labels = {"app.kubernetes.io/name": "mlflow"}
    node.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "mlflow", "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "mlflow", "image": node.images["grpo-trainer"], "imagePullPolicy": "IfNotPresent",
                "command": ["mlflow", "server", "--host", "0.0.0.0", "--port", str(MLFLOW_PORT), "--workers", "1",
                            "--backend-store-uri", "sqlite:////var/mlflow/mlflow.db",
                            "--default-artifact-root", "/var/mlflow/artifacts",
                            # the name the trainer uses, and the cluster IP the test reads it at
                            "--allowed-hosts", f"{MLFLOW_HOST},{MLFLOW_HOST}:{MLFLOW_PORT},10.*"],
                # no job runner (its worker processes took the pod past 1 GiB: OOMKilled); nothing here needs jobs
                "env": [{"name": "PYTHONPATH", "value": "/opt/mlflow-server/site-packages"},
                        {"name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "false"}],
                "ports": [{"name": "http", "containerPort": MLFLOW_PORT}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": MLFLOW_PORT}, "periodSeconds": 2},
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "packages", "mountPath": "/opt/mlflow-server", "readOnly": True},
                                 {"name": "store", "mountPath": "/var/mlflow"}],
            }],
            "volumes": [{"name": "packages", "image": {"reference": pushed, "pullPolicy": "IfNotPresent"}},
                        {"name": "store", "emptyDir": {}}],
        },
    })
    node.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "mlflow", "namespace": NAMESPACE},
                "spec": {"selector": labels, "ports": [{"name": "http", "port": MLFLOW_PORT, "targetPort": "http"}]}})
    service = node.get("service", "mlflow")
    assert service is not None
    try:
        yield f"http://{service['spec']['clusterIP']}:{MLFLOW_PORT}"
    finally:
        node.kubectl("delete", "pod,service", "mlflow", "-n", NAMESPACE, "--wait=false", check=False)


def wait_mlflow(node: Node) -> None:
    node.kubectl("wait", "-n", NAMESPACE, "--for=condition=Ready", "pod/mlflow", "--timeout=240s", timeout=250)


def s3_access(endpoint: str) -> dict[str, str]:
    return {"credentialsSecret": "s3-keys", "endpoint": endpoint}


def from_s3(node: Node, name: str, endpoint: str, **trainer: Any) -> dict[str, Any]:
    """The example run with its model, prompts and reward module from the bucket."""
    run = example_run(node, name, **trainer)
    access = s3_access(endpoint)
    spec = run["spec"]
    spec["model"] = {**spec["model"], "source": f"s3://{BUCKET}/models/tiny", "s3": access}
    spec["dataset"] = {**spec["dataset"], "source": f"s3://{BUCKET}/data", "s3": access}
    spec["rewardCode"] = {"source": f"s3://{BUCKET}/rewards", "s3": access}
    return run


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def workload_of(node: Node, run: str) -> dict[str, Any] | None:
    items = node.list(f"workloads.{GROUP}", f"grpo.dev/run={run}")
    return items[0] if items else None


def nothing_of(node: Node, run: str) -> bool:
    return not any(node.list(kind, f"grpo.dev/run={run}") for kind in ("pod", "job", "deployment"))


def trainer_log(node: Node, run: str) -> str:
    (pod,) = node.list("pod", f"grpo.dev/run={run},grpo.dev/component=trainer")
    return node.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"]).stdout


# ------------------------------------------------------------------------------------------------ the runs


@pytest.fixture
def queues(node: Node, kueue_manager: KueueManager) -> Iterator[Queues]:
    made = Queues(NodeApi(node), NAMESPACE, "e2e", [])
    try:
        yield made
    finally:
        for kind, name in reversed(made.created):
            node.kubectl("delete", f"{kind}.{GROUP}", name, "--wait=false", check=False)


def test_a_queued_run_from_s3_reports_to_mlflow_in_the_cluster_and_exports_to_s3(
        node: Node, staged: str, queues: Queues, s3_endpoint: str, mlflow_url: str) -> None:
    flavor = queues.flavor(node_labels=HOSTNAME_LABEL)
    cluster_queue = queues.cluster_queue(flavor, cpu="500m")   # the server fits, the server and the trainer do not
    team = queues.local_queue(cluster_queue)
    body = from_s3(node, RUN, s3_endpoint, maxSteps=STEPS, reportTo=["mlflow"], env=[
        {"name": "MLFLOW_TRACKING_URI", "value": f"http://{MLFLOW_HOST}:{MLFLOW_PORT}"},
        {"name": "MLFLOW_EXPERIMENT_NAME", "value": EXPERIMENT}])
    body["metadata"]["labels"] = {f"{GROUP}/queue-name": team}
    body["spec"]["output"] = {"destination": f"s3://{BUCKET}/{EXPORT_PREFIX}", **s3_access(s3_endpoint)}
    node.apply(body)

    # Queued: suspended with Kueue's words, nothing of the run exists, one Workload with a pod set for each part.
    def queued() -> dict[str, Any] | None:
        status = run_status(node, RUN)
        return status if status.get("reason") == "Queued" and "insufficient" in status.get("message", "") else None

    status = wait_for(queued, 60, what=f"{RUN} to wait for quota in its queue", interval=1.0)
    assert status["phase"] == "Suspended" and "waiting for Kueue to admit it" in status["message"], status
    workload = workload_of(node, RUN)
    assert workload is not None and workload["spec"]["queueName"] == team, workload
    assert [(ps["name"], ps["count"]) for ps in workload["spec"]["podSets"]] == [("server", 1), ("trainer", 1)]
    wait_mlflow(node)   # the queued run's wait overlaps the tracking server's start
    assert nothing_of(node, RUN), "the run made pods, Jobs or a Deployment before Kueue admitted it"

    # Quota for both: admitted together, placed by the flavor on the node, trained, exported.
    queues.set_quota(cluster_queue, flavor, "2")
    status = wait_phase(node, RUN, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 1 and status["progress"]["step"] == STEPS, status
    reasons = [e["reason"] for e in node.list("events", "", NAMESPACE)
               if e["involvedObject"].get("name") == RUN and e["involvedObject"].get("kind") == "GRPORun"]
    assert "Queued" in reasons and "Admitted" in reasons, reasons
    server = node.get("deployment", f"{RUN}-server")
    assert server is not None and server["spec"]["template"]["spec"]["nodeSelector"] == HOSTNAME_LABEL
    (trainer,) = pods(node, RUN, "trainer")
    assert trainer["spec"]["nodeSelector"] == HOSTNAME_LABEL, trainer["spec"].get("nodeSelector")

    # Sources from S3: only the initializer had the Secret's keys.
    assert status["sources"]["ready"], status["sources"]
    init = node.get("job", f"{RUN}-init")
    assert init is not None and init["status"].get("succeeded") == 1
    refs = {e["name"] for e in init["spec"]["template"]["spec"]["containers"][0]["env"]
            if "secretKeyRef" in (e.get("valueFrom") or {})}
    assert {f"GRPO_S3_{role}_ACCESS_KEY_ID" for role in ("MODEL", "DATASET")} <= refs, refs
    for part in (server["spec"]["template"]["spec"], trainer["spec"]):
        env = part["containers"][0].get("env", [])
        assert not [e for e in env if "secretKeyRef" in (e.get("valueFrom") or {})], env

    # MLflow in the cluster got one run with its settings and every step's metrics.
    (tracked,) = runs_of(mlflow_url, EXPERIMENT)
    assert tracked["info"]["status"] == "FINISHED", tracked["info"]
    params = {p["key"]: p["value"] for p in tracked["data"]["params"]}
    assert params["max_steps"] == str(STEPS) and params["num_generations"] == "8", sorted(params)
    for key in PER_STEP:
        steps = sorted(m["step"] for m in metric_history(mlflow_url, tracked["info"]["run_id"], key))
        assert steps == list(range(1, STEPS + 1)), f"{key}: {steps}"

    # The export: status says where, and the bucket holds every file its manifest names, with that digest.
    output = status["output"]
    assert output["uri"] == f"s3://{BUCKET}/{EXPORT_PREFIX}" and output["form"] == "adapter", output
    client = s3_admin(s3_endpoint)
    objects = {o["Key"].removeprefix(f"{EXPORT_PREFIX}/"): o["Size"]
               for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{EXPORT_PREFIX}/")["Contents"]}
    manifest_bytes = client.get_object(Bucket=BUCKET, Key=f"{EXPORT_PREFIX}/grpo-export.json")["Body"].read()
    assert output["digest"] == f"sha256:{hashlib.sha256(manifest_bytes).hexdigest()}", output
    manifest = json.loads(manifest_bytes)
    assert manifest["source"] == f"v{STEPS}" and set(objects) == {*manifest["files"], "grpo-export.json"}, (
        manifest, objects)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(manifest["files"]), manifest
    for name, described in manifest["files"].items():
        data = client.get_object(Bucket=BUCKET, Key=f"{EXPORT_PREFIX}/{name}")["Body"].read()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (described["size"], described["sha256"]), name
    assert output["size"] == sum(objects.values()) and output["files"] == len(objects), (output, objects)
    export = node.get("job", f"{RUN}-export")
    assert export is not None and export["status"].get("succeeded") == 1
    assert not [e for e in trainer["spec"]["containers"][0].get("env", []) if e["name"].startswith("AWS_")]

    # The run's end finishes its Workload once its pods are gone (the server is scaled to 0).
    finished = wait_for(lambda: condition(workload_of(node, RUN), "Finished"), 120,
                        what="the Workload to be Finished", interval=2.0)
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded"), finished


def test_a_run_of_an_oci_model_warm_starts_from_the_exported_adapter_which_its_server_serves_from_step_0(
        node: Node, staged: str, tiny_files: TinyFiles, s3_endpoint: str, tmp_path: Path) -> None:
    """Its base model is the same tiny model as an image holding only the model (as a team would push to its
    registry), mounted read-only by the kubelet and containerd 2 in every pod of the run (Kubernetes image volumes);
    its adapter is the first run's export, fetched from S3 by the initializer."""
    exported = (run_status(node, RUN).get("output") or {}).get("uri")
    assert exported, f"{RUN} exported nothing (its test failed): no adapter to start from"
    ref = f"{REGISTRY}/grpo-e2e/model:tiny"
    archive = subprocess.run(["bash", "hack/images.sh", "data", "localhost/grpo-e2e-model:tiny", str(tiny_files.model),
                              "/models/tiny"], cwd=REPO, check=True, capture_output=True, text=True,
                             timeout=600).stdout.strip()
    subprocess.run(["bash", "hack/cluster.sh", "push", archive, ref], cwd=REPO, check=True, timeout=300, env=node.env,
                   capture_output=True)
    body = example_run(node, WARM, maxSteps=1)
    body["spec"]["model"] = {"name": "tiny-qwen2", "source": f"oci://{ref}", "path": "models/tiny",
                             "dtype": "float32", "adapter": {"source": exported, "s3": s3_access(s3_endpoint)}}
    node.apply(body)
    status = wait_phase(node, WARM, "Succeeded", RUN_TIMEOUT_S)
    assert status["adapter"]["version"] == 2, status["adapter"]   # v1: the warm start at step 0; v2: after step 1

    # the model: an image volume in every pod, read-only, pulled by the node from the registry
    assert status["sources"]["ready"] and "/mnt/grpo/model/models/tiny" in status["sources"]["progress"], status
    for component in ("initializer", "server", "trainer"):
        pod = pod_spec(node, WARM, component)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["src-model"]["image"]["reference"] == ref, volumes
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["src-model"]["readOnly"] is True
    # the image reached the node only by a pull from the registry (nothing imports it under this name)
    wait_for(lambda: ref in node_images(node), 60, what=f"{ref} among the node's images", interval=2)

    log = trainer_log(node, WARM)
    assert "warm start from" in log, log[-3000:]
    warm = re.search(r"published adapter v1 \(step 0, warm start from spec\.model\.adapter\).*weights (\S+)", log)
    assert warm is not None, log[-3000:]
    assert log.index(warm.group(0)) < log.index("step 1/1"), log[-3000:]
    # the version the server served first holds exactly the exported weights
    weights = tmp_path / "adapter_model.safetensors"
    s3_admin(s3_endpoint).download_file(BUCKET, f"{EXPORT_PREFIX}/adapter_model.safetensors", str(weights))
    assert warm.group(1) == file_digest(weights, like=warm.group(1)), (warm.group(1), describe(node, WARM)[-2000:])
