"""spec.server.replicas: one Deployment of N server pods, a headless Service the trainer resolves, and a
health gate that waits for every replica. Real API server, real operator, real `grpo serve` processes.

The two replicas are `grpo serve` processes on one port of two loopback addresses (127.0.0.2, 127.0.0.3),
so a test can reach them through the server-url override or play the kubelet and give the server pods
those IPs (the operator then checks each pod at its own IP, as on a cluster).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from grpo_api.runconfig import RunConfig
from grpo_operator import children, reconcile
from tests.fixtures.server import RunningServer, free_port, start_server
from tests.fixtures.waiting import consistently, wait_for
from tests.operator.conftest import Kube, OperatorProcess

pytestmark = pytest.mark.controlplane

UNREACHABLE = "http://127.0.0.1:9"  # discard port: nothing answers
REPLICA_IPS = ("127.0.0.2", "127.0.0.3")


class Replica:
    """A `grpo serve` process listening on one loopback address (what a server pod's IP would be)."""

    def __init__(self, server: RunningServer, ip: str) -> None:
        self.server, self.ip = server, ip
        self.url = f"http://{ip}:{server.port}"

    def boot_id(self) -> str:
        value: str = httpx.get(f"{self.url}/health/", timeout=10).json()["boot_id"]
        return value


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Replica]]:
    """Two healthy servers on the same port of 127.0.0.2 and 127.0.0.3, shared by the module's tests (a new
    run has seen no boot id, so both are fresh to each run)."""
    port = free_port()
    started: list[Replica] = []
    try:
        for ip in REPLICA_IPS:
            work = tmp_path_factory.mktemp(f"replica-{ip}")
            server = start_server(work, tiny_model_dir, port=port, wait_healthy=False, extra_args=("--host", ip))
            started.append(Replica(server, ip))
        for replica in started:
            wait_for(lambda r=replica: _healthy(r), timeout=180, what=f"{replica.url} to be healthy")
        yield started[0], started[1]
    finally:
        for replica in started:
            replica.server.stop(timeout=10)


def _healthy(replica: Replica) -> bool:
    if replica.server.proc.poll() is not None:
        pytest.fail(f"server on {replica.url} exited:\n{replica.server.log_tail()}")
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{replica.url}/health/", timeout=5).status_code == 200
    return False


def run_config(kube: Kube, run: str) -> RunConfig:
    data = kube.config_map(f"{run}-config").data["run-config.yaml"]
    return RunConfig.model_validate(yaml.safe_load(data))


def make_pod_ready(kube: Kube, pod: str, ip: str) -> None:
    """Play the kubelet: the pod runs at this IP and passes its readiness probe."""
    kube.core.patch_namespaced_pod_status(pod, kube.namespace, {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}],
    }})


def test_a_run_of_two_replicas_gets_their_deployment_and_headless_service_and_its_trainer_waits_for_both(
    operator: OperatorProcess, kube: Kube, replicas: tuple[Replica, Replica]
) -> None:
    first, second = replicas
    run = kube.create_run("rep", server_url=f"{first.url},{UNREACHABLE}", server={"replicas": 2})
    kube.wait_phase("rep", "StartingServer", reason="ServerStarting")

    deployment = wait_for(lambda: kube.deployment("rep-server"), what="server Deployment")
    assert deployment.spec.replicas == 2 and deployment.spec.strategy.type == "Recreate"
    service = wait_for(lambda: kube.service("rep-replicas"), what="the replicas' headless Service")
    assert service.spec.cluster_ip == "None" and not service.spec.publish_not_ready_addresses
    assert service.spec.selector == deployment.spec.selector.match_labels
    assert [(p.name, p.port, p.target_port) for p in service.spec.ports] == [("http", 8000, "http")]
    refs = service.metadata.owner_references
    assert [(r.kind, r.uid, r.controller) for r in refs] == [("GRPORun", run["metadata"]["uid"], True)]
    endpoints = run_config(kube, "rep").server_endpoints
    assert endpoints is not None
    assert (endpoints.replicas, endpoints.dns_name, endpoints.port) == (2, f"rep-replicas.{kube.namespace}.svc", 8000)

    # One replica of two answers: several reconciles later there is still no trainer.
    wait_for(lambda: "1 of 2 replicas" in kube.status("rep").get("message", ""),
             what=f"the status to count one healthy replica of two (now {kube.status('rep')})")
    consistently(lambda: kube.jobs("rep") == [] and kube.status("rep")["phase"] == "StartingServer", 3,
                 what="no trainer Job while one replica of two answers")

    kube.set_server_url("rep", f"{first.url},{second.url}")
    status = kube.wait_phase("rep", "Training", timeout=30)
    assert status["server"]["bootIds"] == [first.boot_id(), second.boot_id()]
    assert status["server"]["bootId"] == first.boot_id()
    assert status["server"]["ready"] is True and status["server"]["readyReplicas"] == 2
    assert "2 server replicas" in status["message"], status["message"]
    wait_for(lambda: kube.job("rep-trainer-1"), what="the trainer Job once both replicas are healthy")


def test_without_the_override_each_server_pod_is_checked_at_its_own_ip(
    operator: OperatorProcess, kube: Kube, replicas: tuple[Replica, Replica]
) -> None:
    first, second = replicas
    kube.create_run("pods", server={"replicas": 2, "port": first.server.port})
    kube.wait_phase("pods", "StartingServer", reason="ServerStarting")
    pods = wait_for(lambda: len(p := kube.server_pods("pods")) == 2 and p,
                    what="the ReplicaSet controller to create both server pods")
    names = sorted(p.metadata.name for p in pods)

    make_pod_ready(kube, names[0], first.ip)
    wait_for(lambda: "1 of 2 replicas" in (m := kube.status("pods").get("message", "")) and "not ready" in m,
             what=f"one replica healthy, the other's pod not ready (now {kube.status('pods')})")
    assert f"pod {names[1]} not ready" in kube.status("pods")["message"]
    assert kube.jobs("pods") == []

    make_pod_ready(kube, names[1], second.ip)
    status = kube.wait_phase("pods", "Training", timeout=30)
    assert sorted(status["server"]["bootIds"]) == sorted([first.boot_id(), second.boot_id()])
    assert status["server"]["readyReplicas"] == 2
    wait_for(lambda: kube.job("pods-trainer-1"), what="the trainer Job")


def test_the_headless_service_deleted_mid_attempt_is_created_again(operator: OperatorProcess, kube: Kube) -> None:
    kube.create_run("lost", server_url=UNREACHABLE, server={"replicas": 2})
    kube.wait_phase("lost", "StartingServer", reason="ServerStarting")
    wait_for(lambda: kube.service("lost-replicas"), what="the replicas' headless Service")
    again = kube.delete_service_and_see_it_restored("lost", "lost-replicas")
    assert again.spec.cluster_ip == "None"
    status = kube.status("lost")
    assert status["phase"] == "StartingServer" and status["attempt"] == 1, "a missing Service ends no attempt"


@pytest.mark.parametrize(("ip", "url"), [("10.1.2.3", "http://10.1.2.3:8000"),
                                         ("fd00:10::5", "http://[fd00:10::5]:8000")])
def test_a_pod_is_checked_at_its_own_ip_an_ipv6_one_in_brackets(ip: str, url: str) -> None:
    pod = children.pod_info({"metadata": {"name": "p", "annotations": {"grpo.dev/attempt": "1"}},
                             "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})
    assert (pod.ip, pod.ready, pod.attempt) == (ip, True, 1)
    assert reconcile.pod_url(pod.ip, 8000) == url
