"""Many runs at once, and what the operator exposes about itself (metrics, liveness)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from grpo_operator.metrics import METRIC_NAMES
from tests.fixtures.waiting import wait_for
from tests.operator.conftest import Kube, OperatorProcess

pytestmark = pytest.mark.controlplane

RUNS = 50
#: What each run costs until it waits for its server, by kind (measured: exactly this, or one status
#: write and its event fewer when a reconcile sees two steps at once): provisioning (ConfigMap, Secret,
#: PVC, two Services, NetworkPolicy), the initializer Job, the Deployment, one read each of the
#: initializer's log and of the token Secret, and up to four status writes with their events.
CREATES_PER_RUN = {"ConfigMap": 1, "Secret": 1, "PersistentVolumeClaim": 1, "Service": 2, "NetworkPolicy": 1,
                   "Job": 1, "Deployment": 1}
READS_PER_RUN = {"Pod/log": 1, "Secret": 1}
STATUS_WRITES_PER_RUN = 4
#: Slack on every count, for a reconcile that sees the Job between its pod's end and its completion, a
#: conflict on a status write, or a stale cached run refreshed; a run reconciled in a loop costs far more.
SLACK = 1.2
def test_fifty_runs_created_at_once_all_reach_waiting_for_server(
    operator: OperatorProcess, kube: Kube, capsys: pytest.CaptureFixture[str]
) -> None:
    requests_before = operator.metric_sum("grpo_operator_api_requests_total")
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda i: kube.create_run(f"run-{i:03d}"), range(RUNS)))
    created = time.monotonic() - started

    def all_waiting() -> bool:
        runs = kube.custom.list_namespaced_custom_object("grpo.dev", "v1alpha1", kube.namespace, "grporuns")
        waiting = [r for r in runs["items"]
                   if (r.get("status") or {}).get("phase") == "StartingServer"
                   and r["status"].get("reason") == "ServerStarting"]
        return len(waiting) == RUNS

    wait_for(all_waiting, timeout=180, interval=0.2, what=f"all {RUNS} runs to wait for their server")
    elapsed = time.monotonic() - started
    time.sleep(3)  # quiet reconciles of waiting runs must cost no requests
    requests = operator.metric_sum("grpo_operator_api_requests_total") - requests_before
    deployments = kube.apps.list_namespaced_deployment(kube.namespace).items
    assert len(deployments) == RUNS
    reconciles = operator.metric_sum("grpo_operator_reconcile_duration_seconds_count")
    result = {
        "runs": RUNS,
        "reconcile_seconds_mean": round(
            operator.metric_sum("grpo_operator_reconcile_duration_seconds_sum") / max(reconciles, 1), 3),
        "seconds_to_create_runs": round(created, 2),
        "seconds_until_all_waiting_for_server": round(elapsed, 2),
        "operator_api_requests_per_run": round(requests / RUNS, 2),
    }
    by_kind = [line for line in operator.metrics_text().splitlines()
               if line.startswith("grpo_operator_api_requests_total{")]
    with capsys.disabled():
        print(f"\n[operator-scale] {json.dumps(result)}\n" + "\n".join(by_kind))

    def count(kind: str, verb: str) -> float:
        return operator.sample("grpo_operator_api_requests_total", kind=kind, verb=verb) or 0.0

    budget = {**{(kind, "create"): n for kind, n in CREATES_PER_RUN.items()},
              **{(kind, "get"): n for kind, n in READS_PER_RUN.items()},
              ("GRPORun/status", "patch"): STATUS_WRITES_PER_RUN, ("Event", "create"): STATUS_WRITES_PER_RUN}
    for (kind, verb), per_run in budget.items():
        assert count(kind, verb) <= per_run * RUNS * SLACK, (kind, verb, by_kind)
    assert requests <= sum(budget.values()) * RUNS * SLACK, (result, by_kind)


def test_metrics_and_liveness_endpoints_report_the_operator(operator: OperatorProcess, kube: Kube) -> None:
    kube.create_run("observed", server_url="http://127.0.0.1:9",
                    runPolicy={"backoffLimit": 0, "serverReadyTimeoutSeconds": 2})
    kube.wait_phase("observed", "Failed", reason="ServerNotReady", timeout=30)
    run = {"namespace": kube.namespace, "grporun": "observed"}
    # the operator writes the status first, then the events and the metrics
    wait_for(lambda: operator.sample("grpo_operator_run_phase", **run, phase="Failed") == 1
             and operator.sample("grpo_operator_run_failures_total", **run, reason="ServerNotReady") == 1,
             what="the Failed phase and its failure on /metrics")
    text = operator.metrics_text()
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in text, f"{name} missing from /metrics"
    assert operator.metric_sum("grpo_operator_attempts_total") >= 1
    assert 'grpo_operator_failures_total{reason="ServerNotReady"} 1.0' in text
    assert 'grpo_operator_runs{phase="Failed"} 1.0' in text
    assert operator.sample("grpo_operator_run_phase", **run, phase="Failed") == 1
    assert operator.sample("grpo_operator_run_phase", **run, phase="StartingServer") is None, "one phase series"
    assert operator.sample("grpo_operator_run_attempt", **run) == 1
    assert operator.sample("grpo_operator_run_failures_total", **run, reason="ServerNotReady") == 1

    probe = httpx.get(f"http://127.0.0.1:{operator.liveness_port}/healthz", timeout=5)
    assert probe.status_code == 200
    age = probe.json()["secondsSinceLastReconcile"]
    assert 0 <= age < 30


def test_a_deleted_runs_metric_series_go_with_it(operator: OperatorProcess, kube: Kube) -> None:
    kube.create_run("short-lived", server_url="http://127.0.0.1:9")
    kube.wait_phase("short-lived", "StartingServer", reason="ServerStarting")
    run = {"namespace": kube.namespace, "grporun": "short-lived"}
    wait_for(lambda: operator.sample("grpo_operator_run_phase", **run, phase="StartingServer") == 1,
             what="the run's phase series")
    assert operator.sample("grpo_operator_run_attempt", **run) == 1
    kube.custom.delete_namespaced_custom_object("grpo.dev", "v1alpha1", kube.namespace, "grporuns", "short-lived")
    wait_for(lambda: "short-lived" not in operator.metrics_text(), timeout=30,
             what="every series of the deleted run to leave /metrics")
