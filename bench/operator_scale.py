"""Operator scale benchmark: N GRPORuns at once, time until every run's server Deployment exists.

Compared, in the same run and on the same control plane (etcd + kube-apiserver +
kube-controller-manager from the test fixtures), with a client that creates the same objects
(the GRPORun and its ConfigMap, Secret, PVC, Service and Deployment) straight through the API
with as many threads as the operator has reconcile workers. The ratio is the operator's
overhead: watch latency, kopf's own bookkeeping and its status writes and events.

    .venv/bin/python bench/operator_scale.py --runs 100 > bench/results/operator_scale.json

Prints one JSON object. Needs the test binaries (`hack/build-testbin.sh`, cached).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

# Run as a script from the repository root: the control-plane fixture module is reused as a library.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.operator_process import machine_info, start_operator  # noqa: E402
from grpo_api.models import GRPORun  # noqa: E402
from grpo_operator import builders  # noqa: E402
from tests.fixtures.controlplane import CRD_FILE, build_testbin, start_control_plane  # noqa: E402

WORKERS = 16


def run_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPORun",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "tiny", "path": "/models/tiny"},
            "dataset": {"path": "/data/prompts.jsonl"},
            "rewards": [{"function": "token_fraction"}],
            "server": {"engine": "transformers", "maxLoraRank": 64},
            "trainer": {"lora": {"r": 8}},
            "storage": {"size": "1Gi"},
        },
    }


def wait_for_deployments(apps: Any, namespace: str, count: int, timeout: float) -> float:
    """Poll until `count` Deployments exist; returns the monotonic time it was first seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(apps.list_namespaced_deployment(namespace).items) >= count:
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"fewer than {count} Deployments in {namespace} after {timeout}s")


def direct(api: Any, namespace: str, runs: int) -> dict[str, Any]:
    """Create every run and its children straight through the API (no operator)."""
    from kubernetes import client

    custom, core, apps = client.CustomObjectsApi(api), client.CoreV1Api(api), client.AppsV1Api(api)

    def create_one(i: int) -> None:
        created = custom.create_namespaced_custom_object(
            "grpo.dev", "v1alpha1", namespace, "grporuns", run_body(f"run-{i:03d}"))
        run = GRPORun.model_validate({**created, "status": None})
        children = [
            builders.build_config_map(run),
            builders.build_token_secret(run, "token"),
            builders.build_volume_claim(run),
            builders.build_service(run),
            builders.build_server_deployment(run, 1, 1),
        ]
        for obj in children:
            assert obj is not None
            kind = obj["kind"]
            if kind == "Deployment":
                apps.create_namespaced_deployment(namespace, obj, _preload_content=False)
            else:
                creator = {"ConfigMap": core.create_namespaced_config_map, "Secret": core.create_namespaced_secret,
                           "PersistentVolumeClaim": core.create_namespaced_persistent_volume_claim,
                           "Service": core.create_namespaced_service}[kind]
                creator(namespace, obj, _preload_content=False)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        list(pool.map(create_one, range(runs)))
    done = wait_for_deployments(apps, namespace, runs, timeout=600)
    return {"seconds": round(done - started, 3), "api_requests_per_run": 6}


def metric_sum(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(rf"^{re.escape(name)}(\{{|\s)", line))


def operated(api: Any, kubeconfig: Path, namespace: str, runs: int, log: Path) -> dict[str, Any]:
    """Create the runs only; the operator creates the children."""
    from kubernetes import client

    custom, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
    proc, port = start_operator(kubeconfig, namespace, log, extra_args=("--workers", str(WORKERS)),
                                settle_seconds=2)  # kopf's initial listing ends before the clock starts
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            list(pool.map(lambda i: custom.create_namespaced_custom_object(
                "grpo.dev", "v1alpha1", namespace, "grporuns", run_body(f"run-{i:03d}")), range(runs)))
        created = time.monotonic() - started
        done = wait_for_deployments(apps, namespace, runs, timeout=600)
        time.sleep(4)  # the runs' second reconcile (waiting for their server) lands in the request count
        requests = metric_sum(port, "grpo_operator_api_requests_total")
        reconciles = metric_sum(port, "grpo_operator_reconcile_duration_seconds_count")
        reconcile_seconds = metric_sum(port, "grpo_operator_reconcile_duration_seconds_sum")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    return {
        "seconds": round(done - started, 3),
        "seconds_to_create_runs": round(created, 3),
        "api_requests_per_run": round(requests / runs, 2),
        "reconcile_seconds_mean": round(reconcile_seconds / max(reconciles, 1), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="grpo-operator-scale-"))
    bin_dir = build_testbin(workdir / "build-testbin.log")
    cp = start_control_plane(bin_dir, workdir)
    try:
        os.environ["KUBECONFIG"] = str(cp.kubeconfig)
        cp.kubectl("apply", "--server-side", "-f", str(CRD_FILE), check=True)
        cp.kubectl("wait", "--for=condition=Established", "crd/grporuns.grpo.dev", "--timeout=60s", check=True)
        for namespace in ("direct", "operated"):
            cp.kubectl("create", "namespace", namespace, check=True)
        with cp.api_client() as api:
            baseline = direct(api, "direct", args.runs)
            operator = operated(api, cp.kubeconfig, "operated", args.runs, workdir / "operator.log")
    finally:
        cp.stop()
    result = {
        "benchmark": "operator_scale",
        "runs": args.runs,
        "reconcile_workers": WORKERS,
        "direct": baseline,
        "operator": operator,
        "operator_over_direct": round(operator["seconds"] / baseline["seconds"], 2),
        "machine": machine_info(),
        "logs": str(workdir),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
