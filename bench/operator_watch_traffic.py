"""Operator watch traffic: what the API server sends the operator when a namespace holds objects that are
not the runs' (100 foreign Pods and 100 foreign Jobs, whose Job controller adds 100 more Pods).

Measured on one control plane (etcd + kube-apiserver + kube-controller-manager from the test fixtures)
with the API server's own counters (`apiserver_watch_events_total` and `apiserver_watch_events_sizes`,
per resource), for three cases in turn: no operator (the controller-manager's share), the operator of
this checkout (server-side label selectors on its watches of the children), and the operator at a
baseline git revision (kopf's in-process label filtering: every object of the namespace is sent).
The operator's share is the case minus the no-operator case.

    .venv/bin/python bench/operator_watch_traffic.py --baseline-ref d4049ae > bench/results/operator_watch_traffic.json

Prints one JSON object. Needs the test binaries (`hack/build-testbin.sh`, cached).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.operator_process import machine_info, start_operator  # noqa: E402
from tests.fixtures.controlplane import CRD_FILE, ControlPlane, build_testbin, start_control_plane  # noqa: E402

NAMESPACE = "traffic"
RESOURCES = (("", "pods"), ("batch", "jobs"))


def watch_counters(cp: ControlPlane) -> dict[str, float]:
    """Events and bytes the API server has sent to all watchers, per resource."""
    text = httpx.get(f"{cp.server}/metrics", headers={"Authorization": f"Bearer {cp.token}"},
                     verify=str(cp.ca_file), timeout=10).text
    out: dict[str, float] = {}
    for group, resource in RESOURCES:
        for metric, key in (("apiserver_watch_events_total", "events"),
                            ("apiserver_watch_events_sizes_sum", "bytes")):
            pattern = rf'^{metric}\{{[^}}]*group="{group}"[^}}]*resource="{resource}"[^}}]*\}} (\S+)$'
            out[f"{resource}_{key}"] = sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
    return out


def foreign_objects(api: Any, count: int, tag: str) -> None:
    """count Pods and count Jobs without the run label; returns once the Jobs' Pods exist too."""
    from kubernetes import client

    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    container = {"name": "c", "image": "registry.invalid/foreign:1"}

    def pod(i: int) -> None:
        core.create_namespaced_pod(NAMESPACE, {"metadata": {"name": f"{tag}-pod-{i}", "labels": {"app": "foreign"}},
                                               "spec": {"containers": [container]}})

    def job(i: int) -> None:
        batch.create_namespaced_job(NAMESPACE, {
            "metadata": {"name": f"{tag}-job-{i}", "labels": {"app": "foreign"}},
            "spec": {"template": {"metadata": {"labels": {"app": "foreign"}},
                                  "spec": {"containers": [container], "restartPolicy": "Never"}}}})

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(pod, range(count)))
        list(pool.map(job, range(count)))
    deadline = time.monotonic() + 120
    while len(core.list_namespaced_pod(NAMESPACE, label_selector="app=foreign").items) < 2 * count:
        if time.monotonic() > deadline:
            raise RuntimeError("the Job controller did not create the Jobs' pods")
        time.sleep(0.5)
    time.sleep(3)  # status updates settle


def clean(api: Any) -> None:
    from kubernetes import client

    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    batch.delete_collection_namespaced_job(NAMESPACE, label_selector="app=foreign", propagation_policy="Background")
    core.delete_collection_namespaced_pod(NAMESPACE, label_selector="app=foreign", grace_period_seconds=0)
    deadline = time.monotonic() + 120
    while core.list_namespaced_pod(NAMESPACE, label_selector="app=foreign").items or \
            batch.list_namespaced_job(NAMESPACE, label_selector="app=foreign").items:
        if time.monotonic() > deadline:
            raise RuntimeError("foreign objects did not go away")
        time.sleep(0.5)


def measure(cp: ControlPlane, api: Any, count: int, tag: str, pythonpath: str | None, log: Path) -> dict[str, float]:
    proc = start_operator(cp.kubeconfig, NAMESPACE, log, pythonpath=pythonpath)[0] if pythonpath is not None else None
    try:
        before = watch_counters(cp)
        foreign_objects(api, count, tag)
        after = watch_counters(cp)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    clean(api)
    return {k: after[k] - before[k] for k in after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="foreign Pods, and foreign Jobs")
    parser.add_argument("--baseline-ref", default=None, help="git revision of the operator to compare with")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="grpo-watch-traffic-"))
    here = f"{REPO / 'services'}:{REPO / 'operator'}:{REPO}"
    cases: dict[str, str | None] = {"no_operator": None, "operator": here}
    if args.baseline_ref:
        base = workdir / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.baseline_ref],
                       check=True, capture_output=True)
        cases["baseline_operator"] = f"{base / 'services'}:{base / 'operator'}:{base}"
    bin_dir = build_testbin(workdir / "build-testbin.log")
    cp = start_control_plane(bin_dir, workdir)
    results: dict[str, dict[str, float]] = {}
    try:
        os.environ["KUBECONFIG"] = str(cp.kubeconfig)
        cp.kubectl("apply", "--server-side", "-f", str(CRD_FILE), check=True)
        cp.kubectl("wait", "--for=condition=Established", "crd/grporuns.grpo.dev", "--timeout=60s", check=True)
        cp.kubectl("create", "namespace", NAMESPACE, check=True)
        with cp.api_client() as api:
            for i, (case, path) in enumerate(cases.items()):
                results[case] = measure(cp, api, args.count, f"c{i}", path, workdir / f"{case}.log")
    finally:
        cp.stop()
        if args.baseline_ref:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(workdir / "baseline")],
                           check=False, capture_output=True)
    none = results["no_operator"]
    share = {case: {k: round(v - none[k]) for k, v in r.items()}
             for case, r in results.items() if case != "no_operator"}
    out: dict[str, Any] = {
        "benchmark": "operator_watch_traffic",
        "foreign_pods": args.count,
        "foreign_jobs": args.count,
        "sent_to_all_watchers": {case: {k: round(v) for k, v in r.items()} for case, r in results.items()},
        "operator_share": share,
        "baseline_ref": args.baseline_ref,
        "machine": machine_info(),
        "logs": str(workdir),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
